//! Lowering of matrix products: F's and F′'s products per run of tasks (narrowed to the columns
//! that can be non-zero, over a pulled input's distinct rows where they are shared, summed into
//! a sibling's output where [`sums`](super::sums) says so), and the parameter gradients over all
//! vertices.

use super::batch::SharedCopy;
use super::dedup::{self, Shared};
use super::facts::{self, Cut};
use super::internal;
use super::launch::{Launch, ARENA, GRADS, PARAMS};
use super::lower::{Lowering, Pass};
use arbor_core::backend::{Combine, Gemm, IndexLoc, Loc, Rows, NO_ROW};
use arbor_core::error::Result;
use arbor_core::ir::{Op, ParamGrad, ValueId};
use std::ops::Range;
use std::sync::Arc;

/// One product `C += op(A)·op(B)` with `C` `m × n` and inner dimension `k`: `a` is where A is,
/// its row stride and whether it is transposed; `b` the same and whether it is a parameter; `c`
/// where C is and its row stride.
fn accumulating(
    mnk: (usize, usize, usize),
    a: (Loc, usize, bool),
    b: (Loc, usize, bool, bool),
    c: (Loc, usize),
) -> Gemm {
    Gemm { accumulate: true, ..Gemm::single(mnk, a, b, c) }
}

/// Whether `later` adds to the output `first` writes, reading nothing `first` writes: the two
/// may run as one chain.
fn adds_to(first: &Gemm, later: &Gemm) -> bool {
    // The elements a matrix spans from `at` (`rows` rows `ld` apart, `batch` of them `stride`
    // apart), as a range of its buffer.
    let batch = later.batch.saturating_sub(1);
    let span =
        |at: Loc, rows: usize, ld: usize, stride: usize| (at.buf, at.offset..at.offset + stride * batch + ld * rows);
    let c = span(first.c, first.m, first.ldc, first.stride_c);
    let apart = |(buf, r): (usize, Range<usize>)| buf != c.0 || r.end <= c.1.start || c.1.end <= r.start;
    let a_rows = if later.ta { later.k } else { later.m };
    let b_rows = if later.tb { later.n } else { later.k };
    later.accumulate
        && later.c == first.c
        && (later.m, later.n, later.ldc, later.batch, later.stride_c)
            == (first.m, first.n, first.ldc, first.batch, first.stride_c)
        && apart(span(later.a, a_rows, later.lda, later.stride_a))
        && apart(span(later.b, b_rows, later.ldb, later.stride_b))
}

/// The products of one step of a phase, in waves: the products of a wave are independent of
/// each other, and each wave runs after the one before. Emptied waves keep their vectors.
#[derive(Default)]
pub(super) struct Waves {
    waves: Vec<Vec<Gemm>>,
    /// Waves in use since the phase began.
    len: usize,
}

impl Waves {
    /// Waves in use since the phase began.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Adds `g` to wave `wave`.
    pub fn push(&mut self, wave: usize, g: Gemm) {
        if self.waves.len() <= wave {
            self.waves.resize_with(wave + 1, Vec::new);
        }
        self.len = self.len.max(wave + 1);
        self.waves[wave].push(g);
    }

    /// Adds a launch of each wave in use that holds products to `launches`, in order; the waves
    /// keep emptied vectors from `spare` instead. Waves of one product each that add to the
    /// first one's output (`h₀·U₀ + h₁·U₁`) go out as one chain ([`Launch::GemmSum`]).
    pub fn launch(&mut self, spare: &mut Vec<Vec<Gemm>>, launches: &mut Vec<Launch>) {
        let mut chain: Option<Vec<Gemm>> = None;
        for wave in self.waves[..self.len].iter_mut().filter(|w| !w.is_empty()) {
            let mut wave = std::mem::replace(wave, spare.pop().unwrap_or_default());
            match chain.as_mut() {
                Some(c) if wave.len() == 1 && adds_to(&c[0], &wave[0]) => {
                    c.append(&mut wave);
                    spare.push(wave);
                    continue;
                }
                _ => {}
            }
            if let Some(c) = chain.take() {
                launches.push(if c.len() == 1 { Launch::Gemms(c) } else { Launch::GemmSum(c) });
            }
            if wave.len() == 1 {
                chain = Some(wave);
            } else {
                launches.push(Launch::Gemms(wave));
            }
        }
        if let Some(c) = chain {
            launches.push(if c.len() == 1 { Launch::Gemms(c) } else { Launch::GemmSum(c) });
        }
    }

