//! The muxer driven as its worker drives it, with mock guest queues and real host
//! Unix sockets.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::epoll::{Epoll, EpollEvent};
use vmm_sys_util::eventfd::EventFd;

use super::muxer::MAX_PAYLOAD;
use super::packet::*;
use super::*;
use crate::virtio::worker::WorkerContext;

const RX: usize = 0;
const TX: usize = 1;
const EVENT: usize = 2;

const WRITE: u16 = 2;
const GUEST_CID: u64 = 3;
const RX_BUF: u64 = 0x40_0000;
const TX_BUF: u64 = 0x80_0000;
const EVENT_BUF: u64 = 0xc0_0000;

struct Rig<'a> {
    mem: &'a GuestMemoryMmap,
    rx: MockSplitQueue<'a, GuestMemoryMmap>,
    tx: MockSplitQueue<'a, GuestMemoryMmap>,
    ev: MockSplitQueue<'a, GuestMemoryMmap>,
    handler: Box<dyn QueueHandler>,
    epoll: Epoll,
    rx_posted: u16,
    rx_seen: u16,
    tx_sent: u16,
    /// The buffer space the guest's packets declare.
    buf_alloc: u32,
    _dev: Vsock,
}

fn rig<'a>(mem: &'a GuestMemoryMmap, path: &Path, restored: bool) -> Rig<'a> {
    rig_with(mem, Vsock::new(GUEST_CID, path, restored).unwrap())
}

/// The rig around `dev`, activated.
fn rig_with(mem: &GuestMemoryMmap, mut dev: Vsock) -> Rig<'_> {
    let rx = MockSplitQueue::create(mem, GuestAddress(0x1_0000), 16);
    let tx = MockSplitQueue::create(mem, GuestAddress(0x2_0000), 16);
    let ev = MockSplitQueue::create(mem, GuestAddress(0x3_0000), 16);
    let queues = vec![
        rx.create_queue().unwrap(),
        tx.create_queue().unwrap(),
        ev.create_queue().unwrap(),
    ];
    let irq = Arc::new(VirtioInterrupt::new(EventFd::new(0).unwrap()));
    let handler = dev.activate(mem.clone(), 0, queues, irq).unwrap();
    let mut r = Rig {
        mem,
        rx,
        tx,
        ev,
        handler,
        epoll: Epoll::new().unwrap(),
        rx_posted: 0,
        rx_seen: 0,
        tx_sent: 0,
        buf_alloc: 64 << 10,
        _dev: dev,
    };
    let d = SplitDescriptor::new(EVENT_BUF, 4, WRITE, 0);
    r.ev.add_desc_chains(&[RawDescriptor::from(d)], 0).unwrap();
    let ctx = WorkerContext::new(&r.epoll);
    r.handler.start(&ctx);
    r
}

