//! Finite-difference gradient checks of the reductions over a vertex's children — mean, max,
//! attention (`gather_softmax`) and gathers by edge label — through the reference interpreter,
//! with the objective and tolerances of `gradcheck.rs` (see `common/mod.rs`), and their values
//! against hand computation.

mod common;

use arbor_core::ir::{Builder, Init, Reduce, VertexFn};
use arbor_core::testing::VertexCase;
use common::{assert_close, assert_gradients, check, output};

/// A cell reading its children's `h` by mean and by max, and scattering `h` from them.
fn mean_max_fn() -> VertexFn {
    let f = Builder::new("gather-mean-max", 0);
    let x = f.pull("x", 3);
    let (mean, max) = (f.gather_mean("h", 3), f.gather_max("h", 3));
    let u = f.param("U", [3, 3], Init::Xavier);
    let h = (x + mean.matmul(u) + max * mean).tanh();
    f.scatter("h", h);
    f.push("y", f.concat(&[mean, max]));
    f.build().unwrap()
}

#[test]
fn gather_mean_and_gather_max() {
    let f = mean_max_fn();
    assert_eq!(f.max_children(), None);
    let case = VertexCase::random(&f, 21, &[true, false, true, true]);
    let vals = case.forward(&f);
    let kids: Vec<&[f32]> = case.children.iter().flatten().map(|c| c[0].as_slice()).collect();
    let mean: Vec<f32> = (0..3).map(|e| kids.iter().map(|k| k[e]).sum::<f32>() / 3.0).collect();
    let max: Vec<f32> = (0..3).map(|e| kids.iter().map(|k| k[e]).fold(f32::MIN, f32::max)).collect();
    assert_close(&output(&f, &vals, "y")[..3], &mean);
    assert_close(&output(&f, &vals, "y")[3..], &max);
    // The max's gradient reaches, in each column, only the child holding the largest value; the
    // mean's reaches every child, divided by their number.
    let only_y = VertexCase {
        state_grads: vec![vec![0.0; 3]],
        push_grads: vec![vec![0.0, 0.0, 0.0, 1.0, 2.0, 3.0]],
        ..case.clone()
    };
    let (grads, _) = only_y.gradients(&f);
    for (k, kid) in case.children.iter().enumerate() {
        let Some(kid) = kid else { continue };
        let g = &grads.children[k].as_ref().unwrap()[0];
        for e in 0..3 {
            assert_eq!(g[e], if kid[0][e] == max[e] { (e + 1) as f32 } else { 0.0 }, "child {k} column {e}");
        }
    }
    let only_mean = VertexCase { push_grads: vec![vec![3.0, 6.0, 9.0, 0.0, 0.0, 0.0]], ..only_y };
    let (grads, _) = only_mean.gradients(&f);
    for g in grads.children.iter().flatten() {
        assert_close(&g[0], &[1.0, 2.0, 3.0]);
    }
    // A leaf: zeros.
    let leaf = VertexCase::random(&f, 22, &[]);
    assert!(output(&f, &leaf.forward(&f), "y").iter().all(|&v| v == 0.0));
    for present in [&[][..], &[true], &[true, true, true], &[true, false, true, true]] {
        check(&f, present);
    }
}

/// Ties in a max: the first child (in slot order) holding the largest value gets the gradient.
#[test]
fn gather_max_ties_go_to_the_first_child() {
    let f = mean_max_fn();
    let mut case = VertexCase::random(&f, 23, &[true, true, true]);
    for k in 0..3 {
        case.children[k].as_mut().unwrap()[0] = vec![1.0, if k == 2 { 5.0 } else { 2.0 }, -1.0];
    }
    case.push_grads = vec![vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0]];
    case.state_grads = vec![vec![0.0; 3]];
    let (grads, _) = case.gradients(&f);
    let g: Vec<&Vec<f32>> = grads.children.iter().map(|c| &c.as_ref().unwrap()[0]).collect();
    assert_eq!((g[0].clone(), g[1].clone(), g[2].clone()), (vec![1.0, 0.0, 1.0], vec![0.0; 3], vec![0.0, 1.0, 0.0]));
}

/// An attentive cell: two heads score the children's `k` against a query made from the
/// vertex's input, weight their `v`, and scatter both from the result.
fn attention_fn(slope: f32) -> VertexFn {
    let f = Builder::new("attention", 0);
    let x = f.pull("x", 4);
    let wq = f.param("Wq", [4, 3], Init::Xavier);
    let q1 = x.matmul(wq);
    let q2 = (x.slice(1, 3) - q1).tanh();
    let query = f.concat(&[q1, q2]).matmul(f.param("Sq", [6, 6], Init::Xavier));
    // Two heads: the query as [2 × 3].
    let att = f.gather_softmax_leaky(query.slice(0, 6), "k", "v", [1, 4], slope);
    let h = (att + x).tanh();
    f.scatter("k", h.concat(x.slice(0, 2)));
    f.scatter("v", h);
    f.push("y", att);
    f.build().unwrap()
}

#[test]
fn gather_softmax_gradients_and_a_leaf() {
    for slope in [1.0, 0.2] {
        let f = attention_fn(slope);
        assert_eq!(f.max_children(), None);
        for present in [&[][..], &[true], &[true, true, true], &[true, false, true, true]] {
            check(&f, present);
        }
        let leaf = VertexCase::random(&f, 24, &[]);
        assert!(output(&f, &leaf.forward(&f), "y").iter().all(|&v| v == 0.0));
    }
}

