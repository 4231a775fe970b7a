//! From a [`VmConfig`] to the parts of a running VM ([`VmParts`], made into a
//! [`crate::microvm::Microvm`] by its one constructor), as an explicit, ordered list of
//! stages.
//!
//! 1. open KVM, check capabilities, recognise the host
//! 2. validate the configuration against the host
//! 3. decide host quirks (CPUID features to hide, kernel switches to add)
//! 4. map guest memory
//! 5. create the VM: memory slots first, then TSS, irqchip, PIT
//! 6. create devices and wire their interrupts
//! 7. load kernel and initrd, write command line, boot information and MP table
//! 8. create and configure vCPUs
//! 9. start vCPU threads
//!
//! A VM that comes from captured state instead (a clone, a restored snapshot) is
//! rebuilt by [`rebuild`].

pub mod rebuild;

use std::sync::Arc;

use clone::vcpu::CaptureSpec;
use std::time::Instant;

use kvm_ioctls::VmFd;
use vm_memory::GuestMemoryMmap;

use crate::arch::x86_64::boot::{
    load_initrd, load_kernel, write_boot_info, write_cmdline, BootError, LoadedInitrd,
};
use crate::arch::x86_64::cpuid::{
    linux_hide_switches, vcpu_cpuid, FeatureBit, PVM_HIDDEN_FEATURES,
};
use crate::arch::x86_64::mptable::{self, MptableError};
use crate::arch::x86_64::regs::BootProtocol;
use crate::config::{ApBoot, ConfigError, MachineConfig, VmConfig};
use crate::device_manager::{DeviceError, DeviceManager};
use crate::logging::StageTimer;
use crate::microvm::VmParts;
use crate::vstate::kvm::{HostKind, KvmContext, KvmError};
use crate::vstate::memory::{create_guest_memory, MemoryError};
use crate::vstate::vcpu::{start_vcpus, StartMode, Vcpu, VcpuError};
use crate::vstate::vm::{create_vm, VmError};
use api_types::vm::HostReport;
use devices::mailbox::MailboxWindow;

