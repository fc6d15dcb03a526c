//! Devices on the guest's I/O buses: the console and exit port (port I/O),
//! the service device's doorbell and the virtio-blk disks (MMIO); and the
//! host info page the guest reads (memory, no exits).

pub mod block;
pub mod host_info;
pub mod serial;
pub mod service;

use crate::guest_abi::{EXIT_PANIC, PORT_EXIT, SVC_DOORBELL_GPA};
use serial::{ConsoleSink, Serial};
use service::ServiceDevice;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What a port write asks of the VMM.
#[derive(Debug, PartialEq, Eq)]
pub enum PioAction {
    /// Keep running.
    Continue,
    /// The guest asked to stop with this code.
    Exit(u32),
    /// The guest panicked (its message is on the console).
    Panic,
}

/// All port-I/O devices of a VM.
pub struct Devices {
    /// COM1 console.
    pub serial: Serial,
    /// The service device, if the VM serves requests.
    pub service: Option<Arc<ServiceDevice>>,
    /// The VM's disks, in `--disk` order.
    pub disks: Vec<Arc<block::BlockDevice>>,
    unknown_accesses: AtomicU64,
}

impl Devices {
    /// The device set, with console lines going to `console`.
    pub fn new(console: Option<ConsoleSink>, service: Option<Arc<ServiceDevice>>) -> Self {
        Devices {
            serial: Serial::new(console),
            service,
            disks: Vec::new(),
            unknown_accesses: AtomicU64::new(0),
        }
    }

    /// The same devices with these disks.
    pub fn with_disks(mut self, disks: Vec<Arc<block::BlockDevice>>) -> Self {
        self.disks = disks;
        self
    }

    /// Handles an `out` from the guest.
    pub fn pio_write(&self, port: u16, data: &[u8]) -> PioAction {
        if Serial::owns(port) {
            self.serial.write(port, data);
        } else if port == PORT_EXIT {
            return match le_u32(data) {
                EXIT_PANIC => PioAction::Panic,
                code => PioAction::Exit(code),
            };
        } else {
            self.unknown_accesses.fetch_add(1, Ordering::Relaxed);
        }
        PioAction::Continue
    }

    /// Handles a guest store to an address with no RAM behind it.
    pub fn mmio_write(&self, addr: u64, data: &[u8]) {
        match (addr, &self.service) {
            (SVC_DOORBELL_GPA, Some(s)) => s.doorbell(le_u32(data)),
            _ => match self.disks.iter().find(|d| d.owns(addr)) {
                Some(d) => d.mmio_write(addr, data),
                None => {
                    self.unknown_accesses.fetch_add(1, Ordering::Relaxed);
                }
            },
        }
    }

    /// Handles a guest load from an address with no RAM behind it; nothing
    /// there reads as all ones, like an empty bus.
    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) {
        match self.disks.iter().find(|d| d.owns(addr)) {
            Some(d) => d.mmio_read(addr, data),
            None => {
                self.unknown_accesses.fetch_add(1, Ordering::Relaxed);
                data.fill(0xff);
            }
        }
    }

    /// Handles an `in` from the guest; unknown ports read as all ones, like an empty bus.
    pub fn pio_read(&self, port: u16, data: &mut [u8]) {
        if Serial::owns(port) {
            self.serial.read(port, data);
        } else {
            self.unknown_accesses.fetch_add(1, Ordering::Relaxed);
            data.fill(0xff);
        }
    }

    /// Accesses to ports no device owns (a guest bug if not zero).
    pub fn unknown_accesses(&self) -> u64 {
        self.unknown_accesses.load(Ordering::Relaxed)
    }
}

fn le_u32(data: &[u8]) -> u32 {
    let mut raw = [0u8; 4];
    let n = data.len().min(4);
    raw[..n].copy_from_slice(&data[..n]);
    u32::from_le_bytes(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_port_decodes_codes() {
        let d = Devices::new(None, None);
        assert_eq!(
            d.pio_write(PORT_EXIT, &7u32.to_le_bytes()),
            PioAction::Exit(7)
        );
        assert_eq!(
            d.pio_write(PORT_EXIT, &EXIT_PANIC.to_le_bytes()),
            PioAction::Panic
        );
        assert_eq!(d.pio_write(0x80, &[1]), PioAction::Continue);
        let mut b = [0u8; 2];
        d.pio_read(0x61, &mut b);
        assert_eq!(b, [0xff, 0xff]);
        assert_eq!(d.unknown_accesses(), 2);
    }
}
