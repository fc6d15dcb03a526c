//! Drawing the report's charts as PNG files (plotters' bitmap backend),
//! every chart with the migration's phase markers.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;

/// What a chart holds.
pub enum Layer {
    /// A line through the points.
    Line {
        name: String,
        points: Vec<(f64, f64)>,
    },
    /// A dot per point (request latencies).
    Dots {
        name: String,
        points: Vec<(f64, f64)>,
    },
}

/// A vertical line at a moment of the migration.
pub struct Marker {
    pub t: f64,
    pub label: String,
    pub color: RGBColor,
}

/// One chart.
pub struct Chart<'a> {
    pub title: String,
    pub y_label: &'a str,
    pub x_range: (f64, f64),
    pub layers: Vec<Layer>,
    pub markers: &'a [Marker],
    /// Drawn when no layer has a point (why the chart is empty).
    pub empty_note: Option<String>,
    /// Fix the y axis to 0..1 (ratios).
    pub unit_y: bool,
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Registers a TrueType font for the charts' text: `font`, or the first of
/// the usual system paths (Debian's fonts-dejavu-core).
pub fn load_font(font: Option<&Path>) -> Result<()> {
    const PATHS: [&str; 4] = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    ];
    let path = match font {
        Some(p) => p.to_path_buf(),
        None => PATHS
            .iter()
            .map(Path::new)
            .find(|p| p.exists())
            .map(Path::to_path_buf)
            .ok_or_else(|| {
                anyhow!("no TrueType font found for the charts (install fonts-dejavu-core, or give --font PATH)")
            })?,
    };
    let bytes =
        std::fs::read(&path).with_context(|| format!("cannot read font {}", path.display()))?;
    // plotters keeps fonts for the whole process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow!("{} is not a TrueType font", path.display()))
}

/// An axis label short enough for the label area: 1.5k, 2M, 0.25.
fn si(v: f64) -> String {
    let a = v.abs();
    let (x, unit) = match a {
        a if a >= 1e9 => (v / 1e9, "G"),
        a if a >= 1e6 => (v / 1e6, "M"),
        a if a >= 1e3 => (v / 1e3, "k"),
        _ => (v, ""),
    };
    let s = format!("{x:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s}{unit}")
}

/// Draws `c` into a PNG at `path` (1000x320).
pub fn draw(path: &Path, c: &Chart) -> Result<()> {
    draw_inner(path, c).map_err(|e| anyhow!("cannot draw {}: {e}", path.display()))
}

fn draw_inner(path: &Path, c: &Chart) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::new(path, (1000, 320)).into_drawing_area();
    root.fill(&WHITE)?;
    let points = c.layers.iter().flat_map(|l| match l {
        Layer::Line { points, .. } | Layer::Dots { points, .. } => points.iter(),
    });
    let y_max = if c.unit_y {
        1.05
    } else {
        let m = points.map(|p| p.1).fold(0.0f64, f64::max);
        if m > 0.0 {
            m * 1.1
        } else {
            1.0
        }
    };
    let (x0, x1) = c.x_range;
    let mut chart = ChartBuilder::on(&root)
        .caption(&c.title, ("sans-serif", 18))
        .margin(8)
        .x_label_area_size(32)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("seconds from the migration's start")
        .y_desc(c.y_label)
        .y_label_formatter(&|v| si(*v))
        .label_style(("sans-serif", 12))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    for (i, m) in c.markers.iter().enumerate() {
        let style = m.color.stroke_width(1);
        chart.draw_series(LineSeries::new([(m.t, 0.0), (m.t, y_max)], style))?;
        // Markers close together (a short migration) get their labels
        // stepped down so they stay readable.
        chart.draw_series(std::iter::once(Text::new(
            m.label.clone(),
            (m.t, y_max * (0.97 - 0.07 * (i % 5) as f64)),
            ("sans-serif", 11).into_font().color(&m.color),
        )))?;
    }
    let mut any = false;
    for (i, l) in c.layers.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        match l {
            Layer::Line { name, points } => {
                any |= !points.is_empty();
                chart
                    .draw_series(LineSeries::new(
                        points.iter().copied(),
                        color.stroke_width(2),
                    ))?
                    .label(name.clone())
                    .legend(move |(x, y)| {
                        PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2))
                    });
            }
            Layer::Dots { name, points } => {
                any |= !points.is_empty();
                let faint = color.mix(0.35);
                chart
                    .draw_series(points.iter().map(|&p| Circle::new(p, 1, faint.filled())))?
                    .label(name.clone())
                    .legend(move |(x, y)| Circle::new((x + 8, y), 3, color.filled()));
            }
        }
    }
    if !any {
        if let Some(note) = &c.empty_note {
            chart.draw_series(std::iter::once(Text::new(
                note.clone(),
                (x0 + (x1 - x0) * 0.05, y_max * 0.5),
                ("sans-serif", 14).into_font().color(&RGBColor(90, 90, 90)),
            )))?;
        }
    } else {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(200, 200, 200))
            .label_font(("sans-serif", 12))
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn axis_labels_are_short() {
        assert_eq!(super::si(1_250_000_000.0), "1.25G");
        assert_eq!(super::si(2_000_000.0), "2M");
        assert_eq!(super::si(1500.0), "1.5k");
        assert_eq!(super::si(0.25), "0.25");
        assert_eq!(super::si(0.0), "0");
    }
}
