//! A table the engine holds (word vectors kept on the device): inputs given as [`Pull::Held`]
//! have their distinct rows copied from it on the backend, the backward pass sums their
//! gradients into one gradient of the rows any of them pulled, and the table is updated there,
//! its optimizer state beside it ([`Engine::optimize_table`]). Nothing of the table crosses to a
//! device per minibatch but the ids.

use super::batch::Batch;
use super::launch::{Launch, ARENA};
use super::lower::{Lowering, Pass};
use super::{Engine, ParamState, Pull, SparseGrad};
use crate::analysis::Analysis;
use arbor_core::backend::{Backend, IndexLoc, Loc, Mem, OptimAt, Rows, NO_ROW};
use arbor_core::error::{Error, Result};
use arbor_core::optim::Update;

/// The engine's buffer holding the table ([`Engine::set_table`]).
pub const TABLE: usize = 5;
/// The engine's buffers of the table's optimizer state (as [`OptimAt::m`], [`OptimAt::v`]).
pub const TABLE_M: usize = 6;
/// See [`TABLE_M`].
pub const TABLE_V: usize = 7;
/// The engine's buffer of a table gradient given from the host ([`Engine::set_table_grad`]).
pub const TABLE_GRAD: usize = 8;
/// The engine's index buffer of the rows of a table gradient given from the host.
pub const TABLE_ROWS: usize = 1;
/// Every buffer an engine has (some empty until used; the last is [`STEP`](super::STEP)).
pub(super) const BUFFERS: usize = 15;

/// What one minibatch pulls from the held table, as the lowering laid it out.
pub(super) struct HeldRows {
    /// Every id any held input pulls, ascending: the rows the table's gradient covers.
    union: Vec<u32>,
    /// Where `union` is in the index buffer.
    union_at: usize,
    /// The held inputs.
    inputs: Vec<HeldInput>,
    /// The width of a row.
    block: usize,
    /// Where the gradient of the `union` rows is in the arena (training).
    grad_at: Option<usize>,
}

/// One input given as [`Pull::Held`].
struct HeldInput {
    input: usize,
    /// Its distinct ids (copied from the table by them), and where they are in the index buffer.
    ids: Vec<u32>,
    ids_at: usize,
    /// Where its distinct rows go in the arena.
    rows_at: usize,
    /// Per row of its gradient (each distinct row's where the backward pass forms it so, else
    /// each vertex row's), its place in `union` (or `NO_ROW`), and where that is in the index
    /// buffer.
    to_union: Vec<u32>,
    to_union_at: usize,
    /// Whether its gradient is formed per distinct row (else per vertex row).
    per_distinct: bool,
}

