//! kvcr's project automation. Run `cargo xtask help`.
//!
//! Every command starts from the workspace root (found from this crate's
//! manifest directory), so it works from any subdirectory of a fresh clone.

// xtask is a tool, not a sans-I/O core: it may read the clock.
#![allow(clippy::disallowed_methods)]

mod bench;
mod demo;
mod e2e;
mod gpu;
mod layers;
mod link;
mod node;
mod peers;
mod plot;
mod python;
mod setup;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

const HELP: &str = "\
cargo xtask <command>

Commands:
  demo [--pages N] [--prompts P] [--tls T] [--seed S] [--router dynamo]
                    the main job: runner processes on loopback restore a
                    source's offloaded KV pages from its KVCR DRAM over UCX on
                    router hints, check every byte, print a table; with
                    --router dynamo the hints come from Dynamo's standalone
                    KV indexer (in a loopback-only network namespace; root)
  e2e [--quick] [--only NAME[,NAME]] [--example PACKAGE/EXAMPLE] [--release] [--list]
                    multi-process scenarios on loopback with real UCX: the demo
                    workload and faults (source SIGKILL/SIGSTOP mid-transfer,
                    restart at the same address, subscribers gone, a pool full
                    of no_evict claims, 64 concurrent requests) and between
                    two simulated hosts (network namespaces over a shaped
                    link: loss, jitter, reordering, partitions, a throttled
                    rate; root); each checks its invariant; a summary table;
                    non-zero exit on a violation
  link-check        what this kernel can shape, and what a shaped link between
                    two namespaces really does (rate, round trips; root)
  test              install what this machine lacks (apt packages, cargo tools,
                    the Python faces' venv), then run every test in the
                    workspace and both Python faces' suites
  ci [--no-test]    the full gate: fmt, clippy -D warnings (both feature faces),
                    the tests (unless --no-test), the layer check, docs with
                    -D warnings, and a build of the fuzz targets
  fuzz [--runs N] [--target NAME]
                    run the fuzz targets (default: every target, 200000 runs each)
  bench [--quick] [--peers] [--link] [--rounds N]
                    run every benchmark binary N times (default 5, quick 1,
                    quick with --peers 3;
                    each figure beside an anchor measured in the same run);
                    prints progress and BENCH lines (median, min, max over the
                    rounds) and writes target/bench/report.md with SVG plots.
                    --peers also installs (once, into target/peers-venv) and
                    runs the reference Python runner and Mooncake's transfer
                    engine on the same workloads: a side-by-side table
                    --link adds the between-hosts figures: a source and a
                    destination in two network namespaces over a 1 Gbit/s
                    link at 50 µs, 200 µs and 1 ms round trips, beside
                    ucx_perftest over the same link (root)
  link-bench [--quick]
                    one round of those between-hosts figures alone
  gpu-build         build the direct linker's GPU tests and bench into
                    target/gpu/ (stripped, with run.sh), and its Python
                    face's wheel and tests (run-python.sh), to carry to a
                    GPU machine
  python            the Python faces alone (kvcr_hicache, kvcr_direct):
                    install their venv if missing, build the extensions, run
                    their pytest suites (part of `test`)
  layers [--census] check the crate dependency layering and the source rules
                    (runner modules import no private state of lib.rs;
                    unsafe only in its places); --census counts the lines of
                    unsafe code per crate instead
  help              this text
";

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let command = args.next().unwrap_or_else(|| "help".to_owned());
    let rest: Vec<String> = args.collect();
    let root = workspace_root();
    std::env::set_current_dir(&root)?;
    match command.as_str() {
        "test" => test(&root),
        "ci" => ci(&root, &rest),
        "fuzz" => fuzz(&root, &rest),
        "bench" => bench::run(&root, &rest),
        "demo" => demo::run(&root, &rest),
        "e2e" => e2e::run(&root, &rest),
        "gpu-build" => gpu::build(&root),
        "python" => {
            python::ensure_env(&root)?;
            python::build_and_test(&root)
        }
        "link-check" => link::run_check(),
        "link-bench" => {
            crate::setup::ensure_system_packages()?;
            let node = node::build(&root, true)?;
            let quick = rest.iter().any(|a| a == "--quick");
            for line in link::bench_round(&node, quick, "link-bench")? {
                println!("{line}");
            }
            Ok(())
        }
        "link-delayer" => link::run_delayer(&rest),
        "link-echo" => link::run_echo(&rest),
        "link-blast" => link::run_blast(&rest),
        "link-rtt" => link::run_rtt(&rest),
        "layers" if rest.iter().any(|a| a == "--census") => {
            print!("{}", layers::census(&root)?);
            Ok(())
        }
        "layers" => {
            layers::check(&root)?;
            println!("xtask: layering ok");
            Ok(())
        }
        "help" | "--help" | "-h" => {
            print!("{HELP}");
            Ok(())
        }
        other => bail!("unknown command {other:?}\n\n{HELP}"),
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Runs a command, echoing it, and fails with its exit status.
pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: $ {}", show(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("could not start {}", show(cmd)))?;
    if !status.success() {
        bail!("{} failed with {status}", show(cmd));
    }
    Ok(())
}

/// A child's stdout, line by line, read on a thread of its own so that a
/// wait for the next line can time out (`recv_timeout`); the channel
/// disconnects when stdout closes or a read fails.
fn stdout_lines(stdout: std::process::ChildStdout) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead as _;
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    lines
}

