//! A built vertex function: its signature (parameters, states, inputs, outputs) and its values.

use super::op::{load_ops, Op, ValueId};
use crate::error::ValueDesc;
use crate::tensor::Shape;

/// One value of a function: the op computing it and its shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// What computes the value.
    pub op: Op,
    /// Per-vertex shape (or the parameter's shape).
    pub shape: Shape,
    /// Whether the value is a parameter (shared by all vertices) rather than a per-vertex value.
    pub is_param: bool,
}

/// A list of values in topological order: every op reads only earlier values.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Func {
    /// The values.
    pub nodes: Vec<Node>,
}

impl Func {
    /// The node of a value.
    pub fn node(&self, v: ValueId) -> &Node {
        &self.nodes[v.index()]
    }

    /// Appends a value after checking its op's shapes; returns its id.
    pub fn push(&mut self, op: Op) -> Result<ValueId, String> {
        let (shape, is_param) = infer(&op, &self.nodes)?;
        self.nodes.push(Node { op, shape, is_param });
        Ok(ValueId(self.nodes.len() as u32 - 1))
    }

    /// For every value, the values that read it.
    pub fn users(&self) -> Vec<Vec<ValueId>> {
        let mut users = vec![Vec::new(); self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for x in n.op.inputs() {
                users[x.index()].push(ValueId(i as u32));
            }
        }
        users
    }

    /// A value as error messages and plans show it.
    pub fn describe(&self, v: ValueId, names: &Names<'_>) -> ValueDesc {
        let n = self.node(v);
        let named = |list: &[&str], k: usize, show: &dyn Fn(&str) -> String| list.get(k).map(|s| show(s));
        let op = match n.op {
            Op::Param { param } => names.params.get(param).map(|p| format!("param {}", p.name)),
            Op::Gather { slot, state } => named(&names.states, state, &|s| format!("gather(slot {slot}) of `{s}`")),
            Op::GatherAll { state, reduce, label } => named(&names.states, state, &|s| match label {
                None => format!("{} of `{s}`", reduce.name()),
                Some(l) => format!("{} of `{s}` over edges labelled {l}", reduce.name()),
            }),
            Op::Pull { input } => named(&names.inputs, input, &|s| format!("pull `{s}`")),
            _ => None,
        };
        ValueDesc { id: v.index(), op: op.unwrap_or_else(|| n.op.name()), shape: n.shape.clone() }
    }
}

/// What a value's description names parameters, states and pulled inputs by (each by index).
pub struct Names<'a> {
    /// The parameters.
    pub params: &'a [ParamDecl],
    /// The states' names.
    pub states: Vec<&'a str>,
    /// The pulled inputs' names.
    pub inputs: Vec<&'a str>,
}

impl<'a> Names<'a> {
    /// The names of declared parameters, states and inputs.
    pub fn of(params: &'a [ParamDecl], states: &'a [StateDecl], inputs: &'a [Port]) -> Names<'a> {
        Names {
            params,
            states: states.iter().map(|s| s.name.as_str()).collect(),
            inputs: inputs.iter().map(|p| p.name.as_str()).collect(),
        }
    }
}

/// How a parameter is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// A constant.
    Const(f32),
    /// Uniform in `[-a, a]`.
    Uniform(f32),
    /// Xavier/Glorot uniform: `a = sqrt(6 / (fan_in + fan_out))`.
    Xavier,
}

/// A parameter declared in a vertex function.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamDecl {
    /// Unique name.
    pub name: String,
    /// Shape.
    pub shape: Shape,
    /// Initialiser.
    pub init: Init,
}

/// A state a vertex scatters to its parents (and gathers from its children).
#[derive(Clone, Debug, PartialEq)]
pub struct StateDecl {
    /// Unique name.
    pub name: String,
    /// Per-vertex shape.
    pub shape: Shape,
    /// The value scattered.
    pub value: ValueId,
    /// Whether any vertex gathers it (if not, its gradient is always zero).
    pub gathered: bool,
}

/// A named per-vertex port: a pulled input or a pushed output.
#[derive(Clone, Debug, PartialEq)]
pub struct Port {
    /// Unique name.
    pub name: String,
    /// Per-vertex shape.
    pub shape: Shape,
    /// The value (the pull op for inputs, the pushed value for outputs).
    pub value: ValueId,
}

