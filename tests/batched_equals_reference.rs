//! The batched, fused engine on the CPU backend equals the one-vertex-at-a-time reference
//! interpreter: outputs, input gradients and parameter gradients, on random forests and DAGs.

use arbor::ir::interp::run_graph;
use arbor::ir::Reduce;
use arbor::rng::Rng;
use arbor::testing::strategy::with_edge_features;
use arbor::testing::{check_batched_with, Batched};
use arbor::Pass;
use arbor::{nn, Builder, CpuBackend, Engine, Init, InputGraph, Pull, VertexFn};
use proptest::prelude::*;

fn random_rows(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.range(-1.0, 1.0)).collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    // Normwise relative error 2e-5: each entry within 2e-5 of the tensor's largest magnitude (at
    // least 1). Batched GEMMs sum thousands of rows in another order than the interpreter, so an
    // entry much smaller than its tensor's largest carries that tensor's rounding; and a random
    // function's gradient, carried back through a DAG of up to a few dozen levels of products,
    // compounds it (the regression case `fn_seed = 2596376715144221013` reaches 1.3e-5).
    let scale = want.iter().fold(1.0f32, |m, w| m.max(w.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 2e-5 * scale, "{what}[{i}]: engine {g} vs reference {w} (scale {scale})");
    }
}

/// Runs `f` on a random minibatch through the engine and through the reference, and compares.
fn check(f: VertexFn, seed: u64, graphs: usize, max_vertices: usize, dag: bool) {
    check_pulling(f, seed, graphs, max_vertices, dag, None);
}

/// [`check_batched_with`] on `graphs` random forests (DAGs when `dag`) of 1 to `max_vertices`
/// vertices each, with the pulled rows drawn from a table of `table` rows when given; panics with
/// its message.
fn check_pulling(f: VertexFn, seed: u64, graphs: usize, max_vertices: usize, dag: bool, table: Option<usize>) {
    let mut rng = Rng::new(seed);
    let arity = if f.max_children().is_none() { 0 } else { f.arity() };
    let gs: Vec<InputGraph> = (0..graphs)
        .map(|_| {
            let n = 1 + rng.below(max_vertices);
            InputGraph::random(&mut rng, n, arity, dag)
        })
        .collect();
    if let Err(e) = check_batched_with(&f, &gs, &Batched { table, ..Batched::new(seed) }) {
        panic!("{e}");
    }
}

/// A cell using the less common ops: per-vertex matrix values, matmul of two values, concat,
/// sum_cols, a same-shape parameter, div, exp, log, relu, neg, scale.
fn odd_cell() -> VertexFn {
    let f = Builder::new("odd", 2);
    let x = f.pull("x", [2, 3]);
    let s0 = f.gather(0, "s", [2, 3]);
    let s1 = f.gather(1, "s", [2, 3]);
    let m = f.pull("m", [3, 3]);
    let p = f.param("P", [2, 3], Init::Uniform(0.5));
    let w = f.param("W", [3, 3], Init::Xavier);
    let a = (x + s0).matmul(m).tanh() * p;
    let b = (s1.matmul(w).sigmoid() + p).log().relu() - s1.scale(0.5);
    let denom = a.exp() + b.sigmoid();
    let q = -(a / denom);
    let wide = f.concat(&[q, b]);
    let s = wide.slice(1, 3).tanh() + q;
    f.scatter("s", s);
    f.push("sum", wide.sum_cols());
    f.build().unwrap()
}

/// A feed-forward tree cell with GELU units: `h = gelu(x·W + h₀·U₀ + h₁·U₁ + b)`, pushing a
/// GELU of it.
fn gelu_cell() -> VertexFn {
    let f = Builder::new("gelu-cell", 2);
    let x = f.pull("x", 4);
    let (h0, h1) = (f.gather(0, "h", 5), f.gather(1, "h", 5));
    let w = f.param("W", [4, 5], Init::Xavier);
    let u0 = f.param("U0", [5, 5], Init::Xavier);
    let u1 = f.param("U1", [5, 5], Init::Xavier);
    let b = f.param("b", [1, 5], Init::Uniform(0.3));
    let h = (x.matmul(w) + h0.matmul(u0) + h1.matmul(u1) + b).gelu();
    f.scatter("h", h);
    f.push("y", (h - h0.scale(0.5)).gelu());
    f.build().unwrap()
}

/// A cell with the ops a model's head needs: pair features `[|h₀ − h₁|, h₀ ⊙ h₁]`, a scalar
/// gate broadcast over the row, the constant `1 − g`, and a pushed log-softmax.
fn head_ops_cell() -> VertexFn {
    let f = Builder::new("head-ops", 2);
    let x = f.pull("x", 4);
    let (h0, h1) = (f.gather(0, "h", 4), f.gather(1, "h", 4));
    let w = f.param("W", [8, 4], Init::Xavier);
    let v = f.param("v", [4, 1], Init::Xavier);
    let pair = (h0 - h1).abs().concat(h0 * h1);
    let g = x.matmul(v).sigmoid().broadcast_cols(4);
    let h = (g * pair.matmul(w) + (1.0 - g) * x).tanh();
    f.scatter("h", h);
    f.push("log_p", h.log_softmax());
    f.build().unwrap()
}