/// Waits up to `grace` for `child` to exit (std has no wait with a
/// timeout, so this polls), then kills it; its exit status (`None` if
/// waiting failed).
fn wait_or_kill(
    child: &mut std::process::Child,
    grace: std::time::Duration,
    name: &str,
) -> Option<std::process::ExitStatus> {
    let start = std::time::Instant::now();
    while start.elapsed() < grace {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) => std::thread::sleep(std::time::Duration::from_millis(20)),
            Err(_) => return None,
        }
    }
    eprintln!("xtask: {name} did not exit within {grace:?}; killing it");
    let _ = child.kill();
    child.wait().ok()
}

fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
}

fn test(root: &Path) -> Result<()> {
    setup::ensure_system_packages()?;
    setup::ensure_real_clients(root)?;
    python::ensure_env(root)?;
    run_tests(root)?;
    // The Python faces (each its own cargo workspace): SGLang's own loader and
    // call patterns against kvcr_hicache, two runner processes; kvcr_direct's
    // checks, hooks and restores on a host pool.
    python::build_and_test(root)
}

fn run_tests(_root: &Path) -> Result<()> {
    // Snapshots are checked, never written, by the gate: a missing or changed
    // snapshot fails instead of leaving a `.snap.new` behind. The real-client
    // tests (Dynamo's indexer in a loopback-only network namespace, vLLM's own
    // wire classes) are required here: with their flags set, a missing client
    // is a failure, not a skip.
    run(cargo()
        .args(["test", "--workspace", "--locked", "--all-targets"])
        .env("INSTA_UPDATE", "no")
        .env("CI", "true")
        .env("KVCR_TEST_DYNAMO", "1")
        // G3's full-disk test loop-mounts a tiny ext4 (root, as CI is).
        .env("KVCR_TEST_ROOT", "1")
        .env("KVCR_TEST_VLLM_WIRE", "1"))?;
    // The contracts (what a router links) and the facade without its runner
    // must build on their own, outside the workspace's feature unification.
    run(cargo().args(["build", "--locked", "-p", "kvcr-contracts"]))?;
    run(cargo().args([
        "build",
        "--locked",
        "-p",
        "kvcr-foundation",
        "--no-default-features",
    ]))?;
    Ok(())
}

fn ci(root: &Path, rest: &[String]) -> Result<()> {
    let skip_tests = rest.iter().any(|a| a == "--no-test");
    if let Some(unknown) = rest.iter().find(|a| *a != "--no-test") {
        bail!("unknown ci option {unknown:?}");
    }
    setup::ensure_system_packages()?;
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    python::fmt_check(root)?;
    run(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--locked",
        "--",
        "-D",
        "warnings",
    ]))?;
    run(cargo().args([
        "clippy",
        "-p",
        "kvcr-foundation",
        "--no-default-features",
        "--all-targets",
        "--locked",
        "--",
        "-D",
        "warnings",
    ]))?;
    python::clippy(root)?;
    if !skip_tests {
        run_tests(root)?;
    }
    layers::check(root)?;
    eprintln!("xtask: layering ok");
    run(cargo()
        .args(["doc", "--workspace", "--no-deps", "--locked"])
        .env("RUSTDOCFLAGS", "-D warnings"))?;
    fuzz_build(root)?;
    eprintln!("xtask: ci passed");
    Ok(())
}

const FUZZ_DIR: &str = "kvcr-foundation/fuzz";
const FUZZ_TARGETS: &[&str] = &[
    "frame_decode",
    "hint_parse",
    "ucx_envelope",
    "storage_config",
    "extra_info",
    "replay_request",
];

/// cargo-fuzz passes unstable `-Z` flags (sanitizers, coverage); the stable
/// toolchain accepts them for this build only with `RUSTC_BOOTSTRAP=1`.
fn cargo_fuzz(root: &Path) -> Command {
    let mut cmd = cargo();
    cmd.arg("fuzz")
        .current_dir(root.join(FUZZ_DIR))
        .env("RUSTC_BOOTSTRAP", "1");
    cmd
}

fn fuzz_build(root: &Path) -> Result<()> {
    setup::ensure_cargo_tool("cargo-fuzz", "cargo-fuzz", "0.13.2")?;
    run(cargo_fuzz(root).args(["build"]))
}

fn fuzz(root: &Path, rest: &[String]) -> Result<()> {
    let mut runs: u64 = 200_000;
    let mut targets: Vec<String> = FUZZ_TARGETS.iter().map(|t| (*t).to_owned()).collect();
    let mut it = rest.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--runs" => {
                runs = it
                    .next()
                    .context("--runs needs a number")?
                    .parse()
                    .context("--runs needs a number")?;
            }
            "--target" => {
                let name = it.next().context("--target needs a name")?;
                if !FUZZ_TARGETS.contains(&name.as_str()) {
                    bail!("unknown fuzz target {name:?}; known: {FUZZ_TARGETS:?}");
                }
                targets = vec![name.clone()];
            }
            other => bail!("unknown fuzz option {other:?}"),
        }
    }
    fuzz_build(root)?;
    for target in &targets {
        // New inputs go to the (ignored) corpus folder; the committed seeds
        // are valid examples of every frame and hint shape to mutate from.
        let corpus = Path::new("corpus").join(target);
        let seeds = Path::new("seeds").join(target);
        std::fs::create_dir_all(root.join(FUZZ_DIR).join(&corpus))?;
        run(cargo_fuzz(root).args([
            "run",
            target,
            &corpus.to_string_lossy(),
            &seeds.to_string_lossy(),
            "--",
            &format!("-runs={runs}"),
            "-max_len=4096",
        ]))?;
        eprintln!("xtask: fuzz target {target}: {runs} executions without a crash");
    }
    Ok(())
}
