//! Data sets: vocabularies, tree examples, readers for SST, SICK, TU graph sets and GloVe, and the
//! built-in synthetic treebank.

pub mod cycles;
pub mod glove;
pub mod labelled;
pub mod lines;
pub mod sick;
pub mod sst;
pub mod synthetic;
pub mod tu;

use crate::graph::InputGraph;
use std::collections::HashMap;
use std::path::PathBuf;

/// The shared data folder: `ARBOR_DATA` if set, else `../shared/data`.
pub fn data_dir() -> PathBuf {
    std::env::var_os("ARBOR_DATA").map_or_else(|| PathBuf::from("../shared/data"), PathBuf::from)
}

/// The padding id: internal vertices pull its all-zero row.
pub const PAD: u32 = 0;
/// The unknown-word id.
pub const UNK: u32 = 1;

/// Words to ids, with `<pad>` = 0 and `<unk>` = 1.
#[derive(Clone, Debug, PartialEq)]
pub struct Vocab {
    words: Vec<String>,
    ids: HashMap<String, u32>,
    lowercase: bool,
}

impl Vocab {
    /// An empty vocabulary (only `<pad>` and `<unk>`); with `lowercase`, words are folded.
    pub fn new(lowercase: bool) -> Vocab {
        let mut v = Vocab { words: Vec::new(), ids: HashMap::new(), lowercase };
        v.add("<pad>");
        v.add("<unk>");
        v
    }

    fn key(&self, word: &str) -> String {
        if self.lowercase {
            word.to_lowercase()
        } else {
            word.to_string()
        }
    }

    /// A vocabulary from its words in id order (as [`Vocab::words`] lists them).
    pub fn from_words(words: &[String], lowercase: bool) -> Vocab {
        let mut v = Vocab::new(lowercase);
        for w in words.iter().skip(2) {
            v.add(w);
        }
        v
    }

    /// Every word, in id order.
    pub fn words(&self) -> &[String] {
        &self.words
    }

    /// The id of `word`, adding it if new.
    pub fn add(&mut self, word: &str) -> u32 {
        let key = self.key(word);
        if let Some(&id) = self.ids.get(&key) {
            return id;
        }
        let id = self.words.len() as u32;
        self.words.push(key.clone());
        self.ids.insert(key, id);
        id
    }

    /// The id of `word`, or `UNK`.
    pub fn get(&self, word: &str) -> u32 {
        self.ids.get(&self.key(word)).copied().unwrap_or(UNK)
    }

    /// The word of `id`.
    pub fn word(&self, id: u32) -> Option<&str> {
        self.words.get(id as usize).map(String::as_str)
    }

    /// Number of entries, `<pad>` and `<unk>` included.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// Whether only `<pad>` and `<unk>` are in it.
    pub fn is_empty(&self) -> bool {
        self.words.len() <= 2
    }

    /// Whether words are lowercased.
    pub fn lowercase(&self) -> bool {
        self.lowercase
    }
}

/// The three splits of a data set read from its folder, with a vocabulary grown on the training
/// split: what [`sst::read_splits`] (trees) and [`sick::read_splits`] (sentence pairs) return.
pub struct Dataset<E> {
    /// Trained on.
    pub train: Vec<E>,
    /// Chooses the best epoch.
    pub dev: Vec<E>,
    /// Reported at the best epoch.
    pub test: Vec<E>,
    /// The vocabulary.
    pub vocab: Vocab,
}

impl<E> Dataset<E> {
    /// The splits as the training loop takes them.
    pub fn splits(&self) -> crate::trainer::Splits<'_, E> {
        crate::trainer::Splits { train: &self.train, dev: &self.dev, test: &self.test }
    }
}

/// One labelled tree: its graph, each vertex's word id (`PAD` for internal vertices) and label.
#[derive(Clone, Debug, PartialEq)]
pub struct TreeExample {
    /// The tree (children before parents; the root last).
    pub graph: InputGraph,
    /// Word id per vertex.
    pub words: Vec<u32>,
    /// Class label per vertex.
    pub labels: Vec<u32>,
}

impl TreeExample {
    /// The root vertex.
    pub fn root(&self) -> usize {
        self.graph.len() - 1
    }

    /// The tree as a [`Model`](crate::model::Model) reads it: its graph, its words, its root.
    pub fn tree(&self) -> crate::model::Tree<'_> {
        crate::model::Tree::new(&self.graph, &self.words, self.root())
    }

    /// The sentence as a chain: the leaves' words in order, each labelled with the root's label
    /// (the chain's root is its last word).
    pub fn to_chain(&self) -> TreeExample {
        let words: Vec<u32> =
            (0..self.graph.len()).filter(|&v| self.graph.children(v).is_empty()).map(|v| self.words[v]).collect();
        let label = self.labels[self.root()];
        TreeExample { graph: InputGraph::chain(words.len()), labels: vec![label; words.len()], words }
    }
}
