//! What each layer of a [`Model`] costs, measured on a few training steps: the input of the
//! planner that chooses stages × replicas ([`crate::dist::planner`]).

use super::{width_out, Example, Model};
use crate::dist::planner::LayerCost;
use crate::optim::{Config, Optimizer};
use crate::{Backend, InputGraph};
use arbor_core::error::{Error, Result};
use std::time::Instant;

impl<B: Backend> Model<B> {
    /// Each layer's cost, bottom first, the head's added to the top layer's (a pipeline runs the
    /// head on the last stage), measured by training a replica of the model with
    /// `config` on `batches` (the first one warms up; the model itself is left as it is), whole
    /// and cut in quarters, twice each in turn: the faster step times of each give a step's cost per example and its cost per
    /// pass (`t(b) = pass + b·example`), shared among the layers by the floating-point
    /// operations each executed and by the backend calls each made; the bytes of its parameters
    /// (the word vectors with the first layer, of which replicas sum only the rows a minibatch
    /// touches), the arena its last pass used and the rows it passes up (per example).
    pub fn layer_costs(
        &self,
        batches: &[Vec<Example<'_>>],
        config: Config,
        clip: Option<f32>,
    ) -> Result<Vec<LayerCost>> {
        if batches.len() < 2 || batches.iter().any(|b| b.len() < 4) {
            let got = format!("{} of sizes {:?}", batches.len(), batches.iter().map(Vec::len).collect::<Vec<_>>());
            return Err(Error::input("layer costs", "two minibatches or more of 4 examples or more", got));
        }
        let mut m = self.replica()?;
        let mut opt = Optimizer::new(config);
        m.step(&batches[0], &mut opt, clip)?;
        let (flops_before, calls_before) = (m.flops_by_layer(), m.calls_by_layer());
        let mut whole = m.time_steps(&batches[1..], &mut opt, clip)?;
        let (flops, calls) = (m.flops_by_layer(), m.calls_by_layer());
        let quarters: Vec<Vec<Example<'_>>> =
            batches[1..].iter().flat_map(|b| b.chunks(b.len().div_ceil(4)).map(<[_]>::to_vec)).collect();
        let mut quartered = m.time_steps(&quarters, &mut opt, clip)?;
        // A second round, alternating; the faster time of each (a busy moment of the machine
        // in one of them would read as a cost per pass of zero, or a large one).
        whole = whole.min(m.time_steps(&batches[1..], &mut opt, clip)?);
        quartered = quartered.min(m.time_steps(&quarters, &mut opt, clip)?);
        let examples: usize = batches[1..].iter().map(Vec::len).sum();
        let vertices: usize = batches[1..].iter().flatten().flat_map(Example::graphs).map(InputGraph::len).sum();
        // The same examples in `batches.len() − 1` steps and in quarters: the extra passes' cost.
        let passes = (quarters.len() - (batches.len() - 1)) as f64;
        let pass = ((quartered - whole) / passes).max(0.0);
        let per_example = ((whole - pass * (batches.len() - 1) as f64) / examples as f64).max(0.0);
        let vertices = vertices as f64 / examples as f64;
        let last = batches.last().map_or(1, Vec::len) as f64;
        let share = |now: &[u64], was: &[u64]| -> Vec<f64> {
            let d: Vec<f64> = now.iter().zip(was).map(|(n, w)| (n - w) as f64).collect();
            let total = d.iter().sum::<f64>().max(1.0);
            d.iter().map(|x| x / total).collect()
        };
        let (flops, calls) = (share(&flops, &flops_before), share(&calls, &calls_before));
        let table = 4.0 * (self.embedding.vocab() * self.embedding.dim()) as f64;
        let rows = (4.0 * self.embedding.dim() as f64 * vertices * last).min(table);
        let mut costs = Vec::with_capacity(flops.len());
        for (k, e) in m.cells.iter().enumerate() {
            let params = 4.0 * e.params()?.iter().map(Vec::len).sum::<usize>() as f64;
            let (held, summed) = if k == 0 { (table, rows) } else { (0.0, 0.0) };
            costs.push(LayerCost {
                seconds: per_example * flops[k],
                pass_seconds: pass * calls[k],
                param_bytes: params + held,
                sum_bytes: params + summed,
                kept_bytes: 4.0 * e.memory_plan().len as f64 / last,
                output_bytes: 4.0 * (width_out(e.function()) as f64) * vertices,
            });
        }
        let head = 4.0 * m.head.params()?.iter().map(Vec::len).sum::<usize>() as f64;
        let k = flops.len() - 1;
        if let Some(top) = costs.last_mut() {
            top.seconds += per_example * flops[k];
            top.pass_seconds += pass * calls[k];
            top.param_bytes += head;
            top.sum_bytes += head;
            top.kept_bytes += 4.0 * m.head.engine_ref().memory_plan().len as f64 / last;
        }
        Ok(costs)
    }

    /// Floating-point operations each engine executed so far, the cells' then the head's.
    fn flops_by_layer(&self) -> Vec<u64> {
        self.cells.iter().map(|e| e.flops()).chain([self.head.engine_ref().flops()]).collect()
    }

    /// Backend calls each engine made so far, the cells' then the head's.
    fn calls_by_layer(&self) -> Vec<u64> {
        self.cells.iter().map(|e| e.calls()).chain([self.head.engine_ref().calls()]).collect()
    }

    /// Seconds `batches` take as training steps.
    fn time_steps(&mut self, batches: &[Vec<Example<'_>>], opt: &mut Optimizer, clip: Option<f32>) -> Result<f64> {
        let started = Instant::now();
        for b in batches {
            self.step(b, opt, clip)?;
        }
        Ok(started.elapsed().as_secs_f64())
    }
}
