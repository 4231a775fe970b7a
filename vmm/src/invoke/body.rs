//! A finished invocation's body: text the VMM holds (an error it found), or the
//! runtime's reply (or its handler's error text) left where it wrote it, in the
//! mailbox, and written from there to the caller.
//!
//! A reply is read once, when its caller is answered: copying it out of the mailbox
//! first took a buffer as large as the reply, and in a clone every page of a new
//! buffer is a page fault (a 1 MiB reply: 256 of them, about 1 ms on the PVM host,
//! docs/invoke.md). The runtime's vCPU stays parked until its caller is answered
//! (`controller`), so the mailbox holds the reply until then.

use std::borrow::Cow;
use std::io::Write;
use std::os::unix::net::UnixStream;

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// What a finished invocation answers with.
#[derive(Debug)]
pub enum Body {
    /// Bytes the VMM holds: the text of an error the VMM found.
    Held(Vec<u8>),
    /// The runtime's reply (or its handler's error text), `len` bytes at `at` in
    /// `mem`'s mailbox, read when the caller is answered.
    Mailbox {
        /// The VM's memory.
        mem: GuestMemoryMmap,
        /// Where the reply starts.
        at: GuestAddress,
        /// Its length.
        len: usize,
    },
}

impl Body {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Self::Held(b) => b.len(),
            Self::Mailbox { len, .. } => *len,
        }
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its bytes (a reply copied out of the mailbox; empty if that read fails, which
    /// cannot happen for a reply whose header was checked against the mailbox).
    pub fn bytes(&self) -> Cow<'_, [u8]> {
        match self {
            Self::Held(b) => Cow::Borrowed(b),
            Self::Mailbox { mem, at, len } => {
                let mut out = vec![0u8; *len];
                match mem.read_slice(&mut out, *at) {
                    Ok(()) => Cow::Owned(out),
                    Err(_) => Cow::Owned(Vec::new()),
                }
            }
        }
    }

    /// Writes it to `w`, from the mailbox for a reply there.
    pub fn write_to(&self, w: &mut &UnixStream) -> std::io::Result<()> {
        match self {
            Self::Held(b) => w.write_all(b),
            Self::Mailbox { mem, at, len } => mem
                .write_all_volatile_to(*at, w, *len)
                .map_err(|e| std::io::Error::other(e.to_string())),
        }
    }
}

impl From<Vec<u8>> for Body {
    fn from(b: Vec<u8>) -> Self {
        Self::Held(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn a_reply_in_memory_is_written_from_there_and_read_as_held_bytes_are() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let reply: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        mem.write_slice(&reply, GuestAddress(4096)).unwrap();
        let body = Body::Mailbox {
            mem,
            at: GuestAddress(4096),
            len: reply.len(),
        };
        assert_eq!(body.len(), reply.len());
        assert_eq!(&body.bytes()[..], &reply[..]);
        let (a, mut b) = UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || body.write_to(&mut &a));
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();
        writer.join().unwrap().unwrap();
        assert_eq!(got, reply);
        let held = Body::from(b"text".to_vec());
        assert_eq!(
            (&held.bytes()[..], held.len(), held.is_empty()),
            (&b"text"[..], 4, false)
        );
    }
}
