//! A pipeline stage: its engines per micro-batch in flight, the passes of a schedule over a
//! window of minibatches, and the updates of its part.

use super::{Layer, Part, PipeSettings};
use crate::dist::collective::{Collective, Mailbox};
use crate::dist::data_parallel::{merge, shard, Pending};
use crate::dist::schedule::{self, Kind, MicroPass};
use crate::engine::{Engine, Pass, Planned, Planner, Pull, SparseGrad};
use crate::head::Head;
use crate::model::{self, layer_prefix, AsExample, Example, Layout, Outputs};
use crate::optim::{check_finite, clip_to, sum_squares, Optimizer};
use crate::readout::Readout;
use crate::trainer::step::{add_all, all_values, names, update};
use crate::trainer::{each_step, Scores, StepStats};
use crate::{Backend, CpuBackend, DropoutKey, InputGraph};
use arbor_core::error::{Error, Result};
use std::collections::VecDeque;

/// Message tags: activations, their gradients, gradient norms.
const ACT: u8 = 0;
const GRAD: u8 = 1;
const NORM: u8 = 2;

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

impl Accum {
    /// Every dense and sparse gradient value, for clipping.
    fn all_mut(&mut self) -> Vec<&mut [f32]> {
        all_values(&mut self.cells, &mut self.head, &mut self.embedding)
    }
}

/// What a stage's updates use: the optimizer (none where no update is due), the bound on the
/// joint gradient norm of all stages, and what is told of the stage after each update.
pub(super) struct Updates<'u, B: Backend> {
    pub(super) opt: Option<&'u mut Optimizer>,
    pub(super) clip: Option<f32>,
    pub(super) updated: &'u mut dyn FnMut(&Stage<B>) -> Result<()>,
}

/// The head's inputs over a micro-batch, the pooling if any, the rows' width and how many
/// were read.
type HeadInputs = (Vec<Vec<f32>>, Option<crate::readout::Pooled>, usize, usize);

/// One stage's gradients of one minibatch (see [`Stage::gradients`]).
pub struct MinibatchGrads(Accum);

/// A worker's part of a pipeline: its layers, their optimizer state, and the engines of the
/// micro-batches in flight, each on a replica of the stage's backend.
pub struct Stage<B: Backend = CpuBackend> {
    /// The part of the model this stage holds (the newest weights).
    part: Part,
    /// How it runs a minibatch.
    pub(super) plan: PipeSettings,
    /// Optimizer steps applied to `part` (since the start of training, in a run).
    pub(super) version: u64,
    backend: B,
    /// The head and the weights version it holds (on the last stage).
    head: Option<(Head<B>, u64)>,
    engines: Vec<Vec<Engine<B>>>,
    loaded: Vec<Option<u64>>,
    push_grads: Vec<Vec<Vec<f32>>>,
    acc: Option<Accum>,
    pending: VecDeque<Accum>,
    /// Data-parallel replicas of the pipeline (see [`Stage::replicated`]).
    replicas: usize,
}

impl Stage {
    /// A stage holding `part`, running minibatches as `plan` says, on the CPU.
    pub fn new(part: Part, plan: PipeSettings) -> Stage {
        Stage::on(CpuBackend::new(), part, plan)
    }
}

impl<B: Backend> Stage<B> {
    /// A stage holding `part`, running minibatches as `plan` says, whose engines run on
    /// replicas of `backend` ([`Backend::replica`]).
    pub fn on(backend: B, part: Part, plan: PipeSettings) -> Stage<B> {
        Stage {
            backend,
            part,
            plan,
            version: 0,
            head: None,
            engines: Vec::new(),
            loaded: Vec::new(),
            push_grads: Vec::new(),
            acc: None,
            pending: VecDeque::new(),
            replicas: 1,
        }
    }

    /// This stage as one of `replicas` data-parallel copies of its pipeline: the workers of a
    /// group of `P × replicas` (`P` stages) hold stage `s` of replica `r` at rank `r·P + s`;
    /// each replica runs its share of every minibatch (balanced by vertex count), and a stage's
    /// replicas sum their gradients before the update, so a step equals one pipeline's on the
    /// whole minibatch up to the order of the sums.
    pub fn replicated(mut self, replicas: usize) -> Stage<B> {
        self.replicas = replicas.max(1);
        self
    }

