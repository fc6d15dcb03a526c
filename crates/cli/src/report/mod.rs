//! `ferry report RUN…`: migrations' timelines (from `ferry migrate`) drawn
//! as PNG charts and one self-contained HTML page (the images inline, no
//! network needed), with a table comparing the runs.

mod charts;
pub mod data;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use plotters::style::RGBColor;

use charts::{Chart, Layer, Marker};
use data::{Run, Side, BIN};

#[derive(clap::Args)]
pub struct ReportArgs {
    /// Timelines written by `ferry migrate` (its summary names the file).
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// `ferry load --out` logs, one per run in the same order (or fewer):
    /// their requests make the latency charts.
    #[arg(long)]
    load: Vec<PathBuf>,
    /// Where the page and the PNGs go.
    #[arg(long, default_value = "ferry-report")]
    out: PathBuf,
    /// Page title.
    #[arg(long, default_value = "ferry migration report")]
    title: String,
    /// TrueType font for the charts (default: DejaVu Sans from the system).
    #[arg(long)]
    font: Option<PathBuf>,
    /// Print the comparison table as JSON.
    #[arg(long)]
    json: bool,
}

/// The charts of every run, in the page's order: (file suffix, what it shows).
const CHARTS: [(&str, &str); 6] = [
    ("latency", "request latency"),
    ("throughput", "workload throughput"),
    ("exec", "guest execution ratio"),
    ("faults", "faults by kind"),
    ("bandwidth", "bandwidth per stream"),
    ("phases", "phase markers"),
];

