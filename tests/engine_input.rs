//! The engine on bad input (typed errors naming the place), on deep graphs (no recursion), and
//! in steady state (no allocation after the first minibatch of a size).

use arbor::rng::Rng;
use arbor::Pass;
use arbor::{nn, Backend, CpuBackend, Engine, Error, InputGraph, Pull};

fn engine(embed: usize, hidden: usize) -> Engine<CpuBackend> {
    let f = nn::tree_lstm(embed, hidden).unwrap();
    let params = f.init_params(&mut Rng::new(1));
    Engine::new(CpuBackend::new(), f, &params).unwrap()
}

#[test]
fn wrong_input_length_names_the_input() {
    let mut e = engine(3, 2);
    let g = InputGraph::from_children(vec![vec![], vec![Some(0)]]).unwrap();
    let err = e.run(Pass::train(&[&g], &[Pull::Rows(&[0.0; 5])])).unwrap_err();
    assert!(matches!(err, Error::Input { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("input `x`") && msg.contains("6 values") && msg.contains("got 5"), "{msg}");
    let err = e.run(Pass::train(&[&g], &[])).unwrap_err();
    assert!(err.to_string().contains("expected 1"), "{err}");
}

#[test]
fn chosen_rows_past_the_minibatch_are_refused() {
    let mut e = engine(3, 2);
    let g = InputGraph::from_children(vec![vec![], vec![Some(0)]]).unwrap();
    let x = [0.5; 6];
    let err = e.run(Pass::infer(&[&g], &[Pull::Rows(&x)]).rows(&[1, 2])).unwrap_err();
    assert!(matches!(err, Error::Input { .. }), "{err:?}");
    assert!(err.to_string().contains("vertex indices below 2") && err.to_string().contains("vertex 2"), "{err}");
    let root = e.run(Pass::infer(&[&g], &[Pull::Rows(&x)]).rows(&[1])).unwrap();
    assert_eq!(root[0], e.run(Pass::infer(&[&g], &[Pull::Rows(&x)])).unwrap()[0][2..4]);
}

#[test]
fn bad_gradient_rows_are_refused() {
    let mut e = engine(3, 2);
    let g = InputGraph::from_children(vec![vec![], vec![Some(0)]]).unwrap();
    let x = [0.5; 6];
    // The rows of a training pass are where its backward pass takes the gradients.
    let mut err = |rows: &[usize], grad: &[f32]| {
        let pass = e.run(Pass::train(&[&g], &[Pull::Rows(&x)]).rows(rows));
        pass.and_then(|_| e.backward(&[grad])).unwrap_err().to_string()
    };
    let msg = err(&[1, 1], &[1.0; 4]);
    assert!(msg.contains("each vertex at most once") && msg.contains("vertex 1 twice"), "{msg}");
    let msg = err(&[2], &[1.0; 2]);
    assert!(msg.contains("vertex indices below 2") && msg.contains("vertex 2"), "{msg}");
    let msg = err(&[1], &[1.0; 3]);
    assert!(
        msg.contains("gradient of output `h`") && msg.contains("2 values (1 rows × 2)") && msg.contains("got 3"),
        "{msg}"
    );
    let msg = e.run(Pass::train(&[&g], &[Pull::Rows(&x)]).rows(&[0, 5])).unwrap_err().to_string();
    assert!(msg.contains("output rows") && msg.contains("vertex 5"), "{msg}");
}

#[test]
fn bad_lookups_name_the_input_and_vertex() {
    let mut e = engine(3, 2);
    let g = InputGraph::from_children(vec![vec![], vec![], vec![Some(0), Some(1)]]).unwrap();
    let table = [0.5; 12];
    let mut run = |table: &[f32], ids: &[u32], padding| {
        e.run(Pass::train(&[&g], &[Pull::Lookup { table, ids, padding }])).unwrap_err().to_string()
    };
    let msg = run(&table, &[0, 1], None);
    assert!(msg.contains("ids of input `x`") && msg.contains("3 (one per vertex)") && msg.contains("got 2"), "{msg}");
    let msg = run(&table[..11], &[0, 1, 2], None);
    assert!(msg.contains("table of input `x`") && msg.contains("rows of 3 values"), "{msg}");
    let msg = run(&table, &[0, 4, 1], None);
    assert!(msg.contains("id of vertex 1") && msg.contains("below 4") && msg.contains("got 4"), "{msg}");
    // The padding id pulls zeros wherever it lies.
    e.run(Pass::train(&[&g], &[Pull::Lookup { table: &table, ids: &[0, 1, 99], padding: Some(99) }])).unwrap();
}

#[test]
fn too_many_children_names_graph_and_vertex() {
    let mut e = engine(3, 2);
    let ok = InputGraph::from_children(vec![vec![]]).unwrap();
    let wide = InputGraph::from_children(vec![vec![], vec![], vec![], vec![Some(0), Some(1), Some(2)]]).unwrap();
    let err = e.run(Pass::train(&[&ok, &wide], &[Pull::Rows(&[0.0; 15])])).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Graph { .. }));
    assert!(
        msg.contains("#1") && msg.contains("vertex 3") && msg.contains("3 child slots") && msg.contains("at most 2"),
        "{msg}"
    );
}

