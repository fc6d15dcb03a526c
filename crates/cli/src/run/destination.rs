//! A destination's wait: listen for the incoming migration (advertised in
//! the host registry with --advertise) and receive the VM, reconnecting
//! through a postcopy's broken links.

use std::time::Duration;

use anyhow::{Context, Result};
use ferry_migration::defaults;
use ferry_migration::{DestinationStats, Endpoint};
use ferry_vmm::Vm;

use super::RunArgs;

/// Waits at `at` for the VM and receives it; a failure says whether a VM
/// had started here.
pub(super) fn receive(
    vm: &Vm,
    at: &Endpoint,
    args: &RunArgs,
    quiet: bool,
) -> Result<DestinationStats> {
    let incoming = ferry_vmm::migration::WaitingDestination::listen(at)
        .context("cannot listen for the incoming migration")?;
    let token = match args.token.as_deref() {
        Some("auto") => Some(
            ferry_migration::MigrationToken::generate()
                .context("cannot make a migration token")?
                .0,
        ),
        Some("") => anyhow::bail!("--token needs a value, or auto"),
        t => t.map(str::to_string),
    };
    let tls = matches!(at, Endpoint::Tcp(_)) && ferry_migration::transport::credentials().is_some();
    if args.from.is_some() && !tls {
        anyhow::bail!("--from needs a TCP --incoming with TLS: a plaintext peer has no certificate to name it");
    }
    incoming.admit(ferry_migration::transport::Admission {
        from: args.from.clone(),
        token: token.clone(),
    });
    vm.set_waiting(Some(ferry_vmm::Waiting {
        endpoint: incoming.endpoint().to_string(),
        from: args.from.clone(),
        token: token.clone(),
        tls,
    }));
    // Withdrawn (dropped) once a VM arrived.
    let _advert = if args.advertise {
        let registry = ferry_registry::open(
            args.registry.as_deref(),
            crate::security::credentials_for_registry(args.registry.as_deref())?,
        )?;
        let addr = incoming.endpoint().to_string();
        let addr = addr.strip_prefix("tcp:").unwrap_or(&addr).to_string();
        let offer = args.offer.unwrap_or(vm.config().mem_bytes);
        let entry = ferry_registry::HostEntry {
            name: format!("vmm@{addr}"),
            kind: ferry_registry::HostKind::Vmm,
            addr,
            capacity: offer,
            free: offer,
            agent: None,
        };
        Some(ferry_registry::Advertisement::start(
            registry,
            entry,
            ferry_registry::DEFAULT_TTL,
        )?)
    } else {
        None
    };
    if !quiet {
        eprintln!(
            "ferry: waiting for an incoming migration on {}{}{}",
            incoming.endpoint(),
            if tls { " (mutual TLS)" } else { "" },
            args.from
                .as_deref()
                .map(|f| format!(", only from {f}"))
                .unwrap_or_default()
        );
    }
    if let (Some(t), Some("auto")) = (&token, args.token.as_deref()) {
        // The operator hands it to whoever runs `ferry migrate --token`.
        eprintln!("ferry: migration token {t}");
    }
    let got = incoming.receive_with_reconnect(
        vm,
        Duration::from_millis(defaults::TIMEOUT_MS),
        args.reconnect_timeout,
    );
    vm.set_waiting(None);
    let got = match got {
        Ok(got) => got,
        // After a postcopy switch a failure ends a VM that ran
        // here, whether or not pages were missing.
        Err(e) if vm.has_started() => {
            return Err(anyhow::Error::new(e)
                .context("incoming postcopy migration failed; the VM started here is stopped"))
        }
        Err(e) => {
            return Err(
                anyhow::Error::new(e).context("incoming migration failed; no VM was started here")
            )
        }
    };
    if !quiet {
        eprintln!(
            "ferry: migration received ({} pages, {} zero pages, {} rounds, {} verified); VM running",
            got.pages, got.zero_pages, got.rounds, got.verified_pages
        );
        if let Some(f) = &got.postcopy {
            eprintln!(
                "ferry: postcopy faults {} ({} major, p50 {:.0} µs, p99 {:.0} µs; {} absorbed by async PF, {} stopped a vCPU)",
                f.faults, f.major, f.latency_us.p50, f.latency_us.p99,
                f.apf_absorbed.unwrap_or(0), f.blocked
            );
        }
    }
    Ok(got)
}
