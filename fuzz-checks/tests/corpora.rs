//! Every input of the committed corpora (`fuzz/corpus/<target>/`) through its target's
//! checks: what coverage-guided fuzzing found interesting stays checked in every run of
//! the test suite, on stable Rust.

use std::path::Path;

fn replay(target: &str, check: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let run = std::panic::catch_unwind(|| check(&data));
        assert!(run.is_ok(), "{target}: {} fails its checks", path.display());
        n += 1;
    }
    assert!(n > 0, "{target}: empty corpus");
    eprintln!("{target}: {n} inputs replayed");
}

#[test]
fn http_request_corpus() {
    replay("http_request", fuzz_checks::http_request);
}

#[test]
fn api_route_corpus() {
    replay("api_route", fuzz_checks::api_route);
}

#[test]
fn option_text_corpus() {
    replay("option_text", fuzz_checks::option_text);
}

#[test]
fn virtio_queue_corpus() {
    replay("virtio_queue", fuzz_checks::virtio_queue);
}

#[test]
fn mailbox_corpus() {
    replay("mailbox", fuzz_checks::mailbox);
}

#[test]
fn virtio_net_corpus() {
    replay("virtio_net", fuzz_checks::virtio_net);
}

#[test]
fn virtio_vsock_corpus() {
    replay("virtio_vsock", fuzz_checks::virtio_vsock);
}

#[test]
fn overlay_corpus() {
    replay("overlay", fuzz_checks::overlay);
}
