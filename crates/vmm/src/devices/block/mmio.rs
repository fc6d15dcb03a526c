//! The virtio-mmio transport (virtio 1.x, 4.2.2, version 2 registers):
//! the register file a driver reads and writes, the device status and
//! feature handshake, and the queue's configuration. No I/O happens here;
//! a write returns what the device must do about it ([`Action`]).

use virtio_queue::{Queue, QueueT};

/// "virt", little-endian.
pub const MAGIC: u32 = 0x7472_6976;
/// virtio-mmio register layout version 2 (virtio 1.x).
pub const VERSION: u32 = 2;
/// Virtio device id of a block device.
pub const DEVICE_ID_BLOCK: u32 = 2;
/// Vendor id: "FRRY".
pub const VENDOR_ID: u32 = 0x5952_5246;
/// Bytes of the register window of one device.
pub const WINDOW: u64 = 0x1000;
/// Where the device-specific configuration starts in the window.
pub const CONFIG_OFFSET: u64 = 0x100;

/// Register offsets.
pub mod reg {
    #![allow(missing_docs)]
    pub const MAGIC: u64 = 0x000;
    pub const VERSION: u64 = 0x004;
    pub const DEVICE_ID: u64 = 0x008;
    pub const VENDOR_ID: u64 = 0x00c;
    pub const DEVICE_FEATURES: u64 = 0x010;
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    pub const DRIVER_FEATURES: u64 = 0x020;
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    pub const QUEUE_SEL: u64 = 0x030;
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    pub const QUEUE_NUM: u64 = 0x038;
    pub const QUEUE_READY: u64 = 0x044;
    pub const QUEUE_NOTIFY: u64 = 0x050;
    pub const INTERRUPT_STATUS: u64 = 0x060;
    pub const INTERRUPT_ACK: u64 = 0x064;
    pub const STATUS: u64 = 0x070;
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    pub const QUEUE_DRIVER_LOW: u64 = 0x090;
    pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
    pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
    pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
    pub const CONFIG_GENERATION: u64 = 0x0fc;
}

/// Device status bits (2.1).
pub mod status {
    #![allow(missing_docs)]
    pub const ACKNOWLEDGE: u32 = 1;
    pub const DRIVER: u32 = 2;
    pub const DRIVER_OK: u32 = 4;
    pub const FEATURES_OK: u32 = 8;
    pub const DEVICE_NEEDS_RESET: u32 = 0x40;
    pub const FAILED: u32 = 0x80;
}

/// What the device must do after a register write.
#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    /// Nothing.
    None,
    /// The driver notified queue `n`.
    Notify(u32),
    /// The driver reset the device: finish what is in flight, forget the queue.
    Reset,
}

/// The driver's side of the register file, as a migration carries it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransportState {
    /// Device status.
    pub status: u32,
    /// Features the driver wrote.
    pub driver_features: u64,
    /// The selectors the driver last wrote.
    pub device_features_sel: u32,
    /// As above.
    pub driver_features_sel: u32,
    /// As above.
    pub queue_sel: u32,
}

/// The register file of one virtio-mmio device with one queue.
pub struct Transport {
    device_features: u64,
    driver_features: u64,
    device_features_sel: u32,
    driver_features_sel: u32,
    queue_sel: u32,
    status: u32,
    config: Vec<u8>,
    /// Bad register accesses (the guest's bugs, counted, never fatal).
    pub bad_accesses: u64,
}

impl Transport {
    /// A device offering `features`, with `config` as its config space.
    pub fn new(features: u64, config: Vec<u8>) -> Self {
        Transport {
            device_features: features,
            driver_features: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            queue_sel: 0,
            status: 0,
            config,
            bad_accesses: 0,
        }
    }

    /// The device status.
    pub fn status(&self) -> u32 {
        self.status
    }

    /// True once the driver finished set-up and the device is not broken.
    pub fn live(&self) -> bool {
        self.status & status::DRIVER_OK != 0 && self.status & status::DEVICE_NEEDS_RESET == 0
    }

    /// Features both sides agreed on.
    pub fn acked_features(&self) -> u64 {
        self.driver_features & self.device_features
    }

    /// What the driver set, for a migration.
    pub fn state(&self) -> TransportState {
        TransportState {
            status: self.status,
            driver_features: self.driver_features,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            queue_sel: self.queue_sel,
        }
    }

    /// Takes a migrated driver's settings; refused when the driver had
    /// agreed to a feature this device does not offer.
    pub fn restore(&mut self, s: &TransportState) -> Result<(), String> {
        let acked = s.driver_features & self.device_features;
        if s.status & status::FEATURES_OK != 0 && acked != s.driver_features {
            return Err(format!(
                "the guest's driver uses features {:#x} this device does not offer",
                s.driver_features & !self.device_features
            ));
        }
        self.status = s.status;
        self.driver_features = s.driver_features;
        self.device_features_sel = s.device_features_sel;
        self.driver_features_sel = s.driver_features_sel;
        self.queue_sel = s.queue_sel;
        Ok(())
    }

