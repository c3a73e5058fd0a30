//! The gradient check of one vertex through the reference interpreter.

use super::{signed, EntryKind, GradComparisons, GradReport, Mismatch, Tolerance};
use crate::dropout::{self, DropoutKey};
use crate::ir::interp::{self, BackwardIo, Edges, VertexGrads};
use crate::ir::VertexFn;
use crate::rng::Rng;

/// One vertex's inputs and the weights of the scalar objective
/// `L = Σ_o ⟨push_grads[o], pushed_o⟩ + Σ_s ⟨state_grads[s], scattered_s⟩`.
#[derive(Clone, Debug, PartialEq)]
pub struct VertexCase {
    /// Parameter values, in declaration order.
    pub params: Vec<Vec<f32>>,
    /// Per child slot: that child's states (indexed like `f.states()`), or `None`.
    pub children: Vec<Option<Vec<Vec<f32>>>>,
    /// Per input (the pulled ones, then one dropout mask per dropout site): this vertex's row.
    pub pulls: Vec<Vec<f32>>,
    /// Weight of each pushed output (its gradient in the backward pass).
    pub push_grads: Vec<Vec<f32>>,
    /// Weight of each scattered state. States that no vertex gathers get zero weight: no parent
    /// ever reads them, and the backward pass (by design) sends them no gradient.
    pub state_grads: Vec<Vec<f32>>,
    /// The label of the edge to each child slot (empty: every edge 0), for `gather_labelled`.
    pub labels: Vec<u32>,
    /// The feature rows of the edges to the child slots, one after another,
    /// [`VertexFn::edge_feature_width`] values each, for `gather_weighted`.
    pub features: Vec<f32>,
}

impl VertexCase {
    /// Random parameters (from the function's initialisers), child states and pulls of magnitude
    /// in `[0.1, 1)` with random signs, one drawn dropout mask per dropout site, edge feature
    /// rows in `[-1, 1)` where the function reads them, and objective weights in `[-1, 1)`.
    /// `present[k]` says whether child slot `k` holds a child (for a function with any number of
    /// children, how many there are).
    pub fn random(f: &VertexFn, seed: u64, present: &[bool]) -> VertexCase {
        let mut rng = Rng::new(seed);
        let params = f.init_params(&mut rng);
        let children = present
            .iter()
            .map(|&p| {
                p.then(|| {
                    f.states()
                        .iter()
                        .map(|s| (0..s.shape.numel()).map(|_| signed(&mut rng, 0.1, 1.0)).collect())
                        .collect()
                })
            })
            .collect();
        let mut pulls: Vec<Vec<f32>> =
            f.inputs().iter().map(|p| (0..p.shape.numel()).map(|_| signed(&mut rng, 0.1, 1.0)).collect()).collect();
        // Dropout masks, drawn once: the function is then differentiable in everything else.
        let key = DropoutKey { seed, step: 1, first: 0 };
        for (site, (&p, port)) in f.dropout_rates().iter().zip(&f.all_inputs()[f.inputs().len()..]).enumerate() {
            let mut row = vec![0.0; port.shape.numel()];
            dropout::mask_row(key, site, 0, 0, p, &mut row);
            pulls.push(row);
        }
        let push_grads =
            f.outputs().iter().map(|o| (0..o.shape.numel()).map(|_| rng.range(-1.0, 1.0)).collect()).collect();
        let state_grads = f
            .states()
            .iter()
            .map(|s| (0..s.shape.numel()).map(|_| if s.gathered { rng.range(-1.0, 1.0) } else { 0.0 }).collect())
            .collect();
        let features = (0..present.len() * f.edge_feature_width()).map(|_| rng.range(-1.0, 1.0)).collect();
        VertexCase { params, children, pulls, push_grads, state_grads, labels: Vec::new(), features }
    }

    /// What the vertex knows of the edges to its child slots.
    fn edges(&self, f: &VertexFn) -> Edges<'_> {
        Edges { labels: &self.labels, features: &self.features, width: f.edge_feature_width() }
    }

    /// Which child slots hold a child.
    pub fn present(&self) -> Vec<bool> {
        self.children.iter().map(Option::is_some).collect()
    }

    /// Every forward value of the vertex, indexed by value id (`interp::forward`).
    pub fn forward(&self, f: &VertexFn) -> Vec<Vec<f32>> {
        let children: Vec<Option<&[Vec<f32>]>> = self.children.iter().map(|c| c.as_deref()).collect();
        let pulls: Vec<&[f32]> = self.pulls.iter().map(Vec::as_slice).collect();
        interp::forward(f, &self.params, &children, &self.edges(f), &pulls)
    }

    /// The objective `L` and the magnitude `S = Σ|weight·value|` of its terms.
    pub fn objective(&self, f: &VertexFn) -> (f64, f64) {
        let vals = self.forward(f);
        let terms = f
            .outputs()
            .iter()
            .zip(&self.push_grads)
            .map(|(o, w)| (o.value, w))
            .chain(f.states().iter().zip(&self.state_grads).map(|(s, w)| (s.value, w)));
        let mut total = (0.0, 0.0);
        for (v, w) in terms {
            for (&w, &x) in w.iter().zip(&vals[v.index()]) {
                total.0 += f64::from(w) * f64::from(x);
                total.1 += f64::from(w * x).abs();
            }
        }
        total
    }

    /// The analytic gradients of `L` (`interp::backward`): the vertex's and the parameters'.
    pub fn gradients(&self, f: &VertexFn) -> (VertexGrads, Vec<Vec<f32>>) {
        let vals = self.forward(f);
        let children: Vec<Option<&[Vec<f32>]>> = self.children.iter().map(|c| c.as_deref()).collect();
        let io = BackwardIo {
            children: &children,
            edges: self.edges(f),
            state_grads: &self.state_grads,
            push_grads: &self.push_grads,
        };
        let mut param_grads: Vec<Vec<f32>> = self.params.iter().map(|p| vec![0.0; p.len()]).collect();
        let grads = interp::backward(f, &self.params, &vals, &io, &mut param_grads);
        (grads, param_grads)
    }
}

