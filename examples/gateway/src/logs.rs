//! What functions printed: each invocation's logs, kept per function (the newest
//! [`KEPT`]), with every secret's value taken out.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Invocations whose logs are kept per function (each at most 64 KiB of text, the
/// runtime's bound).
pub const KEPT: usize = 100;

/// One invocation's logs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LogEntry {
    /// The invocation: the id of the clone that served it.
    pub invocation: String,
    /// When it ended, in ms since the Unix epoch.
    pub at_ms: u64,
    /// How it ended (`ok`, `handler_error`, `timeout`).
    pub outcome: String,
    /// What it wrote to standard output and error, its last characters, secrets
    /// redacted.
    pub logs: String,
    /// Characters dropped before `logs`.
    pub logs_dropped: u64,
}

/// Every function's recent logs.
#[derive(Debug, Default)]
pub struct LogStore {
    by_function: Mutex<HashMap<String, VecDeque<LogEntry>>>,
}

impl LogStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<LogEntry>>> {
        self.by_function.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `entry` as function `name`'s newest, forgetting its oldest beyond [`KEPT`].
    pub fn push(&self, name: &str, entry: LogEntry) {
        let mut all = self.lock();
        let q = all.entry(name.to_string()).or_default();
        q.push_front(entry);
        q.truncate(KEPT);
    }

    /// Function `name`'s newest `limit` entries, newest first.
    pub fn newest(&self, name: &str, limit: usize) -> Vec<LogEntry> {
        let all = self.lock();
        (all.get(name).into_iter().flatten())
            .take(limit)
            .cloned()
            .collect()
    }

    /// Forgets function `name`'s logs (it was deleted).
    pub fn forget(&self, name: &str) {
        self.lock().remove(name);
    }
}

/// Now, in ms since the Unix epoch.
pub fn now_ms() -> u64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH);
    since.map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// `text` with every value of `secrets` replaced by `[secret NAME]`, longest values
/// first (so that a secret containing another is taken out whole).
pub fn redact(text: &str, secrets: &BTreeMap<String, String>) -> String {
    let mut by_length: Vec<_> = secrets.iter().filter(|(_, v)| !v.is_empty()).collect();
    by_length.sort_by_key(|(_, v)| std::cmp::Reverse(v.len()));
    let mut out = text.to_string();
    for (name, value) in by_length {
        if out.contains(value.as_str()) {
            out = out.replace(value.as_str(), &format!("[secret {name}]"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(n: usize) -> LogEntry {
        LogEntry {
            invocation: n.to_string(),
            at_ms: n as u64,
            outcome: "ok".into(),
            logs: format!("line {n}\n"),
            logs_dropped: 0,
        }
    }

    #[test]
    fn the_newest_entries_are_kept_newest_first_and_forgotten_with_their_function() {
        let s = LogStore::default();
        for n in 0..KEPT + 5 {
            s.push("f", entry(n));
        }
        s.push("g", entry(7));
        let f = s.newest("f", usize::MAX);
        assert_eq!(f.len(), KEPT);
        assert_eq!(f[0], entry(KEPT + 4));
        assert_eq!(f[KEPT - 1], entry(5));
        assert_eq!(s.newest("f", 2), [entry(KEPT + 4), entry(KEPT + 3)]);
        assert!(s.newest("nobody", 10).is_empty());
        s.forget("f");
        assert!(s.newest("f", 10).is_empty());
        assert_eq!(s.newest("g", 10), [entry(7)]);
    }

    #[test]
    fn secrets_are_taken_out_whole_and_empty_ones_ignored() {
        let secrets = BTreeMap::from([
            ("TOKEN".to_string(), "abc123".to_string()),
            ("LONG".to_string(), "abc123-and-more".to_string()),
            ("EMPTY".to_string(), String::new()),
        ]);
        assert_eq!(
            redact("t=abc123 l=abc123-and-more x", &secrets),
            "t=[secret TOKEN] l=[secret LONG] x"
        );
        assert_eq!(redact("nothing here", &secrets), "nothing here");
    }
}
