//! Invocations with the tiny guest (`invoke=1`, docs/tiny-guest.md): a template pauses
//! where its echo handler waits; each `POST /invocations` runs in a fresh clone that
//! answers with the payload and a trailer (its clone number, the request's sequence
//! number, the request's entropy); every error the API lists; keep-alive and in-place
//! invocations; concurrency; no leaks.

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use api_types::InvokeOptions;
use forkvm_client::api as client;
use forkvm_client::http::Response;
use serde_json::Value;
use tests::{
    children_of, count_dir, fd_targets, fds_of, invoke_figure, kvm_available, tiny_vm, Scratch, Vm,
};

const BOOT: Duration = Duration::from_secs(30);
const TRAILER: usize = 48;

/// A tiny-guest template with `extra` arguments, paused where its handler waits.
fn template(scratch: &Scratch, extra: &[&str]) -> Vm {
    template_with(scratch, "ticks=1 invoke=1", extra)
}

/// The same with the guest command line `cmdline`.
fn template_with(scratch: &Scratch, cmdline: &str, extra: &[&str]) -> Vm {
    let tiny = tests::guest_file("tiny.elf").display().to_string();
    let mut args = vec![
        "--kernel",
        &tiny,
        "--mem-mib",
        "64",
        "--ap-boot",
        "direct",
        "--cmdline",
        cmdline,
        "--template",
    ];
    args.extend_from_slice(extra);
    let mut vm = Vm::start(scratch, &args);
    vm.wait_console("tiny: invoke ready\n", BOOT);
    vm.wait_api(BOOT);
    wait_until("the template to pause", || vm.waits_as_template());
    vm
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < BOOT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn invoke_with(sock: &Path, options: &InvokeOptions, payload: &[u8]) -> Response {
    client::invoke(sock, options, payload).unwrap_or_else(|e| panic!("invoke: {e}"))
}

fn invoke(sock: &Path, payload: &[u8]) -> Response {
    invoke_with(sock, &InvokeOptions::default(), payload)
}

/// The echo's reply checked against `payload`: (clone number, sequence, entropy).
fn echoed(r: &Response, payload: &[u8]) -> (u64, u64, Vec<u8>) {
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-forkvm-outcome"), Some("ok"));
    assert_eq!(r.bytes.len(), payload.len() + TRAILER, "{}", r.body);
    assert!(
        r.bytes[..payload.len()] == *payload,
        "the payload came back changed"
    );
    let t = &r.bytes[payload.len()..];
    let clone = u64::from_le_bytes(t[..8].try_into().unwrap());
    let seq = u64::from_le_bytes(t[8..16].try_into().unwrap());
    let id: u64 = match r.header("x-forkvm-clone-id").unwrap() {
        "" => 0,
        id => id.parse().unwrap(),
    };
    assert_eq!(
        clone, id,
        "the guest's clone number is the answer's clone id"
    );
    for h in [
        "x-forkvm-clone-us",
        "x-forkvm-handler-us",
        "x-forkvm-total-us",
    ] {
        let v: u64 = r.header(h).unwrap().parse().unwrap();
        assert!(v < 60_000_000, "{h}: {v}");
    }
    (clone, seq, t[16..].to_vec())
}

fn error_of(r: &Response) -> String {
    serde_json::from_str::<api_types::ErrorBody>(&r.body)
        .map(|e| e.error)
        .unwrap_or_else(|_| r.body.clone())
}

/// What is in the scratch directory besides the template's own files.
fn leftovers(scratch: &Scratch) -> Vec<String> {
    let dir = scratch.path("");
    let mut left: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !["api.sock", "console", "stderr"].contains(&n.as_str()))
        .collect();
    left.sort();
    left
}

#[test]
fn a_thousand_invocations_each_in_a_fresh_clone_echo_byte_for_byte_and_leak_nothing() {
    if !kvm_available("invoke_thousand") {
        return;
    }
    let scratch = Scratch::new("invoke-1000");
    let vm = template(&scratch, &["--warm-clones", "4", "--mailbox-mib", "1"]);
    let pid = vm.child.id();
    // One first, so lazily made state exists before counting.
    echoed(&invoke(&vm.sock, b"warm up"), b"warm up");
    wait_until("the warm pool to refill and the clone to go", || {
        vm.describe()["warm_clones"]["ready"] == 4
            && children_of(pid).len() == 4
            && leftovers(&scratch).is_empty()
    });
    assert_eq!(vm.describe()["warm_clones"]["priming"], false);
    let fds = tests::fds_at_rest(pid);
    let threads = count_dir(format!("/proc/{pid}/task"));
    let mut clones = HashSet::new();
    let mut entropy = HashSet::new();
    let capacity = (1 << 20) - 64 - TRAILER;
    let launched = |vm: &Vm| vm.describe()["warm_clones"]["launched"].as_u64().unwrap();
    let launched_before = launched(&vm);
    for i in 0..1000usize {
        // Sizes from empty to the whole mailbox, bytes that are not text.
        let len = match i {
            0 => 0,
            1..=3 => capacity,
            _ => (i * 7919) % 5000,
        };
        let payload: Vec<u8> = (0..len).map(|b| (b * 31 + i) as u8).collect();
        let r = invoke(&vm.sock, &payload);
        // Without prime=, the tiny guest does not declare prime requests.
        assert_eq!(r.header("x-forkvm-primed"), Some("false"));
        let (clone, seq, e) = echoed(&r, &payload);
        assert_eq!(seq, 1, "a fresh clone serves its first request");
        assert!(clones.insert(clone), "clone {clone} served twice");
        assert!(entropy.insert(e), "entropy repeated at invocation {i}");
        if i == 3 {
            // Each of the first four served by the first warm clone launched for it
            // (four were ready): one that could not take its request (the whole
            // mailbox, most of it read from the launch channel into the mailbox) would
            // die, and the next would be tried, then a clone forked for it, which
            // answers all the same. (A clone that read only the socket's first part
            // failed this 1 of 2 runs.)
            assert_eq!(
                launched(&vm),
                launched_before + 4,
                "warm clones died at launch"
            );
        }
    }
    let info = vm.describe();
    assert_eq!(info["state"], "paused");
    assert_eq!(info["invoke"]["started"], 1001);
    // Every clone is gone, with its socket and console file; the template holds what
    // it held before.
    // The pool refills after the last invocation: its new clone counts as a child as
    // soon as it is forked, while the VMM still holds pipe ends it closes after the fork
    // (CI once counted one descriptor more there). `ready` counts it once that is done.
    wait_until("the clones to be reaped and the pool refilled", || {
        vm.describe()["warm_clones"]["ready"] == 4
            && children_of(pid).len() == 4
            && leftovers(&scratch).is_empty()
    });
    assert_eq!(fds_of(pid, fds), fds, "fds leaked:\n{}", fd_targets(pid));
    assert_eq!(
        count_dir(format!("/proc/{pid}/task")),
        threads,
        "threads leaked"
    );
    let (_, body) = vm.api("GET", "/clones", None);
    let list: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(list["clones"].as_array().unwrap().len(), 0, "{body}");
    drop(vm);
}

#[test]
fn eight_callers_at_once_each_get_their_own_clone() {
    if !kvm_available("invoke_concurrent") {
        return;
    }
    let scratch = Scratch::new("invoke-8");
    let vm = template(&scratch, &["--warm-clones", "8"]);
    let pid = vm.child.id();
    let settled = || {
        vm.describe()["warm_clones"]["ready"] == 8
            && children_of(pid).len() == 8
            && leftovers(&scratch).is_empty()
    };
    echoed(&invoke(&vm.sock, b"warm up"), b"warm up");
    wait_until("the warm pool to refill and the clone to go", settled);
    let fds = tests::fds_at_rest(pid);
    let sock = vm.sock.clone();
    let callers: Vec<_> = (0..8u8)
        .map(|t| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                (0..25u8)
                    .map(|i| {
                        let payload = [b't', t, b'i', i];
                        echoed(&invoke(&sock, &payload), &payload).0
                    })
                    .collect::<Vec<u64>>()
            })
        })
        .collect();
    let mut clones = HashSet::new();
    for c in callers {
        for clone in c.join().unwrap() {
            assert!(clones.insert(clone), "clone {clone} served twice");
        }
    }
    assert_eq!(clones.len(), 200);
    // The template does not wait for its clones to start: each start it watched is
    // over, and nothing is left of 200 clones made 8 at a time.
    wait_until("the clones to be reaped and the pool refilled", settled);
    assert_eq!(fds_of(pid, fds), fds, "fds leaked:\n{}", fd_targets(pid));
    let (_, body) = vm.api("GET", "/clones", None);
    let list: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(list["clones"].as_array().unwrap().len(), 0, "{body}");
    assert_eq!(vm.describe()["invoke"]["started"], 201);
}

