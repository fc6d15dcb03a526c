//! The seed corpora (fuzz/corpus/TARGET/): a handful of small, real inputs
//! per target, made from the messages ferry itself encodes (its own types,
//! encoders and frame writer), so every target starts from input that gets
//! past its decoder's first checks. `make_seeds` writes them; they are
//! committed, and regenerated when a message changes.

use ferry_codec::{EncodedBatch, Method, StreamEncoder};
use ferry_migration::fuzzing::{write_encoded, CodecSetup};
use ferry_migration::protocol::{self, Hello, Kind, Layout, Role, VERSION_MAX, VERSION_STORE};
use ferry_migration::GpaPages;

use crate::codec::CACHES;
use crate::memory::LAYOUT;
use crate::{frame, Input};

mod messages;
mod nbd;
mod vm_state;
use messages::messages;
use vm_state::vm_state_bytes;

/// One seed: its file name and bytes.
pub type Seed = (String, Vec<u8>);

/// Bytes for an [`Input`]-driven target, written in the order it reads.
#[derive(Default)]
struct Bytes(Vec<u8>);

impl Bytes {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn chunk(&mut self, b: &[u8]) -> &mut Self {
        self.u16(b.len() as u16);
        self.0.extend_from_slice(b);
        self
    }
    /// A page for `Input::page`: a stretch of `fill` at `at` of `len`
    /// bytes (and a counter pattern when `counter`); returns its content.
    fn page(&mut self, fill: u8, at: u16, len: u16, counter: bool) -> Vec<u8> {
        let start = self.0.len();
        self.u8(1 | if counter { 2 } else { 0 })
            .u8(fill)
            .u16(at)
            .u16(len);
        Input::new(&self.0[start..]).page()
    }
}

fn named(target: &str, name: &str, bytes: Vec<u8>) -> Seed {
    (format!("{target}/{name}"), bytes)
}

fn enc<T: serde::Serialize>(v: &T) -> Vec<u8> {
    postcard::to_stdvec(v).expect("a message encodes")
}

fn hello(role: Role, min: u16) -> Hello {
    Hello {
        version_min: min,
        version_max: VERSION_MAX,
        role,
        session: 0x1234_5678,
        streams: 2,
    }
}

fn layout() -> Layout {
    Layout {
        regions: LAYOUT.to_vec(),
        vcpus: 2,
    }
}

fn page_of(b: u8) -> Vec<u8> {
    (0..4096u32)
        .map(|i| (i as u8).wrapping_mul(b) ^ b)
        .collect()
}

/// A small timeline file, as `ferry report` reads it.
const TIMELINE: &str = r#"{"type":"header","t":100.0,"mode":"postcopy"}
{"type":"sample","side":"source","t":99.5,"running":true,"guest":{"progress":[10]},"service":{"answered":4,"mean_us":80.0},"links":{"bulk0":[0,0]}}
{"type":"event","side":"source","t":100.0,"what":"open","detail":"v9"}
{"type":"sample","side":"source","t":100.1,"running":true,"throttle_pct":20.0,"guest":{"progress":[60]},"links":{"bulk0":[2097152,0]}}
{"type":"event","side":"source","t":100.2,"what":"phase","detail":"switching"}
{"type":"event","side":"source","t":100.25,"what":"started","detail":""}
{"type":"sample","side":"destination","t":100.3,"running":true,"guest":{"progress":[80]},"links":{"demand":[4096,8192]}}
{"type":"event","side":"source","t":100.4,"what":"phase","detail":"succeeded"}
{"type":"summary","ok":true,"stats":{"total_secs":0.4,"downtime_ms":3.0,"bytes":2097152,"rounds":[{}],"start_unix_s":100.0,"postcopy":{"switch_at_s":0.2,"faults":{"major":3,"series":[{"t_ms":0,"major":2,"minor":1,"zero":0,"async_worker":0,"exec_ratio":0.9}]}}}}
"#;

