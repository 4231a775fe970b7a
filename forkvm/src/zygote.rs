//! A tree of templates that have imported package sets (SOCK's import cache, at VM
//! level), and the functions' templates derived from them.
//!
//! The cache's root is a **base** template: a Python runtime waiting as a zygote
//! (`python3 -m forkvm`), nothing imported. Every other entry is derived from an entry
//! of the cache ([`Template::derive`]):
//! - a **zygote** has imported a package set (a set of module names), and nothing else;
//! - a **function's template** has imported what its function needs and loaded its
//!   source; each invocation of the function runs in a fresh clone of it.
//!
//! A function with PyPI requirements ([`Load::requirements`], a cache made
//! [`ZygoteCache::with_packages`]) has them resolved into a package set
//! ([`crate::PackageCache`]): its **root** is a zygote derived from the base with the
//! set's image in [`PACKAGE_SLOT`], mounted first on `sys.path`, nothing imported. A
//! zygote is keyed by (package set, imports): the functions of one set share its root
//! and the zygotes below it, and a zygote of another set (or of none) is never used
//! for them.
//!
//! Policy (docs/library.md):
//! - **Which zygote**: for a package set P, the zygote whose set is the largest subset
//!   of P (ties: the one used last). A zygote that imported anything outside P is never
//!   used for P: a package the function did not ask for could have tampered with the
//!   interpreter.
//! - **When a zygote is made**: once a package set P has been asked for
//!   [`CachePolicy::create_after`] times without a zygote of exactly P, one is derived
//!   from the best zygote for P, importing what that one lacks.
//! - **Eviction**: after each new entry, while the entries' own memory (what each
//!   template's VMM alone holds, measured when it paused: pages shared copy-on-write
//!   with its parent or its clones are not counted; `GET /vm` `own_memory_kib`) is over
//!   [`CachePolicy::memory_budget_kib`], the least recently used entry that is a leaf
//!   (nothing derived from it is cached) and that no caller holds is stopped. The base
//!   is never evicted. An entry a caller still holds is stopped once the caller drops it.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::OnceCell;

use crate::{Error, InsertMedium, InvokeOptions, Load, Template};
use crate::{PackageCache, PackageHold, PackageSet, PackageSource};

/// Module names a zygote imported.
pub type Packages = BTreeSet<String>;

/// The disk slot a package set's image goes in: the base template needs one
/// (`vmm run --disk-slots 1`) for functions with requirements.
pub const PACKAGE_SLOT: u8 = 0;

/// The package set mounted in a zygote, by its key (None: the guest image's own
/// packages only).
type SetKey = Option<String>;

/// The cache's policy.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CachePolicy {
    /// How many requests for a package set without a zygote of exactly that set make
    /// one (default 2: the second).
    pub create_after: u32,
    /// The entries' own memory the cache keeps, in KiB (default 4 GiB).
    pub memory_budget_kib: u64,
    /// How long deriving a template may take, in ms (imports in a guest are slow on a
    /// host without hardware virtualization; default 600000).
    pub load_timeout_ms: u64,
}

impl Default for CachePolicy {
    fn default() -> Self {
        Self {
            create_after: 2,
            memory_budget_kib: 4 << 20,
            load_timeout_ms: 600_000,
        }
    }
}

/// Where a request was served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Tier {
    /// The function's template was cached.
    Function,
    /// A zygote of exactly the package set.
    Zygote,
    /// A zygote of part of the package set (the rest imported after it).
    Subset,
    /// The base template (nothing imported before).
    Base,
}

impl Tier {
    /// Its name in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Function => "function",
            Tier::Zygote => "zygote",
            Tier::Subset => "subset",
            Tier::Base => "base",
        }
    }
}

/// The cache's figures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Requests served from each tier.
    pub hits: HashMap<&'static str, u64>,
    /// Zygotes made (a package set's root among them).
    pub zygotes_made: u64,
    /// Package sets' roots made: zygotes with a set's image mounted, nothing imported.
    pub package_sets_mounted: u64,
    /// Functions' templates made.
    pub functions_made: u64,
    /// Entries evicted under the memory budget.
    pub evicted: u64,
    /// Entries now (the base included).
    pub entries: usize,
    /// Their own memory, in KiB.
    pub own_memory_kib: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Key {
    /// A zygote: the package set mounted in it and the modules it imported.
    Zygote(SetKey, Packages),
    Function(String),
}

