//! Rewound clones (`--rewind`, docs/invoke.md "Rewound clones"): an invocation clone
//! that answered is put back in the state its template was cloned in, and serves
//! another request, instead of ending. A fresh clone's host process and KVM VM cost
//! most of an invocation's host CPU (the fork, the VM's creation and teardown, the
//! process's exit and copy-on-write faults: 2.1-2.3 of 3.3 ms for the tiny guest,
//! docs/invoke.md "Throughput"); a rewind keeps both and restores only what the request
//! changed:
//!
//! - **guest memory**: every page written since the clone was forked (by the guest,
//!   the VMM or KVM: `vstate::written`) is copied back from the template, which cannot
//!   change while it is paused, through its `/proc/self/mem` opened by the template
//!   before the fork (so no ptrace permission is asked of the clone);
//! - **the vCPUs**, from the state the clone was forked with; the VM-wide state
//!   (irqchip, PIT, clock) and the devices, made new at the next launch as in a warm
//!   clone;
//! - on a host with **shadow paging** (PVM, or KVM without EPT/NPT), KVM's shadow
//!   pages, when the copy rewrote a guest page table behind KVM's back: every memory
//!   slot is removed and registered again (`vstate::vm::reregister_memory`, about
//!   0.2 ms here, more under load: most of a rewind). Not needed when no page written
//!   holds a table reachable from the template's CR3s (`arch::x86_64::paging`, walked
//!   once per clone) and every vCPU's CR3 is the template's: a guest with one address
//!   space that maps nothing new in a request, as the tiny guest and a Linux guest whose
//!   request runs in the runtime's own process (the Python runtime's). A guest that ran
//!   another address space in a request, whose tables it wrote and which the template
//!   does not reach, could meet KVM's shadow of them again in a later request; the
//!   memory it maps is the template's again all the same (every written page was copied
//!   back), so no request's data reaches another, but that guest could misbehave (a
//!   Linux handler that starts a process does that: docs/invoke.md says so).
//!
//! Then the clone primes itself again when its template primes, tells its template it
//! is back on its go channel (a byte, [`BACK`]), and waits for its next launch as any
//! warm clone. A template that ran since the clone's fork (resumed, refreshed) has
//! other memory: the clone's copy may be torn, so the template ends the clone when it
//! comes back from an older generation (`warm.rs`).
//!
//! What a rewound clone shares with the requests before it: its host process (the VMM
//! heap and threads that served them) and its KVM VM. What it does not: guest memory,
//! vCPU and device state, all the template's again. docs/threat-model.md says what that
//! means for isolation.
//!
//! Two costs are kept off the next request: the pages written stay writable (copied
//! back at every rewind whether written again or not, up to [`HOT_BYTES`]), since a page
//! protected again costs the next request a fault on its first write; and the virtio
//! devices made at the next launch take the queue eventfds of those before them,
//! registered in the VM already (`DeviceManager::keep_queue_evts`), since removing an
//! ioeventfd from a VM and adding it again each waits for an SRCU grace period (3-5 ms
//! each here).
//!
//! A vsock device is made per launch as the other devices: its host socket is the
//! identity's (`<api_sock>.vsock`), bound when the launch's vCPUs run and removed when
//! the device goes at the end of the life (and by the template, which takes the
//! clone's record back as at an exit); its connections go with it, and the device made
//! at the next launch tells the guest, whose memory is the template's again, that
//! they are gone (a transport reset), as in any warm clone.
//!
//! Disk slots too: the images a request inserts are its identity's (a writable one
//! with an overlay of its own, an anonymous file), and the template's media are
//! opened again (a copy of the inherited descriptor) at each launch.
//!
//! With cgroup pools, a rewound clone keeps its cgroup (warm clones serve the first
//! class only, and sit in its cgroup already): its usage is counted per life
//! (`ClonePools::life_ended`), and since the pages earlier requests wrote stay its own
//! and charged, its memory limit is raised by them when it comes back, or it ends when
//! they pass its class's limit (`ClonePools::allow_kept`).
//!
//! A network card too: its tap (`fkvm<pid>`, or one the identity hands in) is opened
//! when the launch's devices are made and closed when they go at the end of the life,
//! which removes a tap the clone made, before the rewind; the card's MAC is the pid's,
//! the same in every life of a process (never two live clones').
//!
//! Not built yet: writable disks, and a template's writable medium in a slot (a
//! clone's copy of the template's overlay would have to be put back too: a clone forked
//! with one is not rewound): such a template's clones end as before, and it says why
//! once.

