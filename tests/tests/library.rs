//! The `forkvm` library (the embedding layer) against the tiny guest: a template
//! it starts and owns, invocations in fresh clones (many at once), errors typed by
//! whose they are, and nothing left behind once the handle is gone.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use forkvm::{Error, ErrorKind, InvokeOptions, Outcome, Template, TemplateSpec};
use tests::{guest_file, kvm_available, vmm_bin};

fn tiny_spec(cmdline: &str) -> TemplateSpec {
    let mut spec = TemplateSpec::new(guest_file("tiny.elf"));
    spec.vmm = vmm_bin();
    spec.cmdline = Some(cmdline.into());
    spec.mem_mib = 64;
    spec.warm_clones = 2;
    spec.options.mailbox_mib = Some(1);
    spec.args = ["--ap-boot", "direct"].map(String::from).to_vec();
    spec.start_timeout = Duration::from_secs(30);
    spec
}

/// Processes whose parent is `pid`.
fn children_of(pid: u32) -> usize {
    let path = format!("/proc/{pid}/task/{pid}/children");
    std::fs::read_to_string(path)
        .map(|s| s.split_whitespace().count())
        .unwrap_or(0)
}

/// `VmmOptions::rewind`: the library's template rewinds its invocation clones. One at a
/// time, the same two processes serve every request, each an echo whose guest request
/// count is 1 (the tiny guest's trailer after the payload: clone number, then the
/// guest's own sequence number), as in a fresh clone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_with_rewind_serves_each_request_in_a_clone_put_back_in_its_state() {
    if !kvm_available("library_rewind") {
        return;
    }
    let mut spec = tiny_spec("ticks=1 invoke=1");
    spec.options.rewind = true;
    let t = Template::start(spec).await.unwrap();
    let pid = t.pid();
    let t = &t;
    let ready = || async move { t.status().await.unwrap().warm_clones.ready == 2 };
    let children = || std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"));
    until_async("two warm clones", ready).await;
    // The first requests' clones report the template's working set, and the warm
    // clones made before are replaced (docs/invoke.md): the processes are taken after
    // three requests, once the pool has not changed for a second.
    let (mut processes, mut ids) = (String::new(), HashSet::new());
    for i in 0..11 {
        if i == 3 {
            loop {
                let before = children().unwrap();
                tokio::time::sleep(Duration::from_secs(1)).await;
                let two = before.split_whitespace().count() == 2;
                if two && children().unwrap() == before && ready().await {
                    processes = before;
                    break;
                }
            }
        }
        let payload = format!("again {i}");
        let r = t
            .invoke(payload.clone(), &InvokeOptions::default())
            .await
            .unwrap();
        assert!(r.body.starts_with(payload.as_bytes()), "{r:?}");
        let trailer = &r.body[payload.len()..];
        let seq = u64::from_le_bytes(trailer[8..16].try_into().unwrap());
        assert_eq!(seq, 1, "the guest's memory was not put back");
        assert!(ids.insert(r.clone_id.clone()), "clone {} twice", r.clone_id);
        until_async("the clone to come back", ready).await;
    }
    assert_eq!(children().unwrap(), processes, "a clone was forked or lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_serves_invocations_in_parallel_clones_and_types_its_errors() {
    if !kvm_available("library_template") {
        return;
    }
    let t = Arc::new(
        Template::start(tiny_spec("ticks=1 invoke=1"))
            .await
            .unwrap(),
    );
    let pid = t.pid();
    let dir: PathBuf = t.socket().parent().unwrap().to_path_buf();
    assert!(t.status().await.unwrap().invoke.waiting);

    // 16 at once: each its own clone, its payload back.
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..16 {
        let payload = format!("request {i}");
        let t = t.clone();
        calls.spawn(async move {
            let r = t.invoke(payload.clone(), &InvokeOptions::default()).await;
            (payload, r.unwrap())
        });
    }
    let replies = calls.join_all().await;
    let mut clones = HashSet::new();
    for (payload, r) in &replies {
        assert!(r.body.starts_with(payload.as_bytes()), "{r:?}");
        assert!(
            clones.insert(r.clone_id.clone()),
            "clone {} twice",
            r.clone_id
        );
        assert!(r.total_us >= r.handler_us);
    }

    // The guest's failures: the handler fails, or hangs past the timeout.
    let e = t
        .invoke(&b"fail"[..], &InvokeOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Invocation {
                outcome: Outcome::HandlerError,
                status: 500,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(e.kind(), ErrorKind::Guest);
    let quick = InvokeOptions {
        timeout_ms: Some(300),
        ..Default::default()
    };
    let e = t.invoke(&b"hang"[..], &quick).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Invocation {
                outcome: Outcome::Timeout,
                ..
            }
        ),
        "{e}"
    );
    // The caller's: a payload larger than the mailbox (1 MiB).
    let big = vec![0u8; 2 << 20];
    let e = t.invoke(big, &InvokeOptions::default()).await.unwrap_err();
    assert!(matches!(e, Error::Refused { status: 413, .. }), "{e}");
    assert_eq!(e.kind(), ErrorKind::Caller);
    // A future dropped mid-way (cancelled) leaves no clone behind.
    let slow = InvokeOptions {
        timeout_ms: Some(500),
        ..Default::default()
    };
    let cancelled =
        tokio::time::timeout(Duration::from_millis(50), t.invoke(&b"hang"[..], &slow)).await;
    assert!(cancelled.is_err(), "the hanging handler answered");
    // Served on after all of it.
    let r = t
        .invoke(&b"after"[..], &InvokeOptions::default())
        .await
        .unwrap();
    assert!(r.body.starts_with(b"after"));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while children_of(pid) != 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "clones left: {}",
            children_of(pid)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Dropped: the VMM is stopped, its clones and its directory gone, once the stop
    // the drop started (without blocking) is done.
    drop(Arc::into_inner(t).expect("the only handle"));
    assert!(stops_finished().await);
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists() || zombie(pid));
    assert!(!dir.exists(), "{} left behind", dir.display());
}

