//! The narrow seam between the engine and the hardware.
//!
//! A backend owns device memory as flat f32 buffers and u32 index buffers. The engine addresses
//! memory by ([`Loc`]) buffer number and element offset into the slice of buffers it hands to each
//! call ([`Mem`]), so one call may read and write several regions of the same arena. The engine's
//! memory plan guarantees that what a call writes does not overlap what it reads.

use crate::attention::Widths;
use crate::error::Result;
use crate::fusion::Kernel;
use crate::ir::Reduce;
use crate::optim::Update;

/// An element offset into one of the data buffers of a [`Mem`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Loc {
    /// Which data buffer.
    pub buf: usize,
    /// Offset in elements.
    pub offset: usize,
}

impl Loc {
    /// The location `n` elements further on.
    pub fn offset_by(self, n: usize) -> Loc {
        Loc { buf: self.buf, offset: self.offset.saturating_add(n) }
    }
}

/// An element offset into one of the index buffers of a [`Mem`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IndexLoc {
    /// Which index buffer.
    pub buf: usize,
    /// Offset in elements.
    pub offset: usize,
}

/// The index value meaning "no row here" (a missing child): reads give zeros, adds are skipped.
pub const NO_ROW: u32 = u32::MAX;

/// Where the per-vertex blocks of one operand are, for the `n` vertices of a call. A block is a
/// value's `r·c` elements for one vertex.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rows {
    /// Vertex `i`'s block at `loc + i·block`.
    Contiguous(Loc),
    /// The same block for every vertex (a parameter).
    Broadcast(Loc),
    /// Vertex `i`'s block at `data + index[i]·block`, or zeros where `index[i] == NO_ROW`.
    Indexed {
        /// Start of the source rows.
        data: Loc,
        /// One row number per vertex.
        index: IndexLoc,
    },
    /// For vertex `i`, the blocks at `data + index[j]·block` for `j` in `offsets[i]..offsets[i+1]`,
    /// combined as `combine` says when read and when added to.
    IndexedSet {
        /// Start of the rows.
        data: Loc,
        /// `n + 1` offsets into `index`.
        offsets: IndexLoc,
        /// Row numbers.
        index: IndexLoc,
        /// How the set's blocks combine.
        combine: Combine,
    },
    /// Zeros (reads only).
    Zeros,
}

/// How the blocks of a vertex's [`Rows::IndexedSet`] combine, element by element; an empty set
/// reads as zeros and takes nothing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Combine {
    /// Read: their sum. Added to: each gets the whole block.
    Sum,
    /// Read: their sum divided by their number. Added to: each gets the block divided by it.
    Mean,
    /// Read: the largest (`by` is then `data`). Added to: in each column, only the first member
    /// whose block at `by + index[j]·block` is largest there (the forward rows `gather_max`
    /// read) gets the value. A later member must be larger to replace an earlier one.
    Max {
        /// The rows compared.
        by: Loc,
    },
    /// Read: the sum of the members' blocks each times its weight, member `j`'s (position `j`
    /// of the list `index` points into) at `weights + j`. Added to: each gets the block times
    /// its weight. `feature` is the edge feature the weights are (`gather_weighted`).
    Weighted {
        /// One weight per position of the list.
        weights: Loc,
        /// The edge feature they are.
        feature: u32,
    },
}

impl Combine {
    /// The IR's reduction this combines by.
    pub fn reduce(self) -> Reduce {
        match self {
            Combine::Sum => Reduce::Sum,
            Combine::Mean => Reduce::Mean,
            Combine::Max { .. } => Reduce::Max,
            Combine::Weighted { feature, .. } => Reduce::Weighted { feature },
        }
    }

    /// Combining by `reduce`, a max comparing the rows at `by`, a weighted sum with the weights
    /// at `weights`.
    pub fn of(reduce: Reduce, by: Loc, weights: Loc) -> Combine {
        match reduce {
            Reduce::Sum => Combine::Sum,
            Reduce::Mean => Combine::Mean,
            Reduce::Max => Combine::Max { by },
            Reduce::Weighted { feature } => Combine::Weighted { weights, feature },
        }
    }
}

/// Attention over the children of `n` vertices ([`crate::attention`]): vertex `i`'s query at
/// `query + i·heads·key`; its children's key and value rows (blocks of `heads·key` and
/// `heads·value`) at `keys` and `values`, the rows `index[j]` for `j` in
/// `offsets[i]..offsets[i+1]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attention {
    /// Heads, widths and the scores' slope.
    pub widths: Widths,
    /// Vertices.
    pub n: usize,
    /// The queries, one block per vertex.
    pub query: Loc,
    /// The rows the children's keys are in.
    pub keys: Loc,
    /// The rows the children's values are in.
    pub values: Loc,
    /// `n + 1` offsets into `index`.
    pub offsets: IndexLoc,
    /// The children's row numbers.
    pub index: IndexLoc,
}

