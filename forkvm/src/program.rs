//! Where the programs the library starts are found.

use std::path::{Path, PathBuf};

/// Program `name`: `$var` if set, else `name` beside the current executable if there is
/// one, else `name` (from `PATH`).
pub(crate) fn beside_exe(name: &str, var: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(var) {
        return p.into();
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| Some(e.parent()?.join(name)));
    beside
        .filter(|p| p.is_file())
        .unwrap_or_else(|| name.into())
}

/// Guest file `name` (a kernel, an image) when no path was given: in `../share/forkvm`
/// beside the current executable when it is there (`make install`), else in
/// `target/guest` (a build tree, relative to the working directory).
pub fn guest_file(name: &str) -> PathBuf {
    guest_file_beside(std::env::current_exe().ok().as_deref(), name)
}

/// [`guest_file`] for the program `exe`.
fn guest_file_beside(exe: Option<&Path>, name: &str) -> PathBuf {
    let installed = exe.and_then(|e| Some(e.parent()?.parent()?.join("share/forkvm").join(name)));
    (installed.filter(|p| p.is_file())).unwrap_or_else(|| Path::new("target/guest").join(name))
}

/// Why [`vmm_state_id`] could not tell a `vmm`'s saved-state id.
#[derive(Debug, thiserror::Error)]
pub enum StateIdError {
    /// The program could not be started.
    #[error("cannot start {program} state-id: {source}")]
    Spawn {
        /// The program.
        program: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// It ran and did not print an id (an older `vmm` without the command, say).
    #[error("{program} state-id did not print a saved-state id ({status}): {output}")]
    Output {
        /// The program.
        program: PathBuf,
        /// How it exited.
        status: std::process::ExitStatus,
        /// What it printed (stdout, then stderr), trimmed.
        output: String,
    },
}

/// The saved-state id of the `vmm` program `vmm` (what `vmm state-id` prints: 16
/// hexadecimal digits). Two builds with the same id restore each other's snapshots, so
/// saved VMs kept by their inputs (the containerd shim's template, the gateway's base
/// snapshot) name the `vmm` by its id, not by its bytes: a rebuild that changed nothing
/// of what a saved VM holds keeps them.
pub fn vmm_state_id(vmm: &Path) -> Result<String, StateIdError> {
    let out = std::process::Command::new(vmm)
        .arg("state-id")
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|source| StateIdError::Spawn {
            program: vmm.to_path_buf(),
            source,
        })?;
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if out.status.success() && is_state_id(&id) {
        return Ok(id);
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let output = format!("{id} {}", stderr.trim())
        .trim()
        .chars()
        .take(400)
        .collect();
    Err(StateIdError::Output {
        program: vmm.to_path_buf(),
        status: out.status,
        output,
    })
}

/// Whether `text` is a saved-state id: 16 lower-case hexadecimal digits.
fn is_state_id(text: &str) -> bool {
    text.len() == 16 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_id_is_asked_of_the_program_and_checked() {
        assert!(is_state_id("0123456789abcdef"));
        assert!(!is_state_id("0123456789ABCDEF"));
        assert!(!is_state_id("0123456789abcde"));
        // A program that prints something else, or nothing, or is missing: each its error.
        let e = vmm_state_id(Path::new("/bin/echo")).unwrap_err();
        assert!(
            matches!(&e, StateIdError::Output { output, .. } if output == "state-id"),
            "{e}"
        );
        let e = vmm_state_id(Path::new("/bin/false")).unwrap_err();
        assert!(matches!(e, StateIdError::Output { .. }), "{e}");
        let e = vmm_state_id(Path::new("/nonexistent/vmm")).unwrap_err();
        assert!(matches!(e, StateIdError::Spawn { .. }), "{e}");
        assert!(e.to_string().contains("/nonexistent/vmm"), "{e}");
    }

    #[test]
    fn guest_files_are_found_where_make_install_puts_them_else_in_the_build_tree() {
        let dir = std::env::temp_dir().join(format!("forkvm-guest-file-{}", std::process::id()));
        let share = dir.join("share/forkvm");
        std::fs::create_dir_all(&share).unwrap();
        std::fs::write(share.join("vmlinux"), b"k").unwrap();
        let exe = dir.join("bin/forkvm-gateway");
        assert_eq!(
            guest_file_beside(Some(&exe), "vmlinux"),
            share.join("vmlinux")
        );
        assert_eq!(
            guest_file_beside(Some(&exe), "python.ext4"),
            Path::new("target/guest/python.ext4")
        );
        assert_eq!(
            guest_file_beside(None, "vmlinux"),
            Path::new("target/guest/vmlinux")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
