//! Penn-Treebank bracketed trees, as the Stanford Sentiment Treebank writes them:
//! `(3 (2 It) (4 (2 's) (3 fine)))`. Tokens are split on ASCII spaces and parentheses only, so
//! words may hold other characters (SST has words with U+00A0 inside).

use crate::error::{Error, Result};
use crate::graph::InputGraph;

/// A parsed tree: its graph (children before parents, the root last), each vertex's label and
/// each leaf's word.
#[derive(Clone, Debug, PartialEq)]
pub struct PtbTree {
    /// The tree as an input graph.
    pub graph: InputGraph,
    /// Each vertex's label (e.g. a sentiment class `0`–`4`, or `NP`).
    pub labels: Vec<String>,
    /// Each vertex's word (`None` for internal vertices).
    pub words: Vec<Option<String>>,
}

impl PtbTree {
    /// The root (the last vertex).
    pub fn root(&self) -> usize {
        self.labels.len() - 1
    }

    /// Parses one tree from `text`; errors name `file`, `line` and the column (1-based, in
    /// characters).
    pub fn parse(text: &str, file: &str, line: usize) -> Result<PtbTree> {
        parse(text, true).map_err(|(col, msg)| Error::Parse {
            file: file.into(),
            line,
            msg: format!("column {col}: {msg}"),
        })
    }

    /// Parses one tree without labels, as a parser or a person brackets a new sentence:
    /// `((The film) (is (very good)))`. Every token is a leaf; a bracket around one token or one
    /// bracket is that token or bracket; labels are empty. Errors as [`PtbTree::parse`].
    pub fn parse_unlabelled(text: &str, file: &str, line: usize) -> Result<PtbTree> {
        parse(text, false).map_err(|(col, msg)| Error::Parse {
            file: file.into(),
            line,
            msg: format!("column {col}: {msg}"),
        })
    }
}

/// An open bracket while parsing.
struct Open {
    label: Option<String>,
    word: Option<String>,
    children: Vec<Option<usize>>,
    column: usize,
}

/// `token` for an error message: its first 40 characters, and how long it was if longer.
pub fn clip(token: &str) -> String {
    match token.char_indices().nth(40) {
        Some((cut, _)) => format!("{}… ({} characters)", &token[..cut], token.chars().count()),
        None => token.to_string(),
    }
}

