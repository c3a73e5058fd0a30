//! Pipeline schedules as pure functions: the order in which one stage runs the forward and
//! backward passes of a stream of micro-batches, and a simulation that checks a set of them.
//!
//! Micro-batches are numbered across minibatches: micro-batch `j` belongs to minibatch
//! `j / micro_batches`. Stage `s` of `p` runs 1F1B: `p − s − 1` forwards to fill the pipeline,
//! then one forward and one backward in turn, then the remaining backwards, so it never holds
//! more than `p − s` micro-batches between their forward and backward.

use std::collections::VecDeque;

/// How minibatches follow each other through the pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// 1F1B with a flush after every minibatch: every micro-batch of minibatch `t` sees the
    /// weights `W(t)`, so a step equals accumulating the micro-batches on one worker.
    OneFOneBFlush,
    /// PipeDream-2BW: no flush; minibatch `t` runs on `W(t−1)` while `W(t)` is formed, so a stage
    /// keeps at most two weight versions: `W(t+1) = W(t) − ν·∇f(W(t−1))`.
    TwoBw,
}

impl Kind {
    /// How many versions behind the newest the weights of a minibatch's passes are: 0 with a
    /// flush, 1 for 2BW.
    pub fn lag(self) -> usize {
        match self {
            Kind::OneFOneBFlush => 0,
            Kind::TwoBw => 1,
        }
    }
}

/// One pass of one micro-batch on one stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MicroPass {
    /// The forward pass of micro-batch `j`.
    Forward(usize),
    /// The backward pass of micro-batch `j`.
    Backward(usize),
}

/// 1F1B over micro-batches `first..first + n` for stage `stage` of `stages`.
fn one_f_one_b(stage: usize, stages: usize, first: usize, n: usize, out: &mut Vec<MicroPass>) {
    let warm = stages.saturating_sub(stage + 1).min(n);
    out.extend((first..first + warm).map(MicroPass::Forward));
    for k in 0..n - warm {
        out.push(MicroPass::Forward(first + warm + k));
        out.push(MicroPass::Backward(first + k));
    }
    out.extend((first + n - warm..first + n).map(MicroPass::Backward));
}

/// Stage `stage`'s passes over `minibatches` minibatches of `micro_batches` micro-batches each.
pub fn ops(kind: Kind, stage: usize, stages: usize, minibatches: usize, micro_batches: usize) -> Vec<MicroPass> {
    let mut out = Vec::with_capacity(2 * minibatches * micro_batches);
    match kind {
        Kind::OneFOneBFlush => {
            for t in 0..minibatches {
                one_f_one_b(stage, stages, t * micro_batches, micro_batches, &mut out);
            }
        }
        Kind::TwoBw => one_f_one_b(stage, stages, 0, minibatches * micro_batches, &mut out),
    }
    out
}

/// What a simulated run of a schedule saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    /// For every stage, the most micro-batches it held between forward and backward at once.
    pub max_in_flight: Vec<usize>,
    /// For every stage, the most distinct minibatches among the micro-batches it held at once
    /// (the weight versions 2BW must keep).
    pub max_versions: Vec<usize>,
    /// Messages sent (and received) between neighbouring stages.
    pub messages: usize,
}

/// Runs the stages' op lists against each other with first-in-first-out channels between
/// neighbours: a forward sends its activations to the next stage, a backward its input gradient
/// to the previous one, and every receive must get the micro-batch it expects. Errors name the
/// first violation: a receive that gets another micro-batch, a backward before its forward, a
/// deadlock, or a message left unreceived.
pub fn simulate(per_stage: &[Vec<MicroPass>], micro_batches: usize) -> Result<Trace, String> {
    let p = per_stage.len();
    let m = micro_batches.max(1);
    // down[s]: stage s → s+1 (activations); up[s]: stage s+1 → s (gradients).
    let mut down: Vec<VecDeque<usize>> = vec![VecDeque::new(); p];
    let mut up: Vec<VecDeque<usize>> = vec![VecDeque::new(); p];
    let mut next = vec![0usize; p];
    let mut held: Vec<Vec<usize>> = vec![Vec::new(); p];
    let mut trace = Trace { max_in_flight: vec![0; p], max_versions: vec![0; p], messages: 0 };
    loop {
        let mut progressed = false;
        for s in 0..p {
            let Some(&op) = per_stage[s].get(next[s]) else { continue };
            let inbox = match op {
                MicroPass::Forward(_) if s > 0 => Some(&mut down[s - 1]),
                MicroPass::Backward(_) if s + 1 < p => Some(&mut up[s]),
                _ => None,
            };
            let (MicroPass::Forward(j) | MicroPass::Backward(j)) = op;
            if let Some(inbox) = inbox {
                match inbox.front() {
                    None => continue,
                    Some(&got) if got != j => {
                        return Err(format!("stage {s} expects micro-batch {j} for {op:?} but receives {got}"))
                    }
                    Some(_) => {
                        inbox.pop_front();
                    }
                }
            }
            match op {
                MicroPass::Forward(_) => {
                    held[s].push(j);
                    if s + 1 < p {
                        down[s].push_back(j);
                        trace.messages += 1;
                    }
                }
                MicroPass::Backward(_) => {
                    let Some(k) = held[s].iter().position(|&h| h == j) else {
                        return Err(format!("stage {s} runs the backward of micro-batch {j} before its forward"));
                    };
                    held[s].remove(k);
                    if s > 0 {
                        up[s - 1].push_back(j);
                        trace.messages += 1;
                    }
                }
            }
            let mut versions: Vec<usize> = held[s].iter().map(|j| j / m).collect();
            versions.dedup();
            trace.max_in_flight[s] = trace.max_in_flight[s].max(held[s].len());
            trace.max_versions[s] = trace.max_versions[s].max(versions.len());
            next[s] += 1;
            progressed = true;
        }
        if !progressed {
            break;
        }
    }
    if let Some(s) = (0..p).find(|&s| next[s] < per_stage[s].len()) {
        return Err(format!("deadlock: stage {s} waits at {:?}", per_stage[s][next[s]]));
    }
    if let Some(s) = (0..p).find(|&s| !held[s].is_empty()) {
        return Err(format!("stage {s} never runs the backward of micro-batches {:?}", held[s]));
    }
    if down.iter().chain(&up).any(|q| !q.is_empty()) {
        return Err("a message is never received".into());
    }
    Ok(trace)
}
