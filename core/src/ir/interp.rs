//! The reference interpreter: evaluates F and F' for one vertex at a time, with plain loops, no
//! batching and no fusion. It is the ground truth the batched engine is tested against.

use super::autodiff::ParamGrad;
use super::func::{Func, Node};
use super::op::{Op, Reduce, ValueId};
use super::vertex_fn::VertexFn;
use crate::attention;
use crate::tensor::Shape;

/// What a vertex receives in the backward pass, and where its gradients go.
pub struct BackwardIo<'a> {
    /// Per child slot, the states the child there scattered (`None` for an empty slot): for
    /// `gather(k)`, slot `k`; for `gather_sum` and its kin, all of them (`gather_max` routes its
    /// gradient by them).
    pub children: &'a [Option<&'a [Vec<f32>]>],
    /// What the vertex knows of the edges to its child slots.
    pub edges: Edges<'a>,
    /// Gradient of each scattered state, summed over the vertex's parents.
    pub state_grads: &'a [Vec<f32>],
    /// Gradient of each pushed output.
    pub push_grads: &'a [Vec<f32>],
}

/// What a vertex knows of the edges to its child slots: their labels (for `gather_labelled`)
/// and feature rows (for `gather_weighted`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Edges<'a> {
    /// The label of the edge to each child slot (missing entries: 0).
    pub labels: &'a [u32],
    /// The feature rows of the edges to the child slots, one after another, `width` values each
    /// (missing entries: 0).
    pub features: &'a [f32],
    /// Values per feature row.
    pub width: usize,
}

impl Edges<'_> {
    /// What `reduce` weighs the child in slot `k` by: its edge's feature for `gather_weighted`,
    /// else 1.
    fn weight(&self, reduce: Reduce, k: usize) -> f32 {
        match reduce.feature() {
            Some(f) if (f as usize) < self.width => {
                self.features.get(k * self.width + f as usize).copied().unwrap_or(0.0)
            }
            Some(_) => 0.0,
            None => 1.0,
        }
    }
}

/// The gradients one vertex produces.
#[derive(Clone, Debug, PartialEq)]
pub struct VertexGrads {
    /// Per child slot: the gradient of each of the child's states (`None` for a missing child).
    pub children: Vec<Option<Vec<Vec<f32>>>>,
    /// Gradient of each pulled input.
    pub pulls: Vec<Vec<f32>>,
}

fn eval(node: &Node, func: &Func, vals: &[Vec<f32>]) -> Vec<f32> {
    let shape = &node.shape;
    let (r, c) = (shape.rows(), shape.cols());
    let val = |v: &ValueId| &vals[v.index()];
    match &node.op {
        Op::MatMul { a, b, ta, tb } => {
            let (sa, sb) = (&func.node(*a).shape, &func.node(*b).shape);
            let k = if *ta { sa.rows() } else { sa.cols() };
            let at = |i: usize, j: usize| {
                if *ta {
                    val(a)[j * sa.cols() + i]
                } else {
                    val(a)[i * sa.cols() + j]
                }
            };
            let bt = |i: usize, j: usize| {
                if *tb {
                    val(b)[j * sb.cols() + i]
                } else {
                    val(b)[i * sb.cols() + j]
                }
            };
            let mut out = vec![0.0; r * c];
            for i in 0..r {
                for j in 0..c {
                    out[i * c + j] = (0..k).map(|l| at(i, l) * bt(l, j)).sum();
                }
            }
            out
        }
        Op::Unary { op, x } => val(x).iter().map(|&e| op.apply(e)).collect(),
        Op::Binary { op, a, b } => {
            let (va, vb) = (val(a), val(b));
            // A one-row parameter operand repeats over the rows.
            let pick = |v: &Vec<f32>, e: usize| if v.len() == r * c { v[e] } else { v[e % c] };
            (0..r * c).map(|e| op.apply(pick(va, e), pick(vb, e))).collect()
        }
        Op::Slice { x, start, len } => {
            let w = func.node(*x).shape.cols();
            (0..r).flat_map(|i| val(x)[i * w + start..i * w + start + len].to_vec()).collect()
        }
        Op::Concat { parts } => {
            let mut out = Vec::with_capacity(r * c);
            for i in 0..r {
                for p in parts {
                    let w = func.node(*p).shape.cols();
                    out.extend_from_slice(&val(p)[i * w..(i + 1) * w]);
                }
            }
            out
        }
        Op::SumCols { x } => {
            let w = func.node(*x).shape.cols();
            (0..r).map(|i| val(x)[i * w..(i + 1) * w].iter().sum()).collect()
        }
        Op::MaxCols { x } => {
            let w = func.node(*x).shape.cols();
            (0..r).map(|i| val(x)[i * w..(i + 1) * w].iter().copied().reduce(f32::max).unwrap_or(f32::NAN)).collect()
        }
        Op::BroadcastCols { x, cols } => (0..r).flat_map(|i| vec![val(x)[i]; *cols]).collect(),
        load => unreachable!("load {} is resolved by the caller", load.name()),
    }
}

