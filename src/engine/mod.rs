//! The engine: runs a vertex function over a scheduled minibatch on a backend.
//!
//! Memory: one arena holds every buffer of the minibatch where the [`MemoryPlan`] puts it (pulled
//! inputs, stored values of F and F', output and state gradients), each ordered by task so a task
//! reads and writes contiguous rows. Parameters and their gradients live in two more buffers. The
//! arena and the index buffer grow when a larger minibatch arrives and are reused otherwise, so a
//! steady-state step allocates no device memory.

mod dedup;
mod facts;
mod sums;

use arbor_batching::{MemoryPlan, Policy, Region, Schedule, Scheduler};
use arbor_core::backend::{Backend, Gemm, IndexLoc, Loc, Mem, Rows, NO_ROW};
use arbor_core::error::{Error, Result};
use arbor_core::fusion::{Kernel, Phase, Plan, Step};
use arbor_core::graph::InputGraph;
use arbor_core::ir::{Func, Op, ParamGrad, Port, ValueId, VertexFn};
use dedup::Shared;
use facts::{Cut, FactCache, Facts, Loads};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

const ARENA: usize = 0;
const PARAMS: usize = 1;
const GRADS: usize = 2;
/// Distinct pulled rows and the products over them (see [`dedup`]).
const SHARED: usize = 3;

/// Which function a value belongs to.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Pass {
    Forward,
    Backward,
}

/// A fused kernel with the stores a task leaves unread taken out: its plan (the pass, and
/// whether it trains: forward, inference or backward), its step, and the stores left out (bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct PrunedKernel {
    pass: Pass,
    trains: bool,
    step: (Phase, usize),
    unread: u64,
}

/// Where the gather index plan of one minibatch lives in the index buffer.
#[derive(Default)]
struct IndexLayout {
    vertices: usize,
    child_offsets: usize,
    child_list: usize,
    len: usize,
}

impl IndexLayout {
    fn new(arity: usize, s: &Schedule) -> IndexLayout {
        let n = s.len();
        let child_offsets = arity * n;
        let child_list = child_offsets + n + 1;
        IndexLayout { vertices: n, child_offsets, child_list, len: child_list + s.child_list.len() }
    }

    /// Where the child rows of slot `slot` for row `row` on are.
    fn slot(&self, slot: usize, row: usize) -> IndexLoc {
        IndexLoc { buf: 0, offset: slot * self.vertices + row }
    }

    /// Rows `row..` of a vertex's children, all slots.
    fn set(&self, data: Loc, row: usize) -> Rows {
        Rows::IndexedSet {
            data,
            offsets: IndexLoc { buf: 0, offset: self.child_offsets + row },
            index: IndexLoc { buf: 0, offset: self.child_list },
        }
    }
}

/// A copy of product rows over distinct pulled rows to the rows of the vertices that pulled them.
#[derive(Clone, Copy)]
struct SharedCopy {
    /// The product (`None`: a looked-up input's own rows).
    value: Option<ValueId>,
    from: Loc,
    to: Loc,
    /// The first vertex row, and where its entry of the map is.
    row: usize,
    map: IndexLoc,
    rows: usize,
    block: usize,
}

/// One pulled input of a minibatch.
#[derive(Clone, Copy, Debug)]
pub enum Pull<'a> {
    /// One row per vertex, in merged-vertex order.
    Rows(&'a [f32]),
    /// Vertex `i` pulls row `ids[i]` of `table` (rows as wide as the input, back to back); the
    /// `padding` id pulls zeros and gets no gradient. Each distinct row is copied in once, and
    /// the backward pass returns the table's gradient per id ([`Gradients::tables`]) without
    /// forming per-vertex rows where it can.
    Lookup {
        /// The table, `rows × width`.
        table: &'a [f32],
        /// One id per vertex, in merged-vertex order.
        ids: &'a [u32],
        /// The id that stands for no row.
        padding: Option<u32>,
    },
}

/// A gradient that touches only some rows of a table.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SparseGrad {
    /// The rows touched, ascending, each once.
    pub rows: Vec<u32>,
    /// Their gradients, `rows.len() × dim`.
    pub values: Vec<f32>,
}

/// Gradients from one backward pass.
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients {
    /// Per pulled input given as [`Pull::Rows`], the gradient rows in merged-vertex order (empty
    /// for an input given as a lookup).
    pub pulls: Vec<Vec<f32>>,
    /// Per pulled input given as [`Pull::Lookup`], its table's gradient summed per id (`None` for
    /// an input given as rows).
    pub tables: Vec<Option<SparseGrad>>,
    /// Per parameter, its gradient (summed over all vertices).
    pub params: Vec<Vec<f32>>,
}

/// An error unless every vertex in `rows` is below `n` (the minibatch's vertex count).
fn check_vertices(what: &str, n: usize, rows: &[usize]) -> Result<()> {
    match rows.iter().find(|&&r| r >= n) {
        None => Ok(()),
        Some(&bad) => Err(Error::input(
            what,
            format!("vertex indices below {n} (the minibatch's vertices)"),
            format!("vertex {bad}"),
        )),
    }
}

/// Runs one vertex function over minibatches of input graphs on a backend.
pub struct Engine<B: Backend> {
    backend: B,
    f: Arc<VertexFn>,
    bufs: Vec<B::Buffer>,
    index: Vec<B::Index>,
    param_at: Vec<usize>,
    scheduler: Arc<Mutex<Scheduler>>,
    schedule: Schedule,
    memory: MemoryPlan,
    index_layout: IndexLayout,
    trained: bool,
    /// Per task, which loads of F are all zeros.
    loads: Vec<Loads>,
    /// Per task, what is known of F's values.
    fwd_facts: Vec<Arc<Facts>>,
    /// Per task, what is known of F′'s values.
    bwd_facts: Vec<Arc<Facts>>,
    facts: FactCache,
    /// Per value of F and of F′: written as zeros where known to be zero (see [`facts::must_fill`]).
    must_fill: (Vec<bool>, Vec<bool>),
    /// Fused kernels without the stores a task leaves unread (see [`facts::unread_stores`]).
    pruned: HashMap<PrunedKernel, Arc<Kernel>>,
    /// Per input, which rows (in row order) are all zeros.
    pull_zero_rows: Vec<Vec<bool>>,
    skip_padding_grads: bool,
    /// Per input: whether a forward product reads it as its left factor.
    pulled_factor: Vec<bool>,
    /// Per input: whether anything reads its rows one per vertex (see [`dedup::rows_read`]); a
    /// looked-up input's rows are copied to the vertices only then.
    rows_read: Vec<bool>,
    /// Per looked-up input: whether its rows were copied to the vertices in this minibatch.
    gathered: Vec<bool>,
    /// Per input whose gradient is `dy·Wᵀ` for a parameter gradient `xᵀ·dy` over it: that
    /// parameter gradient (index into F′'s), through which a looked-up input's table gradient
    /// is formed per distinct row.
    table_grad_via: Vec<Option<usize>>,
    /// Per looked-up input whose table gradient is formed that way in this minibatch: where it
    /// is in the `SHARED` buffer.
    table_grad_at: Vec<Option<usize>>,
    /// Products of F accumulating into a sibling's output (see [`sums`]).
    sums: sums::Sums,
    /// Per input, its distinct rows in this minibatch where sharing them pays.
    shared: Vec<Option<Shared>>,
    /// The part of the `SHARED` buffer after the distinct rows: products over them.
    shared_scratch: Range<usize>,
    /// Scratch columns per distinct row: the widest set of products over one input that run
    /// together, or the widest output gradient a parameter gradient sums per distinct row.
    shared_width: usize,
    /// Per value of F: a product over distinct rows that fused kernels may read in scratch (see
    /// [`dedup::read_by_index`]).
    by_index: Vec<bool>,
    /// Such products of this forward pass left in scratch, not yet copied to their rows.
    in_scratch: Vec<SharedCopy>,
    /// Floating-point operations executed so far (GEMMs and fused kernels).
    flops: u64,
    host: Vec<f32>,
    host_index: Vec<u32>,
}

