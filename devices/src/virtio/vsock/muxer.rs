//! The vsock worker: moves packets between the guest's queues and host Unix sockets.
//!
//! Guest packets (tx queue) are handled as they come. Packets for the guest wait in
//! `pending` until the guest posts rx buffers; host streams are read only when an rx
//! buffer is in hand and the guest has credit for the bytes (pull, not push), so nothing
//! is buffered without bound on the way in. Bytes the guest sends wait in a connection's
//! `to_host` while its stream is full; the guest never sends more than the `TX_BUF_ALLOC`
//! credit this side advertises.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use virtio_queue::{Queue, QueueOwnedT, QueueState, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::epoll::EventSet;

use super::packet::*;
use crate::virtio::worker::{QueueHandler, WorkerContext, FIRST_HANDLER_TOKEN};
use crate::virtio::VirtioInterrupt;

const RX: usize = 0;
const TX: usize = 1;
const EVENT: usize = 2;
/// Credit this side gives the guest per connection: bytes it may send ahead of what
/// reached the host stream.
const TX_BUF_ALLOC: u32 = 256 << 10;
/// The longest `CONNECT <port>\n` line read from a host.
const MAX_CONNECT_LINE: usize = 32;
/// The largest payload of a packet either way: Linux's driver sends at most 64 KiB a
/// packet (`VIRTIO_VSOCK_MAX_PKT_BUF_SIZE`). A longer one from the guest resets its
/// connection; the device sends none longer, whatever room and credit the guest gives.
pub(super) const MAX_PAYLOAD: u32 = 64 << 10;
/// First port this side uses for host-initiated connections.
pub(super) const FIRST_LOCAL_PORT: u32 = 1 << 30;
const TOKEN_LISTENER: u64 = FIRST_HANDLER_TOKEN;