/// The fork sources a template keeps besides itself (`--fork-sources`): (id, socket) of
/// each running one that is a ready template, and that the template knows is (its log
/// says so: the template runs with `--log-level info`), once there are `n`.
fn ready_sources(vm: &Vm, n: usize) -> Vec<(String, std::path::PathBuf)> {
    let mut found = Vec::new();
    wait_until("the fork sources to be ready templates", || {
        let (_, body) = vm.api("GET", "/clones", None);
        let list: Value = serde_json::from_str(&body).unwrap();
        found = (list["clones"].as_array().unwrap().iter())
            .filter(|c| c["status"]["state"] == "running")
            .map(|c| {
                let sock = std::path::PathBuf::from(c["api_sock"].as_str().unwrap());
                (c["id"].as_str().unwrap().to_string(), sock)
            })
            .collect();
        let log = vm.stderr_text();
        found.len() == n
            && found.iter().all(|(id, sock)| {
                let v = describe_at(sock);
                v["state"] == "paused"
                    && v["invoke"]["template"] == true
                    && log.contains(&format!("fork source {id} ready"))
            })
    });
    found.sort();
    found
}

/// `--fork-sources 3`: the template makes two clones of itself that are templates too,
/// each with its warm clones, and its invocations are served in turn by it and by them.
/// Eight callers at once: every reply echoes its payload from a clone of its own (ids
/// never twice; the guest's clone number is the last part of the id), the template and
/// both sources each served a share. A resume makes its sources stale: they are
/// stopped, and new ones made once it paused again; nothing is left of the old ones.
#[test]
fn fork_sources_serve_a_template_s_requests_in_turn_and_are_made_again_when_it_changes() {
    if !kvm_available("invoke_fork_sources") {
        return;
    }
    let scratch = Scratch::new("invoke-sources");
    let vm = template(
        &scratch,
        &[
            "--warm-clones",
            "2",
            "--fork-sources",
            "3",
            "--log-level",
            "info",
        ],
    );
    let pid = vm.child.id();
    let sources = ready_sources(&vm, 2);
    for (_, sock) in &sources {
        wait_until("a source's warm clones", || {
            describe_at(sock)["warm_clones"]["ready"] == 2
        });
    }
    let fds = tests::fds_at_rest(pid);
    let sock = vm.sock.clone();
    let callers: Vec<_> = (0..8u8)
        .map(|t| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                (0..15u8)
                    .map(|i| {
                        let payload = [b's', t, b'i', i];
                        let r = invoke(&sock, &payload);
                        assert_eq!(r.status, 200, "{}", r.body);
                        assert_eq!(&r.bytes[..payload.len()], &payload);
                        let t = &r.bytes[payload.len()..];
                        let number = u64::from_le_bytes(t[..8].try_into().unwrap());
                        let id = r.header("x-forkvm-clone-id").unwrap().to_string();
                        let last: u64 = id.rsplit('.').next().unwrap().parse().unwrap();
                        assert_eq!(number, last, "clone {id}: the guest's number");
                        id
                    })
                    .collect::<Vec<String>>()
            })
        })
        .collect();
    let mut ids = HashSet::new();
    for c in callers {
        for id in c.join().unwrap() {
            assert!(ids.insert(id.clone()), "clone {id} served twice");
        }
    }
    assert_eq!(ids.len(), 120);
    let served_by = |source: &str| {
        let prefix = format!("{source}.");
        ids.iter().filter(|id| id.starts_with(&prefix)).count()
    };
    let by_root = ids.iter().filter(|id| !id.contains('.')).count();
    let (first, second) = (served_by(&sources[0].0), served_by(&sources[1].0));
    assert_eq!(by_root + first + second, 120);
    for (who, n) in [
        ("the template", by_root),
        ("source 1", first),
        ("source 2", second),
    ] {
        assert!(
            n >= 20,
            "{who} served {n} of 120 (template {by_root}, sources {first}, {second})"
        );
    }
    // A resume: the template runs on to its runtime's wait and pauses again; its old
    // sources (templates of the state it had) are stopped, new ones made.
    let (code, body) = vm.api("PATCH", "/vm", Some(r#"{"state":"running"}"#));
    assert_eq!(code, 204, "{body}");
    wait_until("the template to pause again", || vm.waits_as_template());
    let renewed = ready_sources(&vm, 2);
    for (old, _) in &sources {
        assert!(
            renewed.iter().all(|(id, _)| id != old),
            "source {old} survived the resume"
        );
    }
    for (_, sock) in &sources {
        wait_until("the old sources' sockets to go", || !sock.exists());
    }
    let r = invoke(&vm.sock, b"after");
    assert_eq!(r.status, 200, "{}", r.body);
    // The template's children: its 2 warm clones and 2 sources, which have 2 each.
    let grandchildren =
        || -> usize { children_of(pid).iter().map(|c| children_of(*c).len()).sum() };
    wait_until("every clone of the requests to end", || {
        children_of(pid).len() == 4
            && grandchildren() == 4
            && renewed
                .iter()
                .all(|(_, sock)| describe_at(sock)["warm_clones"]["ready"] == 2)
    });
    let (_, body) = vm.api("GET", "/clones", None);
    let list: Value = serde_json::from_str(&body).unwrap();
    let running = (list["clones"].as_array().unwrap().iter())
        .filter(|c| c["status"]["state"] == "running")
        .count();
    assert_eq!(running, 2, "only the new sources run: {body}");
    // 121 requests forwarded or served, two sources replaced: no descriptor left.
    assert_eq!(fds_of(pid, fds), fds, "fds leaked:\n{}", fd_targets(pid));
}

/// A fork source its template lets go (a resume) serves the request it has in flight to
/// the end, then ends: a `tick` request (400M cycles of spin, prime=4) running in a
/// source's clone when the template resumes is answered in full.
#[test]
fn a_fork_source_let_go_finishes_the_request_it_serves_then_ends() {
    if !kvm_available("invoke_fork_sources_retire") {
        return;
    }
    let scratch = Scratch::new("invoke-sources-retire");
    let vm = template_with(
        &scratch,
        "ticks=1 invoke=1 prime=4",
        &[
            "--warm-clones",
            "1",
            "--fork-sources",
            "2",
            "--log-level",
            "info",
        ],
    );
    let sources = ready_sources(&vm, 1);
    let (source, source_sock) = sources[0].clone();
    // The first request goes to the source (the root's turn comes next).
    let sock = vm.sock.clone();
    let caller = std::thread::spawn(move || invoke(&sock, b"tick"));
    wait_until("the source's clone to run the request", || {
        let (_, body) = tests::api_request(&source_sock, "GET", "/clones", None);
        body.contains("running")
    });
    let (code, body) = vm.api("PATCH", "/vm", Some(r#"{"state":"running"}"#));
    assert_eq!(code, 204, "{body}");
    let r = caller.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.bytes.len(), 16, "the spin's answer");
    let id = r.header("x-forkvm-clone-id").unwrap();
    assert!(id.starts_with(&format!("{source}.")), "served by {id}");
    wait_until("the source let go to end", || !source_sock.exists());
    wait_until("the template to pause again", || vm.waits_as_template());
    let renewed = ready_sources(&vm, 1);
    assert_ne!(renewed[0].0, source);
}

/// A template derived from one with `--fork-sources 2` (what the gateway's functions
/// are) has a fork source of its own, a clone of what it loaded: requests to it are
/// served by it and by its source in turn, each answering with what the load left.
#[test]
fn a_derived_template_has_fork_sources_of_what_it_loaded() {
    if !kvm_available("invoke_fork_sources_derived") {
        return;
    }
    let scratch = Scratch::new("invoke-sources-derived");
    let vm = template_with(
        &scratch,
        "ticks=1 invoke=1 load=1",
        &[
            "--warm-clones",
            "1",
            "--fork-sources",
            "2",
            "--log-level",
            "info",
        ],
    );
    let root_sources = ready_sources(&vm, 1);
    // Derive requests are the template's own (not forwarded): the derived template is
    // its clone.
    let (id, derived) = derive(&vm.sock, b"loaded!\0");
    assert!(!id.contains('.'), "derived by a source: {id}");
    // Its source, once a ready template (paused where its runtime waits).
    let mut source = None;
    wait_until("the derived template's fork source", || {
        let (_, body) = tests::api_request(&derived, "GET", "/clones", None);
        let list: Value = serde_json::from_str(&body).unwrap();
        source = (list["clones"].as_array().unwrap().iter())
            .find(|c| c["status"]["state"] == "running")
            .map(|c| {
                let sock = std::path::PathBuf::from(c["api_sock"].as_str().unwrap());
                (c["id"].as_str().unwrap().to_string(), sock)
            });
        source.as_ref().is_some_and(|(id, sock)| {
            let v = describe_at(sock);
            v["state"] == "paused"
                && v["invoke"]["waiting"] == true
                && vm
                    .stderr_text()
                    .contains(&format!("fork source {id} ready"))
        })
    });
    let (source, _) = source.unwrap();
    assert!(source.starts_with(&format!("{id}.")), "{source}");
    let mut by = HashSet::new();
    for _ in 0..12 {
        let (shown, clone) = shown(&derived);
        assert_eq!(shown, b"loaded!\0", "clone {clone}");
        by.insert(clone.rsplit_once('.').unwrap().0.to_string());
    }
    let expected: HashSet<String> = [id.clone(), source].into_iter().collect();
    assert_eq!(
        by, expected,
        "served by the derived template and its source"
    );
    assert_eq!(root_sources.len(), 1);
}

/// `--rewind`: an invocation clone that answered is put back in its template's state
/// and serves another request in the same process. Eight callers at once: every reply
/// comes from a VM whose guest memory is the template's again (the guest's own request
/// count is 1 each time, as in a fresh clone), under an id of its own and with entropy
/// of its own; rewound clones rejoin the pool, and nothing is left.
#[test]
fn rewound_clones_serve_eight_callers_as_fresh_ones_and_leak_nothing() {
    if !kvm_available("invoke_rewind") {
        return;
    }
    let scratch = Scratch::new("invoke-rewind");
    let vm = template(&scratch, &["--warm-clones", "4", "--rewind"]);
    let pid = vm.child.id();
    let settled = || {
        let warm = &vm.describe()["warm_clones"];
        let ready = warm["ready"].as_u64().unwrap_or(0);
        (4..=5).contains(&ready)
            && children_of(pid).len() as u64 == ready
            && leftovers(&scratch).is_empty()
    };
    echoed(&invoke(&vm.sock, b"warm up"), b"warm up");
    wait_until("the clone to come back and the pool to settle", settled);
    let sock = vm.sock.clone();
    let callers: Vec<_> = (0..8u8)
        .map(|t| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                (0..20u8)
                    .map(|i| {
                        let payload = [b'r', t, b'i', i];
                        let (clone, seq, entropy) = echoed(&invoke(&sock, &payload), &payload);
                        assert_eq!(seq, 1, "clone {clone}: the guest's memory was not rewound");
                        (clone, entropy)
                    })
                    .collect::<Vec<(u64, Vec<u8>)>>()
            })
        })
        .collect();
    let (mut clones, mut entropy) = (HashSet::new(), HashSet::new());
    for c in callers {
        for (clone, e) in c.join().unwrap() {
            assert!(clones.insert(clone), "clone id {clone} served twice");
            assert!(entropy.insert(e), "two requests got the same entropy");
        }
    }
    assert_eq!(clones.len(), 160);
    // The callers grew the pool past its target; the surplus ends once no clone was
    // launched for 2 s (`SURPLUS_IDLE`). The baseline below is taken after: taken before,
    // the surplus's end could fall in the loop and look like a descriptor lost.
    wait_until("the pool back to its target", || {
        vm.describe()["warm_clones"]["ready"] == 4
            && children_of(pid).len() == 4
            && leftovers(&scratch).is_empty()
    });
    // One at a time, the same processes serve: each request's clone comes back and no
    // clone is forked.
    let launched = || vm.describe()["warm_clones"]["launched"].as_u64().unwrap();
    let (before, processes) = (launched(), children_of(pid));
    let fds = tests::fds_at_rest(pid);
    for i in 0..10u8 {
        let (_, seq, _) = echoed(&invoke(&vm.sock, &[i]), &[i]);
        assert_eq!(seq, 1);
        wait_until("the clone to come back", settled);
    }
    assert_eq!(launched(), before + 10, "each request took a warm clone");
    assert_eq!(children_of(pid), processes, "a clone was forked or lost");
    assert_eq!(fds_of(pid, fds), fds, "fds leaked:\n{}", fd_targets(pid));
    let (_, body) = vm.api("GET", "/clones", None);
    let list: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(list["clones"].as_array().unwrap().len(), 0, "{body}");
}

