//! `cargo xtask e2e`: multi-process scenarios on loopback with real UCX, real
//! TCP control channels and real ZMQ, each stating the invariant it checks.
//!
//! Every scenario drives runner node processes (`kvcr-foundation/examples/
//! node.rs`) through their JSON commands, injects its fault from outside
//! (signals, a vanished subscriber, a full pool), and records checks: an
//! invariant that does not hold is a failed check, never a panic. Deadlines
//! are generous and nothing is timed: only invariants are asserted, so a
//! loaded machine makes a run slower, not red. A summary table closes the
//! run; any failed check makes the command exit non-zero.
//!
//! Adding a scenario: a function `fn(&Ctx) -> Result<Outcome>` in
//! [`scenarios`] and one [`Scenario::builtin`] line in [`registry`]; or, for a
//! program that checks itself (an example binary that exits non-zero on a
//! violation and prints a summary line), one [`Scenario::example`] line.

mod between_hosts;
mod events;
mod g3;
mod guard;
mod hicache_dynamo;
mod real_model;
mod scenarios;

use std::fmt::{Debug, Display};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::node::NodeSpec;

/// What a scenario runs.
#[derive(Clone)]
pub(crate) enum Body {
    /// A scenario in this module.
    Builtin(fn(&Ctx) -> Result<Outcome>),
    /// A cargo example that checks itself: built in the run's profile, run
    /// from the workspace root with `args` (and `KVCR_E2E_QUICK=1` in quick
    /// runs), passes when it exits 0 within [`EXAMPLE_BOUND`]; its last
    /// stdout line is reported as its key numbers.
    Example {
        package: &'static str,
        example: &'static str,
        args: &'static [&'static str],
    },
}

/// One scenario: its name (for `--only`), the invariant it checks, whether
/// `--quick` runs it, and its body.
#[derive(Clone)]
pub(crate) struct Scenario {
    pub(crate) name: &'static str,
    pub(crate) invariant: &'static str,
    pub(crate) quick: bool,
    pub(crate) body: Body,
}

impl Scenario {
    const fn builtin(
        name: &'static str,
        invariant: &'static str,
        quick: bool,
        body: fn(&Ctx) -> Result<Outcome>,
    ) -> Self {
        Self {
            name,
            invariant,
            quick,
            body: Body::Builtin(body),
        }
    }

    /// A cargo example as a scenario, e.g.
    /// `Scenario::example("hicache", "<invariant>", true, "kvcr-hicache-storage", "hicache_e2e", &[])`.
    pub(crate) const fn example(
        name: &'static str,
        invariant: &'static str,
        quick: bool,
        package: &'static str,
        example: &'static str,
        args: &'static [&'static str],
    ) -> Self {
        Self {
            name,
            invariant,
            quick,
            body: Body::Example {
                package,
                example,
                args,
            },
        }
    }
}

