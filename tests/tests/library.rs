//! The `forkvm` library (issue 22's embedding layer) against the tiny guest: a template
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
    spec.args = ["--ap-boot", "direct", "--mailbox-mib", "1"]
        .map(String::from)
        .to_vec();
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

    // Dropped: the VMM is stopped, its clones and its directory gone.
    drop(Arc::into_inner(t).expect("the only handle"));
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists() || zombie(pid));
    assert!(!dir.exists(), "{} left behind", dir.display());
}

fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.contains(") Z "))
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
