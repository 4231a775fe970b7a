//! The fuzz targets' bodies and the properties they check (`fuzz/fuzz_targets/*.rs` are
//! one line each over these), on stable Rust: `tests/corpora.rs` replays every input of
//! the committed corpora (`fuzz/corpus`) through them in the test suite; coverage-guided
//! runs need nightly and cargo-fuzz (`make fuzz`, docs/reliability.md).

use api_types::clones::MAX_CLONES_PER_REQUEST;
use api_types::net::{Ipv4Cidr, MacAddr};
use api_types::options::{format_size, key_values, parse_size};
use api_types::rate_limit::RateLimit;
use api_types::ResourceClass;
use devices::virtio::fuzzing::{blk, rng, Rig};
use vmm::api::http::Request;
use vmm::api::http::{BodyLimits, HttpError, RequestReader};
use vmm::rpc::VmmAction;

/// The control socket's request reader, fed the bytes in the pieces a client might send
/// them in, then the router: never a panic; a request is whole only once its body is;
/// every refusal is a 4xx or 5xx with a JSON error body.
pub fn http_request(data: &[u8]) {
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
}

const ROUTES: &[(&str, &str)] = &[
    ("PATCH", "/vm"),
    ("PUT", "/actions"),
    ("POST", "/clones"),
    ("POST", "/invocations"),
    ("DELETE", "/clones/"),
];

/// The router and the JSON bodies and query strings it reads (`PATCH /vm`, `PUT
/// /actions`, `POST /clones`, `POST /invocations`): never a panic, and a request it takes
/// is within the limits the spec states.
pub fn api_route(data: &[u8]) {
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
}

fn round_trips<T>(text: &str)
where
    T: std::str::FromStr + std::fmt::Display + PartialEq + std::fmt::Debug,
{
    if let Ok(value) = text.parse::<T>() {
        let again = value.to_string().parse::<T>().ok();
        assert_eq!(again.as_ref(), Some(&value), "{text:?}");
    }
}

/// The text syntax command lines and request bodies share (rate limits, sizes, MAC and
/// IPv4 addresses, resource classes, `key=value` lists): never a panic, and what parses
/// prints back to text that parses to the same value.
pub fn option_text(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    round_trips::<RateLimit>(text);
    round_trips::<MacAddr>(text);
    round_trips::<Ipv4Cidr>(text);
    if let Some(size) = parse_size(text) {
        assert_eq!(parse_size(&format_size(size)), Some(size), "{text:?}");
    }
    let _ = key_values(text);
    let _ = text.parse::<ResourceClass>();
    let _ = vmm::config::parse_cgroup_class(text);
}

/// virtio-blk (read-only and over a copy-on-write overlay) and virtio-rng serving a
/// split queue whose descriptor table, rings and buffers are the fuzzer's bytes in guest
/// memory: descriptor chains that loop, point outside memory, claim absurd lengths, or
/// mix readable and writable buffers in any order. Never a panic or a hang, and the
/// device returns no more chains than the driver offered.
pub fn virtio_queue(data: &[u8]) {
    let [which, size, input @ ..] = data else {
        return;
    };
    let size = 1u16 << (size % 9);
    let event_idx = which & 0x80 != 0;
    let Some(rig) = Rig::new(input, size, event_idx) else {
        return;
    };
    let offered = rig.avail_idx();
    let rig = match which % 3 {
        0 => blk(rig, false),
        1 => blk(rig, true),
        _ => rng(rig),
    };
    // A fresh queue: the used index counts the chains returned.
    assert!(
        rig.used_idx() <= offered,
        "{} chains returned of {offered} offered",
        rig.used_idx()
    );
}

/// The invoke mailbox as a guest runtime leaves it (docs/invoke.md): the reply header and
/// payload `read_reply` takes after the runtime wrote a length to the invoke port, and
/// the wait header `runtime_features` reads. Never a panic; a reply taken is as long as
/// the port said and fits the mailbox.
pub fn mailbox(data: &[u8]) {
    use devices::mailbox::{read_reply, runtime_features, MailboxWindow, MAILBOX_START};
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
    let [small, p0, p1, p2, p3, bytes @ ..] = data else {
        return;
    };
    // Mailboxes of 0 to 8 KiB (some without room for a header); the length the runtime
    // wrote to the port.
    let size = usize::from(*small) * 16 + if small & 1 == 0 { 4096 } else { 0 };
    let port = u32::from_le_bytes([*p0, *p1, *p2, *p3]);
    let window = MailboxWindow::of_size(size as u32);
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(MAILBOX_START), size.max(1))])
    else {
        return;
    };
    let _ = mem.write_slice(&bytes[..bytes.len().min(size)], GuestAddress(MAILBOX_START));
    let _ = runtime_features(&mem, window);
    if let Ok((header, payload)) = read_reply(&mem, window, port) {
        assert_eq!(header.length, port);
        assert_eq!(payload.len(), port as usize);
        assert!(payload.len() <= window.capacity());
    }
}