/// A rewound clone's control socket is served in every life (its API thread is kept
/// from one life to the next): `GET /vm` on the socket of a clone whose request is
/// running (a 400M-cycle spin: prime=4's `tick`) answers with that life's clone id, in
/// the first life of a process and in its later ones; a clone whose life ended is no
/// longer listed as running while it rewinds.
#[test]
fn a_rewound_clone_serves_its_control_socket_in_every_life() {
    if !kvm_available("invoke_rewind_api") {
        return;
    }
    let scratch = Scratch::new("invoke-rewind-api");
    let vm = template_with(
        &scratch,
        "ticks=1 invoke=1 prime=4",
        &["--warm-clones", "2", "--rewind"],
    );
    let mut lives: std::collections::HashMap<u64, u32> = Default::default();
    let running = || -> Vec<Value> {
        let (_, body) = vm.api("GET", "/clones", None);
        let list: Value = serde_json::from_str(&body).unwrap();
        (list["clones"].as_array().unwrap().iter())
            .filter(|c| c["status"]["state"] == "running")
            .cloned()
            .collect()
    };
    for i in 0..8 {
        // The clone before ended its life (it may be in the pool again, or not yet:
        // warm clones replaced meanwhile).
        wait_until("two warm clones and no clone running", || {
            vm.describe()["warm_clones"]["ready"] == 2 && running().is_empty()
        });
        let sock = vm.sock.clone();
        let request = std::thread::spawn(move || invoke(&sock, b"tick"));
        // The running clone, from the template's list, and its own answer.
        let mut seen = None;
        while seen.is_none() && !request.is_finished() {
            // A clone whose life ended is not listed as running (it rewinds): the one
            // listed is this request's (its socket may be gone a moment later).
            let running = running();
            assert!(running.len() <= 1, "request {i}: {running:?}");
            let own = running
                .first()
                .and_then(|c| client::describe_vm(Path::new(c["api_sock"].as_str()?)).ok());
            if let (Some(c), Some(own)) = (running.first(), own) {
                assert_eq!(own.clone_id, c["id"].as_str().unwrap(), "request {i}");
                seen = Some(c["pid"].as_u64().unwrap());
            }
        }
        let r = request.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let pid = seen.unwrap_or_else(|| panic!("request {i}: its clone's socket never answered"));
        *lives.entry(pid).or_default() += 1;
    }
    assert!(
        lives.values().any(|&n| n >= 2),
        "no process served two requests (not rewound): {lives:?}"
    );
}

/// A template with a network card rewinds its clones too: each life has a tap of its
/// own (`fkvm<pid>`, made at its launch, in the VMM's network namespace), listed with
/// the running clone and gone when the life ends, before the same process serves the
/// next request. A tick request (prime=4: a 400M-cycle spin) keeps each life running
/// long enough to be looked at.
#[test]
fn a_rewound_clone_makes_a_tap_for_each_life_and_removes_it_when_the_life_ends() {
    if !kvm_available("invoke_rewind_tap") {
        return;
    }
    let scratch = Scratch::new("invoke-rewind-tap");
    let tap = format!("fkw{}", std::process::id() % 100_000_000);
    let vm = template_with(
        &scratch,
        "ticks=1 invoke=1 prime=4",
        &["--warm-clones", "2", "--rewind", "--tap", &tap],
    );
    let taps = || -> Vec<String> {
        let mut names: Vec<String> = (std::fs::read_dir("/sys/class/net").unwrap())
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        names.sort();
        names
    };
    // The clones whose life runs (or starts).
    let live = || -> Vec<Value> {
        let (_, body) = vm.api("GET", "/clones", None);
        let list: Value = serde_json::from_str(&body).unwrap();
        (list["clones"].as_array().unwrap().iter())
            .filter(|c| matches!(c["status"]["state"].as_str(), Some("running" | "starting")))
            .cloned()
            .collect()
    };
    let mut lives: std::collections::HashMap<u64, u32> = Default::default();
    for i in 0..8 {
        wait_until("two warm clones, none running", || {
            vm.describe()["warm_clones"]["ready"] == 2 && live().is_empty()
        });
        let sock = vm.sock.clone();
        let request = std::thread::spawn(move || invoke(&sock, b"tick"));
        let mut seen = None;
        while seen.is_none() && !request.is_finished() {
            if let Some(c) = live().first() {
                let (pid, name) = (c["pid"].as_u64().unwrap(), c["net"]["tap"].clone());
                assert_eq!(name, format!("fkvm{pid}"), "request {i}: {c}");
                // The tap is made once the life's vCPUs run, before its start is told.
                if c["status"]["state"] == "running" {
                    let name = name.as_str().unwrap().to_string();
                    assert!(
                        taps().contains(&name),
                        "request {i}: no {name} in {:?}",
                        taps()
                    );
                    seen = Some((pid, name));
                }
            }
        }
        let r = request.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let (pid, name) = seen.unwrap_or_else(|| panic!("request {i}: its clone was never seen"));
        wait_until("the life's tap to go", || !taps().contains(&name));
        *lives.entry(pid).or_default() += 1;
    }
    assert!(
        lives.values().any(|&n| n >= 2),
        "no process served two requests (not rewound): {lives:?}"
    );
    let pid = vm.child.id();
    let left: Vec<String> = (taps().into_iter())
        .filter(|t| children_of(pid).iter().any(|c| *t == format!("fkvm{c}")))
        .collect();
    assert!(left.is_empty(), "taps of clones at rest: {left:?}");
}

