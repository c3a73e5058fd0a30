//! The input layer around the vertex function (an embedding table feeding `pull`) and the
//! choice of vertices that carry a loss. The output layer is a `Head` in the IR (the `head`
//! module), differentiated like the vertex function; a `Model` (the `model` module) puts the
//! three together. By hand, training a Tree-LSTM for a few steps on three trees:
//!
//! ```
//! use arbor::head::{softmax_classifier, Head};
//! use arbor::layers::Embedding;
//! use arbor::ptb::PtbTree;
//! use arbor::rng::Rng;
//! use arbor::{nn, CpuBackend, Engine, InputGraph, Pass};
//!
//! let text = ["(4 (3 good) (4 (3 very) (4 good)))", "(0 (1 bad) (0 (2 very) (0 bad)))", "(2 (2 a) (2 book))"];
//! let trees: Vec<PtbTree> = text.iter().enumerate().map(|(i, t)| PtbTree::parse(t, "inline", i + 1)).collect::<Result<_, _>>()?;
//! let vocab = ["good", "bad", "very", "a", "book"];
//! let ids: Vec<u32> = trees.iter().flat_map(|t| t.words.iter())
//!     .map(|w| w.as_ref().map_or(0, |w| vocab.iter().position(|v| v == w).unwrap() as u32)).collect();
//! let graphs: Vec<&InputGraph> = trees.iter().map(|t| &t.graph).collect();
//! // Each tree's root (its last vertex) in the merged minibatch, and its one-hot label.
//! let mut roots = Vec::new();
//! let mut onehot = vec![0.0; 3 * 5];
//! for (i, t) in trees.iter().enumerate() {
//!     roots.push(roots.last().map_or(0, |r| r + 1) + t.graph.len() - 1);
//!     onehot[i * 5 + t.labels[t.graph.len() - 1].parse::<usize>().unwrap()] = 1.0;
//! }
//!
//! let (dim, hidden, lr) = (8, 8, 0.5);
//! let mut rng = Rng::new(7);
//! let mut embed = Embedding::new(vocab.len(), dim, 0.1, &mut rng);
//! let cell = nn::tree_lstm(dim, hidden)?;
//! let mut engine = Engine::new(CpuBackend::new(), cell.clone(), &cell.init_params(&mut rng))?;
//! let f = softmax_classifier(hidden, 5)?;
//! let mut head = Head::new(CpuBackend::new(), f.clone(), &f.init_params(&mut rng))?;
//! let sgd = |params: Vec<&mut [f32]>, grads: &[Vec<f32>]| {
//!     for (p, g) in params.into_iter().zip(grads) {
//!         p.iter_mut().zip(g).for_each(|(p, g)| *p -= lr * g);
//!     }
//! };
//! let mut losses = Vec::new();
//! for _ in 0..60 {
//!     let h = engine.run(Pass::train(&graphs, &[embed.pull(&ids)]).rows(&roots))?; // the roots' rows
//!     let loss: f32 = head.forward(&[&h[0], &onehot])?[0].iter().sum();
//!     let out = head.backward(1.0 / 3.0)?; // the mean over the three roots
//!     let grads = engine.backward(&[&out.pulls[0]])?; // at the roots, as the pass read them
//!     engine.update_params(|params| sgd(params, &grads.params))?;
//!     head.engine().update_params(|params| sgd(params, &out.params))?;
//!     if let Some(g) = &grads.tables[0] {
//!         embed.apply(g, -lr); // the looked-up rows' gradient, per id
//!     }
//!     losses.push(loss / 3.0);
//! }
//! assert!(losses[59] < 0.5 * losses[0], "loss went from {} to {}", losses[0], losses[59]);
//! # Ok::<(), arbor::Error>(())
//! ```

use arbor_core::dropout::{self, DropoutKey};
use arbor_core::error::{Error, Result};
use arbor_core::graph::InputGraph;
use arbor_core::rng::Rng;
use std::borrow::Cow;

/// An embedding table: one `dim`-wide row per vocabulary entry.
#[derive(Clone, Debug, PartialEq)]
pub struct Embedding {
    dim: usize,
    vocab: usize,
    table: Vec<f32>,
    padding: Option<u32>,
    word_dropout: Option<WordDropout>,
}

