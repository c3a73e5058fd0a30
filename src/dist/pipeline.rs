//! Pipeline parallelism for stacked models: an embedding, `L` layers of a vertex function (layer
//! `k + 1` pulls the row layer `k` pushed at the same vertex) and a softmax classifier, cut into
//! stages of whole layers. Stage 0 holds the embedding, the last stage the classifier; every
//! stage runs on its own worker of a [`Collective`] (a thread or an MPI rank) and passes
//! activations forward and their gradients back.
//!
//! A minibatch is cut into micro-batches of about equal vertex counts; the stages run them in
//! the order of a [`schedule`] (1F1B with a flush, or PipeDream-2BW). A stage
//! keeps one engine per micro-batch it may hold at once, so a micro-batch's backward pass finds
//! its forward's values — and the weights its forward saw — untouched.

use super::collective::{Collective, Mailbox};
use super::data_parallel::{merge, split};
use super::schedule::{self, Kind, Op};
use crate::data::TreeExample;
use crate::engine::{Engine, Planned, Planner, Pull};
use crate::head::{softmax_classifier, ClassHead};
use crate::layers::{Embedding, LossOn, SparseGrad};
use crate::nn::Model;
use crate::optim::{check_finite, clip_to, sum_squares, Optimizer};
use crate::train::{batch, names, update, StepStats, CLASSIFIER};
use crate::trainer::{each_step, epoch_order, Event, Splits, Summary};
use crate::{Backend, CpuBackend, InputGraph, VertexFn};
use arbor_core::error::{Error, Result};
use arbor_core::rng::Rng;
use std::collections::VecDeque;
use std::time::Instant;

/// Message tags: activations, their gradients, gradient norms, and evaluation flags.
const ACT: u8 = 0;
const GRAD: u8 = 1;
const NORM: u8 = 2;
const FLAG: u8 = 3;

/// One layer of a stack: a vertex function and its parameters.
#[derive(Clone)]
pub struct Layer {
    /// The vertex function.
    pub f: VertexFn,
    /// Its parameters, in the function's order.
    pub params: Vec<Vec<f32>>,
}

impl Layer {
    fn width(&self, pulled: bool) -> usize {
        let ports = if pulled { self.f.inputs() } else { self.f.outputs() };
        ports.first().map_or(0, |p| p.shape.numel())
    }
}

/// A stacked classifier, or the part of one that a pipeline stage holds.
#[derive(Clone)]
pub struct Stack {
    /// The input layer (on the first stage only).
    pub embed: Option<Embedding>,
    /// The vertex-function layers, bottom first.
    pub layers: Vec<Layer>,
    /// The output layer, a classifier head (on the last stage only).
    pub out: Option<Layer>,
}

impl Stack {
    /// A whole stacked classifier: `depth` layers of `model` (the first pulls `embed`-wide word
    /// vectors, the others the `hidden`-wide row below), over `vocab` words of which `padding`
    /// (if any) stays zero, into `classes` classes.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: Model,
        depth: usize,
        embed: usize,
        hidden: usize,
        vocab: usize,
        padding: Option<u32>,
        classes: usize,
        rng: &mut Rng,
    ) -> Result<Stack> {
        if depth == 0 {
            return Err(Error::input("stacked model", "at least 1 layer", "0"));
        }
        let mut table = Embedding::new(vocab, embed, 0.1, rng);
        if let Some(id) = padding {
            table = table.with_padding(id);
        }
        let layers = (0..depth)
            .map(|k| {
                let f = model.cell(if k == 0 { embed } else { hidden }, hidden)?;
                let params = f.init_params(rng);
                Ok(Layer { f, params })
            })
            .collect::<Result<Vec<_>>>()?;
        let f = softmax_classifier(hidden, classes)?;
        let out = Layer { params: f.init_params(rng), f };
        Ok(Stack { embed: Some(table), layers, out: Some(out) })
    }

    /// Cuts a whole stack into `stages` parts of whole layers, as even as the layer count allows.
    pub fn split(self, stages: usize) -> Result<Vec<Stack>> {
        let n = self.layers.len();
        if stages == 0 || stages > n {
            return Err(Error::input(
                "pipeline stages",
                format!("between 1 and the number of layers ({n})"),
                stages.to_string(),
            ));
        }
        let (mut embed, mut out) = (self.embed, self.out);
        let mut layers = self.layers.into_iter();
        Ok((0..stages)
            .map(|s| Stack {
                embed: if s == 0 { embed.take() } else { None },
                layers: layers.by_ref().take((s + 1) * n / stages - s * n / stages).collect(),
                out: if s + 1 == stages { out.take() } else { None },
            })
            .collect())
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
    /// Trees per minibatch.
    pub batch: usize,
    /// Where the loss is taken.
    pub loss_on: LossOn,
    /// Bound on the joint gradient norm of all stages.
    pub clip: Option<f32>,
    /// Stop after this many minibatches in all.
    pub max_steps: Option<u64>,
}

