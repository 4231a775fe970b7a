//! The forkvm clone protocol: state types, capture from live KVM fds, and the
//! quiesce -> capture -> fork -> rebuild sequence.
//!
//! Not implemented yet: this crate is reserved for the flash-cloning work (issue 3) and
//! currently exports nothing.
#![deny(missing_docs)]
