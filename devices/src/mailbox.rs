//! The invocation mailbox: guest-visible memory outside guest RAM through which a
//! request reaches a guest runtime and its reply comes back (docs/invoke.md).
//!
//! The mailbox is one KVM memory slot of its own at [`MAILBOX_START`], in the MMIO gap
//! below 4 GiB, so the guest kernel never treats it as RAM: nothing in the guest can
//! allocate, move or reuse it. A runtime finds it through the invoke ports
//! (`control.rs`) and maps it (a Linux guest through `/dev/mem`). Its host memory is
//! anonymous and private, as guest RAM is: a clone shares its parent's copy-on-write,
//! and its VMM writes the clone's request into its own copy before the clone's vCPU
//! runs.
//!
//! Layout: a 64-byte header at offset 0, then the payload. The VMM writes a
//! [`RequestHeader`]; the runtime answers with a [`ReplyHeader`] in the same place and
//! writes the reply's payload length to the invoke port. Before it waits, a runtime may
//! leave a wait header there (magic [`WAIT_MAGIC`], version, then at offset 8 the
//! features it handles: [`runtime_features`]). All fields are little-endian.

use vm_memory::{Bytes, GuestAddress, GuestMemory};

/// Guest-physical address of the mailbox (the start of the MMIO gap).
pub const MAILBOX_START: u64 = 0xc000_0000;
/// Largest mailbox: it ends before the virtio-mmio devices at 0xd000_0000.
pub const MAX_MAILBOX_BYTES: u64 = 0x1000_0000;
/// Bytes of header before the payload.
pub const HEADER_BYTES: usize = 64;
/// "FKRQ": a request header.
pub const REQUEST_MAGIC: u32 = u32::from_le_bytes(*b"FKRQ");
/// "FKRP": a reply header.
pub const REPLY_MAGIC: u32 = u32::from_le_bytes(*b"FKRP");
/// The mailbox layout's version.
pub const VERSION: u16 = 1;
/// Request kind: call the handler with the payload.
pub const KIND_INVOKE: u16 = 1;
/// Request kind: a dry run of the serving path without the handler (empty payload),
/// sent only to a runtime that declared [`FEATURE_PRIME`]; its reply is dropped.
pub const KIND_PRIME: u16 = 2;
/// Request kind: the payload is for the runtime's loader, not its handler (a template
/// derived from this one: the Python runtime imports packages and loads a handler's
/// source); sent only to a runtime that declared [`FEATURE_LOAD`].
pub const KIND_LOAD: u16 = 3;
/// "FKWT": a wait header, which a runtime may leave before it waits.
pub const WAIT_MAGIC: u32 = u32::from_le_bytes(*b"FKWT");
/// Runtime feature (in its wait header): it answers [`KIND_PRIME`] requests.
pub const FEATURE_PRIME: u32 = 1;
/// Runtime feature (in its wait header): it answers [`KIND_LOAD`] requests.
pub const FEATURE_LOAD: u32 = 2;
/// Request flag: the runtime waits for further requests after this one (keep-alive).
pub const FLAG_KEEP_ALIVE: u32 = 1;
/// Request flag: the VM has a network identity of its own (a clone given an address):
/// the runtime takes it (MAC, address, gateway from the identity block) before the
/// handler runs, and aborts the TCP connections from the address it replaced.
pub const FLAG_ADOPT_NET: u32 = 2;
/// Bytes of fresh host entropy in every request header.
pub const ENTROPY_BYTES: usize = 32;
/// "FKLG": a live log header, at [`MailboxWindow::live_log_offset`].
pub const LIVE_LOG_MAGIC: u32 = u32::from_le_bytes(*b"FKLG");
/// The live log region's size (header and text), at the mailbox's end.
pub const LIVE_LOG_REGION: usize = 64 << 10;
/// The live log header's size: magic (u32), text length (u32), the request's sequence
/// (u64), bytes dropped before the text (u64).
pub const LIVE_LOG_HEADER: usize = 24;

