//! Rows passed between two engines on one backend without crossing to the host: one engine's
//! pushed output pulled by another ([`Pull::Linked`](super::Pull::Linked), run by
//! [`Engine::run_linked`]), and the puller's input gradient given back to the first as its
//! output's gradient ([`Engine::backward_linked`]). On a device this keeps a model's cells and
//! its head talking on the device: the rows never come to the host.
//!
//! During a linked pass the other engine's arena sits in this engine's [`LINKED`] buffer (the
//! buffers are swapped, not copied), and copy launches read it through indices like any other
//! rows. An engine can also set its outputs aside on the backend ([`Engine::keep_outputs`]) and
//! read them at the end of a step, in one read.

use super::batch::Batch;
use super::launch::{Launch, ARENA, STAGED, STAGED_ROWS};
use super::lower::{self, Lowering};
use super::{Engine, Gradients, Pass, Pull};
use arbor_core::backend::{Backend, IndexLoc, Loc, Mem, Rows};
use arbor_core::error::{Error, Result};
use arbor_core::ir::Port;
use arbor_core::profile::{self, Activity};
use std::sync::Arc;

/// The engine's buffer that holds the other engine's arena during a linked pass.
pub const LINKED: usize = 10;

/// Rows of a region in an engine's arena: where the region starts (`None`: it holds zeros, as
/// the gradient of an input no gradient reaches) and one row number per vertex.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LinkedRows {
    /// The region's first element in the arena.
    pub at: Option<usize>,
    /// Per vertex, its row of the region.
    pub rows: Vec<u32>,
}

