//! The copy-on-write overlay's block map against a model disk: writes, reads,
//! snapshots and kept overlays (with their block map) in any order. The disk always
//! reads as the model says.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzz_checks::overlay(data));