impl Rig<'_> {
    /// The guest posts `n` rx buffers of a header and 4 KiB.
    fn post_rx(&mut self, n: u16) {
        for _ in 0..n {
            let i = self.rx_posted;
            let d = SplitDescriptor::new(RX_BUF + u64::from(i) * 0x2000, 44 + 4096, WRITE, 0);
            self.rx
                .add_desc_chains(&[RawDescriptor::from(d)], i)
                .unwrap();
            self.rx_posted += 1;
        }
        let ctx = WorkerContext::new(&self.epoll);
        self.handler.queue_event(RX, &ctx);
    }

    /// Runs the worker's loop until nothing happens for 50 ms; panics if it keeps being
    /// woken (a worker that spins).
    fn pump(&mut self) {
        let mut events = [EpollEvent::default(); 8];
        let mut wakeups = 0;
        while let Ok(n) = self.epoll.wait(50, &mut events) {
            if n == 0 {
                break;
            }
            wakeups += 1;
            assert!(wakeups < 10_000, "the worker does not go idle");
            let ctx = WorkerContext::new(&self.epoll);
            for ev in &events[..n] {
                self.handler.handler_event(ev.data(), ev.event_set(), &ctx);
            }
        }
    }

    /// The next packet the device gave the guest.
    fn next_rx(&mut self) -> Packet {
        self.pump();
        assert!(
            self.rx.used().idx().load() > self.rx_seen,
            "no packet for the guest"
        );
        let used = self
            .rx
            .used()
            .ring()
            .ref_at(self.rx_seen as usize)
            .unwrap()
            .load();
        let addr = RX_BUF + u64::from(used.id()) * 0x2000;
        self.rx_seen += 1;
        let hdr: Header = self.mem.read_obj(GuestAddress(addr)).unwrap();
        let mut data = vec![0u8; hdr.len as usize];
        self.mem
            .read_slice(&mut data, GuestAddress(addr + 44))
            .unwrap();
        assert_eq!(used.len() as usize, 44 + data.len());
        Packet { hdr, data }
    }

    /// The guest sends a packet.
    fn send(&mut self, op: u16, ports: (u32, u32), flags: u32, data: &[u8]) {
        let i = self.tx_sent;
        let addr = TX_BUF + u64::from(i) * 0x2000;
        let hdr = Header {
            src_cid: GUEST_CID,
            dst_cid: HOST_CID,
            src_port: ports.0,
            dst_port: ports.1,
            len: data.len() as u32,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc: self.buf_alloc,
            fwd_cnt: 0,
        };
        self.mem.write_obj(hdr, GuestAddress(addr)).unwrap();
        self.mem.write_slice(data, GuestAddress(addr + 44)).unwrap();
        let d = SplitDescriptor::new(addr, 44 + data.len() as u32, 0, 0);
        self.tx
            .add_desc_chains(&[RawDescriptor::from(d)], i)
            .unwrap();
        self.tx_sent += 1;
        let ctx = WorkerContext::new(&self.epoll);
        self.handler.queue_event(TX, &ctx);
        self.pump();
    }
}

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("forkvm-vsock-{name}-{}", std::process::id()))
}

fn mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap()
}

