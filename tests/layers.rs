//! The static input and output layers: gradients against finite differences, sparse rows,
//! target selection and errors.

use arbor::core::rng::Rng;
use arbor::layers::{Embedding, LossOn, SoftmaxClassifier};
use arbor::InputGraph;

#[test]
fn classifier_gradients_match_finite_differences() {
    let mut rng = Rng::new(11);
    let (d, c) = (4, 3);
    let clf = SoftmaxClassifier::new(d, c, &mut rng);
    let rows: Vec<f32> = (0..5 * d).map(|_| rng.range(-1.0, 1.0)).collect();
    let targets = [Some(0), None, Some(2), Some(1), Some(2)];
    let out = clf.loss(&rows, &targets).unwrap();
    assert_eq!(out.count, 4);
    assert!(out.grad_input[d..2 * d].iter().all(|&g| g == 0.0), "a row without target got gradient");
    let eps = 1e-2;
    for i in 0..rows.len() {
        let (mut up, mut down) = (rows.clone(), rows.clone());
        up[i] += eps;
        down[i] -= eps;
        let numeric = (clf.loss(&up, &targets).unwrap().loss - clf.loss(&down, &targets).unwrap().loss) / (2.0 * eps);
        assert!((numeric - out.grad_input[i]).abs() < 1e-3, "row value {i}: {numeric} vs {}", out.grad_input[i]);
    }
    // Weight gradient: moving the weights along the gradient lowers the loss by about |g|²·step.
    let step = 1e-3;
    let mut moved = clf.clone();
    moved.apply(&out.grads, -step);
    let norm2: f32 = out.grads.weight.iter().chain(&out.grads.bias).map(|g| g * g).sum();
    let drop = out.loss - moved.loss(&rows, &targets).unwrap().loss;
    assert!((drop - step * norm2).abs() < 0.05 * step * norm2, "drop {drop} vs {}", step * norm2);
}

#[test]
fn embedding_gradients_are_sparse_and_summed() {
    let mut rng = Rng::new(2);
    let mut e = Embedding::new(10, 2, 0.1, &mut rng);
    let ids = [7, 3, 7];
    assert_eq!(e.lookup(&ids).unwrap()[..2], e.table()[14..16]);
    let g = e.sparse_grad(&ids, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    assert_eq!(g.rows, vec![3, 7]);
    assert_eq!(g.values, vec![3.0, 4.0, 6.0, 8.0]);
    let before = e.table().to_vec();
    e.apply(&g, -0.5);
    assert_eq!(e.table()[0..6], before[0..6]);
    assert!((e.table()[14] - (before[14] - 3.0)).abs() < 1e-6);
    let err = e.lookup(&[1, 10]).unwrap_err().to_string();
    assert!(err.contains("position 1") && err.contains("below 10"), "{err}");
    assert!(Embedding::from_table(vec![0.0; 5], 2).is_err());
}

#[test]
fn loss_targets_at_roots_or_everywhere() {
    let tree = InputGraph::from_children(vec![vec![], vec![], vec![Some(0), Some(1)]]).unwrap();
    let leaf = InputGraph::chain(1);
    let graphs = [&tree, &leaf];
    let labels = [1, 2, 3, 4];
    assert_eq!(LossOn::Root.select(&graphs, &labels).unwrap(), vec![None, None, Some(3), Some(4)]);
    assert_eq!(LossOn::All.select(&graphs, &labels).unwrap(), vec![Some(1), Some(2), Some(3), Some(4)]);
    assert!(LossOn::All.select(&graphs, &labels[..3]).is_err());
}

#[test]
fn classifier_refuses_bad_targets_and_rows() {
    let clf = SoftmaxClassifier::new(2, 3, &mut Rng::new(1));
    let err = clf.loss(&[0.0; 4], &[Some(1), Some(3)]).unwrap_err().to_string();
    assert!(err.contains("target of row 1") && err.contains("below 3"), "{err}");
    assert!(clf.loss(&[0.0; 3], &[Some(1)]).is_err());
    assert!(clf.loss(&[0.0; 4], &[Some(1)]).is_err());
    assert_eq!(clf.predict(&[0.0; 4]).unwrap().len(), 2);
}

#[test]
fn classifier_needs_one_input_and_one_output() {
    let f = arbor::Builder::new("two-outputs", 1);
    let x = f.pull("x", 2);
    let h = x.tanh();
    f.push("a", h);
    f.push("b", h.sigmoid());
    let cell = f.build().unwrap();
    let err = arbor::train::Classifier::new(cell, 5, None, 2, &mut Rng::new(1)).err().expect("refused");
    assert!(err.to_string().contains("1 inputs and 2 outputs"), "{err}");
}
