//! A template's working set: the guest pages its invocation clones write, learned from
//! the clones themselves and written ahead in each warm clone before its request comes.
//!
//! A clone shares its template's memory copy on write, so the first write to each page
//! in a clone copies it, and the clone's new KVM VM maps it afresh (a shadow-paging fault
//! on a PVM host, an EPT fault on hardware). Measured on this project's Intel PVM host
//! (`benches/cow.py`, docs/benchmarks/clones.md): a first write to a shared page costs
//! about 45 us in the clone, one to a page the clone already owns about 5 us, the VM's
//! mapping alone. Every clone of a template starts from the same state, so its requests
//! write nearly the same guest pages, clone after clone. So:
//!
//! - **Learning**: an invocation clone told to ([`WorkingSet::record_next`]: the first
//!   [`LEARN`] of a template, then one in [`RELEARN_EVERY`]) reads, after it answered,
//!   which of its guest pages it alone maps (`/proc/self/pagemap`'s exclusive bit: the
//!   pages it copied on write or took new) and sends those it did not write ahead to
//!   its template in one datagram (`Duty::report`).
//! - **The set**: the template merges each report into its set, at most `--working-set-mib`
//!   of pages (those seen first are kept).
//! - **Writing ahead**: each warm clone forked after that faults the set's pages in
//!   writable (`MADV_POPULATE_WRITE`, which copies them and changes no byte) before its
//!   prime, off the request's path. Its request then writes them at the cost of the
//!   VM's mapping alone. The warm clones a template has when its first report comes
//!   copied nothing ahead: they are replaced one at a time (`WarmPool::mark_stale`).
//! - **On demand too**: an invocation's clone forked on its request (no warm clone
//!   ready) writes the set ahead before its vCPUs run. That is on the request's path,
//!   but copying a page there costs about a tenth of the guest's first write to it
//!   (docs/invoke.md has the side-by-side figures).
//!
//! The price is memory: each warm clone owns a copy of the set's pages (charged to its
//! cgroup, whose memory limit is raised by as much: `ClonePools::allow_ahead`) while it
//! waits, where it would have copied those its request writes anyway, and about 2 us of
//! host CPU a page to copy them. Clones made by `POST /clones` write nothing ahead: the
//! set is what invocations write.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixDatagram;
use std::sync::Arc;

use vm_memory::{
    Address, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    MemoryRegionAddress,
};

/// Guest page size.
pub(crate) const PAGE: u64 = 4096;

/// Invocation clones of a template that record their working set, from its first.
pub const LEARN: u64 = 3;

/// After those, one invocation clone in this many records what it wrote beyond the set.
pub const RELEARN_EVERY: u64 = 64;

/// The most ranges one report carries (8 bytes each: under a Unix datagram's default
/// limit); a report with more keeps the lowest.
const MAX_REPORT_RANGES: usize = 16 * 1024;

/// Guest pages as ranges of page frame numbers (first, count): sorted, disjoint, and
/// none adjacent to the next.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageSet {
    ranges: Vec<(u64, u64)>,
}

impl PageSet {
    /// The set of `frames`, given in increasing order.
    pub fn from_frames(frames: impl IntoIterator<Item = u64>) -> Self {
        let mut set = Self::default();
        for f in frames {
            set.push(f, 1);
        }
        set
    }

    /// Appends `count` frames from `first`, which must not come before the last range.
    fn push(&mut self, first: u64, count: u64) {
        match self.ranges.last_mut() {
            Some((start, n)) if *start + *n >= first => {
                *n = (*n).max(first + count - *start);
            }
            _ => self.ranges.push((first, count)),
        }
    }

    /// The ranges, (first frame, count).
    pub fn ranges(&self) -> &[(u64, u64)] {
        &self.ranges
    }

    /// How many pages.
    pub fn pages(&self) -> u64 {
        self.ranges.iter().map(|(_, n)| n).sum()
    }

    /// Whether it has no page.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Whether it holds frame `f`.
    pub fn contains(&self, f: u64) -> bool {
        let i = self.ranges.partition_point(|(start, _)| *start <= f);
        i > 0 && {
            let (start, n) = self.ranges[i - 1];
            f < start + n
        }
    }

