//! Whole models of examples with one or more graphs each: word vectors, a vertex function run
//! over every graph of the minibatch at once, and a [`Head`] over rows read out of it, trained
//! with no gradient written by hand. A sentence pair (SICK) is two trees and a target row.
//!
//! The head pulls, in order, one row of the cell's first pushed output for each graph of an
//! example (the root's row, or a pooling over the graph's vertices: see [`Readout`]), then the
//! example's target row; it pushes its `loss` and whatever else a caller reads (a prediction).

use crate::checkpoint::{Checkpoint, Named};
use crate::dist::data_parallel::merge;
use crate::engine::{Engine, Pull, SparseGrad};
use crate::head::Head;
use crate::layers::Embedding;
use crate::optim::{clip_grad_norm, Optimizer};
use crate::readout::{Pooled, Readout};
use crate::{Backend, InputGraph, VertexFn};
use arbor_core::error::{Error, Result};
use arbor_core::rng::Rng;

/// What feeds an input of the vertex function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feed {
    /// Each vertex's own word vector.
    Words,
    /// The word vector of the vertex's parent, the padding row at a root: for a gate computed at
    /// the child on the parent's behalf (see
    /// [`child_sum_tree_lstm_nary`](crate::nn::child_sum_tree_lstm_nary)).
    ParentWords,
}

/// One graph of an example: its structure, a word per vertex, and the vertex the head reads.
#[derive(Clone, Copy, Debug)]
pub struct Tree<'a> {
    /// The structure.
    pub graph: &'a InputGraph,
    /// A word id per vertex.
    pub words: &'a [u32],
    /// The vertex read out (a root).
    pub root: usize,
}

/// One example: its graphs (as many as the head reads) and its target row.
#[derive(Clone, Debug)]
pub struct Example<'a> {
    /// The graphs, in the order of the head's inputs.
    pub trees: Vec<Tree<'a>>,
    /// The target the head's last input pulls.
    pub target: Vec<f32>,
}

/// Word vectors, a vertex function on a backend, and a head.
pub struct Model<B: Backend> {
    /// The word vectors.
    pub embedding: Embedding,
    /// The vertex function's engine.
    pub cells: Engine<B>,
    /// What feeds each of the vertex function's inputs.
    pub feeds: Vec<Feed>,
    /// The head.
    pub head: Head<B>,
    /// How each graph's row is read out for the head ([`Readout::Root`] unless set).
    pub readout: Readout,
}

/// A minibatch laid out for the cells' engine.
struct Layout<'a> {
    graphs: Vec<&'a InputGraph>,
    /// Per vertex (merged order): its word, and its parent's word (padding at a root).
    words: Vec<u32>,
    parent_words: Vec<u32>,
    /// Per example, per graph: the merged index of the vertex read out.
    roots: Vec<usize>,
}

impl<B: Backend> Model<B> {
    /// A model; checks that the feeds match the vertex function's inputs (each as wide as a word
    /// vector), that [`Feed::ParentWords`] has a padding row, and that the head reads rows as
    /// wide as the cell pushes, then a target.
    pub fn new(embedding: Embedding, cells: Engine<B>, feeds: Vec<Feed>, head: Head<B>) -> Result<Model<B>> {
        let f = cells.function();
        let what = |w: &str| format!("model over `{}` with head `{}`: {w}", f.name(), head.function().name());
        if feeds.len() != f.inputs().len() || f.inputs().iter().any(|p| p.shape.numel() != embedding.dim()) {
            return Err(Error::input(
                what("feeds"),
                format!("one per input, each input {} wide (the word vectors)", embedding.dim()),
                format!(
                    "{} feeds for inputs {:?}",
                    feeds.len(),
                    f.inputs().iter().map(|p| p.shape.numel()).collect::<Vec<_>>()
                ),
            ));
        }
        if feeds.contains(&Feed::ParentWords) && embedding.padding().is_none() {
            return Err(Error::input(what("parent words"), "word vectors with a padding row (for roots)", "none"));
        }
        let width = f.outputs().first().map_or(0, |o| o.shape.numel());
        let reads = head.function().inputs();
        let readouts = reads.len().saturating_sub(1);
        if readouts == 0 || reads[..readouts].iter().any(|p| p.shape.numel() != width) {
            return Err(Error::input(
                what("head inputs"),
                format!("one or more rows {width} wide (the cell's first output), then the target"),
                format!("{:?}", reads.iter().map(|p| p.shape.numel()).collect::<Vec<_>>()),
            ));
        }
        Ok(Model { embedding, cells, feeds, head, readout: Readout::Root })
    }

