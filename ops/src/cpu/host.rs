//! Host-side loops outside the backend's calls (an optimizer's update over parameters kept on the
//! host): split between the CPU team's threads and compiled for the widest vector instructions
//! the CPU has.

use std::sync::Mutex;

/// Runs `f` on every item, the items shared out between the team's threads (in order, about
/// equally many per thread). Runs on the caller alone for a single item.
pub fn for_each_on_team<T: Send>(items: Vec<T>, f: impl Fn(T) + Sync) {
    let n = items.len();
    let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
    let take = |i: usize| slots[i].lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
    // Parts never fail: `f` returns nothing.
    let _ = super::team::split(n, |part, parts| {
        for i in super::team::share(n, part, parts) {
            if let Some(t) = take(i) {
                f(t);
            }
        }
        Ok(())
    });
}

/// Runs `f`, compiled for AVX-512 or AVX2 + FMA when the [active](super::isa::active) level has
/// them — where `f` is inlined here: pass a closure marked `#[inline(always)]` (one left to the
/// compiler may be compiled on its own, with the baseline's instructions).
#[inline(always)]
pub fn vectorised<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    match super::isa::active() {
        // SAFETY: the active level is at most what the CPU has.
        super::isa::Isa::Avx512 => return unsafe { wide(f) },
        // SAFETY: as above.
        super::isa::Isa::Avx2 => return unsafe { fast(f) },
        super::isa::Isa::Baseline => {}
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn wide<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fast<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_item_runs_once() {
        let hits: Vec<AtomicUsize> = (0..37).map(|_| AtomicUsize::new(0)).collect();
        for_each_on_team((0..37).collect(), |i: usize| {
            hits[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        let mut data = vec![1.0f32; 1000];
        for_each_on_team(data.chunks_mut(100).collect(), |c| {
            vectorised(
                #[inline(always)]
                || c.iter_mut().for_each(|x| *x *= 3.0),
            )
        });
        assert!(data.iter().all(|&x| x == 3.0));
    }
}
