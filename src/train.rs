//! Training classifiers: embedding → vertex function (on the engine) → softmax classifier, with
//! a target per vertex (trees, sequences) or per graph (a mean over its final vertices).

use crate::checkpoint::{Checkpoint, Lent, Named};
use crate::data::TreeExample;
use crate::engine::{Engine, Planned};
use crate::head::ClassHead;
use crate::layers::{Embedding, LossOn, SparseGrad};
use crate::loss_scale::{scale_all, LossScaler};
use crate::optim::{all_finite, check_finite, clip_grad_norm, Optimizer};
use crate::readout::{Pooled, Readout as Pool};
use crate::{Backend, CpuBackend, InputGraph, VertexFn};
use std::borrow::Cow;
use std::ops::Range;

/// How the pushed rows of a minibatch become predictions.
#[derive(Clone, Copy, Debug)]
pub enum Readout<'a> {
    /// One target per vertex (`None`: no loss at that vertex).
    Vertices(&'a [Option<u32>]),
    /// One target per group of vertices (merged-vertex ranges), predicted from the mean of the
    /// group's rows: graph classification.
    MeanPool {
        /// The vertices of each group.
        groups: &'a [Range<usize>],
        /// The target of each group.
        targets: &'a [u32],
    },
}

use arbor_core::error::{Error, Result};
use arbor_core::rng::Rng;

/// A classifier: vectors pulled by every vertex (words, node labels), a vertex function over each
/// example's graph, and a classifier head over the pushed state (a softmax classifier unless
/// [`Classifier::with_head`] gives another).
pub struct Classifier<B: Backend = CpuBackend> {
    /// The input layer.
    pub embed: Embedding,
    /// The vertex function on its engine.
    pub engine: Engine<B>,
    /// The output layer: a head run over the rows that have targets.
    pub out: ClassHead<B>,
    /// A loss scale for half-precision products (none: gradients are not scaled).
    pub loss_scale: Option<LossScaler>,
}

/// Numbers from one minibatch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Mean loss over the targets.
    pub loss: f32,
    /// Targets predicted right.
    pub correct: usize,
    /// Targets.
    pub count: usize,
    /// Vertices processed.
    pub vertices: usize,
}

/// Forward results of one step whose output-layer gradients are final (see
/// [`Classifier::output_pass`]).
pub struct OutputPass {
    /// Loss and accuracy counts.
    pub stats: StepStats,
    /// The output layer's gradients, one per parameter of its head.
    pub classifier: Vec<Vec<f32>>,
    /// The gradient of the pushed rows: of every vertex, or of the vertices `push_rows`.
    pub push_grad: Vec<f32>,
    /// The vertices `push_grad` holds rows of, in that order (the loss's targets); `None`: all.
    pub push_rows: Option<Vec<usize>>,
}

/// Every gradient of one step (or of one worker's share of it).
#[derive(Clone, Debug)]
pub struct StepGrads {
    /// Loss and accuracy counts.
    pub stats: StepStats,
    /// The vertex function's parameter gradients.
    pub cell: Vec<Vec<f32>>,
    /// The output layer's gradients, one per parameter of its head.
    pub classifier: Vec<Vec<f32>>,
    /// The embedding rows' gradients.
    pub embedding: SparseGrad,
}

/// A minibatch of trees, merged: graphs, then every vertex's word and label in merged order.
pub(crate) struct Batch<'a> {
    pub(crate) graphs: Vec<&'a InputGraph>,
    pub(crate) words: Vec<u32>,
    pub(crate) labels: Vec<u32>,
}

pub(crate) fn batch<'a>(examples: &[&'a TreeExample]) -> Batch<'a> {
    Batch {
        graphs: examples.iter().map(|e| &e.graph).collect(),
        words: examples.iter().flat_map(|e| e.words.iter().copied()).collect(),
        labels: examples.iter().flat_map(|e| e.labels.iter().copied()).collect(),
    }
}

