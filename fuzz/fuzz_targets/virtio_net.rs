//! virtio-net's worker serving a fuzzed receive or transmit queue, its tap holding
//! frames of any length for the guest. Never a panic or a hang, and the device returns
//! no more chains than the driver offered.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzz_checks::virtio_net(data));
