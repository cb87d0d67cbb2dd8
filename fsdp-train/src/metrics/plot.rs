//! SVG plots of metrics files: one line per run, two panels (train loss and test accuracy per epoch for
//! a classifier; train and validation loss per step for a language model).

use super::{read_metrics, MetricsError, MetricsRecord};
use std::fmt::Write as _;
use std::path::Path;

/// What the two panels show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlotKind {
    /// Train loss and test accuracy per epoch (the records' `epoch`).
    #[default]
    Classifier,
    /// Train loss and validation loss (the records' `test_loss`) per optimizer step (the records' `step`,
    /// or `epoch` in files that have none).
    LanguageModel,
}

impl PlotKind {
    /// The x coordinate of a record.
    fn x(self, m: &MetricsRecord) -> f64 {
        match self {
            PlotKind::Classifier => f64::from(m.epoch),
            PlotKind::LanguageModel => m.step.map_or(f64::from(m.epoch), |s| s as f64),
        }
    }
}

/// One run to plot: a label for the legend and its epochs.
#[derive(Debug, Clone, PartialEq)]
pub struct PlotSeries {
    /// Legend text.
    pub label: String,
    /// The run's records (plotted in epoch order).
    pub epochs: Vec<MetricsRecord>,
}

impl PlotSeries {
    /// Reads a metrics file; the label is the file name without its extension.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, MetricsError> {
        let path = path.as_ref();
        let epochs = read_metrics(path)?;
        let label = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        Ok(PlotSeries { label, epochs })
    }
}

/// Size, title and kind of a plot.
#[derive(Debug, Clone, PartialEq)]
pub struct PlotOptions {
    /// What the panels show.
    pub kind: PlotKind,
    /// Title above the panels; none when empty.
    pub title: String,
    /// Width of the whole image in pixels.
    pub width: f64,
    /// Height of one panel's plotting area plus its axes, in pixels (the legend adds to it).
    pub panel_height: f64,
}

impl Default for PlotOptions {
    fn default() -> Self {
        PlotOptions {
            kind: PlotKind::Classifier,
            title: "MNIST: train loss and test accuracy per epoch".to_string(),
            width: 1000.0,
            panel_height: 380.0,
        }
    }
}

/// Line colours (Tableau 10): distinct, and readable on white.
const PALETTE: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];
/// Dash patterns, cycled after the palette so that more than ten runs stay distinguishable.
const DASHES: [&str; 3] = ["", "6 3", "2 3"];

