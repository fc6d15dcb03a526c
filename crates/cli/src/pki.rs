//! `ferry pki`: a fleet's certificate authority and its hosts'
//! certificates (the files every link's mutual TLS is made from).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Subcommand;
use ferry_tls::pki::{self, Validity, Written};

/// Make a fleet's CA, or a host's certificate from it.
#[derive(Subcommand)]
pub enum PkiCommand {
    /// Make a fleet certificate authority in --dir (ca.pem, ca-key.pem).
    Init {
        /// Where the CA goes (keep ca-key.pem off the hosts).
        #[arg(long)]
        dir: PathBuf,
        /// The CA's name.
        #[arg(long, default_value = "ferry fleet CA")]
        name: String,
        /// Days it is valid.
        #[arg(long, default_value_t = 3650)]
        days: u32,
        /// Print JSON for machines.
        #[arg(long)]
        json: bool,
    },
    /// Issue host NAME a certificate from the CA in --dir into --out
    /// (cert.pem, key.pem, and the CA's ca.pem): the host's --tls-dir.
    Issue {
        /// The host's name (its certificate's DNS name; `--from NAME`
        /// matches it).
        name: String,
        /// The CA's directory.
        #[arg(long)]
        dir: PathBuf,
        /// The host's credentials directory.
        #[arg(long)]
        out: PathBuf,
        /// Another name or address the host is reached at (repeat); peers
        /// check the address they connect to against these.
        #[arg(long = "san")]
        sans: Vec<String>,
        /// Days it is valid.
        #[arg(long, default_value_t = 365, conflicts_with = "not_after")]
        days: u32,
        /// Valid until this date (YYYY-MM-DD, UTC; a past date makes an
        /// expired certificate, for drills and tests).
        #[arg(long, value_parser = parse_date)]
        not_after: Option<time::Date>,
        /// Print JSON for machines.
        #[arg(long)]
        json: bool,
    },
}

fn parse_date(s: &str) -> Result<time::Date, String> {
    let f = time::macros::format_description!("[year]-[month]-[day]");
    time::Date::parse(s, &f).map_err(|e| format!("'{s}' is not a date YYYY-MM-DD: {e}"))
}

pub fn pki(cmd: PkiCommand) -> Result<ExitCode> {
    let (w, json) = match cmd {
        PkiCommand::Init {
            dir,
            name,
            days,
            json,
        } => (
            pki::init_ca(&dir, &name, Validity::days(days))
                .with_context(|| format!("cannot make a CA in {}", dir.display()))?,
            json,
        ),
        PkiCommand::Issue {
            name,
            dir,
            out,
            sans,
            days,
            not_after,
            json,
        } => {
            let validity = match not_after {
                Some(d) => {
                    Validity::until(d.with_hms(23, 59, 59).unwrap_or(d.midnight()).assume_utc())
                }
                None => Validity::days(days),
            };
            (
                pki::issue(&dir, &name, &out, &sans, validity)
                    .with_context(|| format!("cannot issue a certificate for {name}"))?,
                json,
            )
        }
    };
    print(&w, json);
    Ok(ExitCode::SUCCESS)
}

fn print(w: &Written, json: bool) {
    if json {
        println!(
            "{}",
            serde_json::json!({
                "name": w.name,
                "files": w.files,
                "sans": w.sans,
                "not_after": w.not_after,
            })
        );
        return;
    }
    println!("{}: valid until {}", w.name, w.not_after);
    if !w.sans.is_empty() {
        println!("  names   {}", w.sans.join(", "));
    }
    for f in &w.files {
        println!("  wrote   {}", f.display());
    }
}
