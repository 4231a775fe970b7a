//! Small helpers shared by device models and the VMM.

/// CLOCK_MONOTONIC in nanoseconds: comparable across processes on this host.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// The calling thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`, the run time its
/// `schedstat` reports), in nanoseconds.
pub fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for clock_gettime to fill.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Writes `value` into a port-read buffer of any width (little-endian, truncated,
/// zero beyond 4 bytes).
pub fn fill_le(data: &mut [u8], value: u32) {
    let bytes = value.to_le_bytes();
    for (i, b) in data.iter_mut().enumerate() {
        *b = bytes.get(i).copied().unwrap_or(0);
    }
}

/// Reads a port-write buffer of any width as a little-endian u32 (bytes beyond 4
/// ignored).
pub fn read_le(data: &[u8]) -> u32 {
    let mut bytes = [0u8; 4];
    let n = data.len().min(4);
    bytes[..n].copy_from_slice(&data[..n]);
    u32::from_le_bytes(bytes)
}

/// Fills `buf` from the host's getrandom.
pub fn host_random(buf: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is valid for writes of its length.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        } else {
            done += n as usize;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn little_endian_any_width() {
        let mut one = [0u8; 1];
        fill_le(&mut one, 0x1234_5678);
        assert_eq!(one, [0x78]);
        let mut eight = [0xaau8; 8];
        fill_le(&mut eight, 0x1234_5678);
        assert_eq!(eight, [0x78, 0x56, 0x34, 0x12, 0, 0, 0, 0]);
        assert_eq!(read_le(&[0x07]), 7);
        assert_eq!(read_le(&[1, 2, 3, 4, 5]), 0x0403_0201);
    }

    #[test]
    fn monotonic_advances() {
        let a = monotonic_ns();
        assert!(a > 0 && monotonic_ns() >= a);
    }
}

/// How many times an event a guest can repeat is logged before the throttle thins it.
pub const LOG_FIRST: u64 = 10;

/// Counts an event a guest can cause over and over (a refused request, a bad register
/// write) and says when to log it: the first [`LOG_FIRST`] times, then when the count
/// reaches a power of two. A guest that repeats it forever costs the log a line per
/// doubling, not a line per try.
#[derive(Debug, Default, Clone, Copy)]
pub struct LogThrottle(u64);

impl LogThrottle {
    /// Counts one more; the count when this one is to be logged.
    pub fn hit(&mut self) -> Option<u64> {
        self.0 = self.0.saturating_add(1);
        (self.0 <= LOG_FIRST || self.0.is_power_of_two()).then_some(self.0)
    }
}

/// A [`LogThrottle`] in a `static`, for events counted wherever they happen in the
/// process (each VMM process serves one VM, so the count is that VM's).
#[derive(Debug, Default)]
pub struct SharedLogThrottle(std::sync::atomic::AtomicU64);

impl SharedLogThrottle {
    /// A throttle that has counted nothing.
    pub const fn new() -> Self {
        Self(std::sync::atomic::AtomicU64::new(0))
    }

    /// Counts one more; the count when this one is to be logged.
    pub fn hit(&self) -> Option<u64> {
        let n = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        (n <= LOG_FIRST || n.is_power_of_two()).then_some(n)
    }
}

#[cfg(test)]
mod throttle_tests {
    use super::*;

    #[test]
    fn the_first_ten_then_each_power_of_two_are_logged() {
        let mut t = LogThrottle::default();
        let logged: Vec<u64> = (0..100_000).filter_map(|_| t.hit()).collect();
        let shared = SharedLogThrottle::new();
        let shared_logged: Vec<u64> = (0..100_000).filter_map(|_| shared.hit()).collect();
        assert_eq!(shared_logged, logged);
        let mut expected: Vec<u64> = (1..=10).collect();
        expected.extend((4..17).map(|p| 1u64 << p));
        assert_eq!(logged, expected);
    }
}
