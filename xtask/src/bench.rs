//! `cargo xtask bench`: builds every benchmark binary of the workspace, runs
//! each several times (rounds), and writes a Markdown report with SVG plots
//! under `target/bench/`.
//!
//! Each benchmark measures its own anchor (memcpy, `ucx_perftest`, a naive
//! path) in the same run and prints
//! `BENCH <name> value=<median> unit=<unit> [anchor=<median>] [ratio=<value/anchor>]`,
//! and latency distributions as `DIST <name> unit=<unit> p0=.. p5=.. … p100=..`.
//! The report gives, for every figure, the median over the rounds and the
//! spread (min–max), beside its anchor and the ratio (each round's ratio is
//! taken inside that round, so the anchor shares the figure's noise).
//! `--peers` adds the reference Python runner, measured after kvcr's
//! figures, and Mooncake's transfer engine, whose one-key transfers run in
//! blocks alternating with kvcr's (see `peers.rs`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::plot::{self, Bar, Group, Line};

/// Command-line options of `cargo xtask bench`.
pub(crate) struct Options {
    pub quick: bool,
    pub peers: bool,
    /// Also run the between-hosts figures over a shaped link (root).
    pub link: bool,
    pub rounds: usize,
    /// [`load`] when the measuring started.
    pub load_at_start: Option<(f64, usize)>,
}

fn parse(rest: &[String]) -> Result<Options> {
    let mut o = Options {
        quick: false,
        peers: false,
        link: false,
        rounds: 0,
        load_at_start: None,
    };
    let mut it = rest.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--quick" => o.quick = true,
            "--peers" => o.peers = true,
            "--link" => o.link = true,
            "--rounds" => {
                o.rounds = it
                    .next()
                    .context("--rounds needs a number")?
                    .parse()
                    .context("--rounds needs a number")?;
                if o.rounds == 0 {
                    bail!("--rounds must be at least 1");
                }
            }
            other => {
                bail!("unknown bench option {other:?} (use --quick, --peers, --link, --rounds N)")
            }
        }
    }
    if o.rounds == 0 {
        // `--quick` is the two-minute look: one round, each figure the
        // median of its binary's own repetitions. A side-by-side with the
        // peers is a comparison round by round, so it keeps three.
        o.rounds = match (o.quick, o.peers) {
            (true, false) => 1,
            (true, true) => 3,
            (false, _) => 5,
        };
    }
    Ok(o)
}

/// One `BENCH` line.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Figure {
    pub name: String,
    pub unit: String,
    pub value: f64,
    pub anchor: Option<f64>,
}

/// One `DIST` line: `(percentile, value)` points.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Dist {
    pub name: String,
    pub unit: String,
    pub points: Vec<(f64, f64)>,
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|part| part.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
}

pub(crate) fn parse_figure(line: &str) -> Option<Figure> {
    let rest = line.strip_prefix("BENCH ")?;
    let name = rest.split_whitespace().next()?.to_owned();
    Some(Figure {
        name,
        unit: field(rest, "unit").unwrap_or("-").to_owned(),
        value: field(rest, "value")?.parse().ok()?,
        anchor: field(rest, "anchor").and_then(|a| a.parse().ok()),
    })
}

pub(crate) fn parse_dist(line: &str) -> Option<Dist> {
    let rest = line.strip_prefix("DIST ")?;
    let name = rest.split_whitespace().next()?.to_owned();
    let points = rest
        .split_whitespace()
        .filter_map(|part| {
            let (k, v) = part.split_once('=')?;
            let p: f64 = k.strip_prefix('p')?.parse().ok()?;
            Some((p, v.parse().ok()?))
        })
        .collect();
    Some(Dist {
        name,
        unit: field(rest, "unit").unwrap_or("-").to_owned(),
        points,
    })
}

/// Figures a benchmark prints without an anchor, paired here with another
/// figure measured in the same round: (figure, anchor figure).
const PAIRS: &[(&str, &str)] = &[
    ("ucx.put_16mib_shm", "ucx.perftest_put_bw_16mib_shm"),
    ("ucx.put_256kib_x64_shm", "ucx.perftest_put_bw_256kib_shm"),
    ("publisher.events", "publisher.events_core"),
];

