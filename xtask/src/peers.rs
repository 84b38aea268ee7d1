//! `cargo xtask bench --peers`: the reference Python KV Cache Runner (kvcr
//! 0.1.1) and Mooncake's transfer engine (TCP) on the workloads kvcr's
//! benches measure, in the same rounds, and a side-by-side table. kvcr's
//! one-key TCP requests and Mooncake's run in alternating blocks of each
//! size (`request_blocks`); the reference runner runs after kvcr's figures.
//!
//! Both are installed once into venvs under `target/peers-venv` by
//! `xtask/peers/setup.sh`; our drivers (`xtask/peers/*.py`) print `BENCH
//! peers.<system>.<figure>` lines. Each driver runs inside a network namespace
//! of its own holding only loopback (when this user may create one), since
//! NIXL and Mooncake open listeners on every interface.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

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
/// compared with kvcr's `peer.request_*_tcp`, block for block with kvcr's
/// (`request_blocks`, called by `bench::run` after the `peer` benchmark).
pub(crate) const MOONCAKE: Driver = ("mooncake", "mooncake_tcp.py");

/// The sizes of the one-key-per-request comparison (`peer.request_*_tcp`
/// against Mooncake's TCP read and write): label, bytes, blocks per side in
/// a quick round (a full round takes three times as many), requests per
/// block.
const REQUEST_SIZES: &[(&str, usize, usize, usize)] = &[
    ("64kib", 64 << 10, 6, 50),
    ("1mib", 1 << 20, 6, 20),
    ("16mib", 16 << 20, 4, 5),
];

/// One block of one side of the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Block {
    label: &'static str,
    requests: usize,
    /// Whether kvcr's block runs before Mooncake's (it alternates, so
    /// neither side always runs right after the other's warm caches).
    kvcr_first: bool,
}

/// The blocks of a round, size by size: each side runs the same blocks,
/// kvcr and Mooncake in turn, so that a slow stretch of a shared host falls
/// on both sides of a comparison rather than on one (a round once lost at
/// every size had run all of kvcr's requests in one such stretch).
fn request_schedule(quick: bool) -> Vec<Block> {
    let mut blocks = Vec::new();
    for &(label, _, quick_blocks, requests) in REQUEST_SIZES {
        let n = if quick {
            quick_blocks
        } else {
            3 * quick_blocks
        };
        blocks.extend((0..n).map(|b| Block {
            label,
            requests,
            kvcr_first: b % 2 == 0,
        }));
    }
    blocks
}

/// Requests of `label` a side serves over a whole round.
fn requests_per_round(schedule: &[Block], label: &str) -> usize {
    schedule
        .iter()
        .filter(|b| b.label == label)
        .map(|b| b.requests)
        .sum()
}

/// A `SAMPLES <label> [name=]<µs>,<µs>,…` line: the lists by name (`""`
/// for an unnamed one).
fn parse_samples(line: &str, label: &str) -> Result<BTreeMap<String, Vec<f64>>> {
    let rest = line
        .strip_prefix("SAMPLES ")
        .and_then(|r| r.strip_prefix(label))
        .and_then(|r| r.strip_prefix(' '))
        .with_context(|| format!("expected `SAMPLES {label} …`, got {line:?}"))?;
    let mut lists = BTreeMap::new();
    for field in rest.split_whitespace() {
        let (name, values) = field.split_once('=').unwrap_or(("", field));
        let values = values
            .split(',')
            .map(|v| {
                v.parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .with_context(|| format!("bad sample {v:?} in {line:?}"))
            })
            .collect::<Result<Vec<f64>>>()?;
        if lists.insert(name.to_owned(), values).is_some() {
            bail!("list {name:?} twice in {line:?}");
        }
    }
    Ok(lists)
}

/// The middle sample (the upper one of an even count), as kvcr's benches
/// take it.
fn median(samples: &[f64]) -> Option<f64> {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied()
}

/// A process serving blocks of requests on command (`READY`, then a
/// `SAMPLES` line for each `<label> <count>` line). A server that says
/// nothing for [`BlockServer::SILENCE`] fails the bench instead of hanging
/// it. Dropping it closes its stdin, which ends it, waits for it a while
/// ([`BlockServer::EXIT_GRACE`]), and then kills it.
struct BlockServer {
    name: &'static str,
    silence: Duration,
    exit_grace: Duration,
    child: Child,
    stdin: Option<ChildStdin>,
    /// Its stdout's lines (`crate::stdout_lines`).
    lines: mpsc::Receiver<String>,
}

