//! The device driven the way a guest driver drives it, through its MMIO
//! registers and rings in (memfd) guest memory, with no KVM: the good
//! requests, then every kind of hostile chain, each answered with an I/O
//! error (or the device marked broken), never a panic.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_memory::GuestMemory;

use super::mmio::{reg, status as dev_status};
use super::request::{kind, status};
use super::*;

const RAM: u64 = 16 << 20;
const DESC: u64 = 0x10000;
const AVAIL: u64 = 0x11000;
const USED: u64 = 0x12000;
const QSIZE: u16 = 16;
const NEXT: u16 = 1;
const WRITE: u16 = 2;

struct Driver {
    mem: Arc<GuestMemory>,
    dev: Arc<BlockDevice>,
    path: PathBuf,
    avail_idx: u16,
    used_seen: u16,
}

impl Driver {
    fn new(name: &str, disk_bytes: u64) -> Driver {
        Driver::with_marker(name, disk_bytes, None)
    }

    fn with_marker(name: &str, disk_bytes: u64, marker: Option<memory::WriteMarker>) -> Driver {
        let path = std::env::temp_dir().join(format!("ferry-blkdev-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let spec = DiskSpec {
            source: super::spec::DiskSource::Image(path.clone()),
            size: Some(disk_bytes),
            create: true,
        };
        let mem = Arc::new(GuestMemory::new(&[(0, RAM)]).unwrap());
        let dev = BlockDevice::new(0, &spec, mem.clone(), marker).unwrap();
        let mut d = Driver {
            mem,
            dev,
            path,
            avail_idx: 0,
            used_seen: 0,
        };
        d.setup();
        d
    }

    fn w(&self, off: u64, v: u32) {
        self.dev.mmio_write(MMIO_BASE + off, &v.to_le_bytes());
    }

    fn r(&self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.dev.mmio_read(MMIO_BASE + off, &mut b);
        u32::from_le_bytes(b)
    }

    fn setup(&mut self) {
        self.w(reg::STATUS, 0);
        self.w(reg::STATUS, 1);
        self.w(reg::STATUS, 3);
        self.w(reg::DRIVER_FEATURES_SEL, 1);
        self.w(reg::DRIVER_FEATURES, 1);
        self.w(reg::DRIVER_FEATURES_SEL, 0);
        self.w(reg::DRIVER_FEATURES, 1 << 9);
        self.w(reg::STATUS, 3 | dev_status::FEATURES_OK);
        self.w(reg::QUEUE_SEL, 0);
        self.w(reg::QUEUE_NUM, u32::from(QSIZE));
        self.w(reg::QUEUE_DESC_LOW, DESC as u32);
        self.w(reg::QUEUE_DRIVER_LOW, AVAIL as u32);
        self.w(reg::QUEUE_DEVICE_LOW, USED as u32);
        self.w(reg::QUEUE_READY, 1);
        self.w(
            reg::STATUS,
            3 | dev_status::FEATURES_OK | dev_status::DRIVER_OK,
        );
        assert_ne!(self.r(reg::STATUS) & dev_status::DRIVER_OK, 0);
        self.avail_idx = 0;
        self.used_seen = 0;
        self.mem.write_bytes(AVAIL, &[0u8; 4]).unwrap();
        self.mem.write_bytes(USED, &[0u8; 4]).unwrap();
    }

    fn desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&addr.to_le_bytes());
        b[8..12].copy_from_slice(&len.to_le_bytes());
        b[12..14].copy_from_slice(&flags.to_le_bytes());
        b[14..16].copy_from_slice(&next.to_le_bytes());
        self.mem.write_bytes(DESC + 16 * u64::from(i), &b).unwrap();
    }

    fn header(&self, at: u64, ty: u32, sector: u64) {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&ty.to_le_bytes());
        b[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_bytes(at, &b).unwrap();
    }

    fn push(&mut self, head: u16) {
        let slot = AVAIL + 4 + 2 * u64::from(self.avail_idx % QSIZE);
        self.mem.write_bytes(slot, &head.to_le_bytes()).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_bytes(AVAIL + 2, &self.avail_idx.to_le_bytes())
            .unwrap();
    }

    fn kick(&self) {
        self.w(reg::QUEUE_NOTIFY, 0);
    }

    /// The next `n` used entries (id, len), waiting for the I/O threads.
    fn used(&mut self, n: usize) -> Vec<(u32, u32)> {
        let t = Instant::now();
        let mut out = Vec::new();
        while out.len() < n {
            let mut idx = [0u8; 2];
            self.mem.read_bytes(USED + 2, &mut idx).unwrap();
            if u16::from_le_bytes(idx) == self.used_seen {
                assert!(t.elapsed() < Duration::from_secs(5), "no completion");
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            let mut e = [0u8; 8];
            let at = USED + 4 + 8 * u64::from(self.used_seen % QSIZE);
            self.mem.read_bytes(at, &mut e).unwrap();
            out.push((
                u32::from_le_bytes(e[0..4].try_into().unwrap()),
                u32::from_le_bytes(e[4..8].try_into().unwrap()),
            ));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }

    fn byte(&self, at: u64) -> u8 {
        let mut b = [0u8; 1];
        self.mem.read_bytes(at, &mut b).unwrap();
        b[0]
    }

    /// A 3-descriptor request at descriptors 0..3: header at 0x20000, data
    /// (`len` bytes at `data`), status at 0x21000.
    fn request(
        &mut self,
        ty: u32,
        sector: u64,
        data: u64,
        len: u32,
        device_writes: bool,
    ) -> (u8, u32) {
        self.header(0x20000, ty, sector);
        self.mem.write_bytes(0x21000, &[0xee]).unwrap();
        self.desc(0, 0x20000, 16, NEXT, 1);
        self.desc(
            1,
            data,
            len,
            NEXT | if device_writes { WRITE } else { 0 },
            2,
        );
        self.desc(2, 0x21000, 1, WRITE, 0);
        self.push(0);
        self.kick();
        let (id, used) = self.used(1)[0];
        assert_eq!(id, 0);
        (self.byte(0x21000), used)
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.dev.shutdown();
        let _ = std::fs::remove_file(&self.path);
    }
}

#[test]
fn writes_reads_flush_and_id_reach_the_image() {
    let mut d = Driver::new("good", 1 << 20);
    assert_eq!(d.r(mmio::CONFIG_OFFSET), 2048); // capacity in sectors
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    d.mem.write_bytes(0x30000, &data).unwrap();
    assert_eq!(
        d.request(kind::OUT, 8, 0x30000, 4096, false),
        (status::OK, 1)
    );
    d.mem.write_bytes(0x40000, &[0u8; 4096]).unwrap();
    assert_eq!(
        d.request(kind::IN, 8, 0x40000, 4096, true),
        (status::OK, 4097)
    );
    let mut back = vec![0u8; 4096];
    d.mem.read_bytes(0x40000, &mut back).unwrap();
    assert_eq!(back, data);
    assert_eq!(d.request(kind::FLUSH, 0, 0x40000, 0, true).0, status::OK);
    assert_eq!(
        d.request(kind::GET_ID, 0, 0x50000, 20, true),
        (status::OK, 21)
    );
    let mut id = [0u8; 11];
    d.mem.read_bytes(0x50000, &mut id).unwrap();
    assert_eq!(&id, b"ferry-disk0");
    let file = std::fs::read(&d.path).unwrap();
    assert_eq!(&file[8 * 512..8 * 512 + 4096], &data[..]);
    // Write-zeroes: one 16-byte segment, readable.
    let mut seg = [0u8; 16];
    seg[0..8].copy_from_slice(&8u64.to_le_bytes());
    seg[8..12].copy_from_slice(&8u32.to_le_bytes());
    d.mem.write_bytes(0x60000, &seg).unwrap();
    assert_eq!(
        d.request(kind::WRITE_ZEROES, 0, 0x60000, 16, false).0,
        status::OK
    );
    let file = std::fs::read(&d.path).unwrap();
    assert!(file[8 * 512..8 * 512 + 4096].iter().all(|b| *b == 0));
    assert_eq!(d.request(99, 0, 0x40000, 512, true).0, status::UNSUPP);
    let info = d.dev.info();
    assert_eq!((info.writes, info.write_bytes), (1, 4096));
    assert_eq!((info.reads, info.read_bytes), (1, 4096));
    assert_eq!(
        (info.flushes, info.zeroes, info.io_errors, info.bad_requests),
        (1, 1, 0, 0)
    );
    assert!(info.live);
}

#[test]
fn several_requests_in_flight_complete_each_once() {
    let mut d = Driver::new("many", 1 << 20);
    for i in 0..5u16 {
        let (h, data, st) = (
            0x20000 + 16 * u64::from(i),
            0x30000 + 4096 * u64::from(i),
            0x21000 + u64::from(i),
        );
        d.mem.write_bytes(data, &[i as u8 + 1; 4096]).unwrap();
        d.header(h, kind::OUT, 8 * u64::from(i));
        d.desc(3 * i, h, 16, NEXT, 3 * i + 1);
        d.desc(3 * i + 1, data, 4096, NEXT, 3 * i + 2);
        d.desc(3 * i + 2, st, 1, WRITE, 0);
        d.push(3 * i);
    }
    d.kick();
    let mut ids: Vec<u32> = d.used(5).into_iter().map(|(id, _)| id).collect();
    ids.sort();
    assert_eq!(ids, vec![0, 3, 6, 9, 12]);
    // Nothing left in flight: notifications are on again (else a driver
    // that honours NO_NOTIFY would never ring again).
    let t = Instant::now();
    while d.byte(USED) & 1 != 0 {
        assert!(t.elapsed() < Duration::from_secs(5), "NO_NOTIFY left set");
        std::thread::sleep(Duration::from_millis(1));
    }
    let file = std::fs::read(&d.path).unwrap();
    for i in 0..5usize {
        assert!(file[i * 4096..(i + 1) * 4096]
            .iter()
            .all(|b| *b == i as u8 + 1));
        assert_eq!(d.byte(0x21000 + i as u64), status::OK);
    }
}

#[test]
fn hostile_requests_get_an_io_error_not_a_panic() {
    let mut d = Driver::new("hostile", 1 << 20);
    // Data outside guest RAM.
    assert_eq!(
        d.request(kind::IN, 0, RAM + 0x1000, 4096, true),
        (status::IOERR, 1)
    );
    // Data running off the end of RAM.
    assert_eq!(
        d.request(kind::OUT, 0, RAM - 512, 4096, false),
        (status::IOERR, 1)
    );
    // Past the disk's end, and a sector number that overflows.
    assert_eq!(
        d.request(kind::IN, 2047, 0x30000, 1024, true).0,
        status::IOERR
    );
    assert_eq!(
        d.request(kind::OUT, u64::MAX - 1, 0x30000, 4096, false).0,
        status::IOERR
    );
    // Not whole sectors.
    assert_eq!(
        d.request(kind::OUT, 0, 0x30000, 100, false).0,
        status::IOERR
    );
    // Larger than the device takes at once.
    assert_eq!(
        d.request(kind::OUT, 0, 0x100000, 2 << 20, false).0,
        status::IOERR
    );
    // A write whose data the device would have to write (wrong direction).
    assert_eq!(d.request(kind::OUT, 0, 0x30000, 512, true).0, status::IOERR);
    // A header outside RAM.
    d.desc(0, RAM + 64, 16, NEXT, 1);
    d.desc(1, 0x21000, 1, WRITE, 0);
    d.push(0);
    d.kick();
    assert_eq!(d.used(1)[0], (0, 1));
    assert_eq!(d.byte(0x21000), status::IOERR);
    // A loop: 0 -> 1 -> 0 -> … (cut by the queue size).
    d.header(0x20000, kind::IN, 0);
    d.desc(0, 0x20000, 16, NEXT, 1);
    d.desc(1, 0x21000, 1, WRITE | NEXT, 0);
    d.push(0);
    d.kick();
    assert_eq!(d.used(1)[0], (0, 1));
    assert_eq!(d.byte(0x21000), status::IOERR);
    // A next index outside the table.
    d.desc(0, 0x20000, 16, NEXT, 999);
    d.push(0);
    d.kick();
    assert_eq!(
        d.used(1)[0].1,
        0,
        "no status byte reachable: nothing written"
    );
    // A readable descriptor after a writable one.
    d.desc(0, 0x20000, 16, NEXT, 1);
    d.desc(1, 0x30000, 512, WRITE | NEXT, 2);
    d.desc(2, 0x31000, 512, NEXT, 3);
    d.desc(3, 0x21000, 1, WRITE, 0);
    d.push(0);
    d.kick();
    assert_eq!(d.used(1)[0], (0, 1));
    assert_eq!(d.byte(0x21000), status::IOERR);
    // A chain with no writable byte at all.
    d.desc(0, 0x20000, 16, 0, 0);
    d.push(0);
    d.kick();
    assert_eq!(d.used(1)[0], (0, 0));
    let info = d.dev.info();
    assert_eq!(info.bad_requests, 12);
    assert_eq!((info.reads, info.writes, info.broken), (0, 0, 0));
    // The device still works.
    assert_eq!(d.request(kind::OUT, 0, 0x30000, 512, false).0, status::OK);
}

#[test]
fn a_broken_queue_needs_a_reset_and_recovers_after_one() {
    let mut d = Driver::new("broken", 1 << 20);
    // The available index runs more than a queue ahead of the device.
    d.mem.write_bytes(AVAIL + 2, &100u16.to_le_bytes()).unwrap();
    d.kick();
    assert_ne!(d.r(reg::STATUS) & dev_status::DEVICE_NEEDS_RESET, 0);
    assert_eq!(d.dev.info().broken, 1);
    // Notifies do nothing until the reset.
    d.kick();
    d.setup();
    assert_eq!(d.r(reg::STATUS) & dev_status::DEVICE_NEEDS_RESET, 0);
    // A head index outside the descriptor table: no used entry can name
    // it, so the queue is broken too.
    d.push(500);
    d.kick();
    let t = Instant::now();
    while d.r(reg::STATUS) & dev_status::DEVICE_NEEDS_RESET == 0 {
        assert!(t.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(d.dev.info().broken, 2);
    d.setup();
    assert_eq!(d.r(reg::STATUS) & dev_status::DEVICE_NEEDS_RESET, 0);
    assert_eq!(d.request(kind::OUT, 0, 0x30000, 512, false).0, status::OK);
}

#[test]
fn every_page_the_device_writes_into_guest_ram_is_marked() {
    let marked: Arc<std::sync::Mutex<std::collections::BTreeSet<u64>>> = Arc::default();
    let m = marked.clone();
    let marker: memory::WriteMarker = Arc::new(move |region, first, pages| {
        assert_eq!(region, 0);
        m.lock().unwrap().extend(first..first + pages);
    });
    let mut d = Driver::with_marker("marked", 1 << 20, Some(marker));
    marked.lock().unwrap().clear();
    // A write: the device writes only the status byte and the used ring.
    d.mem.write_bytes(0x30000, &[7u8; 8192]).unwrap();
    assert_eq!(d.request(kind::OUT, 0, 0x30000, 8192, false).0, status::OK);
    let got: Vec<u64> = std::mem::take(&mut *marked.lock().unwrap())
        .into_iter()
        .collect();
    assert_eq!(got, vec![USED / 4096, 0x21000 / 4096], "{got:x?}");
    // A read of two pages into 0x40000..0x42000 (and part of 0x42000).
    assert_eq!(
        d.request(kind::IN, 0, 0x40800, 8192, true),
        (status::OK, 8193)
    );
    let got: Vec<u64> = std::mem::take(&mut *marked.lock().unwrap())
        .into_iter()
        .collect();
    assert_eq!(
        got,
        vec![USED / 4096, 0x21000 / 4096, 0x40, 0x41, 0x42],
        "{got:x?}"
    );
}

#[test]
fn a_migrated_state_is_taken_only_by_the_same_shared_disk() {
    let mut d = Driver::new("state", 1 << 20);
    assert_eq!(d.request(kind::OUT, 0, 0x30000, 512, false).0, status::OK);
    d.dev.settle(Duration::from_secs(5)).unwrap();
    let st = d.dev.state();
    assert_eq!((st.backend.as_str(), st.size), ("raw", 1 << 20));
    assert_eq!(
        (
            st.queue.size,
            st.queue.ready,
            st.queue.next_avail,
            st.queue.next_used
        ),
        (QSIZE, true, 1, 1)
    );
    assert_eq!(
        (st.queue.desc, st.queue.avail, st.queue.used),
        (DESC, AVAIL, USED)
    );
    assert_ne!(st.transport.status & dev_status::DRIVER_OK, 0);
    // A local image is not shared storage: nobody takes its state.
    let other = Driver::new("state2", 1 << 20);
    let e = other.dev.restore(&st).unwrap_err().to_string();
    assert!(e.contains("same shared disks"), "{e}");
    // Nor does a disk of another size or name.
    let mut nbd = st.clone();
    nbd.backend = "nbd".into();
    nbd.name = "web".into();
    let e = other.dev.restore(&nbd).unwrap_err().to_string();
    assert!(e.contains(r#"export "web" of 1048576 bytes"#), "{e}");
}
