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
    // taken by workers) prepares each step right before it instead. The helper is one thread for
    // the whole loop, asked for each step's preparation in turn (a thread started a step costs
    // its start and its stack's first pages every step).
    let spare_core = crate::cpu_thread_budget() > 1 && count > 1;
    std::thread::scope(|scope| {
        let (ask, asked) = std::sync::mpsc::channel::<usize>();
        let (give, given) = std::sync::mpsc::channel::<Result<P>>();
        let helper = spare_core
            .then(|| {
                std::thread::Builder::new().name("arbor-planner".into()).spawn_scoped(scope, move || {
                    for k in asked {
                        if give.send(prepare(k)).is_err() {
                            break;
                        }
                    }
                })
            })
            .transpose()
            .map_err(|e| planner_error(&format!("no thread: {e}")))?;
        let mut steps = || -> Result<()> {
            for k in 0..count {
                let ahead = helper.is_some() && k + 1 < count;
                if ahead {
                    ask.send(k + 1).map_err(|_| planner_error("a panic"))?;
                }
                let planned = next.take().ok_or_else(|| planner_error("no plan"))?;
                let go = step(k, planned)?;
                next = match ahead {
                    true => Some(given.recv().map_err(|_| planner_error("a panic"))??),
                    false if go && k + 1 < count => Some(prepare(k + 1)?),
                    false => None,
                };
                if !go {
                    break;
                }
            }
            Ok(())
        };
        let done = steps();
        // The helper ends when no more is asked; a panic of its own is this loop's error (joined
        // here, it does not reach the scope).
        drop(ask);
        match helper.map(|h| h.join()) {
            Some(Err(_)) => done.and(Err(planner_error("a panic"))),
            _ => done,
        }
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

#[cfg(test)]
mod tests {
    use super::each_step;
    use arbor_core::error::Error;

    /// Each step gets its own preparation, in order, with a helper thread and without one; a
    /// step that says stop ends the loop; an error of a preparation or a step comes back.
    #[test]
    fn every_step_gets_its_own_preparation() {
        for threads in [1, 2] {
            crate::with_cpu_threads(threads, || {
                let mut seen = Vec::new();
                each_step(5, &|k| Ok(k * 10), &mut |k, p| {
                    seen.push((k, p));
                    Ok(true)
                })
                .unwrap();
                assert_eq!(seen, [(0, 0), (1, 10), (2, 20), (3, 30), (4, 40)], "{threads} threads");
                seen.clear();
                each_step(5, &|k| Ok(k), &mut |k, p| {
                    seen.push((k, p));
                    Ok(k < 2)
                })
                .unwrap();
                assert_eq!(seen, [(0, 0), (1, 1), (2, 2)], "{threads} threads: stopped after step 2");
                let bad = |k: usize| if k == 3 { Err(Error::input("test", "a plan", "none")) } else { Ok(k) };
                let e = each_step(5, &bad, &mut |_, _| Ok(true)).unwrap_err();
                assert!(e.to_string().contains("none"), "{threads} threads: {e}");
                let e = each_step(5, &|k| Ok(k), &mut |k, _| match k {
                    1 => Err(Error::input("test step", "a step", "a failure")),
                    _ => Ok(true),
                })
                .unwrap_err();
                assert!(e.to_string().contains("a failure"), "{threads} threads: {e}");
            });
        }
        // A preparation that panics on the helper is the loop's error, not a panic.
        let e = crate::with_cpu_threads(2, || {
            each_step(5, &|k| if k == 3 { panic!("a planner bug") } else { Ok(k) }, &mut |_, _| Ok(true))
        })
        .unwrap_err();
        assert!(e.to_string().contains("a panic"), "{e}");
    }
}
