//! Source rule (a): no module of the runner reaches back into `lib.rs`'s
//! private state. `lib.rs` is the module map, the re-exports and `Runner`;
//! the state the driver's threads share (`Shared`, the core lock and its
//! pump) lives in a module of its own that the others import by its path.
//!
//! A module breaks the rule when a path that starts at the crate root names
//! `Shared`, or any item `lib.rs` itself defines without plain `pub`
//! (private or `pub(crate)`): `crate::Shared`, `use crate::{Shared, …}`,
//! `super::Shared` from a top-level module (`super::super::…` from one level
//! down), or a glob of the crate root (`use super::*` there). Paths into
//! modules (`crate::net::…`) and `pub` items (re-exports included) are fine.
//! `lib.rs` itself, its `#[cfg(test)]` modules (its own unit tests) and the
//! binaries under `src/bin/` (crate roots of their own) are not checked.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::Result;

use super::lexer::{Located, Token, is_one_of, is_path_sep, is_punct, is_word, strip, tokens};
use super::{read, rust_files, slash_path};

/// The runner crate's source folder, from the workspace root.
pub(super) const RUNNER_SRC: &str = "kvcr-foundation/runner/src";

/// Named whatever `lib.rs` makes of it: the driver's shared state is imported
/// from its own module, never through the crate root.
const SHARED_STATE: &str = "Shared";

/// Keywords that start an item whose name follows.
const ITEM_KEYWORDS: &[&str] = &[
    "struct", "enum", "union", "fn", "const", "static", "type", "trait",
];

/// Words that may stand between a visibility and the item keyword.
const QUALIFIERS: &[&str] = &[
    "const", "async", "unsafe", "safe", "extern", "default", "auto",
];

/// What `lib.rs` holds that its modules must not import through the root.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct CrateRoot {
    /// Items `lib.rs` defines without plain `pub`.
    pub(super) private_items: BTreeSet<String>,
    /// Its `#[cfg(test)] mod name;` children (unit tests of `lib.rs`).
    pub(super) test_modules: BTreeSet<String>,
}

/// Reads `lib.rs`'s top-level items.
pub(super) fn read_crate_root(lib_rs: &str) -> CrateRoot {
    let located = tokens(&strip(lib_rs));
    let mut root = CrateRoot::default();
    let mut depth = 0usize;
    let mut cfg_test = false;
    for (i, (_, token)) in located.iter().enumerate() {
        match token {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => depth = depth.saturating_sub(1),
            _ => {}
        }
        if depth > 0 || matches!(token, Token::Punct('{' | '}')) {
            cfg_test = false;
            continue;
        }
        let Token::Word(word) = token else {
            if matches!(token, Token::Punct(';')) {
                cfg_test = false;
            }
            continue;
        };
        if word == "cfg"
            && is_punct(&located, i + 1, '(')
            && is_word(&located, i + 2, "test")
            && is_punct(&located, i + 3, ')')
        {
            cfg_test = true;
        }
        if word == "mod"
            && cfg_test
            && let (Some((_, Token::Word(name))), true) =
                (located.get(i + 1), is_punct(&located, i + 2, ';'))
        {
            root.test_modules.insert(name.clone());
        }
        if ITEM_KEYWORDS.contains(&word.as_str())
            && let Some(name) = item_name(&located, i)
            && !is_plain_pub(&located, i)
        {
            root.private_items.insert(name);
        }
    }
    root
}

/// The name of the item whose keyword is at `i`, if an item starts there
/// (`const fn` is named at its `fn`, `const _` has none, `fn(u8)` is a type).
fn item_name(located: &[Located], i: usize) -> Option<String> {
    let mut next = i + 1;
    if is_word(located, i, "static") && is_word(located, next, "mut") {
        next += 1;
    }
    match located.get(next) {
        Some((_, Token::Word(name)))
            if name != "_"
                && !ITEM_KEYWORDS.contains(&name.as_str())
                && !QUALIFIERS.contains(&name.as_str()) =>
        {
            Some(name.clone())
        }
        _ => None,
    }
}

/// Whether the item keyword at `i` is preceded by plain `pub` (not
/// `pub(crate)`, `pub(super)` or `pub(in …)`).
fn is_plain_pub(located: &[Located], i: usize) -> bool {
    let mut back = i;
    while back > 0 && is_one_of(located.get(back - 1), QUALIFIERS) {
        back -= 1;
    }
    back > 0 && is_word(located, back - 1, "pub")
}

/// A path in a module that starts at the crate root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum RootPath {
    /// `crate::Name…` (or an entry `Name` of `crate::{…}`).
    Named(String),
    /// `crate::*` or `super::*` up to the root.
    Glob,
}

