//! A built, checked vertex function with its derived backward function and kernel plans.

use super::autodiff::{self, Backward};
use super::declaration::{Declaration, Declared};
use super::func::{Func, Init, Node, ParamDecl, Port, StateDecl};
use super::op::{Op, ValueId};
use crate::error::{Error, Result};
use crate::fusion::Plan;
use crate::rng::Rng;
use std::fmt;

/// A vertex function F: declared once, checked, differentiated and planned at build time.
///
/// Made by [`Builder::build`](super::Builder::build). It holds the forward IR, the derived
/// backward function F′ and the kernel plans of both; `println!("{f}")` prints them. Its
/// declarations ([`params`](VertexFn::params), [`inputs`](VertexFn::inputs),
/// [`states`](VertexFn::states), [`outputs`](VertexFn::outputs)) say what a caller must feed
/// and what it gets back.
///
/// # Example
///
/// A linear chain cell `h = x·W + h_prev`, run by the reference interpreter over a chain of two
/// vertices:
///
/// ```
/// # use arbor_core as arbor; // as the `arbor` crate re-exports it
/// use arbor::graph::InputGraph;
/// use arbor::ir::{interp, Builder, Init};
/// use arbor::rng::Rng;
///
/// let f = Builder::new("linear", 1);
/// let x = f.pull("x", 2);
/// let h = x.matmul(f.param("W", [2, 2], Init::Xavier)) + f.gather(0, "h", 2);
/// f.scatter("h", h);
/// f.push("h", h);
/// let cell = f.build()?;
/// assert_eq!((cell.name(), cell.arity()), ("linear", 1));
/// assert_eq!(cell.params()[0].name, "W");
/// assert_eq!(cell.init_params(&mut Rng::new(0))[0].len(), 4); // fresh values, by `Init`
/// assert_eq!(cell.flops_per_vertex().0, 2 * 2 * 2 + 2); // one 1×2·2×2 product, one add
///
/// let w = vec![1.0, 0.0, 0.0, 2.0]; // W = diag(1, 2)
/// let x = [1.0, 1.0, 3.0, 3.0]; // vertex 0's row, then vertex 1's
/// let dh = [0.0; 4]; // no gradient flows in here
/// let run = interp::run_graph(&cell, &[w], &InputGraph::chain(2), &[&x], &[&dh]);
/// assert_eq!(run.outputs[0], [1.0, 2.0, 4.0, 8.0]); // h₁ = x₁·W + h₀
/// # Ok::<(), arbor_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct VertexFn {
    decl: Declaration,
    backward: Backward,
    forward_plan: Plan,
    inference_plan: Plan,
    backward_plan: Plan,
}

impl VertexFn {
    /// Derives the backward function of a checked declaration and plans the kernels of both:
    /// each step reads only the finished declaration and what the steps before it produced.
    pub(crate) fn new(decl: Declaration) -> Result<VertexFn> {
        let backward = autodiff::derive(&decl)?;
        Ok(VertexFn {
            forward_plan: Plan::forward(&decl, &backward),
            inference_plan: Plan::inference(&decl),
            backward_plan: Plan::backward(&backward),
            decl,
            backward,
        })
    }

    /// The function's name.
    pub fn name(&self) -> &str {
        &self.decl.name
    }