impl BlockServer {
    /// The longest a server may stay silent: its start (a source and
    /// target per size, warmed up) or one block (`REQUEST_SIZES`: at most
    /// 50 requests, or 5 of 16 MiB); a healthy one takes a few seconds.
    const SILENCE: Duration = Duration::from_secs(120);
    /// How long a server closed on its stdin may take to exit.
    const EXIT_GRACE: Duration = Duration::from_secs(10);

    fn start(name: &'static str, cmd: &mut Command) -> Result<Self> {
        Self::start_with(name, cmd, Self::SILENCE, Self::EXIT_GRACE)
    }

    fn start_with(
        name: &'static str,
        cmd: &mut Command,
        silence: Duration,
        exit_grace: Duration,
    ) -> Result<Self> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("could not start {}", crate::show(cmd)))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("no stdout")?;
        let lines = crate::stdout_lines(stdout);
        let server = Self {
            name,
            silence,
            exit_grace,
            child,
            stdin,
            lines,
        };
        loop {
            match server.next_line("starting")? {
                Some(line) if line == "READY" => return Ok(server),
                Some(_) => {}
                None => bail!("{name} exited before it was ready"),
            }
        }
    }

    /// The server's next line (`None`: it closed its stdout), or an error
    /// after its silence limit.
    fn next_line(&self, doing: &str) -> Result<Option<String>> {
        match self.lines.recv_timeout(self.silence) {
            Ok(line) => Ok(Some(line)),
            Err(mpsc::RecvTimeoutError::Disconnected) => Ok(None),
            Err(mpsc::RecvTimeoutError::Timeout) => bail!(
                "{} said nothing for {:?} while {doing}",
                self.name,
                self.silence
            ),
        }
    }

    fn block(&mut self, label: &str, requests: usize) -> Result<BTreeMap<String, Vec<f64>>> {
        let stdin = self.stdin.as_mut().context("stdin closed")?;
        writeln!(stdin, "{label} {requests}")?;
        stdin.flush()?;
        let line = self
            .next_line(&format!("serving {requests} requests of {label}"))?
            .with_context(|| format!("{} exited during a block of {label}", self.name))?;
        let lists = parse_samples(&line, label)?;
        for (name, samples) in &lists {
            if samples.len() != requests {
                bail!(
                    "{} answered {} samples in list {name:?} for {requests} requests",
                    self.name,
                    samples.len()
                );
            }
        }
        Ok(lists)
    }

    /// Closes its stdin and waits for it to exit, killing it after its
    /// grace; its exit status (`None` if waiting failed).
    fn shut(&mut self) -> Option<std::process::ExitStatus> {
        drop(self.stdin.take());
        crate::wait_or_kill(&mut self.child, self.exit_grace, self.name)
    }
}

impl Drop for BlockServer {
    fn drop(&mut self) {
        self.shut();
    }
}

