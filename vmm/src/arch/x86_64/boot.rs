//! Kernel and initrd loading (linux-loader) and the boot information each protocol
//! hands the guest: PVH `hvm_start_info` or the Linux zero page.

use std::fs::File;
use std::path::Path;

use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::elf::PvhBootCapability;
use linux_loader::loader::{BzImage, Elf, KernelLoader};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::layout::{
    e820_map, ram_ranges, CMDLINE_START, HIMEM_START, PVH_INFO_START, PVH_MEMMAP_START,
    PVH_MODLIST_START, ZERO_PAGE_START,
};
use super::regs::{BootProtocol, EntryPoint};

/// Errors loading the kernel and initrd and writing boot information.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The kernel file cannot be opened.
    #[error("cannot open kernel {path}: {source}")]
    OpenKernel {
        /// The path given.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The kernel is neither a loadable ELF nor a bzImage.
    #[error("{path} is not a loadable kernel (ELF: {elf}; bzImage: {bzimage})")]
    KernelFormat {
        /// The path given.
        path: String,
        /// Why the ELF loader refused it.
        elf: linux_loader::loader::Error,
        /// Why the bzImage loader refused it.
        bzimage: linux_loader::loader::Error,
    },
    /// The initrd file cannot be read.
    #[error("cannot read initrd {path}: {source}")]
    OpenInitrd {
        /// The path given.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The initrd does not fit between the kernel and the end of low memory.
    #[error("initrd of {size} bytes does not fit in guest memory above the kernel")]
    InitrdTooBig {
        /// Its size.
        size: u64,
    },
    /// Writing to guest memory failed.
    #[error("cannot write boot information to guest memory: {0}")]
    Memory(String),
    /// The kernel command line is too long.
    #[error("kernel command line is {len} bytes; at most {max} fit")]
    CmdlineTooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// A kernel in guest memory.
#[derive(Debug, Clone)]
pub struct LoadedKernel {
    /// How and where to enter it.
    pub entry: EntryPoint,
    /// First byte after the kernel image.
    pub end: u64,
    /// The bzImage setup header, when it was a bzImage.
    pub setup_header: Option<setup_header>,
}

/// Loads the kernel at `path`: an ELF with a PVH note is entered through PVH, any other
/// ELF or a bzImage through the Linux 64-bit boot protocol.
pub fn load_kernel(mem: &GuestMemoryMmap, path: &Path) -> Result<LoadedKernel, BootError> {
    let shown = path.display().to_string();
    let mut file = File::open(path).map_err(|source| BootError::OpenKernel {
        path: shown.clone(),
        source,
    })?;
    let elf_err = match Elf::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START))) {
        Ok(r) => {
            let entry = match r.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(addr) => EntryPoint {
                    addr: addr.0,
                    protocol: BootProtocol::Pvh,
                },
                _ => EntryPoint {
                    addr: r.kernel_load.0,
                    protocol: BootProtocol::Linux64,
                },
            };
            return Ok(LoadedKernel {
                entry,
                end: r.kernel_end,
                setup_header: None,
            });
        }
        Err(e) => e,
    };
    match BzImage::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START))) {
        Ok(r) => Ok(LoadedKernel {
            // The 64-bit entry point sits 0x200 bytes into the protected-mode kernel.
            entry: EntryPoint {
                addr: r.kernel_load.0 + 0x200,
                protocol: BootProtocol::Linux64,
            },
            end: r.kernel_end,
            setup_header: r.setup_header,
        }),
        Err(bzimage) => Err(BootError::KernelFormat {
            path: shown,
            elf: elf_err,
            bzimage,
        }),
    }
}

/// An initrd in guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadedInitrd {
    /// Guest physical address.
    pub addr: u64,
    /// Size in bytes.
    pub size: u64,
}

/// Highest address the initrd may end at (Linux's default initrd_addr_max + 1).
const INITRD_LIMIT: u64 = 0x8000_0000;

