//! The layering check: the five slices depend strictly downward, siblings never
//! on each other, and only `kvcr-direct-linker` reaches CUDA.
//!
//! ```text
//!          kvcr-foundation
//!          /             \
//!  kvcr-hicache-storage   kvcr-linker-contracts
//!          |                       |
//!  kvcr-hicache-perf      kvcr-direct-linker
//! ```
//!
//! Run by `cargo xtask layers`, by `cargo xtask ci`, and as a `#[test]` so that
//! plain `cargo test` enforces it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use cargo_metadata::{DependencyKind, MetadataCommand, PackageId};

/// Which workspace crates each slice may depend on (directly or not).
const ALLOWED: &[(&str, &[&str])] = &[
    ("kvcr-foundation", &[]),
    ("kvcr-hicache-storage", &["kvcr-foundation"]),
    (
        "kvcr-hicache-perf",
        &["kvcr-foundation", "kvcr-hicache-storage"],
    ),
    ("kvcr-linker-contracts", &["kvcr-foundation"]),
    (
        "kvcr-direct-linker",
        &["kvcr-foundation", "kvcr-linker-contracts"],
    ),
];

/// The Python face of `kvcr-hicache-storage`: an extension crate in its own
/// cargo workspace (excluded from the main one; a cdylib for maturin), checked
/// here by its own manifest. It sits on mode A and may reach these only.
const PYTHON_FACE: (&str, &[&str]) = (
    "kvcr-hicache-storage/python/Cargo.toml",
    &[
        "kvcr-foundation",
        "kvcr-hicache-storage",
        "kvcr-hicache-perf",
    ],
);

/// Crates only `kvcr-direct-linker` (and xtask) may reach.
const CUDA_CRATES: &[&str] = &["cudarc"];

/// What the contracts face (`kvcr-foundation`, no default features) must not
/// pull in: no async runtime, no FFI to UCX/ZMQ/CUDA, no raw memory mapping.
const CONTRACTS_FORBIDDEN: &[&str] = &[
    "tokio", "mio", "zmq", "zeromq", "cudarc", "memmap2", "ucp-sys", "nix",
];

/// A layering problem, as text a reviewer can act on.
pub(crate) fn violations(root: &Path) -> Result<Vec<String>> {
    let metadata = MetadataCommand::new()
        .manifest_path(root.join("Cargo.toml"))
        .exec()
        .context("cargo metadata")?;
    let resolve = metadata.resolve.as_ref().context("no resolve graph")?;
    let names: BTreeMap<&PackageId, &str> = metadata
        .packages
        .iter()
        .map(|p| (&p.id, p.name.as_str()))
        .collect();
    let members: BTreeSet<&str> = metadata
        .workspace_packages()
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    let edges: BTreeMap<&PackageId, Vec<(&PackageId, bool)>> = resolve
        .nodes
        .iter()
        .map(|node| {
            let deps = node
                .deps
                .iter()
                .map(|d| {
                    let dev_only = d
                        .dep_kinds
                        .iter()
                        .all(|k| k.kind == DependencyKind::Development);
                    (&d.pkg, dev_only)
                })
                .collect();
            (&node.id, deps)
        })
        .collect();

    let mut problems = Vec::new();
    for (slice, _) in ALLOWED {
        if !members.contains(slice) {
            problems.push(format!("{slice} is not a workspace member"));
        }
    }
    for pkg in metadata.workspace_packages() {
        let name = pkg.name.as_str();
        if name == "xtask" {
            continue;
        }
        let Some((_, allowed)) = ALLOWED.iter().find(|(slice, _)| *slice == name) else {
            problems.push(format!(
                "{name} is a workspace member outside the five slices and xtask"
            ));
            continue;
        };
        // Everything reachable from this crate; dev-dependencies count for the
        // crate itself (its tests must not couple slices either) but not
        // transitively (a dependency's dev-dependencies are never built).
        let mut seen: BTreeSet<&PackageId> = BTreeSet::new();
        let mut stack: Vec<(&PackageId, bool)> = vec![(&pkg.id, true)];
        while let Some((id, is_root)) = stack.pop() {
            for (dep, dev_only) in edges.get(id).into_iter().flatten() {
                if *dev_only && !is_root {
                    continue;
                }
                if seen.insert(dep) {
                    stack.push((dep, false));
                }
            }
        }
        for dep in seen {
            let dep_name = names.get(dep).copied().unwrap_or("?");
            if members.contains(dep_name) && !allowed.contains(&dep_name) {
                problems.push(format!(
                    "{name} depends on {dep_name}, which is not below it (allowed: {allowed:?})"
                ));
            }
            if CUDA_CRATES.contains(&dep_name) && name != "kvcr-direct-linker" {
                problems.push(format!(
                    "{name} depends on {dep_name}; only kvcr-direct-linker may touch CUDA"
                ));
            }
        }
    }
    problems.extend(contracts_face_violations(root)?);
    problems.extend(python_face_violations(root, &members)?);
    Ok(problems)
}