/// A Tree-LSTM-like cell with dropout everywhere it may go: on the pulled input, on a gathered
/// state, on a parameter (a mask per vertex), inside the recurrence and on the pushed output.
fn dropout_cell() -> VertexFn {
    let f = Builder::new("dropout-cell", 2);
    let x = f.pull("x", 4).dropout(0.3);
    let (h0, h1) = (f.gather(0, "h", 5).dropout(0.2), f.gather(1, "h", 5));
    let w = f.param("W", [4, 5], Init::Xavier);
    let u = f.param("U", [5, 5], Init::Xavier);
    let b = f.param("b", [1, 5], Init::Uniform(0.3)).dropout(0.5);
    let h = (x.matmul(w) + (h0 + h1).matmul(u) + b).tanh().dropout(0.1);
    f.scatter("h", h);
    f.push("y", h.sigmoid().dropout(0.6));
    f.build().unwrap()
}

/// Dropout batched, fused and vectorised draws the masks one graph at a time draws (each graph
/// keyed by its place in the minibatch), under every schedule; inference is the identity.
#[test]
fn dropout_masks_are_the_same_batched_and_one_graph_at_a_time() {
    for (seed, dag) in [(31, false), (32, true), (33, false)] {
        check(dropout_cell(), seed, 10, 40, dag);
    }
    check_pulling(dropout_cell(), 34, 8, 30, false, Some(5));
    check(nn::CellKind::TreeLstm.cell_with_dropout(6, 5, nn::CellDropout::all(0.5)).unwrap(), 35, 8, 30, false);
}

#[test]
fn tree_lstm_on_a_fixed_forest() {
    check(nn::tree_lstm(5, 4).unwrap(), 1, 6, 30, false);
}

/// Tasks wide enough that the CPU backend splits fused kernels between two threads.
#[test]
fn wide_tasks_split_between_threads() {
    check(nn::tree_lstm(32, 32).unwrap(), 3, 64, 40, false);
}

#[test]
fn child_sum_on_a_fixed_dag() {
    check(nn::child_sum_tree_lstm(5, 4, 3).unwrap(), 2, 5, 25, true);
}

#[test]
fn var_lstm_on_chains_and_tree_fc_on_a_forest() {
    check(nn::var_lstm(4, 3).unwrap(), 4, 6, 40, false);
    check(nn::tree_fc(4, 3).unwrap(), 5, 6, 40, false);
    check(nn::ggnn(3, 4).unwrap(), 6, 6, 40, true);
}

/// A GELU cell (the op added by following CONTRIBUTING.md): batched, fused and vectorised
/// equals the reference, with zeros from missing children kept through it.
/// A cell that stops some gradients: its gate reads the children through `detach`, its
/// update through a detached product.
fn detach_cell() -> VertexFn {
    let f = Builder::new("detach-cell", 2);
    let x = f.pull("x", 4);
    let (h0, h1) = (f.gather(0, "h", 5), f.gather(1, "h", 5));
    let w = f.param("W", [4, 5], Init::Xavier);
    let u = f.param("U", [5, 5], Init::Xavier);
    let gate = (h0.detach() - h1).sigmoid();
    let h = (x.matmul(w).detach() + gate * h0.matmul(u)).tanh();
    f.scatter("h", h);
    f.push("y", h.detach() * h1);
    f.build().unwrap()
}

/// Stop-gradients batched and fused equal the reference, forward and backward.
#[test]
fn a_cell_with_stop_gradients_on_a_forest_and_a_dag() {
    for (seed, dag) in [(31, false), (32, true)] {
        check(detach_cell(), seed, 10, 30, dag);
    }
}

#[test]
fn gelu_cell_on_a_forest_and_a_dag() {
    for (seed, dag) in [(11, false), (12, true)] {
        check(gelu_cell(), seed, 12, 40, dag);
    }
}

/// The head ops (abs, constants, broadcast columns, concat, log-softmax) batched, fused and
/// vectorised equal the reference, zeros of missing children included.
#[test]
fn head_ops_cell_on_a_forest_and_a_dag() {
    for (seed, dag) in [(13, false), (14, true)] {
        check(head_ops_cell(), seed, 12, 40, dag);
    }
}

