//! Ready-made vertex functions.

use arbor_core::ir::{Builder, Init, Reduce, Var, VertexFn};
use arbor_core::Result;

/// Dropout rates of a ready-made cell, in training: on its pulled input (the word vector), on
/// its pushed output (what the layer above or the head reads), and on the recurrence's update
/// (Semeniuta et al. 2016: an LSTM's candidate `u` before it enters the memory, Tree-FC's new
/// state; what a vertex carries over from its children is never dropped).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CellDropout {
    /// Rate on the pulled input.
    pub input: f32,
    /// Rate on the pushed output.
    pub output: f32,
    /// Rate on the update of the recurrent state.
    pub recurrent: f32,
}

impl CellDropout {
    /// No dropout.
    pub const NONE: CellDropout = CellDropout { input: 0.0, output: 0.0, recurrent: 0.0 };

    /// Rate `p` everywhere: on the pulled input, the recurrent update and the pushed output.
    pub fn all(p: f32) -> CellDropout {
        CellDropout { input: p, output: p, recurrent: p }
    }

    /// Rate `p` on the pushed output only (Tai et al. (2015) on SST: dropout before the
    /// classifier).
    pub fn output(p: f32) -> CellDropout {
        CellDropout { output: p, ..CellDropout::NONE }
    }
}

/// The binary (N-ary, N = 2) Tree-LSTM cell of Tai et al. (2015), with a forget gate per child.
/// Pulls `x` (`embed` wide), gathers and scatters states `h` and `c`, pushes `h`.
pub fn tree_lstm(embed: usize, hidden: usize) -> Result<VertexFn> {
    tree_lstm_with(embed, hidden, CellDropout::NONE)
}

/// [`tree_lstm`] with dropout `p`.
fn tree_lstm_with(embed: usize, hidden: usize, p: CellDropout) -> Result<VertexFn> {
    let f = Builder::new("tree-lstm", 2);
    let x = f.pull("x", embed).dropout(p.input);
    let (h0, c0) = (f.gather(0, "h", hidden), f.gather(0, "c", hidden));
    let (h1, c1) = (f.gather(1, "h", hidden), f.gather(1, "c", hidden));
    let w = f.param("W", [embed, 5 * hidden], Init::Xavier);
    let u0 = f.param("U0", [hidden, 5 * hidden], Init::Xavier);
    let u1 = f.param("U1", [hidden, 5 * hidden], Init::Xavier);
    let b = f.param("b", [1, 5 * hidden], Init::Zeros);
    let gates = x.matmul(w) + h0.matmul(u0) + h1.matmul(u1) + b;
    let gate = |k: usize| gates.slice(k * hidden, hidden);
    // Gates `[i o u f0 f1]`: a leaf's non-zero gates (its forget gates scale missing cells) are
    // one run of columns, so its products are one call each.
    let (i, o, u) = (gate(0).sigmoid(), gate(1).sigmoid(), gate(2).tanh().dropout(p.recurrent));
    let (f0, f1) = (gate(3).sigmoid(), gate(4).sigmoid());
    let c = i * u + f0 * c0 + f1 * c1;
    let h = o * c.tanh();
    f.scatter("h", h);
    f.scatter("c", c);
    f.push("h", h.dropout(p.output));
    f.build()
}

/// The child-sum Tree-LSTM cell of Tai et al. (2015) for vertices of up to `max_children`
/// children: gates `i, o, u` from the children's summed hidden state, and one forget gate per
/// child, `f_k = σ(x·W_f + h_k·U_f + b_f)` with `U_f` shared by all children. A missing child
/// reads zeros, so it adds nothing to the memory; a vertex with more children is refused.
pub fn child_sum_tree_lstm(embed: usize, hidden: usize, max_children: usize) -> Result<VertexFn> {
    child_sum_tree_lstm_with(embed, hidden, max_children, CellDropout::NONE)
}

/// [`child_sum_tree_lstm`] with dropout `p`.
fn child_sum_tree_lstm_with(embed: usize, hidden: usize, max_children: usize, p: CellDropout) -> Result<VertexFn> {
    if max_children == 0 {
        return Err(arbor_core::Error::input("child-sum Tree-LSTM", "max_children of at least 1", "0"));
    }
    let f = Builder::new("child-sum-tree-lstm", max_children);
    let x = f.pull("x", embed).dropout(p.input);
    let kids: Vec<_> = (0..max_children).map(|k| (f.gather(k, "h", hidden), f.gather(k, "c", hidden))).collect();
    let [w, u, b, wf, uf, bf] = child_sum_params(&f, embed, hidden);
    let sum_h = kids.iter().skip(1).fold(kids[0].0, |s, k| s + k.0);
    let gates = x.matmul(w) + sum_h.matmul(u) + b;
    let gate = |k: usize| gates.slice(k * hidden, hidden);
    let (i, o, uu) = (gate(0).sigmoid(), gate(1).sigmoid(), gate(2).tanh().dropout(p.recurrent));
    let xf = x.matmul(wf) + bf;
    let c_new = kids.iter().fold(i * uu, |c, &(hk, ck)| c + (xf + hk.matmul(uf)).sigmoid() * ck);
    let h_new = o * c_new.tanh();
    f.scatter("h", h_new);
    f.scatter("c", c_new);
    f.push("h", h_new.dropout(p.output));
    f.build()
}