/// The shape of `op`'s result and whether it is a parameter, or why the inputs do not fit.
pub(crate) fn infer(op: &Op, nodes: &[Node]) -> Result<(Shape, bool), String> {
    let get = |v: ValueId| -> Result<&Node, String> {
        nodes.get(v.index()).ok_or_else(|| format!("value {v} does not exist"))
    };
    match op {
        load_ops!() => Err("loads take their shape from the signature".into()),
        Op::GatherSoftmax { .. } => Err("attention takes its shape from the states".into()),
        Op::GatherSoftmaxGrad { query, .. } => Ok((get(*query)?.shape.clone(), false)),
        Op::MatMul { a, b, ta, tb } => {
            let (a, b) = (get(*a)?, get(*b)?);
            if a.is_param {
                return Err("a parameter can only be the right operand of matmul".into());
            }
            let (ar, ac) = if *ta { (a.shape.cols(), a.shape.rows()) } else { (a.shape.rows(), a.shape.cols()) };
            let (br, bc) = if *tb { (b.shape.cols(), b.shape.rows()) } else { (b.shape.rows(), b.shape.cols()) };
            if ac != br {
                return Err(format!("inner dimensions differ ({ac} vs {br})"));
            }
            Ok((Shape::mat(ar, bc), false))
        }
        Op::Unary { x, .. } => {
            let x = get(*x)?;
            if x.is_param {
                return Err("element-wise ops on parameters alone are not vertex computations".into());
            }
            Ok((x.shape.clone(), false))
        }
        Op::Binary { a, b, .. } => {
            let (a, b) = (get(*a)?, get(*b)?);
            match (a.is_param, b.is_param) {
                (true, true) => Err("element-wise ops on parameters alone are not vertex computations".into()),
                (false, false) if a.shape == b.shape => Ok((a.shape.clone(), false)),
                (false, false) => Err("per-vertex operands must have equal shapes".into()),
                (pa, _) => {
                    let (v, p) = if pa { (b, a) } else { (a, b) };
                    let fits = p.shape == v.shape || (p.shape.rows() == 1 && p.shape.cols() == v.shape.cols());
                    if fits {
                        Ok((v.shape.clone(), false))
                    } else {
                        Err("a parameter operand must have the value's shape or be one row of its width".into())
                    }
                }
            }
        }
        Op::Slice { x, start, len } => {
            let x = get(*x)?;
            if x.is_param {
                return Err("cannot slice a parameter inside a vertex function".into());
            }
            if *len == 0 || start + len > x.shape.cols() {
                return Err(format!("columns {start}..{} outside 0..{}", start + len, x.shape.cols()));
            }
            Ok((Shape::mat(x.shape.rows(), *len), false))
        }
        Op::Concat { parts } => {
            let mut cols = 0;
            let mut rows = None;
            if parts.is_empty() {
                return Err("nothing to concatenate".into());
            }
            for p in parts {
                let p = get(*p)?;
                if p.is_param {
                    return Err("cannot concatenate a parameter".into());
                }
                if *rows.get_or_insert(p.shape.rows()) != p.shape.rows() {
                    return Err("parts have different numbers of rows".into());
                }
                cols += p.shape.cols();
            }
            Ok((Shape::mat(rows.unwrap_or(1), cols), false))
        }
        Op::MaxCols { x } if get(*x)?.shape.cols() == 0 => Err("max_cols of a value without columns".into()),
        Op::SumCols { x } | Op::MaxCols { x } => {
            let x = get(*x)?;
            if x.is_param {
                return Err("cannot reduce a parameter inside a vertex function".into());
            }
            Ok((Shape::mat(x.shape.rows(), 1), false))
        }
        Op::BroadcastCols { x, cols } => {
            let x = get(*x)?;
            if x.is_param {
                return Err("cannot broadcast a parameter inside a vertex function".into());
            }
            if x.shape.cols() != 1 {
                return Err("broadcast_cols takes one column".into());
            }
            Ok((Shape::mat(x.shape.rows(), *cols), false))
        }
    }
}
