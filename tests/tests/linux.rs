//! Boots the real Linux 6.1 guest (slow on a PVM host: about a minute, nearly all of it
//! kernel code in the host's instruction emulator). Each test is one boot that checks
//! several things, to keep CI time down.

use std::time::Duration;

use tests::{guest_file, kvm_available, Scratch, Vm};

/// Generous: a Linux boot takes about 55 s here, and two run side by side.
const LINUX_BOOT: Duration = Duration::from_secs(400);

fn path(name: &str) -> String {
    guest_file(name).display().to_string()
}

#[test]
fn linux_smp_pvh_boot_runs_userspace_command_and_reads_the_disk() {
    if !kvm_available("linux_smp_pvh_boot") {
        return;
    }
    let scratch = Scratch::new("linux-pvh");
    let cmd = r#"console=ttyS0 reboot=k panic=-1 forkvm.run="echo hello-from-$(echo userspace); echo nproc=$(nproc); cat /mnt/disk/etc/forkvm-disk""#;
    let mut vm = Vm::start(
        &scratch,
        &[
            "--kernel",
            &path("vmlinux"),
            // The uncompressed archive: unpacking runs in the host's instruction
            // emulator here, and gunzip would double that (docs/benchmarks.md).
            "--initrd",
            &path("initramfs.cpio"),
            "--rootfs",
            &path("rootfs.ext4"),
            "--mem-mib",
            "256",
            "--vcpus",
            "2",
            "--cmdline",
            cmd,
        ],
    );
    let status = vm.wait_exit(LINUX_BOOT);
    let console = vm.console_text();
    let log = vm.stderr_text();
    assert!(status.success(), "exit {status}\n{console}\n{log}");
    assert!(log.contains("via Pvh"), "{log}");
    // The shell expanded $(...): the line came from userspace, not the kernel echoing
    // its command line.
    assert!(console.contains("\nhello-from-userspace\n"), "{console}");
    assert!(console.contains("\nnproc=2\n"), "SMP: {console}");
    assert!(
        console.contains("\nforkvm rootfs disk\n"),
        "disk: {console}"
    );
    assert!(console.contains("forkvm-init: exit status 0"), "{console}");
}

#[test]
fn linux_bzimage_boot_protocol_with_root_on_virtio_blk() {
    if !kvm_available("linux_bzimage_boot") {
        return;
    }
    let scratch = Scratch::new("linux-bz");
    let mut vm = Vm::start(
        &scratch,
        &[
            "--kernel",
            &path("bzImage"),
            "--rootfs",
            &path("rootfs.ext4"),
            "--mem-mib",
            "128",
            "--cmdline",
            r#"console=ttyS0 reboot=k panic=-1 quiet root=/dev/vda ro rootfstype=ext4 forkvm.run="echo bz-$(uname -r); grep ' / ' /proc/mounts""#,
        ],
    );
    let status = vm.wait_exit(LINUX_BOOT);
    let console = vm.console_text();
    let log = vm.stderr_text();
    assert!(status.success(), "exit {status}\n{console}\n{log}");
    assert!(log.contains("via Linux64"), "{log}");
    assert!(console.contains("\nbz-6.1."), "{console}");
    assert!(console.contains("-forkvm\n"), "{console}");
    assert!(
        console.contains("/dev/root / ext4 ro"),
        "root not on the disk: {console}"
    );
}
