//! `cargo xtask bench --peers`: the reference Python KV Cache Runner (kvcr
//! 0.1.1) and Mooncake's transfer engine (TCP) on the workloads kvcr's
//! benches measure, run right after them, and a side-by-side table.
//!
//! Both are installed once into venvs under `target/peers-venv` by
//! `xtask/peers/setup.sh`; our drivers (`xtask/peers/*.py`) print `BENCH
//! peers.<system>.<figure>` lines. Each driver runs inside a network namespace
//! of its own holding only loopback (when this user may create one), since
//! NIXL and Mooncake open listeners on every interface.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result};

use crate::bench::{self, Dist, Figure, Spread, Summary, short};
use crate::plot::{self, Bar, Group};

/// The installed peers, ready to run.
pub(crate) struct Prepared {
    dir: PathBuf,
    /// Whether each driver runs in its own loopback-only network namespace.
    pub isolated: bool,
}

/// Whether this process may create a network namespace (root on Linux).
fn can_unshare() -> bool {
    Command::new("unshare")
        .args(["--net", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `python script args…`, inside a fresh loopback-only network namespace
/// when `isolate`.
fn driver(python: &Path, script: &Path, quick: bool, isolate: bool) -> Command {
    let mut cmd = if isolate {
        let mut c = Command::new("unshare");
        c.args([
            "--net",
            "--",
            "sh",
            "-c",
            "ip link set lo up && exec \"$@\"",
            "sh",
        ])
        .arg(python);
        c
    } else {
        Command::new(python)
    };
    cmd.arg(script);
    if quick {
        cmd.arg("--quick");
    }
    // UCX (inside NIXL) only on loopback; Mooncake's glog at warnings.
    cmd.env("UCX_NET_DEVICES", "lo")
        .env("GLOG_minloglevel", "1");
    cmd
}

/// Installs the peers (once) into `target/peers-venv`.
pub(crate) fn prepare(root: &Path) -> Result<Prepared> {
    let dir = root.join("target").join("peers-venv");
    eprintln!(
        "xtask bench: installing the peers into {} if missing (the reference runner pulls ~6 GB once)…",
        dir.display()
    );
    crate::run(
        Command::new("bash")
            .arg(root.join("xtask/peers/setup.sh"))
            .arg(&dir),
    )
    .context("installing the peer systems (needs python3-venv and PyPI)")?;
    let isolated = can_unshare();
    if !isolated {
        eprintln!(
            "xtask bench: cannot create a network namespace here; the peers run in this one (they only dial 127.0.0.1)"
        );
    }
    Ok(Prepared { dir, isolated })
}

/// A peer system's driver: its name (and venv folder) and its script in
/// `xtask/peers`.
pub(crate) type Driver = (&'static str, &'static str);

/// The reference Python runner's driver.
pub(crate) const REFERENCE: Driver = ("reference", "reference_runner.py");

/// Mooncake's transfer engine driver: its one-key TCP transfers are
/// compared with kvcr's `peer.request_*_tcp`, so a round runs it right
/// after kvcr's `peer` benchmark (see `bench::run`).
pub(crate) const MOONCAKE: Driver = ("mooncake", "mooncake_tcp.py");

/// Runs the given peers' drivers once (one round, next to kvcr's binaries
/// of the same round); returns their figures and latency distributions.
pub(crate) fn run_round(
    root: &Path,
    prepared: &Prepared,
    drivers: &[Driver],
    quick: bool,
    round: &str,
    started: Instant,
) -> Result<(Vec<Figure>, Vec<Dist>)> {
    let logs = root.join("target").join("bench");
    std::fs::create_dir_all(&logs)?;
    let mut figures = Vec::new();
    let mut dists = Vec::new();
    for &(name, script) in drivers {
        let log = logs.join(format!("peers-{name}.log"));
        let mut cmd = driver(
            &prepared.dir.join(name).join("bin/python"),
            &root.join("xtask/peers").join(script),
            quick,
            prepared.isolated,
        );
        cmd.stderr(std::fs::File::create(&log)?);
        let out = bench::collect(&mut cmd, &format!("{round} peers {name}:"), started)
            .with_context(|| format!("the {name} driver failed; see {}", log.display()))?;
        figures.extend(out.figures);
        dists.extend(out.dists);
    }
    Ok((figures, dists))
}

/// One row of the side-by-side table: a workload, kvcr's figure, and the
/// peers' figures for the same workload.
struct Row {
    workload: &'static str,
    unit: &'static str,
    kvcr: &'static str,
    reference: Option<&'static str>,
    mooncake_write: Option<&'static str>,
    mooncake_read: Option<&'static str>,
    /// Whether higher is better (throughput) or lower (latency).
    higher: bool,
}

const ROWS: &[Row] = &[
    Row {
        workload: "local deposit, 512 × 256 KiB",
        unit: "GB/s",
        kvcr: "runner.deposit",
        reference: Some("deposit_256kib"),
        mooncake_write: None,
        mooncake_read: None,
        higher: true,
    },
    Row {
        workload: "local deliver, 512 × 256 KiB (bytes checked)",
        unit: "GB/s",
        kvcr: "runner.deliver",
        reference: Some("deliver_256kib"),
        mooncake_write: None,
        mooncake_read: None,
        higher: true,
    },
    Row {
        workload: "one-block deposit → completion, 256 KiB",
        unit: "us",
        kvcr: "runner.one_block_deposit_p50",
        reference: Some("one_block_deposit_p50"),
        mooncake_write: None,
        mooncake_read: None,
        higher: false,
    },
    Row {
        workload: "peer fetch on a hint, 256 KiB blocks, shared memory (bytes checked; kvcr 512, reference 256 blocks per fetch)",
        unit: "GB/s",
        kvcr: "peer.fetch_256kib_shm",
        reference: Some("peer_fetch_256kib_default"),
        mooncake_write: None,
        mooncake_read: None,
        higher: true,
    },
    Row {
        workload: "one-block peer fetch on a hint, 256 KiB, shared memory",
        unit: "us",
        kvcr: "peer.one_block_p50",
        reference: Some("peer_one_block_default_p50"),
        mooncake_write: None,
        mooncake_read: None,
        higher: false,
    },
    Row {
        workload: "peer fetch on a hint, 256 × 256 KiB, TCP loopback (bytes checked)",
        unit: "GB/s",
        kvcr: "peer.fetch_256kib_tcp",
        reference: Some("peer_fetch_256kib_tcp"),
        mooncake_write: None,
        mooncake_read: None,
        higher: true,
    },
    Row {
        workload: "one-block peer fetch on a hint, 256 KiB, TCP loopback",
        unit: "us",
        kvcr: "peer.one_block_tcp_p50",
        reference: Some("peer_one_block_tcp_p50"),
        mooncake_write: None,
        mooncake_read: None,
        higher: false,
    },
    Row {
        workload: "one 64 KiB transfer per request, TCP loopback",
        unit: "GB/s",
        kvcr: "peer.request_64kib_tcp",
        reference: None,
        mooncake_write: Some("write_64kib_tcp"),
        mooncake_read: Some("read_64kib_tcp"),
        higher: true,
    },
    Row {
        workload: "one 1 MiB transfer per request, TCP loopback",
        unit: "GB/s",
        kvcr: "peer.request_1mib_tcp",
        reference: None,
        mooncake_write: Some("write_1mib_tcp"),
        mooncake_read: Some("read_1mib_tcp"),
        higher: true,
    },
    Row {
        workload: "one 16 MiB transfer per request, TCP loopback",
        unit: "GB/s",
        kvcr: "peer.request_16mib_tcp",
        reference: None,
        mooncake_write: Some("write_16mib_tcp"),
        mooncake_read: Some("read_16mib_tcp"),
        higher: true,
    },
];

fn find(summaries: &[Summary], name: &str) -> Option<Spread> {
    summaries.iter().find(|s| s.name == name).map(|s| s.value)
}

fn peer_value(summaries: &[Summary], system: &str, name: Option<&str>) -> Option<Spread> {
    find(summaries, &format!("peers.{system}.{}", name?))
}

/// kvcr ÷ peer, oriented so that above 1 means kvcr is better.
fn advantage(kvcr: f64, peer: f64, higher: bool) -> Option<f64> {
    let r = if higher { kvcr / peer } else { peer / kvcr };
    r.is_finite().then_some(r)
}

struct Resolved {
    row: &'static Row,
    kvcr: Option<Spread>,
    reference: Option<Spread>,
    write: Option<Spread>,
    read: Option<Spread>,
}

fn resolve(summaries: &[Summary]) -> Vec<Resolved> {
    ROWS.iter()
        .map(|row| Resolved {
            row,
            kvcr: find(summaries, row.kvcr),
            reference: peer_value(summaries, "reference", row.reference),
            write: peer_value(summaries, "mooncake", row.mooncake_write),
            read: peer_value(summaries, "mooncake", row.mooncake_read),
        })
        .collect()
}

fn cell(v: Option<Spread>) -> String {
    v.map_or("-".to_owned(), |s| {
        format!("{} ({}–{})", short(s.median), short(s.low), short(s.high))
    })
}

/// The side-by-side section of the report, and its plot.
pub(crate) fn render(summaries: &[Summary], isolated: bool) -> (String, String) {
    let mut out =
        String::from("\n## Side by side: kvcr, the reference Python runner, Mooncake\n\n");
    let _ = writeln!(
        out,
        "The reference runner (kvcr 0.1.1 from PyPI: NIXL 1.5.0 with its bundled UCX) \
         and Mooncake's transfer engine (0.3.13.post1, non-CUDA, TCP transport, \
         P2P handshake) ran in every round next to kvcr's benchmarks (Mooncake right after \
         kvcr's `peer` benchmark, whose one-key transfers it is compared with; the reference \
         runner after all of kvcr's), each {}, with our \
         drivers in `xtask/peers/`. Every transfer checks its bytes. Every cell is the median \
         over the rounds (min–max) of each run's own median. \"kvcr ×\" is how many times better \
         kvcr is (higher throughput or lower latency; below 1 means the peer is better).\n",
        if isolated {
            "in a network namespace holding only loopback"
        } else {
            "on loopback"
        }
    );
    out.push_str(
        "| workload | unit | kvcr | reference runner | kvcr × reference | Mooncake write | Mooncake read | kvcr × Mooncake read |\n",
    );
    out.push_str("|---|---|---|---|---|---|---|---|\n");
    let rows = resolve(summaries);
    for r in &rows {
        let k = r.kvcr.map(|s| s.median);
        let ratio = |peer: Option<Spread>| -> String {
            match (k, peer) {
                (Some(k), Some(p)) => advantage(k, p.median, r.row.higher)
                    .map_or("-".to_owned(), |x| format!("{x:.2}")),
                _ => "-".to_owned(),
            }
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r.row.workload,
            r.row.unit,
            cell(r.kvcr),
            cell(r.reference),
            ratio(r.reference),
            cell(r.write),
            cell(r.read),
            ratio(r.read),
        );
    }
    out.push_str(
        "\nTransports: the TCP rows pin UCX to `tcp,self` for kvcr and for the reference runner \
         (Mooncake uses its own TCP transport); the shared-memory rows give kvcr \
         `posix,cma,self` and leave the reference runner's UCX on its defaults, which pick \
         shared memory between two processes on one host. The reference runner's local path is \
         NIXL on UCX's defaults; kvcr's is its copy engine.\n\n<!-- plot:peers.svg -->\n",
    );
    let groups: Vec<Group> = rows
        .iter()
        .filter(|r| r.row.unit == "GB/s")
        .map(|r| {
            let mut bars = Vec::new();
            if let Some(s) = r.kvcr {
                bars.push(Bar {
                    series: "kvcr".to_owned(),
                    median: s.median,
                    low: s.low,
                    high: s.high,
                });
            }
            for (series, v) in [
                ("reference runner", r.reference),
                ("Mooncake write", r.write),
                ("Mooncake read", r.read),
            ] {
                if let Some(v) = v {
                    bars.push(Bar {
                        series: series.to_owned(),
                        median: v.median,
                        low: v.low,
                        high: v.high,
                    });
                }
            }
            Group {
                label: r
                    .row
                    .kvcr
                    .trim_start_matches("runner.")
                    .trim_start_matches("peer.")
                    .to_owned(),
                bars,
            }
        })
        .collect();
    let svg = plot::bar_chart("kvcr beside the peers (GB/s)", "GB/s", &groups);
    (out, svg)
}

/// `BENCH` lines for the side-by-side figures: kvcr's median as the value,
/// the peer's as the anchor, the ratio kvcr ÷ peer.
pub(crate) fn bench_lines(summaries: &[Summary]) -> Vec<String> {
    let mut lines = Vec::new();
    for r in resolve(summaries) {
        let Some(k) = r.kvcr else { continue };
        for (label, peer) in [("reference", r.reference), ("mooncake_read", r.read)] {
            if let Some(p) = peer.map(|p| p.median).filter(|p| *p != 0.0) {
                lines.push(format!(
                    "BENCH peers.vs_{label}.{} value={:.3} unit={} anchor={p:.3} ratio={:.3}",
                    r.row.kvcr,
                    k.median,
                    r.row.unit,
                    k.median / p
                ));
            }
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figure(name: &str, value: f64) -> Figure {
        Figure {
            name: name.to_owned(),
            unit: "GB/s".to_owned(),
            value,
            anchor: None,
        }
    }

    #[test]
    fn side_by_side_rows_pair_kvcr_with_each_peer() {
        let summaries = bench::summarize(&[vec![
            figure("runner.deposit", 10.0),
            figure("peer.request_1mib_tcp", 2.0),
            Figure {
                unit: "us".to_owned(),
                ..figure("runner.one_block_deposit_p50", 50.0)
            },
            figure("peers.reference.deposit_256kib", 1.0),
            Figure {
                unit: "us".to_owned(),
                ..figure("peers.reference.one_block_deposit_p50", 1000.0)
            },
            figure("peers.mooncake.write_1mib_tcp", 0.5),
            figure("peers.mooncake.read_1mib_tcp", 4.0),
        ]]);
        let (table, svg) = render(&summaries, true);
        assert!(
            table.contains("| local deposit, 512 × 256 KiB | GB/s | 10.0 (10.0–10.0) | 1.00 (1.00–1.00) | 10.00 | - | - | - |"),
            "{table}"
        );
        // Latency: lower is better, so the advantage is peer ÷ kvcr.
        assert!(
            table.contains("| 50.0 (50.0–50.0) | 1000 (1000–1000) | 20.00 |"),
            "{table}"
        );
        assert!(
            table.contains(
                "| 2.00 (2.00–2.00) | - | - | 0.500 (0.500–0.500) | 4.00 (4.00–4.00) | 0.50 |"
            ),
            "{table}"
        );
        assert!(svg.contains("Mooncake read: 4.00"));
        let lines = bench_lines(&summaries);
        assert!(lines.contains(
            &"BENCH peers.vs_reference.runner.deposit value=10.000 unit=GB/s anchor=1.000 ratio=10.000".to_owned()
        ));
        assert!(lines.contains(
            &"BENCH peers.vs_mooncake_read.peer.request_1mib_tcp value=2.000 unit=GB/s anchor=4.000 ratio=0.500".to_owned()
        ));
    }
}
