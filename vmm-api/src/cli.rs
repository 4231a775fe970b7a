//! The command line's syntax for a VM's configuration values (`--disk`, `--console`,
//! `--cgroup-class`): text to the typed `vmm::config`, which the monitor's core takes as
//! it is.

use std::path::PathBuf;

use vmm::config::{ConsoleSink, DiskConfig};

/// A `--console` value: `stdout` (or `-`), `null` (or `none`), or a file's path.
pub fn parse_console(s: &str) -> Result<ConsoleSink, String> {
    Ok(match s {
        "" => return Err("empty console sink".into()),
        "stdout" | "-" => ConsoleSink::Stdout,
        "null" | "none" => ConsoleSink::Null,
        path => ConsoleSink::File(PathBuf::from(path)),
    })
}

/// Parses `NAME:LIMITS` (`small:cpu=0.5,memory=64M,pids=64`; `NAME` alone is unlimited).
pub fn parse_cgroup_class(s: &str) -> Result<(String, jailer::cgroup::ResourceClass), String> {
    let (name, limits) = s.split_once(':').unwrap_or((s, ""));
    if name.is_empty()
        || name.len() > 32
        || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Err(format!(
            "class name {name:?}: use 1 to 32 letters, digits or '_'"
        ));
    }
    Ok((name.to_string(), limits.parse()?))
}

/// A `--disk` specification that does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DiskSpecError {
    /// No image path before the first comma.
    #[error("disk {0:?}: expected PATH[,cow=DIR[,keep]][,bytes=SIZE..][,ops=N..]")]
    NoPath(String),
    /// An option other than `cow=`, `keep`, `bytes=` and `ops=`.
    #[error("disk {spec:?}: unknown option {option:?} (expected cow=DIR, keep, bytes=.., ops=..)")]
    Option {
        /// The whole specification.
        spec: String,
        /// The option.
        option: String,
    },
    /// An option given twice.
    #[error("disk {spec:?}: {source}")]
    Options {
        /// The whole specification.
        spec: String,
        /// Why.
        source: api_types::options::OptionError,
    },
    /// `keep` on a read-only disk.
    #[error("disk {0:?}: keep needs cow=DIR (a read-only disk has no overlay to keep)")]
    KeepWithoutCow(String),
    /// The rate limit does not parse.
    #[error("disk {spec:?}: {source}")]
    RateLimit {
        /// The whole specification.
        spec: String,
        /// Why.
        source: devices::rate_limiter::RateLimitError,
    },
}

/// A `--disk` value: `images/base.ext4`, `scratch.img,cow=/var/tmp,keep,bytes=10M,ops=1000`
/// (a path may not contain a comma; `keep` needs `cow=`).
pub fn parse_disk(s: &str) -> Result<DiskConfig, DiskSpecError> {
    let (path, options) = s.split_once(',').unwrap_or((s, ""));
    if path.is_empty() {
        return Err(DiskSpecError::NoPath(s.to_string()));
    }
    let items = api_types::options::items(options).map_err(|source| DiskSpecError::Options {
        spec: s.to_string(),
        source,
    })?;
    let mut disk = DiskConfig {
        path: PathBuf::from(path),
        cow_dir: None,
        keep: false,
        rate_limit: None,
    };
    let mut limit = Vec::new();
    for item in items {
        match (item.key, item.value) {
            ("keep", None) => disk.keep = true,
            ("cow", Some(dir)) if !dir.is_empty() => disk.cow_dir = Some(PathBuf::from(dir)),
            ("bytes" | "ops", Some(v)) => limit.push(format!("{}={v}", item.key)),
            (key, value) => {
                return Err(DiskSpecError::Option {
                    spec: s.to_string(),
                    option: value.map_or_else(|| key.to_string(), |v| format!("{key}={v}")),
                })
            }
        }
    }
    if disk.keep && disk.cow_dir.is_none() {
        return Err(DiskSpecError::KeepWithoutCow(s.to_string()));
    }
    if !limit.is_empty() {
        let limit = limit
            .join(",")
            .parse()
            .map_err(|source| DiskSpecError::RateLimit {
                spec: s.to_string(),
                source,
            })?;
        disk.rate_limit = Some(limit);
    }
    Ok(disk)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_specs_parse_and_bad_ones_say_why() {
        let d = parse_disk("a.img").unwrap();
        assert_eq!(
            (d.path, d.cow_dir, d.rate_limit),
            ("a.img".into(), None, None)
        );
        let d = parse_disk("/x/b.img,bytes=1M,cow=/tmp,ops=10/100").unwrap();
        assert!(!d.keep);
        assert_eq!(d.kept_path(1, 42), None);
        let k = parse_disk("/x/b.img,cow=/tmp,keep").unwrap();
        assert_eq!(k.kept_path(1, 42), Some("/tmp/fkvm42-disk1.overlay".into()));
        assert_eq!(
            parse_disk("a,keep"),
            Err(DiskSpecError::KeepWithoutCow("a,keep".into()))
        );
        assert_eq!(d.path, PathBuf::from("/x/b.img"));
        assert_eq!(d.cow_dir, Some("/tmp".into()));
        assert_eq!(d.rate_limit, Some("bytes=1M,ops=10/100".parse().unwrap()));
        assert_eq!(parse_disk(""), Err(DiskSpecError::NoPath("".into())));
        assert!(matches!(
            parse_disk(",cow=/tmp"),
            Err(DiskSpecError::NoPath(_))
        ));
        for bad in ["a,cow=/t,cow=/u", "a,cow=/t,keep,keep", "a,bytes=1,bytes=2"] {
            assert!(
                matches!(parse_disk(bad), Err(DiskSpecError::Options { .. })),
                "{bad}"
            );
        }
        for (bad, option) in [
            ("a,ro", "ro"),
            ("a,cow=", "cow="),
            ("a,size=1", "size=1"),
            ("a,keep=1", "keep=1"),
        ] {
            assert_eq!(
                parse_disk(bad),
                Err(DiskSpecError::Option {
                    spec: bad.into(),
                    option: option.into()
                })
            );
        }
        for bad in ["a,bytes=x", "a,ops=0"] {
            assert!(
                matches!(parse_disk(bad), Err(DiskSpecError::RateLimit { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn cgroup_classes_parse() {
        let (name, class) = parse_cgroup_class("small:cpu=0.5,memory=64M").unwrap();
        assert_eq!(name, "small");
        assert_eq!(class.cpu_quota, Some(0.5));
        assert_eq!(parse_cgroup_class("any").unwrap().1, Default::default());
        for bad in ["", ":cpu=1", "a/b:cpu=1", "x:cpu=0", "x:gpu=1"] {
            assert!(parse_cgroup_class(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn console_sink_parsing() {
        assert_eq!(parse_console("stdout"), Ok(ConsoleSink::Stdout));
        assert_eq!(parse_console("null"), Ok(ConsoleSink::Null));
        assert_eq!(
            parse_console("/tmp/c.log"),
            Ok(ConsoleSink::File("/tmp/c.log".into()))
        );
        assert!(parse_console("").is_err());
    }
}
