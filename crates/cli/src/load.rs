//! `ferry load`: C concurrent clients send GET/SET (or ECHO/NOP) requests to a
//! VM's service device, verify every answer, and record each request's send
//! time and latency.
//!
//! Verification: every value's content is `ferry_value(key, seed)`, so a GET
//! answer is checked byte for byte against the seed it reports, and its
//! checksum against the bytes. Each client writes only its own keys
//! (key % C == client), so it also checks that it reads its own latest writes.
//!
//! The run ends at `--duration` whatever the VM does: connecting waits at
//! most until then, and a request still unanswered [`END_GRACE`] after the
//! end has its connection cut and is counted as unanswered. A refused or
//! timed-out connection is counted as a failed connect, not as a request.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, IsTerminal, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry_vmm::devices::service::wire::{self, Op, Request, Response, Status};
use serde_json::json;

use crate::format;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LoadOp {
    /// GET and SET by --get-ratio (served by the guest's kv workload).
    Mixed,
    /// Answered by the VMM's device alone: the device's own latency.
    Echo,
    /// Answered by a guest worker doing nothing: device + ring + guest wake-up.
    Nop,
}

#[derive(clap::Args)]
pub struct LoadArgs {
    /// The VM's service address (printed by `ferry run`).
    #[arg(long)]
    target: String,
    /// Concurrent clients, one connection each.
    #[arg(long, default_value_t = 8)]
    clients: u32,
    /// How long to send requests (e.g. 10s).
    #[arg(long, default_value = "10s", value_parser = format::parse_duration)]
    duration: Duration,
    /// Stop after this many requests in total (whichever comes first).
    #[arg(long)]
    requests: Option<u64>,
    /// Total requests per second, spread over the clients (default: as fast as answered).
    #[arg(long)]
    rate: Option<f64>,
    /// Share of GETs among GET/SET requests.
    #[arg(long, default_value_t = 0.9)]
    get_ratio: f64,
    /// Use only the first K keys (default: all the guest has).
    #[arg(long)]
    keys: Option<u64>,
    /// What to send.
    #[arg(long, value_enum, default_value_t = LoadOp::Mixed)]
    op: LoadOp,
    /// Write every request (client, send time, latency, op, outcome, send
    /// time since the Unix epoch) here as CSV (`ferry report --load` draws it).
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// How long to wait for the guest to start serving (for its VMM to
    /// listen, then for the guest's kv workload to answer).
    #[arg(long, default_value = "30s", value_parser = format::parse_duration)]
    wait_ready: Duration,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// No live line.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Clone, Copy)]
struct Record {
    send_us: u64,
    latency_us: u32,
    op: u8,
    outcome: Outcome,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    /// Error status, broken connection or no answer within [`ANSWER_WAIT`].
    Error,
    /// Answer whose content or checksum is wrong.
    Wrong,
    /// Still waiting for its answer [`END_GRACE`] after the run's end.
    Unanswered,
}

/// How long a client waits for a connection to open.
const CONNECT_WAIT: Duration = Duration::from_secs(5);
/// How long a request waits for its answer before it counts as an error
/// (and its connection is opened again).
const ANSWER_WAIT: Duration = Duration::from_secs(10);
/// How long after `--duration` the requests still in flight may take to be
/// answered; then their connections are cut. A run ends at most this late.
const END_GRACE: Duration = Duration::from_millis(500);

struct Shared {
    stop: AtomicBool,
    /// Set when the run cut the connections still waiting at its end.
    cut: AtomicBool,
    sent: AtomicU64,
    /// Connections opened again after one broke.
    reconnects: AtomicU64,
    /// Connection attempts refused or timed out.
    connect_failures: AtomicU64,
    limit: u64,
    start: Instant,
    /// When no client starts anything new (start + --duration).
    end: Instant,
    /// Each client's open connection, so the run's end can cut those still
    /// waiting for an answer.
    conns: Vec<Mutex<Option<TcpStream>>>,
}

impl Shared {
    /// Time left until the end (zero once it passed).
    fn left(&self) -> Duration {
        self.end.saturating_duration_since(Instant::now())
    }

