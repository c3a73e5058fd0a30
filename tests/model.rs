//! Whole models (`arbor::model`): the SICK pair model learns relatedness past a stated bar, and
//! a model that does not fit together is refused with an error naming what is wrong.

use arbor::data::sick::{self, Pair};
use arbor::data::{data_dir, PAD};
use arbor::head::Head;
use arbor::layers::Embedding;
use arbor::model::{Example, Feed, Model};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::{metrics, nn, CpuBackend, Engine};

/// Tai et al.'s pair model at `embed`/`hidden`: the n-ary child-sum cell, the relatedness head.
fn pair_model(vocab: usize, embed: usize, hidden: usize, rng: &mut Rng) -> Model<CpuBackend> {
    let words = Embedding::new(vocab, embed, 0.1, rng).with_padding(PAD);
    let cell = nn::child_sum_tree_lstm_nary(embed, hidden).unwrap();
    let head = nn::relatedness_head(hidden, 20, sick::CLASSES).unwrap();
    Model::init(&CpuBackend::new(), words, cell, vec![Feed::Words, Feed::ParentWords], head, rng).unwrap()
}

/// Pearson's correlation of the expected scores with the gold ones.
fn pearson(model: &mut Model<CpuBackend>, pairs: &[Pair]) -> f64 {
    metrics::pearson(&sick::predict(model, pairs).unwrap(), &sick::gold(pairs))
}

/// Three epochs over the SICK training pairs (embed and hidden 64, Adagrad 0.05, batch 25,
/// clipped at 5): the mean KL loss falls every epoch and dev Pearson reaches 0.7 (0.75 when
/// written; an untrained model scores 0.23, the full-size model of `examples/sick.rs` 0.81).
#[test]
fn the_pair_model_learns_sick_relatedness() {
    let data = sick::read_splits(&data_dir().join("sick"), true).expect("SICK data (ARBOR_DATA)");
    let mut rng = Rng::new(3);
    let mut model = pair_model(data.vocab.len(), 64, 64, &mut rng);
    let before = pearson(&mut model, &data.dev);
    let mut opt = Optimizer::new(Config { weight_decay: 1e-4, ..Config::new(Rule::Adagrad, 0.05) });
    let mut train: Vec<&Pair> = data.train.iter().collect();
    let mut losses = Vec::new();
    for _ in 0..3 {
        rng.shuffle(&mut train);
        let mut total = 0.0f64;
        for batch in train.chunks(25) {
            let examples: Vec<Example<'_>> = batch.iter().map(|p| p.example()).collect();
            total += model.step(&examples, &mut opt, Some(5.0)).unwrap()[0].iter().map(|&l| f64::from(l)).sum::<f64>();
        }
        losses.push(total / train.len() as f64);
    }
    let dev = pearson(&mut model, &data.dev);
    assert!(losses.windows(2).all(|w| w[1] < w[0]), "mean losses {losses:?}");
    assert!(dev >= 0.7, "dev Pearson {dev} (before training {before})");
}

