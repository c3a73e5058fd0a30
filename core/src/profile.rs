//! Host time by phase of a step (`arbor bench --profile`): where a step's wall time goes
//! besides waiting for the backend's work. Off unless [`enable`]d; on, each [`time`]d region's
//! duration is summed per phase, exclusively (a phase timed inside another is taken out of the
//! outer one's time), over all threads.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// A phase of a step, as the engine and the model time it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
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
    /// Issuing a pass's other launches: fills, scatters, row sums, attention.
    Launch,
    /// Reading values back (on a GPU: waiting for the work queued before).
    Read,
    /// The update outside the above: tests, clipping and the optimizer's calls.
    Update,
}

/// Every phase, in report order.
pub const PHASES: [Phase; 8] = [
    Phase::Plan,
    Phase::Lower,
    Phase::Upload,
    Phase::Products,
    Phase::Fused,
    Phase::Launch,
    Phase::Read,
    Phase::Update,
];

impl Phase {
    /// The phase's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Plan => "plan",
            Phase::Lower => "lower",
            Phase::Upload => "upload",
            Phase::Products => "products",
            Phase::Fused => "fused",
            Phase::Launch => "other_launches",
            Phase::Read => "read",
            Phase::Update => "update",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; PHASES.len()] = [const { AtomicU64::new(0) }; PHASES.len()];

thread_local! {
    /// The phase this thread is timing and since when.
    static OPEN: Cell<Option<(Phase, Instant)>> = const { Cell::new(None) };
}

/// Turns timing on or off (for the whole process).
pub fn enable(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Sets every phase's total back to zero.
pub fn reset() {
    for n in &NANOS {
        n.store(0, Ordering::Relaxed);
    }
}

/// Each phase's summed time so far, in seconds, in [`PHASES`] order.
pub fn totals() -> Vec<(Phase, f64)> {
    PHASES.iter().map(|&p| (p, NANOS[p as usize].load(Ordering::Relaxed) as f64 * 1e-9)).collect()
}

fn add(phase: Phase, since: Instant, now: Instant) {
    let nanos = u64::try_from((now - since).as_nanos()).unwrap_or(u64::MAX);
    NANOS[phase as usize].fetch_add(nanos, Ordering::Relaxed);
}

/// Runs `f`, its time counted to `phase` when timing is on.
pub fn time<T>(phase: Phase, f: impl FnOnce() -> T) -> T {
    if !ON.load(Ordering::Relaxed) {
        return f();
    }
    let start = Instant::now();
    let outer = OPEN.replace(Some((phase, start)));
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
    fn nested_phases_count_exclusively() {
        enable(true);
        reset();
        time(Phase::Update, || {
            std::thread::sleep(Duration::from_millis(20));
            time(Phase::Read, || std::thread::sleep(Duration::from_millis(30)));
        });
        enable(false);
        time(Phase::Lower, || std::thread::sleep(Duration::from_millis(5)));
        let t: Vec<f64> = totals().iter().map(|&(_, s)| s).collect();
        let (update, read) = (t[Phase::Update as usize], t[Phase::Read as usize]);
        // The update alone would be 50 ms with the read in it.
        assert!((0.02..0.045).contains(&update), "update {update}");
        assert!((0.03..0.055).contains(&read), "read {read}");
        assert_eq!(t[Phase::Lower as usize], 0.0, "timing was off");
    }
}