/// The n-ary child-sum cell batched equals the reference on random forests, and equals the
/// capped child-sum cell with the same parameters when every vertex pulls its parent's input:
/// outputs, parameter gradients, and input gradients (a vertex's own plus what its children send
/// back through `x_parent`).
#[test]
fn nary_child_sum_equals_the_capped_cell() {
    check(nn::child_sum_tree_lstm_nary(5, 4).unwrap(), 21, 8, 30, false);
    let (embed, hidden) = (5, 4);
    let capped = nn::child_sum_tree_lstm(embed, hidden, 3).unwrap();
    let nary = nn::child_sum_tree_lstm_nary(embed, hidden).unwrap();
    let mut rng = Rng::new(22);
    let params: Vec<Vec<f32>> = capped
        .init_params(&mut rng)
        .into_iter()
        .map(|p| p.iter().map(|x| x + rng.range(-0.1, 0.1)).collect())
        .collect();
    let gs: Vec<InputGraph> = (0..6)
        .map(|_| {
            let n = 1 + rng.below(20);
            InputGraph::random(&mut rng, n, 3, false)
        })
        .collect();
    let mut parent = Vec::new();
    for g in &gs {
        let start = parent.len();
        parent.resize(start + g.len(), None);
        for v in 0..g.len() {
            for &c in g.children(v).iter().filter(|&&c| c != arbor::graph::NO_CHILD) {
                parent[start + c as usize] = Some(start + v);
            }
        }
    }
    let x = random_rows(&mut rng, parent.len() * embed);
    let row = |v: usize| &x[v * embed..(v + 1) * embed];
    let x_parent: Vec<f32> = parent.iter().flat_map(|p| p.map_or(vec![0.0; embed], |p| row(p).to_vec())).collect();
    let dh = random_rows(&mut rng, parent.len() * hidden);
    let refs: Vec<&InputGraph> = gs.iter().collect();
    let mut a = Engine::new(CpuBackend::new(), capped, &params).unwrap();
    let mut b = Engine::new(CpuBackend::new(), nary, &params).unwrap();
    let ha = a.run(Pass::train(&refs, &[Pull::Rows(&x)])).unwrap();
    let hb = b.run(Pass::train(&refs, &[Pull::Rows(&x), Pull::Rows(&x_parent)])).unwrap();
    assert_close("h", &hb[0], &ha[0]);
    let (ga, gb) = (a.backward(&[&dh]).unwrap(), b.backward(&[&dh]).unwrap());
    for (p, (gb, ga)) in gb.params.iter().zip(&ga.params).enumerate() {
        assert_close(&format!("parameter {p}"), gb, ga);
    }
    let mut dx = gb.pulls[0].clone();
    for (v, p) in parent.iter().enumerate() {
        if let Some(p) = *p {
            for j in 0..embed {
                dx[p * embed + j] += gb.pulls[1][v * embed + j];
            }
        }
    }
    assert_close("x", &dx, &ga.pulls[0]);
}

#[test]
fn chained_products_without_fused_steps_between() {
    let f = Builder::new("chain", 2);
    let x = f.pull("x", 4);
    let h = f.gather(0, "h", 3) + f.gather(1, "h", 3);
    let w1 = f.param("W1", [4, 5], Init::Xavier);
    let w2 = f.param("W2", [5, 3], Init::Xavier);
    let u = f.param("U", [3, 3], Init::Xavier);
    let y = x.matmul(w1).matmul(w2).matmul(u) + h.matmul(u);
    f.scatter("h", y.tanh());
    f.push("y", y);
    check(f.build().unwrap(), 8, 8, 40, false);
}

#[test]
fn odd_ops_on_a_fixed_dag() {
    check(odd_cell(), 3, 4, 20, true);
}

#[test]
fn zero_blocks_are_skipped_exactly() {
    for seed in [6, 12, 18] {
        check(nn::tree_lstm(6, 5).unwrap(), seed, 20, 60, false);
        check(nn::child_sum_tree_lstm(4, 3, 3).unwrap(), seed, 20, 60, true);
        check(odd_cell(), seed, 6, 30, true);
    }
}

/// Vertices pulling the same rows share the products over them (and the parameter gradients sum
/// per distinct row), with results equal to the reference.
#[test]
fn shared_pulled_rows_equal_reference() {
    for (seed, table) in [(1, 1), (2, 2), (3, 5), (4, 40)] {
        check_pulling(nn::tree_lstm(6, 5).unwrap(), seed, 12, 40, false, Some(table));
        check_pulling(nn::child_sum_tree_lstm(4, 3, 3).unwrap(), seed, 12, 40, true, Some(table));
        check_pulling(nn::var_lstm(4, 3).unwrap(), seed, 6, 40, false, Some(table));
        check_pulling(random_fn(seed), seed, 8, 30, true, Some(table));
    }
}