/// Every scenario, in run order.
pub(crate) fn registry() -> Vec<Scenario> {
    vec![
        Scenario::builtin(
            "demo",
            "the demo workload: every restored byte equals the offloaded byte; every request answered",
            true,
            scenarios::demo,
        ),
        Scenario::builtin(
            "demo-tcp",
            "the demo workload with UCX over TCP (tcp,self): every restored byte equal; every request answered",
            false,
            scenarios::demo_tcp,
        ),
        Scenario::builtin(
            "demo-g3",
            "the demo workload with the source's KVCR DRAM holding half the pages over a G3 file tier: pages move to G3, are filled back to serve the destinations, every restored byte equal",
            true,
            scenarios::demo_g3,
        ),
        Scenario::builtin(
            "source-sigkill",
            "source SIGKILLed mid-transfer: callers fail by the deadline, no corrupted byte; the granted slots stay quarantined (never reused, never freed without proof), also after a restart at the same address",
            true,
            scenarios::source_sigkill,
        ),
        Scenario::builtin(
            "source-sigstop",
            "source SIGSTOPped mid-transfer: callers fail by the deadline; slots quarantined until the source's proof (quiesced), pages deposited meanwhile never overwritten, a late write never commits",
            true,
            scenarios::source_sigstop,
        ),
        Scenario::builtin(
            "source-restart",
            "source restarted at the same address: the new incarnation serves, every restored byte is its byte (no stale bytes), every caller completes",
            true,
            scenarios::source_restart,
        ),
        Scenario::builtin(
            "subscriber-gone",
            "KV-event subscribers vanish or stall mid-stream: the runner never blocks (every deposit completes) and a live router's stored/removed stays balanced with what the runner holds",
            true,
            scenarios::subscriber_gone,
        ),
        Scenario::builtin(
            "no-evict-capacity",
            "pool full of no_evict claims: further deposits and peer restores fail CapacityExhausted (never dropped, nothing evicted), claimed bytes intact, stored/removed balanced",
            true,
            scenarios::no_evict_capacity,
        ),
        Scenario::builtin(
            "concurrent-64",
            "64 concurrent requests restoring overlapping prefixes: all complete, every byte equal, each page crosses the wire at most once, stored/removed balanced",
            true,
            scenarios::concurrent_requests,
        ),
        Scenario::builtin(
            "link-lossy",
            "between two hosts (network namespaces, UCX over tcp), a 200 µs ± 50 µs link with 0.1 % loss: every restored byte equal, every caller answered",
            true,
            between_hosts::lossy,
        ),
        Scenario::builtin(
            "link-partition-late",
            "between two hosts, a partition mid-transfer that heals after the deadline: callers fail by it with no corrupted byte, the written slots stay held until the source's answer quiesces them, then a clean retry restores every page",
            true,
            between_hosts::partition_late,
        ),
        Scenario::builtin(
            "link-partition-early",
            "between two hosts, a 300 ms partition mid-transfer, well before the deadline: no corrupted byte, nothing held once the link is back, every page restorable",
            false,
            between_hosts::partition_early,
        ),
        Scenario::builtin(
            "link-throttled",
            "between two hosts, the link drops to 1 % of its rate mid-transfer: callers fail by the deadline with no corrupted byte, the slots stay held until the source's answer, then a clean retry restores every page",
            false,
            between_hosts::throttled,
        ),
        Scenario::builtin(
            "link-reordered",
            "between two hosts, packets reordered by ± 50 µs of jitter: every restored byte equal",
            false,
            between_hosts::reordered,
        ),
        Scenario::builtin(
            "g3-spill",
            "a 16-page KVCR DRAM pool over a G3 file tier, filled far past its capacity: the victims move to G3 (fetchable from disk), every page comes back byte-exact, with the files removed underneath no wrong byte is ever served, and a node killed mid-spill restarts on the same files with G3 empty (no old byte served)",
            true,
            g3::spill,
        ),
        Scenario::builtin(
            "g3-full-disk",
            "a node's G3 files on a 16 MiB filesystem that fills up: spills fail with ENOSPC, typed and counted, every deposit still lands, and every page is restored byte-exact or reported missing, never wrong",
            true,
            g3::full_disk,
        ),
        Scenario::builtin(
            "engine-crash",
            "a source engine under a kvcr-guard is SIGKILLed while it serves: the destination's request ends with no corrupted byte; the guard serves the recovered pages on the same address and its death report frees the destination's held slots; a new request is served byte-exact; the restarted source claims its group warm, every page recovered with 0 bytes copied in again, byte-exact locally and for a fresh peer; the router sees Cleared, then the recovered pages",
            true,
            guard::engine_crash,
        ),
        Scenario::builtin(
            "journal-overflow",
            "a guard's journal too small for the pages stops (the node keeps serving); the next incarnation says recovery is disabled, seats nothing, serves fresh pages",
            true,
            guard::journal_overflow,
        ),
        Scenario::builtin(
            "journal-corrupt",
            "a journal corrupted in the guard's memory while its engine is dead: the next incarnation refuses it, seats nothing (no wrong byte served), serves fresh pages",
            true,
            guard::journal_corrupt,
        ),
        Scenario::example(
            "hicache",
            "HiCache L3 backend, TP=2, page_first: a hinted destination restores the source's prefix through batch_get, each rank its own shard, digests match; an evicted prefix gives no hint and no transfer; a killed source is a miss, never a fault",
            true,
            "kvcr-hicache-storage",
            "hicache_e2e",
            &[],
        ),
        Scenario::builtin(
            "hicache-dynamo",
            "two SGLang engines at TP=2 (kvcr as HiCache L3, real processes), Dynamo's indexer the only inventory authority: a KVCR-evicted prefix gives 0 tokens, no hint, no transfer; a KVCR-retained prefix restores 192 of 256 tokens on a hint from /query, each shard byte-equal; salt and LoRA namespaces match only themselves; a late indexer converges; closing clears",
            true,
            hicache_dynamo::run,
        ),
        Scenario::builtin(
            "real-model",
            "a real transformer (Qwen3, random weights, small geometry, CPU) with kvcr as HiCache L3 at TP=1 and TP=2: D restores 192 of 256 tokens from S on a hint from Dynamo's indexer; D's 8 ids equal cold inference (which vary), every restored page's SHA-256 equals S's, D's logits equal an own-KV control's bit for bit; zeroed and shuffled pages fail that check; mode B (kvcr_direct, host pool): replays after fillers evicted the engine's pool restore from KVCR DRAM and from a peer process, ids and logits the same",
            true,
            real_model::run,
        ),
    ]
}

