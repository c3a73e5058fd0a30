//! The one update path every model and strategy takes after its gradients are summed: the
//! finiteness check, clipping by the joint norm, and the optimizer step with each tensor's state
//! kept under its name.

use crate::layers::{Embedding, SparseGrad};
use crate::optim::Optimizer;
use crate::VertexFn;
use arbor_core::error::Result;

/// Numbers from one minibatch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Mean loss over the loss's terms.
    pub loss: f32,
    /// Targets predicted right, where the step counts them (0 otherwise).
    pub correct: usize,
    /// Examples.
    pub count: usize,
    /// Vertices processed.
    pub vertices: usize,
    /// The gradient noise, where the step measured it (`--batch auto`).
    pub noise: Option<super::batch_size::Noise>,
}

/// Adds every gradient of `src` to `dst` (taking `src` where `dst` is still empty).
pub(crate) fn add_all(dst: &mut Vec<Vec<f32>>, src: Vec<Vec<f32>>) {
    dst.resize_with(src.len(), Vec::new);
    for (d, s) in dst.iter_mut().zip(src) {
        if d.is_empty() {
            *d = s;
        } else {
            d.iter_mut().zip(&s).for_each(|(d, s)| *d += s);
        }
    }
}

/// Every gradient value of the layers' tensors, the head's and a table's rows, as one list (for
/// a joint norm).
pub(crate) fn all_values<'a>(
    cells: &'a mut [Vec<Vec<f32>>],
    head: &'a mut [Vec<f32>],
    words: &'a mut SparseGrad,
) -> Vec<&'a mut [f32]> {
    let mut all: Vec<&mut [f32]> = cells.iter_mut().flatten().map(Vec::as_mut_slice).collect();
    all.extend(head.iter_mut().map(Vec::as_mut_slice));
    all.push(&mut words.values);
    all
}

/// A tensor's name in checkpoints and optimizer state: `cell.W`, `head.bias`, ….
pub(crate) fn tensor_name(of: &str, param: &str) -> String {
    format!("{of}.{param}")
}

/// The names of `f`'s parameters under the prefix `of`.
pub(crate) fn names(of: &str, f: &VertexFn) -> Vec<String> {
    f.params().iter().map(|p| tensor_name(of, &p.name)).collect()
}

/// One optimizer step over a model's parameters, each tensor's state kept under its name: the
/// dense tensors, then the rows of the word vectors that their gradient touches (settings no
/// update can follow refused first: [`Optimizer::check`]).
pub(crate) fn update(
    opt: &mut Optimizer,
    dense: Vec<(String, &mut [f32], &[f32])>,
    embed: Option<(&mut Embedding, &SparseGrad)>,
) -> Result<()> {
    opt.check()?;
    opt.begin_step();
    for (name, p, g) in dense {
        opt.dense(&name, p, g);
    }
    if let Some((e, g)) = embed {
        let dim = e.dim();
        opt.sparse("embedding", e.table_mut(), dim, g);
    }
    Ok(())
}
