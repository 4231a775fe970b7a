use super::*;
use std::os::unix::net::UnixDatagram;
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

const NEXT: u16 = 1;
const WRITE: u16 = 2;
const MAC: [u8; 6] = [0x06, 0, 0xac, 0x10, 0, 2];

fn mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap()
}

fn desc(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
    RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
}

/// A device over one end of a datagram socket pair (one frame per message, as a tap);
/// the other end plays the host.
struct Rig<'a> {
    rx: MockSplitQueue<'a, GuestMemoryMmap>,
    tx: MockSplitQueue<'a, GuestMemoryMmap>,
    worker: NetWorker,
    host: UnixDatagram,
    /// The rx and tx limiters' counters.
    stats: [Arc<LimiterStats>; 2],
}

fn rig<'a>(m: &'a GuestMemoryMmap, limit: Option<&str>) -> Rig<'a> {
    let (dev, host) = UnixDatagram::pair().unwrap();
    dev.set_nonblocking(true).unwrap();
    host.set_nonblocking(true).unwrap();
    let rx = MockSplitQueue::create(m, GuestAddress(0x1000), 16);
    let tx = MockSplitQueue::create(m, GuestAddress(0x8000), 16);
    let limit: Option<RateLimit> = limit.map(|l| l.parse().unwrap());
    let interrupt = Arc::new(VirtioInterrupt::new(EventFd::new(0).unwrap()));
    let queues = [rx.create_queue().unwrap(), tx.create_queue().unwrap()];
    let stats: [Arc<LimiterStats>; 2] = Default::default();
    let worker = NetWorker::new(
        m.clone(),
        queues,
        interrupt,
        OwnedFd::from(dev),
        limit.as_ref().map(|l| (l, &stats)),
    )
    .unwrap();
    Rig {
        rx,
        tx,
        worker,
        host,
        stats,
    }
}

fn frame(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect()
}

#[test]
fn the_config_space_holds_the_mac_and_the_features_offer_no_offloads() {
    let (dev, _host) = UnixDatagram::pair().unwrap();
    let net = Net::new(OwnedFd::from(dev), MAC, None);
    let mut mac = [0u8; 8];
    net.read_config(0, &mut mac);
    assert_eq!(mac, [0x06, 0, 0xac, 0x10, 0, 2, 0, 0]);
    let mut last = [0u8; 2];
    net.read_config(4, &mut last);
    assert_eq!(last, [0, 2]);
    assert_eq!(net.avail_features(), VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MAC);
    assert_eq!(net.queue_max_sizes().len(), 2);
}

#[test]
fn a_frame_the_guest_sends_reaches_the_host_without_its_header() {
    let m = mem();
    let mut r = rig(&m, None);
    let f = frame(60, 1);
    m.write_slice(&[0xeeu8; HDR_LEN], GuestAddress(0x10_0000))
        .unwrap();
    m.write_slice(&f, GuestAddress(0x20_0000)).unwrap();
    r.tx.add_desc_chains(
        &[
            desc(0x10_0000, HDR_LEN as u32, NEXT, 1),
            desc(0x20_0000, 60, 0, 0),
        ],
        0,
    )
    .unwrap();
    r.worker.process_tx();
    let mut got = [0u8; 200];
    let n = r.host.recv(&mut got).unwrap();
    assert_eq!(&got[..n], &f[..]);
    assert_eq!(r.tx.used().idx().load(), 1);
}