/// What a scenario gets.
pub(crate) struct Ctx {
    /// The node binary.
    pub(crate) binary: PathBuf,
    /// `--quick`: smaller sizes.
    pub(crate) quick: bool,
    /// Where node logs go: `target/e2e/<scenario>/<node>.log`.
    logs: PathBuf,
}

impl Ctx {
    /// A node spec whose stderr goes to this scenario's log folder.
    pub(crate) fn spec(&self, name: &str, blocks: u64, block_bytes: u64) -> NodeSpec {
        NodeSpec {
            log: Some(self.logs.join(format!("{name}.log"))),
            ..NodeSpec::new(blocks, block_bytes)
        }
    }

    /// `quick` in quick runs, else `full`.
    pub(crate) fn size(&self, quick: u64, full: u64) -> u64 {
        if self.quick { quick } else { full }
    }
}

struct Check {
    what: String,
    ok: bool,
    detail: String,
}

/// A scenario's checks and key numbers.
#[derive(Default)]
pub(crate) struct Outcome {
    checks: Vec<Check>,
    numbers: Vec<(String, String)>,
}

impl Outcome {
    /// Records a check; returns whether it held.
    pub(crate) fn check(&mut self, what: &str, ok: bool, detail: impl Display) -> bool {
        self.checks.push(Check {
            what: what.to_owned(),
            ok,
            detail: detail.to_string(),
        });
        ok
    }

    /// Records that `got == want`.
    pub(crate) fn equal<T: PartialEq + Debug>(&mut self, what: &str, got: T, want: T) -> bool {
        let detail = format!("got {got:?}, want {want:?}");
        self.check(what, got == want, detail)
    }

    /// A key number for the summary (a later value of the same name wins).
    pub(crate) fn number(&mut self, name: &str, value: impl Display) {
        let value = value.to_string();
        match self.numbers.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) => *v = value,
            None => self.numbers.push((name.to_owned(), value)),
        }
    }

    fn failed(&self) -> impl Iterator<Item = &Check> {
        self.checks.iter().filter(|c| !c.ok)
    }
}

struct Options {
    quick: bool,
    release: bool,
    only: Vec<String>,
    examples: Vec<(String, String)>,
    list: bool,
}

fn parse(rest: &[String]) -> Result<Options> {
    let mut o = Options {
        quick: false,
        release: false,
        only: Vec::new(),
        examples: Vec::new(),
        list: false,
    };
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--quick" => o.quick = true,
            "--release" => o.release = true,
            "--list" => o.list = true,
            "--only" => o.only.extend(
                it.next()
                    .context("--only needs a scenario name")?
                    .split(',')
                    .map(str::to_owned),
            ),
            "--example" => {
                let spec = it.next().context("--example needs PACKAGE/EXAMPLE")?;
                let (package, example) = spec
                    .split_once('/')
                    .context("--example needs PACKAGE/EXAMPLE")?;
                o.examples.push((package.to_owned(), example.to_owned()));
            }
            other => bail!(
                "unknown e2e option {other:?} (use --quick, --only NAME[,NAME], --example PACKAGE/EXAMPLE, --release, --list)"
            ),
        }
    }
    Ok(o)
}

