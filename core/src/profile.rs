//! Host time by activity within a step (`arbor bench --profile`): where a step's wall time goes
//! besides waiting for the backend's work. Off unless [`enable`]d; on, each [`time`]d region's
//! duration is summed per activity, exclusively (one timed inside another is taken out of the
//! outer one's time), over all threads.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// What the host does in a step, as the engine and the model time it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activity {
    /// Checking and scheduling a minibatch's graphs (ahead of its step, on the planner thread).
    Plan,
    /// Laying out a pass: its batch, index arrays and launch list.
    Lower,
    /// Copying a pass's index arrays and host values to the backend.
    Upload,
    /// Issuing a pass's matrix products (on the CPU: running them).
    Products,
    /// Issuing a pass's fused kernels and row copies.
    Fused,
    /// Issuing a pass's zero fills (gradients before they are added into).
    Fill,
    /// Issuing a pass's scatter-adds (children's gradients into their rows).
    Scatter,
    /// Issuing a pass's row sums (the gradients of parameters added to every row: biases).
    RowSums,
    /// Issuing a pass's attention over children and its gradients.
    Attention,
    /// Issuing the launches a backend held to the end of a pass (on a GPU: a CUDA graph).
    Issue,
    /// Reading values back (on a GPU: waiting for the work queued before).
    Read,
    /// The update outside the above: tests, clipping and the optimizer's calls.
    Update,
}

/// Every activity, in report order.
pub const ACTIVITIES: [Activity; 12] = [
    Activity::Plan,
    Activity::Lower,
    Activity::Upload,
    Activity::Products,
    Activity::Fused,
    Activity::Fill,
    Activity::Scatter,
    Activity::RowSums,
    Activity::Attention,
    Activity::Issue,
    Activity::Read,
    Activity::Update,
];

impl Activity {
    /// The activity's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Activity::Plan => "plan",
            Activity::Lower => "lower",
            Activity::Upload => "upload",
            Activity::Products => "products",
            Activity::Fused => "fused",
            Activity::Fill => "fills",
            Activity::Scatter => "scatters",
            Activity::RowSums => "row_sums",
            Activity::Attention => "attention",
            Activity::Issue => "issue",
            Activity::Read => "read",
            Activity::Update => "update",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; ACTIVITIES.len()] = [const { AtomicU64::new(0) }; ACTIVITIES.len()];

thread_local! {
    /// The activity this thread is timing and since when.
    static OPEN: Cell<Option<(Activity, Instant)>> = const { Cell::new(None) };
}

/// Turns timing on or off (for the whole process).
pub fn enable(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Sets every activity's total back to zero.
pub fn reset() {
    for n in &NANOS {
        n.store(0, Ordering::Relaxed);
    }
}

/// Each activity's summed time so far, in seconds, in [`ACTIVITIES`] order.
pub fn totals() -> Vec<(Activity, f64)> {
    ACTIVITIES.iter().map(|&p| (p, NANOS[p as usize].load(Ordering::Relaxed) as f64 * 1e-9)).collect()
}

fn add(what: Activity, since: Instant, now: Instant) {
    let nanos = u64::try_from((now - since).as_nanos()).unwrap_or(u64::MAX);
    NANOS[what as usize].fetch_add(nanos, Ordering::Relaxed);
}

/// Runs `f`, its time counted to `what` when timing is on.
pub fn time<T>(what: Activity, f: impl FnOnce() -> T) -> T {
    if !ON.load(Ordering::Relaxed) {
        return f();
    }
    let start = Instant::now();
    let outer = OPEN.replace(Some((what, start)));
    if let Some((p, since)) = outer {
        add(p, since, start);
    }
    let out = f();
    let end = Instant::now();
    if let Some((p, since)) = OPEN.replace(outer.map(|(p, _)| (p, end))) {
        add(p, since, end);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn nested_activities_count_exclusively() {
        enable(true);
        reset();
        time(Activity::Update, || {
            std::thread::sleep(Duration::from_millis(20));
            time(Activity::Read, || std::thread::sleep(Duration::from_millis(30)));
        });
        enable(false);
        time(Activity::Lower, || std::thread::sleep(Duration::from_millis(5)));
        let t: Vec<f64> = totals().iter().map(|&(_, s)| s).collect();
        let (update, read) = (t[Activity::Update as usize], t[Activity::Read as usize]);
        // The update alone would be 50 ms with the read in it.
        assert!((0.02..0.045).contains(&update), "update {update}");
        assert!((0.03..0.055).contains(&read), "read {read}");
        assert_eq!(t[Activity::Lower as usize], 0.0, "timing was off");
    }
}
