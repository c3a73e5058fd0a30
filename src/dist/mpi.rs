//! [`Collective`] over MPI processes (Open MPI through the `mpi` crate), for runs launched with
//! `mpirun -np N arbor train ... --distributed mpi`.
//!
//! `send` hands the message to a background thread and returns at once (the thread delivers
//! messages one at a time, in order), so two ranks sending to each other cannot deadlock;
//! receives poll, so a rank that dies or hangs turns into an error after the timeout instead of
//! a hang, and the job is then aborted. This needs `MPI_THREAD_MULTIPLE`.

use super::collective::Collective;
use arbor_core::error::{Error, Result};
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::Threading;
use std::sync::mpsc::{channel, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// This process's place in the MPI world.
pub struct MpiCollective {
    rank: usize,
    size: usize,
    timeout: Duration,
    outbox: Option<Sender<(usize, Vec<u8>)>>,
    sender: Option<JoinHandle<()>>,
    world: SimpleCommunicator,
    // Dropped last: finalizes MPI.
    _universe: mpi::environment::Universe,
}

impl MpiCollective {
    /// Initialises MPI (once per process); each receive waits at most `timeout`.
    pub fn init(timeout: Duration) -> Result<MpiCollective> {
        let fail = |msg: String| Error::Worker { rank: 0, msg };
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| fail("MPI is already initialised in this process".into()))?;
        if threading < Threading::Multiple {
            return Err(fail(format!("this MPI library gives {threading:?} thread support; arbor needs Multiple")));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let (outbox, inbox) = channel::<(usize, Vec<u8>)>();
        let sender = std::thread::Builder::new()
            .name(format!("mpi-send-{rank}"))
            .spawn(move || {
                let world = SimpleCommunicator::world();
                for (to, data) in inbox {
                    // A blocking send would spin in MPI's progress loop until the receiver
                    // matches it, taking a core from the computation; test with pauses instead.
                    mpi::request::scope(|scope| {
                        let mut request = world.process_at_rank(to as i32).immediate_send(scope, &data[..]);
                        let mut pause = Duration::from_micros(1);
                        while let Err(pending) = request.test() {
                            request = pending;
                            std::thread::sleep(pause);
                            pause = (pause * 2).min(Duration::from_micros(200));
                        }
                    });
                }
            })
            .map_err(|e| fail(format!("cannot start the MPI send thread: {e}")))?;
        Ok(MpiCollective {
            rank,
            size,
            timeout,
            outbox: Some(outbox),
            sender: Some(sender),
            world,
            _universe: universe,
        })
    }

    /// Ends every process of the job (MPI_Abort) with exit code `code`: the way out after an
    /// error, since finalizing MPI would wait for peers that may be dead or hung.
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }

    fn error(&self, msg: String) -> Error {
        Error::Worker { rank: self.rank, msg }
    }
}

impl Collective for MpiCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, to: usize, data: Vec<u8>) -> Result<()> {
        if to >= self.size || to == self.rank {
            return Err(self.error(format!("rank {to} is not a peer")));
        }
        let outbox = self.outbox.as_ref().ok_or_else(|| self.error("the MPI send thread is gone".into()))?;
        outbox.send((to, data)).map_err(|_| self.error("the MPI send thread has stopped".into()))
    }

    fn recv(&mut self, from: usize) -> Result<Vec<u8>> {
        if from >= self.size || from == self.rank {
            return Err(self.error(format!("rank {from} is not a peer")));
        }
        let start = Instant::now();
        let process = self.world.process_at_rank(from as i32);
        let mut pause = Duration::from_micros(1);
        loop {
            if let Some(probed) = process.immediate_matched_probe() {
                let (data, _) = probed.matched_receive_vec::<u8>();
                return Ok(data);
            }
            if start.elapsed() > self.timeout {
                return Err(
                    self.error(format!("rank {from} sent nothing for {:.1} s; giving up", self.timeout.as_secs_f64()))
                );
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_micros(50));
        }
    }
}

impl Drop for MpiCollective {
    fn drop(&mut self) {
        // Close the outbox and let the send thread deliver what is queued before MPI finalizes.
        self.outbox = None;
        if let Some(t) = self.sender.take() {
            let _ = t.join();
        }
    }
}
