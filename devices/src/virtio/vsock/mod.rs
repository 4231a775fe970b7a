//! virtio-vsock (stream sockets between the guest and the host), with the host side over
//! Unix sockets.
//!
//! - **Host to guest**: the host connects to the VM's socket path and writes
//!   `CONNECT <port>\n`; once a guest program listening on that vsock port accepts, the
//!   host reads `OK <host port>\n` and the stream carries the connection. If nothing
//!   listens, the host's connection is closed.
//! - **Guest to host**: a guest connection to host CID 2, port P, reaches the Unix
//!   socket `<path>_<P>`, which a host program listens on. A program that does not
//!   listen, or whose backlog is full, refuses the guest at once.
//! - **Clones**: each clone's device listens on its own path. A restored device starts
//!   with no connections and first sends the guest a transport-reset event, so the
//!   guest drops the connections it had at the clone point (they belong to the parent);
//!   its listening sockets keep working.

mod muxer;
mod packet;

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;

use super::worker::QueueHandler;
use super::{ActivateError, VirtioDevice, VirtioDeviceState, VirtioInterrupt, VIRTIO_F_VERSION_1};
use crate::persist::Persist;

pub use packet::HOST_CID;

/// virtio device id of a socket device.
pub const TYPE_VSOCK: u32 = virtio_bindings::virtio_ids::VIRTIO_ID_VSOCK;
const QUEUE_SIZE: u16 = 256;
/// Lowest guest CID (0-2 are reserved).
pub const MIN_GUEST_CID: u64 = 3;

/// Errors creating the device.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    /// The CID is reserved or too large.
    #[error("vsock CID {0} is invalid: use {MIN_GUEST_CID} to {max}", max = u32::MAX - 1)]
    Cid(u64),
    /// The host socket could not be made.
    #[error("cannot listen on vsock socket {path}: {source}")]
    Listen {
        /// The path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// The vsock device.
pub struct Vsock {
    cid: u64,
    path: PathBuf,
    /// None until the host socket is bound ([`Vsock::deferred`]).
    listener: Option<UnixListener>,
    /// A clone's device: tell the driver its connections are gone.
    restored: bool,
    queue_sizes: [u16; 3],
    /// The host-side port of the next host connection (its worker's, saved).
    next_local_port: Arc<AtomicU32>,
}

impl Vsock {
    /// A device with guest CID `cid` whose host side listens on `path` (a stale socket
    /// file there is replaced). `restored` marks a clone's device.
    pub fn new(cid: u64, path: &Path, restored: bool) -> Result<Self, VsockError> {
        let mut v = Self::deferred(cid, path, restored)?;
        v.listener = Some(v.listen()?);
        Ok(v)
    }

    /// As [`Vsock::new`], but the host socket is bound later, by
    /// [`VirtioDevice::open_host`] or on activation. The CID is checked now.
    pub fn deferred(cid: u64, path: &Path, restored: bool) -> Result<Self, VsockError> {
        if !(MIN_GUEST_CID..u64::from(u32::MAX)).contains(&cid) {
            return Err(VsockError::Cid(cid));
        }
        Ok(Self {
            cid,
            path: path.to_path_buf(),
            listener: None,
            restored,
            queue_sizes: [QUEUE_SIZE; 3],
            next_local_port: Arc::new(AtomicU32::new(muxer::FIRST_LOCAL_PORT)),
        })
    }

    fn listen(&self) -> Result<UnixListener, VsockError> {
        let listen_err = |source| VsockError::Listen {
            path: self.path.display().to_string(),
            source,
        };
        match std::fs::remove_file(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(listen_err(e)),
        }
        let listener = UnixListener::bind(&self.path).map_err(listen_err)?;
        listener.set_nonblocking(true).map_err(listen_err)?;
        Ok(listener)
    }

    /// The host socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        if self.listener.is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The socket device's own state: the guest's CID. Connections are not carried: a
/// restored device tells the driver they are gone (a transport reset), and its host
/// socket is the new VM's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    /// The guest's CID.
    pub cid: u64,
    /// The host-side port the next host connection takes (a clone's first connection
    /// must not take the port of one its parent just closed: the guest's socket for it
    /// may still be closing, and would answer the new request with a reset).
    #[serde(default = "first_local_port")]
    pub next_local_port: u32,
}

fn first_local_port() -> u32 {
    muxer::FIRST_LOCAL_PORT
}

impl Persist for Vsock {
    type State = VsockState;
    /// The new VM's host socket path (bound later, by `open_host`).
    type ConstructorArgs = PathBuf;
    type Error = VsockError;

    fn save(&self) -> VsockState {
        VsockState {
            cid: self.cid,
            next_local_port: self.next_local_port.load(Ordering::Relaxed),
        }
    }

    fn restore(path: PathBuf, state: &VsockState) -> Result<Self, VsockError> {
        let v = Self::deferred(state.cid, &path, true)?;
        v.next_local_port
            .store(state.next_local_port, Ordering::Relaxed);
        Ok(v)
    }
}

impl VirtioDevice for Vsock {
    fn state(&self) -> VirtioDeviceState {
        VirtioDeviceState::Vsock(self.save())
    }

    fn name(&self) -> &'static str {
        "virtio-vsock"
    }

    fn device_type(&self) -> u32 {
        TYPE_VSOCK
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // guest_cid (le64) at offset 0.
        super::read_u64_config(self.cid, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::debug!("virtio-vsock: guest wrote read-only config at {offset:#x}");
    }

    fn open_host(&mut self) -> Result<(), ActivateError> {
        if self.listener.is_none() {
            let listener = self.listen().map_err(|e| ActivateError::Host {
                device: "virtio-vsock",
                source: e.into(),
            })?;
            self.listener = Some(listener);
        }
        Ok(())
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        _acked_features: u64,
        queues: Vec<Queue>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Result<Box<dyn QueueHandler>, ActivateError> {
        let [rx, tx, event]: [Queue; 3] = queues
            .try_into()
            .map_err(|_| ActivateError::BadQueue("virtio-vsock needs three queues".into()))?;
        self.open_host()?;
        let listener = self
            .listener
            .as_ref()
            .ok_or_else(|| ActivateError::BadQueue("virtio-vsock has no host socket".into()))?
            .try_clone()
            .map_err(|e| super::WorkerError::Spawn("virtio-vsock", e))?;
        Ok(Box::new(muxer::Muxer::new(
            self.cid,
            self.path.clone(),
            listener,
            mem,
            [rx, tx, event],
            interrupt,
            // Only the first activation of a clone's device reports the reset.
            (
                std::mem::take(&mut self.restored),
                self.next_local_port.clone(),
            ),
        )))
    }
}

/// The worker over a fuzzer's memory and queues (the fuzzing module's rig): guest CID 3, host
/// side on `listener` at `path`.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_worker(
    path: PathBuf,
    listener: UnixListener,
    mem: GuestMemoryMmap,
    queues: [Queue; 3],
    interrupt: Arc<VirtioInterrupt>,
    restored: bool,
) -> impl QueueHandler {
    muxer::Muxer::new(
        MIN_GUEST_CID,
        path,
        listener,
        mem,
        queues,
        interrupt,
        (restored, Arc::new(AtomicU32::new(muxer::FIRST_LOCAL_PORT))),
    )
}

#[cfg(test)]
mod tests;
