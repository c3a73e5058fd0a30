//! The engine: runs a vertex function over a scheduled minibatch on a backend.
//!
//! A pass happens in two steps. [`Lowering`] turns the minibatch into a plain list of
//! [`Launch`]es (products, fused kernels, copies, fills, scatter-adds, row sums) and the host
//! data they start from, reading the per-function analysis (`analysis.rs`) and the minibatch's
//! state (`batch.rs`); it needs no backend, so the list can be printed and tested. [`Engine`]
//! then uploads that data and runs the list on its backend.
//!
//! Memory: one arena holds every buffer of the minibatch where the [`MemoryPlan`] puts it (pulled
//! inputs, stored values of F and F', output and state gradients, distinct pulled rows), each ordered by task so a task
//! reads and writes contiguous rows. Parameters and their gradients live in two more buffers. The
//! arena and the index buffer grow when a larger minibatch arrives and are reused otherwise, so a
//! steady-state step allocates no device memory.

mod analysis;
mod average;
mod batch;
mod dedup;
mod facts;
mod fnv;
mod held;
mod launch;
mod link;
mod lower;
mod optimize;
mod products;
mod sums;

pub use analysis::{PlanKind, StepRef};
pub use average::{AVG, TABLE_AVG};
pub use held::{TABLE, TABLE_GRAD, TABLE_M, TABLE_ROWS, TABLE_V};
pub use launch::{Counts, Launch, Uploads, ARENA, GRADS, PARAMS, STAGED, STAGED_ROWS};
pub use link::{Given, LinkedRows, LINKED, OUTPUTS};
pub use lower::Lowering;
pub use optimize::{ParamState, STATE_M, STATE_V, STEP};

use arbor_batching::{MemoryPlan, Policy, Schedule, Scheduler};
use arbor_core::backend::{Backend, Loc, Mem, NO_ROW};
use arbor_core::dropout::{self, DropoutKey};
use arbor_core::error::{Error, Result};
use arbor_core::graph::InputGraph;
use arbor_core::ir::VertexFn;
use arbor_core::profile::{self, Activity};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

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
    /// Vertex `i` pulls row `ids[i]` of the table the engine holds ([`Engine::set_table`]),
    /// copied on the backend: nothing of the table crosses to a device. The `padding` id pulls
    /// zeros and gets no gradient. The backward pass leaves the table's gradient in the engine
    /// for [`Engine::optimize_table`] (the input's entry of [`Gradients::tables`] is `None`);
    /// several inputs may pull from the table, their gradients summed.
    Held {
        /// One id per vertex, in merged-vertex order.
        ids: &'a [u32],
        /// The id that stands for no row.
        padding: Option<u32>,
    },
    /// Vertex `i` pulls row `rows[i]` of a region of another engine's arena on the same
    /// backend ([`Engine::output_rows`]), copied there when [`Engine::run_linked`] runs the pass:
    /// nothing crosses to the host. The backward pass leaves the input's gradient in the engine
    /// ([`Engine::input_grad_rows`]; its entry of [`Gradients::pulls`] is empty).
    Linked(&'a LinkedRows),
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

fn internal(msg: String) -> Error {
    Error::Backend { backend: "engine", op: "plan".into(), msg }
}

/// An error unless every graph fits `f` (arity, labels), naming the graph's place, and
/// unless batching them fits in memory ([`arbor_core::memory::check_batch`]).
fn check_graphs(f: &VertexFn, graphs: &[&InputGraph]) -> Result<()> {
    for (gi, g) in graphs.iter().enumerate() {
        g.check_for(f).map_err(|e| match e {
            Error::Graph { reason, .. } => Error::Graph { graph: format!("#{gi} of the minibatch"), reason },
            e => e,
        })?;
    }
    Ok(())
}

/// The scheduler, also after a panic on another thread while it was held: it keeps no state
/// between minibatches (its scratch is reset by every schedule), so it is still good.
fn lock(scheduler: &Mutex<Scheduler>) -> std::sync::MutexGuard<'_, Scheduler> {
    scheduler.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Schedules minibatches for one engine, on any thread: a trainer plans minibatch k+1 while
/// the device runs minibatch k, so a forward pass given the plan
/// ([`Pass::planned`]) spends no time scheduling.
#[derive(Clone)]
pub struct Planner {
    f: Arc<VertexFn>,
    scheduler: Arc<Mutex<Scheduler>>,
}

/// A checked and scheduled minibatch, borrowing its graphs (which therefore cannot change
/// before it runs).
pub struct Planned<'g> {
    graphs: PhantomData<&'g InputGraph>,
    /// Vertices per graph (where dropout masks are drawn).
    sizes: Vec<usize>,
    /// Boxed: a plan moves from the thread that made it to the pass, small.
    schedule: Box<Schedule>,
    scheduler: Arc<Mutex<Scheduler>>,
}

