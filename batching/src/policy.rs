//! Scheduling policies: which task each vertex of a minibatch runs in.

use crate::merged::Merged;
use bumpalo::collections::Vec as BumpVec;
use bumpalo::Bump;

/// Assigns every vertex of a merged minibatch to a task. Tasks run in increasing order; every
/// vertex's children must be in strictly earlier tasks.
pub trait Policy: Send + Sync {
    /// The policy's name, for statistics and messages.
    fn name(&self) -> &'static str;

    /// Writes each vertex's task into `task_of` and returns the number of tasks. `bump` is
    /// scratch memory, reset by the caller after the schedule is built.
    fn assign(&self, g: &Merged<'_>, bump: &Bump, task_of: &mut [u32]) -> usize;
}

/// Batches by height: leaves first, then every vertex whose highest child is one below it.
/// Gives the fewest tasks for trees. The default.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByHeight;

/// Batches by depth from the roots: the deepest vertices first, the roots last.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByDepth;

/// A DyNet-style agenda: repeatedly runs the vertices that are ready (all children done), oldest
/// first, at most `max_batch` at a time.
#[derive(Clone, Copy, Debug)]
pub struct Agenda {
    /// The most vertices one task may hold (`usize::MAX`: every ready vertex).
    pub max_batch: usize,
}

impl Default for Agenda {
    fn default() -> Agenda {
        Agenda { max_batch: usize::MAX }
    }
}

impl Policy for ByHeight {
    fn name(&self) -> &'static str {
        "height"
    }

    fn assign(&self, g: &Merged<'_>, bump: &Bump, task_of: &mut [u32]) -> usize {
        let mut tasks = 0;
        for &v in g.children_first(bump).iter() {
            let h = g.children(v).map(|c| task_of[c] + 1).max().unwrap_or(0);
            task_of[v] = h;
            tasks = tasks.max(h as usize + 1);
        }
        tasks
    }
}

impl Policy for ByDepth {
    fn name(&self) -> &'static str {
        "depth"
    }

    fn assign(&self, g: &Merged<'_>, bump: &Bump, task_of: &mut [u32]) -> usize {
        let order = g.children_first(bump);
        task_of.fill(0);
        // Parents come after their children in `order`, so walking it backwards sees every
        // parent's final depth before its children.
        for &v in order.iter().rev() {
            let d = task_of[v] + 1;
            for c in g.children(v) {
                task_of[c] = task_of[c].max(d);
            }
        }
        let deepest = task_of.iter().copied().max().unwrap_or(0);
        for t in task_of.iter_mut() {
            *t = deepest - *t;
        }
        if g.is_empty() {
            0
        } else {
            deepest as usize + 1
        }
    }
}

impl Policy for Agenda {
    fn name(&self) -> &'static str {
        "agenda"
    }

    fn assign(&self, g: &Merged<'_>, bump: &Bump, task_of: &mut [u32]) -> usize {
        let n = g.len();
        // Parents of every vertex (one entry per child slot), as a compressed list.
        let mut pending = BumpVec::from_iter_in((0..n).map(|v| g.children(v).count() as u32), bump);
        let mut starts = BumpVec::with_capacity_in(n + 1, bump);
        starts.push(0u32);
        let mut counts = BumpVec::from_iter_in(std::iter::repeat_n(0u32, n), bump);
        for v in 0..n {
            for c in g.children(v) {
                counts[c] += 1;
            }
        }
        for v in 0..n {
            starts.push(starts[v] + counts[v]);
        }
        let mut fill = BumpVec::from_iter_in(starts.iter().take(n).copied(), bump);
        let mut parents = BumpVec::from_iter_in(std::iter::repeat_n(0u32, starts[n] as usize), bump);
        for v in 0..n {
            for c in g.children(v) {
                parents[fill[c] as usize] = v as u32;
                fill[c] += 1;
            }
        }
        let mut queue = BumpVec::with_capacity_in(n, bump);
        queue.extend((0..n as u32).filter(|&v| pending[v as usize] == 0));
        let mut head = 0usize;
        let mut task = 0;
        while head < queue.len() {
            let end = queue.len().min(head.saturating_add(self.max_batch.max(1)));
            for i in head..end {
                let v = queue[i] as usize;
                task_of[v] = task;
                for &p in &parents[starts[v] as usize..starts[v + 1] as usize] {
                    pending[p as usize] -= 1;
                    if pending[p as usize] == 0 {
                        queue.push(p);
                    }
                }
            }
            head = end;
            task += 1;
        }
        task as usize
    }
}
