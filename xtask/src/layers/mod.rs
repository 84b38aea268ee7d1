//! The layering check: the five slices depend strictly downward, siblings never
//! on each other, and only `kvcr-direct-linker` reaches CUDA.
//!
//! ```text
//!          kvcr-foundation            (a group: facade, contracts, ucx, sys, runner-core,
//!          /             \             runner, guard, publisher)
//!  kvcr-hicache-storage   kvcr-linker-contracts
//!          |                       |
//!  kvcr-hicache-perf      kvcr-direct-linker
//!
//!  inside kvcr-foundation (the facade reaches all; every crate may reach contracts):
//!
//!     kvcr-guard --> kvcr-runner --> kvcr-runner-core (sans-I/O)
//!                        |
//!                        +--> kvcr-sys (the unsafe) --> kvcr-ucx (the binding)
//!     kvcr-publisher
//! ```
//!
//! A slice may be a group of crates in its folder: every crate of a group sits
//! at its slice's level, so a crate may depend on any crate of a slice below
//! its own, and inside a group only along the group's own edges.
//!
//! Besides the manifests, two rules read the source: no module of the runner
//! imports `lib.rs`'s private state ([`private_state`]), and `unsafe` appears
//! only in the places [`unsafe_code::UNSAFE_ALLOWED`] names (and the register
//! contract's calls and wrappers). `cargo xtask layers --census` counts the
//! `unsafe` lines per crate.
//!
//! Run by `cargo xtask layers`, by `cargo xtask ci`, and as a `#[test]` so that
//! plain `cargo test` enforces it.

mod lexer;
mod private_state;
mod unsafe_code;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use cargo_metadata::{DependencyKind, MetadataCommand, PackageId};

/// The slices, bottom up: each slice's crates (the first names the slice and
/// is its facade) and the slices it may sit on.
const SLICES: &[(&[&str], &[&str])] = &[
    (
        &[
            "kvcr-foundation",
            "kvcr-contracts",
            "kvcr-ucx",
            "kvcr-sys",
            "kvcr-runner-core",
            "kvcr-runner",
            "kvcr-guard",
            "kvcr-publisher",
        ],
        &[],
    ),
    (&["kvcr-hicache-storage"], &["kvcr-foundation"]),
    (
        &["kvcr-hicache-perf"],
        &["kvcr-foundation", "kvcr-hicache-storage"],
    ),
    (&["kvcr-linker-contracts"], &["kvcr-foundation"]),
    (
        &["kvcr-direct-linker"],
        &["kvcr-foundation", "kvcr-linker-contracts"],
    ),
];

/// Edges allowed inside a slice group (directly or not), besides the
/// facade's (it may reach every crate of its group): strictly down, the
/// runner to its core, binding and unsafe crate, the Guard on top of the
/// runner, and every crate to the contracts. `kvcr-ucx` depends on no other
/// kvcr crate, `kvcr-sys` on the binding (for `OwnedMemory`) and the
/// contracts only, and no crate of the group but the facade reaches the Guard.
const GROUP_EDGES: &[(&str, &[&str])] = &[
    ("kvcr-contracts", &[]),
    ("kvcr-ucx", &[]),
    ("kvcr-sys", &["kvcr-contracts", "kvcr-ucx"]),
    ("kvcr-runner-core", &["kvcr-contracts"]),
    (
        "kvcr-runner",
        &["kvcr-contracts", "kvcr-runner-core", "kvcr-ucx", "kvcr-sys"],
    ),
    (
        "kvcr-guard",
        // kvcr-ucx: through the runner (edges count transitively).
        &[
            "kvcr-runner",
            "kvcr-runner-core",
            "kvcr-contracts",
            "kvcr-sys",
            "kvcr-ucx",
        ],
    ),
    ("kvcr-publisher", &["kvcr-contracts"]),
];

/// One Python face: an extension crate in its own cargo workspace (excluded
/// from the main one; a cdylib for maturin), checked here by its own manifest.
struct PythonFace {
    /// The face's manifest, from the workspace root.
    manifest: &'static str,
    /// The slices it may reach (and the crates of the slice groups named).
    allowed: &'static [&'static str],
    /// Whether it may reach CUDA, and then only through `kvcr-direct-linker`
    /// (never by a dependency of its own).
    cuda_through_linker: bool,
}