/// What each figure's anchor is (figures not listed are anchors themselves,
/// or are ratios already).
const ANCHOR_WHAT: &[(&str, &str)] = &[
    (
        "g3.spill",
        "O_DIRECT sequential 4 MiB pwrite, one thread per file, same bytes and files, same round",
    ),
    (
        "g3.fill",
        "O_DIRECT sequential 4 MiB pread, one thread per file, same bytes and files, same round",
    ),
    (
        "g3.deposit_with_spills",
        "the same deposits into the same full pool without G3 (victims dropped), same round",
    ),
    (
        "g3.one_block_fill_p50",
        "one O_DIRECT pread of a 3.5 MiB page at the same offset",
    ),
    (
        "guard.warm_restart_ms",
        "a cold start of the same runner without a guard (pools made and prefaulted), same round",
    ),
    (
        "guard.journal_overhead",
        "the same deposits into the same kind of pools without a guard's journal, the two runners taking turns call by call",
    ),
    (
        "link.fetch_bulk_",
        "ucx_perftest put_bw, 256 KiB puts, over the same link (tcp, kvcr's segments)",
    ),
    (
        "link.fetch_bulk",
        "ucx_perftest put_bw, 256 KiB puts, over the same link (tcp, kvcr's segments)",
    ),
    (
        "link.one_block_vs_ucx_",
        "ucx_perftest put_lat of one 256 KiB put over the same link (tcp, kvcr's segments)",
    ),
    (
        "link.one_block_p50_",
        "2 × the link's measured round trip + the page's serialisation at its measured rate",
    ),
    (
        "link.one_block_p50",
        "2 × the link's measured round trip + the page's serialisation at its measured rate",
    ),
    ("runner.deposit", "memcpy, one thread, same 512 × 256 KiB"),
    ("runner.deliver", "memcpy, one thread, same 512 × 256 KiB"),
    (
        "runner.deposit_digests",
        "the same deposits with page digests off, alternating in one round (target ≥ 0.9)",
    ),
    (
        "peer.digest_cost_",
        "the same restores with page digests off, alternating in one round (target ≥ 0.95)",
    ),
    (
        "runner.one_block_deposit_p50",
        "one 256 KiB memcpy on the caller's thread",
    ),
    (
        "runner.query_hits",
        "naive path: std HashMap lookup of the same keys",
    ),
    (
        "peer.fetch_bulk_shm",
        "memcpy, one thread, 1 GiB between distinct DRAM buffers, 16 MiB per call",
    ),
    (
        "peer.fetch_lanes_shm",
        "`process_vm_readv` at the lane count, 1 GiB between distinct DRAM buffers",
    ),
    (
        "peer.fetch_contended",
        "the same fetch without the two busy loops",
    ),
    (
        "peer.fetch_16mib_shm_ucx",
        "the same fetch with the one-copy mapping",
    ),
    (
        "peer.fetch_16mib_shm",
        "`ucx_perftest` put_bw 16 MiB, posix+cma",
    ),
    (
        "peer.fetch_256kib_shm",
        "`ucx_perftest` put_bw 256 KiB, posix+cma",
    ),
    ("peer.fetch_16mib_tcp", "`ucx_perftest` put_bw 16 MiB, tcp"),
    (
        "peer.fetch_256kib_tcp",
        "`ucx_perftest` put_bw 256 KiB, tcp",
    ),
    (
        "peer.request_",
        "Mooncake's TCP read of the same size, in blocks alternating with kvcr's (`--peers`)",
    ),
    (
        "peer.request_vs_socket_",
        "the same requests over a plain loopback TCP socket, inside kvcr's blocks (`--peers`)",
    ),
    (
        "peer.request_64kib_tcp_contended_p50",
        "the same requests without the two busy loops",
    ),
    (
        "peer.one_block_tcp_p50",
        "`ucx_perftest` put_lat 256 KiB, tcp (one way)",
    ),
    (
        "peer.one_block_p50",
        "`ucx_perftest` put_lat 256 KiB, posix+cma (one way)",
    ),
    ("ucx.put_16mib_shm", "`ucx_perftest` put_bw 16 MiB, sm"),
    (
        "ucx.put_256kib_x64_shm",
        "`ucx_perftest` put_bw 256 KiB, posix+cma",
    ),
    (
        "publisher.events",
        "the sans-I/O encoder alone on one thread",
    ),
    (
        "runner.query_ns@",
        "naive path: std HashMap lookup of the same keys",
    ),
    ("ucx.perftest_", "(an anchor: `ucx_perftest` itself)"),
    ("publisher.events_core", "(an anchor: the encoder alone)"),
    (
        "runner.bytes_per_block",
        "(heap bytes per resident block: no anchor)",
    ),
];