/// Where [`Backend::attend_grad`] reads the outputs' gradients and writes the others.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionGrads {
    /// The outputs' gradients, one block per vertex.
    pub out: Loc,
    /// The queries' gradients (written), one block per vertex.
    pub query: Loc,
    /// The rows the children's key gradients are added to.
    pub keys: Loc,
    /// The rows the children's value gradients are added to (may be `keys`).
    pub values: Loc,
}

/// `C_b (+)= op(A_b) · op(B_b)` for `b` in `0..batch`, all row-major; `op` transposes when the
/// flag is set. `A_b` starts at `a + b·stride_a` (likewise B and C); a stride of 0 shares one
/// matrix across the batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// A (stored `m × k`, or `k × m` when transposed).
    pub a: Loc,
    /// Row stride of A as stored.
    pub lda: usize,
    /// Transpose A.
    pub ta: bool,
    /// B (stored `k × n`, or `n × k` when transposed).
    pub b: Loc,
    /// Row stride of B as stored.
    pub ldb: usize,
    /// Transpose B.
    pub tb: bool,
    /// B changes only through [`Backend::write`] (it is a parameter), so a backend may keep a
    /// derived copy of it (e.g. its transpose) until the next write.
    pub b_fixed: bool,
    /// C (`m × n`).
    pub c: Loc,
    /// Row stride of C.
    pub ldc: usize,
    /// Add to C instead of overwriting it.
    pub accumulate: bool,
    /// Number of products.
    pub batch: usize,
    /// Element stride between the A matrices.
    pub stride_a: usize,
    /// Element stride between the B matrices.
    pub stride_b: usize,
    /// Element stride between the C matrices.
    pub stride_c: usize,
}

impl Gemm {
    /// One product `C = op(A)·op(B)` with `C` `m × n` and inner dimension `k`, overwriting C:
    /// `a` is where A is, its row stride and whether it is transposed; `b` the same and whether
    /// it is a parameter ([`Gemm::b_fixed`]); `c` where C is and its row stride.
    pub fn single(
        (m, n, k): (usize, usize, usize),
        (a, lda, ta): (Loc, usize, bool),
        (b, ldb, tb, b_fixed): (Loc, usize, bool, bool),
        (c, ldc): (Loc, usize),
    ) -> Gemm {
        Gemm {
            m,
            n,
            k,
            a,
            lda,
            ta,
            b,
            ldb,
            tb,
            b_fixed,
            c,
            ldc,
            accumulate: false,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
        }
    }
}

/// Where one tensor's optimizer update ([`Backend::update`], [`Backend::update_rows`]) reads and
/// writes: its values `p`, its gradient `g`, and its state `m` (momentum, Adagrad's sum of
/// squares, Adam's first moment) and `v` (Adam's second moment), each in a data buffer; and the
/// step's gate, if it has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptimAt {
    /// The values, updated.
    pub p: Loc,
    /// The gradient, read.
    pub g: Loc,
    /// The first state tensor, updated.
    pub m: Loc,
    /// The second state tensor, updated.
    pub v: Loc,
    /// The step's gate ([`crate::gate`]): the gradient is multiplied by its factor (a backend
    /// may leave it so multiplied) and nothing is updated where it skips the step. `None`: the
    /// gradient as it is.
    pub gate: Option<Loc>,
}

/// The memory one call may touch: data buffers and index buffers.
pub struct Mem<'a, B: Backend + ?Sized> {
    /// f32 buffers, addressed by [`Loc::buf`].
    pub data: &'a mut [B::Buffer],
    /// u32 buffers, addressed by [`IndexLoc::buf`].
    pub index: &'a [B::Index],
}

/// The most scatter-adds one [`Backend::scatter_add_many`] call takes.
pub const SCATTERS: usize = 4;

/// A compute device: memory, matrix products, fused element-wise kernels, gathers and
/// scatter-adds, reductions.
pub trait Backend {
    /// An f32 device buffer.
    type Buffer;
    /// A u32 device buffer.
    type Index;

