//! `arbor::testing`, the kit users test their cells with: the zoo's cells pass its gradient
//! check over whole graphs and its batched check over generated minibatches; a cell whose
//! gradient is wrong fails, naming the parameter; the strategies make the graphs they promise.

use arbor::testing::{check_batched, check_gradients, check_vertex, strategy, GradCheck, Tolerance, VertexCase};
use arbor::{nn, Builder, Init, InputGraph, VertexFn};
use proptest::prelude::*;

/// Graphs of `count` examples from `graph` with the seed `seed`.
fn draw(graph: impl Strategy<Value = InputGraph>, count: usize, seed: u64) -> Vec<InputGraph> {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[seed as u8; 32]);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let batch = strategy::minibatches(graph, count..=count);
    batch.new_tree(&mut runner).expect("graphs").current()
}

/// A cell whose derivative misses a path: `U` reaches `h` only through a row maximum that
/// autodiff treats as a constant, so its gradient is zero where finite differences are not.
fn detached_cell() -> VertexFn {
    let f = Builder::new("detached", 2);
    let x = f.pull("x", 3);
    let (h0, h1) = (f.gather(0, "h", 4), f.gather(1, "h", 4));
    let w = f.param("W", [3, 4], Init::Xavier);
    let u = f.param("U", [3, 4], Init::Xavier);
    let h = (x.matmul(w) + h0 + h1 + x.matmul(u).detached_max_cols().broadcast_cols(4)).tanh();
    f.scatter("h", h);
    f.push("h", h);
    f.build().unwrap()
}

#[test]
fn the_zoo_passes_the_gradient_check_over_whole_graphs() {
    let cases: Vec<(VertexFn, Vec<InputGraph>)> = vec![
        (nn::tree_lstm(3, 4).unwrap(), draw(strategy::trees(2, 1..=9), 3, 1)),
        (nn::child_sum_tree_lstm_nary(3, 4).unwrap(), draw(strategy::nary_trees(4, 1..=9), 3, 2)),
        (nn::var_lstm(3, 4).unwrap(), draw(strategy::chains(1..=7), 3, 3)),
        (nn::tree_fc(3, 4).unwrap(), draw(strategy::trees(2, 1..=9), 3, 4)),
        (nn::ggnn(3, 4).unwrap(), draw(strategy::message_passing(2..=4, 1..=2), 2, 5)),
        (
            nn::CellKind::TreeLstm.cell_with_dropout(3, 4, nn::CellDropout::all(0.3)).unwrap(),
            draw(strategy::dags(2, 1..=9), 3, 6),
        ),
    ];
    for (f, graphs) in cases {
        let report = check_gradients(&f, &graphs, &GradCheck::default()).unwrap_or_else(|e| panic!("{e}"));
        assert!(report.params > 0 && report.pulls > 0 && report.norm > 1e-2, "`{}`: {report:?}", f.name());
        assert!(report.worst <= 1.0, "`{}`: {report:?}", f.name());
    }
}

#[test]
fn a_wrong_gradient_fails_and_names_its_parameter() {
    let f = detached_cell();
    let graphs = draw(strategy::trees(2, 3..=9), 3, 7);
    let err = check_gradients(&f, &graphs, &GradCheck::default()).expect_err("`U` has no gradient");
    assert!(err.names("`U`") && !err.names("`W`"), "{err}");
    let text = err.to_string();
    assert!(text.starts_with("gradients of `detached` over 3 graphs:") && text.contains("param `U`["), "{text}");
    // The same through the reference interpreter, one vertex.
    let err = check_vertex(&f, &VertexCase::random(&f, 3, &[true, true])).expect_err("one vertex");
    assert!(err.names("param `U`") && !err.names("param `W`"), "{err}");
    // What a correct cell's gradient check returns is no error, for the same graphs; over no
    // graph, it is no pass.
    check_gradients(&nn::tree_fc(3, 4).unwrap(), &graphs, &GradCheck::default()).unwrap();
    let none = check_gradients(&nn::tree_fc(3, 4).unwrap(), &[], &GradCheck::default()).expect_err("nothing checked");
    assert!(none.to_string().contains("no vertex to check"), "{none}");
}