/// The little-endian u16 at `b[i..]` (the caller's header holds it).
fn le_u16(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

/// The little-endian u32 at `b[i..]`.
fn le_u32(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// The little-endian u64 at `b[i..]`.
fn le_u64(b: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(w)
}

/// Where the mailbox is in guest-physical memory and how large it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MailboxWindow {
    /// Guest-physical address (0: no mailbox).
    pub addr: u32,
    /// Size in bytes (0: no mailbox).
    pub size: u32,
}

impl MailboxWindow {
    /// A window of `size` bytes at [`MAILBOX_START`] (none when `size` is 0).
    pub fn of_size(size: u32) -> Self {
        match size {
            0 => Self::default(),
            size => Self {
                addr: MAILBOX_START as u32,
                size,
            },
        }
    }

    /// Whether the VM has a mailbox.
    pub fn exists(&self) -> bool {
        self.size as usize > HEADER_BYTES
    }

    /// The largest payload a request or reply may carry.
    pub fn capacity(&self) -> usize {
        (self.size as usize).saturating_sub(HEADER_BYTES)
    }

    /// Where a runtime may keep the running invocation's live log: the mailbox's last
    /// [`LIVE_LOG_REGION`] bytes; None for a mailbox smaller than twice that.
    pub fn live_log_offset(&self) -> Option<usize> {
        let size = self.size as usize;
        (size >= 2 * LIVE_LOG_REGION).then(|| size - LIVE_LOG_REGION)
    }

    /// The guest address `offset` bytes into the mailbox.
    pub fn at(&self, offset: usize) -> GuestAddress {
        GuestAddress(u64::from(self.addr) + offset as u64)
    }
}

/// The features a runtime declared in the wait header it left in `window` before it
/// waited (0: none, or no wait header).
pub fn runtime_features<M: GuestMemory>(mem: &M, window: MailboxWindow) -> u32 {
    let mut b = [0u8; 12];
    if !window.exists() || mem.read_slice(&mut b, window.at(0)).is_err() {
        return 0;
    }
    let word = |i: usize| le_u32(&b, i);
    let version = le_u16(&b, 4);
    match word(0) == WAIT_MAGIC && version == VERSION {
        true => word(8),
        false => 0,
    }
}

/// A request's header, as the VMM writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// [`KIND_INVOKE`], [`KIND_PRIME`] or [`KIND_LOAD`].
    pub kind: u16,
    /// [`FLAG_KEEP_ALIVE`], [`FLAG_ADOPT_NET`], or 0.
    pub flags: u32,
    /// Payload length.
    pub length: u32,
    /// This VM's invocation number (1 for the first).
    pub sequence: u64,
    /// How long the handler may take, in milliseconds (0: no limit).
    pub timeout_ms: u32,
    /// Fresh host random bytes, for the runtime to seed its own PRNGs.
    pub entropy: [u8; ENTROPY_BYTES],
}

impl RequestHeader {
    /// The header's 64 bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.kind.to_le_bytes());
        b[8..12].copy_from_slice(&self.flags.to_le_bytes());
        b[12..16].copy_from_slice(&self.length.to_le_bytes());
        b[16..24].copy_from_slice(&self.sequence.to_le_bytes());
        b[24..28].copy_from_slice(&self.timeout_ms.to_le_bytes());
        b[32..64].copy_from_slice(&self.entropy);
        b
    }
}

/// What a runtime's reply says about the handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyStatus {
    /// The handler returned; the payload is its result.
    Ok,
    /// The handler failed; the payload is the error's text.
    HandlerError,
}

/// A reply's header, as the runtime writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyHeader {
    /// The handler's outcome.
    pub status: ReplyStatus,
    /// Payload length.
    pub length: u32,
}

/// Why a reply in the mailbox cannot be taken; the caller gets a 502.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    /// The header does not start with [`REPLY_MAGIC`].
    #[error("the reply header's magic is {0:#010x}, not \"FKRP\"")]
    Magic(u32),
    /// Another layout version.
    #[error("the reply header has version {0}; this VMM reads version {VERSION}")]
    Version(u16),
    /// An unknown status.
    #[error("the reply header has unknown status {0}")]
    Status(u16),
    /// The port and the header disagree on the length.
    #[error(
        "the runtime wrote a reply length of {port} bytes to the port but {header} in the header"
    )]
    Length {
        /// Written to the port.
        port: u32,
        /// In the header.
        header: u32,
    },
    /// Longer than the mailbox holds.
    #[error("a reply of {length} bytes does not fit the mailbox's {capacity}")]
    TooLarge {
        /// Claimed.
        length: u32,
        /// Most that fits.
        capacity: usize,
    },
    /// The VM has no mailbox.
    #[error("the VM has no mailbox")]
    NoMailbox,
    /// Guest memory could not be read or written.
    #[error("cannot access the mailbox: {0}")]
    Memory(String),
}

