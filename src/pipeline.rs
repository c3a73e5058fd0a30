//! Pipeline parallelism for a [`Model`] of stacked vertex functions ([`Model::stack`]: layer
//! `k + 1` pulls the row layer `k` pushed at the same vertex), cut into stages of whole layers
//! ([`Part::split`]). Stage 0 holds the word vectors, the last stage the head; every stage runs
//! on its own worker of a [`Collective`] (a thread or an MPI rank) and passes the rows of every
//! vertex forward and their gradients back. Examples are any [`AsExample`]: trees with a label
//! per vertex ([`Labelled`](crate::data::labelled::Labelled)), sentence pairs, graphs with a
//! pooled readout.
//!
//! A minibatch is cut into micro-batches of about equal vertex counts; the stages run them in
//! the order of a [`schedule`] (1F1B with a flush, or PipeDream-2BW). A stage
//! keeps one engine per micro-batch it may hold at once, so a micro-batch's backward pass finds
//! its forward's values — and the weights its forward saw — untouched.

use crate::dist::collective::{Collective, Mailbox};
use crate::dist::data_parallel::{merge, shard};
use crate::dist::schedule::{self, Kind, Op};
use crate::engine::{Engine, Planned, Planner, Pull, SparseGrad};
use crate::head::Head;
use crate::layers::Embedding;
use crate::model::{self, layer_prefix, AsExample, Example, Feed, Layout, Model, Outputs};
use crate::optim::{check_finite, clip_to, sum_squares, Optimizer};
use crate::readout::Readout;
use crate::trainer::step::{names, update};
use crate::trainer::{each_step, epoch_order, Event, Scores, Splits, StepStats, Summary};
use crate::{Backend, CpuBackend, DropoutKey, VertexFn};
use arbor_core::error::{Error, Result};
use arbor_core::rng::Rng;
use std::collections::VecDeque;
use std::time::Instant;

/// Message tags: activations, their gradients, gradient norms, and evaluation flags.
const ACT: u8 = 0;
const GRAD: u8 = 1;
const NORM: u8 = 2;
const FLAG: u8 = 3;

/// One layer of a model: a function (a vertex function, or the head) and its parameters.
#[derive(Clone)]
pub struct Layer {
    /// The function.
    pub f: VertexFn,
    /// Its parameters, in the function's order.
    pub params: Vec<Vec<f32>>,
    /// The seed its dropout masks are drawn from.
    pub seed: u64,
}

impl Layer {
    fn of<B: Backend>(engine: &Engine<B>) -> Result<Layer> {
        Ok(Layer { f: engine.function().clone(), params: engine.params()?, seed: engine.dropout_key().seed })
    }

    /// An engine running this layer on `backend`.
    fn engine<B: Backend>(&self, backend: B) -> Result<Engine<B>> {
        let mut e = Engine::new(backend, self.f.clone(), &self.params)?;
        e.set_dropout_key(DropoutKey { seed: self.seed, ..DropoutKey::default() });
        Ok(e)
    }

    /// A head running this layer on `backend`.
    fn head<B: Backend>(&self, backend: B) -> Result<Head<B>> {
        let mut h = Head::new(backend, self.f.clone(), &self.params)?;
        h.engine().set_dropout_key(DropoutKey { seed: self.seed, ..DropoutKey::default() });
        Ok(h)
    }
}

/// The part of a [`Model`] that one pipeline stage holds, as plain values.
#[derive(Clone)]
pub struct Part {
    /// The word vectors and what feeds each input of the bottom layer (first stage only).
    pub input: Option<(Embedding, Vec<Feed>)>,
    /// The index of its first layer in the whole model (its tensors are named after it).
    pub first: usize,
    /// Its vertex-function layers, bottom first.
    pub layers: Vec<Layer>,
    /// The head (last stage only).
    pub head: Option<Layer>,
    /// How the head reads the top layer.
    pub readout: Readout,
    /// Graphs per example.
    pub graphs: usize,
}

