//! Column-level facts about a function's values on one task (a set of vertices that share which
//! loads are all zeros): which columns are known to be zero, and which columns anything the task
//! must produce depends on.
//!
//! Both are exact. A product with a zero factor is zero, so the other factor is not needed there
//! (the engine keeps every value it does not compute at zero, never stale, so a factor that is
//! not computed is still finite). For a binary Tree-LSTM at the leaves, the forget gates multiply
//! the cell states of missing children: their columns of `x·W` are not needed, and their columns
//! of the gate gradient are zero, which removes 40% of every leaf product.

use super::elementwise::Zeros;
use super::func::Func;
use super::op::{Op, ValueId};
use std::ops::Range;

/// A set of columns of one value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Cols(Vec<bool>);

impl Cols {
    /// No column of `width`.
    pub fn none(width: usize) -> Cols {
        Cols(vec![false; width])
    }

    /// Every column of `width`.
    pub fn all(width: usize) -> Cols {
        Cols(vec![true; width])
    }

    /// `all(width)` or `none(width)`.
    pub fn all_if(yes: bool, width: usize) -> Cols {
        Cols(vec![yes; width])
    }

    /// The value's width.
    pub fn width(&self) -> usize {
        self.0.len()
    }

    /// Whether no column is in the set.
    pub fn is_empty(&self) -> bool {
        !self.0.contains(&true)
    }

    /// Whether every column is in the set.
    pub fn is_full(&self) -> bool {
        !self.0.contains(&false)
    }

    /// Whether column `j` is in the set.
    pub fn contains(&self, j: usize) -> bool {
        self.0[j]
    }

    /// The columns not in the set.
    pub fn complement(&self) -> Cols {
        Cols(self.0.iter().map(|c| !c).collect())
    }

    /// The columns in this set and not in `other` (of the same width).
    pub fn minus(&self, other: &Cols) -> Cols {
        Cols(self.0.iter().zip(&other.0).map(|(a, b)| *a && !b).collect())
    }

    /// The columns in both sets.
    pub fn and(&self, other: &Cols) -> Cols {
        Cols(self.0.iter().zip(&other.0).map(|(a, b)| *a && *b).collect())
    }

    /// The columns in either set.
    pub fn or(&self, other: &Cols) -> Cols {
        Cols(self.0.iter().zip(&other.0).map(|(a, b)| *a || *b).collect())
    }

    /// Adds the columns of `other`, shifted to start at column `at`.
    pub fn add_at(&mut self, other: &Cols, at: usize) {
        for (d, s) in self.0[at..at + other.width()].iter_mut().zip(&other.0) {
            *d |= s;
        }
    }

    /// Columns `range` as a set of width `range.len()`.
    pub fn slice(&self, range: Range<usize>) -> Cols {
        Cols(self.0[range].to_vec())
    }

    /// The set as maximal ranges, in order.
    pub fn ranges(&self) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::new();
        for (j, &c) in self.0.iter().enumerate() {
            match out.last_mut() {
                Some(r) if c && r.end == j => r.end += 1,
                _ if c => out.push(j..j + 1),
                _ => {}
            }
        }
        out
    }
}