/// One product `C += op(A)·op(B)` with `C` `m × n` and inner dimension `k`: `a` is where A is,
/// its row stride and whether it is transposed; `b` the same and whether it is a parameter; `c`
/// where C is and its row stride.
fn accumulating(
    mnk: (usize, usize, usize),
    a: (Loc, usize, bool),
    b: (Loc, usize, bool, bool),
    c: (Loc, usize),
) -> Gemm {
    Gemm { accumulate: true, ..Gemm::single(mnk, a, b, c) }
}

fn gemm_flops(g: &Gemm) -> u64 {
    2 * (g.m * g.n * g.k * g.batch) as u64
}

fn internal(msg: String) -> Error {
    Error::Backend { backend: "engine", op: "plan".into(), msg }
}

/// An error unless every graph fits `f` (arity, labels), naming the graph's place.
fn check_graphs(f: &VertexFn, graphs: &[&InputGraph]) -> Result<()> {
    for (gi, g) in graphs.iter().enumerate() {
        g.check_for(f).map_err(|e| match e {
            Error::Graph { reason, .. } => Error::Graph { graph: format!("#{gi} of the minibatch"), reason },
            e => e,
        })?;
    }
    Ok(())
}

/// The parameter gradient `xᵀ·dy` (index into F′'s) whose `dy` gives the gradient of input
/// `input` as `dy·Wᵀ`, if it is formed that way.
fn table_grad_via(f: &VertexFn, input: usize) -> Option<usize> {
    let b = f.backward();
    let Op::MatMul { a: dy, b: w, ta: false, tb: true } = b.func.node(b.pull_grads[input]?).op else { return None };
    let Op::Param { param } = b.func.node(w).op else { return None };
    b.param_grads.iter().position(|pg| match *pg {
        ParamGrad::MatMul { param: p, x, dy: d } => {
            p == param
                && d == dy
                && matches!(b.func.node(x).op, Op::Primal { value } if f.forward().node(value).op == Op::Pull { input })
        }
        ParamGrad::SumRows { .. } => false,
    })
}

/// An error unless `ids` names, for each of `n` vertices, a row of `table` (rows as wide as
/// `port`) or the padding id.
fn check_lookup(port: &Port, table: &[f32], ids: &[u32], padding: Option<u32>, n: usize) -> Result<()> {
    let block = port.shape.numel();
    if ids.len() != n {
        return Err(Error::input(
            format!("ids of input `{}`", port.name),
            format!("{n} (one per vertex)"),
            format!("{}", ids.len()),
        ));
    }
    if block > 0 && !table.len().is_multiple_of(block) {
        return Err(Error::input(
            format!("table of input `{}`", port.name),
            format!("rows of {block} values"),
            format!("{} values", table.len()),
        ));
    }
    let rows = table.len().checked_div(block).unwrap_or(usize::MAX);
    match ids.iter().enumerate().find(|&(_, &id)| Some(id) != padding && id as usize >= rows) {
        Some((v, id)) => Err(Error::input(
            format!("id of vertex {v} (merged-vertex order) for input `{}`", port.name),
            format!("a row of the table (below {rows}) or the padding id"),
            format!("{id}"),
        )),
        None => Ok(()),
    }
}

/// The scheduler, also after a panic on another thread while it was held: it keeps no state
/// between minibatches (its scratch is reset by every schedule), so it is still good.
fn lock(scheduler: &Mutex<Scheduler>) -> std::sync::MutexGuard<'_, Scheduler> {
    scheduler.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Schedules minibatches for one engine, on any thread: a trainer plans minibatch k+1 while
/// the device runs minibatch k, so a forward pass given the plan
/// ([`Engine::forward_planned`]) spends no time scheduling.
#[derive(Clone)]
pub struct Planner {
    f: Arc<VertexFn>,
    scheduler: Arc<Mutex<Scheduler>>,
}

/// A checked and scheduled minibatch, borrowing its graphs (which therefore cannot change
/// before it runs).
pub struct Planned<'g> {
    graphs: Vec<&'g InputGraph>,
    schedule: Schedule,
    scheduler: Arc<Mutex<Scheduler>>,
}

impl Planner {
    /// Checks `graphs` against the vertex function and schedules them.
    pub fn plan<'g>(&self, graphs: &[&'g InputGraph]) -> Result<Planned<'g>> {
        check_graphs(&self.f, graphs)?;
        let mut schedule = Schedule::default();
        lock(&self.scheduler).schedule(graphs, &mut schedule);
        Ok(Planned { graphs: graphs.to_vec(), schedule, scheduler: Arc::clone(&self.scheduler) })
    }
}

/// `values` cut into consecutive pieces of the given sizes.
fn split_sizes<'a>(mut values: &'a mut [f32], sizes: &[usize]) -> Vec<&'a mut [f32]> {
    let mut out = Vec::with_capacity(sizes.len());
    for &n in sizes {
        let n = n.min(values.len());
        let (p, rest) = std::mem::take(&mut values).split_at_mut(n);
        out.push(p);
        values = rest;
    }
    out
}

impl<B: Backend> Engine<B> {
    /// An engine for `f` with initial parameter values (in the order of `f.params()`).
    pub fn new(backend: B, f: VertexFn, params: &[Vec<f32>]) -> Result<Engine<B>> {
        let mut param_at = Vec::with_capacity(f.params().len());
        let mut total = 0;
        for p in f.params() {
            param_at.push(total);
            total += p.shape.numel();
        }
        let bufs = vec![backend.alloc(0)?, backend.alloc(total)?, backend.alloc(total)?, backend.alloc(0)?];
        let mut pulled_factor = vec![false; f.inputs().len()];
        let mut shared_width = 0;
        for v in (0..f.forward().nodes.len()).map(|v| ValueId(v as u32)) {
            if let Some(i) = dedup::pulled_factor(f.forward(), v) {
                pulled_factor[i] = true;
                shared_width += f.forward().node(v).shape.numel();
            }
        }
        for pg in &f.backward().param_grads {
            if let ParamGrad::MatMul { dy, .. } = *pg {
                shared_width = shared_width.max(f.backward().func.node(dy).shape.numel());
            }
        }
        let table_grad_via = (0..f.inputs().len()).map(|i| table_grad_via(&f, i)).collect();
        let rows_read = (0..f.inputs().len()).map(|i| dedup::rows_read(&f, i)).collect();
        let index = vec![backend.alloc_index(0)?];
        let must_fill = facts::must_fill(&f);
        let sums = sums::Sums::new(&f);
        let by_index = dedup::read_by_index(&f, &sums);
        let mut e = Engine {
            backend,
            f: Arc::new(f),
            bufs,
            index,
            param_at,
            scheduler: Arc::default(),
            schedule: Schedule::default(),
            memory: MemoryPlan::default(),
            index_layout: IndexLayout::default(),
            trained: false,
            loads: Vec::new(),
            fwd_facts: Vec::new(),
            bwd_facts: Vec::new(),
            facts: FactCache::default(),
            must_fill,
            pruned: HashMap::new(),
            pull_zero_rows: Vec::new(),
            skip_padding_grads: false,
            pulled_factor,
            rows_read,
            gathered: Vec::new(),
            table_grad_via,
            table_grad_at: Vec::new(),
            sums,
            shared: Vec::new(),
            shared_scratch: 0..0,
            shared_width,
            by_index,
            in_scratch: Vec::new(),
            flops: 0,
            host: Vec::new(),
            host_index: Vec::new(),
        };
        e.set_params(params)?;
        Ok(e)
    }

