//! The gateway's functions: deploy, invoke, list, delete, over a [`ZygoteCache`] whose
//! base is a Python zygote template.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkvm::{Envelope, EnvelopeStatus, Error, ErrorKind, Event, InvokeOptions, Load, Outcome};
use forkvm::{PackageError, Reply, Template, Tier, ZygoteCache};

use crate::packages::{PackageSetInfo, PackageSetView};
use serde::{Deserialize, Serialize};

use crate::logs::{now_ms, redact, LogEntry, LogStore};
use crate::metrics::{ErrorLabels, InvocationLabels, Metrics, TierLabels};

/// A function's limits: the clone's resource class and rate limits, and its timeout.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// A resource class the gateway was started with (`--class`): the clone's cgroup,
    /// with that class's CPU, memory and process limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// How long the handler may take, in ms (default 30000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// The clone's disk rate limit (`bytes=1M,ops=100`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_rate: Option<String>,
    /// The clone's network rate limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_rate: Option<String>,
}

/// `PUT /functions/{name}`'s body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionSpec {
    /// The handler's Python source.
    pub source: String,
    /// The function in it that handles an event (default `handler`): called with the
    /// request body (`bytes`), it returns `bytes` or `str`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handler: Option<String>,
    /// Modules it imports (its zygote is chosen by them).
    #[serde(default)]
    pub packages: BTreeSet<String>,
    /// PyPI requirements (`pyyaml==6.0.1`, `jinja2`): resolved on the host into a
    /// package set (the gateway's `--package-cache`), whose image is mounted first on
    /// the handler's `sys.path`. Functions with the same requirements share the image
    /// and their zygotes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requirements: Vec<String>,
    /// Events its handler is called with in its template before the template pauses
    /// (strings, or `{"base64": "..."}`): what a request touches is then already in
    /// every clone's memory. Their side effects are in every clone too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warmup: Vec<Event>,
    /// True to leave the imports inside its source's functions to their calls. By
    /// default the template runs them before it pauses, so that a request's clone finds
    /// those modules loaded ([`Load::lazy_imports`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lazy_imports: bool,
    /// Its limits.
    #[serde(default)]
    pub limits: Limits,
    /// Environment variables its handler sees in `os.environ` (shown by `GET
    /// /functions`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Environment variables too, whose values are never shown: `GET /functions` lists
    /// their names only, and logs and error answers have each value replaced by
    /// `[secret NAME]`.
    #[serde(default, skip_serializing)]
    pub secrets: BTreeMap<String, String>,
}

/// A deployed function.
#[derive(Debug, Clone)]
struct Function {
    spec: FunctionSpec,
    load: Load,
    options: InvokeOptions,
    /// What its requirements resolved to (once deployed).
    package_set: Option<PackageSetInfo>,
}

/// What `GET /functions` and `PUT` answer about a function.
#[derive(Debug, Clone, Serialize)]
pub struct FunctionInfo {
    /// Its name.
    pub name: String,
    /// Its packages.
    pub packages: BTreeSet<String>,
    /// Its requirements.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub requirements: Vec<String>,
    /// What they resolved to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub package_set: Option<PackageSetInfo>,
    /// Its limits.
    pub limits: Limits,
    /// Its environment variables.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Its secrets' names (never their values).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    /// Invocations so far.
    pub invocations: u64,
}

impl FunctionInfo {
    fn of(name: &str, f: &Function, invocations: u64) -> Self {
        let spec = &f.spec;
        FunctionInfo {
            name: name.to_string(),
            packages: spec.packages.clone(),
            requirements: spec.requirements.clone(),
            package_set: f.package_set.clone(),
            limits: spec.limits.clone(),
            env: spec.env.clone(),
            secrets: spec.secrets.keys().cloned().collect(),
            invocations,
        }
    }
}

/// The gateway's state, shared by every request.
pub struct Gateway {
    cache: RwLock<ZygoteCache>,
    functions: Mutex<BTreeMap<String, (Function, u64)>>,
    classes: Vec<String>,
    /// Whether functions may have requirements (`--package-cache`).
    packages: bool,
    /// Its metrics.
    pub metrics: Metrics,
    /// What its functions printed.
    logs: LogStore,
}