/// Where an initrd of `size` goes: page-aligned, as high as low memory allows, above
/// `kernel_end`.
pub fn initrd_placement(mem_bytes: u64, kernel_end: u64, size: u64) -> Result<u64, BootError> {
    let low_end = ram_ranges(mem_bytes)[0].1.min(INITRD_LIMIT);
    let addr = low_end
        .checked_sub(size)
        .map(|a| a & !0xfff)
        .filter(|a| *a >= kernel_end)
        .ok_or(BootError::InitrdTooBig { size })?;
    Ok(addr)
}

/// Loads the initrd at `path` high in low memory.
pub fn load_initrd(
    mem: &GuestMemoryMmap,
    mem_bytes: u64,
    kernel_end: u64,
    path: &Path,
) -> Result<LoadedInitrd, BootError> {
    let open_err = |source| BootError::OpenInitrd {
        path: path.display().to_string(),
        source,
    };
    let mut file = File::open(path).map_err(open_err)?;
    let size = file.metadata().map_err(open_err)?.len();
    let addr = initrd_placement(mem_bytes, kernel_end, size)?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut file, size as usize)
        .map_err(|e| BootError::Memory(e.to_string()))?;
    Ok(LoadedInitrd { addr, size })
}

/// Writes the command line (NUL-terminated) at CMDLINE_START.
pub fn write_cmdline(mem: &GuestMemoryMmap, cmdline: &str) -> Result<(), BootError> {
    let max = super::layout::CMDLINE_MAX_SIZE;
    if cmdline.len() + 1 > max {
        return Err(BootError::CmdlineTooLong {
            len: cmdline.len(),
            max: max - 1,
        });
    }
    let mut bytes = cmdline.as_bytes().to_vec();
    bytes.push(0);
    mem.write_slice(&bytes, GuestAddress(CMDLINE_START))
        .map_err(|e| BootError::Memory(e.to_string()))
}

/// Writes the boot information for `kernel`'s protocol.
pub fn write_boot_info(
    mem: &GuestMemoryMmap,
    mem_bytes: u64,
    kernel: &LoadedKernel,
    cmdline_len: usize,
    initrd: Option<LoadedInitrd>,
) -> Result<(), BootError> {
    match kernel.entry.protocol {
        BootProtocol::Pvh => write_pvh_info(mem, mem_bytes, initrd),
        BootProtocol::Linux64 => {
            write_zero_page(mem, mem_bytes, kernel.setup_header, cmdline_len, initrd)
        }
    }
}

/// PVH start_info magic.
const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;

fn write_pvh_info(
    mem: &GuestMemoryMmap,
    mem_bytes: u64,
    initrd: Option<LoadedInitrd>,
) -> Result<(), BootError> {
    let memmap: Vec<hvm_memmap_table_entry> = e820_map(mem_bytes)
        .into_iter()
        .map(|(addr, size, kind)| hvm_memmap_table_entry {
            addr,
            size,
            type_: kind as u32,
            reserved: 0,
        })
        .collect();
    let modules: Vec<hvm_modlist_entry> = initrd
        .iter()
        .map(|i| hvm_modlist_entry {
            paddr: i.addr,
            size: i.size,
            ..Default::default()
        })
        .collect();
    let start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        nr_modules: modules.len() as u32,
        cmdline_paddr: CMDLINE_START,
        memmap_paddr: PVH_MEMMAP_START,
        memmap_entries: memmap.len() as u32,
        modlist_paddr: if modules.is_empty() {
            0
        } else {
            PVH_MODLIST_START
        },
        ..Default::default()
    };
    let mut params = BootParams::new(&start_info, GuestAddress(PVH_INFO_START));
    params.set_sections(&memmap, GuestAddress(PVH_MEMMAP_START));
    if !modules.is_empty() {
        params.set_modules(&modules, GuestAddress(PVH_MODLIST_START));
    }
    PvhBootConfigurator::write_bootparams(&params, mem)
        .map_err(|e| BootError::Memory(e.to_string()))
}

const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448;
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x100_0000;

