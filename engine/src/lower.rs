//! Lowering: a minibatch's forward or backward pass turned into a list of [`Launch`]es and the
//! host data they start from ([`Uploads`]), with no backend in sight. The engine then runs the
//! list ([`launch::execute`](super::launch)); a test or a curious user can print it instead.

use super::analysis::{Analysis, PlanKind, StepRef};
use super::batch::{self, Batch, SharedCopy};
use super::facts::{self, Cut, FactCache, Facts, Loads};
use super::fnv::FnvMap;
use super::launch::{Launch, Uploads, ARENA, PARAMS, STAGED, STAGED_ROWS};
use super::link::Given;
use super::products::Waves;
use super::{check_graphs, check_vertices, internal, lock, Planned, Planner, Pull};
use arbor_batching::{ByHeight, Policy, Region, Schedule, Scheduler};
use arbor_core::attention::Widths;
use arbor_core::backend::{Attention, AttentionGrads, Gemm, IndexLoc, Loc, Rows, SCATTERS};
use arbor_core::error::{Error, Result};
use arbor_core::fusion::{Kernel, Phase, Plan, Step};
use arbor_core::graph::InputGraph;
use arbor_core::ir::{Func, Op, Reduce, ValueId, VertexFn};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Which function a value belongs to.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Pass {
    Forward,
    Backward,
}

/// A fused kernel with the stores a task leaves unread taken out: its step, and the stores left
/// out (bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct PrunedKernel {
    step: StepRef,
    unread: u64,
}

/// Turns minibatches of one vertex function into launch lists. It keeps what it learns across
/// minibatches (facts by load pattern, pruned kernels) and the state of the last minibatch,
/// which the backward pass and the engine's downloads read.
pub struct Lowering {
    pub(super) a: Analysis,
    scheduler: Arc<Mutex<Scheduler>>,
    facts: FactCache,
    pruned: FnvMap<PrunedKernel, Arc<Kernel>>,
    skip_padding_grads: bool,
    /// The rows of the table the engine holds, if it holds one.
    held_rows: Option<usize>,
    pub(super) b: Batch,
    pub(super) launches: Vec<Launch>,
    /// Emptied vectors of earlier launches, reused by the next pass's (no allocation per pass).
    spare: Spare,
    pub(super) uploads: Uploads,
}

/// Emptied vectors of launches, kept for reuse.
#[derive(Default)]
struct Spare {
    loads: Vec<Vec<Rows>>,
    stores: Vec<Vec<Loc>>,
    gemms: Vec<Vec<Gemm>>,
    /// The parts of scatter-adds sent together, and the scatters a task groups.
    scatters: Vec<Vec<(Loc, Rows)>>,
    together: Vec<(usize, Loc, Rows)>,
    /// The waves of products of a step (see [`Lowering::phase`]), emptied.
    waves: Waves,
}

/// A scheduler for `f` by `policy`, laying out the edge features `f` weighs children by.
fn scheduler(f: &VertexFn, policy: Box<dyn Policy>) -> Scheduler {
    let mut s = Scheduler::new(policy);
    s.set_edge_features(f.edge_feature_width());
    s
}

impl Lowering {
    /// A lowering for `f`, scheduling by height.
    pub fn new(f: VertexFn) -> Lowering {
        Lowering::with_function(Arc::new(f))
    }

    pub(super) fn with_function(f: Arc<VertexFn>) -> Lowering {
        Lowering {
            scheduler: Arc::new(Mutex::new(scheduler(&f, Box::new(ByHeight)))),
            a: Analysis::new(f),
            facts: FactCache::default(),
            pruned: FnvMap::default(),
            skip_padding_grads: false,
            held_rows: None,
            b: Batch::default(),
            launches: Vec::new(),
            spare: Spare::default(),
            uploads: Uploads::default(),
        }
    }

    /// The vertex function.
    pub fn function(&self) -> &VertexFn {
        &self.a.f
    }

    pub(super) fn function_arc(&self) -> &Arc<VertexFn> {
        &self.a.f
    }

