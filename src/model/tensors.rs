//! A [`Model`]'s learned tensors by name (`embedding`, `cell.<name>`, `cell1.<name>`, …,
//! `head.<name>`): what checkpoints, optimizer state and weight averages are keyed by.

use super::{layer_prefix, Model};
use crate::checkpoint::{Checkpoint, Lent, Named};
use crate::engine::Engine;
use crate::trainer::step::tensor_name;
use crate::{Backend, VertexFn};
use arbor_core::error::Result;
use std::borrow::Cow;

/// The word vectors and, per function, its parameters' values.
type Taken = (Vec<f32>, Vec<Vec<Vec<f32>>>);

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

    /// Replaces the vector of word `id` (a row of [`Model::word_vectors`]), the others and
    /// every optimizer state as they are.
    pub fn set_word_vector(&mut self, id: u32, values: &[f32]) -> Result<()> {
        self.cells[0].set_table_row(id as usize, values)
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
        let (table, mut params) = self.taken(ck)?;
        let head = params.pop().unwrap_or_default();
        for (engine, p) in self.cells.iter_mut().zip(&params) {
            engine.set_params(p)?;
        }
        self.head.engine().set_params(&head)?;
        self.set_word_vectors(&table)
    }

    /// Moves the weight average of every learned tensor `1 − keep` of the way to its value, in
    /// the engines, where the tensors are (a device's memory): nothing crosses to the host.
    /// The first call starts the average at the values.
    pub fn average_in_place(&mut self, keep: f32) -> Result<()> {
        self.cells.iter_mut().try_for_each(|e| e.average(keep))?;
        self.head.engine().average(keep)
    }

    /// The weight averages [`Model::average_in_place`] keeps, named as [`Model::tensors`] names
    /// the tensors (`None` before it begins).
    pub fn averaged(&self) -> Result<Option<Vec<Named>>> {
        if !self.cells[0].has_average() {
            return Ok(None);
        }
        let mut values = Vec::new();
        let mut table = Vec::new();
        for (k, e) in self.cells.iter().chain([self.head.engine_ref()]).enumerate() {
            let (params, t) = e.averages()?;
            if k == 0 {
                table = t;
            }
            values.push(params);
        }
        let mut out = vec![("embedding".to_string(), vec![self.embedding.vocab(), self.embedding.dim()], table)];
        for ((of, f), values) in self.functions().into_iter().zip(values) {
            for (decl, v) in f.params().iter().zip(values) {
                out.push((tensor_name(&of, &decl.name), decl.shape.dims().to_vec(), v));
            }
        }
        Ok(Some(out))
    }

    /// Sets the weight averages the engines keep from `averages` (named as
    /// [`Model::tensors`]; an error names a missing one), or forgets them given none.
    pub fn set_averaged(&mut self, averages: &[Named]) -> Result<()> {
        if averages.is_empty() {
            self.cells.iter_mut().try_for_each(|e| e.set_averages(None))?;
            return self.head.engine().set_averages(None);
        }
        let (table, mut params) =
            self.taken(&Checkpoint { tensors: averages.to_vec(), meta: serde_json::Value::Null })?;
        let head = params.pop().unwrap_or_default();
        for (k, (engine, p)) in self.cells.iter_mut().zip(&params).enumerate() {
            engine.set_averages(Some((p, if k == 0 { &table } else { &[] })))?;
        }
        self.head.engine().set_averages(Some((&head, &[])))
    }

    /// The word vectors and each function's parameters (as [`Model::functions`] lists them)
    /// taken from `ck`; an error names a missing tensor or one of another size.
    fn taken(&self, ck: &Checkpoint) -> Result<Taken> {
        let table = ck.sized("embedding", self.embedding.vocab() * self.embedding.dim())?;
        let mut params = Vec::new();
        for (of, f) in self.functions() {
            let p = f.params().iter().map(|d| ck.sized(&tensor_name(&of, &d.name), d.shape.numel()));
            params.push(p.collect::<Result<Vec<_>>>()?);
        }
        Ok((table, params))
    }
}