/// Builds the Linux zero page.
pub fn zero_page(
    mem_bytes: u64,
    header: Option<setup_header>,
    cmdline_len: usize,
    initrd: Option<LoadedInitrd>,
) -> boot_params {
    let mut params = boot_params::default();
    if let Some(h) = header {
        params.hdr = h;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_len as u32 + 1;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;
    if let Some(i) = initrd {
        params.hdr.ramdisk_image = i.addr as u32;
        params.hdr.ramdisk_size = i.size as u32;
    }
    let map = e820_map(mem_bytes);
    for (slot, (addr, size, kind)) in params.e820_table.iter_mut().zip(map.iter()) {
        *slot = boot_e820_entry {
            addr: *addr,
            size: *size,
            r#type: *kind as u32,
        };
    }
    params.e820_entries = map.len() as u8;
    params
}

fn write_zero_page(
    mem: &GuestMemoryMmap,
    mem_bytes: u64,
    header: Option<setup_header>,
    cmdline_len: usize,
    initrd: Option<LoadedInitrd>,
) -> Result<(), BootError> {
    let params = zero_page(mem_bytes, header, cmdline_len, initrd);
    LinuxBootConfigurator::write_bootparams(
        &BootParams::new(&params, GuestAddress(ZERO_PAGE_START)),
        mem,
    )
    .map_err(|e| BootError::Memory(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::E820Kind;

    #[test]
    fn zero_page_fields() {
        let p = zero_page(
            512 << 20,
            None,
            10,
            Some(LoadedInitrd {
                addr: 0x1f00_0000,
                size: 0x1000,
            }),
        );
        assert_eq!({ p.hdr.boot_flag }, KERNEL_BOOT_FLAG_MAGIC);
        assert_eq!({ p.hdr.header }, KERNEL_HDR_MAGIC);
        assert_eq!({ p.hdr.cmd_line_ptr }, CMDLINE_START as u32);
        assert_eq!({ p.hdr.cmdline_size }, 11);
        assert_eq!({ p.hdr.ramdisk_image }, 0x1f00_0000);
        assert_eq!(p.e820_entries, 3);
        assert_eq!({ p.e820_table[2].addr }, HIMEM_START);
        assert_eq!({ p.e820_table[2].size }, (512 << 20) - HIMEM_START);
        assert_eq!({ p.e820_table[1].r#type }, E820Kind::Reserved as u32);
    }

    #[test]
    fn initrd_goes_high_and_aligned() {
        let a = initrd_placement(256 << 20, 0x200_0000, 5000).unwrap();
        assert_eq!(a, ((256 << 20) - 5000) & !0xfff);
        assert!(a + 5000 <= 256 << 20);
        // Large guests keep it below 2 GiB.
        let a = initrd_placement(8 << 30, 0x200_0000, 4096).unwrap();
        assert_eq!(a, INITRD_LIMIT - 4096);
        // Too big to fit above the kernel.
        assert!(matches!(
            initrd_placement(32 << 20, 0x100_0000, 24 << 20),
            Err(BootError::InitrdTooBig { .. })
        ));
    }

    #[test]
    fn pvh_info_written() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap();
        let initrd = LoadedInitrd {
            addr: 0x300_0000,
            size: 77,
        };
        write_pvh_info(&mem, 64 << 20, Some(initrd)).unwrap();
        let info: hvm_start_info = mem.read_obj(GuestAddress(PVH_INFO_START)).unwrap();
        assert_eq!(info.magic, XEN_HVM_START_MAGIC);
        assert_eq!(info.nr_modules, 1);
        assert_eq!(info.memmap_entries, 3);
        let m: hvm_modlist_entry = mem.read_obj(GuestAddress(PVH_MODLIST_START)).unwrap();
        assert_eq!((m.paddr, m.size), (0x300_0000, 77));
        let e: hvm_memmap_table_entry = mem
            .read_obj(GuestAddress(PVH_MEMMAP_START + 2 * 24))
            .unwrap();
        assert_eq!((e.addr, e.type_), (HIMEM_START, 1));
    }

    #[test]
    fn cmdline_limit() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write_cmdline(&mem, "console=ttyS0").unwrap();
        let long = "x".repeat(2048);
        assert!(matches!(
            write_cmdline(&mem, &long),
            Err(BootError::CmdlineTooLong {
                len: 2048,
                max: 2047
            })
        ));
    }
}
