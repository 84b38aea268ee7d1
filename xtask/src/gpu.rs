//! `cargo xtask gpu-build`: builds the direct linker's GPU test and bench
//! binaries here (the GPU machine has no Rust toolchain) into `target/gpu/`,
//! stripped, with a `run.sh` that runs them there:
//! `KVCR_TEST_GPU=1` tests (which fail if no GPU is found), then the bench.
//! Beside them: the direct linker's Python face as a wheel (abi3, installable
//! offline with `pip install --no-deps`), its pytest suite in
//! `python-tests/`, and `run-python.sh`, which installs the wheel into a
//! private folder and runs that suite with `KVCR_TEST_GPU=1`. And the
//! real-model harness (`xtask/harness`, in `harness/` with the HiCache test
//! helpers and SGLang's three contract files it loads), the `kvcr_hicache`
//! wheel it drives in mode A, and `run-model.sh`, which runs it with
//! Qwen3-0.6B's geometry in bf16 on the GPU: mode A at TP=1 and TP=2, then
//! mode B, then a probe of whether the device repeats one decode to the bit.
//! And `run-seed.sh`: the seed's headline restore and the TP=2 restore, each
//! watched for stalls, then the one-hop GPU tests.

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
model=\"${KVCR_MODEL_ARGS:---geometry qwen3-0.6b --device cuda --dtype bfloat16}\"\n\
\"$python\" -m pip install -q --no-index --no-deps --no-compile --upgrade \\\n\
    --target \"$site\" \"$here\"/kvcr_direct-*.whl\n\
cd \"$here/python-tests\"\n\
KVCR_TEST_GPU=1 PYTHONPATH=\"$site${PYTHONPATH:+:$PYTHONPATH}\" \\\n\
    exec \"$python\" -m pytest -q -p no:cacheprovider . \"$@\"\n";

/// Runs on the GPU machine: issue 42's figures, each run watched so that a
/// stall leaves evidence instead of a killed call.
const RUN_SEED: &str = "#!/bin/sh\n\
# Runs on the GPU machine: the seed's headline restore (direct-bench --bench\n\
# --seed: TP=1, Qwen3-32B, 1812 pages, 30.4 GB), then both TP=2 ranks on this\n\
# host (--tp2 1812), then the one-hop GPU tests. Each bench run is stopped\n\
# after its limit in seconds (KVCR_SEED_LIMIT, default 150), first dumping\n\
# every thread's stack of every bench process (gdb or cuda-gdb) beside its log\n\
# in $OUT (default /tmp/kvcr-seed); symbolise against the unstripped bench in\n\
# target/release/deps. Exit status: that of the tests.\n\
cd \"$(dirname \"$0\")\"\n\
out=\"${OUT:-/tmp/kvcr-seed}\"; mkdir -p \"$out\"\n\
limit=\"${KVCR_SEED_LIMIT:-150}\"\n\
gdb=$(command -v gdb || echo /usr/local/cuda/bin/cuda-gdb)\n\
watched() {\n\
  name=$1; shift\n\
  ./direct-bench --bench \"$@\" > \"$out/$name.log\" 2>&1 &\n\
  bench=$!; waited=0\n\
  while kill -0 $bench 2>/dev/null && [ $waited -lt \"$limit\" ]; do sleep 1; waited=$((waited+1)); done\n\
  if kill -0 $bench 2>/dev/null; then\n\
    for p in $(pgrep -f direct-bench); do\n\
      timeout 40 \"$gdb\" -batch -p \"$p\" -ex 'thread apply all bt 25' > \"$out/bt-$name-$p.txt\" 2>&1\n\
    done\n\
    pkill -9 -f direct-bench; echo \"$name: stopped after $limit s\" >> \"$out/$name.log\"\n\
  fi\n\
  wait\n\
  grep -h 'BENCH\\|one-hop\\|round .* done' \"$out/$name.log\"\n\
}\n\
watched seed --seed\n\
watched tp2 --tp2 1812\n\
KVCR_TEST_GPU=1 ./direct-linker-tests --test-threads=1 one_hop\n";

