//! Token-bucket rate limiting for device I/O (bandwidth and operations), with a timer a
//! device worker watches to know when it may go on.
//!
//! A bucket holds up to `size` tokens and refills `size` tokens every `refill_time_ms`
//! (continuously, not in steps), plus a `one_time_burst` spent first and never refilled.
//! A request may take more tokens than the bucket holds: it is let through when the
//! bucket is full and leaves it in debt, so the average rate still holds for large I/O.

use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use vmm_sys_util::timerfd::TimerFd;

pub use api_types::rate_limit::{BucketConfig, RateLimit, RateLimitError};

/// A bucket in use.
#[derive(Debug)]
struct TokenBucket {
    config: BucketConfig,
    /// Tokens now; negative while a large request is paid off.
    budget: i128,
    burst: u64,
    last: Instant,
}

impl TokenBucket {
    fn new(config: BucketConfig, now: Instant) -> Self {
        Self {
            config,
            budget: i128::from(config.size),
            burst: config.one_time_burst,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let ns = now.saturating_duration_since(self.last).as_nanos() as i128;
        let per_ms = i128::from(self.config.refill_time_ms) * 1_000_000;
        let add = ns * i128::from(self.config.size) / per_ms;
        if add > 0 {
            // Advance the clock only by the time the added tokens stand for, so
            // fractions of a token are not lost between frequent calls.
            let used_ns = add * per_ms / i128::from(self.config.size);
            self.last += Duration::from_nanos(used_ns as u64);
            self.budget = (self.budget + add).min(i128::from(self.config.size));
            if self.budget == i128::from(self.config.size) {
                self.last = now;
            }
        }
    }

    /// Whether `tokens` can be taken now (a request larger than the bucket needs a full
    /// bucket).
    fn can_take(&self, tokens: u64) -> bool {
        let need = i128::from(tokens.saturating_sub(self.burst).min(self.config.size));
        need == 0 || self.budget >= need
    }

    fn take(&mut self, tokens: u64) {
        let from_burst = tokens.min(self.burst);
        self.burst -= from_burst;
        self.budget -= i128::from(tokens - from_burst);
    }

    /// How long until `tokens` can be taken.
    fn wait_for(&self, tokens: u64) -> Duration {
        let need = i128::from(tokens.saturating_sub(self.burst).min(self.config.size));
        let missing = need - self.budget;
        if missing <= 0 {
            return Duration::ZERO;
        }
        let per_ms = i128::from(self.config.refill_time_ms) * 1_000_000;
        let size = i128::from(self.config.size);
        let ns = (missing * per_ms + size - 1) / size;
        Duration::from_nanos(ns.min(i128::from(u64::MAX)) as u64)
    }
}

/// Bandwidth and operation buckets and the timer that fires when a blocked request may
/// be retried.
pub struct RateLimiter {
    bandwidth: Option<TokenBucket>,
    ops: Option<TokenBucket>,
    timer: TimerFd,
    blocked: bool,
}

impl std::fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimiter")
            .field("bandwidth", &self.bandwidth)
            .field("ops", &self.ops)
            .field("blocked", &self.blocked)
            .finish()
    }
}

impl RateLimiter {
    /// A limiter for `limit` (buckets start full).
    pub fn new(limit: &RateLimit) -> std::io::Result<Self> {
        limit.check().map_err(std::io::Error::other)?;
        let now = Instant::now();
        Ok(Self {
            bandwidth: limit.bandwidth.map(|c| TokenBucket::new(c, now)),
            ops: limit.ops.map(|c| TokenBucket::new(c, now)),
            timer: TimerFd::new()?,
            blocked: false,
        })
    }