impl Classifier {
    /// A classifier around `cell` (which must pull one `embed`-wide input and push one row) over
    /// `vocab` input rows, of which `padding` (if any) stays zero, on the CPU.
    pub fn new(
        cell: VertexFn,
        vocab: usize,
        padding: Option<u32>,
        classes: usize,
        rng: &mut Rng,
    ) -> Result<Classifier> {
        Classifier::on(CpuBackend::new(), cell, vocab, padding, classes, rng)
    }
}

impl<B: Backend> Classifier<B> {
    /// [`Classifier::new`] with the vertex function running on `backend`.
    pub fn on(
        backend: B,
        cell: VertexFn,
        vocab: usize,
        padding: Option<u32>,
        classes: usize,
        rng: &mut Rng,
    ) -> Result<Classifier<B>> {
        let (embed_dim, hidden) = match (cell.inputs(), cell.outputs()) {
            ([x], [h]) => (x.shape.numel(), h.shape.numel()),
            (inputs, outputs) => {
                return Err(Error::input(
                    format!("classifier around `{}`", cell.name()),
                    "a vertex function with one pulled input and one pushed output",
                    format!("{} inputs and {} outputs", inputs.len(), outputs.len()),
                ))
            }
        };
        let mut embed = Embedding::new(vocab, embed_dim, 0.1, rng);
        if let Some(id) = padding {
            embed = embed.with_padding(id);
        }
        let params = cell.init_params(rng);
        let out = ClassHead::softmax(backend.replica()?, hidden, classes, rng)?;
        let mut engine = Engine::new(backend, cell, &params)?;
        // The padding row's gradient is dropped by the embedding, so the engine need not form it.
        engine.set_skip_padding_grads(padding.is_some());
        Ok(Classifier { embed, engine, out, loss_scale: None })
    }

    /// The classifier with `head` as its output layer (e.g. a deeper head, or one with dropout:
    /// see [`ClassHead::new`]); its rows must be as wide as the vertex function pushes.
    pub fn with_head(mut self, head: ClassHead<B>) -> Result<Classifier<B>> {
        let width = self.engine.function().outputs()[0].shape.numel();
        if head.input() != width {
            return Err(Error::input(
                format!("head `{}` of the classifier", head.function().name()),
                format!("rows {width} wide (the vertex function's output)"),
                format!("rows {} wide", head.input()),
            ));
        }
        self.out = head;
        Ok(self)
    }

    /// A copy with the same function, sizes and learned values, on its own engine and a
    /// [replica](Backend::replica) of this one's backend (a replica for another worker).
    pub fn replica(&self) -> Result<Classifier<B>> {
        let backend = self.engine.backend().replica()?;
        let mut engine = Engine::new(backend, self.engine.function().clone(), &self.engine.params()?)?;
        engine.set_skip_padding_grads(self.embed.padding().is_some());
        engine.set_dropout_key(self.engine.dropout_key());
        let out = self.out.replica_on(self.engine.backend().replica()?)?;
        Ok(Classifier { embed: self.embed.clone(), engine, out, loss_scale: self.loss_scale })
    }

    /// One optimizer step on a minibatch of trees (or chains); `clip` bounds the joint gradient norm.
    pub fn train_step(
        &mut self,
        examples: &[&TreeExample],
        loss_on: LossOn,
        opt: &mut Optimizer,
        clip: Option<f32>,
    ) -> Result<StepStats> {
        let b = batch(examples);
        let targets = loss_on.select(&b.graphs, &b.labels)?;
        self.step(&b.graphs, &b.words, Readout::Vertices(&targets), opt, clip)
    }