/// Makes `s` non-blocking with fcntl (std uses ioctl(FIONBIO), which the device
/// worker's seccomp filter does not allow).
fn nonblocking(s: &UnixStream) -> std::io::Result<()> {
    let fd = s.as_raw_fd();
    // SAFETY: fcntl on a descriptor `s` owns; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// (port on this side, port on the guest's side).
type Key = (u32, u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnState {
    /// Host-initiated: REQUEST sent, waiting for the guest's RESPONSE.
    Connecting,
    Established,
}

struct Conn {
    stream: UnixStream,
    token: u64,
    state: ConnState,
    /// Bytes from the guest not yet written to the host stream.
    to_host: Vec<u8>,
    /// Bytes of the guest's written to the host stream (our fwd_cnt).
    fwd_cnt: u32,
    /// fwd_cnt last told to the guest.
    fwd_cnt_sent: u32,
    /// Bytes sent to the guest.
    rx_cnt: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// The host stream has more to read, or hung up (cleared when a read runs dry).
    readable: bool,
    /// The guest will send no more: shut the stream's write side once `to_host` is out.
    guest_done_sending: bool,
    /// The events the worker's epoll watches the stream for (what [`Conn::interest`]
    /// was when last registered).
    watching: EventSet,
}

impl Conn {
    fn new(stream: UnixStream, token: u64, state: ConnState, hdr: Option<&Header>) -> Self {
        let mut c = Self {
            stream,
            token,
            state,
            to_host: Vec::new(),
            fwd_cnt: 0,
            fwd_cnt_sent: 0,
            rx_cnt: 0,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            readable: false,
            guest_done_sending: false,
            watching: EventSet::empty(),
        };
        if let Some(h) = hdr {
            c.peer_credit_from(h);
        }
        c
    }

    fn peer_credit_from(&mut self, h: &Header) {
        self.peer_buf_alloc = h.buf_alloc;
        self.peer_fwd_cnt = h.fwd_cnt;
    }

    /// Bytes the guest has room for.
    fn peer_credit(&self) -> u32 {
        self.peer_buf_alloc
            .saturating_sub(self.rx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }

    /// Writes what it can of `to_host`; false on a broken stream.
    fn flush(&mut self) -> bool {
        while !self.to_host.is_empty() {
            match self.stream.write(&self.to_host) {
                Ok(0) => return false,
                Ok(n) => {
                    self.to_host.drain(..n);
                    self.fwd_cnt = self.fwd_cnt.wrapping_add(n as u32);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => return false,
            }
        }
        if self.to_host.is_empty() && self.guest_done_sending {
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
        }
        true
    }

    /// Edge-triggered: `readable` remembers a stream with data (or a hang-up) until a
    /// read runs dry, so a stream the guest has no room for does not wake the worker
    /// again and again.
    fn interest(&self) -> EventSet {
        let mut e = EventSet::EDGE_TRIGGERED | EventSet::IN;
        if !self.to_host.is_empty() {
            e |= EventSet::OUT;
        }
        e
    }
}

/// Connects to the host program at `path` without waiting: a program whose listen
/// backlog is full (it does not accept) refuses at once (`EAGAIN`) instead of holding
/// the device's worker until it accepts.
fn connect_nonblocking(path: &std::path::Path) -> std::io::Result<UnixStream> {
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
    let flags = SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC;
    let fd = socket(AddressFamily::Unix, SockType::Stream, flags, None)?;
    connect(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    Ok(UnixStream::from(fd))
}

/// A host that connected and has not finished its `CONNECT <port>` line.
struct Pending {
    stream: UnixStream,
    line: Vec<u8>,
}

pub(super) struct Muxer {
    cid: u64,
    path: PathBuf,
    listener: UnixListener,
    mem: GuestMemoryMmap,
    queues: [Queue; 3],
    interrupt: Arc<VirtioInterrupt>,
    conns: HashMap<Key, Conn>,
    tokens: HashMap<u64, Key>,
    pending_hosts: HashMap<u64, Pending>,
    /// Packets for the guest, waiting for rx buffers.
    pending: VecDeque<Packet>,
    /// A clone's device owes the guest a transport-reset event.
    reset_pending: bool,
    /// Host connections wait here from the clone's start until the driver has handled
    /// the reset (a connection the guest accepted before that would be reset too).
    held_requests: Option<Vec<Key>>,
    /// The event queue's avail index when the reset was delivered: the driver adds a
    /// buffer (and notifies) once it has handled the event.
    reset_avail: Option<u16>,
    next_token: u64,
    /// The host-side port of the next host connection, shared with the device (which
    /// saves it: a clone or restored VM goes on from it, so its first connections do
    /// not take the ports of the parent's last ones, whose guest sockets may still be
    /// closing in the copy of the guest).
    next_local_port: Arc<AtomicU32>,
}

impl Muxer {
    pub(super) fn new(
        cid: u64,
        path: PathBuf,
        listener: UnixListener,
        mem: GuestMemoryMmap,
        queues: [Queue; 3],
        interrupt: Arc<VirtioInterrupt>,
        (reset_pending, next_local_port): (bool, Arc<AtomicU32>),
    ) -> Self {
        Self {
            cid,
            path,
            listener,
            mem,
            queues,
            interrupt,
            conns: HashMap::new(),
            tokens: HashMap::new(),
            pending_hosts: HashMap::new(),
            pending: VecDeque::new(),
            held_requests: reset_pending.then(Vec::new),
            reset_avail: None,
            reset_pending,
            next_token: TOKEN_LISTENER + 1,
            next_local_port,
        }
    }

    fn header(&self, key: Key, op: u16) -> Header {
        let fwd_cnt = self.conns.get(&key).map_or(0, |c| c.fwd_cnt);
        Header {
            src_cid: HOST_CID,
            dst_cid: self.cid,
            src_port: key.0,
            dst_port: key.1,
            len: 0,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: TX_BUF_ALLOC,
            fwd_cnt,
        }
    }

    fn send_control(&mut self, key: Key, op: u16, flags: u32) {
        let mut hdr = self.header(key, op);
        hdr.flags = flags;
        if let Some(c) = self.conns.get_mut(&key) {
            c.fwd_cnt_sent = c.fwd_cnt;
        }
        self.pending.push_back(Packet {
            hdr,
            data: Vec::new(),
        });
    }

    /// Registers the events `key`'s stream is to be watched for, when they changed. Only
    /// then: modifying an edge-triggered registration re-arms it, and a stream with data
    /// the guest has no room or credit for would be reported again at once, the worker
    /// spinning until the guest takes it.
    fn watch(&mut self, ctx: &WorkerContext<'_>, key: Key) {
        if let Some(c) = self.conns.get_mut(&key) {
            let interest = c.interest();
            if interest == c.watching {
                return;
            }
            match ctx.modify(c.stream.as_raw_fd(), c.token, interest) {
                Ok(()) => c.watching = interest,
                Err(e) => tracing::warn!("virtio-vsock: epoll: {e}"),
            }
        }
    }

    fn add_conn(&mut self, ctx: &WorkerContext<'_>, key: Key, mut conn: Conn) {
        match ctx.add(conn.stream.as_raw_fd(), conn.token, conn.interest()) {
            Ok(()) => conn.watching = conn.interest(),
            Err(e) => tracing::warn!("virtio-vsock: epoll: {e}"),
        }
        self.tokens.insert(conn.token, key);
        self.conns.insert(key, conn);
    }

    fn remove_conn(&mut self, ctx: &WorkerContext<'_>, key: Key) {
        if let Some(c) = self.conns.remove(&key) {
            let _ = ctx.remove(c.stream.as_raw_fd());
            self.tokens.remove(&c.token);
        }
    }

    /// Drops a connection and tells the guest.
    fn reset(&mut self, ctx: &WorkerContext<'_>, key: Key) {
        self.remove_conn(ctx, key);
        self.send_control(key, OP_RST, 0);
    }

    fn token(&mut self) -> u64 {
        self.next_token += 1;
        self.next_token
    }

    // ---------------------------------------------------------------- guest to host

    fn process_tx(&mut self, ctx: &WorkerContext<'_>) {
        let mut used_any = false;
        while let Some(chain) = self.queues[TX].pop_descriptor_chain(&self.mem) {
            let head = chain.head_index();
            match chain.reader(&self.mem) {
                Ok(mut reader) => match reader.read_obj::<Header>() {
                    Ok(hdr) if hdr.len > MAX_PAYLOAD => {
                        // Otherwise the device would copy what the chain covers, up to
                        // 4 GiB of guest memory, into a buffer of its own.
                        tracing::debug!(
                            "virtio-vsock: refused a packet of {} bytes (at most {MAX_PAYLOAD})",
                            { hdr.len }
                        );
                        self.reset(ctx, (hdr.dst_port, hdr.src_port));
                    }
                    Ok(hdr) => {
                        let len = (hdr.len as usize).min(reader.available_bytes());
                        let mut data = vec![0u8; len];
                        if reader.read_exact(&mut data).is_ok() {
                            self.guest_packet(ctx, hdr, data);
                        }
                    }
                    Err(e) => tracing::debug!("virtio-vsock: short tx packet: {e:?}"),
                },
                Err(e) => tracing::debug!("virtio-vsock: bad tx chain {head}: {e:?}"),
            }
            crate::virtio::add_used(&mut self.queues[TX], &self.mem, head, 0, "virtio-vsock");
            used_any = true;
        }
        if used_any {
            crate::virtio::notify_used(
                &mut self.queues[TX],
                &self.mem,
                &self.interrupt,
                "virtio-vsock",
            );
        }
    }

    fn guest_packet(&mut self, ctx: &WorkerContext<'_>, hdr: Header, data: Vec<u8>) {
        let key: Key = (hdr.dst_port, hdr.src_port);
        if hdr.src_cid != self.cid || hdr.dst_cid != HOST_CID || hdr.type_ != TYPE_STREAM {
            tracing::debug!("virtio-vsock: dropped a packet with bad addresses or type");
            if hdr.op != OP_RST {
                self.send_control(key, OP_RST, 0);
            }
            return;
        }
        if hdr.op == OP_REQUEST {
            self.guest_connects(ctx, key, &hdr);
            return;
        }
        let Some(conn) = self.conns.get_mut(&key) else {
            if hdr.op != OP_RST {
                self.send_control(key, OP_RST, 0);
            }
            return;
        };
        conn.peer_credit_from(&hdr);
        match hdr.op {
            OP_RESPONSE if conn.state == ConnState::Connecting => {
                conn.state = ConnState::Established;
                conn.to_host
                    .extend_from_slice(format!("OK {}\n", key.0).as_bytes());
                // The reply is not guest data: it does not count against credit.
                conn.fwd_cnt = conn.fwd_cnt.wrapping_sub(conn.to_host.len() as u32);
                if !conn.flush() {
                    return self.reset(ctx, key);
                }
            }
            OP_RW if conn.state == ConnState::Established => {
                conn.to_host.extend_from_slice(&data);
                if !conn.flush() {
                    return self.reset(ctx, key);
                }
                // Tell the guest about freed room once a quarter of it is back.
                if conn.fwd_cnt.wrapping_sub(conn.fwd_cnt_sent) >= TX_BUF_ALLOC / 4 {
                    self.send_control(key, OP_CREDIT_UPDATE, 0);
                }
            }
            OP_SHUTDOWN => {
                if hdr.flags & SHUTDOWN_SEND != 0 {
                    conn.guest_done_sending = true;
                    if !conn.flush() {
                        return self.reset(ctx, key);
                    }
                }
                if hdr.flags & (SHUTDOWN_SEND | SHUTDOWN_RCV) == SHUTDOWN_SEND | SHUTDOWN_RCV {
                    // Both ways closed: the connection is over once our side says so.
                    let _ = conn.flush();
                    return self.reset(ctx, key);
                }
            }
            OP_RST => return self.remove_conn(ctx, key),
            OP_CREDIT_UPDATE => {}
            OP_CREDIT_REQUEST => self.send_control(key, OP_CREDIT_UPDATE, 0),
            op => {
                tracing::debug!("virtio-vsock: unexpected op {op} on {key:?}");
                return self.reset(ctx, key);
            }
        }
        self.watch(ctx, key);
    }

    /// The guest connects to host port `key.0`: `<path>_<port>`.
    fn guest_connects(&mut self, ctx: &WorkerContext<'_>, key: Key, hdr: &Header) {
        if self.conns.contains_key(&key) {
            return self.reset(ctx, key);
        }
        let target = PathBuf::from(format!("{}_{}", self.path.display(), key.0));
        let stream = connect_nonblocking(&target);
        match stream {
            Ok(s) => {
                let token = self.token();
                let conn = Conn::new(s, token, ConnState::Established, Some(hdr));
                self.add_conn(ctx, key, conn);
                self.send_control(key, OP_RESPONSE, 0);
            }
            Err(e) => {
                tracing::debug!(
                    "virtio-vsock: guest connection to {}: {e}",
                    target.display()
                );
                self.send_control(key, OP_RST, 0);
            }
        }
    }

    // ---------------------------------------------------------------- host to guest

    fn accept_hosts(&mut self, ctx: &WorkerContext<'_>) {
        loop {
            match self.listener.accept() {
                Ok((s, _)) => {
                    if nonblocking(&s).is_err() {
                        continue;
                    }
                    let token = self.token();
                    if ctx.add(s.as_raw_fd(), token, EventSet::IN).is_ok() {
                        self.pending_hosts.insert(
                            token,
                            Pending {
                                stream: s,
                                line: Vec::new(),
                            },
                        );
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!("virtio-vsock: accept: {e}");
                    return;
                }
            }
        }
    }

    /// Reads a host's `CONNECT <port>` line; once whole, asks the guest to accept.
    fn host_line(&mut self, ctx: &WorkerContext<'_>, token: u64) {
        let Some(p) = self.pending_hosts.get_mut(&token) else {
            return;
        };
        let mut byte = [0u8; 1];
        // One byte at a time: whatever follows the line is the connection's data.
        let port = loop {
            match p.stream.read(&mut byte) {
                Ok(1) if byte[0] == b'\n' => {
                    let line = String::from_utf8_lossy(&p.line).into_owned();
                    break line
                        .strip_prefix("CONNECT ")
                        .and_then(|n| n.trim().parse::<u32>().ok());
                }
                Ok(1) if p.line.len() < MAX_CONNECT_LINE => p.line.push(byte[0]),
                Ok(_) => break None,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(_) => break None,
            }
        };
        let Some(p) = self.pending_hosts.remove(&token) else {
            return;
        };
        let _ = ctx.remove(p.stream.as_raw_fd());
        let Some(port) = port else {
            tracing::debug!("virtio-vsock: a host sent a bad CONNECT line");
            return;
        };
        let local = self.local_port();
        let key = (local, port);
        self.add_conn(
            ctx,
            key,
            Conn::new(p.stream, token, ConnState::Connecting, None),
        );
        match self.held_requests.as_mut() {
            Some(held) => held.push(key),
            None => self.send_control(key, OP_REQUEST, 0),
        }
    }

    fn local_port(&mut self) -> u32 {
        loop {
            // Only this worker writes it (the device reads it while the worker is parked).
            let p = self.next_local_port.load(Ordering::Relaxed);
            let next = p.checked_add(1).unwrap_or(FIRST_LOCAL_PORT);
            self.next_local_port.store(next, Ordering::Relaxed);
            if !self.conns.keys().any(|k| k.0 == p) {
                return p;
            }
        }
    }

    fn host_event(&mut self, ctx: &WorkerContext<'_>, token: u64, events: EventSet) {
        if self.pending_hosts.contains_key(&token) {
            return self.host_line(ctx, token);
        }
        let Some(&key) = self.tokens.get(&token) else {
            return;
        };
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if events.contains(EventSet::OUT) && !conn.flush() {
            return self.reset(ctx, key);
        }
        if events.intersects(EventSet::IN | EventSet::HANG_UP | EventSet::ERROR) {
            conn.readable = true;
        }
        self.watch(ctx, key);
    }

    /// The next packet for the guest that fits `room` bytes of payload: a waiting one,
    /// else data (or end of stream) from a readable host stream the guest has credit for.
    fn next_for_guest(&mut self, ctx: &WorkerContext<'_>, room: usize) -> Option<Packet> {
        if let Some(p) = self.pending.pop_front() {
            return Some(p);
        }
        let keys: Vec<Key> = self
            .conns
            .iter()
            .filter(|(_, c)| c.readable && c.peer_credit() > 0)
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            let conn = self.conns.get_mut(&key)?;
            // The guest's buffer and credit may both be gigabytes: a packet is
            // at most what Linux's driver sends.
            let want = room
                .min(conn.peer_credit() as usize)
                .min(MAX_PAYLOAD as usize);
            let mut buf = vec![0u8; want];
            match conn.stream.read(&mut buf) {
                Ok(0) => {
                    // The host closed: the guest will get no more and may send no more.
                    self.remove_conn(ctx, key);
                    let mut hdr = self.header(key, OP_SHUTDOWN);
                    hdr.flags = SHUTDOWN_SEND | SHUTDOWN_RCV;
                    return Some(Packet {
                        hdr,
                        data: Vec::new(),
                    });
                }
                Ok(n) => {
                    buf.truncate(n);
                    conn.rx_cnt = conn.rx_cnt.wrapping_add(n as u32);
                    conn.fwd_cnt_sent = conn.fwd_cnt;
                    let mut hdr = self.header(key, OP_RW);
                    hdr.len = n as u32;
                    return Some(Packet { hdr, data: buf });
                }
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    conn.readable = false;
                    self.watch(ctx, key);
                }
                Err(_) => {
                    self.reset(ctx, key);
                    return self.pending.pop_front();
                }
            }
        }
        None
    }

    /// Fills the guest's rx buffers with what is waiting.
    fn process_rx(&mut self, ctx: &WorkerContext<'_>) {
        let mut used_any = false;
        // A handle of its own: the writer borrows it while packets are made.
        let mem = self.mem.clone();
        while let Some(chain) = self.queues[RX].pop_descriptor_chain(&mem) {
            let head = chain.head_index();
            let mut writer = match chain.writer(&mem) {
                Ok(w) if w.available_bytes() >= HEADER_LEN => w,
                _ => {
                    tracing::debug!("virtio-vsock: rx buffer {head} too small or invalid");
                    crate::virtio::add_used(&mut self.queues[RX], &mem, head, 0, "virtio-vsock");
                    used_any = true;
                    continue;
                }
            };
            let room = writer.available_bytes() - HEADER_LEN;
            let Some(mut pkt) = self.next_for_guest(ctx, room) else {
                self.queues[RX].go_to_previous_position();
                break;
            };
            if pkt.data.len() > room {
                // A waiting packet larger than this buffer (the driver shrank its
                // buffers): send what fits, keep the rest for the next one.
                let rest = pkt.data.split_off(room);
                let mut tail = pkt.hdr;
                tail.len = rest.len() as u32;
                self.pending.push_front(Packet {
                    hdr: tail,
                    data: rest,
                });
                pkt.hdr.len = room as u32;
            }
            let written = writer
                .write_obj(pkt.hdr)
                .and_then(|()| writer.write_all(&pkt.data))
                .map_or(0, |()| HEADER_LEN + pkt.data.len());
            let len = written as u32;
            crate::virtio::add_used(&mut self.queues[RX], &mem, head, len, "virtio-vsock");
            used_any = true;
        }
        if used_any {
            crate::virtio::notify_used(
                &mut self.queues[RX],
                &self.mem,
                &self.interrupt,
                "virtio-vsock",
            );
        }
    }

    /// Tells the driver the transport was reset (a clone's first start); once the
    /// driver has handled that, lets the held host connections through.
    fn process_event(&mut self) {
        let avail = self.queues[EVENT]
            .avail_idx(&self.mem, std::sync::atomic::Ordering::Acquire)
            .map(|w| w.0);
        if !self.reset_pending {
            if self.reset_avail.is_some() && avail.ok() != self.reset_avail {
                self.reset_avail = None;
                for key in self.held_requests.take().unwrap_or_default() {
                    if self.conns.contains_key(&key) {
                        self.send_control(key, OP_REQUEST, 0);
                    }
                }
            }
            return;
        }
        let Some(chain) = self.queues[EVENT].pop_descriptor_chain(&self.mem) else {
            return;
        };
        self.reset_avail = Some(avail.unwrap_or(0));
        let head = chain.head_index();
        let written = chain
            .writer(&self.mem)
            .ok()
            .and_then(|mut w| w.write_obj(EVENT_TRANSPORT_RESET.to_le()).ok())
            .map_or(0, |()| 4);
        crate::virtio::add_used(
            &mut self.queues[EVENT],
            &self.mem,
            head,
            written,
            "virtio-vsock",
        );
        self.reset_pending = false;
        crate::virtio::notify_used(
            &mut self.queues[EVENT],
            &self.mem,
            &self.interrupt,
            "virtio-vsock",
        );
    }
}

impl QueueHandler for Muxer {
    fn start(&mut self, ctx: &WorkerContext<'_>) {
        if let Err(e) = ctx.add(self.listener.as_raw_fd(), TOKEN_LISTENER, EventSet::IN) {
            tracing::error!("virtio-vsock: cannot watch {}: {e}", self.path.display());
        }
        self.process_event();
    }

    fn queue_event(&mut self, index: usize, ctx: &WorkerContext<'_>) {
        match index {
            TX => self.process_tx(ctx),
            EVENT => self.process_event(),
            _ => {}
        }
        // Every guest action may have made packets or room for them.
        self.process_rx(ctx);
    }

    fn handler_event(&mut self, token: u64, events: EventSet, ctx: &WorkerContext<'_>) {
        if token == TOKEN_LISTENER {
            self.accept_hosts(ctx);
        } else {
            self.host_event(ctx, token, events);
        }
        self.process_rx(ctx);
    }

    fn queue_states(&self) -> Vec<QueueState> {
        self.queues.iter().map(Queue::state).collect()
    }
}
