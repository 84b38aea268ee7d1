//! Source rule (b): `unsafe` lives in a few named places only, and the
//! census of where it lives today.
//!
//! The scan reads every `.rs` file of the repository (tests, benches,
//! examples and the crates outside the main workspace included; `target/` and
//! hidden folders skipped) through [`super::lexer`], so comments, doc comments
//! and string literals never count. Code counts when it has the keyword
//! `unsafe` (`unsafe {`, `unsafe fn`, `unsafe impl`, `unsafe extern`) or opts
//! a module out of the lint (`#[allow(unsafe_code)]`, `#[expect(…)]`);
//! `#![deny(unsafe_code)]` and `forbid` are what we want and never count.
//!
//! The register contract reaches past the runner: an engine hands the runner
//! raw memory through `unsafe fn`s ([`REGISTER_CONTRACT`]), and each caller
//! makes its half of the promise in an `unsafe { … }` block around the call,
//! so such a block (keep it to the call) never counts, anywhere. A wrapper
//! that passes the promise on (`unsafe fn register_host_pool`, with its
//! `#[allow(unsafe_code)]`) does not count outside the runner; inside the
//! runner the contract's functions live in `register.rs` only, and its
//! `lib.rs` may opt exactly that module out of the lint (`#[allow(unsafe_code)]
//! mod register;`, [`Place::RunnerRoot`]), nothing else.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::Result;

use super::lexer::{Located, Token, is_one_of, is_punct, is_word, strip, tokens};
use super::{read, rust_files, slash_path};

/// Where `unsafe` may appear, from the workspace root: a folder (ending in
/// `/`, everything under it) or one file, and why.
pub(super) const UNSAFE_ALLOWED: &[(&str, &str)] = &[
    (
        "kvcr-foundation/sys/",
        "kvcr-sys: the runner's unsafe crate (mappings, memfd, seqlock, copy kernels, \
         fd passing, direct I/O); safe types out",
    ),
    (
        "kvcr-foundation/ucx/",
        "kvcr-ucx: the UCX binding; raw calls go through its result layer",
    ),
    (
        "kvcr-direct-linker/",
        "the direct linker: CUDA driver calls on device memory (and its Python face)",
    ),
    (
        "kvcr-hicache-storage/python/",
        "the Python face of mode A: buffers handed over from Python",
    ),
    (
        "kvcr-foundation/runner/src/register.rs",
        "the runner's one contract: an engine hands it raw memory (`register_*`)",
    ),
    (
        "kvcr-foundation/runner/tests/it/device.rs",
        "the device half of that contract: a stand-in `DeviceCopier` copies the raw \
         spans the runner hands it (host memory playing the device), as the CUDA \
         copier does in kvcr-direct-linker; no safe API can name the runner's pools",
    ),
];

/// The functions of the register contract: an engine hands the runner raw
/// memory and promises it stays valid (the runner's, and the wrappers of the
/// crates above that pass the promise on).
pub(super) const REGISTER_CONTRACT: &[&str] = &[
    "register_region",
    "register_device_region",
    "register_host_pool",
];

/// Where a wrapper may declare a function of the register contract besides
/// [`UNSAFE_ALLOWED`]: anywhere but the runner's source, whose contract lives
/// in its `register.rs` alone.
const CONTRACT_WRAPPERS_BARRED: &str = "kvcr-foundation/runner/src/";

/// The runner's crate root, which declares the contract's module.
const RUNNER_ROOT: &str = "kvcr-foundation/runner/src/lib.rs";

/// What the register contract lets a file outside [`UNSAFE_ALLOWED`] hold,
/// by where the file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Place {
    /// Outside the runner's source: wrappers that pass the contract on
    /// (`#[allow(unsafe_code)] pub unsafe fn register_host_pool`).
    Elsewhere,
    /// The runner's source: no wrapper (the contract lives in `register.rs`).
    Runner,
    /// The runner's `lib.rs`: as [`Place::Runner`], and it opts the
    /// contract's module out of the lint with exactly
    /// `#[allow(unsafe_code)] mod register;`.
    RunnerRoot,
}

