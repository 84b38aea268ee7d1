//! Just enough of a Rust lexer for the source rules: comments and literals
//! blanked out (so a word in a doc comment or a string never counts as code),
//! then the code cut into identifiers, `::` and single punctuation marks, each
//! with its line.
//!
//! It is not a parser. It knows line and (nested) block comments, doc comments
//! (they are comments), string, byte and C strings with escapes, raw strings
//! (`r#"…"#`, any number of `#`), and tells a char literal (`'"'`, `'\n'`)
//! from a lifetime or label (`'a`). Macros are read as the tokens they are
//! written with, so code a macro builds from pieces escapes it.

/// One token of code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Token {
    /// An identifier, keyword or number (`unsafe`, `crate`, `Shared`, `42`).
    Word(String),
    /// `::`, the path separator.
    PathSep,
    /// Any other single character of code (`{`, `*`, `#`, `(`).
    Punct(char),
}

/// A token and the 1-based line it starts on.
pub(super) type Located = (usize, Token);

/// `source` with every comment and every string or char literal replaced by
/// spaces; line breaks stay where they were, so line numbers still hold.
pub(super) fn strip(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let at = |i: usize| chars.get(i).copied();
    let mut out = String::with_capacity(source.len());
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while let Some(c) = at(i) {
        let next = at(i + 1);
        let word_before = i.checked_sub(1).and_then(at).is_some_and(is_word_char);
        if c == '/' && next == Some('/') {
            while let Some(c) = at(i).filter(|c| *c != '\n') {
                blank(&mut out, c);
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0usize;
            while let Some(c) = at(i) {
                let pair = (c, at(i + 1));
                if pair == ('/', Some('*')) || pair == ('*', Some('/')) {
                    depth = if c == '/' { depth + 1 } else { depth - 1 };
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, c);
                    i += 1;
                }
            }
        } else if let Some(end) = raw_string_end(&chars, i).filter(|_| !word_before) {
            for c in chars.get(i..end).into_iter().flatten() {
                blank(&mut out, *c);
            }
            i = end;
        } else if c == '"' {
            blank(&mut out, c);
            i += 1;
            while let Some(c) = at(i) {
                let width = if c == '\\' { 2 } else { 1 };
                for c in chars.get(i..i + width).into_iter().flatten() {
                    blank(&mut out, *c);
                }
                i += width;
                if c == '"' {
                    break;
                }
            }
        } else if c == '\'' && (next == Some('\\') || at(i + 2) == Some('\'')) {
            // A char literal: skip the escape (if any), then up to the quote.
            let mut j = if next == Some('\\') { i + 3 } else { i + 2 };
            while at(j).is_some_and(|c| c != '\'') {
                j += 1;
            }
            for c in chars.get(i..=j).into_iter().flatten() {
                blank(&mut out, *c);
            }
            i = j + 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Where the raw string starting at `i` ends (one past its last `#`), if one
/// starts there: `r"…"`, `r#"…"#`, `br"…"`, `cr#"…"#`.
fn raw_string_end(chars: &[char], i: usize) -> Option<usize> {
    let at = |i: usize| chars.get(i).copied();
    let r = match at(i)? {
        'r' => i,
        'b' | 'c' if at(i + 1) == Some('r') => i + 1,
        _ => return None,
    };
    let hashes = (r + 1..).take_while(|j| at(*j) == Some('#')).count();
    let open = r + 1 + hashes;
    (at(open) == Some('"')).then_some(())?;
    let mut j = open + 1;
    loop {
        if at(j)? == '"' && (1..=hashes).all(|h| at(j + h) == Some('#')) {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The tokens of code that [`strip`] has already cleaned.
pub(super) fn tokens(code: &str) -> Vec<Located> {
    let mut out = Vec::new();
    for (index, text) in code.lines().enumerate() {
        let line = index + 1;
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            if is_word_char(c) {
                let mut word = String::from(c);
                while let Some(c) = chars.next_if(|c| is_word_char(*c)) {
                    word.push(c);
                }
                out.push((line, Token::Word(word)));
            } else if c == ':' && chars.next_if_eq(&':').is_some() {
                out.push((line, Token::PathSep));
            } else if !c.is_whitespace() {
                out.push((line, Token::Punct(c)));
            }
        }
    }
    out
}

/// Whether the token at `i` is the word `word`.
pub(super) fn is_word(tokens: &[Located], i: usize, word: &str) -> bool {
    matches!(tokens.get(i), Some((_, Token::Word(w))) if w == word)
}

/// Whether `token` is one of the words in `words`.
pub(super) fn is_one_of(token: Option<&Located>, words: &[&str]) -> bool {
    match token {
        Some((_, Token::Word(w))) => words.contains(&w.as_str()),
        _ => false,
    }
}

/// Whether the token at `i` is the punctuation mark `mark`.
pub(super) fn is_punct(tokens: &[Located], i: usize, mark: char) -> bool {
    matches!(tokens.get(i), Some((_, Token::Punct(p))) if *p == mark)
}

/// Whether the token at `i` is `::`.
pub(super) fn is_path_sep(tokens: &[Located], i: usize) -> bool {
    matches!(tokens.get(i), Some((_, Token::PathSep)))
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[rstest]
    #[case::line_comment("a // unsafe\nb", "a\nb")]
    #[case::doc_comment("/// unsafe {\nfn f() {}", "\nfn f() {}")]
    #[case::inner_doc("//! unsafe\nx", "\nx")]
    #[case::nested_block("a /* x /* unsafe */ y */ b", "a b")]
    #[case::string("f(\"unsafe { // \\\" \")", "f( )")]
    #[case::raw_string("r#\"unsafe \"quoted\" \"# + x", "+ x")]
    #[case::byte_raw_string("br\"unsafe\" y", "y")]
    #[case::char_quote("let q = '\"'; unsafe {", "let q = ; unsafe {")]
    #[case::char_escape("'\\'' unsafe", "unsafe")]
    #[case::lifetime("fn f<'a>(x: &'a u8) {}", "fn f<'a>(x: &'a u8) {}")]
    #[case::word_ending_in_r("let ptr = bar\"x\"", "let ptr = bar")]
    fn strip_keeps_code_only(#[case] source: &str, #[case] code: &str) {
        let squeeze = |s: &str| {
            s.lines()
                .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(squeeze(&strip(source)), squeeze(code));
    }

    #[test]
    fn strip_keeps_lines() {
        let source = "a\n/* one\ntwo */ b\n\"x\ny\" c\n";
        assert_eq!(strip(source).lines().count(), source.lines().count());
        let located = tokens(&strip(source));
        let words: Vec<(usize, &str)> = located
            .iter()
            .filter_map(|(line, t)| match t {
                Token::Word(w) => Some((*line, w.as_str())),
                _ => None,
            })
            .collect();
        assert_eq!(words, [(1, "a"), (3, "b"), (5, "c")]);
    }

    #[test]
    fn tokens_split_paths() {
        let located = tokens("use crate::{Shared, x};");
        let kinds: Vec<&Token> = located.iter().map(|(_, t)| t).collect();
        assert_eq!(kinds.len(), 9);
        assert_eq!(kinds.get(2), Some(&&Token::PathSep));
        assert!(is_word(&located, 1, "crate") && is_punct(&located, 3, '{'));
    }
}
