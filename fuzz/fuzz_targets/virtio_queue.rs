//! virtio-blk (read-only and over a copy-on-write overlay) and virtio-rng serving a
//! split queue whose descriptor table, rings and buffers are the fuzzer's bytes in guest
//! memory: descriptor chains that loop, point outside memory, claim absurd lengths, or
//! mix readable and writable buffers in any order. Never a panic or a hang, and the
//! device returns no more chains than the driver offered.
#![no_main]

use devices::virtio::fuzzing::{blk, rng, Rig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [which, size, image @ ..] = data else {
        return;
    };
    let size = 1u16 << (size % 9);
    let event_idx = which & 0x80 != 0;
    let Some(rig) = Rig::new(image, size, event_idx) else {
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
});
