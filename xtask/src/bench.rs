//! `cargo xtask bench`: runs every benchmark binary of the workspace and
//! gathers their `BENCH` lines into a Markdown report.
//!
//! Each benchmark measures its own anchor (memcpy, `ucx_perftest`, a naive
//! path) in the same run and prints
//! `BENCH <name> value=<median> unit=<unit> [anchor=<median>] [ratio=<value/anchor>]`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

pub(crate) fn run(root: &Path, rest: &[String]) -> Result<()> {
    let quick = rest.iter().any(|a| a == "--quick");
    if let Some(unknown) = rest.iter().find(|a| *a != "--quick") {
        bail!("unknown bench option {unknown:?}");
    }
    crate::setup::ensure_system_packages()?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    // Only the bench targets (library targets would get libtest's bench
    // harness, which does not know our flags).
    let metadata = cargo_metadata::MetadataCommand::new()
        .manifest_path(root.join("Cargo.toml"))
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root).args(["bench", "--locked"]);
    let mut any = false;
    for package in metadata.workspace_packages() {
        for target in &package.targets {
            if target.kind.iter().any(|k| k.to_string() == "bench") {
                cmd.args(["-p", package.name.as_str(), "--bench", target.name.as_str()]);
                any = true;
            }
        }
    }
    if !any {
        bail!("no benchmarks found");
    }
    cmd.arg("--");
    if quick {
        cmd.arg("--quick");
    }
    eprintln!(
        "xtask: building and running benchmarks{}",
        if quick { " (quick)" } else { "" }
    );
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .context("could not start cargo bench")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        // Progress: every figure and note as it arrives.
        if line.starts_with("BENCH ") || line.starts_with("# ") {
            println!("{line}");
            lines.push(line);
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("cargo bench failed with {status}");
    }
    // The Python face is its own cargo workspace with a Python driver.
    lines.extend(crate::python::bench(root, quick)?);
    let report = render(&lines, quick);
    let dir = root.join("target").join("bench");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("report.md");
    std::fs::write(&path, report)?;
    eprintln!("xtask: report written to {}", path.display());
    Ok(())
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|part| part.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
}

fn render(lines: &[String], quick: bool) -> String {
    let mut out = String::from("# kvcr benchmark report\n\n");
    out.push_str(if quick {
        "Mode: `--quick` (fewer repetitions, smaller scales).\n\n"
    } else {
        "Mode: full.\n\n"
    });
    out.push_str("Every value is a median; anchors are measured in the same run.\n\n");
    out.push_str("| figure | value | unit | anchor | ratio |\n|---|---|---|---|---|\n");
    for line in lines.iter().filter(|l| l.starts_with("BENCH ")) {
        let name = line.split_whitespace().nth(1).unwrap_or("?");
        out.push_str(&format!(
            "| `{name}` | {} | {} | {} | {} |\n",
            field(line, "value").unwrap_or("-"),
            field(line, "unit").unwrap_or("-"),
            field(line, "anchor").unwrap_or("-"),
            field(line, "ratio").unwrap_or("-"),
        ));
    }
    let notes: Vec<&String> = lines.iter().filter(|l| l.starts_with("# ")).collect();
    if !notes.is_empty() {
        out.push_str("\nNotes:\n\n");
        for note in notes {
            out.push_str(&format!("- {}\n", note.trim_start_matches("# ")));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_lists_every_figure_with_its_anchor() {
        let lines = vec![
            "BENCH runner.deposit value=11.0 unit=GB/s anchor=12.0 ratio=0.917".to_owned(),
            "BENCH runner.query_hits value=55.2 unit=Mkeys/s".to_owned(),
            "# a note".to_owned(),
        ];
        let report = render(&lines, true);
        assert!(
            report.contains("| `runner.deposit` | 11.0 | GB/s | 12.0 | 0.917 |"),
            "{report}"
        );
        assert!(
            report.contains("| `runner.query_hits` | 55.2 | Mkeys/s | - | - |"),
            "{report}"
        );
        assert!(report.contains("- a note"));
    }
}
