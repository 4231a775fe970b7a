//! Deferring a guest's due timer interrupt, so that a request's handler runs first.
//!
//! A guest that did not run for a while (a template paused since, or a runtime parked
//! between requests) has a local APIC timer deadline in the past: the moment it runs
//! again the interrupt fires, and the kernel catches up on all the time that passed
//! (timekeeping, the timer wheel, scheduler averages, expired timers and the work they
//! wake) before the handler's first instruction. Moving that deadline a little into
//! the future lets the handler run first; a handler that takes longer meets the
//! interrupt then, and one that ends its clone sooner never pays for it. To the guest
//! this is the same as its vCPU not being scheduled for that long.
//!
//! Only the TSC-deadline mode is handled (what Linux uses when CPUID offers it); in
//! that mode the timer's whole state is the IA32_TSC_DEADLINE MSR. A deadline of zero
//! means disarmed and stays so. Writing the MSR also drops an expiry KVM has counted
//! but not yet injected, so a vCPU parked past its deadline is deferred as well.

use kvm_bindings::kvm_msr_entry;

use crate::msrs::{get_msrs_skipping, set_msrs_skipping, MsrAccess, MsrError};
use crate::msrs::{MSR_IA32_TSC, MSR_IA32_TSC_DEADLINE};
use crate::VcpuState;

/// TSC cycles in `ns` nanoseconds at `tsc_khz`.
pub fn cycles(ns: u64, tsc_khz: u32) -> u64 {
    u64::try_from(u128::from(ns) * u128::from(tsc_khz) / 1_000_000).unwrap_or(u64::MAX)
}

/// The deadline to write instead of `deadline` when the TSC reads `tsc`: `tsc + defer`
/// when an armed deadline falls before it; None to leave it.
pub fn deferred(deadline: u64, tsc: u64, defer: u64) -> Option<u64> {
    let at = tsc.saturating_add(defer);
    (deadline != 0 && deadline < at).then_some(at)
}

fn find(msrs: &[kvm_msr_entry], index: u32) -> Option<u64> {
    msrs.iter().find(|m| m.index == index).map(|m| m.data)
}

impl VcpuState {
    /// Defers this state's timer deadline to `ns` after its TSC ([`deferred`]). Returns
    /// whether it moved (not without a known TSC frequency or an armed deadline).
    pub fn defer_timer(&mut self, ns: u64) -> bool {
        let Some(khz) = self.tsc_khz else {
            return false;
        };
        let Some(tsc) = find(&self.msrs, MSR_IA32_TSC) else {
            return false;
        };
        let defer = cycles(ns, khz);
        let entry = self
            .msrs
            .iter_mut()
            .find(|m| m.index == MSR_IA32_TSC_DEADLINE);
        match entry.and_then(|m| deferred(m.data, tsc, defer).map(|at| (m, at))) {
            Some((m, at)) => {
                m.data = at;
                true
            }
            None => false,
        }
    }

    /// This state's timer deadline (IA32_TSC_DEADLINE), when it has one.
    pub fn timer_deadline(&self) -> Option<u64> {
        find(&self.msrs, MSR_IA32_TSC_DEADLINE)
    }

    /// Puts the timer deadline back to `before` where it still reads `set`, the value a
    /// deferral wrote: the guest did not arm its timer again since (its own value is
    /// kept). Returns whether it did.
    pub fn undo_deferral(&mut self, set: u64, before: u64) -> bool {
        let entry = self
            .msrs
            .iter_mut()
            .find(|m| m.index == MSR_IA32_TSC_DEADLINE && m.data == set);
        entry.map(|m| m.data = before).is_some()
    }
}

/// Defers the timer deadline of a live, stopped vCPU to `ns` after its TSC now
/// ([`deferred`]). Returns whether it moved.
pub fn defer_live<A: MsrAccess>(vcpu: &A, tsc_khz: u32, ns: u64) -> Result<bool, MsrError> {
    rewrite_live(vcpu, |deadline, tsc| {
        deferred(deadline, tsc, cycles(ns, tsc_khz))
    })
}

/// Reads a live, stopped vCPU's TSC and timer deadline and writes the deadline `new`
/// makes of them (`new(deadline, tsc)`; None: left). Returns whether it was written.
fn rewrite_live<A: MsrAccess>(
    vcpu: &A,
    new: impl FnOnce(u64, u64) -> Option<u64>,
) -> Result<bool, MsrError> {
    let (now, _) = get_msrs_skipping(vcpu, &[MSR_IA32_TSC, MSR_IA32_TSC_DEADLINE])?;
    let (Some(tsc), Some(deadline)) = (find(&now, MSR_IA32_TSC), find(&now, MSR_IA32_TSC_DEADLINE))
    else {
        return Ok(false);
    };
    let Some(at) = new(deadline, tsc) else {
        return Ok(false);
    };
    let entry = kvm_msr_entry {
        index: MSR_IA32_TSC_DEADLINE,
        data: at,
        ..Default::default()
    };
    let skipped = set_msrs_skipping(vcpu, &[entry])?;
    Ok(skipped.is_empty())
}

/// The deadline to write instead of `deadline` when the TSC reads `tsc`, to re-time a
/// deferral: `tsc + to`, when an armed deadline falls within `tsc + within` (one the
/// deferral set, or a guest timer due inside it); None to leave it.
pub fn retimed(deadline: u64, tsc: u64, to: u64, within: u64) -> Option<u64> {
    let horizon = tsc.saturating_add(within);
    (deadline != 0 && deadline <= horizon).then(|| tsc.saturating_add(to))
}

