//! A team of threads for the CPU backend: the calling thread plus helper threads that wait for
//! work by spinning, then yielding, then sleeping. Handing a part of a call to a spinning helper
//! takes well under a microsecond, where waking a sleeping thread (as a thread pool's join does
//! after any pause) takes tens of microseconds — longer than many of a minibatch's calls.
//!
//! Part `p` of a call is helper `p`'s, but a caller done with its own part that has waited a few
//! microseconds takes over the parts no helper has started: a helper the system has not given a
//! core (the machine runs more threads than it has cores, e.g. two trainings side by side) then
//! costs the call its part's time, not the wait for its next time slice. Each helper marks a part
//! taken on a cache line of its own, so the usual hand-off moves no extra line between cores.
//!
//! One team serves the process. A call uses as many threads as its thread's budget allows
//! ([`with_threads`], which the trainers set per worker, and
//! [`CpuBackend::with_threads`](super::CpuBackend::with_threads) per backend; every core
//! otherwise); a call made while another thread holds the team, or from inside one of its parts,
//! runs on the caller alone.

use arbor_core::error::Error;
use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long an idle helper spins, then yields, before it sleeps.
const SPIN: Duration = Duration::from_micros(100);
const YIELD: Duration = Duration::from_millis(2);
/// Spins (a few microseconds) a caller waits for the helpers before it takes over their parts.
const TAKE_OVER_SPINS: u32 = 64;

/// A part of a call: `f(part, parts)`.
type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    /// `(sequence << 16) | parts` of the latest job: helpers run it when the sequence moves.
    state: AtomicU64,
    /// The latest job. Written only while no helper runs one; read by helpers after they see
    /// its `state` (which is published after it).
    job: UnsafeCell<Option<*const Job>>,
    /// Helpers done with the latest job.
    done: AtomicUsize,
    /// A helper's part panicked.
    panicked: AtomicBool,
    /// Per helper: it is asleep (or about to be) and needs an unpark.
    sleeping: Vec<AtomicBool>,
    /// Per helper: the sequence of the latest job whose part of the helper's was taken, by the
    /// helper or by the caller taking it over.
    taken: Vec<Taken>,
}

/// A helper's [`Shared::taken`], alone on its cache line.
#[repr(align(128))]
struct Taken(AtomicU64);

impl Taken {
    /// Takes the part of the job with sequence `seq` unless it (or a newer job's) is taken.
    fn take(&self, seq: u64) -> bool {
        let now = self.0.load(Ordering::Acquire);
        now < seq && self.0.compare_exchange(now, seq, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }
}

// SAFETY: `job` is written by the thread holding the team only while no helper reads it (before
// publishing `state`, after every participant reported done); all other fields are atomics.
unsafe impl Sync for Shared {}

struct Team {
    shared: &'static Shared,
    helpers: Vec<Thread>,
    busy: AtomicBool,
}

static TEAM: OnceLock<Team> = OnceLock::new();

fn team() -> &'static Team {
    TEAM.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            state: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleeping: (1..cores).map(|_| AtomicBool::new(false)).collect(),
            taken: (1..cores).map(|_| Taken(AtomicU64::new(0))).collect(),
        }));
        // A helper that cannot start leaves the team smaller.
        let helpers = (1..cores)
            .map_while(|me| {
                std::thread::Builder::new()
                    .name(format!("arbor-cpu-{me}"))
                    .spawn(move || helper(shared, me))
                    .ok()
                    .map(|h| h.thread().clone())
            })
            .collect();
        Team { shared, helpers, busy: AtomicBool::new(false) }
    })
}

