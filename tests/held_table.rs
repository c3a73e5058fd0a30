//! A table the engine holds (word vectors kept where the engine computes): inputs pull its rows
//! on the backend, their gradients are summed into one gradient of the rows any pulled, and the
//! table is updated there with its optimizer state beside it — as a table looked up from the
//! host and updated by the host optimizer, to the bit.

use arbor::backend::NO_ROW;
use arbor::dist::data_parallel::merge;
use arbor::engine::Counts;
use arbor::layers::SparseGrad;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::{nn, CpuBackend, Engine, InputGraph, Pass, Pull, VertexFn};

/// Random trees of `n` vertices each (binary arity at most).
fn trees(rng: &mut Rng, count: usize) -> Vec<InputGraph> {
    (0..count).map(|k| InputGraph::random(rng, 3 + 4 * k, 2, false)).collect()
}

/// Five random trees from `seed` and a random table of `vocab` rows of `embed`, with the
/// generator drawn on.
fn minibatch(seed: u64, vocab: usize, embed: usize) -> (Rng, Vec<InputGraph>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let graphs = trees(&mut rng, 5);
    let table = (0..vocab * embed).map(|_| rng.range(-1.0, 1.0)).collect();
    (rng, graphs, table)
}

/// An engine for `f` with parameters from `seed`.
fn engine(f: &VertexFn, seed: u64) -> Engine<CpuBackend> {
    Engine::new(CpuBackend::new(), f.clone(), &f.init_params(&mut Rng::new(seed))).unwrap()
}

/// The child-sum cell pulls a word and its parent's word from one table: held, the two
/// gradients come back summed per row, as the host's lookups merged; the outputs are the same.
#[test]
fn two_inputs_from_the_held_table_sum_their_gradients() {
    let (embed, hidden, vocab) = (4, 3, 11);
    let f = nn::child_sum_tree_lstm_nary(embed, hidden).unwrap();
    let (mut rng, graphs, table) = minibatch(46, vocab, embed);
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    let n: usize = graphs.iter().map(InputGraph::len).sum();
    let words: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
    let parents: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
    let padding = Some(0);
    let push: Vec<f32> = (0..n * hidden).map(|_| rng.range(-1.0, 1.0)).collect();
    let mut host = engine(&f, 1);
    let looked =
        [Pull::Lookup { table: &table, ids: &words, padding }, Pull::Lookup { table: &table, ids: &parents, padding }];
    let want_out = host.run(Pass::train(&refs, &looked)).unwrap();
    let want = host.backward(&[&push]).unwrap();
    let want_grad = merge(&[want.tables[0].clone().unwrap(), want.tables[1].clone().unwrap()], embed);
    let mut held = engine(&f, 1);
    held.set_table(&table, embed).unwrap();
    let pulls = [Pull::Held { ids: &words, padding }, Pull::Held { ids: &parents, padding }];
    let out = held.run(Pass::train(&refs, &pulls)).unwrap();
    let got = held.backward(&[&push]).unwrap();
    assert_eq!(out, want_out);
    assert_eq!(got.params, want.params);
    assert!(got.tables.iter().all(Option::is_none));
    let grad = held.held_table_grad().unwrap();
    assert_eq!(grad.rows, want_grad.rows);
    for (g, w) in grad.values.iter().zip(&want_grad.values) {
        assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{g} vs {w}");
    }
}

/// One held input (the Tree-LSTM's word): its gradient summed per distinct word is the table's
/// gradient as it stands, the input-gradient product writing it whole — nothing is zeroed,
/// copied or scattered for it — and the same bits as a table looked up from the host.
#[test]
fn one_held_input_forms_the_table_gradient_in_place() {
    let (embed, hidden, vocab) = (4, 3, 13);
    let f = nn::tree_lstm(embed, hidden).unwrap();
    let (mut rng, graphs, table) = minibatch(48, vocab, embed);
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    let n: usize = graphs.iter().map(InputGraph::len).sum();
    // Words on the leaves only (padding elsewhere), as in SST's trees.
    let leaf = |g: &InputGraph, v: usize| g.children(v).iter().all(|&c| c == NO_ROW);
    let vertices = graphs.iter().flat_map(|g| (0..g.len()).map(move |v| (g, v)));
    let ids: Vec<u32> = vertices.map(|(g, v)| if leaf(g, v) { 1 + rng.below(vocab - 1) as u32 } else { 0 }).collect();
    let push: Vec<f32> = (0..n * hidden).map(|_| rng.range(-1.0, 1.0)).collect();
    let mut host = engine(&f, 3);
    host.run(Pass::train(&refs, &[Pull::Lookup { table: &table, ids: &ids, padding: Some(0) }])).unwrap();
    let want = host.backward(&[&push]).unwrap();
    let mut held = engine(&f, 3);
    held.set_table(&table, embed).unwrap();
    held.run(Pass::train(&refs, &[Pull::Held { ids: &ids, padding: Some(0) }])).unwrap();
    let got = held.backward(&[&push]).unwrap();
    assert_eq!(got.params, want.params);
    assert_eq!(Some(held.held_table_grad().unwrap()), want.tables[0]);
    let (ran, host_ran) = (Counts::of(held.lowering().launches()), Counts::of(host.lowering().launches()));
    assert_eq!(ran, host_ran, "a held table's gradient costs no launch of its own");
    // Zeroed: the two states' gradients and the input weight's (its product over the leaves
    // writes three of its five gate blocks); the table gradient's product writes it whole.
    let text: String = held.lowering().launches().iter().map(|l| format!("{l}\n")).collect();
    assert_eq!(ran.fills, f.states().len() + 1, "{text}");
}

