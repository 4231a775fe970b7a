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

#[cfg(test)]
mod tests {
    use super::*;

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