    /// One pass over `train` in minibatches of `batch`, in an order drawn from `rng` (the same
    /// state gives the same order); `progress` is told the trees done after every minibatch.
    /// Returns the mean loss.
    #[allow(clippy::too_many_arguments)]
    pub fn epoch(
        &mut self,
        train: &[TreeExample],
        batch: usize,
        loss_on: LossOn,
        opt: &mut Optimizer,
        clip: Option<f32>,
        rng: &mut Rng,
        progress: &mut dyn FnMut(usize),
    ) -> Result<f64> {
        let mut order: Vec<usize> = (0..train.len()).collect();
        rng.shuffle(&mut order);
        let batches: Vec<Vec<&TreeExample>> =
            order.chunks(batch.max(1)).map(|c| c.iter().map(|&i| &train[i]).collect()).collect();
        let mut loss = 0.0;
        self.train_batches(&batches, loss_on, opt, clip, &mut |stats, trees| {
            loss += f64::from(stats.loss);
            progress(trees);
        })?;
        Ok(loss / batches.len().max(1) as f64)
    }

    /// One optimizer step per minibatch of `batches`, in order, each scheduled on a helper
    /// thread while the step before it runs (the same result as [`Classifier::train_step`] on
    /// each); `done` is told each step's numbers and its tree count.
    pub fn train_batches(
        &mut self,
        batches: &[Vec<&TreeExample>],
        loss_on: LossOn,
        opt: &mut Optimizer,
        clip: Option<f32>,
        done: &mut dyn FnMut(&StepStats, usize),
    ) -> Result<()> {
        let graphs = |k: usize| Ok(batches[k].iter().map(|e| &e.graph).collect());
        crate::trainer::plan_each(&self.engine.planner(), batches.len(), &graphs, &mut |k, planned| {
            let b = batch(&batches[k]);
            let targets = loss_on.select(&b.graphs, &b.labels)?;
            let out =
                self.output_pass_planned(&b.graphs, &b.words, Readout::Vertices(&targets), None, Some(planned))?;
            let stats = self.finish_step(out, opt, clip)?;
            done(&stats, batches[k].len());
            Ok(true)
        })
    }

    /// The pushed rows of every vertex of a minibatch, in inference mode.
    pub fn infer(&mut self, graphs: &[&InputGraph], ids: &[u32]) -> Result<Vec<f32>> {
        Ok(self.engine.infer(graphs, &[self.embed.pull(ids)])?.swap_remove(0))
    }

    /// [`Classifier::infer`] returning only the rows of the vertices `rows` (merged-vertex
    /// indices, e.g. the roots), in that order.
    pub fn infer_rows(&mut self, graphs: &[&InputGraph], ids: &[u32], rows: &[usize]) -> Result<Vec<f32>> {
        Ok(self.engine.infer_rows(graphs, &[self.embed.pull(ids)], rows)?.swap_remove(0))
    }

    /// One optimizer step: vertex `i` of the merged minibatch pulls row `ids[i]` of the embedding.
    pub fn step(
        &mut self,
        graphs: &[&InputGraph],
        ids: &[u32],
        readout: Readout<'_>,
        opt: &mut Optimizer,
        clip: Option<f32>,
    ) -> Result<StepStats> {
        let out = self.output_pass(graphs, ids, readout, None)?;
        self.finish_step(out, opt, clip)
    }

    /// A step after its [`Classifier::output_pass`]: backward and the optimizer update.
    fn finish_step(&mut self, out: OutputPass, opt: &mut Optimizer, clip: Option<f32>) -> Result<StepStats> {
        let (cell, embedding) = self.input_pass(&out.push_grad, out.push_rows.as_deref())?;
        let mut grads = StepGrads { stats: out.stats, cell, classifier: out.classifier, embedding };
        self.apply(&mut grads, opt, clip)?;
        Ok(grads.stats)
    }

    /// The first half of a step: forward through every layer, the loss, and the output layer's
    /// gradients, which are final from here on. The loss is summed over the targets and divided
    /// by `denom` (default: the targets here).
    pub fn output_pass(
        &mut self,
        graphs: &[&InputGraph],
        ids: &[u32],
        readout: Readout<'_>,
        denom: Option<usize>,
    ) -> Result<OutputPass> {
        self.output_pass_planned(graphs, ids, readout, denom, None)
    }

