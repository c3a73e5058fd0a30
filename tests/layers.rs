//! The input layer and the classifier head: gradients against finite differences, sparse rows,
//! target selection, word dropout and errors.

use arbor::data::labelled::Labelled;
use arbor::data::{synthetic, PAD};
use arbor::head::{softmax_classifier, softmax_cross_entropy, Head};
use arbor::layers::{Embedding, LossOn, WordDropout};
use arbor::model::{AsExample, Example, Feed, Model, Tree};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::readout::Readout;
use arbor::rng::Rng;
use arbor::{nn, zoo, Builder, CpuBackend, DropoutKey, Init, InputGraph};

/// The softmax classifier head from `d`-wide rows to `c` classes, its parameters drawn from
/// `seed`.
fn softmax(d: usize, c: usize, seed: u64) -> Head<CpuBackend> {
    let f = softmax_classifier(d, c).unwrap();
    let params = f.init_params(&mut Rng::new(seed));
    Head::new(CpuBackend::new(), f, &params).unwrap()
}

/// One-hot target rows of `c` classes; a row of zeros (no loss) where there is no target.
fn onehot(targets: &[Option<u32>], c: usize) -> Vec<f32> {
    let mut rows = vec![0.0; targets.len() * c];
    for (i, t) in targets.iter().enumerate() {
        if let Some(t) = t {
            rows[i * c + *t as usize] = 1.0;
        }
    }
    rows
}

/// The index of the output `name` among `head`'s pushed outputs.
fn output(head: &Head<CpuBackend>, name: &str) -> usize {
    head.function().outputs().iter().position(|o| o.name == name).expect("the head pushes it")
}

