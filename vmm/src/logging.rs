//! Fork-safe logging to stderr.
//!
//! The VMM forks clones while its API thread may be anywhere, possibly writing a log
//! line. `std::io::stderr()` takes a process-wide lock for each write; a child forked
//! while another thread holds it would block forever on its first log line. This
//! writer takes no lock: tracing formats each event into a buffer first, and the
//! buffer goes out in `write(2)` calls on fd 2, which the kernel keeps whole for a
//! line of ordinary size.

use std::io::Write;

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
    type Writer = RawStderr;

    fn make_writer(&'a self) -> Self::Writer {
        *self
    }
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
