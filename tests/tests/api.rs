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
/// the route (or, for 404, the path is unknown), and the body is the type it names.
fn exchange(vm: &Vm, spec: &Value, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let (status, text) = vm.api(method, path, body);
    let what = format!("{method} {path} -> {status}");
    let op = &spec["paths"][template(path)][method.to_lowercase()];
    if status == 404 && op.is_null() {
        assert!(
            spec["paths"].get(template(path)).is_none(),
            "{what}: path in the spec"
        );
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
        400
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