impl Part {
    /// Cuts `model` into `stages` parts of whole layers, as even as the layer count allows
    /// (copies of its learned values).
    pub fn split<B: Backend>(model: &Model<B>, stages: usize) -> Result<Vec<Part>> {
        let n = model.cells.len();
        if stages == 0 || stages > n {
            return Err(Error::input(
                "pipeline stages",
                format!("between 1 and the number of layers ({n})"),
                stages.to_string(),
            ));
        }
        let mut layers = model.cells.iter().map(Layer::of).collect::<Result<Vec<_>>>()?.into_iter();
        let head = Layer {
            f: model.head.function().clone(),
            params: model.head.params()?,
            seed: model.head.dropout_key().seed,
        };
        let (mut input, mut head) = (Some((model.embedding.clone(), model.feeds.clone())), Some(head));
        Ok((0..stages)
            .map(|s| Part {
                input: if s == 0 { input.take() } else { None },
                first: s * n / stages,
                layers: layers.by_ref().take((s + 1) * n / stages - s * n / stages).collect(),
                head: if s + 1 == stages { head.take() } else { None },
                readout: model.readout,
                graphs: model.graphs_per_example(),
            })
            .collect())
    }

    /// The model that `parts` (in order, as [`Part::split`] cut them) make up, each engine on a
    /// replica of `backend`.
    pub fn join<B: Backend>(parts: Vec<Part>, backend: &B) -> Result<Model<B>> {
        let mut input = None;
        let (mut cells, mut head, mut readout) = (Vec::new(), None, Readout::Root);
        for part in parts {
            input = input.or(part.input);
            head = head.or(part.head);
            readout = part.readout;
            for l in &part.layers {
                cells.push(l.engine(backend.replica()?)?);
            }
        }
        let missing = |what: &str| Error::input("pipeline parts", format!("{what} on one of them"), "none");
        let (embedding, feeds) = input.ok_or_else(|| missing("the word vectors"))?;
        let head = head.ok_or_else(|| missing("the head"))?.head(backend.replica()?)?;
        Model::assemble(embedding, cells, feeds, head, readout)
    }

    /// Every learned value, in order: the word vectors, each layer's parameters, the head's.
    pub fn values(&self) -> Vec<f32> {
        let mut out = self.input.as_ref().map(|(e, _)| e.table().to_vec()).unwrap_or_default();
        for l in self.layers.iter().chain(&self.head) {
            l.params.iter().for_each(|p| out.extend(p));
        }
        out
    }
}

/// Settings of a pipeline-parallel run.
#[derive(Clone, Debug)]
pub struct PipeSettings {
    /// The schedule.
    pub kind: Kind,
    /// Micro-batches per minibatch (at least the number of stages for 2BW).
    pub micro_batches: usize,
    /// Passes over the training set.
    pub epochs: usize,
    /// Examples per minibatch.
    pub batch: usize,
    /// Bound on the joint gradient norm of all stages.
    pub clip: Option<f32>,
    /// Stop after this many minibatches in all.
    pub max_steps: Option<u64>,
}

impl PipeSettings {
    /// Checks the plan against the number of stages: at least one micro-batch, no more than a
    /// minibatch has examples, and for 2BW at least one per stage.
    pub fn check(&self, stages: usize) -> Result<()> {
        let m = self.micro_batches;
        if m == 0 || m > self.batch.max(1) || (self.kind == Kind::TwoBw && m < stages) {
            return Err(Error::input(
                "--micro-batches",
                format!(
                    "at least 1, at most the examples of a minibatch (--batch {}), and at least the number of stages ({stages}) for 2BW",
                    self.batch
                ),
                m.to_string(),
            ));
        }
        Ok(())
    }
}

/// One micro-batch, laid out.
struct Micro<'a> {
    layout: Layout<'a>,
    /// The examples' target rows, in order.
    targets: Vec<f32>,
    /// Its examples, and the index of the first in its minibatch (dropout masks are keyed by it).
    examples: usize,
    first: usize,
    /// The index in its minibatch of the head's first example: `first`, or with a per-vertex
    /// readout the vertices before it.
    head_first: usize,
    /// The minibatch's step, for the dropout masks: the steps before it (as [`Model::step`]
    /// counts them, so one stage draws the masks the model draws).
    step: u64,
    /// The whole minibatch's loss terms ([`AsExample::terms`]): its summed loss is divided by
    /// them.
    denom: usize,
    /// Examples in the whole minibatch if this is its last micro-batch.
    ends: Option<usize>,
}

impl Micro<'_> {
    fn vertices(&self) -> usize {
        self.layout.words.len()
    }
}