fn wire_frame() -> Vec<Seed> {
    let t = "wire_frame";
    let mut session = Vec::new();
    for (k, b) in &messages()[..4] {
        session.extend(frame(*k, b));
    }
    let pages = protocol::encode_pages(&[0x2000], &page_of(3));
    let mut flagged = frame(Kind::Complete, &[]);
    flagged[6] = 1;
    vec![
        named(t, "control-open", session),
        named(t, "pages", frame(Kind::Pages, &pages)),
        named(t, "abort", frame(Kind::Abort, b"disk full")),
        named(t, "flags", flagged),
        named(
            t,
            "cut",
            frame(Kind::Layout, &enc(&layout()))[..20].to_vec(),
        ),
    ]
}

fn hello_seeds() -> Vec<Seed> {
    let t = "hello";
    vec![
        named(t, "control", enc(&hello(Role::Control, 1))),
        named(t, "bulk", enc(&hello(Role::Bulk(3), 1))),
        named(t, "demand", enc(&hello(Role::Demand, 3))),
        named(t, "resume", enc(&hello(Role::Resume, 4))),
        named(t, "store", enc(&hello(Role::Store, VERSION_STORE))),
    ]
}

fn layout_seeds() -> Vec<Seed> {
    let t = "layout";
    let big = Layout {
        regions: vec![(0, 1 << 30), (1 << 32, 1 << 30)],
        vcpus: 8,
    };
    let many = Layout {
        regions: (0..16u64).map(|i| (i << 30, 1 << 20)).collect(),
        vcpus: 1,
    };
    vec![
        named(t, "standard", enc(&layout())),
        named(t, "two-gib", enc(&big)),
        named(t, "sixteen", enc(&many)),
    ]
}

fn control_msg() -> Vec<Seed> {
    let mut out: Vec<Seed> = messages()
        .into_iter()
        .map(|(k, b)| {
            let mut bytes = vec![(k as u16 - 1) as u8];
            bytes.extend(b);
            named("control_msg", &format!("{k:?}"), bytes)
        })
        .collect();
    // Verify: this side's hashes of its (zero) memory; the State: a real
    // one.
    let pages: u64 = LAYOUT.iter().map(|(_, s)| s / 4096).sum();
    let mut verify = vec![Kind::Verify as u16 as u8 - 1];
    for _ in 0..pages {
        verify.extend(protocol::page_hash(&[0u8; 4096]).to_le_bytes());
    }
    out.push(named("control_msg", "Verify", verify));
    let mut state = vec![Kind::State as u16 as u8 - 1];
    state.extend(vm_state_bytes());
    out.push(named("control_msg", "State", state));
    out
}

fn pages_seeds() -> Vec<Seed> {
    let t = "pages";
    let body = protocol::encode_pages(
        &[0x2000, 0x3000, 0x10_0000],
        &[page_of(1), page_of(2), page_of(3)].concat(),
    );
    let mut honest = vec![0];
    honest.extend(&body);
    let mut bad_crc = vec![1];
    bad_crc.extend(&body);
    let mut zeros = vec![2];
    zeros.extend(enc(&vec![
        GpaPages::new(0x1000, 3),
        GpaPages::new(0xffff_c000, 4),
    ]));
    // References to the fuzz target's other VM (16 pages of 0x40 + p,
    // keyed under seed 1): one that resolves, one with a wrong id, one
    // outside memory.
    #[derive(serde::Serialize)]
    struct Ref {
        gpa: u64,
        key: u64,
        id: [u8; 16],
    }
    let theirs = vec![0x43u8; 4096];
    let mut id = [0u8; 16];
    id.copy_from_slice(&blake3::hash(&theirs).as_bytes()[..16]);
    let key = xxhash_rust::xxh3::xxh3_64_with_seed(&theirs, 1);
    let mut shared = vec![4];
    shared.extend(enc(&vec![
        Ref {
            gpa: 0x2000,
            key,
            id,
        },
        Ref {
            gpa: 0x3000,
            key,
            id: [9; 16],
        },
    ]));
    let mut shared_outside = vec![4];
    shared_outside.extend(enc(&vec![Ref {
        gpa: 1 << 40,
        key,
        id,
    }]));
    // More misses than the target's memory has pages (28): refused.
    let mut shared_misses = vec![4];
    shared_misses.extend(enc(&(0..29)
        .map(|_| Ref {
            gpa: 0,
            key,
            id: [9; 16],
        })
        .collect::<Vec<_>>()));
    vec![
        named(t, "pages", honest),
        named(t, "pages-bad-crc", bad_crc),
        named(t, "zero-ranges", zeros),
        named(t, "shared-pages", shared),
        named(t, "shared-pages-outside", shared_outside),
        named(t, "shared-more-misses-than-pages", shared_misses),
    ]
}