    /// Starts a new phase (every wave is empty by then).
    pub fn restart(&mut self) {
        self.len = 0;
    }
}

impl Lowering {
    /// Adds the calls of product `v` over the rows `run` (tasks sharing `cut`) to `waves`; an
    /// all-zero product is filled at once. A product of a pulled input with shared rows runs over
    /// the distinct rows into scratch from `scratch` on; the copy to the vertices' rows that must
    /// follow the waves is returned. A product summed `into` a sibling `(p1, add)` writes `p1`'s
    /// output instead: after every wave so far, adding to it, where `add`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn product(
        &mut self,
        pass: Pass,
        v: ValueId,
        run: Range<usize>,
        cut: &Cut,
        into: Option<(ValueId, bool)>,
        waves: &mut Waves,
        scratch: &mut usize,
    ) -> Result<Option<SharedCopy>> {
        let (add, base) = match into {
            Some((_, true)) => (true, waves.len()),
            _ => (false, 0),
        };
        let target = into.map(|(p1, _)| self.loc(pass, p1, run.start, run.start)).transpose()?;
        let mut push = |wave: usize, mut g: Gemm| {
            g.accumulate |= add;
            waves.push(base + wave, g);
        };
        match cut {
            Cut::Skip => {}
            // Summed into a sibling, zeros add nothing (and the kernel reads them as zeros).
            Cut::Zero if into.is_some() || !self.fills(pass)[v.index()] => {}
            Cut::Zero => {
                let dst = self.loc(pass, v, run.start, run.start)?;
                let len = run.len() * self.func(pass).node(v).shape.numel();
                self.push(Launch::Fill { dst, len });
            }
            Cut::Full => {
                let (mut g, copy) = self.shared_gemm(pass, v, run, scratch)?;
                g.c = target.unwrap_or(g.c);
                push(0, g);
                return Ok(copy);
            }
            Cut::Cols { cols, zero, inner } => {
                let (mut g, copy) = self.shared_gemm(pass, v, run, scratch)?;
                g.c = target.unwrap_or(g.c);
                if !add {
                    for z in zero {
                        // A product over an empty inner dimension is zero.
                        push(0, facts::narrow(&g, z.clone(), 0..0, false));
                    }
                }
                for c in cols {
                    for (i, k) in inner.iter().enumerate() {
                        push(i, facts::narrow(&g, c.clone(), k.clone(), i > 0));
                    }
                }
                return Ok(copy);
            }
        }
        Ok(None)
    }

    /// The call of product `v` over the rows `run`: over the distinct rows of its pulled factor
    /// into scratch when that input has shared rows (and scratch has room), with the copy that
    /// must follow it.
    fn shared_gemm(
        &mut self,
        pass: Pass,
        v: ValueId,
        run: Range<usize>,
        scratch: &mut usize,
    ) -> Result<(Gemm, Option<SharedCopy>)> {
        let mut g = self.gemm_call(pass, v, run.clone())?;
        let input = (pass == Pass::Forward).then(|| dedup::pulled_factor(self.func(pass), v)).flatten();
        let Some((i, &Shared { unique, rows_at, map_at, .. })) =
            input.and_then(|i| self.b.shared[i].as_ref().map(|s| (i, s)))
        else {
            return Ok((g, None));
        };
        if *scratch + unique * g.ldc > self.b.shared_scratch.end {
            // Per vertex after all: a looked-up input's rows must be there.
            self.gather_lookup(i);
            return Ok((g, None));
        }
        let copy = SharedCopy {
            value: Some(v),
            from: Loc { buf: ARENA, offset: *scratch },
            to: g.c,
            row: run.start,
            map: IndexLoc { buf: 0, offset: map_at + run.start },
            rows: run.len(),
            block: g.ldc,
        };
        *scratch += unique * g.ldc;
        (g.m, g.a, g.c) = (unique, Loc { buf: ARENA, offset: rows_at }, copy.from);
        Ok((g, Some(copy)))
    }

    fn gemm_call(&self, pass: Pass, v: ValueId, rows: Range<usize>) -> Result<Gemm> {
        let func = self.func(pass);
        let Op::MatMul { a, b, ta, tb } = func.node(v).op else {
            return Err(internal(format!("value {v} is not a matrix product")));
        };
        let (na, nb, nv) = (func.node(a), func.node(b), func.node(v));
        let (r0, n) = (rows.start, rows.len());
        let at = |x: ValueId| self.loc(pass, x, r0, r0);
        let (ar, ac) = if ta { (na.shape.cols(), na.shape.rows()) } else { (na.shape.rows(), na.shape.cols()) };
        let mut g = Gemm {
            m: ar,
            n: nv.shape.cols(),
            k: ac,
            a: at(a)?,
            lda: na.shape.cols(),
            ta,
            b: at(b)?,
            ldb: nb.shape.cols(),
            tb,
            b_fixed: nb.is_param,
            c: at(v)?,
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
            if let Some((at, stride)) = self.gathered_in_place(pass, a, &rows)? {
                (g.a, g.lda) = (at, stride);
            }
        }
        Ok(g)
    }

    /// Where the rows `rows` of gathered value `v` of F already are, evenly spaced, in its
    /// state's rows (the first and the stride), when products may read it there
    /// ([`Analysis::in_place`](super::analysis::Analysis)) and every vertex of `rows` has that
    /// child. The products over those rows read it there, and the kernel storing it over the
    /// same rows leaves the copy out.
    pub(super) fn gathered_in_place(
        &self,
        pass: Pass,
        v: ValueId,
        rows: &Range<usize>,
    ) -> Result<Option<(Loc, usize)>> {
        let f = &self.a.f;
        if pass != Pass::Forward || !self.a.in_place[usize::from(self.b.trained)][v.index()] {
            return Ok(None);
        }
        let Op::Gather { slot, state } = f.forward().node(v).op else { return Ok(None) };
        let Some(children) = self.b.schedule.child_rows.get(slot).and_then(|c| c.get(rows.clone())) else {
            return Ok(None);
        };
        let Some(&first) = children.first() else { return Ok(None) };
        let step = match children {
            [_, second, ..] if *second > first => second - first,
            [_] => 1,
            _ => return Ok(None),
        };
        let even = children.windows(2).all(|w| w[1].checked_sub(w[0]) == Some(step));
        if !even || children.contains(&NO_ROW) {
            return Ok(None);
        }
        let (at, block) = (self.loc(Pass::Forward, f.states()[state].value, 0, 0)?, f.states()[state].shape.numel());
        Ok(Some((at.offset_by(first as usize * block), step as usize * block)))
    }

    /// For a parameter gradient `xᵀ·dy` over the rows `run` whose `x` is a pulled input with
    /// shared rows: sums `dy` per distinct row into scratch and returns the factors over the
    /// distinct rows instead (where x's rows are, where the summed dy is, how many rows).
    fn shared_grad(&mut self, x: ValueId, dy: ValueId, run: &Range<usize>) -> Result<Option<(Loc, Loc, usize)>> {
        let Some(&Shared { unique, rows_at, map_at, ref members, .. }) = self.shared_input(x) else { return Ok(None) };
        let block = self.func(Pass::Backward).node(dy).shape.numel();
        let scratch = &self.b.shared_scratch;
        let sums = Loc { buf: ARENA, offset: scratch.start };
        if scratch.start + unique * block > scratch.end {
            return Ok(None);
        }
        let src = self.loc(Pass::Backward, dy, run.start, 0)?;
        // Where every row that pulls a distinct row lies in the run, each distinct row's sum is
        // read from them (by row number: from dy's first row) and written once; else the sums are
        // zeroed and the run's rows added.
        let launch = match members {
            Some(m) if run.start <= m.span.start && m.span.end <= run.end => {
                let (offsets, index) =
                    (IndexLoc { buf: 0, offset: m.at }, IndexLoc { buf: 0, offset: m.at + unique + 1 });
                let data = self.loc(Pass::Backward, dy, 0, 0)?;
                let from = Rows::IndexedSet { data, offsets, index, combine: Combine::Sum };
                Launch::Copy { from, to: sums, rows: unique, block }
            }
            _ => {
                self.push(Launch::Fill { dst: sums, len: unique * block });
                let dst = Rows::Indexed { data: sums, index: IndexLoc { buf: 0, offset: map_at + run.start } };
                Launch::ScatterAdd { src, block, n: run.len(), dst }
            }
        };
        self.push(launch);
        Ok(Some((Loc { buf: ARENA, offset: rows_at }, sums, unique)))
    }

    /// The shared rows of the input that parameter-gradient factor `x` (a value of F′) reads.
    fn shared_input(&self, x: ValueId) -> Option<&Shared> {
        self.pulled_input(x).and_then(|i| self.b.shared[i].as_ref())
    }

    /// The input that parameter-gradient factor `x` (a value of F′) is, if it is one.
    fn pulled_input(&self, x: ValueId) -> Option<usize> {
        let op = match self.func(Pass::Backward).node(x).op {
            Op::Primal { value } => &self.a.f.forward().node(value).op,
            ref op => op,
        };
        match *op {
            Op::Pull { input } => Some(input),
            _ => None,
        }
    }

    /// Forms every parameter gradient with one operation per term over all vertices (per run of
    /// tasks where the term can be non-zero, over the rows and columns where it can be).
    pub(super) fn param_grads(&mut self) -> Result<()> {
        let tasks = 0..self.b.schedule.tasks.len();
        let f = Arc::clone(&self.a.f);
        let b = f.backward();
        let func = &b.func;
        for (j, pg) in b.param_grads.iter().enumerate() {
            let p = pg.param();
            // A looked-up input whose table gradient `Σ dy·Wᵀ` is formed here per distinct row.
            let table = (0..self.b.table_grad_at.len()).find_map(|i| {
                self.b.table_grad_at[i].filter(|_| self.a.table_grad_via[i] == Some(j)).map(|at| (i, at))
            });
            let decl = &f.params()[p];
            let dst = Loc { buf: GRADS, offset: self.a.param_at[p] };
            match *pg {
                ParamGrad::MatMul { x, dy, .. } => {
                    let (nx, ny) = (func.node(x), func.node(dy));
                    // Per task, the non-zero columns of x (rows of the gradient) and of dy.
                    let blocks = |t: usize| {
                        let f = &self.b.bwd_facts[t];
                        let (rows, cols) = (f.nonzero(x), f.nonzero(dy));
                        (!rows.is_empty() && !cols.is_empty()).then(|| (rows.to_vec(), cols.to_vec()))
                    };
                    for (run, blocks) in self.runs(tasks.clone(), blocks) {
                        let Some((rows, cols)) = blocks else { continue };
                        let (mut x_at, mut dy_at) =
                            (self.loc(Pass::Backward, x, run.start, 0)?, self.loc(Pass::Backward, dy, run.start, 0)?);
                        let mut k = run.len() * nx.shape.rows();
                        match self.shared_grad(x, dy, &run)? {
                            Some(shared) => (x_at, dy_at, k) = shared,
                            None if table.is_some() => {
                                return Err(internal(format!("no room to sum the gradient of `{}` per row", decl.name)))
                            }
                            // Per vertex after all: a looked-up input's rows must be there.
                            None => {
                                if let Some(i) = self.pulled_input(x) {
                                    self.gather_lookup(i);
                                }
                            }
                        }
                        if let Some((i, at)) = table {
                            // The table gradient per distinct row: (Σ dy)·Wᵀ.
                            let (width, w) =
                                (f.all_inputs()[i].shape.numel(), Loc { buf: PARAMS, offset: self.a.param_at[p] });
                            for c in &cols {
                                self.push(Launch::Gemm(accumulating(
                                    (k, width, c.len()),
                                    (dy_at.offset_by(c.start), ny.shape.cols(), false),
                                    (w.offset_by(c.start), decl.shape.cols(), true, true),
                                    (Loc { buf: ARENA, offset: at }, width),
                                )));
                            }
                        }
                        for r in &rows {
                            for c in &cols {
                                self.push(Launch::Gemm(accumulating(
                                    (r.len(), c.len(), k),
                                    (x_at.offset_by(r.start), nx.shape.cols(), true),
                                    (dy_at.offset_by(c.start), ny.shape.cols(), false, false),
                                    (dst.offset_by(r.start * decl.shape.cols() + c.start), decl.shape.cols()),
                                )));
                            }
                        }
                    }
                }
                ParamGrad::SumRows { dy, .. } => {
                    let period = decl.shape.numel();
                    let block = func.node(dy).shape.numel();
                    let zero = |t: usize| self.b.bwd_facts[t].is_zero(dy);
                    for (run, _) in self.runs(tasks.clone(), zero).into_iter().filter(|(_, z)| !z) {
                        let src = self.loc(Pass::Backward, dy, run.start, 0)?;
                        let rows = run.len() * block / period;
                        self.push(Launch::SumRows { src, rows, cols: period, dst, accumulate: true });
                    }
                }
            }
        }
        Ok(())
    }

    /// Lets the first of the launches from `from` on that writes a parameter's gradient (or a
    /// table gradient formed per distinct row) write it instead of adding to it, where that
    /// launch covers the whole region; the other regions (runs of them) are zeroed by fills put
    /// at `at`, before the pass writes any of them.
    pub(super) fn overwrite_first_grads(&mut self, at: usize, from: usize) {
        let f = Arc::clone(&self.a.f);
        let params = f.params().iter().enumerate();
        let params = params.map(|(p, decl)| (Loc { buf: GRADS, offset: self.a.param_at[p] }, decl.shape.numel()));
        let tables = self.b.table_grad_at.iter().zip(&self.b.shared).zip(f.all_inputs());
        let tables = tables.filter_map(|((at, s), input)| {
            Some((Loc { buf: ARENA, offset: (*at)? }, s.as_ref()?.unique * input.shape.numel()))
        });
        let mut zero: Vec<(Loc, usize)> = Vec::new();
        for (region, len) in params.chain(tables).collect::<Vec<_>>() {
            let inside = |c: &Loc| c.buf == region.buf && (region.offset..region.offset + len).contains(&c.offset);
            let writes = |l: &Launch| match l {
                Launch::Gemm(g) => inside(&g.c),
                Launch::Gemms(gs) | Launch::GemmSum(gs) => gs.iter().any(|g| inside(&g.c)),
                Launch::SumRows { dst, .. } | Launch::Fill { dst, .. } | Launch::Copy { to: dst, .. } => inside(dst),
                Launch::ScatterAdd { dst, .. } => rows_inside(dst, inside),
                Launch::ScatterAdds { parts, .. } => parts.iter().any(|(_, dst)| rows_inside(dst, inside)),
                _ => false,
            };
            let whole = match self.launches[from..].iter_mut().find(|l| writes(l)) {
                Some(Launch::Gemm(g))
                    if g.c == region && g.m * g.n == len && g.ldc == g.n && g.batch == 1 && g.k > 0 =>
                {
                    g.accumulate = false;
                    true
                }
                Some(Launch::SumRows { dst, cols, accumulate, .. }) if *dst == region && *cols == len => {
                    *accumulate = false;
                    true
                }
                _ => false,
            };
            match zero.last_mut() {
                _ if whole || len == 0 => {}
                Some((r, l)) if r.buf == region.buf && r.offset + *l == region.offset => *l += len,
                _ => zero.push((region, len)),
            }
        }
        let fills = zero.into_iter().map(|(dst, len)| Launch::Fill { dst, len });
        self.launches.splice(at..at, fills);
    }
}

/// Whether the rows `dst` a scatter adds to start inside a region (`inside`).
fn rows_inside(dst: &Rows, inside: impl Fn(&Loc) -> bool) -> bool {
    match dst {
        Rows::Contiguous(d) | Rows::Broadcast(d) | Rows::Indexed { data: d, .. } | Rows::IndexedSet { data: d, .. } => {
            inside(d)
        }
        Rows::Zeros => false,
    }
}