/// An error answer: status and text (JSON `{"error": ...}`).
#[derive(Debug)]
pub struct Failure(StatusCode, String);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.1 });
        (self.0, Json(body)).into_response()
    }
}

fn bad(text: impl Into<String>) -> Failure {
    Failure(StatusCode::BAD_REQUEST, text.into())
}

/// A function name: 1 to 64 of `[A-Za-z0-9_-]`.
fn check_name(name: &str) -> Result<(), Failure> {
    let ok = (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    match ok {
        true => Ok(()),
        false => Err(bad(format!(
            "function name {name:?}: 1 to 64 letters, digits, '_' or '-'"
        ))),
    }
}

impl Gateway {
    /// A gateway over `cache`, whose VMMs have the resource classes `classes`;
    /// `packages`: whether the cache resolves requirements.
    pub fn new(cache: ZygoteCache, classes: Vec<String>, packages: bool) -> Self {
        Self {
            cache: RwLock::new(cache),
            functions: Mutex::new(BTreeMap::new()),
            classes,
            packages,
            metrics: Metrics::new(),
            logs: LogStore::default(),
        }
    }

    /// The cache now.
    pub fn cache(&self) -> ZygoteCache {
        self.cache.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the cache (its base died and was started again): functions' templates
    /// are derived again from the new one as they are invoked.
    pub fn replace_cache(&self, cache: ZygoteCache) {
        *self.cache.write().unwrap_or_else(|p| p.into_inner()) = cache;
        self.metrics.restarts.inc();
    }

    /// Each deployed function with requirements and its package set.
    pub fn function_sets(&self) -> Vec<(String, PackageSetInfo)> {
        (self.functions().iter())
            .filter_map(|(name, (f, _))| Some((name.clone(), f.package_set.clone()?)))
            .collect()
    }

    fn functions(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (Function, u64)>> {
        self.functions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn count_error(&self, e: &Error) {
        self.count_error_kind(e.kind());
    }

    /// Counts a failure whose fault is `kind`'s (`forkvm_errors_total`).
    fn count_error_kind(&self, kind: ErrorKind) {
        let kind = match kind {
            ErrorKind::Caller => "caller",
            ErrorKind::Guest => "guest",
            ErrorKind::Host => "host",
            _ => "other",
        };
        let labels = ErrorLabels { kind: kind.into() };
        self.metrics.errors.get_or_create(&labels).inc();
    }

    /// The cache's figures into the gauges (at each scrape of `/metrics`, not on the
    /// request path).
    fn update_gauges(&self) {
        let s = self.cache().stats();
        let m = &self.metrics;
        m.templates.set(s.entries as i64);
        m.zygotes_made.set(s.zygotes_made as i64);
        m.package_sets.set(s.package_sets_mounted as i64);
        m.evicted.set(s.evicted as i64);
        m.template_memory.set((s.own_memory_kib * 1024) as i64);
        m.functions.set(self.functions().len() as i64);
    }

    /// Function `name`'s template from the cache (derived if it is not cached), with
    /// its tier. A template whose VMM died is forgotten and derived again.
    async fn template(&self, name: &str, f: &Function) -> Result<(Arc<Template>, Tier), Error> {
        let cache = self.cache();
        let (t, tier) = cache.function(name, &f.load).await?;
        if t.is_alive() {
            return Ok((t, tier));
        }
        tracing::warn!("function {name}'s template died: deriving it again");
        drop(t);
        cache.remove_function(name);
        cache.function(name, &f.load).await
    }
}

/// Checks `spec` (`classes`: the gateway's resource classes; `packages`: whether it
/// has a package cache) and what deploying it means.
fn function_of(
    classes: &[String],
    packages: bool,
    spec: FunctionSpec,
) -> Result<Function, Failure> {
    if !spec.requirements.is_empty() && !packages {
        return Err(bad(
            "requirements need a package cache: this gateway runs without --package-cache",
        ));
    }
    if let Some(c) = &spec.limits.class {
        if !classes.contains(c) {
            return Err(bad(format!(
                "unknown class {c:?}: the gateway has {classes:?} (--class)"
            )));
        }
    }
    check_packages(&spec.packages)?;
    check_env(&spec.env, &spec.secrets)?;
    let rate = |what: &str, v: &Option<String>| {
        v.as_deref()
            .map(|s| s.parse().map_err(|e| bad(format!("{what}: {e}"))))
            .transpose()
    };
    let options = InvokeOptions {
        timeout_ms: spec.limits.timeout_ms,
        resource_class: spec.limits.class.clone(),
        disk_rate: rate("disk_rate", &spec.limits.disk_rate)?,
        net_rate: rate("net_rate", &spec.limits.net_rate)?,
        ..Default::default()
    };
    options.check().map_err(|e| bad(e.to_string()))?;
    let mut env = spec.env.clone();
    env.extend(spec.secrets.clone());
    let mut load = Load::default();
    load.imports = spec.packages.clone();
    load.source = Some(spec.source.clone());
    load.handler = spec.handler.clone();
    load.warmup = spec.warmup.clone();
    load.lazy_imports = spec.lazy_imports;
    load.env = env;
    load.logs = true;
    load.requirements = spec.requirements.clone();
    // Its template's warm clones wait in cgroups of its class.
    load.class = spec.limits.class.clone();
    Ok(Function {
        spec,
        load,
        options,
        package_set: None,
    })
}

/// The most bytes of names and values `env` and `secrets` may hold together.
const ENV_BYTES: usize = 64 << 10;

/// `env` and `secrets`: names of `[A-Za-z_][A-Za-z0-9_]*` (at most 128), none in both,
/// values without NUL, at most [`ENV_BYTES`] in all.
fn check_env(
    env: &BTreeMap<String, String>,
    secrets: &BTreeMap<String, String>,
) -> Result<(), Failure> {
    let mut bytes = 0;
    for (what, map) in [("env", env), ("secrets", secrets)] {
        for (name, value) in map {
            let ok = (1..=128).contains(&name.len())
                && name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !ok {
                return Err(bad(format!(
                    "{what}: {name:?} is no variable name (letters, digits and '_', not first a digit)"
                )));
            }
            if value.contains('\0') {
                return Err(bad(format!("{what}: {name}'s value holds a NUL")));
            }
            bytes += name.len() + value.len();
        }
    }
    if let Some(name) = env.keys().find(|n| secrets.contains_key(*n)) {
        return Err(bad(format!("{name} is in both env and secrets")));
    }
    if bytes > ENV_BYTES {
        return Err(bad(format!(
            "env and secrets hold {bytes} bytes; at most {ENV_BYTES}"
        )));
    }
    Ok(())
}

/// Each of `packages` is a module name (`a.b_c`).
fn check_packages(packages: &BTreeSet<String>) -> Result<(), Failure> {
    for p in packages {
        let ok = !p.is_empty()
            && p.split('.').all(|part| {
                part.chars()
                    .next()
                    .is_some_and(|c| c.is_alphabetic() || c == '_')
                    && part.chars().all(|c| c.is_alphanumeric() || c == '_')
            });
        if !ok {
            return Err(bad(format!("package {p:?} is no module name")));
        }
    }
    Ok(())
}

/// What a failed deployment or invocation answers.
fn failure_of(e: &Error) -> Failure {
    let status = match e {
        Error::Refused { status, .. } => *status,
        Error::Invocation { outcome, .. } => match outcome {
            Outcome::HandlerError => 500,
            Outcome::Timeout => 504,
            _ => 502,
        },
        Error::Unavailable { .. } | Error::Evicted => 503,
        Error::Timeout { .. } => 504,
        Error::Packages(p) => match p {
            PackageError::Requirement(_) => 400,
            PackageError::Budget { .. } => 413,
            PackageError::Resolve(_) => 422,
            _ => 500,
        },
        _ => 502,
    };
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    Failure(status, e.to_string())
}

fn outcome_of(e: &Error) -> &'static str {
    match e {
        Error::Invocation { outcome, .. } => outcome.as_str(),
        Error::Refused { .. } => "refused",
        _ => "unavailable",
    }
}

/// `PUT /functions/{name}`: deploys (or replaces) a function; its template is derived
/// now, so a function that does not load fails here (400, with the traceback).
pub async fn deploy(
    State(g): State<Arc<Gateway>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<Response, Failure> {
    check_name(&name)?;
    let spec: FunctionSpec =
        serde_json::from_slice(&body).map_err(|e| bad(format!("function spec: {e}")))?;
    let mut f = function_of(&g.classes, g.packages, spec)?;
    let started = Instant::now();
    let cache = g.cache();
    // The package set first (the derivation finds it in the package cache then), so
    // the answer can say whether it was built and how long that took.
    let set = match f.load.requirements.is_empty() {
        true => Ok(None),
        false => cache.package_set(&f.load.requirements).await.map(Some),
    };
    let derived = match set {
        Ok(set) => cache.function(&name, &f.load).await.map(|t| (t, set)),
        Err(e) => Err(e),
    };
    let mut built = None;
    let (_, tier) = match derived {
        Ok(((t, tier), set)) => {
            if let Some(s) = set {
                built = Some((s.built, s.took.as_millis() as u64));
                f.package_set = Some(PackageSetInfo {
                    key: s.key,
                    resolved: s.resolved,
                });
            }
            (t, tier)
        }
        Err(e) => {
            g.count_error(&e);
            cache.remove_function(&name);
            let Failure(status, text) = failure_of(&e);
            // A handler that raised while loading: the function's fault.
            let status = match &e {
                Error::Invocation {
                    outcome: Outcome::HandlerError,
                    ..
                } => StatusCode::BAD_REQUEST,
                _ => status,
            };
            return Err(Failure(
                status,
                format!("the function did not load: {text}"),
            ));
        }
    };
    let replaced = g.functions().insert(name.clone(), (f.clone(), 0)).is_some();
    let status = match replaced {
        true => StatusCode::OK,
        false => StatusCode::CREATED,
    };
    let mut info = serde_json::to_value(FunctionInfo::of(&name, &f, 0))
        .unwrap_or_else(|_| serde_json::json!({}));
    info["tier"] = tier.as_str().into();
    if let Some((built, ms)) = built {
        info["package_set"]["built"] = built.into();
        info["package_set"]["build_ms"] = ms.into();
    }
    info["deploy_ms"] = (started.elapsed().as_millis() as u64).into();
    Ok((status, Json(info)).into_response())
}

/// `POST /functions/{name}`: the request body is the event; the answer is the
/// handler's reply, from a fresh clone of the function's template (`?logs=true`: a JSON
/// object with the reply and what the invocation printed, [`with_logs`]).
pub async fn invoke(
    State(g): State<Arc<Gateway>>,
    Path(name): Path<String>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Result<Response, Failure> {
    let started = Instant::now();
    let want_logs = logs_asked(query.as_deref())?;
    let f = g.functions().get(&name).map(|(f, _)| f.clone());
    let f = f.ok_or_else(|| Failure(StatusCode::NOT_FOUND, format!("no function {name:?}")))?;
    let result = match g.template(&name, &f).await {
        Ok((t, tier)) => {
            let labels = TierLabels {
                tier: tier.as_str().into(),
            };
            g.metrics.cache_hits.get_or_create(&labels).inc();
            let r = t.invoke(body, &f.options).await;
            if !matches!(&r, Err(Error::Refused { .. } | Error::Unavailable { .. })) {
                g.metrics.clones.inc();
            }
            r.map(|r| (r, tier))
        }
        Err(e) => Err(e),
    };
    if let Some((_, n)) = g.functions().get_mut(&name) {
        *n += 1;
    }
    let secrets = &f.spec.secrets;
    let count = |outcome: &str| {
        let labels = InvocationLabels {
            function: name.clone(),
            outcome: outcome.into(),
        };
        g.metrics.invocations.get_or_create(&labels).inc();
    };
    let (reply, tier) = match result {
        Ok(r) => r,
        Err(e) => {
            count(outcome_of(&e));
            g.count_error(&e);
            let Failure(status, text) = failure_of(&e);
            let text = redact(&text, secrets);
            if let Error::Invocation {
                outcome,
                clone_id,
                logs,
                logs_dropped,
                ..
            } = &e
            {
                // The VMM ended it (its time limit passed, the guest stopped): what the
                // handler printed until then, from the runtime's live log, or else
                // what the VMM says (with the console's tail).
                let entry = LogEntry {
                    invocation: clone_id.clone(),
                    at_ms: now_ms(),
                    outcome: outcome.as_str().into(),
                    logs: (logs.as_deref()).map_or_else(|| text.clone(), |l| redact(l, secrets)),
                    logs_dropped: *logs_dropped,
                };
                let body = want_logs.then(|| {
                    serde_json::json!({
                        "invocation": clone_id,
                        "error": text,
                        "logs": entry.logs,
                        "logs_dropped": entry.logs_dropped,
                    })
                });
                g.logs.push(&name, entry);
                if let Some(body) = body {
                    return Ok((status, Json(body)).into_response());
                }
            }
            return Err(Failure(status, text));
        }
    };
    let headers = reply_headers(&reply, tier);
    // Every function is loaded with logs; a plain answer is passed on as it is.
    let Ok(env) = reply.envelope() else {
        count("ok");
        g.metrics.latency.observe(started.elapsed().as_secs_f64());
        return Ok((StatusCode::OK, headers, reply.body).into_response());
    };
    let (status, outcome) = match env.status {
        EnvelopeStatus::Ok => (StatusCode::OK, Outcome::Ok),
        EnvelopeStatus::Timeout => (StatusCode::GATEWAY_TIMEOUT, Outcome::Timeout),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, Outcome::HandlerError),
    };
    count(outcome.as_str());
    let logs = redact(&env.logs, secrets);
    g.logs.push(
        &name,
        LogEntry {
            invocation: reply.clone_id.clone(),
            at_ms: now_ms(),
            outcome: outcome.as_str().into(),
            logs: logs.clone(),
            logs_dropped: env.logs_dropped,
        },
    );
    if status == StatusCode::OK {
        g.metrics.latency.observe(started.elapsed().as_secs_f64());
    } else {
        // The handler raised or ran out of time: the guest's failure, as the VMM's own
        // answers for these are counted.
        g.count_error_kind(ErrorKind::Guest);
    }
    let error = (status != StatusCode::OK).then(|| {
        let text = String::from_utf8_lossy(&env.body);
        match env.status {
            EnvelopeStatus::Error => format!("the handler failed: {}", redact(&text, secrets)),
            _ => redact(&text, secrets),
        }
    });
    if want_logs {
        let body = with_logs(&reply.clone_id, &env, error, logs);
        return Ok((status, headers, Json(body)).into_response());
    }
    match error {
        Some(text) => Err(Failure(status, text)),
        None => Ok((StatusCode::OK, headers, env.body).into_response()),
    }
}

/// Whether `?logs=true` was asked for (`logs=false`, or no `logs`, is not); other
/// parameters are refused.
fn logs_asked(query: Option<&str>) -> Result<bool, Failure> {
    let mut logs = false;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        logs = match pair {
            "logs=true" | "logs=1" => true,
            "logs=false" | "logs=0" => false,
            _ => return Err(bad(format!("unknown query {pair:?}: only logs=true|false"))),
        };
    }
    Ok(logs)
}

/// The `x-forkvm-*` headers of an answer from `reply`'s clone.
fn reply_headers(reply: &Reply, tier: Tier) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let octets = HeaderValue::from_static("application/octet-stream");
    headers.insert(header::CONTENT_TYPE, octets);
    let text = |s: &str| HeaderValue::from_str(s).ok();
    for (k, v) in [
        ("x-forkvm-tier", text(tier.as_str())),
        ("x-forkvm-clone-id", text(&reply.clone_id)),
        ("x-forkvm-clone-us", text(&reply.clone_us.to_string())),
        ("x-forkvm-handler-us", text(&reply.handler_us.to_string())),
        ("x-forkvm-total-us", text(&reply.total_us.to_string())),
        (
            "x-forkvm-primed",
            text(if reply.primed { "true" } else { "false" }),
        ),
        (
            "x-forkvm-stretched-us",
            text(&reply.stretched_us.to_string()),
        ),
    ] {
        if let Some(v) = v {
            headers.insert(k, v);
        }
    }
    headers
}

/// `?logs=true`'s answer: `invocation` (the clone's id), `reply` (UTF-8 text, or
/// `reply_base64`) or `error`, `logs` and `logs_dropped`.
pub fn with_logs(
    invocation: &str,
    env: &Envelope,
    error: Option<String>,
    logs: String,
) -> serde_json::Value {
    use base64::Engine as _;

    let mut v = serde_json::json!({
        "invocation": invocation,
        "logs": logs,
        "logs_dropped": env.logs_dropped,
    });
    match (error, std::str::from_utf8(&env.body)) {
        (Some(e), _) => v["error"] = e.into(),
        (None, Ok(text)) => v["reply"] = text.into(),
        (None, Err(_)) => {
            v["reply_base64"] = base64::engine::general_purpose::STANDARD
                .encode(&env.body)
                .into()
        }
    }
    v
}

/// `GET /functions/{name}/logs?limit=N`: what its latest invocations printed, newest
/// first (the last 100 are kept; `limit` defaults to all of them).
pub async fn logs(
    State(g): State<Arc<Gateway>>,
    Path(name): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Json<Vec<LogEntry>>, Failure> {
    if !g.functions().contains_key(&name) {
        return Err(Failure(
            StatusCode::NOT_FOUND,
            format!("no function {name:?}"),
        ));
    }
    let mut limit = usize::MAX;
    for pair in query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
    {
        limit = pair
            .strip_prefix("limit=")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| bad(format!("unknown query {pair:?}: only limit=N")))?;
    }
    Ok(Json(g.logs.newest(&name, limit)))
}

/// `GET /functions`: every deployed function.
pub async fn list(State(g): State<Arc<Gateway>>) -> Json<Vec<FunctionInfo>> {
    let infos = (g.functions().iter())
        .map(|(name, (f, n))| FunctionInfo::of(name, f, *n))
        .collect();
    Json(infos)
}

/// `DELETE /functions/{name}`: 204; its template stops once no invocation holds it.
pub async fn delete(
    State(g): State<Arc<Gateway>>,
    Path(name): Path<String>,
) -> Result<StatusCode, Failure> {
    let gone = g.functions().remove(&name);
    gone.ok_or_else(|| Failure(StatusCode::NOT_FOUND, format!("no function {name:?}")))?;
    g.logs.forget(&name);
    g.cache().remove_function(&name);
    Ok(StatusCode::NO_CONTENT)
}

/// `PUT /zygotes`'s body: a package set to prepare a zygote of.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ZygoteSpec {
    /// Its modules.
    pub packages: BTreeSet<String>,
    /// The package set under it (as a function's `requirements`).
    #[serde(default)]
    pub requirements: Vec<String>,
}

/// `PUT /zygotes`: makes a zygote of exactly these packages now (unless cached), so
/// that functions that import them start from it.
pub async fn prepare(
    State(g): State<Arc<Gateway>>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, Failure> {
    let spec: ZygoteSpec =
        serde_json::from_slice(&body).map_err(|e| bad(format!("zygote spec: {e}")))?;
    check_packages(&spec.packages)?;
    if !spec.requirements.is_empty() && !g.packages {
        return Err(bad(
            "requirements need a package cache: this gateway runs without --package-cache",
        ));
    }
    let started = Instant::now();
    let cache = g.cache();
    let made = match spec.requirements.is_empty() {
        true => cache.prepare(&spec.packages).await.map(|_| None),
        false => match cache.prepare_with(&spec.requirements, &spec.packages).await {
            Ok(_) => cache.package_set(&spec.requirements).await.map(Some),
            Err(e) => Err(e),
        },
    };
    let set = made.map_err(|e| {
        g.count_error(&e);
        let Failure(status, text) = failure_of(&e);
        Failure(status, format!("the zygote did not load: {text}"))
    })?;
    let mut answer = serde_json::json!({
        "packages": spec.packages,
        "ms": started.elapsed().as_millis() as u64,
    });
    if let Some(set) = set {
        answer["package_set"] = serde_json::json!({"key": set.key, "resolved": set.resolved});
    }
    Ok(Json(answer))
}

/// `GET /zygotes`: what the cached zygotes imported (those over the guest image's
/// packages; those over package sets are in `GET /package-sets`).
pub async fn zygotes(State(g): State<Arc<Gateway>>) -> Json<Vec<BTreeSet<String>>> {
    Json(g.cache().zygotes())
}

/// `GET /package-sets`: the package sets of the deployed functions and of the cached
/// zygotes.
pub async fn package_sets(State(g): State<Arc<Gateway>>) -> Json<Vec<PackageSetView>> {
    let mut sets: BTreeMap<String, PackageSetView> = BTreeMap::new();
    let view = |key: &str| PackageSetView {
        key: key.to_string(),
        ..Default::default()
    };
    for (name, set) in g.function_sets() {
        let v = sets
            .entry(set.key.clone())
            .or_insert_with(|| view(&set.key));
        v.resolved = set.resolved;
        v.functions.push(name);
    }
    for (key, imports) in g.cache().package_zygotes() {
        sets.entry(key.clone())
            .or_insert_with(|| view(&key))
            .zygotes
            .push(imports);
    }
    Json(sets.into_values().collect())
}

/// `GET /metrics`: the Prometheus (OpenMetrics) text format.
pub async fn metrics(State(g): State<Arc<Gateway>>) -> Response {
    g.update_gauges();
    let kind = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    ([(header::CONTENT_TYPE, kind)], g.metrics.encode()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_specs_are_checked() {
        assert!(check_name("resize-image_2").is_ok());
        for bad in ["", "a/b", "a b", &"x".repeat(65), "ü"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        let spec: Result<FunctionSpec, _> =
            serde_json::from_str(r#"{"source": "x", "packages": ["json"], "oops": 1}"#);
        assert!(spec.is_err(), "unknown fields are refused");
        let spec: FunctionSpec = serde_json::from_str(
            r#"{"source": "def handler(e): return e", "limits": {"timeout_ms": 500}}"#,
        )
        .unwrap();
        assert_eq!(spec.limits.timeout_ms, Some(500));
        assert!(spec.packages.is_empty());
        let f = function_of(&["small".into()], false, spec.clone()).unwrap();
        assert_eq!(f.options.timeout_ms, Some(500));
        assert_eq!(f.load.handler, None);
        assert!(f.load.warmup.is_empty());
        assert!(
            !f.load.lazy_imports,
            "nested imports run in the template by default"
        );
        let lazy: FunctionSpec =
            serde_json::from_str(r#"{"source": "x", "lazy_imports": true}"#).unwrap();
        assert!(function_of(&[], false, lazy).unwrap().load.lazy_imports);
        let warm: FunctionSpec = serde_json::from_str(
            r#"{"source": "x", "warmup": ["{\"n\": 1}", {"base64": "AAE="}]}"#,
        )
        .unwrap();
        let f = function_of(&[], false, warm).unwrap();
        assert_eq!(
            f.load.warmup,
            [Event::from(r#"{"n": 1}"#), Event::from(vec![0, 1])]
        );
        let bad: Result<FunctionSpec, _> =
            serde_json::from_str(r#"{"source": "x", "warmup": [{"base64": "%"}]}"#);
        assert!(bad.unwrap_err().to_string().contains("bad base64"));
        let mut other = spec.clone();
        other.limits.class = Some("big".into());
        assert!(function_of(&["small".into()], false, other).is_err());
        let mut other = spec.clone();
        other.limits.net_rate = Some("bytes=lots".into());
        assert!(function_of(&[], false, other).is_err());
        let mut other = spec.clone();
        other.packages = ["os; rm".to_string()].into();
        assert!(function_of(&[], false, other).is_err());
        // Requirements: only with a package cache; they reach the load.
        let mut other = spec;
        other.requirements = vec!["pyyaml==6.0.1".into()];
        let Err(Failure(status, text)) = function_of(&[], false, other.clone()) else {
            panic!("requirements without a package cache accepted");
        };
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(text.contains("--package-cache"), "{text}");
        let f = function_of(&[], true, other).unwrap();
        assert_eq!(f.load.requirements, ["pyyaml==6.0.1"]);
        for ok in ["numpy", "a.b_c", "_x"] {
            assert!(check_packages(&[ok.to_string()].into()).is_ok(), "{ok}");
        }
        for bad in ["", "1a", "a..b", "a-b", "a b"] {
            assert!(check_packages(&[bad.to_string()].into()).is_err(), "{bad}");
        }
    }

    #[test]
    fn env_and_secrets_reach_the_load_and_secret_values_are_never_shown() {
        let spec: FunctionSpec = serde_json::from_str(
            r#"{"source": "x", "env": {"GREETING": "hi"}, "secrets": {"TOKEN": "s3cret"}}"#,
        )
        .unwrap();
        let f = function_of(&[], false, spec.clone()).unwrap();
        assert!(f.load.logs, "every function answers with its logs");
        let env: Vec<_> = f
            .load
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(env, [("GREETING", "hi"), ("TOKEN", "s3cret")]);
        let info = serde_json::to_string(&FunctionInfo::of("f", &f, 3)).unwrap();
        assert!(info.contains(r#""env":{"GREETING":"hi"}"#), "{info}");
        assert!(info.contains(r#""secrets":["TOKEN"]"#), "{info}");
        assert!(!info.contains("s3cret"), "{info}");
        let spec_json = serde_json::to_string(&spec).unwrap();
        assert!(!spec_json.contains("s3cret"), "{spec_json}");
        for (bad, says) in [
            (r#"{"env": {"1A": "x"}}"#, "no variable name"),
            (r#"{"env": {"A-B": "x"}}"#, "no variable name"),
            (r#"{"secrets": {"": "x"}}"#, "no variable name"),
            (r#"{"env": {"A": "x\u0000"}}"#, "holds a NUL"),
            (
                r#"{"env": {"A": "x"}, "secrets": {"A": "y"}}"#,
                "in both env and secrets",
            ),
        ] {
            let mut v: serde_json::Value = serde_json::from_str(bad).unwrap();
            v["source"] = "x".into();
            let spec: FunctionSpec = serde_json::from_value(v).unwrap();
            let Err(Failure(status, text)) = function_of(&[], false, spec) else {
                panic!("{bad} accepted");
            };
            assert_eq!(status, StatusCode::BAD_REQUEST);
            assert!(text.contains(says), "{bad}: {text}");
        }
        let mut big = FunctionSpec {
            env: BTreeMap::from([("A".into(), "x".repeat(ENV_BYTES))]),
            ..spec
        };
        assert!(function_of(&[], false, big.clone()).is_err());
        big.env.clear();
        assert!(function_of(&[], false, big).is_ok());
    }

    #[test]
    fn package_errors_answer_4xx_when_the_requirements_are_to_blame() {
        let status = |e: PackageError| failure_of(&Error::Packages(e)).0.as_u16();
        assert_eq!(status(PackageError::Requirement("-x".into())), 400);
        assert_eq!(status(PackageError::Resolve("no match".into())), 422);
        assert_eq!(status(PackageError::Budget { need: 2, budget: 1 }), 413);
        assert_eq!(status(PackageError::Image("mkfs".into())), 500);
    }

    #[test]
    fn the_logs_query_is_read_and_unknown_parameters_refused() {
        assert!(!logs_asked(None).unwrap());
        assert!(logs_asked(Some("logs=true")).unwrap());
        assert!(!logs_asked(Some("logs=true&logs=false")).unwrap());
        assert!(logs_asked(Some("logs=1&")).unwrap());
        for bad in ["logs=yes", "x=1", "logs"] {
            assert!(logs_asked(Some(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_answer_with_logs_says_reply_or_error_and_the_logs() {
        let env = |status, body: &'static [u8]| Envelope {
            status,
            body: Bytes::from_static(body),
            logs: String::new(),
            logs_dropped: 2,
        };
        let v = with_logs(
            "1.2",
            &env(EnvelopeStatus::Ok, b"done"),
            None,
            "hi\n".into(),
        );
        assert_eq!(
            v,
            serde_json::json!({"invocation": "1.2", "reply": "done", "logs": "hi\n", "logs_dropped": 2})
        );
        let v = with_logs(
            "1.3",
            &env(EnvelopeStatus::Ok, b"\xff\x00"),
            None,
            String::new(),
        );
        assert_eq!(v["reply_base64"], "/wA=");
        assert!(v.get("reply").is_none());
        let v = with_logs(
            "1.4",
            &env(EnvelopeStatus::Error, b"Traceback"),
            Some("the handler failed: Traceback".into()),
            String::new(),
        );
        assert_eq!(v["error"], "the handler failed: Traceback");
        assert!(v.get("reply").is_none());
    }
}
