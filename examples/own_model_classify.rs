//! The second program of `examples/own_model.rs`: loads the model from its run folder alone
//! (the cell, readout and head come back from the checkpoint's IR, the vocabulary from its
//! metadata) and classifies the sentences given on the command line:
//!
//! ```text
//! cargo run --release --example own_model_classify -- /tmp/my-model "a good film" "not a good film"
//! ```

use arbor::checkpoint::Checkpoint;
use arbor::data::{sst, Vocab};
use arbor::head::{argmax, probabilities};
use arbor::model::{Model, Tree};
use arbor::CpuBackend;
use std::path::PathBuf;

fn main() -> arbor::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().unwrap_or_else(|| "own-model".into()));
    let sentences: Vec<String> = args.collect();
    if sentences.is_empty() {
        eprintln!("usage: own_model_classify DIR SENTENCE...");
        return Ok(());
    }
    let mut model = Model::load(&dir, &CpuBackend::new())?;
    let meta = Checkpoint::load(&Checkpoint::scored_dir(&dir))?.meta;
    let words: Vec<String> =
        meta["vocab"].as_array().into_iter().flatten().filter_map(|w| w.as_str()).map(String::from).collect();
    let vocab = Vocab::from_words(&words, false);
    // Plain words read as a right-branching tree; brackets, labelled or not, as given.
    let trees = sentences
        .iter()
        .enumerate()
        .map(|(k, s)| Ok(sst::parse_input(s, "argument", k + 1, &vocab)?.0))
        .collect::<arbor::Result<Vec<_>>>()?;
    let inputs: Vec<Vec<Tree<'_>>> = trees.iter().map(|t| vec![Tree::new(&t.graph, &t.words, t.root())]).collect();
    let outputs = model.predict(&inputs)?;
    let logits = outputs.get("logits")?;
    for (sentence, row) in sentences.iter().zip(logits.chunks(logits.len() / sentences.len())) {
        let p = probabilities(row);
        println!("{sentence}: class {} (probability {:.3})", argmax(row), p[argmax(row)]);
    }
    Ok(())
}
