//! The flags as the engine's options: no flag gives the engine's own
//! defaults, --share-link and --own-link, auto-converge's tuning and its
//! checks.

use super::*;
use clap::Parser;

/// `ferry migrate SOCK --to tcp:127.0.0.1:1` with `flags` added, as
/// the engine's options.
fn parsed(flags: &[&str]) -> Result<MigrateOptions> {
    let argv = ["ferry", "migrate", "SOCK", "--to", "tcp:127.0.0.1:1"];
    let cli = crate::Cli::try_parse_from(argv.iter().chain(flags))?;
    match cli.command {
        crate::Command::Migrate(args) => args.options(),
        _ => anyhow::bail!("not parsed as `ferry migrate`"),
    }
}

#[test]
fn no_flags_give_the_engines_own_defaults() {
    // The defaults live in ferry_migration::options alone: a flag that
    // restated one (and drifted) would show here.
    assert_eq!(parsed(&[]).unwrap(), MigrateOptions::default());
}

#[test]
fn share_link_is_the_default_and_own_link_turns_it_off() {
    assert!(parsed(&["--share-link"]).unwrap().share_link);
    assert!(parsed(&[]).unwrap().share_link);
    assert!(!parsed(&["--own-link"]).unwrap().share_link);
    assert!(parsed(&["--own-link", "--share-link"]).is_err());
    // Postcopy's push shares the link too.
    for mode in ["hybrid", "postcopy"] {
        assert!(
            parsed(&["--share-link", "--mode", mode])
                .unwrap()
                .share_link
        );
    }
}

#[test]
fn auto_converge_flags_reach_the_options_and_are_checked() {
    let o = parsed(&[
        "--auto-converge-trigger",
        "0.8",
        "--auto-converge-initial",
        "40",
        "--auto-converge-step",
        "5",
        "--auto-converge-max",
        "80",
    ])
    .unwrap();
    let want = AutoConverge {
        trigger_ratio: 0.8,
        initial_pct: 40,
        step_pct: 5,
        max_pct: 80,
    };
    assert_eq!(o.auto_converge_tuning, want);
    assert!(o.auto_converge);
    let off = parsed(&["--no-auto-converge"]).unwrap();
    assert!(!off.auto_converge);
    let err = parsed(&["--auto-converge-trigger", "0"]).unwrap_err();
    assert!(err.to_string().contains("trigger ratio"), "{err}");
    let err = parsed(&["--auto-converge-max", "100"]).unwrap_err();
    assert!(err.to_string().contains("max throttle"), "{err}");
    let err = parsed(&["--auto-converge-initial", "60", "--auto-converge-max", "50"]).unwrap_err();
    assert!(err.to_string().contains("above its max"), "{err}");
}