/// One scalar input of the vertex a gradient is checked for.
#[derive(Clone, Copy, Debug)]
enum Target {
    Child { slot: usize, state: usize, e: usize },
    Pull { input: usize, e: usize },
    Param { param: usize, e: usize },
}

fn entry(case: &mut VertexCase, t: Target) -> &mut f32 {
    match t {
        Target::Child { slot, state, e } => match &mut case.children[slot] {
            Some(states) => &mut states[state][e],
            None => unreachable!("targets are made for present children only"),
        },
        Target::Pull { input, e } => &mut case.pulls[input][e],
        Target::Param { param, e } => &mut case.params[param][e],
    }
}

fn label(f: &VertexFn, t: Target) -> String {
    match t {
        Target::Child { slot, state, e } => format!("child {slot} state `{}`[{e}]", f.states()[state].name),
        Target::Pull { input, e } => format!("pull `{}`[{e}]", f.inputs()[input].name),
        Target::Param { param, e } => format!("param `{}`[{e}]", f.params()[param].name),
    }
}

/// Compares the interpreter's backward pass (the function's derived F') with central differences
/// of `L` (see [`VertexCase`]) for every entry of every present child's states, every pulled
/// input and every parameter, under the default [`Tolerance`]. Also checks the shapes of what the
/// backward pass returns. A [`Mismatch`] names each wrong entry (``param `W`[3]``,
/// ``child 0 state `h`[1]``).
pub fn check_vertex(f: &VertexFn, case: &VertexCase) -> Result<GradReport, Mismatch> {
    let tol = Tolerance::default();
    let what = format!("gradients of one vertex of `{}`", f.name());
    let shape = |detail: String| Mismatch::other(what.clone(), detail);
    let (grads, param_grads) = case.gradients(f);
    let mut case = case.clone();
    let (_, scale) = case.objective(f);
    if grads.children.len() != case.children.len() {
        let (got, given) = (grads.children.len(), case.children.len());
        return Err(shape(format!("the backward pass returned {got} child slots for {given} given")));
    }
    if grads.pulls.len() != f.all_inputs().len() {
        let (got, inputs) = (grads.pulls.len(), f.all_inputs().len());
        return Err(shape(format!("the backward pass returned {got} input gradients for {inputs} inputs")));
    }
    let mut targets = Vec::new();
    for (slot, (given, got)) in case.children.iter().zip(&grads.children).enumerate() {
        match (given, got) {
            (None, None) => {}
            (Some(states), Some(gs)) => {
                if gs.len() != states.len() {
                    return Err(shape(format!("child {slot}: {} state gradients", gs.len())));
                }
                for (s, (x, g)) in states.iter().zip(gs).enumerate() {
                    if x.len() != g.len() {
                        return Err(shape(format!("child {slot} state {s}: gradient length {}", g.len())));
                    }
                    targets.extend(g.iter().enumerate().map(|(e, &g)| (Target::Child { slot, state: s, e }, g)));
                }
            }
            (Some(_), None) => return Err(shape(format!("no gradient for present child {slot}"))),
            (None, Some(_)) => return Err(shape(format!("a gradient for missing child {slot}"))),
        }
    }
    // Dropout masks (the inputs after the user's) are constants.
    for (i, (x, g)) in case.pulls.iter().zip(&grads.pulls).take(f.inputs().len()).enumerate() {
        if x.len() != g.len() {
            return Err(shape(format!("pull {i}: gradient length {}", g.len())));
        }
        targets.extend(g.iter().enumerate().map(|(e, &g)| (Target::Pull { input: i, e }, g)));
    }
    for (p, g) in param_grads.iter().enumerate() {
        targets.extend(g.iter().enumerate().map(|(e, &g)| (Target::Param { param: p, e }, g)));
    }
    let mut check = GradComparisons::new(what, tol, scale);
    for (t, analytic) in targets {
        let x = *entry(&mut case, t);
        let points = check.points(x);
        *entry(&mut case, t) = points.0;
        let at_hi = case.objective(f).0;
        *entry(&mut case, t) = points.1;
        let at_lo = case.objective(f).0;
        *entry(&mut case, t) = x;
        let kind = match t {
            Target::Child { .. } => EntryKind::Child,
            Target::Pull { .. } => EntryKind::Pull,
            Target::Param { .. } => EntryKind::Param,
        };
        check.compare(kind, || label(f, t), analytic, points, (at_hi, at_lo));
    }
    check.finish()
}