use std::collections::HashSet;
use std::fs::File;
use std::ops::Range;
use std::os::fd::{FromRawFd, RawFd};

use api_types::vm::HostKind;
use clone::MicrovmState;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::arch::x86_64::paging::table_pages;
use crate::builder::rebuild::Prepared;
use crate::logging::StageTimer;
use crate::microvm::{Kept, Microvm};
use crate::vstate::kvm::KvmContext;
use crate::vstate::vcpu::Vcpu;
use crate::vstate::vm::{reregister_memory, VmError};
use crate::vstate::written::{copy_back, WriteTracker, WrittenError};

/// What a rewound clone writes on its go channel once it is back in its template's
/// state (primed, when its template primes): it may be launched again.
pub(super) const BACK: u8 = 2;

/// What a clone to be rewound writes on its go channel when the life it served ended
/// (its sockets gone), before it rewinds: the template ends the request's record then,
/// rather than list the clone as running until it is back.
pub(super) const ENDED: u8 = 3;

/// Errors rewinding a clone (it ends instead).
#[derive(Debug, thiserror::Error)]
pub enum RewindError {
    /// Its written pages could not be found or copied back.
    #[error(transparent)]
    Memory(#[from] WrittenError),
    /// Its memory slots could not be registered again.
    #[error(transparent)]
    Slots(#[from] VmError),
    /// A vCPU thread was gone (it panicked).
    #[error("a vCPU thread ended on its own")]
    VcpuGone,
}

/// Why a template's clones cannot be rewound (they end as before), if they cannot.
pub fn unsupported(template: &Microvm) -> Option<&'static str> {
    let m = &template.config().machine;
    if m.disks.iter().any(|d| d.cow_dir.is_some()) {
        return Some("the VM has a writable disk (not built yet)");
    }
    None
}

/// The template's memory as its clones read it: its `/proc/self/mem`, opened by the
/// template itself (the check is at open), inherited by each clone.
pub(super) fn open_own_memory() -> std::io::Result<File> {
    File::open("/proc/self/mem")
}

/// Whether KVM maps guest memory with shadow pages here (PVM; KVM without EPT or NPT).
fn shadow_paging(host: HostKind) -> bool {
    let off =
        |path: &str| std::fs::read_to_string(path).is_ok_and(|v| matches!(v.trim(), "N" | "0"));
    host == HostKind::Pvm
        || off("/sys/module/kvm_intel/parameters/ept")
        || off("/sys/module/kvm_amd/parameters/npt")
}

/// A clone's means to rewind itself: its guest memory's writes tracked from its fork.
pub(super) struct Rewinder {
    tracker: WriteTracker,
    template_mem: File,
    /// Under shadow paging: the template's page-table pages (guest page numbers) and
    /// its vCPUs' CR3s; a rewind that rewrote none and finds every CR3 the same keeps
    /// KVM's shadow pages. None without shadow paging.
    shadow: Option<ShadowCheck>,
    /// Rewinds so far.
    pub count: u64,
    /// Of those, the ones that registered the memory slots again.
    pub zaps: u64,
}

/// What tells a rewind under shadow paging whether KVM's shadow pages still hold.
struct ShadowCheck {
    /// The guest pages holding the template's page tables; None: unknown (any page
    /// may be one).
    tables: Option<HashSet<u64>>,
    /// Each vCPU's CR3 in the template.
    cr3s: Vec<u64>,
}

impl ShadowCheck {
    fn of(mem: &GuestMemoryMmap, state: &MicrovmState) -> Self {
        let mut tables = Some(HashSet::new());
        for v in &state.vcpus {
            let found = table_pages(mem, &v.sregs);
            tables = tables.zip(found).map(|(mut all, t)| {
                all.extend(t);
                all
            });
        }
        Self {
            tables,
            cr3s: state.vcpus.iter().map(|v| v.sregs.cr3).collect(),
        }
    }

