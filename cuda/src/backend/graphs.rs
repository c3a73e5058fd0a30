//! A pass's launches held and issued together as a CUDA graph (off by default: turn it on with
//! [`CudaBackend::set_graphs`] or `ARBOR_CUDA_GRAPHS=1`; it has not yet run on a device).
//!
//! Between [`Backend::hold_launches`](arbor_core::backend::Backend::hold_launches) and
//! [`Backend::issue_held`](arbor_core::backend::Backend::issue_held) (the engine brackets each
//! launch list with them) the backend records its kernel launches instead of issuing them. A
//! run of at least [`MIN_GRAPH`] launches goes out as one graph: a chain of kernel nodes, kept
//! per length and replayed with only the nodes whose function, blocks or arguments changed set
//! anew (`cuGraphExecKernelNodeSetParams`, which may change a node's function too), so a tree's
//! schedule, which differs with every minibatch, reuses the graph of the last one as long (a
//! chain whose node the driver will not set is built afresh).
//! Measured on an H200 with `benches/cuda/*.cu` (BENCHMARKS.md): a launch costs its host
//! 3.4–3.6 µs and the device runs small kernels no faster than that; a captured chain of 60–99
//! kernels whose every node changed was updated and launched for 1.1–2.0 µs a node (1.7–2.0
//! where three kernels mixed), and a graph runs its kernels 1.5 µs apart. Shorter runs are
//! launched one by one. Anything else that uses the stream (a copy, a read, an allocation, a
//! cuBLAS call) issues what is held first, so the device sees every operation in the order the
//! host made it.

use super::{fail, CudaBackend, BLOCK};
use arbor_core::error::Result;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::null_mut;

/// Held launches fewer than this go out one by one.
pub(super) const MIN_GRAPH: usize = 8;

/// Chains kept (one per length); past this many all are dropped and built afresh.
const MAX_CHAINS: usize = 512;

/// A kernel launch as held: its function, its blocks of [`BLOCK`] threads, and each argument
/// in an 8-byte slot (4-byte ones in the low half, which the driver reads on little-endian
/// hosts).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Held {
    pub func: sys::CUfunction,
    pub blocks: u32,
    pub args: Vec<u64>,
}

/// What issuing held launches asks of the driver (the CUDA driver on the backend's stream; a
/// recording one in the tests).
pub(super) trait Driver {
    /// An instantiated chain of kernel nodes, one after another.
    type Chain;
    /// Launches `h` alone.
    fn launch(&mut self, h: &Held) -> Result<()>;
    /// A chain doing `held` in order.
    fn build(&mut self, held: &[Held]) -> Result<Self::Chain>;
    /// Makes node `node` of `chain` do `h` from its next launch on.
    fn set(&mut self, chain: &Self::Chain, node: usize, h: &Held) -> Result<()>;
    /// Launches `chain`.
    fn launch_chain(&mut self, chain: &Self::Chain) -> Result<()>;
}

/// A chain and what each of its nodes does now.
struct Kept<C> {
    chain: C,
    held: Vec<Held>,
}

/// How the held launches went out so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphCounts {
    /// Graphs launched.
    pub graphs: u64,
    /// Graphs built and instantiated (a chain length seen for the first time).
    pub built: u64,
    /// Nodes given new parameters before a replay.
    pub nodes_set: u64,
    /// Nodes launched as part of a graph.
    pub nodes: u64,
    /// Held launches issued one by one (runs too short to be kept as a graph).
    pub direct: u64,
}

/// A backend's held launches and its chains by length.
pub(super) struct Graphs<C> {
    /// Whether launch lists are held at all (`ARBOR_CUDA_GRAPHS=1` turns it on).
    pub enabled: bool,
    /// Whether launches are being held now.
    pub holding: bool,
    pending: Vec<Held>,
    chains: HashMap<usize, Kept<C>>,
    pub counts: GraphCounts,
}

// SAFETY: a `Graphs` holds the driver's function handles (in `Held`) and, in `C`, its graphs;
// they may be used from any thread as long as their calls are not concurrent, and the backend
// that owns it is used by one thread at a time (it is not `Sync`).
unsafe impl<C: Send> Send for Graphs<C> {}

impl<C> Graphs<C> {
    /// Holding nothing; issuing launch lists as graphs if `enabled`.
    pub fn new(enabled: bool) -> Graphs<C> {
        Graphs { enabled, holding: false, pending: Vec::new(), chains: HashMap::new(), counts: GraphCounts::default() }
    }

