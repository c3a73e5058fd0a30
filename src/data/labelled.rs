//! Trees with a class label per vertex (SST, the synthetic treebank) as examples of a
//! [`Model`](crate::model::Model). With the loss on every vertex the model reads every vertex
//! ([`Readout::Vertices`]): each vertex's target row is the one-hot row of its label, zeros (no
//! loss) where the label is not a class. With the loss on the root it reads the root
//! ([`Readout::Root`]), so only the roots' rows reach the head: the target is the root's row.

use super::TreeExample;
use crate::error::Result;
use crate::head::argmax;
use crate::layers::LossOn;
use crate::model::{AsExample, Example, Outputs, Tree};
use crate::readout::Readout;
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

    /// The readout a model of such examples reads them with.
    pub fn readout(loss_on: LossOn) -> Readout {
        match loss_on {
            LossOn::All => Readout::Vertices,
            LossOn::Root => Readout::Root,
        }
    }
}

impl AsExample for Labelled<'_> {
    /// One graph; a target row per vertex (a label outside the classes carries no loss: the
    /// readers refuse such labels).
    fn example(&self) -> Example<'_> {
        let (t, c) = (self.tree, self.classes);
        let root = t.root();
        let labelled: &[u32] = match self.loss_on {
            LossOn::All => &t.labels,
            LossOn::Root => &t.labels[root..=root],
        };
        let mut target = vec![0.0; labelled.len() * c];
        for (row, &label) in labelled.iter().enumerate() {
            if (label as usize) < c {
                target[row * c + label as usize] = 1.0;
            }
        }
        Example { trees: vec![Tree::new(&t.graph, &t.words, root)], target }
    }

    /// The number of vertices [`example`](Self::example) gives a target: the loss is the mean
    /// over them.
    fn terms(&self) -> usize {
        match self.loss_on {
            LossOn::All => self.tree.labels.iter().filter(|&&l| (l as usize) < self.classes).count(),
            LossOn::Root => 1,
        }
    }

    /// The accuracy at the roots (which picks the best epoch), then, with the loss on every
    /// vertex, over every vertex, from the head's `logits` (one row per vertex read).
    fn score(outputs: &Outputs, data: &[Self]) -> Result<Scores> {
        let logits = outputs.get("logits")?;
        let c = data.first().map_or(1, |d| d.classes.max(1));
        let rows: Vec<&[f32]> = logits.chunks(c).collect();
        let at_roots = data.first().is_some_and(|d| d.loss_on == LossOn::Root);
        let (mut start, mut roots, mut vertices, mut all) = (0, 0usize, 0usize, 0usize);
        for d in data {
            let n = if at_roots { 1 } else { d.tree.graph.len() };
            let Some(mine) = rows.get(start..start + n) else {
                return Err(crate::Error::input(
                    "head outputs `logits`",
                    format!("a row of {c} per vertex of the data"),
                    format!("{} rows", rows.len()),
                ));
            };
            let root = d.tree.root();
            let label = |row: usize| d.tree.labels[if at_roots { root } else { row }] as usize;
            let right = |row: usize| argmax(mine[row]) == label(row);
            roots += usize::from(right(if at_roots { 0 } else { root }));
            vertices += (0..n).filter(|&v| right(v)).count();
            (start, all) = (start + n, all + n);
        }
        // No data, no accuracy (NaN, `null` in JSON): never a best epoch, never a 0.
        let share = |k: usize, of: usize| if of == 0 { f64::NAN } else { k as f64 / of as f64 };
        let mut scores = vec![("root_accuracy".into(), share(roots, data.len()))];
        if !at_roots {
            scores.push(("phrase_accuracy".into(), share(vertices, all)));
        }
        Ok(scores)
    }
}
