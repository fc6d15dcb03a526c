//! Postcopy links lost at a precise message: a relay between source and
//! destination reads the frames and cuts at Finished or at the last
//! Complete. To see the frames it needs plaintext, so this binary, and only
//! it, runs with `--insecure`'s security (the same engine paths run over
//! TLS in postcopy.rs, cut by byte count).

mod common;

use std::time::Duration;

use common::postcopy_rig::*;
use ferry_migration::{MigrateOptions, MigrationStats, Mode};

/// A postcopy whose link is lost for good at `cut`, after every page
/// landed: the source gives up reconnecting soon (1.5 s) and is released.
fn lost_at_the_end(cut: Cut) -> MigrationStats {
    let opts = MigrateOptions {
        mode: Mode::Postcopy,
        verify: true,
        reconnect_timeout_ms: 1_500,
        timeout_ms: 1_000,
        ..Default::default()
    };
    let t = std::time::Instant::now();
    // (run_through checks both sides' outcome and that the source's VM
    // never ran again.)
    let (stats, _, _) = run_through(&opts, Some(cut));
    eprintln!("{:?} after {:?}", stats.postcopy, t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(20));
    stats
}

#[test]
fn a_link_cut_with_finished_on_the_wire_releases_the_source() {
    common::insecure();
    if !uffd_usable() {
        return;
    }
    // The destination ended with Finished; the source never read it. It
    // tries to reconnect, finds no destination waiting, and, since every
    // page had been acknowledged, reports the migration done instead of
    // keeping its VM paused for good.
    lost_at_the_end(Cut::AtFinished);
}

#[test]
fn a_link_lost_for_good_after_every_page_landed_ends_both_sides_well() {
    common::insecure();
    if !uffd_usable() {
        return;
    }
    // The link goes down for good with the source's last Complete on it:
    // the destination, with every page, keeps its VM once its source
    // does not come back (it used to stop it), and the source is released.
    lost_at_the_end(Cut::AtLastComplete);
}