/// Every path in `source` that starts at the crate root, with its line, for
/// a module file `depth` levels below it (1: `src/foo.rs` or
/// `src/foo/mod.rs`; inline `mod x { … }` blocks add their own level).
pub(super) fn root_paths(source: &str, depth: usize) -> Vec<(usize, RootPath)> {
    let located = tokens(&strip(source));
    let mut found = Vec::new();
    let mut braces = 0usize;
    // The brace depth just inside each inline module we are in.
    let mut inline_modules: Vec<usize> = Vec::new();
    let mut i = 0;
    while let Some((line, token)) = located.get(i) {
        let after_path = i > 0 && (is_path_sep(&located, i - 1) || is_punct(&located, i - 1, '$'));
        match token {
            Token::Punct('{') => braces += 1,
            Token::Punct('}') => {
                if inline_modules.last() == Some(&braces) {
                    inline_modules.pop();
                }
                braces = braces.saturating_sub(1);
            }
            Token::Word(w)
                if w == "mod"
                    && matches!(located.get(i + 1), Some((_, Token::Word(_))))
                    && is_punct(&located, i + 2, '{') =>
            {
                braces += 1;
                inline_modules.push(braces);
                i += 3;
                continue;
            }
            Token::Word(w) if !after_path && (w == "crate" || w == "super") => {
                let module_depth = depth + inline_modules.len();
                let mut rest = i;
                let mut hops = 0;
                if w == "crate" {
                    if is_path_sep(&located, i + 1) {
                        rest = i + 2;
                        hops = module_depth;
                    }
                } else {
                    while is_word(&located, rest, "super") && is_path_sep(&located, rest + 1) {
                        hops += 1;
                        rest += 2;
                    }
                }
                if rest > i && hops == module_depth {
                    found.extend(entries_at(&located, rest).into_iter().map(|p| (*line, p)));
                }
            }
            _ => {}
        }
        i += 1;
    }
    found
}

/// The first segment of the path (or of each entry of the `{…}` group) that
/// starts at `i`.
fn entries_at(located: &[Located], i: usize) -> Vec<RootPath> {
    let first = |token: Option<&Located>| match token {
        Some((_, Token::Word(name))) if name != "self" => Some(RootPath::Named(name.clone())),
        Some((_, Token::Punct('*'))) => Some(RootPath::Glob),
        _ => None,
    };
    if !is_punct(located, i, '{') {
        return first(located.get(i)).into_iter().collect();
    }
    let mut entries = Vec::new();
    let mut level = 0usize;
    let mut entry_starts = true;
    for (j, (_, token)) in located.iter().enumerate().skip(i) {
        match token {
            Token::Punct('{') => level += 1,
            Token::Punct('}') => level -= 1,
            Token::Punct(',') if level == 1 => entry_starts = true,
            _ if level == 1 && entry_starts => {
                entries.extend(first(located.get(j)));
                entry_starts = false;
            }
            _ => {}
        }
        if level == 0 {
            break;
        }
    }
    entries
}

/// The rule's findings in one module file of the runner, as `line: what`.
pub(super) fn module_violations(root: &CrateRoot, source: &str, depth: usize) -> Vec<String> {
    root_paths(source, depth)
        .into_iter()
        .filter_map(|(line, path)| match path {
            RootPath::Glob => Some(format!(
                "{line}: glob import of the crate root (takes lib.rs's private state)"
            )),
            RootPath::Named(name) if name == SHARED_STATE => Some(format!(
                "{line}: `{name}` through the crate root (import it from its own module)"
            )),
            RootPath::Named(name) if root.private_items.contains(&name) => Some(format!(
                "{line}: `{name}`, a private item of lib.rs, through the crate root"
            )),
            RootPath::Named(_) => None,
        })
        .collect()
}

/// How deep below the crate root the module of a file under `src/` sits
/// (`foo.rs` and `foo/mod.rs`: 1), and whether the rule looks at it.
pub(super) fn module_depth(root: &CrateRoot, relative: &[&str]) -> Option<usize> {
    let (file, folders) = relative.split_last()?;
    let top = relative.first()?;
    let top_module = top.strip_suffix(".rs").unwrap_or(top);
    let checked = *file != "lib.rs" && *top != "bin" && !root.test_modules.contains(top_module);
    let depth = if *file == "mod.rs" {
        folders.len()
    } else {
        relative.len()
    };
    checked.then_some(depth)
}