    /// A model of `cell` and `head` with fresh parameters drawn from `rng`, each on a replica of
    /// `backend` (see [`Model::new`] for what must fit).
    pub fn init(
        backend: &B,
        embedding: Embedding,
        cell: VertexFn,
        feeds: Vec<Feed>,
        head: VertexFn,
        rng: &mut Rng,
    ) -> Result<Model<B>> {
        let (cp, hp) = (cell.init_params(rng), head.init_params(rng));
        let cells = Engine::new(backend.replica()?, cell, &cp)?;
        Model::new(embedding, cells, feeds, Head::new(backend.replica()?, head, &hp)?)
    }

    /// The model reading each graph out with `readout` (a pooling over its vertices, or its
    /// root's row).
    pub fn with_readout(mut self, readout: Readout) -> Model<B> {
        self.readout = readout;
        self
    }

    /// Graphs per example (the head's readouts).
    pub fn graphs_per_example(&self) -> usize {
        self.head.function().inputs().len() - 1
    }

    /// The head's pushed outputs over `batch`, one block per example (inference).
    pub fn infer(&mut self, batch: &[Example<'_>]) -> Result<Vec<Vec<f32>>> {
        let (_, inputs, _) = self.read_out(batch, false)?;
        self.head.infer(&inputs.iter().map(Vec::as_slice).collect::<Vec<_>>())
    }

    /// Runs the cells over `batch` (keeping what a backward pass needs when `train`); returns
    /// the layout, the head's inputs (per graph slot, the read-out rows of every example, then
    /// the targets) and, for a pooling readout, the pooling.
    fn read_out<'a>(
        &mut self,
        batch: &[Example<'a>],
        train: bool,
    ) -> Result<(Layout<'a>, Vec<Vec<f32>>, Option<Pooled>)> {
        let layout = self.layout(batch)?;
        let pulls = pulls(&self.embedding, &self.feeds, &layout);
        let (h, pooled) = if self.readout == Readout::Root {
            let h = if train {
                self.cells.forward_rows(&layout.graphs, &pulls, &layout.roots)?
            } else {
                self.cells.infer_rows(&layout.graphs, &pulls, &layout.roots)?
            };
            (h.into_iter().next().unwrap_or_default(), None)
        } else {
            let all = if train {
                self.cells.forward(&layout.graphs, &pulls)?
            } else {
                self.cells.infer(&layout.graphs, &pulls)?
            };
            let width = self.cells.function().outputs().first().map_or(0, |o| o.shape.numel());
            let mut start = 0;
            let groups = layout
                .graphs
                .iter()
                .map(|g| {
                    start += g.len();
                    start - g.len()..start
                })
                .collect();
            let mut p = Pooled::forward(all.first().map_or(&[][..], Vec::as_slice), width, groups, self.readout);
            (std::mem::take(&mut p.rows), Some(p))
        };
        let k = self.graphs_per_example();
        let width = h.len() / layout.roots.len().max(1);
        let mut inputs: Vec<Vec<f32>> =
            (0..k).map(|slot| h.chunks(width).skip(slot).step_by(k).flatten().copied().collect()).collect();
        inputs.push(batch.iter().flat_map(|e| e.target.iter().copied()).collect());
        Ok((layout, inputs, pooled))
    }

    /// One training step on `batch`: the mean loss's gradients of every parameter and word
    /// vector, clipped to norm `clip` if given, applied by `opt` under the names `cell.<name>`,
    /// `head.<name>` and `embedding`. Returns the head's outputs (the losses among them).
    pub fn step(&mut self, batch: &[Example<'_>], opt: &mut Optimizer, clip: Option<f32>) -> Result<Vec<Vec<f32>>> {
        let (layout, inputs, pooled) = self.read_out(batch, true)?;
        let outputs = self.head.forward(&inputs.iter().map(Vec::as_slice).collect::<Vec<_>>())?;
        let mut hg = self.head.backward(1.0 / batch.len().max(1) as f32)?;
        let k = self.graphs_per_example();
        let width = inputs[0].len() / batch.len().max(1);
        let mut dh = vec![0.0; layout.roots.len() * width];
        for (slot, g) in hg.pulls.iter().take(k).enumerate() {
            for (e, row) in g.chunks(width).enumerate() {
                dh[(e * k + slot) * width..][..width].copy_from_slice(row);
            }
        }
        let mut cg = match pooled {
            Some(p) => self.cells.backward(&[&p.backward(&dh, layout.words.len())])?,
            None => self.cells.backward_rows(&layout.roots, &[&dh])?,
        };
        let tables: Vec<SparseGrad> = cg.tables.into_iter().flatten().collect();
        let mut words = merge(&tables, self.embedding.dim());
        if let Some(max) = clip {
            let mut all: Vec<&mut [f32]> = cg.params.iter_mut().chain(&mut hg.params).map(Vec::as_mut_slice).collect();
            all.push(&mut words.values);
            clip_grad_norm(&mut all, max);
        }
        opt.begin_step();
        let names = |f: &VertexFn, of: &str| f.params().iter().map(|p| tensor_name(of, &p.name)).collect::<Vec<_>>();
        let cell_names = names(self.cells.function(), "cell");
        self.cells.update_params(|ps| {
            ps.into_iter().zip(&cg.params).zip(&cell_names).for_each(|((p, g), n)| opt.dense(n, p, g));
        })?;
        let head_names = names(self.head.function(), "head");
        self.head.engine().update_params(|ps| {
            ps.into_iter().zip(&hg.params).zip(&head_names).for_each(|((p, g), n)| opt.dense(n, p, g));
        })?;
        let dim = self.embedding.dim();
        opt.sparse("embedding", self.embedding.table_mut(), dim, &words);
        // The next step draws new dropout masks.
        for engine in [&mut self.cells, self.head.engine()] {
            let key = engine.dropout_key();
            engine.set_dropout_key(crate::DropoutKey { step: key.step + 1, ..key });
        }
        Ok(outputs)
    }

    /// Every learned tensor under its name (`embedding`, `cell.<name>`, `head.<name>`), for a
    /// checkpoint.
    pub fn tensors(&mut self) -> Result<Vec<Named>> {
        let mut out = vec![(
            "embedding".to_string(),
            vec![self.embedding.vocab(), self.embedding.dim()],
            self.embedding.table().to_vec(),
        )];
        for (of, engine) in [("cell", &self.cells), ("head", &*self.head.engine())] {
            for (decl, values) in engine.function().params().iter().zip(engine.params()?) {
                out.push((tensor_name(of, &decl.name), decl.shape.dims().to_vec(), values));
            }
        }
        Ok(out)
    }

    /// Takes every learned tensor from `ck` (as [`Model::tensors`] names them); an error names
    /// a missing tensor or one of another size, and changes nothing.
    pub fn restore(&mut self, ck: &Checkpoint) -> Result<()> {
        let table = ck.tensor("embedding")?;
        let sized = |name: &str, values: &[f32], len: usize| {
            if values.len() == len {
                Ok(values.to_vec())
            } else {
                Err(Error::input(
                    format!("checkpoint tensor `{name}`"),
                    format!("{len} values"),
                    values.len().to_string(),
                ))
            }
        };
        let table = sized("embedding", table, self.embedding.table().len())?;
        let mut params = Vec::new();
        for (of, f) in [("cell", self.cells.function()), ("head", self.head.function())] {
            let mut these = Vec::new();
            for decl in f.params() {
                let name = tensor_name(of, &decl.name);
                these.push(sized(&name, ck.tensor(&name)?, decl.shape.numel())?);
            }
            params.push(these);
        }
        self.cells.set_params(&params[0])?;
        self.head.engine().set_params(&params[1])?;
        self.embedding.table_mut().copy_from_slice(&table);
        Ok(())
    }

    /// Checks `batch` and lays it out for the cells.
    fn layout<'a>(&self, batch: &[Example<'a>]) -> Result<Layout<'a>> {
        let k = self.graphs_per_example();
        let pad = self.embedding.padding().unwrap_or(0);
        let mut l = Layout { graphs: Vec::new(), words: Vec::new(), parent_words: Vec::new(), roots: Vec::new() };
        for (e, example) in batch.iter().enumerate() {
            if example.trees.len() != k {
                return Err(Error::input(
                    format!("example {e} of the minibatch"),
                    format!("{k} graphs"),
                    example.trees.len().to_string(),
                ));
            }
            for (t, tree) in example.trees.iter().enumerate() {
                let n = tree.graph.len();
                if tree.words.len() != n || tree.root >= n {
                    return Err(Error::input(
                        format!("graph {t} of example {e} of the minibatch"),
                        format!("{n} words and a root below {n}"),
                        format!("{} words, root {}", tree.words.len(), tree.root),
                    ));
                }
                let start = l.words.len();
                l.roots.push(start + tree.root);
                l.words.extend_from_slice(tree.words);
                l.parent_words.resize(start + n, pad);
                for v in 0..n {
                    for &c in tree.graph.children(v).iter().filter(|&&c| c != arbor_core::graph::NO_CHILD) {
                        l.parent_words[start + c as usize] = tree.words[v];
                    }
                }
                l.graphs.push(tree.graph);
            }
        }
        Ok(l)
    }
}

/// The cells' inputs over `l`, as `feeds` say.
fn pulls<'a>(embedding: &'a Embedding, feeds: &[Feed], l: &'a Layout<'_>) -> Vec<Pull<'a>> {
    feeds
        .iter()
        .map(|feed| match feed {
            Feed::Words => embedding.pull(&l.words),
            Feed::ParentWords => embedding.pull(&l.parent_words),
        })
        .collect()
}

/// A parameter's name in checkpoints and optimizer state: `cell.W`, `head.b`, ….
fn tensor_name(of: &str, param: &str) -> String {
    format!("{of}.{param}")
}