impl Func {
    /// Per value, the columns known to be zero on every vertex, given those of the loads (`load`
    /// is asked for every load op other than parameters and `Zeros`, which is all zeros).
    pub fn zero_columns(&self, mut load: impl FnMut(ValueId, &Op) -> Cols) -> Vec<Cols> {
        let mut z: Vec<Cols> = Vec::with_capacity(self.nodes.len());
        for (i, n) in self.nodes.iter().enumerate() {
            let w = n.shape.cols();
            let at = |v: &ValueId| &z[v.index()];
            // A parameter may hold anything.
            let of = |v: &ValueId| if self.node(*v).is_param { Cols::none(w) } else { at(v).clone() };
            let cols = match &n.op {
                Op::Param { .. } => Cols::none(w),
                Op::Zeros => Cols::all(w),
                op if op.is_load() => load(ValueId(i as u32), op),
                Op::MatMul { a, b, tb, .. } => {
                    let b_node = self.node(*b);
                    if at(a).is_full() || !b_node.is_param && at(b).is_full() {
                        Cols::all(w)
                    } else if !b_node.is_param && !tb {
                        // Column j of op(A)·B is zero where column j of B is.
                        at(b).clone()
                    } else {
                        Cols::none(w)
                    }
                }
                Op::Unary { op, x } if op.keeps_zero() => at(x).clone(),
                Op::Unary { .. } => Cols::none(w),
                Op::Binary { op, a, b } => match op.zeros() {
                    Zeros::Both => of(a).and(&of(b)),
                    Zeros::Either => of(a).or(&of(b)),
                    Zeros::First => of(a),
                    Zeros::Second => of(b),
                },
                Op::Slice { x, start, len } => at(x).slice(*start..start + len),
                Op::Concat { parts } => {
                    let mut c = Cols::none(w);
                    let mut col = 0;
                    for p in parts {
                        c.add_at(at(p), col);
                        col += at(p).width();
                    }
                    c
                }
                Op::SumCols { x } | Op::MaxCols { x } | Op::BroadcastCols { x, .. } => Cols::all_if(at(x).is_full(), w),
                // Attention reads the children's rows, which no load pattern describes.
                Op::GatherSoftmax { .. } | Op::GatherSoftmaxGrad { .. } => Cols::none(w),
                Op::Gather { .. }
                | Op::GatherAll { .. }
                | Op::Pull { .. }
                | Op::Primal { .. }
                | Op::StateGrad { .. }
                | Op::PushGrad { .. }
                | Op::Stored { .. } => unreachable!("loads are handled above"),
            };
            z.push(cols);
        }
        z
    }

    /// Per value, the columns that the columns `roots[v]` asked of each value depend on, given
    /// the zero columns `zero` (from [`Func::zero_columns`]). Parameters are never needed.
    pub fn needed_columns(&self, zero: &[Cols], mut need: Vec<Cols>) -> Vec<Cols> {
        for i in (0..self.nodes.len()).rev() {
            let n = &self.nodes[i];
            if need[i].is_empty() {
                continue;
            }
            let d = need[i].clone();
            let mut ask = |v: ValueId, cols: &Cols, at: usize| {
                if !self.node(v).is_param {
                    need[v.index()].add_at(cols, at);
                }
            };
            let all = |v: ValueId| Cols::all(self.node(v).shape.cols());
            let nonzero = |v: ValueId| if self.node(v).is_param { all(v) } else { zero[v.index()].complement() };
            match &n.op {
                Op::MatMul { a, b, ta, .. } => {
                    // Zero columns of A (the inner dimension unless transposed) add nothing.
                    ask(*a, &if *ta { all(*a) } else { nonzero(*a) }, 0);
                    ask(*b, &all(*b), 0);
                }
                Op::Unary { x, .. } => ask(*x, &d, 0),
                Op::Binary { op, a, b } => match op.zeros() {
                    // An input is not needed where the result is zero whatever it holds.
                    Zeros::Both | Zeros::First => {
                        ask(*a, &d, 0);
                        ask(*b, &d, 0);
                    }
                    Zeros::Either => {
                        ask(*a, &d.and(&nonzero(*b)), 0);
                        ask(*b, &d.and(&nonzero(*a)), 0);
                    }
                    Zeros::Second => {
                        ask(*a, &d.and(&nonzero(*b)), 0);
                        ask(*b, &d, 0);
                    }
                },
                Op::Slice { x, start, .. } => ask(*x, &d, *start),
                Op::Concat { parts } => {
                    let mut col = 0;
                    for p in parts {
                        let w = self.node(*p).shape.cols();
                        ask(*p, &d.slice(col..col + w), 0);
                        col += w;
                    }
                }
                Op::SumCols { x } | Op::MaxCols { x } | Op::BroadcastCols { x, .. } => ask(*x, &all(*x), 0),
                Op::GatherSoftmax { .. } | Op::GatherSoftmaxGrad { .. } => {
                    for x in n.op.inputs() {
                        ask(x, &all(x), 0);
                    }
                }
                _ => {}
            }
        }
        need
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_maximal_runs() {
        let mut c = Cols::none(10);
        c.add_at(&Cols::all(3), 1);
        c.add_at(&Cols::all(2), 6);
        c.add_at(&Cols::all(1), 9);
        assert_eq!(c.ranges(), vec![1..4, 6..8, 9..10]);
        assert_eq!(c.complement().ranges(), vec![0..1, 4..6, 8..9]);
        assert!(Cols::none(0).is_empty() && Cols::none(0).is_full());
    }
}
