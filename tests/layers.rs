//! The input layer and the classifier head: gradients against finite differences, sparse rows,
//! target selection, word dropout and errors.

use arbor::head::ClassHead;
use arbor::layers::{Embedding, LossOn, WordDropout};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::train::{Classifier, Readout};
use arbor::{nn, CpuBackend, DropoutKey, InputGraph};

fn softmax(d: usize, c: usize, seed: u64) -> ClassHead<CpuBackend> {
    ClassHead::softmax(CpuBackend::new(), d, c, &mut Rng::new(seed)).unwrap()
}

#[test]
fn classifier_gradients_match_finite_differences() {
    let mut rng = Rng::new(11);
    let (d, c) = (4, 3);
    let mut clf = softmax(d, c, 11);
    let rows: Vec<f32> = (0..5 * d).map(|_| rng.range(-1.0, 1.0)).collect();
    let targets = [Some(0), None, Some(2), Some(1), Some(2)];
    let out = clf.loss_over(&rows, &targets, 4).unwrap();
    assert_eq!(out.count, 4);
    assert!(out.grad_input[d..2 * d].iter().all(|&g| g == 0.0), "a row without target got gradient");
    // The loss is the true mean cross-entropy, from the softmax of h·W + b.
    let params = clf.params().unwrap();
    let mut expected = 0.0;
    for (i, t) in targets.iter().enumerate() {
        let Some(t) = t else { continue };
        let logits: Vec<f32> = (0..c)
            .map(|j| params[1][j] + (0..d).map(|k| rows[i * d + k] * params[0][k * c + j]).sum::<f32>())
            .collect();
        let norm = logits.iter().map(|l| l.exp()).sum::<f32>().ln();
        expected += (norm - logits[*t as usize]) / 4.0;
    }
    assert!((out.loss - expected).abs() < 1e-5, "loss {} vs {expected}", out.loss);
    let eps = 1e-2;
    let loss = |rows: &[f32], clf: &mut ClassHead<CpuBackend>| clf.loss_over(rows, &targets, 4).unwrap().loss;
    for i in 0..rows.len() {
        let (mut up, mut down) = (rows.clone(), rows.clone());
        up[i] += eps;
        down[i] -= eps;
        let numeric = (loss(&up, &mut clf) - loss(&down, &mut clf)) / (2.0 * eps);
        assert!((numeric - out.grad_input[i]).abs() < 1e-3, "row value {i}: {numeric} vs {}", out.grad_input[i]);
    }
    for (p, grads) in out.grads.iter().enumerate() {
        for (k, g) in grads.iter().enumerate() {
            let moved = |delta: f32, clf: &mut ClassHead<CpuBackend>| {
                let mut ps = params.clone();
                ps[p][k] += delta;
                clf.head().engine().set_params(&ps).unwrap();
                loss(&rows, clf)
            };
            let numeric = (moved(eps, &mut clf) - moved(-eps, &mut clf)) / (2.0 * eps);
            assert!((numeric - g).abs() < 1e-3, "parameter {p} value {k}: {numeric} vs {g}");
        }
    }
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
    let mut clf = softmax(2, 3, 1);
    let err = clf.loss_over(&[0.0; 4], &[Some(1), Some(3)], 2).unwrap_err().to_string();
    assert!(err.contains("target of row 1") && err.contains("below 3"), "{err}");
    assert!(clf.loss_over(&[0.0; 3], &[Some(1)], 1).is_err());
    assert!(clf.loss_over(&[0.0; 4], &[Some(1)], 1).is_err());
    assert_eq!(clf.predict(&[0.0; 4]).unwrap().len(), 2);
    let none = clf.loss_over(&[0.0; 4], &[None, None], 1).unwrap();
    assert_eq!((none.loss, none.count, none.grads.len()), (0.0, 0, 2));
}

