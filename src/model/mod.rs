//! Whole models of examples with one or more graphs each: word vectors, a vertex function run
//! over every graph of the minibatch at once, and a [`Head`] over rows read out of it, trained
//! with no gradient written by hand. A sentence pair (SICK) is two trees and a target row.
//!
//! The head pulls, in order, one row of the cell's first pushed output for each graph of an
//! example (the root's row, or a pooling over the graph's vertices: see [`Readout`]), then the
//! example's target row; it pushes its `loss` and whatever else a caller reads (a prediction).
//! With [`Readout::Vertices`] the head reads every vertex of an example's one graph instead, each
//! with its own target row: a vertex without a target gets a row the head's loss ignores (a row
//! of zeros for cross-entropy or KL divergence; for other losses, e.g. a last column the loss is
//! multiplied by, 0 there), and an example's loss is the sum over its vertices.

use crate::dist::data_parallel::{shard, Pending};
use crate::dist::Collective;
use crate::engine::{Engine, Planned, Planner, SparseGrad};
use crate::head::Head;
use crate::layers::Embedding;
use crate::loss_scale::{scale_all, LossScaler};
use crate::optim::Optimizer;
use crate::readout::Readout;
use crate::trainer::{Scores, StepStats};
use crate::DropoutKey;
use crate::{Backend, InputGraph, VertexFn};
use arbor_core::error::{Error, Result};
use arbor_core::rng::Rng;
use std::ops::Range;

mod costs;
mod example;
mod layout;
mod learner;
mod noise;
mod passes;
mod spec;
mod tensors;
mod update;
pub use example::{Example, Feed, Tree};
pub(crate) use layout::{head_inputs, layout, pulls, read_grad, read_rows, unread, with_words_dropped, Fed, Layout};
pub use spec::{function_from_json, function_to_json, ModelSpec};

/// Word vectors, a vertex function on a backend, and a head.
///
/// [`Model::step`] runs the cell over every graph of a minibatch of [`Example`]s, reads one row
/// per graph out of it ([`Readout`]), runs the head on those rows and the targets, and takes an
/// optimizer step on the mean loss: the head's, the cell's and the word vectors' gradients all
/// come from the IR, none written by hand. [`Model::infer`] returns the head's outputs.
///
/// # Example
///
/// A Tree-LSTM with a regression head of one's own, fitted to two examples:
///
/// ```
/// use arbor::head::mean_squared_error;
/// use arbor::layers::Embedding;
/// use arbor::model::{Example, Feed, Model, Tree};
/// use arbor::optim::{Config, Optimizer, Rule};
/// use arbor::rng::Rng;
/// use arbor::{nn, Builder, CpuBackend, Init, InputGraph};
///
/// // The head: a linear prediction from a root's `h` (3 wide), its squared error to the target.
/// let f = Builder::new("regression", 0);
/// let (h, target) = (f.pull("h", 3), f.pull("target", 1));
/// let prediction = h.matmul(f.param("w", [3, 1], Init::Xavier)) + f.param("b", [1, 1], Init::Zeros);
/// f.push("loss", mean_squared_error(prediction, target));
/// f.push("prediction", prediction);
/// let head = f.build()?;
///
/// let mut rng = Rng::new(0);
/// let words = Embedding::new(5, 4, 0.1, &mut rng).with_padding(0); // word 0: no word
/// let cell = nn::tree_lstm(4, 3)?; // pulls a 4-wide word vector, pushes a 3-wide `h`
/// let mut model = Model::init(&CpuBackend::new(), words, cell, vec![Feed::Words], head, &mut rng)?;
///
/// // A tree over words 1 and 2 (its root, vertex 2, has no word) with target 1, and a
/// // one-word sentence with target −1.
/// let tree = InputGraph::from_children(vec![vec![], vec![], vec![Some(0), Some(1)]])?;
/// let word = InputGraph::chain(1);
/// let batch = [
///     Example { trees: vec![Tree::new(&tree, &[1, 2, 0], 2)], target: vec![1.0] },
///     Example { trees: vec![Tree::new(&word, &[3], 0)], target: vec![-1.0] },
/// ];
/// let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.05));
/// let before = model.infer(&batch)?; // the head's outputs: `loss`, then `prediction`
/// for _ in 0..30 {
///     model.step(&batch, &mut opt, None)?;
/// }
/// let after = model.infer(&batch)?;
/// let loss = |out: &[Vec<f32>]| out[0].iter().sum::<f32>(); // one loss per example
/// assert!(loss(&after) < loss(&before) / 4.0);
/// assert_eq!(after[1].len(), 2); // one prediction per example
/// # Ok::<(), arbor::Error>(())
/// ```
pub struct Model<B: Backend> {
    /// The word vectors.
    embedding: Embedding,
    /// The vertex functions' engines, bottom first: the bottom one pulls what [`Model::feeds`]
    /// say, each one above pulls the first output the one below pushed at the same vertex (see
    /// [`Model::stack`]).
    cells: Vec<Engine<B>>,
    /// What feeds each of the vertex function's inputs.
    feeds: Vec<Feed>,
    /// The head.
    head: Head<B>,
    /// How each graph's row is read out for the head ([`Readout::Root`] unless set).
    readout: Readout,
    /// A loss scale for half-precision products (none: gradients are not scaled).
    loss_scale: Option<LossScaler>,
    /// The step's block on the backend, kept from step to step ([`Model::apply`]).
    block: Option<B::Buffer>,
}