#[test]
fn a_frame_from_the_host_lands_in_an_rx_buffer_behind_a_header() {
    let m = mem();
    let mut r = rig(&m, None);
    r.rx.add_desc_chains(&[desc(0x10_0000, 1526, WRITE, 0)], 0)
        .unwrap();
    let f = frame(100, 2);
    r.host.send(&f).unwrap();
    assert!(r.worker.process_rx(), "keeps watching the backend");
    let used = r.rx.used().ring().ref_at(0).unwrap().load();
    assert_eq!(used.len() as usize, HDR_LEN + 100);
    let mut buf = vec![0u8; HDR_LEN + 100];
    m.read_slice(&mut buf, GuestAddress(0x10_0000)).unwrap();
    assert_eq!(&buf[..HDR_LEN], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
    assert_eq!(&buf[HDR_LEN..], &f[..]);
    assert_eq!(r.worker.interrupt.status() & 1, 1);
}

#[test]
fn a_frame_waits_for_an_rx_buffer_and_a_too_small_buffer_drops_it() {
    let m = mem();
    let mut r = rig(&m, None);
    let f = frame(200, 3);
    r.host.send(&f).unwrap();
    assert!(!r.worker.process_rx(), "no buffer: stop watching");
    assert!(r.worker.pending.is_some());
    // A buffer too small for the frame: the frame is dropped, the buffer kept.
    r.rx.add_desc_chains(&[desc(0x10_0000, 64, WRITE, 0)], 0)
        .unwrap();
    assert!(r.worker.process_rx());
    assert_eq!(r.rx.used().idx().load(), 0);
    assert!(r.worker.pending.is_none());
    // The next frame fits the kept buffer.
    let small = frame(40, 4);
    r.host.send(&small).unwrap();
    assert!(r.worker.process_rx());
    assert_eq!(r.rx.used().idx().load(), 1);
    let mut buf = vec![0u8; 40];
    m.read_slice(&mut buf, GuestAddress(0x10_0000 + HDR_LEN as u64))
        .unwrap();
    assert_eq!(buf, small);
}

#[test]
fn malformed_tx_chains_are_returned_and_send_nothing() {
    let m = mem();
    let mut r = rig(&m, None);
    r.tx.add_desc_chains(
        &[
            // Shorter than a header.
            desc(0x10_0000, 4, 0, 0),
            // Outside guest memory.
            desc(0x4000_0000, 100, 0, 0),
            // A write-only buffer on the transmit queue.
            desc(0x11_0000, 100, WRITE, 0),
            // Larger than any frame.
            desc(0x12_0000, (HDR_LEN + MAX_FRAME + 1) as u32, 0, 0),
        ],
        0,
    )
    .unwrap();
    r.worker.process_tx();
    assert_eq!(r.tx.used().idx().load(), 4, "every chain returned");
    let mut got = [0u8; 16];
    assert!(r.host.recv(&mut got).is_err(), "nothing sent");
    // The device still works.
    let f = frame(60, 5);
    m.write_slice(&[0u8; HDR_LEN], GuestAddress(0x13_0000))
        .unwrap();
    m.write_slice(&f, GuestAddress(0x13_0000 + HDR_LEN as u64))
        .unwrap();
    r.tx.add_desc_chains(&[desc(0x13_0000, (HDR_LEN + 60) as u32, 0, 0)], 4)
        .unwrap();
    r.worker.process_tx();
    let mut got = [0u8; 200];
    assert_eq!(r.host.recv(&mut got).unwrap(), 60);
}

#[test]
fn the_tx_rate_limit_holds_frames_until_the_bucket_refills() {
    let m = mem();
    let mut r = rig(&m, Some("bytes=1000/50"));
    let chains: Vec<_> = (0..3)
        .map(|i| desc(0x10_0000 + i * 0x1000, (HDR_LEN + 600) as u32, 0, 0))
        .collect();
    r.tx.add_desc_chains(&chains, 0).unwrap();
    r.worker.process_tx();
    assert_eq!(
        r.tx.used().idx().load(),
        1,
        "600 of 1000 bytes, then blocked"
    );
    assert!(r.worker.tx_limiter.as_ref().unwrap().is_blocked());
    std::thread::sleep(std::time::Duration::from_millis(60));
    r.worker.tx_limiter.as_mut().unwrap().timer_fired();
    r.worker.process_tx();
    assert_eq!(r.tx.used().idx().load(), 2);
    let mut got = [0u8; 1000];
    assert_eq!(r.host.recv(&mut got).unwrap(), 600);
    assert_eq!(r.host.recv(&mut got).unwrap(), 600);
    // Counted on the tx limiter only: two frames through, the second and the third
    // held back (the third still waits).
    let tx = r.stats[1].report("tx");
    assert_eq!((tx.passed_bytes, tx.throttled), (1200, 2), "{tx:?}");
    assert_eq!(r.stats[0].report("rx").passed_bytes, 0);
}

#[test]
fn the_rx_rate_limit_holds_a_frame_and_stops_watching() {
    let m = mem();
    let mut r = rig(&m, Some("bytes=100/50"));
    r.rx.add_desc_chains(
        &[
            desc(0x10_0000, 1526, WRITE, 0),
            desc(0x11_0000, 1526, WRITE, 0),
        ],
        0,
    )
    .unwrap();
    r.host.send(&frame(80, 6)).unwrap();
    r.host.send(&frame(80, 7)).unwrap();
    assert!(!r.worker.process_rx(), "blocked: the timer resumes");
    assert_eq!(r.rx.used().idx().load(), 1);
    std::thread::sleep(std::time::Duration::from_millis(60));
    r.worker.rx_limiter.as_mut().unwrap().timer_fired();
    assert!(r.worker.process_rx());
    assert_eq!(r.rx.used().idx().load(), 2);
    let rx = r.stats[0].report("rx");
    assert_eq!((rx.passed_bytes, rx.throttled), (160, 1), "{rx:?}");
    assert!(rx.throttled_ms >= 50, "{rx:?}");
}

#[test]
fn a_vanished_backend_drops_frames_and_the_device_keeps_serving() {
    let m = mem();
    let mut r = rig(&m, None);
    drop(std::mem::replace(
        &mut r.host,
        UnixDatagram::unbound().unwrap(),
    ));
    let chains: Vec<_> = (0..2)
        .map(|i| desc(0x10_0000 + i * 0x1000, (HDR_LEN + 60) as u32, 0, 0))
        .collect();
    r.tx.add_desc_chains(&chains, 0).unwrap();
    r.worker.process_tx();
    assert_eq!(r.tx.used().idx().load(), 2, "frames consumed and dropped");
    assert!(!r.worker.backend_ok);
    assert!(!r.worker.process_rx(), "a failed backend is not watched");
}

#[test]
fn tap_names_are_checked_before_the_kernel_sees_them() {
    for bad in ["", "a/b", "has space", "x:1", "sixteen-chars-xx", "."] {
        assert!(matches!(open_tap(bad), Err(TapError::Name(_))), "{bad:?}");
    }
    assert!(valid_ifname("fk123456c17"));
}

#[test]
fn a_deferred_tap_is_named_now_and_opened_later() {
    for bad in ["", "a/b", "sixteen-chars-xx"] {
        assert!(matches!(
            Net::deferred_tap(bad, MAC, None),
            Err(TapError::Name(_))
        ));
    }
    // Nothing is opened (or created) until open_host or activation.
    let net = Net::deferred_tap("fkvm-never", MAC, None).unwrap();
    assert!(net.backend.is_none());
    assert_eq!(net.deferred_tap.as_deref(), Some("fkvm-never"));
}

#[test]
fn a_card_the_driver_resets_starts_again_on_the_same_tap() {
    // Each activation's worker has a descriptor of its own: dropping it (a reset ends
    // the worker) leaves the card's, and a second activation sends on the same tap.
    let m = mem();
    let (dev, host) = UnixDatagram::pair().unwrap();
    host.set_nonblocking(true).unwrap();
    let mut net = Net::new(OwnedFd::from(dev), MAC, None);
    for round in 0..2u8 {
        let rx = MockSplitQueue::create(&m, GuestAddress(0x1000), 16);
        let tx = MockSplitQueue::create(&m, GuestAddress(0x8000), 16);
        let queues = vec![rx.create_queue().unwrap(), tx.create_queue().unwrap()];
        let interrupt = Arc::new(VirtioInterrupt::new(EventFd::new(0).unwrap()));
        let worker = net.activate(m.clone(), 0, queues, interrupt);
        let mut worker = worker.unwrap_or_else(|e| panic!("activation {round}: {e}"));
        let f = frame(60, round);
        m.write_slice(&[0u8; HDR_LEN], GuestAddress(0x10_0000))
            .unwrap();
        m.write_slice(&f, GuestAddress(0x10_0000 + HDR_LEN as u64))
            .unwrap();
        tx.add_desc_chains(&[desc(0x10_0000, (HDR_LEN + 60) as u32, 0, 0)], 0)
            .unwrap();
        let epoll = vmm_sys_util::epoll::Epoll::new().unwrap();
        worker.queue_event(TX, &WorkerContext::new(&epoll));
        let mut got = [0u8; 200];
        let n = host.recv(&mut got).unwrap();
        assert_eq!(&got[..n], &f[..], "activation {round}");
    }
}
