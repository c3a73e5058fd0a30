//! The builder a user declares a vertex function with.
//!
//! ```
//! # use arbor_core as arbor; // as the `arbor` crate re-exports it
//! use arbor::ir::{Builder, Init};
//! let f = Builder::new("rnn-cell", 1);
//! let x = f.pull("x", 4);
//! let h = f.gather(0, "h", 3);
//! let w = f.param("W", [4, 3], Init::Xavier);
//! let u = f.param("U", [3, 3], Init::Xavier);
//! let b = f.param("b", [1, 3], Init::Zeros);
//! let h_new = (x.matmul(w) + h.matmul(u) + b).tanh();
//! f.scatter("h", h_new);
//! f.push("h", h_new);
//! let cell = f.build().unwrap();
//! assert_eq!(cell.params().len(), 3);
//! ```

use super::declaration::Declaration;
use super::func::{Func, Init, Names, Node, ParamDecl, Port, StateDecl};
use super::op::{BinaryOp, Op, Reduce, UnaryOp, ValueId};
use super::vertex_fn::VertexFn;
use crate::error::{Error, Result, ValueDesc};
use crate::tensor::Shape;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ops;
use std::panic::Location;

/// A state as the builder knows it before `build`.
struct PendingState {
    name: String,
    shape: Shape,
    value: Option<ValueId>,
    gathered: bool,
}

#[derive(Default)]
struct Inner {
    func: Func,
    params: Vec<ParamDecl>,
    states: Vec<PendingState>,
    inputs: Vec<Port>,
    /// Dropout sites: each one's mask input (pulled as `MASK_BASE + site` until the build
    /// numbers it after the user's inputs) and its rate.
    masks: Vec<(Port, f32)>,
    outputs: Vec<Port>,
    /// Gathers made so far, by slot (`None`: all children, combined by the reduction, of one
    /// edge label when given) and state.
    gathers: HashMap<(Option<usize>, Reduce, Option<u32>, usize), ValueId>,
    variadic: bool,
    error: Option<Error>,
    /// Where the user's code made each value of `func` (as its nodes), for errors found later.
    made_at: Vec<&'static Location<'static>>,
}

impl Inner {
    /// The names of what has been declared so far, for describing values.
    fn names(&self) -> Names<'_> {
        Names {
            params: &self.params,
            states: self.states.iter().map(|s| s.name.as_str()).collect(),
            inputs: self.inputs.iter().map(|p| p.name.as_str()).collect(),
        }
    }
}

/// Where dropout masks are numbered while the function is declared: pulled input
/// `MASK_BASE + k` is site `k`'s mask.
const MASK_BASE: usize = usize::MAX / 2;

/// Declares a vertex function op by op. Methods take `&self`, so calls nest freely; the first
/// mistake is remembered and returned by [`Builder::build`].
///
/// # Example
///
/// A cell for vertices with any number of children (it sums their states with
/// [`Builder::gather_sum`]), and a shape mistake that `build` reports:
///
/// ```
/// # use arbor_core as arbor; // as the `arbor` crate re-exports it
/// use arbor::ir::{Builder, Init};
/// use arbor::Error;
///
/// let f = Builder::new("sum-cell", 0);
/// let x = f.pull("x", 2); // this vertex's input row, 2 wide
/// let children = f.gather_sum("h", 3); // Σ of the children's `h`; zeros at a leaf
/// let w = f.param("W", [2, 3], Init::Xavier);
/// let h = (x.matmul(w) + children).tanh();
/// f.scatter("h", h); // for the parent
/// f.push("h", h); // for the loss
/// let cell = f.build()?;
/// assert_eq!(cell.max_children(), None); // any number of children
/// assert_eq!((cell.inputs().len(), cell.states().len(), cell.outputs().len()), (1, 1, 1));
///
/// // The first mistake is kept and returned by `build`, with the line that made it.
/// let f = Builder::new("bad", 1);
/// let x = f.pull("x", 2);
/// let w = f.param("W", [3, 3], Init::Xavier); // should be [2, 3]
/// f.push("h", x.matmul(w));
/// let err = f.build().unwrap_err();
/// assert!(matches!(&err, Error::Shape { at: Some(_), op, .. } if op.as_str() == "matmul"));
/// # Ok::<(), arbor_core::Error>(())
/// ```
pub struct Builder {
    name: String,
    arity: usize,
    inner: RefCell<Inner>,
}

