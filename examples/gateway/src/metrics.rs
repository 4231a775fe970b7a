//! The gateway's metrics, in the Prometheus (OpenMetrics) text format at `GET /metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels of an invocation's counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InvocationLabels {
    /// The function.
    pub function: String,
    /// How it ended: ok, handler_error, timeout, bad_reply, guest_stopped, refused,
    /// unavailable.
    pub outcome: String,
}

/// Labels by cache tier.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabels {
    /// function, zygote, subset or base.
    pub tier: String,
}

/// Labels by whose error.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// caller, guest or host.
    pub kind: String,
}

/// Every metric, registered.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Invocations by function and outcome.
    pub invocations: Family<InvocationLabels, Counter>,
    /// End-to-end latency of invocations that reached a clone, in seconds.
    pub latency: Histogram,
    /// Clones made for invocations.
    pub clones: Counter,
    /// Templates cached (base, zygotes, functions' templates).
    pub templates: Gauge,
    /// Zygotes made.
    pub zygotes_made: Gauge,
    /// Package sets mounted: zygotes with a set's image, nothing imported.
    pub package_sets: Gauge,
    /// Templates evicted under the memory budget.
    pub evicted: Gauge,
    /// Own memory of the cached templates, in bytes.
    pub template_memory: Gauge,
    /// Invocations by the cache tier their template came from.
    pub cache_hits: Family<TierLabels, Counter>,
    /// Failed invocations and deployments by whose failure.
    pub errors: Family<ErrorLabels, Counter>,
    /// Base templates started again after their VMM died.
    pub restarts: Counter,
    /// Functions deployed now.
    pub functions: Gauge,
}

impl Metrics {
    /// The metrics, registered under `forkvm_`.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("forkvm");
        let m = Self {
            invocations: Family::default(),
            latency: Histogram::new(exponential_buckets(0.000_25, 2.0, 16)),
            clones: Counter::default(),
            templates: Gauge::default(),
            zygotes_made: Gauge::default(),
            package_sets: Gauge::default(),
            evicted: Gauge::default(),
            template_memory: Gauge::default(),
            cache_hits: Family::default(),
            errors: Family::default(),
            restarts: Counter::default(),
            functions: Gauge::default(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register(
            "invocations",
            "Invocations by function and outcome",
            m.invocations.clone(),
        );
        r.register(
            "invocation_duration_seconds",
            "Time from a request's arrival at the gateway to the handler's reply",
            m.latency.clone(),
        );
        r.register(
            "clones",
            "Clones made for invocations (one per invocation)",
            m.clones.clone(),
        );
        r.register(
            "templates",
            "Templates cached: the base, zygotes and functions' templates",
            m.templates.clone(),
        );
        r.register(
            "zygotes_made",
            "Zygotes made so far",
            m.zygotes_made.clone(),
        );
        r.register(
            "package_sets_mounted",
            "Package sets' root zygotes made so far (among zygotes_made)",
            m.package_sets.clone(),
        );
        r.register(
            "templates_evicted",
            "Templates evicted under the memory budget so far",
            m.evicted.clone(),
        );
        r.register(
            "template_memory_bytes",
            "Own memory of the cached templates (copy-on-write sharing not counted)",
            m.template_memory.clone(),
        );
        r.register(
            "cache_hits",
            "Invocations by the cache tier their function's template came from",
            m.cache_hits.clone(),
        );
        r.register(
            "errors",
            "Failed invocations and deployments by whose failure",
            m.errors.clone(),
        );
        r.register(
            "base_restarts",
            "Base templates started again after their VMM died",
            m.restarts.clone(),
        );
        r.register("functions", "Functions deployed", m.functions.clone());
        Self { registry, ..m }
    }

    /// The text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
