//! Token-bucket rate limiting for device I/O (bandwidth and operations), with a timer a
//! device worker watches to know when it may go on.
//!
//! A bucket holds up to `size` tokens and refills `size` tokens every `refill_time_ms`
//! (continuously, not in steps), plus a `one_time_burst` spent first and never refilled.
//! A request may take more tokens than the bucket holds: it is let through when the
//! bucket is full and leaves it in debt, so the average rate still holds for large I/O.
//!
//! Each limiter counts into a [`LimiterStats`] what it passed, what it held back and for
//! how long, and the tokens its full bandwidth bucket could not hold, split by whether a
//! request waited meanwhile (`late`: the worker came late to its timer) or not
//! (`unused`: nothing asked for them).

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::timerfd::TimerFd;

pub use api_types::rate_limit::{BucketConfig, RateLimit, RateLimitError};
pub use api_types::vm::LimiterReport;

/// A limiter's counters, shared with whoever reports them (`GET /vm`) while a device
/// worker updates them.
#[derive(Debug, Default)]
pub struct LimiterStats {
    passed_bytes: AtomicU64,
    throttled: AtomicU64,
    throttled_ns: AtomicU64,
    unused_bytes: AtomicU64,
    late_bytes: AtomicU64,
}

impl LimiterStats {
    /// The counters now, for direction or queue `name`.
    pub fn report(&self, name: &str) -> LimiterReport {
        LimiterReport {
            name: name.to_string(),
            passed_bytes: self.passed_bytes.load(Ordering::Relaxed),
            throttled: self.throttled.load(Ordering::Relaxed),
            throttled_ms: self.throttled_ns.load(Ordering::Relaxed) / 1_000_000,
            unused_bytes: self.unused_bytes.load(Ordering::Relaxed),
            late_bytes: self.late_bytes.load(Ordering::Relaxed),
        }
    }
}

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

    /// Adds the tokens earned since the last call; returns those a full bucket could not
    /// hold.
    fn refill(&mut self, now: Instant) -> u64 {
        let ns = now.saturating_duration_since(self.last).as_nanos() as i128;
        let per_ms = i128::from(self.config.refill_time_ms) * 1_000_000;
        let add = ns * i128::from(self.config.size) / per_ms;
        let mut lost = 0;
        if add > 0 {
            // Advance the clock only by the time the added tokens stand for, so
            // fractions of a token are not lost between frequent calls.
            let used_ns = add * per_ms / i128::from(self.config.size);
            self.last += Duration::from_nanos(used_ns as u64);
            let size = i128::from(self.config.size);
            lost = (self.budget + add - size).max(0);
            self.budget = (self.budget + add).min(size);
            if self.budget == size {
                self.last = now;
            }
        }
        u64::try_from(lost).unwrap_or(u64::MAX)
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
    /// When the request now held back was first refused.
    blocked_since: Option<Instant>,
    stats: Arc<LimiterStats>,
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
        Self::with_stats(limit, Arc::default())
    }

    /// A limiter for `limit` that counts into `stats`.
    pub fn with_stats(limit: &RateLimit, stats: Arc<LimiterStats>) -> std::io::Result<Self> {
        limit.check().map_err(std::io::Error::other)?;
        let now = Instant::now();
        Ok(Self {
            bandwidth: limit.bandwidth.map(|c| TokenBucket::new(c, now)),
            ops: limit.ops.map(|c| TokenBucket::new(c, now)),
            timer: TimerFd::new()?,
            blocked: false,
            blocked_since: None,
            stats,
        })
    }

    /// Takes `bytes` and one operation if both buckets allow it; otherwise takes nothing,
    /// arms the timer for when they will, and returns false.
    pub fn consume(&mut self, bytes: u64) -> bool {
        let now = Instant::now();
        let buckets = [(&mut self.bandwidth, bytes), (&mut self.ops, 1)];
        let mut wait = Duration::ZERO;
        for (i, (b, n)) in buckets.into_iter().enumerate() {
            if let Some(b) = b.as_mut() {
                let lost = b.refill(now);
                if i == 0 {
                    // A request refused before waits since: the bucket filled up while
                    // it waited (the worker came late). Otherwise nothing was asking.
                    let lost_to = match self.blocked_since {
                        Some(_) => &self.stats.late_bytes,
                        None => &self.stats.unused_bytes,
                    };
                    lost_to.fetch_add(lost, Ordering::Relaxed);
                }
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
            if self.blocked_since.is_none() {
                self.blocked_since = Some(now);
                self.stats.throttled.fetch_add(1, Ordering::Relaxed);
            }
            return false;
        }
        if let Some(since) = self.blocked_since.take() {
            let ns = now.saturating_duration_since(since).as_nanos();
            let ns = u64::try_from(ns).unwrap_or(u64::MAX);
            self.stats.throttled_ns.fetch_add(ns, Ordering::Relaxed);
        }
        self.stats.passed_bytes.fetch_add(bytes, Ordering::Relaxed);
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
    fn the_counters_show_what_passed_waited_and_overflowed() {
        let stats = Arc::new(LimiterStats::default());
        let mut l =
            RateLimiter::with_stats(&"bytes=1000/100".parse().unwrap(), stats.clone()).unwrap();
        // A full bucket at rest loses what it earns: 10 bytes a ms.
        std::thread::sleep(Duration::from_millis(50));
        assert!(l.consume(1000));
        let r = stats.report("rx");
        assert!(r.unused_bytes >= 500, "{r:?}");
        assert_eq!((r.passed_bytes, r.throttled, r.throttled_ms), (1000, 0, 0));
        // Refused twice while it waits: one request held back, counted once it goes.
        assert!(!l.consume(300));
        assert!(!l.consume(300));
        assert_eq!(stats.report("rx").throttled, 1);
        std::thread::sleep(Duration::from_millis(40));
        assert!(l.consume(300));
        let r = stats.report("rx");
        assert_eq!((r.passed_bytes, r.throttled), (1300, 1), "{r:?}");
        assert!(r.throttled_ms >= 40, "{r:?}");
        assert_eq!(r.late_bytes, 0, "{r:?}");
        // An empty bucket refilling loses nothing.
        let unused = r.unused_bytes;
        std::thread::sleep(Duration::from_millis(20));
        assert!(l.consume(100));
        assert_eq!(stats.report("rx").unused_bytes, unused);
        // A request that waits past its timer while the bucket fills: the worker came
        // late, and what the full bucket lost meanwhile is counted so.
        std::thread::sleep(Duration::from_millis(110));
        assert!(l.consume(1000), "a full bucket");
        let unused = stats.report("rx").unused_bytes;
        assert!(!l.consume(1000), "empty");
        std::thread::sleep(Duration::from_millis(150));
        assert!(l.consume(1000));
        let r = stats.report("rx");
        assert!(r.late_bytes >= 400, "{r:?}");
        assert_eq!(r.unused_bytes, unused, "{r:?}");
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
