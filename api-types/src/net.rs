//! Network values: MAC addresses, IPv4 addresses with a prefix, interface names.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An Ethernet MAC address, written `06:00:ac:10:00:02`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

/// The default MAC: locally administered, unicast.
pub const DEFAULT_MAC: MacAddr = MacAddr([0x06, 0x00, 0xac, 0x10, 0x00, 0x02]);

/// A MAC address that does not parse.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum MacError {
    /// Not six hexadecimal bytes separated by colons.
    #[error("invalid MAC address {0:?}: expected six hex bytes like 06:00:ac:10:00:02")]
    Syntax(String),
    /// A multicast address cannot be a card's.
    #[error("invalid MAC address {0:?}: multicast (lowest bit of the first byte set)")]
    Multicast(String),
}

impl std::str::FromStr for MacAddr {
    type Err = MacError;
    fn from_str(s: &str) -> Result<Self, MacError> {
        let syntax = || MacError::Syntax(s.to_string());
        let bytes: Vec<u8> = s
            .split(':')
            .map(|b| {
                (b.len() == 2)
                    .then(|| u8::from_str_radix(b, 16).ok())
                    .flatten()
            })
            .collect::<Option<_>>()
            .ok_or_else(syntax)?;
        let mac: [u8; 6] = bytes.try_into().map_err(|_| syntax())?;
        if mac[0] & 1 == 1 {
            return Err(MacError::Multicast(s.to_string()));
        }
        Ok(Self(mac))
    }
}

impl std::fmt::Display for MacAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

/// An IPv4 address with a prefix length, written `10.0.0.5/24`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Cidr {
    /// The address.
    pub addr: std::net::Ipv4Addr,
    /// The prefix length, 1 to 32.
    pub prefix: u8,
}

/// An IPv4 address with prefix that does not parse.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("invalid address {0:?}: expected an IPv4 address and a prefix length of 1 to 32, like 10.0.0.5/24")]
pub struct CidrError(pub String);

impl std::str::FromStr for Ipv4Cidr {
    type Err = CidrError;
    fn from_str(s: &str) -> Result<Self, CidrError> {
        let bad = || CidrError(s.to_string());
        let (addr, prefix) = s.split_once('/').ok_or_else(bad)?;
        let addr = addr.parse().map_err(|_| bad())?;
        let prefix = prefix.parse().ok().filter(|p| (1..=32).contains(p));
        Ok(Self {
            addr,
            prefix: prefix.ok_or_else(bad)?,
        })
    }
}

impl std::fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Serde through the type's text form (`Display` and `FromStr`).
macro_rules! serde_as_text {
    ($t:ty) => {
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

serde_as_text!(MacAddr);
serde_as_text!(Ipv4Cidr);

/// A JSON schema for a type written as a string matching `pattern`.
macro_rules! schema_as_text {
    ($t:ty, $name:literal, $pattern:literal, $description:literal) => {
        impl schemars::JsonSchema for $t {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                $name.into()
            }

            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                schemars::json_schema!({
                    "type": "string",
                    "pattern": $pattern,
                    "description": $description,
                })
            }
        }
    };
}

schema_as_text!(
    MacAddr,
    "MacAddr",
    "^[0-9a-fA-F][02468aceACE](:[0-9a-fA-F]{2}){5}$",
    "An Ethernet MAC address, `06:00:ac:10:00:02` (unicast)."
);
schema_as_text!(
    Ipv4Cidr,
    "Ipv4Cidr",
    "^((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])/([1-9]|[12][0-9]|3[0-2])$",
    "An IPv4 address and prefix length (1 to 32), `10.0.0.5/24`."
);

/// Longest interface name Linux takes, plus its terminating NUL (`IFNAMSIZ`).
pub const IFNAMSIZ: usize = 16;

/// Whether `name` can name a network interface.
pub fn valid_ifname(name: &str) -> bool {
    !name.is_empty()
        && name.len() < IFNAMSIZ
        && name != "."
        && name != ".."
        && !name
            .chars()
            .any(|c| c == '/' || c == ':' || c.is_whitespace() || c == '\0')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_addresses_parse_print_and_refuse_multicast() {
        let mac: MacAddr = "06:00:AC:10:00:02".parse().unwrap();
        assert_eq!(mac, DEFAULT_MAC);
        assert_eq!(mac.to_string(), "06:00:ac:10:00:02");
        for bad in [
            "",
            "06:00:ac:10:00",
            "06:00:ac:10:00:02:03",
            "6:00:ac:10:00:02",
            "zz:00:ac:10:00:02",
        ] {
            assert!(
                matches!(bad.parse::<MacAddr>(), Err(MacError::Syntax(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            "01:00:5e:00:00:01".parse::<MacAddr>(),
            Err(MacError::Multicast(_))
        ));
        let json = serde_json::to_string(&mac).unwrap();
        assert_eq!(json, r#""06:00:ac:10:00:02""#);
        assert_eq!(serde_json::from_str::<MacAddr>(&json).unwrap(), mac);
    }

    #[test]
    fn ipv4_prefixes_parse_and_print() {
        let c: Ipv4Cidr = "10.1.2.3/8".parse().unwrap();
        assert_eq!((c.addr.octets(), c.prefix), ([10, 1, 2, 3], 8));
        assert_eq!(c.to_string(), "10.1.2.3/8");
        for bad in [
            "10.1.2.3",
            "10.1.2.3/0",
            "10.1.2.3/33",
            "10.1.2/8",
            "x/8",
            "/8",
        ] {
            assert_eq!(bad.parse::<Ipv4Cidr>(), Err(CidrError(bad.into())), "{bad}");
        }
    }

    #[test]
    fn interface_names() {
        assert!(valid_ifname("fkvm4194303"));
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "a:b",
            "a b",
            "a-name-far-too-long-for-linux",
        ] {
            assert!(!valid_ifname(bad), "{bad}");
        }
    }
}