#[test]
fn cycles_and_bad_child_indices_are_refused() {
    let err = InputGraph::from_children(vec![vec![Some(2)], vec![Some(0)], vec![Some(1)]]).unwrap_err();
    assert!(err.to_string().contains("lies on a cycle"), "{err}");
    let err = InputGraph::from_children(vec![vec![Some(0)]]).unwrap_err();
    assert!(err.to_string().contains("cycle"), "{err}");
    let err = InputGraph::from_children(vec![vec![], vec![Some(7)]]).unwrap_err();
    assert!(err.to_string().contains("vertex 1 has child 7"), "{err}");
    let err = InputGraph::from_parents(&[None, Some(9)]).unwrap_err();
    assert!(err.to_string().contains("parent 9"), "{err}");
}

#[test]
fn backward_checks_gradient_lengths() {
    let mut e = engine(3, 2);
    let g = InputGraph::chain(3);
    e.run(Pass::train(&[&g], &[Pull::Rows(&[0.5; 9])])).unwrap();
    let err = e.backward(&[&[1.0; 5]]).unwrap_err();
    assert!(err.to_string().contains("gradient of output `h`"), "{err}");
}

#[test]
fn steady_state_allocates_nothing() {
    let mut e = engine(4, 3);
    let mut rng = Rng::new(3);
    let graphs: Vec<InputGraph> = (0..5).map(|i| InputGraph::chain(2 + i)).collect();
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    let x: Vec<f32> = (0..20 * 4).map(|_| rng.uniform()).collect();
    let dh = vec![1.0; 20 * 3];
    e.run(Pass::train(&refs, &[Pull::Rows(&x)])).unwrap();
    e.backward(&[&dh]).unwrap();
    let after_first = e.backend().allocations();
    for _ in 0..3 {
        e.run(Pass::train(&refs, &[Pull::Rows(&x)])).unwrap();
        e.backward(&[&dh]).unwrap();
    }
    assert_eq!(e.backend().allocations(), after_first, "a steady-state step allocated device memory");
    // A smaller minibatch reuses the same arena too.
    e.run(Pass::train(&refs[..2], &[Pull::Rows(&x[..5 * 4])])).unwrap();
    assert_eq!(e.backend().allocations(), after_first);
}

