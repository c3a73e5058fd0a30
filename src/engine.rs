//! The engine: runs a vertex function over a scheduled minibatch on a backend.
//!
//! Memory: one arena holds, for every vertex of the minibatch, the pulled inputs, every forward
//! value the plan stores, the pushed-output gradients, the state gradients and every backward
//! value the plan stores, each as one `[vertices × block]` region ordered by task. Parameters and
//! their gradients live in two more buffers. The arena and the index buffer grow when a larger
//! minibatch arrives and are reused otherwise, so a steady-state step allocates nothing.

use arbor_batching::Schedule;
use arbor_core::backend::{Backend, Gemm, IndexLoc, Loc, Mem, Rows, NO_ROW};
use arbor_core::error::{Error, Result};
use arbor_core::fusion::{Kernel, Phase, Plan, Step};
use arbor_core::graph::InputGraph;
use arbor_core::ir::{Func, Op, ParamGrad, Port, ValueId, VertexFn};
use std::ops::Range;
use std::sync::Arc;

const ARENA: usize = 0;
const PARAMS: usize = 1;
const GRADS: usize = 2;

/// Which function a value belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
}

/// Where everything of one minibatch lives in the arena and the index buffer.
#[derive(Default)]
struct Layout {
    vertices: usize,
    pulls: Vec<usize>,
    forward: Vec<Option<usize>>,
    backward: Vec<Option<usize>>,
    push_grads: Vec<usize>,
    state_grads: Vec<usize>,
    arena: usize,
    child_slots: usize,
    child_offsets: usize,
    child_list: usize,
    index: usize,
}

impl Layout {
    fn new(f: &VertexFn, s: &Schedule) -> Layout {
        let n = s.len();
        let mut at = 0;
        let mut region = |numel: usize| {
            let start = at;
            at += n * numel;
            start
        };
        let pulls = f.inputs().iter().map(|p| region(p.shape.numel())).collect();
        let mut stored = |func: &Func, plan: &Plan| -> Vec<Option<usize>> {
            func.nodes
                .iter()
                .enumerate()
                .map(|(i, node)| {
                    let own = plan.stored[i]
                        && !matches!(
                            node.op,
                            Op::Pull { .. }
                                | Op::Primal { .. }
                                | Op::StateGrad { .. }
                                | Op::PushGrad { .. }
                        );
                    own.then(|| region(node.shape.numel()))
                })
                .collect()
        };
        let forward = stored(f.forward(), f.forward_plan());
        let backward = stored(&f.backward().func, f.backward_plan());
        let push_grads = f
            .outputs()
            .iter()
            .map(|o| region(o.shape.numel()))
            .collect();
        let state_grads = f
            .states()
            .iter()
            .map(|st| region(st.shape.numel()))
            .collect();
        let child_slots = 0;
        let child_offsets = f.arity() * n;
        let child_list = child_offsets + n + 1;
        Layout {
            vertices: n,
            pulls,
            forward,
            backward,
            push_grads,
            state_grads,
            arena: at,
            child_slots,
            child_offsets,
            child_list,
            index: child_list + s.child_list.len(),
        }
    }
}

/// Gradients from one backward pass.
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients {
    /// Per pulled input, the gradient rows in merged-vertex order.
    pub pulls: Vec<Vec<f32>>,
    /// Per parameter, its gradient (summed over all vertices).
    pub params: Vec<Vec<f32>>,
}

/// Runs one vertex function over minibatches of input graphs on a backend.
pub struct Engine<B: Backend> {
    backend: B,
    f: Arc<VertexFn>,
    bufs: Vec<B::Buffer>,
    index: Vec<B::Index>,
    param_at: Vec<usize>,
    schedule: Schedule,
    layout: Layout,
    host: Vec<f32>,
    host_index: Vec<u32>,
}

fn internal(msg: String) -> Error {
    Error::Backend {
        backend: "engine",
        op: "plan".into(),
        msg,
    }
}

