//! The text syntax command lines and request bodies share (rate limits, sizes, MAC and
//! IPv4 addresses, resource classes, `key=value` lists): never a panic, and what parses
//! prints back to text that parses to the same value.
#![no_main]

use api_types::net::{Ipv4Cidr, MacAddr};
use api_types::options::{format_size, key_values, parse_size};
use api_types::rate_limit::RateLimit;
use api_types::ResourceClass;
use libfuzzer_sys::fuzz_target;

fn round_trips<T>(text: &str)
where
    T: std::str::FromStr + std::fmt::Display + PartialEq + std::fmt::Debug,
{
    if let Ok(value) = text.parse::<T>() {
        let again = value.to_string().parse::<T>().ok();
        assert_eq!(again.as_ref(), Some(&value), "{text:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    round_trips::<RateLimit>(text);
    round_trips::<MacAddr>(text);
    round_trips::<Ipv4Cidr>(text);
    if let Some(size) = parse_size(text) {
        assert_eq!(parse_size(&format_size(size)), Some(size), "{text:?}");
    }
    let _ = key_values(text);
    let _ = text.parse::<ResourceClass>();
    let _ = vmm::config::parse_cgroup_class(text);
});
