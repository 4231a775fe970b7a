//! 8250-compatible serial console (vm-superio) on the port I/O bus.

use std::io::Write;

use vm_superio::serial::NoEvents;
use vm_superio::Serial;

use crate::bus::BusDevice;
use crate::trigger::EventFdTrigger;

/// Port base of COM1.
pub const COM1_BASE: u64 = 0x3f8;
/// Number of ports COM1 decodes.
pub const COM1_LEN: u64 = 8;
/// GSI (IOAPIC pin) COM1 interrupts on.
pub const COM1_GSI: u32 = 4;

/// The guest's serial console: guest output goes to `W`, host input can be queued.
pub struct SerialConsole {
    serial: Serial<EventFdTrigger, NoEvents, Box<dyn Write + Send>>,
    write_errors: u64,
}

impl SerialConsole {
    /// A console that raises `interrupt` and writes guest output to `out`.
    pub fn new(interrupt: EventFdTrigger, out: Box<dyn Write + Send>) -> Self {
        Self {
            serial: Serial::new(interrupt, out),
            write_errors: 0,
        }
    }

    /// Queues host input for the guest to read. Returns how many bytes fit.
    pub fn enqueue_input(&mut self, input: &[u8]) -> std::io::Result<usize> {
        self.serial
            .enqueue_raw_bytes(input)
            .map_err(|e| std::io::Error::other(e.to_string()))
    }

    /// How many guest writes could not reach the output sink.
    pub fn write_errors(&self) -> u64 {
        self.write_errors
    }
}

impl BusDevice for SerialConsole {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value = u8::try_from(offset).map_or(0xff, |o| self.serial.read(o));
        data.fill(0);
        data[0] = value;
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Ok(offset) = u8::try_from(offset) else {
            return;
        };
        if let Err(e) = self.serial.write(offset, data[0]) {
            // A full disk or closed pipe must not stop the guest: count and report once.
            if self.write_errors == 0 {
                tracing::warn!("serial console output failed (further errors counted): {e}");
            }
            self.write_errors += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn guest_output_reaches_sink_and_input_raises_interrupt() {
        let sink = Sink::default();
        let irq = EventFdTrigger::new().unwrap();
        let mut con = SerialConsole::new(irq.try_clone().unwrap(), Box::new(sink.clone()));
        for b in b"hi\n" {
            con.write(0, &[*b]);
        }
        assert_eq!(&*sink.0.lock().unwrap(), b"hi\n");
        // Enable the received-data interrupt, queue input, and read it back.
        con.write(1, &[0x01]);
        assert_eq!(con.enqueue_input(b"x").unwrap(), 1);
        assert_eq!(irq.eventfd().read().unwrap(), 1);
        let mut lsr = [0u8];
        con.read(5, &mut lsr);
        assert_eq!(lsr[0] & 1, 1, "data ready");
        let mut rbr = [0u8];
        con.read(0, &mut rbr);
        assert_eq!(rbr[0], b'x');
    }

    #[test]
    fn failing_sink_is_counted_not_fatal() {
        struct Broken;
        impl Write for Broken {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::Error::other("disk full"))
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut con = SerialConsole::new(EventFdTrigger::new().unwrap(), Box::new(Broken));
        con.write(0, b"a");
        con.write(0, b"b");
        assert_eq!(con.write_errors(), 2);
    }
}
