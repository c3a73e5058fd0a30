//! The state of one minibatch, rebuilt by every forward pass: its schedule, memory plan and
//! index layout, what is known on each task, the distinct rows of its pulled inputs, and the
//! host data the pass uploads. Building it checks every pulled input.

use super::analysis::Analysis;
use super::dedup::{self, Shared};
use super::facts::{FactCache, Facts, Loads};
use super::held::HeldRows;
use super::launch::Uploads;
use super::link::LinkedInput;
use super::Pull;
use arbor_batching::{MemoryPlan, Schedule};
use arbor_core::backend::{Combine, IndexLoc, Loc, Rows, NO_ROW};
use arbor_core::error::{Error, Result};
use arbor_core::ir::{Op, Port, Reduce, ValueId, VertexFn};
use std::ops::Range;
use std::sync::Arc;

/// The children of one edge label, a child set of its own: per row, offsets into its list.
pub(super) struct LabelledSet {
    label: u32,
    offsets: Vec<u32>,
    list: Vec<u32>,
}

/// The child sets of each of `labels` (the edge labels a function gathers by), from the
/// schedule's children and their edges' labels.
fn labelled_sets(labels: &[u32], s: &Schedule) -> Vec<LabelledSet> {
    labels
        .iter()
        .map(|&label| {
            let (mut offsets, mut list) = (Vec::with_capacity(s.len() + 1), Vec::new());
            offsets.push(0);
            for r in 0..s.len() {
                let children = s.child_offsets[r] as usize..s.child_offsets[r + 1] as usize;
                list.extend(children.filter(|&j| s.child_labels[j] == label).map(|j| s.child_list[j]));
                offsets.push(list.len() as u32);
            }
            LabelledSet { label, offsets, list }
        })
        .collect()
}

/// Where the gather index plan of one minibatch lives in the index buffer.
#[derive(Default)]
pub(super) struct IndexLayout {
    vertices: usize,
    child_offsets: usize,
    child_list: usize,
    /// Per edge label gathered by: the label and where its set's offsets start (its list follows).
    labelled: Vec<(u32, usize)>,
    /// Entries laid out so far: the children's rows and sets, then what the distinct rows' maps
    /// and the held table's rows append.
    pub len: usize,
}

impl IndexLayout {
    fn new(arity: usize, s: &Schedule, sets: &[LabelledSet]) -> IndexLayout {
        let n = s.len();
        let child_offsets = arity * n;
        let child_list = child_offsets + n + 1;
        let mut len = child_list + s.child_list.len();
        let labelled = sets
            .iter()
            .map(|set| {
                let at = len;
                len += set.offsets.len() + set.list.len();
                (set.label, at)
            })
            .collect();
        IndexLayout { vertices: n, child_offsets, child_list, labelled, len }
    }

    /// Where the child rows of slot `slot` for row `row` on are.
    pub fn slot(&self, slot: usize, row: usize) -> IndexLoc {
        IndexLoc { buf: 0, offset: slot * self.vertices + row }
    }

    /// Rows `row..` of a vertex's children, all slots (those whose edge carries `label`, when
    /// given), combined by `combine`.
    pub fn set(&self, label: Option<u32>, data: Loc, row: usize, combine: Combine) -> Result<Rows> {
        let (offsets, index) = match label {
            None => self.children(row),
            Some(l) => {
                let &(_, at) = self
                    .labelled
                    .iter()
                    .find(|x| x.0 == l)
                    .ok_or_else(|| super::internal(format!("no child set laid out for edge label {l}")))?;
                (IndexLoc { buf: 0, offset: at + row }, IndexLoc { buf: 0, offset: at + self.vertices + 1 })
            }
        };
        Ok(Rows::IndexedSet { data, offsets, index, combine })
    }

    /// Where the children of the vertices from row `row` on are: their offsets into the child
    /// list, and the list.
    pub fn children(&self, row: usize) -> (IndexLoc, IndexLoc) {
        (IndexLoc { buf: 0, offset: self.child_offsets + row }, IndexLoc { buf: 0, offset: self.child_list })
    }
}

/// A copy of product rows over distinct pulled rows to the rows of the vertices that pulled them.
#[derive(Clone, Copy)]
pub(super) struct SharedCopy {
    /// The product (`None`: a looked-up input's own rows).
    pub value: Option<ValueId>,
    pub from: Loc,
    pub to: Loc,
    /// The first vertex row, and where its entry of the map is.
    pub row: usize,
    pub map: IndexLoc,
    pub rows: usize,
    pub block: usize,
}