/// Whether `pid` has ended: gone, or a zombie (Z) or being reaped (X) by its parent.
fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.contains(") Z ") || s.contains(") X "))
        .unwrap_or(true)
}

#[test]
fn a_template_that_cannot_start_says_why_and_the_blocking_facade_works() {
    if !kvm_available("library_blocking") {
        return;
    }
    // A kernel that does not exist: the VMM exits, and the error says so.
    let mut spec = tiny_spec("invoke=1");
    spec.kernel = "/nonexistent/kernel".into();
    let e = forkvm::blocking::Template::start(spec).unwrap_err();
    assert!(matches!(e, Error::Exited { .. }), "{e}");
    assert_eq!(e.kind(), ErrorKind::Host);
    // A guest whose runtime never waits: the start times out.
    let mut spec = tiny_spec("ticks=1");
    spec.start_timeout = Duration::from_millis(1500);
    let e = forkvm::blocking::Template::start(spec).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");

    let t = forkvm::blocking::Template::start(tiny_spec("ticks=1 invoke=1")).unwrap();
    let r = t
        .invoke(&b"blocking"[..], &InvokeOptions::default())
        .unwrap();
    assert!(r.body.starts_with(b"blocking"));
    assert_eq!(t.status().unwrap().warm_clones.target, 2);
    t.shutdown().unwrap();
}

/// Whether every stop a drop started (without blocking) finished within 10 s.
async fn stops_finished() -> bool {
    tokio::task::spawn_blocking(|| forkvm::wait_stopped(Duration::from_secs(10)))
        .await
        .unwrap()
}