    /// A short name for messages (`cpu`, `cuda:0`).
    fn name(&self) -> &'static str;
    /// The device in words for reports (a GPU's model); the [`name`](Backend::name) by default.
    fn device(&self) -> String {
        self.name().to_string()
    }
    /// Bytes of memory this backend's buffers may still take (a GPU's free memory); the system's
    /// available memory ([`memory::available`](crate::memory::available)) by default, `None`
    /// where it is not known.
    fn memory_available(&self) -> Option<u128> {
        crate::memory::available()
    }
    /// Another backend like this one (same device, same settings) with no buffers yet: the
    /// backend of a replica for another worker.
    fn replica(&self) -> Result<Self>
    where
        Self: Sized;
    /// A zeroed buffer of `len` elements.
    fn alloc(&self, len: usize) -> Result<Self::Buffer>;
    /// A zeroed index buffer of `len` elements.
    fn alloc_index(&self, len: usize) -> Result<Self::Index>;
    /// How many buffers (data and index) this backend has allocated so far.
    fn allocations(&self) -> usize;
    /// Elements in a buffer.
    fn len(&self, buf: &Self::Buffer) -> usize;
    /// Elements in an index buffer.
    fn index_len(&self, buf: &Self::Index) -> usize;
    /// Copies host data into a buffer at `offset`.
    fn write(&self, buf: &mut Self::Buffer, offset: usize, src: &[f32]) -> Result<()>;
    /// Copies host indices into an index buffer at `offset`.
    fn write_index(&self, buf: &mut Self::Index, offset: usize, src: &[u32]) -> Result<()>;
    /// Copies a buffer's elements at `offset` to the host.
    fn read(&self, buf: &Self::Buffer, offset: usize, dst: &mut [f32]) -> Result<()>;
    /// Copies `len` elements at `offset` to a new host vector. By default a zeroed vector
    /// [`read`](Backend::read) into; host memory copies without zeroing first.
    fn read_vec(&self, buf: &Self::Buffer, offset: usize, len: usize) -> Result<Vec<f32>> {
        let mut out = vec![0.0; len];
        self.read(buf, offset, &mut out)?;
        Ok(out)
    }
    /// The buffer's elements, when they are host memory the caller may read in place; `None` (the
    /// default) for device memory, which is read back instead.
    fn host<'a>(&self, _buf: &'a Self::Buffer) -> Option<&'a [f32]> {
        None
    }
    /// The buffer's elements, when they are host memory the caller may change in place; `None`
    /// (the default) for device memory, which is read and written back instead.
    fn host_mut<'a>(&self, _buf: &'a mut Self::Buffer) -> Option<&'a mut [f32]> {
        None
    }
    /// Copies rows `rows` of the `block`-wide rows from `offset` on (row `r` at
    /// `offset + r·block`) to the host, back to back in `dst`. By default one read per row; a
    /// backend whose reads are costly reads the span once and picks.
    fn read_rows(&self, buf: &Self::Buffer, offset: usize, block: usize, rows: &[u32], dst: &mut [f32]) -> Result<()> {
        for (&r, out) in rows.iter().zip(dst.chunks_exact_mut(block.max(1))) {
            self.read(buf, offset + r as usize * block, out)?;
        }
        Ok(())
    }
    /// Sets `len` elements at `dst` to `value`.
    fn fill(&self, mem: &mut Mem<'_, Self>, dst: Loc, len: usize, value: f32) -> Result<()>;
    /// Sets every region `(dst, len)` of `regions` (at most [`SCATTERS`]) to zero; a device may
    /// do them in one launch. By default one fill each.
    fn zero_many(&self, mem: &mut Mem<'_, Self>, regions: &[(Loc, usize)]) -> Result<()> {
        regions.iter().try_for_each(|&(dst, len)| self.fill(mem, dst, len, 0.0))
    }
    /// A (batched, strided) matrix product.
    fn gemm(&self, mem: &mut Mem<'_, Self>, g: &Gemm) -> Result<()>;
    /// Independent products: none writes what another reads or writes, so a backend may run
    /// them concurrently. By default they run one after another.
    fn gemm_batch(&self, mem: &mut Mem<'_, Self>, gs: &[Gemm]) -> Result<()> {
        gs.iter().try_for_each(|g| self.gemm(mem, g))
    }
    /// Kernel launches and library calls given to the device so far, where the backend counts
    /// them (a GPU's; `None` on the CPU, whose calls the engine counts).
    fn launches(&self) -> Option<u64> {
        None
    }
    /// How often the backend has handed its device work so far, where it counts: launches and
    /// library calls issued alone, and each list of held launches issued as one graph
    /// ([`Backend::hold_launches`]). By default [`Backend::launches`].
    fn submissions(&self) -> Option<u64> {
        self.launches()
    }
    /// Holds the launches that follow until [`Backend::issue_held`], to issue them together
    /// (a CUDA device as one graph). Whatever else the backend is asked to do in between (a
    /// copy, a read) issues what it holds first, so the order of the work is kept. By default
    /// nothing is held.
    fn hold_launches(&self) {}
    /// Issues what [`Backend::hold_launches`] held and stops holding.
    fn issue_held(&self) -> Result<()> {
        Ok(())
    }
    /// Products summed into one output, in order: the first writes C as its `accumulate` says,
    /// each later one adds to that C (its `accumulate` set) — `h₀·U₀ + h₁·U₁`, which a device
    /// may run as one launch. By default they run one after another.
    fn gemm_sum(&self, mem: &mut Mem<'_, Self>, gs: &[Gemm]) -> Result<()> {
        gs.iter().try_for_each(|g| self.gemm(mem, g))
    }
    /// Runs a fused kernel over `n` vertices: `loads[j]` binds the kernel's j-th load op,
    /// `stores[j]` is where its j-th stored op writes (vertex `i` at `stores[j] + i·block`).
    fn fused(&self, mem: &mut Mem<'_, Self>, kernel: &Kernel, n: usize, loads: &[Rows], stores: &[Loc]) -> Result<()>;
    /// For each of `n` vertices, adds its `block` elements at `src + i·block` into the rows `dst`
    /// names for it (`Indexed` or `IndexedSet`).
    fn scatter_add(&self, mem: &mut Mem<'_, Self>, src: Loc, block: usize, n: usize, dst: &Rows) -> Result<()>;
    /// Several [`Backend::scatter_add`]s of `n` blocks of `block` elements, one per `(src, dst)`
    /// of `parts` (each `dst` `Indexed`, at most [`SCATTERS`] of them), in one call: a device
    /// runs them as one kernel. By default, one after another.
    fn scatter_add_many(&self, mem: &mut Mem<'_, Self>, block: usize, n: usize, parts: &[(Loc, Rows)]) -> Result<()> {
        parts.iter().try_for_each(|(src, dst)| self.scatter_add(mem, *src, block, n, dst))
    }
    /// Attention over each vertex's children, its outputs (`heads·value` per vertex) written at
    /// `out`.
    fn attend(&self, mem: &mut Mem<'_, Self>, a: &Attention, out: Loc) -> Result<()>;
    /// The gradients of [`Backend::attend`] given its outputs' gradients: the queries' written,
    /// the children's keys' and values' added to their rows.
    fn attend_grad(&self, mem: &mut Mem<'_, Self>, a: &Attention, grads: &AttentionGrads) -> Result<()>;
    /// `dst[j] (+)= Σ_i src[i·cols + j]` over `rows` rows.
    fn sum_rows(
        &self,
        mem: &mut Mem<'_, Self>,
        src: Loc,
        rows: usize,
        cols: usize,
        dst: Loc,
        accumulate: bool,
    ) -> Result<()>;
    /// Applies the optimizer update `u` to the `len` values at `at.p` with the gradient at
    /// `at.g` (times the gate's factor) and the state at `at.m` and `at.v`
    /// (`arbor_core::optim::apply`, bit for bit), unless the gate at `at.gate` skips the step.
    fn update(&self, mem: &mut Mem<'_, Self>, u: &Update, at: &OptimAt, len: usize) -> Result<()>;
    /// Applies `u` to `n` rows of a table of `table = (dim, vocab)`: `vocab` rows of `dim` values at `at.p` (state rows
    /// at `at.m`, `at.v`): row `rows[k]` (ascending, each once) with the gradient at
    /// `at.g + k·dim`. The other rows and their state are left as they are.
    fn update_rows(
        &self,
        mem: &mut Mem<'_, Self>,
        u: &Update,
        at: &OptimAt,
        table: (usize, usize),
        rows: IndexLoc,
        n: usize,
    ) -> Result<()>;
    /// The sum of the squares of each region `(at, len)` of `regions`, in f64, written as
    /// [`SUM_SLOTS`](crate::gate::SUM_SLOTS) partial sums (in the f32 words of
    /// [`crate::gate`]) from `to` on, region `k`'s at `to + k·`[`SUM_WORDS`](crate::gate::SUM_WORDS)
    /// (`to.offset` even): norms and, since a sum is finite exactly when every value is, the
    /// finiteness test in one pass, left on the backend.
    fn sum_squares(&self, mem: &mut Mem<'_, Self>, regions: &[(Loc, usize)], to: Loc) -> Result<()>;
    /// Writes at `gate` the gate ([`crate::gate::decide`], bit for bit) of the partial sums of
    /// `regions` regions at `sums` ([`Backend::sum_squares`]), clipping to norm `clip` (∞: no
    /// clipping).
    fn decide(&self, mem: &mut Mem<'_, Self>, sums: Loc, regions: usize, clip: f32, gate: Loc) -> Result<()>;
    /// Multiplies `len` values at `dst` by `s` (clipping by a norm).
    fn scale(&self, mem: &mut Mem<'_, Self>, dst: Loc, len: usize, s: f32) -> Result<()>;
    /// Moves the weight average of `len` values at `avg` toward the values at `x`
    /// ([`crate::optim::average`], bit for bit).
    fn average(&self, mem: &mut Mem<'_, Self>, avg: Loc, x: Loc, len: usize, keep: f32) -> Result<()>;
}
