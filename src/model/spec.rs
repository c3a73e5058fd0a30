//! The model described once: a [`ModelSpec`] holds everything that builds a [`Model`] — its
//! vertex functions and head as IR (so a cell or head of one's own is stored as surely as the
//! zoo's), the feeds, the readout and the word-vector table's size — and every checkpoint holds
//! it (`model_spec` in its metadata), so [`Model::load`] rebuilds and restores any checkpoint with
//! no other description.

use super::{Feed, Model};
use crate::checkpoint::Checkpoint;
use crate::head::Head;
use crate::ir::{BinaryOp, Declared, Func, Init, Node, Op, ParamDecl, Port, Reduce, StateDecl, UnaryOp, ValueId};
use crate::layers::Embedding;
use crate::readout::Readout;
use crate::{Backend, Engine, Shape, VertexFn};
use arbor_core::error::{Error, Result};
use serde_json::{json, Value};
use std::path::Path;

/// The version of the stored form; a checkpoint of another version is refused, naming it.
const VERSION: u64 = 1;

/// What builds a [`Model`]: its functions, feeds, readout and table size (see [`Model::load`]).
#[derive(Clone, Debug)]
pub struct ModelSpec {
    /// The vertex functions, bottom first.
    pub cells: Vec<VertexFn>,
    /// What feeds each input of the bottom one.
    pub feeds: Vec<Feed>,
    /// The head.
    pub head: VertexFn,
    /// How each graph's row is read out for the head.
    pub readout: Readout,
    /// Rows of the word-vector table.
    pub vocab: usize,
    /// Width of a word vector.
    pub dim: usize,
    /// The row that stays zero (no word), if any.
    pub padding: Option<u32>,
}

impl ModelSpec {
    /// The model this describes on replicas of `backend`, every parameter and word vector zero
    /// (for [`Model::restore`]).
    pub fn build<B: Backend>(&self, backend: &B) -> Result<Model<B>> {
        crate::memory::check_model("a stored model", self.floats(), self.cells.len() as u128 + 1)?;
        let mut words = Embedding::from_table(vec![0.0; self.vocab * self.dim], self.dim)?;
        if let Some(p) = self.padding {
            words = words.with_padding(p);
        }
        let zeros = |f: &VertexFn| f.params().iter().map(|p| vec![0.0; p.shape.numel()]).collect::<Vec<_>>();
        let cells = self
            .cells
            .iter()
            .map(|f| Engine::new(backend.replica()?, f.clone(), &zeros(f)))
            .collect::<Result<Vec<_>>>()?;
        let head = Head::new(backend.replica()?, self.head.clone(), &zeros(&self.head))?;
        Model::assemble(words, cells, self.feeds.clone(), head, self.readout)
    }

    /// The parameters' and word vectors' values.
    fn floats(&self) -> u128 {
        let params = self.cells.iter().chain([&self.head]).map(crate::memory::param_floats).sum::<u128>();
        params + (self.vocab as u128) * (self.dim as u128)
    }

    /// The stored form (JSON).
    pub fn to_json(&self) -> Value {
        json!({
            "version": VERSION,
            "cells": self.cells.iter().map(function_to_json).collect::<Vec<_>>(),
            "feeds": self.feeds.iter().map(|f| match f {
                Feed::Words => json!("words"),
                Feed::ParentWords => json!("parent_words"),
                Feed::ParentEdge(labels) => json!(["parent_edge", labels]),
                Feed::ChildEdges(width, reduce) => json!(["child_edges", width, reduce.name()]),
                Feed::Height(width) => json!(["height", width]),
            }).collect::<Vec<_>>(),
            "head": function_to_json(&self.head),
            "readout": self.readout.name(),
            "vocab": self.vocab,
            "dim": self.dim,
            "padding": self.padding,
        })
    }