/// The parameters of both child-sum cells, in their order: `W`, `U`, `b` (gates `i, o, u`) and
/// `Wf`, `Uf`, `bf` (the forget gate).
fn child_sum_params(f: &Builder, embed: usize, hidden: usize) -> [Var<'_>; 6] {
    [
        f.param("W", [embed, 3 * hidden], Init::Xavier),
        f.param("U", [hidden, 3 * hidden], Init::Xavier),
        f.param("b", [1, 3 * hidden], Init::Zeros),
        f.param("Wf", [embed, hidden], Init::Xavier),
        f.param("Uf", [hidden, hidden], Init::Xavier),
        f.param("bf", [1, hidden], Init::Zeros),
    ]
}

/// The child-sum Tree-LSTM of Tai et al. (2015) for any number of children (dependency trees):
/// [`child_sum_tree_lstm`]'s function with the same parameters, on trees. A vertex's forget gate
/// at its parent, `f = σ(x_parent·W_f + h·U_f + b_f)`, needs the parent's input, so each vertex
/// also pulls `x_parent` (zeros at a root) and scatters `fc = f ⊙ c`; the parent sums `h` and
/// `fc` over however many children it has (`gather_sum`). On a DAG a vertex with several
/// parents would see only one of their inputs: feed trees.
pub fn child_sum_tree_lstm_nary(embed: usize, hidden: usize) -> Result<VertexFn> {
    let f = Builder::new("child-sum-tree-lstm-nary", 0);
    let (x, x_parent) = (f.pull("x", embed), f.pull("x_parent", embed));
    let (sum_h, sum_fc) = (f.gather_sum("h", hidden), f.gather_sum("fc", hidden));
    let [w, u, b, wf, uf, bf] = child_sum_params(&f, embed, hidden);
    let gates = x.matmul(w) + sum_h.matmul(u) + b;
    let gate = |k: usize| gates.slice(k * hidden, hidden);
    let (i, o, uu) = (gate(0).sigmoid(), gate(1).sigmoid(), gate(2).tanh());
    let c = i * uu + sum_fc;
    let h = o * c.tanh();
    f.scatter("h", h);
    f.scatter("fc", (x_parent.matmul(wf) + h.matmul(uf) + bf).sigmoid() * c);
    f.push("h", h);
    f.build()
}

/// An LSTM cell over a chain (Var-LSTM: a sentence as a chain graph, each vertex gathering its
/// predecessor). Pulls `x`, gathers and scatters `h` and `c`, pushes `h`.
pub fn var_lstm(embed: usize, hidden: usize) -> Result<VertexFn> {
    var_lstm_with(embed, hidden, CellDropout::NONE)
}

/// [`var_lstm`] with dropout `p`.
fn var_lstm_with(embed: usize, hidden: usize, p: CellDropout) -> Result<VertexFn> {
    let f = Builder::new("var-lstm", 1);
    let x = f.pull("x", embed).dropout(p.input);
    let (h, c) = (f.gather(0, "h", hidden), f.gather(0, "c", hidden));
    let w = f.param("W", [embed, 4 * hidden], Init::Xavier);
    let u = f.param("U", [hidden, 4 * hidden], Init::Xavier);
    let b = f.param("b", [1, 4 * hidden], Init::Zeros);
    let gates = x.matmul(w) + h.matmul(u) + b;
    let gate = |k: usize| gates.slice(k * hidden, hidden);
    let (i, fg, o, uu) = (gate(0).sigmoid(), gate(1).sigmoid(), gate(2).sigmoid(), gate(3).tanh().dropout(p.recurrent));
    let c_new = i * uu + fg * c;
    let h_new = o * c_new.tanh();
    f.scatter("h", h_new);
    f.scatter("c", c_new);
    f.push("h", h_new.dropout(p.output));
    f.build()
}

