//! virtio-blk (read-only and over a copy-on-write overlay) and virtio-rng serving a
//! split queue whose descriptor table, rings and buffers are the fuzzer's bytes in guest
//! memory: descriptor chains that loop, point outside memory, claim absurd lengths, or
//! mix readable and writable buffers in any order. Never a panic or a hang, and the
//! device returns no more chains than the driver offered.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzz_checks::virtio_queue(data));