    /// The vertex function.
    pub fn function(&self) -> &VertexFn {
        &self.f
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The schedule of the last forward pass.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The memory plan of the last forward pass.
    pub fn memory_plan(&self) -> &MemoryPlan {
        &self.memory
    }

    /// Treats all-zero input rows as padding: their gradient is reported as zero and not
    /// computed (e.g. the internal vertices of a constituency tree, which have no word).
    pub fn set_skip_padding_grads(&mut self, skip: bool) {
        self.skip_padding_grads = skip;
        self.facts.clear();
    }

    /// Floating-point operations this engine has executed: `2·m·n·k` per matrix product, one
    /// per element per fused op. Work skipped as known zeros is not counted.
    pub fn flops(&self) -> u64 {
        self.flops
    }

    /// Schedules later minibatches with `policy` (the default batches by height).
    pub fn set_policy(&mut self, policy: Box<dyn Policy>) {
        self.scheduler = Arc::new(Mutex::new(Scheduler::new(policy)));
    }

    /// A handle that schedules minibatches for this engine on any thread (see [`Planner`]).
    pub fn planner(&self) -> Planner {
        Planner { f: Arc::clone(&self.f), scheduler: Arc::clone(&self.scheduler) }
    }

    /// [`Engine::forward`] on a minibatch this engine's [`Planner`] has already scheduled;
    /// with `rows`, returns only those vertices' outputs, as [`Engine::forward_rows`].
    pub fn forward_planned(
        &mut self,
        planned: Planned<'_>,
        pulls: &[Pull<'_>],
        rows: Option<&[usize]>,
    ) -> Result<Vec<Vec<f32>>> {
        if !Arc::ptr_eq(&planned.scheduler, &self.scheduler) {
            return Err(internal("a minibatch planned for another engine (or before set_policy)".into()));
        }
        check_vertices("output rows", planned.schedule.len(), rows.unwrap_or_default())?;
        self.schedule = planned.schedule;
        self.run_scheduled(&planned.graphs, pulls, true)?;
        self.download_outputs(rows)
    }

    /// Replaces every parameter's values.
    pub fn set_params(&mut self, params: &[Vec<f32>]) -> Result<()> {
        if params.len() != self.f.params().len() {
            return Err(Error::input(
                format!("parameters of `{}`", self.f.name()),
                format!("{} tensors", self.f.params().len()),
                format!("{}", params.len()),
            ));
        }
        for ((p, decl), &at) in params.iter().zip(self.f.params()).zip(&self.param_at) {
            if p.len() != decl.shape.numel() {
                return Err(Error::input(
                    format!("parameter `{}`", decl.name),
                    format!("{} values for {}", decl.shape.numel(), decl.shape),
                    format!("{}", p.len()),
                ));
            }
            self.backend.write(&mut self.bufs[PARAMS], at, p)?;
        }
        Ok(())
    }

    /// Every parameter's current values.
    pub fn params(&self) -> Result<Vec<Vec<f32>>> {
        self.read_params(PARAMS)
    }

    /// Runs `update` on every parameter's values (in the order of `f.params()`): in place where
    /// the backend keeps them in host memory, else on a copy written back after.
    pub fn update_params(&mut self, update: impl FnOnce(Vec<&mut [f32]>)) -> Result<()> {
        let sizes: Vec<usize> = self.f.params().iter().map(|p| p.shape.numel()).collect();
        if let Some(host) = self.backend.host_mut(&mut self.bufs[PARAMS]) {
            update(split_sizes(host, &sizes));
            return Ok(());
        }
        let mut copy = vec![0.0; sizes.iter().sum()];
        self.backend.read(&self.bufs[PARAMS], 0, &mut copy)?;
        update(split_sizes(&mut copy, &sizes));
        self.backend.write(&mut self.bufs[PARAMS], 0, &copy)
    }

    fn read_params(&self, buf: usize) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(self.param_at.len());
        for (decl, &at) in self.f.params().iter().zip(&self.param_at) {
            out.push(self.backend.read_vec(&self.bufs[buf], at, decl.shape.numel())?);
        }
        Ok(out)
    }

    /// Runs F over every vertex of `graphs` (one minibatch), keeping what [`Engine::backward`]
    /// needs. `pulls[i]` gives input `i` for every vertex, graph by graph, vertex by vertex.
    /// Returns each pushed output the same way.
    pub fn forward(&mut self, graphs: &[&InputGraph], pulls: &[Pull<'_>]) -> Result<Vec<Vec<f32>>> {
        self.run_forward(graphs, pulls, true, None)
    }

    /// [`Engine::forward`] returning only the vertices `rows` (merged-vertex indices, e.g. the
    /// roots a loss reads) of each pushed output, in that order: `rows.len()` blocks each. Pair
    /// it with [`Engine::backward_rows`]: the other vertices' outputs never leave the device.
    pub fn forward_rows(
        &mut self,
        graphs: &[&InputGraph],
        pulls: &[Pull<'_>],
        rows: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        self.run_forward(graphs, pulls, true, Some(rows))
    }

    /// Like [`Engine::forward`], for inference: keeps nothing for a backward pass, so it needs
    /// less memory.
    pub fn infer(&mut self, graphs: &[&InputGraph], pulls: &[Pull<'_>]) -> Result<Vec<Vec<f32>>> {
        self.run_forward(graphs, pulls, false, None)
    }

    /// [`Engine::infer`] returning only the vertices `rows` (merged-vertex indices, e.g. the
    /// roots a classifier reads) of each pushed output, in that order: `rows.len()` blocks each.
    /// Only those rows leave the device.
    pub fn infer_rows(&mut self, graphs: &[&InputGraph], pulls: &[Pull<'_>], rows: &[usize]) -> Result<Vec<Vec<f32>>> {
        self.run_forward(graphs, pulls, false, Some(rows))
    }

    fn run_forward(
        &mut self,
        graphs: &[&InputGraph],
        pulls: &[Pull<'_>],
        train: bool,
        rows: Option<&[usize]>,
    ) -> Result<Vec<Vec<f32>>> {
        check_graphs(&self.f, graphs)?;
        check_vertices("output rows", graphs.iter().map(|g| g.len()).sum(), rows.unwrap_or_default())?;
        lock(&self.scheduler).schedule(graphs, &mut self.schedule);
        self.run_scheduled(graphs, pulls, train)?;
        self.download_outputs(rows)
    }

    /// Every pushed output of the last forward pass in merged-vertex order: all vertices, or
    /// only `rows` (checked), in that order.
    fn download_outputs(&mut self, rows: Option<&[usize]>) -> Result<Vec<Vec<f32>>> {
        let outputs: Vec<(ValueId, usize)> = self.f.outputs().iter().map(|o| (o.value, o.shape.numel())).collect();
        outputs
            .into_iter()
            .map(|(v, block)| {
                let at = self.loc(Pass::Forward, v, 0, 0)?;
                match rows {
                    Some(rows) => self.download_some(at, block, rows),
                    None => self.download_rows(at, block),
                }
            })
            .collect()
    }

    /// The forward pass over `graphs`, checked and scheduled into `self.schedule`.
    fn run_scheduled(&mut self, graphs: &[&InputGraph], pulls: &[Pull<'_>], train: bool) -> Result<()> {
        let f = self.f.clone();
        debug_assert_eq!(self.schedule.graph_starts.len(), graphs.len() + 1);
        self.memory = MemoryPlan::new(&f, self.schedule.len(), self.schedule.max_task(), train);
        self.index_layout = IndexLayout::new(f.arity(), &self.schedule);
        self.trained = train;
        self.in_scratch.clear();
        self.reserve()?;
        self.pull_zero_rows = self.place_pulls(pulls)?;
        self.share_pulls(pulls)?;
        self.upload_index()?;
        self.gather_lookups()?;
        self.loads = (0..self.schedule.tasks.len())
            .map(|t| {
                let rows = self.schedule.tasks[t].clone();
                let s = &self.schedule;
                f.forward()
                    .nodes
                    .iter()
                    .map(|n| match n.op {
                        Op::Gather { slot, .. } => {
                            s.child_rows.get(slot).is_none_or(|c| c[rows.clone()].iter().all(|&r| r == NO_ROW))
                        }
                        Op::GatherSum { .. } => s.child_offsets[rows.start] == s.child_offsets[rows.end],
                        Op::Pull { input } => self.task_all(t, &self.pull_zero_rows[input]),
                        _ => false,
                    })
                    .collect()
            })
            .collect();
        let skip = self.skip_padding_grads;
        self.fwd_facts = self.loads.iter().map(|l| self.facts.forward(&f, l, train, skip)).collect();
        let plan = if train { f.forward_plan() } else { f.inference_plan() };
        let tasks = self.schedule.tasks.len();
        self.run_phase(Pass::Forward, plan, Phase::Prologue, 0..tasks)?;
        for t in 0..tasks {
            self.run_phase(Pass::Forward, plan, Phase::Recurrent, t..t + 1)?;
        }
        self.run_phase(Pass::Forward, plan, Phase::Epilogue, 0..tasks)
    }

    /// Runs F' over the minibatch of the last [`Engine::forward`], given each pushed output's
    /// gradient (laid out like the outputs). Returns the gradients of the pulled inputs and of
    /// the parameters.
    pub fn backward(&mut self, push_grads: &[&[f32]]) -> Result<Gradients> {
        self.run_backward(None, push_grads)
    }

    /// [`Engine::backward`] given each pushed output's gradient only at the vertices `rows`
    /// (merged-vertex indices, each at most once; `rows.len()` blocks per output, in that
    /// order), every other vertex's being zero: the output of [`Engine::forward_rows`].
    pub fn backward_rows(&mut self, rows: &[usize], push_grads: &[&[f32]]) -> Result<Gradients> {
        self.run_backward(Some(rows), push_grads)
    }

    fn run_backward(&mut self, rows: Option<&[usize]>, push_grads: &[&[f32]]) -> Result<Gradients> {
        let f = self.f.clone();
        if !self.trained {
            return Err(Error::input(
                "Engine::backward",
                "a preceding Engine::forward",
                "no forward pass, or an inference pass (Engine::infer keeps nothing for backward)",
            ));
        }
        let n = self.schedule.len();
        let regions: Vec<usize> = self.memory.push_grads.iter().map(|r| r.offset).collect();
        let push_zero = match rows {
            None => self.upload_ports("gradient of output", f.outputs(), push_grads, &regions)?,
            Some(rows) => self.upload_some("gradient of output", f.outputs(), rows, push_grads, &regions)?,
        };
        let b = f.backward();
        let skip = self.skip_padding_grads;
        self.bwd_facts = (0..self.schedule.tasks.len())
            .map(|t| {
                let grad_loads: Loads = b
                    .func
                    .nodes
                    .iter()
                    .map(|n| matches!(n.op, Op::PushGrad { output } if self.task_all(t, &push_zero[output])))
                    .collect();
                self.facts.backward(&f, &self.loads[t], &grad_loads, skip)
            })
            .collect();
        for (s, st) in f.states().iter().enumerate() {
            let at = Loc { buf: ARENA, offset: self.memory.state_grads[s].offset };
            let len = n * st.shape.numel();
            self.backend.fill(&mut Mem { data: &mut self.bufs, index: &self.index }, at, len, 0.0)?;
        }
        let grads_len = self.backend.len(&self.bufs[GRADS]);
        self.backend.fill(
            &mut Mem { data: &mut self.bufs, index: &self.index },
            Loc { buf: GRADS, offset: 0 },
            grads_len,
            0.0,
        )?;

        for (i, at) in self.table_grad_at.iter().enumerate() {
            if let (Some(at), Some(s)) = (at, &self.shared[i]) {
                let len = s.unique * f.inputs()[i].shape.numel();
                let at = Loc { buf: SHARED, offset: *at };
                self.backend.fill(&mut Mem { data: &mut self.bufs, index: &self.index }, at, len, 0.0)?;
            }
        }

        let plan = f.backward_plan();
        let tasks = self.schedule.tasks.len();
        self.run_phase(Pass::Backward, plan, Phase::Prologue, 0..tasks)?;
        self.send_child_grads(plan, Phase::Prologue, 0..tasks)?;
        for t in (0..tasks).rev() {
            self.run_phase(Pass::Backward, plan, Phase::Recurrent, t..t + 1)?;
            self.send_child_grads(plan, Phase::Recurrent, t..t + 1)?;
        }
        self.run_phase(Pass::Backward, plan, Phase::Epilogue, 0..tasks)?;
        self.param_grads()?;

        let mut pulls = Vec::with_capacity(f.inputs().len());
        let mut tables = Vec::with_capacity(f.inputs().len());
        for (i, port) in f.inputs().iter().enumerate() {
            let block = port.shape.numel();
            if let Some(ids) = self.shared[i].as_ref().and_then(|s| s.ids.clone()) {
                tables.push(Some(self.table_grad(i, ids, block)?));
                pulls.push(Vec::new());
                continue;
            }
            tables.push(None);
            let mut rows = match f.backward().pull_grads[i] {
                Some(g) => self.download_rows(self.loc(Pass::Backward, g, 0, 0)?, block)?,
                None => vec![0.0; n * block],
            };
            if self.skip_padding_grads {
                for (r, _) in self.pull_zero_rows[i].iter().enumerate().filter(|(_, z)| **z) {
                    let v = self.schedule.vertex_of_row[r] as usize;
                    rows[v * block..(v + 1) * block].fill(0.0);
                }
            }
            pulls.push(rows);
        }
        Ok(Gradients { pulls, tables, params: self.read_params(GRADS)? })
    }

    /// The table gradient of looked-up input `i` (distinct ids `ids`): read where
    /// [`Engine::param_grads`] formed it per distinct row, or else summed per id from the
    /// gradient rows of the vertices.
    fn table_grad(&mut self, i: usize, ids: Vec<u32>, block: usize) -> Result<SparseGrad> {
        let len = ids.len() * block;
        let values = if let Some(at) = self.table_grad_at[i] {
            self.backend.read_vec(&self.bufs[SHARED], at, len)?
        } else if let Some(g) = self.f.backward().pull_grads[i] {
            let mut values = vec![0.0; len];
            self.host.resize(self.schedule.len() * block, 0.0);
            let at = self.loc(Pass::Backward, g, 0, 0)?;
            self.backend.read(&self.bufs[at.buf], at.offset, &mut self.host)?;
            let map = self.shared[i].as_ref().map_or(&[][..], |s| &s.map);
            for (row, &k) in self.host.chunks_exact(block.max(1)).zip(map).filter(|(_, &k)| k != NO_ROW) {
                for (d, x) in values[k as usize * block..(k as usize + 1) * block].iter_mut().zip(row) {
                    *d += x;
                }
            }
            values
        } else {
            return Ok(SparseGrad::default());
        };
        Ok(SparseGrad { rows: ids, values })
    }

    /// Grows the arena and the index buffer to the current layout (never shrinks them).
    fn reserve(&mut self) -> Result<()> {
        if self.backend.len(&self.bufs[ARENA]) < self.memory.len {
            // A quarter more than this minibatch needs, so the next, larger one rarely maps
            // (and faults in) a new arena.
            self.bufs[ARENA] = self.backend.alloc(self.memory.len + self.memory.len / 4)?;
        }
        if self.backend.index_len(&self.index[0]) < self.index_layout.len {
            self.index[0] = self.backend.alloc_index(self.index_layout.len)?;
        }
        Ok(())
    }

    /// Checks one block of rows per vertex for every port and uploads each into its region.
    /// Returns, per port, which rows (in row order) are all zeros.
    fn upload_ports(
        &mut self,
        what: &str,
        ports: &[Port],
        data: &[&[f32]],
        regions: &[usize],
    ) -> Result<Vec<Vec<bool>>> {
        self.check_count(what, ports.len(), data.len())?;
        let mut zero = Vec::with_capacity(ports.len());
        for ((rows, port), &at) in data.iter().zip(ports).zip(regions) {
            self.check_rows(what, port, rows.len())?;
            zero.push(self.upload_rows(at, rows, port.shape.numel())?);
        }
        Ok(zero)
    }

    /// [`Engine::upload_ports`] given only the vertices `rows` (checked, each at most once), the
    /// other vertices' rows zeros.
    fn upload_some(
        &mut self,
        what: &str,
        ports: &[Port],
        rows: &[usize],
        data: &[&[f32]],
        regions: &[usize],
    ) -> Result<Vec<Vec<bool>>> {
        self.check_count(what, ports.len(), data.len())?;
        let n = self.schedule.len();
        check_vertices(what, n, rows)?;
        let mut seen = vec![false; n];
        if let Some(&twice) = rows.iter().find(|&&v| std::mem::replace(&mut seen[v], true)) {
            return Err(Error::input(
                format!("{what} rows"),
                "each vertex at most once",
                format!("vertex {twice} twice"),
            ));
        }
        let mut zero = Vec::with_capacity(ports.len());
        for ((values, port), &at) in data.iter().zip(ports).zip(regions) {
            let block = port.shape.numel();
            if values.len() != rows.len() * block {
                return Err(Error::input(
                    format!("{what} `{}`", port.name),
                    format!("{} values ({} rows × {block})", rows.len() * block, rows.len()),
                    format!("{}", values.len()),
                ));
            }
            let mem = &mut Mem { data: &mut self.bufs, index: &self.index };
            self.backend.fill(mem, Loc { buf: ARENA, offset: at }, n * block, 0.0)?;
            let mut z = vec![true; n];
            for (&v, row) in rows.iter().zip(values.chunks_exact(block.max(1))) {
                let r = self.schedule.row_of_vertex[v] as usize;
                z[r] = row.iter().all(|&x| x == 0.0);
                self.backend.write(&mut self.bufs[ARENA], at + r * block, row)?;
            }
            zero.push(z);
        }
        Ok(zero)
    }

    /// Checks every pulled input and uploads those given as rows into their regions. Returns, per
    /// input, which rows (in row order) are all zeros; for a lookup, which pull the padding id.
    fn place_pulls(&mut self, pulls: &[Pull<'_>]) -> Result<Vec<Vec<bool>>> {
        let f = self.f.clone();
        self.check_count("input", f.inputs().len(), pulls.len())?;
        let mut zero = Vec::with_capacity(pulls.len());
        for (i, (pull, port)) in pulls.iter().zip(f.inputs()).enumerate() {
            zero.push(match *pull {
                Pull::Rows(rows) => {
                    self.check_rows("input", port, rows.len())?;
                    self.upload_rows(self.memory.pulls[i].offset, rows, port.shape.numel())?
                }
                Pull::Lookup { table, ids, padding } => {
                    check_lookup(port, table, ids, padding, self.schedule.len())?;
                    self.schedule.vertex_of_row.iter().map(|&v| Some(ids[v as usize]) == padding).collect()
                }
            });
        }
        Ok(zero)
    }

    /// An error unless `got` ports' worth of data came for `want` ports.
    fn check_count(&self, what: &str, want: usize, got: usize) -> Result<()> {
        if want == got {
            return Ok(());
        }
        Err(Error::input(format!("{what}s of `{}`", self.f.name()), format!("{want}"), format!("{got}")))
    }

    /// An error unless `len` values are one block of `port` per vertex.
    fn check_rows(&self, what: &str, port: &Port, len: usize) -> Result<()> {
        let (n, block) = (self.schedule.len(), port.shape.numel());
        if len == n * block {
            return Ok(());
        }
        Err(Error::input(
            format!("{what} `{}`", port.name),
            format!("{} values ({n} vertices × {block})", n * block),
            format!("{len}"),
        ))
    }

    /// Writes rows given in merged-vertex order into the arena in row order; returns which rows
    /// (in row order) are all zeros.
    fn upload_rows(&mut self, at: usize, src: &[f32], block: usize) -> Result<Vec<bool>> {
        self.host.clear();
        let mut zero = Vec::with_capacity(self.schedule.len());
        for &v in &self.schedule.vertex_of_row {
            let row = &src[v as usize * block..(v as usize + 1) * block];
            zero.push(row.iter().all(|&x| x == 0.0));
            self.host.extend_from_slice(row);
        }
        self.backend.write(&mut self.bufs[ARENA], at, &self.host)?;
        Ok(zero)
    }

    /// Whether every row of task `t` is flagged in `rows`.
    fn task_all(&self, t: usize, rows: &[bool]) -> bool {
        rows[self.schedule.tasks[t].clone()].iter().all(|&z| z)
    }

    /// Reads a region in row order and returns it in merged-vertex order.
    fn download_rows(&mut self, at: Loc, block: usize) -> Result<Vec<f32>> {
        let n = self.schedule.len();
        self.host.resize(n * block, 0.0);
        self.backend.read(&self.bufs[at.buf], at.offset, &mut self.host)?;
        let mut out = Vec::with_capacity(n * block);
        for &r in &self.schedule.row_of_vertex {
            out.extend_from_slice(&self.host[r as usize * block..(r as usize + 1) * block]);
        }
        Ok(out)
    }

    /// Reads the vertices `vertices` (merged-vertex indices, checked) of a region, in that order.
    fn download_some(&mut self, at: Loc, block: usize, vertices: &[usize]) -> Result<Vec<f32>> {
        let rows: Vec<u32> = vertices.iter().map(|&v| self.schedule.row_of_vertex[v]).collect();
        let mut out = vec![0.0; rows.len() * block];
        self.backend.read_rows(&self.bufs[at.buf], at.offset, block, &rows, &mut out)?;
        Ok(out)
    }

    fn upload_index(&mut self) -> Result<()> {
        let s = &self.schedule;
        let n = s.len();
        self.host_index.clear();
        for k in 0..self.f.arity() {
            match s.child_rows.get(k) {
                Some(rows) => self.host_index.extend_from_slice(rows),
                None => self.host_index.extend(std::iter::repeat_n(NO_ROW, n)),
            }
        }
        self.host_index.extend_from_slice(&s.child_offsets);
        self.host_index.extend_from_slice(&s.child_list);
        for shared in self.shared.iter().flatten() {
            self.host_index.extend_from_slice(&shared.map);
        }
        if self.backend.index_len(&self.index[0]) < self.host_index.len() {
            self.index[0] = self.backend.alloc_index(self.host_index.len())?;
        }
        self.backend.write_index(&mut self.index[0], 0, &self.host_index)
    }

    /// Finds the distinct rows of every looked-up input and of every input a product reads (see
    /// [`dedup`]) and uploads them into the `SHARED` buffer, with room after them for the
    /// products over them and for table gradients formed per distinct row.
    fn share_pulls(&mut self, pulls: &[Pull<'_>]) -> Result<()> {
        let (n, f) = (self.schedule.len(), self.f.clone());
        let order = &self.schedule.vertex_of_row;
        self.shared = pulls
            .iter()
            .enumerate()
            .map(|(i, pull)| {
                let block = f.inputs()[i].shape.numel();
                match *pull {
                    Pull::Lookup { table, ids, padding } => Some(dedup::lookup(order, ids, table, block, padding)),
                    Pull::Rows(rows) if self.pulled_factor[i] => {
                        let row = |r: usize| &rows[order[r] as usize * block..(order[r] as usize + 1) * block];
                        dedup::find(n, block, &self.pull_zero_rows[i], row)
                    }
                    Pull::Rows(_) => None,
                }
            })
            .collect();
        let (mut at, mut map_at, mut most) = (0, self.index_layout.len, 0);
        for s in self.shared.iter_mut().flatten() {
            (s.rows_at, s.map_at) = (at, map_at);
            (at, map_at, most) = (at + s.rows.len(), map_at + n, most.max(s.unique));
        }
        self.shared_scratch = at..at + most * self.shared_width;
        self.gathered = vec![false; pulls.len()];
        let mut end = self.shared_scratch.end;
        self.table_grad_at = (0..pulls.len())
            .map(|i| match &self.shared[i] {
                Some(s) if s.ids.is_some() && self.trained && self.table_grad_via[i].is_some() => {
                    let at = end;
                    end += s.unique * f.inputs()[i].shape.numel();
                    Some(at)
                }
                _ => None,
            })
            .collect();
        if self.backend.len(&self.bufs[SHARED]) < end {
            self.bufs[SHARED] = self.backend.alloc(end)?;
        }
        for s in self.shared.iter().flatten() {
            self.backend.write(&mut self.bufs[SHARED], s.rows_at, &s.rows)?;
        }
        Ok(())
    }

    /// Copies each looked-up input's distinct rows to the rows of the vertices that pull them,
    /// where anything reads them there.
    fn gather_lookups(&mut self) -> Result<()> {
        for i in 0..self.shared.len() {
            if self.rows_read[i] {
                self.gather_lookup(i)?;
            }
        }
        Ok(())
    }

    /// Copies looked-up input `i`'s distinct rows to the rows of the vertices that pull them,
    /// unless they are there already (or it is not looked up).
    fn gather_lookup(&mut self, i: usize) -> Result<()> {
        let Some(s) = self.shared[i].as_ref().filter(|s| s.ids.is_some() && !self.gathered[i]) else { return Ok(()) };
        let copy = SharedCopy {
            value: None,
            from: Loc { buf: SHARED, offset: s.rows_at },
            to: Loc { buf: ARENA, offset: self.memory.pulls[i].offset },
            row: 0,
            map: IndexLoc { buf: 0, offset: s.map_at },
            rows: self.schedule.len(),
            block: self.f.inputs()[i].shape.numel(),
        };
        self.gathered[i] = true;
        self.copy_shared(copy)
    }

    /// For a parameter gradient `xᵀ·dy` over the rows `run` whose `x` is a pulled input with
    /// shared rows: sums `dy` per distinct row into scratch and returns the factors over the
    /// distinct rows instead (where x's rows are, where the summed dy is, how many rows).
    fn shared_grad(&mut self, x: ValueId, dy: ValueId, run: &Range<usize>) -> Result<Option<(Loc, Loc, usize)>> {
        let Some(&Shared { unique, rows_at, map_at, .. }) = self.shared_input(x) else { return Ok(None) };
        let block = self.f.backward().func.node(dy).shape.numel();
        let sums = Loc { buf: SHARED, offset: self.shared_scratch.start };
        if self.shared_scratch.start + unique * block > self.shared_scratch.end {
            return Ok(None);
        }
        let src = self.loc(Pass::Backward, dy, run.start, 0)?;
        let mem = &mut Mem { data: &mut self.bufs, index: &self.index };
        self.backend.fill(mem, sums, unique * block, 0.0)?;
        let dst = Rows::Indexed { data: sums, index: IndexLoc { buf: 0, offset: map_at + run.start } };
        self.backend.scatter_add(mem, src, block, run.len(), &dst)?;
        Ok(Some((Loc { buf: SHARED, offset: rows_at }, sums, unique)))
    }

    /// The shared rows of the input that parameter-gradient factor `x` (a value of F′) reads.
    fn shared_input(&self, x: ValueId) -> Option<&Shared> {
        self.pulled_input(x).and_then(|i| self.shared[i].as_ref())
    }

    /// The input that parameter-gradient factor `x` (a value of F′) is, if it is one.
    fn pulled_input(&self, x: ValueId) -> Option<usize> {
        let op = match self.f.backward().func.node(x).op {
            Op::Primal { value } => &self.f.forward().node(value).op,
            ref op => op,
        };
        match *op {
            Op::Pull { input } => Some(input),
            _ => None,
        }
    }

    fn func(&self, pass: Pass) -> &Func {
        match pass {
            Pass::Forward => self.f.forward(),
            Pass::Backward => &self.f.backward().func,
        }
    }

    /// Where row `row` of value `v` of `pass` lives, for a step over rows from `task_start`.
    fn loc(&self, pass: Pass, v: ValueId, row: usize, task_start: usize) -> Result<Loc> {
        let m = &self.memory;
        let region: Option<Region> = match self.func(pass).node(v).op {
            Op::Pull { input } => Some(m.pulls[input]),
            Op::Primal { value } => return self.loc(Pass::Forward, value, row, task_start),
            Op::StateGrad { state } => Some(m.state_grads[state]),
            Op::PushGrad { output } => Some(m.push_grads[output]),
            Op::Param { param } => return Ok(Loc { buf: PARAMS, offset: self.param_at[param] }),
            _ => match pass {
                Pass::Forward => m.forward[v.index()],
                Pass::Backward => m.backward[v.index()],
            },
        };
        region
            .map(|r| Loc { buf: ARENA, offset: r.at(row, task_start) })
            .ok_or_else(|| internal(format!("value {v} of `{}` is read but never stored", self.f.name())))
    }

    /// The rows of the tasks in `tasks` (`None` when there is no task).
    fn task_rows(&self, tasks: &Range<usize>) -> Option<Range<usize>> {
        let first = self.schedule.tasks.get(tasks.start)?;
        Some(first.start..self.schedule.tasks[tasks.end - 1].end)
    }

    /// Row ranges of the tasks in `tasks`, merged into runs of equal `key(task)`.
    fn runs<K: PartialEq>(&self, tasks: Range<usize>, key: impl Fn(usize) -> K) -> Vec<(Range<usize>, K)> {
        let mut out: Vec<(Range<usize>, K)> = Vec::new();
        for t in tasks {
            let (rows, k) = (self.schedule.tasks[t].clone(), key(t));
            match out.last_mut() {
                Some((r, lk)) if *lk == k && r.end == rows.start => r.end = rows.end,
                _ => out.push((rows, k)),
            }
        }
        out
    }

    fn fills(&self, pass: Pass) -> &[bool] {
        match pass {
            Pass::Forward => &self.must_fill.0,
            Pass::Backward => &self.must_fill.1,
        }
    }

    fn facts(&self, pass: Pass, t: usize) -> &Facts {
        match pass {
            Pass::Forward => &self.fwd_facts[t],
            Pass::Backward => &self.bwd_facts[t],
        }
    }

    /// Runs the steps of `phase` over the rows of `tasks` (one task for the recurrent phase). A
    /// matrix product known to be zero on a run of tasks becomes a zero fill there.
    fn run_phase(&mut self, pass: Pass, plan: &Plan, phase: Phase, tasks: Range<usize>) -> Result<()> {
        if tasks.is_empty() {
            return Ok(());
        }
        // Products run in waves: the first part of every product (and its zero columns), then
        // the parts that add further inner ranges to it.
        let mut waves: Vec<Vec<Gemm>> = Vec::new();
        for (i, step) in plan.phases[phase as usize].iter().enumerate() {
            match step {
                Step::Gemms(vs) => {
                    let (mut copies, mut scratch) = (Vec::new(), self.shared_scratch.start);
                    // Products accumulating into a sibling's output are planned after it.
                    for summed in [false, true] {
                        for &v in vs {
                            let target = self.summed_into(pass, v);
                            if target.is_some() != summed || self.formed_per_id(pass, v) {
                                continue;
                            }
                            let into = match target {
                                Some(p1) => Some((p1, self.computed_alone(pass, p1, &tasks)?)),
                                None => None,
                            };
                            let func = self.func(pass);
                            for (run, cut) in self.runs(tasks.clone(), |t| self.facts(pass, t).cut(func, v)) {
                                copies.extend(self.plan_gemm(pass, v, run, &cut, into, &mut waves, &mut scratch)?);
                            }
                        }
                    }
                    // Products left in scratch are copied out before this step writes over them.
                    if !copies.is_empty() {
                        self.settle_scratch(|_| true)?;
                    }
                    for wave in &mut waves {
                        self.flush_gemms(wave)?;
                    }
                    for c in copies {
                        match c.value {
                            Some(v) if pass == Pass::Forward && self.by_index[v.index()] => self.in_scratch.push(c),
                            _ => self.copy_shared(c)?,
                        }
                    }
                }
                Step::Fused(k) => self.run_kernel(pass, (phase, i), k, tasks.clone())?,
            }
        }
        Ok(())
    }

    /// The sibling product `v` accumulates into on this pass (see [`sums`]).
    fn summed_into(&self, pass: Pass, v: ValueId) -> Option<ValueId> {
        (pass == Pass::Forward).then(|| self.sums.target(v)).flatten()
    }

    /// Whether product `p1` is computed on `tasks` (one task: sums are recurrent), so a sibling
    /// summed into it adds to its output rather than writing it.
    fn computed_alone(&self, pass: Pass, p1: ValueId, tasks: &Range<usize>) -> Result<bool> {
        if tasks.len() != 1 {
            return Err(internal(format!("a product summed into {p1} runs over {} tasks at once", tasks.len())));
        }
        Ok(matches!(self.facts(pass, tasks.start).cut(self.func(pass), p1), Cut::Full | Cut::Cols { .. }))
    }

    /// Whether `v` is the gradient of a looked-up input that this minibatch forms per distinct
    /// row instead (in [`Engine::param_grads`]).
    fn formed_per_id(&self, pass: Pass, v: ValueId) -> bool {
        let grads = &self.f.backward().pull_grads;
        pass == Pass::Backward && self.table_grad_at.iter().zip(grads).any(|(at, &g)| at.is_some() && g == Some(v))
    }

    /// Adds the calls of product `v` over the rows `run` (tasks sharing `cut`) to `waves`; an
    /// all-zero product is filled at once. A product of a pulled input with shared rows runs over
    /// the distinct rows into scratch from `scratch` on; the copy to the vertices' rows that must
    /// follow the waves is returned. A product summed `into` a sibling `(p1, add)` writes `p1`'s
    /// output instead: after every wave so far, adding to it, where `add`.
    #[allow(clippy::too_many_arguments)]
    fn plan_gemm(
        &mut self,
        pass: Pass,
        v: ValueId,
        run: Range<usize>,
        cut: &Cut,
        into: Option<(ValueId, bool)>,
        waves: &mut Vec<Vec<Gemm>>,
        scratch: &mut usize,
    ) -> Result<Option<SharedCopy>> {
        let (add, base) = match into {
            Some((_, true)) => (true, waves.len()),
            _ => (false, 0),
        };
        let target = into.map(|(p1, _)| self.loc(pass, p1, run.start, run.start)).transpose()?;
        let mut push = |wave: usize, mut g: Gemm, flops: &mut u64| {
            g.accumulate |= add;
            if waves.len() <= base + wave {
                waves.resize_with(base + wave + 1, Vec::new);
            }
            *flops += gemm_flops(&g);
            waves[base + wave].push(g);
        };
        match cut {
            Cut::Skip => {}
            // Summed into a sibling, zeros add nothing (and the kernel reads them as zeros).
            Cut::Zero if into.is_some() || !self.fills(pass)[v.index()] => {}
            Cut::Zero => {
                let at = self.loc(pass, v, run.start, run.start)?;
                let len = run.len() * self.func(pass).node(v).shape.numel();
                self.backend.fill(&mut Mem { data: &mut self.bufs, index: &self.index }, at, len, 0.0)?;
            }
            Cut::Full => {
                let (mut g, copy) = self.shared_gemm(pass, v, run, scratch)?;
                g.c = target.unwrap_or(g.c);
                push(0, g, &mut self.flops);
                return Ok(copy);
            }
            Cut::Cols { cols, zero, inner } => {
                let (mut g, copy) = self.shared_gemm(pass, v, run, scratch)?;
                g.c = target.unwrap_or(g.c);
                if !add {
                    for z in zero {
                        // A product over an empty inner dimension is zero.
                        push(0, facts::narrow(&g, z.clone(), 0..0, false), &mut self.flops);
                    }
                }
                for c in cols {
                    for (i, k) in inner.iter().enumerate() {
                        push(i, facts::narrow(&g, c.clone(), k.clone(), i > 0), &mut self.flops);
                    }
                }
                return Ok(copy);
            }
        }
        Ok(None)
    }

    /// The call of product `v` over the rows `run`: over the distinct rows of its pulled factor
    /// into scratch when that input has shared rows (and scratch has room), with the copy that
    /// must follow it.
    fn shared_gemm(
        &mut self,
        pass: Pass,
        v: ValueId,
        run: Range<usize>,
        scratch: &mut usize,
    ) -> Result<(Gemm, Option<SharedCopy>)> {
        let mut g = self.gemm_call(pass, v, run.clone())?;
        let input = (pass == Pass::Forward).then(|| dedup::pulled_factor(self.func(pass), v)).flatten();
        let Some((i, &Shared { unique, rows_at, map_at, .. })) =
            input.and_then(|i| self.shared[i].as_ref().map(|s| (i, s)))
        else {
            return Ok((g, None));
        };
        if *scratch + unique * g.ldc > self.shared_scratch.end {
            // Per vertex after all: a looked-up input's rows must be there.
            self.gather_lookup(i)?;
            return Ok((g, None));
        }
        let copy = SharedCopy {
            value: Some(v),
            from: Loc { buf: SHARED, offset: *scratch },
            to: g.c,
            row: run.start,
            map: IndexLoc { buf: 0, offset: map_at + run.start },
            rows: run.len(),
            block: g.ldc,
        };
        *scratch += unique * g.ldc;
        (g.m, g.a, g.c) = (unique, Loc { buf: SHARED, offset: rows_at }, copy.from);
        Ok((g, Some(copy)))
    }

    /// Copies the products left in scratch that `which` selects to their vertices' rows.
    fn settle_scratch(&mut self, which: impl Fn(&SharedCopy) -> bool) -> Result<()> {
        let (settle, keep) = std::mem::take(&mut self.in_scratch).into_iter().partition(which);
        self.in_scratch = keep;
        settle.into_iter().try_for_each(|c: SharedCopy| self.copy_shared(c))
    }

    /// Where a fused kernel reads rows `rows` of product `v` if they are still in scratch: the
    /// distinct rows, by the map. Rows that span several runs are copied out first.
    fn scratch_rows(&mut self, v: ValueId, rows: &Range<usize>) -> Result<Option<Rows>> {
        let within = |c: &SharedCopy| c.row <= rows.start && rows.end <= c.row + c.rows;
        if let Some(c) = self.in_scratch.iter().find(|c| c.value == Some(v) && within(c)) {
            let index = IndexLoc { offset: c.map.offset + (rows.start - c.row), ..c.map };
            return Ok(Some(Rows::Indexed { data: c.from, index }));
        }
        self.settle_scratch(|c| c.value == Some(v))?;
        Ok(None)
    }

    /// Copies the product rows of distinct pulled rows to every vertex that pulled them.
    fn copy_shared(&mut self, c: SharedCopy) -> Result<()> {
        let kernel = dedup::copy_kernel(c.block);
        let loads = [Rows::Indexed { data: c.from, index: c.map }];
        self.backend.fused(&mut Mem { data: &mut self.bufs, index: &self.index }, &kernel, c.rows, &loads, &[c.to])
    }

    /// Runs one product now, counting its flops.
    fn run_gemm(&mut self, g: &Gemm) -> Result<()> {
        self.flops += gemm_flops(g);
        self.backend.gemm(&mut Mem { data: &mut self.bufs, index: &self.index }, g)
    }

    fn flush_gemms(&mut self, gemms: &mut Vec<Gemm>) -> Result<()> {
        if !gemms.is_empty() {
            self.backend.gemm_batch(&mut Mem { data: &mut self.bufs, index: &self.index }, gemms)?;
            gemms.clear();
        }
        Ok(())
    }

    fn gemm_call(&self, pass: Pass, v: ValueId, rows: Range<usize>) -> Result<Gemm> {
        let func = self.func(pass);
        let Op::MatMul { a, b, ta, tb } = func.node(v).op else {
            return Err(internal(format!("value {v} is not a matrix product")));
        };
        let (na, nb, nv) = (func.node(a), func.node(b), func.node(v));
        let (r0, n) = (rows.start, rows.len());
        let at = |x: ValueId| self.loc(pass, x, r0, r0);
        let (ar, ac) = if ta { (na.shape.cols(), na.shape.rows()) } else { (na.shape.rows(), na.shape.cols()) };
        let b_loc = at(b)?;
        let mut g = Gemm {
            m: ar,
            n: nv.shape.cols(),
            k: ac,
            a: at(a)?,
            lda: na.shape.cols(),
            ta,
            b: b_loc,
            ldb: nb.shape.cols(),
            tb,
            b_fixed: nb.is_param,
            c: at(v)?,
            ldc: nv.shape.cols(),
            accumulate: false,
            batch: n,
            stride_a: na.shape.numel(),
            stride_b: if nb.is_param { 0 } else { nb.shape.numel() },
            stride_c: nv.shape.numel(),
        };
        if nb.is_param && !ta {
            // One product over the rows of every vertex.
            g.m = n * ar;
            g.batch = 1;
        }
        Ok(g)
    }

    /// Runs fused kernel `k` (step `step` of its plan) over the rows of `tasks`. On one task,
    /// loads that read as zeros there are bound to zeros, and stores nothing will read are left
    /// out (see [`facts::unread_stores`]).
    fn run_kernel(&mut self, pass: Pass, step: (Phase, usize), k: &Kernel, tasks: Range<usize>) -> Result<()> {
        let Some(rows) = self.task_rows(&tasks) else { return Ok(()) };
        let (r0, n) = (rows.start, rows.len());
        let task = (tasks.len() == 1).then_some(tasks.start);
        let unread = task.map_or(0, |t| facts::unread_stores(k, self.facts(pass, t), self.fills(pass)));
        let pruned = (unread != 0).then(|| {
            let key = PrunedKernel { pass, trains: self.trained, step, unread };
            Arc::clone(self.pruned.entry(key).or_insert_with(|| Arc::new(k.keeping_stores(|j| unread >> j & 1 == 0))))
        });
        let k = pruned.as_deref().unwrap_or(k);
        if k.stores.is_empty() {
            return Ok(());
        }
        self.flops += (n * k.nodes.iter().filter(|x| !x.op.is_load()).map(|x| x.shape.numel()).sum::<usize>()) as u64;
        let mut loads = Vec::new();
        for i in k.loads() {
            let v = k.values[i];
            let ix = &self.index_layout;
            // A product summed into a sibling's output is read there, so it reads as zeros
            // itself, and that output is zero only where both are.
            let summed = self.summed_into(pass, v).is_some();
            let with = (pass == Pass::Forward).then(|| self.sums.source(v)).flatten();
            let zero = task.is_some_and(|t| {
                let facts = self.facts(pass, t);
                !k.nodes[i].is_param && facts.reads_as_zero(v) && with.is_none_or(|s| facts.reads_as_zero(s))
            });
            loads.push(match k.nodes[i].op {
                _ if zero || summed => Rows::Zeros,
                Op::Gather { slot, state } => Rows::Indexed {
                    data: self.loc(Pass::Forward, self.f.states()[state].value, 0, 0)?,
                    index: ix.slot(slot, r0),
                },
                Op::GatherSum { state } => ix.set(self.loc(Pass::Forward, self.f.states()[state].value, 0, 0)?, r0),
                Op::Param { .. } => Rows::Broadcast(self.loc(pass, v, 0, 0)?),
                Op::Zeros => Rows::Zeros,
                _ if pass == Pass::Forward && self.by_index[v.index()] => match self.scratch_rows(v, &rows)? {
                    Some(rows) => rows,
                    None => Rows::Contiguous(self.loc(pass, v, r0, r0)?),
                },
                _ => Rows::Contiguous(self.loc(pass, v, r0, r0)?),
            });
        }
        let mut stores = Vec::with_capacity(k.stores.len());
        for &i in &k.stores {
            stores.push(self.loc(pass, k.values[i], r0, r0)?);
        }
        let backend = &self.backend;
        backend.fused(&mut Mem { data: &mut self.bufs, index: &self.index }, k, n, &loads, &stores)
    }

    /// Scatter-adds the children's gradients computed in `phase` for the rows of `tasks`,
    /// skipping those known to be zero there.
    fn send_child_grads(&mut self, plan: &Plan, phase: Phase, tasks: Range<usize>) -> Result<()> {
        let Some(rows) = self.task_rows(&tasks) else { return Ok(()) };
        let (r0, n) = (rows.start, rows.len());
        let ix = &self.index_layout;
        let mut calls = Vec::new();
        for cg in &self.f.backward().child_grads {
            if plan.phase[cg.value.index()] != phase
                || n == 0
                || tasks.clone().all(|t| self.bwd_facts[t].is_zero(cg.value) || self.bwd_facts[t].unused(cg.value))
            {
                continue;
            }
            let block = self.f.states()[cg.state].shape.numel();
            let data = Loc { buf: ARENA, offset: self.memory.state_grads[cg.state].offset };
            let dst = match cg.slot {
                Some(k) => Rows::Indexed { data, index: ix.slot(k, r0) },
                None => ix.set(data, r0),
            };
            calls.push((self.loc(Pass::Backward, cg.value, r0, r0)?, block, dst));
        }
        for (src, block, dst) in calls {
            let backend = &self.backend;
            backend.scatter_add(&mut Mem { data: &mut self.bufs, index: &self.index }, src, block, n, &dst)?;
        }
        Ok(())
    }

    /// Forms every parameter gradient with one operation per term over all vertices (per run of
    /// tasks where the term can be non-zero, over the rows and columns where it can be).
    fn param_grads(&mut self) -> Result<()> {
        let tasks = 0..self.schedule.tasks.len();
        let f = self.f.clone();
        let b = f.backward();
        let func = &b.func;
        for (j, pg) in b.param_grads.iter().enumerate() {
            let p = pg.param();
            // A looked-up input whose table gradient `Σ dy·Wᵀ` is formed here per distinct row.
            let table = (0..self.table_grad_at.len())
                .find_map(|i| self.table_grad_at[i].filter(|_| self.table_grad_via[i] == Some(j)).map(|at| (i, at)));
            let decl = &f.params()[p];
            let dst = Loc { buf: GRADS, offset: self.param_at[p] };
            match *pg {
                ParamGrad::MatMul { x, dy, .. } => {
                    let (nx, ny) = (func.node(x), func.node(dy));
                    // Per task, the non-zero columns of x (rows of the gradient) and of dy.
                    let blocks = |t: usize| {
                        let f = &self.bwd_facts[t];
                        let (rows, cols) = (f.zero[x.index()].complement(), f.zero[dy.index()].complement());
                        (!rows.is_empty() && !cols.is_empty()).then(|| (rows.ranges(), cols.ranges()))
                    };
                    for (run, blocks) in self.runs(tasks.clone(), blocks) {
                        let Some((rows, cols)) = blocks else { continue };
                        let (mut x_at, mut dy_at) =
                            (self.loc(Pass::Backward, x, run.start, 0)?, self.loc(Pass::Backward, dy, run.start, 0)?);
                        let mut k = run.len() * nx.shape.rows();
                        match self.shared_grad(x, dy, &run)? {
                            Some(shared) => (x_at, dy_at, k) = shared,
                            None if table.is_some() => {
                                return Err(internal(format!("no room to sum the gradient of `{}` per row", decl.name)))
                            }
                            // Per vertex after all: a looked-up input's rows must be there.
                            None => self.pulled_input(x).map_or(Ok(()), |i| self.gather_lookup(i))?,
                        }
                        if let Some((i, at)) = table {
                            // The table gradient per distinct row: (Σ dy)·Wᵀ.
                            let (width, w) =
                                (f.inputs()[i].shape.numel(), Loc { buf: PARAMS, offset: self.param_at[p] });
                            for c in &cols {
                                self.run_gemm(&accumulating(
                                    (k, width, c.len()),
                                    (dy_at.offset_by(c.start), ny.shape.cols(), false),
                                    (w.offset_by(c.start), decl.shape.cols(), true, true),
                                    (Loc { buf: SHARED, offset: at }, width),
                                ))?;
                            }
                        }
                        for r in &rows {
                            for c in &cols {
                                self.run_gemm(&accumulating(
                                    (r.len(), c.len(), k),
                                    (x_at.offset_by(r.start), nx.shape.cols(), true),
                                    (dy_at.offset_by(c.start), ny.shape.cols(), false, false),
                                    (dst.offset_by(r.start * decl.shape.cols() + c.start), decl.shape.cols()),
                                ))?;
                            }
                        }
                    }
                }
                ParamGrad::SumRows { dy, .. } => {
                    let period = decl.shape.numel();
                    let block = func.node(dy).shape.numel();
                    for (run, _) in
                        self.runs(tasks.clone(), |t| self.bwd_facts[t].is_zero(dy)).into_iter().filter(|(_, z)| !z)
                    {
                        let src = self.loc(Pass::Backward, dy, run.start, 0)?;
                        let mem = &mut Mem { data: &mut self.bufs, index: &self.index };
                        self.backend.sum_rows(mem, src, run.len() * block / period, period, dst, true)?;
                    }
                }
            }
        }
        Ok(())
    }
}
