//! Primed warm clones: a warm clone of a ready template runs its runtime's serving path
//! once, before its request comes (docs/invoke.md, "Primed warm clones"). Cloning runs
//! it through its `prime` hook ([`prime`]).
//!
//! A clone's VM is new: KVM knows none of its guest's mappings (its shadow page tables,
//! or EPT on hardware), and none of the guest memory the clone writes has been copied
//! for it yet. The first time the runtime's code and data are touched in the clone,
//! each page costs a fault (on this PVM host about 440 faults, 2 ms, for a Python no-op
//! handler: most of its time). A prime pays them ahead: the warm clone restores its
//! vCPUs with the clocks moved on to now, writes a prime request (no payload) into its
//! mailbox and runs only the runtime's vCPU until the runtime has replied and waits
//! again; the handler is not called. The request then finds the path mapped.
//!
//! Only a runtime that says it handles prime requests (in the wait header it leaves
//! in the mailbox, `devices::mailbox::runtime_features`) is primed. The clone has no
//! devices and no identity yet: the runtime's vCPU may only answer and wait again;
//! anything else (another port, MMIO, a halt), or [`PRIME_LIMIT`] passing, ends the
//! warm clone, and its template primes no more (`cloning/warm.rs`). Its guest kernel's RNG is
//! reseeded at launch as in any clone, after the prime; a prime that stopped inside
//! the kernel's CRNG key code fails too.

use std::time::Duration;

use clone::MicrovmState;
use devices::mailbox::{read_reply, ReplyStatus};

use super::{write_prime, InvokeError};
use crate::builder::rebuild::{prepare_or_reuse, Prepared, RebuildError};
use crate::cloning::PrimeFailure;
use crate::microvm::Microvm;
use crate::vstate::kvm::KvmContext;
use crate::vstate::vcpu::{monotonic_ns, PrimeError};

/// How long a prime may take.
pub const PRIME_LIMIT: Duration = Duration::from_millis(500);

/// How far the runtime vCPU's timer interrupt is deferred for its prime: past
/// [`PRIME_LIMIT`], so that the prime never takes it. A prime that waits for a host CPU
/// longer than the request's deferral (`--tick-defer-ms`, wall-clock time here) would
/// otherwise meet the interrupt and the guest kernel's catch-up on all the time since
/// the template paused, which under shadow paging is tens of milliseconds of emulated
/// kernel work that makes the prime wait longer still: with 8 warm clones priming at
/// once on 2 cores, primes took 24 ms at the median and 424 ms at p90, some failing at
/// the limit (7.8 and 16.8 ms with this deferral). The primed state gets the
/// template's deadline back afterwards.
const PRIME_DEFER: Duration = Duration::from_millis(1_000);