/// Escapes text for SVG content and attribute values.
fn escape_xml(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// A "nice" tick step (1, 2 or 5 times a power of ten) giving about `target` intervals over `span`.
fn nice_step(span: f64, target: f64) -> f64 {
    let raw = span / target;
    let magnitude = 10f64.powf(raw.log10().floor());
    let fraction = raw / magnitude;
    let nice = if fraction <= 1.0 {
        1.0
    } else if fraction <= 2.0 {
        2.0
    } else if fraction <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

/// An axis range covering `[min, max]`, widened to whole tick steps; returns `(lo, hi, step)`.
fn axis_range(min: f64, max: f64, integer: bool) -> (f64, f64, f64) {
    let (mut min, mut max) = (min, max);
    if (max - min).abs() < f64::EPSILON * max.abs().max(1.0) {
        let pad = if min == 0.0 { 1.0 } else { min.abs() * 0.05 };
        min -= pad;
        max += pad;
    }
    let mut step = nice_step(max - min, 5.0);
    if integer {
        step = step.max(1.0).round();
    }
    let lo = (min / step).floor() * step;
    let hi = (max / step).ceil() * step;
    (lo, hi, step)
}

/// Formats a tick value with as many decimals as the step needs.
fn format_tick(value: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    };
    let text = format!("{value:.decimals$}");
    // Avoid "-0" ticks.
    if text
        .trim_start_matches('-')
        .chars()
        .all(|c| c == '0' || c == '.')
    {
        text.trim_start_matches('-').to_string()
    } else {
        text
    }
}

/// A mapped axis: its range, whether it is logarithmic, and its labelled ticks.
#[derive(Debug, Clone, PartialEq)]
struct Axis {
    lo: f64,
    hi: f64,
    log: bool,
    ticks: Vec<(f64, String)>,
}

impl Axis {
    /// A linear axis over nice tick steps covering `[min, max]`.
    fn linear(min: f64, max: f64) -> Self {
        let (lo, hi, step) = axis_range(min, max, false);
        let count = ((hi - lo) / step).round() as usize;
        let ticks = (0..=count)
            .map(|i| {
                let v = lo + i as f64 * step;
                (v, format_tick(v, step))
            })
            .collect();
        Axis {
            lo,
            hi,
            log: false,
            ticks,
        }
    }

    /// An epoch axis: `[min - pad, max + pad]` so end points clear the frame, integer ticks.
    fn epochs(min: f64, max: f64) -> Self {
        let pad = ((max - min) * 0.03).max(0.5);
        let step = nice_step((max - min).max(1.0), 7.0).max(1.0).round();
        let first = ((min - pad) / step).ceil() * step;
        let count = ((max + pad - first) / step).floor().max(0.0) as usize;
        let ticks = (0..=count)
            .map(|i| {
                let v = first + i as f64 * step;
                (v, format_tick(v, step))
            })
            .filter(|&(v, _)| v >= min - pad && v <= max + pad)
            .collect();
        Axis {
            lo: min - pad,
            hi: max + pad,
            log: false,
            ticks,
        }
    }

    /// A base-10 logarithmic axis for `0 < min <= max`, ticked at 1, 2 and 5 times powers of ten
    /// (only at powers of ten when that would be too many ticks).
    fn log10(min: f64, max: f64) -> Self {
        let first = min.log10().floor() as i32 - 1;
        let last = max.log10().ceil() as i32 + 1;
        let candidates: Vec<(f64, bool)> = (first..=last)
            .flat_map(|k| [1.0, 2.0, 5.0].map(|m| (m * 10f64.powi(k), m == 1.0)))
            .collect();
        let lo = candidates
            .iter()
            .map(|c| c.0)
            .filter(|&c| c <= min * (1.0 + 1e-12))
            .fold(f64::NEG_INFINITY, f64::max);
        let hi = candidates
            .iter()
            .map(|c| c.0)
            .filter(|&c| c >= max * (1.0 - 1e-12))
            .fold(f64::INFINITY, f64::min);
        let inside: Vec<(f64, bool)> = candidates
            .into_iter()
            .filter(|&(c, _)| c >= lo * (1.0 - 1e-12) && c <= hi * (1.0 + 1e-12))
            .collect();
        let dense = inside.len() <= 10;
        let ticks = inside
            .into_iter()
            .filter(|&(_, power_of_ten)| dense || power_of_ten)
            .map(|(v, _)| {
                let decimals = (-v.log10().floor()).max(0.0) as usize;
                (v, format!("{v:.decimals$}"))
            })
            .collect();
        Axis {
            lo,
            hi,
            log: true,
            ticks,
        }
    }

    /// Where `v` falls on the axis, 0 at `lo` and 1 at `hi`.
    fn fraction(&self, v: f64) -> f64 {
        if self.log {
            (v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        }
    }
}

struct Panel<'a> {
    class: &'a str,
    title: &'a str,
    y_label: &'a str,
    /// Use a log scale when all values are positive and span at least this factor.
    log_from_ratio: Option<f64>,
    value: fn(&MetricsRecord) -> f64,
}

/// Renders train loss (left) and test accuracy (right) per epoch of every series as an SVG document.
///
/// Each series is drawn in its own colour (and, past ten series, dash pattern) as a line with a
/// marker per epoch, inside `<g class="series" data-label="...">` groups; non-finite values break the
/// line. The legend below the panels lists the labels in order.
pub fn render_svg(series: &[PlotSeries], options: &PlotOptions) -> Result<String, MetricsError> {
    if series.is_empty() {
        return Err(MetricsError::NothingToPlot("no series given".to_string()));
    }
    let second = match options.kind {
        PlotKind::Classifier => Panel {
            class: "test-accuracy",
            title: "Test accuracy",
            y_label: "test accuracy (%)",
            log_from_ratio: None,
            value: |m| m.test_accuracy,
        },
        PlotKind::LanguageModel => Panel {
            class: "val-loss",
            title: "Validation loss",
            y_label: "mean validation loss",
            log_from_ratio: Some(5.0),
            value: |m| m.test_loss,
        },
    };
    let panels = [
        Panel {
            class: "train-loss",
            title: "Train loss",
            y_label: "mean train loss",
            log_from_ratio: Some(5.0),
            value: |m| m.train_loss,
        },
        second,
    ];
    let x_label = match options.kind {
        PlotKind::Classifier => "epoch",
        PlotKind::LanguageModel => "step",
    };

    // Shared x range: epochs of all series.
    let epochs = series
        .iter()
        .flat_map(|s| s.epochs.iter().map(|m| options.kind.x(m)));
    let (x_min, x_max) = epochs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), e| {
        (lo.min(e), hi.max(e))
    });
    if !x_min.is_finite() {
        return Err(MetricsError::NothingToPlot(
            "the series hold no epochs".to_string(),
        ));
    }
    let x_axis = Axis::epochs(x_min, x_max);

    let width = options.width.max(400.0);
    let title_height = if options.title.is_empty() { 10.0 } else { 40.0 };
    let (margin_left, margin_right, margin_top, margin_bottom) = (70.0, 20.0, 30.0, 50.0);
    let gap = 30.0;
    let panel_width = (width - gap) / 2.0;
    let plot_w = panel_width - margin_left - margin_right;
    let plot_h = options.panel_height.max(200.0) - margin_top - margin_bottom;
    // Legend: entries in rows that fit the width.
    // Legend labels are cut to LEGEND_CHARS characters; entries are as wide as the longest label
    // (about 7.6 px per character of 13 px DejaVu Sans).
    const LEGEND_CHARS: usize = 32;
    let longest = series
        .iter()
        .map(|s| s.label.chars().count().min(LEGEND_CHARS))
        .max()
        .unwrap_or(1);
    let entry_width = 38.0 + 7.6 * longest as f64 + 24.0;
    let per_row = ((width - 40.0) / entry_width).floor().max(1.0) as usize;
    let legend_rows = series.len().div_ceil(per_row);
    let legend_top = title_height + options.panel_height.max(200.0) + 10.0;
    let height = legend_top + 22.0 * legend_rows as f64 + 16.0;

    let mut svg = String::new();
    // Writing to a String cannot fail; the results are ignored for that reason.
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="13">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    if !options.title.is_empty() {
        let _ = writeln!(
            svg,
            r#"<text class="title" x="{:.1}" y="26" text-anchor="middle" font-size="17" font-weight="bold">{}</text>"#,
            width / 2.0,
            escape_xml(&options.title)
        );
    }

    for (p, panel) in panels.iter().enumerate() {
        let left = p as f64 * (panel_width + gap) + margin_left;
        let top = title_height + margin_top;
        let values = series
            .iter()
            .flat_map(|s| s.epochs.iter().map(panel.value))
            .filter(|v| v.is_finite());
        let (y_min, y_max) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
        let y_axis = if !y_min.is_finite() {
            Axis::linear(0.0, 1.0)
        } else if panel
            .log_from_ratio
            .is_some_and(|r| y_min > 0.0 && y_max >= r * y_min)
        {
            Axis::log10(y_min, y_max)
        } else {
            Axis::linear(y_min, y_max)
        };
        let sx = |x: f64| left + x_axis.fraction(x) * plot_w;
        let sy = |y: f64| top + plot_h - y_axis.fraction(y) * plot_h;

        let _ = writeln!(svg, r#"<g class="panel {}">"#, panel.class);
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"#,
            left + plot_w / 2.0,
            top - 10.0,
            panel.title
        );
        // Grid and ticks.
        for (y, label) in &y_axis.ticks {
            let py = sy(*y);
            let _ = writeln!(
                svg,
                r##"<line x1="{left:.1}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#e0e0e0"/><text x="{:.1}" y="{:.1}" text-anchor="end">{label}</text>"##,
                left + plot_w,
                left - 6.0,
                py + 4.0,
            );
        }
        for (x, label) in &x_axis.ticks {
            let px = sx(*x);
            let _ = writeln!(
                svg,
                r##"<line x1="{px:.1}" y1="{top:.1}" x2="{px:.1}" y2="{:.1}" stroke="#f0f0f0"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{label}</text>"##,
                top + plot_h,
                top + plot_h + 18.0,
            );
        }
        // Axes and their labels.
        let _ = writeln!(
            svg,
            r#"<rect x="{left:.1}" y="{top:.1}" width="{plot_w:.1}" height="{plot_h:.1}" fill="none" stroke="black"/>"#
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{x_label}</text>"#,
            left + plot_w / 2.0,
            top + plot_h + 38.0
        );
        let (lx, ly) = (left - 52.0, top + plot_h / 2.0);
        let _ = writeln!(
            svg,
            r#"<text x="{lx:.1}" y="{ly:.1}" text-anchor="middle" transform="rotate(-90 {lx:.1} {ly:.1})">{}{}</text>"#,
            panel.y_label,
            if y_axis.log { " (log scale)" } else { "" }
        );
        // Series.
        for (i, s) in series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let dash = DASHES[(i / PALETTE.len()) % DASHES.len()];
            let dash_attr = if dash.is_empty() {
                String::new()
            } else {
                format!(r#" stroke-dasharray="{dash}""#)
            };
            let mut points: Vec<(f64, f64)> = s
                .epochs
                .iter()
                .map(|m| (options.kind.x(m), (panel.value)(m)))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let _ = writeln!(
                svg,
                r#"<g class="series" data-label="{}" stroke="{color}" fill="{color}">"#,
                escape_xml(&s.label)
            );
            // Non-finite values split the line into runs of finite points.
            for run in points.split(|(_, v)| !v.is_finite()) {
                if run.len() >= 2 {
                    let coords: Vec<String> = run
                        .iter()
                        .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
                        .collect();
                    let _ = writeln!(
                        svg,
                        r#"<polyline class="{}" fill="none" stroke-width="2"{dash_attr} points="{}"/>"#,
                        panel.class,
                        coords.join(" ")
                    );
                }
                for &(x, y) in run {
                    let _ = writeln!(
                        svg,
                        r#"<circle class="point" cx="{:.1}" cy="{:.1}" r="3"/>"#,
                        sx(x),
                        sy(y)
                    );
                }
            }
            let _ = writeln!(svg, "</g>");
        }
        let _ = writeln!(svg, "</g>");
    }

    // Legend.
    let _ = writeln!(svg, r#"<g class="legend">"#);
    for (i, s) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let dash = DASHES[(i / PALETTE.len()) % DASHES.len()];
        let x = 20.0 + (i % per_row) as f64 * entry_width;
        let y = legend_top + 22.0 * (i / per_row) as f64 + 8.0;
        let dash_attr = if dash.is_empty() {
            String::new()
        } else {
            format!(r#" stroke-dasharray="{dash}""#)
        };
        let mut label = s.label.clone();
        if label.chars().count() > LEGEND_CHARS {
            label = label.chars().take(LEGEND_CHARS - 1).collect::<String>() + "…";
        }
        let _ = writeln!(
            svg,
            r#"<g class="legend-entry" data-label="{}"><line x1="{x:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{color}" stroke-width="3"{dash_attr}/><circle cx="{:.1}" cy="{y:.1}" r="3" fill="{color}"/><text x="{:.1}" y="{:.1}">{}</text></g>"#,
            escape_xml(&s.label),
            x + 30.0,
            x + 15.0,
            x + 38.0,
            y + 4.5,
            escape_xml(&label)
        );
    }
    let _ = writeln!(svg, "</g>");
    let _ = writeln!(svg, "</svg>");
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_range_covers_data_with_nice_steps() {
        for &(lo, hi) in &[
            (0.013, 0.31),
            (97.2, 99.3),
            (1.0, 14.0),
            (5.0, 5.0),
            (0.0, 0.0),
        ] {
            let (a, b, step) = axis_range(lo, hi, false);
            assert!(a <= lo && b >= hi, "{lo} {hi} -> {a} {b}");
            let m = step / 10f64.powf(step.log10().floor());
            assert!(
                [1.0, 2.0, 5.0, 10.0].iter().any(|n| (m - n).abs() < 1e-9),
                "step {step}"
            );
            let ticks = (b - a) / step;
            assert!(
                (2.0..=11.0).contains(&ticks.round()),
                "{ticks} ticks for {lo}..{hi}"
            );
        }
        let (_, _, s) = axis_range(1.0, 3.0, true);
        assert!(s >= 1.0 && s.fract() == 0.0);
    }

    #[test]
    fn log_axis_brackets_data_and_maps_monotonically() {
        for &(lo, hi) in &[(0.013, 0.31), (0.002, 2.5), (1e-6, 10.0), (0.2, 0.9)] {
            let a = Axis::log10(lo, hi);
            assert!(a.lo <= lo && a.hi >= hi && a.lo > 0.0, "{a:?}");
            assert!(a.fraction(lo) >= -1e-12 && a.fraction(hi) <= 1.0 + 1e-12);
            assert!(a.fraction(lo) < a.fraction(hi));
            assert!(!a.ticks.is_empty() && a.ticks.len() <= 10, "{a:?}");
            assert!(a.ticks.windows(2).all(|w| w[0].0 < w[1].0));
        }
        assert_eq!(
            Axis::log10(0.013, 0.31)
                .ticks
                .iter()
                .map(|t| t.1.as_str())
                .collect::<Vec<_>>(),
            ["0.01", "0.02", "0.05", "0.1", "0.2", "0.5"]
        );
    }

    #[test]
    fn epoch_axis_has_integer_ticks_inside_its_range() {
        for &(lo, hi) in &[(1.0, 1.0), (1.0, 14.0), (1.0, 100.0), (3.0, 5.0)] {
            let a = Axis::epochs(lo, hi);
            assert!(a.lo < lo && a.hi > hi);
            assert!(!a.ticks.is_empty());
            assert!(a
                .ticks
                .iter()
                .all(|&(v, _)| v.fract() == 0.0 && v >= a.lo && v <= a.hi));
        }
    }

    #[test]
    fn ticks_have_the_needed_decimals() {
        assert_eq!(format_tick(0.05, 0.05), "0.05");
        assert_eq!(format_tick(98.5, 0.5), "98.5");
        assert_eq!(format_tick(-0.0, 0.1), "0.0");
        assert_eq!(format_tick(12.0, 2.0), "12");
    }

    #[test]
    fn xml_is_escaped() {
        assert_eq!(escape_xml("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
    }
}