/// Tree-FC, the Cavs benchmark cell: one fully connected layer over a vertex's input and its two
/// children's states, `h = tanh(x·W + h₀·U₀ + h₁·U₁ + b)`.
pub fn tree_fc(embed: usize, hidden: usize) -> Result<VertexFn> {
    tree_fc_with(embed, hidden, CellDropout::NONE)
}

/// [`tree_fc`] with dropout `p`.
fn tree_fc_with(embed: usize, hidden: usize, p: CellDropout) -> Result<VertexFn> {
    let f = Builder::new("tree-fc", 2);
    let x = f.pull("x", embed).dropout(p.input);
    let (h0, h1) = (f.gather(0, "h", hidden), f.gather(1, "h", hidden));
    let w = f.param("W", [embed, hidden], Init::Xavier);
    let u0 = f.param("U0", [hidden, hidden], Init::Xavier);
    let u1 = f.param("U1", [hidden, hidden], Init::Xavier);
    let b = f.param("b", [1, hidden], Init::Zeros);
    let h = (x.matmul(w) + h0.matmul(u0) + h1.matmul(u1) + b).tanh();
    f.scatter("h", h.dropout(p.recurrent));
    f.push("h", h.dropout(p.output));
    f.build()
}

/// The cells of the zoo's tree and sequence models, by the name the CLI gives them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CellKind {
    /// [`tree_lstm`]
    TreeLstm,
    /// [`child_sum_tree_lstm`]
    ChildSum,
    /// [`var_lstm`] (each sentence as a chain)
    VarLstm,
    /// [`tree_fc`]
    TreeFc,
}

impl CellKind {
    /// Every kind.
    pub const ALL: [CellKind; 4] = [CellKind::TreeLstm, CellKind::ChildSum, CellKind::VarLstm, CellKind::TreeFc];

    /// The model's name, as the command line and checkpoints spell it.
    pub fn name(self) -> &'static str {
        match self {
            CellKind::TreeLstm => "tree-lstm",
            CellKind::ChildSum => "child-sum",
            CellKind::VarLstm => "var-lstm",
            CellKind::TreeFc => "tree-fc",
        }
    }

    /// The model called `name`.
    pub fn from_name(name: &str) -> Result<CellKind> {
        CellKind::ALL
            .into_iter()
            .find(|m| m.name() == name)
            .ok_or_else(|| arbor_core::Error::input("model", CellKind::ALL.map(CellKind::name).join(", "), name))
    }

    /// The model's vertex function.
    pub fn cell(self, embed: usize, hidden: usize) -> Result<VertexFn> {
        self.cell_with_dropout(embed, hidden, CellDropout::NONE)
    }

    /// The model's vertex function with dropout `p` on its pulled input (the word vector), its
    /// recurrent update and its pushed output (what the classifier reads);
    /// [`CellDropout::NONE`] gives [`CellKind::cell`].
    pub fn cell_with_dropout(self, embed: usize, hidden: usize, p: CellDropout) -> Result<VertexFn> {
        match self {
            CellKind::TreeLstm => tree_lstm_with(embed, hidden, p),
            // Constituency trees (SST, the synthetic treebank) are binary.
            CellKind::ChildSum => child_sum_tree_lstm_with(embed, hidden, 2, p),
            CellKind::VarLstm => var_lstm_with(embed, hidden, p),
            CellKind::TreeFc => tree_fc_with(embed, hidden, p),
        }
    }

    /// Whether the model reads sentences as chains rather than trees.
    pub fn chains(self) -> bool {
        self == CellKind::VarLstm
    }
}

/// A gated graph network cell (Li et al. 2016) for message passing unrolled as a DAG: vertex
/// `(v, t)` has `(v, t−1)` in child slot 0 and `(u, t−1)` for every neighbour `u` in the other
/// slots. The message is the neighbours' summed state (`gather_sum` minus the own previous state)
/// through a linear map; the update is a GRU; every step also sees the node's features `x`.
pub fn ggnn(features: usize, hidden: usize) -> Result<VertexFn> {
    ggnn_scored(features, hidden, 0)
}