fn anchor_what(name: &str) -> Option<&'static str> {
    // An exact name, else the longest prefix ending in `@` or `_`.
    ANCHOR_WHAT
        .iter()
        .find(|(n, _)| *n == name)
        .or_else(|| {
            ANCHOR_WHAT
                .iter()
                .filter(|(n, _)| (n.ends_with('@') || n.ends_with('_')) && name.starts_with(n))
                .max_by_key(|(n, _)| n.len())
        })
        .map(|(_, w)| *w)
}

/// Median and spread of a set of values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Spread {
    pub median: f64,
    pub low: f64,
    pub high: f64,
}

impl Spread {
    pub(crate) fn of(values: &[f64]) -> Option<Self> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n == 0 {
            return None;
        } else if n % 2 == 1 {
            *v.get(n / 2)?
        } else {
            (v.get(n / 2 - 1)? + v.get(n / 2)?) / 2.0
        };
        Some(Self {
            median,
            low: *v.first()?,
            high: *v.last()?,
        })
    }

    fn show(&self) -> String {
        format!(
            "{} ({}–{})",
            short(self.median),
            short(self.low),
            short(self.high)
        )
    }
}

pub(crate) fn short(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// One figure over every round.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Summary {
    pub name: String,
    pub unit: String,
    pub value: Spread,
    pub anchor: Option<Spread>,
    pub ratio: Option<Spread>,
    pub runs: usize,
}

/// Summarises the figures of every round (in first-seen order), pairing
/// unanchored figures with their [`PAIRS`] anchor from the same round.
pub(crate) fn summarize(rounds: &[Vec<Figure>]) -> Vec<Summary> {
    /// Per figure: its unit, and its values, anchors and ratios over the rounds.
    type Samples = (String, Vec<f64>, Vec<f64>, Vec<f64>);
    let mut order: Vec<String> = Vec::new();
    let mut by_name: BTreeMap<String, Samples> = BTreeMap::new();
    for round in rounds {
        for figure in round {
            let anchor = figure.anchor.or_else(|| {
                let (_, anchor_name) = PAIRS.iter().find(|(f, _)| *f == figure.name)?;
                round
                    .iter()
                    .find(|f| f.name == *anchor_name)
                    .map(|f| f.value)
            });
            let entry = by_name.entry(figure.name.clone()).or_insert_with(|| {
                order.push(figure.name.clone());
                (figure.unit.clone(), Vec::new(), Vec::new(), Vec::new())
            });
            entry.1.push(figure.value);
            if let Some(a) = anchor.filter(|a| *a != 0.0) {
                entry.2.push(a);
                entry.3.push(figure.value / a);
            }
        }
    }
    order
        .into_iter()
        .filter_map(|name| {
            let (unit, values, anchors, ratios) = by_name.remove(&name)?;
            Some(Summary {
                runs: values.len(),
                value: Spread::of(&values)?,
                anchor: Spread::of(&anchors),
                ratio: Spread::of(&ratios),
                name,
                unit,
            })
        })
        .collect()
}

/// The report's sections: title, and which figures (by name prefix) they hold.
const SECTIONS: &[(&str, &[&str])] = &[
    (
        "Local deposit and deliver",
        &["runner.deposit", "runner.deliver"],
    ),
    ("One-block latency", &["runner.one_block", "peer.one_block"]),
    (
        "Query rate and its scaling",
        &["runner.query", "runner.bytes_per_block"],
    ),
    (
        "Peer fetch by transfer size and transport",
        &["peer.fetch", "peer.request"],
    ),
    ("Publisher", &["publisher."]),
    ("G3 file tier", &["g3."]),
    ("Guard: warm restart and the residency journal", &["guard."]),
    ("UCX layer", &["ucx."]),
    ("Peers' own figures (`--peers`)", &["peers."]),
    (
        "Between hosts (`--link`: network namespaces over a 1 Gbit/s link at three round trips, and 4 Gbit/s at 200 µs)",
        &["link."],
    ),
];