    /// Reads the stored form; an error names what is missing or malformed.
    pub fn from_json(v: &Value) -> Result<ModelSpec> {
        let version = v["version"].as_u64();
        if version != Some(VERSION) {
            return Err(Error::input(
                "the model spec",
                format!("version {VERSION} (this build of arbor)"),
                version.map_or("no version".into(), |n| format!("version {n}")),
            ));
        }
        let list = |key: &str| v[key].as_array().ok_or_else(|| bad(key, &v[key]));
        let feeds = list("feeds")?
            .iter()
            .map(|f| match f.as_str() {
                Some("words") => Ok(Feed::Words),
                Some("parent_words") => Ok(Feed::ParentWords),
                _ => match f.as_array().map(Vec::as_slice) {
                    Some([name, labels]) if name == "parent_edge" => {
                        labels.as_u64().map(|n| Feed::ParentEdge(n as usize)).ok_or_else(|| bad("feeds", f))
                    }
                    Some([name, width]) if name == "height" => {
                        width.as_u64().map(|n| Feed::Height(n as usize)).ok_or_else(|| bad("feeds", f))
                    }
                    Some([name, width, reduce]) if name == "child_edges" => {
                        let reduce = Reduce::ALL.into_iter().find(|r| reduce.as_str() == Some(r.name()));
                        width
                            .as_u64()
                            .zip(reduce)
                            .map(|(n, r)| Feed::ChildEdges(n as usize, r))
                            .ok_or_else(|| bad("feeds", f))
                    }
                    _ => Err(bad("feeds", f)),
                },
            })
            .collect::<Result<_>>()?;
        let readout = v["readout"].as_str().and_then(Readout::from_name);
        Ok(ModelSpec {
            cells: list("cells")?.iter().map(function_from_json).collect::<Result<_>>()?,
            feeds,
            head: function_from_json(&v["head"])?,
            readout: readout.ok_or_else(|| bad("readout", &v["readout"]))?,
            vocab: usize_at(v, "vocab")?,
            dim: usize_at(v, "dim")?,
            padding: match &v["padding"] {
                Value::Null => None,
                p => Some(p.as_u64().and_then(|p| u32::try_from(p).ok()).ok_or_else(|| bad("padding", p))?),
            },
        })
    }
}

impl<B: Backend> Model<B> {
    /// What builds this model again ([`ModelSpec::build`]).
    pub fn spec(&self) -> ModelSpec {
        ModelSpec {
            cells: self.cells.iter().map(|e| e.function().clone()).collect(),
            feeds: self.feeds.clone(),
            head: self.head.function().clone(),
            readout: self.readout,
            vocab: self.embedding.vocab(),
            dim: self.embedding.dim(),
            padding: self.embedding.padding(),
        }
    }

    /// The model a checkpoint holds, on replicas of `backend`, from the checkpoint alone: built
    /// from its `model_spec` and restored. `dir` is a run folder (its `best/`, else its `last/`)
    /// or a checkpoint folder; a checkpoint with a weight average gives the averaged weights,
    /// the ones training scored.
    pub fn load(dir: &Path, backend: &B) -> Result<Model<B>> {
        let ck = Checkpoint::load(&Checkpoint::scored_dir(dir))?;
        Model::from_checkpoint(&crate::average::Average::scored_weights(&ck), backend)
    }

    /// The model `ck` holds (see [`Model::load`]).
    pub fn from_checkpoint(ck: &Checkpoint, backend: &B) -> Result<Model<B>> {
        let spec =
            match &ck.meta["model_spec"] {
                Value::Null => return Err(Error::input(
                    "the checkpoint's metadata",
                    "a `model_spec` (every checkpoint since arbor 0.1 with issue 43 holds one)",
                    "none: a checkpoint written before models described themselves; rebuild the model and `restore` it",
                )),
                spec => ModelSpec::from_json(spec)?,
            };
        let mut model = spec.build(backend)?;
        model.restore(ck)?;
        Ok(model)
    }
}

fn bad(key: &str, got: &Value) -> Error {
    let mut got = got.to_string();
    got.truncate(80);
    Error::input(format!("the model spec's `{key}`"), "a well-formed value", got)
}

fn usize_at(v: &Value, key: &str) -> Result<usize> {
    v[key].as_u64().and_then(|n| usize::try_from(n).ok()).ok_or_else(|| bad(key, &v[key]))
}

