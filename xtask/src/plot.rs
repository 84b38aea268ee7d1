//! A small SVG writer for the bench report: grouped bar charts with spread
//! whiskers, and line charts (optionally on a log x axis). Plain text out, no
//! plotting dependency; every chart is a standalone `.svg` a browser or a
//! Markdown viewer shows.

use std::fmt::Write as _;

const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 360.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 270.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 80.0;
/// Rough width of one character at the 12 px font, to tell crowded labels.
const CHAR_W: f64 = 7.0;
/// Colour per series, in order (colour-blind friendly Okabe–Ito).
const COLOURS: &[&str] = &[
    "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000",
];

/// One bar: the median and the spread (min, max) over repeated runs.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Bar {
    pub series: String,
    pub median: f64,
    pub low: f64,
    pub high: f64,
}

/// Bars drawn side by side under one label.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Group {
    pub label: String,
    pub bars: Vec<Bar>,
}

/// One line of a line chart: `(x, y)` points in x order.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn colour(i: usize) -> &'static str {
    COLOURS.get(i % COLOURS.len()).copied().unwrap_or("#000000")
}

/// A "nice" axis top at or above `max` (1, 2 or 5 times a power of ten).
fn nice_ceiling(max: f64) -> f64 {
    if !max.is_finite() || max <= 0.0 {
        return 1.0;
    }
    let power = 10f64.powf(max.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * power)
        .find(|v| *v >= max)
        .unwrap_or(10.0 * power)
}