/// Feeds that do not match the cell, parent words without a padding row, a head that reads rows
/// of another width, and an example with the wrong number of graphs are errors.
#[test]
fn a_model_that_does_not_fit_together_is_refused() {
    let mut rng = Rng::new(4);
    let cell = nn::child_sum_tree_lstm_nary(4, 3).unwrap();
    let cp = cell.init_params(&mut rng);
    let head_for = |hidden: usize, rng: &mut Rng| {
        let h = nn::relatedness_head(hidden, 5, sick::CLASSES).unwrap();
        let hp = h.init_params(rng);
        Head::new(CpuBackend::new(), h, &hp).unwrap()
    };
    let cells = || Engine::new(CpuBackend::new(), cell.clone(), &cp).unwrap();
    let words = |rng: &mut Rng| Embedding::new(10, 4, 0.1, rng);
    let err = |m: arbor::Result<Model<CpuBackend>>| m.err().expect("refused").to_string();
    let e = err(Model::new(words(&mut rng).with_padding(PAD), cells(), vec![Feed::Words], head_for(3, &mut rng)));
    assert!(e.contains("feeds") && e.contains("1 feeds"), "{e}");
    let e = err(Model::new(words(&mut rng), cells(), vec![Feed::Words, Feed::ParentWords], head_for(3, &mut rng)));
    assert!(e.contains("padding row"), "{e}");
    // Two heights of different widths: a minibatch lays out one set of height rows.
    let f = arbor::Builder::new("heights", 0);
    let h = (f.pull("x", 4).slice(0, 3) + f.pull("a", 3) + f.pull("b", 5).slice(0, 3)).tanh();
    f.push("h", h);
    let (two, params) = (f.build().unwrap(), Vec::new());
    let two = Engine::new(CpuBackend::new(), two, &params).unwrap();
    let feeds = vec![Feed::Words, Feed::Height(3), Feed::Height(5)];
    let e = err(Model::new(words(&mut rng), two, feeds, head_for(3, &mut rng)));
    assert!(e.contains("one width per kind of feed") && e.contains("Height(3) and Height(5)"), "{e}");
    let e = err(Model::new(
        words(&mut rng).with_padding(PAD),
        cells(),
        vec![Feed::Words, Feed::ParentWords],
        head_for(5, &mut rng),
    ));
    assert!(e.contains("head inputs") && e.contains("3 wide"), "{e}");
    let mut model = Model::new(
        words(&mut rng).with_padding(PAD),
        cells(),
        vec![Feed::Words, Feed::ParentWords],
        head_for(3, &mut rng),
    )
    .unwrap();
    let graph = arbor::InputGraph::isolated(1);
    let tree = arbor::model::Tree::new(&graph, &[3], 0);
    let one = Example { trees: vec![tree.clone()], target: vec![0.2; sick::CLASSES] };
    let e = model.infer(&[one]).expect_err("one graph for a pair head").to_string();
    assert!(e.contains("example 0") && e.contains("2 graphs"), "{e}");
    let bad_root =
        Example { trees: vec![tree.clone(), arbor::model::Tree { root: 1, ..tree }], target: vec![0.2; sick::CLASSES] };
    let e = model.infer(&[bad_root]).expect_err("a root outside its graph").to_string();
    assert!(e.contains("graph 1 of example 0") && e.contains("root 1"), "{e}");
}

/// A synthetic tree with its root's sentiment (label 0, 1, 2 → −1, 0, +1) as the target.
fn sentiment(t: &arbor::data::TreeExample) -> Example<'_> {
    Example { trees: vec![t.tree()], target: vec![t.labels[t.root()] as f32 - 1.0] }
}

/// A regression head of one tree per example (a linear read-out of the root, mean squared
/// error to its sentiment −1, 0 or +1) on the synthetic treebank: three epochs take the test
/// MSE from that of an untrained model (about 0.7) below 0.05.
#[test]
fn a_regression_head_learns_root_sentiment() {
    use arbor::data::synthetic;
    use arbor::head::mean_squared_error;
    use arbor::{Builder, Init};
    let (train, test) = (synthetic::generate(4000, 10, 1), synthetic::generate(300, 10, 2));
    let f = Builder::new("linear-regression", 0);
    let (h, target) = (f.pull("h", 32), f.pull("target", 1));
    let (w, b) = (f.param("w", [32, 1], Init::Xavier), f.param("b", [1, 1], Init::Zeros));
    f.push("loss", mean_squared_error(h.matmul(w) + b, target));
    let head = f.build().unwrap();
    let mut rng = Rng::new(5);
    let words = Embedding::new(synthetic::vocab().len(), 16, 0.1, &mut rng).with_padding(PAD);
    let cell = nn::tree_lstm(16, 32).unwrap();
    let mut model = Model::init(&CpuBackend::new(), words, cell, vec![Feed::Words], head, &mut rng).unwrap();
    let test_examples: Vec<Example<'_>> = test.iter().map(sentiment).collect();
    let mse =
        |model: &mut Model<CpuBackend>| model.infer(&test_examples).unwrap()[0].iter().sum::<f32>() / test.len() as f32;
    let before = mse(&mut model);
    let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.01));
    for _ in 0..3 {
        for batch in train.chunks(25) {
            model.step(&batch.iter().map(sentiment).collect::<Vec<_>>(), &mut opt, Some(5.0)).unwrap();
        }
    }
    let after = mse(&mut model);
    assert!(before > 0.3 && after < 0.05, "test MSE {before} before training, {after} after");
}