/// A Tree-LSTM (input width, hidden width, function, parameters) and a minibatch of 50 lone
/// leaves, for counting executed work.
fn fifty_leaves() -> (usize, usize, VertexFn, Vec<Vec<f32>>, Vec<InputGraph>) {
    let (embed, hidden) = (8, 6);
    let f = nn::tree_lstm(embed, hidden).unwrap();
    let params = f.init_params(&mut Rng::new(1));
    let leaves = (0..50).map(|_| InputGraph::from_children(vec![vec![]]).unwrap()).collect();
    (embed, hidden, f, params, leaves)
}

/// Executed work falls where it should: a minibatch whose vertices all pull one row runs the
/// input product over that row only, and leaves (whose children's states are zeros) run no
/// recurrent products and need only the gates their inputs can open.
#[test]
fn shared_rows_and_zero_columns_cut_executed_flops() {
    let (embed, hidden, f, params, leaves) = fifty_leaves();
    let refs: Vec<&InputGraph> = leaves.iter().collect();
    let mut rng = Rng::new(2);
    let distinct = random_rows(&mut rng, 50 * embed);
    let same: Vec<f32> = distinct[..embed].repeat(50);
    let flops = |x: &[f32]| {
        let mut e = Engine::new(CpuBackend::new(), f.clone(), &params).unwrap();
        let out = e.run(Pass::infer(&refs, &[Pull::Rows(x)])).unwrap();
        (e.flops(), out)
    };
    let (all, _) = flops(&distinct);
    let (shared, out) = flops(&same);
    // Leaves: x·W over the input, output, cell and candidate gates only (3 of 5 gate blocks).
    let product = 2 * embed * 3 * hidden;
    let fused = all - 50 * product as u64;
    assert_eq!(shared, fused + product as u64, "one shared row: one row of the product");
    let one = run_graph(&f, &params, &leaves[0], &[&same[..embed]], &[&[0.0; 6]]);
    for row in out[0].chunks(hidden) {
        assert_close("shared leaf", row, &one.outputs[0]);
    }
}

/// A looked-up input's table gradient is formed per distinct id: over leaves that all pull one
/// row, the backward pass runs `dy·Wᵀ` over that row only, where rows given per vertex run it
/// once per vertex.
#[test]
fn lookup_gradients_run_per_distinct_id() {
    let (embed, hidden, f, params, leaves) = fifty_leaves();
    let refs: Vec<&InputGraph> = leaves.iter().collect();
    let mut rng = Rng::new(3);
    let table = random_rows(&mut rng, 3 * embed);
    let ids = [1u32; 50];
    let rows = table[embed..2 * embed].repeat(50);
    let dh = random_rows(&mut rng, 50 * hidden);
    let backward = |pull: Pull| {
        let mut e = Engine::new(CpuBackend::new(), f.clone(), &params).unwrap();
        e.run(Pass::train(&refs, &[pull])).unwrap();
        let before = e.flops();
        let grads = e.backward(&[&dh]).unwrap();
        (e.flops() - before, grads)
    };
    let (per_row, by_rows) = backward(Pull::Rows(&rows));
    let (per_id, by_id) = backward(Pull::Lookup { table: &table, ids: &ids, padding: None });
    // Leaves: dy·Wᵀ over the input, output, cell and candidate gates only (3 of 5 gate blocks).
    let product = 2 * embed * 3 * hidden;
    assert_eq!(per_id, per_row - 49 * product as u64, "one distinct id: one row of dy·Wᵀ");
    let got = by_id.tables[0].as_ref().expect("a table gradient");
    assert_eq!(got.rows, [1]);
    let want: Vec<f32> = (0..embed).map(|c| by_rows.pulls[0].chunks(embed).map(|r| r[c]).sum()).collect();
    assert_close("table gradient", &got.values, &want);
    assert_close("parameter gradients", &by_id.params.concat(), &by_rows.params.concat());
}