/// What the cells' pass is for.
enum Purpose<'p> {
    /// Training, with the minibatch already scheduled if it is.
    Train(Option<Planned<'p>>),
    /// Inference.
    Infer,
}

/// An example a [`Model`] learns from in the one training loop
/// ([`Learner`](crate::trainer::Learner)): one or more graphs and a target, and the score that
/// picks the best epoch over such examples.
pub trait AsExample: Sync + Sized {
    /// The example's graphs, words and target.
    fn example(&self) -> Example<'_>;

    /// How many terms the example's loss sums (its loss-carrying vertices, for a target per
    /// vertex). The training loop divides a minibatch's summed loss by its examples' total, so
    /// the default of one per example trains on the mean over examples, and a count of
    /// labelled vertices on the mean over them.
    fn terms(&self) -> usize {
        1
    }

    /// The scores on `data` by name from the head's `outputs` over it (inference, in order;
    /// [`Model::infer_all`]), the first the one that picks the best epoch (higher is better: a
    /// correlation of its predictions, an accuracy, a negated error, …).
    fn score(outputs: &Outputs, data: &[Self]) -> Result<Scores>;
}

/// A head's pushed outputs over a data set, by name: each a block per example (or per vertex,
/// with [`Readout::Vertices`]), in order.
#[derive(Clone, Debug, Default)]
pub struct Outputs {
    names: Vec<String>,
    values: Vec<Vec<f32>>,
}

impl Outputs {
    /// Empty outputs named as `head` pushes them.
    pub fn of(head: &VertexFn) -> Outputs {
        Outputs::named(head.outputs().iter().map(|o| o.name.clone()).collect())
    }

    /// Empty outputs of these names.
    pub fn named(names: Vec<String>) -> Outputs {
        Outputs { values: vec![Vec::new(); names.len()], names }
    }

    /// Replaces the output `name`'s values; an error lists the names there are.
    pub fn set(&mut self, name: &str, values: Vec<f32>) -> Result<()> {
        let i = self.index(name)?;
        self.values[i] = values;
        Ok(())
    }

    /// Where the output `name` is among them; an error lists the names there are.
    fn index(&self, name: &str) -> Result<usize> {
        let i = self.names.iter().position(|n| n == name);
        i.ok_or_else(|| Error::input("head outputs", format!("one of {:?}", self.names), format!("`{name}`")))
    }

    /// Appends one pass's outputs (as [`Model::infer`] returns them).
    pub fn extend(&mut self, pass: Vec<Vec<f32>>) {
        for (all, part) in self.values.iter_mut().zip(pass) {
            all.extend(part);
        }
    }

    /// The output pushed as `name`; an error lists the names there are.
    pub fn get(&self, name: &str) -> Result<&[f32]> {
        Ok(&self.values[self.index(name)?])
    }
}

/// What [`Model::gradients_then`] tells as soon as the head's part of a step is final: the
/// head's outputs and its parameters' gradients.
type HeadDone<'a> = dyn FnMut(&[Vec<f32>], &[Vec<f32>]) -> Result<()> + 'a;