    /// Takes `bytes` and one operation if both buckets allow it; otherwise takes nothing,
    /// arms the timer for when they will, and returns false.
    pub fn consume(&mut self, bytes: u64) -> bool {
        let now = Instant::now();
        let buckets = [(&mut self.bandwidth, bytes), (&mut self.ops, 1)];
        let mut wait = Duration::ZERO;
        for (b, n) in buckets {
            if let Some(b) = b.as_mut() {
                b.refill(now);
                if !b.can_take(n) {
                    wait = wait.max(b.wait_for(n));
                }
            }
        }
        if wait > Duration::ZERO {
            // At least 100 us, so a nearly refilled bucket does not spin the worker.
            let wait = wait.max(Duration::from_micros(100));
            if let Err(e) = self.timer.reset(wait, None) {
                tracing::error!("rate limiter: cannot arm its timer: {e}");
            }
            self.blocked = true;
            return false;
        }
        if let Some(b) = self.bandwidth.as_mut() {
            b.take(bytes);
        }
        if let Some(b) = self.ops.as_mut() {
            b.take(1);
        }
        true
    }

    /// Whether a request is waiting for the timer.
    pub fn is_blocked(&self) -> bool {
        self.blocked
    }

    /// The timer fired: reads it; the device may retry.
    pub fn timer_fired(&mut self) {
        let _ = self.timer.wait();
        self.blocked = false;
    }
}

impl AsRawFd for RateLimiter {
    /// The timer descriptor a worker watches (readable when a blocked request may go).
    fn as_raw_fd(&self) -> RawFd {
        self.timer.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(spec: &str) -> RateLimiter {
        RateLimiter::new(&spec.parse().unwrap()).unwrap()
    }

    #[test]
    fn a_full_bucket_passes_then_blocks_and_refills() {
        let mut l = limiter("bytes=1000/100");
        assert!(l.consume(600));
        assert!(l.consume(400));
        assert!(!l.consume(100), "bucket is empty");
        assert!(l.is_blocked());
        // The timer fires when 100 bytes are back: about 10 ms.
        let t = Instant::now();
        let mut pfd = libc::pollfd {
            fd: l.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 2000) }, 1);
        l.timer_fired();
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(9), "{waited:?}");
        assert!(l.consume(100));
    }

    #[test]
    fn burst_is_spent_first_and_large_requests_go_into_debt() {
        let mut l = limiter("bytes=100/1000+50");
        assert!(l.consume(150), "bucket plus burst");
        assert!(!l.consume(1));
        let mut l = limiter("bytes=100/1000");
        assert!(l.consume(1000), "larger than the bucket, bucket full");
        assert!(!l.consume(1), "900 bytes of debt");
        let b = l.bandwidth.as_ref().unwrap();
        assert!(
            b.wait_for(1) >= Duration::from_millis(9000),
            "{:?}",
            b.wait_for(1)
        );
    }

    #[test]
    fn ops_and_bytes_are_taken_together_or_not_at_all() {
        let mut l = limiter("bytes=1000/1000,ops=2/1000");
        assert!(l.consume(10));
        assert!(l.consume(10));
        assert!(!l.consume(10), "ops bucket empty");
        assert_eq!(l.bandwidth.as_ref().unwrap().budget, 980, "no bytes taken");
    }

    #[test]
    fn long_run_rate_matches_the_limit() {
        // Simulated clock: 10 s of 1 KiB requests against 100 KiB/s.
        let cfg = BucketConfig {
            size: 100 << 10,
            one_time_burst: 0,
            refill_time_ms: 1000,
        };
        let start = Instant::now();
        let mut b = TokenBucket::new(cfg, start);
        let mut sent = 0u64;
        for step in 0..10_000u64 {
            let now = start + Duration::from_millis(step);
            b.refill(now);
            while b.can_take(1024) {
                b.take(1024);
                sent += 1024;
            }
        }
        // 10 s at 100 KiB/s plus the initial full bucket.
        let expect = 11 * (100 << 10);
        assert!(
            sent.abs_diff(expect) <= 2048,
            "sent {sent}, expected {expect}"
        );
    }
}