/// [`ggnn`], pushing also `scores` attention scores per vertex (see [`push_scored`]).
pub fn ggnn_scored(features: usize, hidden: usize, scores: usize) -> Result<VertexFn> {
    // Arity 1 for the own previous state; `gather_sum` admits any number of neighbours.
    let f = Builder::new("ggnn", 1);
    let x = f.pull("x", features);
    let prev = f.gather(0, "h", hidden);
    let message = (f.gather_sum("h", hidden) - prev).matmul(f.param("Wm", [hidden, hidden], Init::Xavier));
    let gate = |name: &str| {
        let w = f.param(&format!("W{name}"), [hidden, hidden], Init::Xavier);
        let v = f.param(&format!("V{name}"), [features, hidden], Init::Xavier);
        let b = f.param(&format!("b{name}"), [1, hidden], Init::Zeros);
        message.matmul(w) + x.matmul(v) + b
    };
    let z = (gate("z") + prev.matmul(f.param("Uz", [hidden, hidden], Init::Xavier))).sigmoid();
    let r = (gate("r") + prev.matmul(f.param("Ur", [hidden, hidden], Init::Xavier))).sigmoid();
    let candidate = (gate("h") + (r * prev).matmul(f.param("Uh", [hidden, hidden], Init::Xavier))).tanh();
    let h = prev + z * (candidate - prev);
    f.scatter("h", h);
    push_scored(&f, h, scores);
    f.build()
}

/// A graph isomorphism network layer (GIN, Xu et al. 2019) for message passing unrolled as a DAG
/// (as [`ggnn`]): the node's previous state scaled by `1 + ε` (learned, per column) plus its
/// neighbours' summed, and the node's features, through a two-layer perceptron with ReLUs. With
/// `edge_labels` above 0 (bond types), each label's neighbours are summed through a matrix of
/// their own (`gather_labelled`, as R-GCN weighs edge types); without, all of them alike
/// (`gather_sum` minus the own previous state). Every step shares the weights (see
/// [`gin_per_step`]).
pub fn gin(features: usize, hidden: usize, edge_labels: u32) -> Result<VertexFn> {
    gin_with(features, hidden, edge_labels, None, 0)
}

/// [`gin`] with a perceptron and an `ε` of its own for each of the `steps + 1` steps of a graph
/// unrolled `steps` times, as GIN's layers are: the cell pulls its step as a second input, the
/// one-hot row of `Feed::Height(steps + 1)` (a model's feed), and keeps the
/// perceptron of its step (each step's computed at every vertex and masked, so the cell costs
/// `steps + 1` perceptrons a vertex). On a graph unrolled for more steps than `steps`, the later
/// steps use the last step's weights (their heights count as the last column).
pub fn gin_per_step(features: usize, hidden: usize, edge_labels: u32, steps: usize) -> Result<VertexFn> {
    gin_with(features, hidden, edge_labels, Some(steps), 0)
}

/// [`gin`], pushing also `scores` attention scores per vertex (see [`push_scored`]).
pub fn gin_scored(features: usize, hidden: usize, edge_labels: u32, scores: usize) -> Result<VertexFn> {
    gin_with(features, hidden, edge_labels, None, scores)
}

/// [`gin_per_step`], pushing also `scores` attention scores per vertex (see [`push_scored`]).
pub fn gin_per_step_scored(
    features: usize,
    hidden: usize,
    edge_labels: u32,
    steps: usize,
    scores: usize,
) -> Result<VertexFn> {
    gin_with(features, hidden, edge_labels, Some(steps), scores)
}

/// GIN with one set of weights (`steps` none) or one per step of `steps`.
fn gin_with(features: usize, hidden: usize, edge_labels: u32, steps: Option<usize>, scores: usize) -> Result<VertexFn> {
    let f = Builder::new("gin", 1);
    let x = f.pull("x", features);
    let step = steps.map(|s| f.pull("step", s + 1));
    let prev = f.gather(0, "h", hidden);
    let neighbours = match edge_labels {
        0 => f.gather_sum("h", hidden) - prev,
        _ => (0..edge_labels)
            .map(|l| {
                let e = f.param(&format!("E{l}"), [hidden, hidden], Init::Xavier);
                f.gather_labelled(Reduce::Sum, l, "h", hidden).matmul(e)
            })
            .reduce(|a, b| a + b)
            .unwrap_or(prev),
    };
    let one_plus_eps = match step {
        // One row per step, the step's picked by its one-hot row.
        Some(k) => k.matmul(f.param("one_plus_eps", [k.shape().numel(), hidden], Init::Const(1.0))),
        None => f.param("one_plus_eps", [1, hidden], Init::Const(1.0)),
    };
    let input = prev * one_plus_eps + neighbours + x.matmul(f.param("V", [features, hidden], Init::Xavier));
    let perceptron = |tag: &str| {
        let mut h = input;
        for k in 1..=2 {
            let w = f.param(&format!("W{k}{tag}"), [hidden, hidden], Init::Xavier);
            h = (h.matmul(w) + f.param(&format!("b{k}{tag}"), [1, hidden], Init::Zeros)).relu();
        }
        h
    };
    let h = match step {
        Some(k) => (0..k.shape().numel())
            .map(|t| k.slice(t, 1).broadcast_cols(hidden) * perceptron(&format!("_{t}")))
            .reduce(|a, b| a + b)
            .unwrap_or(input),
        None => perceptron(""),
    };
    f.scatter("h", h);
    push_scored(&f, h, scores);
    f.build()
}