    /// This set with `other`'s pages added, lowest first, until it holds `cap` pages
    /// (its own are all kept).
    pub fn merged(&self, other: &PageSet, cap: u64) -> PageSet {
        let mut room = cap.saturating_sub(self.pages());
        let mut added = Vec::new();
        'ranges: for &(start, n) in &other.ranges {
            for f in start..start + n {
                if room == 0 {
                    break 'ranges;
                }
                if !self.contains(f) {
                    added.push(f);
                    room -= 1;
                }
            }
        }
        if added.is_empty() {
            return self.clone();
        }
        let mut all: Vec<(u64, u64)> = self.ranges.clone();
        all.extend(PageSet::from_frames(added).ranges);
        all.sort_unstable();
        let mut set = PageSet::default();
        for (start, n) in all {
            set.push(start, n);
        }
        set
    }

    /// The set on the wire: each range as two little-endian u64s.
    pub fn encode(&self) -> Vec<u8> {
        let ranges = &self.ranges[..self.ranges.len().min(MAX_REPORT_RANGES)];
        ranges
            .iter()
            .flat_map(|(s, n)| s.to_le_bytes().into_iter().chain(n.to_le_bytes()))
            .collect()
    }

    /// A set from [`PageSet::encode`]'s bytes; None if they are not one (ranges out of
    /// order, overlapping, empty, or a partial one).
    pub fn decode(bytes: &[u8]) -> Option<PageSet> {
        if bytes.len() % 16 != 0 {
            return None;
        }
        let mut set = PageSet::default();
        for c in bytes.chunks_exact(16) {
            let start = u64::from_le_bytes(c[..8].try_into().ok()?);
            let n = u64::from_le_bytes(c[8..].try_into().ok()?);
            let after_last = set.ranges.last().map_or(0, |(s, n)| s + n);
            if n == 0 || start < after_last || start.checked_add(n).is_none() {
                return None;
            }
            set.push(start, n);
        }
        Some(set)
    }
}

/// A page's entry in `/proc/self/pagemap`: present (bit 63) and mapped by this process
/// alone (bit 56, "exclusively mapped").
fn exclusive(entry: u64) -> bool {
    entry & (1 << 63) != 0 && entry & (1 << 56) != 0
}

/// The guest pages this process alone maps (written since its fork, copied or new),
/// less those in `known`.
pub fn exclusive_pages(mem: &GuestMemoryMmap, known: &PageSet) -> std::io::Result<PageSet> {
    let pagemap = std::fs::File::open("/proc/self/pagemap")?;
    let mut set = PageSet::default();
    let mut buf = vec![0u8; 8 * 8192];
    for region in mem.iter() {
        let host = region
            .get_host_address(MemoryRegionAddress(0))
            .map_err(std::io::Error::other)? as u64;
        let first = region.start_addr().raw_value() / PAGE;
        let pages = region.len() / PAGE;
        let mut done = 0;
        while done < pages {
            let n = (pages - done).min(buf.len() as u64 / 8);
            let bytes = &mut buf[..n as usize * 8];
            pagemap.read_exact_at(bytes, (host / PAGE + done) * 8)?;
            for (i, e) in bytes.chunks_exact(8).enumerate() {
                let f = first + done + i as u64;
                let e = u64::from_le_bytes(e.try_into().expect("8 bytes"));
                if exclusive(e) && !known.contains(f) {
                    set.push(f, 1);
                }
            }
            done += n;
        }
    }
    Ok(set)
}

