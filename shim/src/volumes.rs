//! Host directories and larger files the OCI spec binds into a container (volumes:
//! Kubernetes' ConfigMap, Secret and service-account token volumes, `hostPath`,
//! `emptyDir`), copied into the guest: an archive the shim writes on the container's
//! first process's input, which `forkvm-oci --unpack` reads to its end entry and makes
//! in the container's root file system before the program starts (what follows is the
//! program's own input). The copy is the container's: what it writes there stays in its
//! guest, and changes on the host after the start do not reach it.
//!
//! The format (guest/tools/forkvm-oci.h): per entry a 16-byte head (a kind byte, 3 zero
//! bytes, then the mode, the path's length and the data's length, little-endian 32-bit
//! numbers), the path in the container, and the data: `D` a directory, `F` a file, `L`
//! a symbolic link (the data its target), `E` the end.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// The most an archive may hold: the guest agent takes at most 16 MiB of input with a
/// request.
pub const MAX_ARCHIVE: usize = 15 << 20;

/// The most entries in one archive (each costs a few system calls in the guest).
pub const MAX_ENTRIES: usize = 4096;

/// Why a volume cannot be copied into the guest.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// The volumes hold more than one archive carries.
    #[error(
        "the volumes bound in hold more than {MAX_ARCHIVE} bytes or {MAX_ENTRIES} entries \
         (at {0}); forkvm copies volumes into the guest (docs/containerd.md)"
    )]
    TooLarge(String),
    /// A path in the volume is not UTF-8 or not absolute in the container.
    #[error("{0}: a path the guest cannot be given")]
    Path(String),
    /// Something in the volume cannot be read.
    #[error("{path}: {error}")]
    Read {
        /// What.
        path: String,
        /// Why.
        error: std::io::Error,
    },
}

/// An archive of copies for `forkvm-oci --unpack`.
#[derive(Debug, Default)]
pub struct Archive {
    bytes: Vec<u8>,
    entries: usize,
}

