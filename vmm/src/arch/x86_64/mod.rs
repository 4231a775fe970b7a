//! x86_64 guest setup: memory layout, boot protocols, CPUID, MSRs, registers, MP table.

pub mod boot;
pub mod cpu_compat;
pub mod cpuid;
pub mod gdt;
pub mod layout;
pub mod mptable;
pub mod msr;
pub mod paging;
pub mod regs;