/// Faults `set`'s pages in writable in this process (`MADV_POPULATE_WRITE`: copied if
/// shared, no byte changed). Pages outside guest memory are skipped. Returns the pages
/// written ahead.
///
/// On one thread, while no other thread of the process runs: each copy on write
/// flushes the TLB of every CPU where a thread of this process is running. Measured
/// (2026-12-05, AMD PVM host, a forked child writing 64 MiB its parent had written):
/// 33-35 ms alone or beside a sleeping thread, 108-112 ms beside a thread spinning on
/// the other CPU, and 66-70 ms cut between two threads.
pub fn populate(mem: &GuestMemoryMmap, set: &PageSet) -> std::io::Result<u64> {
    let mut done = 0;
    for &(start, n) in set.ranges() {
        let (mut gpa, end) = (start * PAGE, (start + n) * PAGE);
        while gpa < end {
            let Some(region) = mem.find_region(GuestAddress(gpa)) else {
                break;
            };
            let offset = gpa - region.start_addr().raw_value();
            let len = (end - gpa).min(region.len() - offset);
            let host = region
                .get_host_address(MemoryRegionAddress(offset))
                .map_err(std::io::Error::other)?;
            // SAFETY: `host` and `len` lie inside a mapping `mem` owns, alive here;
            // MADV_POPULATE_WRITE only faults its pages in, changing none of their bytes.
            let rc = unsafe { libc::madvise(host.cast(), len as usize, libc::MADV_POPULATE_WRITE) };
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
            done += len / PAGE;
            gpa += len;
        }
    }
    Ok(done)
}

/// What a child of a template takes from its working set: the set (written ahead by a
/// warm clone) and the template's end for reports.
#[derive(Debug, Clone)]
pub(crate) struct ForChild {
    /// The set as of the fork.
    pub set: Arc<PageSet>,
    /// The clones' end of the report channel (inherited).
    pub report: RawFd,
}

/// A clone's duty to report what it wrote beyond `known`, the pages it had written
/// ahead (none in a clone that was not).
#[derive(Debug)]
pub(crate) struct Duty {
    report: RawFd,
    known: Arc<PageSet>,
}

impl Duty {
    /// The duty of a clone made from `child`, which wrote `known` ahead.
    pub fn new(child: &ForChild, known: Arc<PageSet>) -> Self {
        Self {
            report: child.report,
            known,
        }
    }

    /// Reads this clone's working set and sends it to the template (a hint: a failure
    /// is logged, nothing more).
    pub fn report(self, mem: &GuestMemoryMmap) {
        let t0 = std::time::Instant::now();
        let sent = exclusive_pages(mem, &self.known).and_then(|set| {
            let bytes = set.encode();
            nix::sys::socket::send(
                self.report,
                &bytes,
                nix::sys::socket::MsgFlags::MSG_DONTWAIT,
            )
            .map_err(std::io::Error::from)?;
            Ok(set.pages())
        });
        match sent {
            Ok(pages) => tracing::debug!(
                "working set: {pages} pages beyond the {} written ahead, reported in {} us",
                self.known.pages(),
                t0.elapsed().as_micros()
            ),
            Err(e) => tracing::warn!("cannot report the clone's working set: {e}"),
        }
    }
}

/// A template's working set and the channel its clones report on.
#[derive(Debug)]
pub struct WorkingSet {
    set: Arc<PageSet>,
    /// At most this many pages (0: off).
    cap: u64,
    /// The template's end (non-blocking) and the clones'.
    channel: Option<(UnixDatagram, OwnedFd)>,
    /// Invocation clones launched so far.
    launched: u64,
    /// Reports merged so far.
    reports: u64,
}

impl WorkingSet {
    /// A template's, of at most `cap_mib` MiB (0: off). Without a channel (it could not
    /// be made: logged) it is off.
    pub fn new(cap_mib: u64) -> Self {
        let channel = (cap_mib > 0)
            .then(|| {
                let (ours, theirs) = UnixDatagram::pair()?;
                ours.set_nonblocking(true)?;
                Ok::<_, std::io::Error>((ours, OwnedFd::from(theirs)))
            })
            .and_then(|r| {
                r.map_err(|e| tracing::warn!("no working set: cannot make its channel: {e}"))
                    .ok()
            });
        Self {
            set: Default::default(),
            cap: (cap_mib << 20) / PAGE,
            channel,
            launched: 0,
            reports: 0,
        }
    }

    /// Off: clones neither record nor write ahead (a clone's own, which is no template).
    pub fn off() -> Self {
        Self::new(0)
    }

    /// What a child forked now takes; None when off.
    pub(crate) fn for_child(&self) -> Option<ForChild> {
        let (_, theirs) = self.channel.as_ref()?;
        Some(ForChild {
            set: self.set.clone(),
            report: theirs.as_raw_fd(),
        })
    }