/// The rule's findings over the runner's source: `path:line: what`.
pub(super) fn violations(root: &Path) -> Result<Vec<String>> {
    let src = root.join(RUNNER_SRC);
    let crate_root = read_crate_root(&read(&src.join("lib.rs"))?);
    let mut problems = Vec::new();
    for path in rust_files(&src)? {
        let relative = slash_path(&src, &path);
        let parts: Vec<&str> = relative.split('/').collect();
        let Some(depth) = module_depth(&crate_root, &parts) else {
            continue;
        };
        for finding in module_violations(&crate_root, &read(&path)?, depth) {
            problems.push(format!("{RUNNER_SRC}/{relative}:{finding}"));
        }
    }
    Ok(problems)
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    const LIB_RS: &str = r#"
//! The crate root. struct NotAnItem;
pub mod net;
mod shared;
#[cfg(test)]
mod tests;
#[cfg(feature = "x")]
mod gated;
pub use shared::Exported;
use std::sync::Arc;
pub(crate) struct Shared { inner: Arc<()> }
struct Inner;
pub struct Runner;
pub(crate) enum Stage { A }
const SPIN: u32 = 3;
pub const MAX: u32 = 4;
static mut COUNT: u32 = 0;
type Callback = Box<dyn FnMut() + Send>;
pub type Result<T> = std::result::Result<T, ()>;
pub(crate) const fn helper() -> u32 { 1 }
pub async fn open() {}
const _: () = { fn hidden() {} };
impl Runner { fn method(&self) {} pub fn run(&self) {} }
fn default_policy() -> fn(u8) { todo!() }
"#;

    #[test]
    fn crate_root_items() {
        let root = read_crate_root(LIB_RS);
        let private: Vec<&str> = root.private_items.iter().map(String::as_str).collect();
        assert_eq!(
            private,
            [
                "COUNT",
                "Callback",
                "Inner",
                "SPIN",
                "Shared",
                "Stage",
                "default_policy",
                "helper"
            ]
        );
        assert_eq!(root.test_modules.iter().collect::<Vec<_>>(), ["tests"]);
    }

    #[rstest]
    #[case::use_group("use crate::{Shared, net::Listener};", 1, &["1: `Shared`"])]
    #[case::crate_path("fn f(s: &crate::Shared) {}", 1, &["1: `Shared`"])]
    #[case::super_top("use super::Shared;", 1, &["1: `Shared`"])]
    #[case::super_two_levels("use super::super::{Inner, net};", 2, &["1: `Inner`"])]
    #[case::private_fn("let p = crate::default_policy();", 3, &["1: `default_policy`"])]
    #[case::variant_path("\nmatch s { crate::Stage::A => {} }", 1, &["2: `Stage`"])]
    #[case::glob_top("use super::*;", 1, &["1: glob"])]
    #[case::nested_group("use crate::{net::{a, b}, SPIN};", 2, &["1: `SPIN`"])]
    #[case::shared_anywhere("use crate::shared::Shared;", 1, &[])]
    #[case::pub_reexport("use crate::{Exported, Runner, MAX, Result};", 1, &[])]
    #[case::module_path("use crate::net::Shared as Other;", 1, &[])]
    #[case::super_sibling("use super::Shared;", 2, &[])]
    #[case::inline_test_module("mod tests {\n use super::*;\n}", 1, &[])]
    #[case::inline_then_root("mod t { use super::Inner; }\nuse super::Inner;", 1, &["2: `Inner`"])]
    #[case::restricted_visibility("pub(crate) fn f() {} pub(in crate::net) fn g() {}", 1, &[])]
    #[case::macro_crate("$crate::Shared", 1, &[])]
    #[case::comment_and_doc("// crate::Shared\n/// [`crate::Shared`]\nfn f() {}", 1, &[])]
    #[case::string("let s = \"crate::Shared\";", 1, &[])]
    fn private_state_rule(#[case] source: &str, #[case] depth: usize, #[case] want: &[&str]) {
        let root = read_crate_root(LIB_RS);
        let found = module_violations(&root, source, depth);
        assert_eq!(found.len(), want.len(), "{found:#?}");
        for (finding, start) in found.iter().zip(want) {
            assert!(
                finding.starts_with(start),
                "{finding} should start with {start}"
            );
        }
    }

    #[rstest]
    #[case::top_file(&["copy.rs"], Some(1))]
    #[case::top_folder(&["net", "mod.rs"], Some(1))]
    #[case::nested_file(&["net", "session.rs"], Some(2))]
    #[case::deeper(&["peer", "thread", "mod.rs"], Some(2))]
    #[case::lib(&["lib.rs"], None)]
    #[case::lib_tests(&["tests.rs"], None)]
    #[case::lib_tests_folder(&["tests", "props.rs"], None)]
    #[case::binary(&["bin", "kvcr-guard.rs"], None)]
    fn which_files_and_how_deep(#[case] relative: &[&str], #[case] depth: Option<usize>) {
        let root = read_crate_root(LIB_RS);
        assert_eq!(module_depth(&root, relative), depth);
    }
}