    /// Data-parallel replicas of this stage's pipeline (1: one pipeline).
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// Tagged messages over `coll` among this stage's pipeline (its replica's stages).
    pub(super) fn mailbox<'c>(&self, coll: &'c mut dyn Collective) -> Result<Mailbox<'c>> {
        Mailbox::grid(coll, self.replicas)
    }

    /// The part of the model this stage holds, with the newest weights.
    pub fn part(&self) -> &Part {
        &self.part
    }

    /// The part this stage holds.
    pub fn into_part(self) -> Part {
        self.part
    }

    /// Takes `part`'s learned values (a part of the same shape): every engine loads them
    /// before its next pass.
    pub(super) fn set_part(&mut self, part: Part) {
        self.part = part;
        self.loaded.iter_mut().for_each(|l| *l = None);
        self.head = None;
    }

    /// The backend the stage's engines run on.
    pub(super) fn backend(&self) -> &B {
        &self.backend
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
        let fed = self.part.input.as_ref().map(|(e, feeds)| model::Fed::of(feeds, e)).unwrap_or_default();
        let f = self
            .part
            .layers
            .first()
            .map(|l| &l.f)
            .ok_or_else(|| Error::input("pipeline stage", "at least one layer", "none"))?;
        model::layout(batch, self.part.graphs, self.part.readout, fed, f)
    }

    /// The micro-batches of replica `replica`'s share (of `replicas`) of `minibatches` (the
    /// first numbered `step`), `m` per minibatch (balanced by vertex count; some may be empty
    /// when a minibatch has few examples).
    fn micro_batches<'a, E: AsExample>(
        &self,
        minibatches: &[Vec<&'a E>],
        m: usize,
        step: u64,
        (replica, replicas): (usize, usize),
    ) -> Result<Vec<Micro<'a>>> {
        let mut out = Vec::with_capacity(minibatches.len() * m);
        for (t, batch) in minibatches.iter().enumerate() {
            let examples: Vec<Example<'a>> = batch.iter().map(|e| e.example()).collect();
            let denom = batch.iter().map(|e| e.terms()).sum();
            let weights: Vec<usize> = examples.iter().map(|e| e.graphs().map(InputGraph::len).sum()).collect();
            let share = shard(&weights, replicas).get(replica).cloned().unwrap_or_default();
            let parts: Vec<_> = shard(&weights[share.clone()], m)
                .into_iter()
                .map(|r| share.start + r.start..share.start + r.end)
                .collect();
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
    /// `plans`, one per layer) or in slot 0 (inference, `plans` empty): what the top layer
    /// pushed at every vertex (its rows first).
    fn layers(
        &mut self,
        mail: &mut Mailbox<'_>,
        layout: &Layout<'_>,
        k: usize,
        plans: Option<Vec<Planned<'_>>>,
        key: DropoutKey,
    ) -> Result<Vec<Vec<f32>>> {
        let n = layout.words.len();
        let mut x = match &self.part.input {
            Some(_) => vec![Vec::new()],
            None => vec![mail.recv_f32(mail.rank() - 1, ACT, n * self.width_in())?],
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
            let input = [Pull::Rows(&x[0])];
            let pulls = match (&part.input, i) {
                (Some((embedding, feeds)), 0) => {
                    model::pulls(embedding, feeds, dropped.as_ref().unwrap_or(layout), false)
                }
                _ => input.to_vec(),
            };
            x = if train {
                e.set_dropout_key(DropoutKey { seed: e.dropout_key().seed, ..key });
                let plan = plans.next().ok_or_else(|| Error::Worker {
                    rank: mail.rank(),
                    msg: format!("no schedule for layer {}", part.first + i),
                })?;
                e.run(Pass::planned(plan, &pulls))?
            } else {
                e.run(Pass::infer(&layout.graphs, &pulls))?
            };
        }
        Ok(x)
    }

    /// The head's inputs over the top layer's rows `x` of `layout`, and the pooling if any.
    fn head_inputs(&self, x: Vec<Vec<f32>>, layout: &Layout<'_>, targets: Vec<f32>) -> Result<HeadInputs> {
        let width = self.width_out();
        let (read, pooled) = model::read_rows(x, layout, self.part.readout, width, false)?;
        let rows = read.len() / width.max(1);
        Ok((model::head_inputs(read, self.part.graphs, width, targets), pooled, width, rows))
    }

    /// The forward pass of a micro-batch in slot `k`, through each layer's engine with its
    /// schedule from `plans` (one per layer; none for an empty micro-batch); on the last stage
    /// also the head's forward and backward passes.
    fn forward(&mut self, mail: &mut Mailbox<'_>, mb: &Micro<'_>, k: usize, plans: Vec<Planned<'_>>) -> Result<()> {
        self.load(k)?;
        let key = DropoutKey { seed: 0, step: mb.step, first: mb.first * self.part.graphs };
        let x = self.layers(mail, &mb.layout, k, Some(plans), key)?;
        if self.part.head.is_none() {
            return mail.send_f32(mail.rank() + 1, ACT, &x[0]);
        }
        if mb.examples == 0 {
            self.push_grads[k] = Vec::new();
            return Ok(());
        }
        let (inputs, pooled, width, rows) = self.head_inputs(x, &mb.layout, mb.targets.clone())?;
        let (readout, graphs) = (self.part.readout, self.part.graphs);
        let head = self.head()?.ok_or_else(|| Error::Worker { rank: mail.rank(), msg: "no head".into() })?;
        let key = head.dropout_key();
        head.engine().set_dropout_key(DropoutKey { step: mb.step, first: mb.head_first, ..key });
        let outputs = head.forward(&inputs.iter().map(Vec::as_slice).collect::<Vec<_>>())?;
        let hg = head.backward(1.0 / mb.denom.max(1) as f32)?;
        let loss = outputs.get(head.loss_output()).map_or(0.0, |l| l.iter().sum::<f32>()) / mb.denom.max(1) as f32;
        let dh = model::read_grad(&hg.pulls, graphs, width, rows);
        let top = self.engines[k].last().ok_or_else(|| Error::Worker { rank: mail.rank(), msg: "no layer".into() })?;
        self.push_grads[k] = model::unread(dh, &mb.layout, readout, pooled.as_ref(), top.function());
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
        // The gradients of the top layer's outputs: its rows' (and an attention readout's
        // scores') on the last stage, else the next stage's input gradient.
        let mut g = match self.part.head {
            Some(_) => std::mem::take(&mut self.push_grads[k]),
            None => vec![mail.recv_f32(mail.rank() + 1, GRAD, n * self.width_out())?],
        };
        let acc = self.acc.get_or_insert_with(Accum::default);
        if n > 0 {
            acc.cells.resize_with(self.engines[k].len(), Vec::new);
            let bottom = self.part.input.is_some();
            for (i, (e, cell)) in self.engines[k].iter_mut().zip(&mut acc.cells).enumerate().rev() {
                let mut grads = e.backward(&g.iter().map(Vec::as_slice).collect::<Vec<_>>())?;
                add_all(cell, std::mem::take(&mut grads.params));
                if bottom && i == 0 {
                    // The word vectors' gradient, as rows of the looked-up words.
                    acc.parts.extend(grads.tables.into_iter().flatten());
                    g = Vec::new();
                } else {
                    g = vec![grads.pulls.swap_remove(0)];
                }
            }
        }
        if self.part.input.is_none() {
            mail.send_f32(mail.rank() - 1, GRAD, g.first().map_or(&[][..], Vec::as_slice))?;
        }
        let Some(examples) = mb.ends else { return Ok(None) };
        let mut acc = self.acc.take().unwrap_or_default();
        if let Some((e, _)) = &self.part.input {
            acc.embedding = merge(&acc.parts, e.dim());
        }
        if mail.replica_count() > 1 {
            sum_replicas(&mut acc, &self.part, mail)?;
        }
        if clip {
            share_norm(&mut acc, mail)?;
        }
        let stats = acc.stats;
        self.pending.push_back(acc);
        Ok(Some((examples, stats)))
    }

    /// Applies finished minibatch gradients, oldest first, until the weights are `version`.
    fn catch_up(&mut self, mail: &mut Mailbox<'_>, version: u64, up: &mut Updates<'_, B>) -> Result<()> {
        while self.version < version {
            let Some(mut acc) = self.pending.pop_front() else {
                return Err(Error::Worker {
                    rank: mail.rank(),
                    msg: format!("weights version {version} needed before its gradients are complete"),
                });
            };
            if let Some(max) = up.clip {
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
            check_finite(self.version + 1, "the gradient of", named)?;
            let opt = up
                .opt
                .as_deref_mut()
                .ok_or_else(|| Error::Worker { rank: mail.rank(), msg: "an update with no optimizer".into() })?;
            update(opt, dense, part.input.as_mut().map(|(e, _)| (e, &acc.embedding)))?;
            self.version += 1;
            (up.updated)(self)?;
        }
        Ok(())
    }

    /// Trains on `minibatches` (examples, in order) as its stage of `coll`'s workers (worker
    /// `r·P + s` is stage `s` of replica `r`, [`Stage::replicated`]),
    /// updating with `opt` and bounding the joint gradient norm of all stages by `clip`; the
    /// last stage reports every finished minibatch to `done` with its numbers.
    pub fn train<E: AsExample>(
        &mut self,
        opt: &mut Optimizer,
        minibatches: &[Vec<&E>],
        clip: Option<f32>,
        coll: &mut dyn Collective,
        done: &mut dyn FnMut(usize, StepStats),
    ) -> Result<()> {
        let mut up = Updates { opt: Some(opt), clip, updated: &mut |_| Ok(()) };
        self.window(&mut self.mailbox(coll)?, minibatches, &mut up, done)
    }

    /// The gradients of one minibatch at the current weights, cut into micro-batches as the
    /// stage's plan says and summed, without applying them (every stage must call it).
    pub fn gradients<E: AsExample>(&mut self, minibatch: &[&E], coll: &mut dyn Collective) -> Result<MinibatchGrads> {
        let mut mail = self.mailbox(coll)?;
        let kind = std::mem::replace(&mut self.plan.kind, Kind::OneFOneBFlush);
        let mut up = Updates { opt: None, clip: None, updated: &mut |_| Ok(()) };
        let ran = self.run_ops(&mut mail, &[minibatch.to_vec()], &mut up, &mut |_, _| {});
        self.plan.kind = kind;
        ran?;
        let acc = self
            .pending
            .pop_back()
            .ok_or_else(|| Error::Worker { rank: mail.rank(), msg: "the minibatch produced no gradients".into() })?;
        Ok(MinibatchGrads(acc))
    }

    /// Applies gradients from [`Stage::gradients`] (of any weights) to the current weights with
    /// `opt`, `clip` bounding the joint norm of all stages (every stage must call it).
    pub fn update(
        &mut self,
        g: MinibatchGrads,
        opt: &mut Optimizer,
        clip: Option<f32>,
        coll: &mut dyn Collective,
    ) -> Result<()> {
        let mut mail = self.mailbox(coll)?;
        let mut acc = g.0;
        if clip.is_some() {
            share_norm(&mut acc, &mut mail)?;
        }
        self.pending.push_back(acc);
        let mut up = Updates { opt: Some(opt), clip, updated: &mut |_| Ok(()) };
        self.catch_up(&mut mail, self.version + self.pending.len() as u64, &mut up)
    }

    /// Trains on `minibatches` and applies every update (the pipeline drains).
    pub(super) fn window<E: AsExample>(
        &mut self,
        mail: &mut Mailbox<'_>,
        minibatches: &[Vec<&E>],
        up: &mut Updates<'_, B>,
        done: &mut dyn FnMut(usize, StepStats),
    ) -> Result<()> {
        let base = self.version;
        self.run_ops(mail, minibatches, up, done)?;
        self.catch_up(mail, base + minibatches.len() as u64, up)
    }

    /// Runs this stage's passes over `minibatches`, applying updates only as the schedule
    /// needs them.
    fn run_ops<E: AsExample>(
        &mut self,
        mail: &mut Mailbox<'_>,
        minibatches: &[Vec<&E>],
        up: &mut Updates<'_, B>,
        done: &mut dyn FnMut(usize, StepStats),
    ) -> Result<()> {
        let (rank, stages, plan) = (mail.rank(), mail.size(), self.plan);
        let m = plan.micro_batches;
        let batch = minibatches.iter().map(Vec::len).max().unwrap_or(0);
        plan.check(stages, batch.max(m))?;
        self.check_place(mail)?;
        let slots = stages - rank;
        if self.engines.len() != slots {
            self.make_slots(slots)?;
        }
        let base = self.version;
        let micro = self.micro_batches(minibatches, m, base, (mail.replica(), mail.replica_count()))?;
        let ops = schedule::ops(plan.kind, rank, stages, minibatches.len(), m);
        // The steps of the loop: each forward pass with the backward passes after it (and any
        // backward passes before the first forward), its micro-batch scheduled ahead.
        let starts: Vec<usize> =
            (0..ops.len()).filter(|&i| i == 0 || matches!(ops[i], MicroPass::Forward(_))).collect();
        let planners: Vec<Vec<Planner>> =
            self.engines.iter().map(|s| s.iter().map(Engine::planner).collect()).collect();
        let prepare = |u: usize| match ops[starts[u]] {
            MicroPass::Forward(j) if micro[j].vertices() > 0 => {
                planners[j % slots].iter().map(|p| p.plan(&micro[j].layout.graphs)).collect::<Result<Vec<_>>>()
            }
            _ => Ok(Vec::new()),
        };
        each_step(starts.len(), &prepare, &mut |u, mut plans| {
            let end = starts.get(u + 1).copied().unwrap_or(ops.len());
            for &op in &ops[starts[u]..end] {
                match op {
                    MicroPass::Forward(j) => {
                        // Minibatch t runs on W(t) after a flush, on W(t−1) under 2BW.
                        let lagging = (j / m).saturating_sub(plan.kind.lag()) as u64;
                        self.catch_up(mail, base + lagging, up)?;
                        self.forward(mail, &micro[j], j % slots, std::mem::take(&mut plans))?;
                    }
                    MicroPass::Backward(j) => {
                        if let Some((examples, stats)) = self.backward(mail, &micro[j], j % slots, up.clip.is_some())? {
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
    pub(super) fn score<E: AsExample>(&mut self, mail: &mut Mailbox<'_>, data: &[E]) -> Result<Scores> {
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
                mail.send_f32(mail.rank() + 1, ACT, &x[0])?;
                continue;
            };
            let targets = examples.iter().flat_map(|e| e.target.iter().copied()).collect();
            let (inputs, ..) = self.head_inputs(x, &layout, targets)?;
            let head = self.head()?.ok_or_else(|| Error::Worker { rank: mail.rank(), msg: "no head".into() })?;
            out.extend(head.infer(&inputs.iter().map(Vec::as_slice).collect::<Vec<_>>())?);
        }
        outputs.map_or(Ok(Scores::new()), |out| E::score(&out, data))
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

/// Sums a finished minibatch's gradients and numbers over the replicas of this stage (in
/// replica order, so every replica gets the same bits): the layers' and the head's as dense
/// buckets (zeros where a replica's share ran nothing), the word vectors' rows merged.
fn sum_replicas(acc: &mut Accum, part: &Part, mail: &mut Mailbox<'_>) -> Result<()> {
    let zeros = |l: &Layer| l.params.iter().map(|p| vec![0.0; p.len()]).collect::<Vec<_>>();
    acc.cells.resize_with(part.layers.len(), Vec::new);
    for (cell, layer) in acc.cells.iter_mut().zip(&part.layers) {
        if cell.is_empty() {
            *cell = zeros(layer);
        }
    }
    if let (true, Some(head)) = (acc.head.is_empty(), &part.head) {
        acc.head = zeros(head);
    }
    // The layers, the head and the numbers, each as one layer of buckets.
    let s = acc.stats;
    let mut layers = std::mem::take(&mut acc.cells);
    layers.push(std::mem::take(&mut acc.head));
    layers.push(vec![vec![s.loss, s.correct as f32, s.count as f32, s.vertices as f32]]);
    let (vocab, dim) = part.input.as_ref().map_or((0, 1), |(e, _)| (e.vocab(), e.dim()));
    let mut coll = mail.replicas();
    let pending = Pending::start(&mut coll, layers, std::mem::take(&mut acc.embedding))?;
    let (mut layers, embedding) = pending.finish(&mut coll, vocab, dim)?;
    let numbers = layers.pop().and_then(|mut n| n.pop()).unwrap_or_default();
    acc.head = layers.pop().unwrap_or_default();
    acc.cells = layers;
    if let [loss, correct, count, vertices] = numbers[..] {
        acc.stats = StepStats {
            loss,
            correct: correct as usize,
            count: count as usize,
            vertices: vertices as usize,
            noise: None,
        };
    }
    acc.embedding = embedding;
    Ok(())
}
