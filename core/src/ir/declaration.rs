//! A declared forward function, checked: its IR and its ports, before anything is derived from
//! it. Autodiff and fusion read only this (and each other's results), never a half-built
//! [`VertexFn`](super::VertexFn).

use super::func::{Func, Names, ParamDecl, Port, StateDecl};
use super::op::ValueId;
use crate::error::{Error, Result};

/// A vertex function's declared parts: what [`VertexFn::declared`](super::VertexFn::declared)
/// gives and [`VertexFn::from_declared`](super::VertexFn::from_declared) checks and builds from
/// (to store a function and read it back).
#[derive(Clone, Debug, PartialEq)]
pub struct Declared {
    /// The function's name.
    pub name: String,
    /// Ordered child slots.
    pub arity: usize,
    /// Whether it reads any number of children (`gather_sum`).
    pub variadic: bool,
    /// The forward IR.
    pub forward: Func,
    /// The parameters.
    pub params: Vec<ParamDecl>,
    /// The scattered states.
    pub states: Vec<StateDecl>,
    /// The pulled inputs: the user's, then one dropout mask per site.
    pub inputs: Vec<Port>,
    /// The rate of each dropout site (the last `dropout.len()` inputs are their masks).
    pub dropout: Vec<f32>,
    /// The pushed outputs.
    pub outputs: Vec<Port>,
}

/// F as the builder declared it, checked: every value feeds a state or an output.
pub(crate) type Declaration = Declared;

impl Declared {
    /// Checks that the function scatters or pushes something and that every value it computes
    /// is used on the way there.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        name: String,
        arity: usize,
        variadic: bool,
        forward: Func,
        params: Vec<ParamDecl>,
        states: Vec<StateDecl>,
        inputs: Vec<Port>,
        dropout: Vec<f32>,
        outputs: Vec<Port>,
    ) -> Result<Declaration> {
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
            let value = forward.describe(ValueId(i as u32), &Names::of(&params, &states, &inputs));
            return Err(if users[i].is_empty() {
                Error::Unused { at: None, function: name, value }
            } else {
                Error::Dead { at: None, function: name, value }
            });
        }
        Ok(Declared { name, arity, variadic, forward, params, states, inputs, dropout, outputs })
    }

    /// The names of the function's parameters, states and inputs, for describing values.
    pub fn names(&self) -> Names<'_> {
        Names::of(&self.params, &self.states, &self.inputs)
    }
}