/// Why a prime failed (the warm clone ends).
#[derive(Debug, thiserror::Error)]
pub enum PrimeFailed {
    /// The VM could not be rebuilt for it.
    #[error(transparent)]
    Rebuild(#[from] RebuildError),
    /// The VM-wide state could not be restored.
    #[error(transparent)]
    VmState(#[from] clone::vm::VmStateError),
    /// The prime request could not be written.
    #[error(transparent)]
    Invoke(#[from] InvokeError),
    /// The runtime's vCPU did not answer and wait again.
    #[error(transparent)]
    Run(#[from] PrimeError),
}

/// Primes a warm clone of `template`, captured as `template_state`, on vCPU `vcpu`,
/// where the template's runtime waits (cloning's `prime` hook). Returns the state the
/// clone is to be launched from (the template's, with that vCPU's as the prime left it)
/// and its VM, prepared and primed (`reuse`, a rewound clone's VM, or a new one).
pub fn prime(
    kvm: &KvmContext,
    template: &Microvm,
    template_state: &MicrovmState,
    vcpu: u8,
    reuse: Option<Prepared>,
    pages: &[u8],
) -> Result<(MicrovmState, Prepared), PrimeFailure> {
    primed(kvm, template, template_state, vcpu, reuse, pages).map_err(|e| PrimeFailure {
        timed_out: matches!(e, PrimeFailed::Run(PrimeError::Timeout(_))),
        error: Box::new(e),
    })
}

fn primed(
    kvm: &KvmContext,
    template: &Microvm,
    template_state: &MicrovmState,
    vcpu: u8,
    reuse: Option<Prepared>,
    pages: &[u8],
) -> Result<(MicrovmState, Prepared), PrimeFailed> {
    let config = template.config();
    let mem = template.memory();
    let index = (template_state.vcpus.iter().position(|v| v.id == vcpu))
        .ok_or_else(|| PrimeError::Left(format!("no vCPU {vcpu} in the template")))?;
    // The clocks moved on to now, a timer interrupt due deferred as for a request (the
    // runtime's vCPU's past the prime's limit: see PRIME_DEFER), the runtime's read
    // returning the prime request's length (its payload's: the pages to map).
    let mut now = template_state.clone();
    now.advance_clocks(monotonic_ns().saturating_sub(now.captured_at_ns));
    if config.invoke.tick_defer_ns() > 0 {
        for v in &mut now.vcpus {
            v.defer_timer(config.invoke.tick_defer_ns());
        }
    }
    now.vcpus[index].defer_timer(PRIME_DEFER.as_nanos() as u64);
    let deferred_to = now.vcpus[index].timer_deadline();
    // Pages to map that do not fit the mailbox are left out (whole runs of 16 bytes):
    // a request larger than it would fail the prime.
    let window = template.mailbox();
    let pages = &pages[..pages.len().min(window.capacity() / 16 * 16)];
    now.vcpus[index].regs.rax = pages.len() as u64;
    let mut prepared = prepare_or_reuse(kvm, &now, mem, window, reuse)?;
    clone::vm::restore_vm(&prepared.vm, &now.vm)?;
    write_prime(mem, window, PRIME_LIMIT.as_millis() as u64, pages).map_err(InvokeError::from)?;
    // A runtime that fails its prime would fail requests the same way: not primed.
    let reply_mem = mem.clone();
    let check = move |length| match read_reply(&reply_mem, window, length) {
        Ok((h, _)) if h.status == ReplyStatus::Ok => Ok(()),
        Ok((_, text)) => Err(format!(
            "it answered with an error: {}",
            String::from_utf8_lossy(&text)
        )),
        Err(e) => Err(format!("a bad reply: {e}")),
    };
    let runtime = prepared.vcpus.remove(index).prime(PRIME_LIMIT, check)?;
    let crng = template.devices().crng.registration.layout();
    if crng.is_some_and(|l| l.busy(mem)) {
        let why = "it stopped inside the guest kernel's CRNG key code";
        return Err(PrimeError::Left(why.into()).into());
    }
    let (mut primed, _) = (runtime.save(template.capture_spec()))
        .map_err(|e| PrimeError::Left(format!("cannot save its vCPU: {e}")))?;
    prepared.vcpus.insert(index, runtime);
    // Its timer as the template's, unless the guest armed it again meanwhile: the
    // launch defers it as in any warm clone.
    if let (Some(set), Some(before)) = (deferred_to, template_state.vcpus[index].timer_deadline()) {
        primed.undo_deferral(set, before);
    }
    // Its TSC as the template's: the launch moves every vCPU's clock and the VM's on
    // from the template's capture, as in any warm clone (the guest's clocks stay
    // monotonic: the launch is later than the prime).
    let template_tsc =
        (template_state.vcpus[index].msrs.iter()).find(|m| m.index == clone::msrs::MSR_IA32_TSC);
    for m in &mut primed.msrs {
        if let (clone::msrs::MSR_IA32_TSC, Some(t)) = (m.index, template_tsc) {
            m.data = t.data;
        }
    }
    let mut state = template_state.clone();
    state.vcpus[index] = primed;
    Ok((state, prepared))
}