struct Row {
    name: String,
    invariant: String,
    passed: bool,
    numbers: String,
    secs: f64,
    problems: Vec<String>,
}

pub(crate) fn run(root: &Path, rest: &[String]) -> Result<()> {
    if let [flag, events] = rest
        && flag == "--subscriber-child"
    {
        return events::subscriber_child(events);
    }
    let o = parse(rest)?;
    let mut all = registry();
    for (package, example) in &o.examples {
        // Leaked once per run: a scenario's names are `'static`.
        let package: &'static str = Box::leak(package.clone().into_boxed_str());
        let example: &'static str = Box::leak(example.clone().into_boxed_str());
        all.push(Scenario::example(
            example,
            "the example's own checks (exit status 0)",
            true,
            package,
            example,
            &[],
        ));
    }
    if o.list {
        for s in &all {
            println!(
                "{:<18} {}{}",
                s.name,
                if s.quick { "[quick] " } else { "" },
                s.invariant
            );
        }
        return Ok(());
    }
    for name in &o.only {
        if !all.iter().any(|s| s.name == name) {
            let known: Vec<&str> = all.iter().map(|s| s.name).collect();
            bail!("unknown scenario {name:?}; known: {known:?}");
        }
    }
    let explicit: Vec<&str> = o
        .examples
        .iter()
        .map(|(_, e)| e.as_str())
        .chain(o.only.iter().map(String::as_str))
        .collect();
    let selected: Vec<Scenario> = all
        .into_iter()
        .filter(|s| {
            if o.only.is_empty() {
                !o.quick || s.quick || explicit.contains(&s.name)
            } else {
                explicit.contains(&s.name)
            }
        })
        .collect();
    crate::setup::ensure_system_packages()?;
    let release = o.release || !o.quick;
    eprintln!(
        "e2e: building the runner node ({})…",
        if release { "release" } else { "dev profile" }
    );
    let binary = crate::node::build(root, release)?;
    let logs = root.join("target/e2e");
    let mut rows = Vec::new();
    let total = selected.len();
    let started = Instant::now();
    for (i, scenario) in selected.iter().enumerate() {
        eprintln!(
            "\ne2e: [{}/{total}] {}: {}",
            i + 1,
            scenario.name,
            scenario.invariant
        );
        let ctx = Ctx {
            binary: binary.clone(),
            quick: o.quick,
            logs: logs.join(scenario.name),
        };
        let start = Instant::now();
        let result = match &scenario.body {
            Body::Builtin(body) => body(&ctx),
            Body::Example {
                package,
                example,
                args,
            } => run_example(root, release, o.quick, package, example, args),
        };
        let secs = start.elapsed().as_secs_f64();
        let row = match result {
            Ok(outcome) => {
                let problems: Vec<String> = outcome
                    .failed()
                    .map(|c| format!("{}: {}", c.what, c.detail))
                    .collect();
                for c in &outcome.checks {
                    eprintln!(
                        "e2e:   {} {} ({})",
                        if c.ok { "ok  " } else { "FAIL" },
                        c.what,
                        c.detail
                    );
                }
                Row {
                    name: scenario.name.to_owned(),
                    invariant: scenario.invariant.to_owned(),
                    passed: problems.is_empty() && !outcome.checks.is_empty(),
                    numbers: outcome
                        .numbers
                        .iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                    secs,
                    problems: if outcome.checks.is_empty() {
                        vec!["the scenario checked nothing".to_owned()]
                    } else {
                        problems
                    },
                }
            }
            Err(e) => Row {
                name: scenario.name.to_owned(),
                invariant: scenario.invariant.to_owned(),
                passed: false,
                numbers: String::new(),
                secs,
                problems: vec![format!("{e:#}")],
            },
        };
        eprintln!(
            "e2e: {} {} in {:.1} s",
            scenario.name,
            if row.passed { "passed" } else { "FAILED" },
            secs
        );
        rows.push(row);
    }
    println!();
    println!("| scenario | invariant | result | key numbers | s |");
    println!("|---|---|---|---|---|");
    for row in &rows {
        println!(
            "| {} | {} | {} | {} | {:.1} |",
            row.name,
            row.invariant,
            if row.passed { "pass" } else { "FAIL" },
            row.numbers,
            row.secs
        );
    }
    let failed: Vec<&Row> = rows.iter().filter(|r| !r.passed).collect();
    for row in &failed {
        println!("\n{} failed:", row.name);
        for p in &row.problems {
            println!("  - {p}");
        }
    }
    println!(
        "\ne2e: {} of {} scenarios passed in {:.0} s (node logs under {})",
        rows.len() - failed.len(),
        rows.len(),
        started.elapsed().as_secs_f64(),
        logs.display()
    );
    if !failed.is_empty() {
        bail!("{} e2e scenario(s) failed", failed.len());
    }
    Ok(())
}