/// Checks the Python face's crate (outside the main workspace): every crate of
/// ours it reaches must be one it may sit on, and it reaches no CUDA.
fn python_face_violations(root: &Path, members: &BTreeSet<&str>) -> Result<Vec<String>> {
    let (manifest, allowed) = PYTHON_FACE;
    let metadata = MetadataCommand::new()
        .manifest_path(root.join(manifest))
        .other_options(vec!["--locked".to_owned()])
        .exec()
        .with_context(|| format!("cargo metadata for {manifest}"))?;
    let face = metadata
        .root_package()
        .map(|p| p.name.to_string())
        .unwrap_or_else(|| manifest.to_owned());
    let mut problems = Vec::new();
    for pkg in &metadata.packages {
        let name = pkg.name.as_str();
        if name == face {
            continue;
        }
        if members.contains(name) && !allowed.contains(&name) {
            problems.push(format!(
                "{face} (the Python face) depends on {name} (allowed: {allowed:?})"
            ));
        }
        if CUDA_CRATES.contains(&name) {
            problems.push(format!(
                "{face} (the Python face) depends on {name}; only kvcr-direct-linker may touch CUDA"
            ));
        }
    }
    Ok(problems)
}

/// Checks the crates the contracts face really builds, resolved for that
/// package alone (workspace feature unification would hide a leak).
fn contracts_face_violations(root: &Path) -> Result<Vec<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .current_dir(root)
        .args([
            "tree",
            "--locked",
            "-p",
            "kvcr-foundation",
            "--no-default-features",
            "-e",
            "normal,build",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .output()
        .context("cargo tree")?;
    if !out.status.success() {
        bail!(
            "cargo tree failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let crates: BTreeSet<&str> = text
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    Ok(CONTRACTS_FORBIDDEN
        .iter()
        .filter(|f| crates.contains(*f))
        .map(|f| {
            format!("kvcr-foundation without default features depends on {f} (the contracts face must stay free of I/O and FFI)")
        })
        .collect())
}

/// Fails with every violation listed.
pub(crate) fn check(root: &Path) -> Result<()> {
    let problems = violations(root)?;
    if !problems.is_empty() {
        bail!("layering violations:\n  {}", problems.join("\n  "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_layering_holds() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let problems = violations(root).unwrap();
        assert!(problems.is_empty(), "{problems:#?}");
    }

    /// The rule table itself: siblings are never allowed, and nothing but the
    /// direct linker sits above linker-contracts.
    #[test]
    fn rule_table_keeps_modes_apart() {
        for (slice, allowed) in ALLOWED {
            let hicache = slice.starts_with("kvcr-hicache");
            let linker = slice.contains("linker");
            for dep in *allowed {
                assert!(
                    !(hicache && dep.contains("linker")
                        || linker && dep.starts_with("kvcr-hicache")),
                    "{slice} may not depend on {dep}"
                );
            }
        }
    }
}