    /// A function from its declared parts, as [`VertexFn::declared`] gives them back (e.g. read
    /// from a checkpoint): every value is checked against the signature and the ops before it
    /// (a forward function holds no backward-only op), then the backward function is derived
    /// and the kernels planned as [`Builder::build`](super::Builder::build) does. An error names
    /// the function and the value.
    pub fn from_declared(d: Declared) -> Result<VertexFn> {
        let bad = |value: usize, why: String| {
            Error::input(
                format!("vertex function `{}`, value %{value}", d.name),
                "a value the signature and the values before it allow",
                why,
            )
        };
        let mut checked: Vec<Node> = Vec::with_capacity(d.forward.nodes.len());
        for (i, node) in d.forward.nodes.iter().enumerate() {
            let want = match &node.op {
                Op::Pull { input } => d.inputs.get(*input).map(|p| (p.shape.clone(), false)),
                Op::Param { param } => d.params.get(*param).map(|p| (p.shape.clone(), true)),
                Op::Gather { slot, state } if *slot < d.arity => d.states.get(*state).map(|s| (s.shape.clone(), false)),
                Op::GatherAll { state, .. } if d.variadic => d.states.get(*state).map(|s| (s.shape.clone(), false)),
                Op::GatherSoftmax { query, key, value, .. } if d.variadic => {
                    let (q, k, v) = (checked.get(query.index()), d.states.get(*key), d.states.get(*value));
                    match (q, k, v) {
                        (Some(q), Some(k), Some(v))
                            if !q.is_param && q.shape == k.shape && q.shape.rows() == v.shape.rows() =>
                        {
                            Some((v.shape.clone(), false))
                        }
                        _ => None,
                    }
                }
                Op::GatherSoftmaxGrad { .. } => None,
                op if op.is_load() => None,
                op => Some(super::func::infer(op, &checked).map_err(|why| bad(i, why))?),
            };
            match want {
                Some((shape, is_param)) if shape == node.shape && is_param == node.is_param => {
                    checked.push(node.clone())
                }
                Some((shape, _)) => {
                    return Err(bad(
                        i,
                        format!("`{}` of shape {:?} where its inputs make {shape:?}", node.op.name(), node.shape),
                    ))
                }
                None => {
                    return Err(bad(i, format!("`{}`, which this function's signature does not allow", node.op.name())))
                }
            }
        }
        let ports = d
            .states
            .iter()
            .map(|s| (&s.name, &s.shape, s.value))
            .chain(d.inputs.iter().chain(&d.outputs).map(|p| (&p.name, &p.shape, p.value)));
        for (name, shape, value) in ports {
            match checked.get(value.index()) {
                Some(n) if n.shape == *shape && !n.is_param => {}
                _ => return Err(bad(value.index(), format!("port `{name}` of shape {shape:?} naming it"))),
            }
        }
        let decl = Declaration::new(
            d.name, d.arity, d.variadic, d.forward, d.params, d.states, d.inputs, d.dropout, d.outputs,
        )?;
        VertexFn::new(decl)
    }

    /// The function's declared parts (what [`VertexFn::from_declared`] rebuilds it from).
    pub fn declared(&self) -> Declared {
        self.decl.clone()
    }

    /// Number of ordered child slots `gather(k)` may read.
    pub fn arity(&self) -> usize {
        self.decl.arity
    }

    /// The most children a vertex may have: `None` when the function uses `gather_sum`.
    pub fn max_children(&self) -> Option<usize> {
        (!self.decl.variadic).then_some(self.decl.arity)
    }

    /// How many values each edge's feature row must hold at least for the graphs this function
    /// runs on: one past the largest feature `gather_weighted` reads (0 when it reads none).
    pub fn edge_feature_width(&self) -> usize {
        let feature = |n: &Node| match n.op {
            Op::GatherAll { reduce, .. } => reduce.feature().map(|f| f as usize + 1),
            _ => None,
        };
        self.decl.forward.nodes.iter().filter_map(feature).max().unwrap_or(0)
    }

    /// The forward IR.
    pub fn forward(&self) -> &Func {
        &self.decl.forward
    }

    /// The derived backward function.
    pub fn backward(&self) -> &Backward {
        &self.backward
    }

    /// The kernel plan of the forward function.
    pub fn forward_plan(&self) -> &Plan {
        &self.forward_plan
    }

    /// The child slot and state of forward value `value` when it is a child's state that the
    /// forward plan does not copy: the backward function reads it, if at all, only in fused
    /// kernels, which read it by index where the child's state is.
    pub fn read_where_gathered(&self, value: ValueId) -> Option<(usize, usize)> {
        match self.decl.forward.node(value).op {
            Op::Gather { slot, state } if !self.forward_plan.stored[value.index()] => Some((slot, state)),
            _ => None,
        }
    }

    /// The kernel plan of the forward function when no backward pass follows.
    pub fn inference_plan(&self) -> &Plan {
        &self.inference_plan
    }

    /// The kernel plan of the backward function.
    pub fn backward_plan(&self) -> &Plan {
        &self.backward_plan
    }

    /// Declared parameters, in declaration order.
    pub fn params(&self) -> &[ParamDecl] {
        &self.decl.params
    }

    /// Scattered states, in order of first mention.
    pub fn states(&self) -> &[StateDecl] {
        &self.decl.states
    }

    /// The inputs the caller pulls, in declaration order.
    pub fn inputs(&self) -> &[Port] {
        &self.decl.inputs[..self.decl.inputs.len() - self.decl.dropout.len()]
    }

    /// Every pulled input: [`VertexFn::inputs`], then the mask of each dropout site (which the
    /// engine fills; see [`dropout`](crate::dropout)).
    pub fn all_inputs(&self) -> &[Port] {
        &self.decl.inputs
    }

    /// The rate of each dropout site ([`Var::dropout`](super::Var::dropout)), in declaration order.
    pub fn dropout_rates(&self) -> &[f32] {
        &self.decl.dropout
    }

    /// Pushed outputs.
    pub fn outputs(&self) -> &[Port] {
        &self.decl.outputs
    }