/// Gradients of one minibatch on one stage, summed over its micro-batches in order.
#[derive(Default)]
struct Accum {
    cells: Vec<Vec<Vec<f32>>>,
    head: Vec<Vec<f32>>,
    parts: Vec<SparseGrad>,
    embedding: SparseGrad,
    stats: StepStats,
    squares: f64,
}

/// Adds every gradient of `src` to `dst` (taking `src` where `dst` is still empty).
fn add_all(dst: &mut Vec<Vec<f32>>, src: Vec<Vec<f32>>) {
    dst.resize_with(src.len(), Vec::new);
    for (d, s) in dst.iter_mut().zip(src) {
        if d.is_empty() {
            *d = s;
        } else {
            d.iter_mut().zip(&s).for_each(|(d, s)| *d += s);
        }
    }
}

impl Accum {
    /// Every dense and sparse gradient value, for clipping.
    fn all_mut(&mut self) -> Vec<&mut [f32]> {
        let mut all: Vec<&mut [f32]> = self.cells.iter_mut().flatten().map(Vec::as_mut_slice).collect();
        all.extend(self.head.iter_mut().map(Vec::as_mut_slice));
        all.push(&mut self.embedding.values);
        all
    }
}

/// One stage's gradients of one minibatch (see [`Stage::gradients`]).
pub struct MinibatchGrads(Accum);

/// A worker's part of a pipeline: its layers, their optimizer state, and the engines of the
/// micro-batches in flight, each on a replica of the stage's backend.
pub struct Stage<B: Backend = CpuBackend> {
    /// The part of the model this stage holds (the newest weights).
    pub part: Part,
    /// The optimizer of this stage's parameters.
    pub opt: Optimizer,
    /// Optimizer steps applied to `part`.
    pub version: usize,
    /// Best dev score so far (the first of the examples' scores; on the last stage).
    pub best_dev: f64,
    /// The test scores at the best dev score (on the last stage).
    pub test_scores: Scores,
    /// The RNG state the next epoch's order is drawn from.
    pub order: Rng,
    backend: B,
    /// The head and the weights version it holds (on the last stage).
    head: Option<(Head<B>, usize)>,
    engines: Vec<Vec<Engine<B>>>,
    loaded: Vec<Option<usize>>,
    push_grads: Vec<Vec<f32>>,
    acc: Option<Accum>,
    pending: VecDeque<Accum>,
}

impl Stage {
    /// A stage holding `part`, updated by `opt`, on the CPU; epochs are shuffled by `order`.
    pub fn new(part: Part, opt: Optimizer, order: Rng) -> Stage {
        Stage::on(CpuBackend::new(), part, opt, order)
    }
}

impl<B: Backend> Stage<B> {
    /// A stage holding `part`, updated by `opt`, whose engines run on replicas of `backend`
    /// ([`Backend::replica`]); epochs are shuffled by `order`.
    pub fn on(backend: B, part: Part, opt: Optimizer, order: Rng) -> Stage<B> {
        Stage {
            backend,
            part,
            opt,
            version: 0,
            best_dev: f64::NEG_INFINITY,
            test_scores: Scores::new(),
            order,
            head: None,
            engines: Vec::new(),
            loaded: Vec::new(),
            push_grads: Vec::new(),
            acc: None,
            pending: VecDeque::new(),
        }
    }

    /// The main test score at the best dev score (NaN before any evaluation or off the last
    /// stage).
    pub fn test_score(&self) -> f64 {
        self.test_scores.first().map_or(f64::NAN, |s| s.1)
    }

    /// One engine per layer for each of `slots` micro-batches in flight.
    fn make_slots(&mut self, slots: usize) -> Result<()> {
        self.engines = (0..slots)
            .map(|_| self.part.layers.iter().map(|l| l.engine(self.backend.replica()?)).collect::<Result<Vec<_>>>())
            .collect::<Result<_>>()?;
        self.loaded = vec![Some(self.version); slots];
        self.push_grads = vec![Vec::new(); slots];
        Ok(())
    }

    /// The head with the newest weights (on the last stage; `None` elsewhere).
    fn head(&mut self) -> Result<Option<&mut Head<B>>> {
        let Some(out) = &self.part.head else { return Ok(None) };
        match &mut self.head {
            Some((head, version)) if *version != self.version => {
                head.engine().set_params(&out.params)?;
                *version = self.version;
            }
            Some(_) => {}
            None => self.head = Some((out.head(self.backend.replica()?)?, self.version)),
        }
        Ok(self.head.as_mut().map(|(head, _)| head))
    }

