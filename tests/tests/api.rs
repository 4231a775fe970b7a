//! The control API against its description: every answer a live VMM gives is one
//! `docs/api/openapi.yaml` lists for its route, and every body decodes into the
//! `api_types` type the spec names and encodes back to the same JSON (no field the types
//! lack, none they have that the server left out).

use std::time::Duration;

use api_types::{CloneInfo, CloneList, ErrorBody, VmInfo};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use tests::{kvm_available, raw_request, repo_root, tiny_vm, Scratch, Vm};

fn spec() -> Value {
    let text = std::fs::read_to_string(repo_root().join("docs/api/openapi.yaml")).unwrap();
    serde_norway::from_str(&text).unwrap()
}

/// `path` as the spec writes it.
fn template(path: &str) -> &str {
    if path.starts_with("/clones/") {
        "/clones/{id}"
    } else {
        path
    }
}

/// The body decodes into `T` and `T` encodes back to the same JSON.
fn round_trips<T: Serialize + DeserializeOwned>(what: &str, body: &str) -> T {
    let raw: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{what}: {e}: {body}"));
    let typed: T =
        serde_json::from_value(raw.clone()).unwrap_or_else(|e| panic!("{what}: {e}: {body}"));
    assert_eq!(serde_json::to_value(&typed).unwrap(), raw, "{what}");
    typed
}

/// Sends one request and checks its answer against the spec: the status is listed for
/// the route (or, for 404, the path is unknown; for 405, the method is not listed for
/// it), and the body is the type it names.
fn exchange(vm: &Vm, spec: &Value, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let (status, text) = vm.api(method, path, body);
    let what = format!("{method} {path} -> {status}");
    let op = &spec["paths"][template(path)][method.to_lowercase()];
    if status == 404 && op.is_null() {
        assert!(
            spec["paths"].get(template(path)).is_none(),
            "{what}: path in the spec"
        );
    } else if status == 405 && op.is_null() {
        // A method the path does not take: the path is in the spec, the method is not.
        assert!(spec["paths"].get(template(path)).is_some(), "{what}");
        round_trips::<ErrorBody>(&what, &text);
    } else {
        let answer = &op["responses"][status.to_string()];
        assert!(answer.is_object(), "{what}: status not in the spec: {text}");
        let schema = answer["content"]["application/json"]["schema"]["$ref"].as_str();
        match schema {
            None => assert!(text.is_empty(), "{what}: a body the spec does not describe"),
            Some("#/components/schemas/VmInfo") => drop(round_trips::<VmInfo>(&what, &text)),
            Some("#/components/schemas/CloneList") => drop(round_trips::<CloneList>(&what, &text)),
            Some("#/components/schemas/CloneInfo") => drop(round_trips::<CloneInfo>(&what, &text)),
            Some("#/components/schemas/ErrorBody") => drop(round_trips::<ErrorBody>(&what, &text)),
            Some(other) => panic!("{what}: no check for {other}"),
        }
    }
    (status, text)
}

