//! The memory plan of one minibatch: where every value of every task lives in the arena.
//!
//! Every buffer (a pulled input, a stored value of F or F', an output or state gradient) gets a
//! lifetime on the timeline of one step: the forward pass, then (when training) the backward
//! pass, then the parameter gradients. Buffers whose lifetimes overlap never share elements; the
//! others may. A value whose whole life lies inside one task of the recurrent phase (a task's
//! temporaries, a task's gradients for its children before they are scatter-added) needs rows
//! for one task only, not for the whole minibatch.

use arbor_core::fusion::{Phase, Plan, Step};
use arbor_core::ir::{Func, Op, ParamGrad, Reduce, ValueId, VertexFn};
use std::ops::Range;
use std::sync::Arc;

/// Offsets are rounded up to this many elements (64 bytes of f32).
const ALIGN: usize = 16;

/// Where one buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Element offset of row 0 in the arena.
    pub offset: usize,
    /// Elements per vertex.
    pub block: usize,
    /// Whether the region holds one task's rows only (rows counted from the task's first row).
    pub per_task: bool,
}

impl Region {
    /// Element offset of row `row` of the minibatch, for a step over rows starting at `task_start`.
    pub fn at(&self, row: usize, task_start: usize) -> usize {
        self.offset + self.block * if self.per_task { row - task_start } else { row }
    }
}

/// One buffer of the plan with its lifetime, for inspection and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lifetime {
    /// What the buffer holds, e.g. `Forward(9)` or `StateGrad(0)`.
    pub what: Arc<str>,
    /// Its range of f32 elements in the arena.
    pub elems: Range<usize>,
    /// First and last step (inclusive) of the timeline that touch it.
    pub steps: Range<usize>,
}

/// Where every buffer of one minibatch lives.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MemoryPlan {
    /// Per pulled input.
    pub pulls: Vec<Region>,
    /// Per forward value (`None` where the plan does not store it).
    pub forward: Vec<Option<Region>>,
    /// Per backward value (`None` where not stored, and for inference).
    pub backward: Vec<Option<Region>>,
    /// Per pushed output: its gradient.
    pub push_grads: Vec<Region>,
    /// Per state: its gradient.
    pub state_grads: Vec<Region>,
    /// Elements the arena needs.
    pub len: usize,
    /// Every buffer with its lifetime.
    pub lifetimes: Vec<Lifetime>,
}

/// A logical buffer of the plan.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Buf {
    Pull(usize),
    Forward(usize),
    Backward(usize),
    PushGrad(usize),
    StateGrad(usize),
}

#[derive(Clone, Copy, PartialEq)]
enum Pass {
    Forward,
    Backward,
}

struct Use {
    first: usize,
    last: usize,
    /// Read by a gather (from other tasks), so never task-local.
    gathered: bool,
    /// Touched outside the recurrent phase.
    outside: bool,
}

struct Timeline<'a> {
    f: &'a VertexFn,
    bufs: Vec<Buf>,
    uses: Vec<Use>,
    time: usize,
    /// Step ranges of the recurrent sections: each runs once per task.
    sections: Vec<Range<usize>>,
}

