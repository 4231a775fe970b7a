//! The text syntax of option values, shared by every command line and request body that
//! takes one: comma-separated `key=value` items (and bare flags), and byte sizes with
//! an optional `K`, `M` or `G` suffix (powers of 1024).
//!
//! `bytes=10M,ops=1000/100` (a rate limit), `cpu=0.5,memory=64M,pids=64` (a resource
//! class) and `cow=/var/tmp,keep,bytes=1M` (a disk's options) all go through
//! [`items`], and every size through [`parse_size`].

/// Why an option list does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    /// The same key twice.
    #[error("{0:?} is given twice")]
    Repeated(String),
    /// A bare word where only `key=value` items are allowed.
    #[error("{0:?}: expected key=value")]
    NotKeyValue(String),
}

/// One item of an option list: `key=value`, or a bare flag (`value` None).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item<'a> {
    /// The key, or the flag.
    pub key: &'a str,
    /// The text after the first `=`.
    pub value: Option<&'a str>,
}

/// Splits `s` at commas into items, trimming blanks around each and skipping empty
/// ones; a key given twice is refused.
pub fn items(s: &str) -> Result<Vec<Item<'_>>, OptionError> {
    let mut out: Vec<Item<'_>> = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let item = match part.split_once('=') {
            Some((key, value)) => Item {
                key: key.trim(),
                value: Some(value.trim()),
            },
            None => Item {
                key: part,
                value: None,
            },
        };
        if out.iter().any(|i| i.key == item.key) {
            return Err(OptionError::Repeated(item.key.to_string()));
        }
        out.push(item);
    }
    Ok(out)
}

/// As [`items`], where every item must be `key=value`.
pub fn key_values(s: &str) -> Result<Vec<(&str, &str)>, OptionError> {
    items(s)?
        .into_iter()
        .map(|i| match i.value {
            Some(v) => Ok((i.key, v)),
            None => Err(OptionError::NotKeyValue(i.key.to_string())),
        })
        .collect()
}

/// A byte size: digits with an optional `K`, `M` or `G` (either case, powers of 1024).
/// None if it does not parse or does not fit 64 bits.
pub fn parse_size(s: &str) -> Option<u64> {
    let (digits, shift) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 10),
        b'M' | b'm' => (&s[..s.len() - 1], 20),
        b'G' | b'g' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// `bytes` written the shortest exact way [`parse_size`] reads back (`65536` -> `64K`).
pub fn format_size(bytes: u64) -> String {
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "K")] {
        if bytes != 0 && bytes % (1 << shift) == 0 {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes_and_print_back() {
        assert_eq!(parse_size("10"), Some(10));
        assert_eq!(parse_size("64K"), Some(64 << 10));
        assert_eq!(parse_size("3m"), Some(3 << 20));
        assert_eq!(parse_size("2G"), Some(2 << 30));
        for bad in [
            "",
            "K",
            "x",
            "1.5M",
            "-1",
            "1T",
            "+1",
            "99999999999999999999G",
        ] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
        for n in [0, 1, 1000, 1024, 3 << 20, (5 << 30) + 1024, u64::MAX] {
            assert_eq!(parse_size(&format_size(n)), Some(n), "{n}");
        }
        assert_eq!(format_size(1 << 20), "1M");
    }

    #[test]
    fn items_split_trim_and_refuse_repeats() {
        let got = items(" cow=/tmp , keep,, bytes=1M ").unwrap();
        assert_eq!(
            got,
            [
                Item {
                    key: "cow",
                    value: Some("/tmp")
                },
                Item {
                    key: "keep",
                    value: None
                },
                Item {
                    key: "bytes",
                    value: Some("1M")
                },
            ]
        );
        assert_eq!(items("a=1,a=2"), Err(OptionError::Repeated("a".into())));
        assert_eq!(
            items("keep,keep"),
            Err(OptionError::Repeated("keep".into()))
        );
        assert_eq!(items("").unwrap(), []);
        assert_eq!(key_values("a=1,b=").unwrap(), [("a", "1"), ("b", "")]);
        assert_eq!(
            key_values("a=1,b"),
            Err(OptionError::NotKeyValue("b".into()))
        );
    }
}
