//! The `ferry` command line: runs VMs and talks to them through their control sockets.

mod bench;
mod delay;
mod fleet;
mod format;
mod handover;
mod lab;
mod load;
mod memserver;
mod migrate;
mod pki;
mod report;
mod run;
mod security;
mod standby;
mod status;
mod uffd_cost;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ferry",
    version,
    about = "A KVM virtual machine monitor built around live migration"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// This host's TLS credentials (ca.pem, cert.pem, key.pem from `ferry
    /// pki issue`) for every link to another host [env: FERRY_TLS_DIR;
    /// default: /etc/ferry/tls].
    #[arg(long, global = true, value_name = "HOSTDIR")]
    tls_dir: Option<PathBuf>,
    /// Plaintext, unauthenticated links: anyone on the network can read
    /// the guest's memory and push a VM into a waiting port [env:
    /// FERRY_INSECURE=1]. For trusted test networks only.
    #[arg(long, global = true, conflicts_with = "tls_dir")]
    insecure: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Boot the test guest with a workload and show its figures live.
    Run(run::RunArgs),
    /// Send requests to a VM's service device from C concurrent clients.
    Load(load::LoadArgs),
    /// Live-migrate a running VM to a destination started with `ferry run --incoming`.
    Migrate(migrate::MigrateArgs),
    /// Move a running VM to a new VMM process on this host (e.g. a newer
    /// ferry) without copying its memory; its control socket path stays.
    Handover(handover::HandoverArgs),
    /// Draw migrations' timelines (from `ferry migrate`) as charts and one
    /// HTML page, with a table comparing them.
    Report(report::ReportArgs),
    /// Run a benchmark suite (results go to bench/results/ with their command).
    Bench(bench::BenchArgs),
    /// Run a memory server: holds pages of split VMs for their main hosts,
    /// advertised in the host registry.
    Memserver(memserver::MemserverArgs),
    /// Run a postcopy safety net: holds the pages a destination still lacks
    /// after a postcopy switch (`ferry migrate --safety-net`) and finishes
    /// the move if the source dies.
    Standby(standby::StandbyArgs),
    /// List the hosts the registry knows (agents, waiting VMMs, memory
    /// servers), dead hosts, and drains in progress.
    Hosts(memserver::HostsArgs),
    /// A fleet's certificate authority and its hosts' certificates (the
    /// mutual TLS every link between hosts speaks).
    #[command(subcommand)]
    Pki(pki::PkiCommand),
    /// Test hosts as network namespaces (for migrations across a real network).
    #[command(subcommand)]
    Lab(lab::LabCommand),
    /// Run this host's agent: registers the host, starts, adopts and moves
    /// its VMs for the fleet (docs/agent.md).
    Agent(fleet::AgentArgs),
    /// The fleet's VMs: start one on a host, list them, stop one.
    #[command(subcommand)]
    Vm(fleet::VmCommand),
    /// Move every VM off a host (to the others, by the registry), within
    /// limits, and never lose one.
    Drain(fleet::DrainArgs),
    /// Hand every VM of a host to a fresh VMM process (a new ferry binary),
    /// copying no guest memory.
    Upgrade(fleet::UpgradeArgs),
    /// Show a running VM's state through its control socket.
    Status {
        /// The VM's control socket (printed by `ferry run`).
        socket: PathBuf,
        /// Print JSON for machines.
        #[arg(long)]
        json: bool,
        /// Include the guest's counters.
        #[arg(long)]
        metrics: bool,
    },
    /// Send a control command to a running VM.
    Ctl {
        /// The VM's control socket.
        socket: PathBuf,
        /// What to do.
        #[arg(value_enum)]
        action: status::Action,
        /// For `dump`: the file to write the guest's non-zero pages to.
        #[arg(long, required_if_eq("action", "dump"))]
        out: Option<PathBuf>,
        /// Print JSON for machines.
        #[arg(long)]
        json: bool,
    },
}

/// A command on which `--tls-dir` would change nothing, and why: it opens
/// no link that speaks TLS itself (a VMM it asks opens its own, with the
/// credentials it was started with).
fn tls_dir_unused(cmd: &Command) -> Option<(&'static str, security::NoLink<'_>)> {
    use security::NoLink;
    match cmd {
        // Placing a split from an etcds:// registry is its one link.
        Command::Migrate(a) if !a.opens_a_link() => Some(("migrate", NoLink::Vmm(a.socket()))),
        // The VMM starts the new process, with its own environment.
        Command::Handover(a) => Some(("handover", NoLink::Vmm(a.socket()))),
        Command::Status { socket, .. } => Some(("status", NoLink::Vmm(socket))),
        Command::Ctl { socket, .. } => Some(("ctl", NoLink::Vmm(socket))),
        Command::Load(_) => Some((
            "load",
            NoLink::Plain("its requests go to the VM's service device in plaintext"),
        )),
        Command::Report(_) => Some(("report", NoLink::Plain("it reads files and opens no link"))),
        _ => None,
    }
}

fn main() -> ExitCode {
    quiet_on_closed_stdout();
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            // FERRY_LOG, else RUST_LOG (e.g. `ferry=debug`: every ferry
            // crate's events, the migration engine's phases among them).
            tracing_subscriber::EnvFilter::try_from_env("FERRY_LOG")
                .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal, not in logs and pipes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if cli.tls_dir.is_some() {
        if let Some((name, why)) = tls_dir_unused(&cli.command) {
            eprintln!("ferry: error: {}", security::tls_dir_refusal(name, why));
            return ExitCode::from(2);
        }
    }
    // The flag, not FERRY_INSECURE=1 (an environment's setting for every
    // command it runs).
    if cli.insecure && std::env::var_os("FERRY_INSECURE").is_none() {
        if let Some((name, why)) = tls_dir_unused(&cli.command) {
            eprintln!("ferry: error: {}", security::insecure_refusal(name, why));
            return ExitCode::from(2);
        }
    }
    security::install(cli.tls_dir, cli.insecure);
    let result = match cli.command {
        Command::Pki(cmd) => pki::pki(cmd),
        Command::Run(args) => run::run(args),
        Command::Load(args) => load::load(args),
        Command::Lab(cmd) => lab::lab(cmd),
        Command::Bench(args) => bench::bench(args),
        Command::Report(args) => report::report(args),
        Command::Migrate(args) => migrate::migrate(args),
        Command::Handover(args) => handover::handover(args),
        Command::Memserver(args) => memserver::memserver(args),
        Command::Standby(args) => standby::standby(args),
        Command::Hosts(args) => memserver::hosts(args),
        Command::Agent(args) => fleet::agent(args),
        Command::Vm(cmd) => fleet::vm(cmd),
        Command::Drain(args) => fleet::drain(args),
        Command::Upgrade(args) => fleet::upgrade(args),
        Command::Status {
            socket,
            json,
            metrics,
        } => status::status(&socket, json, metrics),
        Command::Ctl {
            socket,
            action,
            out,
            json,
        } => status::ctl(&socket, action, out, json),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ferry: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// A reader that went away (`ferry migrate --json | head`) ends the command
/// as it ends other Unix tools, quietly with status 141 (SIGPIPE), instead of
/// a panic: SIGPIPE itself stays ignored, so a VMM or a client writing to a
/// socket whose peer died gets an error it handles, not a kill.
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to std") && msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}
