//! The live clones of a whole tree (an original VM, its clones, their clones, ...),
//! bounded by `--max-tree-clones`. `--max-clones` bounds each VM's own clones, and each
//! clone has its own: without this a guest whose every clone asks for clones would grow
//! the tree geometrically.
//!
//! The original VM maps one shared page range ([`Slots`]); every clone inherits it with
//! fork, so all the tree's processes see the same slots. A slot holds the pid of a live
//! clone, or the pid of a VM that reserved it for a clone it is making, with
//! [`RESERVED`] set; 0 is free. The parent frees a clone's slot when it reaps it. A
//! clone that outlived its parent is killed with it (`PR_SET_PDEATHSIG`) and reaped by
//! someone else: its slot is freed by the next VM that finds the tree full and the pid
//! gone ([`Slots::sweep`]). A pid reused by another process before that keeps its slot
//! taken until that process ends too: the bound errs on the side of fewer clones.

use std::num::NonZeroUsize;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

use nix::errno::Errno;
use nix::sys::mman::{mmap_anonymous, MapFlags, ProtFlags};
use nix::sys::signal::kill;
use nix::unistd::Pid;

/// A slot reserved by the VM whose pid is in the other bits, for a clone it is making.
pub const RESERVED: u32 = 1 << 31;

/// The tree is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "{live} clones are running in this VM's tree (the original VM's clones, theirs, ...); \
     at most {max} may be (--max-tree-clones)"
)]
pub struct TreeFull {
    /// Live or reserved slots when the request came.
    pub live: usize,
    /// The tree's limit.
    pub max: usize,
}

/// One slot per clone the tree may have, in memory every process of the tree shares.
#[derive(Debug)]
pub struct Slots {
    base: NonNull<AtomicU32>,
    len: usize,
}

// SAFETY: the slots are atomics in a mapping that lives as long as the process (never
// unmapped); any thread may use them.
unsafe impl Send for Slots {}
// SAFETY: as above: every access is atomic.
unsafe impl Sync for Slots {}

impl Slots {
    /// `len` free slots in a new shared anonymous mapping (zeroed by the kernel). It is
    /// never unmapped: it lives as long as the process, and in every clone forked.
    pub fn new(len: usize) -> std::io::Result<Self> {
        let bytes = NonZeroUsize::new(len.max(1) * std::mem::size_of::<AtomicU32>())
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: a new anonymous mapping at an address the kernel picks; it replaces
        // nothing.
        let base = unsafe {
            mmap_anonymous(
                None,
                bytes,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
            )
        }?;
        Ok(Self {
            base: base.cast(),
            len,
        })
    }

    fn slots(&self) -> &[AtomicU32] {
        // SAFETY: `len` zero-initialized u32s, mapped for the life of the process and
        // only ever accessed atomically.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr(), self.len) }
    }

    /// Slots taken (live clones and reservations).
    pub fn taken(&self) -> usize {
        let taken = self.slots().iter();
        taken.filter(|s| s.load(Ordering::Relaxed) != 0).count()
    }

    /// Reserves `n` slots for clones `me` is making: all of them or none. When too few
    /// are free, the slots of clones that are gone are freed first.
    pub fn reserve(&self, n: usize, me: u32) -> Result<Reservation<'_>, TreeFull> {
        let mut held = Reservation {
            slots: self,
            at: Vec::with_capacity(n),
            mark: RESERVED | me,
        };
        for swept in [false, true] {
            if swept && self.sweep() == 0 {
                break;
            }
            for (i, s) in self.slots().iter().enumerate() {
                if held.at.len() == n {
                    return Ok(held);
                }
                let free = s.load(Ordering::Relaxed) == 0;
                if free
                    && s.compare_exchange(0, held.mark, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                {
                    held.at.push(i);
                }
            }
            if held.at.len() == n {
                return Ok(held);
            }
        }
        let live = self.taken() - held.at.len();
        Err(TreeFull {
            live,
            max: self.len,
        })
    }

    /// Frees the slot of clone `pid` (its parent reaped it); false if none is its.
    pub fn release(&self, pid: u32) -> bool {
        let slot = self
            .slots()
            .iter()
            .find(|s| s.load(Ordering::Relaxed) == pid);
        slot.is_some_and(|s| {
            s.compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })
    }

    /// Frees every slot whose process (a clone, or a VM that reserved it) is gone;
    /// returns how many.
    pub fn sweep(&self) -> usize {
        let mut freed = 0;
        for s in self.slots() {
            let v = s.load(Ordering::Relaxed);
            let pid = v & !RESERVED;
            if pid == 0 || kill(Pid::from_raw(pid as i32), None) != Err(Errno::ESRCH) {
                continue;
            }
            if s.compare_exchange(v, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                freed += 1;
            }
        }
        freed
    }
}