/// Words on the inner vertices only of balanced trees (the leaves pull padding): the rows that
/// pull each distinct word lie in one run of tasks after the leaves', where the backward pass
/// reads them to sum the output gradient per word; the parameter and table gradients equal the
/// reference's.
#[test]
fn words_inside_the_trees_only_equal_reference() {
    let (embed, hidden, vocab) = (4, 3, 4);
    let f = nn::tree_lstm(embed, hidden).unwrap();
    let params = f.init_params(&mut Rng::new(5));
    let mut rng = Rng::new(6);
    let graphs: Vec<InputGraph> = (0..6).map(|k| InputGraph::balanced_binary(2 + k % 3)).collect();
    let table = random_rows(&mut rng, vocab * embed);
    let leaf = |g: &InputGraph, v: usize| g.children(v).iter().all(|&c| c == arbor::backend::NO_ROW);
    let ids: Vec<Vec<u32>> = graphs
        .iter()
        .map(|g| (0..g.len()).map(|v| if leaf(g, v) { 0 } else { 1 + rng.below(vocab - 1) as u32 }).collect())
        .collect();
    let dh: Vec<Vec<f32>> = graphs.iter().map(|g| random_rows(&mut rng, g.len() * hidden)).collect();
    let mut e = Engine::new(CpuBackend::new(), f.clone(), &params).unwrap();
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    e.run(Pass::train(&refs, &[Pull::Lookup { table: &table, ids: &ids.concat(), padding: Some(0) }])).unwrap();
    let got = e.backward(&[&dh.concat()]).unwrap();
    let mut params_want: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut table_want = vec![0.0f32; vocab * embed];
    for ((g, ids), dh) in graphs.iter().zip(&ids).zip(&dh) {
        let row = |&id: &u32| if id == 0 { vec![0.0; embed] } else { table[id as usize * embed..][..embed].to_vec() };
        let x: Vec<f32> = ids.iter().flat_map(row).collect();
        let one = run_graph(&f, &params, g, &[&x], &[dh]);
        for (w, g) in params_want.iter_mut().zip(&one.param_grads) {
            w.iter_mut().zip(g).for_each(|(w, g)| *w += g);
        }
        for (&id, g) in ids.iter().zip(one.pull_grads[0].chunks(embed)).filter(|(&id, _)| id != 0) {
            table_want[id as usize * embed..][..embed].iter_mut().zip(g).for_each(|(w, g)| *w += g);
        }
    }
    assert_close("parameter gradients", &got.params.concat(), &params_want.concat());
    let sparse = got.tables[0].as_ref().expect("a table gradient");
    let rows: Vec<f32> = sparse.rows.iter().flat_map(|&r| table_want[r as usize * embed..][..embed].to_vec()).collect();
    assert_close("table gradient", &sparse.values, &rows);
}

#[test]
fn padding_rows_get_zero_gradients_when_asked() {
    let f = nn::tree_lstm(3, 2).unwrap();
    let params = f.init_params(&mut Rng::new(1));
    let g = InputGraph::from_children(vec![vec![], vec![], vec![Some(0), Some(1)]]).unwrap();
    let x = [0.5, -0.2, 0.1, 0.3, 0.3, -0.7, 0.0, 0.0, 0.0];
    let dh = [0.0, 0.0, 0.0, 0.0, 1.0, -1.0];
    let mut plain = Engine::new(CpuBackend::new(), f.clone(), &params).unwrap();
    plain.run(Pass::train(&[&g], &[Pull::Rows(&x)])).unwrap();
    let want = plain.backward(&[&dh]).unwrap();
    let mut skipping = Engine::new(CpuBackend::new(), f, &params).unwrap();
    skipping.set_skip_padding_grads(true);
    skipping.run(Pass::train(&[&g], &[Pull::Rows(&x)])).unwrap();
    let got = skipping.backward(&[&dh]).unwrap();
    assert_eq!(got.pulls[0][..6], want.pulls[0][..6]);
    assert!(want.pulls[0][6..].iter().any(|&v| v != 0.0), "the root's input gradient is not zero without skipping");
    assert_eq!(got.pulls[0][6..], [0.0; 3]);
    assert_eq!(got.params, want.params);
}

#[test]
fn empty_slots_and_single_vertices() {
    let f = nn::tree_lstm(3, 2).unwrap();
    let mut rng = Rng::new(5);
    let params = f.init_params(&mut rng);
    let lone = InputGraph::from_children(vec![vec![]]).unwrap();
    let right_only = InputGraph::from_children(vec![vec![], vec![None, Some(0)]]).unwrap();
    let mut engine = Engine::new(CpuBackend::new(), f.clone(), &params).unwrap();
    let x: Vec<f32> = random_rows(&mut rng, 3 * 3);
    let out = engine.run(Pass::train(&[&lone, &right_only], &[Pull::Rows(&x)])).unwrap();
    let run = run_graph(&f, &params, &right_only, &[&x[3..]], &[&[0.0; 4]]);
    assert_close("right-only child", &out[0][2..], &run.outputs[0]);
}

/// A cell reading its children by every reduction over all of them: `h = tanh(x·W + mean·U +
/// max − sum/10)`, pushing `[max, mean]`.
fn reductions_cell() -> VertexFn {
    let f = Builder::new("reductions", 0);
    let x = f.pull("x", 4);
    let (sum, mean, max) = (f.gather_sum("h", 5), f.gather_mean("h", 5), f.gather_max("h", 5));
    let w = f.param("W", [4, 5], Init::Xavier);
    let u = f.param("U", [5, 5], Init::Xavier);
    let h = (x.matmul(w) + mean.matmul(u) + max - sum.scale(0.1)).tanh();
    f.scatter("h", h);
    f.push("y", max.concat(mean));
    f.build().unwrap()
}