/// A value under construction: a handle into its [`Builder`].
///
/// A `Var` holds one row per vertex (its [`shape`](Var::shape) is the per-vertex shape), or is
/// a parameter shared by every vertex. It is `Copy`; ops combine values of the same builder and
/// are differentiated by [`Builder::build`]. Arithmetic works between values (a parameter
/// broadcasts over vertices, a one-row parameter over rows) and with `f32` constants.
///
/// # Example
///
/// A GRU-style update, checking shapes as it goes:
///
/// ```
/// # use arbor_core as arbor; // as the `arbor` crate re-exports it
/// use arbor::ir::{Builder, Init};
/// use arbor::Shape;
///
/// let f = Builder::new("gru-ish", 1);
/// let (x, h) = (f.pull("x", 3), f.gather(0, "h", 4));
/// let w = f.param("W", [3, 8], Init::Xavier);
/// let b = f.param("b", [1, 8], Init::Zeros);
/// let gates = (x.matmul(w) + b).sigmoid();
/// assert_eq!(gates.shape(), Shape::mat(1, 8));
/// let (z, r) = (gates.slice(0, 4), gates.slice(4, 4));
/// let h_new = z * h + (1.0 - z) * (r * h).tanh(); // constants work on either side
/// f.scatter("h", h_new);
/// let p = h_new.concat(x).softmax(); // a row of 7 probabilities
/// assert_eq!(p.shape(), Shape::from(7));
/// f.push("p", p);
/// assert!(f.build().is_ok());
/// ```
#[derive(Clone, Copy)]
pub struct Var<'b> {
    b: &'b Builder,
    id: ValueId,
}

/// Where the user's code called the builder (through `#[track_caller]` methods).
#[track_caller]
fn caller() -> Option<String> {
    Some(place(Location::caller()))
}

/// A place in the user's code as errors print it: `file:line:column`.
fn place(at: &Location<'_>) -> String {
    format!("{}:{}:{}", at.file(), at.line(), at.column())
}

impl Builder {
    /// A new function named `name` whose vertices have up to `arity` ordered child slots
    /// (`gather(k)` needs `k < arity`; `gather_sum` takes any number of children).
    pub fn new(name: impl Into<String>, arity: usize) -> Builder {
        Builder { name: name.into(), arity, inner: RefCell::new(Inner::default()) }
    }

    fn fail(&self, e: Error) {
        let mut inner = self.inner.borrow_mut();
        if inner.error.is_none() {
            inner.error = Some(e);
        }
    }

    #[track_caller]
    fn load(&self, op: Op, shape: Shape, is_param: bool) -> ValueId {
        let mut inner = self.inner.borrow_mut();
        inner.func.nodes.push(Node { op, shape, is_param });
        inner.made_at.push(Location::caller());
        ValueId(inner.func.nodes.len() as u32 - 1)
    }

    /// Records an [`Error::Shape`] at the user's line: `op` cannot take `values`, for `reason`.
    /// Returns the first value's shape (for a placeholder to continue with).
    #[track_caller]
    fn fail_shape(&self, op: String, values: &[ValueId], reason: String) -> Shape {
        let inputs: Vec<ValueDesc> = {
            let inner = self.inner.borrow();
            let names = inner.names();
            values.iter().map(|&v| inner.func.describe(v, &names)).collect()
        };
        let shape = inputs.first().map(|d| d.shape.clone()).unwrap_or_default();
        self.fail(Error::Shape { at: caller(), function: self.name.clone(), op, inputs, reason });
        shape
    }

