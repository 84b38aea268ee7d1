//! `cargo xtask gpu-build`: builds the direct linker's GPU test and bench
//! binaries here (the GPU machine has no Rust toolchain) into `target/gpu/`,
//! stripped, with a `run.sh` that runs them there:
//! `KVCR_TEST_GPU=1` tests (which fail if no GPU is found), then the bench.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// Builds one cargo target set and returns the executables it produced.
fn executables(root: &Path, args: &[&str]) -> Result<Vec<PathBuf>> {
    eprintln!("xtask: $ cargo {}", args.join(" "));
    let output = crate::cargo()
        .current_dir(root)
        .args(args)
        .args(["--message-format=json-render-diagnostics"])
        .stderr(Stdio::inherit())
        .output()
        .context("could not start cargo")?;
    if !output.status.success() {
        bail!("cargo {} failed", args.join(" "));
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let Some(exe) = message.get("executable").and_then(|e| e.as_str()) {
            found.push(PathBuf::from(exe));
        }
    }
    Ok(found)
}

fn install(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to).with_context(|| format!("copy {}", from.display()))?;
    // Debug info would push the binaries past what a device call carries.
    let status = Command::new("strip").arg(to).status();
    if !status.is_ok_and(|s| s.success()) {
        eprintln!("xtask: strip failed; keeping {} unstripped", to.display());
    }
    Ok(())
}

pub(crate) fn build(root: &Path) -> Result<()> {
    let out = root.join("target").join("gpu");
    std::fs::create_dir_all(&out)?;
    let tests = executables(
        root,
        &[
            "test",
            "--locked",
            "--release",
            "-p",
            "kvcr-direct-linker",
            "--test",
            "it",
            "--no-run",
        ],
    )?;
    let benches = executables(
        root,
        &[
            "bench",
            "--locked",
            "-p",
            "kvcr-direct-linker",
            "--bench",
            "direct",
            "--no-run",
        ],
    )?;
    let (Some(test), Some(bench)) = (tests.first(), benches.first()) else {
        bail!("cargo produced no test or bench executable");
    };
    install(test, &out.join("direct-linker-tests"))?;
    install(bench, &out.join("direct-bench"))?;
    let script = "#!/bin/sh\n\
# Runs on the GPU machine: the GPU tests (they fail when no GPU is found),\n\
# then the benchmark. Extra arguments go to the benchmark (e.g. --quick).\n\
set -e\n\
cd \"$(dirname \"$0\")\"\n\
KVCR_TEST_GPU=1 ./direct-linker-tests --test-threads=1\n\
./direct-bench --bench \"$@\"\n";
    std::fs::write(out.join("run.sh"), script)?;
    let run = out.join("run.sh");
    let mut perms = std::fs::metadata(&run)?.permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&run, perms)?;
    let size: u64 = std::fs::read_dir(&out)?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    eprintln!(
        "xtask: GPU binaries in {} ({:.1} MiB); run target/gpu/run.sh on the GPU machine",
        out.display(),
        size as f64 / (1 << 20) as f64
    );
    Ok(())
}
