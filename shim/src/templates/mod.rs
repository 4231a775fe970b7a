//! The template service: one process per host (per shim configuration) that keeps the
//! images' templates restored and paused, with warm clones, and lends their clones to
//! the shims.
//!
//! Without it each shim restores its own copy of its image's template for its one
//! container (tens of milliseconds of host work, a VMM process per container, the
//! warm clone made in the request's path). The service is the shim's own program run
//! as `containerd-shim-forkvm-v2 templates`, started, detached, by the first shim that
//! finds none ([`client::lease`]), and serves on a Unix socket in
//! `FORKVM_SHIM_RUN_DIR` ([`crate::config::ShimConfig::service_socket`]). A shim's
//! connection is its lease: one JSON line asks for a clone of an image's template (its
//! snapshot and the container's resource limits, [`Request`]), one line answers
//! ([`Answer`]), and the clone is stopped when the connection closes, whether the shim
//! deleted its container or died. On the same connection the shim asks for the
//! clone's cgroup usage (`ctr task metrics`). A template no container has used for
//! `FORKVM_SHIM_TEMPLATE_IDLE_S` is shut down, and the service exits once it keeps none
//! and serves no one.

pub mod client;
pub mod server;

use std::path::PathBuf;

use api_types::{CloneAddresses, CloneInfo};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt};

/// The argument that runs the shim's program as the template service.
pub const SUBCOMMAND: &str = "templates";

/// The longest line either side sends.
const MAX_LINE: usize = 64 << 10;

/// Reads one line of at most [`MAX_LINE`] bytes (its newline dropped); None at the end
/// of the stream.
async fn read_line<R: AsyncBufRead + Unpin>(reader: &mut R) -> std::io::Result<Option<String>> {
    let mut line = String::new();
    let n = (&mut *reader)
        .take(MAX_LINE as u64)
        .read_line(&mut line)
        .await?;
    if n == 0 {
        return Ok(None);
    }
    if !line.ends_with('\n') {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a line longer than {MAX_LINE} bytes, or cut short"),
        ));
    }
    line.pop();
    Ok(Some(line))
}

/// A template the service keeps: restored from `snapshot` (the shim's template's, or an
/// image's, in the shim's directory), its clones' cgroups with the limits `limits`
/// (`cpu=..,memory=..`, or empty).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TemplateKey {
    /// The template's snapshot.
    pub snapshot: PathBuf,
    /// Its clones' resource limits.
    pub limits: String,
}

impl std::fmt::Display for TemplateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.snapshot.display(), self.limits)
    }
}

/// A shim's request: a clone of `template`, on a tap of its own with the guest's
/// addresses when given (a pod on a network of its own).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// The template.
    #[serde(flatten)]
    pub template: TemplateKey,
    /// The clone's tap (made by its VMM under this name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tap: Option<String>,
    /// The guest's addresses in the clone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addresses: Option<CloneAddresses>,
}

/// What a shim asks on its lease once it has its clone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Call {
    /// The clone as its template's clone table shows it now (its cgroup's usage).
    Usage,
}

/// The service's answers, one JSON line each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Answer {
    /// The clone made for the request: running, lent until the connection closes.
    Clone(CloneInfo),
    /// The clone now ([`Call::Usage`]).
    Usage(CloneInfo),
    /// The template could not be restored from its snapshot (the snapshot is of no
    /// use: the shim removes it).
    Restore(String),
    /// Anything else that failed.
    Error(String),
}

impl Answer {
    /// The answer as one line, its newline included.
    fn line(&self) -> Vec<u8> {
        let mut line = serde_json::to_vec(self).unwrap_or_else(|e| {
            format!(r#"{{"error":"the answer could not be written: {e}"}}"#).into_bytes()
        });
        line.push(b'\n');
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_answers_read_back_as_written() {
        let mut r = Request {
            template: TemplateKey {
                snapshot: "/var/lib/forkvm/shim/prepared-a-b".into(),
                limits: "cpu=1.50".into(),
            },
            tap: None,
            addresses: None,
        };
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(
            text,
            r#"{"snapshot":"/var/lib/forkvm/shim/prepared-a-b","limits":"cpu=1.50"}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&text).unwrap(), r);
        r.tap = Some("fvp0123".into());
        r.addresses = Some(CloneAddresses {
            ipv4: "10.88.0.5/16".parse().unwrap(),
            gateway: Some("10.88.0.1".parse().unwrap()),
        });
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Request>(&text).unwrap(), r);
        let a = Answer::Restore("no such file".into());
        let line = a.line();
        assert_eq!(line.last(), Some(&b'\n'));
        assert_eq!(serde_json::from_slice::<Answer>(&line).unwrap(), a);
        assert_eq!(serde_json::to_string(&Call::Usage).unwrap(), r#""usage""#);
    }

    #[tokio::test]
    async fn lines_are_read_whole_and_a_long_one_is_refused() {
        let mut r = tokio::io::BufReader::new(&b"one\ntwo"[..]);
        assert_eq!(read_line(&mut r).await.unwrap().as_deref(), Some("one"));
        // The end came before the newline: cut short.
        assert!(read_line(&mut r).await.is_err());
        assert_eq!(read_line(&mut r).await.unwrap(), None);
        let long = vec![b'x'; MAX_LINE + 10];
        let mut r = tokio::io::BufReader::new(&long[..]);
        assert!(read_line(&mut r).await.is_err());
    }
}