#[test]
fn every_answer_of_a_live_vmm_is_in_the_spec_and_decodes_into_the_types() {
    if !kvm_available("every_answer_of_a_live_vmm_is_in_the_spec_and_decodes_into_the_types") {
        return;
    }
    let scratch = Scratch::new("api-spec");
    let mut vm = tiny_vm(&scratch, "32", "1", "ticks=1 beat=20");
    vm.wait_api(Duration::from_secs(10));
    let spec = spec();
    let ex = |m: &str, p: &str, b: Option<&str>| exchange(&vm, &spec, m, p, b);

    let (status, body) = ex("GET", "/vm", None);
    assert_eq!(status, 200);
    let info: VmInfo = serde_json::from_str(&body).unwrap();
    assert_eq!(info.state, api_types::VmState::Running);
    assert_eq!(ex("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
    assert_eq!(ex("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 409);
    let (status, body) = ex("POST", "/clones", Some(r#"{"count":1,"console":"null"}"#));
    assert_eq!(status, 201, "{body}");
    let made: CloneList = serde_json::from_str(&body).unwrap();
    let id = made.clones[0].id.clone();
    assert_eq!(ex("GET", "/clones", None).0, 200);
    assert_eq!(ex("GET", &format!("/clones/{id}"), None).0, 405);
    assert_eq!(ex("DELETE", &format!("/clones/{id}"), None).0, 200);
    assert_eq!(ex("DELETE", &format!("/clones/{id}"), None).0, 404);
    assert_eq!(ex("PATCH", "/vm", Some(r#"{"state":"running"}"#)).0, 204);
    assert_eq!(ex("POST", "/clones", Some(r#"{"count":0}"#)).0, 400);
    assert_eq!(ex("POST", "/clones", Some(r#"{"count":"x"}"#)).0, 400);
    assert_eq!(
        ex("POST", "/clones", Some(r#"{"resource_class":"small"}"#)).0,
        409
    );
    assert_eq!(
        ex("PUT", "/actions", Some(r#"{"action_type":"reboot"}"#)).0,
        400
    );
    for (method, path) in [("DELETE", "/vm"), ("GET", "/actions"), ("PUT", "/clones")] {
        assert_eq!(ex(method, path, None).0, 405, "{method} {path}");
    }
    assert_eq!(ex("GET", "/nope", None).0, 404);
    let big = format!("PATCH /vm HTTP/1.1\r\nContent-Length: {}\r\n\r\n", 1 << 20);
    let (status, body) = raw_request(&vm.sock, big.as_bytes());
    assert_eq!(status, 413);
    assert!(spec["paths"]["/vm"]["patch"]["responses"]["413"].is_object());
    round_trips::<ErrorBody>("413", &body);
    assert_eq!(
        ex("PUT", "/actions", Some(r#"{"action_type":"shutdown"}"#)).0,
        204
    );
    assert!(vm.wait_exit(Duration::from_secs(10)).success());
}

/// Where schemathesis is: `$FORKVM_SCHEMATHESIS`, else the virtual environment
/// `scripts/install-deps.sh test` makes.
fn schemathesis() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("FORKVM_SCHEMATHESIS")
        .map(Into::into)
        .unwrap_or_else(|| "/var/cache/forkvm/st-venv/bin/st".into());
    std::path::Path::new(&path).exists().then_some(path)
}

/// Serves TCP connections on a loopback port by relaying each to the Unix socket
/// `sock` (schemathesis speaks HTTP over TCP only); the port.
fn tcp_bridge(sock: std::path::PathBuf) -> u16 {
    use std::net::{TcpListener, TcpStream};
    use std::os::unix::net::UnixStream;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let Ok(unix) = UnixStream::connect(&sock) else {
                continue;
            };
            let relay = |mut from: Box<dyn std::io::Read + Send>,
                         mut to: Box<dyn std::io::Write + Send>,
                         done: Box<dyn FnOnce() + Send>| {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    done();
                });
            };
            let (t2, u2) = (tcp.try_clone().unwrap(), unix.try_clone().unwrap());
            let (t3, u3) = (tcp.try_clone().unwrap(), unix.try_clone().unwrap());
            relay(
                Box::new(tcp),
                Box::new(unix),
                Box::new(move || drop(u3.shutdown(std::net::Shutdown::Write))),
            );
            relay(
                Box::new(u2),
                Box::new(t2),
                Box::new(move || drop(TcpStream::shutdown(&t3, std::net::Shutdown::Write))),
            );
        }
    });
    port
}

/// schemathesis, from PyPI, generates requests from the spec (valid ones, and ones the
/// schema refuses) against a live VMM, and checks every answer: no 5xx but those
/// listed, statuses and bodies as the spec says, schema-valid requests accepted and
/// invalid ones refused, 405 with `Allow` for methods a path does not take. `PUT
/// /actions` (it stops the VMM) is left to the test above, and `PUT /snapshot` (it
/// writes where it is told, as root: anywhere on the host) to `snapshot.rs`; `--max-clones 4` keeps the
/// clones it makes few (further requests are refused with 409).
#[test]
fn schemathesis_finds_nothing_against_a_live_vmm() {
    if !kvm_available("schemathesis") {
        return;
    }
    let Some(st) = schemathesis() else {
        let missing = "schemathesis is not installed (scripts/install-deps.sh test)";
        tests::require("schemathesis", false, missing);
        return;
    };
    let scratch = Scratch::new("schemathesis");
    let tiny = tests::guest_file("tiny.elf").display().to_string();
    let mut vm = Vm::start(
        &scratch,
        &[
            "--kernel",
            &tiny,
            "--mem-mib",
            "32",
            "--ap-boot",
            "direct",
            "--cmdline",
            "ticks=1 tickless=1",
            "--max-clones",
            "4",
        ],
    );
    vm.wait_api(Duration::from_secs(30));
    let port = tcp_bridge(vm.sock.clone());
    let out = std::process::Command::new(st)
        .current_dir(scratch.path(""))
        .arg("--config-file")
        .arg(repo_root().join("tests/schemathesis/schemathesis.toml"))
        .args(["run", "--url", &format!("http://127.0.0.1:{port}")])
        .args(["--exclude-path", "/actions", "--exclude-path", "/snapshot"])
        .args(["--max-examples", "40"])
        .args(["--seed", "20261125", "--no-color"])
        .arg(repo_root().join("docs/api/openapi.yaml"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "schemathesis failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // It made clones (and deleted some) within the limit, and the VMM still serves.
    let (code, body) = vm.api("GET", "/clones", None);
    assert_eq!(code, 200, "{body}");
    let made: CloneList = serde_json::from_str(&body).unwrap();
    let live = made.clones.iter().filter(|c| c.status.is_live()).count();
    assert!(!made.clones.is_empty() && live <= 4, "{body}\n{text}");
    vm.shutdown(Duration::from_secs(30));
}
