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
//!   pages: the copy rewrote guest page tables behind KVM's back, so every memory slot
//!   is removed and registered again (`vstate::vm::reregister_memory`).
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
//! means for isolation. Not built yet: VMs with virtio devices (their ioeventfds would
//! have to be removed from the VM before the next launch adds them again) and cgroup
//! pools (the clone's cgroup would have to be given back and taken again): their
//! clones end as before.

use std::fs::File;
use std::ops::Range;
use std::os::fd::{FromRawFd, RawFd};

use api_types::vm::HostKind;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::builder::rebuild::Prepared;
use crate::microvm::{Kept, Microvm};
use crate::vstate::kvm::KvmContext;
use crate::vstate::vm::{reregister_memory, VmError};
use crate::vstate::written::{copy_back, WriteTracker, WrittenError};

/// What a rewound clone writes on its go channel once it is back in its template's
/// state (primed, when its template primes): it may be launched again.
pub(super) const BACK: u8 = 2;

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
pub fn unsupported(template: &Microvm, cgroup_pools: bool) -> Option<&'static str> {
    if template.devices().has_virtio() {
        return Some("the VM has virtio devices (not built yet)");
    }
    if cgroup_pools {
        return Some("the template has cgroup pools (not built yet)");
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
    shadow: bool,
    /// Rewinds so far.
    pub count: u64,
}

impl Rewinder {
    /// In a warm clone, before anything writes its guest memory: tracks writes to
    /// `mem`, to be copied back from the template's memory (`template_mem`, the
    /// inherited descriptor of [`open_own_memory`], owned from here on).
    pub fn new(
        template_mem: RawFd,
        mem: &GuestMemoryMmap,
        host: HostKind,
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
        Ok(Self {
            tracker: WriteTracker::new(&ranges)?,
            template_mem,
            shadow: shadow_paging(host),
            count: 0,
        })
    }

    /// Puts the memory of `vm`, stopped after its invocation, back as the template's
    /// (its written pages copied back). Returns /dev/kvm and the VM, whose vCPUs the
    /// next preparation restores (`builder::rebuild::prepare_or_reuse`).
    pub fn rewind(
        &mut self,
        vm: Microvm,
    ) -> Result<(KvmContext, Prepared, RewoundPages), RewindError> {
        let Kept {
            vm,
            vcpus,
            mem,
            kvm,
        } = vm.into_kept().ok_or(RewindError::VcpuGone)?;
        let written = self.tracker.written()?;
        // SAFETY: the ranges are this clone's guest memory, and every vCPU thread and
        // device is gone: nothing else uses it.
        let bytes = unsafe { copy_back(&self.template_mem, &written, 0) }?;
        for r in &written {
            self.tracker.protect(r)?;
        }
        if self.shadow {
            reregister_memory(&vm, &mem)?;
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
        };
        Ok((kvm, prepared, pages))
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