impl Timeline<'_> {
    fn func(&self, pass: Pass) -> &Func {
        match pass {
            Pass::Forward => self.f.forward(),
            Pass::Backward => &self.f.backward().func,
        }
    }

    /// The buffer holding value `v` of `pass` (`None` for parameters and zeros).
    fn resolve(&self, pass: Pass, v: ValueId) -> Option<Buf> {
        match self.func(pass).node(v).op {
            Op::Pull { input } => Some(Buf::Pull(input)),
            Op::Primal { value } => self.resolve(Pass::Forward, value),
            Op::StateGrad { state } => Some(Buf::StateGrad(state)),
            Op::PushGrad { output } => Some(Buf::PushGrad(output)),
            Op::Param { .. } | Op::Zeros => None,
            _ => Some(match pass {
                Pass::Forward => Buf::Forward(v.index()),
                Pass::Backward => Buf::Backward(v.index()),
            }),
        }
    }

    fn touch(&mut self, b: Option<Buf>, recurrent: bool, gathered: bool) {
        let Some(b) = b else { return };
        let t = self.time;
        match self.bufs.iter().position(|x| *x == b) {
            Some(i) => {
                let u = &mut self.uses[i];
                u.first = u.first.min(t);
                u.last = u.last.max(t);
                u.gathered |= gathered;
                u.outside |= !recurrent;
            }
            None => {
                self.bufs.push(b);
                self.uses.push(Use { first: t, last: t, gathered, outside: !recurrent });
            }
        }
    }

    /// Records the reads and writes of every step of `plan`.
    fn steps(&mut self, pass: Pass, plan: &Plan, phase: Phase) {
        let recurrent = phase == Phase::Recurrent;
        if recurrent {
            self.sections.push(self.time + 1..self.time + 1);
        }
        for step in &plan.phases[phase as usize] {
            self.time += 1;
            match step {
                // Products of one step may run at the same time: they share one time step, so no
                // output reuses the elements of any input of the step.
                // A product may read a child's state where the child's state is, not from a copy.
                Step::Gemms(vs) => {
                    for &v in vs {
                        if let Op::MatMul { a, b, .. } = self.func(pass).node(v).op {
                            for x in [a, b, v] {
                                let buf = self.resolve(pass, x);
                                self.touch(buf, recurrent, false);
                                if let (Pass::Forward, Op::Gather { state, .. }) = (pass, &self.func(pass).node(x).op) {
                                    let buf = self.resolve(Pass::Forward, self.f.states()[*state].value);
                                    self.touch(buf, recurrent, true);
                                }
                            }
                        }
                    }
                }
                // Attention reads its query (and gradient) and every child's key and value rows,
                // writes its value, and its gradient adds to the children's state gradients.
                Step::Attend(v) => {
                    let (key, value) = match self.func(pass).node(*v).op {
                        Op::GatherSoftmax { key, value, .. } | Op::GatherSoftmaxGrad { key, value, .. } => (key, value),
                        _ => continue,
                    };
                    for x in self.func(pass).node(*v).op.inputs().into_iter().chain([*v]) {
                        let buf = self.resolve(pass, x);
                        self.touch(buf, recurrent, false);
                    }
                    for s in [key, value] {
                        let buf = self.resolve(Pass::Forward, self.f.states()[s].value);
                        self.touch(buf, recurrent, true);
                        if pass == Pass::Backward {
                            self.touch(Some(Buf::StateGrad(s)), recurrent, false);
                        }
                    }
                }
                Step::Fused(k) => {
                    for (node, &v) in k.nodes.iter().zip(&k.values) {
                        // A child's state: F's gathers, and those F′ reads where F did not
                        // copy them.
                        let child = match node.op {
                            Op::Gather { state, .. } | Op::GatherAll { state, .. } => Some(state),
                            Op::Primal { value } => self.f.read_where_gathered(value).map(|(_, state)| state),
                            _ => None,
                        };
                        let (buf, gathered) = match child {
                            Some(state) => (self.resolve(Pass::Forward, self.f.states()[state].value), true),
                            None if node.op.is_load() => (self.resolve(pass, v), false),
                            None => (None, false),
                        };
                        self.touch(buf, recurrent, gathered);
                    }
                    for &l in &k.stores {
                        let buf = self.resolve(pass, k.values[l]);
                        self.touch(buf, recurrent, false);
                    }
                }
            }
        }
    }

    fn touch_all(&mut self, bufs: impl IntoIterator<Item = Option<Buf>>, recurrent: bool) {
        for b in bufs {
            self.touch(b, recurrent, false);
        }
    }

    /// Closes the current recurrent section at the current step.
    fn end_section(&mut self) {
        if let Some(s) = self.sections.last_mut() {
            s.end = self.time + 1;
        }
    }

    /// Whether buffer `i` lives for one task only: touched only inside one recurrent section
    /// and never by a gather of a later task. Other buffers that a section touches live through
    /// all of it, since the section runs again for every task.
    fn lifetime(&self, i: usize) -> (bool, Range<usize>) {
        let u = &self.uses[i];
        let within = |s: &Range<usize>| s.start <= u.first && u.last < s.end;
        let per_task = matches!(self.bufs[i], Buf::Forward(_) | Buf::Backward(_))
            && !u.gathered
            && !u.outside
            && self.sections.iter().any(within);
        let mut live = u.first..u.last + 1;
        if !per_task {
            for s in &self.sections {
                if s.start < live.end && live.start < s.end {
                    live = live.start.min(s.start)..live.end.max(s.end);
                }
            }
        }
        (per_task, live)
    }
}