pub fn report(args: ReportArgs) -> Result<ExitCode> {
    if args.load.len() > args.runs.len() {
        bail!(
            "{} --load logs for {} runs: give at most one per run, in the runs' order",
            args.load.len(),
            args.runs.len()
        );
    }
    let mut runs = Vec::new();
    for (i, p) in args.runs.iter().enumerate() {
        let mut r = Run::read(p)?;
        if let Some(l) = args.load.get(i) {
            r.add_load(l)?;
        }
        runs.push(r);
    }
    // Two runs of the same file name get told apart.
    for i in 0..runs.len() {
        if runs[..i].iter().any(|r| r.name == runs[i].name) {
            runs[i].name = format!("{}-{}", runs[i].name, i + 1);
        }
    }
    charts::load_font(args.font.as_deref())?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let mut pngs = Vec::new();
    for r in &runs {
        pngs.push(draw_run(r, &args.out)?);
    }
    let figures: Vec<serde_json::Value> = runs.iter().map(Run::figures).collect();
    let page = html(&args.title, &runs, &figures, &pngs)?;
    let index = args.out.join("index.html");
    std::fs::write(&index, page).with_context(|| format!("cannot write {}", index.display()))?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "page": index, "runs": figures,
                "pngs": pngs.iter().flatten().collect::<Vec<_>>(),
            }))?
        );
    } else {
        print_table(&figures);
        println!(
            "report       {} ({} charts)",
            index.display(),
            pngs.iter().map(Vec::len).sum::<usize>()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The moments worth a line on every chart.
fn markers(r: &Run) -> Vec<Marker> {
    let gray = RGBColor(150, 150, 150);
    let mut out = Vec::new();
    for e in &r.events {
        let (label, color) = match (e.side, e.what.as_str(), e.detail.as_str()) {
            (Side::Source, "open", _) => ("start".to_string(), gray),
            (Side::Source, "round", d) => (
                format!("r{}", d.split(':').next().unwrap_or("")),
                RGBColor(190, 190, 190),
            ),
            (Side::Source, "phase", "switching") => ("pause".into(), RGBColor(214, 39, 40)),
            (Side::Source, "started", _) => ("runs there".into(), RGBColor(44, 160, 44)),
            (Side::Source, "finished", _) => ("all pages".into(), RGBColor(31, 119, 180)),
            (_, "link_broken", _) => ("link broken".into(), RGBColor(255, 127, 14)),
            (Side::Source, "resumed", _) => ("resumed".into(), RGBColor(255, 127, 14)),
            (Side::Source, "failed", _) => ("failed".into(), RGBColor(214, 39, 40)),
            _ => continue,
        };
        out.push(Marker {
            t: e.t,
            label,
            color,
        });
    }
    out
}

/// Draws one run's charts; returns their paths.
fn draw_run(r: &Run, out: &Path) -> Result<Vec<PathBuf>> {
    let marks = markers(r);
    let span = r.span();
    let path = |k: &str| out.join(format!("{}-{k}.png", r.name));
    let mut made = Vec::new();
    let title = |what: &str| format!("{}: {what} ({})", r.name, r.mode());

    // Request latency: every request as a dot, the 100 ms mean as a line.
    let mut layers = Vec::new();
    if r.requests.is_empty() {
        layers.push(Layer::Line {
            name: "service mean, 100 ms (in the VMM: post to answer)".into(),
            points: r.latency_mean(),
        });
    } else {
        // Beyond ~200k dots the picture is the same and drawing is slow.
        let step = (r.requests.len() / 200_000).max(1);
        layers.push(Layer::Dots {
            name: "each request (ferry load)".into(),
            points: r
                .requests
                .iter()
                .step_by(step)
                .filter(|q| q.ok)
                .map(|q| (q.t, q.ms))
                .collect(),
        });
        layers.push(Layer::Line {
            name: "100 ms mean".into(),
            points: r.latency_mean(),
        });
    }
    let chart =
        |title: String, y: &'static str, layers: Vec<Layer>, note: Option<&str>, unit: bool| {
            Chart {
                title,
                y_label: y,
                x_range: span,
                layers,
                markers: &marks,
                empty_note: note.map(str::to_string),
                unit_y: unit,
            }
        };
    let p = path("latency");
    charts::draw(
        &p,
        &chart(
            title("request latency"),
            "ms",
            layers,
            Some("no requests: the VM has no request service under load"),
            false,
        ),
    )?;
    made.push(p);

    let mut layers = vec![Layer::Line {
        name: "guest workload progress / s".into(),
        points: r.progress_rate(),
    }];
    if let Some(a) = r.answered_rate() {
        layers.push(Layer::Line {
            name: "requests answered / s".into(),
            points: a,
        });
    }
    let p = path("throughput");
    charts::draw(
        &p,
        &chart(
            title("workload throughput per 100 ms"),
            "per second",
            layers,
            None,
            false,
        ),
    )?;
    made.push(p);

    let p = path("exec");
    charts::draw(
        &p,
        &chart(
            title("guest execution ratio per 100 ms"),
            "share of wall time",
            vec![Layer::Line {
                name: "vCPUs running (paused 0, less throttle and fault waits)".into(),
                points: r.exec_ratio(),
            }],
            None,
            true,
        ),
    )?;
    made.push(p);

    let bins = r.fault_bins();
    let per = |f: fn(&data::FaultBin) -> f64| bins.iter().map(|b| (b.t, f(b))).collect::<Vec<_>>();
    let layers = if bins.is_empty() {
        Vec::new()
    } else {
        vec![
            Layer::Line {
                name: "major (fetched)".into(),
                points: per(|b| b.major),
            },
            Layer::Line {
                name: "minor (arrived)".into(),
                points: per(|b| b.minor),
            },
            Layer::Line {
                name: "zero-filled".into(),
                points: per(|b| b.zero),
            },
            Layer::Line {
                name: "async (KVM workers)".into(),
                points: per(|b| b.async_worker),
            },
        ]
    };
    let p = path("faults");
    charts::draw(
        &p,
        &chart(
            title("destination faults per 100 ms"),
            "faults",
            layers,
            Some("no faults: every page arrived before the VM started there (precopy)"),
            false,
        ),
    )?;
    made.push(p);

    let layers = r
        .bandwidth()
        .into_iter()
        .map(|(name, pts)| Layer::Line {
            name,
            points: pts
                .into_iter()
                .map(|(t, b)| (t, b / (1 << 20) as f64))
                .collect(),
        })
        .collect();
    let p = path("bandwidth");
    charts::draw(
        &p,
        &chart(
            title("bandwidth per stream"),
            "MiB/s",
            layers,
            Some("no stream carried 1 MiB"),
            false,
        ),
    )?;
    made.push(p);

    // Where the migration was: its phase as a step line (0 before, 1
    // copying, 2 paused, 3 postcopy, 4 done) on both sides.
    let mut layers = Vec::new();
    for (side, name) in [(Side::Source, "source"), (Side::Destination, "destination")] {
        let mut pts = Vec::new();
        let mut level = 0.0;
        for e in r
            .events
            .iter()
            .filter(|e| e.side == side && e.what == "phase")
        {
            let next = match e.detail.as_str() {
                "running" => 0.25,
                "switching" => 0.5,
                "postcopy" => 0.75,
                "paused" => 0.6,
                "succeeded" => 1.0,
                _ => 0.0,
            };
            pts.push((e.t, level));
            pts.push((e.t, next));
            level = next;
        }
        if !pts.is_empty() {
            pts.insert(0, (span.0, 0.0));
            pts.push((span.1, level));
            layers.push(Layer::Line {
                name: format!("{name} (.25 copying, .5 paused, .75 postcopy, 1 done)"),
                points: pts,
            });
        }
    }
    let p = path("phases");
    charts::draw(&p, &chart(title("phases"), "phase", layers, None, true))?;
    made.push(p);
    Ok(made)
}

fn fmt_opt(v: &serde_json::Value, scale: f64, digits: usize) -> String {
    v.as_f64()
        .map_or("–".into(), |x| format!("{:.*}", digits, x * scale))
}

/// The comparison table's rows: (header, cell per run).
fn table_rows(figures: &[serde_json::Value]) -> Vec<(&'static str, Vec<String>)> {
    let col =
        |k: &str, scale: f64, d: usize| figures.iter().map(|f| fmt_opt(&f[k], scale, d)).collect();
    vec![
        (
            "run",
            figures
                .iter()
                .map(|f| f["run"].as_str().unwrap_or("").to_string())
                .collect(),
        ),
        (
            "mode",
            figures
                .iter()
                .map(|f| f["mode"].as_str().unwrap_or("").to_string())
                .collect(),
        ),
        (
            "result",
            figures
                .iter()
                .map(|f| {
                    if f["ok"] == true {
                        "ok".into()
                    } else {
                        format!("failed: {}", f["error"].as_str().unwrap_or(""))
                    }
                })
                .collect(),
        ),
        ("total (s)", col("total_s", 1.0, 3)),
        ("downtime (ms)", col("downtime_ms", 1.0, 1)),
        ("sent (MiB)", col("bytes", 1.0 / (1u64 << 20) as f64, 1)),
        ("precopy rounds", col("rounds", 1.0, 0)),
        ("major faults", col("major_faults", 1.0, 0)),
        ("progress/s before", col("progress_before_per_s", 1.0, 0)),
        ("progress/s during", col("progress_during_per_s", 1.0, 0)),
        ("during vs before (%)", col("during_vs_before", 100.0, 1)),
        ("lowest exec ratio", col("exec_ratio_min", 1.0, 2)),
        ("median exec ratio", col("exec_ratio_median", 1.0, 2)),
        ("requests (load)", col("requests", 1.0, 0)),
        ("request errors", col("request_errors", 1.0, 0)),
        ("latency p50 (ms)", col("latency_p50_ms", 1.0, 2)),
        ("latency p99 (ms)", col("latency_p99_ms", 1.0, 2)),
        ("latency max (ms)", col("latency_max_ms", 1.0, 1)),
    ]
}

fn print_table(figures: &[serde_json::Value]) {
    for (h, cells) in table_rows(figures) {
        println!(
            "{h:<22} {}",
            cells.iter().map(|c| format!("{c:>16}")).collect::<String>()
        );
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The page: the table, then each run's charts inline (base64 PNGs), and a
/// script that checks every chart decoded and has ink, for tests.
fn html(
    title: &str,
    runs: &[Run],
    figures: &[serde_json::Value],
    pngs: &[Vec<PathBuf>],
) -> Result<String> {
    use base64::Engine as _;
    let mut h = String::new();
    let _ = write!(
        h,
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{t}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 2em; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ text-align: left; background: #f4f4f4; }}
img {{ display: block; margin: 0.5em 0 1.5em; max-width: 100%; }}
.note {{ color: #555; max-width: 60em; }}
</style></head><body>
<h1>{t}</h1>
<p class="note">Times are seconds from each migration's start on the source's clock. Latency: every request
from <code>ferry load</code> (when its log was given) with the 100 ms mean; throughput: the guest's own workload
counters; execution ratio: the share of time the vCPUs ran (0 while paused, less the auto-converge throttle and
the time vCPU threads waited on postcopy faults); bandwidth: bytes each connection sent.</p>
<table>
"#,
        t = escape(title)
    );
    for (i, (head, cells)) in table_rows(figures).into_iter().enumerate() {
        let tag = if i == 0 { "th" } else { "td" };
        let _ = write!(h, "<tr><th>{}</th>", escape(head));
        for c in cells {
            let _ = write!(h, "<{tag}>{}</{tag}>", escape(&c));
        }
        h.push_str("</tr>\n");
    }
    h.push_str("</table>\n");
    for (r, files) in runs.iter().zip(pngs) {
        let _ = write!(
            h,
            "<h2>{}</h2>\n<p class=\"note\">{}</p>\n",
            escape(&r.name),
            escape(&summary_line(r))
        );
        for (f, (key, what)) in files.iter().zip(CHARTS) {
            let bytes = std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?;
            let _ = writeln!(
                h,
                r#"<img class="chart" data-chart="{key}" alt="{} {}" width="1000" height="320" src="data:image/png;base64,{}">"#,
                escape(&r.name),
                what,
                base64::engine::general_purpose::STANDARD.encode(bytes)
            );
        }
    }
    h.push_str(
        r#"<pre id="chart-check">checking charts…</pre>
<script>
// For tests in a headless browser: every chart decoded and drew
// something besides its white background.
window.addEventListener('load', () => {
  const imgs = [...document.querySelectorAll('img.chart')];
  let drawn = 0;
  for (const img of imgs) {
    if (!img.complete || img.naturalWidth === 0) continue;
    const c = document.createElement('canvas');
    c.width = img.naturalWidth; c.height = img.naturalHeight;
    const g = c.getContext('2d');
    g.drawImage(img, 0, 0);
    const px = g.getImageData(0, 0, c.width, c.height).data;
    let ink = 0;
    for (let i = 0; i < px.length; i += 4) if (px[i] < 200 || px[i + 1] < 200 || px[i + 2] < 200) ink++;
    if (ink > 500) drawn++;
  }
  const out = document.getElementById('chart-check');
  out.textContent = `charts drawn: ${drawn} of ${imgs.length}`;
  document.body.dataset.chartsDrawn = String(drawn);
  document.body.dataset.charts = String(imgs.length);
});
</script>
</body></html>
"#,
    );
    Ok(h)
}

/// One sentence on what a run did.
fn summary_line(r: &Run) -> String {
    let vm = &r.header["vm"];
    let what = format!(
        "{} of a {} MiB, {}-vCPU VM running {} to {}",
        r.mode(),
        vm["mem_bytes"].as_u64().unwrap_or(0) >> 20,
        vm["vcpus"].as_u64().unwrap_or(0),
        vm["workloads"]
            .as_array()
            .map(|a| a
                .iter()
                .filter_map(|w| w.as_str())
                .collect::<Vec<_>>()
                .join(" + "))
            .unwrap_or_default(),
        r.header["to"].as_str().unwrap_or("?"),
    );
    match (&r.stats, &r.error) {
        (Some(s), _) => format!(
            "{what}: {:.3} s, downtime {:.1} ms, {:.1} MiB sent; {} samples from the source, {} from the destination; bins of {} ms.",
            s["total_secs"].as_f64().unwrap_or(0.0),
            s["downtime_ms"].as_f64().unwrap_or(0.0),
            s["bytes"].as_f64().unwrap_or(0.0) / (1u64 << 20) as f64,
            r.samples.iter().filter(|x| x.side == Side::Source).count(),
            r.samples.iter().filter(|x| x.side == Side::Destination).count(),
            (BIN * 1e3) as u32,
        ),
        (None, Some(e)) => format!("{what}: failed: {e}"),
        (None, None) => format!("{what}: no summary (the timeline was cut short)"),
    }
}