/// A pushed output's gradient given to a backward pass.
#[derive(Clone, Copy, Debug)]
pub enum Given<'a> {
    /// Rows from the host.
    Rows(&'a [f32]),
    /// Rows in the linked engine's arena, in pieces whose rows together are one per vertex.
    Linked(&'a [LinkedRows]),
}

/// An input linked to another engine's rows: which input, and its index entries (the source
/// row of each of its rows, in row order).
pub(super) struct LinkedInput {
    pub input: usize,
    pub at: Option<usize>,
    pub index_at: usize,
    pub rows: Vec<u32>,
}

impl Batch {
    /// The inputs given as [`Pull::Linked`], with their index entries laid out after the others.
    pub(super) fn link_pulls(&mut self, pulls: &[Pull<'_>]) -> Vec<LinkedInput> {
        let mut linked = Vec::new();
        for (input, pull) in pulls.iter().enumerate() {
            if let Pull::Linked(from) = pull {
                let rows = self.schedule.vertex_of_row.iter().map(|&v| from.rows[v as usize]).collect();
                linked.push(LinkedInput { input, at: from.at, index_at: self.index.len, rows });
                self.index.len += self.schedule.len();
            }
        }
        linked
    }
}

impl Lowering {
    /// Copies every linked input's rows from the linked arena (first in a forward pass, with the
    /// held table's).
    pub(super) fn copy_linked_rows(&mut self) {
        let b = &self.b;
        let n = b.schedule.len();
        let launches: Vec<Launch> = b
            .linked
            .iter()
            .map(|l| {
                let to = Loc { buf: ARENA, offset: b.memory.pulls[l.input].offset };
                let block = self.a.f.all_inputs()[l.input].shape.numel();
                match l.at {
                    Some(at) => Launch::Copy {
                        from: Rows::Indexed {
                            data: Loc { buf: LINKED, offset: at },
                            index: IndexLoc { buf: 0, offset: l.index_at },
                        },
                        to,
                        rows: n,
                        block,
                    },
                    None => Launch::Fill { dst: to, len: n * block },
                }
            })
            .collect();
        launches.into_iter().for_each(|l| self.push(l));
    }

    /// The launches that place a linked gradient of the rows `dst_rows` of an output (in its
    /// pieces `from`) in `STAGED` from `staged_at` on, adding the pieces' source rows to the
    /// staged index after what it holds.
    pub(super) fn stage_linked(&mut self, from: &[LinkedRows], block: usize, staged_at: usize) {
        let mut done = 0;
        for piece in from {
            let to = Loc { buf: STAGED, offset: staged_at + done * block };
            let rows = piece.rows.len();
            let launch = match piece.at {
                Some(at) => {
                    let index = IndexLoc { buf: STAGED_ROWS, offset: self.uploads.staged_rows.len() };
                    self.uploads.staged_rows.extend_from_slice(&piece.rows);
                    Launch::Copy {
                        from: Rows::Indexed { data: Loc { buf: LINKED, offset: at }, index },
                        to,
                        rows,
                        block,
                    }
                }
                None => Launch::Fill { dst: to, len: rows * block },
            };
            self.push(launch);
            done += rows;
        }
    }
}

/// An error unless the rows of `linked` (as wide as `port`) all lie in a buffer of `len`.
fn check_fits(what: &str, port: &Port, linked: &LinkedRows, len: usize) -> Result<()> {
    let Some(at) = linked.at else { return Ok(()) };
    let block = port.shape.numel();
    let end = linked.rows.iter().map(|&r| at + (r as usize + 1) * block).max().unwrap_or(0);
    if end <= len {
        return Ok(());
    }
    Err(Error::input(
        format!("{what} `{}`", port.name),
        format!("rows inside the linked engine's arena ({len} values; Engine::run_linked)"),
        format!("rows up to element {end}"),
    ))
}

impl<B: Backend> Engine<B> {
    /// Where vertices `vertices` (merged-vertex indices, checked) of pushed output `output` of
    /// the last forward pass are, for another engine to pull ([`Pull::Linked`]).
    pub fn output_rows(&self, output: usize, vertices: &[usize]) -> Result<LinkedRows> {
        let f = self.function();
        let o = f.outputs().get(output).ok_or_else(|| {
            Error::input(
                format!("output of `{}`", f.name()),
                format!("below {}", f.outputs().len()),
                output.to_string(),
            )
        })?;
        let at = self.lowering.loc(lower::Pass::Forward, o.value, 0, 0)?;
        self.rows_at("output rows", at, vertices)
    }

    /// Where the gradient rows of pulled input `input` at `vertices` are after the last
    /// backward pass, to give to another engine's [`Engine::backward_linked`]; `at` is `None`
    /// where no gradient reaches the input.
    pub fn input_grad_rows(&self, input: usize, vertices: &[usize]) -> Result<LinkedRows> {
        let f = self.function();
        if input >= f.inputs().len() {
            return Err(Error::input(
                format!("input of `{}`", f.name()),
                format!("below {}", f.inputs().len()),
                input.to_string(),
            ));
        }
        match f.backward().pull_grads[input] {
            Some(g) => {
                self.rows_at("input gradient rows", self.lowering.loc(lower::Pass::Backward, g, 0, 0)?, vertices)
            }
            None => Ok(LinkedRows { at: None, rows: vec![0; vertices.len()] }),
        }
    }

    fn rows_at(&self, what: &str, at: Loc, vertices: &[usize]) -> Result<LinkedRows> {
        super::check_vertices(what, self.schedule().len(), vertices)?;
        if at.buf != ARENA {
            return Err(Error::input(what, "rows in the arena", format!("buffer {}", at.buf)));
        }
        let rows = vertices.iter().map(|&v| self.schedule().row_of_vertex[v]).collect();
        Ok(LinkedRows { at: Some(at.offset), rows })
    }

    /// [`Engine::run`] whose inputs given as [`Pull::Linked`] pull their rows from `from`'s
    /// arena (another engine on the same backend, after the pass that formed them).
    pub fn run_linked(&mut self, pass: Pass<'_>, from: &mut Engine<B>) -> Result<Vec<Vec<f32>>> {
        self.with_linked(from, |e| e.run(pass))
    }

    /// [`Engine::backward_kept`] given, for each pushed output, its gradient at the vertices the
    /// last pass returned ([`Pass::rows`]) as rows of `from`'s arena: in pieces, in order, that
    /// together hold one row per vertex (e.g. [`Engine::input_grad_rows`] of the engine that
    /// pulled them).
    pub fn backward_linked(&mut self, from: &mut Engine<B>, grads: &[&[LinkedRows]]) -> Result<Gradients> {
        let given: Vec<Given<'_>> = grads.iter().map(|g| Given::Linked(g)).collect();
        self.with_linked(from, |e| {
            let len = e.backend.len(&e.bufs[LINKED]);
            for (port, pieces) in e.function().outputs().iter().zip(grads) {
                pieces.iter().try_for_each(|p| check_fits("gradient of output", port, p, len))?;
            }
            let rows = e.rows.take();
            let grads = e.run_backward(rows.as_deref(), &given);
            e.rows = rows;
            grads
        })
    }

    /// Runs `work` with `from`'s arena in this engine's [`LINKED`] buffer, then gives it back.
    fn with_linked<T>(&mut self, from: &mut Engine<B>, work: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        std::mem::swap(&mut self.bufs[LINKED], &mut from.bufs[ARENA]);
        let out = work(self);
        std::mem::swap(&mut self.bufs[LINKED], &mut from.bufs[ARENA]);
        out
    }

    /// An error unless every [`Pull::Linked`] input's rows lie in the [`LINKED`] buffer.
    pub(super) fn check_linked(&self, pulls: &[Pull<'_>]) -> Result<()> {
        let len = self.backend.len(&self.bufs[LINKED]);
        for (pull, port) in pulls.iter().zip(self.function().all_inputs()) {
            if let Pull::Linked(rows) = pull {
                check_fits("input", port, rows, len)?;
            }
        }
        Ok(())
    }
}

/// The engine's buffer that holds the pushed outputs a pass set aside ([`Engine::keep_outputs`]).
pub const OUTPUTS: usize = 11;

impl<B: Backend> Engine<B> {
    /// Copies every pushed output of the last forward pass (all vertices) aside on the
    /// backend, out of reach of later passes, for [`Engine::read_kept_outputs`] to read in one
    /// read once the rest of a step is launched: a step then waits for the device once, at its
    /// end.
    pub fn keep_outputs(&mut self) -> Result<()> {
        let f = Arc::clone(self.lowering.function_arc());
        let n = self.schedule().len();
        let total: usize = f.outputs().iter().map(|o| n * o.shape.numel()).sum();
        if self.backend.len(&self.bufs[OUTPUTS]) < total {
            self.bufs[OUTPUTS] = self.backend.alloc(total.next_power_of_two())?;
        }
        let mut launches = Vec::with_capacity(f.outputs().len());
        let mut to = 0;
        for o in f.outputs() {
            let from = Rows::Contiguous(self.lowering.loc(lower::Pass::Forward, o.value, 0, 0)?);
            let block = o.shape.numel();
            launches.push(Launch::Copy { from, to: Loc { buf: OUTPUTS, offset: to }, rows: n, block });
            to += n * block;
        }
        let mem = &mut Mem { data: &mut self.bufs, index: &self.index };
        let (flops, calls) = super::launch::execute(&self.backend, mem, &launches)?;
        self.flops += flops;
        self.calls += calls;
        self.kept_order = self.schedule().row_of_vertex.clone();
        Ok(())
    }

    /// The outputs [`Engine::keep_outputs`] set aside, each in merged-vertex order, read in one
    /// read.
    pub fn read_kept_outputs(&mut self) -> Result<Vec<Vec<f32>>> {
        let total = self.kept_len();
        let mut host = std::mem::take(&mut self.host);
        host.resize(total, 0.0);
        if total > 0 {
            profile::time(Activity::Read, || self.backend.read(&self.bufs[OUTPUTS], 0, &mut host))?;
        }
        let out = self.unpack_kept(&host);
        self.host = host;
        Ok(out)
    }

    /// The values [`Engine::keep_outputs`] set aside: one per vertex and output element.
    pub fn kept_len(&self) -> usize {
        let n = self.kept_order.len();
        self.function().outputs().iter().map(|o| n * o.shape.numel()).sum()
    }

    /// Copies the outputs [`Engine::keep_outputs`] set aside into the lent step block
    /// ([`STEP`](crate::STEP)) from word `at` on ([`Engine::kept_len`] words), for the model's
    /// one read at the end of a step ([`Engine::unpack_kept`] takes them apart).
    pub fn copy_kept_outputs(&mut self, at: usize) -> Result<()> {
        // Rows of one value: one copy kernel for any number of outputs.
        let rows = self.kept_len();
        let from = Rows::Contiguous(Loc { buf: OUTPUTS, offset: 0 });
        let copy = [Launch::Copy { from, to: Loc { buf: crate::STEP, offset: at }, rows, block: 1 }];
        let mem = &mut Mem { data: &mut self.bufs, index: &self.index };
        let (flops, calls) = super::launch::execute(&self.backend, mem, &copy)?;
        self.flops += flops;
        self.calls += calls;
        Ok(())
    }

    /// The kept outputs from their values `host` as set aside ([`Engine::kept_len`] of them),
    /// each in merged-vertex order.
    pub fn unpack_kept(&self, host: &[f32]) -> Vec<Vec<f32>> {
        let n = self.kept_order.len();
        let mut at = 0;
        let mut out = Vec::with_capacity(self.function().outputs().len());
        for o in self.function().outputs() {
            let block = o.shape.numel();
            out.push(super::in_order(&host[at..at + n * block], &self.kept_order, block));
            at += n * block;
        }
        out
    }
}