/// A forest (a DAG when `dag`) of `n` vertices of mixed degree, up to about 50 children: half the
/// vertices hang under the next hub (every 50th vertex), most others under a random later vertex,
/// some under none (a root); in a DAG a third also under a second later vertex.
fn mixed_degree(rng: &mut Rng, n: usize, dag: bool) -> InputGraph {
    let mut children: Vec<Vec<Option<usize>>> = vec![Vec::new(); n];
    for v in 0..n.saturating_sub(1) {
        let hub = (v / 50 + 1) * 50;
        let later = |rng: &mut Rng| v + 1 + rng.below(n - v - 1);
        let parent = match (rng.below(2), rng.below(6)) {
            (0, _) if hub < n => Some(hub),
            (_, 0) => None,
            _ => Some(later(rng)),
        };
        if let Some(p) = parent {
            children[p].push(Some(v));
        }
        if dag && rng.below(3) == 0 {
            children[later(rng)].push(Some(v));
        }
    }
    InputGraph::from_children(children).unwrap()
}

/// An attentive cell of two heads: each vertex's query comes from its input, the children's
/// keys and values from their states; scores through a leaky ReLU of `slope`.
fn attention_cell(slope: f32) -> VertexFn {
    let f = Builder::new("attention", 0);
    let x = f.pull("x", [2, 4]);
    let q = x.matmul(f.param("Wq", [4, 3], Init::Xavier)).tanh();
    let att = f.gather_softmax_leaky(q, "k", "v", [2, 4], slope);
    let h = (att + x).tanh();
    f.scatter("k", h.matmul(f.param("Wk", [4, 3], Init::Xavier)));
    f.scatter("v", h);
    f.push("y", att.concat(h));
    f.build().unwrap()
}

