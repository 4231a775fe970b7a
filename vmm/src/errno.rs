//! The host error number behind an error, for records that carry one (a failed
//! clone's report to its parent, a snapshot's failure).

/// The host error number behind `e`: the first `std::io::Error` or `nix` errno in its
/// chain of sources (0 if none).
pub(crate) fn errno_of(mut e: &(dyn std::error::Error + 'static)) -> i32 {
    loop {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if let Some(n) = io.raw_os_error() {
                return n;
            }
        }
        if let Some(n) = e.downcast_ref::<nix::errno::Errno>() {
            return *n as i32;
        }
        match e.source() {
            Some(next) => e = next,
            None => return 0,
        }
    }
}