/// The Python faces: mode A's sits on the HiCache slice, mode B's on the
/// direct linker's (which alone reaches CUDA).
const PYTHON_FACES: &[PythonFace] = &[
    PythonFace {
        manifest: "kvcr-hicache-storage/python/Cargo.toml",
        allowed: &[
            "kvcr-foundation",
            "kvcr-hicache-storage",
            "kvcr-hicache-perf",
        ],
        cuda_through_linker: false,
    },
    PythonFace {
        manifest: "kvcr-direct-linker/python/Cargo.toml",
        allowed: &[
            "kvcr-foundation",
            "kvcr-linker-contracts",
            "kvcr-direct-linker",
        ],
        cuda_through_linker: true,
    },
];

/// Crates only `kvcr-direct-linker` (and xtask) may reach.
const CUDA_CRATES: &[&str] = &["cudarc"];

/// The pure crates, each resolved for itself (workspace feature unification
/// would hide a leak): no async runtime, no FFI to UCX/ZMQ/CUDA, no libc, no
/// raw memory mapping, and none of our crates that carry those.
const PURE_CRATES: &[&[&str]] = &[
    &["-p", "kvcr-contracts"],
    &["-p", "kvcr-runner-core"],
    &["-p", "kvcr-linker-contracts"],
    &["-p", "kvcr-foundation", "--no-default-features"],
];

/// What a pure crate must not pull in.
const PURE_FORBIDDEN: &[&str] = &[
    "tokio",
    "mio",
    "libc",
    "zmq",
    "zmq-sys",
    "zeromq",
    "cudarc",
    "memmap2",
    "nix",
    "kvcr-ucx",
    "kvcr-sys",
    "kvcr-runner",
    "kvcr-guard",
    "kvcr-publisher",
];

/// The crates of a slice (its group) and the slice's facade name.
fn slice_of(name: &str) -> Option<(&'static str, &'static [&'static str])> {
    SLICES
        .iter()
        .find(|(crates, _)| crates.contains(&name))
        .and_then(|(crates, below)| crates.first().map(|facade| (*facade, *below)))
}

/// Whether `from` may depend on `to` (both workspace crates).
fn edge_allowed(from: &str, to: &str) -> bool {
    let (Some((from_slice, below)), Some((to_slice, _))) = (slice_of(from), slice_of(to)) else {
        return false;
    };
    if from_slice == to_slice {
        if from == from_slice {
            return from != to;
        }
        return GROUP_EDGES
            .iter()
            .any(|(crate_name, deps)| *crate_name == from && deps.contains(&to));
    }
    below.contains(&to_slice)
}

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
    for (crates, _) in SLICES {
        for name in *crates {
            if !members.contains(name) {
                problems.push(format!("{name} is not a workspace member"));
            }
        }
    }
    for pkg in metadata.workspace_packages() {
        let name = pkg.name.as_str();
        if name == "xtask" {
            continue;
        }
        if slice_of(name).is_none() {
            problems.push(format!(
                "{name} is a workspace member outside the five slices and xtask"
            ));
            continue;
        }
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
            if members.contains(dep_name) && !edge_allowed(name, dep_name) {
                problems.push(format!(
                    "{name} depends on {dep_name}, which is not below it in the slice stack"
                ));
            }
            if CUDA_CRATES.contains(&dep_name) && name != "kvcr-direct-linker" {
                problems.push(format!(
                    "{name} depends on {dep_name}; only kvcr-direct-linker may touch CUDA"
                ));
            }
        }
    }
    for args in PURE_CRATES {
        problems.extend(pure_crate_violations(root, args)?);
    }
    problems.extend(python_face_violations(root, &members)?);
    Ok(problems)
}

/// Checks the Python faces' crates (outside the main workspace): every crate
/// of ours each reaches must be one it may sit on, and it reaches CUDA only
/// where allowed, and then only through `kvcr-direct-linker`.
fn python_face_violations(root: &Path, members: &BTreeSet<&str>) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    for face in PYTHON_FACES {
        problems.extend(python_face_problems(root, members, face)?);
    }
    Ok(problems)
}

