//! Global descriptor table entries and the KVM segments that match them.

use kvm_bindings::kvm_segment;

/// Encodes a GDT entry from its flags (access byte in bits 0-7, flags nibble in 12-15),
/// base and limit, the layout the CPU expects.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
        | ((limit as u64 & 0x000f_0000) << 32)
        | ((flags as u64 & 0xf0ff) << 40)
}

fn base(entry: u64) -> u64 {
    ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000)
}

fn limit(entry: u64) -> u32 {
    let limit = ((entry & 0xffff) | ((entry >> 32) & 0xf_0000)) as u32;
    // With granularity set the limit counts 4 KiB pages.
    if (entry >> 55) & 1 == 1 {
        (limit << 12) | 0xfff
    } else {
        limit
    }
}

/// The KVM segment register for GDT entry `index` holding `entry`.
pub fn kvm_segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    kvm_segment {
        base: base(entry),
        limit: limit(entry),
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 0x3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: ((entry >> 55) & 1) as u8,
        avl: ((entry >> 52) & 1) as u8,
        unusable: u8::from((entry >> 47) & 1 == 0),
        padding: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_64bit_code_segment() {
        let e = gdt_entry(0xa09b, 0, 0xfffff);
        assert_eq!(e, 0x00af_9b00_0000_ffff);
        let s = kvm_segment_from_gdt(e, 2);
        assert_eq!(s.selector, 0x10);
        assert_eq!(
            (s.l, s.db, s.g, s.present, s.type_, s.s),
            (1, 0, 1, 1, 0xb, 1)
        );
        assert_eq!(s.limit, 0xffff_ffff);
        assert_eq!(s.base, 0);
    }

    #[test]
    fn base_and_limit_round_trip() {
        let e = gdt_entry(0x0093, 0x1234_5678, 0xabcde);
        let s = kvm_segment_from_gdt(e, 3);
        assert_eq!(s.base, 0x1234_5678);
        assert_eq!(s.limit, 0xabcde);
        assert_eq!(s.g, 0);
        let null = kvm_segment_from_gdt(0, 0);
        assert_eq!(null.unusable, 1);
    }
}
