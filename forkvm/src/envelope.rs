//! The answer of a Python function loaded with logs (`Load::logs`): the invocation's
//! status, its body (the reply, or the traceback) and what it printed, in the envelope
//! the runtime writes (docs/invoke.md, "Logs").

use bytes::Bytes;
use serde::Deserialize;

/// An envelope's first bytes.
pub const ENVELOPE_MAGIC: &[u8] = b"FKVMENV1";

/// How an invocation with logs ended, by the runtime's account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum EnvelopeStatus {
    /// The handler returned; the body is its reply.
    Ok,
    /// The handler raised; the body is its traceback.
    Error,
    /// The handler was still running shortly before its time limit and was
    /// interrupted; the body says so.
    Timeout,
}

/// An unpacked envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// How the invocation ended.
    pub status: EnvelopeStatus,
    /// The reply, or the traceback (UTF-8) for an error or a timeout.
    pub body: Bytes,
    /// What the handler wrote to standard output and error (its last characters).
    pub logs: String,
    /// Characters of its output dropped before `logs` (the runtime keeps the last 64 KiB,
    /// and cuts more to fit the mailbox).
    pub logs_dropped: u64,
}

/// Why an answer is no envelope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// It does not start with [`ENVELOPE_MAGIC`]: the runtime did not load with logs.
    #[error("the answer is no envelope (a function loaded without logs?)")]
    NotAnEnvelope,
    /// It is cut short or its header does not parse.
    #[error("a malformed envelope: {0}")]
    Malformed(String),
}

#[derive(Deserialize)]
struct Header {
    status: EnvelopeStatus,
    body: usize,
    logs: usize,
    logs_dropped: u64,
}

impl Envelope {
    /// Unpacks `answer`.
    pub fn parse(answer: &Bytes) -> Result<Self, EnvelopeError> {
        let bad = |what: &str| EnvelopeError::Malformed(what.into());
        let rest = answer
            .strip_prefix(ENVELOPE_MAGIC)
            .ok_or(EnvelopeError::NotAnEnvelope)?;
        let (len, rest) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| bad("no length"))?;
        let len = u32::from_le_bytes(*len) as usize;
        let head = rest.get(..len).ok_or_else(|| bad("header cut short"))?;
        let h: Header = serde_json::from_slice(head)
            .map_err(|e| EnvelopeError::Malformed(format!("header: {e}")))?;
        let start = ENVELOPE_MAGIC.len() + 4 + len;
        let body_end = start
            .checked_add(h.body)
            .ok_or_else(|| bad("body length"))?;
        let end = body_end
            .checked_add(h.logs)
            .ok_or_else(|| bad("logs length"))?;
        if end != answer.len() {
            return Err(EnvelopeError::Malformed(format!(
                "{} bytes where the header says {end}",
                answer.len()
            )));
        }
        Ok(Envelope {
            status: h.status,
            body: answer.slice(start..body_end),
            logs: String::from_utf8_lossy(&answer[body_end..end]).into_owned(),
            logs_dropped: h.logs_dropped,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pack(header: &str, rest: &[u8]) -> Bytes {
        let mut v = ENVELOPE_MAGIC.to_vec();
        v.extend_from_slice(&(header.len() as u32).to_le_bytes());
        v.extend_from_slice(header.as_bytes());
        v.extend_from_slice(rest);
        Bytes::from(v)
    }

    #[test]
    fn an_envelope_unpacks_into_status_body_and_logs() {
        let h = r#"{"status": "ok", "body": 5, "logs": 4, "logs_dropped": 7}"#;
        let e = Envelope::parse(&pack(h, b"replyhi\n\n")).unwrap();
        assert_eq!(e.status, EnvelopeStatus::Ok);
        assert_eq!(&e.body[..], b"reply");
        assert_eq!((e.logs.as_str(), e.logs_dropped), ("hi\n\n", 7));
        let h = r#"{"status": "timeout", "body": 0, "logs": 0, "logs_dropped": 0}"#;
        assert_eq!(
            Envelope::parse(&pack(h, b"")).unwrap().status,
            EnvelopeStatus::Timeout
        );
    }

    #[test]
    fn what_is_no_envelope_or_a_broken_one_says_so() {
        assert_eq!(
            Envelope::parse(&Bytes::from_static(b"plain reply")),
            Err(EnvelopeError::NotAnEnvelope)
        );
        let ok = r#"{"status": "ok", "body": 5, "logs": 4, "logs_dropped": 0}"#;
        for (answer, says) in [
            (Bytes::from_static(b"FKVMENV1\x01"), "no length"),
            (pack(ok, b"reply"), "where the header says"),
            (pack(ok, b"replyhi\n\nmore"), "where the header says"),
            (pack(r#"{"status": "maybe"}"#, b""), "header"),
            (
                pack(
                    r#"{"status": "ok", "body": 18446744073709551615, "logs": 2, "logs_dropped": 0}"#,
                    b"",
                ),
                "length",
            ),
        ] {
            let e = Envelope::parse(&answer).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
        let mut cut = pack(ok, b"").to_vec();
        cut.truncate(ENVELOPE_MAGIC.len() + 10);
        let e = Envelope::parse(&Bytes::from(cut)).unwrap_err().to_string();
        assert!(e.contains("header cut short"), "{e}");
    }
}
