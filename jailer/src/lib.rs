//! The forkvm jailer: cgroup pool and VMM sandbox.
//!
//! Not implemented yet: this crate is reserved for the jailer work (issue 4) and
//! currently exports nothing.
#![deny(missing_docs)]
