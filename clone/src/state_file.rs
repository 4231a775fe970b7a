//! The snapshot state file (the VMM's `snapshot` module writes and reads it): a
//! versioned, checksummed container for a snapshot's state (vCPUs, VM, devices, the
//! VM's configuration), so that a file from another forkvm version, a truncated
//! copy or a corrupted one is refused with a clear error before anything is built from
//! it.
//!
//! Layout (little endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic, `FKVMSNAP` |
//! | 8 | 4 | format version ([`FORMAT_VERSION`]) |
//! | 12 | 4 | flags, 0 |
//! | 16 | 8 | payload length in bytes |
//! | 24 | 4 | CRC-32 (IEEE) of the payload |
//! | 28 | 4 | reserved, 0 |
//! | 32 | length | payload: the state as JSON |
//!
//! The file holds what the guest's registers held, so it is created owner-only (0600),
//! through a temporary name and a rename: a reader never sees half a file under the
//! final name.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// The first bytes of every state file.
pub const MAGIC: [u8; 8] = *b"FKVMSNAP";
/// The format this forkvm writes and reads. A change to the payload's types that an
/// older reader would misread bumps it.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes before the payload.
pub const HEADER_LEN: usize = 32;

/// Why a state file cannot be written or read.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    /// The state could not be encoded.
    #[error("cannot encode the snapshot state: {0}")]
    Encode(#[source] serde_json::Error),
    /// The file could not be written.
    #[error("cannot write the snapshot state file {path}: {source}")]
    Write {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file could not be read.
    #[error("cannot read the snapshot state file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file does not start with [`MAGIC`].
    #[error("{path} is not a forkvm snapshot state file (it does not start with FKVMSNAP)")]
    NotAStateFile {
        /// The file.
        path: String,
    },
    /// The file is of another format version.
    #[error(
        "{path} has snapshot format version {found}; this forkvm reads version \
         {FORMAT_VERSION} only (take the snapshot again with this version)"
    )]
    Version {
        /// The file.
        path: String,
        /// The version it has.
        found: u32,
    },
    /// The file is shorter or longer than its header says.
    #[error("{path} is {got} bytes long, its header says {expected}: truncated or appended to")]
    Length {
        /// The file.
        path: String,
        /// Its length.
        got: u64,
        /// The length its header gives.
        expected: u64,
    },
    /// The payload does not match its checksum.
    #[error("{path} is corrupted: its contents have checksum {found:#010x}, the header says {expected:#010x}")]
    Checksum {
        /// The file.
        path: String,
        /// The payload's CRC-32.
        found: u32,
        /// The header's.
        expected: u32,
    },
    /// The header has flags or reserved bytes this version does not know.
    #[error("{path} has header fields this forkvm does not know (flags {flags:#x})")]
    Header {
        /// The file.
        path: String,
        /// The flags.
        flags: u32,
    },
    /// The payload is intact but does not decode into the state.
    #[error("{path} does not hold a state this forkvm can read: {source}")]
    Decode {
        /// The file.
        path: String,
        /// Why.
        source: serde_json::Error,
    },
}

/// The whole file for `state`: header and payload.
pub fn encode<T: Serialize>(state: &T) -> Result<Vec<u8>, StateFileError> {
    let payload = serde_json::to_vec(state).map_err(StateFileError::Encode)?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

/// The state in `bytes`, a whole file read from `path` (named in errors). Checks, in
/// order: the magic, the version, the header, the length, the checksum, the contents.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], path: &Path) -> Result<T, StateFileError> {
    let path = || path.display().to_string();
    if bytes.len() < MAGIC.len() || bytes[..MAGIC.len()] != MAGIC {
        return Err(StateFileError::NotAStateFile { path: path() });
    }
    if bytes.len() < HEADER_LEN {
        return Err(StateFileError::Length {
            path: path(),
            got: bytes.len() as u64,
            expected: HEADER_LEN as u64,
        });
    }
    let version = le_u32(bytes, 8);
    if version != FORMAT_VERSION {
        return Err(StateFileError::Version {
            path: path(),
            found: version,
        });
    }
    let flags = le_u32(bytes, 12);
    if flags != 0 || le_u32(bytes, 28) != 0 {
        return Err(StateFileError::Header {
            path: path(),
            flags,
        });
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[16..24]);
    let expected = (HEADER_LEN as u64).saturating_add(u64::from_le_bytes(len));
    if bytes.len() as u64 != expected {
        return Err(StateFileError::Length {
            path: path(),
            got: bytes.len() as u64,
            expected,
        });
    }
    let payload = &bytes[HEADER_LEN..];
    let (found, wanted) = (crc32fast::hash(payload), le_u32(bytes, 24));
    if found != wanted {
        return Err(StateFileError::Checksum {
            path: path(),
            found,
            expected: wanted,
        });
    }
    serde_json::from_slice(payload).map_err(|source| StateFileError::Decode {
        path: path(),
        source,
    })
}

