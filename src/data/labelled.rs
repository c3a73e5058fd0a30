//! Trees with a class label per vertex (SST, the synthetic treebank) as examples of a
//! [`Model`](crate::model::Model) reading every vertex ([`Readout::Vertices`](crate::readout::Readout)):
//! each vertex's target row is the one-hot row of its label where it carries a loss, zeros (no
//! loss) elsewhere.

use super::TreeExample;
use crate::error::Result;
use crate::head::argmax;
use crate::layers::LossOn;
use crate::model::{AsExample, Example, Outputs, Tree};
use crate::trainer::Scores;

/// A tree with a label per vertex, the vertices that carry a loss, and the number of classes.
#[derive(Clone, Copy, Debug)]
pub struct Labelled<'a> {
    /// The tree, its words and labels.
    pub tree: &'a TreeExample,
    /// Which vertices carry a loss.
    pub loss_on: LossOn,
    /// The number of classes (the width of a target row).
    pub classes: usize,
}

impl<'a> Labelled<'a> {
    /// Every tree of `trees`, with the loss on `loss_on` over `classes` classes.
    pub fn all(trees: &'a [TreeExample], loss_on: LossOn, classes: usize) -> Vec<Labelled<'a>> {
        trees.iter().map(|tree| Labelled { tree, loss_on, classes }).collect()
    }
}

impl AsExample for Labelled<'_> {
    /// One graph; a target row per vertex (a label outside the classes carries no loss: the
    /// readers refuse such labels).
    fn example(&self) -> Example<'_> {
        let (t, c) = (self.tree, self.classes);
        let root = t.root();
        let mut target = vec![0.0; t.graph.len() * c];
        for (v, &label) in t.labels.iter().enumerate() {
            if (label as usize) < c && (self.loss_on == LossOn::All || v == root) {
                target[v * c + label as usize] = 1.0;
            }
        }
        Example { trees: vec![Tree { graph: &t.graph, words: &t.words, root }], target }
    }

    /// The number of vertices [`example`](Self::example) gives a target: the loss is the mean
    /// over them, as a [`Classifier`](crate::train::Classifier)'s.
    fn terms(&self) -> usize {
        match self.loss_on {
            LossOn::All => self.tree.labels.iter().filter(|&&l| (l as usize) < self.classes).count(),
            LossOn::Root => 1,
        }
    }

    /// The accuracy at the roots (which picks the best epoch), then over every vertex, from the
    /// head's `logits` (one row per vertex).
    fn score(outputs: &Outputs, data: &[Self]) -> Result<Scores> {
        let logits = outputs.get("logits")?;
        let c = data.first().map_or(1, |d| d.classes.max(1));
        let rows: Vec<&[f32]> = logits.chunks(c).collect();
        let (mut start, mut roots, mut vertices, mut all) = (0, 0usize, 0usize, 0usize);
        for d in data {
            let n = d.tree.graph.len();
            let Some(mine) = rows.get(start..start + n) else {
                return Err(crate::Error::input(
                    "head outputs `logits`",
                    format!("a row of {c} per vertex of the data"),
                    format!("{} rows", rows.len()),
                ));
            };
            let right = |v: usize| argmax(mine[v]) == d.tree.labels[v] as usize;
            roots += usize::from(right(d.tree.root()));
            vertices += (0..n).filter(|&v| right(v)).count();
            (start, all) = (start + n, all + n);
        }
        // No data, no accuracy (NaN, `null` in JSON): never a best epoch, never a 0.
        let share = |k: usize, of: usize| if of == 0 { f64::NAN } else { k as f64 / of as f64 };
        Ok(vec![("root_accuracy".into(), share(roots, data.len())), ("phrase_accuracy".into(), share(vertices, all))])
    }
}
