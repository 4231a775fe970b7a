//! What a template hands the clone it makes for a request (cloning's opaque
//! [`Handover`]: the [`Delivery`] as its note, the payload, the caller's connection), and
//! what the clone makes of it before its vCPUs run ([`take`]: the request written into
//! its copy of the mailbox, an [`Invoker`] with the request in flight).

use std::any::Any;

use api_types::CreateClones;
use serde::Deserialize;

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
    let invoker = Invoker::in_clone(
        config,
        (template.memory(), template.mailbox()),
        &delivery,
        (handed.payload, conn),
        handed.primed,
    )?;
    Ok(Box::new(invoker))
}
