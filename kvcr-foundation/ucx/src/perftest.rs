//! UCX's own benchmark, `ucx_perftest`, run between two processes on
//! loopback: the anchor our UCX benchmarks measure beside themselves in the
//! same round (feature `perftest`; benchmarks only).
//!
//! A server process is started on a port of its own, then a client runs one
//! test against it (bounded by `timeout 120`) and its `Final:` row is read.
//! `None` when `ucx_perftest` is missing or the test fails: the caller
//! reports its figure without an anchor.

#![allow(clippy::disallowed_methods)] // a benchmark helper: it waits for a server to listen

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

/// `ucx_perftest -t ucp_put_bw` bandwidth (GB/s, the "overall" column) at
/// `size` bytes per put.
pub fn put_bw_gbs(tls: &str, size: usize, iters: usize, extra: &[&str]) -> Option<f64> {
    let row = final_row(tls, "ucp_put_bw", size, iters, extra)?;
    let overall_mbs: f64 = row.get(6)?.parse().ok()?;
    Some(overall_mbs / 1e3)
}

/// `ucx_perftest -t ucp_put_lat` one-way latency (µs, the "typical"
/// column) at `size` bytes.
pub fn put_lat_us(tls: &str, size: usize, iters: usize) -> Option<f64> {
    let row = final_row(tls, "ucp_put_lat", size, iters, &[])?;
    row.get(2)?.parse().ok()
}

/// Runs one test; returns the fields of the client's `Final:` row.
fn final_row(
    tls: &str,
    test: &str,
    size: usize,
    iters: usize,
    extra: &[&str],
) -> Option<Vec<String>> {
    // A port per call and per process: benches run one after another, and a
    // server that lingers must not take the next test's port.
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let port = 15_000 + (std::process::id() % 2000) as u16 + NEXT.fetch_add(1, Ordering::Relaxed);
    let port = port.to_string();
    // Over tcp, the segment sizes kvcr runs with: the anchor takes the
    // same route with the same settings (the environment still wins).
    let tcp_env: Vec<(String, &str)> = if tls.split(',').any(|t| t == "tcp") {
        crate::TCP_SEGMENT_SIZES
            .iter()
            .map(|(name, value)| (format!("UCX_TCP_{name}"), *value))
            .filter(|(var, _)| std::env::var_os(var).is_none())
            .collect()
    } else {
        Vec::new()
    };
    let mut server = Command::new("ucx_perftest")
        .args(["-p", &port])
        .envs(tcp_env.iter().map(|(k, v)| (k.as_str(), *v)))
        .env("UCX_TLS", tls)
        .env("UCX_NET_DEVICES", "lo")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    // ucx_perftest prints nothing when it listens; give it time to bind.
    std::thread::sleep(Duration::from_millis(500));
    let out = Command::new("timeout")
        .args(["120", "ucx_perftest", "127.0.0.1", "-p", &port, "-t", test])
        .args(["-s", &size.to_string(), "-n", &iters.to_string()])
        .args(["-w", &(iters / 10).max(2).to_string()])
        .args(extra)
        .envs(tcp_env.iter().map(|(k, v)| (k.as_str(), *v)))
        .env("UCX_TLS", tls)
        .env("UCX_NET_DEVICES", "lo")
        .output();
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out.ok()?.stdout).into_owned();
    let line = text.lines().find(|l| l.starts_with("Final:"))?;
    Some(line.split_whitespace().map(str::to_owned).collect())
}