impl Place {
    /// The place of `path` (relative, `/`-separated).
    pub(super) fn of(path: &str) -> Self {
        if path == RUNNER_ROOT {
            Self::RunnerRoot
        } else if path.starts_with(CONTRACT_WRAPPERS_BARRED) {
            Self::Runner
        } else {
            Self::Elsewhere
        }
    }
}

/// The reason `unsafe` may appear in `path` (relative, `/`-separated), if it
/// may.
pub(super) fn allowed_because(path: &str) -> Option<&'static str> {
    UNSAFE_ALLOWED
        .iter()
        .find(|(place, _)| {
            if place.ends_with('/') {
                path.starts_with(place)
            } else {
                path == *place
            }
        })
        .map(|(_, why)| *why)
}

/// The lines of `source` whose code uses `unsafe`, with that code trimmed.
/// Calls of the register contract never count; its wrappers' declarations
/// and the runner's `mod register;` attribute count unless `place` allows
/// them.
pub(super) fn unsafe_lines(source: &str, place: Place) -> Vec<(usize, String)> {
    let wrappers_allowed = place == Place::Elsewhere;
    let code = strip(source);
    let located = tokens(&code);
    let mut lines: Vec<usize> = Vec::new();
    let mut lint_parens: Option<usize> = None;
    // Where the lint attribute being read starts (its `allow`/`expect`).
    let mut lint_start = 0;
    for (i, (line, token)) in located.iter().enumerate() {
        let hit = match token {
            Token::Word(w) if w == "unsafe" => {
                !(calls_contract(&located, i)
                    || wrappers_allowed && declares_contract(&located, i + 1))
            }
            Token::Word(w) if (w == "allow" || w == "expect") && is_punct(&located, i + 1, '(') => {
                lint_parens = Some(0);
                lint_start = i;
                false
            }
            Token::Punct('(') => {
                lint_parens = lint_parens.map(|depth| depth + 1);
                false
            }
            Token::Punct(')') => {
                lint_parens = lint_parens.and_then(|depth| depth.checked_sub(1).filter(|d| *d > 0));
                false
            }
            Token::Word(w) => {
                w == "unsafe_code"
                    && lint_parens.is_some()
                    && !(wrappers_allowed && attribute_on_contract(&located, lint_start))
                    && !(place == Place::RunnerRoot && opts_out_register(&located, lint_start))
            }
            _ => false,
        };
        if hit && lines.last() != Some(line) {
            lines.push(*line);
        }
    }
    let code_lines: Vec<&str> = code.lines().collect();
    lines
        .into_iter()
        .map(|line| {
            let text = code_lines.get(line - 1).copied().unwrap_or_default();
            (line, text.split_whitespace().collect::<Vec<_>>().join(" "))
        })
        .collect()
}

/// Whether `unsafe` at `i` opens a block that calls a function of the
/// register contract.
fn calls_contract(located: &[Located], i: usize) -> bool {
    if !is_punct(located, i + 1, '{') {
        return false;
    }
    let mut depth = 0usize;
    for (j, (_, token)) in located.iter().enumerate().skip(i + 1) {
        match token {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    return false;
                }
            }
            Token::Word(w)
                if REGISTER_CONTRACT.contains(&w.as_str()) && is_punct(located, j + 1, '(') =>
            {
                return true;
            }
            _ => {}
        }
    }
    false
}

/// Whether the tokens from `i` on are `fn <a function of the contract>`.
fn declares_contract(located: &[Located], i: usize) -> bool {
    is_word(located, i, "fn") && is_one_of(located.get(i + 1), REGISTER_CONTRACT)
}

/// Whether the attribute whose lint list starts at `start` sits on a
/// declaration of a function of the contract (`#[allow(unsafe_code)] pub
/// unsafe fn register_host_pool`).
fn attribute_on_contract(located: &[Located], start: usize) -> bool {
    let Some(close) = (start..located.len()).find(|j| is_punct(located, *j, ']')) else {
        return false;
    };
    let Some(unsafe_at) = (close + 1..located.len())
        .take_while(|j| !is_punct(located, *j, '{') && !is_punct(located, *j, ';'))
        .find(|j| is_word(located, *j, "unsafe"))
    else {
        return false;
    };
    declares_contract(located, unsafe_at + 1)
}