/// Runs on the GPU machine (Python >= 3.10 with torch and transformers, no
/// package index): both wheels into a private folder, then the real-model
/// harness, mode A and mode B, Qwen3-0.6B's geometry in bf16 on the GPU.
const RUN_MODEL: &str = "#!/bin/sh\n\
# Runs on the GPU machine: installs kvcr_hicache and kvcr_direct (the wheels\n\
# beside this script; no package index needed) into a private folder, then the\n\
# real-model harness with Qwen3-0.6B's geometry (random weights, bf16, cuda):\n\
# mode A (HiCache backend) at TP=1 and TP=2, the hint from the source's\n\
# inventory (no Dynamo indexer there), then mode B (kvcr_direct, 3000-token\n\
# prompts, filler traffic, local and peer restores), then, on the GPU, mode B's\n\
# TTFT against cold prefill at 3K, 16K and 32K tokens (model_mode_b.py, BENCH\n\
# model.ttft_*), then determinism_probe.py. DIAG lines say, per pair of runs\n\
# that must agree to the bit, which decode steps' logits do and where the\n\
# first that does not parted (margins, layer, module). PYTHON picks the\n\
# interpreter; logs go to $KVCR_MODEL_LOGS (default /tmp/kvcr-real-model);\n\
# KVCR_MODEL_ARGS replaces the model arguments (e.g. \"--geometry small\n\
# --device cpu --dtype float32\" checks the bundle on a machine with no GPU).\n\
set -e\n\
here=\"$(cd \"$(dirname \"$0\")\" && pwd)\"\n\
site=\"${KVCR_MODEL_SITE:-/tmp/kvcr-model-site}\"\n\
logs=\"${KVCR_MODEL_LOGS:-/tmp/kvcr-real-model}\"\n\
python=\"${PYTHON:-python3}\"\n\
model=\"${KVCR_MODEL_ARGS:---geometry qwen3-0.6b --device cuda --dtype bfloat16}\"\n\
\"$python\" -m pip install -q --no-index --no-deps --no-compile --upgrade \\\n\
    --target \"$site\" \"$here\"/kvcr_hicache-*.whl \"$here\"/kvcr_direct-*.whl\n\
export PYTHONPATH=\"$site${PYTHONPATH:+:$PYTHONPATH}\" PYTHONUNBUFFERED=1\n\
export KVCR_SGLANG_SRC=\"$here/harness/py-sglang\"\n\
cd \"$here/harness\"\n\
status=0\n\
\"$python\" real_model.py --hint-from inventory --tp 1,2 --new-tokens 16 $model --log-dir \"$logs\" \\\n\
    || status=1\n\
\"$python\" real_model_direct.py --new-tokens 16 $model || status=1\n\
if [ -z \"${KVCR_MODEL_ARGS:-}\" ]; then \"$python\" model_mode_b.py || status=1; fi\n\
# Diagnostics only (its exit status is not the run's): does the device repeat\n\
# one decode to the bit, under each SDPA backend and BLAS switch?\n\
\"$python\" determinism_probe.py $model || true\n\
exit $status\n";

/// The harness's Python files, relative to the workspace root.
const HARNESS: &[&str] = &[
    "xtask/harness/reference_model.py",
    "xtask/harness/divergence.py",
    "xtask/harness/determinism_probe.py",
    "xtask/harness/model_engine.py",
    "xtask/harness/real_model.py",
    "xtask/harness/real_model_direct.py",
    "kvcr-direct-linker/python/e2e/model_mode_b.py",
];

/// The HiCache face's test helpers the mode A harness imports.
const HICACHE_HELPERS: &[&str] = &[
    "engine.py",
    "host_pool.py",
    "sglang_files.py",
    "test_tensor_parallel.py",
];

/// The real-model harness in `out/harness`, the `kvcr_hicache` wheel and
/// `run-model.sh`.
fn model_harness(root: &Path, out: &Path) -> Result<()> {
    crate::python::wheel(root, &crate::python::HICACHE, out)?;
    let harness = out.join("harness");
    if harness.exists() {
        std::fs::remove_dir_all(&harness)?;
    }
    let helpers = harness.join("hicache-helpers");
    std::fs::create_dir_all(&helpers)?;
    for file in HARNESS {
        let from = root.join(file);
        let name = from.file_name().context("a harness file name")?;
        std::fs::copy(&from, harness.join(name))
            .with_context(|| format!("copy {}", from.display()))?;
    }
    let tests = root.join(crate::python::HICACHE.dir).join("tests");
    for name in HICACHE_HELPERS {
        std::fs::copy(tests.join(name), helpers.join(name))
            .with_context(|| format!("copy {name}"))?;
    }
    // SGLang's three files, verbatim, as `setup.sh` extracted them.
    let sglang = root.join("target").join("py-sglang");
    for rel in [
        "sglang/srt/environ.py",
        "sglang/srt/mem_cache/hicache_storage.py",
        "sglang/srt/mem_cache/storage/backend_factory.py",
    ] {
        let to = harness.join("py-sglang").join(rel);
        if let Some(dir) = to.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::copy(sglang.join(rel), &to).with_context(|| format!("copy {rel}"))?;
    }
    executable(&out.join("run-model.sh"), RUN_MODEL)
}

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
    // The wheels need the venv's maturin and the harness SGLang's files: a
    // fresh clone gets them here (idempotent, seconds when present). The UCX
    // binding needs the system packages first, as `cargo xtask test` does.
    crate::setup::ensure_system_packages()?;
    crate::python::ensure_env(root)?;
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
    executable(&out.join("run-seed.sh"), RUN_SEED)?;
    python_face(root, &out)?;
    model_harness(root, &out)?;
    let size: u64 = std::fs::read_dir(&out)?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    eprintln!(
        "xtask: GPU binaries, both wheels and the real-model harness in {} ({:.1} MiB); \
         run target/gpu/run.sh, run-seed.sh, run-python.sh and run-model.sh on the GPU machine",
        out.display(),
        size as f64 / (1 << 20) as f64
    );
    Ok(())
}