/// The classifier head over rows of which some have a target (a one-hot row) and some none (a
/// row of zeros, as a model reading every vertex gives an unlabelled vertex): the loss is the
/// true mean cross-entropy over the rows with a target, and its gradients of the rows and the
/// parameters match finite differences, a row without a target getting none.
#[test]
fn classifier_gradients_match_finite_differences() {
    let mut rng = Rng::new(11);
    let (d, c) = (4, 3);
    let mut clf = softmax(d, c, 11);
    let rows: Vec<f32> = (0..5 * d).map(|_| rng.range(-1.0, 1.0)).collect();
    let targets = [Some(0), None, Some(2), Some(1), Some(2)];
    let target = onehot(&targets, c);
    let loss_at = output(&clf, "loss");
    // The mean over the four rows with a target.
    let scale = 1.0 / 4.0;
    let out = clf.forward(&[&rows, &target]).unwrap();
    assert_eq!(out[loss_at].len(), 5);
    assert_eq!(out[loss_at].iter().filter(|&&l| l != 0.0).count(), 4, "losses {:?}", out[loss_at]);
    assert_eq!(out[loss_at][1], 0.0, "a row without target has a loss");
    let loss = out[loss_at].iter().sum::<f32>() * scale;
    let g = clf.backward(scale).unwrap();
    let grad_input = &g.pulls[0];
    assert_eq!(grad_input.len(), rows.len());
    assert!(grad_input[d..2 * d].iter().all(|&g| g == 0.0), "a row without target got gradient");
    // The loss is the true mean cross-entropy, from the softmax of h·W + b.
    let params = clf.params().unwrap();
    let mut expected = 0.0;
    for (i, t) in targets.iter().enumerate() {
        let Some(t) = t else { continue };
        let logits: Vec<f32> = (0..c)
            .map(|j| params[1][j] + (0..d).map(|k| rows[i * d + k] * params[0][k * c + j]).sum::<f32>())
            .collect();
        let norm = logits.iter().map(|l| l.exp()).sum::<f32>().ln();
        expected += (norm - logits[*t as usize]) * scale;
    }
    assert!((loss - expected).abs() < 1e-5, "loss {loss} vs {expected}");
    let eps = 1e-2;
    let loss = |rows: &[f32], clf: &mut Head<CpuBackend>| {
        clf.forward(&[rows, &target]).unwrap()[loss_at].iter().sum::<f32>() * scale
    };
    for i in 0..rows.len() {
        let (mut up, mut down) = (rows.clone(), rows.clone());
        up[i] += eps;
        down[i] -= eps;
        let numeric = (loss(&up, &mut clf) - loss(&down, &mut clf)) / (2.0 * eps);
        assert!((numeric - grad_input[i]).abs() < 1e-3, "row value {i}: {numeric} vs {}", grad_input[i]);
    }
    for (p, grads) in g.params.iter().enumerate() {
        for (k, g) in grads.iter().enumerate() {
            let moved = |delta: f32, clf: &mut Head<CpuBackend>| {
                let mut ps = params.clone();
                ps[p][k] += delta;
                clf.engine().set_params(&ps).unwrap();
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

/// The head refuses rows that are not whole, targets that are not one row per example and a
/// wrong number of inputs; inference gives a row of logits per example; rows without a target
/// give no loss and no gradient. A model refuses examples whose target rows are of another
/// class count than its head's.
#[test]
fn a_head_refuses_bad_targets_and_rows() {
    let mut clf = softmax(2, 3, 1);
    let err = clf.forward(&[&[0.0; 3], &[0.0; 3]]).unwrap_err().to_string();
    assert!(err.contains("input `h` of head `softmax-classifier`") && err.contains("3 values"), "{err}");
    let err = clf.forward(&[&[0.0; 4], &[0.0; 3]]).unwrap_err().to_string();
    assert!(err.contains("input `target`") && err.contains("2 blocks of 3 values"), "{err}");
    assert!(clf.forward(&[&[0.0; 4]]).is_err());
    let logits = output(&clf, "logits");
    assert_eq!(clf.infer(&[&[0.0; 4], &[0.0; 6]]).unwrap()[logits].len(), 2 * 3);
    let loss_at = output(&clf, "loss");
    let none = clf.forward(&[&[0.5; 4], &onehot(&[None, None], 3)]).unwrap();
    assert_eq!(none[loss_at], [0.0, 0.0]);
    let g = clf.backward(1.0).unwrap();
    assert_eq!(g.params.len(), 2);
    assert!(g.params.iter().flatten().chain(&g.pulls[0]).all(|&x| x == 0.0), "{g:?}");

    let data = synthetic::generate(4, 6, 1);
    let classes = synthetic::CLASSES;
    let mut model = zoo::tree_classifier(
        nn::tree_lstm(4, 4).unwrap(),
        synthetic::vocab().len(),
        classes,
        LossOn::All,
        &mut Rng::new(1),
    )
    .unwrap();
    let other = Labelled::all(&data, LossOn::All, classes + 1);
    let batch: Vec<Example<'_>> = other.iter().map(Labelled::example).collect();
    let mut opt = Optimizer::new(Config::new(Rule::Sgd { momentum: 0.0 }, 0.1));
    let err = model.step(&batch, &mut opt, None).unwrap_err().to_string();
    // The model finds the targets too wide for its readout before the head runs.
    assert!(err.contains("target of example 0 of the minibatch") && err.contains("row(s) of 3 values"), "{err}");
    let mine = Labelled::all(&data, LossOn::All, classes);
    let batch: Vec<Example<'_>> = mine.iter().map(Labelled::example).collect();
    model.step(&batch, &mut opt, None).unwrap();
}

/// A head must push a one-value `loss`; a model whose head pushes no `logits` is not a
/// classifier of labelled trees (scoring it says what is missing), one with the softmax
/// classifier's is.
#[test]
fn a_head_without_logits_is_not_a_classifier() {
    let no_logits = || {
        let g = Builder::new("no-logits", 0);
        let (h, t) = (g.pull("h", 2), g.pull("target", 3));
        g.push("loss", softmax_cross_entropy(h.matmul(g.param("W", [2, 3], Init::Xavier)), t));
        g.build().unwrap()
    };
    let no_loss = Builder::new("no-loss", 0);
    let (h, t) = (no_loss.pull("h", 2), no_loss.pull("target", 3));
    no_loss.push("logits", h.matmul(no_loss.param("W", [2, 3], Init::Xavier)) + t);
    let no_loss = no_loss.build().unwrap();
    let params = no_loss.init_params(&mut Rng::new(1));
    let err = Head::new(CpuBackend::new(), no_loss, &params).err().expect("refused").to_string();
    assert!(err.contains("head `no-loss`") && err.contains("`loss`"), "{err}");

    let data = synthetic::generate(6, 6, 2);
    let labelled = Labelled::all(&data, LossOn::All, synthetic::CLASSES);
    let model = |head| {
        let mut rng = Rng::new(1);
        let words = Embedding::new(synthetic::vocab().len(), 2, 0.1, &mut rng).with_padding(PAD);
        let cell = nn::tree_lstm(2, 2).unwrap();
        Model::init(&CpuBackend::new(), words, cell, vec![Feed::Words], head, &mut rng)
            .unwrap()
            .with_readout(Readout::Vertices)
    };
    let scores = model(softmax_classifier(2, 3).unwrap()).score(&labelled).unwrap();
    let names: Vec<&str> = scores.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(names, ["root_accuracy", "phrase_accuracy"]);
    assert!(scores.iter().all(|s| (0.0..=1.0).contains(&s.1)), "{scores:?}");
    let err = model(no_logits()).score(&labelled).expect_err("refused").to_string();
    assert!(err.contains("`logits`") && err.contains("[\"loss\"]"), "{err}");
}

/// A model needs a feed per input of its cell, each as wide as the word vectors, and a head
/// reading rows as wide as the cell's first pushed output (the one it reads).
#[test]
fn a_model_needs_a_feed_per_input_and_a_head_as_wide_as_its_cell() {
    let two_inputs = Builder::new("two-inputs", 1);
    let (x, y) = (two_inputs.pull("x", 2), two_inputs.pull("y", 2));
    two_inputs.push("h", (x + y).tanh());
    let err =
        zoo::tree_classifier(two_inputs.build().unwrap(), 5, 2, LossOn::All, &mut Rng::new(1)).err().expect("refused");
    assert!(err.to_string().contains("feeds") && err.to_string().contains("1 feeds"), "{err}");

    let two_outputs = || {
        let f = Builder::new("two-outputs", 1);
        let x = f.pull("x", 2);
        let h = x.tanh();
        f.push("a", h);
        f.push("b", h.concat(h).sigmoid());
        f.build().unwrap()
    };
    let mut rng = Rng::new(1);
    let words = Embedding::new(5, 2, 0.1, &mut rng);
    let head = softmax_classifier(4, 2).unwrap();
    let err = Model::init(&CpuBackend::new(), words.clone(), two_outputs(), vec![Feed::Words], head, &mut rng)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("head inputs") && err.to_string().contains("2 wide"), "{err}");
    let model = zoo::tree_classifier(two_outputs(), 5, 2, LossOn::All, &mut rng).unwrap();
    assert_eq!(model.head().function().inputs()[0].shape.numel(), 2, "the head reads the first output");
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
    let mut model = zoo::tree_classifier(nn::tree_lstm(4, 4).unwrap(), 5, 3, LossOn::Root, &mut rng).unwrap();
    assert_eq!(PAD, 0);
    let words = WordDropout::by_frequency(1, &[0, 0, 1, 1, 1], 1e6);
    *model.embedding_mut() = model.embedding().clone().with_word_dropout(words);
    let before = model.word_vectors().unwrap();
    let tree = InputGraph::balanced_binary(2);
    let ids = [2, 3, 0];
    // The loss on the root (vertex 2), of class 1.
    let example = Example { trees: vec![Tree::new(&tree, &ids, 2)], target: onehot(&[Some(1)], 3) };
    let mut opt = Optimizer::new(Config::new(Rule::Sgd { momentum: 0.0 }, 0.5));
    model.step(&[example], &mut opt, None).unwrap();
    let after = model.word_vectors().unwrap();
    let moved = |id: usize| before[id * 4..][..4] != after[id * 4..][..4];
    assert!(moved(1), "the unknown word's vector did not move");
    assert!(!moved(2) && !moved(3) && !moved(4), "a dropped word's vector moved");
}

/// One word's vector is replaced alone; a row beyond the vocabulary or of another width is
/// refused.
#[test]
fn one_word_vector_is_set_alone() {
    let mut rng = Rng::new(3);
    let mut model = zoo::tree_classifier(nn::tree_lstm(4, 4).unwrap(), 5, 3, LossOn::Root, &mut rng).unwrap();
    let mut want = model.word_vectors().unwrap();
    model.set_word_vector(3, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    want[12..16].copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
    assert_eq!(model.word_vectors().unwrap(), want);
    for (row, values) in [(5, vec![0.0; 4]), (2, vec![0.0; 3])] {
        let e = model.set_word_vector(row, &values).unwrap_err().to_string();
        assert!(e.contains("set_table_row") && e.contains(&format!("row {row} of {} values", values.len())), "{e}");
    }
    assert_eq!(model.word_vectors().unwrap(), want);
}
