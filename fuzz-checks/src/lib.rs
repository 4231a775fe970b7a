//! The fuzz targets' bodies and the properties they check (`fuzz/fuzz_targets/*.rs` are
//! one line each over these), on stable Rust: `tests/corpora.rs` replays every input of
//! the committed corpora (`fuzz/corpus`) through them in the test suite; coverage-guided
//! runs need nightly and cargo-fuzz (`make fuzz`, docs/reliability.md).

use api_types::clones::CLONE_COUNTS;
use api_types::net::{Ipv4Cidr, MacAddr};
use api_types::options::{format_size, key_values, parse_size};
use api_types::rate_limit::RateLimit;
use api_types::ResourceClass;
use devices::virtio::fuzzing::{blk, net, rng, vsock, Rig, VsockHost};
use forkvm_client::http::Request;
use forkvm_client::http::{BodyLimits, HttpError, RequestReader};
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
                if let Err(reply) = vmm_api::route(req, None) {
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
    match vmm_api::route(req, None) {
        Ok(VmmAction::CreateClones { request, .. }) => {
            assert!(CLONE_COUNTS.contains(&request.count));
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
    let _ = vmm_api::cli::parse_cgroup_class(text);
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
    let Some((r, offer)) = rig(*which, *size, input) else {
        return;
    };
    let r = match which % 3 {
        0 => blk(r, false),
        1 => blk(r, true),
        _ => rng(r),
    };
    returned_no_more_than_offered(&r, offer);
}

/// Reads a queue's size and the rig from the head of a virtio target's input: the
/// fuzzed queue of `1 << (size % 9)` entries (1 to 256), with event-index when `flags`
/// has 0x80.
fn rig(flags: u8, size: u8, input: &[u8]) -> Option<(Rig, Offer)> {
    let rig = Rig::new(input, 1u16 << (size % 9), flags & 0x80 != 0)?;
    let offer = Offer {
        chains: rig.avail_idx(),
        driver_area: rig.driver_area(),
    };
    Some((rig, offer))
}

/// What the driver offered before the device ran: its available index, and its
/// descriptor table and available ring as they were.
struct Offer {
    chains: u16,
    driver_area: Vec<u8>,
}

fn returned_no_more_than_offered(rig: &Rig, offer: Offer) {
    // A driver may give the device a writable buffer over its own descriptors or
    // available ring (fuzzing found one over both); what it offers then changes as the
    // device writes, and only "no panic, no hang" is promised. Otherwise the offer is
    // as it was, and on a fresh queue the used index counts the chains returned.
    if rig.driver_area() != offer.driver_area {
        return;
    }
    assert!(
        rig.used_idx() <= offer.chains,
        "{} chains returned of {} offered",
        rig.used_idx(),
        offer.chains
    );
}

/// virtio-net's worker with the fuzzed queue as its receive or transmit queue, its tap
/// holding up to three frames for the guest (of lengths the input gives, up to 64 KiB
/// and beyond the largest frame): never a panic or a hang, and no more chains returned
/// than offered.
pub fn virtio_net(data: &[u8]) {
    let [flags, size, l0, l1, l2, input @ ..] = data else {
        return;
    };
    // Lengths 0 to 64 KiB + 255: empty, tiny, larger than any rx buffer, larger than a
    // frame.
    let lens = [l0, l1, l2].map(|&l| usize::from(l) * usize::from(l) + usize::from(l));
    let frames: Vec<Vec<u8>> = (0..usize::from(flags & 3))
        .map(|i| vec![i as u8; lens[i]])
        .collect();
    let frames: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
    let Some((r, offer)) = rig(*flags, *size, input) else {
        return;
    };
    if let Some(r) = net(r, flags & 4 != 0, &frames) {
        returned_no_more_than_offered(&r, offer);
    }
}

/// virtio-vsock's worker with the fuzzed queue as its transmit queue (guest packets of
/// any header: requests, data, shutdowns and resets on any port, bad addresses and
/// lengths) or its receive queue, a host program listening on port
/// [`devices::virtio::fuzzing::VSOCK_PORT`], and a host that connects and writes the
/// input's bytes (a `CONNECT` line, data, garbage), then perhaps closes: never a panic
/// or a hang, and no more chains returned than offered.
pub fn virtio_vsock(data: &[u8]) {
    let [flags, size, host_len, rest @ ..] = data else {
        return;
    };
    let (host, input) = rest.split_at(usize::from(*host_len).min(rest.len()));
    let host = VsockHost {
        connects: (flags & 8 != 0).then_some(host),
        closes: flags & 16 != 0,
        restored: flags & 32 != 0,
    };
    let Some((r, offer)) = rig(*flags, *size, input) else {
        return;
    };
    if let Some(r) = vsock(r, flags & 4 != 0, host) {
        returned_no_more_than_offered(&r, offer);
    }
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

/// A base image of `size` bytes, each byte from its offset, as an unnamed file.
fn base_image(size: usize) -> Option<std::fs::File> {
    static RUN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("forkvm-fuzz-base-{}-{n}", std::process::id()));
    let bytes: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
    let written = std::fs::write(&path, bytes);
    let file = written.and_then(|()| std::fs::File::open(&path));
    let _ = std::fs::remove_file(&path);
    file.ok()
}

/// What a kept overlay (`path` and its `.blocks` map) says the disk holds over `base`.
fn kept_disk(path: &std::path::Path, base: &std::fs::File, size: usize) -> Vec<u8> {
    use devices::virtio::block::overlay::BLOCK;
    use std::os::unix::fs::FileExt;
    let map = std::fs::read(path.with_extension("blocks")).expect("block map");
    let kept = std::fs::File::open(path).expect("kept overlay");
    let block = BLOCK as usize;
    assert_eq!(
        map.len(),
        size.div_ceil(block).div_ceil(64) * 8,
        "block map size"
    );
    let mut disk = vec![0u8; size];
    for (b, piece) in disk.chunks_mut(block).enumerate() {
        let word = u64::from_le_bytes(map[b / 64 * 8..b / 64 * 8 + 8].try_into().unwrap());
        let from = if word & (1 << (b % 64)) != 0 {
            &kept
        } else {
            base
        };
        from.read_exact_at(piece, (b * block) as u64).expect("read");
    }
    disk
}

/// The copy-on-write overlay's block map against a model disk: up to 64 operations of
/// five bytes each (kind, offset, length) on a disk of 1 byte to 24 KiB (a last block
/// that is partial, often): writes of any length at any offset, reads compared with the
/// model, snapshots (a clone's copy, which goes on in place of the original, and must
/// hold the same blocks), and keeping the overlay under a name with its `.blocks` map,
/// read back block by block and taken up again (`Overlay::from_kept`). The disk always
/// reads as the model says.
pub fn overlay(data: &[u8]) {
    use devices::virtio::block::overlay::Overlay;
    let [s0, s1, ops @ ..] = data else {
        return;
    };
    let size = 1 + usize::from(u16::from_le_bytes([*s0, *s1])) % (6 * 4096);
    let Some(base) = base_image(size) else {
        return;
    };
    let dir = std::env::temp_dir();
    let Ok(mut layer) = Overlay::create(&dir, size as u64) else {
        return;
    };
    let mut model: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
    for (n, op) in ops.chunks_exact(5).take(64).enumerate() {
        let &[kind, o0, o1, l0, l1] = op else {
            unreachable!("chunks of five")
        };
        let off = usize::from(u16::from_le_bytes([o0, o1])) % size;
        let len = usize::from(u16::from_le_bytes([l0, l1])) % (size - off + 1);
        match kind % 4 {
            0 => {
                let bytes: Vec<u8> = (0..len).map(|i| kind ^ (n as u8) ^ (i as u8)).collect();
                layer.write_at(&base, &bytes, off as u64).expect("write");
                model[off..off + len].copy_from_slice(&bytes);
            }
            1 => {
                let mut buf = vec![0u8; len];
                layer.read_at(&base, &mut buf, off as u64).expect("read");
                assert!(buf == model[off..off + len], "read {len} at {off} differs");
            }
            2 => {
                let Ok(copy) = layer.snapshot() else { return };
                let child = Overlay::from_snapshot(copy, &dir, size as u64);
                assert_eq!(child.blocks_present(), layer.blocks_present());
                layer = child;
            }
            _ => {
                let path = dir.join(format!("forkvm-fuzz-kept-{}-{n}", std::process::id()));
                let kept = layer.keep(&path);
                let disk = kept.is_ok().then(|| kept_disk(&path, &base, size));
                if kept.is_ok() {
                    // Taken up again (a restored snapshot's disk), it reads the same.
                    let again = Overlay::from_kept(&path, &dir, size as u64).expect("from_kept");
                    let mut all = vec![0u8; size];
                    again.read_at(&base, &mut all, 0).expect("read");
                    assert!(all == model, "the overlay taken up again differs");
                }
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_file(path.with_extension("blocks"));
                if let Some(disk) = disk {
                    assert!(disk == model, "the kept overlay differs");
                }
            }
        }
    }
    let mut all = vec![0u8; size];
    layer.read_at(&base, &mut all, 0).expect("read");
    assert!(all == model, "the disk differs from the model");
}
