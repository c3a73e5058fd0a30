//! Training curves as an SVG image: one panel per series, epochs along the x axis.

use arbor_core::error::{Error, Result};
use std::fmt::Write as _;
use std::path::Path;

/// A named curve: one value per epoch.
pub struct Series<'a> {
    /// Title of the panel.
    pub name: &'a str,
    /// Values, epoch by epoch.
    pub values: &'a [f64],
}

const W: f64 = 420.0;
const H: f64 = 260.0;
const PAD: f64 = 56.0;

/// Draws the series side by side and writes the SVG to `path`; values that are not finite are
/// left out.
pub fn write_svg(path: &Path, series: &[Series<'_>]) -> Result<()> {
    let mut svg = String::new();
    let total = W * series.len() as f64;
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{total}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    for (k, s) in series.iter().enumerate() {
        let x0 = k as f64 * W;
        // A value that is not finite (a NaN dev score of an empty split) is left out.
        let shown = || s.values.iter().enumerate().filter(|(_, v)| v.is_finite());
        let (lo, hi) =
            shown().map(|(_, v)| v).fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &v| (l.min(v), h.max(v)));
        let (lo, hi) = match (lo.is_finite(), hi > lo) {
            (true, true) => (lo, hi),
            (true, false) => (lo.min(0.0), lo.max(0.0) + 1.0),
            (false, _) => (0.0, 1.0),
        };
        let n = s.values.len().max(2) - 1;
        let px = |i: usize| x0 + PAD + (W - 2.0 * PAD) * i as f64 / n as f64;
        let py = |v: f64| H - PAD - (H - 2.0 * PAD) * (v - lo) / (hi - lo);
        let _ = writeln!(svg, r#"<text x="{}" y="20" text-anchor="middle">{}</text>"#, x0 + W / 2.0, s.name);
        let _ = writeln!(
            svg,
            r#"<path d="M{a} {t} V{b} H{c}" stroke="black" fill="none"/>"#,
            a = x0 + PAD,
            t = PAD,
            b = H - PAD,
            c = x0 + W - PAD
        );
        let _ = writeln!(svg, r#"<text x="{}" y="{}" text-anchor="end">{hi:.3}</text>"#, x0 + PAD - 4.0, PAD + 4.0);
        let _ = writeln!(svg, r#"<text x="{}" y="{}" text-anchor="end">{lo:.3}</text>"#, x0 + PAD - 4.0, H - PAD);
        let _ = writeln!(svg, r#"<text x="{}" y="{}" text-anchor="middle">epoch</text>"#, x0 + W / 2.0, H - 10.0);
        let points: Vec<String> = shown().map(|(i, &v)| format!("{:.1},{:.1}", px(i), py(v))).collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" stroke="steelblue" stroke-width="2" fill="none"/>"#,
            points.join(" ")
        );
        for (i, &v) in shown() {
            let _ = writeln!(svg, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="steelblue"/>"#, px(i), py(v));
        }
    }
    svg.push_str("</svg>\n");
    std::fs::write(path, svg).map_err(|e| Error::Io { path: path.display().to_string(), msg: e.to_string() })
}