/// Whether the lint list starting at `start` (its `allow`) is exactly
/// `#[allow(unsafe_code)] mod register;`: an outer attribute with that one
/// lint, on that module's declaration (not an inline module, not `pub`).
fn opts_out_register(located: &[Located], start: usize) -> bool {
    let Some(hash) = start.checked_sub(2) else {
        return false;
    };
    is_punct(located, hash, '#')
        && is_punct(located, hash + 1, '[')
        && is_word(located, start, "allow")
        && is_punct(located, start + 1, '(')
        && is_word(located, start + 2, "unsafe_code")
        && is_punct(located, start + 3, ')')
        && is_punct(located, start + 4, ']')
        && is_word(located, start + 5, "mod")
        && is_word(located, start + 6, "register")
        && is_punct(located, start + 7, ';')
}

/// The rule's findings over the tree: `path:line: code` for every line of
/// code with `unsafe` outside [`UNSAFE_ALLOWED`].
pub(super) fn violations(root: &Path) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    for path in rust_files(root)? {
        let relative = slash_path(root, &path);
        if allowed_because(&relative).is_some() {
            continue;
        }
        let source = read(&path)?;
        for (line, code) in unsafe_lines(&source, Place::of(&relative)) {
            problems.push(format!(
                "{relative}:{line}: unsafe outside its places: {code}"
            ));
        }
    }
    Ok(problems)
}

/// One crate's line in the census.
#[derive(Debug, Default)]
struct Count {
    files: usize,
    keyword_lines: usize,
    any_lines: usize,
}

/// The census: per crate (by the nearest `Cargo.toml` with a package), the
/// files with `unsafe` code, the lines with the `unsafe` keyword, and the
/// lines whose code holds the word at all (lint names such as
/// `#![deny(unsafe_code)]` included: `grep -c unsafe` without comments and
/// strings).
pub(super) fn census(root: &Path) -> Result<String> {
    let mut counts: BTreeMap<String, Count> = BTreeMap::new();
    let mut names: BTreeMap<PathBuf, String> = BTreeMap::new();
    for path in rust_files(root)? {
        let source = read(&path)?;
        let keyword_lines = tokens(&strip(&source))
            .iter()
            .filter(|(_, t)| matches!(t, Token::Word(w) if w == "unsafe"))
            .map(|(line, _)| *line)
            .collect::<BTreeSet<_>>()
            .len();
        let any_lines = strip(&source)
            .lines()
            .filter(|l| l.contains("unsafe"))
            .count();
        let name = crate_of(root, &path, &mut names)?;
        let count = counts.entry(name).or_default();
        count.files += usize::from(keyword_lines > 0);
        count.keyword_lines += keyword_lines;
        count.any_lines += any_lines;
    }
    let mut out = format!(
        "{:<28} {:>6} {:>8} {:>8}\n",
        "crate", "files", "unsafe", "grep -c"
    );
    let mut total = Count::default();
    for (name, count) in &counts {
        out.push_str(&format!(
            "{name:<28} {:>6} {:>8} {:>8}\n",
            count.files, count.keyword_lines, count.any_lines
        ));
        total.files += count.files;
        total.keyword_lines += count.keyword_lines;
        total.any_lines += count.any_lines;
    }
    out.push_str(&format!(
        "{:<28} {:>6} {:>8} {:>8}\n",
        "total", total.files, total.keyword_lines, total.any_lines
    ));
    Ok(out)
}

/// The package that owns `path`: the nearest folder above it whose
/// `Cargo.toml` has a `[package]` name.
fn crate_of(root: &Path, path: &Path, names: &mut BTreeMap<PathBuf, String>) -> Result<String> {
    for folder in path.ancestors().skip(1) {
        if !folder.starts_with(root) {
            break;
        }
        if let Some(name) = names.get(folder) {
            return Ok(name.clone());
        }
        let manifest = folder.join("Cargo.toml");
        if !manifest.is_file() {
            continue;
        }
        if let Some(name) = package_name(&read(&manifest)?) {
            names.insert(folder.to_path_buf(), name.clone());
            return Ok(name);
        }
    }
    Ok("(no package)".to_owned())
}

