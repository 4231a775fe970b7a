//! 8250-compatible serial console (vm-superio) on the port I/O bus.

use std::io::Write;

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::Serial;

use crate::bus::BusDevice;
use crate::persist::Persist;
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

/// The UART's registers and unread input, as carried into a clone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialConsoleState {
    /// Divisor latch, low byte.
    pub baud_divisor_low: u8,
    /// Divisor latch, high byte.
    pub baud_divisor_high: u8,
    /// IER.
    pub interrupt_enable: u8,
    /// IIR.
    pub interrupt_identification: u8,
    /// LCR.
    pub line_control: u8,
    /// LSR.
    pub line_status: u8,
    /// MCR.
    pub modem_control: u8,
    /// MSR.
    pub modem_status: u8,
    /// Scratch register.
    pub scratch: u8,
    /// Received bytes the guest has not read.
    pub in_buffer: Vec<u8>,
}

impl Default for SerialConsoleState {
    fn default() -> Self {
        SerialState::default().into()
    }
}

impl From<SerialState> for SerialConsoleState {
    fn from(s: SerialState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialConsoleState> for SerialState {
    fn from(s: &SerialConsoleState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

/// Errors restoring a console from saved state.
#[derive(Debug, thiserror::Error)]
#[error("invalid serial console state: {0}")]
pub struct SerialRestoreError(String);

/// What a console is made with: the line it raises and where guest output goes.
pub struct SerialArgs {
    /// Raised when the UART interrupts (an irqfd).
    pub interrupt: EventFdTrigger,
    /// Where guest output goes.
    pub out: Box<dyn Write + Send>,
}

impl Persist for SerialConsole {
    type State = SerialConsoleState;
    type ConstructorArgs = SerialArgs;
    type Error = SerialRestoreError;

    /// The UART's registers and the input the guest has not read.
    fn save(&self) -> SerialConsoleState {
        self.serial.state().into()
    }

    /// A console continuing from `state`.
    fn restore(args: SerialArgs, state: &SerialConsoleState) -> Result<Self, SerialRestoreError> {
        let serial = Serial::from_state(&state.into(), args.interrupt, NoEvents, args.out)
            .map_err(|e| SerialRestoreError(format!("{e:?}")))?;
        Ok(Self {
            serial,
            write_errors: 0,
        })
    }
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
    fn save_and_restore_keep_registers_and_pending_input() {
        let sink = Sink::default();
        let mut con = SerialConsole::new(EventFdTrigger::new().unwrap(), Box::new(sink.clone()));
        con.write(1, &[0x03]); // IER: data ready + THR empty interrupts
        con.write(7, &[0x5a]); // scratch
        con.enqueue_input(b"ab").unwrap();
        let state = con.save();
        assert_eq!(state.interrupt_enable, 0x03);
        assert_eq!(state.in_buffer, b"ab");
        let json = serde_json_like(&state);
        let args = SerialArgs {
            interrupt: EventFdTrigger::new().unwrap(),
            out: Box::new(sink),
        };
        let mut copy = SerialConsole::restore(args, &state).unwrap();
        assert_eq!(copy.save(), state, "{json}");
        let mut b = [0u8];
        copy.read(7, &mut b);
        assert_eq!(b[0], 0x5a);
        copy.read(0, &mut b);
        assert_eq!(b[0], b'a');
    }

    fn serde_json_like(s: &SerialConsoleState) -> String {
        format!("{s:?}")
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