    /// Keeps a handle on client `id`'s connection (None: it has none);
    /// false if the run already cut its connections (the client stops).
    fn hold(&self, id: u64, conn: Option<&TcpStream>) -> bool {
        let mut slot = self.conns[id as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *slot = conn.and_then(|c| c.try_clone().ok());
        drop(slot);
        // Read after storing: either the cut saw this connection, or this
        // client sees the cut.
        !self.cut.load(Ordering::SeqCst)
    }

    /// Cuts every connection still open: their clients' reads end now.
    fn cut_all(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for slot in &self.conns {
            if let Some(c) = slot.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
    }
}

struct ClientCfg {
    id: u64,
    clients: u64,
    keys: u64,
    value_size: usize,
    get_ratio: f64,
    interval: Option<Duration>,
    op: LoadOp,
}

fn connect(addr: SocketAddr, wait: Duration) -> std::io::Result<(BufReader<TcpStream>, TcpStream)> {
    // connect_timeout refuses a zero wait.
    let s = TcpStream::connect_timeout(&addr, wait.max(Duration::from_millis(1)))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(ANSWER_WAIT))?;
    let w = s.try_clone()?;
    Ok((BufReader::new(s), w))
}

fn call(r: &mut BufReader<TcpStream>, w: &mut TcpStream, req: &Request) -> Result<Response> {
    w.write_all(&req.encode())?;
    let body = wire::read_frame(r, wire::MAX_BODY)?.context("connection closed")?;
    Ok(Response::decode(&body)?)
}

/// Asks the guest for its table size until it serves, at most `wait`.
fn info(addr: SocketAddr, wait: Duration) -> Result<(u64, usize)> {
    let deadline = Instant::now() + wait;
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    let (mut r, mut w) = loop {
        match connect(addr, CONNECT_WAIT.min(left())) {
            Ok(c) => break c,
            // Nothing listens yet (a VMM just started): wait for it.
            Err(e)
                if e.kind() == std::io::ErrorKind::ConnectionRefused
                    && Instant::now() + Duration::from_millis(100) < deadline =>
            {
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "cannot connect to {addr} (waited up to --wait-ready {:.1} s)",
                        wait.as_secs_f64()
                    )
                })
            }
        }
    };
    loop {
        r.get_ref()
            .set_read_timeout(Some(ANSWER_WAIT.min(left())))?;
        let resp = call(&mut r, &mut w, &Request::new(Op::Info, 0, 0, 0)).with_context(|| {
            format!(
                "the VM at {addr} did not tell its table size within --wait-ready {:.1} s",
                wait.as_secs_f64()
            )
        })?;
        match resp.status {
            Status::Ok => return Ok((resp.key, resp.seed as usize)),
            Status::NotReady if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100))
            }
            s => bail!(
                "the VM at {addr} does not serve kv requests: {s:?}: {}",
                resp.message()
            ),
        }
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn client(addr: SocketAddr, cfg: ClientCfg, shared: Arc<Shared>, out: Arc<Mutex<Vec<Record>>>) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (cfg.id + 1).wrapping_mul(0x2545_F491_4F6C_DD1D));
    let mut written: HashMap<u64, u64> = HashMap::new();
    let mut conn: Option<(BufReader<TcpStream>, TcpStream)> = None;
    let mut opened = false;
    let mut next_send = Instant::now();
    let mut seq = 0u64;
    let own_keys = cfg.keys / cfg.clients + u64::from(cfg.id < cfg.keys % cfg.clients);
    while !shared.stop.load(Ordering::Relaxed) && !shared.left().is_zero() {
        if conn.is_none() {
            match connect(addr, CONNECT_WAIT.min(shared.left())) {
                Ok(c) => {
                    if !shared.hold(cfg.id, Some(&c.1)) {
                        break;
                    }
                    if opened {
                        shared.reconnects.fetch_add(1, Ordering::Relaxed);
                    }
                    opened = true;
                    conn = Some(c);
                }
                Err(_) => {
                    shared.connect_failures.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(50).min(shared.left()));
                    continue;
                }
            }
        }
        if let Some(iv) = cfg.interval {
            let now = Instant::now();
            if next_send > now {
                std::thread::sleep((next_send - now).min(shared.left()));
                if shared.left().is_zero() {
                    break;
                }
            }
            next_send += iv;
        }
        if shared.sent.fetch_add(1, Ordering::Relaxed) >= shared.limit {
            break;
        }
        seq += 1;
        let id = (cfg.id << 40) | seq;
        let req = match cfg.op {
            LoadOp::Echo => Request {
                op: Op::Echo,
                id,
                key: 0,
                seed: seq,
                value: vec![0x5a; 16],
            },
            LoadOp::Nop => Request::new(Op::Nop, id, 0, 0),
            LoadOp::Mixed if own_keys == 0 || rng.unit() < cfg.get_ratio => {
                Request::new(Op::Get, id, rng.next() % cfg.keys, 0)
            }
            LoadOp::Mixed => {
                let key = (rng.next() % own_keys) * cfg.clients + cfg.id;
                let seed = id;
                Request {
                    op: Op::Set,
                    id,
                    key,
                    seed,
                    value: wire::value(cfg.value_size, key, seed),
                }
            }
        };
        let Some((r, w)) = conn.as_mut() else {
            break; // opened above
        };
        let sent_at = Instant::now();
        let result = call(r, w, &req);
        let latency = sent_at.elapsed();
        let outcome = match result {
            // The run's end cut it while it waited.
            Err(_) if shared.cut.load(Ordering::SeqCst) => Outcome::Unanswered,
            Err(_) => {
                // Broken, or no answer within ANSWER_WAIT: open another.
                conn = None;
                shared.hold(cfg.id, None);
                Outcome::Error
            }
            Ok(resp) => check(&req, &resp, cfg.value_size, &mut written),
        };
        let rec = Record {
            send_us: sent_at.duration_since(shared.start).as_micros() as u64,
            latency_us: latency.as_micros().min(u32::MAX as u128) as u32,
            op: req.op as u8,
            outcome,
        };
        out.lock().unwrap_or_else(|e| e.into_inner()).push(rec);
    }
}