/// The template does not wait for an invocation clone to start: a clone that is slow
/// to (stopped here, as a loaded host may leave it unscheduled) holds up no other
/// request, and is listed as starting until it runs.
#[test]
fn a_clone_slow_to_start_holds_up_no_other_request() {
    if !kvm_available("invoke_slow_start") {
        return;
    }
    let scratch = Scratch::new("invoke-slow-start");
    let vm = template(&scratch, &["--warm-clones", "1"]);
    let pid = vm.child.id();
    wait_until("the warm clone", || {
        vm.describe()["warm_clones"]["ready"] == 1 && children_of(pid).len() == 1
    });
    let stopped = children_of(pid)[0] as i32;
    // SAFETY: kill has no memory preconditions; the pid is this test's warm clone.
    assert_eq!(unsafe { libc::kill(stopped, libc::SIGSTOP) }, 0);
    let slow = {
        let sock = vm.sock.clone();
        std::thread::spawn(move || invoke(&sock, b"slow"))
    };
    let clones = || -> Vec<Value> {
        let (_, body) = vm.api("GET", "/clones", None);
        let list: Value = serde_json::from_str(&body).unwrap();
        list["clones"].as_array().unwrap().clone()
    };
    wait_until("the stopped clone to be launched", || {
        clones().iter().any(|c| c["pid"] == stopped)
    });
    let listed = clones().into_iter().find(|c| c["pid"] == stopped).unwrap();
    assert_eq!(listed["status"]["state"], "starting", "{listed}");
    // Meanwhile other requests are served, each in its own clone.
    for i in 0..5u8 {
        let payload = [b'q', i];
        echoed(&invoke(&vm.sock, &payload), &payload);
    }
    assert!(!slow.is_finished(), "the stopped clone answered");
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(stopped, libc::SIGCONT) }, 0);
    echoed(&slow.join().unwrap(), b"slow");
    wait_until("every clone to be reaped", || {
        leftovers(&scratch).is_empty() && clones().is_empty()
    });
}

