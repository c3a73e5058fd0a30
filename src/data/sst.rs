//! The Stanford Sentiment Treebank in PTB form (`DIR/{train,dev,test}.txt`, one tree per line,
//! labels 0–4 on every vertex).

use super::{Dataset, TreeExample, Vocab, PAD};
use crate::error::{Error, Result};
use crate::ptb::PtbTree;
use std::path::Path;

/// Number of sentiment classes.
pub const CLASSES: usize = 5;

/// Reads one split, streaming line by line. With `grow`, new words enter `vocab`; otherwise they
/// map to `<unk>`. Errors name the file and line.
pub fn read(path: &Path, vocab: &mut Vocab, grow: bool) -> Result<Vec<TreeExample>> {
    let name = path.display().to_string();
    let mut out = Vec::new();
    for line in super::lines::lines(path)? {
        let (number, line) = line?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(parse_line(&line, &name, number, vocab, grow)?);
    }
    Ok(out)
}

/// Parses one SST line into an example.
pub fn parse_line(line: &str, file: &str, lineno: usize, vocab: &mut Vocab, grow: bool) -> Result<TreeExample> {
    let tree = PtbTree::parse(line, file, lineno)?;
    let mut labels = Vec::with_capacity(tree.labels.len());
    for l in &tree.labels {
        match l.parse::<u32>() {
            Ok(c) if (c as usize) < CLASSES => labels.push(c),
            _ => {
                return Err(Error::Parse {
                    file: file.into(),
                    line: lineno,
                    msg: format!("label `{}` is not a sentiment class 0-{}", crate::ptb::clip(l), CLASSES - 1),
                })
            }
        }
    }
    let words = tree
        .words
        .iter()
        .map(|w| match w {
            Some(w) if grow => vocab.add(w),
            Some(w) => vocab.get(w),
            None => PAD,
        })
        .collect();
    Ok(TreeExample { graph: tree.graph, words, labels })
}

/// A sentence to classify, as a person gives it: an SST tree (its root label returned as the
/// gold class), an unlabelled bracketing (`((The film) (is good))`), or plain tokens separated
/// by spaces, read as a right-branching binary tree (`The (film (is good))`). Words outside
/// `vocab` read as `<unk>`; every vertex is labelled 0. Errors name `file` and `line`.
pub fn parse_input(text: &str, file: &str, line: usize, vocab: &Vocab) -> Result<(TreeExample, Option<u32>)> {
    let text = text.trim();
    let (tree, gold) = if text.starts_with('(') {
        match PtbTree::parse(text, file, line) {
            Ok(tree) => {
                let gold = tree.labels.last().and_then(|l| l.parse::<u32>().ok()).filter(|&c| (c as usize) < CLASSES);
                (tree, gold)
            }
            Err(_) => (PtbTree::parse_unlabelled(text, file, line)?, None),
        }
    } else {
        (right_branching(text, file, line)?, None)
    };
    let words = tree.words.iter().map(|w| w.as_deref().map_or(PAD, |w| vocab.get(w))).collect();
    let labels = vec![0; tree.graph.len()];
    Ok((TreeExample { graph: tree.graph, words, labels }, gold))
}

/// The tokens of `text` (split on ASCII whitespace) as the leaves of a right-branching binary
/// tree.
fn right_branching(text: &str, file: &str, line: usize) -> Result<PtbTree> {
    let tokens: Vec<&str> = text.split_ascii_whitespace().collect();
    if tokens.is_empty() {
        return Err(Error::Parse { file: file.into(), line, msg: "an empty sentence".into() });
    }
    let n = tokens.len();
    let mut children: Vec<Vec<Option<usize>>> = vec![Vec::new(); n];
    let mut words: Vec<Option<String>> = tokens.iter().map(|t| Some(t.to_string())).collect();
    let mut right = n - 1;
    for left in (0..n - 1).rev() {
        children.push(vec![Some(left), Some(right)]);
        words.push(None);
        right = children.len() - 1;
    }
    let graph = crate::graph::InputGraph::from_children(children)?;
    Ok(PtbTree { labels: vec![String::new(); graph.len()], graph, words })
}

/// Reads `DIR/train.txt`, `DIR/dev.txt` and `DIR/test.txt`.
pub fn read_splits(dir: &Path, lowercase: bool) -> Result<Dataset<TreeExample>> {
    let mut vocab = Vocab::new(lowercase);
    let train = read(&dir.join("train.txt"), &mut vocab, true)?;
    let dev = read(&dir.join("dev.txt"), &mut vocab, false)?;
    let test = read(&dir.join("test.txt"), &mut vocab, false)?;
    Ok(Dataset { train, dev, test, vocab })
}
