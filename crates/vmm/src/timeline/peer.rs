//! The destination's timeline lines, as the source takes them into its own
//! file: they come from the peer, so each is checked before it is written.
//! Only what a destination writes passes, a `sample` or an `event` of the
//! `destination` side at a finite time, one JSON object per line, within
//! a count and a length; each is written again by this side's serializer,
//! so a peer cannot add a header or a summary of its own, speak for the
//! source, or break a line in two. What is dropped is counted, and said in
//! the source's own timeline.

use serde_json::Value;

/// Most lines taken from a destination: 10 ms samples for over five hours.
pub const MAX_PEER_LINES: usize = 2_000_000;

/// Longest line taken (a sample with the CPU of a few hundred threads
/// is a few KiB).
pub const MAX_PEER_LINE: usize = 64 << 10;

/// The lines that passed, and how many did not.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PeerLines {
    /// JSON lines, each ending in a newline, as this side wrote them.
    pub lines: Vec<u8>,
    /// Lines dropped.
    pub dropped: usize,
    /// Why the first dropped line was.
    pub first_why: Option<String>,
}

/// Checks a destination's timeline, line by line (see the module header).
pub fn check(raw: &[u8]) -> PeerLines {
    check_within(raw, MAX_PEER_LINES, MAX_PEER_LINE)
}

/// [`check`] with the limits given.
fn check_within(raw: &[u8], max_lines: usize, max_line: usize) -> PeerLines {
    let mut out = PeerLines::default();
    let mut kept = 0usize;
    for line in raw.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let verdict = if kept >= max_lines {
            Err(format!("more than {max_lines} lines"))
        } else if line.len() > max_line {
            Err(format!(
                "a line of {} bytes (at most {max_line})",
                line.len()
            ))
        } else {
            one(line)
        };
        match verdict {
            Ok(v) => {
                // Serializing a Value cannot fail, and escapes every
                // control character inside strings: one line stays one.
                let _ = serde_json::to_writer(&mut out.lines, &v);
                out.lines.push(b'\n');
                kept += 1;
            }
            Err(why) => {
                out.dropped += 1;
                out.first_why.get_or_insert(why);
            }
        }
    }
    out
}

/// One line, if it is one a destination writes.
fn one(line: &[u8]) -> Result<Value, String> {
    let v: Value = serde_json::from_slice(line).map_err(|e| format!("not JSON ({e})"))?;
    if !v.is_object() {
        return Err("not a JSON object".into());
    }
    match v["type"].as_str() {
        Some("sample" | "event") => {}
        other => {
            return Err(format!(
                "a line of type {other:?} (a destination sends samples and events)"
            ))
        }
    }
    if v["side"] != "destination" {
        return Err(format!(
            "a line of side {} (not the destination's)",
            v["side"]
        ));
    }
    if !v["t"].as_f64().is_some_and(f64::is_finite) {
        return Err("a line without a time".into());
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::Recorder;
    use serde_json::json;

    const GOOD: &str = r#"{"type":"sample","side":"destination","t":100.5,"running":true}"#;

    #[test]
    fn only_a_destinations_samples_and_events_pass_one_line_each() {
        let raw = [
            GOOD,
            r#"{"type":"event","side":"destination","t":100.6,"what":"started","detail":""}"#,
            r#"{"type":"summary","ok":true,"stats":{"downtime_ms":0.1}}"#,
            r#"{"type":"header","t":1}"#,
            r#"{"type":"sample","side":"source","t":100.7}"#,
            r#"{"type":"sample","side":"destination"}"#,
            r#"{"type":"sample","side":"destination","t":"soon"}"#,
            r#"[1,2,3]"#,
            "not json at all",
            // A line that is two: the second half would be a summary.
            r#"{"type":"sample","side":"destination","t":1}{"type":"summary","ok":true}"#,
            "\r\n",
            // The last line without its newline still passes, with one.
            r#"{"type":"event","side":"destination","t":101,"what":"x\ny","detail":""}"#,
        ]
        .join("\n");
        let got = check(raw.as_bytes());
        assert_eq!(got.dropped, 9, "{:?}", got.first_why);
        assert!(got.first_why.unwrap().contains("summary"));
        let lines: Vec<Value> = got
            .lines
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3);
        assert!(lines.iter().all(|l| l["side"] == "destination"));
        assert_eq!(lines[2]["what"], "x\ny");
        assert!(got.lines.ends_with(b"\n"));
    }

    #[test]
    fn counts_and_lengths_are_bounded() {
        let raw = format!("{GOOD}\n").repeat(10);
        let got = check_within(raw.as_bytes(), 4, MAX_PEER_LINE);
        assert_eq!(
            (got.lines.split(|&b| b == b'\n').count() - 1, got.dropped),
            (4, 6)
        );
        assert!(got.first_why.unwrap().contains("more than 4 lines"));
        let long = format!(
            r#"{{"type":"event","side":"destination","t":1,"what":"{}"}}"#,
            "x".repeat(100)
        );
        let got = check_within(long.as_bytes(), 4, 64);
        assert_eq!((got.lines.len(), got.dropped), (0, 1));
    }

    #[test]
    fn a_destination_cannot_write_the_sources_summary() {
        let rec = Recorder::new("source");
        let forged = format!(
            "{GOOD}\n{}\n{}",
            r#"{"type":"summary","ok":true,"stats":{"downtime_ms":0.001}}"#,
            r#"{"type":"sample","side":"source","t":100,"running":true}"#
        );
        rec.set_peer_lines(forged.into_bytes());
        let dir = std::env::temp_dir().join(format!("ferry-peer-timeline-{}", std::process::id()));
        let path = dir.join("t.jsonl");
        rec.write(
            &path,
            json!({"type": "header"}),
            json!({"type": "summary", "ok": false, "error": "it failed"}),
        )
        .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| {
                serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("{l:?} is not one JSON object: {e}"))
            })
            .collect();
        let summaries: Vec<&Value> = lines.iter().filter(|l| l["type"] == "summary").collect();
        assert_eq!(summaries.len(), 1, "{text}");
        assert_eq!(summaries[0]["error"], "it failed");
        assert_eq!(lines.last().unwrap()["type"], "summary");
        // The source's own lines are only its own.
        assert!(!lines
            .iter()
            .any(|l| l["type"] == "sample" && l["side"] == "source"));
        // The drop is told in the source's lines.
        assert!(lines.iter().any(|l| l["type"] == "event"
            && l["side"] == "source"
            && l["detail"].as_str().unwrap().contains("dropped 2")));
    }
}