fn section_of(name: &str) -> usize {
    SECTIONS
        .iter()
        .position(|(_, prefixes)| prefixes.iter().any(|p| name.starts_with(p)))
        .unwrap_or(SECTIONS.len())
}

/// A bench binary built by cargo.
struct Binary {
    name: String,
    path: PathBuf,
}

fn build(root: &Path) -> Result<Vec<Binary>> {
    let metadata = cargo_metadata::MetadataCommand::new()
        .manifest_path(root.join("Cargo.toml"))
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    let mut cmd = crate::cargo();
    cmd.current_dir(root).args([
        "bench",
        "--locked",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ]);
    let mut any = false;
    for package in metadata.workspace_packages() {
        for target in &package.targets {
            if target.kind.iter().any(|k| k.to_string() == "bench") {
                cmd.args(["-p", package.name.as_str(), "--bench", target.name.as_str()]);
                any = true;
            }
        }
    }
    if !any {
        bail!("no benchmarks found");
    }
    eprintln!("xtask bench: building the benchmarks (release)…");
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .context("could not start cargo bench --no-run")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut binaries = Vec::new();
    for message in cargo_metadata::Message::parse_stream(BufReader::new(stdout)) {
        if let cargo_metadata::Message::CompilerArtifact(artifact) = message? {
            let is_bench = artifact
                .target
                .kind
                .iter()
                .any(|k| k.to_string() == "bench");
            if let (true, Some(exe)) = (is_bench, artifact.executable) {
                binaries.push(Binary {
                    name: artifact.target.name.clone(),
                    path: exe.into_std_path_buf(),
                });
            }
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("building the benchmarks failed with {status}");
    }
    // A stable order: cheap, noisy-sensitive figures first.
    binaries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(binaries)
}

/// Everything one run of one bench binary printed that the report uses.
#[derive(Default)]
pub(crate) struct Output {
    pub figures: Vec<Figure>,
    pub dists: Vec<Dist>,
    pub notes: Vec<String>,
}

/// Runs `cmd`, echoing its `BENCH`/`DIST`/`# ` lines with `prefix` as they
/// arrive, and collects them.
pub(crate) fn collect(cmd: &mut Command, prefix: &str, started: Instant) -> Result<Output> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start {}", crate::show(cmd)))?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut out = Output::default();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        let elapsed = started.elapsed().as_secs_f64();
        if let Some(f) = parse_figure(&line) {
            eprintln!("[{elapsed:6.1} s] {prefix} {line}");
            out.figures.push(f);
        } else if let Some(d) = parse_dist(&line) {
            eprintln!("[{elapsed:6.1} s] {prefix} {} (distribution)", d.name);
            out.dists.push(d);
        } else if let Some(note) = line.strip_prefix("# ") {
            eprintln!("[{elapsed:6.1} s] {prefix} {line}");
            out.notes.push(note.to_owned());
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("{} failed with {status}", crate::show(cmd));
    }
    Ok(out)
}

