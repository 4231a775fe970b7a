//! What a template hands the clone it makes for a request (cloning's opaque
//! [`Handover`]: the [`Delivery`] as its note, the payload, the caller's connection), and
//! what the clone makes of it before its vCPUs run ([`take`]: the request written into
//! its copy of the mailbox, an [`Invoker`] with the request in flight).

use std::any::Any;

use std::os::fd::BorrowedFd;

use api_types::CreateClones;
use devices::mailbox::{MailboxWindow, HEADER_BYTES};
use serde::Deserialize;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, ReadVolatile};

use super::{initial_defer_ns, Connection, Delivery, Invocation, Invoker};
use crate::cloning::{HandedOver, Handover, ServeError};
use crate::config::VmConfig;
use crate::microvm::Microvm;

/// The clone request and the handover that run `inv` in a clone of a template whose
/// runtime waits on `vcpu`, its timer deferred by `tick_defer_ns` (`--tick-defer-ms`).
pub(super) fn handover(inv: Invocation, vcpu: u8, tick_defer_ns: u64) -> (CreateClones, Handover) {
    let delivery = Delivery::of(&inv, vcpu);
    let req = CreateClones {
        count: 1,
        resource_class: inv.options.resource_class.clone(),
        rate_limits: inv.options.rate_limits(),
        taps: inv.options.tap.iter().cloned().collect(),
        addresses: inv.options.addresses().into_iter().collect(),
        media: inv.options.media.clone(),
        ..CreateClones::default()
    };
    let handover = Handover {
        // A struct of numbers and flags: it always serializes.
        note: serde_json::to_value(&delivery).unwrap_or_default(),
        guest_result: (vcpu, u64::from(delivery.length)),
        defer_timer_ns: initial_defer_ns(tick_defer_ns),
        payload: inv.payload,
        stream: inv.conn.shared(),
    };
    (req, handover)
}

/// In the clone, before its vCPUs run: the request into its copy of the mailbox (the
/// runtime's port read already returns its length), and the [`Invoker`] that has it in
/// flight, for the controller (`controller::serve_clone`).
pub fn take(
    handed: HandedOver,
    config: &VmConfig,
    template: &Microvm,
) -> Result<Box<dyn Any>, ServeError> {
    let delivery = Delivery::deserialize(handed.note)
        .map_err(|e| format!("not an invocation's delivery: {e}"))?;
    let conn = Connection::new(handed.stream);
    let (mem, window) = (template.memory(), template.mailbox());
    let mut in_place = 0;
    if let Some((from, count)) = handed.rest {
        read_rest(mem, window, handed.payload.len(), (from, count))?;
        in_place = count;
    }
    let invoker = Invoker::in_clone(
        config,
        (mem, window),
        &delivery,
        (handed.payload, in_place, conn),
        handed.primed,
    )?;
    Ok(Box::new(invoker))
}

/// Reads the rest of a payload, `count` bytes from `from`, straight into the mailbox
/// after its first `first` bytes.
fn read_rest(
    mem: &GuestMemoryMmap,
    window: MailboxWindow,
    first: usize,
    (mut from, count): (BorrowedFd<'_>, usize),
) -> Result<(), ServeError> {
    let total = first.saturating_add(count);
    if total > window.capacity() {
        return Err(format!(
            "a payload of {total} bytes does not fit the mailbox ({})",
            window.capacity()
        )
        .into());
    }
    // One slice of the mailbox (a single region), filled by as many reads as the socket
    // takes (`read_exact_volatile`; `GuestMemory::read_exact_volatile_from` makes only
    // one read).
    let at = window.at(HEADER_BYTES + first);
    let short = |e: &dyn std::fmt::Display| format!("the payload's last {count} bytes: {e}");
    let mut slice = mem.get_slice(at, count).map_err(|e| short(&e))?;
    from.read_exact_volatile(&mut slice)
        .map_err(|e| short(&e).into())
}
