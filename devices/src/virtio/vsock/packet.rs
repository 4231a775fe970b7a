//! The virtio-vsock packet header and its constants (virtio 1.2, 5.10.6).

use vm_memory::ByteValued;

/// The host's CID.
pub const HOST_CID: u64 = 2;

pub(crate) const TYPE_STREAM: u16 = 1;
pub(crate) const OP_REQUEST: u16 = 1;
pub(crate) const OP_RESPONSE: u16 = 2;
pub(crate) const OP_RST: u16 = 3;
pub(crate) const OP_SHUTDOWN: u16 = 4;
pub(crate) const OP_RW: u16 = 5;
pub(crate) const OP_CREDIT_UPDATE: u16 = 6;
pub(crate) const OP_CREDIT_REQUEST: u16 = 7;
/// SHUTDOWN flag: the sender will receive no more.
pub(crate) const SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more.
pub(crate) const SHUTDOWN_SEND: u32 = 2;
/// Event id: the transport was reset (all connections are gone).
pub(crate) const EVENT_TRANSPORT_RESET: u32 = 0;

/// struct virtio_vsock_hdr (little endian, packed, 44 bytes).
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
#[repr(C, packed)]
pub(crate) struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}
// SAFETY: packed plain old data (integers only, no padding), valid for any bit pattern.
unsafe impl ByteValued for Header {}

pub(crate) const HEADER_LEN: usize = std::mem::size_of::<Header>();

const _: () = assert!(HEADER_LEN == 44);

/// A packet for the guest: header and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Packet {
    pub hdr: Header,
    pub data: Vec<u8>,
}