impl HeldRows {
    /// The held rows of `b`'s minibatch (after its distinct rows are placed), their index
    /// entries after the maps, their gradient in the arena when it trains.
    pub(super) fn of(b: &mut Batch, a: &Analysis, pulls: &[Pull<'_>]) -> Option<HeldRows> {
        let held: Vec<usize> = (0..pulls.len()).filter(|&i| matches!(pulls[i], Pull::Held { .. })).collect();
        let &first = held.first()?;
        let block = a.f.all_inputs()[first].shape.numel();
        let mut union: Vec<u32> =
            held.iter().filter_map(|&i| b.shared[i].as_ref()?.ids.as_deref()).flatten().copied().collect();
        union.sort_unstable();
        union.dedup();
        let place = |id: u32| union.binary_search(&id).map_or(NO_ROW, |k| k as u32);
        let union_at = b.index.len;
        let mut at = union_at + union.len();
        let mut inputs = Vec::with_capacity(held.len());
        for &i in &held {
            let Some(s) = &b.shared[i] else { continue };
            let ids = s.ids.clone().unwrap_or_default();
            let per_distinct = b.table_grad_at[i].is_some();
            let to_union: Vec<u32> = if per_distinct {
                ids.iter().map(|&id| place(id)).collect()
            } else {
                s.map.iter().map(|&k| if k == NO_ROW { NO_ROW } else { place(ids[k as usize]) }).collect()
            };
            let (ids_at, to_union_at) = (at, at + ids.len());
            at = to_union_at + to_union.len();
            inputs.push(HeldInput { input: i, ids, ids_at, rows_at: s.rows_at, to_union, to_union_at, per_distinct });
        }
        b.index.len = at;
        // One input whose gradient is formed per distinct row forms it over the union's rows, in
        // order: that is the table's gradient, with nothing to sum.
        let grad_at = match inputs.as_slice() {
            [only] if only.per_distinct => b.table_grad_at[only.input],
            _ => b.trained.then(|| b.memory.append("gradient of the held table's rows", union.len() * block)),
        };
        Some(HeldRows { union, union_at, inputs, block, grad_at })
    }

    /// Whether input `i` pulls from the held table.
    pub(super) fn holds(&self, i: usize) -> bool {
        self.inputs.iter().any(|h| h.input == i)
    }

    /// Appends the index entries: the union, then per input its ids and its map to the union.
    pub(super) fn index_contents(&self, out: &mut Vec<u32>) {
        out.extend_from_slice(&self.union);
        for h in &self.inputs {
            out.extend_from_slice(&h.ids);
            out.extend_from_slice(&h.to_union);
        }
    }
}

impl Lowering {
    /// Copies every held input's distinct rows from the table into the arena (first in a
    /// forward pass).
    pub(super) fn copy_held_rows(&mut self) {
        let Some(h) = &self.b.held else { return };
        let copies: Vec<Launch> = h
            .inputs
            .iter()
            .map(|i| Launch::Copy {
                from: Rows::Indexed {
                    data: Loc { buf: TABLE, offset: 0 },
                    index: IndexLoc { buf: 0, offset: i.ids_at },
                },
                to: Loc { buf: ARENA, offset: i.rows_at },
                rows: i.ids.len(),
                block: h.block,
            })
            .collect();
        copies.into_iter().for_each(|l| self.push(l));
    }

    /// Sums every held input's gradient into the gradient of the union rows (last in a
    /// backward pass).
    pub(super) fn sum_held_grads(&mut self) -> Result<()> {
        let Some(h) = &self.b.held else { return Ok(()) };
        let Some(grad_at) = h.grad_at else { return Ok(()) };
        if h.inputs.iter().any(|i| self.b.table_grad_at[i.input] == Some(grad_at)) {
            return Ok(());
        }
        let mut launches =
            vec![Launch::Fill { dst: Loc { buf: ARENA, offset: grad_at }, len: h.union.len() * h.block }];
        for i in &h.inputs {
            let src = match (i.per_distinct, self.b.table_grad_at[i.input], self.a.f.backward().pull_grads[i.input]) {
                (true, Some(at), _) => Loc { buf: ARENA, offset: at },
                (false, _, Some(g)) => self.loc(Pass::Backward, g, 0, 0)?,
                // No gradient reaches the input.
                _ => continue,
            };
            let dst = Rows::Indexed {
                data: Loc { buf: ARENA, offset: grad_at },
                index: IndexLoc { buf: 0, offset: i.to_union_at },
            };
            launches.push(Launch::ScatterAdd { src, block: h.block, n: i.to_union.len(), dst });
        }
        launches.into_iter().for_each(|l| self.push(l));
        Ok(())
    }
}

/// Where the table's gradient is, the last backward pass's or one the host gave
/// ([`Engine::set_table_grad`]): its rows' numbers on the backend and on the host, its values.
struct TableGrad<'a> {
    index: IndexLoc,
    rows: &'a [u32],
    values: Loc,
}

impl<B: Backend> Engine<B> {
    /// Holds `table` (rows of `width` values) for the inputs given as [`Pull::Held`]: written to
    /// the engine's buffer (on a device, once), its optimizer state zero where its size changes.
    pub fn set_table(&mut self, table: &[f32], width: usize) -> Result<()> {
        if width == 0 || !table.len().is_multiple_of(width) {
            return Err(Error::input(
                "Engine::set_table",
                format!("rows of {width} values"),
                format!("{} values", table.len()),
            ));
        }
        if self.backend.len(&self.bufs[TABLE]) != table.len() || self.table_width != width {
            self.bufs[TABLE] = self.backend.alloc(table.len())?;
            self.bufs[TABLE_M] = self.backend.alloc(0)?;
            self.bufs[TABLE_V] = self.backend.alloc(0)?;
            self.table_width = width;
        }
        self.backend.write(&mut self.bufs[TABLE], 0, table)?;
        self.lowering.set_held_rows(Some(table.len() / width));
        self.given_table_rows = None;
        Ok(())
    }

