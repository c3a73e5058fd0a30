//! The model described once: every function of the zoo, and a model of one's own, survive being
//! stored as a `ModelSpec` (as every checkpoint holds it) and read back; `Model::load` rebuilds
//! and restores a checkpoint with nothing else; a malformed or missing spec is refused, saying
//! what is wrong.

use arbor::data::labelled::Labelled;
use arbor::data::synthetic;
use arbor::head::{mean_squared_error, softmax_classifier};
use arbor::layers::{Embedding, LossOn};
use arbor::model::{function_from_json, function_to_json, AsExample, Example, Feed, Model, ModelSpec, Tree};
use arbor::nn::{self, CellDropout, CellKind as Kind};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::readout::Readout;
use arbor::rng::Rng;
use arbor::trainer::{Run, Settings, Splits};
use arbor::{Builder, CpuBackend, Init, VertexFn};

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("arbor-model-spec-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

/// A cell reading its children by every reduction (one weighted by edge feature 3) and by
/// attention.
fn over_children() -> VertexFn {
    let f = Builder::new("over-children", 0);
    let x = f.pull("x", 4);
    let att = f.gather_softmax_leaky(x.tanh(), "h", "h", 4, 0.2);
    let weighted = f.gather_weighted(3, "h", 4);
    let h = (f.gather_sum("h", 4) + f.gather_mean("h", 4) * f.gather_max("h", 4) + att + weighted + x).tanh();
    f.scatter("h", h);
    f.push("h", h);
    f.build().unwrap()
}

#[test]
fn every_zoo_function_survives_its_stored_form() {
    let mut functions: Vec<VertexFn> = [Kind::TreeLstm, Kind::ChildSum, Kind::VarLstm, Kind::TreeFc]
        .into_iter()
        .map(|k| k.cell_with_dropout(6, 5, CellDropout::all(0.2)).unwrap())
        .collect();
    functions.extend([
        nn::ggnn(4, 5).unwrap(),
        nn::gin(4, 5, 3).unwrap(),
        nn::gat(4, 5).unwrap(),
        nn::child_sum_tree_lstm_nary(6, 5).unwrap(),
        nn::relatedness_head(5, 7, 5).unwrap(),
        softmax_classifier(5, 3).unwrap(),
        over_children(),
    ]);
    for f in functions {
        let stored = function_to_json(&f);
        // Through text, as a checkpoint's metadata holds it.
        let text = serde_json::to_string(&stored).unwrap();
        let again = function_from_json(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(again.declared(), f.declared(), "{}", f.name());
        assert_eq!(format!("{again}"), format!("{f}"), "{}: plans differ", f.name());
    }
}

#[test]
fn a_malformed_spec_is_refused_naming_the_field() {
    let f = nn::tree_lstm(4, 3).unwrap();
    let mut stored = function_to_json(&f);
    stored["values"][3][0] = serde_json::json!(["unary", "no-such-op", 0.0, 1]);
    let err = function_from_json(&stored).unwrap_err().to_string();
    assert!(err.contains("tree-lstm.values"), "{err}");
    let mut stored = function_to_json(&f);
    stored["params"][0][1] = serde_json::json!(99);
    let err = function_from_json(&stored).unwrap_err().to_string();
    assert!(err.contains("vertex function `tree-lstm`"), "{err}");
    let spec = serde_json::json!({"version": 99});
    let err = ModelSpec::from_json(&spec).unwrap_err().to_string();
    assert!(err.contains("version 99"), "{err}");
}

/// A regression example of one's own: a tree and a number.
struct Scored {
    tree: arbor::data::TreeExample,
    y: f32,
}

impl AsExample for Scored {
    fn example(&self) -> Example<'_> {
        Example {
            trees: vec![arbor::model::Tree::new(&self.tree.graph, &self.tree.words, self.tree.root())],
            target: vec![self.y],
        }
    }

    fn score(outputs: &arbor::model::Outputs, data: &[Self]) -> arbor::Result<arbor::trainer::Scores> {
        let p = outputs.get("prediction")?;
        let mse = p.iter().zip(data).map(|(p, d)| (p - d.y).powi(2)).sum::<f32>() / data.len().max(1) as f32;
        Ok(vec![("neg_mse".into(), -f64::from(mse))])
    }
}

#[test]
fn a_model_of_ones_own_loads_from_its_checkpoint_alone() {
    // A cell and a head of one's own, mean-pooled.
    let cell = {
        let f = Builder::new("my-cell", 2);
        let x = f.pull("x", 4);
        let h = (x.matmul(f.param("W", [4, 3], Init::Xavier)) + f.gather(0, "h", 3) + f.gather(1, "h", 3)).tanh();
        f.scatter("h", h);
        f.push("h", h);
        f.build().unwrap()
    };
    let head = {
        let f = Builder::new("my-head", 0);
        let (h, y) = (f.pull("h", 3), f.pull("y", 1));
        let prediction = h.matmul(f.param("w", [3, 1], Init::Xavier)).scale(2.0) + f.param("b", [1, 1], Init::Zeros);
        f.push("loss", mean_squared_error(prediction, y));
        f.push("prediction", prediction);
        f.build().unwrap()
    };
    let mut rng = Rng::new(5);
    let words = Embedding::new(synthetic::vocab().len(), 4, 0.1, &mut rng).with_padding(0);
    let model = Model::init(&CpuBackend::new(), words, cell, vec![Feed::Words], head, &mut rng)
        .unwrap()
        .with_readout(Readout::Mean);
    let data: Vec<Scored> = synthetic::generate(60, 6, 3)
        .into_iter()
        .map(|tree| Scored { y: tree.graph.len() as f32 / 10.0, tree })
        .collect();
    let dir = temp("own");
    let mut run = Run::new(model, Optimizer::new(Config::new(Rule::Adam, 0.02)), &Rng::new(1));
    let plan = Settings::new(2, 10).checkpoint(&dir);
    run.fit_local(Splits { train: &data[..40], dev: &data[40..], test: &data[40..] }, &plan).unwrap();

    // The best epoch's model, from the folder alone, predicts what the trained model did at
    // its best epoch (scored again here).
    let mut loaded = Model::load(&dir, &CpuBackend::new()).unwrap();
    assert_eq!(loaded.readout(), Readout::Mean);
    let scores = loaded.score(&data[40..]).unwrap();
    assert_eq!(scores[0].1, run.best_dev(), "{scores:?} vs best dev {}", run.best_dev());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_tree_classifier_loads_and_scores_as_trained() {
    let (train, dev) = (synthetic::generate(80, 8, 1), synthetic::generate(30, 8, 2));
    let classes = synthetic::CLASSES;
    let cell = nn::tree_lstm(8, 8).unwrap();
    let model =
        arbor::zoo::tree_classifier(cell, synthetic::vocab().len(), classes, LossOn::All, &mut Rng::new(3)).unwrap();
    let dir = temp("zoo");
    let mut run = Run::new(model, Optimizer::new(Config::new(Rule::Adagrad, 0.05)), &Rng::new(1));
    let (train, dev) = (Labelled::all(&train, LossOn::All, classes), Labelled::all(&dev, LossOn::All, classes));
    run.fit_local(Splits { train: &train, dev: &dev, test: &dev }, &Settings::new(2, 16).checkpoint(&dir)).unwrap();
    let mut loaded = Model::load(&dir, &CpuBackend::new()).unwrap();
    assert_eq!(&loaded.score(&dev).unwrap(), run.test_scores());
    // Serving: the trees alone, without targets, get the logits inference with targets gives
    // (a row per vertex: the loss was at every vertex).
    let trees: Vec<Vec<Tree<'_>>> = dev.iter().map(|e| e.example().trees).collect();
    let served = loaded.predict(&trees).unwrap();
    let scored = loaded.infer_all(&dev).unwrap();
    assert_eq!(served.get("logits").unwrap(), scored.get("logits").unwrap());
    assert_eq!(
        served.get("logits").unwrap().len(),
        dev.iter().map(|e| e.example().trees[0].graph.len()).sum::<usize>() * classes
    );
    // A checkpoint written before models described themselves says so.
    let last = dir.join("last");
    let mut ck = arbor::checkpoint::Checkpoint::load(&last).unwrap();
    ck.meta.as_object_mut().unwrap().remove("model_spec");
    let err = Model::<CpuBackend>::from_checkpoint(&ck, &CpuBackend::new()).err().unwrap().to_string();
    assert!(err.contains("before models described themselves"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