/// A function's declared parts as JSON: its signature, then one entry per value, `[op, operands…,
/// rows, cols, is_param]`.
pub fn function_to_json(f: &VertexFn) -> Value {
    let d = f.declared();
    let port = |p: &Port| json!([p.name, p.value.0, p.shape.rows(), p.shape.cols()]);
    let init = |i: Init| match i {
        Init::Zeros => json!("zeros"),
        Init::Xavier => json!("xavier"),
        Init::Const(c) => json!(["const", c]),
        Init::Uniform(a) => json!(["uniform", a]),
    };
    let op = |op: &Op| -> Value {
        match op {
            Op::Gather { slot, state } => json!(["gather", slot, state]),
            Op::GatherAll { state, reduce: reduce @ Reduce::Weighted { feature }, label: None } => {
                json!([reduce.name(), state, null, feature])
            }
            Op::GatherAll { state, reduce, label: None } => json!([reduce.name(), state]),
            Op::GatherAll { state, reduce, label: Some(l) } => json!([reduce.name(), state, l]),
            Op::Pull { input } => json!(["pull", input]),
            Op::Param { param } => json!(["param", param]),
            Op::MatMul { a, b, ta, tb } => json!(["matmul", a.0, b.0, ta, tb]),
            Op::Unary { op, x } => json!(["unary", op.name(), op.arg(), x.0]),
            Op::Binary { op, a, b } => json!(["binary", op.name(), a.0, b.0]),
            Op::Slice { x, start, len } => json!(["slice", x.0, start, len]),
            Op::Concat { parts } => json!(["concat", parts.iter().map(|p| p.0).collect::<Vec<_>>()]),
            Op::SumCols { x } => json!(["sum_cols", x.0]),
            Op::MaxCols { x } => json!(["max_cols", x.0]),
            Op::BroadcastCols { x, cols } => json!(["broadcast_cols", x.0, cols]),
            Op::GatherSoftmax { query, key, value, slope } => json!(["gather_softmax", query.0, key, value, slope]),
            // Backward-only ops never appear in a forward function.
            other => json!([other.name()]),
        }
    };
    json!({
        "name": d.name, "arity": d.arity, "variadic": d.variadic,
        "params": d.params.iter().map(|p| json!([p.name, p.shape.rows(), p.shape.cols(), init(p.init)])).collect::<Vec<_>>(),
        "states": d.states.iter().map(|s| json!([s.name, s.value.0, s.shape.rows(), s.shape.cols(), s.gathered])).collect::<Vec<_>>(),
        "inputs": d.inputs.iter().map(port).collect::<Vec<_>>(),
        "dropout": d.dropout,
        "outputs": d.outputs.iter().map(port).collect::<Vec<_>>(),
        "values": d.forward.nodes.iter().map(|n| json!([op(&n.op), n.shape.rows(), n.shape.cols(), n.is_param])).collect::<Vec<_>>(),
    })
}

