//! A [`Model`]'s learned tensors by name (`embedding`, `cell.<name>`, `cell1.<name>`, …,
//! `head.<name>`): what checkpoints, optimizer state and weight averages are keyed by.

use super::{layer_prefix, Model};
use crate::checkpoint::{Checkpoint, Lent, Named};
use crate::engine::Engine;
use crate::trainer::step::tensor_name;
use crate::{Backend, VertexFn};
use arbor_core::error::Result;
use std::borrow::Cow;

impl<B: Backend> Model<B> {
    /// Every learned tensor under its name (`embedding`, `cell.<name>`, `cell1.<name>`, …,
    /// `head.<name>`), for a checkpoint.
    pub fn tensors(&self) -> Result<Vec<Named>> {
        Ok(crate::checkpoint::owned(self.tensors_lent()?))
    }

    /// [`Model::tensors`] as the weight average takes them every step: the word vectors lent where
    /// the backend keeps them in host memory, not copied.
    pub fn tensors_lent(&self) -> Result<Vec<Lent<'_>>> {
        let mut out = vec![(
            "embedding".to_string(),
            vec![self.embedding.vocab(), self.embedding.dim()],
            self.cells[0].table_lent()?,
        )];
        let mut values: Vec<Vec<Vec<f32>>> = self.cells.iter().map(Engine::params).collect::<Result<_>>()?;
        values.push(self.head.params()?);
        for ((of, f), values) in self.functions().into_iter().zip(values) {
            for (decl, values) in f.params().iter().zip(values) {
                out.push((tensor_name(&of, &decl.name), decl.shape.dims().to_vec(), Cow::Owned(values)));
            }
        }
        Ok(out)
    }

    /// The word vectors, `vocab × dim`, read from the bottom engine that holds them.
    pub fn word_vectors(&self) -> Result<Vec<f32>> {
        self.cells[0].table()
    }

    /// Replaces the word vectors (`vocab × dim` values, e.g. pre-trained ones), keeping their
    /// optimizer state.
    pub fn set_word_vectors(&mut self, table: &[f32]) -> Result<()> {
        let e = &self.embedding;
        if table.len() != e.vocab() * e.dim() {
            return Err(arbor_core::error::Error::input(
                "word vectors",
                format!("{} values ({} rows of {})", e.vocab() * e.dim(), e.vocab(), e.dim()),
                format!("{} values", table.len()),
            ));
        }
        self.cells[0].set_table(table, e.dim())
    }

    /// Every function with parameters under its name prefix: each layer's, then the head's.
    fn functions(&self) -> Vec<(String, &VertexFn)> {
        let mut all: Vec<_> = self.cells.iter().enumerate().map(|(k, e)| (layer_prefix(k), e.function())).collect();
        all.push(("head".to_string(), self.head.function()));
        all
    }

    /// Takes every learned tensor from `ck` (as [`Model::tensors`] names them); an error names
    /// a missing tensor or one of another size, and changes nothing.
    pub fn restore(&mut self, ck: &Checkpoint) -> Result<()> {
        let table = ck.sized("embedding", self.embedding.vocab() * self.embedding.dim())?;
        let mut params = Vec::new();
        for (of, f) in self.functions() {
            params.push(
                f.params()
                    .iter()
                    .map(|d| ck.sized(&tensor_name(&of, &d.name), d.shape.numel()))
                    .collect::<Result<Vec<_>>>()?,
            );
        }
        let head = params.pop().unwrap_or_default();
        for (engine, p) in self.cells.iter_mut().zip(&params) {
            engine.set_params(p)?;
        }
        self.head.engine().set_params(&head)?;
        self.set_word_vectors(&table)
    }
}