    /// Marks the device broken: it does nothing until the driver resets it.
    pub fn set_needs_reset(&mut self) {
        self.status |= status::DEVICE_NEEDS_RESET;
    }

    /// A read of `data.len()` bytes at `offset` in the window.
    pub fn read(&mut self, q: &Queue, interrupt: u32, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_OFFSET {
            let at = (offset - CONFIG_OFFSET) as usize;
            for (i, b) in data.iter_mut().enumerate() {
                *b = self.config.get(at + i).copied().unwrap_or(0);
            }
            return;
        }
        if data.len() != 4 {
            self.bad_accesses += 1;
            data.fill(0);
            return;
        }
        let v = match offset {
            reg::MAGIC => MAGIC,
            reg::VERSION => VERSION,
            reg::DEVICE_ID => DEVICE_ID_BLOCK,
            reg::VENDOR_ID => VENDOR_ID,
            reg::DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device_features as u32,
                1 => (self.device_features >> 32) as u32,
                _ => 0,
            },
            reg::QUEUE_NUM_MAX => {
                if self.queue_sel == 0 {
                    u32::from(q.max_size())
                } else {
                    0
                }
            }
            reg::QUEUE_READY => u32::from(self.queue_sel == 0 && q.ready()),
            reg::INTERRUPT_STATUS => interrupt,
            reg::STATUS => self.status,
            reg::CONFIG_GENERATION => 0,
            _ => {
                self.bad_accesses += 1;
                0
            }
        };
        data.copy_from_slice(&v.to_le_bytes());
    }

    /// A write at `offset`; the queue's configuration goes into `q`.
    pub fn write(&mut self, q: &mut Queue, offset: u64, data: &[u8]) -> Action {
        if offset >= CONFIG_OFFSET || data.len() != 4 {
            // The block config space is read-only for us (no writeback toggle).
            self.bad_accesses += 1;
            return Action::None;
        }
        let v = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        // Queue registers count only while the driver sets up (before DRIVER_OK).
        let setting_up = self.status & status::FEATURES_OK != 0
            && self.status & (status::DRIVER_OK | status::FAILED) == 0;
        let queue_ok = setting_up && self.queue_sel == 0;
        const QUEUE_REGS: [u64; 8] = [
            reg::QUEUE_NUM,
            reg::QUEUE_READY,
            reg::QUEUE_DESC_LOW,
            reg::QUEUE_DESC_HIGH,
            reg::QUEUE_DRIVER_LOW,
            reg::QUEUE_DRIVER_HIGH,
            reg::QUEUE_DEVICE_LOW,
            reg::QUEUE_DEVICE_HIGH,
        ];
        if QUEUE_REGS.contains(&offset) && !queue_ok {
            self.bad_accesses += 1;
            return Action::None;
        }
        match offset {
            reg::DEVICE_FEATURES_SEL => self.device_features_sel = v,
            reg::DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            reg::DRIVER_FEATURES => {
                if self.status & status::DRIVER != 0 && self.status & status::FEATURES_OK == 0 {
                    match self.driver_features_sel {
                        0 => {
                            self.driver_features =
                                (self.driver_features & !0xffff_ffff) | u64::from(v)
                        }
                        1 => {
                            self.driver_features =
                                (self.driver_features & 0xffff_ffff) | (u64::from(v) << 32)
                        }
                        _ => self.bad_accesses += 1,
                    }
                } else {
                    self.bad_accesses += 1;
                }
            }
            reg::QUEUE_SEL => self.queue_sel = v,
            reg::QUEUE_NUM => q.set_size(v as u16),
            reg::QUEUE_READY => q.set_ready(v == 1),
            reg::QUEUE_DESC_LOW => q.set_desc_table_address(Some(v), None),
            reg::QUEUE_DESC_HIGH => q.set_desc_table_address(None, Some(v)),
            reg::QUEUE_DRIVER_LOW => q.set_avail_ring_address(Some(v), None),
            reg::QUEUE_DRIVER_HIGH => q.set_avail_ring_address(None, Some(v)),
            reg::QUEUE_DEVICE_LOW => q.set_used_ring_address(Some(v), None),
            reg::QUEUE_DEVICE_HIGH => q.set_used_ring_address(None, Some(v)),
            reg::QUEUE_NOTIFY => return Action::Notify(v),
            reg::INTERRUPT_ACK => {} // the device's caller clears the bits
            reg::STATUS => return self.write_status(q, v),
            _ => self.bad_accesses += 1,
        }
        Action::None
    }

    fn write_status(&mut self, q: &mut Queue, v: u32) -> Action {
        if v == 0 {
            self.status = 0;
            self.driver_features = 0;
            self.device_features_sel = 0;
            self.driver_features_sel = 0;
            self.queue_sel = 0;
            q.reset();
            return Action::Reset;
        }
        // Bits are only ever added (except by a reset), in the spec's order.
        if v & self.status != self.status {
            self.bad_accesses += 1;
            return Action::None;
        }
        let mut v = v;
        let new = v & !self.status;
        if new & status::FEATURES_OK != 0 {
            // Refused (left clear, the driver reads it back) unless the
            // driver's features are ours and include VERSION_1.
            let version_1 = 1u64 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
            if self.driver_features & !self.device_features != 0
                || self.driver_features & version_1 == 0
            {
                v &= !status::FEATURES_OK;
            }
        }
        if new & status::DRIVER_OK != 0 && (self.status & status::FEATURES_OK == 0 || !q.ready()) {
            self.bad_accesses += 1;
            v &= !status::DRIVER_OK;
        }
        self.status = v | (self.status & status::DEVICE_NEEDS_RESET);
        Action::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rd(t: &mut Transport, q: &Queue, off: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(q, 0, off, &mut b);
        u32::from_le_bytes(b)
    }

    fn wr(t: &mut Transport, q: &mut Queue, off: u64, v: u32) -> Action {
        t.write(q, off, &v.to_le_bytes())
    }

    const V1: u64 = 1 << 32;

    #[test]
    fn identity_and_the_feature_handshake() {
        let mut q = Queue::new(64).unwrap();
        let mut t = Transport::new(V1 | 1 << 9, vec![1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(rd(&mut t, &q, reg::MAGIC), MAGIC);
        assert_eq!(rd(&mut t, &q, reg::VERSION), 2);
        assert_eq!(rd(&mut t, &q, reg::DEVICE_ID), 2);
        assert_eq!(rd(&mut t, &q, reg::QUEUE_NUM_MAX), 64);
        wr(&mut t, &mut q, reg::STATUS, status::ACKNOWLEDGE);
        wr(
            &mut t,
            &mut q,
            reg::STATUS,
            status::ACKNOWLEDGE | status::DRIVER,
        );
        wr(&mut t, &mut q, reg::DEVICE_FEATURES_SEL, 1);
        assert_eq!(rd(&mut t, &q, reg::DEVICE_FEATURES), 1);
        // A feature the device lacks: FEATURES_OK stays clear.
        wr(&mut t, &mut q, reg::DRIVER_FEATURES_SEL, 0);
        wr(&mut t, &mut q, reg::DRIVER_FEATURES, 1 << 3);
        wr(&mut t, &mut q, reg::STATUS, 3 | status::FEATURES_OK);
        assert_eq!(rd(&mut t, &q, reg::STATUS) & status::FEATURES_OK, 0);
        // Reset, then the right features.
        assert_eq!(wr(&mut t, &mut q, reg::STATUS, 0), Action::Reset);
        wr(&mut t, &mut q, reg::STATUS, 3);
        wr(&mut t, &mut q, reg::DRIVER_FEATURES, 1 << 9);
        wr(&mut t, &mut q, reg::DRIVER_FEATURES_SEL, 1);
        wr(&mut t, &mut q, reg::DRIVER_FEATURES, 1);
        wr(&mut t, &mut q, reg::STATUS, 3 | status::FEATURES_OK);
        assert_ne!(rd(&mut t, &q, reg::STATUS) & status::FEATURES_OK, 0);
        assert_eq!(t.acked_features(), V1 | 1 << 9);
        // DRIVER_OK without a ready queue is refused.
        wr(&mut t, &mut q, reg::STATUS, 11 | status::DRIVER_OK);
        assert!(!t.live());
        wr(&mut t, &mut q, reg::QUEUE_NUM, 16);
        wr(&mut t, &mut q, reg::QUEUE_DESC_LOW, 0x10000);
        wr(&mut t, &mut q, reg::QUEUE_DRIVER_LOW, 0x11000);
        wr(&mut t, &mut q, reg::QUEUE_DEVICE_LOW, 0x12000);
        wr(&mut t, &mut q, reg::QUEUE_READY, 1);
        wr(&mut t, &mut q, reg::STATUS, 11 | status::DRIVER_OK);
        assert!(t.live());
        assert_eq!(q.size(), 16);
        assert_eq!(q.desc_table(), 0x10000);
        // Queue registers are frozen once live.
        wr(&mut t, &mut q, reg::QUEUE_DESC_LOW, 0x20000);
        assert_eq!(q.desc_table(), 0x10000);
        assert_eq!(wr(&mut t, &mut q, reg::QUEUE_NOTIFY, 0), Action::Notify(0));
        // Config space reads, in and past its end.
        let mut b = [0u8; 4];
        t.read(&q, 0, CONFIG_OFFSET + 6, &mut b);
        assert_eq!(b, [7, 8, 0, 0]);
    }

    #[test]
    fn odd_accesses_are_counted_not_fatal() {
        let mut q = Queue::new(64).unwrap();
        let mut t = Transport::new(V1, vec![]);
        let mut b = [0u8; 2];
        t.read(&q, 0, reg::MAGIC, &mut b);
        t.write(&mut q, reg::STATUS, &[1]);
        wr(&mut t, &mut q, 0x0f0, 5);
        wr(&mut t, &mut q, reg::QUEUE_NUM, 8); // before FEATURES_OK
        assert_eq!(t.bad_accesses, 4);
        assert_eq!(rd(&mut t, &q, reg::STATUS), 0);
    }
}