impl ReplyHeader {
    /// The header's 64 bytes (what a runtime writes; for tests and host-side tools).
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&REPLY_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        let status: u16 = match self.status {
            ReplyStatus::Ok => 0,
            ReplyStatus::HandlerError => 1,
        };
        b[6..8].copy_from_slice(&status.to_le_bytes());
        b[8..12].copy_from_slice(&self.length.to_le_bytes());
        b
    }

    /// Reads a header, checking it against the length written to the port and the
    /// mailbox's capacity.
    pub fn decode(b: &[u8; HEADER_BYTES], port: u32, capacity: usize) -> Result<Self, ReplyError> {
        let u32_at = |i: usize| le_u32(b, i);
        let u16_at = |i: usize| le_u16(b, i);
        if u32_at(0) != REPLY_MAGIC {
            return Err(ReplyError::Magic(u32_at(0)));
        }
        if u16_at(4) != VERSION {
            return Err(ReplyError::Version(u16_at(4)));
        }
        let status = match u16_at(6) {
            0 => ReplyStatus::Ok,
            1 => ReplyStatus::HandlerError,
            s => return Err(ReplyError::Status(s)),
        };
        let length = u32_at(8);
        if length != port {
            return Err(ReplyError::Length {
                port,
                header: length,
            });
        }
        if length as usize > capacity {
            return Err(ReplyError::TooLarge { length, capacity });
        }
        Ok(Self { status, length })
    }
}

/// Writes a request (header and payload) into the mailbox `window` of `mem`. The
/// caller has checked the payload fits ([`MailboxWindow::capacity`]); the header's
/// length may count bytes after `payload` that the caller put in place itself.
pub fn write_request<M: GuestMemory>(
    mem: &M,
    window: MailboxWindow,
    header: &RequestHeader,
    payload: &[u8],
) -> Result<(), ReplyError> {
    if !window.exists() {
        return Err(ReplyError::NoMailbox);
    }
    // The payload may go on with bytes already in place after it: the header's length
    // counts them.
    let length = (header.length as usize).max(payload.len());
    if length > window.capacity() {
        return Err(ReplyError::TooLarge {
            length: length as u32,
            capacity: window.capacity(),
        });
    }
    let memory = |e: vm_memory::GuestMemoryError| ReplyError::Memory(e.to_string());
    mem.write_slice(payload, window.at(HEADER_BYTES))
        .map_err(memory)?;
    mem.write_slice(&header.encode(), window.at(0))
        .map_err(memory)
}

/// Reads and checks the header of the reply the runtime wrote, `port` being the length
/// it wrote to the invoke port: its payload, of the length it gives, is at
/// `window.at(HEADER_BYTES)`.
pub fn read_reply_header<M: GuestMemory>(
    mem: &M,
    window: MailboxWindow,
    port: u32,
) -> Result<ReplyHeader, ReplyError> {
    if !window.exists() {
        return Err(ReplyError::NoMailbox);
    }
    let memory = |e: vm_memory::GuestMemoryError| ReplyError::Memory(e.to_string());
    let mut raw = [0u8; HEADER_BYTES];
    mem.read_slice(&mut raw, window.at(0)).map_err(memory)?;
    ReplyHeader::decode(&raw, port, window.capacity())
}

/// Reads the reply the runtime wrote, `port` being the length it wrote to the invoke
/// port: its header and payload.
pub fn read_reply<M: GuestMemory>(
    mem: &M,
    window: MailboxWindow,
    port: u32,
) -> Result<(ReplyHeader, Vec<u8>), ReplyError> {
    let memory = |e: vm_memory::GuestMemoryError| ReplyError::Memory(e.to_string());
    let header = read_reply_header(mem, window, port)?;
    let mut payload = vec![0u8; header.length as usize];
    mem.read_slice(&mut payload, window.at(HEADER_BYTES))
        .map_err(memory)?;
    Ok((header, payload))
}

