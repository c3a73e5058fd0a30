//! The communication seam of distributed training: point-to-point messages between workers, and
//! the collectives built on them.
//!
//! An implementation only moves bytes (`send` never waits for the receiver; `recv` waits at most
//! a timeout). All-gather and all-reduce are built here on top, so every implementation sums in
//! the same fixed rank order and every worker ends with bitwise the same result. Threads of one
//! process reduce through shared memory instead of bytes, in that same order.

use arbor_core::error::{Error, Result};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

/// How long a worker waits for a peer by default before it gives up with an error.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// Point-to-point messages between the `size()` workers of a group, and collectives over them.
///
/// Messages between two workers arrive in the order they were sent; every worker must issue the
/// same sequence of collectives.
pub trait Collective {
    /// This worker's index in the group.
    fn rank(&self) -> usize;

    /// Workers in the group.
    fn size(&self) -> usize;

    /// Queues `data` for worker `to`; never waits for `to` to receive it.
    fn send(&mut self, to: usize, data: Vec<u8>) -> Result<()>;

    /// The next message from worker `from`; an error if `from` has stopped or sends nothing
    /// within the group's timeout.
    fn recv(&mut self, from: usize) -> Result<Vec<u8>>;

    /// Starts an all-gather: sends `data` to every peer and returns at once.
    fn start_all_gather(&mut self, data: &[u8]) -> Result<()> {
        let me = self.rank();
        for to in (0..self.size()).filter(|&r| r != me) {
            self.send(to, data.to_vec())?;
        }
        Ok(())
    }

    /// Completes the oldest started collective as an all-gather: every worker's data in rank
    /// order, with `mine` (what this worker started with) in its place.
    fn finish_all_gather(&mut self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let mut mine = Some(mine);
        (0..self.size())
            .map(|from| if from == self.rank() { Ok(mine.take().unwrap_or_default()) } else { self.recv(from) })
            .collect()
    }

    /// Starts an all-gather of f32 values: hands `data` to every peer and returns at once.
    /// [`Collective::finish_gather_values`] or [`Collective::finish_all_reduce`] completes it.
    fn start_all_gather_values(&mut self, data: &[f32]) -> Result<()> {
        self.start_all_gather(&to_bytes(data))
    }

    /// Completes the oldest started all-gather of values: every peer's values in rank order,
    /// `None` in this worker's place.
    fn finish_gather_values(&mut self) -> Result<Vec<Option<Values>>> {
        let me = self.rank();
        (0..self.size())
            .map(|from| if from == me { Ok(None) } else { Ok(Some(Arc::new(from_bytes(&self.recv(from)?)))) })
            .collect()
    }

    /// Starts an all-gather of values handed over as they are: peers that share memory read
    /// them without a copy. Completed like [`Collective::start_all_gather_values`].
    fn start_all_gather_shared(&mut self, data: Values) -> Result<()> {
        self.start_all_gather_values(&data)
    }

    /// Starts an all-reduce of `data`: hands it to every peer and returns at once, so the rest of
    /// a backward pass overlaps the transfer. [`Collective::finish_all_reduce`] completes it;
    /// several may be in flight and finish in the order they started.
    fn start_all_reduce(&mut self, data: &[f32]) -> Result<()> {
        self.start_all_gather_values(data)
    }

    /// Completes the oldest started all-gather of values as their sum over all workers, added
    /// in rank order (`mine` in this worker's place), so every worker gets the same bits.
    fn finish_sum(&mut self, mine: &[f32]) -> Result<Vec<f32>> {
        let me = self.rank();
        let parts = self.finish_gather_values()?;
        for (from, p) in parts.iter().enumerate() {
            if let Some(p) = p.as_ref().filter(|p| p.len() != mine.len()) {
                let msg = format!("expected {} values from worker {from}, got {}", mine.len(), p.len());
                return Err(Error::Worker { rank: me, msg });
            }
        }
        let part = |r: usize| parts[r].as_deref().map_or(mine, Vec::as_slice);
        let mut sum: Vec<f32> = match parts.len() {
            0 | 1 => mine.to_vec(),
            _ => part(0).iter().zip(part(1)).map(|(a, b)| a + b).collect(),
        };
        for r in 2..parts.len() {
            sum.iter_mut().zip(part(r)).for_each(|(a, x)| *a += x);
        }
        Ok(sum)
    }

    /// Completes the oldest started all-reduce: `data` (this worker's contribution, as started)
    /// becomes the sum over all workers, added in rank order.
    fn finish_all_reduce(&mut self, data: &mut [f32]) -> Result<()> {
        if self.size() > 1 {
            let sum = self.finish_sum(data)?;
            data.copy_from_slice(&sum);
        }
        Ok(())
    }

    /// Sums `data` over all workers (in rank order), in place.
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<()> {
        self.start_all_reduce(data)?;
        self.finish_all_reduce(data)
    }
}

/// f32 values as little-endian bytes.
pub fn to_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = vec![0; 4 * values.len()];
    // One plain loop over fixed-size chunks: a copy on little-endian machines.
    for (o, v) in out.chunks_exact_mut(4).zip(values) {
        o.copy_from_slice(&v.to_le_bytes());
    }
    out
}

