//! The control socket's request reader, fed the bytes in the pieces a client might send
//! them in, then the router: never a panic; a request is whole only once its body is;
//! every refusal is a 4xx or 5xx with a JSON error body.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzz_checks::http_request(data));
