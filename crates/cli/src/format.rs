//! Human-readable numbers for live lines and summaries.

/// Bytes as B/KiB/MiB/GiB.
pub fn bytes(v: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = v;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{v:.0} {}", UNITS[i])
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

/// A count with k/M/G suffixes.
pub fn count(v: f64) -> String {
    if v >= 1e9 {
        format!("{:.2} G", v / 1e9)
    } else if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1} k", v / 1e3)
    } else {
        format!("{v:.0} ")
    }
}

/// A quantity in a workload's unit.
pub fn amount(v: f64, unit: &str) -> String {
    match unit {
        "bytes" => bytes(v),
        u => format!("{}{u}", count(v)),
    }
}

/// A per-second rate in a workload's unit.
pub fn rate(v: f64, unit: &str) -> String {
    format!("{}/s", amount(v, unit))
}

/// A duration as a flag takes it and shows its default (`20s`), so a
/// default kept as a `Duration` elsewhere is written once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Secs(pub std::time::Duration);

impl std::fmt::Display for Secs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}s", self.0.as_secs_f64())
    }
}

/// [`parse_duration`] into a [`Secs`].
pub fn parse_secs(text: &str) -> Result<Secs, String> {
    parse_duration(text).map(Secs)
}

/// Parses `10s`, `500ms`, `2m`, `1h` or plain seconds.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    parse_duration_from(text, false)
}

/// Like [`parse_duration`], where 0 also means something (no delay, no
/// tail).
pub fn parse_duration_or_zero(text: &str) -> Result<std::time::Duration, String> {
    parse_duration_from(text, true)
}

fn parse_duration_from(text: &str, zero: bool) -> Result<std::time::Duration, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("'{text}' is not a duration (e.g. 10s, 500ms, 2m)"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1e3,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        _ => {
            return Err(format!(
                "'{text}': unknown unit '{unit}' (use ms, s, m or h)"
            ))
        }
    };
    if !secs.is_finite() || secs < 0.0 || (secs == 0.0 && !zero) || secs > 30.0 * 86400.0 {
        let least = if zero { "0 or more" } else { "more than 0" };
        return Err(format!(
            "'{text}' is out of range ({least}, at most 30 days)"
        ));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

/// A default given in milliseconds, written as a duration flag takes it
/// (`30s`, `1500ms`): the help shows the engine's own default, spelled
/// once in `ferry_migration::defaults`.
pub fn ms_arg(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_default_duration_shows_as_it_parses() {
        let d = Secs(std::time::Duration::from_secs(20));
        assert_eq!(d.to_string(), "20s");
        assert_eq!(parse_secs(&d.to_string()).unwrap(), d);
        let half = Secs(std::time::Duration::from_millis(2500));
        assert_eq!(parse_secs(&half.to_string()).unwrap(), half);
    }

    #[test]
    fn formats_and_parses() {
        assert_eq!(bytes(512.0), "512 B");
        assert_eq!(bytes(3.0 * 1048576.0), "3.0 MiB");
        assert_eq!(rate(2.5e9, "ops"), "2.50 Gops/s");
        assert_eq!(parse_duration("500ms").unwrap().as_millis(), 500);
        assert_eq!(parse_duration("2m").unwrap().as_secs(), 120);
        assert_eq!(parse_duration("3").unwrap().as_secs(), 3);
        assert!(parse_duration("3 parsecs").is_err());
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("-1s").is_err());
        assert_eq!(parse_duration_or_zero("0s").unwrap().as_millis(), 0);
        assert_eq!(parse_duration_or_zero("2s").unwrap().as_secs(), 2);
        assert!(parse_duration_or_zero("-1s").is_err());
        for (ms, text) in [
            (30_000, "30s"),
            (0, "0s"),
            (1_500, "1500ms"),
            (300_000, "300s"),
        ] {
            assert_eq!(ms_arg(ms), text);
            let back = parse_duration_or_zero(&ms_arg(ms)).unwrap();
            assert_eq!(back.as_millis(), u128::from(ms));
        }
    }
}

/// A UTC time as `YYYYMMDD-HHMMSS` (for file names that sort by time).
pub fn utc_stamp(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Days since 1970-01-01 to a civil date (proleptic Gregorian calendar).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod stamp_tests {
    use super::utc_stamp;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn stamps_are_utc_calendar_times() {
        assert_eq!(utc_stamp(UNIX_EPOCH), "19700101-000000");
        // 2000-02-29 (a leap day) 12:34:56 UTC.
        let t = UNIX_EPOCH + Duration::from_secs(951_827_696);
        assert_eq!(utc_stamp(t), "20000229-123456");
        let t = UNIX_EPOCH + Duration::from_secs(1_795_478_400);
        assert_eq!(utc_stamp(t), "20261124-000000");
    }
}

/// A capacity of guest memory (e.g. 512M, 4G; at least a page): a memory
/// server's or a standby's `--capacity`.
pub fn parse_capacity(s: &str) -> Result<u64, String> {
    match ferry_vmm::boot::layout::parse_size(s) {
        Some(v) if v >= 4096 => Ok(v),
        _ => Err(format!("'{s}' is not a capacity (e.g. 512M, 4G)")),
    }
}

/// HOST:PORT or tcp:HOST:PORT: memory servers, standbys and the sources
/// that reach them speak TCP only.
pub fn tcp_endpoint(addr: &str) -> Result<ferry_migration::Endpoint, String> {
    let spec = if addr.starts_with("tcp:") {
        addr.to_string()
    } else {
        format!("tcp:{addr}")
    };
    spec.parse()
}
