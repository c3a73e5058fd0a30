//! The kernel plans of the Tree-LSTM cells: how many GEMMs and fused kernels, in which phase.

mod common;

use arbor_core::fusion::{Phase, Plan, Step};
use arbor_core::ir::{Op, VertexFn};
use common::{binary_tree_lstm, check_plans, child_sum_tree_lstm};

/// GEMM and fused-kernel counts of one phase.
fn phase_counts(plan: &Plan, p: Phase) -> (usize, usize) {
    let steps = &plan.phases[p as usize];
    let gemms = steps.iter().map(|s| if let Step::Gemms(vs) = s { vs.len() } else { 0 }).sum();
    (gemms, steps.iter().filter(|s| matches!(s, Step::Fused(_))).count())
}

/// The GEMMs of a phase, as (left operand's op, right operand's op) of the function.
fn gemm_operands(f: &arbor_core::ir::Func, plan: &Plan, p: Phase) -> Vec<(String, String)> {
    plan.phases[p as usize]
        .iter()
        .flat_map(|s| match s {
            Step::Gemms(vs) => vs
                .iter()
                .map(|v| match f.node(*v).op {
                    Op::MatMul { a, b, .. } => (f.node(a).op.name(), f.node(b).op.name()),
                    _ => panic!("gemm step {v} is not a matmul"),
                })
                .collect(),
            Step::Fused(_) | Step::Attend(_) => vec![],
        })
        .collect()
}

fn pull_matmul_in_prologue(cell: &VertexFn) {
    let fwd = cell.forward_plan();
    let pro = gemm_operands(cell.forward(), fwd, Phase::Prologue);
    assert!(pro.iter().all(|(a, _)| a == "pull(0)"), "prologue GEMMs must read only the pulled x: {pro:?}\n{fwd}");
    let rec = gemm_operands(cell.forward(), fwd, Phase::Recurrent);
    assert!(rec.iter().all(|(a, _)| a.starts_with("gather")), "recurrent GEMMs read gathered states: {rec:?}\n{fwd}");
}

#[test]
fn binary_tree_lstm_plan() {
    let cell = binary_tree_lstm(4, 3);
    let fwd = cell.forward_plan();
    let text = format!("{fwd}");
    assert_eq!(fwd.counts(), (3, 2), "forward plan:\n{text}");
    // x·W is hoisted; h0·U0 and h1·U1 run per task, with one kernel copying the gathered h
    // blocks for them and one kernel for all gate math; nothing is left for the epilogue.
    assert_eq!(phase_counts(fwd, Phase::Prologue), (1, 0), "{text}");
    assert_eq!(phase_counts(fwd, Phase::Recurrent), (2, 2), "{text}");
    assert_eq!(phase_counts(fwd, Phase::Epilogue), (0, 0), "{text}");
    pull_matmul_in_prologue(&cell);
    assert!(text.contains("Prologue"), "{text}");
    assert!(text.contains("Recurrent"), "{text}");
    assert!(!text.contains("Epilogue"), "{text}");
    assert!(text.contains("gemm"), "{text}");
    assert!(text.contains("fused["), "{text}");

    let bwd = cell.backward_plan();
    let text = format!("{bwd}");
    // One fused kernel forms the gate gradient; dh0 = dG·U0ᵀ and dh1 = dG·U1ᵀ run per task;
    // dx = dG·Wᵀ feeds no child and waits for the epilogue. Parameter gradients are lazy (one
    // GEMM over all vertices at the end) and are not steps of the plan.
    assert_eq!(bwd.counts(), (3, 1), "backward plan:\n{text}");
    assert_eq!(phase_counts(bwd, Phase::Recurrent), (2, 1), "{text}");
    assert_eq!(phase_counts(bwd, Phase::Epilogue), (1, 0), "{text}");
    if let Err(e) = check_plans(&cell) {
        panic!("{e}")
    }

    // The whole function prints with both plans.
    let all = format!("{cell}");
    assert!(all.contains("vertex function `tree-lstm` (arity 2)"), "{all}");
    assert!(all.contains("forward plan:") && all.contains("backward plan:"), "{all}");
}

#[test]
fn binary_tree_lstm_backward_reads_saved_values_only() {
    let cell = binary_tree_lstm(4, 3);
    let b = cell.backward();
    // Two child slots × two states, one pulled input, four parameter terms (W, U0, U1 via
    // matmul, b via its broadcast add).
    assert_eq!(b.child_grads.len(), 4);
    assert_eq!(b.pull_grads.len(), 1);
    assert!(b.pull_grads[0].is_some());
    assert_eq!(b.param_grads.len(), 4);
    let mut params: Vec<usize> = b.param_grads.iter().map(|g| g.param()).collect();
    params.sort();
    assert_eq!(params, [0, 1, 2, 3]);
    for v in &b.saved {
        assert!(!cell.forward().node(*v).is_param, "saved values are per-vertex values");
        assert!(
            cell.forward_plan().stored[v.index()]
                || matches!(cell.forward().node(*v).op, Op::Pull { .. } | Op::Gather { .. }),
            "saved {v} is neither stored by the forward plan nor a pulled input nor a child's state"
        );
    }
    // The children's `h`, factors of products, are copied; their `c`, which F′ reads only in
    // fused kernels, are read by index where the children's memories are.
    let fwd = cell.forward();
    for (i, n) in fwd.nodes.iter().enumerate() {
        if let Op::Gather { state, .. } = n.op {
            let h = cell.states()[state].name == "h";
            assert_eq!(cell.forward_plan().stored[i], h, "gather %{i} of state {state}");
        }
    }
}

#[test]
fn child_sum_tree_lstm_plan() {
    let cell = child_sum_tree_lstm(4, 3);
    let fwd = cell.forward_plan();
    // x·W and x·Wf are hoisted; h̃·U and h̃·Uf run per task.
    assert_eq!(phase_counts(fwd, Phase::Prologue).0, 2, "{fwd}");
    assert_eq!(phase_counts(fwd, Phase::Recurrent).0, 2, "{fwd}");
    pull_matmul_in_prologue(&cell);
    if let Err(e) = check_plans(&cell) {
        panic!("{e}")
    }
}