fn number(v: f64) -> String {
    if v == 0.0 {
        "0".to_owned()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn open(out: &mut String, title: &str) {
    let _ = write!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" \
         viewBox=\"0 0 {WIDTH} {HEIGHT}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
        WIDTH / 2.0,
        escape(title)
    );
}

fn legend(out: &mut String, labels: &[String]) {
    for (i, label) in labels.iter().enumerate() {
        let y = TOP + 10.0 + i as f64 * 18.0;
        let x = WIDTH - RIGHT + 15.0;
        let _ = writeln!(
            out,
            "<rect x=\"{x}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{}\"/>\
             <text x=\"{}\" y=\"{}\">{}</text>",
            y - 10.0,
            colour(i),
            x + 17.0,
            y,
            escape(label)
        );
    }
}

fn y_axis(out: &mut String, top: f64, unit: &str) {
    let plot_h = HEIGHT - TOP - BOTTOM;
    for tick in 0..=4 {
        let v = top * f64::from(tick) / 4.0;
        let y = HEIGHT - BOTTOM - plot_h * f64::from(tick) / 4.0;
        let _ = writeln!(
            out,
            "<line x1=\"{LEFT}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#ddd\"/>\
             <text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
            WIDTH - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            number(v)
        );
    }
    let _ = writeln!(
        out,
        "<text x=\"16\" y=\"{}\" transform=\"rotate(-90 16 {})\" text-anchor=\"middle\">{}</text>",
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0,
        escape(unit)
    );
}

/// Grouped bars with a whisker from each bar's low to high; `unit` labels the
/// y axis, which starts at zero.
pub(crate) fn bar_chart(title: &str, unit: &str, groups: &[Group]) -> String {
    let mut series: Vec<String> = Vec::new();
    for bar in groups.iter().flat_map(|g| &g.bars) {
        if !series.contains(&bar.series) {
            series.push(bar.series.clone());
        }
    }
    let max = groups
        .iter()
        .flat_map(|g| &g.bars)
        .map(|b| b.high.max(b.median))
        .fold(0.0, f64::max);
    let top = nice_ceiling(max);
    let mut out = String::new();
    open(&mut out, title);
    y_axis(&mut out, top, unit);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let group_w = plot_w / groups.len().max(1) as f64;
    let bar_w = (group_w * 0.8) / series.len().max(1) as f64;
    let y_of = |v: f64| HEIGHT - BOTTOM - plot_h * (v / top).clamp(0.0, 1.0);
    for (g, group) in groups.iter().enumerate() {
        let gx = LEFT + group_w * g as f64 + group_w * 0.1;
        for bar in &group.bars {
            let s = series.iter().position(|n| *n == bar.series).unwrap_or(0);
            let x = gx + bar_w * s as f64;
            let y = y_of(bar.median);
            let _ = writeln!(
                out,
                "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\">\
                 <title>{}: {} (spread {}–{})</title></rect>",
                bar_w * 0.92,
                HEIGHT - BOTTOM - y,
                colour(s),
                escape(&bar.series),
                number(bar.median),
                number(bar.low),
                number(bar.high)
            );
            let cx = x + bar_w * 0.46;
            let (lo, hi) = (y_of(bar.low), y_of(bar.high));
            let _ = writeln!(
                out,
                "<line x1=\"{cx:.1}\" y1=\"{lo:.1}\" x2=\"{cx:.1}\" y2=\"{hi:.1}\" stroke=\"#333\"/>\
                 <line x1=\"{:.1}\" y1=\"{hi:.1}\" x2=\"{:.1}\" y2=\"{hi:.1}\" stroke=\"#333\"/>\
                 <line x1=\"{:.1}\" y1=\"{lo:.1}\" x2=\"{:.1}\" y2=\"{lo:.1}\" stroke=\"#333\"/>",
                cx - 3.0,
                cx + 3.0,
                cx - 3.0,
                cx + 3.0
            );
        }
        let x = LEFT + group_w * (g as f64 + 0.5);
        let y = HEIGHT - BOTTOM + 18.0;
        if group.label.chars().count() as f64 * CHAR_W > group_w {
            // Crowded: slant the label so neighbours do not overlap.
            let _ = writeln!(
                out,
                "<text x=\"{x:.1}\" y=\"{y}\" text-anchor=\"end\" \
                 transform=\"rotate(-25 {x:.1} {y})\">{}</text>",
                escape(&group.label)
            );
        } else {
            let _ = writeln!(
                out,
                "<text x=\"{x:.1}\" y=\"{y}\" text-anchor=\"middle\">{}</text>",
                escape(&group.label)
            );
        }
    }
    let _ = writeln!(
        out,
        "<line x1=\"{LEFT}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"#333\"/>",
        HEIGHT - BOTTOM,
        WIDTH - RIGHT
    );
    legend(&mut out, &series);
    out.push_str("</svg>\n");
    out
}

/// Lines over a shared x axis; `log_x` spaces x by decades (every x must then
/// be positive; others are dropped). The y axis starts at zero.
pub(crate) fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    log_x: bool,
    lines: &[Line],
) -> String {
    let fx = |x: f64| if log_x { x.log10() } else { x };
    let points = || {
        lines
            .iter()
            .flat_map(|l| &l.points)
            .filter(|(x, _)| !log_x || *x > 0.0)
    };
    let (mut x_min, mut x_max) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
        (a.min(fx(p.0)), b.max(fx(p.0)))
    });
    if !x_min.is_finite() || !x_max.is_finite() {
        (x_min, x_max) = (0.0, 1.0);
    }
    if log_x {
        x_min = x_min.floor();
        x_max = x_max.ceil();
    }
    if x_max <= x_min {
        x_max = x_min + 1.0;
    }
    let top = nice_ceiling(points().map(|p| p.1).fold(0.0, f64::max));
    let mut out = String::new();
    open(&mut out, title);
    y_axis(&mut out, top, y_label);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let sx = |x: f64| LEFT + plot_w * (fx(x) - x_min) / (x_max - x_min);
    let sy = |y: f64| HEIGHT - BOTTOM - plot_h * (y / top).clamp(0.0, 1.0);
    // x ticks: each decade on a log axis, else five even steps.
    let ticks: Vec<f64> = if log_x {
        (x_min as i32..=x_max as i32)
            .map(|e| 10f64.powi(e))
            .collect()
    } else {
        (0..=4)
            .map(|i| x_min + (x_max - x_min) * f64::from(i) / 4.0)
            .collect()
    };
    for t in ticks {
        let x = sx(t);
        let _ = writeln!(
            out,
            "<line x1=\"{x:.1}\" y1=\"{TOP}\" x2=\"{x:.1}\" y2=\"{}\" stroke=\"#eee\"/>\
             <text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            HEIGHT - BOTTOM,
            HEIGHT - BOTTOM + 16.0,
            number(t)
        );
    }
    let _ = writeln!(
        out,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
        LEFT + plot_w / 2.0,
        HEIGHT - 14.0,
        escape(x_label)
    );
    for (i, line) in lines.iter().enumerate() {
        let path: Vec<String> = line
            .points
            .iter()
            .filter(|(x, _)| !log_x || *x > 0.0)
            .map(|(x, y)| format!("{:.1},{:.1}", sx(*x), sy(*y)))
            .collect();
        let _ = writeln!(
            out,
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"/>",
            colour(i),
            path.join(" ")
        );
        for p in &path {
            if let Some((x, y)) = p.split_once(',') {
                let _ = writeln!(
                    out,
                    "<circle cx=\"{x}\" cy=\"{y}\" r=\"3\" fill=\"{}\"/>",
                    colour(i)
                );
            }
        }
    }
    let labels: Vec<String> = lines.iter().map(|l| l.label.clone()).collect();
    legend(&mut out, &labels);
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bar(series: &str, median: f64) -> Bar {
        Bar {
            series: series.to_owned(),
            median,
            low: median * 0.9,
            high: median * 1.1,
        }
    }

    #[test]
    fn bar_chart_draws_one_rect_per_bar_and_escapes_labels() {
        let svg = bar_chart(
            "deposit <local>",
            "GB/s",
            &[
                Group {
                    label: "256 KiB".into(),
                    bars: vec![bar("kvcr", 11.0), bar("memcpy", 12.0)],
                },
                Group {
                    label: "16 MiB".into(),
                    bars: vec![bar("kvcr", 9.0)],
                },
            ],
        );
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        // Three bars plus the background and two legend swatches.
        assert_eq!(svg.matches("<rect").count(), 3 + 1 + 2);
        assert!(svg.contains("deposit &lt;local&gt;"));
        assert!(svg.contains("kvcr: 11.0 (spread 9.90–12.1)"));
    }

    #[test]
    fn nice_ceiling_rounds_up_to_one_two_five() {
        assert_eq!(nice_ceiling(11.0), 20.0);
        assert_eq!(nice_ceiling(0.7), 1.0);
        assert_eq!(nice_ceiling(2.2), 2.5);
        assert_eq!(nice_ceiling(0.0), 1.0);
    }

    #[test]
    fn log_line_chart_drops_non_positive_x_and_ticks_each_decade() {
        let svg = line_chart(
            "query",
            "blocks",
            "ns/key",
            true,
            &[Line {
                label: "kvcr".into(),
                points: vec![(0.0, 1.0), (1e3, 20.0), (1e6, 40.0)],
            }],
        );
        assert_eq!(svg.matches("<circle").count(), 2);
        for decade in ["1000", "10000", "100000", "1000000"] {
            assert!(svg.contains(&format!(">{decade}</text>")), "{decade}");
        }
    }
}