/// Re-times the deferred timer deadline of a live, stopped vCPU to `ns` after its TSC
/// now, if it falls within `within_ns` ([`retimed`]): a deferral moved on, or ended
/// (`ns` 0: the interrupt is due at once). Returns whether it moved.
pub fn retime_live<A: MsrAccess>(
    vcpu: &A,
    tsc_khz: u32,
    ns: u64,
    within_ns: u64,
) -> Result<bool, MsrError> {
    rewrite_live(vcpu, |deadline, tsc| {
        retimed(
            deadline,
            tsc,
            cycles(ns, tsc_khz),
            cycles(within_ns, tsc_khz),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retime_moves_only_an_armed_deadline_within_the_horizon() {
        assert_eq!(retimed(900, 1_000, 0, 500), Some(1_000), "overdue: due now");
        assert_eq!(retimed(1_400, 1_000, 200, 500), Some(1_200), "pulled in");
        assert_eq!(retimed(1_100, 1_000, 300, 500), Some(1_300), "pushed on");
        assert_eq!(retimed(1_600, 1_000, 200, 500), None, "beyond the horizon");
        assert_eq!(retimed(0, 1_000, 200, 500), None, "disarmed");
    }

    #[test]
    fn a_deferral_is_undone_only_where_the_guest_left_it() {
        let mut state = crate::state::sample_state(Some(1_000));
        let before = state.vcpus[0].timer_deadline().expect("a deadline");
        // 10 ms at 1,000 kHz: 10,000 cycles after the TSC (1,000), past the deadline.
        assert!(state.vcpus[0].defer_timer(10_000_000));
        let set = state.vcpus[0].timer_deadline().expect("a deadline");
        assert_eq!((before, set), (5_000, 11_000));
        assert!(state.vcpus[0].undo_deferral(set, before));
        assert_eq!(state.vcpus[0].timer_deadline(), Some(before));
        // The guest armed its timer again: its value stays.
        assert!(state.vcpus[0].defer_timer(10_000_000));
        for m in &mut state.vcpus[0].msrs {
            if m.index == MSR_IA32_TSC_DEADLINE {
                m.data = 7_777;
            }
        }
        assert!(!state.vcpus[0].undo_deferral(set, before));
        assert_eq!(state.vcpus[0].timer_deadline(), Some(7_777));
    }

    #[test]
    fn only_an_armed_deadline_due_before_the_deferral_moves() {
        assert_eq!(deferred(900, 1_000, 500), Some(1_500), "overdue");
        assert_eq!(deferred(1_200, 1_000, 500), Some(1_500), "due within it");
        assert_eq!(deferred(1_500, 1_000, 500), None, "due at it");
        assert_eq!(deferred(9_000, 1_000, 500), None, "due later");
        assert_eq!(deferred(0, 1_000, 500), None, "disarmed");
        assert_eq!(
            deferred(5, u64::MAX - 1, 500),
            Some(u64::MAX),
            "no overflow"
        );
    }

    #[test]
    fn a_states_overdue_deadline_moves_and_nothing_else() {
        // 2.5 GHz: 10 us are 25,000 cycles after the TSC of 1,000.
        let mut s = crate::state::sample_state(Some(2_500_000));
        assert!(s.vcpus[0].defer_timer(10_000));
        let data: Vec<u64> = s.vcpus[0].msrs.iter().map(|m| m.data).collect();
        assert_eq!(data, vec![1_000, 26_000, 7]);
        // Due later already: left.
        assert!(!s.vcpus[0].defer_timer(1_000));
        // Without a TSC frequency nothing can be computed.
        let mut s = crate::state::sample_state(None);
        assert!(!s.vcpus[0].defer_timer(10_000));
        assert_eq!(s.vcpus[0].msrs[1].data, 5_000);
    }

    /// A vCPU with a TSC and a deadline, recording writes.
    struct Live {
        tsc: u64,
        deadline: std::cell::Cell<u64>,
    }

    impl MsrAccess for Live {
        fn set_msrs(&self, m: &kvm_bindings::Msrs) -> Result<usize, kvm_ioctls::Error> {
            for e in m.as_slice() {
                assert_eq!(
                    e.index, MSR_IA32_TSC_DEADLINE,
                    "only the deadline is written"
                );
                self.deadline.set(e.data);
            }
            Ok(m.as_slice().len())
        }
        fn get_msrs(&self, m: &mut kvm_bindings::Msrs) -> Result<usize, kvm_ioctls::Error> {
            for e in m.as_mut_slice() {
                e.data = match e.index {
                    MSR_IA32_TSC => self.tsc,
                    _ => self.deadline.get(),
                };
            }
            Ok(m.as_slice().len())
        }
    }

    #[test]
    fn a_live_vcpus_overdue_deadline_moves() {
        let v = Live {
            tsc: 1_000_000,
            deadline: 999_000.into(),
        };
        // 1 GHz: 1 ms is 1,000,000 cycles.
        assert!(defer_live(&v, 1_000_000, 1_000_000).unwrap());
        assert_eq!(v.deadline.get(), 2_000_000);
        assert!(!defer_live(&v, 1_000_000, 1_000_000).unwrap(), "not again");
        v.deadline.set(0);
        assert!(!defer_live(&v, 1_000_000, 1_000_000).unwrap());
        assert_eq!(v.deadline.get(), 0, "a disarmed timer stays disarmed");
    }

    #[test]
    fn cycles_follow_the_tsc_frequency() {
        assert_eq!(cycles(10_000_000, 2_500_000), 25_000_000);
        assert_eq!(cycles(0, 2_500_000), 0);
        assert_eq!(cycles(u64::MAX, u32::MAX), u64::MAX);
    }
}