/// The child slots that hold a child and, when `label` is given, whose edge carries it.
fn chosen(children: &[Option<&[Vec<f32>]>], labels: &[u32], label: Option<u32>) -> Vec<usize> {
    let carries = |k: usize| label.is_none_or(|l| labels.get(k).copied().unwrap_or(0) == l);
    (0..children.len()).filter(|&k| children[k].is_some() && carries(k)).collect()
}

/// The rows of states `key` and `value` of every present child.
fn child_rows<'a>(children: &[Option<&'a [Vec<f32>]>], key: usize, value: usize) -> (Vec<&'a [f32]>, Vec<&'a [f32]>) {
    children.iter().flatten().map(|s| (s[key].as_slice(), s[value].as_slice())).unzip()
}

/// The widths of an attention whose query has shape `query` and output `out`.
fn widths(query: &Shape, out: &Shape, slope: f32) -> attention::Widths {
    attention::Widths { heads: query.rows(), key: query.cols(), value: out.cols(), slope }
}

/// The children's `rows` combined by `reduce` (`gather_weighted`'s each times its weight in
/// `weights`), element by element (`len` zeros for none).
fn combine(reduce: Reduce, rows: &[&[f32]], weights: &[f32], len: usize) -> Vec<f32> {
    let mut out = zeros(&Shape::from(len));
    if let Reduce::Max = reduce {
        for e in 0..len {
            out[e] = first_largest(rows, e).map_or(0.0, |k| rows[k][e]);
        }
        return out;
    }
    for (row, &w) in rows.iter().zip(weights) {
        match reduce {
            Reduce::Weighted { .. } => out.iter_mut().zip(*row).for_each(|(s, x)| *s += w * x),
            _ => out.iter_mut().zip(*row).for_each(|(s, x)| *s += x),
        }
    }
    if let (Reduce::Mean, count @ 1..) = (reduce, rows.len()) {
        out.iter_mut().for_each(|s| *s /= count as f32);
    }
    out
}

/// The first of `rows` holding the largest value in column `e` (a later row must be larger to
/// replace an earlier one, so a NaN never wins over the first row), if there is a row.
fn first_largest(rows: &[&[f32]], e: usize) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (k, row) in rows.iter().enumerate() {
        if best.is_none_or(|b| row[e] > rows[b][e]) {
            best = Some(k);
        }
    }
    best
}

fn zeros(shape: &Shape) -> Vec<f32> {
    vec![0.0; shape.numel()]
}

/// Runs F on one vertex. `children[k]` holds the states the child in slot `k` scattered (indexed
/// like [`VertexFn::states`]) or `None`, `edges` what it knows of the edges to them;
/// `pulls` holds the vertex's row of each input. Returns every forward value of the vertex
/// (parameters included), indexed by [`ValueId`].
pub fn forward(
    f: &VertexFn,
    params: &[Vec<f32>],
    children: &[Option<&[Vec<f32>]>],
    edges: &Edges<'_>,
    pulls: &[&[f32]],
) -> Vec<Vec<f32>> {
    let func = f.forward();
    let mut vals: Vec<Vec<f32>> = Vec::with_capacity(func.nodes.len());
    for node in &func.nodes {
        let v = match &node.op {
            Op::Gather { slot, state } => match children.get(*slot).copied().flatten() {
                Some(states) => states[*state].clone(),
                None => zeros(&node.shape),
            },
            Op::GatherAll { state, reduce, label } => {
                let (weights, rows): (Vec<f32>, Vec<&[f32]>) = chosen(children, edges.labels, *label)
                    .into_iter()
                    .filter_map(|k| children[k].map(|s| (edges.weight(*reduce, k), s[*state].as_slice())))
                    .unzip();
                combine(*reduce, &rows, &weights, node.shape.numel())
            }
            Op::GatherSoftmax { query, key, value, slope } => {
                let (keys, values) = child_rows(children, *key, *value);
                let mut out = zeros(&node.shape);
                let w = widths(&func.node(*query).shape, &node.shape, *slope);
                attention::forward(&w, &vals[query.index()], &keys, &values, &mut out, &mut Default::default());
                out
            }
            Op::Pull { input } => pulls[*input].to_vec(),
            Op::Param { param } => params[*param].clone(),
            _ => eval(node, func, &vals),
        };
        vals.push(v);
    }
    vals
}