    /// Loads the newest weights into slot `k`'s engines unless they have them.
    fn load(&mut self, k: usize) -> Result<()> {
        if self.loaded[k] != Some(self.version) {
            for (e, l) in self.engines[k].iter_mut().zip(&self.part.layers) {
                e.set_params(&l.params)?;
            }
            self.loaded[k] = Some(self.version);
        }
        Ok(())
    }

    /// Checks that this stage's part fits its place: the word vectors on the first stage only,
    /// the head on the last only.
    fn check_place(&self, mail: &Mailbox<'_>) -> Result<()> {
        let (rank, stages) = (mail.rank(), mail.size());
        if self.part.input.is_some() != (rank == 0) || self.part.head.is_some() != (rank + 1 == stages) {
            return Err(Error::input(
                format!("pipeline stage {rank} of {stages}"),
                "the parts of Part::split in order (word vectors first, head last)",
                "a part that belongs elsewhere",
            ));
        }
        Ok(())
    }

    fn width_in(&self) -> usize {
        self.part.layers.first().and_then(|l| l.f.inputs().first()).map_or(0, |p| p.shape.numel())
    }

    fn width_out(&self) -> usize {
        self.part.layers.last().map_or(0, |l| model::width_out(&l.f))
    }

    /// Lays out `batch`.
    fn lay_out<'a>(&self, batch: &[Example<'a>]) -> Result<Layout<'a>> {
        let parents =
            self.part.input.as_ref().and_then(|(e, feeds)| {
                feeds.contains(&crate::model::Feed::ParentWords).then(|| e.padding().unwrap_or(0))
            });
        let f = self
            .part
            .layers
            .first()
            .map(|l| &l.f)
            .ok_or_else(|| Error::input("pipeline stage", "at least one layer", "none"))?;
        model::layout(batch, self.part.graphs, self.part.readout, parents, f)
    }

    /// The micro-batches of `minibatches` (the first numbered `step`), `m` per minibatch
    /// (balanced by vertex count; some may be empty when a minibatch has few examples).
    fn micro_batches<'a, E: AsExample>(
        &self,
        minibatches: &[Vec<&'a E>],
        m: usize,
        step: u64,
    ) -> Result<Vec<Micro<'a>>> {
        let mut out = Vec::with_capacity(minibatches.len() * m);
        for (t, batch) in minibatches.iter().enumerate() {
            let examples: Vec<Example<'a>> = batch.iter().map(|e| e.example()).collect();
            let denom = batch.iter().map(|e| e.terms()).sum();
            let weights: Vec<usize> = examples.iter().map(|e| e.trees.iter().map(|t| t.graph.len()).sum()).collect();
            let parts = shard(&weights, m);
            for (i, r) in parts.iter().enumerate() {
                let mine = &examples[r.clone()];
                out.push(Micro {
                    layout: self.lay_out(mine)?,
                    targets: mine.iter().flat_map(|e| e.target.iter().copied()).collect(),
                    examples: mine.len(),
                    first: r.start,
                    head_first: if self.part.readout == Readout::Vertices {
                        weights[..r.start].iter().sum()
                    } else {
                        r.start
                    },
                    step: step + t as u64,
                    denom,
                    ends: (i + 1 == parts.len()).then_some(examples.len()),
                });
            }
        }
        Ok(out)
    }

    /// Runs this stage's layers over `layout` in slot `k` (training, with their schedules
    /// `plans`, one per layer) or in slot 0 (inference, `plans` empty): the rows of every vertex
    /// the top layer pushed.
    fn layers(
        &mut self,
        mail: &mut Mailbox<'_>,
        layout: &Layout<'_>,
        k: usize,
        plans: Option<Vec<Planned<'_>>>,
        key: DropoutKey,
    ) -> Result<Vec<f32>> {
        let n = layout.words.len();
        let mut x = match &self.part.input {
            Some(_) => Vec::new(),
            None => mail.recv_f32(mail.rank() - 1, ACT, n * self.width_in())?,
        };
        if n == 0 {
            return Ok(x);
        }
        let Stage { engines, part, .. } = self;
        let train = plans.is_some();
        let mut plans = plans.unwrap_or_default().into_iter();
        let dropped = match (&part.input, engines[k].first()) {
            (Some((embedding, _)), Some(e)) if train => {
                model::with_words_dropped(embedding, DropoutKey { seed: e.dropout_key().seed, ..key }, layout)
            }
            _ => None,
        };
        for (i, e) in engines[k].iter_mut().enumerate() {
            let input = [Pull::Rows(&x)];
            let pulls = match (&part.input, i) {
                (Some((embedding, feeds)), 0) => model::pulls(embedding, feeds, dropped.as_ref().unwrap_or(layout)),
                _ => input.to_vec(),
            };
            let mut out = if train {
                e.set_dropout_key(DropoutKey { seed: e.dropout_key().seed, ..key });
                let plan = plans.next().ok_or_else(|| Error::Worker {
                    rank: mail.rank(),
                    msg: format!("no schedule for layer {}", part.first + i),
                })?;
                e.forward_planned(plan, &pulls, None)?
            } else {
                e.infer(&layout.graphs, &pulls)?
            };
            x = out.swap_remove(0);
        }
        Ok(x)
    }

    /// The head's inputs over the top layer's rows `x` of `layout`, and the pooling if any.
    fn head_inputs(
        &self,
        x: Vec<f32>,
        layout: &Layout<'_>,
        targets: Vec<f32>,
    ) -> (Vec<Vec<f32>>, Option<crate::readout::Pooled>, usize, usize) {
        let width = self.width_out();
        let (read, pooled) = model::read_rows(x, layout, self.part.readout, width, false);
        let rows = read.len() / width.max(1);
        (model::head_inputs(read, self.part.graphs, width, targets), pooled, width, rows)
    }

    /// The forward pass of a micro-batch in slot `k`, through each layer's engine with its
    /// schedule from `plans` (one per layer; none for an empty micro-batch); on the last stage
    /// also the head's forward and backward passes.
    fn forward(&mut self, mail: &mut Mailbox<'_>, mb: &Micro<'_>, k: usize, plans: Vec<Planned<'_>>) -> Result<()> {
        self.load(k)?;
        let key = DropoutKey { seed: 0, step: mb.step, first: mb.first * self.part.graphs };
        let x = self.layers(mail, &mb.layout, k, Some(plans), key)?;
        if self.part.head.is_none() {
            return mail.send_f32(mail.rank() + 1, ACT, &x);
        }
        if mb.examples == 0 {
            self.push_grads[k] = Vec::new();
            return Ok(());
        }
        let (inputs, pooled, width, rows) = self.head_inputs(x, &mb.layout, mb.targets.clone());
        let (readout, graphs) = (self.part.readout, self.part.graphs);
        let head = self.head()?.ok_or_else(|| Error::Worker { rank: mail.rank(), msg: "no head".into() })?;
        let key = head.dropout_key();
        head.engine().set_dropout_key(DropoutKey { step: mb.step, first: mb.head_first, ..key });
        let outputs = head.forward(&inputs.iter().map(Vec::as_slice).collect::<Vec<_>>())?;
        let hg = head.backward(1.0 / mb.denom.max(1) as f32)?;
        let loss = outputs.get(head.loss_output()).map_or(0.0, |l| l.iter().sum::<f32>()) / mb.denom.max(1) as f32;
        let dh = model::read_grad(&hg.pulls, graphs, width, rows);
        self.push_grads[k] = model::unread(dh, &mb.layout, readout, width, pooled.as_ref());
        let acc = self.acc.get_or_insert_with(Accum::default);
        add_all(&mut acc.head, hg.params);
        let s = &mut acc.stats;
        (s.loss, s.count, s.vertices) = (s.loss + loss, s.count + mb.examples, s.vertices + mb.vertices());
        Ok(())
    }

    /// The backward pass of a micro-batch; after a minibatch's last one, returns its examples
    /// and numbers.
    fn backward(
        &mut self,
        mail: &mut Mailbox<'_>,
        mb: &Micro<'_>,
        k: usize,
        clip: bool,
    ) -> Result<Option<(usize, StepStats)>> {
        let n = mb.vertices();
        let mut g = match self.part.head {
            Some(_) => std::mem::take(&mut self.push_grads[k]),
            None => mail.recv_f32(mail.rank() + 1, GRAD, n * self.width_out())?,
        };
        let acc = self.acc.get_or_insert_with(Accum::default);
        if n > 0 {
            acc.cells.resize_with(self.engines[k].len(), Vec::new);
            let bottom = self.part.input.is_some();
            for (i, (e, cell)) in self.engines[k].iter_mut().zip(&mut acc.cells).enumerate().rev() {
                let mut grads = e.backward(&[&g])?;
                add_all(cell, std::mem::take(&mut grads.params));
                if bottom && i == 0 {
                    // The word vectors' gradient, as rows of the looked-up words.
                    acc.parts.extend(grads.tables.into_iter().flatten());
                    g = Vec::new();
                } else {
                    g = grads.pulls.swap_remove(0);
                }
            }
        }
        if self.part.input.is_none() {
            mail.send_f32(mail.rank() - 1, GRAD, &g)?;
        }
        let Some(examples) = mb.ends else { return Ok(None) };
        let mut acc = self.acc.take().unwrap_or_default();
        if let Some((e, _)) = &self.part.input {
            acc.embedding = merge(&acc.parts, e.dim());
        }
        if clip {
            share_norm(&mut acc, mail)?;
        }
        let stats = acc.stats;
        self.pending.push_back(acc);
        Ok(Some((examples, stats)))
    }

    /// Applies finished minibatch gradients, oldest first, until the weights are `version`.
    fn catch_up(&mut self, mail: &mut Mailbox<'_>, version: usize, clip: Option<f32>) -> Result<()> {
        while self.version < version {
            let Some(mut acc) = self.pending.pop_front() else {
                return Err(Error::Worker {
                    rank: mail.rank(),
                    msg: format!("weights version {version} needed before its gradients are complete"),
                });
            };
            if let Some(max) = clip {
                let mut total = 0.0f64;
                for from in 0..mail.size() {
                    total += if from == mail.rank() {
                        acc.squares
                    } else {
                        let b = mail.recv(from, NORM)?;
                        let b: [u8; 8] = b.try_into().map_err(|_| Error::Worker {
                            rank: mail.rank(),
                            msg: format!("worker {from} sent a malformed gradient norm"),
                        })?;
                        f64::from_le_bytes(b)
                    };
                }
                clip_to(&mut acc.all_mut(), total.sqrt() as f32, max);
            }
            let part = &mut self.part;
            let first = part.first;
            let layers = part.layers.iter_mut().zip(&acc.cells).enumerate();
            let mut tensors: Vec<_> =
                layers.map(|(i, (layer, grads))| (layer_prefix(first + i), layer, grads)).collect();
            tensors.extend(part.head.as_mut().map(|head| ("head".to_string(), head, &acc.head)));
            let dense: Vec<(String, &mut [f32], &[f32])> = tensors
                .into_iter()
                .flat_map(|(of, layer, grads)| names(&of, &layer.f).into_iter().zip(&mut layer.params).zip(grads))
                .map(|((n, p), g)| (n, p.as_mut_slice(), g.as_slice()))
                .collect();
            let embedding = std::iter::once(("embedding", acc.embedding.values.as_slice()));
            let named = dense.iter().map(|(n, _, g)| (n.as_str(), *g)).chain(embedding);
            check_finite(self.version as u64 + 1, "the gradient of", named)?;
            update(&mut self.opt, dense, part.input.as_mut().map(|(e, _)| (e, &acc.embedding)));
            self.version += 1;
        }
        Ok(())
    }

    /// Trains on `minibatches` (examples, in order) as stage `coll.rank()` of `coll.size()`;
    /// the last stage reports every finished minibatch to `done` with its numbers.
    pub fn train<E: AsExample>(
        &mut self,
        minibatches: &[Vec<&E>],
        plan: &PipeSettings,
        coll: &mut dyn Collective,
        done: &mut dyn FnMut(usize, StepStats),
    ) -> Result<()> {
        let mut mail = Mailbox::new(coll);
        self.train_on(&mut mail, minibatches, plan, done)
    }

    /// The gradients of one minibatch at the current weights, cut into `plan.micro_batches`
    /// micro-batches and summed, without applying them (every stage must call it).
    pub fn gradients<E: AsExample>(
        &mut self,
        minibatch: &[&E],
        plan: &PipeSettings,
        coll: &mut dyn Collective,
    ) -> Result<MinibatchGrads> {
        let mut mail = Mailbox::new(coll);
        let plan = PipeSettings { kind: Kind::OneFOneBFlush, clip: None, ..plan.clone() };
        self.run_ops(&mut mail, &[minibatch.to_vec()], &plan, &mut |_, _| {})?;
        let acc = self
            .pending
            .pop_back()
            .ok_or_else(|| Error::Worker { rank: mail.rank(), msg: "the minibatch produced no gradients".into() })?;
        Ok(MinibatchGrads(acc))
    }

    /// Applies gradients from [`Stage::gradients`] (of any weights) to the current weights, with
    /// `clip` bounding the joint norm of all stages (every stage must call it).
    pub fn update(&mut self, g: MinibatchGrads, clip: Option<f32>, coll: &mut dyn Collective) -> Result<()> {
        let mut mail = Mailbox::new(coll);
        let mut acc = g.0;
        if clip.is_some() {
            share_norm(&mut acc, &mut mail)?;
        }
        self.pending.push_back(acc);
        self.catch_up(&mut mail, self.version + self.pending.len(), clip)
    }

    fn train_on<E: AsExample>(
        &mut self,
        mail: &mut Mailbox<'_>,
        minibatches: &[Vec<&E>],
        plan: &PipeSettings,
        done: &mut dyn FnMut(usize, StepStats),
    ) -> Result<()> {
        let base = self.version;
        self.run_ops(mail, minibatches, plan, done)?;
        // The pipeline drains: every minibatch's update is applied.
        self.catch_up(mail, base + minibatches.len(), plan.clip)
    }

    /// Runs this stage's passes over `minibatches`, applying updates only as the schedule
    /// needs them.
    fn run_ops<E: AsExample>(
        &mut self,
        mail: &mut Mailbox<'_>,
        minibatches: &[Vec<&E>],
        plan: &PipeSettings,
        done: &mut dyn FnMut(usize, StepStats),
    ) -> Result<()> {
        let (rank, stages, m) = (mail.rank(), mail.size(), plan.micro_batches);
        plan.check(stages)?;
        self.check_place(mail)?;
        let slots = stages - rank;
        if self.engines.len() != slots {
            self.make_slots(slots)?;
        }
        let base = self.version;
        let micro = self.micro_batches(minibatches, m, base as u64)?;
        let ops = schedule::ops(plan.kind, rank, stages, minibatches.len(), m);
        // The steps of the loop: each forward pass with the backward passes after it (and any
        // backward passes before the first forward), its micro-batch scheduled ahead.
        let starts: Vec<usize> = (0..ops.len()).filter(|&i| i == 0 || matches!(ops[i], Op::Forward(_))).collect();
        let planners: Vec<Vec<Planner>> =
            self.engines.iter().map(|s| s.iter().map(Engine::planner).collect()).collect();
        let prepare = |u: usize| match ops[starts[u]] {
            Op::Forward(j) if micro[j].vertices() > 0 => {
                planners[j % slots].iter().map(|p| p.plan(&micro[j].layout.graphs)).collect::<Result<Vec<_>>>()
            }
            _ => Ok(Vec::new()),
        };
        each_step(starts.len(), &prepare, &mut |u, mut plans| {
            let end = starts.get(u + 1).copied().unwrap_or(ops.len());
            for &op in &ops[starts[u]..end] {
                match op {
                    Op::Forward(j) => {
                        // Minibatch t runs on W(t) after a flush, on W(t−1) under 2BW.
                        self.catch_up(mail, base + (j / m).saturating_sub(plan.kind.lag()), plan.clip)?;
                        self.forward(mail, &micro[j], j % slots, std::mem::take(&mut plans))?;
                    }
                    Op::Backward(j) => {
                        if let Some((examples, stats)) =
                            self.backward(mail, &micro[j], j % slots, plan.clip.is_some())?
                        {
                            if self.part.head.is_some() {
                                done(examples, stats);
                            }
                        }
                    }
                }
            }
            Ok(true)
        })
    }

    /// The examples' scores on `data`, run through the pipeline in inference mode; every stage
    /// must call it, and the last stage's answer is the one that counts (the others return none).
    fn score<E: AsExample>(&mut self, mail: &mut Mailbox<'_>, data: &[E]) -> Result<Scores> {
        self.check_place(mail)?;
        if self.engines.is_empty() {
            self.make_slots(mail.size() - mail.rank())?;
        }
        self.load(0)?;
        let mut outputs = self.part.head.as_ref().map(|h| Outputs::of(&h.f));
        for chunk in data.chunks(256) {
            let examples: Vec<Example<'_>> = chunk.iter().map(E::example).collect();
            let layout = self.lay_out(&examples)?;
            let x = self.layers(mail, &layout, 0, None, DropoutKey::default())?;
            let Some(out) = &mut outputs else {
                mail.send_f32(mail.rank() + 1, ACT, &x)?;
                continue;
            };
            let targets = examples.iter().flat_map(|e| e.target.iter().copied()).collect();
            let (inputs, ..) = self.head_inputs(x, &layout, targets);
            let head = self.head()?.ok_or_else(|| Error::Worker { rank: mail.rank(), msg: "no head".into() })?;
            out.extend(head.infer(&inputs.iter().map(Vec::as_slice).collect::<Vec<_>>())?);
        }
        outputs.map_or(Ok(Scores::new()), |out| E::score(&out, data))
    }

    /// Trains for `plan.epochs` epochs (or `plan.max_steps` minibatches) as stage `coll.rank()`
    /// of `coll.size()`, scoring dev after every epoch (and test when dev improves). The last
    /// stage reports `events` and holds the scores.
    pub fn fit<E: AsExample>(
        &mut self,
        data: Splits<'_, E>,
        plan: &PipeSettings,
        coll: &mut dyn Collective,
        events: &mut dyn FnMut(Event),
    ) -> Result<Summary> {
        let mut mail = Mailbox::new(coll);
        let last = mail.rank() + 1 == mail.size();
        let mut summary = Summary::default();
        let mut steps = 0u64;
        for epoch in 1..=plan.epochs {
            let order = epoch_order(data.train.len(), &mut self.order);
            let mut minibatches: Vec<Vec<&E>> =
                order.chunks(plan.batch.max(1)).map(|c| c.iter().map(|&i| &data.train[i]).collect()).collect();
            if let Some(max) = plan.max_steps {
                minibatches.truncate(max.saturating_sub(steps) as usize);
            }
            if minibatches.is_empty() {
                break;
            }
            if last {
                events(Event::EpochStart { epoch, done: 0, total: data.train.len() });
            }
            let (mut loss, start) = (0.0f64, Instant::now());
            self.train_on(&mut mail, &minibatches, plan, &mut |examples, stats| {
                loss += f64::from(stats.loss);
                events(Event::Trees(examples));
            })?;
            summary.train_seconds += start.elapsed().as_secs_f64();
            summary.sentences += minibatches.iter().map(Vec::len).sum::<usize>();
            steps += minibatches.len() as u64;
            let dev = self.score(&mut mail, data.dev)?.first().map_or(f64::NAN, |s| s.1);
            // With no finite dev score by the last epoch (an empty or constant dev split), test
            // is scored on the last epoch's weights.
            let end = epoch == plan.epochs || plan.max_steps.is_some_and(|m| steps >= m);
            let improved = dev > self.best_dev || (end && self.best_dev == f64::NEG_INFINITY);
            let me = mail.rank();
            for to in (0..mail.size()).filter(|&r| last && r != me) {
                mail.send(to, FLAG, vec![u8::from(improved)])?;
            }
            let improved = if last { improved } else { mail.recv(mail.size() - 1, FLAG)? == [1] };
            if improved {
                self.test_scores = self.score(&mut mail, data.test)?;
                self.best_dev = dev;
            }
            if last {
                let loss = loss / minibatches.len() as f64;
                summary.loss_curve.push(loss);
                summary.dev_curve.push(dev);
                events(Event::EpochEnd { epoch, loss, dev });
            }
        }
        Ok(summary)
    }
}

/// Sends the sum of squares of a minibatch's gradients on this stage to every other stage, for
/// the joint norm.
fn share_norm(acc: &mut Accum, mail: &mut Mailbox<'_>) -> Result<()> {
    acc.squares = sum_squares(&acc.all_mut());
    let me = mail.rank();
    for to in (0..mail.size()).filter(|&r| r != me) {
        mail.send(to, NORM, acc.squares.to_le_bytes().to_vec())?;
    }
    Ok(())
}
