//! The Python faces: `kvcr-hicache-storage/python` (mode A, `kvcr_hicache`)
//! and `kvcr-direct-linker/python` (mode B, `kvcr_direct`). Their cached venv,
//! their extension builds, their test suites and the HiCache benchmark.
//!
//! Each extension crate is its own Cargo workspace (excluded from the main
//! one), so everything here drives it by manifest path and builds it into a
//! shared target folder, `target/py-build`, which never contends with the
//! main workspace's build lock (and lets the faces share their dependencies'
//! artifacts).
//!
//! | path | what |
//! |---|---|
//! | `target/py-venv` | venv: PyPI torch 2.14.1, numpy, maturin, pytest, transformers (`setup.sh`) |
//! | `target/py-sglang` | SGLang 0.5.23's three contract files, verbatim |
//! | `target/py-build` | the extensions' cargo target folder |
//! | `target/py-wheels` | the wheels `maturin build` produced and the venv installed |

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::run;

/// One Python face: an extension crate with its pure-Python package beside
/// it and its pytest suite in `tests/`.
pub(crate) struct Face {
    /// The face's folder, relative to the workspace root.
    pub(crate) dir: &'static str,
    /// How its wheels' file names start (the Python package's name).
    wheel_prefix: &'static str,
    /// Whether its tests start a `kvcr-guard` process (`KVCR_GUARD_BIN`).
    needs_guard: bool,
}

/// Mode A: kvcr as SGLang's HiCache storage backend. Its folder also holds
/// the venv's `setup.sh`.
pub(crate) const HICACHE: Face = Face {
    dir: "kvcr-hicache-storage/python",
    wheel_prefix: "kvcr_hicache-",
    needs_guard: true,
};

/// Mode B: the direct linker over an engine's torch KV pool.
pub(crate) const DIRECT: Face = Face {
    dir: "kvcr-direct-linker/python",
    wheel_prefix: "kvcr_direct-",
    needs_guard: false,
};

/// Every face, in the order they build and test.
const FACES: &[&Face] = &[&HICACHE, &DIRECT];

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
    cmd.arg(root.join(HICACHE.dir).join("setup.sh"));
    with_env(root, &mut cmd);
    run(&mut cmd).context("installing the Python face's venv (needs PyPI)")
}

/// Builds `face`'s wheel (release) into `out`, replacing any earlier one of
/// that face there, and returns its path.
pub(crate) fn wheel(root: &Path, face: &Face, out: &Path) -> Result<PathBuf> {
    for old in wheels_of(face, out) {
        std::fs::remove_file(&old).with_context(|| format!("removing {}", old.display()))?;
    }
    let mut maturin = Command::new(venv(root).join("bin").join("maturin"));
    maturin
        .current_dir(root.join(face.dir))
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
        .arg(out);
    with_env(root, &mut maturin);
    run(&mut maturin)?;
    wheels_of(face, out)
        .into_iter()
        .next()
        .with_context(|| format!("maturin built no wheel for {}", face.dir))
}

/// `face`'s wheels in `dir`.
fn wheels_of(face: &Face, dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|ext| ext == "whl"))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(face.wheel_prefix))
        })
        .collect()
}

/// Builds every face's extension (release; the benchmark and the tests share
/// them) and installs the wheels into the venv.
pub(crate) fn build(root: &Path) -> Result<()> {
    let wheels = root.join("target").join("py-wheels");
    if wheels.exists() {
        std::fs::remove_dir_all(&wheels)
            .with_context(|| format!("clearing {}", wheels.display()))?;
    }
    let mut built = Vec::with_capacity(FACES.len());
    for face in FACES {
        built.push(wheel(root, face, &wheels)?);
    }
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
    .args(&built);
    with_env(root, &mut pip);
    run(&mut pip)
}

/// Builds the extensions and runs each face's test suite with pytest (for
/// HiCache: SGLang's own loader and call patterns, two runner processes; for
/// the direct linker: argument checks, the request hooks and byte-exact
/// restores on a host pool, the GPU tests skipped without `KVCR_TEST_GPU=1`).
/// Needs [`ensure_env`] first.
pub(crate) fn build_and_test(root: &Path) -> Result<()> {
    build(root)?;
    for face in FACES {
        let mut pytest = Command::new(python(root));
        if face.needs_guard {
            // The guard test starts a `kvcr-guard` process (built in the main
            // target folder, as the e2e scenarios use it).
            pytest.env("KVCR_GUARD_BIN", crate::node::build_guard(root, false)?);
        }
        // From the tests folder: `python -m` puts the working folder first on
        // sys.path, and the package's source folder (no extension inside) must
        // not shadow the installed wheel.
        pytest.current_dir(root.join(face.dir).join("tests")).args([
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            ".",
        ]);
        with_env(root, &mut pytest);
        run(&mut pytest)?;
    }
    Ok(())
}

/// Runs the HiCache face's benchmark and returns its `BENCH` and `# ` lines.
pub(crate) fn bench(root: &Path, quick: bool) -> Result<Vec<String>> {
    ensure_env(root)?;
    build(root)?;
    let mut cmd = Command::new(python(root));
    cmd.current_dir(root.join(HICACHE.dir))
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

/// Clippy over every extension crate (each is outside the main workspace,
/// so the workspace-wide clippy of `cargo xtask ci` does not reach them).
pub(crate) fn clippy(root: &Path) -> Result<()> {
    for face in FACES {
        let manifest = root.join(face.dir).join("Cargo.toml");
        let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
        cmd.args(["clippy", "--locked", "--all-targets", "--manifest-path"])
            .arg(&manifest)
            .args(["--", "-D", "warnings"])
            .env("CARGO_TARGET_DIR", root.join("target").join("py-build"));
        run(&mut cmd)?;
    }
    Ok(())
}

/// `cargo fmt` over every extension crate.
pub(crate) fn fmt_check(root: &Path) -> Result<()> {
    for face in FACES {
        let manifest = root.join(face.dir).join("Cargo.toml");
        let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
        cmd.args(["fmt", "--manifest-path"])
            .arg(&manifest)
            .args(["--", "--check"]);
        run(&mut cmd)?;
    }
    Ok(())
}