/// The longest an example scenario may run (it is killed after that).
const EXAMPLE_BOUND: Duration = Duration::from_secs(600);

/// Builds and runs a cargo example that checks itself.
fn run_example(
    root: &Path,
    release: bool,
    quick: bool,
    package: &str,
    example: &str,
    args: &[&str],
) -> Result<Outcome> {
    let mut build = crate::cargo();
    build.current_dir(root).args([
        "build",
        "--locked",
        "--quiet",
        "-p",
        package,
        "--example",
        example,
    ]);
    if release {
        build.arg("--release");
    }
    crate::run(&mut build)?;
    let profile = if release { "release" } else { "debug" };
    let binary = root
        .join("target")
        .join(profile)
        .join("examples")
        .join(example);
    let mut cmd = Command::new(&binary);
    cmd.env("KVCR_CLUSTER_SECRET", crate::node::cluster_secret());
    cmd.args(args)
        .current_dir(root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    if quick {
        cmd.env("KVCR_E2E_QUICK", "1");
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let stdout = child.stdout.take().context("stdout")?;
    let prefix = example.to_owned();
    let reader = std::thread::spawn(move || {
        let mut last = String::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            println!("{prefix}: {line}");
            if !line.trim().is_empty() {
                last = line;
            }
        }
        last
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if start.elapsed() > EXAMPLE_BOUND {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        // Polling a child's exit: std has no wait with a timeout.
        std::thread::sleep(Duration::from_millis(50));
    };
    let last = reader.join().unwrap_or_default();
    let mut outcome = Outcome::default();
    match status {
        Some(status) => {
            outcome.check("the example exits 0", status.success(), status);
        }
        None => {
            outcome.check(
                "the example finishes",
                false,
                format!("killed after {} s", EXAMPLE_BOUND.as_secs()),
            );
        }
    }
    outcome.number("summary", last.replace('|', "/"));
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn options_parse_and_unknown_ones_are_refused() {
        let o = parse(&args(&[
            "--quick",
            "--only",
            "demo,concurrent-64",
            "--example",
            "pkg/ex",
        ]))
        .unwrap();
        assert!(o.quick && !o.release && !o.list);
        assert_eq!(o.only, ["demo", "concurrent-64"]);
        assert_eq!(o.examples, [("pkg".to_owned(), "ex".to_owned())]);
        assert!(parse(&args(&["--fast"])).is_err());
        assert!(parse(&args(&["--only"])).is_err());
        assert!(parse(&args(&["--example", "no-slash"])).is_err());
    }

    #[test]
    fn scenario_names_are_unique() {
        let names: Vec<&str> = registry().iter().map(|s| s.name).collect();
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "{names:?}");
    }

    #[test]
    fn a_later_number_of_the_same_name_wins_and_a_failed_check_is_reported() {
        let mut o = Outcome::default();
        o.number("n", 1);
        o.number("n", 2);
        assert_eq!(o.numbers, [("n".to_owned(), "2".to_owned())]);
        assert!(o.equal("same", 1, 1));
        assert!(!o.equal("different", 1, 2));
        let failed: Vec<&str> = o.failed().map(|c| c.what.as_str()).collect();
        assert_eq!(failed, ["different"]);
    }
}
