//! Intel MultiProcessor Specification 1.4 table, so a guest without ACPI finds its CPUs,
//! its IOAPIC and how ISA interrupts are routed.
//!
//! The table is built as bytes (no packed structs, no unsafe) and placed in the EBDA,
//! where guests scan for the `_MP_` floating pointer.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::layout::{APIC_START, EBDA_START, IOAPIC_START};

/// Most vCPUs the MP table (and forkvm) supports: APIC ids are 8 bits and the IOAPIC
/// takes the id after the last CPU.
pub const MAX_VCPUS: u8 = 254;
/// IOAPIC pins; ISA IRQ n is routed to pin n.
pub const IOAPIC_PINS: u8 = 24;
/// First GSI (IOAPIC pin) for virtio-mmio devices; 0-4 are the PIT, keyboard, cascade,
/// and the serial ports.
pub const VIRTIO_FIRST_GSI: u32 = 5;
/// Most virtio devices one VM can have: one IOAPIC pin each from `VIRTIO_FIRST_GSI` up.
pub const MAX_VIRTIO_DEVICES: usize = IOAPIC_PINS as usize - VIRTIO_FIRST_GSI as usize;

const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const SPEC_REV: u8 = 4;
const CPU_ENABLED: u8 = 1;
const CPU_BSP: u8 = 2;
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;
/// CPU signature (family 6) and feature flags (FPU, APIC) reported per processor.
const CPU_SIGNATURE: u32 = 0x600;
const CPU_FEATURES: u32 = 0x201;

/// Errors writing the MP table.
#[derive(Debug, thiserror::Error)]
pub enum MptableError {
    /// Zero or too many vCPUs.
    #[error("the MP table supports 1 to {MAX_VCPUS} vCPUs, not {0}")]
    VcpuCount(u8),
    /// The table did not fit in guest memory.
    #[error("cannot write the MP table to guest memory: {0}")]
    Write(vm_memory::GuestMemoryError),
}

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// Builds the floating pointer and configuration table for `num_cpus`, as placed at
/// `base`. Returned bytes start with the floating pointer.
pub fn build(num_cpus: u8, base: u64) -> Result<Vec<u8>, MptableError> {
    if num_cpus == 0 || num_cpus > MAX_VCPUS {
        return Err(MptableError::VcpuCount(num_cpus));
    }
    let ioapic_id = num_cpus + 1;
    let table_addr = base + 16;

    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for cpu in 0..num_cpus {
        let flags = CPU_ENABLED | if cpu == 0 { CPU_BSP } else { 0 };
        entries.extend_from_slice(&[0, cpu, APIC_VERSION, flags]);
        entries.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
        entries.extend_from_slice(&CPU_FEATURES.to_le_bytes());
        entries.extend_from_slice(&[0; 8]);
        count += 1;
    }
    // Bus 0: ISA.
    entries.extend_from_slice(&[1, 0]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    // The IOAPIC.
    entries.extend_from_slice(&[2, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    count += 1;
    // ISA IRQ n -> IOAPIC pin n (KVM's default GSI routing).
    for irq in 0..IOAPIC_PINS {
        entries.extend_from_slice(&[3, INT_TYPE_INT, 0, 0, 0, irq, ioapic_id, irq]);
        count += 1;
    }
    // LINT0: ExtINT (the PIC), LINT1: NMI, on every local APIC.
    entries.extend_from_slice(&[4, INT_TYPE_EXTINT, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, INT_TYPE_NMI, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let mut header = Vec::with_capacity(44);
    header.extend_from_slice(b"PCMP");
    header.extend_from_slice(&((44 + entries.len()) as u16).to_le_bytes());
    header.push(SPEC_REV);
    header.push(0); // checksum, below
    header.extend_from_slice(b"FORKVM  ");
    header.extend_from_slice(b"MICROVM     ");
    header.extend_from_slice(&0u32.to_le_bytes()); // OEM table
    header.extend_from_slice(&0u16.to_le_bytes());
    header.extend_from_slice(&count.to_le_bytes());
    header.extend_from_slice(&(APIC_START as u32).to_le_bytes());
    header.extend_from_slice(&[0, 0, 0, 0]); // extended table length, checksum, reserved
    let mut table = header;
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut fp = Vec::with_capacity(16);
    fp.extend_from_slice(b"_MP_");
    fp.extend_from_slice(&(table_addr as u32).to_le_bytes());
    fp.extend_from_slice(&[1, SPEC_REV, 0, 0, 0, 0, 0, 0]);
    fp[10] = checksum(&fp);

    fp.extend_from_slice(&table);
    Ok(fp)
}

/// Writes the MP table for `num_cpus` into the EBDA.
pub fn setup(mem: &GuestMemoryMmap, num_cpus: u8) -> Result<(), MptableError> {
    let bytes = build(num_cpus, EBDA_START)?;
    mem.write_slice(&bytes, GuestAddress(EBDA_START))
        .map_err(MptableError::Write)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    #[test]
    fn checksums_and_layout() {
        for n in [1u8, 2, 4, 32, MAX_VCPUS] {
            let b = build(n, EBDA_START).unwrap();
            assert_eq!(&b[..4], b"_MP_");
            assert_eq!(sum(&b[..16]), 0, "floating pointer checksum");
            let ptr = u32::from_le_bytes(b[4..8].try_into().unwrap()) as u64;
            assert_eq!(ptr, EBDA_START + 16);
            let t = &b[16..];
            assert_eq!(&t[..4], b"PCMP");
            let len = u16::from_le_bytes([t[4], t[5]]) as usize;
            assert_eq!(len, t.len());
            assert_eq!(sum(t), 0, "config table checksum");
            let count = u16::from_le_bytes([t[34], t[35]]);
            assert_eq!(count, n as u16 + 1 + 1 + IOAPIC_PINS as u16 + 2);
            // First processor is the enabled BSP with APIC id 0; the last has id n-1.
            assert_eq!(&t[44..48], &[0, 0, APIC_VERSION, CPU_ENABLED | CPU_BSP]);
            let last = 44 + (n as usize - 1) * 20;
            assert_eq!(t[last + 1], n - 1);
            if n > 1 {
                assert_eq!(t[last + 3], CPU_ENABLED, "only vCPU 0 is the BSP");
            }
            // Everything fits below 1 MiB (the EBDA region and the reserved area above it).
            assert!(EBDA_START + b.len() as u64 <= 0x10_0000);
        }
    }

    #[test]
    fn rejects_bad_counts() {
        assert!(matches!(build(0, 0), Err(MptableError::VcpuCount(0))));
        assert!(matches!(build(255, 0), Err(MptableError::VcpuCount(255))));
    }
}