/// The weights are the softmax of `q·k` over the children, shifted so large scores do not
/// overflow; one child gets weight 1.
#[test]
fn gather_softmax_weights_are_a_softmax_over_the_children() {
    let f = Builder::new("att", 0);
    let q = f.pull("q", 2);
    let att = f.gather_softmax(q, "k", "v", 1);
    f.scatter("k", q);
    f.scatter("v", att + 1.0);
    f.push("y", att);
    let f = f.build().unwrap();
    let mut case = VertexCase::random(&f, 25, &[true, true, true]);
    case.pulls[0] = vec![400.0, -100.0];
    let keys = [[1.0, 0.0], [0.5, 0.5], [1.0, 1.0]];
    for (c, k) in keys.iter().enumerate() {
        let states = case.children[c].as_mut().unwrap();
        states[0] = k.to_vec();
        states[1] = vec![c as f32 + 1.0];
    }
    let scores: Vec<f64> = keys.iter().map(|k| f64::from(400.0 * k[0] - 100.0 * k[1])).collect();
    let most = scores.iter().copied().fold(f64::MIN, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - most).exp()).collect();
    let want = e.iter().enumerate().map(|(c, e)| e * (c as f64 + 1.0)).sum::<f64>() / e.iter().sum::<f64>();
    let got = output(&f, &case.forward(&f), "y")[0];
    assert!(got.is_finite() && (f64::from(got) - want).abs() < 1e-5, "{got} vs {want}");
    let single = VertexCase::random(&f, 26, &[true]);
    let v = single.children[0].as_ref().unwrap()[1][0];
    assert_close(output(&f, &single.forward(&f), "y"), &[v]);
}

/// Children weighed by an edge feature: each child's state times that value of its edge's
/// feature row, the gradient reaching each child times the same value; a weight per feature
/// through a matrix each (an edge-conditioned sum).
#[test]
fn gather_weighted_weighs_each_child_by_its_edge() {
    let f = Builder::new("weighted", 0);
    let x = f.pull("x", 3);
    let first = f.gather_weighted(0, "h", 3);
    let second = f.gather_weighted(2, "h", 3);
    let h =
        (x + first.matmul(f.param("U0", [3, 3], Init::Xavier)) + second.matmul(f.param("U2", [3, 3], Init::Xavier)))
            .tanh();
    f.scatter("h", h);
    f.push("y", f.concat(&[first, second]));
    let f = f.build().unwrap();
    assert_eq!(f.edge_feature_width(), 3, "feature 2 is read: three values an edge");
    let mut case = VertexCase::random(&f, 28, &[true, false, true, true]);
    assert_eq!(case.features.len(), 4 * 3, "a row per child slot");
    case.features = vec![0.5, 9.0, -1.0, 7.0, 7.0, 7.0, 2.0, 9.0, 0.25, -3.0, 9.0, 4.0];
    let kids: Vec<&[f32]> = case.children.iter().map(|c| c.as_ref().map_or(&[][..], |c| c[0].as_slice())).collect();
    let weighed = |col: usize| -> Vec<f32> {
        (0..3).map(|e| [0, 2, 3].iter().map(|&k| case.features[k * 3 + col] * kids[k][e]).sum()).collect()
    };
    let want: Vec<f32> = weighed(0).into_iter().chain(weighed(2)).collect();
    assert_close(output(&f, &case.forward(&f), "y"), &want);
    assert_gradients(&f, &case);
}

/// `gather_weighted` reads all children: by label it is refused, naming both.
#[test]
fn gather_weighted_by_label_is_refused() {
    let f = Builder::new("both", 0);
    let x = f.pull("x", 3);
    f.scatter("h", x + f.gather_labelled(Reduce::Weighted { feature: 0 }, 1, "h", 3));
    let e = f.build().unwrap_err().to_string();
    assert!(e.contains("gather_labelled") && e.contains("gather_weighted"), "{e}");
}

/// Children gathered by edge label: only those whose edge carries it, their gradients only to
/// them.
#[test]
fn gather_labelled_reads_and_differentiates_only_its_label() {
    let f = Builder::new("labelled", 0);
    let x = f.pull("x", 3);
    let ones = f.gather_labelled(Reduce::Sum, 1, "h", 3);
    let twos = f.gather_labelled(Reduce::Max, 2, "h", 3);
    let h = (x + ones.matmul(f.param("U", [3, 3], Init::Xavier)) + twos).tanh();
    f.scatter("h", h);
    f.push("y", f.concat(&[ones, twos]));
    let f = f.build().unwrap();
    let mut case = VertexCase::random(&f, 27, &[true, true, false, true]);
    case.labels = vec![1, 2, 1, 1];
    let kids: Vec<&[f32]> = case.children.iter().map(|c| c.as_ref().map_or(&[][..], |c| c[0].as_slice())).collect();
    let want: Vec<f32> = (0..3).map(|e| kids[0][e] + kids[3][e]).chain((0..3).map(|e| kids[1][e])).collect();
    assert_close(output(&f, &case.forward(&f), "y"), &want);
    assert_gradients(&f, &case);
    // Every edge unlabelled (label 0): nothing to read.
    case.labels.clear();
    assert!(output(&f, &case.forward(&f), "y").iter().all(|&v| v == 0.0));
    assert_gradients(&f, &case);
}