fn bulk_stream() -> Vec<Seed> {
    let t = "bulk_stream";
    let mut out = Vec::new();
    // Honest rounds, one per codec (the target's METHODS order).
    for (i, name) in ["none", "rle", "xbzrle", "dedup", "lz4", "zstd1", "zstd3"]
        .iter()
        .enumerate()
    {
        let mut b = Bytes::default();
        b.u8(0).u8(1).u8(i as u8).u8(1).u8(4);
        for (n, first, op) in [(3u8, 1u8, 1u8), (2, 9, 0), (2, 20, 2), (4, 5, 1)] {
            b.u8(n - 1);
            for k in 0..n {
                b.u8(first + k);
            }
            b.u8(op);
            if op != 0 {
                for k in 0..n {
                    b.page(k + 1, 100 * u16::from(k), 300, k % 2 == 0);
                }
            }
            if op == 1 {
                b.u8(0);
            }
        }
        out.push(named(t, &format!("honest-{name}"), b.0));
    }
    // A hostile mix made of real frames' bodies.
    let mut b = Bytes::default();
    b.u8(1);
    let setup = enc(&CodecSetup {
        xbzrle_bytes: CACHES.xbzrle_bytes,
        dedup_bytes: CACHES.dedup_bytes,
        shards: 1,
    });
    b.u8(2).chunk(&setup);
    b.u8(3).chunk(&encoded_body(Method::Rle, 0));
    b.u8(0)
        .chunk(&protocol::encode_pages(&[0x4000], &page_of(7)));
    b.u8(1).chunk(&enc(&vec![GpaPages::new(0x5000, 2)]));
    out.push(named(t, "hostile-mix", b.0));
    out
}

/// A real Encoded body: three pages coded with `method` by a fresh encoder.
fn encoded_body(method: Method, shard: u8) -> Vec<u8> {
    let gpas = [0x1000u64, 0x2000, 0x10_0000];
    let data = [page_of(0), page_of(5), vec![0u8; 4096]].concat();
    let mut enc = StreamEncoder::new(CACHES);
    let mut batch = EncodedBatch::default();
    let pages: Vec<u64> = gpas.iter().map(|g| g / 4096).collect();
    enc.encode(method, &pages, &data, &mut batch)
        .expect("encodes");
    let mut wire = Vec::new();
    write_encoded(&mut wire, method, shard, &gpas, &batch).expect("to a Vec");
    wire[protocol::HEADER..].to_vec()
}

fn encoded() -> Vec<Seed> {
    let t = "encoded";
    let mut out = Vec::new();
    for (name, m) in [
        ("none", Method::None),
        ("rle", Method::Rle),
        ("xbzrle", Method::Xbzrle),
        ("dedup", Method::Dedup),
        ("lz4", Method::Lz4),
        ("zstd", Method::Zstd(3)),
    ] {
        let mut b = Bytes::default();
        b.u8(1)
            .chunk(&encoded_body(m, 0))
            .chunk(&encoded_body(m, 1));
        out.push(named(t, name, b.0));
    }
    out
}

