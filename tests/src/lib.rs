//! Integration tests that boot real guests live in `tests/tests/`; this library holds
//! their shared helpers.
