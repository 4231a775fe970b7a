//! The FaaS gateway example (`examples/gateway`, docs/faas.md) used as its tutorial
//! says, with a real HTTP client: start it, deploy Python functions, invoke them (many
//! at once, each in its own clone), read the metrics, delete, stop; every error answer
//! the tutorial names; nothing left behind. Started again from a tree `make
//! install-files` made, it serves docs/getting-started.md's function as the page says.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tests::{cache, kvm_available, workspace_bin, Scratch};

/// A Linux boot and Python's start on this PVM host take a minute or two; more on a
/// busy one.
const START: Duration = Duration::from_secs(600);

struct Gateway {
    child: Child,
    url: String,
    agent: ureq::Agent,
    /// Its standard error (its log).
    log: PathBuf,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

struct Answer {
    status: u16,
    headers: ureq::http::HeaderMap,
    body: String,
}

impl Gateway {
    /// Starts the gateway on a free loopback port with `guest`'s kernel and root image,
    /// its base template kept as a snapshot in the test cache ([`base_snapshots`]), and
    /// waits until it serves.
    fn start(scratch: &Scratch, guest: &(String, String, PathBuf), name: &str) -> Gateway {
        let (kernel, rootfs, snapshots) = guest;
        let program = workspace_bin("forkvm-gateway");
        let packages = scratch.path(&format!("{name}-packages"));
        let packages = packages.to_str().unwrap();
        let args = [
            "--kernel",
            kernel,
            "--rootfs",
            rootfs,
            "--package-cache",
            packages,
        ];
        Gateway::start_program(scratch, &program, &args, snapshots, name)
    }