    /// [`Classifier::output_pass`], with the minibatch already scheduled when `planned` is given
    /// (for the same `graphs`, by this engine's [`Planner`](crate::Planner)).
    pub fn output_pass_planned(
        &mut self,
        graphs: &[&InputGraph],
        ids: &[u32],
        readout: Readout<'_>,
        denom: Option<usize>,
        planned: Option<Planned<'_>>,
    ) -> Result<OutputPass> {
        let dropped = self.embed.training_ids(self.engine.dropout_key(), graphs, ids);
        let pull = self.embed.pull(&dropped);
        // A loss on some vertices (the roots) reads and feeds back only their rows.
        let rows: Option<Vec<usize>> = match readout {
            Readout::Vertices(targets) if targets.iter().any(Option::is_none) => {
                Some(targets.iter().enumerate().filter(|(_, t)| t.is_some()).map(|(v, _)| v).collect())
            }
            _ => None,
        };
        let h = match planned {
            Some(p) => self.engine.forward_planned(p, &[pull], rows.as_deref())?,
            None => match &rows {
                Some(rows) => self.engine.forward_rows(graphs, &[pull], rows)?,
                None => self.engine.forward(graphs, &[pull])?,
            },
        };
        let width = self.engine.function().outputs()[0].shape.numel();
        let (step, push_grad) = match readout {
            Readout::Vertices(targets) => {
                let denom = denom.unwrap_or_else(|| targets.iter().flatten().count());
                let picked: Vec<Option<u32>>;
                let targets = match &rows {
                    Some(rows) => {
                        picked = rows.iter().map(|&v| targets[v]).collect();
                        &picked
                    }
                    None => targets,
                };
                let mut step = self.out.loss_over(&h[0], targets, denom)?;
                let g = std::mem::take(&mut step.grad_input);
                (step, g)
            }
            Readout::MeanPool { groups, targets } => {
                let pooled = Pooled::forward(&h[0], width, groups.to_vec(), Pool::Mean);
                let t: Vec<Option<u32>> = targets.iter().map(|&t| Some(t)).collect();
                let step = self.out.loss_over(&pooled.rows, &t, denom.unwrap_or(t.len()))?;
                let g = pooled.backward(&step.grad_input, ids.len());
                (step, g)
            }
        };
        Ok(OutputPass {
            stats: StepStats { loss: step.loss, correct: step.correct, count: step.count, vertices: ids.len() },
            classifier: step.grads,
            push_grad,
            push_rows: rows,
        })
    }

    /// The second half of a step: backward through the vertex function and the embedding, from
    /// the gradient of the pushed rows (of every vertex, or of the vertices `rows`, as in
    /// [`OutputPass`]). Returns the cell's and the embedding's gradients. With a
    /// [loss scale](Self::loss_scale) the backward pass runs on scaled gradients and its results
    /// are unscaled.
    pub fn input_pass(&mut self, push_grad: &[f32], rows: Option<&[usize]>) -> Result<(Vec<Vec<f32>>, SparseGrad)> {
        let mut backward = |g: &[f32]| match rows {
            Some(rows) => self.engine.backward_rows(rows, &[g]),
            None => self.engine.backward(&[g]),
        };
        let mut grads = match self.loss_scale {
            Some(s) => {
                let scaled: Vec<f32> = push_grad.iter().map(|g| g * s.scale()).collect();
                let mut grads = backward(&scaled)?;
                let tables = grads.tables.iter_mut().flatten().map(|t| &mut t.values);
                scale_all(grads.params.iter_mut().chain(tables), 1.0 / s.scale());
                grads
            }
            None => backward(push_grad)?,
        };
        let sparse = grads.tables.swap_remove(0).unwrap_or_default();
        Ok((grads.params, sparse))
    }

