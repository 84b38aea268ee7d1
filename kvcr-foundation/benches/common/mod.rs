//! What every benchmark of this crate prints and how it summarises samples:
//! the `BENCH`/`DIST` lines `cargo xtask bench` parses, medians and
//! percentiles. (A folder module, so cargo does not take it for a bench.)

// Each bench binary compiles its own copy and uses a part of it.
#![allow(dead_code)]

use std::time::Duration;

/// The middle sample (the upper one of an even count).
pub(crate) fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// The `p` quantile (0..=1) of samples sorted ascending: the nearest rank.
pub(crate) fn at(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// `samples` sorted ascending.
pub(crate) fn sorted(mut samples: Vec<f64>) -> Vec<f64> {
    samples.sort_by(f64::total_cmp);
    samples
}

/// `BENCH <name> value=.. unit=.. [anchor=.. ratio=..]`.
pub(crate) fn bench(name: &str, value: f64, unit: &str, anchor: Option<f64>) {
    match anchor {
        Some(a) => println!(
            "BENCH {name} value={value:.3} unit={unit} anchor={a:.3} ratio={:.3}",
            value / a
        ),
        None => println!("BENCH {name} value={value:.3} unit={unit}"),
    }
}

/// The distribution for the report's plot, from samples sorted ascending:
/// `DIST <name> unit=us p0=.. p5=.. … p100=..` (every fifth percentile).
pub(crate) fn dist(name: &str, sorted: &[f64]) {
    let points: Vec<String> = (0..=20)
        .map(|i| format!("p{}={:.2}", i * 5, at(sorted, f64::from(i) / 20.0)))
        .collect();
    println!("DIST {name} unit=us {}", points.join(" "));
}

/// GB/s of `bytes` moved in `elapsed`.
pub(crate) fn gbps(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e9
}