    /// Whether the invocation clone launched next records its working set: the first
    /// [`LEARN`], then one in [`RELEARN_EVERY`].
    pub fn record_next(&mut self) -> bool {
        if self.channel.is_none() {
            return false;
        }
        self.launched += 1;
        self.launched <= LEARN || self.launched % RELEARN_EVERY == 0
    }

    /// Merges the reports that came since last asked (a clone sends its report before
    /// it exits: so all of those reaped). Returns whether the set was empty before and
    /// is not now: warm clones made before copied nothing ahead.
    pub fn take_reports(&mut self) -> bool {
        let Some((ours, _)) = &self.channel else {
            return false;
        };
        let before = self.set.pages();
        // Each report read into a buffer of its own length, found first (MSG_TRUNC: a
        // datagram's whole length): this runs at every reap, and a buffer of the
        // largest report's size (256 KiB) allocated and zeroed each time cost the
        // template copies on write of heap pages its newest clone shares (this and
        // the controller's forwarding note made only for a source, measured together:
        // about 2 page faults fewer per fresh invocation).
        while let Some(len) = next_len(ours) {
            let mut buf = vec![0u8; len];
            let Ok(n) = ours.recv(&mut buf) else { break };
            match PageSet::decode(&buf[..n]) {
                Some(report) => {
                    self.reports += 1;
                    self.set = Arc::new(self.set.merged(&report, self.cap));
                }
                None => tracing::warn!("a clone's working-set report is not one ({n} bytes)"),
            }
        }
        let after = self.set.pages();
        if after != before {
            tracing::info!(
                "working set: {} KiB in {} ranges after {} reports; clones made from now on write it ahead",
                after * PAGE / 1024,
                self.set.ranges().len(),
                self.reports
            );
        }
        before == 0 && after > 0
    }

    /// The set now.
    pub fn set(&self) -> &PageSet {
        &self.set
    }
}

/// The length of the next datagram on `socket`, without taking it; None when there is
/// none (the socket is non-blocking) or it failed.
fn next_len(socket: &UnixDatagram) -> Option<usize> {
    use nix::sys::socket::{recv, MsgFlags};
    let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_TRUNC | MsgFlags::MSG_DONTWAIT;
    recv(socket.as_raw_fd(), &mut [], flags).ok()
}

/// Most pages a prime request names (64 MiB of 4 KiB pages).
const PRIME_PAGES: usize = 16 * 1024;
// Every run of a prime request fits a report's wire form (`PageSet::encode`).
const _: () = assert!(PRIME_PAGES <= MAX_REPORT_RANGES);