fn python_face_problems(
    root: &Path,
    members: &BTreeSet<&str>,
    face: &PythonFace,
) -> Result<Vec<String>> {
    let PythonFace {
        manifest,
        allowed,
        cuda_through_linker,
    } = face;
    let metadata = MetadataCommand::new()
        .manifest_path(root.join(manifest))
        .other_options(vec!["--locked".to_owned()])
        .exec()
        .with_context(|| format!("cargo metadata for {manifest}"))?;
    let root_package = metadata.root_package();
    let face_name = root_package
        .map(|p| p.name.to_string())
        .unwrap_or_else(|| (*manifest).to_owned());
    let mut problems = Vec::new();
    for dep in root_package.into_iter().flat_map(|p| &p.dependencies) {
        if CUDA_CRATES.contains(&dep.name.as_str()) {
            problems.push(format!(
                "{face_name} (a Python face) depends on {} itself; only kvcr-direct-linker may \
                 touch CUDA",
                dep.name
            ));
        }
    }
    for pkg in &metadata.packages {
        let name = pkg.name.as_str();
        if name == face_name {
            continue;
        }
        let in_allowed_slice = slice_of(name).is_some_and(|(slice, _)| allowed.contains(&slice));
        if members.contains(name) && !in_allowed_slice {
            problems.push(format!(
                "{face_name} (a Python face) depends on {name} (allowed: {allowed:?})"
            ));
        }
        if CUDA_CRATES.contains(&name) && !cuda_through_linker {
            problems.push(format!(
                "{face_name} (a Python face) depends on {name}; only kvcr-direct-linker may \
                 touch CUDA"
            ));
        }
    }
    Ok(problems)
}

/// Checks the crates a pure crate really builds, resolved for that package
/// alone (workspace feature unification would hide a leak).
fn pure_crate_violations(root: &Path, package: &[&str]) -> Result<Vec<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .current_dir(root)
        .args(["tree", "--locked"])
        .args(package)
        .args(["-e", "normal,build", "--prefix", "none", "--format", "{p}"])
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
    let what = package.join(" ");
    Ok(PURE_FORBIDDEN
        .iter()
        .filter(|f| crates.contains(*f))
        .map(|f| format!("{what} depends on {f} (pure crates stay free of I/O runtimes and FFI)"))
        .collect())
}

/// The source rules' findings: imports of `lib.rs`'s private state by the
/// runner's modules, then `unsafe` outside its places.
fn source_findings(root: &Path) -> Result<Vec<String>> {
    let mut findings = private_state::violations(root)?;
    findings.extend(unsafe_code::violations(root)?);
    Ok(findings)
}

/// Fails with every violation listed: the manifests' and the source
/// rules'.
pub(crate) fn check(root: &Path) -> Result<()> {
    let mut problems = violations(root)?;
    problems.extend(source_findings(root)?);
    if !problems.is_empty() {
        bail!("layering violations:\n  {}", problems.join("\n  "));
    }
    Ok(())
}

/// The `unsafe` census, one line per crate.
pub(crate) fn census(root: &Path) -> Result<String> {
    unsafe_code::census(root)
}

/// Every `.rs` file under `root`, sorted, leaving out build output
/// (`target/`) and hidden folders.
fn rust_files(root: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut folders = vec![root.to_path_buf()];
    while let Some(folder) = folders.pop() {
        let entries =
            fs::read_dir(&folder).with_context(|| format!("reading {}", folder.display()))?;
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let kind = entry.file_type()?;
            if kind.is_dir() && name != "target" && !name.starts_with('.') {
                folders.push(entry.path());
            } else if kind.is_file() && name.ends_with(".rs") {
                files.push(entry.path());
            }
        }
    }
    files.sort();
    Ok(files)
}

