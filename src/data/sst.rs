//! The Stanford Sentiment Treebank in PTB form (`DIR/{train,dev,test}.txt`, one tree per line,
//! labels 0–4 on every vertex).

use super::{TreeExample, Vocab, PAD};
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

/// The three splits of a treebank directory, with a vocabulary grown on the training split.
pub struct Splits {
    /// Training trees.
    pub train: Vec<TreeExample>,
    /// Development trees.
    pub dev: Vec<TreeExample>,
    /// Test trees.
    pub test: Vec<TreeExample>,
    /// The vocabulary.
    pub vocab: Vocab,
}

/// Reads `DIR/train.txt`, `DIR/dev.txt` and `DIR/test.txt`.
pub fn read_splits(dir: &Path, lowercase: bool) -> Result<Splits> {
    let mut vocab = Vocab::new(lowercase);
    let train = read(&dir.join("train.txt"), &mut vocab, true)?;
    let dev = read(&dir.join("dev.txt"), &mut vocab, false)?;
    let test = read(&dir.join("test.txt"), &mut vocab, false)?;
    Ok(Splits { train, dev, test, vocab })
}
