//! virtio-vsock's worker: guest packets of any header on a fuzzed transmit queue, or a
//! fuzzed receive queue, beside a host that connects and writes anything, then may
//! close. Never a panic or a hang, and no more chains returned than offered.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzz_checks::virtio_vsock(data));