impl Key {
    /// The base template's key.
    fn base() -> Self {
        Key::Zygote(None, Packages::new())
    }

    /// What a zygote imported (nothing for a function's template: never a parent).
    fn imports(&self) -> Packages {
        match self {
            Key::Zygote(_, p) => p.clone(),
            Key::Function(_) => Packages::new(),
        }
    }
}

type Slot = Arc<OnceCell<Arc<Template>>>;

#[derive(Debug)]
struct Entry {
    slot: Slot,
    /// The entry it was derived from (None: the base).
    parent: Option<Key>,
    /// What a function's template loaded (to tell a new version from the cached one).
    load: Option<Load>,
    own_kib: u64,
    last_used: Instant,
    /// A package set's root: keeps the set's image in the package cache.
    _hold: Option<PackageHold>,
}

#[derive(Debug)]
struct State {
    policy: CachePolicy,
    entries: HashMap<Key, Entry>,
    asked: HashMap<(SetKey, Packages), u32>,
    stats: CacheStats,
    /// Where functions' requirements are resolved.
    packages: Option<(PackageCache, PackageSource)>,
}

/// The zygote tree: shared by every task of a scheduler (`Clone` is cheap).
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
/// # let tiny = root.join("target/guest/tiny.elf");
/// # let vmm = root.join("target/debug/vmm");
/// # if !std::path::Path::new("/dev/kvm").exists() || !tiny.exists() || !vmm.exists() {
/// #     assert!(std::env::var_os("CI").is_none(), "CI needs /dev/kvm, tiny.elf and vmm");
/// #     eprintln!("SKIPPED: no /dev/kvm, target/guest/tiny.elf or target/debug/vmm");
/// #     return Ok(());
/// # }
/// # let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
/// # rt.block_on(async {
/// use forkvm::{CachePolicy, Load, Template, TemplateSpec, Tier, ZygoteCache};
///
/// // The base: a runtime that loads (forkvm's tiny guest here; the Python runtime,
/// // `python3 -m forkvm`, in a real deployment).
/// let mut spec = TemplateSpec::new(&tiny);
/// spec.vmm = vmm;
/// spec.cmdline = Some("invoke=1 load=1".into());
/// spec.mem_mib = 64;
/// spec.args = vec!["--ap-boot".into(), "direct".into()];
/// let cache = ZygoteCache::new(Template::start(spec).await?, CachePolicy::default()).await?;
///
/// let mut load = Load::imports(["json"]);
/// load.source = Some("def handler(event):\n    return event\n".into());
/// let (f, tier) = cache.function("echo", &load).await?;
/// assert_eq!(tier, Tier::Base); // derived from the base: nothing imported before
/// let (again, tier) = cache.function("echo", &load).await?;
/// assert_eq!(tier, Tier::Function); // cached
/// assert!(f.invoke(&b"hi"[..], &Default::default()).await?.body.starts_with(b"hi"));
/// # drop((f, again));
/// # Ok::<_, forkvm::Error>(())
/// # })?;
/// // Dropped templates stop on the library's threads: wait for them before exiting.
/// forkvm::wait_stopped(std::time::Duration::from_secs(10));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ZygoteCache {
    state: Arc<Mutex<State>>,
}

/// The largest subset of `want` among `sets` (ties: the latest `used`), as an index.
fn best_subset<'a>(
    want: &Packages,
    sets: impl Iterator<Item = (&'a Packages, Instant)>,
) -> Option<&'a Packages> {
    sets.filter(|(s, _)| s.is_subset(want))
        .max_by_key(|(s, used)| (s.len(), *used))
        .map(|(s, _)| s)
}