/// When the check over whole graphs fails, it re-checks one vertex of each kind at a time and
/// names the first whose own derivative is wrong, down to the child state: here the first child's
/// `h`, read through a stop-gradient (leaves, which have no first child, check alone).
#[test]
fn a_failing_gradient_check_names_the_vertex_and_the_child_state() {
    let f = Builder::new("stops-h0", 2);
    let x = f.pull("x", 3);
    let (h0, h1) = (f.gather(0, "h", 4), f.gather(1, "h", 4));
    let w = f.param("W", [3, 4], Init::Xavier);
    let h = (x.matmul(w) + h0.detach() + h1).tanh();
    f.scatter("h", h);
    f.push("h", h);
    let f = f.build().unwrap();
    let graphs = draw(strategy::trees(2, 3..=9), 3, 8);
    let text = check_gradients(&f, &graphs, &GradCheck::default()).expect_err("h0 stops its gradient").to_string();
    assert!(text.contains("localized: vertex") && text.contains("(children [true, "), "{text}");
    assert!(text.contains("child 0 state `h`[") && !text.contains("child 1 state"), "{text}");
}

#[test]
fn the_batched_check_reports_what_the_engine_refuses() {
    // A binary cell handed a vertex with three children: the engine's error, as a `Mismatch`.
    let graph = InputGraph::from_children(vec![vec![], vec![], vec![], vec![Some(0), Some(1), Some(2)]]).unwrap();
    let err = check_batched(&nn::tree_lstm(3, 4).unwrap(), &[graph], 1).expect_err("three children");
    assert!(err.wrong.is_empty() && err.to_string().contains("tree-lstm"), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn tree_lstm_batched_equals_reference_on_generated_minibatches(
        graphs in strategy::minibatches(strategy::trees(2, 1..=20), 1..=6),
        seed in any::<u64>(),
    ) {
        check_batched(&nn::tree_lstm(4, 3).unwrap(), &graphs, seed).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }

    #[test]
    fn child_sum_batched_equals_reference_on_nary_trees(
        graphs in strategy::minibatches(strategy::nary_trees(5, 1..=20), 1..=6),
        seed in any::<u64>(),
    ) {
        check_batched(&nn::child_sum_tree_lstm_nary(4, 3).unwrap(), &graphs, seed).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }

    #[test]
    fn trees_are_rooted_and_within_their_arity(g in strategy::trees(3, 1..=60), n in strategy::nary_trees(3, 1..=60)) {
        for t in [&g, &n] {
            prop_assert_eq!(t.roots(), vec![t.len() - 1]);
            prop_assert!((0..t.len()).all(|v| t.children(v).len() <= 3));
            // A tree: every vertex but the root is some vertex's child exactly once.
            let mut parents = vec![0; t.len()];
            for v in 0..t.len() {
                for &c in t.children(v).iter().filter(|&&c| c != arbor::graph::NO_CHILD) {
                    parents[c as usize] += 1;
                }
            }
            prop_assert!(parents[..t.len() - 1].iter().all(|&p| p == 1) && parents[t.len() - 1] == 0);
        }
        prop_assert!((0..n.len()).all(|v| !n.children(v).contains(&arbor::graph::NO_CHILD)), "n-ary trees have no empty slots");
    }

    #[test]
    fn chains_and_message_passing_graphs_have_their_sizes(len in strategy::chains(1..=30), g in strategy::message_passing(1..=6, 0..=3)) {
        prop_assert_eq!(len.roots().len(), 1);
        prop_assert!((0..len.len()).all(|v| len.children(v).len() <= 1));
        prop_assert!(g.len() % g.roots().len() == 0);
    }
}

/// A correct derivative fails where the step straddles a kink: a check that fails at ε but
/// passes at a step ten or a hundred times smaller says so rather than blaming a vertex.
#[test]
fn a_failure_at_a_kink_says_so() {
    let f = Builder::new("relu-fc", 2);
    let x = f.pull("x", 3);
    let (h0, h1) = (f.gather(0, "h", 4), f.gather(1, "h", 4));
    let w = f.param("W", [3, 4], Init::Xavier);
    let b = f.param("b", [1, 4], Init::Zeros);
    let h = (x.matmul(w) + h0 + h1 + b).relu();
    f.scatter("h", h);
    f.push("h", h);
    let f = f.build().unwrap();
    let graphs = draw(strategy::trees(2, 3..=9), 3, 9);
    // A step of 0.3 straddles the kink of many of the biases' entries.
    let coarse = GradCheck { tolerance: Tolerance { eps: 0.3, ..Tolerance::default() }, ..GradCheck::default() };
    let text = check_gradients(&f, &graphs, &coarse).expect_err("ε straddles kinks").to_string();
    assert!(text.contains("every value checks at ε = 3e-") && !text.contains("localized"), "{text}");
    check_gradients(&f, &graphs, &GradCheck::default()).unwrap_or_else(|e| panic!("{e}"));
    // A wrong derivative is no kink: it fails at every step and is localized.
    let text = check_gradients(&detached_cell(), &graphs, &coarse).expect_err("`U` has no gradient").to_string();
    assert!(!text.contains("every value checks at") && text.contains("localized"), "{text}");
}