fn check(
    req: &Request,
    resp: &Response,
    value_size: usize,
    written: &mut HashMap<u64, u64>,
) -> Outcome {
    if resp.status != Status::Ok || resp.id != req.id {
        return Outcome::Error;
    }
    match req.op {
        Op::Get => {
            let good = resp.key == req.key
                && resp.value.len() == value_size
                && wire::csum(&resp.value) == resp.checksum
                && resp.value == wire::value(value_size, req.key, resp.seed)
                && written.get(&req.key).is_none_or(|&s| s == resp.seed);
            if good {
                Outcome::Ok
            } else {
                Outcome::Wrong
            }
        }
        Op::Set => {
            if resp.checksum == wire::csum(&req.value) {
                written.insert(req.key, req.seed);
                Outcome::Ok
            } else {
                Outcome::Wrong
            }
        }
        Op::Echo => {
            if resp.value == req.value && resp.seed == req.seed {
                Outcome::Ok
            } else {
                Outcome::Wrong
            }
        }
        _ => Outcome::Ok,
    }
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

pub fn load(args: LoadArgs) -> Result<ExitCode> {
    if args.clients == 0 || args.clients > 4096 {
        bail!("--clients must be 1 to 4096");
    }
    if !(0.0..=1.0).contains(&args.get_ratio) {
        bail!("--get-ratio must be between 0 and 1");
    }
    if args.rate.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
        bail!("--rate must be a positive number of requests per second");
    }
    let addr = args
        .target
        .to_socket_addrs()
        .with_context(|| format!("--target {}: not an address (use HOST:PORT)", args.target))?
        .next()
        .with_context(|| format!("--target {} resolves to nothing", args.target))?;
    let (mut keys, value_size) = match args.op {
        LoadOp::Mixed => info(addr, args.wait_ready)?,
        _ => (1, 0),
    };
    if let Some(k) = args.keys {
        if k == 0 || k > keys {
            bail!("--keys {k}: the guest has keys 0..{keys}");
        }
        keys = k;
    }
    let start = Instant::now();
    let shared = Arc::new(Shared {
        stop: AtomicBool::new(false),
        cut: AtomicBool::new(false),
        sent: AtomicU64::new(0),
        reconnects: AtomicU64::new(0),
        connect_failures: AtomicU64::new(0),
        limit: args.requests.unwrap_or(u64::MAX),
        start,
        end: start + args.duration,
        conns: (0..args.clients).map(|_| Mutex::new(None)).collect(),
    });
    let records: Vec<Arc<Mutex<Vec<Record>>>> = (0..args.clients)
        .map(|_| Arc::new(Mutex::new(Vec::new())))
        .collect();
    let mut threads = Vec::new();
    for (i, rec) in records.iter().enumerate() {
        let cfg = ClientCfg {
            id: i as u64,
            clients: args.clients as u64,
            keys,
            value_size,
            get_ratio: args.get_ratio,
            interval: args
                .rate
                .map(|r| Duration::from_secs_f64(args.clients as f64 / r)),
            op: args.op,
        };
        let (s, r) = (shared.clone(), rec.clone());
        threads.push(
            std::thread::Builder::new()
                .name(format!("client{i}"))
                .spawn(move || client(addr, cfg, s, r))?,
        );
    }
    let live = !args.quiet && std::io::stderr().is_terminal();
    let mut seen = vec![0usize; records.len()];
    let mut last = Instant::now();
    while shared.start.elapsed() < args.duration && threads.iter().any(|t| !t.is_finished()) {
        std::thread::sleep(Duration::from_millis(50));
        if live && last.elapsed() >= Duration::from_millis(500) {
            let mut lat = Vec::new();
            for (i, r) in records.iter().enumerate() {
                let r = r.lock().unwrap_or_else(|e| e.into_inner());
                lat.extend(r[seen[i]..].iter().map(|x| x.latency_us));
                seen[i] = r.len();
            }
            lat.sort_unstable();
            let rate = lat.len() as f64 / last.elapsed().as_secs_f64();
            eprint!(
                "\r\x1b[2K[{:6.1}s] {:>9.0} req/s  p50 {} us  p99 {} us",
                shared.start.elapsed().as_secs_f64(),
                rate,
                percentile(&lat, 0.5),
                percentile(&lat, 0.99)
            );
            last = Instant::now();
        }
    }
    shared.stop.store(true, Ordering::Relaxed);
    // Requests in flight get END_GRACE to be answered; then their
    // connections are cut, so no client outlives the run by more.
    let grace = Instant::now() + END_GRACE;
    while Instant::now() < grace && threads.iter().any(|t| !t.is_finished()) {
        std::thread::sleep(Duration::from_millis(5));
    }
    shared.cut_all();
    for t in threads {
        let _ = t.join();
    }
    if live {
        eprint!("\r\x1b[2K");
    }
    let elapsed = shared.start.elapsed().as_secs_f64();
    let start_unix_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
        - elapsed;
    let mut all: Vec<(usize, Record)> = Vec::new();
    for (i, r) in records.iter().enumerate() {
        all.extend(
            r.lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .map(|x| (i, *x)),
        );
    }
    if let Some(path) = &args.out {
        let mut f = BufWriter::new(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create {}", path.display()))?,
        );
        // send_unix_us lines the requests up with a migration's timeline.
        writeln!(f, "client,send_us,latency_us,op,outcome,send_unix_us")?;
        let base_us = (start_unix_s * 1e6) as u64;
        let mut sorted = all.clone();
        sorted.sort_by_key(|(_, r)| r.send_us);
        for (c, r) in &sorted {
            let op = Op::from_u8(r.op).map_or("?".to_string(), |o| format!("{o:?}").to_lowercase());
            let outcome = match r.outcome {
                Outcome::Ok => "ok",
                Outcome::Error => "error",
                Outcome::Wrong => "wrong",
                Outcome::Unanswered => "unanswered",
            };
            writeln!(
                f,
                "{c},{},{},{op},{outcome},{}",
                r.send_us,
                r.latency_us,
                base_us + r.send_us
            )?;
        }
        f.flush()?;
    }
    let mut lat: Vec<u32> = all
        .iter()
        .filter(|(_, r)| r.outcome == Outcome::Ok)
        .map(|(_, r)| r.latency_us)
        .collect();
    lat.sort_unstable();
    let count = |o: Outcome| all.iter().filter(|(_, r)| r.outcome == o).count();
    let by_op = |op: Op| all.iter().filter(|(_, r)| r.op == op as u8).count();
    let (errors, wrong) = (count(Outcome::Error), count(Outcome::Wrong));
    let unanswered = count(Outcome::Unanswered);
    let connect_failures = shared.connect_failures.load(Ordering::Relaxed);
    let summary = json!({
        "target": addr.to_string(),
        "clients": args.clients,
        "op": format!("{:?}", args.op).to_lowercase(),
        "keys": keys,
        "value_bytes": value_size,
        "duration_s": elapsed,
        // When send_us counts from (this host's clock).
        "start_unix_s": start_unix_s,
        "requests": all.len(),
        "gets": by_op(Op::Get),
        "sets": by_op(Op::Set),
        "throughput_rps": all.len() as f64 / elapsed,
        "latency_us": {
            "p50": percentile(&lat, 0.5),
            "p90": percentile(&lat, 0.9),
            "p99": percentile(&lat, 0.99),
            "max": lat.last().copied().unwrap_or(0),
        },
        "errors": errors,
        "wrong_values": wrong,
        // Cut at the end, END_GRACE after --duration, still unanswered.
        "unanswered": unanswered,
        "reconnects": shared.reconnects.load(Ordering::Relaxed),
        "connect_failures": connect_failures,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        let l = &summary["latency_us"];
        println!("── ferry load summary ────────────────────────────────────────────");
        println!(
            "target       {addr}, {} clients, op {}",
            args.clients,
            summary["op"].as_str().unwrap_or("")
        );
        println!(
            "requests     {} in {elapsed:.2} s: {:.0} req/s ({} GET, {} SET)",
            all.len(),
            all.len() as f64 / elapsed,
            summary["gets"],
            summary["sets"]
        );
        println!(
            "latency      p50 {} us  p90 {} us  p99 {} us  max {} us",
            l["p50"], l["p90"], l["p99"], l["max"]
        );
        println!(
            "errors       {errors}   wrong values {wrong}   unanswered at the end {unanswered}   \
             reconnects {}   failed connects {connect_failures}",
            summary["reconnects"]
        );
    }
    Ok(
        if errors == 0 && wrong == 0 && unanswered == 0 && connect_failures == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(3)
        },
    )
}