/// Runs F' on one vertex, given its forward values (from [`forward`]). Adds this vertex's share of
/// every parameter gradient into `param_grads` and returns its children's and inputs' gradients.
pub fn backward(
    f: &VertexFn,
    params: &[Vec<f32>],
    primal: &[Vec<f32>],
    io: &BackwardIo<'_>,
    param_grads: &mut [Vec<f32>],
) -> VertexGrads {
    let b = f.backward();
    let func = &b.func;
    let state_zeros = || f.states().iter().map(|s| zeros(&s.shape)).collect::<Vec<_>>();
    let mut children: Vec<Option<Vec<Vec<f32>>>> = io.children.iter().map(|c| c.map(|_| state_zeros())).collect();
    let present: Vec<usize> = (0..children.len()).filter(|&k| io.children[k].is_some()).collect();
    let mut vals: Vec<Vec<f32>> = Vec::with_capacity(func.nodes.len());
    for node in &func.nodes {
        let v = match &node.op {
            Op::GatherSoftmaxGrad { query, grad, key, value, slope } => {
                let (keys, values) = child_rows(io.children, *key, *value);
                let mut dq = zeros(&node.shape);
                let w = widths(&node.shape, &func.node(*grad).shape, *slope);
                let (q, g) = (&vals[query.index()], &vals[grad.index()]);
                attention::backward(&w, q, &keys, &values, g, &mut dq, &mut Default::default(), |c, dk, dv| {
                    if let Some(states) = &mut children[present[c]] {
                        states[*key].iter_mut().zip(dk).for_each(|(d, x)| *d += x);
                        states[*value].iter_mut().zip(dv).for_each(|(d, x)| *d += x);
                    }
                });
                dq
            }
            Op::Primal { value } => primal[value.index()].clone(),
            Op::StateGrad { state } => io.state_grads[*state].clone(),
            Op::PushGrad { output } => io.push_grads[*output].clone(),
            Op::Param { param } => params[*param].clone(),
            Op::Zeros => zeros(&node.shape),
            _ => eval(node, func, &vals),
        };
        vals.push(v);
    }
    for cg in &b.child_grads {
        let g = &vals[cg.value.index()];
        let present = chosen(io.children, io.edges.labels, cg.label);
        let mut add = |k: usize, e: usize, x: f32| {
            if let Some(Some(states)) = children.get_mut(k) {
                states[cg.state][e] += x;
            }
        };
        match (cg.slot, cg.reduce) {
            (Some(k), _) => g.iter().enumerate().for_each(|(e, &x)| add(k, e, x)),
            (None, Reduce::Sum) => present.iter().for_each(|&k| g.iter().enumerate().for_each(|(e, &x)| add(k, e, x))),
            (None, reduce @ Reduce::Weighted { .. }) => present.iter().for_each(|&k| {
                let w = io.edges.weight(reduce, k);
                g.iter().enumerate().for_each(|(e, &x)| add(k, e, x * w))
            }),
            (None, Reduce::Mean) => {
                let count = present.len() as f32;
                present.iter().for_each(|&k| g.iter().enumerate().for_each(|(e, &x)| add(k, e, x / count)))
            }
            (None, Reduce::Max) => {
                let rows: Vec<&[f32]> =
                    present.iter().filter_map(|&k| io.children[k].map(|s| s[cg.state].as_slice())).collect();
                for (e, &x) in g.iter().enumerate() {
                    if let Some(k) = first_largest(&rows, e) {
                        add(present[k], e, x);
                    }
                }
            }
        }
    }
    let pulls = f
        .all_inputs()
        .iter()
        .zip(&b.pull_grads)
        .map(|(p, g)| g.map_or_else(|| zeros(&p.shape), |g| vals[g.index()].clone()))
        .collect();
    for pg in &b.param_grads {
        let shape = &f.params()[pg.param()].shape;
        let dw = &mut param_grads[pg.param()];
        match *pg {
            ParamGrad::MatMul { x, dy, .. } => {
                let (xs, ys) = (&func.node(x).shape, &func.node(dy).shape);
                let (xv, yv) = (&vals[x.index()], &vals[dy.index()]);
                for i in 0..shape.rows() {
                    for j in 0..shape.cols() {
                        dw[i * shape.cols() + j] +=
                            (0..xs.rows()).map(|l| xv[l * xs.cols() + i] * yv[l * ys.cols() + j]).sum::<f32>();
                    }
                }
            }
            ParamGrad::SumRows { dy, .. } => {
                let len = dw.len();
                for (e, g) in vals[dy.index()].iter().enumerate() {
                    dw[e % len] += g;
                }
            }
        }
    }
    VertexGrads { children, pulls }
}