#[test]
fn chain_of_100k_vertices_runs_forward_and_backward() {
    let mut e = engine(2, 2);
    let n = 100_000;
    let g = InputGraph::chain(n);
    let x = vec![0.1; n * 2];
    let h = e.run(Pass::train(&[&g], &[Pull::Rows(&x)])).unwrap();
    assert_eq!(h[0].len(), n * 2);
    assert!(h[0].iter().all(|v| v.is_finite()));
    let mut dh = vec![0.0; n * 2];
    dh[(n - 1) * 2] = 1.0; // gradient at the root only
    let grads = e.backward(&[&dh]).unwrap();
    // The root's own input gets gradient; the gradient vanishes along the chain but stays finite.
    assert!(grads.pulls[0][(n - 1) * 2..].iter().any(|&g| g != 0.0));
    assert!(grads.pulls[0].iter().all(|g| g.is_finite()));
}

#[test]
fn tree_of_100k_leaves_runs_forward_and_backward() {
    let mut e = engine(2, 2);
    let g = InputGraph::balanced_binary(100_000);
    let n = g.len();
    let x = vec![0.1; n * 2];
    e.run(Pass::train(&[&g], &[Pull::Rows(&x)])).unwrap();
    assert_eq!(e.schedule().tasks.len(), 18); // ⌈log2 100000⌉ + 1 heights
    let grads = e.backward(&[&vec![1e-3; n * 2]]).unwrap();
    assert!(grads.params.iter().flatten().all(|g| g.is_finite()));
}

#[test]
fn unreachable_vertices_are_refused() {
    let err = InputGraph::from_parents(&[None, Some(0), None]).unwrap_err();
    assert!(err.to_string().contains("vertex 2 is not reachable from the root 0"), "{err}");
    let err = InputGraph::from_edges(4, &[(3, 0), (3, 1)], Some(3)).unwrap_err();
    assert!(err.to_string().contains("vertex 2 is not reachable from the root 3"), "{err}");
    let err = InputGraph::from_edges(2, &[(5, 0)], None).unwrap_err();
    assert!(err.to_string().contains("parent 5"), "{err}");
    let g = InputGraph::from_edges(3, &[(2, 1), (2, 0)], Some(2)).unwrap();
    assert_eq!(g.children(2), &[1, 0]);
    assert_eq!(g.roots(), vec![2]);
    assert!(InputGraph::from_parents(&[Some(0)]).is_err());
}

/// A minibatch planned ahead (on another thread) runs exactly as one scheduled in `forward`;
/// its graphs are checked when planned, and a plan is refused by any other engine.
#[test]
fn planned_ahead_equals_scheduled_in_forward() {
    let mut rng = Rng::new(12);
    let graphs: Vec<InputGraph> = (0..6).map(|k| InputGraph::random(&mut rng, 4 + 3 * k, 2, false)).collect();
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    let vertices: usize = graphs.iter().map(InputGraph::len).sum();
    let x: Vec<f32> = (0..vertices * 3).map(|_| rng.range(-1.0, 1.0)).collect();
    let (mut direct, mut ahead) = (engine(3, 2), engine(3, 2));
    let want = direct.run(Pass::train(&refs, &[Pull::Rows(&x)])).unwrap();
    let planner = ahead.planner();
    let planned = std::thread::scope(|s| s.spawn(|| planner.plan(&refs)).join().unwrap()).unwrap();
    assert_eq!(ahead.run(Pass::planned(planned, &[Pull::Rows(&x)])).unwrap(), want);
    let dy = vec![0.5; want[0].len()];
    assert_eq!(ahead.backward(&[&dy]).unwrap(), direct.backward(&[&dy]).unwrap());

    let wide = InputGraph::from_children(vec![vec![], vec![], vec![], vec![Some(0), Some(1), Some(2)]]).unwrap();
    let err = planner.plan(&[&graphs[0], &wide]).err().expect("a graph too wide for the cell");
    assert!(err.to_string().contains("#1"), "{err}");
    let other = planner.plan(&refs).unwrap();
    assert!(direct.run(Pass::planned(other, &[Pull::Rows(&x)])).is_err(), "another engine's plan was accepted");
}