pub(crate) fn run(root: &Path, rest: &[String]) -> Result<()> {
    let mut o = parse(rest)?;
    crate::setup::ensure_system_packages()?;
    let binaries = build(root)?;
    let peers = if o.peers {
        Some(crate::peers::prepare(root)?)
    } else {
        None
    };
    let started = Instant::now();
    o.load_at_start = load();
    let mut rounds: Vec<Vec<Figure>> = Vec::new();
    let mut dists: Vec<Dist> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    eprintln!(
        "xtask bench: {} binaries{} × {} rounds{}",
        binaries.len(),
        if o.peers { " and 2 peers" } else { "" },
        o.rounds,
        if o.quick { " (quick)" } else { "" }
    );
    // Mooncake's one-key transfers and kvcr's run right after kvcr's `peer`
    // benchmark, in alternating blocks of each size (`peers::request_blocks`):
    // a stretch of the shared VM's noise then falls on both sides (when
    // Mooncake ran after every binary, ~20 s after kvcr's requests, a round
    // kvcr lost at every size had run all of kvcr's tcp figures at half
    // speed while Mooncake's were not slowed).
    let mooncake_after_peer = binaries.iter().any(|b| b.name == "peer");
    for round in 0..o.rounds {
        let mut figures = Vec::new();
        let mut peer_dists = Vec::new();
        let label = format!("round {}/{}", round + 1, o.rounds);
        let mut drivers: Vec<crate::peers::Driver> = Vec::new();
        if peers.is_some() {
            drivers.push(crate::peers::REFERENCE);
            if !mooncake_after_peer {
                drivers.push(crate::peers::MOONCAKE);
            }
        }
        for binary in &binaries {
            let mut cmd = Command::new(&binary.path);
            cmd.current_dir(root).arg("--bench");
            if o.quick {
                cmd.arg("--quick").env("KVCR_BENCH_QUICK", "1");
            }
            if o.peers {
                // The peer bench adds kvcr's side of the peers' workloads.
                cmd.env("KVCR_BENCH_PEERS", "1");
            }
            let out = collect(&mut cmd, &format!("{label} {}:", binary.name), started)?;
            figures.extend(out.figures);
            // Distributions and notes: the last round's (one plot, not many).
            if round + 1 == o.rounds {
                dists.extend(out.dists);
                notes.extend(out.notes);
            }
            if let Some(prepared) = peers
                .as_ref()
                .filter(|_| mooncake_after_peer && binary.name == "peer")
            {
                figures.extend(crate::peers::request_blocks(
                    root,
                    prepared,
                    &binary.path,
                    o.quick,
                    &label,
                    started,
                )?);
            }
        }
        if let Some(prepared) = &peers {
            // Right after kvcr's figures of the same round: the machine's
            // noise of the moment is shared between the two.
            let (f, d) =
                crate::peers::run_round(root, prepared, &drivers, o.quick, &label, started)?;
            figures.extend(f);
            peer_dists.extend(d);
        }
        if round + 1 == o.rounds {
            dists.extend(peer_dists);
        }
        if o.link {
            let node = crate::node::build(root, true)?;
            let lines = crate::link::bench_round(&node, o.quick, &label)?;
            figures.extend(lines.iter().filter_map(|l| parse_figure(l)));
        }
        rounds.push(figures);
    }
    // The Python face (its own cargo workspace and a Python driver): once,
    // into the last round, when its venv exists (`cargo xtask python` or
    // `cargo xtask test` makes it; installing torch is not a benchmark's job).
    if crate::python::env_ready(root) {
        let lines = crate::python::bench(root, o.quick)?;
        if let Some(last) = rounds.last_mut() {
            last.extend(lines.iter().filter_map(|l| parse_figure(l)));
        }
    } else {
        notes.push(
            "py.restore_ratio skipped: no Python venv (run `cargo xtask python` once)".to_owned(),
        );
    }
    let summaries = summarize(&rounds);
    let dir = root.join("target").join("bench");
    std::fs::create_dir_all(&dir)?;
    let mut plots: Vec<(String, String)> = plots(&summaries, &dists);
    let mut report = render(&summaries, &o, started.elapsed().as_secs_f64(), &notes);
    if let Some(prepared) = &peers {
        let (table, svg) = crate::peers::render(&summaries, prepared.isolated);
        report.push_str(&table);
        plots.push(("peers.svg".to_owned(), svg));
    }
    for (file, svg) in &plots {
        std::fs::write(dir.join(file), svg)?;
        // Each plot goes under the section that names it.
        let marker = format!("<!-- plot:{file} -->");
        report = report.replace(&marker, &format!("![{file}]({file})"));
    }
    let path = dir.join("report.md");
    std::fs::write(&path, &report)?;
    eprintln!("xtask bench: summary (median over {} rounds):", o.rounds);
    for s in &summaries {
        println!("{}", bench_line(s));
    }
    if peers.is_some() {
        for line in crate::peers::bench_lines(&summaries) {
            println!("{line}");
        }
    }
    eprintln!(
        "xtask bench: report and {} plots written to {}",
        plots.len(),
        path.display()
    );
    Ok(())
}

/// The summary in the `BENCH` line format, with the spread appended.
pub(crate) fn bench_line(s: &Summary) -> String {
    let mut line = format!(
        "BENCH {} value={:.3} unit={}",
        s.name, s.value.median, s.unit
    );
    if let (Some(a), Some(r)) = (s.anchor, s.ratio) {
        let _ = write!(line, " anchor={:.3} ratio={:.3}", a.median, r.median);
    }
    let _ = write!(
        line,
        " min={:.3} max={:.3} runs={}",
        s.value.low, s.value.high, s.runs
    );
    line
}