/// Three steps of Adagrad on the held table's rows give the host optimizer's bits on a host
/// table; the state reads back as the host's slot and, written into another engine, goes on
/// the same way; a gradient set from the host (a sum across workers) is the one applied, and
/// its sum of squares and scaling are the host's.
#[test]
fn the_held_table_is_updated_as_the_host_optimizer_updates_it() {
    let (embed, hidden, vocab) = (3, 2, 9);
    let f = nn::tree_lstm(embed, hidden).unwrap();
    let mut rng = Rng::new(47);
    let graphs = trees(&mut rng, 4);
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    let n: usize = graphs.iter().map(InputGraph::len).sum();
    let mut table: Vec<f32> = (0..vocab * embed).map(|_| rng.range(-1.0, 1.0)).collect();
    let mut held = engine(&f, 2);
    held.set_table(&table, embed).unwrap();
    let config = Config { weight_decay: 0.01, ..Config::new(Rule::Adagrad, 0.1) };
    let mut opt = Optimizer::new(config);
    let mut copy: Option<Engine<CpuBackend>> = None;
    for step in 0..3 {
        let ids: Vec<u32> = (0..n).map(|_| 1 + rng.below(vocab - 1) as u32).collect();
        let push: Vec<f32> = (0..n * hidden).map(|_| rng.range(-1.0, 1.0)).collect();
        held.run(Pass::train(&refs, &[Pull::Held { ids: &ids, padding: Some(0) }])).unwrap();
        held.backward(&[&push]).unwrap();
        let g = held.held_table_grad().unwrap();
        opt.begin_step();
        let u = opt.update_of("embedding");
        if let Some(other) = copy.as_mut() {
            other.set_table_grad(&g).unwrap();
            other.optimize_table(u).unwrap();
        }
        held.optimize_table(u).unwrap();
        opt.sparse("embedding", &mut table, embed, &g);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&held.table().unwrap()), bits(&table), "step {step}");
        let [m, v] = held.table_state().unwrap().expect("state after an update");
        assert_eq!((&m, &v), (&opt.slots["embedding"].m, &opt.slots["embedding"].v));
        match copy.as_ref() {
            Some(other) => assert_eq!(bits(&other.table().unwrap()), bits(&table), "the copy at step {step}"),
            None => {
                let mut other = engine(&f, 2);
                other.set_table(&table, embed).unwrap();
                other.set_table_state(Some(&[m, v])).unwrap();
                copy = Some(other);
            }
        }
    }
    // A gradient from the host replaces the pass's until the next backward pass.
    let g = SparseGrad { rows: vec![2, 5], values: vec![3.0, 0.0, 0.0, 0.0, 4.0, 0.0] };
    held.set_table_grad(&g).unwrap();
    assert_eq!(held.grad_sum_squares().unwrap().1, 25.0);
    held.scale_table_grad(0.5).unwrap();
    assert_eq!(
        held.held_table_grad().unwrap(),
        SparseGrad { rows: vec![2, 5], values: vec![1.5, 0.0, 0.0, 0.0, 2.0, 0.0] }
    );
}

/// Pulling from a table the engine does not hold, an id past it, a table of partial rows, a
/// gradient of the wrong size and state of the wrong size are errors naming what is wrong.
#[test]
fn a_held_table_refuses_what_does_not_fit() {
    let f = nn::tree_lstm(2, 2).unwrap();
    let mut e = engine(&f, 3);
    let g = InputGraph::from_children(vec![vec![], vec![Some(0)]]).unwrap();
    let err = e.run(Pass::train(&[&g], &[Pull::Held { ids: &[1, 0], padding: None }])).unwrap_err().to_string();
    assert!(err.contains("Engine::set_table") && err.contains("none held"), "{err}");
    e.set_table(&[0.5; 8], 2).unwrap();
    let err = e.run(Pass::train(&[&g], &[Pull::Held { ids: &[1, 4], padding: None }])).unwrap_err().to_string();
    assert!(err.contains("vertex 1") && err.contains("below 4"), "{err}");
    assert!(e.set_table(&[0.5; 7], 2).unwrap_err().to_string().contains("rows of 2 values"));
    let bad = SparseGrad { rows: vec![1], values: vec![1.0] };
    assert!(e.set_table_grad(&bad).unwrap_err().to_string().contains("1 rows of 2 values"));
    assert!(e.set_table_state(Some(&[vec![0.0; 3], vec![0.0; 8]])).unwrap_err().to_string().contains("8 values"));
}
