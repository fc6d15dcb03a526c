//! Throughput of one TLS connection on loopback against plain TCP:
//! `cargo run --release -p ferry-tls --example tls_pipe [MiB]`.
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use ferry_tls::pki::{self, Validity};
use ferry_tls::{Credentials, Handshake, TlsSocket};
use rustls::pki_types::ServerName;

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(1024);
    let dir = std::env::temp_dir().join(format!("ferry-tls-pipe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    pki::init_ca(&dir.join("ca"), "bench", Validity::days(1)).unwrap();
    pki::issue(
        &dir.join("ca"),
        "h",
        &dir.join("h"),
        &["127.0.0.1".into()],
        Validity::days(1),
    )
    .unwrap();
    let creds = Credentials::load(&dir.join("h")).unwrap();
    for round in 0..3 {
        for tls in [false, true] {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let at = l.local_addr().unwrap();
            let sc = creds.server_config();
            let rx = std::thread::spawn(move || {
                let (s, _) = l.accept().unwrap();
                let mut buf = vec![0u8; 1 << 20];
                let mut total = 0usize;
                let mut r: Box<dyn Read> = if tls {
                    Box::new(
                        TlsSocket::handshake(s, Handshake::Server(sc), Duration::from_secs(5))
                            .unwrap(),
                    )
                } else {
                    Box::new(s)
                };
                loop {
                    let n = r.read(&mut buf).unwrap();
                    if n == 0 {
                        break;
                    }
                    total += n;
                }
                total
            });
            let tcp = TcpStream::connect(at).unwrap();
            tcp.set_nodelay(true).unwrap();
            let mut w: Box<dyn Write> = if tls {
                let name = ServerName::IpAddress(at.ip().into());
                Box::new(
                    TlsSocket::handshake(
                        tcp,
                        Handshake::Client(creds.client_config(), name),
                        Duration::from_secs(5),
                    )
                    .unwrap(),
                )
            } else {
                Box::new(tcp)
            };
            let chunk = vec![0x5au8; 256 * 1024];
            let t = Instant::now();
            for _ in 0..mib * 4 {
                w.write_all(&chunk).unwrap();
            }
            drop(w);
            let got = rx.join().unwrap();
            let s = t.elapsed().as_secs_f64();
            println!(
                "round {round} {}: {} MiB in {:.3} s = {:.0} MB/s",
                if tls { "tls  " } else { "plain" },
                got >> 20,
                s,
                got as f64 / s / 1e6
            );
        }
    }
}