    /// Graphs on where `ARBOR_CUDA_GRAPHS` is `1`.
    pub fn from_env() -> Graphs<C> {
        Graphs::new(std::env::var("ARBOR_CUDA_GRAPHS").is_ok_and(|v| v == "1"))
    }

    /// Holds `held()` if launches are being held, and says whether it did.
    pub fn hold(&mut self, held: impl FnOnce() -> Held) -> bool {
        if self.holding {
            self.pending.push(held());
        }
        self.holding
    }

    /// Whether launches are held, not yet issued.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Issues every held launch through `driver`: as a chain if there are at least
    /// [`MIN_GRAPH`] (the one kept for that length, its changed nodes set anew; else a new one),
    /// otherwise one by one.
    pub fn issue<D: Driver<Chain = C>>(&mut self, driver: &mut D) -> Result<()> {
        let held = std::mem::take(&mut self.pending);
        let n = held.len();
        if n < MIN_GRAPH {
            self.counts.direct += n as u64;
            return held.iter().try_for_each(|h| driver.launch(h));
        }
        if self.chains.len() >= MAX_CHAINS && !self.chains.contains_key(&n) {
            self.chains.clear();
        }
        let replayed = self.chains.remove(&n).and_then(|mut kept| {
            // A node's new parameters refused (a driver that will not change a node's function,
            // say): the chain is dropped, and one built for this list.
            self.replay(&mut kept, &held, driver).ok().map(|()| kept)
        });
        let kept = match replayed {
            Some(kept) => kept,
            None => {
                self.counts.built += 1;
                Kept { chain: driver.build(&held)?, held }
            }
        };
        self.counts.graphs += 1;
        self.counts.nodes += n as u64;
        let launched = driver.launch_chain(&kept.chain);
        self.chains.insert(n, kept);
        launched
    }

    /// Sets anew the nodes of `kept` whose launch differs from `held`'s.
    fn replay<D: Driver<Chain = C>>(&mut self, kept: &mut Kept<C>, held: &[Held], driver: &mut D) -> Result<()> {
        for (node, (now, h)) in kept.held.iter_mut().zip(held).enumerate() {
            if now != h {
                driver.set(&kept.chain, node, h)?;
                now.clone_from(h);
                self.counts.nodes_set += 1;
            }
        }
        Ok(())
    }
}

/// The CUDA driver on one stream.
pub(super) struct Cuda {
    stream: sys::CUstream,
    /// Pointers to one launch's arguments, kept for the call that reads them.
    slots: Vec<*mut c_void>,
}

/// A CUDA graph of a chain of kernel nodes, instantiated.
pub(super) struct CudaChain {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    nodes: Vec<sys::CUgraphNode>,
}

// SAFETY: see `Graphs`.
unsafe impl Send for CudaChain {}

