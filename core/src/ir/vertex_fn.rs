//! A built, checked vertex function with its derived backward function and kernel plans.

use super::autodiff::{self, Backward};
use super::declaration::Declaration;
use super::func::{Func, Init, ParamDecl, Port, StateDecl};
use super::op::{Op, ValueId};
use crate::error::Result;
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
/// use arbor_core::graph::InputGraph;
/// use arbor_core::ir::{interp, Builder, Init};
/// use arbor_core::rng::Rng;
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

    /// Number of ordered child slots `gather(k)` may read.
    pub fn arity(&self) -> usize {
        self.decl.arity
    }

    /// The most children a vertex may have: `None` when the function uses `gather_sum`.
    pub fn max_children(&self) -> Option<usize> {
        (!self.decl.variadic).then_some(self.decl.arity)
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
