//! The loop over steps every trainer runs, each step's work prepared ahead on a helper thread.

use crate::engine::{Planned, Planner};
use crate::InputGraph;
use arbor_core::error::{Error, Result};

/// The one loop over steps that every trainer runs ([`Run::fit`](super::Run::fit), which `arbor train`, `arbor
/// bench --mode train` and cross-validation run, and a pipeline stage's passes): while
/// `step` runs step `k` with what `prepare(k)` made of it, `prepare(k + 1)` runs on a helper
/// thread — for a minibatch, checking and scheduling its graphs ([`plan_each`]) — when this
/// thread's CPU budget leaves a core for it (more than one thread), else right after step `k`.
/// Stops after a step that returns `false`.
pub fn each_step<P: Send>(
    count: usize,
    prepare: &(dyn Fn(usize) -> Result<P> + Sync),
    step: &mut dyn FnMut(usize, P) -> Result<bool>,
) -> Result<()> {
    let planner_error = |got: &str| Error::input("the minibatch planner thread", "a finished plan", got);
    let mut next = if count > 0 { Some(prepare(0)?) } else { None };
    // Preparing ahead needs a core the step leaves idle: a worker held to one thread (every core
    // taken by workers) prepares each step right before it instead.
    let spare_core = crate::cpu_thread_budget() > 1;
    std::thread::scope(|scope| {
        for k in 0..count {
            let ahead = (spare_core && k + 1 < count)
                .then(|| {
                    std::thread::Builder::new().name("arbor-planner".into()).spawn_scoped(scope, move || prepare(k + 1))
                })
                .transpose()
                .map_err(|e| planner_error(&format!("no thread: {e}")))?;
            let planned = next.take().ok_or_else(|| planner_error("no plan"))?;
            let go = step(k, planned)?;
            next = match ahead {
                Some(h) => Some(h.join().map_err(|_| planner_error("a panic"))??),
                None if go && k + 1 < count => Some(prepare(k + 1)?),
                None => None,
            };
            if !go {
                break;
            }
        }
        Ok(())
    })
}

/// [`each_step`] over `count` minibatches whose graphs (the part this worker's engine runs) are
/// `graphs(k)`, each checked and scheduled by `planner` ahead of its step.
pub fn plan_each<'g>(
    planner: &Planner,
    count: usize,
    graphs: &(dyn Fn(usize) -> Result<Vec<&'g InputGraph>> + Sync),
    step: &mut dyn FnMut(usize, Planned<'g>) -> Result<bool>,
) -> Result<()> {
    each_step(count, &|k| planner.plan(&graphs(k)?), step)
}