/// One minibatch as the lowering sees it.
#[derive(Default)]
pub(super) struct Batch {
    pub schedule: Schedule,
    pub memory: MemoryPlan,
    pub index: IndexLayout,
    /// Whether the forward pass keeps what a backward pass needs.
    pub trained: bool,
    /// Per task, which loads of F are all zeros.
    pub loads: Vec<Loads>,
    /// Per task, what is known of F's values.
    pub fwd_facts: Vec<Arc<Facts>>,
    /// Per task, what is known of F′'s values (set by the backward pass).
    pub bwd_facts: Vec<Arc<Facts>>,
    /// Per input, which rows (in row order) are all zeros (for a lookup, which pull padding).
    pub pull_zero_rows: Vec<Vec<bool>>,
    /// Per input, its distinct rows where sharing them pays.
    pub shared: Vec<Option<Shared>>,
    /// The part of the arena after the distinct rows where products over them are formed.
    pub shared_scratch: Range<usize>,
    /// Per looked-up input whose table gradient is formed per distinct row: where, in the arena.
    pub table_grad_at: Vec<Option<usize>>,
    /// Per looked-up input: whether its rows were copied to the vertices in this minibatch.
    pub gathered: Vec<bool>,
    /// Products over distinct rows left in scratch by the forward pass, not yet copied out.
    pub in_scratch: Vec<SharedCopy>,
    /// The rows of the engine's table the inputs given as [`Pull::Held`] pull, if any.
    pub held: Option<HeldRows>,
    /// The inputs given as [`Pull::Linked`].
    pub linked: Vec<LinkedInput>,
    /// The child sets of the edge labels gathered by.
    labelled: Vec<LabelledSet>,
    /// Per edge feature weighed by (`gather_weighted`): the feature and where, in the arena,
    /// its value for every child of the child list is.
    weights: Vec<(u32, usize)>,
}

/// An error unless `got` ports' worth of data came for `want` ports of `f`.
pub(super) fn check_count(f: &VertexFn, what: &str, want: usize, got: usize) -> Result<()> {
    if want == got {
        return Ok(());
    }
    Err(Error::input(format!("{what}s of `{}`", f.name()), format!("{want}"), format!("{got}")))
}

/// An error unless `len` values are one block of `port` for each of `n` vertices.
pub(super) fn check_rows(what: &str, port: &Port, n: usize, len: usize) -> Result<()> {
    let block = port.shape.numel();
    if len == n * block {
        return Ok(());
    }
    Err(Error::input(
        format!("{what} `{}`", port.name),
        format!("{} values ({n} vertices × {block})", n * block),
        format!("{len}"),
    ))
}

/// An error unless `ids` names, for each of `n` vertices, a row of `table` (rows as wide as
/// `port`) or the padding id.
fn check_lookup(port: &Port, table: &[f32], ids: &[u32], padding: Option<u32>, n: usize) -> Result<()> {
    let block = port.shape.numel();
    if block > 0 && !table.len().is_multiple_of(block) {
        return Err(Error::input(
            format!("table of input `{}`", port.name),
            format!("rows of {block} values"),
            format!("{} values", table.len()),
        ));
    }
    check_ids(port, table.len().checked_div(block).unwrap_or(usize::MAX), ids, padding, n)
}

/// An error unless `ids` names, for each of `n` vertices, one of `rows` rows or the padding id.
pub(super) fn check_ids(port: &Port, rows: usize, ids: &[u32], padding: Option<u32>, n: usize) -> Result<()> {
    if ids.len() != n {
        return Err(Error::input(
            format!("ids of input `{}`", port.name),
            format!("{n} (one per vertex)"),
            format!("{}", ids.len()),
        ));
    }
    match ids.iter().enumerate().find(|&(_, &id)| Some(id) != padding && id as usize >= rows) {
        Some((v, id)) => Err(Error::input(
            format!("id of vertex {v} (merged-vertex order) for input `{}`", port.name),
            format!("a row of the table (below {rows}) or the padding id"),
            format!("{id}"),
        )),
        None => Ok(()),
    }
}

/// Adds a write of rows given in merged-vertex order to the arena at `at` in row order; returns
/// which rows (in row order) are all zeros.
pub(super) fn upload_rows(up: &mut Uploads, order: &[u32], at: usize, src: &[f32], block: usize) -> Vec<bool> {
    let mut zero = Vec::with_capacity(order.len());
    up.write_with(at, |data| {
        for &v in order {
            let row = &src[v as usize * block..(v as usize + 1) * block];
            zero.push(row.iter().all(|&x| x == 0.0));
            data.extend_from_slice(row);
        }
    });
    zero
}