/// kvcr's one-key requests (`peer` bench binary `peer_bench`) and Mooncake's
/// TCP transfers, in alternating blocks of the same size
/// (`request_schedule`): `peer.request_<size>_tcp` (GB/s: the size over
/// the median request; anchor: Mooncake's read of the same blocks),
/// `peers.mooncake.{read,write}_<size>_tcp`, and the same requests over a
/// plain TCP socket inside kvcr's blocks (the host's loopback ceiling):
/// `peers.plain_socket.read_<size>_tcp` and `peer.request_vs_socket_<size>_tcp`
/// (kvcr anchored on it).
pub(crate) fn request_blocks(
    root: &Path,
    prepared: &Prepared,
    peer_bench: &Path,
    quick: bool,
    round: &str,
    started: Instant,
) -> Result<Vec<Figure>> {
    let schedule = request_schedule(quick);
    let plan: Vec<String> = REQUEST_SIZES
        .iter()
        .map(|&(label, bytes, ..)| {
            format!("{label}:{bytes}:{}", requests_per_round(&schedule, label))
        })
        .collect();
    let log = root.join("target").join("bench").join("peers-mooncake.log");
    std::fs::create_dir_all(log.parent().context("log folder")?)?;
    let mut kvcr = BlockServer::start(
        "kvcr's peer bench",
        Command::new(peer_bench).current_dir(root).args([
            "--bench",
            "--request-blocks",
            &plan.join(","),
        ]),
    )?;
    let mut mooncake = BlockServer::start(
        "Mooncake's driver",
        driver(
            &prepared.dir.join("mooncake").join("bin/python"),
            &root.join("xtask/peers/mooncake_tcp.py"),
            quick,
            prepared.isolated,
        )
        .arg("--blocks")
        .stderr(std::fs::File::create(&log)?),
    )
    .with_context(|| format!("see {}", log.display()))?;
    let mut samples: BTreeMap<(&str, &str), Vec<f64>> = BTreeMap::new();
    for block in &schedule {
        let mut run = |server: &mut BlockServer, side: &'static str| -> Result<()> {
            for (name, values) in server.block(block.label, block.requests)? {
                let key = match (side, name.as_str()) {
                    ("kvcr", "") => "kvcr",
                    ("kvcr", "socket") => "socket",
                    ("mooncake", "read") => "read",
                    ("mooncake", "write") => "write",
                    _ => bail!("{side} answered an unknown list {name:?}"),
                };
                samples
                    .entry((block.label, key))
                    .or_default()
                    .extend(values);
            }
            Ok(())
        };
        if block.kvcr_first {
            run(&mut kvcr, "kvcr")?;
            run(&mut mooncake, "mooncake")?;
        } else {
            run(&mut mooncake, "mooncake")?;
            run(&mut kvcr, "kvcr")?;
        }
    }
    drop((kvcr, mooncake));
    let mut figures = Vec::new();
    for &(label, bytes, ..) in REQUEST_SIZES {
        let gbs = |key: &str| -> Result<f64> {
            let med = samples
                .get(&(label, key))
                .and_then(|s| median(s))
                .with_context(|| format!("no {key} samples of {label}"))?;
            Ok(bytes as f64 / med / 1e3)
        };
        let (kvcr, read, write) = (gbs("kvcr")?, gbs("read")?, gbs("write")?);
        let socket = gbs("socket")?;
        let count = requests_per_round(&schedule, label);
        eprintln!(
            "[{:6.1} s] {round} requests of {label} in alternating blocks ({count} each): \
             kvcr {kvcr:.3} GB/s, Mooncake read {read:.3}, write {write:.3}, \
             plain socket {socket:.3}",
            started.elapsed().as_secs_f64()
        );
        let figure = |name: String, value: f64, anchor: Option<f64>| Figure {
            name,
            unit: "GB/s".to_owned(),
            value,
            anchor,
        };
        figures.push(figure(
            format!("peer.request_{label}_tcp"),
            kvcr,
            Some(read),
        ));
        figures.push(figure(
            format!("peers.mooncake.read_{label}_tcp"),
            read,
            None,
        ));
        figures.push(figure(
            format!("peers.mooncake.write_{label}_tcp"),
            write,
            None,
        ));
        // The host's loopback ceiling for one request at a time of this
        // size, and kvcr's share of it.
        figures.push(figure(
            format!("peers.plain_socket.read_{label}_tcp"),
            socket,
            None,
        ));
        figures.push(figure(
            format!("peer.request_vs_socket_{label}_tcp"),
            kvcr,
            Some(socket),
        ));
    }
    Ok(figures)
}

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
         P2P handshake) ran in every round next to kvcr's benchmarks (Mooncake's one-key transfers \
         in blocks alternating with kvcr's of the same size, right after kvcr's `peer` \
         benchmark; the reference runner after all of kvcr's), each {}, with our \
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

    /// SIGKILL's number (9 on every Linux architecture).
    const SIGKILL: i32 = 9;

    /// A block server played by `sh -c script`.
    fn shell_server(script: &str, silence_ms: u64, grace_ms: u64) -> Result<BlockServer> {
        BlockServer::start_with(
            "test server",
            Command::new("sh").args(["-c", script]),
            Duration::from_millis(silence_ms),
            Duration::from_millis(grace_ms),
        )
    }

    #[test]
    fn a_block_server_answers_blocks_and_ends_with_its_stdin() {
        let mut server = shell_server(
            "echo noise; echo READY; while read label n; do echo \"SAMPLES $label 1.5,2.5\"; done",
            10_000,
            10_000,
        )
        .unwrap();
        let lists = server.block("64kib", 2).unwrap();
        assert_eq!(lists[""], vec![1.5, 2.5]);
        // Two samples answered for three asked is an error, not a figure.
        let err = server.block("64kib", 3).unwrap_err();
        assert!(err.to_string().contains("answered 2 samples"), "{err:#}");
        let status = server.shut().unwrap();
        assert!(status.success(), "closed stdin ends it: {status}");
    }

    #[test]
    fn a_block_server_that_exits_or_stays_silent_is_an_error() {
        let err = shell_server("exit 0", 10_000, 10_000).err().unwrap();
        assert!(
            err.to_string().contains("exited before it was ready"),
            "{err:#}"
        );
        let err = shell_server("exec sleep 30", 200, 100).err().unwrap();
        assert!(err.to_string().contains("said nothing"), "{err:#}");
        // The silence limit covers the start too: long enough for `sh` to
        // say READY on a loaded machine.
        let mut server = shell_server("echo READY; read line; exec sleep 30", 2_000, 100).unwrap();
        let err = server.block("1mib", 1).unwrap_err();
        assert!(err.to_string().contains("said nothing"), "{err:#}");
    }

    #[test]
    fn a_block_server_that_ignores_its_closed_stdin_is_killed() {
        // `exec sleep` ignores stdin: only the kill after the grace ends it.
        use std::os::unix::process::ExitStatusExt as _;
        let mut server = shell_server("echo READY; exec sleep 30", 10_000, 100).unwrap();
        let status = server.shut().unwrap();
        assert_eq!(status.signal(), Some(SIGKILL), "{status}");
    }

    #[test]
    fn each_size_gives_both_sides_the_same_blocks_first_in_turn() {
        for quick in [true, false] {
            let schedule = request_schedule(quick);
            for &(label, _, quick_blocks, requests) in REQUEST_SIZES {
                let blocks: Vec<&Block> = schedule.iter().filter(|b| b.label == label).collect();
                let n = if quick {
                    quick_blocks
                } else {
                    3 * quick_blocks
                };
                assert_eq!(blocks.len(), n, "{label}");
                assert!(
                    n % 2 == 0,
                    "{label}: as many blocks with kvcr first as second"
                );
                assert!(blocks.iter().all(|b| b.requests == requests));
                let kvcr_first = blocks.iter().filter(|b| b.kvcr_first).count();
                assert_eq!(kvcr_first * 2, n, "{label}: kvcr first in half the blocks");
                assert!(
                    blocks
                        .windows(2)
                        .all(|w| w[0].kvcr_first != w[1].kvcr_first),
                    "{label}: the order alternates block by block"
                );
                assert_eq!(requests_per_round(&schedule, label), n * requests);
            }
            // Sizes run one after another, not interleaved with each other.
            let labels: Vec<&str> = schedule.iter().map(|b| b.label).collect();
            let mut runs = labels.clone();
            runs.dedup();
            assert_eq!(runs.len(), REQUEST_SIZES.len());
        }
    }

    #[test]
    fn samples_lines_parse_named_and_unnamed_lists() {
        let kvcr = parse_samples("SAMPLES 64kib 41.5,40.2,55.0", "64kib").unwrap();
        assert_eq!(kvcr[""], vec![41.5, 40.2, 55.0]);
        let moon = parse_samples("SAMPLES 1mib write=900.1,950 read=1200,1100.5", "1mib").unwrap();
        assert_eq!(moon["write"], vec![900.1, 950.0]);
        assert_eq!(moon["read"], vec![1200.0, 1100.5]);
        assert_eq!(moon.len(), 2);
    }

    #[test]
    fn bad_samples_lines_are_errors() {
        for (line, label) in [
            ("SAMPLES 1mib 1,2", "64kib"),            // another size
            ("SAMPLE 64kib 1,2", "64kib"),            // not a samples line
            ("SAMPLES 64kib 1,x", "64kib"),           // not a number
            ("SAMPLES 64kib 1,0", "64kib"),           // a zero time
            ("SAMPLES 64kib 1,inf", "64kib"),         // not finite
            ("SAMPLES 64kib read=1 read=2", "64kib"), // a list twice
            ("SAMPLES 64kib 1,,2", "64kib"),          // an empty sample
        ] {
            assert!(parse_samples(line, label).is_err(), "{line:?} parsed");
        }
    }

    #[test]
    fn median_takes_the_upper_middle() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(3.0));
        assert_eq!(median(&[]), None);
    }

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