/// The gradients of one step of a [`Model`] (or of one worker's share of it).
#[derive(Clone, Debug, Default)]
pub struct ModelGrads {
    /// The head's pushed outputs, one block per example (the loss among them).
    pub outputs: Vec<Vec<f32>>,
    /// Of each vertex function's parameters, bottom layer first.
    pub cells: Vec<Vec<Vec<f32>>>,
    /// Of the head's parameters.
    pub head: Vec<Vec<f32>>,
    /// Of the word vectors the minibatch looked up.
    pub words: SparseGrad,
    /// The dense gradients are held by the engines, where [`Model::apply`] tests, clips and
    /// applies them (`cells` and `head` are empty).
    pub kept: bool,
    /// The head's outputs are still on the backend, set aside: [`Model::apply`] reads them into
    /// `outputs` with the step's gate, in the step's one read.
    pub outputs_kept: bool,
}

/// The prefix of the tensor names of layer `k`'s parameters: `cell` for the bottom one, `cell1`,
/// `cell2`, … above it.
pub(crate) fn layer_prefix(k: usize) -> String {
    if k == 0 {
        "cell".to_string()
    } else {
        format!("cell{k}")
    }
}

/// The width of `f`'s first pushed output.
pub(crate) fn width_out(f: &VertexFn) -> usize {
    f.outputs().first().map_or(0, |o| o.shape.numel())
}

/// Checks that `head` reads one or more rows as wide as `top` pushes, then a target.
fn check_head(top: &VertexFn, head: &VertexFn) -> Result<()> {
    let width = width_out(top);
    let reads = head.inputs();
    let readouts = reads.len().saturating_sub(1);
    if readouts == 0 || reads[..readouts].iter().any(|p| p.shape.numel() != width) {
        return Err(Error::input(
            format!("model over `{}` with head `{}`: head inputs", top.name(), head.name()),
            format!("one or more rows {width} wide (the top vertex function's first output), then the target"),
            format!("{:?}", reads.iter().map(|p| p.shape.numel()).collect::<Vec<_>>()),
        ));
    }
    Ok(())
}

/// Checks that `above` can be stacked on `below`: one input as wide as `below`'s first output.
fn check_above(below: &VertexFn, above: &VertexFn) -> Result<()> {
    let width = width_out(below);
    if above.inputs().len() != 1 || above.inputs()[0].shape.numel() != width {
        return Err(Error::input(
            format!("vertex function `{}` stacked on `{}`", above.name(), below.name()),
            format!("one input {width} wide (the first output below)"),
            format!("inputs {:?}", above.inputs().iter().map(|p| p.shape.numel()).collect::<Vec<_>>()),
        ));
    }
    Ok(())
}

impl<B: Backend> Model<B> {
    /// The word vectors' settings (vocabulary, width, padding, word dropout); their values live
    /// in the bottom engine, on its device ([`Model::word_vectors`]), and the table here is empty.
    pub fn embedding(&self) -> &Embedding {
        &self.embedding
    }

    /// The word vectors' settings, to change (word dropout); the values are changed with
    /// [`Model::set_word_vectors`].
    pub fn embedding_mut(&mut self) -> &mut Embedding {
        &mut self.embedding
    }

    /// The vertex functions' engines, bottom first (see [`Model::stack`]).
    pub fn cells(&self) -> &[Engine<B>] {
        &self.cells
    }

    /// The engines, to change (their parameters, dropout keys or skipping of padding rows).
    pub fn cells_mut(&mut self) -> &mut [Engine<B>] {
        &mut self.cells
    }

    /// What feeds each of the bottom vertex function's inputs.
    pub fn feeds(&self) -> &[Feed] {
        &self.feeds
    }

    /// The head.
    pub fn head(&self) -> &Head<B> {
        &self.head
    }

    /// The head, to change (its dropout key, its engine's parameters).
    pub fn head_mut(&mut self) -> &mut Head<B> {
        &mut self.head
    }

    /// How each graph's row is read out for the head.
    pub fn readout(&self) -> Readout {
        self.readout
    }

    /// A model; checks that the feeds match the vertex function's inputs (each as wide as its
    /// feed: a word vector, or the width a row feed names, one width per kind of row feed), that
    /// [`Feed::ParentWords`] has a padding row, and that the head reads rows as wide as the cell
    /// pushes, then a target.
    pub fn new(embedding: Embedding, cells: Engine<B>, feeds: Vec<Feed>, head: Head<B>) -> Result<Model<B>> {
        Model::assemble(embedding, vec![cells], feeds, head, Readout::Root)
    }