    /// Clips the joint gradient norm to `clip` and applies one optimizer step. With a
    /// [loss scale](Self::loss_scale), a step whose gradients overflowed is skipped (and the
    /// scale lowered); returns whether the step was applied. Either way the next step draws new
    /// dropout masks ([`DropoutKey::step`](crate::DropoutKey::step) moves on).
    pub fn apply(&mut self, grads: &mut StepGrads, opt: &mut Optimizer, clip: Option<f32>) -> Result<bool> {
        // Steps counted from 1 since the start of training (the dropout key counts from 0).
        let step = self.engine.dropout_key().step + 1;
        for engine in [&mut self.engine, self.out.head().engine()] {
            let key = engine.dropout_key();
            engine.set_dropout_key(crate::DropoutKey { step: key.step + 1, ..key });
        }
        if let Some(scaler) = &mut self.loss_scale {
            let finite =
                grads.cell.iter().map(Vec::as_slice).chain([grads.embedding.values.as_slice()]).all(all_finite);
            if !scaler.update(finite) {
                return Ok(false);
            }
        } else {
            // Without a loss scale to skip it, a step that is not finite ends training.
            check_finite(step, "the value of", [("loss", std::slice::from_ref(&grads.stats.loss))])?;
            let parts =
                [("cell", self.engine.function(), &grads.cell), (CLASSIFIER, self.out.function(), &grads.classifier)];
            check_gradients(step, &parts, &grads.embedding.values)?;
        }
        if let Some(max) = clip {
            clip_all(&mut [&mut grads.cell, &mut grads.classifier], &mut grads.embedding.values, max);
        }
        let (head, embed) = (self.out.head().engine(), &mut self.embed);
        let cell_names = names("cell", self.engine.function());
        let head_names = names(CLASSIFIER, head.function());
        let mut updated = Ok(());
        self.engine.update_params(|cell| {
            updated = head.update_params(|out| {
                let cell = cell_names.into_iter().zip(cell).zip(&grads.cell);
                let named = cell.chain(head_names.into_iter().zip(out).zip(&grads.classifier));
                let dense = named.map(|((n, p), g)| (n, p, g.as_slice())).collect();
                update(opt, dense, Some((embed, &grads.embedding)));
            })
        })?;
        updated?;
        Ok(true)
    }

    /// Accuracy of mean-pooled predictions: `groups[i]` are the vertices whose mean predicts
    /// `targets[i]`.
    pub fn pooled_accuracy(
        &mut self,
        graphs: &[&InputGraph],
        ids: &[u32],
        groups: &[Range<usize>],
        targets: &[u32],
    ) -> Result<f64> {
        let h = self.infer(graphs, ids)?;
        let width = self.engine.function().outputs()[0].shape.numel();
        let predicted = self.out.predict(&Pooled::forward(&h, width, groups.to_vec(), Pool::Mean).rows)?;
        let correct = predicted.iter().zip(targets).filter(|(p, t)| **p == **t as usize).count();
        Ok(correct as f64 / targets.len().max(1) as f64)
    }

    /// Every learned tensor, named: `cell.<param>`, `classifier.<param>` (`classifier.weight`
    /// and `classifier.bias` for the softmax classifier), `embedding`.
    pub fn tensors(&self) -> Result<Vec<Named>> {
        Ok(crate::checkpoint::owned(self.tensors_lent()?))
    }