fn gone(pid: u32) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists() || zombie(pid)
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn derived_templates_form_a_tree_that_lives_as_long_as_its_handles() {
    if !kvm_available("library_derive") {
        return;
    }
    // The tiny guest's loader keeps a load's first 8 bytes; "show" answers them.
    let root = Template::start(tiny_spec("ticks=1 invoke=1 prime=1 load=1"))
        .await
        .unwrap();
    let root_pid = root.pid();
    let opts = InvokeOptions::default();
    let (numpy, reply) = root.derive(&b"numpy\0\0\0"[..], &opts).await.unwrap();
    assert_eq!(numpy.clone_id(), Some(reply.clone_id.as_str()));
    assert!(numpy.socket().exists());
    let info = numpy.status().await.unwrap();
    assert!(info.invoke.template && info.invoke.waiting, "{info:?}");
    assert!(info.invoke.own_memory_kib.is_some_and(|k| k > 0));
    let r = numpy.invoke(&b"show"[..], &opts).await.unwrap();
    assert_eq!(&r.body[..], b"numpy\0\0\0");
    assert!(r.clone_id.starts_with(&format!("{}.", reply.clone_id)));
    let (json, _) = numpy.derive(&b"json\0\0\0\0"[..], &opts).await.unwrap();
    assert_eq!(
        &json.invoke(&b"show"[..], &opts).await.unwrap().body[..],
        b"json\0\0\0\0"
    );
    assert_eq!(
        &root.invoke(&b"show"[..], &opts).await.unwrap().body[..],
        [0u8; 8]
    );

    // A derived template whose VMM dies is reported, with how it ended; its parent
    // serves on, and can derive another.
    let json_pid = json.pid();
    let died = tokio::spawn(async move { (json.died().await, json) });
    // SAFETY: a process this test's template made; signalled by pid while it lives.
    unsafe { libc::kill(json_pid as i32, libc::SIGKILL) };
    let (e, json) = tokio::time::timeout(Duration::from_secs(10), died)
        .await
        .expect("died() resolves")
        .unwrap();
    assert!(matches!(e, Error::Exited { .. }), "{e}");
    assert!(json.status().await.is_err());
    drop(json);
    let (json, _) = numpy.derive(&b"json2\0\0\0"[..], &opts).await.unwrap();

    // Dropping the root handle keeps its VMM while templates derived from it live;
    // dropping them stops every VMM of the tree.
    let numpy_pid = numpy.pid();
    let json_pid = json.pid();
    drop(root);
    assert!(
        !gone(root_pid),
        "the root went while derived templates live"
    );
    assert_eq!(
        &json.invoke(&b"show"[..], &opts).await.unwrap().body[..],
        b"json2\0\0\0"
    );
    drop(numpy);
    assert!(!gone(numpy_pid) && !gone(root_pid));
    drop(json);
    until("every VMM of the tree to end", || {
        gone(json_pid) && gone(numpy_pid) && gone(root_pid)
    })
    .await;

    // A runtime that loads nothing: the caller's error, 409.
    let plain = Template::start(tiny_spec("ticks=1 invoke=1"))
        .await
        .unwrap();
    let e = plain.derive(&b"numpy"[..], &opts).await.unwrap_err();
    assert!(matches!(e, Error::Refused { status: 409, .. }), "{e}");
    assert_eq!(e.kind(), ErrorKind::Caller);
    plain.shutdown().await.unwrap();
}

fn packages(names: &[&str]) -> forkvm::Packages {
    names.iter().map(|s| s.to_string()).collect()
}