/// The function [`function_to_json`] stored, checked as [`VertexFn::from_declared`] checks it.
pub fn function_from_json(v: &Value) -> Result<VertexFn> {
    let name = v["name"].as_str().ok_or_else(|| bad("name", &v["name"]))?.to_string();
    let field = |key: &str| format!("{name}.{key}");
    let list = |key: &str| v[key].as_array().ok_or_else(|| bad(&field(key), &v[key]));
    let num =
        |x: &Value, key: &str| x.as_u64().and_then(|n| usize::try_from(n).ok()).ok_or_else(|| bad(&field(key), x));
    let text = |x: &Value, key: &str| x.as_str().map(String::from).ok_or_else(|| bad(&field(key), x));
    let float = |x: &Value, key: &str| x.as_f64().map(|f| f as f32).ok_or_else(|| bad(&field(key), x));
    let shape = |e: &[Value], at: usize, key: &str| -> Result<Shape> {
        Ok(Shape::mat(num(&e[at], key)?, num(&e[at + 1], key)?))
    };
    let entry = |x: &Value, len: usize, key: &str| -> Result<Vec<Value>> {
        match x.as_array() {
            Some(e) if e.len() >= len => Ok(e.clone()),
            _ => Err(bad(&field(key), x)),
        }
    };
    let port = |x: &Value| -> Result<Port> {
        let e = entry(x, 4, "ports")?;
        Ok(Port {
            name: text(&e[0], "ports")?,
            value: ValueId(num(&e[1], "ports")? as u32),
            shape: shape(&e, 2, "ports")?,
        })
    };
    let init = |x: &Value| -> Result<Init> {
        Ok(match (x.as_str(), x.as_array().map(Vec::as_slice)) {
            (Some("zeros"), _) => Init::Zeros,
            (Some("xavier"), _) => Init::Xavier,
            (_, Some([kind, a])) if kind == "const" => Init::Const(float(a, "params")?),
            (_, Some([kind, a])) if kind == "uniform" => Init::Uniform(float(a, "params")?),
            _ => return Err(bad(&field("params"), x)),
        })
    };
    let id = |x: &Value| num(x, "values").map(|n| ValueId(n as u32));
    let op = |x: &Value| -> Result<Op> {
        let e = entry(x, 1, "values")?;
        let arg = |k: usize| e.get(k).cloned().unwrap_or(Value::Null);
        let small = |v: Value| -> Result<Option<u32>> {
            match v {
                Value::Null => Ok(None),
                v => Ok(Some(u32::try_from(num(&v, "values")?).map_err(|_| bad(&field("values"), x))?)),
            }
        };
        let weighted = Reduce::Weighted { feature: 0 };
        let reduce = match e[0].as_str() {
            Some(name) if name == weighted.name() => {
                Some(Reduce::Weighted { feature: small(arg(3))?.ok_or_else(|| bad(&field("values"), x))? })
            }
            name => Reduce::ALL.into_iter().find(|r| name == Some(r.name())),
        };
        if let Some(reduce) = reduce {
            return Ok(Op::GatherAll { state: num(&arg(1), "values")?, reduce, label: small(arg(2))? });
        }
        Ok(match e[0].as_str().unwrap_or_default() {
            "gather" => Op::Gather { slot: num(&arg(1), "values")?, state: num(&arg(2), "values")? },
            "pull" => Op::Pull { input: num(&arg(1), "values")? },
            "param" => Op::Param { param: num(&arg(1), "values")? },
            "matmul" => Op::MatMul {
                a: id(&arg(1))?,
                b: id(&arg(2))?,
                ta: arg(3).as_bool().unwrap_or(false),
                tb: arg(4).as_bool().unwrap_or(false),
            },
            "unary" => {
                let op = UnaryOp::from_name(&text(&arg(1), "values")?, float(&arg(2), "values")?);
                Op::Unary { op: op.ok_or_else(|| bad(&field("values"), x))?, x: id(&arg(3))? }
            }
            "binary" => {
                let op = BinaryOp::from_name(&text(&arg(1), "values")?);
                Op::Binary { op: op.ok_or_else(|| bad(&field("values"), x))?, a: id(&arg(2))?, b: id(&arg(3))? }
            }
            "slice" => Op::Slice { x: id(&arg(1))?, start: num(&arg(2), "values")?, len: num(&arg(3), "values")? },
            "concat" => Op::Concat {
                parts: arg(1)
                    .as_array()
                    .ok_or_else(|| bad(&field("values"), x))?
                    .iter()
                    .map(id)
                    .collect::<Result<_>>()?,
            },
            "sum_cols" => Op::SumCols { x: id(&arg(1))? },
            "max_cols" => Op::MaxCols { x: id(&arg(1))? },
            "broadcast_cols" => Op::BroadcastCols { x: id(&arg(1))?, cols: num(&arg(2), "values")? },
            "gather_softmax" => Op::GatherSoftmax {
                query: id(&arg(1))?,
                key: num(&arg(2), "values")?,
                value: num(&arg(3), "values")?,
                slope: float(&arg(4), "values")?,
            },
            _ => return Err(bad(&field("values"), x)),
        })
    };
    let nodes = list("values")?
        .iter()
        .map(|x| {
            let e = entry(x, 4, "values")?;
            Ok(Node { op: op(&e[0])?, shape: shape(&e, 1, "values")?, is_param: e[3].as_bool().unwrap_or(false) })
        })
        .collect::<Result<Vec<_>>>()?;
    let params = list("params")?
        .iter()
        .map(|x| {
            let e = entry(x, 4, "params")?;
            Ok(ParamDecl { name: text(&e[0], "params")?, shape: shape(&e, 1, "params")?, init: init(&e[3])? })
        })
        .collect::<Result<_>>()?;
    let states = list("states")?
        .iter()
        .map(|x| {
            let e = entry(x, 5, "states")?;
            Ok(StateDecl {
                name: text(&e[0], "states")?,
                value: ValueId(num(&e[1], "states")? as u32),
                shape: shape(&e, 2, "states")?,
                gathered: e[4].as_bool().unwrap_or(true),
            })
        })
        .collect::<Result<_>>()?;
    VertexFn::from_declared(Declared {
        arity: num(&v["arity"], "arity")?,
        variadic: v["variadic"].as_bool().ok_or_else(|| bad(&field("variadic"), &v["variadic"]))?,
        forward: Func { nodes },
        params,
        states,
        inputs: list("inputs")?.iter().map(port).collect::<Result<_>>()?,
        dropout: list("dropout")?.iter().map(|x| float(x, "dropout")).collect::<Result<_>>()?,
        outputs: list("outputs")?.iter().map(port).collect::<Result<_>>()?,
        name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every feed and every readout survives the stored form.
    #[test]
    fn feeds_and_readouts_round_trip() {
        let f = crate::nn::tree_lstm(2, 3).expect("a cell");
        let head = crate::head::softmax_classifier(3, 2).expect("a head");
        let feeds = vec![Feed::Words, Feed::ParentWords, Feed::ParentEdge(4), Feed::Height(3)]
            .into_iter()
            .chain(Reduce::ALL.map(|r| Feed::ChildEdges(5, r)))
            .collect::<Vec<_>>();
        for readout in Readout::ALL {
            let spec = ModelSpec {
                cells: vec![f.clone()],
                feeds: feeds.clone(),
                head: head.clone(),
                readout,
                vocab: 7,
                dim: 2,
                padding: Some(0),
            };
            let back = ModelSpec::from_json(&spec.to_json()).expect("reads back");
            assert_eq!((back.feeds, back.readout), (feeds.clone(), readout));
        }
    }
}