#[test]
fn a_head_without_logits_is_not_a_classifier() {
    let f = arbor::head::softmax_classifier(2, 3).unwrap();
    let params = f.init_params(&mut Rng::new(1));
    assert!(ClassHead::new(CpuBackend::new(), f, &params).is_ok());
    let g = arbor::Builder::new("no-logits", 0);
    let (h, t) = (g.pull("h", 2), g.pull("target", 3));
    g.push("loss", arbor::head::softmax_cross_entropy(h.matmul(g.param("W", [2, 3], arbor::Init::Xavier)), t));
    let g = g.build().unwrap();
    let params = g.init_params(&mut Rng::new(1));
    let err = ClassHead::new(CpuBackend::new(), g, &params).err().expect("refused").to_string();
    assert!(err.contains("classifier head `no-logits`") && err.contains("logits"), "{err}");
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

/// Word dropout replaces a word seen `c` times by the unknown word at rate α / (α + c), never the
/// padding, and draws by place: one pass over many graphs drops what a pass per graph (its
/// `first` at the graph's place) drops, and another step draws anew.
#[test]
fn word_dropout_replaces_rare_words_at_their_rate_by_place() {
    let (pad, unk, rare, common) = (0u32, 1u32, 2u32, 3u32);
    // α = 0.25: a word seen once goes at 0.2, one seen 99 times at about 0.0025.
    let w = WordDropout::by_frequency(unk, &[500, 0, 1, 99], 0.25);
    assert_eq!((w.rate(pad), w.rate(unk)), (0.25 / 500.25, 0.0));
    assert!((w.rate(rare) - 0.2).abs() < 1e-6 && (w.rate(common) - 0.25 / 99.25).abs() < 1e-6);
    let chains: Vec<InputGraph> = (0..400).map(|_| InputGraph::chain(50)).collect();
    let graphs: Vec<&InputGraph> = chains.iter().collect();
    let ids: Vec<u32> = (0..400 * 50).map(|i| [pad, rare, common, rare][i % 4]).collect();
    let embed = Embedding::new(4, 2, 0.1, &mut Rng::new(1)).with_padding(pad).with_word_dropout(w.clone());
    let key = DropoutKey { seed: 9, step: 4, first: 0 };
    let out = embed.training_ids(key, &graphs, &ids);
    let replaced = |of: u32| {
        let at: Vec<usize> = (0..ids.len()).filter(|&i| ids[i] == of).collect();
        assert!(at.iter().all(|&i| out[i] == of || out[i] == unk), "{of} became something else");
        at.iter().filter(|&&i| out[i] == unk).count() as f64 / at.len() as f64
    };
    assert_eq!(replaced(pad), 0.0, "the padding was dropped");
    assert!((replaced(rare) - 0.2).abs() < 0.015, "rare words dropped at {}", replaced(rare));
    assert!(replaced(common) < 0.01, "common words dropped at {}", replaced(common));
    let one_by_one: Vec<u32> = graphs
        .iter()
        .enumerate()
        .flat_map(|(g, &graph)| {
            let mine = &ids[g * 50..(g + 1) * 50];
            w.apply(DropoutKey { first: g, ..key }, &[graph], mine, None)
        })
        .collect();
    // Given no padding to keep, `apply` may drop it: compare the words.
    let words = |v: &[u32]| v.iter().zip(&ids).filter(|(_, &i)| i != pad).map(|(&o, _)| o).collect::<Vec<_>>();
    assert_eq!(words(&out), words(&one_by_one));
    assert_ne!(out, embed.training_ids(DropoutKey { step: 5, ..key }, &graphs, &ids));
}

/// A training step with word dropout moves the unknown word's vector in place of the dropped
/// words' (here every word is seen once and α is large: nearly all are dropped).
#[test]
fn a_training_step_trains_the_unknown_word_for_the_dropped_ones() {
    let mut rng = Rng::new(2);
    let mut model = Classifier::new(nn::tree_lstm(4, 4).unwrap(), 5, Some(0), 3, &mut rng).unwrap();
    let words = WordDropout::by_frequency(1, &[0, 0, 1, 1, 1], 1e6);
    model.embed = model.embed.clone().with_word_dropout(words);
    let before = model.embed.table().to_vec();
    let tree = InputGraph::balanced_binary(2);
    let ids = [2, 3, 0];
    let targets = [None, None, Some(1)];
    let mut opt = Optimizer::new(Config::new(Rule::Sgd { momentum: 0.0 }, 0.5));
    model.step(&[&tree], &ids, Readout::Vertices(&targets), &mut opt, None).unwrap();
    let moved = |id: usize| before[id * 4..][..4] != model.embed.table()[id * 4..][..4];
    assert!(moved(1), "the unknown word's vector did not move");
    assert!(!moved(2) && !moved(3) && !moved(4), "a dropped word's vector moved");
}