fn find<'a>(summaries: &'a [Summary], name: &str) -> Option<&'a Summary> {
    summaries.iter().find(|s| s.name == name)
}

fn bars_with_anchor(summaries: &[Summary], names: &[(&str, &str)], anchor: &str) -> Vec<Group> {
    names
        .iter()
        .filter_map(|(name, label)| {
            let s = find(summaries, name)?;
            let mut bars = vec![Bar {
                series: "kvcr".to_owned(),
                median: s.value.median,
                low: s.value.low,
                high: s.value.high,
            }];
            if let Some(a) = s.anchor {
                bars.push(Bar {
                    series: anchor.to_owned(),
                    median: a.median,
                    low: a.low,
                    high: a.high,
                });
            }
            Some(Group {
                label: (*label).to_owned(),
                bars,
            })
        })
        .collect()
}

/// Query cost per key at each resident-set size (`runner.query_ns@<blocks>`).
fn query_lines(summaries: &[Summary]) -> Vec<Line> {
    let mut kvcr = Vec::new();
    let mut naive = Vec::new();
    for s in summaries {
        let Some(blocks) = s
            .name
            .strip_prefix("runner.query_ns@")
            .and_then(|b| b.parse::<f64>().ok())
        else {
            continue;
        };
        kvcr.push((blocks, s.value.median));
        if let Some(a) = s.anchor {
            naive.push((blocks, a.median));
        }
    }
    kvcr.sort_by(|a, b| a.0.total_cmp(&b.0));
    naive.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut lines = vec![Line {
        label: "kvcr query".to_owned(),
        points: kvcr,
    }];
    if !naive.is_empty() {
        lines.push(Line {
            label: "std HashMap".to_owned(),
            points: naive,
        });
    }
    lines
}

/// Every plot of the report: (file name, SVG).
fn plots(summaries: &[Summary], dists: &[Dist]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let local = bars_with_anchor(
        summaries,
        &[("runner.deposit", "deposit"), ("runner.deliver", "deliver")],
        "memcpy",
    );
    if !local.is_empty() {
        out.push((
            "local.svg".to_owned(),
            plot::bar_chart(
                "Local deposit / deliver, 512 × 256 KiB (median, min–max)",
                "GB/s",
                &local,
            ),
        ));
    }
    let peer_names: Vec<(&str, &str)> = summaries
        .iter()
        .filter_map(|s| {
            let label = s
                .name
                .strip_prefix("peer.fetch_")
                .or_else(|| s.name.strip_prefix("peer."))?;
            // One-key requests are anchored on Mooncake, not ucx_perftest:
            // they are drawn in the side-by-side plot.
            // Digest costs are anchored on the same restore without.
            let own_anchor =
                s.name.starts_with("peer.request_") || s.name.starts_with("peer.digest_cost_");
            (s.unit == "GB/s" && !own_anchor).then_some((s.name.as_str(), label))
        })
        .collect();
    let peer = bars_with_anchor(summaries, &peer_names, "ucx_perftest");
    if !peer.is_empty() {
        out.push((
            "peer.svg".to_owned(),
            plot::bar_chart("Peer fetch by transfer size and transport", "GB/s", &peer),
        ));
    }
    let query = query_lines(summaries);
    if query.iter().any(|l| !l.points.is_empty()) {
        out.push((
            "query.svg".to_owned(),
            plot::line_chart(
                "Query cost per key by resident blocks",
                "resident blocks",
                "ns per key",
                true,
                &query,
            ),
        ));
    }
    if !dists.is_empty() {
        let lines: Vec<Line> = dists
            .iter()
            .map(|d| Line {
                label: d.name.clone(),
                points: d.points.iter().map(|(p, v)| (*v, *p)).collect(),
            })
            .collect();
        let unit = dists.first().map_or("us", |d| d.unit.as_str());
        out.push((
            "latency.svg".to_owned(),
            plot::line_chart(
                "One-block (256 KiB) latency distribution (last round)",
                &format!("latency ({unit}, log)"),
                "percentile",
                true,
                &lines,
            ),
        ));
    }
    let publisher = bars_with_anchor(
        summaries,
        &[("publisher.events", "end to end")],
        "encoder alone",
    );
    if !publisher.is_empty() {
        out.push((
            "publisher.svg".to_owned(),
            plot::bar_chart("Publisher rate", "Mevents/s", &publisher),
        ));
    }
    out
}