/// The loop of helper `me` (1-based: part 0 is the caller's).
fn helper(shared: &'static Shared, me: usize) {
    let mut seen = 0u64;
    loop {
        let mut idle_since = Instant::now();
        let mut spins = 0u32;
        let state = loop {
            let s = shared.state.load(Ordering::Acquire);
            if s >> 16 != seen >> 16 {
                break s;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(256) {
                std::hint::spin_loop();
                continue;
            }
            let idle = idle_since.elapsed();
            if idle < SPIN {
                std::hint::spin_loop();
            } else if idle < SPIN + YIELD {
                std::thread::yield_now();
            } else {
                shared.sleeping[me - 1].store(true, Ordering::SeqCst);
                if shared.state.load(Ordering::SeqCst) >> 16 == seen >> 16 {
                    std::thread::park();
                }
                shared.sleeping[me - 1].store(false, Ordering::SeqCst);
                idle_since = Instant::now();
            }
        };
        seen = state;
        let parts = (state & 0xffff) as usize;
        if me < parts && shared.taken[me - 1].take(state >> 16) {
            // SAFETY: the job was written before `state` was published, and the caller keeps it
            // alive until every part taken has been reported done.
            let job = unsafe { *shared.job.get() };
            // No job would break the team's protocol; it fails the call like a panicking part.
            // SAFETY: the job outlives this call (as above).
            let ran = job.is_some_and(|job| catch_unwind(AssertUnwindSafe(|| unsafe { &*job }(me, parts))).is_ok());
            if !ran {
                shared.panicked.store(true, Ordering::Relaxed);
            }
            shared.done.fetch_add(1, Ordering::Release);
        }
    }
}

thread_local! {
    /// This thread's budget of threads per call (0: every core).
    static BUDGET: Cell<usize> = const { Cell::new(0) };
}

/// Runs `f` with every CPU backend call and optimizer update made on this thread using at most
/// `n` threads (at least 1): a trainer's share of the cores per worker.
pub fn with_threads<T>(n: usize, f: impl FnOnce() -> T) -> T {
    /// Puts the budget back, also when `f` panics.
    struct Restore(usize);
    impl Drop for Restore {
        fn drop(&mut self) {
            BUDGET.set(self.0);
        }
    }
    let _restore = Restore(BUDGET.replace(n.max(1)));
    f()
}

/// Threads a call on this thread may use at most: its budget ([`with_threads`]), else every core
/// (the team's size, counted once).
pub fn budget() -> usize {
    match BUDGET.get() {
        0 => team().helpers.len() + 1,
        n => n,
    }
}

/// Threads in the team: no call is split into more parts.
pub(crate) fn size() -> usize {
    team().helpers.len() + 1
}

/// Threads a call made now could use: the thread's budget, at most the team's size, and 1 while
/// another call holds the team.
pub(crate) fn threads() -> usize {
    let t = team();
    if t.busy.load(Ordering::Relaxed) {
        return 1;
    }
    budget().clamp(1, t.helpers.len() + 1)
}

/// Runs `f(part, parts)` for every part of `0..parts`, each on its own thread (part 0 on the
/// caller), with `parts` at most `max` and at most [`threads`]; returns when all are done, with
/// the first error any part returned.
pub(crate) fn split(max: usize, f: impl Fn(usize, usize) -> Result<(), Error> + Sync) -> Result<(), Error> {
    let t = team();
    let parts = max.min(threads());
    if parts <= 1 || t.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        return f(0, 1);
    }
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    let job = |part: usize, parts: usize| {
        if let Err(e) = f(part, parts) {
            let mut slot = first_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            slot.get_or_insert(e);
        }
    };
    let job_ref: &(dyn Fn(usize, usize) + Sync + '_) = &job;
    let s = t.shared;
    // SAFETY: no helper reads `job` now (the previous call waited for all its participants), and
    // this call waits for all of its own before `job` goes out of scope, even if part 0 panics.
    // The lifetime is erased only for the duration of this call.
    unsafe {
        *s.job.get() = Some(std::mem::transmute::<&(dyn Fn(usize, usize) + Sync + '_), &'static Job>(job_ref));
    }
    s.done.store(0, Ordering::Relaxed);
    let seq = (s.state.load(Ordering::Relaxed) >> 16).wrapping_add(1) & 0xffff_ffff_ffff;
    s.state.store((seq << 16) | parts as u64, Ordering::SeqCst);
    for (h, asleep) in t.helpers.iter().zip(&s.sleeping).take(parts - 1) {
        if asleep.load(Ordering::SeqCst) {
            h.unpark();
        }
    }
    let mut mine = catch_unwind(AssertUnwindSafe(|| job(0, parts)));
    // Helpers count their parts in `done`; the caller counts those it took over.
    let mut taken_over = 0;
    let mut spins = 0u32;
    while s.done.load(Ordering::Acquire) + taken_over < parts - 1 {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(TAKE_OVER_SPINS) {
            for part in 1..parts {
                if s.taken[part - 1].take(seq) {
                    let ran = catch_unwind(AssertUnwindSafe(|| job(part, parts)));
                    mine = mine.and(ran);
                    taken_over += 1;
                }
            }
        }
        if spins < 1 << 16 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    let helper_panicked = s.panicked.swap(false, Ordering::Relaxed);
    t.busy.store(false, Ordering::Release);
    if let Err(p) = mine {
        resume_unwind(p);
    }
    if helper_panicked {
        panic!("a part of a CPU backend call panicked on a helper thread");
    }
    first_error.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner).map_or(Ok(()), Err)
}

/// The part `part` of `parts` equal shares of `0..units`, as a range.
pub(crate) fn share(units: usize, part: usize, parts: usize) -> std::ops::Range<usize> {
    units * part / parts..units * (part + 1) / parts
}

/// Who has taken which of a call's units of work. The units are shared out as runs, one a part
/// ([`share`]); a part takes its own run from the front, then the others' from the back: each
/// thread works on its own stretch (two threads writing beside each other share cache lines at
/// every border), and none waits while another has work left. Sized for the team ([`size`]),
/// which bounds every call's parts.
pub(crate) struct Claims(smallvec::SmallVec<[AtomicU64; 8]>);

impl Claims {
    /// Claims for calls split into at most `parts` parts.
    pub(crate) fn new(parts: usize) -> Self {
        Claims((0..parts).map(|_| AtomicU64::new(0)).collect())
    }

    /// The next unit of `units` for part `part` of `parts`, if any is left.
    pub(crate) fn next(&self, units: usize, part: usize, parts: usize) -> Option<usize> {
        for q in (0..parts).map(|i| (part + i) % parts) {
            let stretch = share(units, q, parts);
            // Units taken from the front (by its owner) in the high half, from the back below.
            let taken = &self.0[q];
            let mut now = taken.load(Ordering::Acquire);
            loop {
                let (front, back) = ((now >> 32) as usize, (now & 0xffff_ffff) as usize);
                if stretch.start + front + back >= stretch.end {
                    break;
                }
                let (then, unit) = if q == part {
                    (now + (1 << 32), stretch.start + front)
                } else {
                    (now + 1, stretch.end - 1 - back)
                };
                match taken.compare_exchange_weak(now, then, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Some(unit),
                    Err(seen) => now = seen,
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_part_runs_once_and_errors_come_back() {
        for _ in 0..1000 {
            let hits: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
            split(64, |part, parts| {
                for i in share(64, part, parts) {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
            .unwrap();
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        let e = split(4, |part, _| if part == 0 { Err(crate::cpu::bad("test", "part 0 fails")) } else { Ok(()) });
        assert!(e.unwrap_err().to_string().contains("part 0 fails"));
    }

    #[test]
    fn nested_and_concurrent_calls_run_alone() {
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        let count = AtomicUsize::new(0);
                        split(8, |_, outer| {
                            split(8, |_, inner| {
                                // (An outer call that ran alone holds no team: its nested call may.)
                                if outer > 1 {
                                    assert_eq!(inner, 1, "a nested call runs on its caller alone");
                                }
                                count.fetch_add(1, Ordering::Relaxed);
                                Ok(())
                            })
                        })
                        .unwrap();
                        assert!(count.load(Ordering::Relaxed) >= 1);
                    }
                });
            }
        });
    }

    #[test]
    fn a_part_is_taken_once_and_never_for_an_older_job() {
        let t = Taken(AtomicU64::new(0));
        let wins = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    if t.take(7) {
                        wins.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        });
        assert_eq!(wins.load(Ordering::Relaxed), 1);
        // A helper that wakes late for job 5 finds job 7's part taken and runs nothing.
        assert!(!t.take(5) && !t.take(7) && t.take(8));
    }

    #[test]
    fn shares_cover_the_range() {
        for units in [0, 1, 7, 750] {
            for parts in 1..5 {
                let all: Vec<usize> = (0..parts).flat_map(|p| share(units, p, parts)).collect();
                assert_eq!(all, (0..units).collect::<Vec<_>>());
            }
        }
    }
}