impl PipeSettings {
    /// Checks the plan against the number of stages: at least one micro-batch, and for 2BW at
    /// least one per stage.
    pub fn check(&self, stages: usize) -> Result<()> {
        let m = self.micro_batches;
        if m == 0 || (self.kind == Kind::TwoBw && m < stages) {
            return Err(Error::input(
                "--micro-batches",
                format!("at least 1, and at least the number of stages ({stages}) for 2BW"),
                m.to_string(),
            ));
        }
        Ok(())
    }
}

/// One micro-batch, merged.
struct Micro<'a> {
    graphs: Vec<&'a InputGraph>,
    words: Vec<u32>,
    targets: Vec<Option<u32>>,
    /// Targets in the whole minibatch: the loss is their mean.
    denom: usize,
    /// Trees in the whole minibatch if this is its last micro-batch.
    ends: Option<usize>,
}

/// The micro-batches of `minibatches`, `m` per minibatch (balanced by vertex count; some may be
/// empty when a minibatch has few trees).
fn micro_batches<'a>(minibatches: &[Vec<&'a TreeExample>], m: usize, loss_on: LossOn) -> Result<Vec<Micro<'a>>> {
    let mut out = Vec::with_capacity(minibatches.len() * m);
    for examples in minibatches {
        let (denom, parts) = split(examples, m, loss_on)?;
        for (i, r) in parts.iter().enumerate() {
            let b = batch(&examples[r.clone()]);
            let targets = loss_on.select(&b.graphs, &b.labels)?;
            let ends = (i + 1 == parts.len()).then_some(examples.len());
            out.push(Micro { graphs: b.graphs, words: b.words, targets, denom, ends });
        }
    }
    Ok(out)
}

/// Gradients of one minibatch on one stage, summed over its micro-batches in order.
#[derive(Default)]
struct Accum {
    cell: Vec<Vec<Vec<f32>>>,
    classifier: Vec<Vec<f32>>,
    parts: Vec<SparseGrad>,
    embedding: SparseGrad,
    stats: StepStats,
    squares: f64,
}

fn add_into(dst: &mut Vec<f32>, src: Vec<f32>) {
    if dst.is_empty() {
        *dst = src;
    } else {
        dst.iter_mut().zip(&src).for_each(|(d, s)| *d += s);
    }
}

impl Accum {
    /// Every dense and sparse gradient value, for clipping.
    fn all_mut(&mut self) -> Vec<&mut [f32]> {
        let mut all: Vec<&mut [f32]> = self.cell.iter_mut().flatten().map(Vec::as_mut_slice).collect();
        all.extend(self.classifier.iter_mut().map(Vec::as_mut_slice));
        all.push(&mut self.embedding.values);
        all
    }
}

/// One stage's gradients of one minibatch (see [`Stage::gradients`]).
pub struct MinibatchGrads(Accum);

/// A worker's part of a pipeline: its layers, their optimizer state, and the engines of the
/// micro-batches in flight, each on a replica of the stage's backend.
pub struct Stage<B: Backend = CpuBackend> {
    /// The layers this stage holds (the newest weights).
    pub part: Stack,
    /// The optimizer of this stage's parameters.
    pub opt: Optimizer,
    /// Optimizer steps applied to `part`.
    pub version: usize,
    /// Best dev accuracy so far (on the last stage).
    pub best_dev: f64,
    /// Test accuracy at the best dev accuracy (on the last stage).
    pub test_acc: f64,
    /// The RNG state the next epoch's order is drawn from.
    pub order: Rng,
    backend: B,
    /// The output layer's head and the weights version it holds (on the last stage).
    head: Option<(ClassHead<B>, usize)>,
    engines: Vec<Vec<Engine<B>>>,
    loaded: Vec<Option<usize>>,
    push_grads: Vec<Vec<f32>>,
    acc: Option<Accum>,
    pending: VecDeque<Accum>,
}