    /// Adds a computed op, recording a shape error (and continuing with a placeholder) if it fails.
    #[track_caller]
    fn op(&self, op: Op) -> Var<'_> {
        let pushed = self.inner.borrow_mut().func.push(op.clone());
        let id = match pushed {
            Ok(id) => {
                self.inner.borrow_mut().made_at.push(Location::caller());
                id
            }
            Err(reason) => {
                let shape = self.fail_shape(op.name(), &op.inputs(), reason);
                self.load(op, shape, false)
            }
        };
        Var { b: self, id }
    }

    fn state_index(&self, name: &str, shape: &Shape) -> usize {
        let mut inner = self.inner.borrow_mut();
        if let Some(i) = inner.states.iter().position(|s| s.name == name) {
            return i;
        }
        inner.states.push(PendingState { name: name.into(), shape: shape.clone(), value: None, gathered: false });
        inner.states.len() - 1
    }

    #[track_caller]
    fn gather_op(&self, slot: Option<usize>, reduce: Reduce, label: Option<u32>, state: &str, shape: Shape) -> Var<'_> {
        let s = self.gathered(state, &shape);
        if let Some(&id) = self.inner.borrow().gathers.get(&(slot, reduce, label, s)) {
            return Var { b: self, id };
        }
        let op = match slot {
            Some(slot) => Op::Gather { slot, state: s },
            None => Op::GatherAll { state: s, reduce, label },
        };
        let id = self.load(op, shape, false);
        self.inner.borrow_mut().gathers.insert((slot, reduce, label, s), id);
        Var { b: self, id }
    }

    /// The index of state `state`, read by parents as `shape` (recorded as gathered; a shape
    /// that differs from how it is scattered or read elsewhere is an error).
    #[track_caller]
    fn gathered(&self, state: &str, shape: &Shape) -> usize {
        let s = self.state_index(state, shape);
        let (known, scattered) = {
            let mut inner = self.inner.borrow_mut();
            let st = &mut inner.states[s];
            st.gathered = true;
            (st.shape.clone(), st.value.is_some())
        };
        if known != *shape && scattered {
            self.fail(Error::StateShape {
                at: caller(),
                function: self.name.clone(),
                state: state.into(),
                gathered: shape.clone(),
                scattered: known,
            });
        } else if known != *shape {
            self.fail(Error::Shape {
                at: caller(),
                function: self.name.clone(),
                op: format!("gather of state `{state}`"),
                inputs: vec![],
                reason: format!("it is gathered as {shape} here but as {known} elsewhere"),
            });
        }
        s
    }

    /// The state `state` (of per-vertex shape `shape`) scattered by the child in slot `slot`;
    /// zeros when the vertex has no child there.
    #[track_caller]
    pub fn gather(&self, slot: usize, state: &str, shape: impl Into<Shape>) -> Var<'_> {
        if slot >= self.arity {
            let (function, state, arity) = (self.name.clone(), state.into(), self.arity);
            self.fail(Error::GatherSlot { at: caller(), function, slot, state, arity });
        }
        self.gather_op(Some(slot), Reduce::Sum, None, state, shape.into())
    }

    /// The sum over all children of the state `state` they scattered; zeros for a leaf.
    #[track_caller]
    pub fn gather_sum(&self, state: &str, shape: impl Into<Shape>) -> Var<'_> {
        self.gather_all(Reduce::Sum, state, shape)
    }

    /// The mean over all children of the state `state` they scattered (the sum divided by
    /// their number, as GraphSAGE's mean aggregator); zeros for a leaf.
    #[track_caller]
    pub fn gather_mean(&self, state: &str, shape: impl Into<Shape>) -> Var<'_> {
        self.gather_all(Reduce::Mean, state, shape)
    }

    /// The largest, element by element, of the state `state` over all children (max pooling
    /// over neighbours); zeros for a leaf. In each column the gradient goes to the first child
    /// (in slot order) holding the largest value.
    #[track_caller]
    pub fn gather_max(&self, state: &str, shape: impl Into<Shape>) -> Var<'_> {
        self.gather_all(Reduce::Max, state, shape)
    }

    /// The sum over all children of the state `state` they scattered, each times value
    /// `feature` of its edge's feature row ([`InputGraph::with_edge_features`](crate::graph::InputGraph::with_edge_features):
    /// a bond length, a distance expanded in radial functions, a relation's one-hot row); zeros
    /// for a leaf. A message that depends on the edge through a matrix of its own per feature,
    /// `Σ_f Θ_f · Σ_j e_jf·h_j` (an edge-conditioned convolution whose edge network is linear),
    /// is one `gather_weighted` per feature, each times its `Θ_f`. The graphs run must carry
    /// more than `feature` values per edge; the values are data (no gradient reaches them).
    ///
    /// # Example
    ///
    /// An edge-conditioned sum over two edge features, each through a matrix of its own, checked
    /// against finite differences on a vertex whose three children's edges carry random rows:
    ///
    /// ```
    /// # use arbor_core as arbor; // as the `arbor` crate re-exports it
    /// use arbor::ir::{Builder, Init};
    /// use arbor::testing::{check_vertex, VertexCase};
    ///
    /// let f = Builder::new("edge-conditioned", 0);
    /// let x = f.pull("x", 3);
    /// let mut h = x.matmul(f.param("V", [3, 4], Init::Xavier));
    /// for feature in 0..2 {
    ///     let theta = f.param(&format!("T{feature}"), [4, 4], Init::Xavier);
    ///     h = h + f.gather_weighted(feature, "h", 4).matmul(theta);
    /// }
    /// f.scatter("h", h.tanh());
    /// let cell = f.build()?;
    /// assert_eq!(cell.edge_feature_width(), 2); // the graphs' edges carry 2 values or more
    /// let case = VertexCase::random(&cell, 7, &[true, true, true]);
    /// assert!(check_vertex(&cell, &case).is_ok());
    /// # Ok::<(), arbor_core::Error>(())
    /// ```
    #[track_caller]
    pub fn gather_weighted(&self, feature: u32, state: &str, shape: impl Into<Shape>) -> Var<'_> {
        self.gather_all(Reduce::Weighted { feature }, state, shape)
    }

    /// Attention over all children (graph attention, attentive Tree-LSTMs): each child's state
    /// `key` is scored against `query` (this vertex's value, so it may read the vertex's pulled
    /// input or, in an unrolled graph, its own previous state), the scores are normalized over
    /// the vertex's actual children by a softmax (shifted by their largest, so no score
    /// overflows), and the children's state `value` (per-vertex shape `value_shape`) is summed
    /// with those weights; zeros for a leaf. Each row of `query` is a head: `query` is
    /// `[heads × d]`, `key` `[heads × d]`, `value_shape` `[heads × m]`, the result `[heads × m]`.
    /// The scores are the dot products `query·key`; see [`gather_softmax_leaky`](Builder::gather_softmax_leaky)
    /// for GAT's.
    #[track_caller]
    pub fn gather_softmax<'a>(
        &'a self,
        query: Var<'a>,
        key: &str,
        value: &str,
        value_shape: impl Into<Shape>,
    ) -> Var<'a> {
        self.gather_softmax_leaky(query, key, value, value_shape, 1.0)
    }

    /// [`gather_softmax`](Builder::gather_softmax) with each score passed through a leaky ReLU of
    /// `slope` (negative scores times `slope`) before the softmax, as graph attention networks
    /// score (`slope` 0.2, with `query = [1, a_l·Wh_i]` and `key = [a_r·Wh_j, 1]`).
    #[track_caller]
    pub fn gather_softmax_leaky<'a>(
        &'a self,
        query: Var<'a>,
        key: &str,
        value: &str,
        value_shape: impl Into<Shape>,
        slope: f32,
    ) -> Var<'a> {
        let (q, value_shape) = (query.shape(), value_shape.into());
        if self.inner.borrow().func.node(query.id).is_param || q.rows() != value_shape.rows() {
            let reason = format!("the query must be a per-vertex value with as many rows as the value ({value_shape})");
            let shape = self.fail_shape("gather_softmax".into(), &[query.id], reason);
            return Var { b: self, id: self.load(Op::Zeros, shape, false) };
        }
        self.inner.borrow_mut().variadic = true;
        let (key, value) = (self.gathered(key, &q), self.gathered(value, &value_shape));
        let id = self.load(Op::GatherSoftmax { query: query.id, key, value, slope }, value_shape, false);
        Var { b: self, id }
    }

    /// The state `state` of every child combined by `reduce` ([`gather_sum`](Builder::gather_sum),
    /// [`gather_mean`](Builder::gather_mean), [`gather_max`](Builder::gather_max),
    /// [`gather_weighted`](Builder::gather_weighted)).
    #[track_caller]
    pub fn gather_all(&self, reduce: Reduce, state: &str, shape: impl Into<Shape>) -> Var<'_> {
        self.inner.borrow_mut().variadic = true;
        self.gather_op(None, reduce, None, state, shape.into())
    }

    /// [`gather_all`](Builder::gather_all) over only the children whose edge carries `label`
    /// ([`InputGraph::with_edge_labels`](crate::graph::InputGraph::with_edge_labels)): a bond
    /// type, a dependency relation. Summing each label's children through a matrix of its own
    /// gives a weight per edge type (R-GCN). Zeros where there is no such child; in a graph
    /// without labels every edge carries label 0.
    #[track_caller]
    pub fn gather_labelled(&self, reduce: Reduce, label: u32, state: &str, shape: impl Into<Shape>) -> Var<'_> {
        let shape = shape.into();
        if reduce.feature().is_some() {
            let reason = "children are weighted by an edge feature over all of them (`gather_weighted`), not by label"
                .to_string();
            self.fail_shape(format!("gather_labelled(label {label}, {})", reduce.name()), &[], reason);
        }
        self.inner.borrow_mut().variadic = true;
        self.gather_op(None, reduce, Some(label), state, shape)
    }

    /// This vertex's row of the external input `name`, computed by the input layer.
    #[track_caller]
    pub fn pull(&self, name: &str, shape: impl Into<Shape>) -> Var<'_> {
        let shape = shape.into();
        let input = {
            let inner = self.inner.borrow();
            if inner.inputs.iter().any(|p| p.name == name) {
                drop(inner);
                self.fail(Error::Duplicate { function: self.name.clone(), kind: "input", name: name.into() });
            }
            self.inner.borrow().inputs.len()
        };
        let id = self.load(Op::Pull { input }, shape.clone(), false);
        self.inner.borrow_mut().inputs.push(Port { name: name.into(), shape, value: id });
        Var { b: self, id }
    }

    /// A parameter shared by every vertex.
    #[track_caller]
    pub fn param(&self, name: &str, shape: impl Into<Shape>, init: Init) -> Var<'_> {
        let shape = shape.into();
        if self.inner.borrow().params.iter().any(|p| p.name == name) {
            self.fail(Error::Duplicate { function: self.name.clone(), kind: "param", name: name.into() });
        }
        let param = self.inner.borrow().params.len();
        self.inner.borrow_mut().params.push(ParamDecl { name: name.into(), shape: shape.clone(), init });
        let id = self.load(Op::Param { param }, shape, true);
        Var { b: self, id }
    }

    /// Records an error if `value` is a parameter: only per-vertex values leave a vertex.
    #[track_caller]
    fn check_per_vertex(&self, what: &str, name: &str, value: Var<'_>) {
        if self.inner.borrow().func.node(value.id).is_param {
            let reason = "a parameter is not a per-vertex value".into();
            self.fail_shape(format!("{what} `{name}`"), &[value.id], reason);
        }
    }

    /// Publishes `value` as this vertex's state `name`, for its parents to gather.
    #[track_caller]
    pub fn scatter(&self, name: &str, value: Var<'_>) {
        self.check_per_vertex("scatter", name, value);
        let shape = self.inner.borrow().func.node(value.id).shape.clone();
        let s = self.state_index(name, &shape);
        let (known, already) = {
            let inner = self.inner.borrow();
            (inner.states[s].shape.clone(), inner.states[s].value.is_some())
        };
        if already {
            self.fail(Error::Duplicate { function: self.name.clone(), kind: "scattered state", name: name.into() });
        } else if known != shape {
            self.fail(Error::StateShape {
                at: caller(),
                function: self.name.clone(),
                state: name.into(),
                gathered: known,
                scattered: shape,
            });
        }
        self.inner.borrow_mut().states[s].value = Some(value.id);
    }

    /// Emits `value` as this vertex's output `name`, for the output layer.
    #[track_caller]
    pub fn push(&self, name: &str, value: Var<'_>) {
        self.check_per_vertex("push", name, value);
        let mut inner = self.inner.borrow_mut();
        if inner.outputs.iter().any(|p| p.name == name) {
            drop(inner);
            self.fail(Error::Duplicate { function: self.name.clone(), kind: "output", name: name.into() });
            return;
        }
        let shape = inner.func.node(value.id).shape.clone();
        inner.outputs.push(Port { name: name.into(), shape, value: value.id });
    }

    /// The parts side by side, column-wise.
    #[track_caller]
    pub fn concat(&self, parts: &[Var<'_>]) -> Var<'_> {
        self.op(Op::Concat { parts: parts.iter().map(|p| p.id).collect() })
    }

    /// Checks the function once (shapes, slots, states, unused and dead values), derives its
    /// backward function and plans its kernels.
    pub fn build(self) -> Result<VertexFn> {
        let inner = self.inner.into_inner();
        if let Some(e) = inner.error {
            return Err(e);
        }
        let mut states = Vec::with_capacity(inner.states.len());
        for s in inner.states {
            let Some(value) = s.value else {
                return Err(Error::NotScattered { function: self.name, state: s.name });
            };
            states.push(StateDecl { name: s.name, shape: s.shape, value, gathered: s.gathered });
        }
        // Masks are pulled after the user's inputs.
        let mut func = inner.func;
        let mut inputs = inner.inputs;
        for node in &mut func.nodes {
            if let Op::Pull { input } = &mut node.op {
                if *input >= MASK_BASE {
                    *input = *input - MASK_BASE + inputs.len();
                }
            }
        }
        let rates = inner.masks.iter().map(|(_, p)| *p).collect();
        inputs.extend(inner.masks.into_iter().map(|(port, _)| port));
        let made_at = inner.made_at;
        // An unused or dead value is named with the line of the user's code that made it.
        let at = |value: &ValueDesc| made_at.get(value.id).map(|l| place(l));
        let declared = Declaration::new(
            self.name,
            self.arity,
            inner.variadic,
            func,
            inner.params,
            states,
            inputs,
            rates,
            inner.outputs,
        )
        .map_err(|e| match e {
            Error::Unused { function, value, .. } => Error::Unused { at: at(&value), function, value },
            Error::Dead { function, value, .. } => Error::Dead { at: at(&value), function, value },
            e => e,
        })?;
        VertexFn::new(declared)
    }
}

impl<'b> Var<'b> {
    /// The value's id in its function.
    pub fn id(self) -> ValueId {
        self.id
    }

    /// The value's per-vertex shape (or the parameter's shape).
    pub fn shape(self) -> Shape {
        self.b.inner.borrow().func.node(self.id).shape.clone()
    }

    #[track_caller]
    fn unary(self, op: UnaryOp) -> Var<'b> {
        self.b.op(Op::Unary { op, x: self.id })
    }

    #[track_caller]
    fn binary(self, op: BinaryOp, rhs: Var<'b>) -> Var<'b> {
        self.b.op(Op::Binary { op, a: self.id, b: rhs.id })
    }

    /// `self · rhs`; `rhs` may be a parameter.
    #[track_caller]
    pub fn matmul(self, rhs: Var<'b>) -> Var<'b> {
        self.b.op(Op::MatMul { a: self.id, b: rhs.id, ta: false, tb: false })
    }

    /// Element-wise logistic sigmoid.
    #[track_caller]
    pub fn sigmoid(self) -> Var<'b> {
        self.unary(UnaryOp::Sigmoid)
    }

    /// Element-wise tanh.
    #[track_caller]
    pub fn tanh(self) -> Var<'b> {
        self.unary(UnaryOp::Tanh)
    }

    /// Element-wise `max(x, 0)`.
    #[track_caller]
    pub fn relu(self) -> Var<'b> {
        self.unary(UnaryOp::Relu)
    }

    /// Element-wise `e^x`.
    #[track_caller]
    pub fn exp(self) -> Var<'b> {
        self.unary(UnaryOp::Exp)
    }

    /// Element-wise natural logarithm.
    #[track_caller]
    pub fn log(self) -> Var<'b> {
        self.unary(UnaryOp::Log)
    }

    /// `gelu(self)`: `x·Φ(x)` in the tanh form of Hendrycks and Gimpel, element-wise.
    #[track_caller]
    pub fn gelu(self) -> Var<'b> {
        self.unary(UnaryOp::Gelu)
    }

    /// Dropout at rate `p`: in training, each element is zeroed with probability `p` and the
    /// rest scaled by `1 / (1 − p)`; in inference, the identity. The masks are drawn per vertex
    /// and column from the pass's [`DropoutKey`](crate::dropout::DropoutKey), the same however
    /// the minibatch is batched and on every backend; no gradient flows through them. `p = 0`
    /// returns `self`; a `p` outside `[0, 1)` is an error at [`Builder::build`].
    #[track_caller]
    pub fn dropout(self, p: f32) -> Var<'b> {
        let b = self.b;
        if p == 0.0 {
            return self;
        }
        if !(0.0..1.0).contains(&p) {
            b.fail_shape(format!("dropout({p})"), &[self.id], "the rate must be in [0, 1)".into());
            return self;
        }
        let shape = self.shape();
        let site = b.inner.borrow().masks.len();
        let id = b.load(Op::Pull { input: MASK_BASE + site }, shape.clone(), false);
        let port = Port { name: format!("#dropout{site}"), shape, value: id };
        b.inner.borrow_mut().masks.push((port, p));
        self * Var { b, id }
    }

    /// `s · x`.
    #[track_caller]
    pub fn scale(self, s: f32) -> Var<'b> {
        self.unary(UnaryOp::Scale(s))
    }

    /// Columns `start..start + len`.
    #[track_caller]
    pub fn slice(self, start: usize, len: usize) -> Var<'b> {
        self.b.op(Op::Slice { x: self.id, start, len })
    }

    /// The sum of each row: `[r × c] → [r × 1]`.
    #[track_caller]
    pub fn sum_cols(self) -> Var<'b> {
        self.b.op(Op::SumCols { x: self.id })
    }

    /// Element-wise `|x|`.
    #[track_caller]
    pub fn abs(self) -> Var<'b> {
        self.unary(UnaryOp::Abs)
    }

    /// The value as it is, **without a gradient**: autodiff treats it as a constant, so nothing
    /// flows back through it to what it was computed from (a stop-gradient, PyTorch's
    /// `detach`). `x * x.detach()` has the gradient `x`, not `2x`.
    #[track_caller]
    pub fn detach(self) -> Var<'b> {
        self.unary(UnaryOp::Detach)
    }

    /// `x + c` for a constant `c` (not trained); also written `self + c`, and `c - self` for
    /// `1 − z` and the like.
    #[track_caller]
    pub fn offset(self, c: f32) -> Var<'b> {
        self.unary(UnaryOp::Offset(c))
    }

    /// A one-column value repeated to `cols` columns: `[r × 1] → [r × cols]`, e.g. a scalar gate
    /// scaling a row.
    #[track_caller]
    pub fn broadcast_cols(self, cols: usize) -> Var<'b> {
        self.b.op(Op::BroadcastCols { x: self.id, cols })
    }

    /// The largest value of each row, `[r × c] → [r × 1]`, **without a gradient** (autodiff
    /// treats it as a constant): for shifting a softmax or a log-sum-exp, whose values the shift
    /// does not change. Not a max pooling.
    #[track_caller]
    pub fn detached_max_cols(self) -> Var<'b> {
        self.b.op(Op::MaxCols { x: self.id })
    }

    /// `self` and `rhs` side by side, column-wise (see [`Builder::concat`] for more parts).
    #[track_caller]
    pub fn concat(self, rhs: Var<'b>) -> Var<'b> {
        self.b.concat(&[self, rhs])
    }

    /// The log-softmax of each row: `x − log Σ_j e^{x_j}`, computed after shifting by the row's
    /// largest value, so large values do not overflow.
    #[track_caller]
    pub fn log_softmax(self) -> Var<'b> {
        let cols = self.shape().cols();
        let shifted = self - self.detached_max_cols().broadcast_cols(cols);
        shifted - shifted.exp().sum_cols().log().broadcast_cols(cols)
    }

    /// The softmax of each row: `e^{x_j} / Σ_k e^{x_k}` (as `exp` of [`Var::log_softmax`]).
    #[track_caller]
    pub fn softmax(self) -> Var<'b> {
        self.log_softmax().exp()
    }
}