/// Graph classification through a pooling readout: a GIN-like cell over each MUTAG molecule
/// unrolled three steps, every vertex max-pooled, a softmax head. After 4 epochs (Adam 0.001) on four
/// fifths of the molecules, the held-out fifth is classified with accuracy ≥ 0.8 (0.89 when
/// written, before it overfits; the majority class is 0.73 of it).
#[test]
fn a_max_pooled_graph_model_learns_mutag() {
    use arbor::data::tu;
    use arbor::head::softmax_cross_entropy;
    use arbor::model::Tree;
    use arbor::readout::Readout;
    use arbor::{Builder, InputGraph};

    let data = tu::read(&data_dir().join("mutag"), "MUTAG").expect("MUTAG data (ARBOR_DATA)");
    let (features, hidden, classes) = (16, 32, data.classes);
    let f = Builder::new("classifier", 0);
    let (h, target) = (f.pull("h", hidden), f.pull("target", classes));
    let logits =
        h.matmul(f.param("W", [hidden, classes], arbor::Init::Xavier)) + f.param("b", [1, classes], arbor::Init::Zeros);
    f.push("loss", softmax_cross_entropy(logits, target));
    f.push("logits", logits);
    let head = f.build().unwrap();
    let mut rng = Rng::new(5);
    let labels = Embedding::new(data.node_label_count, features, 0.5, &mut rng);
    // A GIN-like cell: the node's features and the sum over itself and its neighbours a step
    // earlier, through one layer.
    let f = Builder::new("gin", 0);
    let (x, around) = (f.pull("x", features), f.gather_sum("h", hidden));
    let v = f.param("V", [features, hidden], arbor::Init::Xavier);
    let w = f.param("W", [hidden, hidden], arbor::Init::Xavier);
    let h = (x.matmul(v) + around.matmul(w) + f.param("b", [1, hidden], arbor::Init::Zeros)).tanh();
    f.scatter("h", h);
    f.push("h", h);
    let cell = f.build().unwrap();
    let mut model = Model::init(&CpuBackend::new(), labels, cell, vec![Feed::Words], head, &mut rng)
        .unwrap()
        .with_readout(Readout::Max);
    let mut graphs: Vec<&tu::GraphExample> = data.graphs.iter().collect();
    rng.shuffle(&mut graphs);
    let unrolled: Vec<(InputGraph, Vec<u32>, Vec<f32>)> = graphs
        .iter()
        .map(|g| {
            let target = (0..classes).map(|c| f32::from(c == g.label as usize)).collect();
            (g.unroll(3, 0).expect("MUTAG unrolls"), g.node_labels.repeat(4), target)
        })
        .collect();
    fn example((graph, words, target): &(InputGraph, Vec<u32>, Vec<f32>)) -> Example<'_> {
        Example { trees: vec![Tree::new(graph, words, 0)], target: target.clone() }
    }
    let (test, train) = unrolled.split_at(unrolled.len() / 5);
    let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.001));
    let mut order: Vec<usize> = (0..train.len()).collect();
    for _ in 0..4 {
        rng.shuffle(&mut order);
        for batch in order.chunks(16) {
            model.step(&batch.iter().map(|&i| example(&train[i])).collect::<Vec<_>>(), &mut opt, Some(5.0)).unwrap();
        }
    }
    let logits = model.infer(&test.iter().map(example).collect::<Vec<_>>()).unwrap().swap_remove(1);
    let correct = logits.chunks(classes).zip(test).filter(|(z, (_, _, t))| t[usize::from(z[1] > z[0])] == 1.0).count();
    let accuracy = correct as f64 / test.len() as f64;
    assert!(accuracy >= 0.8, "held-out accuracy {accuracy}");
}