impl Stage {
    /// A stage holding `part`, updated by `opt`, on the CPU; epochs are shuffled by `order`.
    pub fn new(part: Stack, opt: Optimizer, order: Rng) -> Stage {
        Stage::on(CpuBackend::new(), part, opt, order)
    }
}

impl<B: Backend> Stage<B> {
    /// A stage holding `part`, updated by `opt`, whose engines run on replicas of `backend`
    /// ([`Backend::replica`]); epochs are shuffled by `order`.
    pub fn on(backend: B, part: Stack, opt: Optimizer, order: Rng) -> Stage<B> {
        Stage {
            backend,
            part,
            opt,
            version: 0,
            best_dev: 0.0,
            test_acc: 0.0,
            order,
            head: None,
            engines: Vec::new(),
            loaded: Vec::new(),
            push_grads: Vec::new(),
            acc: None,
            pending: VecDeque::new(),
        }
    }

    /// One engine per layer for each of `slots` micro-batches in flight.
    fn make_slots(&mut self, slots: usize) -> Result<()> {
        let skip_padding = self.part.embed.as_ref().is_some_and(|e| e.padding().is_some());
        self.engines = (0..slots)
            .map(|_| {
                self.part
                    .layers
                    .iter()
                    .enumerate()
                    .map(|(k, l)| {
                        let mut e = Engine::new(self.backend.replica()?, l.f.clone(), &l.params)?;
                        // Padding rows of the embedding get no gradient, so layer 0 need not form it.
                        e.set_skip_padding_grads(k == 0 && skip_padding);
                        Ok(e)
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        self.loaded = vec![Some(self.version); slots];
        self.push_grads = vec![Vec::new(); slots];
        Ok(())
    }

    /// The output layer's head with the newest weights (on the last stage; `None` elsewhere).
    fn head(&mut self) -> Result<Option<&mut ClassHead<B>>> {
        let Some(out) = &self.part.out else { return Ok(None) };
        match &mut self.head {
            Some((head, version)) if *version != self.version => {
                head.head().engine().set_params(&out.params)?;
                *version = self.version;
            }
            Some(_) => {}
            None => {
                self.head = Some((ClassHead::new(self.backend.replica()?, out.f.clone(), &out.params)?, self.version))
            }
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

    /// Checks that this stage's part fits its place: the embedding on the first stage only, the
    /// classifier on the last only.
    fn check_place(&self, mail: &Mailbox<'_>) -> Result<()> {
        let (rank, stages) = (mail.rank(), mail.size());
        if self.part.embed.is_some() != (rank == 0) || self.part.out.is_some() != (rank + 1 == stages) {
            return Err(Error::input(
                format!("pipeline stage {rank} of {stages}"),
                "the parts of Stack::split in order (embedding first, classifier last)",
                "a part that belongs elsewhere",
            ));
        }
        Ok(())
    }

    fn width_in(&self) -> usize {
        self.part.layers.first().map_or(0, |l| l.width(true))
    }

    fn width_out(&self) -> usize {
        self.part.layers.last().map_or(0, |l| l.width(false))
    }

    /// The input rows of a micro-batch: looked up (stage 0) or received from the stage before.
    fn input(&self, mail: &mut Mailbox<'_>, words: &[u32], tag: u8) -> Result<Vec<f32>> {
        match &self.part.embed {
            Some(e) => e.lookup(words),
            None => mail.recv_f32(mail.rank() - 1, tag, words.len() * self.width_in()),
        }
    }

    /// The forward pass of a micro-batch in slot `k`, through each layer's engine with its
    /// schedule from `plans` (one per layer; none for an empty micro-batch).
    fn forward(&mut self, mail: &mut Mailbox<'_>, mb: &Micro<'_>, k: usize, plans: Vec<Planned<'_>>) -> Result<()> {
        self.load(k)?;
        let mut x = self.input(mail, &mb.words, ACT)?;
        if !mb.words.is_empty() {
            if plans.len() != self.engines[k].len() {
                return Err(Error::Worker {
                    rank: mail.rank(),
                    msg: format!("{} schedules for {} layers", plans.len(), self.engines[k].len()),
                });
            }
            for (e, plan) in self.engines[k].iter_mut().zip(plans) {
                x = e.forward_planned(plan, &[Pull::Rows(&x)], None)?.swap_remove(0);
            }
        }
        let Some(out) = self.head()? else { return mail.send_f32(mail.rank() + 1, ACT, &x) };
        self.push_grads[k] = if mb.words.is_empty() {
            Vec::new()
        } else {
            let step = out.loss_over(&x, &mb.targets, mb.denom)?;
            let acc = self.acc.get_or_insert_with(Accum::default);
            acc.classifier.resize_with(step.grads.len(), Vec::new);
            for (c, g) in acc.classifier.iter_mut().zip(step.grads) {
                add_into(c, g);
            }
            let s = &mut acc.stats;
            (s.loss, s.correct, s.count) = (s.loss + step.loss, s.correct + step.correct, s.count + step.count);
            s.vertices += mb.words.len();
            step.grad_input
        };
        Ok(())
    }

    /// The backward pass of a micro-batch; after a minibatch's last one, returns its trees and
    /// numbers.
    fn backward(
        &mut self,
        mail: &mut Mailbox<'_>,
        mb: &Micro<'_>,
        k: usize,
        clip: bool,
    ) -> Result<Option<(usize, StepStats)>> {
        let mut g = match self.part.out {
            Some(_) => std::mem::take(&mut self.push_grads[k]),
            None => mail.recv_f32(mail.rank() + 1, GRAD, mb.words.len() * self.width_out())?,
        };
        let acc = self.acc.get_or_insert_with(Accum::default);
        if !mb.words.is_empty() {
            acc.cell.resize_with(self.engines[k].len(), Vec::new);
            for (e, cell) in self.engines[k].iter_mut().zip(&mut acc.cell).rev() {
                let mut grads = e.backward(&[&g])?;
                cell.resize_with(grads.params.len(), Vec::new);
                for (c, p) in cell.iter_mut().zip(grads.params) {
                    add_into(c, p);
                }
                g = grads.pulls.swap_remove(0);
            }
        }
        match &self.part.embed {
            Some(e) if !mb.words.is_empty() => acc.parts.push(e.sparse_grad(&mb.words, &g)?),
            Some(_) => {}
            None => mail.send_f32(mail.rank() - 1, GRAD, &g)?,
        }
        let Some(trees) = mb.ends else { return Ok(None) };
        let mut acc = self.acc.take().unwrap_or_default();
        if let Some(e) = &self.part.embed {
            acc.embedding = merge(&acc.parts, e.dim());
        }
        if clip {
            share_norm(&mut acc, mail)?;
        }
        let stats = acc.stats;
        self.pending.push_back(acc);
        Ok(Some((trees, stats)))
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
            let layers = self.part.layers.iter_mut().zip(&acc.cell).enumerate();
            let mut tensors: Vec<_> = layers.map(|(l, (layer, grads))| (format!("layer{l}"), layer, grads)).collect();
            tensors.extend(self.part.out.as_mut().map(|out| (CLASSIFIER.to_string(), out, &acc.classifier)));
            let dense: Vec<(String, &mut [f32], &[f32])> = tensors
                .into_iter()
                .flat_map(|(of, layer, grads)| names(&of, &layer.f).into_iter().zip(&mut layer.params).zip(grads))
                .map(|((n, p), g)| (n, p.as_mut_slice(), g.as_slice()))
                .collect();
            let embedding = std::iter::once(("embedding", acc.embedding.values.as_slice()));
            let named = dense.iter().map(|(n, _, g)| (n.as_str(), *g)).chain(embedding);
            check_finite(self.version as u64 + 1, "the gradient of", named)?;
            update(&mut self.opt, dense, self.part.embed.as_mut().map(|e| (e, &acc.embedding)));
            self.version += 1;
        }
        Ok(())
    }

    /// Trains on `minibatches` (trees, in order) as stage `coll.rank()` of `coll.size()`; the
    /// last stage reports every finished minibatch to `done` with its numbers.
    pub fn train(
        &mut self,
        minibatches: &[Vec<&TreeExample>],
        plan: &PipeSettings,
        coll: &mut dyn Collective,
        done: &mut dyn FnMut(usize, StepStats),
    ) -> Result<()> {
        let mut mail = Mailbox::new(coll);
        self.train_on(&mut mail, minibatches, plan, done)
    }

    /// The gradients of one minibatch at the current weights, cut into `plan.micro_batches`
    /// micro-batches and summed, without applying them (every stage must call it).
    pub fn gradients(
        &mut self,
        minibatch: &[&TreeExample],
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

    fn train_on(
        &mut self,
        mail: &mut Mailbox<'_>,
        minibatches: &[Vec<&TreeExample>],
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
    fn run_ops(
        &mut self,
        mail: &mut Mailbox<'_>,
        minibatches: &[Vec<&TreeExample>],
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
        let micro = micro_batches(minibatches, m, plan.loss_on)?;
        let base = self.version;
        let ops = schedule::ops(plan.kind, rank, stages, minibatches.len(), m);
        // The steps of the loop: each forward pass with the backward passes after it (and any
        // backward passes before the first forward), its micro-batch scheduled ahead.
        let starts: Vec<usize> = (0..ops.len()).filter(|&i| i == 0 || matches!(ops[i], Op::Forward(_))).collect();
        let planners: Vec<Vec<Planner>> =
            self.engines.iter().map(|s| s.iter().map(Engine::planner).collect()).collect();
        let prepare = |u: usize| match ops[starts[u]] {
            Op::Forward(j) if !micro[j].words.is_empty() => {
                planners[j % slots].iter().map(|p| p.plan(&micro[j].graphs)).collect::<Result<Vec<_>>>()
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
                        if let Some((trees, stats)) = self.backward(mail, &micro[j], j % slots, plan.clip.is_some())? {
                            if self.part.out.is_some() {
                                done(trees, stats);
                            }
                        }
                    }
                }
            }
            Ok(true)
        })
    }

    /// Root accuracy over `data`, run through the pipeline in inference mode; every stage must
    /// call it, and the last stage's answer is the one that counts (the others return 0).
    fn accuracy(&mut self, mail: &mut Mailbox<'_>, data: &[TreeExample]) -> Result<f64> {
        self.check_place(mail)?;
        if self.engines.is_empty() {
            self.make_slots(mail.size() - mail.rank())?;
        }
        self.load(0)?;
        let (mut correct, mut count) = (0usize, 0usize);
        for chunk in data.chunks(256) {
            let refs: Vec<&TreeExample> = chunk.iter().collect();
            let b = batch(&refs);
            let mut x = self.input(mail, &b.words, ACT)?;
            for e in &mut self.engines[0] {
                x = e.infer(&b.graphs, &[Pull::Rows(&x)])?.swap_remove(0);
            }
            let Some(out) = self.head()? else {
                mail.send_f32(mail.rank() + 1, ACT, &x)?;
                continue;
            };
            let predicted = out.predict(&x)?;
            for (row, t) in LossOn::Root.select(&b.graphs, &b.labels)?.iter().enumerate() {
                if let Some(t) = t {
                    count += 1;
                    correct += usize::from(predicted[row] == *t as usize);
                }
            }
        }
        Ok(if count == 0 { 0.0 } else { correct as f64 / count as f64 })
    }

    /// Trains for `plan.epochs` epochs (or `plan.max_steps` minibatches) as stage `coll.rank()`
    /// of `coll.size()`, evaluating on dev after every epoch (and on test when dev improves).
    /// The last stage reports `events` and holds the accuracies.
    pub fn fit(
        &mut self,
        data: Splits<'_>,
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
            let mut minibatches: Vec<Vec<&TreeExample>> =
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
            self.train_on(&mut mail, &minibatches, plan, &mut |trees, stats| {
                loss += f64::from(stats.loss);
                events(Event::Trees(trees));
            })?;
            summary.train_seconds += start.elapsed().as_secs_f64();
            summary.sentences += minibatches.iter().map(Vec::len).sum::<usize>();
            steps += minibatches.len() as u64;
            let dev = self.accuracy(&mut mail, data.dev)?;
            let improved = dev > self.best_dev;
            let me = mail.rank();
            for to in (0..mail.size()).filter(|&r| last && r != me) {
                mail.send(to, FLAG, vec![u8::from(improved)])?;
            }
            let improved = if last { improved } else { mail.recv(mail.size() - 1, FLAG)? == [1] };
            if improved {
                let test = self.accuracy(&mut mail, data.test)?;
                (self.best_dev, self.test_acc) = (dev, test);
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