/// Errors building a microVM, one per stage.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Stage 1.
    #[error(transparent)]
    Kvm(#[from] KvmError),
    /// Stage 2.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// Stage 4.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// Stage 5.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// Stage 6.
    #[error(transparent)]
    Devices(#[from] DeviceError),
    /// Stage 7.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// Stage 7.
    #[error(transparent)]
    Mptable(#[from] MptableError),
    /// Stages 8 and 9.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
}

/// Kernel switches every guest gets on a PVM host beyond the CPUID ones: mitigations use
/// instructions the emulator refuses; `noint3selftest` and `nofwait` come from forkvm's
/// guest kernel patches and skip the boot-time INT3 self test and the FWAIT at task
/// exit, both of which stop the VM there (docs/guest-kernel.md). Kernels without the
/// patches ignore them.
const PVM_LINUX_SWITCHES: &str = "mitigations=off noint3selftest nofwait";

/// The host quirks to apply: CPUID features to hide and kernel switches to add.
pub fn host_quirks(host: HostKind, enabled: bool) -> (&'static [FeatureBit], String) {
    match (host, enabled) {
        (HostKind::Pvm, true) => (
            PVM_HIDDEN_FEATURES,
            format!(
                "{} {PVM_LINUX_SWITCHES}",
                linux_hide_switches(PVM_HIDDEN_FEATURES)
            ),
        ),
        _ => (&[], String::new()),
    }
}

/// What stages 6 to 8 produce.
struct PreparedGuest {
    devices: DeviceManager,
    cmdline: String,
    vcpus: Vec<Vcpu>,
    skipped_msrs: Vec<u32>,
}

/// Builds and starts the VM described by `config`.
pub fn build_microvm(config: VmConfig) -> Result<VmParts, BuildError> {
    let window = mailbox(&config.machine);
    let started = Instant::now();
    let mut timer = StageTimer::new();

    // 1. KVM.
    let kvm = KvmContext::open()?;
    timer.done("kvm");
    // 2. Configuration.
    config.validate(kvm.max_vcpus)?;
    timer.done("config");
    // 3. Host quirks.
    let (hidden, quirk_switches) = host_quirks(kvm.host, config.machine.host_quirks);
    if kvm.host == HostKind::Pvm {
        if config.machine.host_quirks {
            tracing::info!(
                "host KVM is PVM: hiding CPUID features [{}] and adding kernel switches \"{}\" (disable with --no-host-quirks)",
                hidden.iter().map(|h| h.name).collect::<Vec<_>>().join(","),
                quirk_switches
            );
        } else {
            tracing::warn!(
                "host KVM is PVM and host quirks are disabled: stock Linux guests will likely stop"
            );
        }
    }

    // 4. Memory.
    let (mem, mem_info) = create_guest_memory(
        config.machine.mem_mib << 20,
        config.host.thp,
        config.host.prefault,
        window,
    )?;
    timer.done("memory");

    // 5. VM with its memory slots.
    let vm = create_vm(&kvm, &mem)?;
    timer.done("vm");

    // 6-8. Devices, boot image, vCPUs.
    let prepared = prepare_guest(&config, window, &kvm, &vm, &mem, hidden, &quirk_switches)?;
    timer.done("devices, boot image, vcpus");
    let PreparedGuest {
        devices,
        cmdline,
        vcpus,
        skipped_msrs,
    } = prepared;

    let capture_spec = capture_spec(&kvm, &vm)?;

    // 9. Start.
    let started_vcpus = start_vcpus(vcpus, &devices.pio, &devices.mmio, None, &devices.crng)?;
    timer.done("start");
    tracing::info!(
        "VM started in {} us: {} vCPUs, {} MiB",
        started.elapsed().as_micros(),
        config.machine.vcpus,
        config.machine.mem_mib
    );
    tracing::debug!("build stages: {}", timer.report());

    let kvm_run_size = kvm.kvm.get_vcpu_mmap_size().map_err(KvmError::MmapSize)?;
    let host = HostReport {
        kvm: kvm.host,
        quirks_applied: !hidden.is_empty(),
        hidden_cpuid: hidden.iter().map(|h| h.name.to_string()).collect(),
        kernel_switches: quirk_switches,
        skipped_msrs,
        memory: mem_info,
    };
    Ok(VmParts {
        config,
        mailbox: window,
        vm,
        mem,
        kvm,
        devices,
        vcpus: started_vcpus,
        host,
        cmdline,
        capture_spec: Arc::new(capture_spec),
        kvm_run_size,
    })
}

/// Where the invocation mailbox of a VM with `machine` lies in guest memory, and how
/// large it is: decided here, for every way a VM comes to be (a boot, a snapshot's
/// restore, a clone's rebuild on its template's memory); the VM keeps it
/// ([`crate::microvm::Microvm::mailbox`]).
pub fn mailbox(machine: &MachineConfig) -> MailboxWindow {
    MailboxWindow::of_size(machine.mailbox_mib << 20)
}

/// What capturing this VM's vCPUs needs to know about the host.
pub(crate) fn capture_spec(kvm: &KvmContext, vm: &VmFd) -> Result<CaptureSpec, BuildError> {
    let msr_indices = kvm
        .kvm
        .get_msr_index_list()
        .map_err(KvmError::MsrList)?
        .as_slice()
        .to_vec();
    let xsave_size = match vm.check_extension_int(kvm_ioctls::Cap::Xsave2) {
        n if n > 0 => Some(n as usize),
        _ if vm.check_extension(kvm_ioctls::Cap::Xsave) => Some(4096),
        _ => None,
    };
    Ok(CaptureSpec {
        msr_indices,
        xsave_size,
        xcrs: vm.check_extension(kvm_ioctls::Cap::Xcrs),
    })
}

/// Stages 6 to 8: devices, the boot image in guest memory, configured vCPUs.
fn prepare_guest(
    config: &VmConfig,
    window: MailboxWindow,
    kvm: &KvmContext,
    vm: &VmFd,
    mem: &GuestMemoryMmap,
    hidden: &[FeatureBit],
    quirk_switches: &str,
) -> Result<PreparedGuest, BuildError> {
    let mem_bytes = config.machine.mem_mib << 20;

    // 6. Devices.
    let mut devices = DeviceManager::new(vm, config, mem, 0, None)?;
    devices.add_virtio_devices(vm, mem, config, None)?;

    // 7. Kernel, initrd, command line, boot information, MP table.
    let kernel = load_kernel(mem, &config.machine.kernel)?;
    let initrd: Option<LoadedInitrd> = config
        .machine
        .initrd
        .as_deref()
        .map(|p| load_initrd(mem, mem_bytes, kernel.end, p))
        .transpose()?;
    let mut cmdline = config.machine.cmdline.trim().to_string();
    for extra in devices
        .cmdline_extra
        .iter()
        .map(String::as_str)
        .chain(std::iter::once(quirk_switches))
    {
        if !extra.is_empty() {
            cmdline.push(' ');
            cmdline.push_str(extra);
        }
    }
    write_cmdline(mem, &cmdline)?;
    write_boot_info(mem, mem_bytes, &kernel, cmdline.len(), initrd)?;
    mptable::setup(mem, config.machine.vcpus)?;
    tracing::info!(
        "kernel {} entry {:#x} via {:?}; cmdline \"{}\"",
        config.machine.kernel.display(),
        kernel.entry.addr,
        kernel.entry.protocol,
        cmdline
    );

    // 8. vCPUs.
    let base_cpuid = kvm
        .kvm
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(KvmError::Cpuid)?;
    let mut vcpus = Vec::with_capacity(config.machine.vcpus as usize);
    let mut skipped_msrs = Vec::new();
    for id in 0..config.machine.vcpus {
        let cpuid = vcpu_cpuid(&base_cpuid, id, config.machine.vcpus, hidden);
        let start = if id == 0 || config.machine.ap_boot == ApBoot::Direct {
            StartMode::Entry(kernel.entry)
        } else {
            StartMode::WaitForSipi
        };
        let (vcpu, skipped) = Vcpu::create(vm, mem, id, &cpuid, start, window)?;
        if id == 0 && !skipped.is_empty() {
            tracing::info!("host refused MSRs {skipped:#x?}; skipped them");
            skipped_msrs = skipped;
        }
        vcpus.push(vcpu);
    }
    if config.machine.ap_boot == ApBoot::Direct && kernel.entry.protocol == BootProtocol::Linux64 {
        tracing::warn!("--ap-boot direct with a Linux boot-protocol kernel: every vCPU enters the kernel as the boot CPU");
    }
    Ok(PreparedGuest {
        devices,
        cmdline,
        vcpus,
        skipped_msrs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quirks_only_on_pvm_and_only_when_enabled() {
        let (h, s) = host_quirks(HostKind::Pvm, true);
        assert_eq!(h.len(), PVM_HIDDEN_FEATURES.len());
        assert!(s.contains("noxsave") && s.ends_with("mitigations=off noint3selftest nofwait"));
        assert_eq!(host_quirks(HostKind::Pvm, false), (&[][..], String::new()));
        assert_eq!(
            host_quirks(HostKind::Hardware, true),
            (&[][..], String::new())
        );
    }
}
