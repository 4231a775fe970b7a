//! The control socket's request reader, fed the bytes in the pieces a client might send
//! them in, then the router: never a panic; a request is whole only once its body is;
//! every refusal is a 4xx or 5xx with a JSON error body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::api::http::{BodyLimits, HttpError, RequestReader};

fuzz_target!(|data: &[u8]| {
    // The first byte sets the piece size (1 to 256 bytes).
    let Some((&size, bytes)) = data.split_first() else {
        return;
    };
    let limits = BodyLimits {
        invocation: 1 << 16,
    };
    let mut reader = RequestReader::default();
    for piece in bytes.chunks(usize::from(size) + 1) {
        match reader.feed(piece, &limits) {
            Ok(None) => continue,
            Ok(Some(req)) => {
                assert!(req.body.len() <= limits.invocation);
                if let Err(reply) = vmm::api::route(req) {
                    assert!((400..600).contains(&reply.status), "{reply:?}");
                    let body = reply.body.as_deref().unwrap_or_default();
                    let _: api_types::ErrorBody = serde_json::from_str(body).expect("error body");
                }
                return;
            }
            Err(HttpError::Malformed(_) | HttpError::TooLarge(_)) => return,
            Err(HttpError::Io(e)) => panic!("feed never does I/O: {e}"),
        }
    }
});
