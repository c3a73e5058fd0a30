//! A run's state as a checkpoint holds it ([`Run::snapshot`]), and a run resumed from one
//! ([`Run::resume`]).

use super::{BatchSize, EpochEnd, Learned, Position, Run, Tuned};
use crate::average::Average;
use crate::checkpoint::Checkpoint;
use arbor_core::error::{Error, Result};
use serde_json::{json, Value};

fn meta_error(key: &str, got: &Value) -> Error {
    Error::input("checkpoint metadata", format!("`{key}`"), got.to_string())
}

impl<L> Run<L> {
    /// The run's state as a checkpoint (phase one of CheckFreq: an in-memory copy); `meta` says
    /// what the model and data are.
    pub fn snapshot(&self, meta: &Value, with_optimizer: bool) -> Result<Checkpoint>
    where
        L: Learned,
    {
        let mut tensors = self.model.tensors()?;
        // A checkpoint is never written of a model that is not finite.
        let values = tensors.iter().map(|(n, _, v)| (n.as_str(), v.as_slice()));
        crate::optim::check_finite(self.pos.steps, "the value of", values)?;
        if with_optimizer {
            tensors.extend(self.model.optimizer_tensors()?);
            tensors.extend(self.opt.tensors());
            if let Some(avg) = &self.average {
                tensors.extend(Average::named(&self.averages(avg)?));
            }
        }
        // The run's state goes beside what `meta` records (nothing, where it is not an object).
        let mut meta = if meta.is_object() { meta.clone() } else { json!({}) };
        if let Some(spec) = self.model.spec() {
            meta["model_spec"] = spec;
        }
        let p = self.pos;
        let state = json!({
            "epoch": p.epoch - usize::from(p.step_in_epoch == 0),
            "steps": p.steps,
            "position": {
                "epoch": p.epoch, "step_in_epoch": p.step_in_epoch, "examples_in_epoch": p.examples_in_epoch,
                "epoch_rng": p.epoch_rng, "epoch_loss": self.epoch_loss,
            },
            "best_dev_acc": self.best_dev,
            "best_epoch": self.best_epoch,
            // Its best score and epoch are the run's (`best_dev_acc`, `best_epoch`).
            "last_epoch": self.last_epoch.map(|e| json!({"epoch": e.epoch, "loss": e.loss, "dev": e.dev})),
            "test_acc": self.test_acc,
            "test_scores": self.test_scores.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<String, Value>>(),
            "checkpoint_cadence": self.tuned.map(Tuned::to_json),
            "batch_size": self.batch_size.as_ref().map(BatchSize::to_json),
        });
        if let (Some(m), Value::Object(s)) = (meta.as_object_mut(), state) {
            m.extend(s);
        }
        Ok(Checkpoint { tensors, meta })
    }