/// A lockstep input for `method`: one honest priming batch (pages 1, 2),
/// then as the "hostile" batch the encoder's real coding of pages 1 (a
/// little changed) and 3, so the target starts from a batch that decodes.
fn codec_seed(method: Method) -> Vec<u8> {
    let mut b = Bytes::default();
    b.u8(1); // one priming batch
    b.u8(2).u8(1);
    let p1 = b.page(0x11, 0, 2048, true);
    b.u8(2);
    let p2 = b.page(0x22, 512, 1024, false);
    let mut enc = StreamEncoder::new(CACHES);
    let mut batch = EncodedBatch::default();
    enc.encode(method, &[1, 2], &[p1.clone(), p2].concat(), &mut batch)
        .expect("encodes");
    let mut p1b = p1;
    p1b[100] ^= 0xff;
    p1b[3000] = 7;
    let p3 = page_of(9);
    enc.encode(method, &[1, 3], &[p1b, p3].concat(), &mut batch)
        .expect("encodes");
    b.u8(2);
    let mut at = 0;
    for (i, idx) in [1u8, 3].iter().enumerate() {
        let len = batch.lens[i] as usize;
        b.u8(*idx)
            .u8(0xf0 + batch.codecs[i] as u8)
            .chunk(&batch.payload[at..at + len]);
        at += len;
    }
    b.u8(0);
    b.0
}

fn codecs() -> Vec<Seed> {
    let mut out = Vec::new();
    for (t, m) in [
        ("codec_rle", Method::Rle),
        ("codec_xbzrle", Method::Xbzrle),
        ("codec_dedup", Method::Dedup),
        ("codec_lz4", Method::Lz4),
    ] {
        out.push(named(t, "primed", codec_seed(m)));
    }
    let mut z = vec![2]; // level 3
    z.extend(codec_seed(Method::Zstd(3)));
    out.push(named("codec_zstd", "primed", z));
    // zrle: encodings of a few chunks.
    for (name, chunk) in [
        ("zeros", [0u8; 256]),
        ("ramp", std::array::from_fn(|i| i as u8)),
        (
            "sparse",
            std::array::from_fn(|i| if i % 37 == 0 { 9 } else { 0 }),
        ),
    ] {
        let mut e = [0u8; 256];
        let n = ferry_codec::zrle::encode(&chunk, &mut e).unwrap_or(0);
        let mut bytes = vec![3];
        bytes.extend_from_slice(&e[..n]);
        out.push(named("codec_zrle", name, bytes));
    }
    // Round trip: batches with each method.
    for m in 0..6u8 {
        let mut b = Bytes::default();
        b.u8(2);
        for round in 0..2u8 {
            b.u8(m).u8(3);
            for k in 0..3u8 {
                b.u8(k + round);
                b.page(k ^ round, 64 * u16::from(k), 700, round == 1);
            }
        }
        out.push(named("codec_roundtrip", &format!("method-{m}"), b.0));
    }
    out
}

fn demand() -> Vec<Seed> {
    let t = "demand";
    let mut out = Vec::new();
    for (name, prefetch, reqs) in [
        ("one", 2u8, vec![vec![3u8]]),
        ("prefetch", 4, vec![vec![0, 5], vec![6], vec![20, 27]]),
        ("edge", 1, vec![vec![15, 16, 23, 24, 27]]),
    ] {
        let mut b = Bytes::default();
        b.u8(prefetch).u8(2).u8(0).u8(7).u8(17).u8(6);
        for r in reqs {
            b.u8(0).u8(r.len() as u8);
            for i in r {
                b.u8(i).u8(0);
            }
        }
        out.push(named(t, name, b.0));
    }
    // A raw PageRequest body (odd selector) with an address outside memory.
    let mut b = Bytes::default();
    b.u8(1)
        .u8(0)
        .u8(1)
        .chunk(&enc(&vec![0x2000u64, 0x7000_0000]));
    out.push(named(t, "outside", b.0));
    out
}

fn memserver() -> Vec<Seed> {
    let t = "memserver";
    let mut b = Bytes::default();
    b.u8(1).u16(16);
    // Pages at 3 and 4, a sync, a request of both, a fetch of 3..5, a
    // list, zero runs at 3..5.
    b.u8(0).u8(1).u8(3).u8(4);
    b.page(5, 0, 4096, true);
    b.page(6, 10, 20, false);
    b.u8(3).u64(1);
    b.u8(4).u8(2).u8(3).u8(4);
    b.u8(5).u8(3).u8(2).u8(0);
    b.u8(6);
    b.u8(2).u8(3).u8(2).u8(1);
    let mut raw = Bytes::default();
    raw.u8(0).u8(1).u64(0).u64(1 << 30).u16(0);
    raw.u8(6);
    vec![named(t, "session", b.0), named(t, "raw-layout", raw.0)]
}