/// Attention over 0 to 50 children, batched across vertices of different degrees, on a forest
/// and a DAG, with and without the leaky ReLU.
#[test]
fn attention_over_children_on_a_fixed_forest_and_dag() {
    for (seed, dag, slope) in [(51, false, 1.0), (52, true, 0.2)] {
        let mut rng = Rng::new(seed);
        let gs: Vec<InputGraph> = (0..5)
            .map(|_| {
                let n = 1 + rng.below(120);
                mixed_degree(&mut rng, n, dag)
            })
            .collect();
        check_batched_with(&attention_cell(slope), &gs, &Batched::new(seed)).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A cell weighing its children per edge label (R-GCN-style): labels 0, 1 and 2 summed through
/// a matrix each, label 1 also by max, and every child's mean.
fn labelled_cell() -> VertexFn {
    let f = Builder::new("labelled", 0);
    let x = f.pull("x", 4);
    let mut h = x.matmul(f.param("W", [4, 5], Init::Xavier)) + f.gather_mean("h", 5);
    for label in 0..3 {
        let u = f.param(&format!("U{label}"), [5, 5], Init::Xavier);
        h = h + f.gather_labelled(Reduce::Sum, label, "h", 5).matmul(u);
    }
    let h = (h + f.gather_labelled(Reduce::Max, 1, "h", 5)).tanh();
    f.scatter("h", h);
    f.push("y", h);
    f.build().unwrap()
}

/// [`mixed_degree`] with a random label in 0..4 on every edge (3 is read by no gather).
fn labelled(rng: &mut Rng, g: InputGraph) -> InputGraph {
    let labels = (0..g.len()).map(|v| g.children(v).iter().map(|_| rng.below(4) as u32).collect()).collect();
    g.with_edge_labels(labels).unwrap()
}

/// Children gathered per edge label, batched, equal the reference (which reads each edge's
/// label from the graph); graphs without labels read every edge as label 0.
#[test]
fn gathers_by_edge_label_on_a_fixed_forest_and_dag() {
    for (seed, dag) in [(61, false), (62, true)] {
        let mut rng = Rng::new(seed);
        let mut gs: Vec<InputGraph> = (0..5)
            .map(|_| {
                let n = 1 + rng.below(120);
                let g = mixed_degree(&mut rng, n, dag);
                labelled(&mut rng, g)
            })
            .collect();
        gs.push(mixed_degree(&mut rng, 30, dag));
        check_batched_with(&labelled_cell(), &gs, &Batched::new(seed)).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A cell weighing its children by their edges' features (an edge-conditioned sum: a matrix
/// per feature), beside every child's plain sum.
fn weighted_cell() -> VertexFn {
    let f = Builder::new("weighted", 0);
    let x = f.pull("x", 4);
    let mut h = x.matmul(f.param("W", [4, 5], Init::Xavier)) + f.gather_sum("h", 5);
    for feature in [0, 2] {
        let u = f.param(&format!("U{feature}"), [5, 5], Init::Xavier);
        h = h + f.gather_weighted(feature, "h", 5).matmul(u);
    }
    let h = h.tanh();
    f.scatter("h", h);
    f.push("y", h);
    f.build().unwrap()
}

/// Children weighed by edge features, batched, equal the reference (which reads each edge's row
/// from the graph), on graphs of mixed degree whose rows are wider than the cell reads.
#[test]
fn gathers_weighted_by_edge_features_on_a_fixed_forest_and_dag() {
    for (seed, dag) in [(71, false), (72, true)] {
        let mut rng = Rng::new(seed);
        let gs: Vec<InputGraph> = (0..5)
            .map(|_| {
                let n = 1 + rng.below(120);
                let g = mixed_degree(&mut rng, n, dag);
                with_edge_features(g, 3 + seed as usize % 2, &mut rng)
            })
            .collect();
        check_batched_with(&weighted_cell(), &gs, &Batched::new(seed)).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A graph whose edges carry too few feature values for the cell is refused, naming both.
#[test]
fn gathers_weighted_by_a_feature_the_edges_lack_are_refused() {
    let mut rng = Rng::new(73);
    let g = mixed_degree(&mut rng, 20, false);
    let g = with_edge_features(g, 2, &mut rng);
    let e = check_batched_with(&weighted_cell(), &[g], &Batched::new(73)).unwrap_err().to_string();
    assert!(e.contains("edge feature 2") && e.contains("2 feature values"), "{e}");
}

/// Sum, mean and max over 0 to 50 children, batched across vertices of different degrees.
#[test]
fn reductions_over_children_on_a_fixed_forest_and_dag() {
    for (seed, dag) in [(41, false), (42, true)] {
        let mut rng = Rng::new(seed);
        let gs: Vec<InputGraph> = (0..6)
            .map(|_| {
                let n = 1 + rng.below(120);
                mixed_degree(&mut rng, n, dag)
            })
            .collect();
        let widest = gs.iter().flat_map(|g| (0..g.len()).map(|v| g.children(v).len())).max();
        assert!(widest > Some(20), "the widest vertex has {widest:?} children");
        check_batched_with(&reductions_cell(), &gs, &Batched::new(seed)).unwrap_or_else(|e| panic!("{e}"));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn tree_lstm_batched_equals_reference(seed in any::<u64>(), graphs in 1usize..=32, max_v in 1usize..=200, dag in any::<bool>(), table in proptest::option::of(1usize..20)) {
        check_pulling(nn::tree_lstm(6, 5).unwrap(), seed, graphs, max_v, dag, table);
    }

    #[test]
    fn child_sum_batched_equals_reference(seed in any::<u64>(), graphs in 1usize..=32, max_v in 1usize..=200, dag in any::<bool>()) {
        check(nn::child_sum_tree_lstm(4, 3, 3).unwrap(), seed, graphs, max_v, dag);
    }

    #[test]
    fn dropout_batched_equals_reference(seed in any::<u64>(), graphs in 1usize..=16, max_v in 1usize..=60, dag in any::<bool>(), table in proptest::option::of(1usize..8)) {
        check_pulling(dropout_cell(), seed, graphs, max_v, dag, table);
    }

    #[test]
    fn odd_ops_batched_equals_reference(seed in any::<u64>(), graphs in 1usize..=8, max_v in 1usize..=30) {
        check(odd_cell(), seed, graphs, max_v, true);
    }

    #[test]
    fn attention_batched_equals_reference(seed in any::<u64>(), graphs in 1usize..=10, max_v in 1usize..=120, dag in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let gs: Vec<InputGraph> = (0..graphs).map(|_| { let n = 1 + rng.below(max_v); mixed_degree(&mut rng, n, dag) }).collect();
        let slope = if seed % 2 == 0 { 1.0 } else { 0.2 };
        check_batched_with(&attention_cell(slope), &gs, &Batched::new(seed)).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }

    #[test]
    fn weighted_gathers_batched_equal_reference(seed in any::<u64>(), graphs in 1usize..=10, max_v in 1usize..=120, dag in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let gs: Vec<InputGraph> = (0..graphs).map(|_| { let n = 1 + rng.below(max_v); let g = mixed_degree(&mut rng, n, dag); with_edge_features(g, 3, &mut rng) }).collect();
        check_batched_with(&weighted_cell(), &gs, &Batched::new(seed)).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }

    #[test]
    fn reductions_batched_equal_reference(seed in any::<u64>(), graphs in 1usize..=12, max_v in 1usize..=150, dag in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let gs: Vec<InputGraph> = (0..graphs).map(|_| { let n = 1 + rng.below(max_v); mixed_degree(&mut rng, n, dag) }).collect();
        check_batched_with(&reductions_cell(), &gs, &Batched::new(seed)).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}

/// A random well-typed 2-ary vertex function: a random DAG of element-wise ops, slices, concats,
/// row sums and matrix products over one pulled input and two gathered states, of random widths.
/// Every value is used: leftovers are folded into the pushed output.
fn random_fn(seed: u64) -> VertexFn {
    let mut rng = Rng::new(seed);
    let f = Builder::new("random", 2);
    let w_state = 1 + rng.below(5);
    let x = f.pull("x", 1 + rng.below(5));
    let mut pool = vec![x, f.gather(0, "s", w_state), f.gather(1, "s", w_state)];
    let mut used = vec![false; pool.len()];
    let count = std::cell::Cell::new(0);
    let param = |shape: [usize; 2]| {
        count.set(count.get() + 1);
        f.param(&format!("P{}", count.get()), shape, Init::Uniform(0.6))
    };
    for _ in 0..3 + rng.below(8) {
        let i = rng.below(pool.len());
        let a = pool[i];
        let wa = a.shape().cols();
        let v = match rng.below(8) {
            0 => match rng.below(3) {
                0 => a.tanh(),
                1 => a.sigmoid(),
                _ => -a.scale(0.7),
            },
            1 | 2 => {
                // A partner of the same width, made by a product if needed.
                let j = rng.below(pool.len());
                let b = pool[j];
                used[j] = true;
                let b = if b.shape() == a.shape() { b } else { b.matmul(param([b.shape().cols(), wa])).tanh() };
                match rng.below(3) {
                    0 => a + b,
                    1 => a - b,
                    _ => a * b,
                }
            }
            3 => a + param([1, wa]),
            4 => a.matmul(param([wa, 1 + rng.below(5)])),
            5 if wa > 1 => {
                let start = rng.below(wa - 1);
                a.slice(start, 1 + rng.below(wa - start))
            }
            6 => {
                let j = rng.below(pool.len());
                used[j] = true;
                f.concat(&[a, pool[j]])
            }
            _ => a.sum_cols().tanh(),
        };
        used[i] = true;
        pool.push(v);
        used.push(false);
    }
    // Fold every unused value into a scalar pushed output; project the last value onto the state.
    let last = *pool.last().unwrap();
    let state = last.matmul(param([last.shape().cols(), w_state])).tanh();
    let mut out = state.sum_cols();
    for (v, u) in pool.iter().zip(&used).take(pool.len() - 1) {
        if !u {
            out = out + v.sum_cols();
        }
    }
    f.scatter("s", state);
    f.push("y", out);
    f.build().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn random_functions_batched_equal_reference(fn_seed in any::<u64>(), seed in any::<u64>(), graphs in 1usize..=12, max_v in 1usize..=30, dag in any::<bool>(), table in proptest::option::of(1usize..8)) {
        check_pulling(random_fn(fn_seed), seed, graphs, max_v, dag, table);
    }
}

/// Sums of two sibling products, which the engine forms by accumulating the second into the
/// first's output: directly, inside a longer sum, with the partial sum also read elsewhere
/// (where it must not), and on vertices with only one of the two children.
#[test]
fn sibling_products_summed_in_place() {
    for variant in 0..3 {
        let f = Builder::new("siblings", 2);
        let x = f.pull("x", 4);
        let (h0, h1) = (f.gather(0, "h", 3), f.gather(1, "h", 3));
        let w = f.param("W", [4, 3], Init::Xavier);
        let u0 = f.param("U0", [3, 3], Init::Xavier);
        let u1 = f.param("U1", [3, 3], Init::Xavier);
        let (p0, p1) = (h0.matmul(u0), h1.matmul(u1));
        let h = match variant {
            0 => (p1 + p0).tanh() + x.matmul(w),
            1 => (x.matmul(w) + p0 + p1).sigmoid(),
            _ => {
                let partial = x.matmul(w) + p0;
                (partial + p1).tanh() * partial
            }
        };
        f.scatter("h", h);
        f.push("h", h);
        let f = f.build().unwrap();
        for seed in [1, 2, 3] {
            check(f.clone(), seed, 12, 50, false);
        }
        let mut rng = Rng::new(9);
        let params = f.init_params(&mut rng);
        let right_only = InputGraph::from_children(vec![vec![], vec![None, Some(0)]]).unwrap();
        let left_only = InputGraph::from_children(vec![vec![], vec![Some(0), None]]).unwrap();
        let mut engine = Engine::new(CpuBackend::new(), f.clone(), &params).unwrap();
        let x = random_rows(&mut rng, 4 * 4);
        let out = engine.run(Pass::train(&[&right_only, &left_only], &[Pull::Rows(&x)])).unwrap();
        for (g, graph) in [&right_only, &left_only].into_iter().enumerate() {
            let run = run_graph(&f, &params, graph, &[&x[8 * g..8 * g + 8]], &[&[0.0; 6]]);
            assert_close("one child", &out[0][6 * g..6 * g + 6], &run.outputs[0]);
        }
    }
}
