//! Cgroup files kept open: a cgroup whose accounting is read and reset often (a pooled
//! cgroup a rewound clone keeps from one request to the next) has its files opened once
//! and read and written in place (`pread`, `pwrite`), where each access by path costs
//! an open, a read or write and a close.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// One held cgroup's open files, by path and mode (a file read and written is opened
/// once for each: a read-only cgroup file cannot be opened for writing).
type Open = HashMap<(PathBuf, bool), File>;

/// The open files of the cgroups held, by cgroup name.
#[derive(Debug, Clone, Default)]
pub(super) struct HeldFiles(Arc<Mutex<HashMap<String, Open>>>);

impl HeldFiles {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Open>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps cgroup `name`'s files open from their next access.
    pub fn hold(&self, name: &str) {
        self.lock().entry(name.to_string()).or_default();
    }

    /// Closes cgroup `name`'s files (it is released or removed).
    pub fn let_go(&self, name: &str) {
        self.lock().remove(name);
    }

    /// Runs `f` on `path`, a file of cgroup `name`, open for writing or reading; None
    /// when `name` is not held. A file that fails is closed (opened again next time).
    fn with<T>(
        &self,
        name: &str,
        path: &Path,
        write: bool,
        f: impl FnOnce(&File) -> io::Result<T>,
    ) -> Option<io::Result<T>> {
        let mut held = self.lock();
        let files = held.get_mut(name)?;
        let key = (path.to_path_buf(), write);
        let file = match files.entry(key.clone()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                match OpenOptions::new().read(!write).write(write).open(path) {
                    Ok(file) => e.insert(file),
                    Err(err) => return Some(Err(err)),
                }
            }
        };
        let result = f(file);
        if result.is_err() {
            files.remove(&key);
        }
        Some(result)
    }

    /// The whole of `path` (cgroup `name`'s), read in place; None when not held.
    pub fn read(&self, name: &str, path: &Path) -> Option<io::Result<String>> {
        self.with(name, path, false, |file| {
            let mut text = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let n = file.read_at(&mut buf, text.len() as u64)?;
                if n == 0 {
                    break;
                }
                text.extend_from_slice(&buf[..n]);
            }
            String::from_utf8(text).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
        })
    }

    /// Writes `value` to `path` (cgroup `name`'s) in place; `truncate`: a plain file
    /// (a fake hierarchy's) is cut to it. None when not held.
    pub fn write(
        &self,
        name: &str,
        path: &Path,
        value: &str,
        truncate: bool,
    ) -> Option<io::Result<()>> {
        self.with(name, path, true, |file| {
            file.write_all_at(value.as_bytes(), 0)?;
            if truncate {
                file.set_len(value.len() as u64)?;
            }
            Ok(())
        })
    }
}