/// Parses `text`: with `labelled`, a bracket is `(label word)` or `(label subtrees…)`; without,
/// `(children…)` where a child is a token (a leaf) or a bracket.
fn parse(text: &str, labelled: bool) -> std::result::Result<PtbTree, (usize, String)> {
    let mut stack: Vec<Open> = Vec::new();
    let mut children: Vec<Vec<Option<usize>>> = Vec::new();
    let mut labels = Vec::new();
    let mut words = Vec::new();
    let mut root_closed = false;
    let mut chars = text.char_indices().peekable();
    let mut column = 0;
    while let Some((start, ch)) = chars.next() {
        column += 1;
        if root_closed && !ch.is_ascii_whitespace() {
            return Err((column, format!("text after the end of the tree: `{ch}`")));
        }
        match ch {
            // ASCII whitespace separates tokens; other spaces belong to a word (the SST has
            // U+00A0 inside words such as `1 1/2`).
            c if c.is_ascii_whitespace() => {}
            '(' => stack.push(Open { label: None, word: None, children: Vec::new(), column }),
            ')' if !labelled => {
                let open = stack.pop().ok_or((column, "`)` closes nothing".to_string()))?;
                let v = match open.children[..] {
                    [] => return Err((open.column, "an empty bracket".into())),
                    // A bracket around one child is that child.
                    [Some(only)] => only,
                    _ => {
                        labels.push(String::new());
                        words.push(None);
                        children.push(open.children);
                        labels.len() - 1
                    }
                };
                match stack.last_mut() {
                    Some(parent) => parent.children.push(Some(v)),
                    None => root_closed = true,
                }
            }
            ')' => {
                let open = stack.pop().ok_or((column, "`)` closes nothing".to_string()))?;
                let label = open.label.ok_or((open.column, "a bracket has no label".to_string()))?;
                match (&open.word, open.children.is_empty()) {
                    (Some(_), false) => {
                        return Err((open.column, format!("`{}` has both a word and subtrees", clip(&label))))
                    }
                    (None, true) => {
                        return Err((open.column, format!("`{}` has neither a word nor subtrees", clip(&label))))
                    }
                    _ => {}
                }
                let v = labels.len();
                labels.push(label);
                words.push(open.word);
                children.push(open.children);
                match stack.last_mut() {
                    Some(parent) => parent.children.push(Some(v)),
                    None => root_closed = true,
                }
            }
            _ => {
                let mut end = start + ch.len_utf8();
                while let Some(&(i, c)) = chars.peek() {
                    if c.is_ascii_whitespace() || matches!(c, '(' | ')') {
                        break;
                    }
                    end = i + c.len_utf8();
                    column += 1;
                    chars.next();
                }
                let token = &text[start..end];
                let open = stack.last_mut().ok_or((column, format!("`{}` is outside any bracket", clip(token))))?;
                if !labelled {
                    open.children.push(Some(labels.len()));
                    labels.push(String::new());
                    words.push(Some(token.to_string()));
                    children.push(Vec::new());
                } else if open.label.is_none() {
                    open.label = Some(token.to_string());
                } else if open.word.is_none() && open.children.is_empty() {
                    open.word = Some(token.to_string());
                } else {
                    return Err((column, format!("unexpected `{}`: a leaf has one word", clip(token))));
                }
            }
        }
    }
    if let Some(open) = stack.last() {
        return Err((open.column, "this `(` is never closed".into()));
    }
    if labels.is_empty() {
        return Err((1, "no tree".into()));
    }
    let graph = InputGraph::from_children(children).map_err(|e| (1, e.to_string()))?;
    Ok(PtbTree { graph, labels, words })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_an_sst_tree() {
        let t = PtbTree::parse("(3 (2 It) (4 (2 's) (3 fine\u{a0}wine)))", "t", 1).unwrap();
        assert_eq!(t.labels, ["2", "2", "3", "4", "3"]);
        assert_eq!(t.words[4], None);
        assert_eq!(t.words[2].as_deref(), Some("fine\u{a0}wine"));
        assert_eq!(t.graph.children(4), &[0, 3]);
        assert_eq!(t.graph.children(3), &[1, 2]);
        assert_eq!(t.root(), 4);
        assert_eq!(t.graph.roots(), vec![4]);
    }

    #[test]
    fn parses_an_unlabelled_tree() {
        let t = PtbTree::parse_unlabelled("((The film) (is ((very)) good))", "t", 1).unwrap();
        let words: Vec<_> = t.words.iter().map(|w| w.as_deref().unwrap_or("·")).collect();
        assert_eq!(words, ["The", "film", "·", "is", "very", "good", "·", "·"]);
        assert!(t.labels.iter().all(String::is_empty));
        assert_eq!(t.graph.children(7), &[2, 6]);
        assert_eq!(t.graph.children(6), &[3, 4, 5]);
        assert_eq!(PtbTree::parse_unlabelled("(word)", "t", 1).unwrap().graph.len(), 1);
        for (text, want) in [("(a ())", "an empty bracket"), ("(a b", "never closed"), ("a b", "outside any bracket")] {
            let e = PtbTree::parse_unlabelled(text, "t", 2).unwrap_err().to_string();
            assert!(e.starts_with("t:2: ") && e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn errors_name_line_and_column() {
        let cases = [
            ("(3 (2 It)", "column 1: this `(` is never closed"),
            ("(3 (2 It)))", "column 11: text after the end of the tree"),
            (")", "column 1: `)` closes nothing"),
            ("(3 (2 It) x)", "unexpected `x`"),
            ("(3 word (2 It))", "has both a word and subtrees"),
            ("(3)", "neither a word nor subtrees"),
            ("()", "no label"),
            ("(2 a) (2 b)", "text after the end of the tree"),
            ("", "no tree"),
            ("word", "outside any bracket"),
        ];
        for (text, want) in cases {
            let e = PtbTree::parse(text, "train.txt", 7).unwrap_err().to_string();
            assert!(e.starts_with("train.txt:7: "), "{e}");
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn deep_trees_parse_without_recursion() {
        let depth = 100_000;
        let text = format!("{}(1 w){}", "(1 ".repeat(depth), ")".repeat(depth));
        let t = PtbTree::parse(&text, "deep", 1).unwrap();
        assert_eq!(t.labels.len(), depth + 1);
    }
}