    /// Restores parameters, optimizer state, position and accuracies from a checkpoint written
    /// by a run (its `last/` folder). Every setting in `settings` (what
    /// [`Settings::meta`](super::Settings::meta) records: model, sizes, data, seed, batch, …)
    /// must be what the checkpoint recorded, or the position would mean another place in another
    /// order.
    pub fn resume(&mut self, ck: &Checkpoint, settings: &Value) -> Result<()>
    where
        L: Learned,
    {
        let m = &ck.meta;
        if settings.get("model").is_some_and(|want| &m["model"] != want) {
            return Err(Error::input(
                "--resume",
                format!("a checkpoint of this run's model {}", settings["model"]),
                format!("one of model {}", m["model"]),
            ));
        }
        for (key, want) in settings.as_object().into_iter().flatten() {
            if &m[key] != want {
                let (had, asked) = differing(&as_typed(&m[key]).to_string(), &as_typed(want).to_string());
                return Err(Error::input(
                    format!("resuming from a checkpoint with `{key}` = {had}"),
                    "the same setting in this run",
                    asked,
                ));
            }
        }
        if !ck.tensors.iter().any(|(name, _, _)| name.starts_with("opt.")) && m["steps"].as_u64() != Some(0) {
            return Err(Error::input(
                "resuming from a checkpoint",
                "one with optimizer state (a `last/` folder)",
                "parameters only (a `best/` folder is for `arbor eval`)",
            ));
        }
        let p = &m["position"];
        let num = |v: &Value, key: &str| v[key].as_u64().ok_or_else(|| meta_error(key, &v[key]));
        let rng: Vec<u64> =
            p["epoch_rng"].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default();
        let [a, b, c, d] = rng[..] else { return Err(meta_error("position.epoch_rng", &p["epoch_rng"])) };
        let epoch = num(p, "epoch")? as usize;
        if epoch == 0 {
            return Err(meta_error("position.epoch (from 1)", &p["epoch"]));
        }
        let pos = Position {
            epoch,
            step_in_epoch: num(p, "step_in_epoch")? as usize,
            examples_in_epoch: p["examples_in_epoch"].as_u64().map(|n| n as usize),
            epoch_rng: [a, b, c, d],
            steps: num(m, "steps")?,
        };
        self.model.restore(ck)?;
        self.opt.restore(ck, pos.steps)?;
        self.model.adopt_optimizer_state(&mut self.opt)?;
        // A part of a model keeps the optimizer state of its own tensors only.
        let own: std::collections::BTreeSet<String> = self.model.tensors()?.into_iter().map(|t| t.0).collect();
        self.opt.slots.retain(|name, _| own.contains(name));
        self.restore_average(ck)?;
        self.pos = pos;
        // Written by arbor before the epoch's loss was kept: the epoch's mean from here on.
        self.epoch_loss = p["epoch_loss"].as_f64().unwrap_or(0.0);
        // No epoch evaluated yet: recorded as null.
        self.best_dev = m["best_dev_acc"].as_f64().unwrap_or(f64::NEG_INFINITY);
        self.best_epoch = m["best_epoch"].as_u64().unwrap_or(0) as usize;
        let e = &m["last_epoch"];
        let num = |key: &str| e[key].as_f64().unwrap_or(f64::NAN);
        self.last_epoch = e["epoch"].as_u64().map(|epoch| EpochEnd {
            epoch: epoch as usize,
            loss: num("loss"),
            dev: num("dev"),
            best_dev: self.best_dev,
            best_epoch: self.best_epoch,
        });
        self.test_acc = m["test_acc"].as_f64().unwrap_or(f64::NAN);
        self.tuned = Tuned::from_json(&m["checkpoint_cadence"]);
        self.batch_size = BatchSize::from_json(&m["batch_size"]);
        self.test_scores = m["test_scores"]
            .as_object()
            .map(|s| s.iter().filter_map(|(k, v)| Some((k.clone(), v.as_f64()?))).collect())
            .unwrap_or_default();
        Ok(())
    }
}

/// `v` with every number that a flag typed as `f32` recorded (`0.10000000149011612`) shown as
/// typed (`0.1`).
fn as_typed(v: &Value) -> Value {
    match v {
        Value::Number(n) => match n.as_f64() {
            Some(x) if n.is_f64() && f64::from(x as f32) == x => {
                (x as f32).to_string().parse::<f64>().map_or_else(|_| v.clone(), |x| json!(x))
            }
            _ => v.clone(),
        },
        Value::Array(items) => Value::Array(items.iter().map(as_typed).collect()),
        Value::Object(fields) => Value::Object(fields.iter().map(|(k, x)| (k.clone(), as_typed(x))).collect()),
        _ => v.clone(),
    }
}

/// Two settings as a message shows them: whole when short, else only the fields that differ
/// (`…lr: 0.05…` against `…lr: 0.01…` for two optimizer descriptions, or a vocabulary's
/// first differing words).
fn differing(a: &str, b: &str) -> (String, String) {
    if a.len().max(b.len()) <= 60 {
        return (a.to_string(), b.to_string());
    }
    fn fields(s: &str) -> Vec<&str> {
        s.split([',', '{', '}', '[', ']']).map(str::trim).collect()
    }
    let (fa, fb) = (fields(a), fields(b));
    let start = fa.iter().zip(&fb).take_while(|(x, y)| x == y).count();
    let end = fa[start..].iter().rev().zip(fb[start..].iter().rev()).take_while(|(x, y)| x == y).count();
    let part = |f: &[&str]| {
        let middle = f[start..f.len() - end].join(", ");
        let cut: String = middle.chars().take(60).collect();
        format!("…{cut}…")
    };
    (part(&fa), part(&fb))
}