    /// A model of stacked `cells` (bottom first); checks what [`Model::new`] and
    /// [`Model::stack`] check.
    pub(crate) fn assemble(
        embedding: Embedding,
        cells: Vec<Engine<B>>,
        feeds: Vec<Feed>,
        head: Head<B>,
        readout: Readout,
    ) -> Result<Model<B>> {
        let Some(f) = cells.first().map(Engine::function) else {
            return Err(Error::input("model", "at least one vertex function", "none"));
        };
        let what = |w: &str| format!("model over `{}` with head `{}`: {w}", f.name(), head.function().name());
        let width = |feed: &Feed| match feed {
            Feed::Words | Feed::ParentWords => embedding.dim(),
            Feed::ParentEdge(width) | Feed::ChildEdges(width, _) | Feed::Height(width) => *width,
        };
        if feeds.len() != f.inputs().len()
            || f.inputs().iter().zip(&feeds).any(|(p, feed)| p.shape.numel() != width(feed))
        {
            return Err(Error::input(
                what("feeds"),
                format!("one per input, each as wide as its feed (word vectors: {})", embedding.dim()),
                format!(
                    "{} feeds for inputs {:?}",
                    feeds.len(),
                    f.inputs().iter().map(|p| p.shape.numel()).collect::<Vec<_>>()
                ),
            ));
        }
        // A minibatch lays out one set of rows per kind of row feed.
        let kind = |feed: &Feed| std::mem::discriminant(feed);
        if let Some((a, b)) = feeds
            .iter()
            .enumerate()
            .find_map(|(i, a)| feeds[i + 1..].iter().find(|b| kind(a) == kind(b) && a != *b).map(|b| (a, b)))
        {
            return Err(Error::input(what("feeds"), "one width per kind of feed", format!("{a:?} and {b:?}")));
        }
        if feeds.contains(&Feed::ParentWords) && embedding.padding().is_none() {
            return Err(Error::input(what("parent words"), "word vectors with a padding row (for roots)", "none"));
        }
        for pair in cells.windows(2) {
            check_above(pair[0].function(), pair[1].function())?;
        }
        check_head(cells[cells.len() - 1].function(), head.function())?;
        // The word vectors live in the bottom engine, beside the cells that pull them.
        let (mut embedding, mut cells) = (embedding, cells);
        let dim = embedding.dim();
        cells[0].set_table(&embedding.take_table(), dim)?;
        let mut model = Model { embedding, cells, feeds, head, readout, loss_scale: None, block: None };
        model.skip_unused_grads();
        Ok(model)
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

    /// The model with `f` stacked on its vertex functions, with fresh parameters drawn from
    /// `rng`, on a replica of the top one's backend: `f` pulls, at every vertex, the first output
    /// the layer below pushed there (its one input must be that wide), and the head reads `f`'s
    /// first output from now on. A stacked model can be cut into pipeline stages
    /// (`pipeline::Part::split`).
    pub fn stack(mut self, f: VertexFn, rng: &mut Rng) -> Result<Model<B>> {
        let top = self.top();
        check_above(top.function(), &f)?;
        check_head(&f, self.head.function())?;
        let params = f.init_params(rng);
        let mut engine = Engine::new(top.backend().replica()?, f, &params)?;
        // Each layer draws its own dropout masks.
        let key = top.dropout_key();
        engine.set_dropout_key(DropoutKey { seed: key.seed.wrapping_add(1), ..key });
        self.cells.push(engine);
        Ok(self)
    }

    /// Gradients nobody reads are not formed or read: the bottom engine's of padding rows, which
    /// the word vectors drop anyway, and the head's of its targets.
    fn skip_unused_grads(&mut self) {
        let padded = self.embedding.padding().is_some();
        self.cells[0].set_skip_padding_grads(padded);
        let targets = self.graphs_per_example();
        self.head.engine().skip_input_grads(&[targets]);
        let edges: Vec<usize> = (0..self.feeds.len())
            .filter(|&i| matches!(self.feeds[i], Feed::ParentEdge(_) | Feed::ChildEdges(..) | Feed::Height(_)))
            .collect();
        self.cells[0].skip_input_grads(&edges);
    }

    /// The model with products in half precision guarded by `scaler`: the gradient entering the
    /// backward pass is multiplied by its scale and the results divided by it, and a step whose
    /// gradients overflowed is skipped (the scale lowered) instead of ending training.
    pub fn with_loss_scale(mut self, scaler: LossScaler) -> Model<B> {
        self.loss_scale = Some(scaler);
        self
    }

    /// The loss scale, as the steps so far have moved it (none: gradients are not scaled).
    pub fn loss_scale(&self) -> Option<LossScaler> {
        self.loss_scale
    }

    /// The top vertex function's engine (whose first output the head reads).
    fn top(&self) -> &Engine<B> {
        &self.cells[self.cells.len() - 1]
    }

    /// The model reading each graph out with `readout` (its root's row, a pooling over its
    /// vertices, or every vertex's row for a target per vertex).
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
        if self.readout == Readout::Root {
            return Ok(self.forward_linked(batch, Purpose::Infer)?.1);
        }
        let (_, inputs, _) = self.read_out(batch, Purpose::Infer)?;
        self.head.infer(&inputs.iter().map(Vec::as_slice).collect::<Vec<_>>())
    }