/// Slots reserved for the clones of one request: each becomes its clone's with
/// [`Reservation::assign`]; those not assigned are freed when it drops (the request
/// failed).
#[derive(Debug)]
pub struct Reservation<'a> {
    slots: &'a Slots,
    at: Vec<usize>,
    mark: u32,
}

impl Reservation<'_> {
    /// The clones were made: their pids take the reserved slots (one each, in order;
    /// slots left over are freed).
    pub fn assign(mut self, pids: impl IntoIterator<Item = u32>) {
        let all = self.slots.slots();
        let mut pids = pids.into_iter();
        self.at.retain(|&at| match pids.next() {
            Some(pid) => {
                all[at].store(pid, Ordering::Release);
                false
            }
            None => true,
        });
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let all = self.slots.slots();
        for &at in &self.at {
            let _ = all[at].compare_exchange(self.mark, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }
}

/// This process's tree: made by the original VM ([`init`]), inherited by its clones.
static TREE: OnceLock<Slots> = OnceLock::new();

/// Makes this process's tree with `max` slots, unless it has one (a clone has its
/// original's; each VMM process serves one VM).
pub fn init(max: usize) -> std::io::Result<()> {
    if TREE.get().is_none() {
        let _ = TREE.set(Slots::new(max)?);
    }
    Ok(())
}

/// Reserves `n` slots of this process's tree for clones it is making (None without a
/// tree: a VM built without [`init`], as in unit tests).
pub fn reserve(n: usize) -> Result<Option<Reservation<'static>>, TreeFull> {
    let me = std::process::id();
    TREE.get().map(|t| t.reserve(n, me)).transpose()
}

/// The tree's figures for `GET /vm` (zeros without a tree).
pub fn report() -> api_types::vm::TreeReport {
    TREE.get()
        .map(|t| api_types::vm::TreeReport {
            taken: t.taken(),
            max: t.len,
        })
        .unwrap_or_default()
}

/// Frees the slot of clone `pid`, which this process reaped.
pub fn release(pid: i32) {
    if let Some(t) = TREE.get() {
        t.release(pid as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_tree_refuses_and_a_freed_slot_serves_again() {
        let slots = Slots::new(3).unwrap();
        let me = std::process::id();
        let two = slots.reserve(2, me).unwrap();
        assert_eq!(slots.taken(), 2);
        // The live pids of this process's threads stand in for clones.
        two.assign([me, me]);
        assert_eq!(
            slots.reserve(2, me).unwrap_err(),
            TreeFull { live: 2, max: 3 }
        );
        assert_eq!(slots.taken(), 2, "a refused request holds nothing");
        let one = slots.reserve(1, me).unwrap();
        drop(one);
        assert_eq!(slots.taken(), 2, "an unassigned reservation is freed");
        assert!(slots.release(me));
        assert_eq!(slots.taken(), 1);
        assert!(!slots.release(12345678), "no slot is that pid's");
        slots.reserve(2, me).unwrap().assign([me, me]);
        assert_eq!(slots.taken(), 3);
    }

    #[test]
    fn slots_of_processes_that_are_gone_are_swept_when_the_tree_is_full() {
        let slots = Slots::new(2).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let me = std::process::id();
        slots.reserve(2, me).unwrap().assign([gone, me]);
        // One slot is a gone pid's: freed, and taken again.
        let again = slots.reserve(1, me).unwrap();
        assert_eq!(slots.taken(), 2);
        drop(again);
        assert_eq!(slots.sweep(), 0, "live pids and free slots stay");
        assert_eq!(
            slots.reserve(2, me).unwrap_err(),
            TreeFull { live: 1, max: 2 }
        );
    }

    #[test]
    fn a_forked_child_shares_the_slots() {
        let slots = Slots::new(4).unwrap();
        // SAFETY: the child only touches the atomics and exits with _exit.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                let r = slots.reserve(3, std::process::id());
                let code = match r {
                    Ok(r) => {
                        r.assign([1, 2, 3]);
                        0
                    }
                    Err(_) => 1,
                };
                // SAFETY: _exit has no preconditions.
                unsafe { libc::_exit(code) }
            }
            nix::unistd::ForkResult::Parent { child } => {
                let status = nix::sys::wait::waitpid(child, None).unwrap();
                assert_eq!(status, nix::sys::wait::WaitStatus::Exited(child, 0));
            }
        }
        assert_eq!(
            slots.taken(),
            3,
            "the child's clones are in the parent's view"
        );
    }
}
