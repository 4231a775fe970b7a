//! The router and the JSON bodies and query strings it reads (`PATCH /vm`, `PUT
//! /actions`, `POST /clones`, `POST /invocations`): never a panic, and a request it takes
//! is within the limits the spec states.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzz_checks::api_route(data));