/// The part of a memory plan that depends only on the vertex function and the pass (training or
/// inference): every buffer's size per vertex, whether it holds one task's rows, its lifetime,
/// the order buffers are placed in and, per buffer, the buffers placed before it that live at
/// the same time. Made once per function ([`MemoryLayout::new`]); each minibatch then only sizes
/// and places the buffers ([`MemoryLayout::plan`]).
#[derive(Clone, Debug)]
pub struct MemoryLayout {
    /// The buffers in the order they are placed.
    bufs: Vec<Placed>,
    /// Regions per kind of buffer (its length per kind).
    counts: [usize; 5],
}

/// One buffer of a [`MemoryLayout`].
#[derive(Clone, Debug)]
struct Placed {
    buf: Buf,
    block: usize,
    per_task: bool,
    live: Range<usize>,
    what: Arc<str>,
    /// Positions (in placing order) of the earlier buffers live at the same time.
    conflicts: Vec<usize>,
}

impl MemoryLayout {
    /// The layout of `f`'s arena; `train` adds the backward pass (otherwise the inference plan
    /// is used).
    pub fn new(f: &VertexFn, train: bool) -> MemoryLayout {
        let mut tl = Timeline { f, bufs: Vec::new(), uses: Vec::new(), time: 0, sections: Vec::new() };
        let fwd_plan = if train { f.forward_plan() } else { f.inference_plan() };
        tl.touch_all((0..f.all_inputs().len()).map(|i| Some(Buf::Pull(i))), false);
        for phase in [Phase::Prologue, Phase::Recurrent, Phase::Epilogue] {
            tl.steps(Pass::Forward, fwd_plan, phase);
            if phase == Phase::Recurrent {
                tl.end_section();
            }
        }
        tl.time += 1;
        let outputs: Vec<_> = f.outputs().iter().map(|o| tl.resolve(Pass::Forward, o.value)).collect();
        tl.touch_all(outputs, false);
        if train {
            let b = f.backward();
            let bwd_plan = f.backward_plan();
            tl.time += 1;
            tl.touch_all((0..f.outputs().len()).map(|o| Some(Buf::PushGrad(o))), false);
            tl.touch_all((0..f.states().len()).map(|s| Some(Buf::StateGrad(s))), false);
            // A gradient sent to every child reads the children's states where it goes to the
            // largest (`gather_max`).
            let sends = |tl: &Timeline<'_>, phase: Phase| -> Vec<Option<Buf>> {
                b.child_grads
                    .iter()
                    .filter(|c| bwd_plan.phase[c.value.index()] == phase)
                    .flat_map(|c| {
                        let by = (c.slot.is_none() && c.reduce == Reduce::Max)
                            .then(|| tl.resolve(Pass::Forward, f.states()[c.state].value))
                            .flatten();
                        [tl.resolve(Pass::Backward, c.value), Some(Buf::StateGrad(c.state)), by]
                    })
                    .collect()
            };
            tl.steps(Pass::Backward, bwd_plan, Phase::Prologue);
            tl.time += 1;
            let s = sends(&tl, Phase::Prologue);
            tl.touch_all(s, false);
            tl.steps(Pass::Backward, bwd_plan, Phase::Recurrent);
            tl.time += 1;
            let s = sends(&tl, Phase::Recurrent);
            tl.touch_all(s, true);
            tl.end_section();
            tl.steps(Pass::Backward, bwd_plan, Phase::Epilogue);
            tl.time += 1;
            let mut reads = Vec::new();
            for g in &b.param_grads {
                match *g {
                    ParamGrad::MatMul { x, dy, .. } => {
                        reads.extend([tl.resolve(Pass::Backward, x), tl.resolve(Pass::Backward, dy)])
                    }
                    ParamGrad::SumRows { dy, .. } => reads.push(tl.resolve(Pass::Backward, dy)),
                }
            }
            tl.touch_all(reads, false);
            tl.time += 1;
            let pulls: Vec<_> = b.pull_grads.iter().flatten().map(|&g| tl.resolve(Pass::Backward, g)).collect();
            tl.touch_all(pulls, false);
        }
        let block = |b: Buf| match b {
            Buf::Pull(i) => f.all_inputs()[i].shape.numel(),
            Buf::Forward(v) => f.forward().nodes[v].shape.numel(),
            Buf::Backward(v) => f.backward().func.nodes[v].shape.numel(),
            Buf::PushGrad(o) => f.outputs()[o].shape.numel(),
            Buf::StateGrad(s) => f.states()[s].shape.numel(),
        };
        let mut order: Vec<usize> = (0..tl.bufs.len()).collect();
        order.sort_by_key(|&i| (tl.uses[i].first, std::cmp::Reverse(block(tl.bufs[i]))));
        let mut bufs: Vec<Placed> = Vec::with_capacity(order.len());
        for i in order {
            let (per_task, live) = tl.lifetime(i);
            let conflicts =
                (0..bufs.len()).filter(|&j| bufs[j].live.start < live.end && live.start < bufs[j].live.end).collect();
            let (buf, what) = (tl.bufs[i], format!("{:?}", tl.bufs[i]).into());
            bufs.push(Placed { buf, block: block(buf), per_task, live, what, conflicts });
        }
        let counts = [
            f.all_inputs().len(),
            f.forward().nodes.len(),
            f.backward().func.nodes.len(),
            f.outputs().len(),
            f.states().len(),
        ];
        MemoryLayout { bufs, counts }
    }

    /// Gives every buffer, for a minibatch of `vertices` vertices whose largest task has
    /// `max_task`, the lowest aligned offset free of the buffers live at the same time.
    pub fn plan(&self, vertices: usize, max_task: usize) -> MemoryPlan {
        let [pulls, forward, backward, outputs, states] = self.counts;
        let unused = Region { offset: 0, block: 0, per_task: false };
        let mut plan = MemoryPlan {
            pulls: vec![unused; pulls],
            forward: vec![None; forward],
            backward: vec![None; backward],
            push_grads: vec![unused; outputs],
            state_grads: vec![unused; states],
            len: 0,
            lifetimes: Vec::with_capacity(self.bufs.len()),
        };
        let mut busy: Vec<Range<usize>> = Vec::new();
        for p in &self.bufs {
            let rows = if p.per_task { max_task } else { vertices };
            let size = (rows * p.block).div_ceil(ALIGN) * ALIGN;
            busy.clear();
            busy.extend(p.conflicts.iter().map(|&j| plan.lifetimes[j].elems.clone()));
            busy.sort_unstable_by_key(|r| r.start);
            let mut offset = 0;
            for r in &busy {
                if offset + size <= r.start {
                    break;
                }
                offset = offset.max(r.end);
            }
            let elems = offset..offset + size;
            plan.len = plan.len.max(elems.end);
            plan.lifetimes.push(Lifetime { what: Arc::clone(&p.what), elems, steps: p.live.clone() });
            let region = Region { offset, block: p.block, per_task: p.per_task };
            match p.buf {
                Buf::Pull(i) => plan.pulls[i] = region,
                Buf::Forward(v) => plan.forward[v] = Some(region),
                Buf::Backward(v) => plan.backward[v] = Some(region),
                Buf::PushGrad(o) => plan.push_grads[o] = region,
                Buf::StateGrad(s) => plan.state_grads[s] = region,
            }
        }
        plan
    }
}