    /// Sets the rows of the table the engine holds ([`Engine::set_table`](super::Engine::set_table)),
    /// which inputs given as [`Pull::Held`](super::Pull::Held) are checked against.
    pub(super) fn set_held_rows(&mut self, rows: Option<usize>) {
        self.held_rows = rows;
    }

    /// Treats all-zero input rows as padding (see [`Engine::set_skip_padding_grads`](super::Engine::set_skip_padding_grads)).
    pub fn set_skip_padding_grads(&mut self, skip: bool) {
        self.skip_padding_grads = skip;
        self.facts.clear();
    }

    pub(super) fn skip_padding_grads(&self) -> bool {
        self.skip_padding_grads
    }

    /// Schedules later minibatches with `policy`.
    pub fn set_policy(&mut self, policy: Box<dyn Policy>) {
        self.scheduler = Arc::new(Mutex::new(scheduler(&self.a.f, policy)));
    }

    /// A handle that schedules minibatches for this lowering on any thread.
    pub fn planner(&self) -> Planner {
        Planner { f: Arc::clone(&self.a.f), scheduler: Arc::clone(&self.scheduler) }
    }

    /// The schedule of the last forward pass.
    pub fn schedule(&self) -> &Schedule {
        &self.b.schedule
    }

    /// The memory plan of the last forward pass.
    pub fn memory_plan(&self) -> &arbor_batching::MemoryPlan {
        &self.b.memory
    }

    /// The launches of the last pass lowered.
    pub fn launches(&self) -> &[Launch] {
        &self.launches
    }