/// Arithmetic with a constant: `x + c`, `x − c`, `x · c`, `c + x`, `c − x`, `c · x`.
macro_rules! constant_operators {
    ($($trait:ident, $method:ident, |$x:ident, $c:ident| $var_op_c:expr, $c_op_var:expr;)*) => {$(
        impl<'b> ops::$trait<f32> for Var<'b> {
            type Output = Var<'b>;
            #[track_caller]
            fn $method(self, $c: f32) -> Var<'b> {
                let $x = self;
                $var_op_c
            }
        }

        impl<'b> ops::$trait<Var<'b>> for f32 {
            type Output = Var<'b>;
            #[track_caller]
            fn $method(self, $x: Var<'b>) -> Var<'b> {
                let $c = self;
                $c_op_var
            }
        }
    )*};
}

constant_operators! {
    Add, add, |x, c| x.offset(c), x.offset(c);
    Sub, sub, |x, c| x.offset(-c), (-x).offset(c);
    Mul, mul, |x, c| x.scale(c), x.scale(c);
}

macro_rules! binary_operator {
    ($trait:ident, $method:ident, $op:expr) => {
        impl<'b> ops::$trait for Var<'b> {
            type Output = Var<'b>;
            #[track_caller]
            fn $method(self, rhs: Var<'b>) -> Var<'b> {
                self.binary($op, rhs)
            }
        }
    };
}

binary_operator!(Add, add, BinaryOp::Add);
binary_operator!(Sub, sub, BinaryOp::Sub);
binary_operator!(Mul, mul, BinaryOp::Mul);
binary_operator!(Div, div, BinaryOp::Div);

impl<'b> ops::Neg for Var<'b> {
    type Output = Var<'b>;
    #[track_caller]
    fn neg(self) -> Var<'b> {
        self.unary(UnaryOp::Neg)
    }
}