impl Drop for CudaChain {
    fn drop(&mut self) {
        // SAFETY: both were made for this chain and are destroyed once; a failure (the context
        // gone) leaves nothing to free.
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

fn check(op: &str, r: sys::CUresult) -> Result<()> {
    r.result().map_err(|e| fail(op, e))
}

impl Cuda {
    /// The driver's description of `h`, its argument pointers in `self.slots` (valid until the
    /// next call).
    fn params(&mut self, h: &Held) -> sys::CUDA_KERNEL_NODE_PARAMS {
        self.slots.clear();
        self.slots.extend(h.args.iter().map(|a| std::ptr::from_ref(a).cast_mut().cast::<c_void>()));
        sys::CUDA_KERNEL_NODE_PARAMS {
            func: h.func,
            gridDimX: h.blocks,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: BLOCK,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            kernelParams: self.slots.as_mut_ptr(),
            extra: null_mut(),
            kern: null_mut(),
            ctx: null_mut(),
        }
    }
}

impl Driver for Cuda {
    type Chain = CudaChain;

    fn launch(&mut self, h: &Held) -> Result<()> {
        let p = self.params(h);
        // SAFETY: the function and arguments were checked when the launch was held; the
        // argument pointers point into `h.args`, alive for the call.
        check("launch", unsafe {
            sys::cuLaunchKernel(h.func, h.blocks, 1, 1, BLOCK, 1, 1, 0, self.stream, p.kernelParams, null_mut())
        })
    }

    fn build(&mut self, held: &[Held]) -> Result<CudaChain> {
        let mut chain = CudaChain { graph: null_mut(), exec: null_mut(), nodes: Vec::with_capacity(held.len()) };
        // SAFETY: each call gets handles made here and arguments alive for the call (the driver
        // copies them); a failure drops the chain, which destroys what was made.
        unsafe {
            check("graph", sys::cuGraphCreate(&mut chain.graph, 0))?;
            for h in held {
                let p = self.params(h);
                let mut node = null_mut();
                let (deps, count) = match chain.nodes.last() {
                    Some(last) => (std::ptr::from_ref(last), 1),
                    None => (std::ptr::null(), 0),
                };
                check("graph node", sys::cuGraphAddKernelNode_v2(&mut node, chain.graph, deps, count, &p))?;
                chain.nodes.push(node);
            }
            check("graph instantiate", sys::cuGraphInstantiateWithFlags(&mut chain.exec, chain.graph, 0))?;
        }
        Ok(chain)
    }

    fn set(&mut self, chain: &CudaChain, node: usize, h: &Held) -> Result<()> {
        let p = self.params(h);
        // SAFETY: the node belongs to the graph `exec` was instantiated from; the driver copies
        // the arguments.
        check("graph update", unsafe { sys::cuGraphExecKernelNodeSetParams_v2(chain.exec, chain.nodes[node], &p) })
    }

    fn launch_chain(&mut self, chain: &CudaChain) -> Result<()> {
        // SAFETY: `exec` is instantiated and the stream is the backend's.
        check("graph launch", unsafe { sys::cuGraphLaunch(chain.exec, self.stream) })
    }
}

impl CudaBackend {
    /// Turns issuing each launch list as a CUDA graph on or off (off by default, unless
    /// `ARBOR_CUDA_GRAPHS=1`); what is held is issued first.
    pub fn set_graphs(&self, on: bool) -> Result<()> {
        self.issue()?;
        self.graphs.borrow_mut().enabled = on;
        Ok(())
    }

    /// How held launches went out so far.
    pub fn graph_counts(&self) -> GraphCounts {
        self.graphs.borrow().counts
    }

    /// Issues every held launch (see [`Graphs::issue`]); launches after it are held still if
    /// they were.
    pub(super) fn issue(&self) -> Result<()> {
        let mut g = self.graphs.borrow_mut();
        if !g.has_pending() {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(|e| fail("graph", e))?;
        g.issue(&mut Cuda { stream: self.stream.cu_stream(), slots: Vec::new() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A driver that records what it is asked to do.
    #[derive(Default)]
    struct Recording {
        calls: Vec<String>,
        chains: usize,
        /// Refuse to set a node's parameters.
        refuse: bool,
    }

    impl Driver for Recording {
        type Chain = usize;
        fn launch(&mut self, h: &Held) -> Result<()> {
            self.calls.push(format!("launch {}", h.blocks));
            Ok(())
        }
        fn build(&mut self, held: &[Held]) -> Result<usize> {
            self.chains += 1;
            let blocks: Vec<String> = held.iter().map(|h| h.blocks.to_string()).collect();
            self.calls.push(format!("build {} [{}]", self.chains, blocks.join(" ")));
            Ok(self.chains)
        }
        fn set(&mut self, chain: &usize, node: usize, h: &Held) -> Result<()> {
            if self.refuse {
                return Err(fail("graph update", "refused"));
            }
            self.calls.push(format!("set {chain}.{node} {} {:?}", h.blocks, h.args));
            Ok(())
        }
        fn launch_chain(&mut self, chain: &usize) -> Result<()> {
            self.calls.push(format!("chain {chain}"));
            Ok(())
        }
    }

    fn held(func: usize, blocks: u32, arg: u64) -> Held {
        Held { func: std::ptr::without_provenance_mut(func), blocks, args: vec![arg, 7] }
    }

    fn issue(g: &mut Graphs<usize>, d: &mut Recording, list: &[Held]) -> Vec<String> {
        g.holding = true;
        for h in list {
            assert!(g.hold(|| h.clone()));
        }
        g.holding = false;
        d.calls.clear();
        g.issue(d).unwrap();
        std::mem::take(&mut d.calls)
    }

    #[test]
    fn nothing_is_held_unless_holding() {
        let mut g = Graphs::<usize>::new(true);
        assert!(!g.hold(|| unreachable!("not held")));
        assert!(!g.has_pending());
    }

    #[test]
    fn short_runs_go_out_one_by_one_in_order() {
        let (mut g, mut d) = (Graphs::new(true), Recording::default());
        let list: Vec<Held> = (0..MIN_GRAPH as u32 - 1).map(|k| held(1, k + 1, 0)).collect();
        let calls = issue(&mut g, &mut d, &list);
        let want: Vec<String> = (1..MIN_GRAPH).map(|k| format!("launch {k}")).collect();
        assert_eq!(calls, want);
        assert_eq!(g.counts, GraphCounts { direct: MIN_GRAPH as u64 - 1, ..GraphCounts::default() });
    }

    #[test]
    fn a_chain_per_length_is_replayed_with_only_its_changed_nodes_set() {
        let (mut g, mut d) = (Graphs::new(true), Recording::default());
        let list: Vec<Held> = (0..10).map(|k| held(1, k + 1, 0)).collect();
        let first = issue(&mut g, &mut d, &list);
        assert_eq!(first, ["build 1 [1 2 3 4 5 6 7 8 9 10]", "chain 1"]);
        // The same list replays as it is.
        assert_eq!(issue(&mut g, &mut d, &list), ["chain 1"]);
        // Another function at node 2, other blocks at node 5 and another argument at node 9.
        let mut other = list.clone();
        other[2] = held(2, 3, 0);
        other[5].blocks = 60;
        other[9].args[0] = 99;
        let set = issue(&mut g, &mut d, &other);
        assert_eq!(set, ["set 1.2 3 [0, 7]", "set 1.5 60 [0, 7]", "set 1.9 10 [99, 7]", "chain 1"]);
        // The chain now holds `other`: issuing it again sets nothing, the first list sets back.
        assert_eq!(issue(&mut g, &mut d, &other), ["chain 1"]);
        assert_eq!(issue(&mut g, &mut d, &list).len(), 4);
        // Another length builds its own chain; the first is kept.
        let longer: Vec<Held> = (0..12).map(|k| held(1, k + 1, 0)).collect();
        assert_eq!(issue(&mut g, &mut d, &longer)[1], "chain 2");
        assert_eq!(issue(&mut g, &mut d, &list), ["chain 1"]);
        let c = g.counts;
        assert_eq!((c.graphs, c.built, c.nodes_set, c.nodes, c.direct), (7, 2, 6, 72, 0));
    }

    #[test]
    fn a_chain_whose_nodes_cannot_be_set_is_built_afresh() {
        let (mut g, mut d) = (Graphs::new(true), Recording::default());
        let list: Vec<Held> = (0..9).map(|k| held(1, k + 1, 0)).collect();
        issue(&mut g, &mut d, &list);
        let mut other = list.clone();
        other[4] = held(2, 5, 0);
        d.refuse = true;
        assert_eq!(issue(&mut g, &mut d, &other), ["build 2 [1 2 3 4 5 6 7 8 9]", "chain 2"]);
        // The new chain holds `other`: it replays as it is.
        assert_eq!(issue(&mut g, &mut d, &other), ["chain 2"]);
        assert_eq!((g.counts.built, g.counts.graphs, g.counts.nodes_set), (2, 3, 0));
    }

    #[test]
    fn past_the_limit_every_chain_is_built_afresh() {
        let (mut g, mut d) = (Graphs::new(true), Recording::default());
        for n in MIN_GRAPH..MIN_GRAPH + MAX_CHAINS {
            let list: Vec<Held> = (0..n).map(|_| held(1, 1, 0)).collect();
            issue(&mut g, &mut d, &list);
        }
        assert_eq!(g.chains.len(), MAX_CHAINS);
        let list: Vec<Held> = (0..MIN_GRAPH).map(|_| held(1, 1, 0)).collect();
        assert_eq!(issue(&mut g, &mut d, &list), ["chain 1"], "a kept length replays");
        let beyond: Vec<Held> = (0..MIN_GRAPH + MAX_CHAINS).map(|_| held(1, 1, 0)).collect();
        issue(&mut g, &mut d, &beyond);
        assert_eq!(g.chains.len(), 1, "the others were dropped");
        assert_eq!(g.counts.built, MAX_CHAINS as u64 + 1);
    }
}
