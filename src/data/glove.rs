//! Word vectors in GloVe text format: one word per line followed by its values, space-separated.

use super::Vocab;
use crate::error::{Error, Result};
use std::path::Path;

/// What [`read_into`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    /// Vocabulary words that got a vector.
    pub words: usize,
    /// Lines that a folding vocabulary (`--lowercase`) read as a word already given (`The`
    /// after `the`): the word keeps the line spelled as the vocabulary spells it, else the first.
    pub merged: usize,
}

/// Reads the vectors of the words in `vocab` from `path` into `table` (`vocab.len() × dim`,
/// row-major), leaving other rows as they are. Errors name the file and line: a value that is
/// not a finite number, a row of the wrong width, or a vocabulary word listed twice as the same
/// string.
pub fn read_into(path: &Path, vocab: &Vocab, dim: usize, table: &mut [f32]) -> Result<Found> {
    let name = path.display().to_string();
    // The spelling each row was read from.
    let mut from: Vec<Option<String>> = vec![None; vocab.len()];
    let mut merged = 0;
    for line in super::lines::lines(path)? {
        let (number, line) = line?;
        let mut parts = line.split(' ').filter(|s| !s.is_empty());
        let Some(word) = parts.next() else { continue };
        let id = vocab.get(word);
        let known = id != super::UNK || word == "<unk>";
        let values: Vec<&str> = parts.collect();
        if values.len() != dim {
            return Err(Error::Parse {
                file: name,
                line: number,
                msg: format!("`{word}` has {} values, expected {dim} (the --embed width)", values.len()),
            });
        }
        if !known {
            continue;
        }
        let exact = |w: &str| vocab.word(id) == Some(w);
        if let Some(earlier) = &from[id as usize] {
            if earlier == word {
                return Err(Error::Parse {
                    file: name,
                    line: number,
                    msg: format!("`{word}` is listed a second time"),
                });
            }
            merged += 1;
            if exact(earlier) || !exact(word) {
                continue;
            }
        }
        let row = &mut table[id as usize * dim..(id as usize + 1) * dim];
        for (k, (dst, v)) in row.iter_mut().zip(&values).enumerate() {
            *dst = v.parse().ok().filter(|x: &f32| x.is_finite()).ok_or_else(|| Error::Parse {
                file: name.clone(),
                line: number,
                msg: format!("value {} of `{word}` is not a finite number: `{v}`", k + 1),
            })?;
        }
        from[id as usize] = Some(word.to_string());
    }
    Ok(Found { words: from.iter().filter(|f| f.is_some()).count(), merged })
}
