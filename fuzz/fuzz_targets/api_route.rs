//! The router and the JSON bodies and query strings it reads (`PATCH /vm`, `PUT
//! /actions`, `POST /clones`, `POST /invocations`): never a panic, and a request it takes
//! is within the limits the spec states.
#![no_main]

use api_types::clones::MAX_CLONES_PER_REQUEST;
use libfuzzer_sys::fuzz_target;
use vmm::api::http::Request;
use vmm::rpc::VmmAction;

const ROUTES: &[(&str, &str)] = &[
    ("PATCH", "/vm"),
    ("PUT", "/actions"),
    ("POST", "/clones"),
    ("POST", "/invocations"),
    ("DELETE", "/clones/"),
];

fuzz_target!(|data: &[u8]| {
    // The first byte picks the route; the rest is the body, or the query string of an
    // invocation, or the id of a clone to delete.
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let (method, path) = ROUTES[usize::from(pick) % ROUTES.len()];
    let text = String::from_utf8_lossy(rest).into_owned();
    let mut req = Request {
        method: method.into(),
        path: path.into(),
        ..Default::default()
    };
    match path {
        "/invocations" => req.query = text,
        "/clones/" => req.path.push_str(&text),
        _ => req.body = rest.to_vec(),
    }
    match vmm::api::route(req) {
        Ok(VmmAction::CreateClones { request, .. }) => {
            assert!((1..=u64::from(MAX_CLONES_PER_REQUEST)).contains(&request.count));
        }
        Ok(VmmAction::DeleteClone(id)) => assert!(!id.is_empty()),
        Ok(_) => {}
        Err(reply) => assert!((400..600).contains(&reply.status), "{reply:?}"),
    }
});