/// Little-endian bytes as f32 values (a trailing partial value is dropped).
pub fn from_bytes(bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0.0; bytes.len() / 4];
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    out
}

/// `len` f32 values received by worker `rank` from worker `from`, or an error naming both.
fn values(rank: usize, from: usize, len: usize, bytes: &[u8]) -> Result<Vec<f32>> {
    if bytes.len() != 4 * len {
        return Err(Error::Worker {
            rank,
            msg: format!("expected {len} values from worker {from}, got {} bytes", bytes.len()),
        });
    }
    Ok(from_bytes(bytes))
}

/// A worker's values as its peers receive them (shared, not copied, between threads).
pub type Values = Arc<Vec<f32>>;

/// One worker of a group of threads in one process, connected by channels. Its all-reduces and
/// all-gathers of values share memory: a worker hands its peers its values read-only (no bytes;
/// one copy per reduction, none for values handed over as they are), and reuses a copy's buffer
/// once every peer has read it.
pub struct ThreadCollective {
    rank: usize,
    to: Vec<Option<Sender<Vec<u8>>>>,
    from: Vec<Option<Receiver<Vec<u8>>>>,
    /// The all-reduce channels, beside the byte channels.
    reduce_to: Vec<Option<Sender<Values>>>,
    reduce_from: Vec<Option<Receiver<Values>>>,
    /// Buffers this worker has shared; reused when no peer holds them any more.
    lent: Vec<Values>,
    timeout: Duration,
}

impl ThreadCollective {
    /// A group of `n` connected workers (hand one to each thread); each waits at most `timeout`
    /// for a message.
    pub fn group(n: usize, timeout: Duration) -> Vec<ThreadCollective> {
        let mut workers: Vec<ThreadCollective> = (0..n)
            .map(|rank| ThreadCollective {
                rank,
                to: (0..n).map(|_| None).collect(),
                from: (0..n).map(|_| None).collect(),
                reduce_to: (0..n).map(|_| None).collect(),
                reduce_from: (0..n).map(|_| None).collect(),
                lent: Vec::new(),
                timeout,
            })
            .collect();
        for a in 0..n {
            for b in (0..n).filter(|&b| b != a) {
                let (tx, rx) = channel();
                workers[a].to[b] = Some(tx);
                workers[b].from[a] = Some(rx);
                let (tx, rx) = channel();
                workers[a].reduce_to[b] = Some(tx);
                workers[b].reduce_from[a] = Some(rx);
            }
        }
        workers
    }

    fn peer_error(&self, peer: usize, what: &str) -> Error {
        Error::Worker { rank: self.rank, msg: format!("worker {peer} {what}") }
    }

    /// The next message on one of `channels` from worker `from`, within the timeout.
    fn take<T>(&self, channels: &[Option<Receiver<T>>], from: usize) -> Result<T> {
        let rx = channels.get(from).and_then(Option::as_ref).ok_or_else(|| self.peer_error(from, "is not a peer"))?;
        rx.recv_timeout(self.timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => {
                self.peer_error(from, &format!("sent nothing for {:.1} s; giving up", self.timeout.as_secs_f64()))
            }
            RecvTimeoutError::Disconnected => self.peer_error(from, "has stopped"),
        })
    }
}

impl Collective for ThreadCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.to.len()
    }

    fn send(&mut self, to: usize, data: Vec<u8>) -> Result<()> {
        let tx = self.to.get(to).and_then(Option::as_ref).ok_or_else(|| self.peer_error(to, "is not a peer"))?;
        tx.send(data).map_err(|_| self.peer_error(to, "has stopped"))
    }

    fn recv(&mut self, from: usize) -> Result<Vec<u8>> {
        self.take(&self.from, from)
    }

    fn start_all_gather_values(&mut self, data: &[f32]) -> Result<()> {
        if self.size() == 1 {
            return Ok(());
        }
        // The smallest buffer every peer is done with that holds `data`, else the largest such
        // buffer (grown), else a new one: each bucket of a step finds its own buffer again.
        let cap = |i: &usize| self.lent[*i].capacity();
        let free = (0..self.lent.len()).filter(|&i| Arc::strong_count(&self.lent[i]) == 1);
        let free = free.clone().filter(|i| cap(i) >= data.len()).min_by_key(cap).or_else(|| free.max_by_key(cap));
        let mut buf = free.map(|i| self.lent.swap_remove(i)).unwrap_or_default();
        let values = Arc::make_mut(&mut buf);
        values.clear();
        values.extend_from_slice(data);
        self.start_all_gather_shared(Arc::clone(&buf))?;
        self.lent.push(buf);
        Ok(())
    }

    fn start_all_gather_shared(&mut self, data: Values) -> Result<()> {
        for to in (0..self.size()).filter(|&r| r != self.rank) {
            let tx = self.reduce_to[to].as_ref().ok_or_else(|| self.peer_error(to, "is not a peer"))?;
            tx.send(Arc::clone(&data)).map_err(|_| self.peer_error(to, "has stopped"))?;
        }
        Ok(())
    }

    fn finish_gather_values(&mut self) -> Result<Vec<Option<Values>>> {
        let me = self.rank;
        (0..self.size())
            .map(|from| if from == me { Ok(None) } else { self.take(&self.reduce_from, from).map(Some) })
            .collect()
    }
}