impl Batch {
    /// Lays out the minibatch `schedule` for `a`'s function, checks `pulls` and adds their
    /// uploads (and the index buffer's) to `up`; `train` keeps what a backward pass needs.
    pub(super) fn new(
        a: &Analysis,
        facts: &mut FactCache,
        (skip_padding_grads, held_rows): (bool, Option<usize>),
        schedule: Schedule,
        pulls: &[Pull<'_>],
        train: bool,
        up: &mut Uploads,
    ) -> Result<Batch> {
        let f = &*a.f;
        let n = schedule.len();
        let labelled = labelled_sets(&a.edge_labels, &schedule);
        let mut b = Batch {
            memory: a.layout(train).plan(n, schedule.max_task()),
            index: IndexLayout::new(f.arity(), &schedule, &labelled),
            labelled,
            schedule,
            trained: train,
            ..Batch::default()
        };
        up.clear();
        b.pull_zero_rows = b.place_pulls(f, pulls, held_rows, up)?;
        b.share_pulls(a, pulls, up);
        b.place_weights(a, up);
        b.held = HeldRows::of(&mut b, a, pulls);
        b.linked = b.link_pulls(pulls);
        b.index_contents(f, &mut up.index);
        b.loads = (0..b.schedule.tasks.len()).map(|t| b.zero_loads(f, t)).collect();
        b.fwd_facts = b.loads.iter().map(|l| facts.forward(f, l, train, skip_padding_grads)).collect();
        Ok(b)
    }

    /// Places, for every edge feature F weighs children by, its value for each child of the
    /// child list in the arena, and adds them to the uploads.
    fn place_weights(&mut self, a: &Analysis, up: &mut Uploads) {
        let (s, width) = (&self.schedule, a.f.edge_feature_width());
        self.weights = a
            .edge_features
            .iter()
            .map(|&feature| {
                let at = self.memory.append(format!("edge feature {feature} of every child"), s.child_list.len());
                let column = s.child_features.iter().skip(feature as usize).step_by(width.max(1));
                up.write_with(at, |data| data.extend(column.take(s.child_list.len())));
                (feature, at)
            })
            .collect();
    }

    /// Where the values of edge feature `feature` for every child of the child list are.
    pub fn weights(&self, feature: u32) -> Result<Loc> {
        let &(_, at) = self
            .weights
            .iter()
            .find(|w| w.0 == feature)
            .ok_or_else(|| super::internal(format!("no weights laid out for edge feature {feature}")))?;
        Ok(Loc { buf: super::launch::ARENA, offset: at })
    }

    /// The rows of the vertices from `row` on of every child's `data`, combined by `reduce`.
    pub fn child_set(&self, reduce: Reduce, label: Option<u32>, data: Loc, by: Loc, row: usize) -> Result<Rows> {
        let weights = match reduce.feature() {
            Some(feature) => self.weights(feature)?,
            None => data,
        };
        self.index.set(label, data, row, Combine::of(reduce, by, weights))
    }

    /// Which loads of F are all zeros on task `t`.
    fn zero_loads(&self, f: &VertexFn, t: usize) -> Loads {
        let (s, rows) = (&self.schedule, self.schedule.tasks[t].clone());
        f.forward()
            .nodes
            .iter()
            .map(|n| match n.op {
                Op::Gather { slot, .. } => {
                    s.child_rows.get(slot).is_none_or(|c| c[rows.clone()].iter().all(|&r| r == NO_ROW))
                }
                Op::GatherAll { label: None, .. } => s.child_offsets[rows.start] == s.child_offsets[rows.end],
                Op::GatherAll { label: Some(l), .. } => self
                    .labelled
                    .iter()
                    .find(|x| x.label == l)
                    .is_none_or(|x| x.offsets[rows.start] == x.offsets[rows.end]),
                Op::Pull { input } => self.task_all(t, &self.pull_zero_rows[input]),
                _ => false,
            })
            .collect()
    }

    /// Whether every row of task `t` is flagged in `rows`.
    pub fn task_all(&self, t: usize, rows: &[bool]) -> bool {
        rows[self.schedule.tasks[t].clone()].iter().all(|&z| z)
    }

    /// Checks every pulled input and adds those given as rows to the uploads. Returns, per input,
    /// which rows (in row order) are all zeros; for a lookup, which pull the padding id.
    fn place_pulls(
        &self,
        f: &VertexFn,
        pulls: &[Pull<'_>],
        held_rows: Option<usize>,
        up: &mut Uploads,
    ) -> Result<Vec<Vec<bool>>> {
        check_count(f, "input", f.all_inputs().len(), pulls.len())?;
        let n = self.schedule.len();
        let mut zero = Vec::with_capacity(pulls.len());
        for (i, (pull, port)) in pulls.iter().zip(f.all_inputs()).enumerate() {
            zero.push(match *pull {
                Pull::Rows(rows) => {
                    check_rows("input", port, n, rows.len())?;
                    let at = self.memory.pulls[i].offset;
                    upload_rows(up, &self.schedule.vertex_of_row, at, rows, port.shape.numel())
                }
                Pull::Lookup { table, ids, padding } => {
                    check_lookup(port, table, ids, padding, n)?;
                    self.schedule.vertex_of_row.iter().map(|&v| Some(ids[v as usize]) == padding).collect()
                }
                Pull::Held { ids, padding } => {
                    let rows = held_rows.ok_or_else(|| {
                        Error::input(
                            format!("input `{}`", port.name),
                            "a table held by the engine (Engine::set_table)",
                            "none held",
                        )
                    })?;
                    check_ids(port, rows, ids, padding, n)?;
                    self.schedule.vertex_of_row.iter().map(|&v| Some(ids[v as usize]) == padding).collect()
                }
                Pull::Linked(from) => {
                    if from.rows.len() != n {
                        return Err(Error::input(
                            format!("linked rows of input `{}`", port.name),
                            format!("{n} (one per vertex)"),
                            from.rows.len().to_string(),
                        ));
                    }
                    // Unknown on the host; zeros only where the region is.
                    vec![from.at.is_none(); n]
                }
            });
        }
        Ok(zero)
    }

    /// Finds the distinct rows of every looked-up input and of every input a product reads (see
    /// [`dedup`]), places them in the arena with room after them for the products over them and
    /// for table gradients formed per distinct row, and adds them to the uploads.
    fn share_pulls(&mut self, a: &Analysis, pulls: &[Pull<'_>], up: &mut Uploads) {
        let (n, f) = (self.schedule.len(), &*a.f);
        let order = &self.schedule.vertex_of_row;
        self.shared = pulls
            .iter()
            .enumerate()
            .map(|(i, pull)| {
                let block = f.all_inputs()[i].shape.numel();
                match *pull {
                    Pull::Lookup { table, ids, padding } => {
                        Some(dedup::lookup(order, ids, Some(table), block, padding))
                    }
                    Pull::Held { ids, padding } => Some(dedup::lookup(order, ids, None, block, padding)),
                    Pull::Rows(rows) if a.pulled_factor[i] => {
                        let row = |r: usize| &rows[order[r] as usize * block..(order[r] as usize + 1) * block];
                        dedup::find(n, block, &self.pull_zero_rows[i], row)
                    }
                    Pull::Rows(_) | Pull::Linked(_) => None,
                }
            })
            .collect();
        let mut map_at = self.index.len;
        let mut most = 0;
        for (i, s) in self.shared.iter_mut().enumerate() {
            if let Some(s) = s {
                let len = s.unique * f.all_inputs()[i].shape.numel();
                s.rows_at = self.memory.append(format!("distinct rows of input {i}"), len);
                s.map_at = map_at;
                map_at += n;
                if self.trained {
                    let members = dedup::Members { at: map_at, ..s.members() };
                    map_at += members.entries.len();
                    s.members = Some(members);
                }
                most = most.max(s.unique);
                if !s.rows.is_empty() {
                    up.write_with(s.rows_at, |data| data.extend_from_slice(&s.rows));
                }
            }
        }
        self.index.len = map_at;
        let scratch = self.memory.append("products over distinct rows", most * a.shared_width);
        self.shared_scratch = scratch..scratch + most * a.shared_width;
        self.gathered = vec![false; pulls.len()];
        self.table_grad_at = (0..pulls.len())
            .map(|i| match &self.shared[i] {
                Some(s) if s.ids.is_some() && self.trained && a.table_grad_via[i].is_some() => {
                    let len = s.unique * f.all_inputs()[i].shape.numel();
                    Some(self.memory.append(format!("table gradient of input {i}"), len))
                }
                _ => None,
            })
            .collect();
    }

    /// The index buffer's contents: the children's rows per slot, the child sets, then the map
    /// of every input's distinct rows.
    fn index_contents(&self, f: &VertexFn, out: &mut Vec<u32>) {
        let s = &self.schedule;
        let n = s.len();
        for k in 0..f.arity() {
            match s.child_rows.get(k) {
                Some(rows) => out.extend_from_slice(rows),
                None => out.extend(std::iter::repeat_n(NO_ROW, n)),
            }
        }
        out.extend_from_slice(&s.child_offsets);
        out.extend_from_slice(&s.child_list);
        for set in &self.labelled {
            out.extend_from_slice(&set.offsets);
            out.extend_from_slice(&set.list);
        }
        for shared in self.shared.iter().flatten() {
            out.extend_from_slice(&shared.map);
            if let Some(m) = &shared.members {
                out.extend_from_slice(&m.entries);
            }
        }
        if let Some(h) = &self.held {
            h.index_contents(out);
        }
        for l in &self.linked {
            out.extend_from_slice(&l.rows);
        }
    }
}
