//! virtio-rng (entropy device): fills the driver's buffers with bytes from the host's
//! `getrandom`, optionally rate limited. Each clone's device reads its own host entropy,
//! so clones never share what they get from it.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::GuestMemoryMmap;

use super::worker::QueueHandler;
use super::{ActivateError, VirtioDevice, VirtioDeviceState, VirtioInterrupt, VIRTIO_F_VERSION_1};
use crate::persist::Persist;
use crate::rate_limiter::{LimiterReport, LimiterStats, RateLimit, RateLimiter};
use crate::util::host_random;

/// virtio device id of an entropy source.
pub const TYPE_RNG: u32 = virtio_bindings::virtio_ids::VIRTIO_ID_RNG;
const QUEUE_SIZE: u16 = 256;
/// Most bytes served per request (Linux asks for at most a page).
const MAX_REQUEST: usize = 64 << 10;

/// The entropy device.
pub struct Rng {
    limit: Option<RateLimit>,
    /// Its limiter's counters (each worker's limiter counts into them).
    stats: Arc<LimiterStats>,
    queue_sizes: [u16; 1],
}

impl Rng {
    /// An entropy device, rate limited by `limit` (bytes and requests).
    pub fn new(limit: Option<RateLimit>) -> Self {
        Self {
            limit,
            stats: Arc::default(),
            queue_sizes: [QUEUE_SIZE],
        }
    }
}

/// The entropy device's own state: none. It keeps nothing between requests (its queue is
/// its transport's); its rate limit is the new VM's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {}

impl Persist for Rng {
    type State = RngState;
    /// Its rate limit.
    type ConstructorArgs = Option<RateLimit>;
    type Error = std::convert::Infallible;

    fn save(&self) -> RngState {
        RngState {}
    }

    fn restore(limit: Option<RateLimit>, _: &RngState) -> Result<Self, Self::Error> {
        Ok(Self::new(limit))
    }
}

impl VirtioDevice for Rng {
    fn state(&self) -> VirtioDeviceState {
        VirtioDeviceState::Rng(self.save())
    }

    fn name(&self) -> &'static str {
        "virtio-rng"
    }

    fn device_type(&self) -> u32 {
        TYPE_RNG
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        // virtio-rng has no configuration space.
        data.fill(0);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::debug!("virtio-rng: guest wrote config at {offset:#x}; it has none");
    }

    fn limiter_reports(&self) -> Vec<LimiterReport> {
        super::request_limiter_report(self.limit.as_ref(), &self.stats)
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        _acked_features: u64,
        queues: Vec<Queue>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Result<Box<dyn QueueHandler>, ActivateError> {
        let queue = super::single_queue(queues, "virtio-rng")?;
        let limiter = super::new_limiter(self.limit.as_ref(), "virtio-rng", &self.stats)?;
        Ok(Box::new(super::Limited(RngWorker {
            mem,
            queue,
            interrupt,
            limiter,
        })))
    }
}

struct RngWorker {
    mem: GuestMemoryMmap,
    queue: Queue,
    interrupt: Arc<VirtioInterrupt>,
    limiter: Option<RateLimiter>,
}

impl RngWorker {
    fn process_queue(&mut self) {
        use std::io::Write;
        let mut used_any = false;
        while let Some(chain) = self.queue.pop_descriptor_chain(&self.mem) {
            let head = chain.head_index();
            let mut writer = match chain.writer(&self.mem) {
                Ok(w) => w,
                Err(e) => {
                    tracing::debug!("virtio-rng: bad descriptor chain {head}: {e:?}");
                    self.add_used(head, 0);
                    used_any = true;
                    continue;
                }
            };
            let len = writer.available_bytes().min(MAX_REQUEST);
            if let Some(l) = self.limiter.as_mut() {
                if !l.consume(len as u64) {
                    // Served when the limiter's timer fires.
                    self.queue.go_to_previous_position();
                    break;
                }
            }
            let mut buf = vec![0u8; len];
            let written = match host_random(&mut buf) {
                Ok(()) => writer.write_all(&buf).map_or(0, |_| len),
                Err(e) => {
                    tracing::warn!("virtio-rng: getrandom failed: {e}");
                    0
                }
            };
            self.add_used(head, written as u32);
            used_any = true;
        }
        if used_any {
            super::notify_used(&mut self.queue, &self.mem, &self.interrupt, "virtio-rng");
        }
    }