    /// Index of the parameter named `name`.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.decl.params.iter().position(|p| p.name == name)
    }

    /// Floating-point operations per vertex: `(forward, backward)`. Matrix products count
    /// `2·m·k·n`, element-wise ops one per element; backward includes the parameter-gradient
    /// products.
    pub fn flops_per_vertex(&self) -> (u64, u64) {
        fn count(func: &super::Func) -> u64 {
            func.nodes
                .iter()
                .map(|n| match n.op {
                    Op::MatMul { a, ta, .. } => {
                        let s = &func.node(a).shape;
                        let k = if ta { s.rows() } else { s.cols() };
                        2 * (n.shape.numel() * k) as u64
                    }
                    ref op if op.is_load() => 0,
                    _ => n.shape.numel() as u64,
                })
                .sum()
        }
        let b = &self.backward;
        let param_grads: u64 = b
            .param_grads
            .iter()
            .map(|g| match *g {
                super::ParamGrad::MatMul { x, dy, .. } => {
                    2 * (b.func.node(x).shape.numel() * b.func.node(dy).shape.cols()) as u64
                }
                super::ParamGrad::SumRows { dy, .. } => b.func.node(dy).shape.numel() as u64,
            })
            .sum();
        (count(&self.decl.forward), count(&b.func) + param_grads)
    }

    /// Fresh parameter values drawn from their initialisers with `rng`, in declaration order.
    pub fn init_params(&self, rng: &mut Rng) -> Vec<Vec<f32>> {
        self.decl
            .params
            .iter()
            .map(|p| {
                let n = p.shape.numel();
                let bound = match p.init {
                    Init::Zeros => return vec![0.0; n],
                    Init::Const(c) => return vec![c; n],
                    Init::Uniform(a) => a,
                    Init::Xavier => (6.0 / (p.shape.rows() + p.shape.cols()) as f32).sqrt(),
                };
                (0..n).map(|_| rng.range(-bound, bound)).collect()
            })
            .collect()
    }
}

impl fmt::Display for VertexFn {
    /// Prints the IR of F and F' and both kernel plans.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "vertex function `{}` (arity {}{})",
            self.decl.name,
            self.decl.arity,
            if self.decl.variadic { ", gather_sum" } else { "" }
        )?;
        let names = self.decl.names();
        for (i, n) in self.decl.forward.nodes.iter().enumerate() {
            let v = ValueId(i as u32);
            let ins: Vec<String> = n.op.inputs().iter().map(ToString::to_string).collect();
            writeln!(f, "  {} ({})", self.decl.forward.describe(v, &names), ins.join(", "))?;
        }
        writeln!(f, "forward plan:\n{}", self.forward_plan)?;
        write!(f, "backward plan:\n{}", self.backward_plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, Builder, UnaryOp};

    fn cell() -> VertexFn {
        let f = Builder::new("cell", 2);
        let x = f.pull("x", 3);
        let h = (x.matmul(f.param("W", [3, 4], Init::Xavier)) + f.gather(0, "h", 4)).tanh().dropout(0.25);
        f.scatter("h", h);
        f.push("h", h.scale(2.0));
        f.build().unwrap()
    }

    #[test]
    fn a_function_rebuilt_from_its_declared_parts_is_the_same() {
        let f = cell();
        let again = VertexFn::from_declared(f.declared()).unwrap();
        assert_eq!(again.declared(), f.declared());
        assert_eq!(format!("{again}"), format!("{f}"));
    }

    #[test]
    fn parts_that_do_not_fit_are_refused_naming_the_value() {
        let f = cell();
        let mut d = f.declared();
        // A product whose inner dimensions no longer meet.
        d.params[0].shape = crate::Shape::mat(5, 4);
        let err = VertexFn::from_declared(d).unwrap_err().to_string();
        assert!(err.contains("vertex function `cell`, value %"), "{err}");
        let mut d = f.declared();
        d.forward.nodes[0].op = Op::Gather { slot: 7, state: 0 };
        assert!(VertexFn::from_declared(d).is_err());
        let mut d = f.declared();
        d.outputs[0].value = ValueId(999);
        assert!(VertexFn::from_declared(d).unwrap_err().to_string().contains("port `h`"));
    }

    #[test]
    fn element_wise_ops_are_found_by_name() {
        for op in [UnaryOp::Tanh, UnaryOp::Scale(0.5), UnaryOp::Offset(-2.0), UnaryOp::Gelu] {
            assert_eq!(UnaryOp::from_name(op.name(), op.arg()), Some(op));
        }
        assert_eq!(BinaryOp::from_name(BinaryOp::SigmoidGrad.name()), Some(BinaryOp::SigmoidGrad));
        assert_eq!((UnaryOp::from_name("nope", 0.0), BinaryOp::from_name("nope")), (None, None));
    }
}