    /// Whether KVM's shadow pages must go: a page written (`written`, host ranges of
    /// `mem`) holds a template page table whose entries changed in more than their
    /// accessed and dirty bits (compared with the template's, read through
    /// `template_mem`), or a vCPU runs another CR3 now, or it cannot tell.
    ///
    /// Accessed and dirty bits alone do not stale a shadow page: KVM sets them in the
    /// guest's entries as the guest touches pages, and the copy back clears them again;
    /// every page whose dirty bit a request set was written, so its KVM mapping goes
    /// when it is protected again after the copy, and the guest's next write sets the
    /// bit anew. An accessed bit left clear is a hint the guest reads again later.
    fn must_zap(
        &self,
        template_mem: &File,
        mem: &GuestMemoryMmap,
        written: &[Range<usize>],
        vcpus: &[Vcpu],
    ) -> bool {
        let Some(tables) = &self.tables else {
            tracing::debug!("shadow pages dropped: the template's page tables are unknown");
            return true;
        };
        let moved = vcpus
            .iter()
            .zip(&self.cr3s)
            .any(|(v, &cr3)| v.cr3().map_or(true, |now| now != cr3));
        if moved {
            tracing::debug!("shadow pages dropped: a vCPU runs another CR3");
            return true;
        }
        for (host, gfn) in written_pages(mem, written) {
            let changed = match gfn {
                None => true,
                Some(g) if tables.contains(&g) => !same_but_accessed_dirty(template_mem, host),
                Some(_) => false,
            };
            if changed {
                tracing::debug!("shadow pages dropped: page table {gfn:x?} changed");
                return true;
            }
        }
        false
    }
}

impl ShadowCheck {
    /// The accessed and dirty bits of the entries of each template page-table page in
    /// `written` (host ranges of `mem`), to be set again after the copy back: with KVM's
    /// shadow pages kept and the page left writable, a dirty bit cleared would not be set
    /// again by the guest's next write (its mapping is writable already), and the guest
    /// would take a written page for a clean one. A bit set that the template had clear
    /// says no more than that the page was touched (it was, in the request before).
    fn accessed_dirty(
        &self,
        mem: &GuestMemoryMmap,
        written: &[Range<usize>],
    ) -> Vec<(usize, Vec<u64>)> {
        let Some(tables) = &self.tables else {
            return Vec::new();
        };
        written_pages(mem, written)
            .filter(|(_, gfn)| gfn.is_some_and(|g| tables.contains(&g)))
            .map(|(host, _)| {
                // SAFETY: a page of this clone's guest memory, mapped, not written
                // meanwhile (every vCPU thread and device is gone).
                let entries = unsafe { std::slice::from_raw_parts(host as *const u64, 512) };
                (host, entries.iter().map(|e| e & ACCESSED_DIRTY).collect())
            })
            .collect()
    }
}

/// Whether the page-table page at host address `host` (this clone's, not copied back
/// yet) has the same entries as the template's (read through `template_mem`) but for
/// their accessed and dirty bits.
fn same_but_accessed_dirty(template_mem: &File, host: usize) -> bool {
    use std::os::unix::fs::FileExt;
    let mut theirs = [0u8; 4096];
    if template_mem
        .read_exact_at(&mut theirs, host as u64)
        .is_err()
    {
        return false;
    }
    // SAFETY: `host` is a page of this clone's guest memory, mapped and not written
    // meanwhile (every vCPU thread and device is gone).
    let ours = unsafe { std::slice::from_raw_parts(host as *const u8, 4096) };
    let entries = |b: &[u8]| -> Vec<u64> {
        b.chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) & !ACCESSED_DIRTY)
            .collect()
    };
    entries(&theirs) == entries(ours)
}

/// The pages in host `ranges` of `mem`: each page's host address and guest page number
/// (None for a page outside it).
fn written_pages<'a>(
    mem: &'a GuestMemoryMmap,
    ranges: &'a [Range<usize>],
) -> impl Iterator<Item = (usize, Option<u64>)> + 'a {
    ranges.iter().flat_map(move |r| {
        (r.start..r.end).step_by(4096).map(move |host| {
            let gfn = mem.iter().find_map(|region| {
                let base = region
                    .get_host_address(vm_memory::MemoryRegionAddress(0))
                    .ok()? as usize;
                let offset = host
                    .checked_sub(base)
                    .filter(|&o| (o as u64) < region.len())?;
                Some((region.start_addr().0 + offset as u64) >> 12)
            });
            (host, gfn)
        })
    })
}

