//! `cargo xtask gpu-build`: builds the direct linker's GPU test and bench
//! binaries here (the GPU machine has no Rust toolchain) into `target/gpu/`,
//! stripped, with a `run.sh` that runs them there:
//! `KVCR_TEST_GPU=1` tests (which fail if no GPU is found), then the bench.
//! Beside them: the direct linker's Python face as a wheel (abi3, installable
//! offline with `pip install --no-deps`), its pytest suite in
//! `python-tests/`, and `run-python.sh`, which installs the wheel into a
//! private folder and runs that suite with `KVCR_TEST_GPU=1`.

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

/// Runs on the GPU machine (Python >= 3.10 with torch and pytest, no package
/// index): the wheel into a private folder, then the face's pytest suite.
const RUN_PYTHON: &str = "#!/bin/sh\n\
# Runs on the GPU machine: installs the direct linker's Python face (the wheel\n\
# beside this script; no package index needed) into a private folder and runs\n\
# its pytest suite with KVCR_TEST_GPU=1 (its GPU tests fail when no GPU is\n\
# found). PYTHON picks the interpreter; extra arguments go to pytest.\n\
set -e\n\
here=\"$(cd \"$(dirname \"$0\")\" && pwd)\"\n\
site=\"${KVCR_DIRECT_SITE:-/tmp/kvcr-direct-site}\"\n\
python=\"${PYTHON:-python3}\"\n\
\"$python\" -m pip install -q --no-index --no-deps --no-compile --upgrade \\\n\
    --target \"$site\" \"$here\"/kvcr_direct-*.whl\n\
cd \"$here/python-tests\"\n\
KVCR_TEST_GPU=1 PYTHONPATH=\"$site${PYTHONPATH:+:$PYTHONPATH}\" \\\n\
    exec \"$python\" -m pytest -q -p no:cacheprovider . \"$@\"\n";

fn executable(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text)?;
    let mut perms = std::fs::metadata(path)?.permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(path, perms)?;
    Ok(())
}

/// The direct linker's Python face: its wheel, its tests and `run-python.sh`.
fn python_face(root: &Path, out: &Path) -> Result<()> {
    crate::python::ensure_env(root)?;
    let face = &crate::python::DIRECT;
    crate::python::wheel(root, face, out)?;
    let tests = out.join("python-tests");
    if tests.exists() {
        std::fs::remove_dir_all(&tests)?;
    }
    std::fs::create_dir_all(&tests)?;
    for entry in std::fs::read_dir(root.join(face.dir).join("tests"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "py")
            && let Some(name) = path.file_name()
        {
            std::fs::copy(&path, tests.join(name))?;
        }
    }
    executable(&out.join("run-python.sh"), RUN_PYTHON)
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
    executable(&out.join("run.sh"), script)?;
    python_face(root, &out)?;
    let size: u64 = std::fs::read_dir(&out)?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    eprintln!(
        "xtask: GPU binaries and the kvcr_direct wheel in {} ({:.1} MiB); run \
         target/gpu/run.sh and target/gpu/run-python.sh on the GPU machine",
        out.display(),
        size as f64 / (1 << 20) as f64
    );
    Ok(())
}
