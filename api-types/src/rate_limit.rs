//! Rate limits for a device's I/O: token buckets for bytes and for operations, written
//! `bytes=SIZE[/MS][+BURST],ops=N[/MS][+BURST]` on command lines and in request bodies.

use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::options::{format_size, key_values, parse_size};

/// One bucket's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BucketConfig {
    /// Tokens the bucket holds when full (bytes or operations).
    pub size: u64,
    /// Extra tokens available once, at start.
    #[serde(default)]
    pub one_time_burst: u64,
    /// Milliseconds to refill a whole bucket from empty.
    pub refill_time_ms: u64,
}

/// A rate limit for one device: bandwidth (bytes) and/or operations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RateLimit {
    /// Bytes.
    #[serde(default)]
    pub bandwidth: Option<BucketConfig>,
    /// Operations (requests, frames).
    #[serde(default)]
    pub ops: Option<BucketConfig>,
}

/// Errors parsing or checking a rate limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RateLimitError {
    /// The text is not `bytes=SIZE[/MS][+BURST],ops=N[/MS][+BURST]`.
    #[error("bad rate limit {0:?}: expected bytes=SIZE[/MS][+BURST] and/or ops=N[/MS][+BURST], e.g. bytes=10M,ops=1000/1000")]
    Syntax(String),
    /// A bucket of size 0 or a refill time of 0 would block or divide by zero.
    #[error("bad rate limit: {0} needs a size and a refill time above 0")]
    Zero(&'static str),
}

/// Refill period when a limit gives none: a second.
const DEFAULT_REFILL_MS: u64 = 1000;

fn parse_bucket(s: &str) -> Option<BucketConfig> {
    let (rest, burst) = match s.split_once('+') {
        Some((r, b)) => (r, parse_size(b)?),
        None => (s, 0),
    };
    let (size, ms) = match rest.split_once('/') {
        Some((sz, ms)) => (parse_size(sz)?, ms.parse().ok()?),
        None => (parse_size(rest)?, DEFAULT_REFILL_MS),
    };
    Some(BucketConfig {
        size,
        one_time_burst: burst,
        refill_time_ms: ms,
    })
}

impl FromStr for RateLimit {
    type Err = RateLimitError;

    /// `bytes=10M` is 10 MiB per second; `ops=500/100+1000` is 500 operations per 100 ms
    /// with a one-time burst of 1000; both may be given, comma-separated.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || RateLimitError::Syntax(s.to_string());
        let mut limit = RateLimit::default();
        let items = key_values(s).map_err(|_| bad())?;
        if items.is_empty() {
            return Err(bad());
        }
        for (key, value) in items {
            let bucket = parse_bucket(value).ok_or_else(bad)?;
            match key {
                "bytes" => limit.bandwidth = Some(bucket),
                "ops" => limit.ops = Some(bucket),
                _ => return Err(bad()),
            }
        }
        limit.check()?;
        Ok(limit)
    }
}

impl std::fmt::Display for BucketConfig {
    /// `SIZE[/MS][+BURST]`, leaving out the defaults.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", format_size(self.size))?;
        if self.refill_time_ms != DEFAULT_REFILL_MS {
            write!(f, "/{}", self.refill_time_ms)?;
        }
        if self.one_time_burst != 0 {
            write!(f, "+{}", format_size(self.one_time_burst))?;
        }
        Ok(())
    }
}

impl std::fmt::Display for RateLimit {
    /// The text [`RateLimit::from_str`] reads back.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = [("bytes", self.bandwidth), ("ops", self.ops)]
            .into_iter()
            .filter_map(|(k, b)| b.map(|b| format!("{k}={b}")))
            .collect();
        f.write_str(&parts.join(","))
    }
}

impl RateLimit {
    /// Refuses buckets that could never refill.
    pub fn check(&self) -> Result<(), RateLimitError> {
        for (name, b) in [("bytes", self.bandwidth), ("ops", self.ops)] {
            if b.is_some_and(|b| b.size == 0 || b.refill_time_ms == 0) {
                return Err(RateLimitError::Zero(name));
            }
        }
        Ok(())
    }
}