    fn add_used(&mut self, head: u16, len: u32) {
        super::add_used(&mut self.queue, &self.mem, head, len, "virtio-rng");
    }
}

/// The queue work once over a fuzzer's memory and queue (the fuzzing module's rig);
/// hands the queue back.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_process(
    mem: &GuestMemoryMmap,
    queue: Queue,
    interrupt: &Arc<VirtioInterrupt>,
) -> Queue {
    let mut w = RngWorker {
        mem: mem.clone(),
        queue,
        interrupt: interrupt.clone(),
        limiter: None,
    };
    w.process_queue();
    w.queue
}

impl super::LimitedQueue for RngWorker {
    const NAME: &'static str = "virtio-rng";

    fn process_queue(&mut self) {
        RngWorker::process_queue(self);
    }

    fn queue(&self) -> &Queue {
        &self.queue
    }

    fn limiter(&mut self) -> Option<&mut RateLimiter> {
        self.limiter.as_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EventFd;

    const WRITE: u16 = 2;

    fn worker(
        mem: &GuestMemoryMmap,
        vq: &MockSplitQueue<'_, GuestMemoryMmap>,
        limit: Option<&str>,
    ) -> RngWorker {
        RngWorker {
            mem: mem.clone(),
            queue: vq.create_queue().unwrap(),
            interrupt: Arc::new(VirtioInterrupt::new(EventFd::new(0).unwrap())),
            limiter: limit.map(|l| RateLimiter::new(&l.parse().unwrap()).unwrap()),
        }
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap()
    }

    fn desc(addr: u64, len: u32, flags: u16) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags, 0))
    }

    #[test]
    fn fills_writable_buffers_with_host_random_bytes() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, 16);
        vq.add_desc_chains(&[desc(0x10_0000, 64, WRITE), desc(0x20_0000, 64, WRITE)], 0)
            .unwrap();
        let mut w = worker(&m, &vq, None);
        w.process_queue();
        let mut a = [0u8; 64];
        let mut b = [0u8; 64];
        m.read_slice(&mut a, GuestAddress(0x10_0000)).unwrap();
        m.read_slice(&mut b, GuestAddress(0x20_0000)).unwrap();
        assert_ne!(a, [0u8; 64]);
        assert_ne!(a, b, "two requests got the same bytes");
        assert_eq!(vq.used().ring().ref_at(0).unwrap().load().len(), 64);
        assert_eq!(w.interrupt.status() & 1, 1);
    }

    #[test]
    fn read_only_and_out_of_memory_buffers_get_nothing() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, 16);
        vq.add_desc_chains(&[desc(0x10_0000, 64, 0), desc(0x2000_0000, 64, WRITE)], 0)
            .unwrap();
        let mut w = worker(&m, &vq, None);
        w.process_queue();
        assert_eq!(vq.used().idx().load(), 2, "both chains returned");
        assert_eq!(vq.used().ring().ref_at(0).unwrap().load().len(), 0);
        assert_eq!(vq.used().ring().ref_at(1).unwrap().load().len(), 0);
    }

    #[test]
    fn rate_limit_holds_requests_until_the_bucket_refills() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, 16);
        let chains: Vec<_> = (0..4)
            .map(|i| desc(0x10_0000 + i * 0x1000, 100, WRITE))
            .collect();
        vq.add_desc_chains(&chains, 0).unwrap();
        let mut w = worker(&m, &vq, Some("bytes=200/50"));
        w.process_queue();
        assert_eq!(vq.used().idx().load(), 2, "200 bytes allowed at once");
        assert!(w.limiter.as_ref().unwrap().is_blocked());
        // The queue did not advance past the held request.
        assert_eq!(w.queue.next_avail(), 2);
        std::thread::sleep(std::time::Duration::from_millis(60));
        w.limiter.as_mut().unwrap().timer_fired();
        w.process_queue();
        assert_eq!(vq.used().idx().load(), 4);
    }
}
