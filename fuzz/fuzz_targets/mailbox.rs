//! The invoke mailbox as a guest runtime leaves it: the reply header and payload read
//! after the runtime wrote a length to the invoke port, and the wait header. Never a
//! panic; a reply taken is as long as the port said and fits the mailbox.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fuzz_checks::mailbox(data));