fn control_json() -> Vec<Seed> {
    let t = "control_json";
    [
        ("status", r#"{"cmd":"status"}"#),
        ("pause", r#"{"cmd":"pause"}"#),
        (
            "migrate",
            r#"{"cmd":"migrate","to":"tcp:10.0.0.2:7000","mode":"hybrid","postcopy_after":"1.5s","prefetch":4,"verify":true,"compression":{"compress":"zstd:3"},"timeline":"/tmp/t.jsonl"}"#,
        ),
        (
            "migrate-resume",
            r#"{"cmd":"migrate-resume","to":"unix:/run/ferry/d.sock","reconnect_timeout_ms":5000}"#,
        ),
        ("handover", r#"{"cmd":"handover","verify":true}"#),
        ("dump", r#"{"cmd":"dump","path":"/tmp/guest.bin"}"#),
    ]
    .into_iter()
    .map(|(n, l)| named(t, n, l.as_bytes().to_vec()))
    .collect()
}

fn service_wire() -> Vec<Seed> {
    use ferry_vmm::devices::service::wire::{Op, Request, Response, Status};
    let t = "service_wire";
    let mut set = Request::new(Op::from_u8(2).expect("an op"), 7, 42, 9);
    set.value = vec![0xab; 64];
    let mut both = Request::new(Op::from_u8(1).expect("an op"), 1, 2, 3).encode();
    both.extend(set.encode());
    vec![
        named(t, "requests", both),
        named(
            t,
            "response",
            Response::error(Status::BadKey, 1, 5, "no such key").encode(),
        ),
    ]
}

fn timeline() -> Vec<Seed> {
    let t = "timeline";
    let mut file = Bytes::default();
    file.u8(0).chunk(TIMELINE.as_bytes());
    let peer: String = TIMELINE
        .lines()
        .filter(|l| l.contains("destination"))
        .map(|l| format!("{l}\n"))
        .collect();
    let mut packed = vec![1];
    packed.extend(ferry_migration::fuzzing::pack_lines(peer.as_bytes()));
    let mut load = Bytes::default();
    load.u8(2).chunk(TIMELINE.as_bytes());
    load.0.extend_from_slice(
        b"send_unix_us,latency_us,outcome\n100050000,350,ok\n100150000,2100,ok\n100210000,0,error\n",
    );
    vec![
        named(t, "file", file.0),
        named(t, "peer-lines", packed),
        named(t, "with-load", load.0),
    ]
}

fn registry() -> Vec<Seed> {
    use base64_lite::encode as b64;
    let t = "registry";
    let entry = |name: &str, kind: &str, free: u64| {
        format!(
            r#"{{"name":"{name}","kind":"{kind}","addr":"10.0.0.5:7000","capacity":{},"free":{free}}}"#,
            free * 2
        )
    };
    let records = format!(
        "{{\"entry\":{},\"expires\":4102444800.0}}\n{{\"entry\":{},\"expires\":4102444800.0}}\n{{\"entry\":{},\"expires\":1.0}}",
        entry("main-a", "vmm", 1 << 30),
        entry("mem-b", "memserver", 4 << 30),
        entry("mem-c", "memserver", 2 << 30),
    );
    let mut file = Bytes::default();
    file.u8(0).chunk(records.as_bytes());
    file.0.extend((1u32 << 21).to_le_bytes());
    file.u16(1024).u8(0).u8(1);
    let range = format!(
        r#"{{"kvs":[{{"key":"{}","value":"{}"}},{{"key":"{}","value":"{}"}}]}}"#,
        b64(b"/ferry/hosts/main-a"),
        b64(entry("main-a", "vmm", 1 << 30).as_bytes()),
        b64(b"/ferry/hosts/mem-b"),
        b64(entry("mem-b", "memserver", 4 << 30).as_bytes()),
    );
    let mut etcd = Bytes::default();
    etcd.u8(1).chunk(range.as_bytes());
    etcd.0.extend((1u32 << 21).to_le_bytes());
    etcd.u16(2048).u8(1).u64(1 << 29).u8(2);
    vec![named(t, "records", file.0), named(t, "etcd-range", etcd.0)]
}

/// A tiny standard base64 encoder for the etcd seed (the registry's own
/// is private to it).
mod base64_lite {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

    pub fn encode(b: &[u8]) -> String {
        let mut s = String::new();
        for c in b.chunks(3) {
            let n = (u32::from(c[0]) << 16)
                | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
                | u32::from(*c.get(2).unwrap_or(&0));
            for i in 0..4 {
                if i <= c.len() {
                    s.push(T[(n >> (18 - 6 * i)) as usize & 63] as char);
                } else {
                    s.push('=');
                }
            }
        }
        s
    }
}

/// Every target's seeds, named `TARGET/NAME`.
fn agent_api() -> Vec<Seed> {
    let t = "agent_api";
    let host = r#"{"name":"h2","addr":"10.77.0.2:7700","mem_bytes":1073741824,"free_mem":939524096,"vcpus":8,"free_vcpus":7,"link_bps":1000000000,"vms":[{"spec":{"name":"web","mem_bytes":134217728,"vcpus":1,"workload":"kv","vm_address":"10.77.0.100","serve":"10.77.0.100:7000"},"state":"running","pid":4242,"socket":"/run/ferry/agent/h2/web.sock","uptime_s":12.5,"came_by":"migrated"}]}"#;
    [
        ("q-info", r#"Q{"op":"info"}"#.to_string()),
        ("q-dirty-rates", r#"Q{"op":"dirty-rates"}"#.into()),
        (
            "q-start",
            r#"Q{"op":"start","vm":{"name":"web","mem_bytes":134217728,"vcpus":2,"workload":"compute+dirty:rate=32,wss=32"}}"#.into(),
        ),
        ("q-stop", r#"Q{"op":"stop","name":"web"}"#.into()),
        (
            "q-receive",
            r#"Q{"op":"receive","vm":{"name":"web","mem_bytes":134217728,"vcpus":1,"workload":"idle"},"from":"ferry-h1","token":"00112233445566778899aabbccddeeff"}"#.into(),
        ),
        (
            "q-send",
            r#"Q{"op":"send","name":"web","to":"tcp:10.77.0.2:41234","token":"00112233445566778899aabbccddeeff","mode":"hybrid","verify":true,"postcopy_after":"1|20s","bandwidth":125000000.0}"#.into(),
        ),
        ("q-upgrade", r#"Q{"op":"upgrade","name":"web","binary":"/usr/local/bin/ferry"}"#.into()),
        ("q-store", r#"Q{"op":"store","vm":"big","bytes":671088640}"#.into()),
        (
            "q-send-split",
            r#"Q{"op":"send","name":"big","to":"tcp:10.77.0.2:41234","token":"00112233445566778899aabbccddeeff","mode":"split","split":{"subs":["tcp:10.77.0.3:40001"],"main_budget":1073741824}}"#.into(),
        ),
        ("a-info", format!(r#"A{{"ok":true,"host":{host}}}"#)),
        ("a-error", r#"A{"ok":false,"error":"no room for VM web"}"#.into()),
        ("a-progress", r#"A{"progress":{"round":2,"remaining_pages":1234,"bytes":5678}}"#.into()),
    ]
    .into_iter()
    .map(|(n, l)| named(t, n, l.into_bytes()))
    .collect()
}

pub fn all() -> Vec<Seed> {
    let mut out = Vec::new();
    out.extend(wire_frame());
    out.extend(hello_seeds());
    out.extend(layout_seeds());
    out.extend(control_msg());
    out.extend(pages_seeds());
    out.extend(bulk_stream());
    out.extend(encoded());
    out.extend(codecs());
    out.extend(demand());
    out.extend(memserver());
    out.push(named("vm_state", "real", vm_state_bytes()));
    out.extend(control_json());
    out.extend(service_wire());
    out.extend(timeline());
    out.extend(registry());
    out.extend(agent_api());
    out.extend(nbd::nbd_server());
    out
}
