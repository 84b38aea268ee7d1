//! `hicache-dynamo`: two SGLang engines at TP=2 with kvcr as their HiCache L3
//! backend, and Dynamo's standalone KV indexer as the only inventory
//! authority, all real processes.
//!
//! The scenario itself is a Python program,
//! `kvcr-hicache-storage/python/e2e/hicache_dynamo.py` (it drives SGLang's own
//! loader and the engines' processes; see its docstring for the cases). This
//! module gets it what it needs (the Python face's venv with a freshly built
//! wheel, the real-client venv with `ai-dynamo-runtime`), runs it in a new
//! network namespace holding only loopback (the indexer binds every
//! interface; this needs root), streams its output to
//! `target/e2e/hicache-dynamo/orchestrator.log` (the engines' and indexers'
//! logs sit beside it), and turns its `CHECK` and `NUMBER` lines and its exit
//! status into the scenario's checks and key numbers.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use super::{Ctx, Outcome};

/// The orchestrator, relative to the workspace root.
const SCRIPT: &str = "kvcr-hicache-storage/python/e2e/hicache_dynamo.py";
/// The interpreter with `ai-dynamo-runtime` (`crate::setup::ensure_real_clients`).
pub(super) const INDEXER_PYTHON: &str = "target/realclients/venv/bin/python";
/// The longest the orchestrator may run (its process group is stopped after
/// that). Its own deadlines are far shorter; this only bounds a hang.
const BOUND: Duration = Duration::from_secs(600);
/// How long a stopped orchestrator gets to close its engines and indexers
/// before its process group is killed.
const GRACE: Duration = Duration::from_secs(15);

/// What one line of the orchestrator's output says.
#[derive(Debug, PartialEq)]
enum Line<'a> {
    /// `CHECK PASS|FAIL <what> (<detail>)`.
    Check {
        ok: bool,
        what: &'a str,
        detail: &'a str,
    },
    /// `NUMBER <name>=<value>`.
    Number {
        name: &'a str,
        value: &'a str,
    },
    Other,
}

fn parse_line(line: &str) -> Line<'_> {
    if let Some(rest) = line.strip_prefix("CHECK ") {
        let (ok, rest) = match rest.split_once(' ') {
            Some(("PASS", rest)) => (true, rest),
            Some(("FAIL", rest)) => (false, rest),
            _ => return Line::Other,
        };
        // The detail is the last parenthesised part, when there is one.
        let (what, detail) = rest
            .strip_suffix(')')
            .and_then(|r| r.rsplit_once(" ("))
            .unwrap_or((rest, ""));
        return Line::Check { ok, what, detail };
    }
    if let Some((name, value)) = line
        .strip_prefix("NUMBER ")
        .and_then(|rest| rest.split_once('='))
    {
        return Line::Number { name, value };
    }
    Line::Other
}

