//! Two engines passing rows on the backend ([`Pull::Linked`], [`Engine::run_linked`],
//! [`Engine::backward_linked`]) compute what the same passes through the host do, bitwise: a
//! Tree-LSTM's chosen vertices pulled, in a chosen order, by a second cell that reads two of
//! them per vertex, its outputs set aside and read at the end, and its input gradients given
//! back as the first's output gradient. Bad links are typed errors, never panics.

use arbor::engine::LinkedRows;
use arbor::rng::Rng;
use arbor::{nn, Builder, CpuBackend, Engine, Error, Init, InputGraph, Pass, Pull};

/// A Tree-LSTM (embed 3, hidden 4) and a reader of two of its rows per vertex.
fn engines() -> (Engine<CpuBackend>, Engine<CpuBackend>) {
    let mut rng = Rng::new(7);
    let cell = nn::tree_lstm(3, 4).unwrap();
    let lower = Engine::new(CpuBackend::new(), cell.clone(), &cell.init_params(&mut rng)).unwrap();
    let f = Builder::new("reader", 0);
    let (a, b) = (f.pull("a", 4), f.pull("b", 4));
    let w = f.param("W", [4, 2], Init::Xavier);
    f.push("y", (a.matmul(w) * b.matmul(w)).tanh());
    f.push("s", (a + b).sum_cols());
    let f = f.build().unwrap();
    let upper = Engine::new(CpuBackend::new(), f.clone(), &f.init_params(&mut rng)).unwrap();
    (lower, upper)
}

fn graphs() -> Vec<InputGraph> {
    vec![
        InputGraph::from_children(vec![vec![], vec![], vec![Some(0), Some(1)]]).unwrap(),
        InputGraph::from_children(vec![vec![], vec![], vec![Some(0), Some(1)], vec![], vec![Some(3), Some(2)]])
            .unwrap(),
    ]
}

#[test]
fn linked_passes_equal_passes_through_the_host() {
    let gs = graphs();
    let refs: Vec<&InputGraph> = gs.iter().collect();
    let x: Vec<f32> = (0..8 * 3).map(|i| (i as f32 * 0.37).sin()).collect();
    // Vertices read: (4, 2) and (7, 0) — the second graph's root first, out of order.
    let (a, b) = ([4usize, 7], [2usize, 0]);
    let chosen = [4usize, 7, 2, 0];
    let dy: Vec<f32> = (0..2 * 2).map(|i| 0.5 - i as f32 * 0.3).collect();
    let ds = [1.0, -2.0];

    // Through the host.
    let (mut lower, mut upper) = engines();
    let h = lower.run(Pass::train(&refs, &[Pull::Rows(&x)]).rows(&chosen)).unwrap().swap_remove(0);
    let one = InputGraph::isolated(1);
    let ones = [&one, &one];
    let out = upper.run(Pass::train(&ones, &[Pull::Rows(&h[..8]), Pull::Rows(&h[8..])])).unwrap();
    let g = upper.backward(&[&dy, &ds]).unwrap();
    let dh = [g.pulls[0].clone(), g.pulls[1].clone()].concat();
    let host = lower.backward(&[&dh]).unwrap();

    // On the backend.
    let (mut lower, mut upper) = engines();
    let got = lower.run(Pass::train(&refs, &[Pull::Rows(&x)]).rows(&chosen).kept()).unwrap();
    assert!(got.iter().all(Vec::is_empty), "a kept pass reads nothing back");
    let (la, lb) = (lower.output_rows(0, &a).unwrap(), lower.output_rows(0, &b).unwrap());
    upper.run_linked(Pass::train(&ones, &[Pull::Linked(&la), Pull::Linked(&lb)]).kept(), &mut lower).unwrap();
    upper.keep_outputs().unwrap();
    let g = upper.backward(&[&dy, &ds]).unwrap();
    assert!(g.pulls.iter().all(Vec::is_empty), "linked inputs' gradients stay on the backend");
    let pieces = [upper.input_grad_rows(0, &[0, 1]).unwrap(), upper.input_grad_rows(1, &[0, 1]).unwrap()];
    let mut linked = lower.backward_linked(&mut upper, &[&pieces]).unwrap();
    linked.params = lower.param_grads().unwrap();
    assert_eq!(upper.read_kept_outputs().unwrap(), out, "the outputs set aside");
    assert_eq!(linked.pulls, host.pulls, "the lower engine's input gradients");
    assert_eq!(linked.params, host.params, "the lower engine's parameter gradients");
}

#[test]
fn bad_links_are_errors() {
    let gs = graphs();
    let refs: Vec<&InputGraph> = gs.iter().collect();
    let x = vec![0.1; 8 * 3];
    let (mut lower, mut upper) = engines();
    lower.run(Pass::train(&refs, &[Pull::Rows(&x)]).rows(&[4, 7]).kept()).unwrap();
    let one = InputGraph::isolated(1);
    let ones = [&one, &one];
    let rows = lower.output_rows(0, &[4, 7]).unwrap();
    // Linked rows without a linked engine.
    let err = upper.run(Pass::train(&ones, &[Pull::Linked(&rows), Pull::Linked(&rows)])).unwrap_err();
    assert!(matches!(err, Error::Input { .. }) && err.to_string().contains("linked engine"), "{err}");
    // Rows past the other engine's arena.
    let far = LinkedRows { at: rows.at, rows: vec![0, 1 << 20] };
    let err = upper.run_linked(Pass::train(&ones, &[Pull::Linked(&far), Pull::Linked(&rows)]), &mut lower).unwrap_err();
    assert!(err.to_string().contains("rows inside the linked engine's arena"), "{err}");
    // One row per vertex.
    let short = LinkedRows { at: rows.at, rows: vec![0] };
    let err =
        upper.run_linked(Pass::train(&ones, &[Pull::Linked(&short), Pull::Linked(&rows)]), &mut lower).unwrap_err();
    assert!(err.to_string().contains("one per vertex"), "{err}");
    // Vertices past the pass, and a gradient of too few rows.
    assert!(lower.output_rows(0, &[8]).unwrap_err().to_string().contains("vertex 8"));
    upper.run_linked(Pass::train(&ones, &[Pull::Linked(&rows), Pull::Linked(&rows)]), &mut lower).unwrap();
    upper.backward(&[&[0.1; 4], &[1.0; 2]]).unwrap();
    let piece = [upper.input_grad_rows(0, &[0]).unwrap()];
    let err = lower.backward_linked(&mut upper, &[&piece]).unwrap_err();
    assert!(err.to_string().contains("2 linked rows (one per vertex)"), "{err}");
    // The engines still work after the errors.
    assert_eq!(lower.run(Pass::infer(&refs, &[Pull::Rows(&x)])).unwrap()[0].len(), 8 * 4);
}