impl Planner {
    /// Checks `graphs` against the vertex function and schedules them.
    pub fn plan<'g>(&self, graphs: &[&'g InputGraph]) -> Result<Planned<'g>> {
        profile::time(Activity::Plan, || {
            check_graphs(&self.f, graphs)?;
            let mut schedule = Schedule::default();
            lock(&self.scheduler).schedule(graphs, self.f.arity(), &mut schedule);
            let sizes = graphs.iter().map(|g| g.len()).collect();
            let scheduler = Arc::clone(&self.scheduler);
            Ok(Planned { graphs: PhantomData, sizes, schedule: Box::new(schedule), scheduler })
        })
    }
}

/// The minibatch of a [`Pass`]: graphs checked and scheduled as it runs, or ahead of it.
enum Graphs<'a> {
    Now(&'a [&'a InputGraph]),
    Planned(Planned<'a>),
}

/// One forward pass of an [`Engine`] ([`Engine::run`]): its minibatch, each input's rows,
/// whether it trains, and which vertices' outputs come back.
///
/// ```
/// # use arbor::{engine::Pass, InputGraph, Pull};
/// # fn passes(graphs: &[&InputGraph], x: &[f32], roots: &[usize]) {
/// let pulls = [Pull::Rows(x)];
/// let training = Pass::train(graphs, &pulls); // every vertex's outputs, kept for backward
/// let at_roots = Pass::train(graphs, &pulls).rows(roots); // only the roots' outputs
/// let inference = Pass::infer(graphs, &pulls); // keeps nothing for backward
/// # }
/// ```
pub struct Pass<'a> {
    graphs: Graphs<'a>,
    pulls: &'a [Pull<'a>],
    train: bool,
    rows: Option<&'a [usize]>,
    /// Whether [`Engine::run`] reads the outputs back ([`Pass::kept`]: no).
    read: bool,
}

