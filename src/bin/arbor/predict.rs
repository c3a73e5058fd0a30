//! `arbor predict`: a checkpoint classifies new sentences, one JSON line each.

use crate::args::{Device, PredictArgs};
use crate::eval::{scored_checkpoint, vocabulary, Restored};
use arbor::data::{sst, TreeExample, Vocab};
use arbor::head::{argmax, probabilities};
use arbor::nn::Model;
use arbor::{CpuBackend, Error, Result};
use serde_json::json;
use std::io::BufRead;

/// Sentences classified per pass.
const CHUNK: usize = 256;

/// Classifies the sentences of `args` (arguments, `--input` or standard input) with the
/// checkpoint's tree or sequence model and prints, per sentence, its predicted class, the
/// probabilities of every class and, for an SST tree with a root label, that label as `gold`.
pub(crate) fn predict(args: &PredictArgs) -> Result<()> {
    let (dir, ck) = scored_checkpoint(&args.checkpoint, "predicting with")?;
    let name = ck.meta["model"].as_str().unwrap_or_default().to_string();
    if name == "sick" {
        return Err(Error::input(
            format!("arbor predict --checkpoint {}", dir.display()),
            "a checkpoint of a tree or sequence classifier",
            "one of the sentence-pair model `sick` (score pairs with `arbor eval`)",
        ));
    }
    let kind = Model::from_name(&name)?;
    let (words, lowercase) = vocabulary(&ck.meta);
    let vocab = Vocab::from_words(&words, lowercase);
    let mut model = match args.device {
        Device::Cpu => Predictor::Cpu(Box::new(Restored::from(CpuBackend::new(), kind, &ck, words.len())?)),
        #[cfg(feature = "cuda")]
        Device::Cuda => Predictor::Cuda(Box::new(Restored::from(crate::cuda_backend()?, kind, &ck, words.len())?)),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => return crate::cuda_backend().map(|_| ()),
    };
    let mut pending: Vec<(String, TreeExample, Option<u32>)> = Vec::new();
    let mut classify = |line: String, file: &str, number: usize, flush: bool| -> Result<()> {
        if !line.trim().is_empty() {
            let (tree, gold) = sst::parse_input(&line, file, number, &vocab)?;
            let tree = if kind.chains() { tree.to_chain() } else { tree };
            pending.push((line, tree, gold));
        }
        if pending.len() >= CHUNK || (flush && !pending.is_empty()) {
            let trees: Vec<TreeExample> = pending.iter().map(|(_, t, _)| t.clone()).collect();
            for ((text, _, gold), logits) in pending.drain(..).zip(model.root_logits(&trees)?) {
                let mut line = json!({
                    "input": text.trim(), "class": argmax(&logits), "probabilities": probabilities(&logits),
                });
                if let Some(gold) = gold {
                    line["gold"] = json!(gold);
                }
                println!("{line}");
            }
        }
        Ok(())
    };
    if !args.sentences.is_empty() {
        let last = args.sentences.len();
        for (k, sentence) in args.sentences.iter().enumerate() {
            classify(sentence.clone(), "argument", k + 1, k + 1 == last)?;
        }
        return Ok(());
    }
    match &args.input {
        Some(path) => {
            let file = path.display().to_string();
            for line in arbor::data::lines::lines(path)? {
                let (number, text) = line?;
                classify(text, &file, number, false)?;
            }
            classify(String::new(), &file, 0, true)
        }
        None => {
            for (k, line) in std::io::stdin().lock().lines().enumerate() {
                let text = line.map_err(|e| Error::Parse { file: "stdin".into(), line: k + 1, msg: e.to_string() })?;
                classify(text, "stdin", k + 1, false)?;
            }
            classify(String::new(), "stdin", 0, true)
        }
    }
}

/// The restored classifier on the device `--device` chose.
enum Predictor {
    Cpu(Box<Restored<CpuBackend>>),
    #[cfg(feature = "cuda")]
    Cuda(Box<Restored<arbor::cuda::CudaBackend>>),
}

impl Predictor {
    fn root_logits(&mut self, trees: &[TreeExample]) -> Result<Vec<Vec<f32>>> {
        match self {
            Predictor::Cpu(m) => m.root_logits(trees),
            #[cfg(feature = "cuda")]
            Predictor::Cuda(m) => m.root_logits(trees),
        }
    }
}