/// The relatedness head with `(h_a − h_b)²` in place of `|h_a − h_b|`: smooth, so central
/// differences agree with the gradient everywhere (`abs` has a kink where the two roots agree in
/// a column, and a difference step across it averages its two slopes).
fn smooth_pair_head(hidden: usize) -> arbor::VertexFn {
    use arbor::{Builder, Init};
    let f = Builder::new("smooth-relatedness", 0);
    let (ha, hb, p) = (f.pull("ha", hidden), f.pull("hb", hidden), f.pull("target", sick::CLASSES));
    let w = f.param("W", [2 * hidden, 4], Init::Xavier);
    let v = f.param("V", [4, sick::CLASSES], Init::Xavier);
    let d = ha - hb;
    let log_q =
        ((d * d).concat(ha * hb).matmul(w) + f.param("b", [1, 4], Init::Zeros)).sigmoid().matmul(v).log_softmax();
    f.push("loss", arbor::head::kl_divergence(log_q, p));
    f.push("q", log_q.exp());
    f.build().unwrap()
}

/// `Feed::ParentEdge`: a vertex pulls its parent edge's label as a one-hot row. On SICK pairs,
/// whose edges carry their dependents' relations, a cell multiplying that row by a matrix gets
/// a gradient of the matrix non-zero exactly in the rows of the relations the batch holds (so
/// each row arrives in its label's column); the model's gradients check by central differences
/// (with a smooth pair head, [`smooth_pair_head`]), and the feed survives the model's stored
/// description.
#[test]
fn parent_edge_labels_reach_the_cell_as_one_hot_rows() {
    use arbor::testing::{check_model_gradients, GradCheck};
    use arbor::{Builder, Init};
    let data = sick::read_splits(&data_dir().join("sick"), true).expect("SICK data (ARBOR_DATA)");
    let (embed, hidden, labels) = (4, 3, sick::RELATIONS.len());
    let f = Builder::new("relations", 0);
    let (x, rel) = (f.pull("x", embed), f.pull("relation", labels));
    let h = (x.matmul(f.param("W", [embed, hidden], Init::Xavier))
        + rel.matmul(f.param("R", [labels, hidden], Init::Xavier))
        + f.gather_sum("h", hidden))
    .tanh();
    f.scatter("h", h);
    f.push("h", h);
    let cell = f.build().unwrap();
    let mut rng = Rng::new(5);
    let words = Embedding::new(data.vocab.len(), embed, 0.1, &mut rng).with_padding(PAD);
    let feeds = vec![Feed::Words, Feed::ParentEdge(labels)];
    let mut model = Model::init(&CpuBackend::new(), words, cell, feeds, smooth_pair_head(hidden), &mut rng).unwrap();
    let pairs = &data.train[..3];
    let batch: Vec<Example<'_>> = pairs.iter().map(Pair::example).collect();
    let grads = model.gradients(&batch, batch.len(), None).unwrap();
    let used: std::collections::BTreeSet<usize> = pairs
        .iter()
        .flat_map(|p| [&p.a, &p.b])
        .flat_map(|s| {
            (0..s.graph.len())
                .flat_map(move |v| (0..s.graph.children(v).len()).map(move |k| s.graph.edge_label(v, k) as usize))
        })
        .collect();
    let r = &grads.cells[0][1];
    for label in 0..labels {
        let moved = r[label * hidden..(label + 1) * hidden].iter().any(|&g| g != 0.0);
        assert_eq!(moved, used.contains(&label), "relation {} ({label})", sick::RELATIONS[label]);
    }
    check_model_gradients(&mut model, &batch, &GradCheck { max_entries: 24, ..GradCheck::default() })
        .unwrap_or_else(|e| panic!("{e}"));
    let stored = arbor::model::ModelSpec::from_json(&model.spec().to_json()).unwrap();
    assert_eq!(stored.feeds, [Feed::Words, Feed::ParentEdge(labels)]);
}