/// A graph attention layer (GAT, Veličković et al. 2018) for message passing unrolled as a DAG
/// (as [`ggnn`]): every node sends `z = h·W` and half a score `a_r·z`; a node weighs its
/// children (its own previous state and its neighbours) by a softmax over
/// `LeakyReLU_0.2(a_l·z_self + a_r·z_child)` (`gather_softmax_leaky`, its own half read from its
/// previous state), and its new state is `tanh` of that weighted sum plus its features' map.
/// Every step shares the weights.
pub fn gat(features: usize, hidden: usize) -> Result<VertexFn> {
    gat_scored(features, hidden, 0)
}

/// [`gat`], pushing also `scores` attention scores per vertex (see [`push_scored`]).
pub fn gat_scored(features: usize, hidden: usize, scores: usize) -> Result<VertexFn> {
    let f = Builder::new("gat", 1);
    let x = f.pull("x", features);
    let prev = f.gather(0, "h", hidden);
    let w = f.param("W", [hidden, hidden], Init::Xavier);
    let (a_l, a_r) = (f.param("a_l", [hidden, 1], Init::Xavier), f.param("a_r", [hidden, 1], Init::Xavier));
    // Scores as one product: the query [1, a_l·z_self] against each child's key [a_r·z, 1].
    let own = prev.matmul(w).matmul(a_l);
    let one = own.scale(0.0).offset(1.0);
    let att = f.gather_softmax_leaky(one.concat(own), "k", "z", hidden, 0.2);
    let xv = x.matmul(f.param("V", [features, hidden], Init::Xavier));
    let h = (att + xv + f.param("b", [1, hidden], Init::Zeros)).tanh();
    let z = h.matmul(w);
    f.scatter("z", z);
    f.scatter("k", z.matmul(a_r).concat(one));
    // `h` itself is gathered from the own previous step: scattered too.
    f.scatter("h", h);
    push_scored(&f, h, scores);
    f.build()
}

/// Pushes a vertex function's state `h` and, with `scores` above 0, a score per attention head
/// `h·G` (`G` a `[hidden, scores]` parameter) for an attention readout
/// ([`Readout::Attention`](crate::readout::Readout::Attention)).
pub fn push_scored(f: &Builder, h: Var<'_>, scores: usize) {
    f.push("h", h);
    if scores > 0 {
        let hidden = h.shape().numel();
        f.push("score", h.matmul(f.param("G", [hidden, scores], Init::Xavier)));
    }
}

/// The relatedness head of Tai et al. (2015) over a sentence pair's roots (`hidden` wide each):
/// `[|h_a − h_b|, h_a ⊙ h_b]`, `units` sigmoid units, a softmax over `classes` scores. Pulls
/// `ha`, `hb` and the target distribution; pushes the KL divergence to it as `loss` and the
/// predicted distribution as `q` (the expected score is `Σ_k k·q_k` over scores `1..=classes`).
pub fn relatedness_head(hidden: usize, units: usize, classes: usize) -> Result<VertexFn> {
    let f = Builder::new("relatedness", 0);
    let (ha, hb, p) = (f.pull("ha", hidden), f.pull("hb", hidden), f.pull("target", classes));
    let w = f.param("W", [2 * hidden, units], Init::Xavier);
    let b = f.param("b", [1, units], Init::Zeros);
    let v = f.param("V", [units, classes], Init::Xavier);
    let log_q = ((ha - hb).abs().concat(ha * hb).matmul(w) + b).sigmoid().matmul(v).log_softmax();
    f.push("loss", crate::head::kl_divergence(log_q, p));
    f.push("q", log_q.exp());
    f.build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cell_dropout_puts_each_rate_where_it_says() {
        for model in CellKind::ALL {
            let rates = |p| model.cell_with_dropout(4, 3, p).expect("a zoo cell builds").dropout_rates().to_vec();
            assert_eq!(rates(CellDropout::NONE), Vec::<f32>::new(), "{}", model.name());
            assert_eq!(rates(CellDropout::output(0.5)), [0.5], "{}", model.name());
            // The pulled input is declared first, the recurrent update before the pushed output.
            let all = CellDropout { input: 0.2, output: 0.4, recurrent: 0.1 };
            assert_eq!(rates(all), [0.2, 0.1, 0.4], "{}", model.name());
            assert_eq!(rates(CellDropout::all(0.3)), [0.3; 3], "{}", model.name());
        }
    }
}