/// Word dropout (Iyyer et al. 2015; Kiperwasser and Goldberg 2016): in training, a vertex's word
/// is replaced by the unknown word with a probability of the word's own, so the unknown word's
/// vector learns to stand for the words evaluation brings that training never saw, and rare
/// words are not memorised. Each vertex's draw is hashed from its place, as
/// [`Var::dropout`](crate::Var::dropout)'s masks are.
#[derive(Clone, Debug, PartialEq)]
pub struct WordDropout {
    unk: u32,
    rates: Vec<f32>,
}

/// The dropout site of word dropout's draws (apart from any vertex function's sites).
const WORD_SITE: usize = usize::MAX;

impl WordDropout {
    /// Replaces a word seen `counts[id]` times in training by `unk` with probability
    /// `alpha / (alpha + counts[id])`; a word never seen (the padding, `unk` itself) is kept.
    pub fn by_frequency(unk: u32, counts: &[usize], alpha: f32) -> WordDropout {
        let rate = |&c: &usize| if c == 0 { 0.0 } else { alpha / (alpha + c as f32) };
        WordDropout { unk, rates: counts.iter().map(rate).collect() }
    }

    /// The probability that `id` is replaced (0 for ids beyond the counts).
    pub fn rate(&self, id: u32) -> f32 {
        self.rates.get(id as usize).copied().unwrap_or(0.0)
    }

    /// `ids` of a training pass at `key` (merged over `graphs`, vertex by vertex), with each word
    /// drawn to be dropped replaced by the unknown word; `keep` (the padding: a vertex without a
    /// word has none to drop) is never replaced.
    pub fn apply(&self, key: DropoutKey, graphs: &[&InputGraph], ids: &[u32], keep: Option<u32>) -> Vec<u32> {
        let mut out = ids.to_vec();
        let places = graphs.iter().enumerate().flat_map(|(g, graph)| (0..graph.len()).map(move |v| (g, v)));
        for (id, (g, v)) in out.iter_mut().zip(places) {
            let p = if Some(*id) == keep { 0.0 } else { self.rate(*id) };
            if p > 0.0 && dropout::vertex_dropped(key, WORD_SITE, key.first + g, v, p) {
                *id = self.unk;
            }
        }
        out
    }
}

use crate::engine::Pull;
pub use crate::engine::SparseGrad;

impl Embedding {
    /// A `vocab × dim` table drawn uniformly from `[-scale, scale]`.
    pub fn new(vocab: usize, dim: usize, scale: f32, rng: &mut Rng) -> Embedding {
        let table = (0..vocab * dim).map(|_| rng.range(-scale, scale)).collect();
        Embedding { dim, vocab, table, padding: None, word_dropout: None }
    }

    /// Drops words in training passes as `w` says (never the padding row).
    pub fn with_word_dropout(mut self, w: WordDropout) -> Embedding {
        self.word_dropout = Some(w);
        self
    }

