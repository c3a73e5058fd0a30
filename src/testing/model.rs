//! The gradient check of a whole model: word vectors, cells, readout and head.

use super::{EntryKind, GradCheck, GradComparisons, GradReport, Mismatch};
use crate::model::{Example, Model};
use crate::rng::Rng;
use crate::CpuBackend;

/// Which tensor an entry belongs to.
#[derive(Clone, Copy)]
enum Part {
    /// Parameter `p` of layer `k`.
    Cell(usize, usize),
    Head(usize),
    /// A row of the word vectors.
    Word(u32),
}

/// The host's copy of a model's values, whose entries the check perturbs one at a time.
struct Values {
    cells: Vec<Vec<Vec<f32>>>,
    head: Vec<Vec<f32>>,
    words: Vec<f32>,
    dim: usize,
}

impl Values {
    /// Entry `e` of `part`.
    fn entry(&mut self, part: Part, e: usize) -> &mut f32 {
        match part {
            Part::Cell(k, p) => &mut self.cells[k][p][e],
            Part::Head(p) => &mut self.head[p][e],
            Part::Word(r) => &mut self.words[r as usize * self.dim + e],
        }
    }

    /// Sets entry `e` of `part` to `value`, here and in `model` (a word's vector alone, not
    /// the whole table).
    fn set(&mut self, model: &mut Model<CpuBackend>, part: Part, e: usize, value: f32) -> crate::Result<()> {
        *self.entry(part, e) = value;
        match part {
            Part::Cell(k, _) => model.cells_mut()[k].set_params(&self.cells[k]),
            Part::Head(_) => model.head_mut().engine().set_params(&self.head),
            Part::Word(r) => model.set_word_vector(r, &self.words[r as usize * self.dim..][..self.dim]),
        }
    }
}

/// Checks the gradients of `model`'s mean loss over `batch` (what [`Model::gradients`] gives a
/// training step: the vertex function's parameters, the head's and the rows of the word vectors
/// the batch looks up) against central differences of that loss, in training mode with the
/// dropout masks held fixed, up to [`GradCheck::max_entries`] sampled entries of each tensor
/// (and of each word vector). The model is left as it was. A [`Mismatch`] names each wrong
/// entry: ``cell `W`[2, 5]`` (``cell1 `W`[2, 5]`` for the layer stacked on it), ``head `V`[0, 1]``,
/// `word 3 [1]`; where every value checks at a step ten or a hundred times smaller, the detail
/// says that a kink lies within ε of a checked value (see
/// [`check_gradients`](super::check_gradients)).
pub fn check_model_gradients(
    model: &mut Model<CpuBackend>,
    batch: &[Example<'_>],
    opts: &GradCheck,
) -> Result<GradReport, Mismatch> {
    check_model_whole(model, batch, opts).map_err(|m| {
        if m.wrong.is_empty() {
            return m;
        }
        super::gradients::kink_or(m, opts, |finer| check_model_whole(model, batch, finer).is_ok(), |m| m)
    })
}

/// [`check_model_gradients`] before a failure is checked at smaller steps.
fn check_model_whole(
    model: &mut Model<CpuBackend>,
    batch: &[Example<'_>],
    opts: &GradCheck,
) -> Result<GradReport, Mismatch> {
    let what = format!("gradients of a model over {} examples", batch.len());
    let fail = |e: crate::Error| Mismatch::other(what.clone(), e.to_string());
    let n = batch.len().max(1);
    let loss_at = model.head().loss_output();
    // The mean loss and the magnitude of its terms, in training mode without an update.
    let loss = |model: &mut Model<CpuBackend>| -> crate::Result<(f64, f64)> {
        let out = model.gradients(batch, n, None)?;
        let l = out.outputs.get(loss_at).map(Vec::as_slice).unwrap_or_default();
        Ok((l.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64, l.iter().map(|&v| f64::from(v).abs()).sum()))
    };
    let grads = model.gradients(batch, n, None).map_err(fail)?;
    let (_, scale) = loss(model).map_err(fail)?;
    // Each parameter's name and width, per layer and for the head.
    let shapes = |f: &crate::VertexFn| -> Vec<(String, usize)> {
        f.params().iter().map(|p| (p.name.clone(), p.shape.cols().max(1))).collect()
    };
    let cell_shapes: Vec<Vec<(String, usize)>> = model.cells().iter().map(|e| shapes(e.function())).collect();
    let head_shapes = shapes(model.head().function());
    let dim = model.embedding().dim();
    let mut rng = Rng::new(opts.seed);
    let mut targets: Vec<(Part, usize, f32)> = Vec::new();
    for (k, layer) in grads.cells.iter().enumerate() {
        for (p, g) in layer.iter().enumerate() {
            let entries = super::gradients::sample(&mut rng, g.len(), opts.max_entries);
            targets.extend(entries.into_iter().map(|e| (Part::Cell(k, p), e, g[e])));
        }
    }
    for (p, g) in grads.head.iter().enumerate() {
        targets.extend(
            super::gradients::sample(&mut rng, g.len(), opts.max_entries).into_iter().map(|e| (Part::Head(p), e, g[e])),
        );
    }
    for (&row, g) in grads.words.rows.iter().zip(grads.words.values.chunks(dim)) {
        targets.extend(
            super::gradients::sample(&mut rng, dim, opts.max_entries).into_iter().map(|e| (Part::Word(row), e, g[e])),
        );
    }
    let label = |part: Part, e: usize| {
        let at = |of: String, (name, cols): &(String, usize)| format!("{of} `{name}`[{}, {}]", e / cols, e % cols);
        match part {
            Part::Cell(k, p) => at(crate::model::layer_prefix(k), &cell_shapes[k][p]),
            Part::Head(p) => at("head".into(), &head_shapes[p]),
            Part::Word(r) => format!("word {r} [{e}]"),
        }
    };
    let mut values = Values {
        cells: model.cells().iter().map(|e| e.params()).collect::<crate::Result<_>>().map_err(fail)?,
        head: model.head().params().map_err(fail)?,
        words: model.word_vectors().map_err(fail)?,
        dim,
    };
    let mut check = GradComparisons::new(what.clone(), opts.tolerance, scale);
    for (part, e, analytic) in targets {
        let x = *values.entry(part, e);
        let points = check.points(x);
        values.set(model, part, e, points.0).map_err(fail)?;
        let at_hi = loss(model).map_err(fail)?.0;
        values.set(model, part, e, points.1).map_err(fail)?;
        let at_lo = loss(model).map_err(fail)?.0;
        values.set(model, part, e, x).map_err(fail)?;
        let kind = if let Part::Word(_) = part { EntryKind::Pull } else { EntryKind::Param };
        check.compare(kind, || label(part, e), analytic, points, (at_hi, at_lo));
    }
    check.finish()
}