    /// [`Classifier::tensors`] with the word vectors lent, not copied.
    pub fn tensors_lent(&self) -> Result<Vec<Lent<'_>>> {
        let mut out = Vec::new();
        let parts = [
            ("cell", self.engine.function(), self.engine.params()?),
            (CLASSIFIER, self.out.function(), self.out.params()?),
        ];
        for (of, f, values) in parts {
            for (p, v) in f.params().iter().zip(values) {
                out.push((tensor_name(of, &p.name), p.shape.dims().to_vec(), Cow::Owned(v)));
            }
        }
        out.push(("embedding".into(), vec![self.embed.vocab(), self.embed.dim()], Cow::Borrowed(self.embed.table())));
        Ok(out)
    }

    /// Restores every learned tensor from a checkpoint made by [`Classifier::tensors`]; an error
    /// names a missing tensor or one of another size, and changes nothing.
    pub fn restore(&mut self, ck: &Checkpoint) -> Result<()> {
        let mut loaded = Vec::new();
        for (of, f) in [("cell", self.engine.function()), (CLASSIFIER, self.out.function())] {
            loaded.push(
                f.params()
                    .iter()
                    .map(|p| ck.sized(&tensor_name(of, &p.name), p.shape.numel()))
                    .collect::<Result<Vec<_>>>()?,
            );
        }
        let table = ck.sized("embedding", self.embed.table().len())?;
        self.engine.set_params(&loaded[0])?;
        self.out.head().engine().set_params(&loaded[1])?;
        self.embed.table_mut().copy_from_slice(&table);
        Ok(())
    }

    /// The class scores (logits) at every tree's root, `batch_size` trees at a time, in
    /// inference mode; the trees' labels are not read (a new sentence needs none).
    pub fn root_logits(&mut self, data: &[TreeExample], batch_size: usize) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(data.len());
        for chunk in data.chunks(batch_size.max(1)) {
            let refs: Vec<&TreeExample> = chunk.iter().collect();
            let b = batch(&refs);
            // The root is each tree's last vertex, and the trees lie one after another.
            let rows: Vec<usize> = chunk
                .iter()
                .scan(0, |end, e| {
                    *end += e.graph.len();
                    Some(*end - 1)
                })
                .collect();
            let h = self.infer_rows(&b.graphs, &b.words, &rows)?;
            let classes = self.out.classes();
            out.extend(self.out.logits(&h)?.chunks(classes).map(<[f32]>::to_vec));
        }
        Ok(out)
    }

    /// Root accuracy over `data`, in minibatches of `batch` trees, in inference mode (NaN for no
    /// data).
    pub fn accuracy(&mut self, data: &[TreeExample], batch_size: usize) -> Result<f64> {
        let (mut correct, mut count) = (0, 0);
        for chunk in data.chunks(batch_size.max(1)) {
            let refs: Vec<&TreeExample> = chunk.iter().collect();
            let b = batch(&refs);
            let targets = LossOn::Root.select(&b.graphs, &b.labels)?;
            let (rows, labels): (Vec<usize>, Vec<u32>) =
                targets.iter().enumerate().filter_map(|(row, t)| t.map(|t| (row, t))).unzip();
            let h = self.infer_rows(&b.graphs, &b.words, &rows)?;
            let predicted = self.out.predict(&h)?;
            count += labels.len();
            correct += predicted.iter().zip(&labels).filter(|(p, t)| **p == **t as usize).count();
        }
        // No data, no accuracy (NaN, `null` in JSON): never a best epoch, never a 0.
        Ok(if count == 0 { f64::NAN } else { correct as f64 / count as f64 })
    }
}

/// The prefix of the output layer's tensors in checkpoints and optimizer state.
const CLASSIFIER: &str = "classifier";

/// A tensor's name in checkpoints and optimizer state: `cell.W`, `classifier.bias`, ….
pub(crate) fn tensor_name(of: &str, param: &str) -> String {
    format!("{of}.{param}")
}

/// The names of `f`'s parameters under the prefix `of`.
pub(crate) fn names(of: &str, f: &VertexFn) -> Vec<String> {
    f.params().iter().map(|p| tensor_name(of, &p.name)).collect()
}

/// Ends training with [`Error::Diverged`] at step `step` if a gradient is not finite: of the
/// parameters of each part (its prefix, function, and one gradient per parameter), or of the
/// looked-up word vectors.
pub(crate) fn check_gradients(step: u64, parts: &[(&str, &VertexFn, &Vec<Vec<f32>>)], words: &[f32]) -> Result<()> {
    let names: Vec<Vec<String>> = parts.iter().map(|(of, f, _)| names(of, f)).collect();
    let dense = names.iter().zip(parts).flat_map(|(n, (_, _, g))| n.iter().zip(g.iter()));
    let words = std::iter::once(("embedding", words));
    check_finite(step, "the gradient of", dense.map(|(n, g)| (n.as_str(), g.as_slice())).chain(words))
}