    /// Replaces row `row` of the table the engine holds with `values` (a row's width), the rest
    /// and every optimizer state as they are.
    pub fn set_table_row(&mut self, row: usize, values: &[f32]) -> Result<()> {
        let rows = self.backend.len(&self.bufs[TABLE]) / self.table_width.max(1);
        if self.table_width == 0 || values.len() != self.table_width || row >= rows {
            return Err(Error::input(
                "Engine::set_table_row",
                format!("a row below {rows} of {} values of the held table", self.table_width),
                format!("row {row} of {} values", values.len()),
            ));
        }
        self.backend.write(&mut self.bufs[TABLE], row * self.table_width, values)
    }

    /// The table the engine holds (empty if none), read back.
    pub fn table(&self) -> Result<Vec<f32>> {
        self.backend.read_vec(&self.bufs[TABLE], 0, self.backend.len(&self.bufs[TABLE]))
    }

    /// [`Engine::table`], lent where the backend keeps it in host memory (no copy).
    pub fn table_lent(&self) -> Result<std::borrow::Cow<'_, [f32]>> {
        match self.backend.host(&self.bufs[TABLE]) {
            Some(t) => Ok(std::borrow::Cow::Borrowed(t)),
            None => Ok(std::borrow::Cow::Owned(self.table()?)),
        }
    }

    /// The width of the held table's rows (0: none held).
    pub fn table_width(&self) -> usize {
        self.table_width
    }

    /// Where the gradient of the held table is after the last backward pass (or as set).
    fn table_grad_loc(&self) -> Option<TableGrad<'_>> {
        if let Some(rows) = &self.given_table_rows {
            let (index, values) = (IndexLoc { buf: TABLE_ROWS, offset: 0 }, Loc { buf: TABLE_GRAD, offset: 0 });
            return Some(TableGrad { index, rows, values });
        }
        let h = self.lowering.b.held.as_ref().filter(|_| self.lowering.b.trained)?;
        let values = Loc { buf: ARENA, offset: h.grad_at? };
        Some(TableGrad { index: IndexLoc { buf: 0, offset: h.union_at }, rows: &h.union, values })
    }

    /// The gradient of the held table from the last backward pass (or as
    /// [`Engine::set_table_grad`] replaced it), read back: for summing across workers.
    pub fn held_table_grad(&self) -> Result<SparseGrad> {
        let Some(g) = self.table_grad_loc() else { return Ok(SparseGrad::default()) };
        let values =
            self.backend.read_vec(&self.bufs[g.values.buf], g.values.offset, g.rows.len() * self.table_width)?;
        Ok(SparseGrad { rows: g.rows.to_vec(), values })
    }

    /// Replaces the gradient of the held table (by its sum across workers, say) until the next
    /// backward pass: rows ascending, each once.
    pub fn set_table_grad(&mut self, g: &SparseGrad) -> Result<()> {
        let w = self.table_width;
        if g.values.len() != g.rows.len() * w {
            return Err(Error::input(
                "Engine::set_table_grad",
                format!("{} rows of {w} values", g.rows.len()),
                format!("{} values", g.values.len()),
            ));
        }
        if self.backend.len(&self.bufs[TABLE_GRAD]) < g.values.len() {
            self.bufs[TABLE_GRAD] = self.backend.alloc(g.values.len().next_power_of_two())?;
        }
        if self.backend.index_len(&self.index[TABLE_ROWS]) < g.rows.len() {
            self.index[TABLE_ROWS] = self.backend.alloc_index(g.rows.len().next_power_of_two())?;
        }
        self.backend.write(&mut self.bufs[TABLE_GRAD], 0, &g.values)?;
        self.backend.write_index(&mut self.index[TABLE_ROWS], 0, &g.rows)?;
        self.given_table_rows = Some(g.rows.clone());
        Ok(())
    }

    /// Where the held table's gradient is, and its length, if there is one.
    pub(super) fn table_grad_region(&self) -> Option<(Loc, usize)> {
        self.table_grad_loc().map(|g| (g.values, g.rows.len() * self.table_width))
    }

    /// Multiplies the held table's gradient by `s` (clipping).
    pub fn scale_table_grad(&mut self, s: f32) -> Result<()> {
        let Some((at, len)) = self.table_grad_region() else { return Ok(()) };
        let mut mem = Mem { data: &mut self.bufs, index: &self.index };
        self.calls += 1;
        self.backend.scale(&mut mem, at, len, s)
    }

    /// Applies `update` to the rows of the held table its gradient covers, with the state kept
    /// for every row (zeros at first; [`Engine::table_state`]); nothing for `None`. Gated by the
    /// lent block, if any ([`Engine::swap_block`]).
    pub fn optimize_table(&mut self, update: Option<Update>) -> Result<()> {
        let Some(u) = update else { return Ok(()) };
        let Some((index, n, values)) = self.table_grad_loc().map(|g| (g.index, g.rows.len(), g.values)) else {
            return Ok(());
        };
        let len = self.backend.len(&self.bufs[TABLE]);
        if self.backend.len(&self.bufs[TABLE_M]) != len {
            self.bufs[TABLE_M] = self.backend.alloc(len)?;
            self.bufs[TABLE_V] = self.backend.alloc(len)?;
            // The state the rule reads is zeroed now, whole: a fresh host allocation is mapped
            // page by page as it is first written, so each new word's row would cost the step
            // that first updates it a page fault (the first 500 batch-1 SST steps: ~50 µs each).
            let mut mem = Mem { data: &mut self.bufs, index: &self.index };
            self.backend.fill(&mut mem, Loc { buf: TABLE_M, offset: 0 }, len, 0.0)?;
            if u.uses_v() {
                self.backend.fill(&mut mem, Loc { buf: TABLE_V, offset: 0 }, len, 0.0)?;
            }
        }
        let at = OptimAt {
            p: Loc { buf: TABLE, offset: 0 },
            g: values,
            m: Loc { buf: TABLE_M, offset: 0 },
            v: Loc { buf: TABLE_V, offset: 0 },
            gate: self.gate(),
        };
        let w = self.table_width;
        let mut mem = Mem { data: &mut self.bufs, index: &self.index };
        self.calls += 1;
        self.backend.update_rows(&mut mem, &u, &at, (w, len / w), index, n)
    }

    /// The held table's optimizer state (`None` before its first update), read back.
    pub fn table_state(&self) -> Result<Option<ParamState>> {
        let len = self.backend.len(&self.bufs[TABLE_M]);
        if len == 0 {
            return Ok(None);
        }
        Ok(Some([
            self.backend.read_vec(&self.bufs[TABLE_M], 0, len)?,
            self.backend.read_vec(&self.bufs[TABLE_V], 0, len)?,
        ]))
    }

    /// Replaces the held table's optimizer state (as [`Engine::table_state`] gives it).
    pub fn set_table_state(&mut self, state: Option<&ParamState>) -> Result<()> {
        let len = self.backend.len(&self.bufs[TABLE]);
        let Some([m, v]) = state else {
            self.bufs[TABLE_M] = self.backend.alloc(0)?;
            self.bufs[TABLE_V] = self.backend.alloc(0)?;
            return Ok(());
        };
        if m.len() != len || v.len() != len {
            return Err(Error::input(
                "Engine::set_table_state",
                format!("two tensors of {len} values (the table's)"),
                format!("{} and {}", m.len(), v.len()),
            ));
        }
        self.bufs[TABLE_M] = self.backend.alloc(len)?;
        self.bufs[TABLE_V] = self.backend.alloc(len)?;
        self.backend.write(&mut self.bufs[TABLE_M], 0, m)?;
        self.backend.write(&mut self.bufs[TABLE_V], 0, v)
    }
}
