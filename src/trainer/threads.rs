//! The workers of a run as threads of this process.

use super::{Event, Learner, Run, Settings, Splits, Summary};
use crate::dist::ThreadCollective;
use arbor_core::error::{Error, Result};
use std::time::Duration;

/// The error to report from a group of failed workers: the first that is not a consequence of
/// another worker stopping.
fn root_cause(errors: Vec<Error>) -> Error {
    let consequence = |e: &Error| matches!(e, Error::Worker { msg, .. } if msg.ends_with("has stopped"));
    let first = errors.iter().position(|e| !consequence(e)).unwrap_or(0);
    errors.into_iter().nth(first).unwrap_or(Error::Worker { rank: 0, msg: "failed".into() })
}

/// Runs `work` once per state, each on its own thread (one worker alone on this thread) as one
/// worker of a [`ThreadCollective`] group (worker `i` gets `states[i]`), with an equal share of the calling thread's CPU threads
/// ([`cpu_thread_budget`](crate::cpu_thread_budget)) for its backend calls and updates. Worker `reporter`'s events reach `events` on this thread. Returns every worker's
/// result in rank order; if any failed, the error that caused the others'.
pub fn on_threads<S: Send, T: Send>(
    states: Vec<S>,
    timeout: Duration,
    reporter: usize,
    events: &mut dyn FnMut(Event),
    work: impl Fn(S, &mut ThreadCollective, &mut dyn FnMut(Event)) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let workers = states.len().max(1);
    let share = (crate::cpu_thread_budget() / workers).max(1);
    if states.len() == 1 {
        // One worker runs on this thread: no thread to start, and its memory comes from the
        // allocator's main arena like the rest of the program's.
        let no_worker = || Error::Worker { rank: 0, msg: "no worker".into() };
        let mut coll = ThreadCollective::group(1, timeout).pop().ok_or_else(no_worker)?;
        let state = states.into_iter().next().ok_or_else(no_worker)?;
        let mut quiet = |_: Event| {};
        let events: &mut dyn FnMut(Event) = if reporter == 0 { events } else { &mut quiet };
        let run = std::panic::AssertUnwindSafe(|| crate::with_cpu_threads(share, || work(state, &mut coll, events)));
        let done =
            std::panic::catch_unwind(run).unwrap_or_else(|_| Err(Error::Worker { rank: 0, msg: "panicked".into() }));
        return done.map(|t| vec![t]);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let work = &work;
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = states
            .into_iter()
            .zip(ThreadCollective::group(workers, timeout))
            .enumerate()
            .map(|(rank, (state, mut coll))| {
                let tx = (rank == reporter).then(|| tx.clone());
                s.spawn(move || {
                    let mut report = |e: Event| {
                        if let Some(tx) = &tx {
                            // The receiver lives until every worker has ended.
                            let _ = tx.send(e);
                        }
                    };
                    crate::with_cpu_threads(share, || work(state, &mut coll, &mut report))
                })
            })
            .collect();
        // The reporter's events, relayed on this thread until every worker is done.
        drop(tx);
        rx.iter().for_each(events);
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| h.join().unwrap_or_else(|_| Err(Error::Worker { rank, msg: "panicked".into() })))
            .collect()
    });
    let errors: Vec<Error> = results.iter().filter_map(|r| r.as_ref().err().cloned()).collect();
    if errors.is_empty() {
        results.into_iter().collect()
    } else {
        Err(root_cause(errors))
    }
}

/// Trains `run` data-parallel on `workers` threads of this process; returns worker 0's summary,
/// with `run` holding the result. A worker that fails or stops answering for `timeout` ends the
/// run with an error.
pub fn fit_threads<L: Learner<E>, E: Sync>(
    run: &mut Run<L>,
    workers: usize,
    timeout: Duration,
    data: Splits<'_, E>,
    plan: &Settings,
    events: &mut dyn FnMut(Event),
) -> Result<Summary>
where
    Run<L>: Send,
{
    let mut replicas: Vec<Run<L>> = (1..workers.max(1)).map(|_| run.replica()).collect::<Result<_>>()?;
    let runs: Vec<&mut Run<L>> = std::iter::once(run).chain(replicas.iter_mut()).collect();
    fit_together(runs, timeout, data, plan, events)
}

/// Trains `runs` together, one thread each, as the workers of one run: replicas of one model
/// (data-parallel), or the stages of a pipeline in order ([`Learned::parted`](super::Learned::parted)), replica after
/// replica where the pipeline is replicated. Returns the summary of the worker that reports
/// (worker 0, or the first pipeline's last stage, which knows the losses), `events` hearing
/// what it reports.
pub fn fit_together<L: Learner<E>, E: Sync>(
    runs: Vec<&mut Run<L>>,
    timeout: Duration,
    data: Splits<'_, E>,
    plan: &Settings,
    events: &mut dyn FnMut(Event),
) -> Result<Summary>
where
    Run<L>: Send,
{
    let parts = |r: &&mut Run<L>| r.model.parted().then(|| runs.len() / r.model.replicas().max(1));
    let reporter = runs.first().and_then(parts).map_or(0, |p| p.saturating_sub(1));
    let summaries = on_threads(runs, timeout, reporter, events, |run, coll, report| run.fit(data, plan, coll, report))?;
    Ok(summaries.into_iter().nth(reporter).unwrap_or_default())
}