/// Clips the joint norm of the dense gradients of `parts` and the word vectors' to `max`.
pub(crate) fn clip_all(parts: &mut [&mut Vec<Vec<f32>>], words: &mut [f32], max: f32) {
    let mut all: Vec<&mut [f32]> = parts.iter_mut().flat_map(|p| p.iter_mut()).map(Vec::as_mut_slice).collect();
    all.push(words);
    clip_grad_norm(&mut all, max);
}

/// One optimizer step over a model's parameters, each tensor's state kept under its name (as
/// [`Classifier::tensors`] names it): the dense tensors, then the rows of the embedding that its
/// gradient touches.
pub(crate) fn update(
    opt: &mut Optimizer,
    dense: Vec<(String, &mut [f32], &[f32])>,
    embed: Option<(&mut Embedding, &SparseGrad)>,
) {
    opt.begin_step();
    for (name, p, g) in dense {
        opt.dense(&name, p, g);
    }
    if let Some((e, g)) = embed {
        let dim = e.dim();
        opt.sparse("embedding", e.table_mut(), dim, g);
    }
}

/// Settings of graph classification by cross-validation.
#[derive(Clone, Debug)]
pub struct GraphTraining {
    /// Message-passing steps.
    pub steps: usize,
    /// Node-feature (label embedding) width.
    pub features: usize,
    /// Hidden state width.
    pub hidden: usize,
    /// Passes over each fold's training graphs.
    pub epochs: usize,
    /// Graphs per minibatch.
    pub batch: usize,
    /// Folds.
    pub folds: usize,
    /// Seed for the split, the initialisation and the order.
    pub seed: u64,
    /// Optimizer settings.
    pub optimizer: crate::optim::Config,
    /// Gradient-norm bound.
    pub clip: Option<f32>,
}

/// Cross-validated accuracy.
#[derive(Clone, Debug, PartialEq)]
pub struct CvResult {
    /// Held-out accuracy of every fold.
    pub fold_acc: Vec<f64>,
    /// Their mean.
    pub mean: f64,
    /// Their standard deviation.
    pub std: f64,
    /// Graphs trained on per second.
    pub graphs_per_s: f64,
}

struct GraphBatch {
    graphs: Vec<InputGraph>,
    ids: Vec<u32>,
    groups: Vec<Range<usize>>,
    targets: Vec<u32>,
}

fn graph_batch(examples: &[&crate::data::tu::GraphExample], steps: usize) -> GraphBatch {
    let mut b = GraphBatch { graphs: Vec::new(), ids: Vec::new(), groups: Vec::new(), targets: Vec::new() };
    for e in examples {
        let g = e.unroll(steps);
        let base = b.ids.len();
        for _ in 0..=steps {
            b.ids.extend(&e.node_labels);
        }
        b.groups.push(base + g.len() - e.node_labels.len()..base + g.len());
        b.targets.push(e.label);
        b.graphs.push(g);
    }
    b
}

/// Refuses graph training that would not fit in memory, before anything is allocated: the
/// model (node-label vectors, cell, classifier), every training graph unrolled over
/// `cfg.steps` (an epoch's minibatches are unrolled up front) and the values of the largest
/// minibatch.
fn check_graph_training(data: &crate::data::tu::TuDataset, cfg: &GraphTraining) -> Result<()> {
    let cell = crate::nn::ggnn(cfg.features, cfg.hidden)?;
    let labels = (data.node_label_count * cfg.features) as u128 + (cfg.hidden * data.classes) as u128;
    crate::memory::check_model("--hidden and --embed", crate::memory::param_floats(&cell) + labels, 1)?;
    let steps = cfg.steps as u128 + 1;
    // A vertex of an unrolled graph: its slot list, its label id and its child slots.
    let unrolled: u128 = data
        .graphs
        .iter()
        .map(|g| 36 * g.node_labels.len() as u128 + 4 * g.neighbours.iter().map(|n| n.len() as u128).sum::<u128>())
        .sum::<u128>()
        * steps;
    let mut sizes: Vec<usize> = data.graphs.iter().map(|g| g.node_labels.len()).collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let largest: u128 = sizes.iter().take(cfg.batch.max(1)).map(|&n| n as u128).sum::<u128>() * steps;
    let values = largest * crate::memory::vertex_floats(&cell) * 4;
    crate::memory::check(
        "--steps, --hidden, --embed and --batch",
        unrolled.saturating_add(values),
        "unrolled graphs and a minibatch's values",
    )
}