impl ZygoteCache {
    /// A cache whose root is `base`, a ready template whose runtime loads (the Python
    /// runtime, `python3 -m forkvm`).
    #[tracing::instrument(level = "debug", name = "zygotes.new", skip_all)]
    pub async fn new(base: Template, policy: CachePolicy) -> Result<Self, Error> {
        let own_kib = base.status().await?.invoke.own_memory_kib.unwrap_or(0);
        let slot = Arc::new(OnceCell::new_with(Some(Arc::new(base))));
        let entry = Entry {
            slot,
            parent: None,
            load: None,
            own_kib,
            last_used: Instant::now(),
            _hold: None,
        };
        let mut state = State {
            policy,
            entries: HashMap::new(),
            asked: HashMap::new(),
            stats: CacheStats::default(),
            packages: None,
        };
        state.entries.insert(Key::base(), entry);
        Ok(Self {
            state: Arc::new(Mutex::new(state)),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The base template (the tree's root): watch it with [`Template::died`].
    pub fn base(&self) -> Arc<Template> {
        let s = self.lock();
        let base = s.entries.get(&Key::base());
        base.and_then(|e| e.slot.get().cloned())
            .expect("the base is never evicted")
    }

    /// The policy now.
    pub fn policy(&self) -> CachePolicy {
        self.lock().policy.clone()
    }

    /// Sets the memory budget, in KiB, and evicts down to it now.
    pub fn set_memory_budget(&self, kib: u64) {
        self.lock().policy.memory_budget_kib = kib;
        self.evict();
    }

    /// The cache's figures now.
    pub fn stats(&self) -> CacheStats {
        let s = self.lock();
        CacheStats {
            entries: s.entries.len(),
            own_memory_kib: s.entries.values().map(|e| e.own_kib).sum(),
            ..s.stats.clone()
        }
    }

    /// Functions' requirements are resolved by `packages` from `source` from now on
    /// ([`Load::requirements`]); the base template needs a disk slot for them
    /// ([`PACKAGE_SLOT`]).
    pub fn with_packages(self, packages: PackageCache, source: PackageSource) -> Self {
        self.lock().packages = Some((packages, source));
        self
    }

    /// What the zygotes now cached imported, over the guest image's packages only (the
    /// base's is empty).
    pub fn zygotes(&self) -> Vec<Packages> {
        let mut sets: Vec<Packages> = (self.zygote_keys().into_iter())
            .filter_map(|(set, p)| set.is_none().then_some(p))
            .collect();
        sets.sort();
        sets
    }

    /// The zygotes now cached over package sets: each set's key ([`PackageSet::key`])
    /// and what the zygote imported (empty: the set's root, the base with the set's
    /// image mounted).
    pub fn package_zygotes(&self) -> Vec<(String, Packages)> {
        let mut sets: Vec<(String, Packages)> = (self.zygote_keys().into_iter())
            .filter_map(|(set, p)| Some((set?, p)))
            .collect();
        sets.sort();
        sets
    }

    fn zygote_keys(&self) -> Vec<(SetKey, Packages)> {
        let s = self.lock();
        (s.entries.iter())
            .filter_map(|(k, e)| match k {
                Key::Zygote(set, p) if e.slot.initialized() => Some((set.clone(), p.clone())),
                _ => None,
            })
            .collect()
    }

    /// A zygote of exactly `packages`, made now (from the best zygote for them) unless
    /// it is cached: a scheduler warms the cache for package sets it expects.
    #[tracing::instrument(level = "debug", name = "zygotes.prepare", skip_all)]
    pub async fn prepare(&self, packages: &Packages) -> Result<Arc<Template>, Error> {
        self.prepare_in(None, packages).await
    }

    /// [`ZygoteCache::prepare`] over the package set `requirements` resolve to.
    #[tracing::instrument(level = "debug", name = "zygotes.prepare_with", skip_all)]
    pub async fn prepare_with(
        &self,
        requirements: &[String],
        packages: &Packages,
    ) -> Result<Arc<Template>, Error> {
        let (set, _hold) = self.resolve_held(requirements).await?;
        self.prepare_in(Some(&set), packages).await
    }

    async fn prepare_in(
        &self,
        set: Option<&PackageSet>,
        packages: &Packages,
    ) -> Result<Arc<Template>, Error> {
        let set_key = self.mount(set).await?;
        let (key, tier) = {
            let s = self.lock();
            self.best(&s, &set_key, packages)
        };
        if tier == Tier::Zygote {
            return self.touch(&key);
        }
        let load = Load {
            imports: packages.difference(&key.imports()).cloned().collect(),
            ..Default::default()
        };
        let exact = Key::Zygote(set_key, packages.clone());
        self.derive_entry(exact, key, load, None, Vec::new(), None)
            .await
    }

    /// The best zygote for `packages` and its tier, making a zygote of exactly
    /// `packages` when they have been asked for often enough.
    #[tracing::instrument(level = "debug", name = "zygotes.zygote", skip_all)]
    pub async fn zygote(&self, packages: &Packages) -> Result<(Arc<Template>, Tier), Error> {
        self.zygote_in(None, packages).await
    }

    async fn zygote_in(
        &self,
        set: Option<&PackageSet>,
        packages: &Packages,
    ) -> Result<(Arc<Template>, Tier), Error> {
        let set_key = self.mount(set).await?;
        let (key, tier, create) = {
            let mut s = self.lock();
            let asked = s.asked.entry((set_key.clone(), packages.clone()));
            let asked = *asked.and_modify(|n| *n += 1).or_insert(1);
            let (best, tier) = self.best(&s, &set_key, packages);
            let create = tier != Tier::Zygote && asked >= s.policy.create_after;
            (best, tier, create)
        };
        if create {
            return Ok((self.prepare_in(set, packages).await?, tier));
        }
        Ok((self.touch(&key)?, tier))
    }

    /// The best cached zygote for `packages` over package set `set`: its key and tier.
    fn best(&self, s: &State, set: &SetKey, packages: &Packages) -> (Key, Tier) {
        let sets = (s.entries.iter()).filter_map(|(k, e)| match k {
            Key::Zygote(kset, p) if kset == set && e.slot.initialized() => Some((p, e.last_used)),
            _ => None,
        });
        let best = best_subset(packages, sets).cloned().unwrap_or_default();
        let tier = match (best.len(), best.len() == packages.len()) {
            (_, true) => Tier::Zygote,
            (0, false) => Tier::Base,
            _ => Tier::Subset,
        };
        (Key::Zygote(set.clone(), best), tier)
    }

    /// The package set `requirements` resolve to, from the cache's package cache
    /// ([`ZygoteCache::with_packages`]).
    #[tracing::instrument(level = "debug", name = "zygotes.package_set", skip_all)]
    pub async fn package_set(&self, requirements: &[String]) -> Result<PackageSet, Error> {
        Ok(self.resolve_held(requirements).await?.0)
    }

    /// [`ZygoteCache::package_set`], its image held from eviction until the hold goes.
    async fn resolve_held(
        &self,
        requirements: &[String],
    ) -> Result<(PackageSet, PackageHold), Error> {
        let (cache, source) = self.lock().packages.clone().ok_or(Error::Unsupported(
            "requirements need a package cache (ZygoteCache::with_packages)",
        ))?;
        let set = cache.resolve(requirements, &source).await?;
        let hold = cache.hold(&set.key);
        if set.image.exists() {
            return Ok((set, hold));
        }
        // Evicted by another resolution before the hold: made again, now held.
        let set = cache.resolve(requirements, &source).await?;
        Ok((set, hold))
    }

    /// The key of package set `set`, its root zygote made first unless it is cached:
    /// the base template with the set's image in [`PACKAGE_SLOT`], mounted first on
    /// `sys.path`, nothing imported.
    async fn mount(&self, set: Option<&PackageSet>) -> Result<SetKey, Error> {
        let Some(set) = set else { return Ok(None) };
        let key = Key::Zygote(Some(set.key.clone()), Packages::new());
        let hold = {
            let s = self.lock();
            if s.entries.get(&key).is_some_and(|e| e.slot.initialized()) {
                return Ok(Some(set.key.clone()));
            }
            (s.packages.as_ref()).map(|(cache, _)| cache.hold(&set.key))
        };
        let load = Load {
            disks: vec![PACKAGE_SLOT],
            ..Default::default()
        };
        let media = vec![InsertMedium {
            slot: PACKAGE_SLOT,
            path: set.image.clone(),
            writable: false,
        }];
        self.derive_entry(key, Key::base(), load, None, media, hold)
            .await?;
        Ok(Some(set.key.clone()))
    }

    /// The template of `key`, marked used now.
    fn touch(&self, key: &Key) -> Result<Arc<Template>, Error> {
        let mut s = self.lock();
        let e = s.entries.get_mut(key).ok_or(Error::Evicted)?;
        e.last_used = Instant::now();
        e.slot.get().cloned().ok_or(Error::Evicted)
    }

    /// Function `name`'s template: cached ([`Tier::Function`]), or derived from the best
    /// zygote for `load.imports` with `load` (the function's source and handler); the
    /// tier says which. A `load` other than the cached one's replaces it.
    #[tracing::instrument(level = "debug", name = "zygotes.function", skip_all, fields(function = name))]
    pub async fn function(&self, name: &str, load: &Load) -> Result<(Arc<Template>, Tier), Error> {
        let key = Key::Function(name.to_string());
        let cached = {
            let s = self.lock();
            (s.entries.get(&key)).map(|e| (e.load.as_ref() == Some(load), e.slot.initialized()))
        };
        match cached {
            Some((true, true)) => {
                self.count(Tier::Function);
                return Ok((self.touch(&key)?, Tier::Function));
            }
            Some((false, _)) => self.remove_function(name),
            _ => {}
        }
        let set = match load.requirements.is_empty() {
            true => None,
            false => Some(self.resolve_held(&load.requirements).await?),
        };
        let set = set.as_ref().map(|(set, _hold)| set);
        let (zygote, tier) = self.zygote_in(set, &load.imports).await?;
        let parent = self.key_of(&zygote).ok_or(Error::Evicted)?;
        let own = Load {
            imports: load
                .imports
                .difference(&parent.imports())
                .cloned()
                .collect(),
            requirements: Vec::new(),
            ..load.clone()
        };
        let t = self
            .derive_entry(key, parent, own, Some(load.clone()), Vec::new(), None)
            .await?;
        self.count(tier);
        Ok((t, tier))
    }

    fn count(&self, tier: Tier) {
        *self.lock().stats.hits.entry(tier.as_str()).or_default() += 1;
    }

    fn key_of(&self, t: &Arc<Template>) -> Option<Key> {
        let s = self.lock();
        (s.entries.iter())
            .find(|(_, e)| e.slot.get().is_some_and(|x| Arc::ptr_eq(x, t)))
            .map(|(k, _)| k.clone())
    }

    /// Forgets function `name`'s template (a new version, or the function deleted); its
    /// VMM stops once no caller holds it.
    pub fn remove_function(&self, name: &str) {
        let gone = self.lock().entries.remove(&Key::Function(name.to_string()));
        if let Some(e) = gone {
            dispose(e.slot);
        }
    }

    /// The entry `key`, derived from `parent` with `load` and `media` in its disk slots
    /// (or being derived by another caller: then its result); `function`: the whole
    /// load of a function's template, to tell a new version from it; `hold`: the
    /// package set a set's root keeps.
    async fn derive_entry(
        &self,
        key: Key,
        parent: Key,
        load: Load,
        function: Option<Load>,
        media: Vec<InsertMedium>,
        hold: Option<PackageHold>,
    ) -> Result<Arc<Template>, Error> {
        let slot = {
            let mut s = self.lock();
            let entry = s.entries.entry(key.clone()).or_insert_with(|| Entry {
                slot: Arc::new(OnceCell::new()),
                parent: Some(parent.clone()),
                load: function,
                own_kib: 0,
                last_used: Instant::now(),
                _hold: hold,
            });
            entry.slot.clone()
        };
        let from = self.touch(&parent)?;
        let options = InvokeOptions {
            timeout_ms: Some(self.policy().load_timeout_ms),
            media,
            resource_class: load.class.clone(),
            ..Default::default()
        };
        let made = slot
            .get_or_try_init(|| async {
                let (t, _) = from.derive(load.payload(), &options).await?;
                // A function's first requests would learn its working set otherwise.
                if let (Key::Function(name), false) = (&key, load.warmup.is_empty()) {
                    let run = InvokeOptions {
                        timeout_ms: Some(self.policy().load_timeout_ms),
                        ..Default::default()
                    };
                    if let Err(e) = t.rehearse(&load.warmup, &run).await {
                        tracing::warn!("function {name}: rehearsing its warm-up failed: {e}");
                    }
                }
                let own = t.status().await?.invoke.own_memory_kib.unwrap_or(0);
                let mut s = self.lock();
                if let Some(e) = s.entries.get_mut(&key) {
                    e.own_kib = own;
                }
                match &key {
                    Key::Function(_) => s.stats.functions_made += 1,
                    Key::Zygote(Some(_), p) if p.is_empty() => {
                        s.stats.zygotes_made += 1;
                        s.stats.package_sets_mounted += 1;
                    }
                    Key::Zygote(..) => s.stats.zygotes_made += 1,
                }
                Ok::<_, Error>(Arc::new(t))
            })
            .await;
        let made = match made {
            Ok(t) => t.clone(),
            Err(e) => {
                // Nothing cached: the next request tries again.
                let mut s = self.lock();
                if s.entries.get(&key).is_some_and(|e| !e.slot.initialized()) {
                    s.entries.remove(&key);
                }
                return Err(e);
            }
        };
        self.evict();
        Ok(made)
    }

    /// Stops least recently used leaves until the entries' own memory is within the
    /// budget (or nothing more can go).
    fn evict(&self) {
        let mut s = self.lock();
        loop {
            let total: u64 = s.entries.values().map(|e| e.own_kib).sum();
            if total <= s.policy.memory_budget_kib {
                return;
            }
            let parents: BTreeSet<&Key> = s
                .entries
                .values()
                .filter_map(|e| e.parent.as_ref())
                .collect();
            let victim = (s.entries.iter())
                .filter(|(k, e)| {
                    e.parent.is_some()
                        && !parents.contains(k)
                        && e.slot.get().is_some_and(|t| Arc::strong_count(t) == 1)
                })
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone());
            let Some(victim) = victim else { return };
            if let Some(e) = s.entries.remove(&victim) {
                s.stats.evicted += 1;
                dispose(e.slot);
            }
        }
    }
}

/// Stops a template no longer cached, off the async threads (a VMM's stop blocks up
/// to 2 s), once nobody else holds it.
fn dispose(slot: Slot) {
    let t = Arc::into_inner(slot).and_then(OnceCell::into_inner);
    if let Some(t) = t {
        match tokio::runtime::Handle::try_current() {
            Ok(h) => drop(h.spawn_blocking(move || drop(t))),
            Err(_) => drop(t),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(names: &[&str]) -> Packages {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_best_zygote_is_the_largest_subset_never_a_superset() {
        let now = Instant::now();
        let later = now + std::time::Duration::from_secs(1);
        let base = set(&[]);
        let np = set(&["numpy"]);
        let js = set(&["json"]);
        let npjs = set(&["json", "numpy"]);
        let all = [(&base, now), (&np, now), (&js, later), (&npjs, now)];
        let best = |want: &[&str]| best_subset(&set(want), all.iter().copied()).cloned();
        assert_eq!(best(&["numpy", "json", "os"]), Some(npjs.clone()));
        assert_eq!(best(&["numpy", "os"]), Some(np.clone()));
        assert_eq!(best(&["os"]), Some(base.clone()));
        assert_eq!(best(&["json", "numpy"]), Some(npjs));
        // Two subsets of one size: the one used last.
        let two = [(&np, now), (&js, later)];
        let want = set(&["json", "numpy", "x"]);
        assert_eq!(best_subset(&want, two.iter().copied()), Some(&js));
        // No subset at all.
        assert_eq!(best_subset(&set(&["os"]), [(&np, now)].into_iter()), None);
    }
}