impl MemoryPlan {
    /// Plans the arena for `f` over `vertices` vertices whose largest task has `max_task`
    /// vertices; `train` adds the backward pass (otherwise the inference plan is used). A
    /// caller planning many minibatches keeps the [`MemoryLayout`] and calls its `plan`.
    pub fn new(f: &VertexFn, vertices: usize, max_task: usize, train: bool) -> MemoryPlan {
        MemoryLayout::new(f, train).plan(vertices, max_task)
    }

    /// Places a buffer of `len` elements after every other, live for the whole minibatch (the
    /// engine's distinct pulled rows, and the products and gradients over them); returns its
    /// offset.
    pub fn append(&mut self, what: impl Into<Arc<str>>, len: usize) -> usize {
        let offset = self.len.next_multiple_of(ALIGN);
        self.len = offset + len;
        self.lifetimes.push(Lifetime { what: what.into(), elems: offset..self.len, steps: 0..usize::MAX });
        offset
    }

    /// Bytes of the arena (f32 elements × 4).
    pub fn bytes(&self) -> usize {
        self.len * 4
    }

    /// The first pair of buffers that are live at the same time and share elements, if any.
    pub fn overlap(&self) -> Option<(&Lifetime, &Lifetime)> {
        for (i, a) in self.lifetimes.iter().enumerate() {
            for b in &self.lifetimes[i + 1..] {
                let live = a.steps.start < b.steps.end && b.steps.start < a.steps.end;
                let shared = a.elems.start < b.elems.end && b.elems.start < a.elems.end;
                if live && shared && !a.elems.is_empty() && !b.elems.is_empty() {
                    return Some((a, b));
                }
            }
        }
        None
    }
}
