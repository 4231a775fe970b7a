//! The text syntax command lines and request bodies share (rate limits, sizes, MAC and
//! IPv4 addresses, resource classes, `key=value` lists): never a panic, and what parses
//! prints back to text that parses to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzz_checks::option_text(data));
