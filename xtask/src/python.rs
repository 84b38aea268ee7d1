//! The Python face of `kvcr-hicache-storage` (`kvcr-hicache-storage/python`):
//! its cached venv, its extension build, its test suite and its benchmark.
//!
//! The extension crate is its own Cargo workspace (excluded from the main
//! one), so everything here drives it by manifest path and builds it into its
//! own target folder, `target/py-build`, which never contends with the main
//! workspace's build lock.
//!
//! | path | what |
//! |---|---|
//! | `target/py-venv` | venv: PyPI torch 2.14.1, numpy, maturin, pytest (`setup.sh`) |
//! | `target/py-sglang` | SGLang 0.5.23's three contract files, verbatim |
//! | `target/py-build` | the extension's cargo target folder |
//! | `target/py-wheels` | the wheel `maturin build` produced and the venv installed |

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::run;

/// The Python face's folder, relative to the workspace root.
pub(crate) const DIR: &str = "kvcr-hicache-storage/python";

fn venv(root: &Path) -> PathBuf {
    root.join("target").join("py-venv")
}

fn python(root: &Path) -> PathBuf {
    venv(root).join("bin").join("python")
}

/// The environment every command of the Python face runs with.
fn with_env(root: &Path, cmd: &mut Command) {
    let bin = venv(root).join("bin");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![bin];
    paths.extend(std::env::split_paths(&path));
    cmd.env("VIRTUAL_ENV", venv(root))
        .env("PATH", std::env::join_paths(paths).unwrap_or(path))
        .env("KVCR_PY_VENV", venv(root))
        .env("KVCR_SGLANG_SRC", root.join("target").join("py-sglang"))
        .env("CARGO_TARGET_DIR", root.join("target").join("py-build"))
        .env("PYTHONDONTWRITEBYTECODE", "1");
}

/// The venv's interpreter, with the environment every command of the Python
/// face runs with set on `cmd`: for a caller that starts the interpreter
/// through a wrapper (`cargo xtask e2e` starts it under `unshare`).
pub(crate) fn interpreter(root: &Path, cmd: &mut Command) -> PathBuf {
    with_env(root, cmd);
    python(root)
}

/// Whether the venv exists already (the benchmark runs only then).
pub(crate) fn env_ready(root: &Path) -> bool {
    python(root).exists()
}

/// Installs the venv and SGLang's files if missing (idempotent, seconds when
/// present; about 70 s on a fresh machine, most of it PyPI torch).
pub(crate) fn ensure_env(root: &Path) -> Result<()> {
    let mut cmd = Command::new("bash");
    cmd.arg(root.join(DIR).join("setup.sh"));
    with_env(root, &mut cmd);
    run(&mut cmd).context("installing the Python face's venv (needs PyPI)")
}

/// Builds the extension (release; the benchmark and the tests share it) and
/// installs its wheel into the venv.
pub(crate) fn build(root: &Path) -> Result<()> {
    let wheels = root.join("target").join("py-wheels");
    if wheels.exists() {
        std::fs::remove_dir_all(&wheels)
            .with_context(|| format!("clearing {}", wheels.display()))?;
    }
    let mut maturin = Command::new(venv(root).join("bin").join("maturin"));
    maturin
        .current_dir(root.join(DIR))
        // The wheel links the system's UCX (Debian's libucx); it is installed
        // here, not redistributed, so no auditwheel repair (which would
        // vendor libucx and needs patchelf).
        .args([
            "build",
            "--release",
            "--locked",
            "--auditwheel",
            "skip",
            "--out",
        ])
        .arg(&wheels);
    with_env(root, &mut maturin);
    run(&mut maturin)?;
    let wheel = std::fs::read_dir(&wheels)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|ext| ext == "whl"))
        .context("maturin built no wheel")?;
    let mut pip = Command::new(python(root));
    pip.args([
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--no-deps",
        "--force-reinstall",
    ])
    .arg(&wheel);
    with_env(root, &mut pip);
    run(&mut pip)
}

/// Builds the extension and runs the Python face's test suite (SGLang's own
/// loader and call patterns, two runner processes) with pytest. Needs
/// [`ensure_env`] first.
pub(crate) fn build_and_test(root: &Path) -> Result<()> {
    build(root)?;
    // The guard test starts a `kvcr-guard` process (built in the main
    // target folder, as the e2e scenarios use it).
    let guard = crate::node::build_guard(root, false)?;
    let mut pytest = Command::new(python(root));
    pytest.env("KVCR_GUARD_BIN", guard);
    // From the tests folder: `python -m` puts the working folder first on
    // sys.path, and the package's source folder (no extension inside) must
    // not shadow the installed wheel.
    pytest.current_dir(root.join(DIR).join("tests")).args([
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        ".",
    ]);
    with_env(root, &mut pytest);
    run(&mut pytest)
}

/// Runs the Python face's benchmark and returns its `BENCH` and `# ` lines.
pub(crate) fn bench(root: &Path, quick: bool) -> Result<Vec<String>> {
    ensure_env(root)?;
    build(root)?;
    let mut cmd = Command::new(python(root));
    cmd.current_dir(root.join(DIR))
        .arg("bench/restore_ratio.py")
        .stdout(Stdio::piped());
    if quick {
        cmd.arg("--quick");
    }
    with_env(root, &mut cmd);
    let out = cmd
        .spawn()
        .context("could not start the Python benchmark")?
        .wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with("BENCH ") || l.starts_with("# "))
        .map(str::to_owned)
        .collect();
    for line in &lines {
        println!("{line}");
    }
    if !out.status.success() {
        bail!("the Python benchmark failed with {}", out.status);
    }
    Ok(lines)
}

/// Clippy over the extension crate (it is outside the main workspace, so the
/// workspace-wide clippy of `cargo xtask ci` does not reach it).
pub(crate) fn clippy(root: &Path) -> Result<()> {
    let manifest = root.join(DIR).join("Cargo.toml");
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    cmd.args(["clippy", "--locked", "--all-targets", "--manifest-path"])
        .arg(&manifest)
        .args(["--", "-D", "warnings"])
        .env("CARGO_TARGET_DIR", root.join("target").join("py-build"));
    run(&mut cmd)
}

/// `cargo fmt` over the extension crate.
pub(crate) fn fmt_check(root: &Path) -> Result<()> {
    let manifest = root.join(DIR).join("Cargo.toml");
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    cmd.args(["fmt", "--manifest-path"])
        .arg(&manifest)
        .args(["--", "--check"]);
    run(&mut cmd)
}