impl Archive {
    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Adds host directory `host` (all under it: directories, files, symbolic links as
    /// they are; other kinds are left out) at `dest` in the container.
    pub fn add_dir(&mut self, host: &Path, dest: &str) -> Result<(), VolumeError> {
        let meta = read(host, std::fs::metadata(host))?;
        let dest = dest.trim_end_matches('/');
        self.push(b'D', meta.permissions().mode(), dest, &[])?;
        let mut names: Vec<_> = read(host, std::fs::read_dir(host))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(|error| read_error(host, error))?;
        // The same archive for the same tree.
        names.sort();
        for name in names {
            let path = host.join(&name);
            let name = name
                .to_str()
                .ok_or_else(|| VolumeError::Path(path.display().to_string()))?;
            let inside = format!("{dest}/{name}");
            let meta = read(&path, std::fs::symlink_metadata(&path))?;
            if meta.is_dir() {
                self.add_dir(&path, &inside)?;
            } else if meta.is_symlink() {
                let target = read(&path, std::fs::read_link(&path))?;
                let target = target
                    .to_str()
                    .ok_or_else(|| VolumeError::Path(path.display().to_string()))?;
                self.push(b'L', 0o777, &inside, target.as_bytes())?;
            } else if meta.is_file() {
                self.add_file(&path, &inside)?;
            }
        }
        Ok(())
    }

    /// Adds host file `host` at `dest` in the container.
    pub fn add_file(&mut self, host: &Path, dest: &str) -> Result<(), VolumeError> {
        let file = read(host, std::fs::File::open(host))?;
        let mode = read(host, file.metadata())?.permissions().mode();
        // At most what still fits, and a byte more to tell a file that does not (it may
        // have grown since it was looked at): a large file is never read whole.
        let room = MAX_ARCHIVE.saturating_sub(self.bytes.len()) as u64;
        let mut data = Vec::new();
        read(host, file.take(room + 1).read_to_end(&mut data))?;
        self.push(b'F', mode, dest, &data)
    }

    fn push(&mut self, kind: u8, mode: u32, path: &str, data: &[u8]) -> Result<(), VolumeError> {
        if !path.starts_with('/') || path.contains('\0') {
            return Err(VolumeError::Path(path.to_string()));
        }
        self.entries += 1;
        if self.entries > MAX_ENTRIES
            || self.bytes.len() + 16 + path.len() + data.len() > MAX_ARCHIVE
        {
            return Err(VolumeError::TooLarge(path.to_string()));
        }
        self.bytes.extend([kind, 0, 0, 0]);
        for n in [mode & 0o7777, path.len() as u32, data.len() as u32] {
            self.bytes.extend(n.to_le_bytes());
        }
        self.bytes.extend(path.as_bytes());
        self.bytes.extend(data);
        Ok(())
    }

    /// The archive, its end entry added; empty if nothing was added.
    pub fn finish(mut self) -> Vec<u8> {
        if self.entries > 0 {
            self.bytes.extend(b"E\0\0\0");
            self.bytes.extend([0u8; 12]);
        }
        self.bytes
    }
}

fn read_error(path: &Path, error: std::io::Error) -> VolumeError {
    VolumeError::Read {
        path: path.display().to_string(),
        error,
    }
}

fn read<T>(path: &Path, r: std::io::Result<T>) -> Result<T, VolumeError> {
    r.map_err(|e| read_error(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The entries of an archive: (kind, mode, path, data).
    fn entries(mut b: &[u8]) -> Vec<(char, u32, String, Vec<u8>)> {
        let mut out = Vec::new();
        loop {
            let n = |i: usize| u32::from_le_bytes(b[4 + 4 * i..8 + 4 * i].try_into().unwrap());
            let (kind, mode, plen, dlen) = (b[0] as char, n(0), n(1) as usize, n(2) as usize);
            assert_eq!(&b[1..4], [0, 0, 0]);
            if kind == 'E' {
                assert_eq!(b.len(), 16, "nothing after the end");
                return out;
            }
            let path = String::from_utf8(b[16..16 + plen].to_vec()).unwrap();
            let data = b[16 + plen..16 + plen + dlen].to_vec();
            out.push((kind, mode, path, data));
            b = &b[16 + plen + dlen..];
        }
    }

    #[test]
    fn a_directory_tree_is_archived_with_its_files_links_and_modes() {
        let dir = std::env::temp_dir().join(format!("forkvm-shim-vol-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // A ConfigMap volume's shape: the keys are links into a timestamped directory.
        std::fs::create_dir_all(dir.join("..2026_12_03/sub")).unwrap();
        std::fs::write(dir.join("..2026_12_03/app.conf"), "port=8080\n").unwrap();
        std::fs::write(dir.join("..2026_12_03/sub/key"), vec![7u8; 70_000]).unwrap();
        std::fs::set_permissions(
            dir.join("..2026_12_03/sub/key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        std::os::unix::fs::symlink("..2026_12_03", dir.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/app.conf", dir.join("app.conf")).unwrap();
        let mut a = Archive::default();
        assert!(a.is_empty());
        a.add_dir(&dir, "/etc/config/").unwrap();
        let got = entries(&a.finish());
        let kinds: Vec<(char, &str)> = got.iter().map(|e| (e.0, e.2.as_str())).collect();
        assert_eq!(
            kinds,
            [
                ('D', "/etc/config"),
                ('D', "/etc/config/..2026_12_03"),
                ('F', "/etc/config/..2026_12_03/app.conf"),
                ('D', "/etc/config/..2026_12_03/sub"),
                ('F', "/etc/config/..2026_12_03/sub/key"),
                ('L', "/etc/config/..data"),
                ('L', "/etc/config/app.conf"),
            ]
        );
        assert_eq!(got[2].3, b"port=8080\n");
        assert_eq!((got[4].1, got[4].3.len()), (0o600, 70_000));
        assert_eq!(got[6].3, b"..data/app.conf");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_empty_archive_has_no_end_and_a_large_one_is_an_error() {
        assert!(Archive::default().finish().is_empty());
        let mut a = Archive::default();
        for i in 0..MAX_ENTRIES {
            a.push(b'D', 0o755, &format!("/d{i}"), &[]).unwrap();
        }
        let e = a.push(b'D', 0o755, "/one-more", &[]).unwrap_err();
        assert!(e.to_string().contains("/one-more"), "{e}");
        let mut a = Archive::default();
        let e = a
            .push(b'F', 0o644, "/big", &vec![0; MAX_ARCHIVE])
            .unwrap_err();
        assert!(matches!(e, VolumeError::TooLarge(_)), "{e}");
        let e = a.push(b'F', 0o644, "relative", &[]).unwrap_err();
        assert!(matches!(e, VolumeError::Path(_)), "{e}");
        // A file larger than what is left is refused, read only that far (a sparse
        // 64 GiB file here: reading it whole would take the memory).
        let big = std::env::temp_dir().join(format!("forkvm-shim-sparse-{}", std::process::id()));
        std::fs::File::create(&big)
            .unwrap()
            .set_len(64 << 30)
            .unwrap();
        let mut a = Archive::default();
        a.push(b'F', 0o644, "/some", &vec![1; 4096]).unwrap();
        let e = a.add_file(&big, "/big").unwrap_err();
        std::fs::remove_file(&big).unwrap();
        assert!(
            matches!(e, VolumeError::TooLarge(ref at) if at == "/big"),
            "{e}"
        );
        let e = a.add_file(&big, "/gone").unwrap_err();
        assert!(matches!(e, VolumeError::Read { .. }), "{e}");
    }
}