    /// Lowers the forward pass (inference unless `train`) over `graphs` with inputs `pulls`
    /// (as [`Engine::run`](super::Engine::run) takes them) and returns its launches.
    pub fn forward(&mut self, graphs: &[&InputGraph], pulls: &[Pull<'_>], train: bool) -> Result<&[Launch]> {
        check_graphs(&self.a.f, graphs)?;
        let schedule = self.schedule_graphs(graphs);
        self.forward_scheduled(schedule, pulls, train)?;
        Ok(&self.launches)
    }

    /// Schedules checked `graphs`, reusing the last minibatch's schedule's memory.
    pub(super) fn schedule_graphs(&mut self, graphs: &[&InputGraph]) -> Schedule {
        let mut schedule = std::mem::take(&mut self.b.schedule);
        lock(&self.scheduler).schedule(graphs, self.a.f.arity(), &mut schedule);
        schedule
    }

    /// The schedule and graph sizes of a minibatch this lowering's [`Planner`] scheduled.
    pub(super) fn take_planned(&self, planned: Planned<'_>) -> Result<(Schedule, Vec<usize>)> {
        if !Arc::ptr_eq(&planned.scheduler, &self.scheduler) {
            return Err(internal("a minibatch planned for another engine (or before set_policy)".into()));
        }
        Ok((*planned.schedule, planned.sizes))
    }

    /// The forward pass over a checked, scheduled minibatch.
    pub(super) fn forward_scheduled(&mut self, schedule: Schedule, pulls: &[Pull<'_>], train: bool) -> Result<()> {
        self.clear_launches();
        let skip = self.skip_padding_grads;
        let setup = (skip, self.held_rows);
        self.b = Batch::new(&self.a, &mut self.facts, setup, schedule, pulls, train, &mut self.uploads)?;
        self.copy_held_rows();
        self.copy_linked_rows();
        for i in 0..self.b.shared.len() {
            if self.a.rows_read[i] {
                self.gather_lookup(i);
            }
        }
        let kind = if train { PlanKind::Forward } else { PlanKind::Inference };
        let f = Arc::clone(&self.a.f);
        let plan = kind.of(&f);
        let tasks = self.b.schedule.tasks.len();
        self.phase(Pass::Forward, kind, plan, Phase::Prologue, 0..tasks)?;
        for t in 0..tasks {
            self.phase(Pass::Forward, kind, plan, Phase::Recurrent, t..t + 1)?;
        }
        self.phase(Pass::Forward, kind, plan, Phase::Epilogue, 0..tasks)
    }

    /// Lowers the backward pass over the minibatch of the last training forward pass, given
    /// each pushed output's gradient (all vertices, or only `rows`, as
    /// [`Engine::backward`](super::Engine::backward) takes them after a pass of [`Pass::rows`](super::Pass::rows)).
    pub fn backward(&mut self, rows: Option<&[usize]>, push_grads: &[&[f32]]) -> Result<&[Launch]> {
        let given: Vec<Given<'_>> = push_grads.iter().map(|g| Given::Rows(g)).collect();
        self.backward_given(rows, &given)
    }

    /// [`Lowering::backward`], each pushed output's gradient given from the host or as rows of
    /// a linked engine's arena (only with `rows`).
    pub fn backward_given(&mut self, rows: Option<&[usize]>, push_grads: &[Given<'_>]) -> Result<&[Launch]> {
        if !self.b.trained {
            return Err(Error::input(
                "Engine::backward",
                "a preceding training pass (Engine::run of Pass::train)",
                "no forward pass, or an inference pass (Pass::infer keeps nothing for backward)",
            ));
        }
        let f = Arc::clone(&self.a.f);
        self.clear_launches();
        self.uploads.clear();
        let push_zero = self.upload_push_grads(rows, push_grads)?;
        let b = f.backward();
        self.b.bwd_facts = (0..self.b.schedule.tasks.len())
            .map(|t| {
                let grad_loads: Loads = b
                    .func
                    .nodes
                    .iter()
                    .map(|n| matches!(n.op, Op::PushGrad { output } if self.b.task_all(t, &push_zero[output])))
                    .collect();
                self.facts.backward(&f, &self.b.loads[t], &grad_loads, self.skip_padding_grads)
            })
            .collect();
        let n = self.b.schedule.len();
        for (s, st) in f.states().iter().enumerate() {
            let dst = Loc { buf: ARENA, offset: self.b.memory.state_grads[s].offset };
            self.launches.push(Launch::Fill { dst, len: n * st.shape.numel() });
        }
        // The parameters' and tables' gradients are zeroed here where their first write adds to
        // them.
        let grads_zeroed_at = self.launches.len();
        let plan = f.backward_plan();
        let tasks = self.b.schedule.tasks.len();
        let kind = PlanKind::Backward;
        self.phase(Pass::Backward, kind, plan, Phase::Prologue, 0..tasks)?;
        self.send_child_grads(plan, Phase::Prologue, 0..tasks)?;
        for t in (0..tasks).rev() {
            self.phase(Pass::Backward, kind, plan, Phase::Recurrent, t..t + 1)?;
            self.send_child_grads(plan, Phase::Recurrent, t..t + 1)?;
        }
        self.phase(Pass::Backward, kind, plan, Phase::Epilogue, 0..tasks)?;
        let param_grads_from = self.launches.len();
        self.param_grads()?;
        self.overwrite_first_grads(grads_zeroed_at, param_grads_from);
        self.sum_held_grads()?;
        Ok(&self.launches)
    }

    /// Checks each pushed output's gradient and adds it to the uploads (the vertices not in
    /// `rows`, when given, zeros). Returns, per output, which rows (in row order) are all zeros.
    fn upload_push_grads(&mut self, rows: Option<&[usize]>, data: &[Given<'_>]) -> Result<Vec<Vec<bool>>> {
        let what = "gradient of output";
        let f = Arc::clone(&self.a.f);
        batch::check_count(&f, what, f.outputs().len(), data.len())?;
        let n = self.b.schedule.len();
        let Some(rows) = rows else {
            let mut zero = Vec::with_capacity(data.len());
            for ((given, port), region) in data.iter().zip(f.outputs()).zip(&self.b.memory.push_grads) {
                let Given::Rows(values) = *given else {
                    return Err(Error::input(
                        format!("{what} `{}`", port.name),
                        "rows from the host (linked rows need a pass of Pass::rows)",
                        "linked rows",
                    ));
                };
                batch::check_rows(what, port, n, values.len())?;
                let order = &self.b.schedule.vertex_of_row;
                zero.push(batch::upload_rows(&mut self.uploads, order, region.offset, values, port.shape.numel()));
            }
            return Ok(zero);
        };
        check_vertices(what, n, rows)?;
        let mut seen = vec![false; n];
        if let Some(&twice) = rows.iter().find(|&&v| std::mem::replace(&mut seen[v], true)) {
            return Err(Error::input(
                format!("{what} rows"),
                "each vertex at most once",
                format!("vertex {twice} twice"),
            ));
        }
        // Only the given rows are sent (or copied from the linked engine, after the host's); on
        // the backend the region is zeroed and they are scattered to their vertices' rows.
        let row_of_vertex = &self.b.schedule.row_of_vertex;
        self.uploads.staged_rows.extend(rows.iter().map(|&v| row_of_vertex[v]));
        let mut zero = vec![Vec::new(); data.len()];
        let host_first = (0..data.len()).filter(|&o| matches!(data[o], Given::Rows(_)));
        for o in host_first.chain((0..data.len()).filter(|&o| matches!(data[o], Given::Linked(_)))) {
            let (port, region) = (&f.outputs()[o], self.b.memory.push_grads[o]);
            let block = port.shape.numel();
            let wrong = |expected: String, got: String| Error::input(format!("{what} `{}`", port.name), expected, got);
            let mut z = vec![true; n];
            let src = Loc { buf: STAGED, offset: self.uploads.staged_room() };
            match data[o] {
                Given::Rows(values) => {
                    if values.len() != rows.len() * block {
                        let expected = format!("{} values ({} rows × {block})", rows.len() * block, rows.len());
                        return Err(wrong(expected, values.len().to_string()));
                    }
                    for (&v, row) in rows.iter().zip(values.chunks_exact(block.max(1))) {
                        z[self.b.schedule.row_of_vertex[v] as usize] = row.iter().all(|&x| x == 0.0);
                    }
                    self.uploads.staged.extend_from_slice(values);
                }
                Given::Linked(pieces) => {
                    let count: usize = pieces.iter().map(|p| p.rows.len()).sum();
                    if count != rows.len() {
                        return Err(wrong(format!("{} linked rows (one per vertex)", rows.len()), count.to_string()));
                    }
                    let mut v = rows.iter();
                    for p in pieces {
                        for &v in v.by_ref().take(p.rows.len()) {
                            z[self.b.schedule.row_of_vertex[v] as usize] = p.at.is_none();
                        }
                    }
                    self.stage_linked(pieces, block, src.offset);
                    self.uploads.staged_len = src.offset + rows.len() * block;
                }
            }
            let dst = Rows::Indexed {
                data: Loc { buf: ARENA, offset: region.offset },
                index: IndexLoc { buf: STAGED_ROWS, offset: 0 },
            };
            self.launches.push(Launch::Fill { dst: Loc { buf: ARENA, offset: region.offset }, len: n * block });
            self.launches.push(Launch::ScatterAdd { src, block, n: rows.len(), dst });
            zero[o] = z;
        }
        Ok(zero)
    }

    pub(super) fn func(&self, pass: Pass) -> &Func {
        match pass {
            Pass::Forward => self.a.f.forward(),
            Pass::Backward => &self.a.f.backward().func,
        }
    }

    /// Where row `row` of value `v` of `pass` lives, for a step over rows from `task_start`.
    pub(super) fn loc(&self, pass: Pass, v: ValueId, row: usize, task_start: usize) -> Result<Loc> {
        let m = &self.b.memory;
        let region: Option<Region> = match self.func(pass).node(v).op {
            Op::Pull { input } => Some(m.pulls[input]),
            Op::Primal { value } => return self.loc(Pass::Forward, value, row, task_start),
            Op::StateGrad { state } => Some(m.state_grads[state]),
            Op::PushGrad { output } => Some(m.push_grads[output]),
            Op::Param { param } => return Ok(Loc { buf: PARAMS, offset: self.a.param_at[param] }),
            _ => match pass {
                Pass::Forward => m.forward[v.index()],
                Pass::Backward => m.backward[v.index()],
            },
        };
        region
            .map(|r| Loc { buf: ARENA, offset: r.at(row, task_start) })
            .ok_or_else(|| internal(format!("value {v} of `{}` is read but never stored", self.a.f.name())))
    }

    /// The rows of the tasks in `tasks` (`None` when there is no task).
    pub(super) fn task_rows(&self, tasks: &Range<usize>) -> Option<Range<usize>> {
        let first = self.b.schedule.tasks.get(tasks.start)?;
        Some(first.start..self.b.schedule.tasks[tasks.end - 1].end)
    }

    /// Row ranges of the tasks in `tasks`, merged into runs of equal `key(task)`.
    pub(super) fn runs<K: PartialEq>(&self, tasks: Range<usize>, key: impl Fn(usize) -> K) -> Vec<(Range<usize>, K)> {
        let mut out: Vec<(Range<usize>, K)> = Vec::new();
        for t in tasks {
            let (rows, k) = (self.b.schedule.tasks[t].clone(), key(t));
            match out.last_mut() {
                Some((r, lk)) if *lk == k && r.end == rows.start => r.end = rows.end,
                _ => out.push((rows, k)),
            }
        }
        out
    }

    pub(super) fn fills(&self, pass: Pass) -> &[bool] {
        match pass {
            Pass::Forward => &self.a.must_fill.0,
            Pass::Backward => &self.a.must_fill.1,
        }
    }

    pub(super) fn facts(&self, pass: Pass, t: usize) -> &Facts {
        match pass {
            Pass::Forward => &self.b.fwd_facts[t],
            Pass::Backward => &self.b.bwd_facts[t],
        }
    }

    pub(super) fn push(&mut self, launch: Launch) {
        self.launches.push(launch);
    }

    /// Empties the launch list, keeping its vectors for the next pass.
    fn clear_launches(&mut self) {
        let spare = &mut self.spare;
        for launch in self.launches.drain(..) {
            match launch {
                Launch::Fused { mut loads, mut stores, .. } => {
                    loads.clear();
                    stores.clear();
                    spare.loads.push(loads);
                    spare.stores.push(stores);
                }
                Launch::Gemms(mut gemms) | Launch::GemmSum(mut gemms) => {
                    gemms.clear();
                    spare.gemms.push(gemms);
                }
                Launch::ScatterAdds { mut parts, .. } => {
                    parts.clear();
                    spare.scatters.push(parts);
                }
                _ => {}
            }
        }
    }

    /// Lowers the steps of `phase` of `plan` (`kind`) over the rows of `tasks` (one task for the
    /// recurrent phase). A matrix product known to be zero on a run of tasks becomes a zero fill
    /// there.
    fn phase(&mut self, pass: Pass, kind: PlanKind, plan: &Plan, phase: Phase, tasks: Range<usize>) -> Result<()> {
        if tasks.is_empty() {
            return Ok(());
        }
        // Products run in waves: the first part of every product (and its zero columns), then
        // the parts that add further inner ranges to it.
        let mut waves = std::mem::take(&mut self.spare.waves);
        for (i, step) in plan.phases[phase as usize].iter().enumerate() {
            match step {
                Step::Gemms(vs) => {
                    let (mut copies, mut scratch) = (Vec::new(), self.b.shared_scratch.start);
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
                            for (run, cut) in self.runs(tasks.clone(), |t| self.facts(pass, t).cut(v).clone()) {
                                copies.extend(self.product(pass, v, run, &cut, into, &mut waves, &mut scratch)?);
                            }
                        }
                    }
                    // Products left in scratch are copied out before this step writes over them.
                    if !copies.is_empty() {
                        self.settle_scratch(|_| true);
                    }
                    waves.launch(&mut self.spare.gemms, &mut self.launches);
                    for c in copies {
                        match c.value {
                            Some(v) if pass == Pass::Forward && self.a.by_index[v.index()] => self.b.in_scratch.push(c),
                            _ => self.copy_shared(c),
                        }
                    }
                }
                Step::Fused(_) => self.kernel(pass, StepRef { plan: kind, phase, step: i }, tasks.clone())?,
                Step::Attend(v) => self.attend(pass, *v, tasks.clone())?,
            }
        }
        waves.restart();
        self.spare.waves = waves;
        Ok(())
    }

    /// The sibling product `v` accumulates into on this pass (see [`sums`](super::sums)).
    pub(super) fn summed_into(&self, pass: Pass, v: ValueId) -> Option<ValueId> {
        (pass == Pass::Forward).then(|| self.a.sums.target(v)).flatten()
    }

    /// Whether product `p1` is computed on `tasks` (one task: sums are recurrent), so a sibling
    /// summed into it adds to its output rather than writing it.
    fn computed_alone(&self, pass: Pass, p1: ValueId, tasks: &Range<usize>) -> Result<bool> {
        if tasks.len() != 1 {
            return Err(internal(format!("a product summed into {p1} runs over {} tasks at once", tasks.len())));
        }
        Ok(matches!(self.facts(pass, tasks.start).cut(p1), Cut::Full | Cut::Cols { .. }))
    }

    /// Whether `v` is the gradient of a looked-up input that this minibatch forms per distinct
    /// row instead (in [`Lowering::param_grads`]).
    fn formed_per_id(&self, pass: Pass, v: ValueId) -> bool {
        let grads = &self.a.f.backward().pull_grads;
        pass == Pass::Backward && self.b.table_grad_at.iter().zip(grads).any(|(at, &g)| at.is_some() && g == Some(v))
    }

    /// Copies looked-up input `i`'s distinct rows to the rows of the vertices that pull them,
    /// unless they are there already (or it is not looked up).
    pub(super) fn gather_lookup(&mut self, i: usize) {
        let b = &self.b;
        let Some(s) = b.shared[i].as_ref().filter(|s| s.ids.is_some() && !b.gathered[i]) else { return };
        let copy = SharedCopy {
            value: None,
            from: Loc { buf: ARENA, offset: s.rows_at },
            to: Loc { buf: ARENA, offset: b.memory.pulls[i].offset },
            row: 0,
            map: IndexLoc { buf: 0, offset: s.map_at },
            rows: b.schedule.len(),
            block: self.a.f.all_inputs()[i].shape.numel(),
        };
        self.b.gathered[i] = true;
        self.copy_shared(copy);
    }

    /// Copies the products left in scratch that `which` selects to their vertices' rows.
    fn settle_scratch(&mut self, which: impl Fn(&SharedCopy) -> bool) {
        let (settle, keep) = std::mem::take(&mut self.b.in_scratch).into_iter().partition(which);
        self.b.in_scratch = keep;
        settle.into_iter().for_each(|c: SharedCopy| self.copy_shared(c));
    }

    /// Where a fused kernel reads rows `rows` of product `v` if they are still in scratch: the
    /// distinct rows, by the map. Rows that span several runs are copied out first.
    fn scratch_rows(&mut self, v: ValueId, rows: &Range<usize>) -> Option<Rows> {
        let within = |c: &SharedCopy| c.row <= rows.start && rows.end <= c.row + c.rows;
        if let Some(c) = self.b.in_scratch.iter().find(|c| c.value == Some(v) && within(c)) {
            let index = IndexLoc { offset: c.map.offset + (rows.start - c.row), ..c.map };
            return Some(Rows::Indexed { data: c.from, index });
        }
        self.settle_scratch(|c| c.value == Some(v));
        None
    }

    /// Copies the product rows of distinct pulled rows to every vertex that pulled them.
    pub(super) fn copy_shared(&mut self, c: SharedCopy) {
        let from = Rows::Indexed { data: c.from, index: c.map };
        self.launches.push(Launch::Copy { from, to: c.to, rows: c.rows, block: c.block });
    }

    /// Lowers fused step `step` over the rows of `tasks`. On one task, loads that read as zeros
    /// there are bound to zeros, and stores nothing will read are left out (see
    /// [`facts::unread_stores`]); so are copies of children's rows that products read where they
    /// are ([`Lowering::gathered_in_place`]).
    fn kernel(&mut self, pass: Pass, step: StepRef, tasks: Range<usize>) -> Result<()> {
        let Some(rows) = self.task_rows(&tasks) else { return Ok(()) };
        let (r0, n) = (rows.start, rows.len());
        let full = Arc::clone(&self.a.kernels[&step]);
        let task = (tasks.len() == 1).then_some(tasks.start);
        let mut unread = task.map_or(0, |t| facts::unread_stores(&full, self.facts(pass, t), self.fills(pass)));
        // Children's rows that every product reads where they are need no copy (the mask has
        // room for 64 stores).
        if full.stores.len() <= 64 {
            for (j, &l) in full.stores.iter().enumerate() {
                if self.gathered_in_place(pass, full.values[l], &rows)?.is_some() {
                    unread |= 1 << j;
                }
            }
        }
        let kernel = match unread {
            0 => full,
            _ => Arc::clone(
                self.pruned
                    .entry(PrunedKernel { step, unread })
                    .or_insert_with(|| Arc::new(full.keeping_stores(|j| unread >> j & 1 == 0))),
            ),
        };
        if kernel.stores.is_empty() {
            return Ok(());
        }
        let mut loads = self.spare.loads.pop().unwrap_or_default();
        for i in kernel.loads() {
            let v = kernel.values[i];
            let ix = &self.b.index;
            // A product summed into a sibling's output is read there, so it reads as zeros
            // itself, and that output is zero only where both are.
            let summed = self.summed_into(pass, v).is_some();
            let with = (pass == Pass::Forward).then(|| self.a.sums.source(v)).flatten();
            let zero = task.is_some_and(|t| {
                let facts = self.facts(pass, t);
                !kernel.nodes[i].is_param && facts.reads_as_zero(v) && with.is_none_or(|s| facts.reads_as_zero(s))
            });
            let f = &self.a.f;
            // A child's state: F's gathers, and those F′ reads where F did not copy them.
            let child = match kernel.nodes[i].op {
                Op::Gather { slot, state } => Some((slot, state)),
                Op::Primal { value } => f.read_where_gathered(value),
                _ => None,
            };
            loads.push(match (&kernel.nodes[i].op, child) {
                _ if zero || summed => Rows::Zeros,
                (_, Some((slot, state))) => Rows::Indexed {
                    data: self.loc(Pass::Forward, f.states()[state].value, 0, 0)?,
                    index: ix.slot(slot, r0),
                },
                (&Op::GatherAll { state, reduce, label }, _) => {
                    let data = self.loc(Pass::Forward, f.states()[state].value, 0, 0)?;
                    self.b.child_set(reduce, label, data, data, r0)?
                }
                (Op::Param { .. }, _) => Rows::Broadcast(self.loc(pass, v, 0, 0)?),
                (Op::Zeros, _) => Rows::Zeros,
                _ if pass == Pass::Forward && self.a.by_index[v.index()] => match self.scratch_rows(v, &rows) {
                    Some(rows) => rows,
                    None => Rows::Contiguous(self.loc(pass, v, r0, r0)?),
                },
                _ => Rows::Contiguous(self.loc(pass, v, r0, r0)?),
            });
        }
        let mut stores = self.spare.stores.pop().unwrap_or_default();
        for &i in &kernel.stores {
            stores.push(self.loc(pass, kernel.values[i], r0, r0)?);
        }
        self.launches.push(Launch::Fused { step, kernel, n, loads, stores });
        Ok(())
    }

    /// Lowers the attention step computing `v` (F's attention over the children, or its
    /// gradient in F′) over the rows of `tasks`.
    fn attend(&mut self, pass: Pass, v: ValueId, tasks: Range<usize>) -> Result<()> {
        let Some(rows) = self.task_rows(&tasks) else { return Ok(()) };
        let (r0, n) = (rows.start, rows.len());
        let f = Arc::clone(&self.a.f);
        let func = self.func(pass);
        let (query, grad, key, value, slope) = match func.node(v).op {
            Op::GatherSoftmax { query, key, value, slope } => (query, None, key, value, slope),
            Op::GatherSoftmaxGrad { query, grad, key, value, slope } => (query, Some(grad), key, value, slope),
            ref op => return Err(internal(format!("an attention step computes {}", op.name()))),
        };
        let q = &func.node(query).shape;
        let out = grad.map_or(&func.node(v).shape, |g| &func.node(g).shape);
        let widths = Widths { heads: q.rows(), key: q.cols(), value: out.cols(), slope };
        let (offsets, index) = self.b.index.children(r0);
        let state = |s: usize| self.loc(Pass::Forward, f.states()[s].value, 0, 0);
        let (keys, values) = (state(key)?, state(value)?);
        let attention = Attention { widths, n, query: self.loc(pass, query, r0, r0)?, keys, values, offsets, index };
        let at = self.loc(pass, v, r0, r0)?;
        let launch = match grad {
            None => Launch::Attend { attention, out: at },
            Some(g) => {
                let state_grad = |s: usize| Loc { buf: ARENA, offset: self.b.memory.state_grads[s].offset };
                let (keys, values) = (state_grad(key), state_grad(value));
                let grads = AttentionGrads { out: self.loc(pass, g, r0, r0)?, query: at, keys, values };
                Launch::AttendGrad { attention, grads }
            }
        };
        self.launches.push(launch);
        Ok(())
    }

    /// Scatter-adds the children's gradients computed in `phase` for the rows of `tasks`,
    /// skipping those known to be zero there.
    fn send_child_grads(&mut self, plan: &Plan, phase: Phase, tasks: Range<usize>) -> Result<()> {
        let Some(rows) = self.task_rows(&tasks) else { return Ok(()) };
        let (r0, n) = (rows.start, rows.len());
        let f = Arc::clone(&self.a.f);
        // Scatters into child slots of one width go out together, a few to a call.
        let mut together = std::mem::take(&mut self.spare.together);
        together.clear();
        for cg in &f.backward().child_grads {
            let b = &self.b;
            if plan.phase[cg.value.index()] != phase
                || n == 0
                || tasks.clone().all(|t| b.bwd_facts[t].is_zero(cg.value) || b.bwd_facts[t].unused(cg.value))
            {
                continue;
            }
            let block = f.states()[cg.state].shape.numel();
            let data = Loc { buf: ARENA, offset: b.memory.state_grads[cg.state].offset };
            let dst = match cg.slot {
                Some(k) => Rows::Indexed { data, index: b.index.slot(k, r0) },
                None => {
                    // A max's gradient goes where the children's forward rows are largest.
                    let by = match cg.reduce {
                        Reduce::Max => self.loc(Pass::Forward, f.states()[cg.state].value, 0, 0)?,
                        _ => data,
                    };
                    self.b.child_set(cg.reduce, cg.label, data, by, r0)?
                }
            };
            let src = self.loc(Pass::Backward, cg.value, r0, r0)?;
            match dst {
                Rows::Indexed { .. } => together.push((block, src, dst)),
                _ => self.launches.push(Launch::ScatterAdd { src, block, n, dst }),
            }
        }
        together.sort_by_key(|&(block, ..)| block);
        for same in together.chunk_by(|a, b| a.0 == b.0) {
            for part in same.chunks(SCATTERS) {
                let launch = match part {
                    [(block, src, dst)] => Launch::ScatterAdd { src: *src, block: *block, n, dst: *dst },
                    _ => {
                        let mut parts = self.spare.scatters.pop().unwrap_or_default();
                        parts.extend(part.iter().map(|&(_, s, d)| (s, d)));
                        Launch::ScatterAdds { block: part[0].0, n, parts }
                    }
                };
                self.launches.push(launch);
            }
        }
        self.spare.together = together;
        Ok(())
    }
}