/// `path` relative to `root`, with `/` between its parts.
fn slash_path(root: &Path, path: &Path) -> String {
    let relative = path.strip_prefix(root).unwrap_or(path);
    relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

/// A source file's text.
fn read(path: &Path) -> Result<String> {
    fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    /// The tree as it is: manifests and source rules both hold (it fails
    /// when `unsafe` appears outside its places or a runner module imports
    /// `lib.rs`'s private state).
    #[test]
    fn workspace_layering_holds() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let problems = violations(root).unwrap();
        assert!(problems.is_empty(), "{problems:#?}");
        let findings = source_findings(root).unwrap();
        assert!(findings.is_empty(), "{findings:#?}");
    }

    /// The rule table itself: siblings are never allowed, and nothing but the
    /// direct linker sits above linker-contracts.
    #[test]
    fn rule_table_keeps_modes_apart() {
        for (crates, below) in SLICES {
            for slice in *crates {
                let hicache = slice.starts_with("kvcr-hicache");
                let linker = slice.contains("linker");
                for dep in *below {
                    assert!(
                        !(hicache && dep.contains("linker")
                            || linker && dep.starts_with("kvcr-hicache")),
                        "{slice} may not depend on {dep}"
                    );
                }
            }
        }
    }

    /// Group edges point down: no crate of a group reaches the facade, and
    /// the binding reaches nothing of ours.
    #[test]
    fn group_edges_point_down() {
        assert!(edge_allowed("kvcr-runner", "kvcr-runner-core"));
        assert!(edge_allowed("kvcr-foundation", "kvcr-publisher"));
        assert!(edge_allowed("kvcr-linker-contracts", "kvcr-contracts"));
        assert!(!edge_allowed("kvcr-runner-core", "kvcr-runner"));
        assert!(!edge_allowed("kvcr-contracts", "kvcr-runner-core"));
        assert!(!edge_allowed("kvcr-ucx", "kvcr-contracts"));
        assert!(!edge_allowed("kvcr-runner", "kvcr-foundation"));
        assert!(!edge_allowed("kvcr-publisher", "kvcr-runner"));
        assert!(edge_allowed("kvcr-runner", "kvcr-sys"));
        assert!(edge_allowed("kvcr-sys", "kvcr-ucx"));
        assert!(!edge_allowed("kvcr-sys", "kvcr-runner"));
        assert!(!edge_allowed("kvcr-sys", "kvcr-runner-core"));
        assert!(!edge_allowed("kvcr-runner-core", "kvcr-sys"));
        assert!(edge_allowed("kvcr-guard", "kvcr-runner"));
        assert!(edge_allowed("kvcr-foundation", "kvcr-guard"));
        assert!(!edge_allowed("kvcr-runner", "kvcr-guard"));
        assert!(!edge_allowed("kvcr-publisher", "kvcr-guard"));
        assert!(!edge_allowed(
            "kvcr-hicache-storage",
            "kvcr-linker-contracts"
        ));
        assert!(!edge_allowed("kvcr-contracts", "kvcr-hicache-storage"));
    }

    /// The unsafe crate and the Guard in the group: the runner sits on
    /// `kvcr-sys`, the Guard on the runner, and nothing of the group but the
    /// facade reaches the Guard (the slices above may).
    #[rstest]
    #[case::sys_to_ucx("kvcr-sys", "kvcr-ucx", true)]
    #[case::runner_to_sys("kvcr-runner", "kvcr-sys", true)]
    #[case::facade_to_sys("kvcr-foundation", "kvcr-sys", true)]
    #[case::facade_to_guard("kvcr-foundation", "kvcr-guard", true)]
    #[case::guard_to_runner("kvcr-guard", "kvcr-runner", true)]
    #[case::guard_to_core("kvcr-guard", "kvcr-runner-core", true)]
    #[case::guard_to_contracts("kvcr-guard", "kvcr-contracts", true)]
    #[case::guard_to_sys("kvcr-guard", "kvcr-sys", true)]
    #[case::storage_to_guard("kvcr-hicache-storage", "kvcr-guard", true)]
    #[case::linker_to_guard("kvcr-direct-linker", "kvcr-guard", true)]
    #[case::sys_to_runner("kvcr-sys", "kvcr-runner", false)]
    #[case::sys_to_core("kvcr-sys", "kvcr-runner-core", false)]
    #[case::sys_to_contracts("kvcr-sys", "kvcr-contracts", true)]
    #[case::sys_to_guard("kvcr-sys", "kvcr-guard", false)]
    #[case::ucx_to_sys("kvcr-ucx", "kvcr-sys", false)]
    #[case::core_to_sys("kvcr-runner-core", "kvcr-sys", false)]
    #[case::runner_to_guard("kvcr-runner", "kvcr-guard", false)]
    #[case::core_to_guard("kvcr-runner-core", "kvcr-guard", false)]
    #[case::contracts_to_guard("kvcr-contracts", "kvcr-guard", false)]
    #[case::publisher_to_guard("kvcr-publisher", "kvcr-guard", false)]
    #[case::guard_to_publisher("kvcr-guard", "kvcr-publisher", false)]
    #[case::guard_to_facade("kvcr-guard", "kvcr-foundation", false)]
    fn new_crates_in_the_group(#[case] from: &str, #[case] to: &str, #[case] allowed: bool) {
        assert_eq!(edge_allowed(from, to), allowed, "{from} -> {to}");
    }

    /// The scan covers the workspace: the runner's modules, its tests and the
    /// crates outside the main workspace, never build output.
    #[test]
    fn scan_covers_the_tree() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let files: Vec<String> = rust_files(root)
            .unwrap()
            .iter()
            .map(|p| slash_path(root, p))
            .collect();
        for expected in [
            "kvcr-foundation/runner/src/lib.rs",
            "xtask/src/layers/mod.rs",
            "kvcr-hicache-storage/python/src/lib.rs",
            "kvcr-direct-linker/python/src/lib.rs",
        ] {
            assert!(
                files.iter().any(|f| f == expected),
                "{expected} not scanned"
            );
        }
        assert!(
            !files
                .iter()
                .any(|f| f.starts_with("target/") || f.contains("/target/"))
        );
    }
}