/// Tagged messages among the stages of one pipeline over a [`Collective`]: a receive for one tag
/// keeps the messages of other tags that arrive first from the same peer for later receives, so
/// independent conversations (a pipeline's activations and its gradient norms) can share one
/// channel.
///
/// The pipeline may be one of several replicas ([`Mailbox::grid`], one replica: every worker a
/// stage): worker `r·P + s` of a group of `P × W` workers is stage `s` of replica `r`. Its ranks
/// are then the stages of its own replica, and [`Mailbox::replicas`] reaches the workers holding
/// the same stage in the others.
/// The two never share a pair of workers, so their messages never meet on one channel.
pub struct Mailbox<'a> {
    coll: &'a mut dyn Collective,
    stash: std::collections::HashMap<(usize, u8), std::collections::VecDeque<Vec<u8>>>,
    /// Stages per replica (`P`).
    stages: usize,
}

impl<'a> Mailbox<'a> {
    /// Tagged messages over `coll`, whose workers are `replicas` copies of a pipeline (worker
    /// `r·P + s` is stage `s` of replica `r`); an error unless `replicas` divides the workers.
    pub fn grid(coll: &'a mut dyn Collective, replicas: usize) -> Result<Mailbox<'a>> {
        let size = coll.size();
        if replicas == 0 || !size.is_multiple_of(replicas) {
            return Err(Error::input(
                "pipeline replicas",
                format!("a number that divides the {size} workers (stages × replicas)"),
                replicas.to_string(),
            ));
        }
        Ok(Mailbox { coll, stash: Default::default(), stages: size / replicas })
    }

    /// This worker's stage.
    pub fn rank(&self) -> usize {
        self.coll.rank() % self.stages
    }

    /// Stages in the pipeline.
    pub fn size(&self) -> usize {
        self.stages
    }

    /// This worker's replica of the pipeline.
    pub fn replica(&self) -> usize {
        self.coll.rank() / self.stages
    }

    /// Replicas of the pipeline.
    pub fn replica_count(&self) -> usize {
        self.coll.size() / self.stages
    }

    /// The workers holding this worker's stage in every replica, as a group (ranked by replica)
    /// for summing gradients.
    pub fn replicas(&mut self) -> Replicas<'_> {
        let (stage, stages) = (self.rank(), self.stages);
        Replicas { coll: &mut *self.coll, stage, stages }
    }

    /// The group rank of this replica's stage `stage`.
    fn peer(&self, stage: usize) -> usize {
        self.replica() * self.stages + stage
    }

    /// Sends `data` to stage `to` under `tag`.
    pub fn send(&mut self, to: usize, tag: u8, mut data: Vec<u8>) -> Result<()> {
        data.push(tag);
        self.coll.send(self.peer(to), data)
    }

    /// The next message under `tag` from stage `from`.
    pub fn recv(&mut self, from: usize, tag: u8) -> Result<Vec<u8>> {
        if let Some(m) = self.stash.get_mut(&(from, tag)).and_then(|q| q.pop_front()) {
            return Ok(m);
        }
        loop {
            let mut m = self.coll.recv(self.peer(from))?;
            let Some(got) = m.pop() else {
                return Err(Error::Worker {
                    rank: self.coll.rank(),
                    msg: format!("worker {} sent a message without a tag", self.peer(from)),
                });
            };
            if got == tag {
                return Ok(m);
            }
            self.stash.entry((from, got)).or_default().push_back(m);
        }
    }

    /// Sends f32 values to `to` under `tag`.
    pub fn send_f32(&mut self, to: usize, tag: u8, data: &[f32]) -> Result<()> {
        self.send(to, tag, to_bytes(data))
    }

    /// Receives exactly `len` f32 values from `from` under `tag`.
    pub fn recv_f32(&mut self, from: usize, tag: u8, len: usize) -> Result<Vec<f32>> {
        let bytes = self.recv(from, tag)?;
        values(self.rank(), from, len, &bytes)
    }
}

/// The workers that hold one stage in every replica of a pipeline ([`Mailbox::replicas`]), as a
/// group of their own: rank `r` is replica `r`'s worker.
pub struct Replicas<'a> {
    coll: &'a mut dyn Collective,
    stage: usize,
    stages: usize,
}

impl Collective for Replicas<'_> {
    fn rank(&self) -> usize {
        self.coll.rank() / self.stages
    }

    fn size(&self) -> usize {
        self.coll.size() / self.stages
    }

    fn send(&mut self, to: usize, data: Vec<u8>) -> Result<()> {
        self.coll.send(to * self.stages + self.stage, data)
    }

    fn recv(&mut self, from: usize) -> Result<Vec<u8>> {
        self.coll.recv(from * self.stages + self.stage)
    }
}
