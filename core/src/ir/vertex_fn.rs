//! A built, checked vertex function with its derived backward function and kernel plans.

use super::autodiff::{self, Backward};
use super::func::{Func, Init, ParamDecl, Port, StateDecl};
use super::op::{Op, ValueId};
use crate::error::{Error, Result};
use crate::fusion::Plan;
use crate::rng::Rng;
use std::fmt;

/// A vertex function F: declared once, checked, differentiated and planned at build time.
#[derive(Clone, Debug)]
pub struct VertexFn {
    name: String,
    arity: usize,
    variadic: bool,
    forward: Func,
    params: Vec<ParamDecl>,
    states: Vec<StateDecl>,
    inputs: Vec<Port>,
    outputs: Vec<Port>,
    backward: Backward,
    forward_plan: Plan,
    inference_plan: Plan,
    backward_plan: Plan,
}

impl VertexFn {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        name: String,
        arity: usize,
        variadic: bool,
        forward: Func,
        params: Vec<ParamDecl>,
        states: Vec<StateDecl>,
        inputs: Vec<Port>,
        outputs: Vec<Port>,
    ) -> Result<VertexFn> {
        let roots: Vec<ValueId> = states.iter().map(|s| s.value).chain(outputs.iter().map(|o| o.value)).collect();
        if roots.is_empty() {
            return Err(Error::NoOutput { function: name });
        }
        let users = forward.users();
        let mut is_root = vec![false; forward.nodes.len()];
        for r in &roots {
            is_root[r.index()] = true;
        }
        // Values are topologically ordered, so one reverse sweep finds everything the roots use.
        let mut live = is_root;
        for i in (0..forward.nodes.len()).rev() {
            if live[i] {
                for x in forward.nodes[i].op.inputs() {
                    live[x.index()] = true;
                }
            }
        }
        if let Some(i) = live.iter().position(|l| !l) {
            let value = forward.describe(ValueId(i as u32), &params);
            return Err(if users[i].is_empty() {
                Error::Unused { function: name, value }
            } else {
                Error::Dead { function: name, value }
            });
        }
        let mut f = VertexFn {
            name,
            arity,
            variadic,
            forward,
            params,
            states,
            inputs,
            outputs,
            backward: Backward::default(),
            forward_plan: Plan::default(),
            inference_plan: Plan::default(),
            backward_plan: Plan::default(),
        };
        f.backward = autodiff::derive(&f)?;
        f.forward_plan = Plan::forward(&f);
        f.inference_plan = Plan::inference(&f);
        f.backward_plan = Plan::backward(&f);
        Ok(f)
    }

    /// The function's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of ordered child slots `gather(k)` may read.
    pub fn arity(&self) -> usize {
        self.arity
    }

    /// The most children a vertex may have: `None` when the function uses `gather_sum`.
    pub fn max_children(&self) -> Option<usize> {
        (!self.variadic).then_some(self.arity)
    }

    /// The forward IR.
    pub fn forward(&self) -> &Func {
        &self.forward
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
        &self.params
    }

    /// Scattered states, in order of first mention.
    pub fn states(&self) -> &[StateDecl] {
        &self.states
    }

    /// Pulled inputs.
    pub fn inputs(&self) -> &[Port] {
        &self.inputs
    }

    /// Pushed outputs.
    pub fn outputs(&self) -> &[Port] {
        &self.outputs
    }

    /// Index of the parameter named `name`.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|p| p.name == name)
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
        (count(&self.forward), count(&b.func) + param_grads)
    }

    /// Fresh parameter values drawn from their initialisers with `rng`, in declaration order.
    pub fn init_params(&self, rng: &mut Rng) -> Vec<Vec<f32>> {
        self.params
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
            self.name,
            self.arity,
            if self.variadic { ", gather_sum" } else { "" }
        )?;
        for (i, n) in self.forward.nodes.iter().enumerate() {
            let v = ValueId(i as u32);
            let ins: Vec<String> = n.op.inputs().iter().map(ToString::to_string).collect();
            writeln!(f, "  {} ({})", self.forward.describe(v, &self.params), ins.join(", "))?;
        }
        writeln!(f, "forward plan:\n{}", self.forward_plan)?;
        write!(f, "backward plan:\n{}", self.backward_plan)
    }
}
