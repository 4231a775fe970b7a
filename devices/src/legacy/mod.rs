//! Legacy PC devices: the 8250 serial console and the i8042 reset line.

mod i8042;
mod serial;

pub use i8042::{I8042State, I8042};
pub use serial::{
    SerialArgs, SerialConsole, SerialConsoleState, SerialRestoreError, COM1_BASE, COM1_GSI,
    COM1_LEN,
};
