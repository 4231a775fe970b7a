//! A request written into the mailbox: its header (fresh entropy, the VM's sequence)
//! and its payload.

use devices::mailbox::{
    write_request, MailboxWindow, ReplyError, RequestHeader, ENTROPY_BYTES, FLAG_ADOPT_NET,
    FLAG_KEEP_ALIVE, KIND_INVOKE, KIND_LOAD, KIND_PRIME,
};
use vm_memory::GuestMemoryMmap;

use super::Delivery;

/// Writes `payload` and a request header (fresh entropy, this VM's `sequence`) into
/// the mailbox; the payload goes on with the bytes in place after it (`in_place` of
/// them, read there by the caller).
pub(super) fn write(
    mem: &GuestMemoryMmap,
    window: MailboxWindow,
    d: &Delivery,
    sequence: u64,
    (payload, in_place): (&[u8], usize),
) -> Result<(), ReplyError> {
    let flags = if d.keep_alive { FLAG_KEEP_ALIVE } else { 0 }
        | if d.adopt_net { FLAG_ADOPT_NET } else { 0 };
    let kind = if d.derive { KIND_LOAD } else { KIND_INVOKE };
    let payload = (payload, in_place);
    write_header(mem, window, kind, flags, (sequence, d.timeout_ms), payload)
}

/// Writes a prime request (sequence 0) into the mailbox of a warm clone about to be
/// primed (`cloning::prime`); `timeout_ms` is the prime's time limit, `pages` its
/// payload (`cloning::working::prime_pages`: pages for the runtime to map; may be empty).
pub fn write_prime(
    mem: &GuestMemoryMmap,
    window: MailboxWindow,
    timeout_ms: u64,
    pages: &[u8],
) -> Result<(), ReplyError> {
    write_header(mem, window, KIND_PRIME, 0, (0, timeout_ms), (pages, 0))
}

fn write_header(
    mem: &GuestMemoryMmap,
    window: MailboxWindow,
    kind: u16,
    flags: u32,
    (sequence, timeout_ms): (u64, u64),
    (payload, in_place): (&[u8], usize),
) -> Result<(), ReplyError> {
    let mut entropy = [0u8; ENTROPY_BYTES];
    devices::util::host_random(&mut entropy).map_err(|e| ReplyError::Memory(e.to_string()))?;
    let header = RequestHeader {
        kind,
        flags,
        length: u32::try_from(payload.len() + in_place).unwrap_or(u32::MAX),
        sequence,
        timeout_ms: u32::try_from(timeout_ms).unwrap_or(u32::MAX),
        entropy,
    };
    write_request(mem, window, &header, payload)
}
