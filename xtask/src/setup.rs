//! Installs what a fresh Debian machine lacks, and only that.

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::run;

/// Debian packages the workspace needs: UCX headers and pkg-config to build the
/// UCX binding, `ucx-utils` for `ucx_perftest` anchors, a C++ compiler for
/// libzmq (built from source by zmq-sys), and Python with venv plus iproute2
/// for the real-client tests (Dynamo's indexer, vLLM's wire classes).
const APT_PACKAGES: &[&str] = &[
    "pkg-config",
    "libucx-dev",
    "ucx-utils",
    "g++",
    "python3",
    "python3-venv",
    "iproute2",
    // The link harness (`cargo xtask e2e`'s between-hosts scenarios): loss,
    // partitions and the delayer's NFQUEUE rules.
    "iptables",
];

fn is_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Installs the missing apt packages (as root, or through `sudo -n`).
pub(crate) fn ensure_system_packages() -> Result<()> {
    if Command::new("dpkg-query")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("xtask: not a Debian-family system; install {APT_PACKAGES:?} yourself");
        return Ok(());
    }
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| !is_installed(p))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing missing packages: {}", missing.join(" "));
    let apt = |args: &[&str]| -> Command {
        let mut cmd = if is_root() {
            Command::new("apt-get")
        } else {
            let mut sudo = Command::new("sudo");
            sudo.args(["-n", "apt-get"]);
            sudo
        };
        cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    };
    run(&mut apt(&["update", "-q"])).context("apt-get update (need root or passwordless sudo)")?;
    let mut install = apt(&["install", "-y", "-q", "--no-install-recommends"]);
    install.args(&missing);
    run(&mut install)?;
    let still: Vec<&str> = missing.into_iter().filter(|p| !is_installed(p)).collect();
    if !still.is_empty() {
        bail!("packages still missing after install: {still:?}");
    }
    Ok(())
}

/// Installs the real third-party clients the publisher tests run against
/// (idempotent; a venv under `target/realclients`).
pub(crate) fn ensure_real_clients(root: &std::path::Path) -> Result<()> {
    run(Command::new("bash").arg(root.join("kvcr-foundation/publisher/tests/realclients/setup.sh")))
        .context("installing the real-client test dependencies (needs PyPI)")
}

/// Installs a cargo subcommand at a pinned version if it is not on PATH.
pub(crate) fn ensure_cargo_tool(binary: &str, krate: &str, version: &str) -> Result<()> {
    let present = Command::new(binary)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
        || Command::new("cargo")
            .args([binary.trim_start_matches("cargo-"), "--version"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
    if present {
        return Ok(());
    }
    eprintln!("xtask: installing {krate} {version}");
    run(Command::new("cargo").args(["install", "--locked", krate, "--version", version]))
}