/// Writes `state` to `path` (owner-only, through `<path>.tmp` and a rename, synced).
pub fn write<T: Serialize>(path: &Path, state: &T) -> Result<(), StateFileError> {
    let bytes = encode(state)?;
    let err = |source| StateFileError::Write {
        path: path.display().to_string(),
        source,
    };
    let tmp = path.with_extension("tmp");
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(&bytes)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(e));
    }
    Ok(())
}

/// Reads the state at `path`.
pub fn read<T: DeserializeOwned>(path: &Path) -> Result<T, StateFileError> {
    let bytes = std::fs::read(path).map_err(|source| StateFileError::Read {
        path: path.display().to_string(),
        source,
    })?;
    decode(&bytes, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;

    #[derive(Debug, PartialEq, Serialize, serde::Deserialize)]
    struct Sample {
        regs: Vec<u64>,
        name: String,
    }

    fn sample() -> Sample {
        Sample {
            regs: (0..64).map(|i| i * 0x1111).collect(),
            name: "template".into(),
        }
    }

    fn dir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("forkvm-state-file-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn refused(bytes: &[u8]) -> StateFileError {
        decode::<Sample>(bytes, Path::new("state")).unwrap_err()
    }

    #[test]
    fn a_state_written_reads_back_the_same_owner_only_and_with_no_temporary_left() {
        let d = dir("roundtrip");
        let path = d.join("state");
        write(&path, &sample()).unwrap();
        assert_eq!(read::<Sample>(&path).unwrap(), sample());
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["state"]);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn every_kind_of_bad_file_is_refused_with_its_own_error() {
        let good = encode(&sample()).unwrap();
        assert!(matches!(
            refused(b"hello"),
            StateFileError::NotAStateFile { .. }
        ));
        assert!(matches!(refused(b""), StateFileError::NotAStateFile { .. }));
        assert!(matches!(
            refused(&good[..20]),
            StateFileError::Length {
                got: 20,
                expected: 32,
                ..
            }
        ));
        let mut newer = good.clone();
        newer[8] = 2;
        let e = refused(&newer);
        assert!(matches!(e, StateFileError::Version { found: 2, .. }), "{e}");
        assert!(e.to_string().contains("version 2"), "{e}");
        let mut flagged = good.clone();
        flagged[12] = 1;
        assert!(matches!(
            refused(&flagged),
            StateFileError::Header { flags: 1, .. }
        ));
        let cut = &good[..good.len() - 1];
        assert!(matches!(refused(cut), StateFileError::Length { .. }));
        let mut longer = good.clone();
        longer.push(b'\n');
        assert!(matches!(refused(&longer), StateFileError::Length { .. }));
        // Every single flipped bit of the payload is caught by the checksum.
        for at in [HEADER_LEN, good.len() / 2, good.len() - 1] {
            let mut bad = good.clone();
            bad[at] ^= 0x10;
            assert!(
                matches!(refused(&bad), StateFileError::Checksum { .. }),
                "byte {at}"
            );
        }
        // Intact, but not this type.
        let other = encode(&vec![1u8, 2, 3]).unwrap();
        let e = refused(&other);
        assert!(matches!(e, StateFileError::Decode { .. }), "{e}");
        assert_eq!(
            decode::<Sample>(&good, Path::new("state")).unwrap(),
            sample()
        );
    }

    #[test]
    fn a_missing_file_or_directory_is_a_clear_error() {
        let e = read::<Sample>(Path::new("/nonexistent/forkvm/state")).unwrap_err();
        assert!(matches!(e, StateFileError::Read { .. }), "{e}");
        let e = write(Path::new("/nonexistent/forkvm/state"), &sample()).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/forkvm/state"), "{e}");
    }
}