    /// The head's pushed outputs for inputs that have no target — each example given as its
    /// graphs alone, in the order of the head's inputs — by name, in order (inference, in
    /// chunks): what serving a model needs. The head's target input reads zeros, so a loss it
    /// pushes means nothing here; read its other outputs (`logits`, a prediction).
    pub fn predict(&mut self, inputs: &[Vec<Tree<'_>>]) -> Result<Outputs> {
        let width = self.target_width();
        let mut out = Outputs::of(self.head.function());
        for chunk in inputs.chunks(256) {
            let batch: Vec<Example<'_>> = chunk
                .iter()
                .map(|trees| Example { trees: trees.clone(), target: vec![0.0; width * self.target_rows(trees)] })
                .collect();
            out.extend(self.infer(&batch)?);
        }
        Ok(out)
    }

    /// The head's pushed outputs over all of `data`, by name (inference, in chunks).
    pub fn infer_all<E: AsExample>(&mut self, data: &[E]) -> Result<Outputs> {
        let mut out = Outputs::of(self.head.function());
        for chunk in data.chunks(256) {
            out.extend(self.infer(&chunk.iter().map(E::example).collect::<Vec<_>>())?);
        }
        Ok(out)
    }

    /// The scores of the model on `data` by name ([`AsExample::score`]), from inference.
    pub fn score<E: AsExample>(&mut self, data: &[E]) -> Result<Scores> {
        let outputs = self.infer_all(data)?;
        E::score(&outputs, data)
    }

    /// One training step on `batch`: the gradients of the mean loss over its examples, of every
    /// parameter and word vector, clipped to norm `clip` if given, applied by `opt` under the
    /// names `cell.<name>` (`cell1.<name>`, … for layers stacked above), `head.<name>` and
    /// `embedding`. Returns the head's outputs (the losses among them).
    pub fn step(&mut self, batch: &[Example<'_>], opt: &mut Optimizer, clip: Option<f32>) -> Result<Vec<Vec<f32>>> {
        let mut grads = self.gradients_kept(batch, batch.len())?;
        self.apply(&mut grads, opt, clip)?;
        Ok(grads.outputs)
    }

    /// The gradients of the loss summed over `batch` and divided by `denom` (the examples of
    /// the whole minibatch when `batch` is one worker's share of it, or their
    /// [`AsExample::terms`]), with the head's outputs;
    /// `planned` is `batch`'s graphs (in order, as [`Example::trees`] lists them) already
    /// scheduled by [`Model::planner`], if they are.
    pub fn gradients(
        &mut self,
        batch: &[Example<'_>],
        denom: usize,
        planned: Option<Planned<'_>>,
    ) -> Result<ModelGrads> {
        self.gradients_then(batch, denom, planned, &mut |_, _| Ok(()), false)
    }

    /// [`Model::gradients`] with the dense gradients left in the engines, where
    /// [`Model::apply`] tests, clips and applies them ([`ModelGrads::kept`]; `cells` and `head`
    /// empty): on a device, nothing parameter-sized comes to the host. With a root readout the
    /// head's outputs stay on the backend too, for [`Model::apply`] to read
    /// ([`ModelGrads::outputs_kept`]): forming the gradients reads nothing back.
    pub fn gradients_kept(&mut self, batch: &[Example<'_>], denom: usize) -> Result<ModelGrads> {
        self.gradients_then(batch, denom, None, &mut |_, _| Ok(()), true)
    }

    /// [`Model::gradients`], telling `head_done` the head's outputs and its parameters' final
    /// gradients as soon as they are known, before the cells' backward pass runs (so that a
    /// data-parallel step can send them meanwhile); with `keep`, the dense gradients stay in the
    /// engines ([`ModelGrads::kept`]) and `head_done` is told none (nor called with a root
    /// readout, whose outputs stay on the backend: [`ModelGrads::outputs_kept`]).
    fn gradients_then(
        &mut self,
        batch: &[Example<'_>],
        denom: usize,
        planned: Option<Planned<'_>>,
        head_done: &mut HeadDone<'_>,
        keep: bool,
    ) -> Result<ModelGrads> {
        let (k, width) = (self.graphs_per_example(), width_out(self.top().function()));
        // With a root readout, the head's outputs are read once the backward passes are
        // launched (kept, alone) or before the cells' (to send them meanwhile).
        let linked = self.readout == Readout::Root;
        let (layout, mut outputs, pooled) = if linked {
            (self.forward_linked(batch, Purpose::Train(planned))?.0, Vec::new(), None)
        } else {
            let (layout, inputs, pooled) = self.read_out(batch, Purpose::Train(planned))?;
            (layout, self.head.forward(&inputs.iter().map(Vec::as_slice).collect::<Vec<_>>())?, pooled)
        };
        // Under a loss scale every gradient is formed scaled and divided by the scale once final.
        let scale = self.loss_scale.map_or(1.0, |s| s.scale());
        let head_scale = scale / denom.max(1) as f32;
        let mut hg = if keep { self.head.backward_kept(head_scale)? } else { self.head.backward(head_scale)? };
        if scale != 1.0 {
            scale_all(&mut hg.params, 1.0 / scale);
            if keep {
                self.head.engine().scale_grads(1.0 / scale)?;
            }
        }
        if linked && !keep {
            outputs = self.head.kept_outputs()?;
        }
        if !(linked && keep) {
            head_done(&outputs, &hg.params)?;
        }
        let backward = |e: &mut Engine<B>, g: &[&[f32]]| if keep { e.backward_kept(g) } else { e.backward(g) };
        let top = self.cells.len() - 1;
        let mut g = match self.readout {
            Readout::Root => {
                let mut g = self.backward_linked(batch.len())?;
                if !keep {
                    g.params = self.cells[top].param_grads()?;
                }
                g
            }
            readout => {
                // One graph per example, every vertex's row read in order: the head's input
                // gradient is the cells' output gradient as it is.
                let dh = match readout {
                    Readout::Vertices => std::mem::take(&mut hg.pulls[0]),
                    _ => read_grad(&hg.pulls, k, width, layout.roots.len()),
                };
                let all = unread(dh, &layout, readout, pooled.as_ref(), self.cells[top].function());
                backward(&mut self.cells[top], &all.iter().map(Vec::as_slice).collect::<Vec<_>>())?
            }
        };
        let mut cells = vec![Vec::new(); self.cells.len()];
        for k in (0..top).rev() {
            cells[k + 1] = std::mem::take(&mut g.params);
            let below = g.pulls.swap_remove(0);
            g = backward(&mut self.cells[k], &[&below])?;
        }
        cells[0] = g.params;
        // Kept with a root readout, the outputs are read with the step's gate ([`Model::apply`]).
        let outputs_kept = linked && keep;
        // The word vectors' gradient (every feed's, summed) stays in the bottom engine if kept.
        let words = if keep { SparseGrad::default() } else { self.cells[0].held_table_grad()? };
        let mut grads = ModelGrads { outputs, cells, head: hg.params, words, kept: keep, outputs_kept };
        if scale != 1.0 {
            scale_all(grads.cells.iter_mut().flatten().chain([&mut grads.words.values]), 1.0 / scale);
            if keep {
                self.cells.iter_mut().try_for_each(|e| e.scale_grads(1.0 / scale))?;
                self.cells[0].scale_table_grad(1.0 / scale)?;
            }
        }
        Ok(grads)
    }

    /// Floating-point operations the cells' and the head's engines executed so far.
    pub fn flops(&mut self) -> u64 {
        self.cells.iter().map(Engine::flops).sum::<u64>() + self.head.engine().flops()
    }

    /// Backend calls the cells' and the head's engines made so far ([`Engine::calls`]).
    pub fn calls(&mut self) -> u64 {
        self.cells.iter().map(Engine::calls).sum::<u64>() + self.head.engine().calls()
    }

    /// The backend of the bottom cells' engine (every engine's is a replica of it: the same
    /// device).
    pub fn backend(&self) -> &B {
        self.cells[0].backend()
    }

    /// Kernel launches and library calls the engines' backends gave their device so far, where
    /// they count them ([`Backend::launches`]: a GPU's).
    pub fn launches(&mut self) -> Option<u64> {
        let head = self.head.engine().backend().launches();
        self.cells.iter().map(|e| e.backend().launches()).chain([head]).sum()
    }

    /// How often the engines' backends handed their device work so far, a list of launches
    /// issued as one graph counted once ([`Backend::submissions`]).
    pub fn submissions(&mut self) -> Option<u64> {
        let head = self.head.engine().backend().submissions();
        self.cells.iter().map(|e| e.backend().submissions()).chain([head]).sum()
    }

    /// The scheduler of the bottom cells' engine (for [`Model::gradients`] with a minibatch
    /// planned ahead).
    pub fn planner(&self) -> Planner {
        self.cells[0].planner()
    }

    /// A copy with the same functions, sizes and learned values, each engine on a replica of its
    /// backend (for another worker).
    pub fn replica(&self) -> Result<Model<B>> {
        let mut cells = self
            .cells
            .iter()
            .map(|e| {
                let mut copy = Engine::new(e.backend().replica()?, e.function().clone(), &e.params()?)?;
                copy.set_dropout_key(e.dropout_key());
                copy.set_optimizer_state(&e.optimizer_state()?)?;
                Ok(copy)
            })
            .collect::<Result<Vec<_>>>()?;
        cells[0].set_table(&self.cells[0].table()?, self.embedding.dim())?;
        cells[0].set_table_state(self.cells[0].table_state()?.as_ref())?;
        let head = self.head.replica_on(self.cells[0].backend().replica()?)?;
        let (embedding, feeds) = (self.embedding.clone(), self.feeds.clone());
        let (readout, loss_scale) = (self.readout, self.loss_scale);
        let mut model = Model { embedding, cells, feeds, head, readout, loss_scale, block: None };
        model.skip_unused_grads();
        if let Some(averages) = self.averaged()? {
            model.set_averaged(&averages)?;
        }
        Ok(model)
    }

    /// One data-parallel step on `batch` (the same on every worker of `coll`): this worker takes
    /// the examples of its share (balanced by vertex count), the gradients are summed across the
    /// workers in rank order and every replica applies the same update, so the replicas stay
    /// identical and the step equals [`Model::step`] on the whole minibatch up to the rounding of
    /// the sums. The loss summed over `batch` is divided by `denom` (`batch.len()` for the mean
    /// over examples; [`AsExample::terms`]). Dropout masks are keyed by step `step` and each
    /// example's place in `batch`. `planned` is this worker's graphs ([`Model::share`]) as
    /// scheduled. Returns the whole minibatch's loss so divided, and its size.
    #[allow(clippy::too_many_arguments)]
    pub fn step_shared(
        &mut self,
        coll: &mut dyn Collective,
        batch: &[Example<'_>],
        denom: usize,
        opt: &mut Optimizer,
        clip: Option<f32>,
        step: u64,
        planned: Option<Planned<'_>>,
    ) -> Result<StepStats> {
        let share = Model::<B>::share(batch, coll.rank(), coll.size());
        self.key_share(batch, share.start, step);
        let mine = &batch[share];
        let (count, vertices) = (mine.len(), mine.iter().flat_map(Example::graphs).map(InputGraph::len).sum::<usize>());
        let loss_at = self.head.loss_output();
        let loss_of =
            |outputs: &[Vec<f32>]| outputs.get(loss_at).map_or(0.0, |l| l.iter().sum::<f32>()) / denom.max(1) as f32;
        // With other workers, the head's gradients and the step's numbers travel in the first
        // bucket while the cells' backward pass runs (wait-free backpropagation).
        let mut first_bucket: Option<Vec<f32>> = None;
        // Alone, the dense gradients stay in the engines (nothing to sum across workers).
        let alone = coll.size() == 1;
        let mut head_done = |outputs: &[Vec<f32>], head: &[Vec<f32>]| -> Result<()> {
            if coll.size() > 1 {
                let mut bucket: Vec<f32> = head.iter().flatten().copied().collect();
                bucket.extend([loss_of(outputs), count as f32, vertices as f32]);
                coll.start_all_reduce(&bucket)?;
                first_bucket = Some(bucket);
            }
            Ok(())
        };
        let mut grads = if mine.is_empty() {
            let zeros = |f: &VertexFn| f.params().iter().map(|p| vec![0.0; p.shape.numel()]).collect();
            let grads = ModelGrads {
                outputs: Vec::new(),
                cells: self.cells.iter().map(|e| zeros(e.function())).collect(),
                head: zeros(self.head.function()),
                words: SparseGrad::default(),
                kept: false,
                outputs_kept: false,
            };
            head_done(&[], &grads.head)?;
            grads
        } else {
            self.gradients_then(mine, denom, planned, &mut head_done, alone)?
        };
        let mut summed = None;
        if let Some(mut bucket) = first_bucket {
            let pending = Pending::start(coll, std::mem::take(&mut grads.cells), std::mem::take(&mut grads.words))?;
            coll.finish_all_reduce(&mut bucket)?;
            (grads.cells, grads.words) = pending.finish(coll, self.embedding.vocab(), self.embedding.dim())?;
            let mut at = 0;
            for g in &mut grads.head {
                let len = g.len();
                g.copy_from_slice(&bucket[at..at + len]);
                at += len;
            }
            let n = &bucket[at..];
            summed =
                Some(StepStats { loss: n[0], count: n[1] as usize, vertices: n[2] as usize, ..StepStats::default() });
        }
        self.apply(&mut grads, opt, clip)?;
        Ok(summed.unwrap_or(StepStats { loss: loss_of(&grads.outputs), count, vertices, ..StepStats::default() }))
    }

    /// Keys the dropout masks of step `step` for the share of `batch` that starts at example
    /// `start`, so that a share draws the masks it draws within the whole minibatch.
    fn key_share(&mut self, batch: &[Example<'_>], start: usize, step: u64) {
        let k = self.graphs_per_example();
        for engine in &mut self.cells {
            engine.set_dropout_key(DropoutKey { step, first: start * k, ..engine.dropout_key() });
        }
        // The head's examples are the examples, or with a per-vertex readout their vertices.
        let first = match self.readout {
            Readout::Vertices => batch[..start].iter().flat_map(Example::graphs).map(InputGraph::len).sum(),
            _ => start,
        };
        let head = self.head.engine();
        head.set_dropout_key(DropoutKey { step, first, ..head.dropout_key() });
    }

    /// Worker `rank`'s share (of `size` workers) of `batch`: contiguous examples, balanced by
    /// vertex count.
    pub fn share(batch: &[Example<'_>], rank: usize, size: usize) -> Range<usize> {
        let weights: Vec<usize> = batch.iter().map(|e| e.graphs().map(InputGraph::len).sum()).collect();
        shard(&weights, size).get(rank).cloned().unwrap_or_default()
    }

    /// Values in a target row: the width of the head's last input.
    fn target_width(&self) -> usize {
        self.head.function().inputs().last().map_or(0, |p| p.shape.numel())
    }

    /// Target rows an example of `trees` has: one per vertex with [`Readout::Vertices`], else one.
    fn target_rows(&self, trees: &[Tree<'_>]) -> usize {
        match self.readout {
            Readout::Vertices => trees.iter().map(|t| t.graph.len()).sum(),
            _ => 1,
        }
    }

    /// Checks that every example of `batch` has the target rows the readout gives the head; a
    /// target per vertex under another readout is named as such.
    fn check_targets(&self, batch: &[Example<'_>]) -> Result<()> {
        let width = self.target_width();
        for (e, example) in batch.iter().enumerate() {
            let rows = self.target_rows(&example.trees);
            let got = example.target.len();
            if got == rows * width || example.trees.len() != self.graphs_per_example() {
                continue;
            }
            let vertices: usize = example.trees.iter().map(|t| t.graph.len()).sum();
            let per_vertex = self.readout != Readout::Vertices && got == vertices * width;
            let hint = if per_vertex {
                "; a target row per vertex needs `Model::with_readout(Readout::Vertices)` (what \
                 `Labelled::readout(LossOn::All)` gives)"
            } else {
                ""
            };
            return Err(Error::input(
                format!("target of example {e} of the minibatch"),
                format!("{rows} row(s) of {width} values (readout `{}`)", self.readout.name()),
                format!("{got} values{hint}"),
            ));
        }
        Ok(())
    }

    /// Checks `batch` and lays it out for the cells.
    fn layout<'a>(&self, batch: &[Example<'a>]) -> Result<Layout<'a>> {
        self.check_targets(batch)?;
        let fed = Fed::of(&self.feeds, &self.embedding);
        layout(batch, self.graphs_per_example(), self.readout, fed, self.cells[0].function())
    }
}
