//! The fused kernels of the model zoo as the CUDA code generator sees them: every fused step of
//! every plan, bound the ways the engine binds loads.

use arbor::cuda::codegen::Binding;
use arbor::fusion::{Kernel, Plan, Step};
use arbor::ir::Op;
use arbor::{nn, Builder, Init, VertexFn};

/// The fused kernels of a plan, in order.
pub fn fused(plan: &Plan) -> Vec<Kernel> {
    plan.phases.iter().flatten().filter_map(|s| if let Step::Fused(k) = s { Some(k.clone()) } else { None }).collect()
}

/// Every fused kernel of a function's forward, inference and backward plans, and each kernel of
/// several stores again with every other store left out (as the engine leaves out the stores a
/// task never reads), so some of its ops feed nothing; each with a label (`forward 0`,
/// `backward 1 pruned`).
pub fn kernels(f: &VertexFn) -> Vec<(String, Kernel)> {
    let plans = [("forward", f.forward_plan()), ("inference", f.inference_plan()), ("backward", f.backward_plan())];
    let all: Vec<(String, Kernel)> = plans
        .into_iter()
        .flat_map(|(phase, plan)| fused(plan).into_iter().enumerate().map(move |(i, k)| (format!("{phase} {i}"), k)))
        .collect();
    let pruned: Vec<(String, Kernel)> = all
        .iter()
        .filter(|(_, k)| k.stores.len() > 1)
        .map(|(label, k)| (format!("{label} pruned"), k.keeping_stores(|j| j % 2 == 0)))
        .collect();
    all.into_iter().chain(pruned).collect()
}

/// One small instance of every cell (and head) of the zoo.
pub fn cells() -> Vec<VertexFn> {
    vec![
        nn::tree_lstm(5, 4).unwrap(),
        nn::child_sum_tree_lstm(5, 4, 3).unwrap(),
        nn::var_lstm(5, 4).unwrap(),
        nn::tree_fc(5, 4).unwrap(),
        nn::ggnn(3, 4).unwrap(),
        nn::gin(3, 4, 2).unwrap(),
        nn::gin_per_step(3, 4, 2, 2).unwrap(),
        nn::gat(3, 4).unwrap(),
        nn::child_sum_tree_lstm_nary(5, 4).unwrap(),
        nn::relatedness_head(4, 3, 5).unwrap(),
        arbor::head::softmax_classifier(4, 5).unwrap(),
        nn::CellKind::VarLstm.cell_with_dropout(5, 4, nn::CellDropout::all(0.5)).unwrap(),
        every_op(),
    ]
}

/// A cell that uses every element-wise op of one input (and, in its backward function, every
/// backward-only op), every row reduction and broadcast, every reduction over children (one
/// weighted by an edge feature) and attention, so each op's CUDA code is generated, compiled and run.
fn every_op() -> VertexFn {
    let f = Builder::new("every-op", 2);
    let x = f.pull("x", 4);
    let (h0, h1) = (f.gather(0, "h", 4), f.gather(1, "h", 4));
    let w = f.param("W", [4, 4], Init::Xavier);
    let a = x.matmul(w) + h0;
    let positive = a.sigmoid() + h1.exp();
    let gate = (1.0 - a.abs().sum_cols().sigmoid()).broadcast_cols(4);
    let y = a.gelu() * a.tanh() - a.relu().scale(0.5)
        + positive.log() / positive
        + gate * a.log_softmax()
        + a.detach() * h1
        + f.gather_sum("h", 4) * f.gather_mean("h", 4) * f.gather_max("h", 4).tanh()
        + f.gather_weighted(1, "h", 4)
        + f.gather_softmax(a.tanh(), "h", "h", 4);
    f.scatter("h", -y);
    f.push("y", y);
    f.build().unwrap()
}

/// How the engine would bind each load of a kernel of `f`: parameters broadcast, gathers (and
/// the children's states F′ reads where they are) by index, sums over child sets by index set,
/// the rest contiguous (`plain`: gathers contiguous too).
pub fn bindings(f: &VertexFn, k: &Kernel, plain: bool) -> Vec<Binding> {
    k.loads()
        .map(|i| match (&k.nodes[i].op, k.nodes[i].is_param, plain) {
            (_, true, _) => Binding::Broadcast,
            (Op::Gather { .. }, _, false) => Binding::Indexed,
            (Op::Primal { value }, _, false) if f.read_where_gathered(*value).is_some() => Binding::Indexed,
            (Op::GatherAll { reduce, .. }, _, false) => Binding::set(*reduce),
            (Op::Zeros, _, _) => Binding::Zeros,
            _ => Binding::Contiguous,
        })
        .collect()
}