impl<B: Backend> Engine<B> {
    /// An engine for `f` with initial parameter values (in the order of `f.params()`).
    pub fn new(backend: B, f: VertexFn, params: &[Vec<f32>]) -> Result<Engine<B>> {
        let mut param_at = Vec::with_capacity(f.params().len());
        let mut total = 0;
        for p in f.params() {
            param_at.push(total);
            total += p.shape.numel();
        }
        let bufs = vec![
            backend.alloc(0)?,
            backend.alloc(total)?,
            backend.alloc(total)?,
        ];
        let index = vec![backend.alloc_index(0)?];
        let mut e = Engine {
            backend,
            f: Arc::new(f),
            bufs,
            index,
            param_at,
            schedule: Schedule::default(),
            layout: Layout::default(),
            host: Vec::new(),
            host_index: Vec::new(),
        };
        e.set_params(params)?;
        Ok(e)
    }

    /// The vertex function.
    pub fn function(&self) -> &VertexFn {
        &self.f
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The schedule of the last forward pass.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Replaces every parameter's values.
    pub fn set_params(&mut self, params: &[Vec<f32>]) -> Result<()> {
        if params.len() != self.f.params().len() {
            return Err(Error::Input {
                what: format!("parameters of `{}`", self.f.name()),
                expected: format!("{} tensors", self.f.params().len()),
                got: format!("{}", params.len()),
            });
        }
        for ((p, decl), &at) in params.iter().zip(self.f.params()).zip(&self.param_at) {
            if p.len() != decl.shape.numel() {
                return Err(Error::Input {
                    what: format!("parameter `{}`", decl.name),
                    expected: format!("{} values for {}", decl.shape.numel(), decl.shape),
                    got: format!("{}", p.len()),
                });
            }
            self.backend.write(&mut self.bufs[PARAMS], at, p)?;
        }
        Ok(())
    }

    /// Every parameter's current values.
    pub fn params(&self) -> Result<Vec<Vec<f32>>> {
        self.read_params(PARAMS)
    }

    fn read_params(&self, buf: usize) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(self.param_at.len());
        for (decl, &at) in self.f.params().iter().zip(&self.param_at) {
            let mut v = vec![0.0; decl.shape.numel()];
            self.backend.read(&self.bufs[buf], at, &mut v)?;
            out.push(v);
        }
        Ok(out)
    }

    /// Runs F over every vertex of `graphs` (one minibatch). `pulls[i]` holds input `i` for every
    /// vertex, graph by graph, vertex by vertex. Returns each pushed output the same way.
    pub fn forward(&mut self, graphs: &[&InputGraph], pulls: &[&[f32]]) -> Result<Vec<Vec<f32>>> {
        let f = self.f.clone();
        for (gi, g) in graphs.iter().enumerate() {
            g.check_for(&f).map_err(|e| match e {
                Error::Graph { reason, .. } => Error::Graph {
                    graph: format!("#{gi} of the minibatch"),
                    reason,
                },
                e => e,
            })?;
        }
        self.schedule = Schedule::by_height(graphs);
        self.layout = Layout::new(&f, &self.schedule);
        self.reserve()?;
        let n = self.layout.vertices;
        let regions = self.layout.pulls.clone();
        self.upload_ports("input", f.inputs(), pulls, &regions)?;
        self.upload_index()?;
        let plan = f.forward_plan();
        self.run_phase(Pass::Forward, plan, Phase::Prologue, 0..n)?;
        for t in 0..self.schedule.tasks.len() {
            let rows = self.schedule.tasks[t].clone();
            self.run_phase(Pass::Forward, plan, Phase::Recurrent, rows)?;
        }
        self.run_phase(Pass::Forward, plan, Phase::Epilogue, 0..n)?;
        let outputs: Vec<(ValueId, usize)> = f
            .outputs()
            .iter()
            .map(|o| (o.value, o.shape.numel()))
            .collect();
        outputs
            .into_iter()
            .map(|(v, block)| self.download_rows(self.loc(Pass::Forward, v)?, block))
            .collect()
    }