    /// The word ids a training pass at `key` over `graphs` pulls: `ids`, with the words word
    /// dropout (if any) replaces.
    pub fn training_ids<'a>(&self, key: DropoutKey, graphs: &[&InputGraph], ids: &'a [u32]) -> Cow<'a, [u32]> {
        match &self.word_dropout {
            Some(w) => Cow::Owned(w.apply(key, graphs, ids, self.padding)),
            None => Cow::Borrowed(ids),
        }
    }

    /// Makes row `id` an all-zero row that never gets a gradient (for vertices without a word).
    pub fn with_padding(mut self, id: u32) -> Embedding {
        let d = self.dim;
        if let Some(row) = self.table.get_mut(id as usize * d..(id as usize + 1) * d) {
            row.fill(0.0);
            self.padding = Some(id);
        }
        self
    }

    /// The table, row-major, to update in place.
    pub fn table_mut(&mut self) -> &mut [f32] {
        &mut self.table
    }

    /// A table from given rows (e.g. pre-trained vectors); errors if `table` is not whole rows.
    pub fn from_table(table: Vec<f32>, dim: usize) -> Result<Embedding> {
        if dim == 0 || !table.len().is_multiple_of(dim) {
            return Err(Error::input(
                "embedding table",
                format!("a whole number of {dim}-wide rows"),
                format!("{} values", table.len()),
            ));
        }
        Ok(Embedding { dim, vocab: table.len() / dim, table, padding: None, word_dropout: None })
    }

    /// The padding row, if any.
    pub fn padding(&self) -> Option<u32> {
        self.padding
    }

    /// Rows in the table.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Moves the values out, keeping the settings (vocabulary, width, padding, word dropout):
    /// a model's bottom engine holds them (`Model::word_vectors` reads them), and
    /// [`Embedding::table`] is empty after.
    pub fn take_table(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.table)
    }

    /// The same settings with the values `table` (`vocab × dim` of them, else an error).
    pub fn with_table(mut self, table: Vec<f32>) -> Result<Embedding> {
        if table.len() != self.vocab * self.dim {
            return Err(Error::input(
                "embedding table",
                format!("{} values ({} rows of {})", self.vocab * self.dim, self.vocab, self.dim),
                format!("{} values", table.len()),
            ));
        }
        self.table = table;
        Ok(self)
    }

    /// Width of a row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The table, row-major.
    pub fn table(&self) -> &[f32] {
        &self.table
    }

    /// The engine input through which vertex `i` of a minibatch pulls row `ids[i]` (the padding
    /// row pulls zeros and gets no gradient).
    pub fn pull<'a>(&'a self, ids: &'a [u32]) -> Pull<'a> {
        Pull::Lookup { table: &self.table, ids, padding: self.padding }
    }

    /// [`Embedding::pull`] from the values an engine holds ([`Engine::set_table`](crate::Engine::set_table)).
    pub fn held_pull<'a>(&self, ids: &'a [u32]) -> Pull<'a> {
        Pull::Held { ids, padding: self.padding }
    }

    fn check(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().position(|&i| i as usize >= self.vocab()) {
            Some(p) => Err(Error::input(
                format!("embedding lookup, position {p}"),
                format!("an id below {}", self.vocab()),
                ids[p].to_string(),
            )),
            None => Ok(()),
        }
    }

    /// The rows of `ids`, one after another (the `pull` input of every vertex).
    pub fn lookup(&self, ids: &[u32]) -> Result<Vec<f32>> {
        self.check(ids)?;
        let d = self.dim;
        let mut rows = Vec::with_capacity(ids.len() * d);
        for &i in ids {
            rows.extend_from_slice(&self.table[i as usize * d..(i as usize + 1) * d]);
        }
        Ok(rows)
    }

    /// The table's gradient from the gradient of looked-up rows: rows summed per id.
    pub fn sparse_grad(&self, ids: &[u32], grad_rows: &[f32]) -> Result<SparseGrad> {
        self.check(ids)?;
        let d = self.dim;
        if grad_rows.len() != ids.len() * d {
            return Err(Error::input(
                "embedding gradient",
                format!("{} values ({} ids × {d})", ids.len() * d, ids.len()),
                grad_rows.len().to_string(),
            ));
        }
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_by_key(|&p| ids[p]);
        let mut g = SparseGrad::default();
        for p in order {
            if Some(ids[p]) == self.padding {
                continue;
            }
            if g.rows.last() != Some(&ids[p]) {
                g.rows.push(ids[p]);
                g.values.extend(std::iter::repeat_n(0.0, d));
            }
            let at = g.values.len() - d;
            for (a, x) in g.values[at..].iter_mut().zip(&grad_rows[p * d..(p + 1) * d]) {
                *a += x;
            }
        }
        Ok(g)
    }

    /// `table[row] += scale · grad[row]` for the rows the gradient touches.
    pub fn apply(&mut self, g: &SparseGrad, scale: f32) {
        let d = self.dim;
        for (k, &r) in g.rows.iter().enumerate() {
            for (t, x) in self.table[r as usize * d..(r as usize + 1) * d].iter_mut().zip(&g.values[k * d..(k + 1) * d])
            {
                *t += scale * x;
            }
        }
    }
}

/// Which vertices carry a loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossOn {
    /// Only each graph's roots (e.g. sentence sentiment).
    Root,
    /// Every vertex (e.g. every phrase of a sentiment treebank).
    All,
}

impl LossOn {
    /// The target of each vertex of the minibatch (graph by graph), given every vertex's label.
    pub fn select(self, graphs: &[&InputGraph], labels: &[u32]) -> Result<Vec<Option<u32>>> {
        let total: usize = graphs.iter().map(|g| g.len()).sum();
        if labels.len() != total {
            return Err(Error::input("vertex labels", format!("one per vertex ({total})"), labels.len().to_string()));
        }
        Ok(match self {
            LossOn::All => labels.iter().map(|&l| Some(l)).collect(),
            LossOn::Root => {
                let mut out = vec![None; total];
                let mut base = 0;
                for g in graphs {
                    for r in g.roots() {
                        out[base + r] = Some(labels[base + r]);
                    }
                    base += g.len();
                }
                out
            }
        })
    }
}