impl<'a> Pass<'a> {
    /// A training pass over `graphs`: it keeps what [`Engine::backward`] needs.
    pub fn train(graphs: &'a [&'a InputGraph], pulls: &'a [Pull<'a>]) -> Pass<'a> {
        Pass { graphs: Graphs::Now(graphs), pulls, train: true, rows: None, read: true }
    }

    /// An inference pass over `graphs`: it keeps nothing for a backward pass, so it needs less
    /// memory.
    pub fn infer(graphs: &'a [&'a InputGraph], pulls: &'a [Pull<'a>]) -> Pass<'a> {
        Pass { graphs: Graphs::Now(graphs), pulls, train: false, rows: None, read: true }
    }

    /// A training pass over a minibatch the engine's [`Planner`] has already checked and
    /// scheduled (on another thread, while the pass before ran).
    pub fn planned(planned: Planned<'a>, pulls: &'a [Pull<'a>]) -> Pass<'a> {
        Pass { graphs: Graphs::Planned(planned), pulls, train: true, rows: None, read: true }
    }

    /// Returns only the vertices `rows` (merged-vertex indices, e.g. the roots a loss reads) of
    /// each pushed output, in that order: `rows.len()` blocks each. Only those rows leave the
    /// device; after a training pass, [`Engine::backward`] takes gradients at those rows only.
    pub fn rows(self, rows: &'a [usize]) -> Pass<'a> {
        Pass { rows: Some(rows), ..self }
    }

    /// Leaves the pushed outputs on the backend ([`Engine::run`] returns no rows), for another
    /// engine to pull ([`Engine::output_rows`], [`Pull::Linked`]).
    pub fn kept(self) -> Pass<'a> {
        Pass { read: false, ..self }
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

/// Runs one vertex function over minibatches of input graphs on a backend.
///
/// [`Engine::run`] runs F over every vertex of a minibatch of graphs (one [`Pass`]), batching the
/// vertices that are ready at the same step across all graphs; a training pass keeps what
/// [`Engine::backward`] needs, an inference pass nothing. Per-vertex data, in and out, is laid out graph by graph,
/// vertex by vertex (the *merged-vertex order*). The engine owns the parameters
/// ([`Engine::params`], [`Engine::set_params`], [`Engine::update_params`]); the backward pass
/// returns their gradients and leaves updating them to the caller.
///
/// # Example
///
/// An Elman cell `h = tanh(x·W + h_prev·U + b)` over two sentences (chains of 2 and 3 tokens),
/// with parameters chosen so that the result can be checked by hand:
///
/// ```
/// use arbor::engine::Pass;
/// use arbor::{Builder, CpuBackend, Engine, Init, InputGraph, Pull};
///
/// let f = Builder::new("elman", 1);
/// let (x, h_prev) = (f.pull("x", 2), f.gather(0, "h", 3));
/// let (w, u) = (f.param("W", [2, 3], Init::Xavier), f.param("U", [3, 3], Init::Xavier));
/// let h = (x.matmul(w) + h_prev.matmul(u) + f.param("b", [1, 3], Init::Zeros)).tanh();
/// f.scatter("h", h);
/// f.push("h", h);
/// let cell = f.build()?;
///
/// // Every entry of W is 0.5 and of U 0.25; b is zero (usually: `cell.init_params(&mut rng)`).
/// let params = vec![vec![0.5; 2 * 3], vec![0.25; 3 * 3], vec![0.0; 3]];
/// let mut engine = Engine::new(CpuBackend::new(), cell, &params)?;
/// let (a, b) = (InputGraph::chain(2), InputGraph::chain(3));
/// let x = vec![1.0; 5 * 2]; // one 2-wide row per vertex: a's 2, then b's 3
/// let pulls = [Pull::Rows(&x)];
/// let out = engine.run(Pass::train(&[&a, &b], &pulls))?;
/// let h = &out[0]; // the pushed `h`, 5 rows of 3
/// let h0 = 1f32.tanh(); // x·W = 1 in every column, no child
/// let h1 = (1.0 + 3.0 * 0.25 * h0).tanh(); // plus h0·U
/// assert!((h[0] - h0).abs() < 1e-5 && (h[3] - h1).abs() < 1e-5); // a's vertices 0 and 1
/// assert!((h[2 * 3] - h0).abs() < 1e-5); // b's vertex 0 is vertex 2 of the minibatch
///
/// // d(Σ h)/d(everything): the gradient of the pushed output is 1 everywhere.
/// let grads = engine.backward(&[&vec![1.0; 5 * 3]])?;
/// assert_eq!(grads.pulls[0].len(), 5 * 2); // dL/dx, one row per vertex
/// assert!(grads.params[2].iter().all(|&g| g > 0.0)); // dL/db: every h grows with b
///
/// // Inference computes the same values and keeps nothing for a backward pass.
/// let again = engine.run(Pass::infer(&[&a, &b], &pulls))?;
/// assert!(again[0].iter().zip(h).all(|(p, q)| (p - q).abs() < 1e-6));
/// # Ok::<(), arbor::Error>(())
/// ```
pub struct Engine<B: Backend> {
    backend: B,
    /// The arena, the parameters and their gradients ([`ARENA`], [`PARAMS`], [`GRADS`]).
    bufs: Vec<B::Buffer>,
    index: Vec<B::Index>,
    lowering: Lowering,
    /// Floating-point operations executed so far (GEMMs and fused kernels).
    flops: u64,
    /// Backend calls made so far ([`Counts::total`]).
    calls: u64,
    host: Vec<f32>,
    /// What the next training pass draws its dropout masks from.
    dropout: DropoutKey,
    /// The masks of the last pass, one per dropout site.
    masks: Vec<Vec<f32>>,
    /// The vertices whose outputs the last training pass returned (none: all), where
    /// [`Engine::backward`] takes their gradients.
    rows: Option<Vec<usize>>,
    /// Per parameter: [`Engine::optimize`] has updated it (its state is in use).
    updated: Vec<bool>,
    /// The width of the held table's rows (0: none; [`Engine::set_table`]).
    table_width: usize,
    /// The rows of a gradient of the held table given from the host, until the next backward
    /// pass (see [`Engine::set_table_grad`]).
    given_table_rows: Option<Vec<u32>>,
    /// Per pulled input, whether backward passes leave its gradient unread
    /// ([`Engine::skip_input_grads`]).
    unread_inputs: Vec<bool>,
    /// The row of each vertex of the outputs [`Engine::keep_outputs`] set aside.
    kept_order: Vec<u32>,
}

impl<B: Backend> Engine<B> {
    /// An engine for `f` with initial parameter values (in the order of `f.params()`).
    pub fn new(backend: B, f: VertexFn, params: &[Vec<f32>]) -> Result<Engine<B>> {
        let lowering = Lowering::with_function(Arc::new(f));
        let total = lowering.a.params_len;
        let mut bufs = vec![backend.alloc(0)?, backend.alloc(total)?, backend.alloc(total)?];
        // The optimizer's state and the held table's buffers, empty until used.
        while bufs.len() < held::BUFFERS {
            bufs.push(backend.alloc(0)?);
        }
        // The minibatch's, a given table gradient's rows (`TABLE_ROWS`), the staged rows.
        let index = vec![backend.alloc_index(0)?, backend.alloc_index(0)?, backend.alloc_index(0)?];
        let mut e = Engine {
            backend,
            bufs,
            index,
            lowering,
            flops: 0,
            calls: 0,
            host: Vec::new(),
            dropout: DropoutKey::default(),
            masks: Vec::new(),
            rows: None,
            updated: Vec::new(),
            table_width: 0,
            given_table_rows: None,
            unread_inputs: Vec::new(),
            kept_order: Vec::new(),
        };
        e.set_params(params)?;
        Ok(e)
    }

    /// The vertex function.
    pub fn function(&self) -> &VertexFn {
        self.lowering.function()
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The lowering of the last pass: its launches, schedule and memory plan.
    pub fn lowering(&self) -> &Lowering {
        &self.lowering
    }

    /// The schedule of the last forward pass.
    pub fn schedule(&self) -> &Schedule {
        self.lowering.schedule()
    }

    /// The memory plan of the last forward pass.
    pub fn memory_plan(&self) -> &MemoryPlan {
        self.lowering.memory_plan()
    }

    /// Treats all-zero input rows as padding: their gradient is reported as zero and not
    /// computed (e.g. the internal vertices of a constituency tree, which have no word).
    pub fn set_skip_padding_grads(&mut self, skip: bool) {
        self.lowering.set_skip_padding_grads(skip);
    }

    /// Floating-point operations this engine has executed: `2·m·n·k` per matrix product, one
    /// per element per fused op. Work skipped as known zeros is not counted.
    pub fn flops(&self) -> u64 {
        self.flops
    }

    /// Backend calls this engine has made: one per product, fused kernel, copy, fill,
    /// scatter-add and row sum, and the optimizer's (a sum of squares per region, a scaling, an
    /// update): on a GPU, a kernel launch or a cuBLAS call each. Reads and writes of values are
    /// not counted.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// Schedules later minibatches with `policy` (the default batches by height).
    pub fn set_policy(&mut self, policy: Box<dyn Policy>) {
        self.lowering.set_policy(policy);
    }

    /// Draws the dropout masks of later training passes from `key` (the caller moves
    /// [`DropoutKey::step`] on every optimizer step; see [`dropout`]).
    pub fn set_dropout_key(&mut self, key: DropoutKey) {
        self.dropout = key;
    }

    /// What training passes draw their dropout masks from.
    pub fn dropout_key(&self) -> DropoutKey {
        self.dropout
    }

    /// `pulls` followed by the dropout masks of a pass over graphs of `sizes` vertices (drawn
    /// in training, ones in inference), which the returned list borrows from `masks`.
    fn with_masks<'a>(
        f: &VertexFn,
        key: DropoutKey,
        masks: &'a mut Vec<Vec<f32>>,
        pulls: &[Pull<'a>],
        sizes: &[usize],
        train: bool,
    ) -> Result<Vec<Pull<'a>>> {
        batch::check_count(f, "input", f.inputs().len(), pulls.len())?;
        dropout::fill_masks(f, key, sizes, train, masks);
        Ok(pulls.iter().copied().chain(masks.iter().map(|m| Pull::Rows(m))).collect())
    }

    /// A handle that schedules minibatches for this engine on any thread (see [`Planner`]).
    pub fn planner(&self) -> Planner {
        self.lowering.planner()
    }

    /// Replaces every parameter's values.
    pub fn set_params(&mut self, params: &[Vec<f32>]) -> Result<()> {
        self.write_params(PARAMS, params, "parameters")
    }

    /// Writes one tensor per parameter (`what` they are, for errors) to buffer `buf`, laid out
    /// as the parameters are.
    fn write_params(&mut self, buf: usize, values: &[Vec<f32>], what: &str) -> Result<()> {
        let f = self.lowering.function_arc();
        if values.len() != f.params().len() {
            return Err(Error::input(
                format!("{what} of `{}`", f.name()),
                format!("{} tensors", f.params().len()),
                format!("{}", values.len()),
            ));
        }
        for ((p, decl), &at) in values.iter().zip(f.params()).zip(&self.lowering.a.param_at) {
            if p.len() != decl.shape.numel() {
                return Err(Error::input(
                    format!("{what} of parameter `{}`", decl.name),
                    format!("{} values for {}", decl.shape.numel(), decl.shape),
                    format!("{}", p.len()),
                ));
            }
            self.backend.write(&mut self.bufs[buf], at, p)?;
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
        let sizes: Vec<usize> = self.function().params().iter().map(|p| p.shape.numel()).collect();
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
        let f = self.function();
        let mut out = Vec::with_capacity(f.params().len());
        for (decl, &at) in f.params().iter().zip(&self.lowering.a.param_at) {
            out.push(self.backend.read_vec(&self.bufs[buf], at, decl.shape.numel())?);
        }
        Ok(out)
    }

    /// Runs F over every vertex of a minibatch as `pass` says (see [`Pass`]): in training,
    /// keeping what [`Engine::backward`] needs. `pulls[i]` gives input `i` for every vertex,
    /// graph by graph, vertex by vertex. Returns each pushed output the same way (or only the
    /// vertices [`Pass::rows`] names; empty after [`Pass::kept`]).
    pub fn run(&mut self, pass: Pass<'_>) -> Result<Vec<Vec<f32>>> {
        let Pass { graphs, pulls, train, rows, read } = pass;
        self.check_linked(pulls)?;
        let (schedule, sizes) = match graphs {
            Graphs::Now(graphs) => {
                check_graphs(self.function(), graphs)?;
                (self.lowering.schedule_graphs(graphs), graphs.iter().map(|g| g.len()).collect())
            }
            Graphs::Planned(planned) => self.lowering.take_planned(planned)?,
        };
        check_vertices("output rows", sizes.iter().sum(), rows.unwrap_or_default())?;
        profile::time(Activity::Lower, || {
            if self.function().dropout_rates().is_empty() {
                self.lowering.forward_scheduled(schedule, pulls, train)
            } else {
                let f = Arc::clone(self.lowering.function_arc());
                let all = Engine::<B>::with_masks(&f, self.dropout, &mut self.masks, pulls, &sizes, train)?;
                self.lowering.forward_scheduled(schedule, &all, train)
            }
        })?;
        self.rows = rows.map(<[usize]>::to_vec);
        self.execute()?;
        if !read {
            return Ok(vec![Vec::new(); self.function().outputs().len()]);
        }
        profile::time(Activity::Read, || self.download_outputs(rows))
    }

    /// Uploads the host data of the pass just lowered (growing the arena and the index buffer
    /// to its layout; they never shrink) and runs its launches.
    fn execute(&mut self) -> Result<()> {
        profile::time(Activity::Upload, || self.upload())?;
        let (l, backend) = (&self.lowering, &self.backend);
        let (flops, calls) =
            launch::execute(backend, &mut Mem { data: &mut self.bufs, index: &self.index }, l.launches())?;
        self.flops += flops;
        self.calls += calls;
        Ok(())
    }

    /// Grows the arena and the index buffers to the pass just lowered and copies its host data.
    fn upload(&mut self) -> Result<()> {
        let (l, backend) = (&self.lowering, &self.backend);
        let arena = l.memory_plan().len;
        if backend.len(&self.bufs[ARENA]) < arena {
            // A quarter more than this minibatch needs, so the next, larger one rarely maps
            // (and faults in) a new arena.
            self.bufs[ARENA] = backend.alloc(arena + arena / 4)?;
        }
        let up = &l.uploads;
        if !up.index.is_empty() {
            if backend.index_len(&self.index[0]) < up.index.len() {
                self.index[0] = backend.alloc_index(up.index.len())?;
            }
            backend.write_index(&mut self.index[0], 0, &up.index)?;
        }
        if up.staged_room() > 0 {
            if backend.len(&self.bufs[STAGED]) < up.staged_room() {
                self.bufs[STAGED] = backend.alloc(up.staged_room().next_power_of_two())?;
            }
            if !up.staged.is_empty() {
                backend.write(&mut self.bufs[STAGED], 0, &up.staged)?;
            }
            if backend.index_len(&self.index[STAGED_ROWS]) < up.staged_rows.len() {
                self.index[STAGED_ROWS] = backend.alloc_index(up.staged_rows.len().next_power_of_two())?;
            }
            backend.write_index(&mut self.index[STAGED_ROWS], 0, &up.staged_rows)?;
        }
        for (at, range) in &up.writes {
            backend.write(&mut self.bufs[ARENA], *at, &up.data[range.clone()])?;
        }
        Ok(())
    }

    /// Every pushed output of the last forward pass in merged-vertex order: all vertices, or
    /// only `rows` (checked), in that order. All vertices' outputs lying close together in one
    /// buffer (the span at most twice their values, and 4,096 more) come back in one read.
    fn download_outputs(&mut self, rows: Option<&[usize]>) -> Result<Vec<Vec<f32>>> {
        let f = Arc::clone(self.lowering.function_arc());
        let n = self.schedule().len();
        let regions = f
            .outputs()
            .iter()
            .map(|o| Ok((self.lowering.loc(lower::Pass::Forward, o.value, 0, 0)?, o.shape.numel())))
            .collect::<Result<Vec<(Loc, usize)>>>()?;
        if let (None, Some(&(first, _))) = (rows, regions.first()) {
            let start = regions.iter().map(|(at, _)| at.offset).min().unwrap_or(first.offset);
            let end = regions.iter().map(|(at, block)| at.offset + n * block).max().unwrap_or(start);
            let total: usize = regions.iter().map(|(_, block)| n * block).sum();
            if regions.iter().all(|(at, _)| at.buf == first.buf) && end - start <= 2 * total + 4096 {
                self.host.resize(end - start, 0.0);
                self.backend.read(&self.bufs[first.buf], start, &mut self.host)?;
                let order = &self.lowering.b.schedule.row_of_vertex;
                return Ok(regions
                    .iter()
                    .map(|&(at, block)| in_order(&self.host[at.offset - start..][..n * block], order, block))
                    .collect());
            }
        }
        regions
            .into_iter()
            .map(|(at, block)| match rows {
                Some(rows) => self.download_some(at, block, rows),
                None => self.download_rows(at, block),
            })
            .collect()
    }

    /// Runs F' over the minibatch of the last training [`Engine::run`], given each pushed
    /// output's gradient laid out as that pass returned the outputs: every vertex's, or only
    /// those of the vertices [`Pass::rows`] named (every other vertex's gradient being zero).
    /// Returns the gradients of the pulled inputs and of the parameters.
    pub fn backward(&mut self, push_grads: &[&[f32]]) -> Result<Gradients> {
        let mut grads = self.backward_kept(push_grads)?;
        grads.params = self.param_grads()?;
        Ok(grads)
    }

    /// [`Engine::backward`], leaving the parameters' gradients in the engine (`params` comes
    /// back empty) for [`Engine::optimize`]; [`Engine::param_grads`] reads them.
    pub fn backward_kept(&mut self, push_grads: &[&[f32]]) -> Result<Gradients> {
        let given: Vec<Given<'_>> = push_grads.iter().map(|g| Given::Rows(g)).collect();
        let rows = self.rows.take();
        let grads = self.run_backward(rows.as_deref(), &given);
        self.rows = rows;
        grads
    }

    /// Which pulled inputs' gradients backward passes leave unread (their entries of
    /// [`Gradients::pulls`] empty): a head's targets, say, whose gradient nobody uses.
    pub fn skip_input_grads(&mut self, inputs: &[usize]) {
        let n = self.function().all_inputs().len();
        self.unread_inputs = (0..n).map(|i| inputs.contains(&i)).collect();
    }

    fn run_backward(&mut self, rows: Option<&[usize]>, push_grads: &[Given<'_>]) -> Result<Gradients> {
        self.given_table_rows = None;
        profile::time(Activity::Lower, || self.lowering.backward_given(rows, push_grads).map(|_| ()))?;
        self.execute()?;
        let f = Arc::clone(self.lowering.function_arc());
        let n = self.schedule().len();
        let skip = self.lowering.skip_padding_grads();
        let mut pulls = Vec::with_capacity(f.inputs().len());
        let mut tables = Vec::with_capacity(f.inputs().len());
        for (i, port) in f.inputs().iter().enumerate() {
            let block = port.shape.numel();
            let linked = self.lowering.b.linked.iter().any(|l| l.input == i);
            if linked
                || self.unread_inputs.get(i) == Some(&true)
                || self.lowering.b.held.as_ref().is_some_and(|h| h.holds(i))
            {
                // The held table's and a linked input's gradients stay in the engine.
                tables.push(None);
                pulls.push(Vec::new());
                continue;
            }
            if let Some(ids) = self.lowering.b.shared[i].as_ref().and_then(|s| s.ids.clone()) {
                tables.push(Some(profile::time(Activity::Read, || self.table_grad(i, ids, block))?));
                pulls.push(Vec::new());
                continue;
            }
            tables.push(None);
            let mut rows = match f.backward().pull_grads[i] {
                Some(g) => self.download_rows(self.lowering.loc(lower::Pass::Backward, g, 0, 0)?, block)?,
                None => vec![0.0; n * block],
            };
            if skip {
                let b = &self.lowering.b;
                for (r, _) in b.pull_zero_rows[i].iter().enumerate().filter(|(_, z)| **z) {
                    let v = b.schedule.vertex_of_row[r] as usize;
                    rows[v * block..(v + 1) * block].fill(0.0);
                }
            }
            pulls.push(rows);
        }
        Ok(Gradients { pulls, tables, params: Vec::new() })
    }

    /// The table gradient of looked-up input `i` (distinct ids `ids`): read where the backward
    /// pass formed it per distinct row, or else summed per id from the gradient rows of the
    /// vertices.
    fn table_grad(&mut self, i: usize, ids: Vec<u32>, block: usize) -> Result<SparseGrad> {
        let len = ids.len() * block;
        let l = &self.lowering;
        let values = if let Some(at) = l.b.table_grad_at[i] {
            self.backend.read_vec(&self.bufs[ARENA], at, len)?
        } else if let Some(g) = l.function().backward().pull_grads[i] {
            let mut values = vec![0.0; len];
            self.host.resize(l.b.schedule.len() * block, 0.0);
            let at = l.loc(lower::Pass::Backward, g, 0, 0)?;
            self.backend.read(&self.bufs[at.buf], at.offset, &mut self.host)?;
            let map = l.b.shared[i].as_ref().map_or(&[][..], |s| &s.map);
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

    /// Reads a region in row order and returns it in merged-vertex order.
    fn download_rows(&mut self, at: Loc, block: usize) -> Result<Vec<f32>> {
        let s = &self.lowering.b.schedule;
        self.host.resize(s.len() * block, 0.0);
        self.backend.read(&self.bufs[at.buf], at.offset, &mut self.host)?;
        Ok(in_order(&self.host, &s.row_of_vertex, block))
    }

    /// Reads the vertices `vertices` (merged-vertex indices, checked) of a region, in that order.
    fn download_some(&mut self, at: Loc, block: usize, vertices: &[usize]) -> Result<Vec<f32>> {
        let rows: Vec<u32> = vertices.iter().map(|&v| self.schedule().row_of_vertex[v]).collect();
        let mut out = vec![0.0; rows.len() * block];
        self.backend.read_rows(&self.bufs[at.buf], at.offset, block, &rows, &mut out)?;
        Ok(out)
    }
}

/// The `block`-wide rows of `region` in the order `order` names them (row `order[i]` i-th): a
/// region laid out in row order, returned in merged-vertex order.
pub(crate) fn in_order(region: &[f32], order: &[u32], block: usize) -> Vec<f32> {
    order.iter().flat_map(|&r| &region[r as usize * block..][..block]).copied().collect()
}