    /// Runs F' over the minibatch of the last [`Engine::forward`], given each pushed output's
    /// gradient (laid out like the outputs). Returns the gradients of the pulled inputs and of
    /// the parameters.
    pub fn backward(&mut self, push_grads: &[&[f32]]) -> Result<Gradients> {
        let f = self.f.clone();
        let n = self.layout.vertices;
        let regions = self.layout.push_grads.clone();
        self.upload_ports("gradient of output", f.outputs(), push_grads, &regions)?;
        for (s, st) in f.states().iter().enumerate() {
            let at = Loc {
                buf: ARENA,
                offset: self.layout.state_grads[s],
            };
            let len = n * st.shape.numel();
            self.backend.fill(
                &mut Mem {
                    data: &mut self.bufs,
                    index: &self.index,
                },
                at,
                len,
                0.0,
            )?;
        }
        let grads_len = self.backend.len(&self.bufs[GRADS]);
        self.backend.fill(
            &mut Mem {
                data: &mut self.bufs,
                index: &self.index,
            },
            Loc {
                buf: GRADS,
                offset: 0,
            },
            grads_len,
            0.0,
        )?;

        let plan = f.backward_plan();
        self.run_phase(Pass::Backward, plan, Phase::Prologue, 0..n)?;
        self.send_child_grads(plan, Phase::Prologue, 0..n)?;
        for t in (0..self.schedule.tasks.len()).rev() {
            let rows = self.schedule.tasks[t].clone();
            self.run_phase(Pass::Backward, plan, Phase::Recurrent, rows.clone())?;
            self.send_child_grads(plan, Phase::Recurrent, rows)?;
        }
        self.run_phase(Pass::Backward, plan, Phase::Epilogue, 0..n)?;
        self.param_grads()?;

        let mut pulls = Vec::with_capacity(f.inputs().len());
        for (i, port) in f.inputs().iter().enumerate() {
            let block = port.shape.numel();
            pulls.push(match f.backward().pull_grads[i] {
                Some(g) => self.download_rows(self.loc(Pass::Backward, g)?, block)?,
                None => vec![0.0; n * block],
            });
        }
        Ok(Gradients {
            pulls,
            params: self.read_params(GRADS)?,
        })
    }

    /// Grows the arena and the index buffer to the current layout (never shrinks them).
    fn reserve(&mut self) -> Result<()> {
        if self.backend.len(&self.bufs[ARENA]) < self.layout.arena {
            self.bufs[ARENA] = self.backend.alloc(self.layout.arena)?;
        }
        if self.backend.index_len(&self.index[0]) < self.layout.index {
            self.index[0] = self.backend.alloc_index(self.layout.index)?;
        }
        Ok(())
    }

    /// Checks one block of rows per vertex for every port and uploads each into its region.
    fn upload_ports(
        &mut self,
        what: &str,
        ports: &[Port],
        data: &[&[f32]],
        regions: &[usize],
    ) -> Result<()> {
        let n = self.layout.vertices;
        if data.len() != ports.len() {
            return Err(Error::Input {
                what: format!("{what}s of `{}`", self.f.name()),
                expected: format!("{}", ports.len()),
                got: format!("{}", data.len()),
            });
        }
        for ((rows, port), &at) in data.iter().zip(ports).zip(regions) {
            let block = port.shape.numel();
            if rows.len() != n * block {
                return Err(Error::Input {
                    what: format!("{what} `{}`", port.name),
                    expected: format!("{} values ({n} vertices × {block})", n * block),
                    got: format!("{}", rows.len()),
                });
            }
            self.upload_rows(at, rows, block)?;
        }
        Ok(())
    }

    /// Writes rows given in merged-vertex order into the arena in row order.
    fn upload_rows(&mut self, at: usize, src: &[f32], block: usize) -> Result<()> {
        self.host.clear();
        for &v in &self.schedule.vertex_of_row {
            let v = v as usize;
            self.host
                .extend_from_slice(&src[v * block..(v + 1) * block]);
        }
        self.backend.write(&mut self.bufs[ARENA], at, &self.host)
    }

    /// Reads a region in row order and returns it in merged-vertex order.
    fn download_rows(&mut self, at: Loc, block: usize) -> Result<Vec<f32>> {
        let n = self.layout.vertices;
        self.host.resize(n * block, 0.0);
        self.backend
            .read(&self.bufs[at.buf], at.offset, &mut self.host)?;
        let mut out = vec![0.0; n * block];
        for (v, &r) in self.schedule.row_of_vertex.iter().enumerate() {
            let r = r as usize;
            out[v * block..(v + 1) * block].copy_from_slice(&self.host[r * block..(r + 1) * block]);
        }
        Ok(out)
    }

    fn upload_index(&mut self) -> Result<()> {
        let s = &self.schedule;
        let n = s.len();
        self.host_index.clear();
        for k in 0..self.f.arity() {
            match s.child_rows.get(k) {
                Some(rows) => self.host_index.extend_from_slice(rows),
                None => self.host_index.extend(std::iter::repeat_n(NO_ROW, n)),
            }
        }
        self.host_index.extend_from_slice(&s.child_offsets);
        self.host_index.extend_from_slice(&s.child_list);
        self.backend
            .write_index(&mut self.index[0], 0, &self.host_index)
    }