/// Everything one example produces under the reference interpreter.
#[derive(Clone, Debug, PartialEq)]
pub struct GraphRun {
    /// Per pushed output, its rows for every vertex (in vertex order).
    pub outputs: Vec<Vec<f32>>,
    /// Per pulled input, its gradient rows for every vertex.
    pub pull_grads: Vec<Vec<f32>>,
    /// Per parameter, its gradient summed over the graph.
    pub param_grads: Vec<Vec<f32>>,
}

/// Runs F and then F' over one graph, vertex by vertex. `pulls[i]` and `push_grads[o]` hold one
/// row block per vertex, in vertex order.
pub fn run_graph(
    f: &VertexFn,
    params: &[Vec<f32>],
    g: &crate::graph::InputGraph,
    pulls: &[&[f32]],
    push_grads: &[&[f32]],
) -> GraphRun {
    let n = g.len();
    let order: Vec<usize> = g.children_first().iter().map(|&v| v as usize).collect();
    let block = |s: &Shape| s.numel();
    let mut values: Vec<Vec<Vec<f32>>> = vec![Vec::new(); n];
    let mut states: Vec<Vec<Vec<f32>>> = vec![Vec::new(); n];
    for &v in &order {
        let kids: Vec<Option<&[Vec<f32>]>> = g
            .children(v)
            .iter()
            .map(|&c| (c != crate::graph::NO_CHILD).then(|| states[c as usize].as_slice()))
            .collect();
        let rows: Vec<&[f32]> =
            f.all_inputs().iter().zip(pulls).map(|(p, x)| &x[v * block(&p.shape)..(v + 1) * block(&p.shape)]).collect();
        let labels: Vec<u32> = (0..kids.len()).map(|k| g.edge_label(v, k)).collect();
        let edges = Edges { labels: &labels, features: g.edge_features(v), width: g.edge_feature_width() };
        let vals = forward(f, params, &kids, &edges, &rows);
        states[v] = f.states().iter().map(|s| vals[s.value.index()].clone()).collect();
        values[v] = vals;
    }
    let outputs =
        f.outputs().iter().map(|o| (0..n).flat_map(|v| values[v][o.value.index()].clone()).collect()).collect();
    let mut state_grads: Vec<Vec<Vec<f32>>> =
        (0..n).map(|_| f.states().iter().map(|s| zeros(&s.shape)).collect()).collect();
    let mut param_grads: Vec<Vec<f32>> = f.params().iter().map(|p| zeros(&p.shape)).collect();
    let mut pull_grads: Vec<Vec<f32>> = f.all_inputs().iter().map(|p| vec![0.0; n * block(&p.shape)]).collect();
    for &v in order.iter().rev() {
        let kids: Vec<Option<&[Vec<f32>]>> = g
            .children(v)
            .iter()
            .map(|&c| (c != crate::graph::NO_CHILD).then(|| states[c as usize].as_slice()))
            .collect();
        let pg: Vec<Vec<f32>> = f
            .outputs()
            .iter()
            .zip(push_grads)
            .map(|(o, x)| x[v * block(&o.shape)..(v + 1) * block(&o.shape)].to_vec())
            .collect();
        let labels: Vec<u32> = (0..kids.len()).map(|k| g.edge_label(v, k)).collect();
        let edges = Edges { labels: &labels, features: g.edge_features(v), width: g.edge_feature_width() };
        let io = BackwardIo { children: &kids, edges, state_grads: &state_grads[v], push_grads: &pg };
        let grads = backward(f, params, &values[v], &io, &mut param_grads);
        for (k, child) in grads.children.into_iter().enumerate() {
            if let Some(child) = child {
                let c = g.children(v)[k] as usize;
                for (acc, gs) in state_grads[c].iter_mut().zip(child) {
                    for (a, x) in acc.iter_mut().zip(gs) {
                        *a += x;
                    }
                }
            }
        }
        for ((dst, p), gp) in pull_grads.iter_mut().zip(f.all_inputs()).zip(grads.pulls) {
            let b = block(&p.shape);
            dst[v * b..(v + 1) * b].copy_from_slice(&gp);
        }
    }
    GraphRun { outputs, pull_grads, param_grads }
}