    /// Starts `program` with `args` as [`Gateway::start`] does.
    fn start_program(
        scratch: &Scratch,
        program: &std::path::Path,
        args: &[&str],
        snapshots: &std::path::Path,
        name: &str,
    ) -> Gateway {
        let log = scratch.path(&format!("{name}.log"));
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        let listen = format!("127.0.0.1:{port}");
        let mut child = Command::new(program)
            .args(["--listen", &listen, "--warm-clones", "1"])
            .args(args)
            .arg("--base-snapshot")
            .arg(snapshots)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("forkvm-gateway");
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let line = rx.recv_timeout(START).unwrap_or_else(|_| {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            panic!("the gateway did not serve; its log:\n{log}")
        });
        assert_eq!(line, format!("forkvm-gateway: serving on http://{listen}"));
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(300)))
            .build();
        Gateway {
            child,
            url: format!("http://{listen}"),
            agent: config.into(),
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn send(&self, method: &str, path: &str, body: &str) -> Answer {
        let url = format!("{}{path}", self.url);
        let r = match method {
            "PUT" => self.agent.put(&url).send(body),
            "POST" => self.agent.post(&url).send(body),
            "GET" => self.agent.get(&url).call(),
            "DELETE" => self.agent.delete(&url).call(),
            _ => unreachable!(),
        };
        let mut r = r.unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        Answer {
            status: r.status().as_u16(),
            headers: r.headers().clone(),
            body: r.body_mut().read_to_string().unwrap(),
        }
    }

    fn deploy(&self, name: &str, spec: Value) -> Answer {
        self.send("PUT", &format!("/functions/{name}"), &spec.to_string())
    }

    fn invoke(&self, name: &str, event: &str) -> Answer {
        self.send("POST", &format!("/functions/{name}"), event)
    }

    /// A metric's value in `GET /metrics` (the sample line that starts with `sample`).
    fn metric(&self, sample: &str) -> f64 {
        let text = self.send("GET", "/metrics", "").body;
        (text.lines())
            .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }
}

/// The guest files (copies in the test cache, so the gateway's memo of their hashes
/// holds from run to run) and the gateway's `--base-snapshot` directory, in the test
/// cache under a name that changes with the sources of what a snapshot holds
/// (`tests::cache::entry`): the first run boots the base template and saves it, the
/// others restore it.
fn base_snapshots() -> (String, String, PathBuf) {
    let kernel = cache::guest_image("vmlinux");
    let rootfs = cache::guest_image("python.ext4");
    let key = cache::CachedBoot {
        name: "gateway-base",
        run_args: &[&kernel, &rootfs],
        ready: &|_| {},
    };
    let dir = cache::entry(&key);
    // Recently used: kept by the cache's pruning.
    let _ = std::fs::File::open(&dir).and_then(|f| f.set_modified(std::time::SystemTime::now()));
    (kernel, rootfs, dir)
}

/// Signals the gateway with SIGTERM and waits up to 30 s for it to exit: it stops every
/// VMM it started and exits 0.
fn stop(gw: &mut Gateway) {
    // SAFETY: signals the gateway this test started, still running.
    unsafe { libc::kill(gw.child.id() as i32, libc::SIGTERM) };
    let started = Instant::now();
    let status = loop {
        if let Some(s) = gw.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the gateway did not stop"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
}

fn json(a: &Answer) -> Value {
    serde_json::from_str(&a.body).unwrap_or_else(|e| panic!("{e}: {}", a.body))
}

/// Processes whose parent is `pid` (any thread).
fn children_of(pid: u32) -> Vec<u32> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten();
    tasks
        .flatten()
        .flat_map(|t| {
            std::fs::read_to_string(t.path().join("children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(true, |s| s.contains(") Z ") || s.contains(") X "))
}

/// `make install-files` of this build into `scratch`; returns the prefix.
fn install(scratch: &Scratch) -> PathBuf {
    let destdir = scratch.path("installed");
    let bin_dir = workspace_bin("vmm").parent().unwrap().to_path_buf();
    let out = Command::new("make")
        .arg("-C")
        .arg(tests::repo_root())
        .arg("install-files")
        .arg(format!("DESTDIR={}", destdir.display()))
        .arg("PREFIX=/usr/local")
        .arg(format!("BIN_DIR={}", bin_dir.display()))
        .output()
        .expect("make");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "make install-files: {text}");
    let prefix = destdir.join("usr/local");
    for f in [
        "bin/vmm",
        "bin/jailer",
        "bin/forkvm-gateway",
        "share/forkvm/vmlinux",
        "share/forkvm/python.ext4",
        "lib/systemd/system/forkvm-gateway.service",
    ] {
        assert!(prefix.join(f).is_file(), "{f} not installed");
    }
    prefix
}

/// The installed systemd unit's command (its `ExecStart=`), the program under
/// `prefix`: the program and the options other than `--listen` and `--base-snapshot`
/// (and their values), which the test sets itself (a free port, the test cache), with
/// `--package-cache`'s value replaced by `packages`.
fn unit_command(prefix: &std::path::Path, packages: &str) -> (PathBuf, Vec<String>) {
    let unit = prefix.join("lib/systemd/system/forkvm-gateway.service");
    let text = std::fs::read_to_string(&unit).expect("the installed unit");
    let line = (text.lines())
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart= in the unit");
    let mut words = line.split_whitespace();
    let program = words.next().expect("a program");
    assert_eq!(program, "/usr/local/bin/forkvm-gateway", "{line}");
    let mut args = Vec::new();
    let (mut listen, mut snapshot, mut cache) = (false, false, false);
    while let Some(w) = words.next() {
        match w {
            "--listen" => listen = words.next().is_some(),
            "--base-snapshot" => snapshot = words.next().is_some(),
            "--package-cache" => {
                cache = words.next().is_some();
                args.extend(["--package-cache".to_string(), packages.to_string()]);
            }
            _ => args.push(w.to_string()),
        }
    }
    assert!(
        listen && snapshot && cache,
        "the unit serves on an address from a snapshot, with a package cache: {line}"
    );
    (prefix.join("bin/forkvm-gateway"), args)
}

/// docs/getting-started.md's steps 3 to 5 against `gw`, with the page's own function
/// (its `hello.json`) and requests: deploy, invoke, read the logs; its secret in none
/// of the answers. Deletes the function after.
fn getting_started(gw: &Gateway) {
    let page = std::fs::read_to_string(tests::repo_root().join("docs/getting-started.md"))
        .expect("docs/getting-started.md");
    let start = page
        .find("cat > hello.json <<'EOF'\n")
        .expect("the page's hello.json");
    let rest = &page[start..];
    let body = &rest[rest.find('\n').unwrap() + 1..rest.find("\nEOF\n").unwrap()];
    let spec: Value = serde_json::from_str(body).expect("the page's hello.json parses");
    let token = spec["secrets"]["API_TOKEN"].as_str().unwrap().to_string();
    let a = gw.deploy("hello", spec);
    assert_eq!(a.status, 201, "{}", a.body);
    assert_eq!(json(&a)["secrets"], serde_json::json!(["API_TOKEN"]));
    let a = gw.invoke("hello", r#"{"name": "Ada"}"#);
    assert_eq!((a.status, a.body.as_str()), (200, r#"{"hello": "Ada"}"#));
    let a = gw.send("POST", "/functions/hello?logs=true", r#"{"name": "Grace"}"#);
    assert_eq!(a.status, 200, "{}", a.body);
    let v = json(&a);
    assert_eq!(v["reply"], r#"{"hello": "Grace"}"#);
    let logs = format!(
        "greeting Grace\nWARNING:root:token has {} characters\n",
        token.len()
    );
    assert_eq!(v["logs"], logs);
    let a = gw.send("GET", "/functions/hello/logs", "");
    let entries = json(&a);
    assert_eq!(entries.as_array().unwrap().len(), 2, "{}", a.body);
    assert_eq!(entries[0]["invocation"], v["invocation"]);
    assert_eq!(entries[0]["logs"], logs);
    for path in ["/functions", "/functions/hello/logs", "/metrics"] {
        let body = gw.send("GET", path, "").body;
        assert!(!body.contains(&token), "{path}: {body}");
    }
    assert_eq!(gw.send("DELETE", "/functions/hello", "").status, 204);
}

const HELLO: &str = "import json\n\ndef handler(event):\n    name = json.loads(event or b'{}').get('name', 'world')\n    return json.dumps({'hello': name})\n";

/// Prints, logs and uses its environment and a secret: ends as the event says.
const TALK: &str = "import logging, os, signal, time\n\ndef handler(event):\n    token = os.environ['TOKEN']\n    print('printing', event.decode())\n    logging.warning('token is %s', token)\n    if event == b'raise':\n        print('about to raise')\n        raise ValueError('bad token ' + token)\n    if event == b'loop':\n        print('looping')\n        while True:\n            pass\n    if event == b'hang':\n        print('hanging with', token)\n        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])\n        time.sleep(60)\n    return '%s %d' % (os.environ['GREETING'], len(token))\n";

/// TALK's secret.
const TOKEN: &str = "tok-5ecret-77";

#[test]
fn the_tutorial_deploys_invokes_and_measures_python_functions_over_http() {
    if !kvm_available("gateway") {
        return;
    }
    let scratch = Scratch::new("gateway");
    let guest = base_snapshots();
    let mut gw = Gateway::start(&scratch, &guest, "first");
    // Deploy: its template is derived from the base (nothing imported yet).
    let a = gw.deploy(
        "hello",
        serde_json::json!({"source": HELLO, "packages": ["json"]}),
    );
    assert_eq!(a.status, 201, "{}", a.body);
    assert_eq!(json(&a)["tier"], "base");

    // Invoke: the handler's reply, from a fresh clone each time; 8 at once.
    let a = gw.invoke("hello", r#"{"name": "forkvm"}"#);
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(json(&a), serde_json::json!({"hello": "forkvm"}));
    assert_eq!(a.headers["x-forkvm-tier"], "function");
    let replies: Vec<Answer> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..8)
            .map(|i| {
                let gw = &gw;
                s.spawn(move || gw.invoke("hello", &format!(r#"{{"name": "caller {i}"}}"#)))
            })
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    let mut clones = std::collections::HashSet::new();
    for (i, a) in replies.iter().enumerate() {
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(json(a)["hello"], format!("caller {i}"));
        let id = a.headers["x-forkvm-clone-id"].to_str().unwrap().to_string();
        assert!(clones.insert(id), "a clone served twice");
    }

    // A second function of the same packages makes their zygote; a third starts from
    // it; a function that also imports something else starts from it too (subset).
    let shout = serde_json::json!({
        "source": "import json\ndef handler(event):\n    return event.upper()\n",
        "packages": ["json"],
    });
    assert_eq!(json(&gw.deploy("shout", shout.clone()))["tier"], "base");
    assert_eq!(gw.metric("forkvm_zygotes_made"), 1.0);
    assert_eq!(json(&gw.deploy("shout2", shout))["tier"], "zygote");
    let both = serde_json::json!({
        "source": "import json, base64\ndef handler(event):\n    return base64.b64encode(event)\n",
        "packages": ["json", "base64"],
    });
    assert_eq!(json(&gw.deploy("b64", both))["tier"], "subset");
    assert_eq!(gw.invoke("b64", "hi").body, "aGk=");
    assert_eq!(gw.invoke("shout2", "hi").body, "HI");

    // Errors: a handler that raises (500, its traceback), a handler past its timeout
    // (504), source that does not load (400), a bad spec or name (400), no such
    // function (404).
    let div = serde_json::json!({"source": "def handler(event):\n    return 1 / 0\n"});
    assert_eq!(gw.deploy("div", div).status, 201);
    let a = gw.invoke("div", "");
    assert_eq!(a.status, 500);
    assert!(a.body.contains("ZeroDivisionError"), "{}", a.body);
    let slow = serde_json::json!({
        "source": "def handler(event):\n    while True:\n        pass\n",
        "limits": {"timeout_ms": 300},
    });
    assert_eq!(gw.deploy("slow", slow).status, 201);
    assert_eq!(gw.invoke("slow", "").status, 504);
    let a = gw.deploy("broken", serde_json::json!({"source": "def handler(:\n"}));
    assert_eq!(a.status, 400);
    assert!(a.body.contains("SyntaxError"), "{}", a.body);
    let a = gw.deploy(
        "x",
        serde_json::json!({"source": "", "limits": {"class": "none"}}),
    );
    assert_eq!(a.status, 400, "{}", a.body);
    assert_eq!(gw.send("PUT", "/functions/x", "not json").status, 400);
    assert_eq!(
        gw.deploy("a.b", serde_json::json!({"source": ""})).status,
        400
    );
    assert_eq!(gw.invoke("nope", "").status, 404);

    // What a function prints is kept per invocation, its secrets taken out: an ok, a
    // raising and a timed-out invocation; env and secrets reach the handler, and a
    // secret's value is in no answer, listing, log or metric.
    let talk = serde_json::json!({
        "source": TALK,
        "env": {"GREETING": "hello"},
        "secrets": {"TOKEN": TOKEN},
        "limits": {"timeout_ms": 4000},
    });
    let a = gw.deploy("talk", talk);
    assert_eq!(a.status, 201, "{}", a.body);
    assert_eq!(json(&a)["secrets"], serde_json::json!(["TOKEN"]));
    let a = gw.invoke("talk", "ok");
    assert_eq!((a.status, a.body.as_str()), (200, "hello 13"), "{}", a.body);
    let a = gw.send("POST", "/functions/talk?logs=true", "ok");
    assert_eq!(a.status, 200, "{}", a.body);
    let v = json(&a);
    assert_eq!(v["reply"], "hello 13");
    assert_eq!(
        v["logs"],
        "printing ok\nWARNING:root:token is [secret TOKEN]\n"
    );
    assert_eq!(
        v["invocation"],
        a.headers["x-forkvm-clone-id"].to_str().unwrap()
    );
    let a = gw.invoke("talk", "raise");
    assert_eq!(a.status, 500, "{}", a.body);
    assert!(
        a.body.contains("ValueError: bad token [secret TOKEN]"),
        "{}",
        a.body
    );
    let a = gw.invoke("talk", "loop");
    assert_eq!(a.status, 504, "{}", a.body);
    // One the runtime cannot interrupt (SIGALRM blocked) meets the VMM's own limit: its
    // answer and its log entry still hold what it printed, from the runtime's live log
    // in the mailbox, and the clone that ran it.
    let a = gw.send("POST", "/functions/talk?logs=true", "hang");
    assert_eq!(a.status, 504, "{}", a.body);
    let v = json(&a);
    let printed =
        "printing hang\nWARNING:root:token is [secret TOKEN]\nhanging with [secret TOKEN]\n";
    assert_eq!(v["logs"], printed, "{}", a.body);
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("did not reply in time"),
        "{}",
        a.body
    );
    let hung = v["invocation"].as_str().unwrap().to_string();
    assert!(!hung.is_empty(), "{}", a.body);
    let a = gw.send("GET", "/functions/talk/logs", "");
    assert_eq!(a.status, 200, "{}", a.body);
    let entries = json(&a);
    let outcomes: Vec<&str> = (entries.as_array().unwrap().iter())
        .map(|e| e["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(
        outcomes,
        ["timeout", "timeout", "handler_error", "ok", "ok"],
        "{}",
        a.body
    );
    assert_eq!(entries[0]["logs"], printed, "{}", a.body);
    assert_eq!(entries[0]["invocation"], hung.as_str(), "{}", a.body);
    assert!(entries[1]["logs"].as_str().unwrap().ends_with("looping\n"));
    assert!(entries[2]["logs"]
        .as_str()
        .unwrap()
        .contains("about to raise\n"));
    let a = gw.send("GET", "/functions/talk/logs?limit=1", "");
    assert_eq!(json(&a).as_array().unwrap().len(), 1);
    assert_eq!(gw.send("GET", "/functions/nope/logs", "").status, 404);
    assert_eq!(
        gw.send("POST", "/functions/talk?verbose=1", "ok").status,
        400
    );
    for path in ["/functions", "/functions/talk/logs", "/metrics"] {
        let body = gw.send("GET", path, "").body;
        assert!(!body.contains(TOKEN), "{path}: {body}");
    }

    // A zygote made ahead of deployments.
    let a = gw.send("PUT", "/zygotes", r#"{"packages": ["base64"]}"#);
    assert_eq!(a.status, 200, "{}", a.body);
    let sets = json(&gw.send("GET", "/zygotes", ""));
    assert_eq!(sets, serde_json::json!([[], ["base64"], ["json"]]));
    assert_eq!(
        gw.send("PUT", "/zygotes", r#"{"packages": ["a-b"]}"#)
            .status,
        400
    );

    // List, metrics, delete.
    let listed = json(&gw.send("GET", "/functions", ""));
    let names: Vec<&str> = (listed.as_array().unwrap().iter())
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["b64", "div", "hello", "shout", "shout2", "slow", "talk"]
    );
    let talk = &listed[6];
    assert_eq!(talk["env"], serde_json::json!({"GREETING": "hello"}));
    assert_eq!(talk["invocations"], 5);
    let ok = gw.metric(r#"forkvm_invocations_total{function="hello",outcome="ok"}"#);
    assert_eq!(ok, 9.0);
    assert_eq!(
        gw.metric(r#"forkvm_invocations_total{function="div",outcome="handler_error"}"#),
        1.0
    );
    assert_eq!(
        gw.metric(r#"forkvm_invocations_total{function="slow",outcome="timeout"}"#),
        1.0
    );
    assert_eq!(
        gw.metric(r#"forkvm_invocations_total{function="talk",outcome="ok"}"#),
        2.0
    );
    assert_eq!(
        gw.metric(r#"forkvm_invocations_total{function="talk",outcome="timeout"}"#),
        2.0
    );
    // hello 9, talk 5, b64, shout2, div and slow 1 each; 13 answered ok; the guest's
    // errors: div, slow, talk's three and the deployment that did not load.
    assert_eq!(
        gw.metric(r#"forkvm_cache_hits_total{tier="function"}"#),
        18.0
    );
    assert_eq!(gw.metric("forkvm_invocation_duration_seconds_count"), 13.0);
    assert_eq!(gw.metric("forkvm_clones_total"), 18.0);
    assert_eq!(gw.metric(r#"forkvm_errors_total{kind="guest"}"#), 6.0);
    assert!(gw.metric("forkvm_template_memory_bytes") > 0.0);
    assert_eq!(gw.send("DELETE", "/functions/hello", "").status, 204);
    assert_eq!(gw.invoke("hello", "").status, 404);
    assert_eq!(gw.send("DELETE", "/functions/hello", "").status, 404);

    // SIGTERM: the gateway stops every VMM it started and exits 0.
    let base = children_of(gw.child.id());
    assert_eq!(base.len(), 1, "one base template VMM: {base:?}");
    let mut vmms = base.clone();
    let mut i = 0;
    while i < vmms.len() {
        vmms.extend(children_of(vmms[i]));
        i += 1;
    }
    assert!(
        vmms.len() > 6,
        "the base, its zygote, the functions' templates and their warm clones: {vmms:?}"
    );
    stop(&mut gw);
    assert!(vmms.iter().all(|&p| gone(p)), "VMMs left: {vmms:?}");

    // Started again, installed: `make install-files` (as `make install`, from this
    // build) into a scratch tree, the gateway started from there as the installed
    // systemd unit starts it (its ExecStart: no --kernel or --rootfs; a free port and
    // the test cache's snapshot for its address and directory). It finds vmm beside
    // itself and the guest images in share/forkvm, and its base template is restored
    // from the snapshot (saved by the first start of these sources; the installed files
    // are the same bytes), not booted.
    let first = gw.log();
    assert!(
        first.contains("base template restored from") || first.contains("base template saved in"),
        "{first}"
    );
    let prefix = install(&scratch);
    let packages = scratch.path("again-packages");
    let (program, mut unit_args) = unit_command(&prefix, packages.to_str().unwrap());
    // Wheels made here: the gateway takes them from a directory, not an index.
    let wheels = scratch.path("wheels");
    std::fs::create_dir_all(&wheels).unwrap();
    for v in ["1.0", "2.0"] {
        tests::wheels::pure(&scratch.path(""), v, &wheels);
    }
    tests::wheels::c_extension(&scratch.path(""), &wheels);
    unit_args.extend(["--find-links".into(), wheels.display().to_string()]);
    let unit_args: Vec<&str> = unit_args.iter().map(String::as_str).collect();
    let mut gw = Gateway::start_program(&scratch, &program, &unit_args, &guest.2, "again");
    let log = gw.log();
    assert!(log.contains("base template restored from"), "{log}");
    assert!(!log.contains("booting the base template"), "{log}");
    getting_started(&gw);
    let a = gw.deploy(
        "hello",
        serde_json::json!({"source": HELLO, "packages": ["json"]}),
    );
    assert_eq!(a.status, 201, "{}", a.body);
    let a = gw.invoke("hello", r#"{"name": "again"}"#);
    assert_eq!(json(&a), serde_json::json!({"hello": "again"}));
    requirements(&gw, &packages);

    // Warm-up events: the handler ran on them in the function's template, before it
    // paused, so every clone starts from what they left (its `seen`), and each request
    // still runs in a clone of its own with its own randomness.
    let warm = serde_json::json!({
        "source": WARMED,
        "packages": ["json"],
        "warmup": ["w1", {"base64": "dzI="}],
    });
    let a = gw.deploy("warm", warm);
    assert_eq!(a.status, 201, "{}", a.body);
    let replies: Vec<Answer> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..4)
            .map(|i| {
                let gw = &gw;
                s.spawn(move || gw.invoke("warm", &format!("r{i}")))
            })
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    let mut distinct = std::collections::HashSet::new();
    for (i, a) in replies.iter().enumerate() {
        assert_eq!(a.status, 200, "{}", a.body);
        let v = json(a);
        assert_eq!(
            v["seen"],
            serde_json::json!(["w1", "w2", format!("r{i}")]),
            "{v}"
        );
        for key in ["urandom", "uuid", "random"] {
            assert!(distinct.insert(v[key].to_string()), "{key} repeated: {v}");
        }
        let id = a.headers["x-forkvm-clone-id"].to_str().unwrap().to_string();
        assert!(distinct.insert(id), "a clone served twice");
    }
    // A warm-up event that raises fails the deployment, naming the event.
    let a = gw.deploy(
        "warm-fails",
        serde_json::json!({"source": WARMED, "warmup": ["w1", "fail"]}),
    );
    assert_eq!(a.status, 400, "{}", a.body);
    assert!(
        a.body.contains("warm-up event 1 failed: refused") && a.body.contains("ValueError"),
        "{}",
        a.body
    );
    let a = gw.deploy(
        "warm-bad",
        serde_json::json!({"source": WARMED, "warmup": [{"base64": "%%"}]}),
    );
    assert_eq!(a.status, 400, "{}", a.body);
    assert!(a.body.contains("bad base64"), "{}", a.body);
    stop(&mut gw);
}

/// Imports both test packages (`tests::wheels`) and answers with what they say.
const PACKAGED: &str = "import fkvm_c, fkvm_pure\ndef handler(e):\n    return 'hello %s from %s and %d' % (e.decode(), fkvm_pure.VERSION, fkvm_c.answer())\n";

/// Functions with requirements on `gw` (its package cache in `packages`, its wheels
/// the test's): they import them; the same requirements are one package set, one image
/// and one root zygote, another version another; bad requirements are refused with
/// pip's reason, nothing built.
fn requirements(gw: &Gateway, packages: &std::path::Path) {
    let spec = |reqs: &[&str]| {
        serde_json::json!({
            "source": PACKAGED,
            "packages": ["fkvm_pure", "fkvm_c"],
            "requirements": reqs,
        })
    };
    let a = gw.deploy("pkg1", spec(&["fkvm-pure==1.0", "fkvm-c"]));
    assert_eq!(a.status, 201, "{}", a.body);
    let mut set = json(&a)["package_set"].clone();
    assert_eq!(
        set["resolved"],
        serde_json::json!(["fkvm-c==1.0", "fkvm-pure==1.0"])
    );
    assert_eq!(set["built"], true, "{set}");
    assert!(set["build_ms"].as_u64().unwrap() > 0, "{set}");
    set["built"] = false.into();
    set["build_ms"] = 0.into();
    let a = gw.invoke("pkg1", "Ada");
    assert_eq!(
        (a.status, a.body.as_str()),
        (200, "hello Ada from 1.0 and 42")
    );
    let a = gw.deploy("pkg2", spec(&["fkvm-c", "fkvm-pure==1.0"]));
    assert_eq!(a.status, 201, "{}", a.body);
    assert_eq!(json(&a)["package_set"], set, "the same set, from the cache");
    assert_eq!(gw.metric("forkvm_package_sets_mounted"), 1.0);
    let a = gw.deploy("pkg3", spec(&["fkvm-pure==2.0", "fkvm-c"]));
    assert_eq!(a.status, 201, "{}", a.body);
    assert_ne!(json(&a)["package_set"]["key"], set["key"]);
    assert_eq!(gw.invoke("pkg3", "Lin").body, "hello Lin from 2.0 and 42");
    assert_eq!(gw.metric("forkvm_package_sets_mounted"), 2.0);
    // A zygote made ahead over a set.
    let a = gw.send(
        "PUT",
        "/zygotes",
        r#"{"packages": ["fkvm_pure"], "requirements": ["fkvm-pure==2.0", "fkvm-c"]}"#,
    );
    assert_eq!(a.status, 200, "{}", a.body);
    let images = || {
        (std::fs::read_dir(packages).unwrap().flatten())
            .filter(|e| e.path().extension().is_some_and(|x| x == "ext4"))
            .count()
    };
    assert_eq!(images(), 2);
    for (reqs, status, says) in [
        (&["--index-url=http://x"][..], 400, "is no requirement"),
        (&["fkvm-missing"][..], 422, "fkvm-missing"),
    ] {
        let a = gw.deploy("pkgbad", spec(reqs));
        assert_eq!(a.status, status, "{reqs:?}: {}", a.body);
        assert!(a.body.contains(says), "{reqs:?}: {}", a.body);
    }
    assert_eq!(images(), 2, "nothing built for a refused set");
    let listed = json(&gw.send("GET", "/functions", ""));
    let pkg1 = (listed.as_array().unwrap().iter())
        .find(|f| f["name"] == "pkg1")
        .unwrap();
    assert_eq!(
        pkg1["requirements"],
        serde_json::json!(["fkvm-pure==1.0", "fkvm-c"])
    );
    assert_eq!(pkg1["package_set"]["key"], set["key"]);
    assert_eq!(pkg1["package_set"]["resolved"], set["resolved"]);
    // The sets, their functions and zygotes: the first's root and the zygote its second
    // deployment made; the second's root and the one made ahead.
    let sets = json(&gw.send("GET", "/package-sets", ""));
    let of = |key: &Value| {
        (sets.as_array().unwrap().iter())
            .find(|s| s["key"] == *key)
            .cloned()
            .unwrap_or_else(|| panic!("no set {key} in {sets}"))
    };
    let first = of(&set["key"]);
    assert_eq!(
        first["functions"],
        serde_json::json!(["pkg1", "pkg2"]),
        "{sets}"
    );
    assert_eq!(
        first["zygotes"],
        serde_json::json!([[], ["fkvm_c", "fkvm_pure"]]),
        "{sets}"
    );
    let second = (sets.as_array().unwrap().iter())
        .find(|s| s["key"] != set["key"])
        .unwrap();
    assert_eq!(second["functions"], serde_json::json!(["pkg3"]), "{sets}");
    assert_eq!(
        second["zygotes"],
        serde_json::json!([[], ["fkvm_pure"]]),
        "{sets}"
    );
    assert_eq!(sets.as_array().unwrap().len(), 2, "{sets}");
    assert!(!listed.to_string().contains("pkgbad"), "{listed}");
}

/// A handler that answers with every event it has seen (warm-up events included) and
/// fresh randomness of each kind.
const WARMED: &str = r#"
import json, os, random, uuid

seen = []

def handler(event):
    seen.append(event.decode())
    if event == b"fail":
        raise ValueError("refused")
    return json.dumps({"seen": seen, "urandom": os.urandom(16).hex(),
                       "uuid": str(uuid.uuid4()), "random": random.random()})
"#;