    fn func(&self, pass: Pass) -> &Func {
        match pass {
            Pass::Forward => self.f.forward(),
            Pass::Backward => &self.f.backward().func,
        }
    }

    /// Where row 0 of value `v` of `pass` lives.
    fn loc(&self, pass: Pass, v: ValueId) -> Result<Loc> {
        let l = &self.layout;
        let offset = match self.func(pass).node(v).op {
            Op::Pull { input } => Some(l.pulls[input]),
            Op::Primal { value } => return self.loc(Pass::Forward, value),
            Op::StateGrad { state } => Some(l.state_grads[state]),
            Op::PushGrad { output } => Some(l.push_grads[output]),
            Op::Param { param } => {
                return Ok(Loc {
                    buf: PARAMS,
                    offset: self.param_at[param],
                })
            }
            _ => match pass {
                Pass::Forward => l.forward[v.index()],
                Pass::Backward => l.backward[v.index()],
            },
        };
        offset
            .map(|offset| Loc { buf: ARENA, offset })
            .ok_or_else(|| {
                internal(format!(
                    "value {v} of `{}` is read but never stored",
                    self.f.name()
                ))
            })
    }

    fn run_phase(
        &mut self,
        pass: Pass,
        plan: &Plan,
        phase: Phase,
        rows: Range<usize>,
    ) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        for step in &plan.phases[phase as usize] {
            match step {
                Step::Gemm(v) => {
                    let g = self.gemm_call(pass, *v, rows.clone())?;
                    let backend = &self.backend;
                    backend.gemm(
                        &mut Mem {
                            data: &mut self.bufs,
                            index: &self.index,
                        },
                        &g,
                    )?;
                }
                Step::Fused(k) => self.run_kernel(pass, k, rows.clone())?,
            }
        }
        Ok(())
    }

    fn gemm_call(&self, pass: Pass, v: ValueId, rows: Range<usize>) -> Result<Gemm> {
        let func = self.func(pass);
        let Op::MatMul { a, b, ta, tb } = func.node(v).op else {
            return Err(internal(format!("value {v} is not a matrix product")));
        };
        let (na, nb, nv) = (func.node(a), func.node(b), func.node(v));
        let (r0, n) = (rows.start, rows.len());
        let at = |x: ValueId, block: usize| -> Result<Loc> {
            Ok(self.loc(pass, x)?.offset_by(r0 * block))
        };
        let (ar, ac) = if ta {
            (na.shape.cols(), na.shape.rows())
        } else {
            (na.shape.rows(), na.shape.cols())
        };
        let b_loc = if nb.is_param {
            self.loc(pass, b)?
        } else {
            at(b, nb.shape.numel())?
        };
        let mut g = Gemm {
            m: ar,
            n: nv.shape.cols(),
            k: ac,
            a: at(a, na.shape.numel())?,
            lda: na.shape.cols(),
            ta,
            b: b_loc,
            ldb: nb.shape.cols(),
            tb,
            c: at(v, nv.shape.numel())?,
            ldc: nv.shape.cols(),
            accumulate: false,
            batch: n,
            stride_a: na.shape.numel(),
            stride_b: if nb.is_param { 0 } else { nb.shape.numel() },
            stride_c: nv.shape.numel(),
        };
        if nb.is_param && !ta {
            // One product over the rows of every vertex.
            g.m = n * ar;
            g.batch = 1;
        }
        Ok(g)
    }

    fn run_kernel(&mut self, pass: Pass, k: &Kernel, rows: Range<usize>) -> Result<()> {
        let (r0, n) = (rows.start, rows.len());
        let l = &self.layout;
        let mut loads = Vec::new();
        for i in k.loads() {
            let node = &k.nodes[i];
            let v = k.values[i];
            let block = node.shape.numel();
            loads.push(match node.op {
                Op::Gather { slot, state } => Rows::Indexed {
                    data: self.loc(Pass::Forward, self.f.states()[state].value)?,
                    index: IndexLoc {
                        buf: 0,
                        offset: l.child_slots + slot * l.vertices + r0,
                    },
                },
                Op::GatherSum { state } => Rows::IndexedSet {
                    data: self.loc(Pass::Forward, self.f.states()[state].value)?,
                    offsets: IndexLoc {
                        buf: 0,
                        offset: l.child_offsets + r0,
                    },
                    index: IndexLoc {
                        buf: 0,
                        offset: l.child_list,
                    },
                },
                Op::Param { .. } => Rows::Broadcast(self.loc(pass, v)?),
                Op::Zeros => Rows::Zeros,
                _ => Rows::Contiguous(self.loc(pass, v)?.offset_by(r0 * block)),
            });
        }
        let mut stores = Vec::with_capacity(k.stores.len());
        for &i in &k.stores {
            stores.push(
                self.loc(pass, k.values[i])?
                    .offset_by(r0 * k.nodes[i].shape.numel()),
            );
        }
        let backend = &self.backend;
        backend.fused(
            &mut Mem {
                data: &mut self.bufs,
                index: &self.index,
            },
            k,
            n,
            &loads,
            &stores,
        )
    }

    /// Scatter-adds the children's gradients computed in `phase` for `rows`.
    fn send_child_grads(&mut self, plan: &Plan, phase: Phase, rows: Range<usize>) -> Result<()> {
        let (r0, n) = (rows.start, rows.len());
        let l = &self.layout;
        let mut calls = Vec::new();
        for cg in &self.f.backward().child_grads {
            if plan.phase[cg.value.index()] != phase || n == 0 {
                continue;
            }
            let block = self.f.states()[cg.state].shape.numel();
            let data = Loc {
                buf: ARENA,
                offset: l.state_grads[cg.state],
            };
            let dst = match cg.slot {
                Some(k) => Rows::Indexed {
                    data,
                    index: IndexLoc {
                        buf: 0,
                        offset: l.child_slots + k * l.vertices + r0,
                    },
                },
                None => Rows::IndexedSet {
                    data,
                    offsets: IndexLoc {
                        buf: 0,
                        offset: l.child_offsets + r0,
                    },
                    index: IndexLoc {
                        buf: 0,
                        offset: l.child_list,
                    },
                },
            };
            calls.push((
                self.loc(Pass::Backward, cg.value)?.offset_by(r0 * block),
                block,
                dst,
            ));
        }
        for (src, block, dst) in calls {
            let backend = &self.backend;
            backend.scatter_add(
                &mut Mem {
                    data: &mut self.bufs,
                    index: &self.index,
                },
                src,
                block,
                n,
                &dst,
            )?;
        }
        Ok(())
    }

    /// Forms every parameter gradient with one operation per term over all vertices.
    fn param_grads(&mut self) -> Result<()> {
        let n = self.layout.vertices;
        if n == 0 {
            return Ok(());
        }
        let b = self.f.backward();
        let func = &b.func;
        for pg in &b.param_grads {
            let p = pg.param();
            let decl = &self.f.params()[p];
            let dst = Loc {
                buf: GRADS,
                offset: self.param_at[p],
            };
            match *pg {
                ParamGrad::MatMul { x, dy, .. } => {
                    let (nx, ny) = (func.node(x), func.node(dy));
                    let g = Gemm {
                        m: nx.shape.cols(),
                        n: ny.shape.cols(),
                        k: n * nx.shape.rows(),
                        a: self.loc(Pass::Backward, x)?,
                        lda: nx.shape.cols(),
                        ta: true,
                        b: self.loc(Pass::Backward, dy)?,
                        ldb: ny.shape.cols(),
                        tb: false,
                        c: dst,
                        ldc: decl.shape.cols(),
                        accumulate: true,
                        batch: 1,
                        stride_a: 0,
                        stride_b: 0,
                        stride_c: 0,
                    };
                    self.backend.gemm(
                        &mut Mem {
                            data: &mut self.bufs,
                            index: &self.index,
                        },
                        &g,
                    )?;
                }
                ParamGrad::SumRows { dy, .. } => {
                    let period = decl.shape.numel();
                    let rows = n * func.node(dy).shape.numel() / period;
                    let src = self.loc(Pass::Backward, dy)?;
                    self.backend.sum_rows(
                        &mut Mem {
                            data: &mut self.bufs,
                            index: &self.index,
                        },
                        src,
                        rows,
                        period,
                        dst,
                        true,
                    )?;
                }
            }
        }
        Ok(())
    }
}