impl Rewinder {
    /// In a warm clone, before anything writes its guest memory: tracks writes to
    /// `mem`, to be copied back from the template's memory (`template_mem`, the
    /// inherited descriptor of [`open_own_memory`], owned from here on).
    pub fn new(
        template_mem: RawFd,
        mem: &GuestMemoryMmap,
        host: HostKind,
        state: &MicrovmState,
    ) -> Result<Self, RewindError> {
        // SAFETY: the template's memory descriptor, inherited and kept open by
        // close_all_but; its owner in this process (the parent's) is never dropped.
        let template_mem = unsafe { File::from_raw_fd(template_mem) };
        let ranges: Vec<Range<usize>> = mem
            .iter()
            .filter_map(|r| {
                let host = r.get_host_address(vm_memory::MemoryRegionAddress(0)).ok()?;
                Some(host as usize..host as usize + r.len() as usize)
            })
            .collect();
        let shadow = shadow_paging(host).then(|| ShadowCheck::of(mem, state));
        Ok(Self {
            tracker: WriteTracker::new(&ranges)?,
            template_mem,
            shadow,
            count: 0,
            zaps: 0,
        })
    }

    /// Puts the memory of `vm`, stopped after its invocation, back as the template's
    /// (its written pages copied back). Returns /dev/kvm and the VM, whose vCPUs the
    /// next preparation restores (`builder::rebuild::prepare_or_reuse`).
    pub fn rewind(
        &mut self,
        vm: Microvm,
        marks: &mut StageTimer,
    ) -> Result<(KvmContext, Prepared, RewoundPages), RewindError> {
        let Kept {
            vm,
            vcpus,
            mem,
            kvm,
            queue_evts,
        } = vm.into_kept().ok_or(RewindError::VcpuGone)?;
        marks.done("stopped");
        let written = self.tracker.written()?;
        marks.done("scanned");
        // Before the copy: it compares the page tables written with the template's, and
        // keeps their entries' accessed and dirty bits.
        let shadow = self.shadow.as_ref();
        let zap = shadow.is_some_and(|s| s.must_zap(&self.template_mem, &mem, &written, &vcpus));
        let bits = shadow.map(|s| s.accessed_dirty(&mem, &written));
        // SAFETY: the ranges are this clone's guest memory, and every vCPU thread and
        // device is gone: nothing else uses it.
        let bytes = unsafe { copy_back(&self.template_mem, &written, 0) }?;
        if let Some(bits) = bits {
            // SAFETY: as above.
            unsafe { put_accessed_dirty(&bits) };
        }
        // Written pages stay unprotected (copied back at every rewind whether written
        // again or not), up to HOT_BYTES: a page protected again costs the next request
        // a fault on its first write to it (for the Python no-op, about 100 pages: 2 ms
        // of a 3 ms request here; for a handler that allocates 32 MiB, 8,500 pages:
        // 92 ms against 5 ms, where copying them back takes 12-14 ms off the request's
        // path). Past it, every written page is protected again, and the next rewind
        // learns which the requests write.
        if bytes > HOT_BYTES {
            for r in &written {
                self.tracker.protect(r)?;
            }
        }
        marks.done("copied back");
        if zap {
            reregister_memory(&vm, &mem)?;
            self.zaps += 1;
            marks.done("slots");
        }
        self.count += 1;
        let pages = RewoundPages {
            ranges: written.len(),
            bytes,
        };
        let prepared = Prepared {
            vm,
            vcpus,
            skipped_msrs: Vec::new(),
            queue_evts,
        };
        Ok((kvm, prepared, pages))
    }
}

/// How many bytes of written guest memory a clone leaves unprotected (copied back at
/// every rewind): past it, every written page is protected again. A page copied back
/// cost about a sixth of a first write's fault on the PVM host (1.6 against about
/// 10 us, a handler that writes 32 MiB), so a request's working set is kept up to a
/// size whose copy stays short beside the request that wrote it (64 MiB: about 25 ms
/// there).
const HOT_BYTES: usize = 64 << 20;

/// Accessed and dirty bits of a page table's entries.
const ACCESSED_DIRTY: u64 = (1 << 5) | (1 << 6);

/// Sets again, in each page-table page (host address) copied back, the accessed and
/// dirty bits its entries had before the copy.
///
/// # Safety
/// Each address is a page of this clone's guest memory that nothing else uses.
unsafe fn put_accessed_dirty(pages: &[(usize, Vec<u64>)]) {
    for (host, bits) in pages {
        // SAFETY: the caller's guarantee; the page is 4 KiB, aligned.
        let entries = unsafe { std::slice::from_raw_parts_mut(*host as *mut u64, 512) };
        for (e, b) in entries.iter_mut().zip(bits) {
            *e |= b;
        }
    }
}

/// What a rewind copied back.
#[derive(Debug, Clone, Copy)]
pub(super) struct RewoundPages {
    /// Ranges of adjacent written pages.
    pub ranges: usize,
    /// Bytes copied.
    pub bytes: usize,
}