/// One bucket's text in [`RATE_LIMIT_PATTERN`]: a size above 0 (`K`, `M`, `G`: powers of
/// 1024), a refill time above 0 in ms, a burst.
macro_rules! bucket_pattern {
    () => {
        r"[1-9][0-9]{0,8}[KMG]?(/[1-9][0-9]{0,5})?(\+[0-9]{1,9}[KMG]?)?"
    };
}

/// The rate limit texts every parser here takes (a part of them: digits without leading
/// zeros, suffixes in upper case, values that fit), as a regular expression for the
/// API's schema.
pub const RATE_LIMIT_PATTERN: &str = concat!(
    "^(bytes=",
    bucket_pattern!(),
    "(,ops=",
    bucket_pattern!(),
    ")?|ops=",
    bucket_pattern!(),
    "(,bytes=",
    bucket_pattern!(),
    ")?)$"
);

/// A rate limit as request bodies and query strings write it (`bytes=10M,ops=1000`),
/// for the JSON schema (the value is a [`RateLimit`]).
#[derive(JsonSchema)]
#[schemars(
    description = "`bytes=SIZE[/MS][+BURST]` and/or `ops=N[/MS][+BURST]`, comma-separated: a bucket of SIZE bytes (K, M, G: powers of 1024) or N operations refilled every MS milliseconds (default 1000), with a one-time BURST."
)]
pub struct RateLimitText(#[schemars(regex(pattern = RATE_LIMIT_PATTERN))] pub String);

/// Serde for an optional rate limit written as its text (`"bytes=2K"`), as request
/// bodies take it: `#[serde(with = "api_types::rate_limit::text")]`.
pub mod text {
    use super::RateLimit;
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes the limit's text, or null.
    pub fn serialize<S: Serializer>(limit: &Option<RateLimit>, s: S) -> Result<S::Ok, S::Error> {
        match limit {
            Some(l) => s.collect_str(l),
            None => s.serialize_none(),
        }
    }

    /// Reads the limit's text, or null.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<RateLimit>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|s| s.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(size: u64, ms: u64, burst: u64) -> Option<BucketConfig> {
        Some(BucketConfig {
            size,
            one_time_burst: burst,
            refill_time_ms: ms,
        })
    }

    #[test]
    fn parses_bytes_and_ops_and_prints_them_back() {
        let l: RateLimit = "bytes=10M,ops=500/100+1K".parse().unwrap();
        assert_eq!(l.bandwidth, bucket(10 << 20, 1000, 0));
        assert_eq!(l.ops, bucket(500, 100, 1024));
        assert_eq!(l.to_string(), "bytes=10M,ops=500/100+1K");
        for text in ["bytes=1", "ops=7/3", "bytes=64K+1G,ops=1"] {
            let l: RateLimit = text.parse().unwrap();
            assert_eq!(l.to_string().parse::<RateLimit>(), Ok(l), "{text}");
        }
    }

    #[test]
    fn texts_in_the_schema_pattern_parse() {
        let pattern = regex_lite::Regex::new(RATE_LIMIT_PATTERN).unwrap();
        for text in [
            "bytes=1",
            "ops=7/3",
            "bytes=64K+1G,ops=1",
            "ops=999999999G/999999+999999999G,bytes=1M",
            "bytes=100+0",
        ] {
            assert!(pattern.is_match(text), "{text}");
            assert!(text.parse::<RateLimit>().is_ok(), "{text}");
        }
        for text in [
            "",
            "bytes=0",
            "bytes=1/0",
            "bytes=1,bytes=2",
            "bytes=1,",
            "x=1",
        ] {
            assert!(!pattern.is_match(text), "{text}");
        }
    }

    #[test]
    fn refuses_bad_text_and_buckets_that_never_refill() {
        for bad in [
            "",
            "fast",
            "bytes",
            "bytes=",
            "bytes=x",
            "gpu=1",
            "bytes=1,bytes=2",
            "bytes=1/x",
            "bytes=99999999999999999999G",
        ] {
            assert!(
                matches!(bad.parse::<RateLimit>(), Err(RateLimitError::Syntax(_))),
                "{bad}"
            );
        }
        assert_eq!(
            "ops=0".parse::<RateLimit>(),
            Err(RateLimitError::Zero("ops"))
        );
        assert_eq!(
            "bytes=1/0".parse::<RateLimit>(),
            Err(RateLimitError::Zero("bytes"))
        );
    }
}