#[test]
fn host_connects_exchanges_data_and_closes() {
    let m = mem();
    let path = temp_path("host");
    let mut r = rig(&m, &path, false);
    assert_eq!(
        r.ev.used().idx().load(),
        0,
        "no reset for an original device"
    );
    r.post_rx(8);
    let mut host = UnixStream::connect(&path).unwrap();
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    host.write_all(b"CONNECT 1234\n").unwrap();
    let req = r.next_rx();
    assert_eq!(
        ({ req.hdr.op }, { req.hdr.dst_port }, { req.hdr.dst_cid }, {
            req.hdr.src_cid
        }),
        (OP_REQUEST, 1234, GUEST_CID, HOST_CID)
    );
    let local = req.hdr.src_port;
    r.send(OP_RESPONSE, (1234, local), 0, &[]);
    let mut reader = BufReader::new(host.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert_eq!(line, format!("OK {local}\n"));

    host.write_all(b"hello").unwrap();
    let rw = r.next_rx();
    assert_eq!(({ rw.hdr.op }, rw.data.as_slice()), (OP_RW, &b"hello"[..]));
    r.send(OP_RW, (1234, local), 0, b"world");
    let mut got = [0u8; 5];
    reader.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"world");

    drop(reader);
    drop(host);
    let bye = r.next_rx();
    assert_eq!(({ bye.hdr.op }, { bye.hdr.flags }), (OP_SHUTDOWN, 3));
    // Data for a connection that is gone is refused.
    r.send(OP_RW, (1234, local), 0, b"late");
    assert_eq!({ r.next_rx().hdr.op }, OP_RST);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_guest_packet_longer_than_64_kib_resets_its_connection_and_nothing_of_it_is_sent() {
    // The fuzzer found packets of up to 4 GiB copied whole into the device's memory
    // (`virtio_vsock`, slow inputs): one chain's descriptors may cover that much.
    let m = mem();
    let path = temp_path("big");
    let mut r = rig(&m, &path, false);
    r.post_rx(8);
    let mut host = UnixStream::connect(&path).unwrap();
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    host.write_all(b"CONNECT 1234\n").unwrap();
    let local = r.next_rx().hdr.src_port;
    r.send(OP_RESPONSE, (1234, local), 0, &[]);
    let mut reader = BufReader::new(host.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    // 64 KiB goes through.
    let most = vec![7u8; MAX_PAYLOAD as usize];
    r.send(OP_RW, (1234, local), 0, &most);
    let mut got = vec![0u8; most.len()];
    reader.read_exact(&mut got).unwrap();
    assert_eq!(got, most);
    // One byte more: the connection is reset, the host gets none of it.
    r.send(
        OP_RW,
        (1234, local),
        0,
        &vec![8u8; MAX_PAYLOAD as usize + 1],
    );
    // (After a credit update for the 64 KiB the host took.)
    let op = loop {
        let op = r.next_rx().hdr.op;
        if op != OP_CREDIT_UPDATE {
            break op;
        }
    };
    assert_eq!(op, OP_RST);
    let mut rest = Vec::new();
    reader.read_to_end(&mut rest).unwrap();
    assert!(
        rest.is_empty(),
        "{} bytes of the long packet sent",
        rest.len()
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn the_device_sends_at_most_64_kib_a_packet_whatever_room_and_credit_the_guest_gives() {
    // Also: while the host has data the guest has no room for, the worker sleeps (it
    // re-armed the stream's edge-triggered registration on each event, and so spun).
    let m = mem();
    let path = temp_path("big-rx");
    let mut r = rig(&m, &path, false);
    r.post_rx(1);
    let mut host = UnixStream::connect(&path).unwrap();
    host.write_all(b"CONNECT 1234\n").unwrap();
    let local = r.next_rx().hdr.src_port;
    // 16 MiB of credit, and one buffer of 1 MiB.
    r.buf_alloc = 16 << 20;
    r.send(OP_RESPONSE, (1234, local), 0, &[]);
    let mut line = String::new();
    BufReader::new(host.try_clone().unwrap())
        .read_line(&mut line)
        .unwrap();
    const BIG_RX: u64 = 0x50_0000;
    let d = SplitDescriptor::new(BIG_RX, 44 + (1 << 20), WRITE, 0);
    r.rx.add_desc_chains(&[RawDescriptor::from(d)], r.rx_posted)
        .unwrap();
    r.rx_posted += 1;
    // As much as the socket takes at once (more than 64 KiB), without blocking.
    host.set_nonblocking(true).unwrap();
    let sent = host.write(&vec![5u8; 96 << 10]).unwrap();
    assert!(sent > MAX_PAYLOAD as usize, "{sent}");
    let ctx = WorkerContext::new(&r.epoll);
    r.handler.queue_event(RX, &ctx);
    r.pump();
    let used =
        r.rx.used()
            .ring()
            .ref_at(r.rx_seen as usize)
            .unwrap()
            .load();
    let hdr: Header = m.read_obj(GuestAddress(BIG_RX)).unwrap();
    assert_eq!(({ hdr.op }, hdr.len), (OP_RW, MAX_PAYLOAD));
    assert_eq!(used.len(), 44 + MAX_PAYLOAD);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn guest_connects_to_a_host_socket_and_unknown_ports_are_refused() {
    let m = mem();
    let path = temp_path("guest");
    let mut r = rig(&m, &path, false);
    r.post_rx(8);
    let server = UnixListener::bind(format!("{}_5000", path.display())).unwrap();
    r.send(OP_REQUEST, (49152, 5000), 0, &[]);
    assert_eq!({ r.next_rx().hdr.op }, OP_RESPONSE);
    let (mut s, _) = server.accept().unwrap();
    r.send(OP_RW, (49152, 5000), 0, b"ping");
    let mut got = [0u8; 4];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"ping");
    s.write_all(b"pong").unwrap();
    let rw = r.next_rx();
    assert_eq!(rw.data, b"pong");
    assert_eq!({ rw.hdr.dst_port }, 49152);
    // Nobody listens on port 6000.
    r.send(OP_REQUEST, (49153, 6000), 0, &[]);
    assert_eq!({ r.next_rx().hdr.op }, OP_RST);
    // A packet claiming another source CID is refused.
    let i = r.tx_sent;
    let addr = TX_BUF + u64::from(i) * 0x2000;
    let bad = Header {
        src_cid: 99,
        dst_cid: HOST_CID,
        op: OP_REQUEST,
        type_: TYPE_STREAM,
        ..Default::default()
    };
    m.write_obj(bad, GuestAddress(addr)).unwrap();
    r.tx.add_desc_chains(
        &[RawDescriptor::from(SplitDescriptor::new(addr, 44, 0, 0))],
        i,
    )
    .unwrap();
    r.handler.queue_event(TX, &WorkerContext::new(&r.epoll));
    assert_eq!({ r.next_rx().hdr.op }, OP_RST);
    // A bad CONNECT line is dropped without bothering the guest.
    let mut host = UnixStream::connect(&path).unwrap();
    host.write_all(b"HELLO\n").unwrap();
    r.pump();
    assert_eq!(r.rx.used().idx().load(), r.rx_seen);
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(host.read(&mut got).unwrap(), 0, "closed");
    let _ = std::fs::remove_file(format!("{}_5000", path.display()));
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_host_program_that_does_not_accept_cannot_stall_the_device() {
    use nix::sys::socket::{
        bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr,
    };
    let m = mem();
    let path = temp_path("backlog");
    let mut r = rig(&m, &path, false);
    r.post_rx(8);
    // A program listening on port 5000 with a backlog of one, which never accepts.
    let program = format!("{}_5000", path.display());
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    bind(fd.as_raw_fd(), &UnixAddr::new(program.as_str()).unwrap()).unwrap();
    listen(&fd, Backlog::new(0).unwrap()).unwrap();
    // The backlog takes one or two connections (the kernel's bound is inclusive); the
    // next is refused at once instead of holding the worker until the program accepts.
    let mut ops = Vec::new();
    for port in 49152..49156 {
        r.send(OP_REQUEST, (port, 5000), 0, &[]);
        ops.push(r.next_rx().hdr.op);
    }
    assert_eq!(ops[0], OP_RESPONSE, "{ops:?}");
    assert_eq!(ops[3], OP_RST, "{ops:?}");
    // The device still serves: a host connects and is offered to the guest.
    let mut host = UnixStream::connect(&path).unwrap();
    host.write_all(b"CONNECT 77\n").unwrap();
    assert_eq!({ r.next_rx().hdr.op }, OP_REQUEST);
    let _ = std::fs::remove_file(&program);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_restored_device_reports_a_transport_reset_and_holds_hosts_until_it_is_handled() {
    let m = mem();
    let path = temp_path("reset");
    let mut r = rig(&m, &path, true);
    // The worker serves every queue once at start: that is not the driver's answer.
    r.handler.queue_event(EVENT, &WorkerContext::new(&r.epoll));
    assert_eq!(r.ev.used().idx().load(), 1);
    let id: u32 = m.read_obj(GuestAddress(EVENT_BUF)).unwrap();
    assert_eq!(id, EVENT_TRANSPORT_RESET);
    // A host connecting before the driver handled the reset waits...
    r.post_rx(4);
    let mut host = UnixStream::connect(&path).unwrap();
    host.write_all(b"CONNECT 1234\n").unwrap();
    r.pump();
    assert_eq!(
        r.rx.used().idx().load(),
        0,
        "request sent before the reset was handled"
    );
    // ...until the driver refills the event queue and notifies it.
    let d = SplitDescriptor::new(EVENT_BUF, 4, WRITE, 0);
    r.ev.add_desc_chains(&[RawDescriptor::from(d)], 1).unwrap();
    r.handler.queue_event(EVENT, &WorkerContext::new(&r.epoll));
    let req = r.next_rx();
    assert_eq!(({ req.hdr.op }, { req.hdr.dst_port }), (OP_REQUEST, 1234));
    drop(host);
    drop(r);
    assert!(!path.exists(), "socket file removed with the device");
}

#[test]
fn a_restored_device_goes_on_from_its_parents_host_ports() {
    // The parent's last host connection may still be closing in the copy of its guest:
    // a clone (or a restored VM) whose first connection took the same port would be
    // answered with a reset by that socket.
    let m = mem();
    let path = temp_path("ports");
    let mut r = rig(&m, &path, false);
    r.post_rx(8);
    let mut host = UnixStream::connect(&path).unwrap();
    host.write_all(b"CONNECT 1234\n").unwrap();
    let first = r.next_rx().hdr.src_port;
    let state = r._dev.save();
    assert_eq!(state.next_local_port, first + 1);
    drop(host);
    drop(r);
    // A state saved before the field existed starts where a new device does.
    let old: VsockState = serde_json::from_str(r#"{"cid":3}"#).unwrap();
    assert_eq!(old.next_local_port, first);

    let path = temp_path("ports-restored");
    let mut dev = Vsock::restore(path.clone(), &state).unwrap();
    dev.open_host().unwrap();
    let mut r = rig_with(&m, dev);
    // The reset delivered and handled (the driver refills the event queue).
    r.handler.queue_event(EVENT, &WorkerContext::new(&r.epoll));
    let d = SplitDescriptor::new(EVENT_BUF, 4, WRITE, 0);
    r.ev.add_desc_chains(&[RawDescriptor::from(d)], 1).unwrap();
    r.handler.queue_event(EVENT, &WorkerContext::new(&r.epoll));
    r.post_rx(4);
    let mut host = UnixStream::connect(&path).unwrap();
    host.write_all(b"CONNECT 1234\n").unwrap();
    let req = r.next_rx();
    assert_eq!(
        ({ req.hdr.op }, { req.hdr.src_port }),
        (OP_REQUEST, first + 1)
    );
}

#[test]
fn bad_cids_are_refused() {
    for cid in [0, 1, 2, u64::from(u32::MAX), u64::MAX] {
        assert!(matches!(
            Vsock::new(cid, &temp_path("cid"), false),
            Err(VsockError::Cid(_))
        ));
    }
}

#[test]
fn a_deferred_device_binds_its_socket_when_opened_or_activated() {
    let path = temp_path("deferred");
    let mut dev = Vsock::deferred(GUEST_CID, &path, true).unwrap();
    assert!(!path.exists(), "nothing bound before open_host");
    dev.open_host().unwrap();
    assert!(path.exists());
    dev.open_host().unwrap(); // once open, again is a no-op
    drop(dev);
    assert!(!path.exists(), "socket file removed with the device");

    // A driver that starts the device first binds it too.
    let m = mem();
    let mut dev = Vsock::deferred(GUEST_CID, &path, false).unwrap();
    let queues = [0x1_0000, 0x2_0000, 0x3_0000].map(|a| {
        MockSplitQueue::create(&m, GuestAddress(a), 16)
            .create_queue()
            .unwrap()
    });
    let irq = Arc::new(VirtioInterrupt::new(EventFd::new(0).unwrap()));
    dev.activate(m.clone(), 0, queues.into(), irq).unwrap();
    assert!(path.exists());
    drop(dev);

    // A socket that cannot be bound is the device's error, not a panic.
    let bad = temp_path("no-such-dir").join("sock");
    let mut dev = Vsock::deferred(GUEST_CID, &bad, true).unwrap();
    let e = dev.open_host().unwrap_err();
    assert!(
        matches!(
            e,
            ActivateError::Host {
                device: "virtio-vsock",
                ..
            }
        ),
        "{e}"
    );
    drop(dev);
    assert!(!bad.exists());
}