fn function_load(imports: &[&str], source: &str) -> forkvm::Load {
    let mut load = forkvm::Load::default();
    load.imports = packages(imports);
    load.source = Some(source.into());
    load
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_zygote_cache_picks_subsets_makes_zygotes_when_asked_twice_and_evicts_lru_leaves() {
    if !kvm_available("library_zygotes") {
        return;
    }
    use forkvm::{CachePolicy, Tier, ZygoteCache};
    // The tiny guest's loader takes any load (it keeps 8 bytes): the cache's policy is
    // what is tested here; the Python loader's effect is in linux_invoke.rs.
    let mut spec = tiny_spec("ticks=1 invoke=1 prime=1 load=1");
    spec.warm_clones = 1;
    let base = Template::start(spec).await.unwrap();
    let base_pid = base.pid();
    let mut policy = CachePolicy::default();
    policy.create_after = 2;
    let cache = ZygoteCache::new(base, policy).await.unwrap();
    let a = function_load(&["a"], "one");
    let (f1, tier) = cache.function("f1", &a).await.unwrap();
    assert_eq!(tier, Tier::Base, "the first ask of {{a}}: no zygote yet");
    let (again, tier) = cache.function("f1", &a).await.unwrap();
    assert_eq!(tier, Tier::Function);
    assert!(Arc::ptr_eq(&f1, &again));
    assert!(f1
        .invoke(&b"show"[..], &InvokeOptions::default())
        .await
        .is_ok());
    // The second ask of {a}: a zygote of {a} is made (from the base), and f2 from it.
    let (f2, tier) = cache
        .function("f2", &function_load(&["a"], "two"))
        .await
        .unwrap();
    assert_eq!(tier, Tier::Base, "this request paid for the imports");
    assert_eq!(cache.zygotes(), vec![packages(&[]), packages(&["a"])]);
    let za = f2
        .clone_id()
        .unwrap()
        .rsplit_once('.')
        .unwrap()
        .0
        .to_string();
    // {a, b}: the {a} zygote is the largest subset; {b}: never the {a} zygote.
    let (f3, tier) = cache
        .function("f3", &function_load(&["a", "b"], "three"))
        .await
        .unwrap();
    assert_eq!(tier, Tier::Subset);
    assert!(f3.clone_id().unwrap().starts_with(&format!("{za}.")));
    let (f4, tier) = cache
        .function("f4", &function_load(&["b"], "four"))
        .await
        .unwrap();
    assert_eq!(tier, Tier::Base);
    assert!(
        !f4.clone_id().unwrap().contains('.'),
        "f4 derives from the base"
    );
    let (f5, tier) = cache
        .function("f5", &function_load(&["a"], "five"))
        .await
        .unwrap();
    assert_eq!(tier, Tier::Zygote);
    // Cached, whatever part of its packages its zygote had.
    let (f5_again, tier) = cache
        .function("f5", &function_load(&["a"], "five"))
        .await
        .unwrap();
    assert_eq!(tier, Tier::Function);
    assert!(Arc::ptr_eq(&f5, &f5_again));
    drop(f5_again);
    // A new version of f1 replaces it.
    let (f1b, tier) = cache
        .function("f1", &function_load(&["a"], "one, v2"))
        .await
        .unwrap();
    assert_eq!(tier, Tier::Zygote);
    assert!(!Arc::ptr_eq(&f1, &f1b));
    let stats = cache.stats();
    assert_eq!(stats.zygotes_made, 1, "{stats:?}");
    assert_eq!(stats.functions_made, 6, "{stats:?}");
    assert_eq!(stats.entries, 7, "base, {{a}}, f1..f5: {stats:?}");
    assert!(stats.own_memory_kib > 0);
    for (tier, n) in [("function", 2), ("zygote", 2), ("subset", 1), ("base", 3)] {
        assert_eq!(
            stats.hits.get(tier).copied().unwrap_or(0),
            n,
            "{tier}: {stats:?}"
        );
    }

    // Under a smaller budget the least recently used leaves nobody holds go first;
    // the {a} zygote has children and the base is never evicted.
    let old_f1 = f1.pid();
    drop((f1, again));
    until("the old f1 to stop", || gone(old_f1)).await;
    let (f2_pid, f4_pid) = (f2.pid(), f4.pid());
    drop((f2, f4));
    cache.set_memory_budget(stats.own_memory_kib - 1);
    let after = cache.stats();
    assert_eq!(after.evicted, 1, "{after:?}");
    until("f2 (used first) to stop", || gone(f2_pid)).await;
    assert!(!gone(f4_pid));
    // Held leaves are not evicted; the base and {a} stay whatever the budget.
    cache.set_memory_budget(0);
    let after = cache.stats();
    assert_eq!(
        after.entries, 5,
        "base, {{a}}, f3, f5 and f1b held: {after:?}"
    );
    until("f4 to stop", || gone(f4_pid)).await;
    let (f5_pid, f3_pid) = (f5.pid(), f3.pid());
    drop((f3, f5, f1b));
    cache.set_memory_budget(0);
    assert_eq!(
        cache.stats().entries,
        1,
        "only the base: {:?}",
        cache.stats()
    );
    until("f3 and f5 to stop", || gone(f5_pid) && gone(f3_pid)).await;
    // A zygote made ahead of requests, once.
    let c = cache.prepare(&packages(&["c"])).await.unwrap();
    assert_eq!(cache.zygotes(), vec![packages(&[]), packages(&["c"])]);
    assert!(Arc::ptr_eq(
        &c,
        &cache.prepare(&packages(&["c"])).await.unwrap()
    ));
    drop(c);
    drop(cache);
    until("the base to stop", || gone(base_pid)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_made_on_request_serve_in_place_and_go_with_their_handles() {
    if !kvm_available("library_clones") {
        return;
    }
    let t = Template::start(tiny_spec("ticks=1 invoke=1"))
        .await
        .unwrap();
    let request = forkvm::CreateClones {
        count: 2,
        ..Default::default()
    };
    let mut clones = t.create_clones(&request).await.unwrap();
    assert_eq!(clones.len(), 2);
    assert_ne!(clones[0].id(), clones[1].id());
    let keep = InvokeOptions {
        keep_alive: true,
        ..Default::default()
    };
    let c = clones.pop().unwrap();
    assert!(!c.status().await.unwrap().invoke.template);
    for i in 0..3 {
        let r = c.invoke(format!("in place {i}"), &keep).await.unwrap();
        assert!(r.body.starts_with(format!("in place {i}").as_bytes()));
        assert_eq!(r.clone_id, c.id(), "served in place, by the clone itself");
    }
    // Its last invocation: the clone ends after answering.
    let r = c
        .invoke(&b"last"[..], &InvokeOptions::default())
        .await
        .unwrap();
    assert!(r.body.starts_with(b"last"));
    until("the clone to end", || !c.is_alive()).await;
    // No agent in the tiny guest: a clear error, not a hang.
    let other = clones.pop().unwrap();
    let e = other.exec(1024, "true", b"").await.unwrap_err();
    assert!(matches!(e, Error::Agent(_)), "{e}");
    let pid = other.pid();
    drop(other);
    until("a dropped clone to be stopped", || gone(pid)).await;
    let again = t
        .create_clones(&Default::default())
        .await
        .unwrap()
        .pop()
        .unwrap();
    let pid = again.pid();
    again.delete().await.unwrap();
    until("a deleted clone to be stopped", || gone(pid)).await;
    // A class the template does not have: the caller's error.
    let bad = forkvm::CreateClones {
        resource_class: Some("nope".into()),
        ..Default::default()
    };
    let e = t.create_clones(&bad).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Caller, "{e}");
    t.shutdown().await.unwrap();
}

/// The `Uid` and `NSpid` lines of `/proc/<pid>/status`.
fn uid_and_nspid(pid: u32) -> (String, String) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |k: &str| {
        (status.lines())
            .find_map(|l| l.strip_prefix(k))
            .unwrap_or("")
            .trim()
            .to_string()
    };
    (field("Uid:"), field("NSpid:"))
}

/// A pid that ran and ended (the sweep's test for a library process that is gone).
fn ended_pid() -> u32 {
    let mut c = std::process::Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jailed_template_invokes_derives_and_clones_and_leaves_nothing() {
    if !tests::kvm_and_root_available("library_jail") {
        return;
    }
    const UID: u32 = 60131;
    let scratch = tests::Scratch::new("library-jail");
    let base = scratch.path("jails");
    // What a library process killed with SIGKILL leaves: a jail directory, a cgroup
    // parent, a template directory. The next start removes them.
    let dead = ended_pid();
    let stale_jail = base.join("vmm").join(format!("lib-{dead}-0"));
    std::fs::create_dir_all(stale_jail.join("root")).unwrap();
    std::fs::write(stale_jail.join("root/console"), b"old").unwrap();
    // On cgroup v1, the jailer's controllers (on v2 the jailer cleans its own up).
    let v1 = std::path::Path::new("/sys/fs/cgroup/pids/cgroup.procs").exists();
    let stale_cgroups: Vec<PathBuf> = ["cpu", "cpuacct", "memory", "pids"]
        .iter()
        .map(|c| PathBuf::from(format!("/sys/fs/cgroup/{c}/forkvm-lib-{dead}-0")))
        .filter(|_| v1)
        .collect();
    for c in &stale_cgroups {
        std::fs::create_dir_all(c.join(format!("jail-lib-{dead}-0/vmm"))).unwrap();
    }
    let stale_dir = std::env::temp_dir().join(format!("forkvm-template-{dead}-abc"));
    std::fs::create_dir_all(&stale_dir).unwrap();

    let mut spec = tiny_spec("ticks=1 invoke=1 load=1");
    let small = "memory=64M,pids=64".parse().unwrap();
    spec.options.cgroup_classes = vec![("small".into(), small)];
    let mut jail = forkvm::JailSpec::new(UID, UID + 1);
    jail.jailer = tests::jailer_bin();
    jail.chroot_base = base.clone();
    spec.jail = Some(jail);
    let t = Template::start(spec).await.unwrap();
    assert!(!stale_jail.exists(), "a dead library's jail stays");
    assert!(!stale_dir.exists(), "a dead library's directory stays");
    for c in &stale_cgroups {
        assert!(!c.exists(), "a dead library's cgroup {} stays", c.display());
    }

    // The library's child is the jailer; its socket is in the jail.
    let jailer = t.pid();
    let root = t.socket().parent().unwrap().to_path_buf();
    assert!(
        root.starts_with(&base) && root.ends_with("root"),
        "{root:?}"
    );
    let id = root
        .parent()
        .unwrap()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let r = t
        .invoke(&b"jailed"[..], &InvokeOptions::default())
        .await
        .unwrap();
    assert!(r.body.starts_with(b"jailed"), "{r:?}");

    // A derived template in the jail: its host pid is an unprivileged process in the
    // jail's pid namespace, its socket in the jail.
    let opts = InvokeOptions::default();
    let (derived, _) = t.derive(&b"loaded!\0"[..], &opts).await.unwrap();
    let (uid, nspid) = uid_and_nspid(derived.pid());
    assert!(uid.starts_with(&UID.to_string()), "{uid}");
    assert_eq!(nspid.split_whitespace().count(), 2, "{nspid}");
    assert!(derived.socket().starts_with(&root));
    let shown = derived.invoke(&b"show"[..], &opts).await.unwrap();
    assert_eq!(&shown.body[..], b"loaded!\0");

    // A clone on request, served in place, then stopped through its (host) pidfd.
    // Its clone table: the derived template, with the host's paths and its cgroup's
    // usage.
    let table = t.clone_table().await.unwrap();
    let derived_id = derived.clone_id().unwrap();
    assert!(table.clones.iter().any(|c| c.id == derived_id), "{table:?}");
    for c in &table.clones {
        assert!(c.api_sock.starts_with(&root), "{c:?}");
        assert!(c.cgroup.is_some(), "{c:?}");
    }
    let c = t
        .create_clones(&Default::default())
        .await
        .unwrap()
        .pop()
        .unwrap();
    let keep = InvokeOptions {
        keep_alive: true,
        ..Default::default()
    };
    let r = c.invoke(&b"in place"[..], &keep).await.unwrap();
    assert_eq!(r.clone_id, c.id());
    let clone_pid = c.pid();
    assert!(uid_and_nspid(clone_pid).0.starts_with(&UID.to_string()));
    drop(c);
    until("a dropped jailed clone to be stopped", || gone(clone_pid)).await;

    // Dropped: the jailer and every VMM gone, the jail and its cgroups removed.
    let derived_pid = derived.pid();
    drop(derived);
    drop(t);
    until("the jailer and the derived template to end", || {
        gone(jailer) && gone(derived_pid)
    })
    .await;
    assert!(stops_finished().await);
    assert!(!root.parent().unwrap().exists(), "jail {id} left behind");
    for c in ["cpu", "memory", "pids"] {
        let dir = PathBuf::from(format!("/sys/fs/cgroup/{c}/forkvm-{id}"));
        assert!(!dir.exists(), "{} left behind", dir.display());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_template_is_ready_on_its_console_or_running_and_clones_on_request() {
    if !kvm_available("library_plain") {
        return;
    }
    // No runtime: the tiny guest beats on its console; the library pauses it there.
    let mut spec = tiny_spec("beat=20");
    spec.ready = forkvm::Ready::Console("tiny: beat 2\n".into());
    let t = Template::start(spec).await.unwrap();
    let info = t.status().await.unwrap();
    assert_eq!(info.state, api_types::vm::VmState::Paused, "{info:?}");
    assert!(!info.invoke.waiting);
    until_async("2 warm clones", || async {
        t.status().await.unwrap().warm_clones.ready == 2
    })
    .await;
    // Its clones run on from the pause, beating on their own consoles.
    let c = t
        .create_clones(&Default::default())
        .await
        .unwrap()
        .pop()
        .unwrap();
    until("the clone's beat", || {
        c.console_tail().contains("tiny: beat")
    })
    .await;
    // No runtime waits: an invocation is the caller's error.
    let e = t
        .invoke(&b"x"[..], &InvokeOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Caller, "{e}");
    drop(c);
    t.shutdown().await.unwrap();

    // Ready once it runs: not paused.
    let mut spec = tiny_spec("beat=20");
    spec.ready = forkvm::Ready::Running;
    let t = Template::start(spec).await.unwrap();
    assert_eq!(
        t.status().await.unwrap().state,
        api_types::vm::VmState::Running
    );
    t.shutdown().await.unwrap();
    // A text that never shows: the start times out.
    let mut spec = tiny_spec("beat=20");
    spec.ready = forkvm::Ready::Console("never printed".into());
    spec.start_timeout = Duration::from_millis(1500);
    let e = Template::start(spec).await.unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
}

async fn until_async<F: std::future::Future<Output = bool>>(
    what: &str,
    mut done: impl FnMut() -> F,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done().await {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_saved_as_a_snapshot_restores_without_booting_and_serves_as_it_did() {
    if !kvm_available("library_snapshot") {
        return;
    }
    let scratch = tests::Scratch::new("library-snapshot");
    let t = Template::start(tiny_spec("ticks=1 invoke=1 load=1"))
        .await
        .unwrap();
    let (derived, _) = t
        .derive(&b"loaded!\0"[..], &InvokeOptions::default())
        .await
        .unwrap();
    // Saved: the template and a derived one, each paused where its runtime waits.
    let base_dir = scratch.path("base");
    let info = t.snapshot(&base_dir).await.unwrap();
    assert_eq!(info.dir, base_dir.display().to_string());
    // 64 MiB of guest memory and the 1 MiB mailbox.
    assert_eq!(info.memory_bytes, 65 << 20);
    let derived_dir = scratch.path("derived");
    derived.snapshot(&derived_dir).await.unwrap();
    // The directory exists now: refused, the caller's error.
    let e = t.snapshot(&base_dir).await.unwrap_err();
    assert!(matches!(e, Error::Refused { status: 409, .. }), "{e}");
    drop(derived);
    t.shutdown().await.unwrap();

    // Restored: it serves invocations, with its warm clones, and derives on.
    // The guest is the snapshot's; `args` are `vmm restore`'s.
    let mut spec = tiny_spec("ignored: the snapshot's guest runs");
    spec.kernel = "/nonexistent/kernel".into();
    spec.args.clear();
    let r = Template::restore(&base_dir, spec.clone()).await.unwrap();
    let reply = r
        .invoke(&b"restored"[..], &InvokeOptions::default())
        .await
        .unwrap();
    assert!(reply.body.starts_with(b"restored"), "{reply:?}");
    until_async("2 warm clones", || async {
        r.status().await.unwrap().warm_clones.ready == 2
    })
    .await;
    let (d, _) = r
        .derive(&b"again!!\0"[..], &InvokeOptions::default())
        .await
        .unwrap();
    let shown = d.invoke(&b"show"[..], &InvokeOptions::default()).await;
    assert_eq!(&shown.unwrap().body[..], b"again!!\0");
    drop(d);
    // The derived template's snapshot holds what it loaded.
    let rd = Template::restore(&derived_dir, spec.clone()).await.unwrap();
    let shown = rd.invoke(&b"show"[..], &InvokeOptions::default()).await;
    assert_eq!(&shown.unwrap().body[..], b"loaded!\0");
    rd.shutdown().await.unwrap();
    r.shutdown().await.unwrap();

    // A plain template, ready on its console: restored paused.
    let mut plain = tiny_spec("beat=20");
    plain.ready = forkvm::Ready::Console("tiny: beat 2\n".into());
    let p = Template::start(plain.clone()).await.unwrap();
    let plain_dir = scratch.path("plain");
    p.snapshot(&plain_dir).await.unwrap();
    p.shutdown().await.unwrap();
    plain.args.clear();
    let p = Template::restore(&plain_dir, plain).await.unwrap();
    let info = p.status().await.unwrap();
    assert_eq!(info.state, api_types::vm::VmState::Paused, "{info:?}");
    p.shutdown().await.unwrap();

    // A running VM cannot be saved; a snapshot that is not one fails with the VMM's
    // reason; a jail is not supported yet.
    let mut running = tiny_spec("beat=20");
    running.ready = forkvm::Ready::Running;
    let run = Template::start(running).await.unwrap();
    let e = run.snapshot(scratch.path("running")).await.unwrap_err();
    assert!(matches!(e, Error::Refused { status: 409, .. }), "{e}");
    run.shutdown().await.unwrap();
    assert!(!scratch.path("running").exists());
    let missing = scratch.path("missing");
    let e = Template::restore(&missing, spec.clone()).await.unwrap_err();
    assert!(matches!(e, Error::Exited { .. }), "{e}");
    assert!(e.to_string().contains("its log ends with: "), "{e}");
    assert!(e.to_string().contains("missing"), "{e}");
    spec.jail = Some(forkvm::JailSpec::new(1000, 1000));
    let e = Template::restore(&base_dir, spec).await.unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    assert_eq!(e.kind(), ErrorKind::Caller);
}
