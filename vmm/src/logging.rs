//! Fork-safe logging to stderr.
//!
//! The VMM forks clones while its API thread may be anywhere, possibly writing a log
//! line. `std::io::stderr()` takes a process-wide lock for each write; a child forked
//! while another thread holds it would block forever on its first log line. This
//! writer takes no lock: tracing formats each event into a buffer first, and the
//! buffer goes out in one `write(2)` on fd 2, which the kernel keeps whole for a line
//! of ordinary size. Clones share their parent's stderr; each of their lines starts
//! with the clone's tag ([`set_tag`]).

use std::io::Write;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

/// A `tracing_subscriber` writer for fd 2 that holds no lock.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawStderr;

impl Write for RawStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        loop {
            // SAFETY: writes at most buf.len() bytes from a valid buffer to fd 2.
            let n = unsafe { libc::write(2, buf.as_ptr().cast(), buf.len()) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for RawStderr {
    type Writer = LogLine;

    fn make_writer(&'a self) -> Self::Writer {
        LogLine(Vec::with_capacity(160))
    }
}

/// The tag of this process's VM, `[clone 2.1] `, or empty in an original VM. Clones
/// share their parent's stderr, so every log line a clone writes starts with it. Kept in
/// place (no allocation to leak or free under a writer: a rewound clone names itself
/// at every request); a line written while it changes may show a mixed tag.
static TAG: [AtomicU8; MAX_TAG] = [const { AtomicU8::new(0) }; MAX_TAG];
/// The tag's length in [`TAG`].
static TAG_LEN: AtomicUsize = AtomicUsize::new(0);
/// The longest tag kept (longer ones are cut).
const MAX_TAG: usize = 64;

/// From now on, every log line of this process starts with `[<name>] ` (a clone names
/// itself once forked, `clone pid 123` while it is warm, then `clone 2.1`).
pub fn set_tag(name: &str) {
    let tag = format!("[{name}] ");
    let bytes = &tag.as_bytes()[..tag.len().min(MAX_TAG)];
    TAG_LEN.store(0, Ordering::Release);
    for (slot, b) in TAG.iter().zip(bytes) {
        slot.store(*b, Ordering::Relaxed);
    }
    TAG_LEN.store(bytes.len(), Ordering::Release);
}

/// The tag now (empty before [`set_tag`]).
fn tag() -> String {
    let len = TAG_LEN.load(Ordering::Acquire).min(MAX_TAG);
    let bytes: Vec<u8> = TAG[..len]
        .iter()
        .map(|b| b.load(Ordering::Relaxed))
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// One log event, collected and written out with the process's tag in one `write(2)`
/// when tracing is done with it (so lines of clones sharing stderr do not interleave).
#[derive(Debug)]
pub struct LogLine(Vec<u8>);

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            let _ = RawStderr.write_all(&tagged(&tag(), &self.0));
        }
    }
}

/// `text` with `tag` before each of its lines.
fn tagged(tag: &str, text: &[u8]) -> Vec<u8> {
    if tag.is_empty() {
        return text.to_vec();
    }
    let mut out = Vec::with_capacity(text.len() + tag.len());
    for line in text.split_inclusive(|b| *b == b'\n') {
        out.extend_from_slice(tag.as_bytes());
        out.extend_from_slice(line);
    }
    out
}

/// Writes one message line to stderr without taking a lock (for forked children,
/// where `eprintln!` could deadlock).
pub fn raw_eprintln(msg: &str) {
    let mut line = String::with_capacity(msg.len() + 1);
    line.push_str(msg);
    line.push('\n');
    let _ = RawStderr.write_all(line.as_bytes());
}

/// How long each stage of a start-up took (logged at debug level, for finding costs):
/// the VM build's stages, a clone's rebuild.
pub struct StageTimer {
    last: std::time::Instant,
    stages: Vec<(&'static str, u128)>,
}

impl StageTimer {
    /// Starts timing the first stage now.
    pub fn new() -> Self {
        Self {
            last: std::time::Instant::now(),
            stages: Vec::new(),
        }
    }

    /// The stage under way is done: records its time and starts the next.
    pub fn done(&mut self, stage: &'static str) {
        let now = std::time::Instant::now();
        self.stages.push((stage, (now - self.last).as_micros()));
        self.last = now;
    }

    /// `stage 12us, stage 40us, ...`.
    pub fn report(&self) -> String {
        self.stages
            .iter()
            .map(|(s, us)| format!("{s} {us}us"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Default for StageTimer {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_starts_every_line_of_an_event() {
        assert_eq!(tagged("", b"a\nb\n"), b"a\nb\n");
        assert_eq!(
            tagged("[clone 2.1] ", b" WARN refused\n  detail\n"),
            b"[clone 2.1]  WARN refused\n[clone 2.1]   detail\n"
        );
        assert_eq!(tagged("[c] ", b"no newline"), b"[c] no newline");
    }
}