/// The `name` of a manifest's `[package]` table, read line by line.
fn package_name(manifest: &str) -> Option<String> {
    let mut in_package = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_package = line == "[package]";
        } else if in_package
            && let Some(value) = line.strip_prefix("name")
            && let Some(value) = value.trim_start().strip_prefix('=')
        {
            return Some(value.trim().trim_matches('"').to_owned());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    /// The numbers of the lines [`unsafe_lines`] finds in `source`.
    fn line_numbers(source: &str, place: Place) -> Vec<usize> {
        unsafe_lines(source, place)
            .into_iter()
            .map(|(l, _)| l)
            .collect()
    }

    #[rstest]
    #[case::block("let x = unsafe { *p };", &[1])]
    #[case::function("\npub unsafe fn f() {}", &[2])]
    #[case::impl_send("unsafe impl Send for X {}", &[1])]
    #[case::extern_block("unsafe extern \"C\" {\n fn f();\n}", &[1])]
    #[case::allow_attr("#[allow(unsafe_code)]\nmod copy;", &[1])]
    #[case::allow_list("#[allow(dead_code, unsafe_code)]", &[1])]
    #[case::expect_attr("#![expect(unsafe_code, reason = \"x\")]", &[1])]
    #[case::twice_one_line("unsafe { a() }; unsafe { b() }", &[1])]
    #[case::deny("#![deny(unsafe_code)]", &[])]
    #[case::forbid("#![forbid(unsafe_code)]", &[])]
    #[case::allow_then_word("#[allow(dead_code)] fn unsafe_code() {}", &[])]
    #[case::line_comment("let x = 1; // unsafe { }", &[])]
    #[case::doc_comment("/// Calls `unsafe fn` inside.\n//! unsafe\nfn f() {}", &[])]
    #[case::block_comment("/* unsafe\n unsafe */ fn f() {}", &[])]
    #[case::string("panic!(\"unsafe {{ }}\");", &[])]
    #[case::raw_string("let s = r#\"unsafe \"x\" fn\"#;", &[])]
    #[case::identifier_part("let unsafely = not_unsafe();", &[])]
    fn unsafe_rule(#[case] source: &str, #[case] lines: &[usize]) {
        for place in [Place::Elsewhere, Place::Runner, Place::RunnerRoot] {
            assert_eq!(line_numbers(source, place), lines);
        }
    }

    /// The register contract: its calls never count, its wrappers'
    /// declarations only where wrappers are allowed (outside the runner).
    #[rstest]
    #[case::call("let r = unsafe { runner.register_region(desc) };", &[], &[])]
    #[case::call_multiline(
        "unsafe {\n runner.register_device_region(RegionDesc {\n a,\n })\n}",
        &[],
        &[]
    )]
    #[case::call_path("unsafe { Storage::register_host_pool(&s, d) }?;", &[], &[])]
    #[case::other_call("unsafe { AsyncFd::register_with_interest(fd, i) }", &[1], &[1])]
    #[case::name_not_called("unsafe { let f = register_region; f(x) }", &[1], &[1])]
    #[case::after_block("unsafe { libc::kill(p, s) };\nrunner.register_region(d);", &[1], &[1])]
    #[case::wrapper(
        "#[allow(unsafe_code)]\npub unsafe fn register_host_pool(&self, d: D) -> R {\n\
         unsafe { self.storage.register_host_pool(d) }\n}",
        &[],
        &[1, 2]
    )]
    #[case::other_fn("#[allow(unsafe_code)]\npub unsafe fn copy_plan() {}", &[1, 2], &[1, 2])]
    #[case::crate_allow("#![allow(missing_docs, unsafe_code)]\nfn main() {}", &[1], &[1])]
    fn register_contract(
        #[case] source: &str,
        #[case] outside_runner: &[usize],
        #[case] in_runner: &[usize],
    ) {
        let lines = |place| line_numbers(source, place);
        assert_eq!(lines(Place::Elsewhere), outside_runner);
        assert_eq!(lines(Place::Runner), in_runner);
        assert_eq!(lines(Place::RunnerRoot), in_runner);
    }

    /// The runner's `lib.rs` may opt exactly its contract's module out of
    /// the lint, and nothing else; no other file may.
    #[rstest]
    #[case::the_contract("#[allow(unsafe_code)]\nmod register;", &[])]
    #[case::one_line("#[allow(unsafe_code)] mod register;", &[])]
    #[case::documented("/// The contract.\n#[allow(unsafe_code)]\nmod register;", &[])]
    #[case::other_module("#[allow(unsafe_code)]\nmod copy;", &[1])]
    #[case::public("#[allow(unsafe_code)]\npub mod register;", &[1])]
    #[case::inline("#[allow(unsafe_code)]\nmod register {}", &[1])]
    #[case::inline_unsafe(
        "#[allow(unsafe_code)]\nmod register {\n unsafe fn f() {}\n}",
        &[1, 3]
    )]
    #[case::expect("#[expect(unsafe_code)]\nmod register;", &[1])]
    #[case::more_lints("#[allow(dead_code, unsafe_code)]\nmod register;", &[1])]
    #[case::inner("#![allow(unsafe_code)]\nmod register;", &[1])]
    #[case::register_then_more("#[allow(unsafe_code)]\nmod register;\nunsafe fn f() {}", &[3])]
    fn register_module(#[case] source: &str, #[case] in_root: &[usize]) {
        let lines = |place| line_numbers(source, place);
        assert_eq!(lines(Place::RunnerRoot), in_root);
        let attribute_line = source
            .lines()
            .position(|l| l.contains("unsafe_code"))
            .unwrap()
            + 1;
        for place in [Place::Elsewhere, Place::Runner] {
            assert!(
                lines(place).contains(&attribute_line),
                "{place:?} takes no attribute"
            );
        }
    }

    #[rstest]
    #[case::root("kvcr-foundation/runner/src/lib.rs", Place::RunnerRoot)]
    #[case::module("kvcr-foundation/runner/src/copy/mod.rs", Place::Runner)]
    #[case::nested_lib("kvcr-foundation/runner/src/peer/lib.rs", Place::Runner)]
    #[case::runner_tests("kvcr-foundation/runner/tests/it/main.rs", Place::Elsewhere)]
    #[case::other_crate("kvcr-hicache-perf/src/backend.rs", Place::Elsewhere)]
    #[case::guard_root("kvcr-foundation/guard/src/lib.rs", Place::Elsewhere)]
    fn places(#[case] path: &str, #[case] place: Place) {
        assert_eq!(Place::of(path), place);
    }

    #[rstest]
    #[case::sys_crate("kvcr-foundation/sys/src/mapping.rs", true)]
    #[case::ucx_tests("kvcr-foundation/ucx/tests/it/main.rs", true)]
    #[case::linker_bench("kvcr-direct-linker/benches/copy.rs", true)]
    #[case::linker_face("kvcr-direct-linker/python/src/lib.rs", true)]
    #[case::storage_face("kvcr-hicache-storage/python/src/lib.rs", true)]
    #[case::register("kvcr-foundation/runner/src/register.rs", true)]
    #[case::device_seam_test("kvcr-foundation/runner/tests/it/device.rs", true)]
    #[case::other_runner_test("kvcr-foundation/runner/tests/it/g3_tier.rs", false)]
    #[case::register_folder("kvcr-foundation/runner/src/register/raw.rs", false)]
    #[case::runner_module("kvcr-foundation/runner/src/copy.rs", false)]
    #[case::runner_core("kvcr-foundation/runner-core/src/lib.rs", false)]
    #[case::facade_tests("kvcr-foundation/tests/it/runner.rs", false)]
    #[case::storage("kvcr-hicache-storage/src/lib.rs", false)]
    #[case::sys_lookalike("kvcr-foundation/system/lib.rs", false)]
    fn allow_list(#[case] path: &str, #[case] allowed: bool) {
        assert_eq!(allowed_because(path).is_some(), allowed);
    }

    #[rstest]
    #[case::plain("[package]\nname = \"kvcr-sys\"\n", Some("kvcr-sys"))]
    #[case::later("[workspace]\n[package]\nversion = \"0\"\nname=\"x\"\n", Some("x"))]
    #[case::virtual_manifest("[workspace]\nmembers = []\n", None)]
    #[case::other_table("[package]\n[dependencies]\nname = \"y\"\n", None)]
    #[case::name_prefix("[package]\nnamespace = 1\nname = \"z\"\n", Some("z"))]
    fn manifest_names(#[case] manifest: &str, #[case] name: Option<&str>) {
        assert_eq!(package_name(manifest).as_deref(), name);
    }
}
