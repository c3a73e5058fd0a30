//! Word vectors in GloVe text format: one word per line followed by its values, space-separated.

use super::Vocab;
use crate::error::{Error, Result};
use std::io::{BufRead, BufReader};
use std::path::Path;

/// Reads the vectors of the words in `vocab` from `path` into `table` (`vocab.len() × dim`,
/// row-major), leaving other rows as they are. Returns how many vocabulary words were found.
/// Errors name the file and line: a value that is not a finite number, a row of the wrong width,
/// or a vocabulary word listed twice.
pub fn read_into(path: &Path, vocab: &Vocab, dim: usize, table: &mut [f32]) -> Result<usize> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|e| Error::Io { path: name.clone(), msg: e.to_string() })?;
    let mut found = vec![false; vocab.len()];
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| Error::Io { path: name.clone(), msg: e.to_string() })?;
        let mut parts = line.split(' ').filter(|s| !s.is_empty());
        let Some(word) = parts.next() else { continue };
        let id = vocab.get(word);
        let known = id != super::UNK || word == "<unk>";
        let values: Vec<&str> = parts.collect();
        if values.len() != dim {
            return Err(Error::Parse {
                file: name,
                line: i + 1,
                msg: format!("`{word}` has {} values, expected {dim} (the --embed width)", values.len()),
            });
        }
        if !known {
            continue;
        }
        if found[id as usize] {
            return Err(Error::Parse { file: name, line: i + 1, msg: format!("`{word}` is listed a second time") });
        }
        let row = &mut table[id as usize * dim..(id as usize + 1) * dim];
        for (k, (dst, v)) in row.iter_mut().zip(&values).enumerate() {
            *dst = v.parse().ok().filter(|x: &f32| x.is_finite()).ok_or_else(|| Error::Parse {
                file: name.clone(),
                line: i + 1,
                msg: format!("value {} of `{word}` is not a finite number: `{v}`", k + 1),
            })?;
        }
        found[id as usize] = true;
    }
    Ok(found.iter().filter(|&&f| f).count())
}