const PLOT_OF_SECTION: &[&str] = &[
    "local.svg",
    "latency.svg",
    "query.svg",
    "peer.svg",
    "publisher.svg",
    "",
    "",
];

/// The 1-minute load average and the CPU count, to tell a quiet run from a
/// crowded one (`None` off Linux).
pub(crate) fn load() -> Option<(f64, usize)> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let one: f64 = text.split_whitespace().next()?.parse().ok()?;
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    Some((one, cpus))
}

fn render(summaries: &[Summary], o: &Options, secs: f64, notes: &[String]) -> String {
    let mut out = String::from("# kvcr benchmark report\n\n");
    // `date` rather than a time crate: the report only needs a readable stamp.
    if let Ok(stamp) = Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
    {
        let stamp = String::from_utf8_lossy(&stamp.stdout);
        if !stamp.trim().is_empty() {
            let _ = writeln!(out, "Written {}.\n", stamp.trim());
        }
    }
    let _ = writeln!(
        out,
        "Mode: {}; {} rounds of every benchmark binary; {secs:.0} s of measuring.\n",
        if o.quick {
            "`--quick` (fewer repetitions, smaller scales)"
        } else {
            "full"
        },
        o.rounds
    );
    if let (Some((start, cpus)), Some((end, _))) = (o.load_at_start, load()) {
        let _ = writeln!(
            out,
            "Machine load (1-minute average) {start:.1} at the start and {end:.1} at the end, on \
             {cpus} CPUs: above the CPU count, other work competed with these figures.\n"
        );
    }
    out.push_str(
        "Each cell is the median over the rounds with the spread (min–max) in brackets. Every \
         anchor is measured in the same round as its figure, and each ratio is figure ÷ anchor \
         within one round (then the median over rounds). On a shared or small machine, treat \
         differences under about 2× as noise.\n",
    );
    for (i, (title, _)) in SECTIONS
        .iter()
        .chain(std::iter::once(&("Other", &[][..])))
        .enumerate()
    {
        let rows: Vec<&Summary> = summaries
            .iter()
            .filter(|s| section_of(&s.name) == i)
            .collect();
        if rows.is_empty() {
            continue;
        }
        let _ = writeln!(out, "\n## {title}\n");
        out.push_str("| figure | value | unit | anchor | anchor value | ratio |\n");
        out.push_str("|---|---|---|---|---|---|\n");
        for s in rows {
            let what = anchor_what(&s.name).unwrap_or(if s.anchor.is_some() {
                "measured in the same run"
            } else if s.unit == "x" {
                "(a ratio itself)"
            } else if s.name.starts_with("peers.") {
                "(see the side-by-side table)"
            } else {
                "(no anchor)"
            });
            let _ = writeln!(
                out,
                "| `{}` | {} | {} | {} | {} | {} |",
                s.name,
                s.value.show(),
                s.unit,
                what,
                s.anchor.map_or("-".to_owned(), |a| a.show()),
                s.ratio.map_or("-".to_owned(), |r| r.show()),
            );
        }
        if let Some(file) = PLOT_OF_SECTION.get(i).filter(|f| !f.is_empty()) {
            let _ = writeln!(out, "\n<!-- plot:{file} -->");
        }
    }
    if !notes.is_empty() {
        out.push_str("\n## Notes from the benchmarks (last round)\n\n");
        for note in notes {
            let _ = writeln!(out, "- {note}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fig(name: &str, value: f64, anchor: Option<f64>) -> Figure {
        Figure {
            name: name.to_owned(),
            unit: "GB/s".to_owned(),
            value,
            anchor,
        }
    }

    #[test]
    fn parses_bench_and_dist_lines() {
        assert_eq!(
            parse_figure("BENCH runner.deposit value=11.0 unit=GB/s anchor=12.0 ratio=0.917"),
            Some(fig("runner.deposit", 11.0, Some(12.0)))
        );
        assert_eq!(parse_figure("BENCH broken unit=GB/s"), None);
        assert_eq!(parse_figure("note: something"), None);
        let d = parse_dist("DIST runner.one_block unit=us p0=10 p50=20.5 p100=90").unwrap();
        assert_eq!(d.unit, "us");
        assert_eq!(d.points, vec![(0.0, 10.0), (50.0, 20.5), (100.0, 90.0)]);
    }

    #[test]
    fn summary_takes_median_spread_and_per_round_ratios() {
        let rounds = vec![
            vec![fig("runner.deposit", 10.0, Some(20.0))],
            vec![fig("runner.deposit", 12.0, Some(12.0))],
            vec![fig("runner.deposit", 8.0, Some(16.0))],
        ];
        let s = summarize(&rounds);
        assert_eq!(s.len(), 1);
        let s = &s[0];
        assert_eq!(s.runs, 3);
        assert_eq!(
            s.value,
            Spread {
                median: 10.0,
                low: 8.0,
                high: 12.0
            }
        );
        assert_eq!(s.anchor.unwrap().median, 16.0);
        // Ratios per round: 0.5, 1.0, 0.5 — not 10 / 16.
        assert_eq!(
            s.ratio.unwrap(),
            Spread {
                median: 0.5,
                low: 0.5,
                high: 1.0
            }
        );
    }

    /// Every size's one-key requests name their anchors: Mooncake's read
    /// for the plain figure, the plain socket for its share of it.
    #[rstest::rstest]
    #[case::mooncake_64k("peer.request_64kib_tcp", "Mooncake's TCP read")]
    #[case::mooncake_16m("peer.request_16mib_tcp", "Mooncake's TCP read")]
    #[case::socket_64k("peer.request_vs_socket_64kib_tcp", "plain loopback TCP socket")]
    #[case::socket_1m("peer.request_vs_socket_1mib_tcp", "plain loopback TCP socket")]
    #[case::socket_16m("peer.request_vs_socket_16mib_tcp", "plain loopback TCP socket")]
    fn request_figures_name_their_anchor(#[case] name: &str, #[case] anchor: &str) {
        let what = anchor_what(name).unwrap();
        assert!(what.contains(anchor), "{name}: {what}");
    }

    #[test]
    fn unanchored_figures_pair_with_an_anchor_from_the_same_round() {
        let rounds = vec![
            vec![
                fig("publisher.events_core", 4.0, None),
                fig("publisher.events", 2.0, None),
            ],
            vec![fig("publisher.events", 3.0, None)],
        ];
        let s = summarize(&rounds);
        let events = s.iter().find(|s| s.name == "publisher.events").unwrap();
        // Only the first round had the anchor: one ratio, from that round.
        assert_eq!(events.runs, 2);
        assert_eq!(events.ratio.unwrap().median, 0.5);
        assert_eq!(events.anchor.unwrap().median, 4.0);
    }

    #[test]
    fn report_places_figures_in_sections_with_their_anchors_and_plots() {
        let rounds = vec![vec![
            fig("runner.deposit", 11.0, Some(12.0)),
            fig("peer.fetch_16mib_shm", 5.0, Some(8.0)),
            fig("mystery.thing", 1.0, None),
        ]];
        let summaries = summarize(&rounds);
        let o = Options {
            quick: true,
            peers: false,
            link: false,
            rounds: 1,
            load_at_start: None,
        };
        let report = render(&summaries, &o, 1.0, &["a note".to_owned()]);
        assert!(report.contains("## Local deposit and deliver"));
        assert!(report.contains(
            "| `runner.deposit` | 11.0 (11.0–11.0) | GB/s | memcpy, one thread, same 512 × 256 KiB | 12.0 (12.0–12.0) | 0.917 (0.917–0.917) |"
        ));
        assert!(report.contains("## Peer fetch by transfer size and transport"));
        assert!(report.contains("## Other"));
        assert!(report.contains("<!-- plot:local.svg -->"));
        assert!(report.contains("- a note"));
        let files: Vec<String> = plots(&summaries, &[]).into_iter().map(|p| p.0).collect();
        assert_eq!(files, vec!["local.svg", "peer.svg"]);
    }

    #[test]
    fn bench_line_keeps_the_documented_format() {
        let s = summarize(&[vec![fig("runner.deposit", 11.0, Some(12.0))]]);
        assert_eq!(
            bench_line(&s[0]),
            "BENCH runner.deposit value=11.000 unit=GB/s anchor=12.000 ratio=0.917 min=11.000 max=11.000 runs=1"
        );
    }
}