/// Trains a fresh gated graph network per fold on the CPU and reports held-out accuracy;
/// `progress` is told `(fold, epoch)` after every epoch.
pub fn cross_validate(
    data: &crate::data::tu::TuDataset,
    cfg: &GraphTraining,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<CvResult> {
    cross_validate_on(&CpuBackend::new(), data, cfg, progress)
}

/// [`cross_validate`] with each fold's model on a replica of `backend` ([`Backend::replica`]).
pub fn cross_validate_on<B: Backend>(
    backend: &B,
    data: &crate::data::tu::TuDataset,
    cfg: &GraphTraining,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<CvResult> {
    let mut rng = Rng::new(cfg.seed);
    let mut order: Vec<usize> = (0..data.graphs.len()).collect();
    rng.shuffle(&mut order);
    let folds = cfg.folds;
    if folds < 2 || folds > data.graphs.len() {
        return Err(Error::input(
            "cross-validation folds",
            format!("between 2 and the number of graphs ({})", data.graphs.len()),
            folds.to_string(),
        ));
    }
    check_graph_training(data, cfg)?;
    let mut fold_acc = Vec::with_capacity(folds);
    let (mut seconds, mut seen) = (0.0, 0usize);
    for k in 0..folds {
        let held: Vec<usize> = order.iter().copied().skip(k).step_by(folds).collect();
        let mut train: Vec<usize> = order.iter().copied().filter(|i| !held.contains(i)).collect();
        let cell = crate::nn::ggnn(cfg.features, cfg.hidden)?;
        let mut model = Classifier::on(backend.replica()?, cell, data.node_label_count, None, data.classes, &mut rng)?;
        let mut opt = Optimizer::new(cfg.optimizer);
        let start = std::time::Instant::now();
        for epoch in 0..cfg.epochs {
            rng.shuffle(&mut train);
            // Unrolled up front, so the loop schedules each minibatch while the one before runs.
            let batches: Vec<GraphBatch> = train
                .chunks(cfg.batch.max(1))
                .map(|chunk| graph_batch(&chunk.iter().map(|&i| &data.graphs[i]).collect::<Vec<_>>(), cfg.steps))
                .collect();
            let graphs = |k: usize| Ok(batches[k].graphs.iter().collect());
            crate::trainer::plan_each(&model.engine.planner(), batches.len(), &graphs, &mut |k, planned| {
                let b = &batches[k];
                let refs: Vec<&InputGraph> = b.graphs.iter().collect();
                let readout = Readout::MeanPool { groups: &b.groups, targets: &b.targets };
                let out = model.output_pass_planned(&refs, &b.ids, readout, None, Some(planned))?;
                model.finish_step(out, &mut opt, cfg.clip)?;
                Ok(true)
            })?;
            seen += train.len();
            progress(k, epoch);
        }
        seconds += start.elapsed().as_secs_f64();
        let examples: Vec<_> = held.iter().map(|&i| &data.graphs[i]).collect();
        let b = graph_batch(&examples, cfg.steps);
        let refs: Vec<&InputGraph> = b.graphs.iter().collect();
        fold_acc.push(model.pooled_accuracy(&refs, &b.ids, &b.groups, &b.targets)?);
    }
    let mean = fold_acc.iter().sum::<f64>() / fold_acc.len() as f64;
    let std = (fold_acc.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / fold_acc.len() as f64).sqrt();
    Ok(CvResult { fold_acc, mean, std, graphs_per_s: seen as f64 / seconds.max(1e-9) })
}