#[test]
fn every_failure_has_its_status_and_leaves_the_template_untouched() {
    if !kvm_available("invoke_errors") {
        return;
    }
    let scratch = Scratch::new("invoke-errors");
    let vm = template(&scratch, &["--warm-clones", "2", "--mailbox-mib", "1"]);
    let quick = InvokeOptions {
        timeout_ms: Some(300),
        ..Default::default()
    };
    for (payload, status, outcome, says) in [
        (
            &b"fail"[..],
            500,
            "handler_error",
            "the handler failed: tiny: the handler failed",
        ),
        (b"hang", 504, "timeout", "did not reply in time"),
        (b"poff", 502, "guest_stopped", "the guest powered off"),
        (b"crsh", 502, "guest_stopped", "vCPU 0"),
        (b"done", 502, "guest_stopped", "ended with status 7"),
        (b"garb", 502, "bad_reply", "magic is 0x55555555"),
        (b"bigl", 502, "bad_reply", "does not fit the mailbox"),
    ] {
        let r = invoke_with(&vm.sock, &quick, payload);
        let what = String::from_utf8_lossy(payload);
        assert_eq!(r.status, status, "{what}: {}", r.body);
        assert_eq!(r.header("x-forkvm-outcome"), Some(outcome), "{what}");
        assert!(error_of(&r).contains(says), "{what}: {}", error_of(&r));
        // The template is as it was: the next invocation is served as ever.
        echoed(&invoke(&vm.sock, b"after"), b"after");
    }
    // A clone whose VMM dies before it answers: the template answers for it.
    let r = invoke(&vm.sock, b"before");
    echoed(&r, b"before");
    let before: u64 = r.header("x-forkvm-clone-id").unwrap().parse().unwrap();
    let hang_id = (before + 1).to_string();
    let slow = InvokeOptions {
        timeout_ms: Some(20_000),
        ..Default::default()
    };
    let waiter = {
        let sock = vm.sock.clone();
        std::thread::spawn(move || invoke_with(&sock, &slow, b"hang"))
    };
    let mut pid = 0;
    wait_until("the hanging clone", || {
        let (_, body) = vm.api("GET", "/clones", None);
        let list: Value = serde_json::from_str(&body).unwrap();
        let live = list["clones"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == hang_id.as_str() && c["status"]["state"] == "running")
            .cloned();
        pid = live.map_or(0, |c| c["pid"].as_i64().unwrap());
        pid > 0
    });
    // SAFETY: kill has no memory preconditions; the pid is a clone this test made.
    let killed = unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert_eq!(
        killed,
        0,
        "clone {hang_id} (pid {pid}):\n{}",
        vm.stderr_text()
    );
    let r = waiter.join().unwrap();
    assert_eq!(r.status, 502, "{}\n{}", r.body, vm.stderr_text());
    assert_eq!(r.header("x-forkvm-outcome"), Some("guest_stopped"));
    assert!(
        error_of(&r).contains("was killed by SIGKILL"),
        "{}",
        error_of(&r)
    );
    echoed(&invoke(&vm.sock, b"after"), b"after");
    // A payload one byte over what the mailbox holds is refused before any clone.
    let started = vm.describe()["invoke"]["started"].clone();
    let r = invoke(&vm.sock, &vec![0u8; (1 << 20) - 64 + 1]);
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(vm.describe()["invoke"]["started"], started);
    // Bad options.
    let (code, body) = vm.api("POST", "/invocations?timeout_ms=0", Some("x"));
    assert_eq!(code, 400, "{body}");
    let (code, body) = vm.api("POST", "/invocations?colour=red", Some("x"));
    assert_eq!(code, 400, "{body}");
    // Resumed from outside, the template's runtime reads "no request", waits again,
    // and the template pauses itself again.
    let (code, body) = vm.api("PATCH", "/vm", Some(r#"{"state":"running"}"#));
    assert_eq!(code, 204, "{body}");
    wait_until("the template to pause again", || vm.waits_as_template());
    echoed(&invoke(&vm.sock, b"again"), b"again");
    wait_until("every clone to be reaped", || {
        leftovers(&scratch).is_empty()
    });
}

#[test]
fn a_vm_without_a_waiting_runtime_or_a_mailbox_refuses() {
    if !kvm_available("invoke_refused") {
        return;
    }
    let scratch = Scratch::new("invoke-refused");
    let mut vm = tiny_vm(&scratch, "64", "1", "ticks=1 beat=50");
    vm.wait_console("tiny: beat 1\n", BOOT);
    let r = invoke(&vm.sock, b"x");
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(error_of(&r).contains("no runtime"), "{}", r.body);
    vm.shutdown(BOOT);
    let scratch = Scratch::new("invoke-nomailbox");
    let tiny = tests::guest_file("tiny.elf").display().to_string();
    let mut vm = Vm::start(
        &scratch,
        &[
            "--kernel",
            &tiny,
            "--ap-boot",
            "direct",
            "--cmdline",
            "ticks=1 beat=50",
            "--mailbox-mib",
            "0",
        ],
    );
    vm.wait_console("tiny: beat 1\n", BOOT);
    let r = invoke(&vm.sock, b"x");
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(error_of(&r).contains("no mailbox"), "{}", r.body);
    assert_eq!(vm.describe()["invoke"]["mailbox_bytes"], 0);
    vm.shutdown(BOOT);
    // A template needs a mailbox.
    let (status, _, err) = tests::run_vmm(
        &["run", "--kernel", &tiny, "--template", "--mailbox-mib", "0"],
        BOOT,
    );
    assert!(!status.success());
    assert!(err.contains("mailbox of 0 MiB"), "{err}");
}

#[test]
fn a_keep_alive_clone_serves_further_requests_in_place_until_one_ends_it() {
    if !kvm_available("invoke_keep_alive") {
        return;
    }
    let scratch = Scratch::new("invoke-keep");
    let vm = template(&scratch, &["--warm-clones", "1"]);
    let keep = InvokeOptions {
        keep_alive: true,
        ..Default::default()
    };
    let r = invoke_with(&vm.sock, &keep, b"one");
    let (clone, seq, first_entropy) = echoed(&r, b"one");
    assert_eq!(seq, 1);
    let sock = std::path::PathBuf::from(r.header("x-forkvm-socket").unwrap());
    assert!(sock.exists());
    let (clone2, seq, entropy) = echoed(&invoke_with(&sock, &keep, b"two"), b"two");
    assert_eq!((clone2, seq), (clone, 2), "the same clone serves in place");
    assert_ne!(entropy, first_entropy);
    // Back to back: a request that comes before the runtime waits again is held for
    // it, not refused.
    for n in 3..23u64 {
        let (c, seq, _) = echoed(&invoke_with(&sock, &keep, b"more"), b"more");
        assert_eq!((c, seq), (clone, n));
    }
    // While a request runs in it, the clone takes no other.
    let hang = InvokeOptions {
        keep_alive: true,
        timeout_ms: Some(2000),
        ..Default::default()
    };
    let waiter = {
        let sock = sock.clone();
        std::thread::spawn(move || invoke_with(&sock, &hang, b"hang"))
    };
    wait_until("the hanging request to start", || {
        let (_, body) = tests::api_request(&sock, "GET", "/vm", None);
        serde_json::from_str::<Value>(&body).unwrap()["invoke"]["in_flight"] == true
    });
    let r = invoke(&sock, b"three");
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(error_of(&r).contains("one at a time"), "{}", r.body);
    // The timeout ends the clone, keep-alive or not.
    let r = waiter.join().unwrap();
    assert_eq!(r.status, 504, "{}", r.body);
    wait_until("the clone to end", || !sock.exists());
    // A request without keep-alive ends its clone once answered.
    let r = invoke_with(&vm.sock, &keep, b"four");
    let sock = std::path::PathBuf::from(r.header("x-forkvm-socket").unwrap());
    echoed(&invoke(&sock, b"five"), b"five");
    wait_until("the clone to end", || !sock.exists());
    wait_until("every clone to be reaped", || {
        leftovers(&scratch).is_empty()
    });
}

#[test]
fn a_vm_that_is_no_template_serves_one_invocation_in_place_and_ends() {
    if !kvm_available("invoke_in_place") {
        return;
    }
    let scratch = Scratch::new("invoke-inplace");
    let mut vm = tiny_vm(&scratch, "64", "1", "ticks=1 invoke=1");
    vm.wait_console("tiny: invoke ready\n", BOOT);
    vm.wait_api(BOOT);
    wait_until("the runtime to wait", || {
        vm.describe()["invoke"]["waiting"] == true
    });
    assert_eq!(vm.describe()["state"], "running");
    let r = invoke(&vm.sock, b"here");
    let (clone, seq, _) = echoed(&r, b"here");
    assert_eq!((clone, seq), (0, 1), "served by the VM itself");
    assert_eq!(r.header("x-forkvm-clone-id"), Some(""));
    let status = vm.wait_exit(BOOT);
    assert!(status.success(), "{status}\n{}", vm.stderr_text());
}

/// `GET /vm`'s invocation figure `what` of the VM serving on `sock`.
#[test]
fn requests_that_come_while_the_runtime_is_on_its_way_back_are_held_for_it() {
    if !kvm_available("invoke_held") {
        return;
    }
    let scratch = Scratch::new("invoke-held");
    // After "no request" the handler spins 3e9 TSC cycles (a second or so) before it
    // waits again; no refresh, so that only the test resumes it.
    let cmdline = "ticks=1 invoke=1 rewait=3000";
    let vm = template_with(
        &scratch,
        cmdline,
        &["--warm-clones", "1", "--refresh-idle-ms", "0"],
    );
    let resume = || {
        let (code, body) = vm.api("PATCH", "/vm", Some(r#"{"state":"running"}"#));
        assert_eq!(code, 204, "{body}");
    };
    // Three callers while it comes back: held, then each served in its own clone.
    resume();
    let callers: Vec<_> = (0..3u8)
        .map(|i| {
            let sock = vm.sock.clone();
            std::thread::spawn(move || invoke(&sock, &[b'h', i]))
        })
        .collect();
    wait_until("three requests to be held", || {
        invoke_figure(&vm.sock, "held") == 3
    });
    assert_eq!(vm.describe()["state"], "running");
    let clones: HashSet<u64> = callers
        .into_iter()
        .enumerate()
        .map(|(i, c)| echoed(&c.join().unwrap(), &[b'h', i as u8]).0)
        .collect();
    assert_eq!(clones.len(), 3, "each in its own clone");
    assert!(vm.waits_as_template());
    // A held request whose timeout passes first gets 504; the template serves on.
    resume();
    let short = InvokeOptions {
        timeout_ms: Some(100),
        ..Default::default()
    };
    let r = invoke_with(&vm.sock, &short, b"late");
    assert_eq!(r.status, 504, "{}", r.body);
    assert_eq!(r.header("x-forkvm-outcome"), Some("timeout"));
    assert!(error_of(&r).contains("did not wait"), "{}", r.body);
    wait_until("the template to pause again", || vm.waits_as_template());
    echoed(&invoke(&vm.sock, b"next"), b"next");
    wait_until("every clone to be reaped", || {
        leftovers(&scratch).is_empty()
    });
}

#[test]
fn a_template_holds_at_most_its_limit_and_refuses_more_with_503() {
    if !kvm_available("invoke_held_full") {
        return;
    }
    let scratch = Scratch::new("invoke-held-full");
    // 3e10 TSC cycles (7 s or more) to come back: longer than the callers' timeout.
    let cmdline = "ticks=1 invoke=1 rewait=30000";
    let vm = template_with(&scratch, cmdline, &["--refresh-idle-ms", "0"]);
    let (code, body) = vm.api("PATCH", "/vm", Some(r#"{"state":"running"}"#));
    assert_eq!(code, 204, "{body}");
    let opts = InvokeOptions {
        timeout_ms: Some(5000),
        ..Default::default()
    };
    let max = vmm::invoke::MAX_HELD;
    let callers: Vec<_> = (0..max)
        .map(|_| {
            let (sock, opts) = (vm.sock.clone(), opts.clone());
            std::thread::spawn(move || invoke_with(&sock, &opts, b"x"))
        })
        .collect();
    wait_until("the template to hold its most", || {
        invoke_figure(&vm.sock, "held") == max as u64
    });
    let r = invoke_with(&vm.sock, &opts, b"one more");
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(error_of(&r).contains("wait already"), "{}", r.body);
    for c in callers {
        let r = c.join().unwrap();
        assert_eq!(r.status, 504, "{}", r.body);
    }
    assert_eq!(invoke_figure(&vm.sock, "held"), 0);
    assert_eq!(invoke_figure(&vm.sock, "started"), 0, "no clone was made");
    wait_until("the template to pause again", || vm.waits_as_template());
    echoed(&invoke(&vm.sock, b"after"), b"after");
    wait_until("every clone to be reaped", || {
        leftovers(&scratch).is_empty()
    });
}

#[test]
fn an_idle_runtime_is_refreshed_and_serves_throughout() {
    if !kvm_available("invoke_refresh") {
        return;
    }
    let scratch = Scratch::new("invoke-refresh");
    let vm = template(
        &scratch,
        &["--warm-clones", "2", "--refresh-idle-ms", "100"],
    );
    assert_eq!(vm.describe()["invoke"]["refresh_idle_ms"], 100);
    // Refreshed while idle: it runs, waits again, pauses again, new warm clones.
    wait_until("three refreshes", || {
        invoke_figure(&vm.sock, "refreshes") >= 3
    });
    wait_until("the warm clones to be made again", || {
        let v = vm.describe();
        v["warm_clones"]["discarded"].as_u64() >= Some(4) && v["warm_clones"]["ready"] == 2
    });
    // Requests served from a template refreshed under them, some of them held.
    for i in 0..20u8 {
        let (_, seq, _) = echoed(&invoke(&vm.sock, &[b'r', i]), &[b'r', i]);
        assert_eq!(seq, 1);
        std::thread::sleep(Duration::from_millis(u64::from(i) * 7 % 130));
    }
    // A keep-alive clone's runtime is refreshed in place, and serves on.
    let keep = InvokeOptions {
        keep_alive: true,
        ..Default::default()
    };
    let r = invoke_with(&vm.sock, &keep, b"one");
    let (clone, _, _) = echoed(&r, b"one");
    let sock = std::path::PathBuf::from(r.header("x-forkvm-socket").unwrap());
    wait_until("the clone's runtime to be refreshed", || {
        invoke_figure(&sock, "refreshes") >= 2
    });
    let (c, seq, _) = echoed(&invoke(&sock, b"two"), b"two");
    assert_eq!((c, seq), (clone, 2));
    wait_until("the clone to end", || !sock.exists());
    // Refreshes every 50 ms of a runtime that takes a while to come back: the template
    // is running about as often as not, and every request is still served.
    drop(vm);
    let scratch = Scratch::new("invoke-refresh-slow");
    let cmdline = "ticks=1 invoke=1 rewait=100";
    let vm = template_with(&scratch, cmdline, &["--refresh-idle-ms", "50"]);
    for i in 0..20u8 {
        echoed(&invoke(&vm.sock, &[b's', i]), &[b's', i]);
        std::thread::sleep(Duration::from_millis(u64::from(i) * 11 % 90));
    }
    assert!(invoke_figure(&vm.sock, "refreshes") > 0);
    wait_until("every clone to be reaped", || {
        leftovers(&scratch).is_empty()
    });
}

#[test]
fn a_template_paused_half_a_minute_is_refreshed_without_being_asked() {
    if !kvm_available("invoke_template_age") {
        return;
    }
    // Its clones' kernels would catch up on all the time since it paused: a template is
    // refreshed after 30 s paused (vmm::invoke::IDLE_CATCH_UP_AFTER) with idle refresh
    // off (the default), busy or not. A keep-alive clone that waits is refreshed once a
    // second after a delivery deferred its timer (CATCH_UP_AFTER), then not again
    // before it waited 30 s: not once a second while it waits.
    let scratch = Scratch::new("invoke-template-age");
    let vm = template(&scratch, &["--warm-clones", "1"]);
    assert_eq!(vm.describe()["invoke"]["refresh_idle_ms"], 0);
    let keep = InvokeOptions {
        keep_alive: true,
        ..Default::default()
    };
    let r = invoke_with(&vm.sock, &keep, b"stay");
    let sock = std::path::PathBuf::from(r.header("x-forkvm-socket").unwrap());
    let start = Instant::now();
    let mut served = 0u8;
    while invoke_figure(&vm.sock, "refreshes") == 0 {
        let elapsed = start.elapsed();
        assert!(
            elapsed < Duration::from_secs(60),
            "no refresh in {elapsed:?}"
        );
        echoed(&invoke(&vm.sock, &[b'a', served]), &[b'a', served]);
        served = served.wrapping_add(1);
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        start.elapsed() > Duration::from_secs(25),
        "{:?}",
        start.elapsed()
    );
    let in_place = invoke_figure(&sock, "refreshes");
    assert!(
        (1..=2).contains(&in_place),
        "the waiting clone was refreshed {in_place} times"
    );
    echoed(&invoke(&sock, b"end"), b"end");
    echoed(&invoke(&vm.sock, b"after"), b"after");
    wait_until("every clone to be reaped", || {
        leftovers(&scratch).is_empty()
    });
}

/// A template refreshed while nobody asks replaces its (older) warm clones one at a
/// time, and then rests: the pool is over its target while a replacement is made, which
/// must not count as a surplus of clones come back rewound (ended as soon as made, made
/// again: hundreds of forks a second).
#[test]
fn an_idle_template_refreshed_replaces_its_warm_clones_once() {
    if !kvm_available("invoke_refresh_idle_pool") {
        return;
    }
    let scratch = Scratch::new("invoke-refresh-idle-pool");
    // prime=4: each warm clone's prime spins about 0.1 s, as a Linux runtime's takes
    // milliseconds: a replacement is a while from ready.
    let vm = template_with(
        &scratch,
        "ticks=1 invoke=1 prime=4",
        &["--warm-clones", "2", "--refresh-idle-ms", "2500"],
    );
    let pid = vm.child.id();
    let warm = |what: &str| vm.describe()["warm_clones"][what].as_u64().unwrap();
    wait_until("the warm clones", || warm("ready") == 2);
    let start = Instant::now();
    while invoke_figure(&vm.sock, "refreshes") < 2 {
        assert!(start.elapsed() < BOOT, "no two refreshes in {BOOT:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_until("the pool to settle", || {
        warm("ready") == 2 && children_of(pid).len() == 2
    });
    // Each refresh replaces the two clones there are: a few discarded, not hundreds.
    let refreshes = invoke_figure(&vm.sock, "refreshes");
    let discarded = warm("discarded");
    assert!(
        discarded <= 2 * refreshes + 2,
        "{discarded} warm clones discarded in {refreshes} refreshes"
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(warm("discarded") <= 2 * invoke_figure(&vm.sock, "refreshes") + 2);
}

#[test]
fn a_snapshot_or_pause_asked_during_a_refresh_waits_for_the_template_to_pause_again() {
    if !kvm_available("invoke_refresh_snapshot") {
        return;
    }
    // The template runs for each refresh (its runtime takes 100 ms to wait again here):
    // a snapshot asked for then waits for it to pause, where it was refused as of a VM
    // not paused; a pause waits for the same.
    let scratch = Scratch::new("invoke-refresh-snapshot");
    let vm = template_with(
        &scratch,
        "ticks=1 invoke=1 rewait=100",
        &["--refresh-idle-ms", "300"],
    );
    for i in 0..2 {
        wait_until("a refresh", || vm.describe()["state"] == "running");
        let snap = scratch.path(&format!("snap{i}"));
        let (code, answer) = vm.snapshot(&snap);
        assert_eq!(code, 201, "{answer}");
        assert!(snap.join("state").exists());
        std::fs::remove_dir_all(&snap).unwrap();
    }
    // So does a pause: the one it makes at its runtime's wait, not one in mid-run.
    wait_until("a refresh", || vm.describe()["state"] == "running");
    let (code, answer) = vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#));
    assert_eq!(code, 204, "{answer}");
    assert!(vm.waits_as_template(), "{}", vm.describe());
    echoed(&invoke(&vm.sock, b"after"), b"after");
    wait_until("every clone to be reaped", || {
        leftovers(&scratch).is_empty()
    });
}

#[test]
fn a_request_that_meets_a_refresh_is_served_by_a_warm_clone_made_before_it() {
    if !kvm_available("invoke_refresh_warm") {
        return;
    }
    // A refresh only lets the template's kernel catch up: its warm clones are clones of
    // it still, so a request held while it runs (its runtime takes 100 ms to wait again
    // here) is served by one of them once it pauses, not by a clone forked for it.
    let scratch = Scratch::new("invoke-refresh-warm");
    let cmdline = "ticks=1 invoke=1 rewait=100";
    let vm = template_with(
        &scratch,
        cmdline,
        &["--warm-clones", "2", "--refresh-idle-ms", "300"],
    );
    let launched = || vm.describe()["warm_clones"]["launched"].as_u64().unwrap();
    for i in 0..3u8 {
        wait_until("two warm clones", || {
            vm.waits_as_template() && vm.describe()["warm_clones"]["ready"] == 2
        });
        wait_until("a refresh", || vm.describe()["state"] == "running");
        let before = launched();
        echoed(&invoke(&vm.sock, &[b'h', i]), &[b'h', i]);
        assert_eq!(
            launched(),
            before + 1,
            "request {i} was not served by a warm clone"
        );
    }
    assert!(invoke_figure(&vm.sock, "refreshes") >= 3);
    wait_until("every clone to be reaped", || {
        leftovers(&scratch).is_empty()
    });
}

#[test]
fn a_busy_keep_alive_runtime_is_refreshed_when_its_timer_was_deferred_too_long() {
    if !kvm_available("invoke_busy_refresh") {
        return;
    }
    // Every delivery moves the guest's due timer interrupt on (--tick-defer-ms): a
    // keep-alive clone asked every 100 ms would never give its kernel its time; it is
    // refreshed once that went on for a second (idle refresh itself is off, the
    // default). Without deferral it has nothing to catch up on between requests.
    let keep = InvokeOptions {
        keep_alive: true,
        ..Default::default()
    };
    let refreshes_when_busy = |defer: &str| {
        let scratch = Scratch::new("invoke-busy");
        let extra = ["--tick-defer-ms", defer];
        let vm = template(&scratch, &extra);
        let r = invoke_with(&vm.sock, &keep, b"start");
        let (clone, _, _) = echoed(&r, b"start");
        let sock = std::path::PathBuf::from(r.header("x-forkvm-socket").unwrap());
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(100));
            let (c, _, _) = echoed(&invoke_with(&sock, &keep, b"busy"), b"busy");
            assert_eq!(c, clone);
        }
        let n = invoke_figure(&sock, "refreshes");
        echoed(&invoke(&sock, b"end"), b"end");
        n
    };
    let deferred = refreshes_when_busy("10");
    assert!((2..=4).contains(&deferred), "{deferred} refreshes in 3 s");
    assert_eq!(refreshes_when_busy("0"), 0);
}

#[test]
fn primed_warm_clones_serve_their_request_and_a_failed_prime_turns_priming_off() {
    if !kvm_available("invoke_primed") {
        return;
    }
    // prime=1: the runtime declares prime requests and answers them without its
    // handler. Every warm clone is primed; each request is still its clone's first
    // (sequence 1), with its own entropy.
    let scratch = Scratch::new("invoke-primed");
    let vm = template_with(
        &scratch,
        "ticks=1 invoke=1 prime=1",
        &["--warm-clones", "2"],
    );
    let pid = vm.child.id();
    let mut entropy = HashSet::new();
    for i in 0..10 {
        wait_until("two warm clones", || {
            vm.describe()["warm_clones"]["ready"] == 2
        });
        let r = invoke(&vm.sock, b"primed echo");
        assert_eq!(r.header("x-forkvm-primed"), Some("true"), "invocation {i}");
        let (_, seq, e) = echoed(&r, b"primed echo");
        assert_eq!(seq, 1, "the prime is no request of the clone's");
        assert!(entropy.insert(e), "entropy repeated at invocation {i}");
    }
    let warm = &vm.describe()["warm_clones"];
    assert_eq!(warm["priming"], true, "{warm}");
    assert!(warm["primed"].as_u64().unwrap() >= 11, "{warm}");
    wait_until("the clones to be reaped", || {
        children_of(pid).len() == 2 && leftovers(&scratch).is_empty()
    });
    drop(vm);

    // prime=2: the prime writes the serial port, which a warm clone without devices
    // cannot serve: the warm clone ends, the template stops priming and serves on with
    // warm clones that are not primed, and nothing is left behind.
    let scratch = Scratch::new("invoke-prime-fails");
    let vm = template_with(
        &scratch,
        "ticks=1 invoke=1 prime=2",
        &["--warm-clones", "2"],
    );
    let pid = vm.child.id();
    wait_until("priming to be turned off and two warm clones", || {
        let warm = &vm.describe()["warm_clones"];
        warm["priming"] == false && warm["ready"] == 2
    });
    assert!(
        vm.stderr_text()
            .contains("prime failed: the runtime left its serving path"),
        "{}",
        vm.stderr_text()
    );
    for _ in 0..5 {
        let r = invoke(&vm.sock, b"after a failed prime");
        assert_eq!(r.header("x-forkvm-primed"), Some("false"));
        echoed(&r, b"after a failed prime");
    }
    wait_until("the clones to be reaped", || {
        children_of(pid).len() == 2 && leftovers(&scratch).is_empty()
    });
    assert!(
        !std::fs::read_to_string(scratch.path("console"))
            .unwrap_or_default()
            .contains('!'),
        "the failed prime's serial write reached the template's console"
    );
    drop(vm);
}

#[test]
fn primes_that_run_out_of_time_pause_priming_which_comes_back_after_the_pause() {
    // prime=3: the runtime never answers its prime, as a prime on a host too busy to run
    // it in time. Three such in a row pause priming (not for good: the runtime is not at
    // fault) for 10 s; the template serves on with warm clones that are not primed.
    // After the pause the next warm clone is primed again, runs out of time again, and
    // the next pause is twice as long.
    if !kvm_available("invoke_prime_timeout") {
        return;
    }
    let scratch = Scratch::new("invoke-prime-slow");
    let vm = template_with(
        &scratch,
        "ticks=1 invoke=1 prime=3",
        &["--warm-clones", "2"],
    );
    let paused = "ran out of time: the host is busy; warm clones are not primed for the next";
    wait_until("priming to be paused and two warm clones", || {
        let warm = &vm.describe()["warm_clones"];
        warm["priming"] == false && warm["ready"] == 2
    });
    let log = vm.stderr_text();
    assert!(log.contains(&format!("{paused} 10 s")), "{log}");
    assert!(!log.contains("no longer primed"), "{log}");
    let started = Instant::now();
    let r = invoke(&vm.sock, b"while paused");
    assert_eq!(r.header("x-forkvm-primed"), Some("false"));
    echoed(&r, b"while paused");
    // Past the pause, each invocation's refill is primed again, until three more ran out
    // of time.
    std::thread::sleep(Duration::from_secs(10).saturating_sub(started.elapsed()));
    let mut served = 0;
    while !vm.stderr_text().contains(&format!("{paused} 20 s")) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "priming did not come back: {}",
            vm.stderr_text()
        );
        let r = invoke(&vm.sock, b"after the pause");
        echoed(&r, b"after the pause");
        served += 1;
        std::thread::sleep(Duration::from_millis(700));
    }
    assert!(served >= 1);
    let warm = &vm.describe()["warm_clones"];
    assert_eq!(warm["priming"], false, "{warm}");
    assert!(warm["primed"].as_u64().unwrap() >= 6, "{warm}");
    drop(vm);
}

#[test]
fn a_prime_takes_no_timer_interrupt_and_leaves_the_timer_as_the_template_had_it() {
    // prime=4: the runtime armed its timer (TSC-deadline mode) before its first wait,
    // due 100M cycles later, so it is due in every clone; the prime spins 400M cycles
    // with interrupts on, a prime that ran long (as one waiting for a busy host's CPU).
    // The prime runs with the timer deferred past its limit: it takes no interrupt.
    // The clone the request launches has the template's deadline back, deferred only
    // by the request's 10 ms: a spin as long in the request takes it, once, and a
    // shorter one none.
    if !kvm_available("invoke_prime_timer") {
        return;
    }
    let scratch = Scratch::new("invoke-prime-timer");
    let vm = template_with(
        &scratch,
        "ticks=1 invoke=1 prime=4",
        &["--warm-clones", "1"],
    );
    // Then "tack": a spin of 16M cycles, within the request's 10 ms, takes none,
    // although the warm clone's vCPU thread ran the prime's 400M before it (the
    // deferral counts the request's run, not the thread's: counted whole, it ended at
    // the first check and the spin took the interrupt).
    let requests = [(b"tick", 1); 3].into_iter().chain([(b"tack", 0); 2]);
    for (i, (verb, in_request)) in requests.enumerate() {
        wait_until("a primed warm clone", || {
            vm.describe()["warm_clones"]["ready"] == 1
        });
        let r = invoke(&vm.sock, verb);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-forkvm-primed"), Some("true"), "invocation {i}");
        assert_eq!(r.bytes.len(), 16, "{}", r.body);
        let count = |at: usize| u64::from_le_bytes(r.bytes[at..at + 8].try_into().unwrap());
        assert_eq!(
            (count(0), count(8)),
            (0, in_request),
            "timer interrupts taken in the prime and in the request, invocation {i}"
        );
    }
    drop(vm);
}

/// `GET /vm` on socket `sock`.
fn describe_at(sock: &Path) -> Value {
    let (code, body) = tests::api_request(sock, "GET", "/vm", None);
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Derives a template from the one on `sock` with load payload `load`; returns its
/// clone id and socket once it is a ready template (paused where its runtime waits).
fn derive(sock: &Path, load: &[u8]) -> (String, std::path::PathBuf) {
    let options = InvokeOptions {
        derive: true,
        ..Default::default()
    };
    let r = invoke_with(sock, &options, load);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-forkvm-outcome"), Some("ok"));
    assert!(r.bytes.is_empty(), "the tiny loader replies with nothing");
    let id = r.header("x-forkvm-clone-id").unwrap().to_string();
    let derived = std::path::PathBuf::from(r.header("x-forkvm-socket").unwrap());
    wait_until("the derived template to pause", || {
        let v = describe_at(&derived);
        v["state"] == "paused" && v["invoke"]["waiting"] == true && v["invoke"]["template"] == true
    });
    (id, derived)
}

/// What the tiny guest's "show" answers in a fresh clone of the template on `sock`,
/// with the clone's id.
fn shown(sock: &Path) -> (Vec<u8>, String) {
    let r = invoke(sock, b"show");
    assert_eq!(r.status, 200, "{}", r.body);
    let id = r.header("x-forkvm-clone-id").unwrap().to_string();
    (r.bytes.clone(), id)
}

/// The gateway's shape with `--rewind`: a template with a vsock device whose functions'
/// templates are derived ones. The derived template's clones come back rewound (the
/// same processes serve), each with what the load left and a clone id of its own, and
/// each life's sockets (control and vsock) go with it.
#[test]
fn a_derived_template_with_a_vsock_device_rewinds_its_clones() {
    if !kvm_available("invoke_derive_rewind") {
        return;
    }
    let scratch = Scratch::new("invoke-derive-rewind");
    let vsock = scratch.path("template.vsock").display().to_string();
    let vm = template_with(
        &scratch,
        "ticks=1 invoke=1 prime=1 load=1",
        &["--warm-clones", "2", "--rewind", "--vsock", &vsock],
    );
    let (id1, sock1) = derive(&vm.sock, b"numpy\0\0\0");
    let (_, body) = vm.api("GET", "/clones", None);
    let list: Value = serde_json::from_str(&body).unwrap();
    let derived = (list["clones"].as_array().unwrap().iter())
        .find(|c| c["id"] == id1.as_str())
        .and_then(|c| c["pid"].as_u64())
        .unwrap_or_else(|| panic!("{id1} not listed: {body}"));
    let files = leftovers(&scratch);
    let settled = || {
        describe_at(&sock1)["warm_clones"]["ready"] == 2
            && children_of(derived as u32).len() == 2
            && leftovers(&scratch) == files
    };
    let (mut ids, mut processes, mut fds) = (HashSet::new(), Vec::new(), Vec::new());
    for i in 0..10 {
        // The first requests' clones report the working set, and the warm clones
        // made before are replaced: the processes are taken after three.
        if i == 3 {
            let mut last = Vec::new();
            wait_until("the derived template's pool to settle", || {
                let now = children_of(derived as u32);
                let same = now == last && settled();
                last = now;
                std::thread::sleep(Duration::from_millis(500));
                same
            });
            processes = last;
        }
        // Their descriptors once each served a life (they take turns): a warm clone
        // that never served one has fewer (its devices' kept queue eventfds, its API
        // thread), which its first life adds for good.
        if i == 5 {
            fds = processes.iter().map(|&p| tests::fds_at_rest(p)).collect();
        }
        let r = invoke(&sock1, b"show");
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.bytes, b"numpy\0\0\0", "invocation {i}");
        let id = r.header("x-forkvm-clone-id").unwrap().to_string();
        assert!(id.starts_with(&format!("{id1}.")), "{id}");
        assert!(ids.insert(id), "a clone id twice");
        wait_until("the clone to come back", settled);
    }
    assert_eq!(
        children_of(derived as u32),
        processes,
        "the derived template's clones were not rewound (forked anew or lost)"
    );
    for (p, n) in processes.into_iter().zip(fds) {
        assert_eq!(fds_of(p, n), n, "fds leaked:\n{}", fd_targets(p));
    }
}

#[test]
fn a_derived_template_serves_fresh_clones_of_what_it_loaded_and_goes_with_its_parent() {
    if !kvm_available("invoke_derive") {
        return;
    }
    // load=1: the runtime declares load requests and keeps a load's first 8 bytes;
    // "show" answers with them.
    let scratch = Scratch::new("invoke-derive");
    let vm = template_with(
        &scratch,
        "ticks=1 invoke=1 prime=1 load=1",
        &["--warm-clones", "2"],
    );
    let pid = vm.child.id();
    assert_eq!(shown(&vm.sock).0, [0u8; 8], "nothing loaded in the root");

    // A derived template: a clone that ran the load, paused where its runtime waits
    // again, with warm clones of its own (primed), its memory measured.
    let (id1, sock1) = derive(&vm.sock, b"numpy\0\0\0trailing");
    wait_until("the derived template's warm clones", || {
        describe_at(&sock1)["warm_clones"]["ready"] == 2
    });
    let info = describe_at(&sock1);
    assert_eq!(info["clone_id"], id1.as_str());
    let own = info["invoke"]["own_memory_kib"]
        .as_u64()
        .expect("own memory measured");
    assert!(own > 0, "{info}");
    let mut ids = HashSet::new();
    for i in 0..5 {
        let r = invoke(&sock1, b"show");
        assert_eq!(r.header("x-forkvm-primed"), Some("true"), "invocation {i}");
        assert_eq!(r.bytes, b"numpy\0\0\0", "invocation {i}");
        let id = r.header("x-forkvm-clone-id").unwrap().to_string();
        assert!(
            id.starts_with(&format!("{id1}.")),
            "{id} is a clone of {id1}"
        );
        assert!(ids.insert(id), "a clone served twice");
        wait_until("the warm clones again", || {
            describe_at(&sock1)["warm_clones"]["ready"] == 2
        });
    }
    let echo = invoke(&sock1, b"still an echo");
    assert_eq!(&echo.bytes[..13], b"still an echo");
    // The parent is untouched, and lists the derived template as a live clone.
    assert_eq!(shown(&vm.sock).0, [0u8; 8]);
    let (code, clones) = vm.api("GET", "/clones", None);
    assert_eq!(code, 200);
    let clones: Value = serde_json::from_str(&clones).unwrap();
    let listed = (clones["clones"].as_array().unwrap().iter()).find(|c| c["id"] == id1.as_str());
    assert_eq!(listed.unwrap()["status"]["state"], "running", "{clones}");

    // A template derived from the derived one: its own load, its parent's unchanged.
    let (id2, sock2) = derive(&sock1, b"json\0\0\0\0");
    assert!(id2.starts_with(&format!("{id1}.")), "{id2}");
    assert_eq!(shown(&sock2).0, b"json\0\0\0\0");
    assert_eq!(shown(&sock1).0, b"numpy\0\0\0");

    // Stopping the derived template (on its parent) takes its own derived template
    // and clones with it; the root serves on and nothing is left.
    let (code, body) = vm.api("DELETE", &format!("/clones/{id1}"), None);
    assert_eq!(code, 200, "{body}");
    wait_until("the derived templates' sockets to go", || {
        !sock1.exists() && !sock2.exists()
    });
    assert_eq!(shown(&vm.sock).0, [0u8; 8]);
    wait_until("the clones to be reaped", || {
        children_of(pid).len() == 2 && leftovers(&scratch).is_empty()
    });
    drop(vm);

    // A runtime that loads nothing cannot be derived from: 409, no clone made.
    let scratch = Scratch::new("invoke-derive-refused");
    let vm = template_with(
        &scratch,
        "ticks=1 invoke=1 prime=1",
        &["--warm-clones", "1"],
    );
    let options = InvokeOptions {
        derive: true,
        ..Default::default()
    };
    let r = invoke_with(&vm.sock, &options, b"numpy");
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(
        error_of(&r).contains("does not take load requests"),
        "{}",
        r.body
    );
    assert_eq!(vm.describe()["invoke"]["started"], 0);
    echoed(&invoke(&vm.sock, b"served on"), b"served on");
}

/// KiB of memory process `pid` alone holds (`Private_Clean` + `Private_Dirty` of its
/// `smaps_rollup`).
fn private_kib(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    (text.lines())
        .filter(|l| l.starts_with("Private_Clean:") || l.starts_with("Private_Dirty:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

/// The template's only child once it is a ready warm clone, and the memory it alone
/// holds when `enough` says it is enough (or once it is steady, for a None).
fn warm_clone_memory(vm: &Vm, enough: Option<u64>) -> u64 {
    let pid = vm.child.id();
    let mut kib = 0;
    wait_until("one ready warm clone", || {
        let ready = describe_at(&vm.sock)["warm_clones"]["ready"].as_u64() == Some(1);
        let children = children_of(pid);
        kib = children.first().map_or(0, |&c| private_kib(c));
        ready && children.len() == 1 && enough.is_none_or(|k| kib >= k)
    });
    if enough.is_none() {
        std::thread::sleep(Duration::from_millis(300));
        kib = children_of(pid).first().map_or(0, |&c| private_kib(c));
    }
    kib
}

/// The memory the clone serving a `tick` request (a 400M-cycle spin, prime=4) to `vm`
/// alone holds, read while the spin runs (it is the template's only child).
fn running_clone_memory(vm: &Vm) -> u64 {
    let sock = vm.sock.clone();
    let caller = std::thread::spawn(move || invoke(&sock, b"tick"));
    let mut kib = 0;
    wait_until("the request's clone to run", || {
        let children = children_of(vm.child.id());
        let (_, body) = tests::api_request(&vm.sock, "GET", "/clones", None);
        kib = children.first().map_or(0, |&c| private_kib(c));
        children.len() == 1 && body.contains("running")
    });
    // What it wrote ahead it wrote before its vCPUs ran; the spin writes nothing more.
    std::thread::sleep(Duration::from_millis(30));
    kib = kib.max(
        children_of(vm.child.id())
            .first()
            .map_or(0, |&c| private_kib(c)),
    );
    let r = caller.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.bytes.len(), 16, "the spin's answer");
    kib
}

/// With no warm clone ready, an invocation's clone is forked on its request: once its
/// template has learned a working set, that clone writes it ahead too, before its vCPUs
/// run (a guest's first write to a page it shares costs about ten times the copy).
#[test]
fn an_invocation_clone_forked_on_demand_writes_the_working_set_ahead() {
    if !kvm_available("invoke_working_set_on_demand") {
        return;
    }
    let payload: Vec<u8> = (0..768u32 << 10).map(|i| (i * 7 % 251) as u8).collect();
    let scratch = Scratch::new("invoke-ws-demand");
    let mut vm = template_with(
        &scratch,
        "ticks=1 invoke=1 prime=4",
        &[
            "--warm-clones",
            "0",
            "--mailbox-mib",
            "1",
            "--log-level",
            "info",
        ],
    );
    // Before the template learned anything: what a clone holds of its own as it runs.
    let before = running_clone_memory(&vm);
    let mut clones = HashSet::new();
    for _ in 0..4 {
        let (clone, _, _) = echoed(&invoke(&vm.sock, &payload), &payload);
        assert!(clones.insert(clone), "clone {clone} served two requests");
    }
    wait_until("the working set learned", || {
        vm.stderr_text().contains("working set: ")
    });
    let after = running_clone_memory(&vm);
    eprintln!("a clone forked on demand: {after} KiB of its own, {before} KiB before learning");
    assert!(
        after >= before + 700,
        "{after} KiB against {before} KiB before"
    );
    // Clones that wrote it ahead echo byte for byte, each its own.
    for _ in 0..2 {
        let (clone, _, _) = echoed(&invoke(&vm.sock, &payload), &payload);
        assert!(clones.insert(clone), "clone {clone} served two requests");
    }
    vm.shutdown(BOOT);
    assert!(leftovers(&scratch).is_empty(), "{:?}", leftovers(&scratch));
}

#[test]
fn a_template_learns_what_its_clones_write_and_warm_clones_made_after_write_it_ahead() {
    if !kvm_available("invoke_working_set") {
        return;
    }
    // Each echo writes 768 KiB into its clone's mailbox (the request) and the guest reads
    // and writes them back: pages every clone of the template writes.
    let payload: Vec<u8> = (0..768u32 << 10).map(|i| (i * 7 % 251) as u8).collect();
    let serve = |vm: &Vm, n: usize, clones: &mut HashSet<u64>| {
        for _ in 0..n {
            let (clone, _, _) = echoed(&invoke(&vm.sock, &payload), &payload);
            assert!(clones.insert(clone), "clone {clone} served two requests");
        }
    };
    let args = |mib| {
        [
            "--warm-clones",
            "1",
            "--mailbox-mib",
            "1",
            "--log-level",
            "info",
            "--working-set-mib",
            mib,
        ]
    };
    // Without a working set: what a warm clone holds of its own after the same requests.
    let off_scratch = Scratch::new("invoke-ws-off");
    let mut off = template(&off_scratch, &args("0"));
    serve(&off, 4, &mut HashSet::new());
    let plain = warm_clone_memory(&off, None);
    assert!(
        !off.stderr_text().contains("working set:"),
        "{}",
        off.stderr_text()
    );
    off.shutdown(BOOT);

    let scratch = Scratch::new("invoke-ws");
    let mut vm = template(&scratch, &args("64"));
    let mut clones = HashSet::new();
    serve(&vm, 4, &mut clones);
    wait_until("the working set learned", || {
        vm.stderr_text().contains("working set: ")
    });
    let log = vm.stderr_text();
    let line = log.lines().find(|l| l.contains("working set: ")).unwrap();
    let learned: u64 = line
        .split("working set: ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(learned >= 768, "{line}");
    // A warm clone made from now on copies the set ahead: it holds it of its own.
    let ahead = warm_clone_memory(&vm, Some(plain + 700));
    eprintln!(
        "warm clone: {ahead} KiB of its own, {plain} KiB without a working set of {learned} KiB"
    );
    assert!(
        ahead >= plain + 700,
        "{ahead} KiB against {plain} KiB without"
    );
    // Clones that wrote it ahead echo byte for byte, each its own.
    serve(&vm, 4, &mut clones);
    assert_eq!(clones.len(), 8);
    vm.shutdown(BOOT);
    assert!(leftovers(&scratch).is_empty(), "{:?}", leftovers(&scratch));
}
