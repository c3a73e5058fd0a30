//! A model's passes over a minibatch: the layers of cells, then the head over the rows read
//! out of the top layer — read to the host, or, with a root readout, passed to the head on the
//! backend with their gradients passed back the same way.

use super::{head_inputs, pulls, read_rows, width_out, with_words_dropped, Example, Layout, Model, Purpose};
use crate::engine::{Engine, Gradients, LinkedRows, Pass, Planned, Pull};
use crate::readout::{Pooled, Readout};
use crate::{Backend, InputGraph};
use arbor_core::error::Result;

/// One engine's pass: training (scheduled ahead if `planned` is given) or inference, returning
/// only `rows`' outputs if given.
fn run_pass<B: Backend>(
    engine: &mut Engine<B>,
    graphs: &[&InputGraph],
    pulls: &[Pull<'_>],
    rows: Option<&[usize]>,
    train: bool,
    planned: Option<Planned<'_>>,
    kept: bool,
) -> Result<Vec<Vec<f32>>> {
    let pass = match (train, planned) {
        (true, Some(p)) => Pass::planned(p, pulls),
        (true, None) => Pass::train(graphs, pulls),
        (false, _) => Pass::infer(graphs, pulls),
    };
    let pass = match rows {
        Some(rows) => pass.rows(rows),
        None => pass,
    };
    engine.run(if kept { pass.kept() } else { pass })
}

impl<B: Backend> Model<B> {
    /// Runs the cells over `batch` (keeping what a backward pass needs unless `pass` is
    /// inference); returns the layout, the head's inputs (per graph slot, the read-out rows of
    /// every example, then the targets) and, for a pooling readout, the pooling.
    pub(super) fn read_out<'a>(
        &mut self,
        batch: &[Example<'a>],
        pass: Purpose<'_>,
    ) -> Result<(Layout<'a>, Vec<Vec<f32>>, Option<Pooled>)> {
        let layout = self.layout(batch)?;
        let rows = (self.readout == Readout::Root).then_some(layout.roots.as_slice());
        let top = self.run_cells(&layout, pass, rows, false)?;
        let width = width_out(self.top().function());
        let (read, pooled) = read_rows(top, &layout, self.readout, width, rows.is_some())?;
        let targets = batch.iter().flat_map(|e| e.target.iter().copied()).collect();
        Ok((layout, head_inputs(read, self.graphs_per_example(), width, targets), pooled))
    }

    /// Runs the layers of cells over `layout` (keeping what a backward pass needs unless `pass`
    /// is inference); returns the top layer's outputs (only at `rows` if given), or nothing
    /// with `kept` (they stay on the backend).
    fn run_cells(
        &mut self,
        layout: &Layout<'_>,
        pass: Purpose<'_>,
        rows: Option<&[usize]>,
        kept: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let (train, mut planned) = match pass {
            Purpose::Train(planned) => (true, planned),
            Purpose::Infer => (false, None),
        };
        let dropped = train.then(|| with_words_dropped(&self.embedding, self.cells[0].dropout_key(), layout)).flatten();
        let pulls = pulls(&self.embedding, &self.feeds, dropped.as_ref().unwrap_or(layout), true);
        let top = self.cells.len() - 1;
        let mut below: Vec<Vec<f32>> = Vec::new();
        for (k, engine) in self.cells.iter_mut().enumerate() {
            let input = [Pull::Rows(below.first().map_or(&[][..], Vec::as_slice))];
            let pulls = if k == 0 { pulls.as_slice() } else { &input };
            below = run_pass(
                engine,
                &layout.graphs,
                pulls,
                rows.filter(|_| k == top),
                train,
                planned.take(),
                kept && k == top,
            )?;
        }
        Ok(below)
    }

    /// With a root readout: runs the cells and the head over `batch`, the roots' rows passed
    /// from the top layer to the head on the backend (and, after [`Model::backward_linked`],
    /// their gradients back); returns the layout and the head's outputs in inference (in
    /// training they wait on the backend: [`Head::kept_outputs`]).
    pub(super) fn forward_linked<'a>(
        &mut self,
        batch: &[Example<'a>],
        pass: Purpose<'_>,
    ) -> Result<(Layout<'a>, Vec<Vec<f32>>)> {
        let layout = self.layout(batch)?;
        let train = matches!(pass, Purpose::Train(_));
        let order = slot_order(&layout.roots, self.graphs_per_example(), batch.len());
        self.run_cells(&layout, pass, Some(&order), true)?;
        let top = self.cells.len() - 1;
        let n = batch.len();
        let linked = (0..self.graphs_per_example())
            .map(|s| self.cells[top].output_rows(0, &order[s * n..(s + 1) * n]))
            .collect::<Result<Vec<_>>>()?;
        let targets: Vec<f32> = batch.iter().flat_map(|e| e.target.iter().copied()).collect();
        let outputs = self.head.forward_linked(&mut self.cells[top], &linked, &[&targets], train)?;
        Ok((layout, outputs))
    }

    /// The top layer's backward pass after [`Model::forward_linked`] and the head's backward
    /// pass, its output's gradient at the roots taken from the head's input gradients on the
    /// backend; the parameters' gradients stay in the engine.
    pub(super) fn backward_linked(&mut self, examples: usize) -> Result<Gradients> {
        let all: Vec<usize> = (0..examples).collect();
        let head = self.head.engine_ref();
        let pieces =
            (0..self.graphs_per_example()).map(|s| head.input_grad_rows(s, &all)).collect::<Result<Vec<_>>>()?;
        let top = self.cells.len() - 1;
        // Outputs after the first (none the head reads) get zeros.
        let zeros = [LinkedRows { at: None, rows: vec![0; pieces.iter().map(|p| p.rows.len()).sum()] }];
        let others = self.cells[top].function().outputs().len().saturating_sub(1);
        let given: Vec<&[LinkedRows]> =
            std::iter::once(&pieces[..]).chain(std::iter::repeat_n(&zeros[..], others)).collect();
        self.cells[top].backward_linked(self.head.engine(), &given)
    }
}

/// `roots` (per example, per graph of `k`) slot by slot: every example's first graph's root,
/// then every example's second, …
fn slot_order(roots: &[usize], k: usize, examples: usize) -> Vec<usize> {
    (0..k).flat_map(|s| roots.iter().skip(s).step_by(k.max(1)).take(examples).copied()).collect()
}