/// What a runtime printed during an invocation that ended without a reply, from its
/// live log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveLog {
    /// The text's last bytes (UTF-8, lossily: the cut may split a character).
    pub text: String,
    /// Bytes dropped before them.
    pub dropped: u64,
}

/// The live log the runtime kept for request `sequence` (the runtime writes it while the
/// handler runs, when it captures the handler's output): None when there is none, it is
/// another request's, or its header is not whole. Read while the runtime may still be
/// writing, so its text is what was written by then.
pub fn read_live_log<M: GuestMemory>(
    mem: &M,
    window: MailboxWindow,
    sequence: u64,
) -> Option<LiveLog> {
    let offset = window.live_log_offset()?;
    let mut h = [0u8; LIVE_LOG_HEADER];
    mem.read_slice(&mut h, window.at(offset)).ok()?;
    let u32_at = |i: usize| le_u32(&h, i);
    let u64_at = |i: usize| le_u64(&h, i);
    if u32_at(0) != LIVE_LOG_MAGIC || u64_at(8) != sequence {
        return None;
    }
    let length = (u32_at(4) as usize).min(LIVE_LOG_REGION - LIVE_LOG_HEADER);
    let mut text = vec![0u8; length];
    mem.read_slice(&mut text, window.at(offset + LIVE_LOG_HEADER))
        .ok()?;
    Some(LiveLog {
        text: String::from_utf8_lossy(&text).into_owned(),
        dropped: u64_at(16),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn mem(size: usize) -> (GuestMemoryMmap, MailboxWindow) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(MAILBOX_START), size)]).unwrap();
        (mem, MailboxWindow::of_size(size as u32))
    }

    #[test]
    fn a_wait_header_declares_the_runtimes_features() {
        let (m, w) = mem(4096);
        assert_eq!(runtime_features(&m, w), 0, "no wait header");
        let mut raw = [0u8; 12];
        raw[0..4].copy_from_slice(b"FKWT");
        raw[4..6].copy_from_slice(&VERSION.to_le_bytes());
        raw[8..12].copy_from_slice(&FEATURE_PRIME.to_le_bytes());
        m.write_slice(&raw, GuestAddress(MAILBOX_START)).unwrap();
        assert_eq!(runtime_features(&m, w), FEATURE_PRIME);
        raw[4] = 9;
        m.write_slice(&raw, GuestAddress(MAILBOX_START)).unwrap();
        assert_eq!(runtime_features(&m, w), 0, "unknown layout version");
        raw[0..6].copy_from_slice(b"FKRP\x01\x00");
        m.write_slice(&raw, GuestAddress(MAILBOX_START)).unwrap();
        assert_eq!(
            runtime_features(&m, w),
            0,
            "a reply header is no wait header"
        );
        assert_eq!(
            runtime_features(&m, MailboxWindow::default()),
            0,
            "no mailbox"
        );
    }

    #[test]
    fn a_request_is_written_where_the_abi_says() {
        let (m, w) = mem(4096);
        let h = RequestHeader {
            kind: KIND_INVOKE,
            flags: FLAG_KEEP_ALIVE,
            length: 5,
            sequence: 7,
            timeout_ms: 1500,
            entropy: [0xab; ENTROPY_BYTES],
        };
        write_request(&m, w, &h, b"hello").unwrap();
        let mut raw = [0u8; 69];
        m.read_slice(&mut raw, GuestAddress(MAILBOX_START)).unwrap();
        assert_eq!(&raw[0..4], b"FKRQ");
        assert_eq!(raw[4..6], [1, 0]);
        assert_eq!(raw[6..8], [1, 0]);
        assert_eq!(raw[8..12], [1, 0, 0, 0]);
        assert_eq!(raw[12..16], [5, 0, 0, 0]);
        assert_eq!(raw[16..24], 7u64.to_le_bytes());
        assert_eq!(raw[24..28], 1500u32.to_le_bytes());
        assert_eq!(raw[28..32], [0; 4]);
        assert_eq!(raw[32..64], [0xab; 32]);
        assert_eq!(&raw[64..], b"hello");
        // One byte over the capacity is refused, not cut.
        let big = vec![0u8; w.capacity() + 1];
        assert!(matches!(
            write_request(&m, w, &h, &big),
            Err(ReplyError::TooLarge { .. })
        ));
        assert!(write_request(&m, w, &h, &big[1..]).is_ok());
    }

    #[test]
    fn a_reply_is_checked_before_it_is_taken() {
        let (m, w) = mem(4096);
        let put = |h: &[u8; HEADER_BYTES], payload: &[u8]| {
            m.write_slice(h, GuestAddress(MAILBOX_START)).unwrap();
            m.write_slice(payload, GuestAddress(MAILBOX_START + 64))
                .unwrap();
        };
        let ok = ReplyHeader {
            status: ReplyStatus::Ok,
            length: 3,
        };
        put(&ok.encode(), b"abc");
        assert_eq!(read_reply(&m, w, 3).unwrap(), (ok, b"abc".to_vec()));
        let failed = ReplyHeader {
            status: ReplyStatus::HandlerError,
            length: 2,
        };
        put(&failed.encode(), b"no");
        assert_eq!(
            read_reply(&m, w, 2).unwrap().0.status,
            ReplyStatus::HandlerError
        );
        // The port and the header disagree.
        assert_eq!(
            read_reply(&m, w, 3).unwrap_err(),
            ReplyError::Length { port: 3, header: 2 }
        );
        // Garbage.
        put(&[0x55; HEADER_BYTES], b"");
        assert!(matches!(read_reply(&m, w, 0), Err(ReplyError::Magic(_))));
        let mut h = ok.encode();
        h[4] = 9;
        put(&h, b"");
        assert_eq!(read_reply(&m, w, 3).unwrap_err(), ReplyError::Version(9));
        let mut h = ok.encode();
        h[6] = 7;
        put(&h, b"");
        assert_eq!(read_reply(&m, w, 3).unwrap_err(), ReplyError::Status(7));
        // Longer than the mailbox.
        let huge = ReplyHeader {
            status: ReplyStatus::Ok,
            length: 4096,
        };
        put(&huge.encode(), b"");
        assert!(matches!(
            read_reply(&m, w, 4096),
            Err(ReplyError::TooLarge {
                length: 4096,
                capacity: 4032
            })
        ));
        assert_eq!(
            read_reply(&m, MailboxWindow::default(), 0).unwrap_err(),
            ReplyError::NoMailbox
        );
    }

    #[test]
    fn a_live_log_is_read_only_for_its_own_request() {
        let (m, w) = mem(256 << 10);
        let at = GuestAddress(MAILBOX_START + (w.live_log_offset().unwrap()) as u64);
        assert_eq!(w.live_log_offset(), Some((256 << 10) - LIVE_LOG_REGION));
        assert_eq!(read_live_log(&m, w, 1), None, "none written");
        let mut h = [0u8; LIVE_LOG_HEADER];
        h[0..4].copy_from_slice(b"FKLG");
        h[4..8].copy_from_slice(&5u32.to_le_bytes());
        h[8..16].copy_from_slice(&3u64.to_le_bytes());
        h[16..24].copy_from_slice(&7u64.to_le_bytes());
        m.write_slice(&h, at).unwrap();
        m.write_slice(b"hello, more", GuestAddress(at.0 + LIVE_LOG_HEADER as u64))
            .unwrap();
        let log = read_live_log(&m, w, 3).unwrap();
        assert_eq!((log.text.as_str(), log.dropped), ("hello", 7));
        assert_eq!(read_live_log(&m, w, 4), None, "another request's");
        // A length past the region is cut to it.
        h[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        m.write_slice(&h, at).unwrap();
        let log = read_live_log(&m, w, 3).unwrap();
        assert_eq!(log.text.len(), LIVE_LOG_REGION - LIVE_LOG_HEADER);
        assert_eq!(
            MailboxWindow::of_size(64 << 10).live_log_offset(),
            None,
            "too small"
        );
    }
}