/// Stops the orchestrator's process group (SIGTERM, then SIGKILL after the
/// grace period). The group is the one this scenario started: the
/// orchestrator leads it and its engines and indexers are in it.
fn stop_group(child: &mut Child) {
    let Ok(id) = i32::try_from(child.id()) else {
        let _ = child.kill();
        let _ = child.wait();
        return;
    };
    let group = Pid::from_raw(id);
    let _ = killpg(group, Signal::SIGTERM);
    let start = Instant::now();
    while start.elapsed() < GRACE {
        if matches!(child.try_wait(), Ok(Some(_))) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = killpg(group, Signal::SIGKILL);
    let _ = child.wait();
}

pub(super) fn run(ctx: &Ctx) -> Result<Outcome> {
    let root = crate::workspace_root();
    let args = [
        OsString::from("--indexer-python"),
        root.join(INDEXER_PYTHON).into_os_string(),
        OsString::from("--log-dir"),
        ctx.logs.clone().into_os_string(),
    ];
    orchestrate(ctx, "hicache-dynamo", SCRIPT, &args)
}

/// Runs a Python orchestrator that prints `CHECK` and `NUMBER` lines (this
/// scenario's, or another that drives engines with Dynamo's indexer the same
/// way) in a network namespace holding only loopback, with the Python face's
/// venv and a freshly built wheel, and turns its output and exit status into
/// checks. `script` is relative to the workspace root; `name` prefixes its
/// echoed lines.
pub(super) fn orchestrate(
    ctx: &Ctx,
    name: &'static str,
    script: &str,
    args: &[OsString],
) -> Result<Outcome> {
    let root = crate::workspace_root();
    crate::python::ensure_env(&root)?;
    crate::python::build(&root)?;
    crate::setup::ensure_real_clients(&root)?;
    std::fs::create_dir_all(&ctx.logs)
        .with_context(|| format!("creating {}", ctx.logs.display()))?;
    let log_path = ctx.logs.join("orchestrator.log");
    let mut log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;

    let mut cmd = Command::new("unshare");
    let python = crate::python::interpreter(&root, &mut cmd);
    // The indexer's HTTP server binds every interface and has no host flag:
    // the whole scenario runs where only loopback exists. stderr joins
    // stdout, so the log keeps both in order.
    cmd.args([
        "--net",
        "--",
        "sh",
        "-c",
        "ip link set lo up && exec \"$@\" 2>&1",
        "sh",
    ])
    .arg(python)
    .arg(root.join(script))
    .args(args)
    .env("PYTHONUNBUFFERED", "1")
    .current_dir(&root)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    // Its own process group, so a hang is stopped with everything it started.
    .process_group(0);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting the {name} orchestrator under unshare"))?;
    let stdout = child.stdout.take().context("the orchestrator's stdout")?;
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            println!("{name}: {line}");
            let _ = writeln!(log, "{line}");
            lines.push(line);
        }
        lines
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if start.elapsed() > BOUND {
            stop_group(&mut child);
            break None;
        }
        // Polling a child's exit: std has no wait with a timeout.
        std::thread::sleep(Duration::from_millis(100));
    };
    let lines = reader.join().unwrap_or_default();

    let mut outcome = Outcome::default();
    for line in &lines {
        match parse_line(line) {
            Line::Check { ok, what, detail } => {
                outcome.check(what, ok, detail);
            }
            Line::Number { name, value } => outcome.number(name, value),
            Line::Other => {}
        }
    }
    match status {
        Some(status) => {
            // No check line at all: it never ran (`unshare` needs root).
            let hint = if lines.iter().any(|l| l.starts_with("CHECK ")) {
                ""
            } else {
                "; it ran no check: see the log (unshare needs root or CAP_SYS_ADMIN)"
            };
            outcome.check(
                "the orchestrator exits 0 (every check held, every case ran)",
                status.success(),
                format!("{status}; log {}{hint}", log_path.display()),
            );
        }
        None => {
            outcome.check(
                "the orchestrator finishes",
                false,
                format!("stopped after {} s", BOUND.as_secs()),
            );
        }
    }
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_and_number_lines_parse() {
        assert_eq!(
            parse_line(
                "CHECK PASS (b) KVCR retained: 3 blocks per TP shard (got [3, 3], want [3, 3])"
            ),
            Line::Check {
                ok: true,
                what: "(b) KVCR retained: 3 blocks per TP shard",
                detail: "got [3, 3], want [3, 3]",
            }
        );
        assert_eq!(
            parse_line("CHECK FAIL close: cleared"),
            Line::Check {
                ok: false,
                what: "close: cleared",
                detail: "",
            }
        );
        assert_eq!(
            parse_line("NUMBER source_bytes=22020096"),
            Line::Number {
                name: "source_bytes",
                value: "22020096",
            }
        );
        assert_eq!(parse_line("CHECK MAYBE x"), Line::Other);
        assert_eq!(parse_line("# engine S ready"), Line::Other);
    }
}