/// The prime request's payload for a warm clone of a template whose runtime waits on
/// vCPU `vcpu` (captured in `state`): the virtual pages of the runtime's address space
/// whose frames the template's learned working set holds, as runs of (first virtual page
/// number, count), little-endian u64 each. The runtime reads one byte of each in the
/// prime, so the guest maps them in the clone's VM before the request writes them (the
/// working set is written ahead, but a page is mapped in a new VM only at the guest's
/// first touch). Empty without a working set, or when the tables cannot be read.
pub fn prime_pages(
    mem: &vm_memory::GuestMemoryMmap,
    state: &clone::MicrovmState,
    vcpu: u8,
    set: &PageSet,
) -> Vec<u8> {
    let Some(v) = state.vcpus.iter().find(|v| v.id == vcpu) else {
        return Vec::new();
    };
    let pages =
        crate::arch::x86_64::paging::user_pages_of(mem, &v.sregs, |f| set.contains(f), PRIME_PAGES);
    // Runs of page numbers in a report's wire form (ascending, so pushed as they come;
    // at most PRIME_PAGES of them, within the form's MAX_REPORT_RANGES).
    PageSet::from_frames(pages.unwrap_or_default()).encode()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_become_ranges() {
        let s = PageSet::from_frames([1, 2, 3, 7, 9, 10]);
        assert_eq!(s.ranges(), &[(1, 3), (7, 1), (9, 2)]);
        assert_eq!(s.pages(), 6);
        assert!(s.contains(1) && s.contains(3) && s.contains(10));
        assert!(!s.contains(0) && !s.contains(4) && !s.contains(8) && !s.contains(11));
        assert!(PageSet::default().is_empty() && !PageSet::default().contains(0));
    }

    #[test]
    fn merging_keeps_the_set_and_adds_lowest_first_up_to_the_cap() {
        let a = PageSet::from_frames([10, 11, 20]);
        let b = PageSet::from_frames([5, 11, 12, 30, 31]);
        assert_eq!(
            a.merged(&b, 100).ranges(),
            &[(5, 1), (10, 3), (20, 1), (30, 2)]
        );
        // Room for two more: 5 and 12 (11 is in already).
        assert_eq!(a.merged(&b, 5).ranges(), &[(5, 1), (10, 3), (20, 1)]);
        // Full: nothing added, nothing dropped.
        assert_eq!(a.merged(&b, 2), a);
        assert_eq!(PageSet::default().merged(&b, 100), b);
    }

    #[test]
    fn a_set_reads_back_from_the_wire_and_bad_bytes_are_refused() {
        let s = PageSet::from_frames([0, 1, 5, 1 << 40]);
        assert_eq!(PageSet::decode(&s.encode()), Some(s));
        assert_eq!(PageSet::decode(&[]), Some(PageSet::default()));
        let range = |s: u64, n: u64| [s.to_le_bytes(), n.to_le_bytes()].concat();
        assert_eq!(PageSet::decode(&range(1, 2)[..15]), None);
        assert_eq!(PageSet::decode(&range(1, 0)), None);
        assert_eq!(PageSet::decode(&[range(5, 1), range(1, 1)].concat()), None);
        assert_eq!(PageSet::decode(&[range(1, 5), range(3, 1)].concat()), None);
        assert_eq!(PageSet::decode(&range(u64::MAX, 2)), None);
    }

    #[test]
    fn clones_record_first_then_now_and_then_and_none_when_off() {
        let mut w = WorkingSet::new(1);
        let asked: Vec<u64> = (1..=200).filter(|_| w.record_next()).collect();
        assert_eq!(asked, [1, 2, 3, 64, 128, 192]);
        let mut off = WorkingSet::off();
        assert!(!off.record_next() && off.for_child().is_none());
    }

    #[test]
    fn pages_written_after_a_fork_are_found_written_ahead_and_reported() {
        use vm_memory::Bytes;
        let window = devices::mailbox::MailboxWindow::default();
        let (mem, _) =
            crate::vstate::memory::create_guest_memory(4 << 20, false, false, window).unwrap();
        // Shared with the child after the fork: every page but the last few.
        for p in 0..1000 {
            mem.write_obj(2u8, GuestAddress(p * PAGE)).unwrap();
        }
        let mut w = WorkingSet::new(64);
        let child = w.for_child().unwrap();
        // SAFETY: the test's child only touches its own copy of `mem`, reads pagemap,
        // writes a datagram and `_exit`s.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // Before the first write nothing is this process's alone; then page 3 and 4.
            let before = exclusive_pages(&mem, &PageSet::default()).unwrap();
            mem.write_obj(1u8, GuestAddress(3 * PAGE)).unwrap();
            mem.write_obj(1u8, GuestAddress(4 * PAGE + 17)).unwrap();
            let ahead = PageSet::from_frames([8, 9]);
            let written = populate(&mem, &ahead).unwrap();
            let after = exclusive_pages(&mem, &PageSet::default()).unwrap();
            let ok = before.is_empty()
                && written == 2
                && after == PageSet::from_frames([3, 4, 8, 9])
                && mem.read_obj::<u8>(GuestAddress(8 * PAGE)).unwrap() == 2;
            if ok {
                Duty::new(&child, Arc::new(ahead)).report(&mem);
            }
            // SAFETY: ends the test's child.
            unsafe { libc::_exit(i32::from(!ok)) };
        }
        let status = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None).unwrap();
        assert_eq!(
            status,
            nix::sys::wait::WaitStatus::Exited(nix::unistd::Pid::from_raw(pid), 0)
        );
        assert!(w.take_reports(), "the first report fills the set");
        assert!(!w.take_reports(), "no report came since");
        assert_eq!(w.set(), &PageSet::from_frames([3, 4]));
        assert_eq!(w.for_child().unwrap().set.pages(), 2);
    }
}
