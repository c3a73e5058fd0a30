//! The optimizer on the CPU: [`arbor_core::optim::apply`] over a dense tensor or over chosen
//! rows of a table, in pieces shared out between the team's threads and compiled for the widest
//! vector instructions the CPU has; the backend's optimizer calls and the host-side
//! `arbor::optim::Optimizer` both run it.

use super::bad;
use super::host::{for_each_on_team, vectorised};
use super::memory::{apart, Raw, Span};
use arbor_core::backend::{IndexLoc, Loc, OptimAt};
use arbor_core::error::Result;
use arbor_core::optim::{apply, Update};

/// Elements per piece of a dense update shared out between the threads (the optimizer's and a
/// weight average's).
pub const PIECE: usize = 1 << 14;

/// The sum of the squares of `x` in f64, over pieces of [`PIECE`] shared out between the team's
/// threads and added in order: the same on any number of threads.
pub fn sum_squares(x: &[f32]) -> f64 {
    let one = |x: &[f32]| {
        vectorised(
            #[inline(always)]
            || arbor_core::optim::sum_squares(x),
        )
    };
    if x.len() <= PIECE {
        return one(x);
    }
    let mut sums = vec![0.0; x.len().div_ceil(PIECE)];
    for_each_on_team(x.chunks(PIECE).zip(&mut sums).collect(), |(piece, sum)| *sum = one(piece));
    sums.iter().sum()
}

/// Applies `u` to `p` with gradient `g` and state `m`, `v` (each as long as `p`; `v` may be
/// empty where the rule keeps no second moment).
pub fn dense(u: &Update, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let mut v = v.chunks_mut(PIECE);
    let pieces = p.chunks_mut(PIECE).zip(g.chunks(PIECE)).zip(m.chunks_mut(PIECE));
    let items = pieces.map(|((p, g), m)| (p, g, m, v.next().unwrap_or_default())).collect();
    for_each_on_team(items, |(p, g, m, v)| {
        vectorised(
            #[inline(always)]
            || apply(u, p, g, m, v),
        )
    });
}

/// Applies `u` to the rows `rows` (ascending, each once, below the table's row count) of the
/// table `table` of rows of `dim` values, row `rows[k]`'s gradient being `g[k·dim..]`, with
/// state `m`, `v` kept for every row of the table. Rows past the table's end are not updated.
pub fn rows(u: &Update, (table, dim): (&mut [f32], usize), rows: &[u32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let dim = dim.max(1);
    let mut v = v.chunks_exact_mut(dim);
    let mut all = table.chunks_exact_mut(dim).zip(m.chunks_exact_mut(dim));
    let mut next = 0;
    let mut items = Vec::with_capacity(rows.len());
    for (&r, g) in rows.iter().zip(g.chunks_exact(dim)) {
        let Some((p, m)) = all.nth(r as usize - next) else { break };
        let v = v.nth(r as usize - next).unwrap_or_default();
        next = r as usize + 1;
        items.push((p, g, m, v));
    }
    for_each_on_team(items, |(p, g, m, v)| {
        vectorised(
            #[inline(always)]
            || apply(u, p, g, m, v),
        )
    });
}

/// Whether `rows` are ascending, each once, and below `vocab`: the form [`rows`] takes.
pub fn rows_in_order(rows: &[u32], vocab: usize) -> bool {
    rows.windows(2).all(|w| w[0] < w[1]) && rows.last().is_none_or(|&r| (r as usize) < vocab)
}

/// The regions of one update, checked apart from each other: `p`, `m`, `v` (each `len`, or the
/// table's) written, `g` (`glen`) read.
fn regions(op: &str, at: &OptimAt, len: usize, glen: usize) -> Result<()> {
    let w = [Span::at(at.p, len), Span::at(at.m, len), Span::at(at.v, len)];
    for (i, a) in w.iter().enumerate() {
        apart(op, *a, Span::at(at.g, glen))?;
        for b in &w[i + 1..] {
            apart(op, *a, *b)?;
        }
    }
    Ok(())
}

/// The backend's dense update (`Backend::update`).
pub(crate) fn update(raw: &Raw<'_>, u: &Update, at: &OptimAt, len: usize) -> Result<()> {
    regions("update", at, len, len)?;
    // SAFETY: every range is checked by `Raw`, and apart from the others (above).
    let (p, g, m, v) = unsafe {
        (
            raw.get_mut("update", at.p, len)?,
            raw.get("update", at.g, len)?,
            raw.get_mut("update", at.m, len)?,
            raw.get_mut("update", at.v, len)?,
        )
    };
    dense(u, p, g, m, v);
    Ok(())
}

/// Moves the weight average `avg` toward `x` ([`arbor_core::optim::average`]) in pieces shared
/// out between the team's threads.
pub fn average_on_team(avg: &mut [f32], x: &[f32], keep: f32) {
    let pieces = avg.chunks_mut(PIECE).zip(x.chunks(PIECE)).collect();
    for_each_on_team(pieces, |(avg, x)| {
        vectorised(
            #[inline(always)]
            || arbor_core::optim::average(avg, x, keep),
        )
    });
}

/// The backend's weight average (`Backend::average`).
pub(crate) fn average(raw: &Raw<'_>, avg: Loc, x: Loc, len: usize, keep: f32) -> Result<()> {
    apart("average", Span::at(avg, len), Span::at(x, len))?;
    // SAFETY: both ranges are checked by `Raw`, and apart (above).
    let (avg, x) = unsafe { (raw.get_mut("average", avg, len)?, raw.get("average", x, len)?) };
    average_on_team(avg, x, keep);
    Ok(())
}

/// The backend's update of table rows (`Backend::update_rows`).
pub(crate) fn update_rows(
    raw: &Raw<'_>,
    u: &Update,
    at: &OptimAt,
    (dim, vocab): (usize, usize),
    index: IndexLoc,
    n: usize,
) -> Result<()> {
    let len = dim * vocab;
    regions("update_rows", at, len, n * dim)?;
    let ids = raw.index("update_rows", index, n)?;
    if !rows_in_order(ids, vocab) {
        return Err(bad("update_rows", format!("the {n} rows are not ascending, each once, below {vocab}")));
    }
    // SAFETY: as in `update`.
    let (p, g, m, v) = unsafe {
        (
            raw.get_mut("update_rows", at.p, len)?,
            raw.get("update_rows", at.g, n * dim)?,
            raw.get_mut("update_rows", at.m, len)?,
            raw.get_mut("update_rows", at.v, len)?,
        )
    };
    rows(u, (p, dim), ids, g, m, v);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_core::optim::{Config, Rule};

    #[test]
    fn rows_update_only_the_rows_named() {
        let u = Update::new(Config::new(Rule::Sgd { momentum: 0.0 }, 1.0), 1);
        let (mut table, mut m, mut v) = (vec![1.0f32; 8], vec![0.0; 8], vec![0.0; 8]);
        rows(&u, (&mut table, 2), &[1, 3], &[1.0, 2.0, 3.0, 4.0], &mut m, &mut v);
        assert_eq!(table, [1.0, 1.0, 0.0, -1.0, 1.0, 1.0, -2.0, -3.0]);
        assert!(rows_in_order(&[0, 2], 3) && !rows_in_order(&[2, 2], 3) && !rows_in_order(&[3], 3));
        // Every third row of 300 (Adagrad, with state): the others untouched.
        let u = Update::new(Config::new(Rule::Adagrad, 0.5), 1);
        let (dim, vocab) = (3, 300);
        let named: Vec<u32> = (0..vocab as u32).step_by(3).collect();
        let g: Vec<f32> = (0..named.len() * dim).map(|i| (i % 7) as f32 - 3.0).collect();
        let (mut table, mut m, mut v) = (vec![1.0f32; dim * vocab], vec![0.5; dim * vocab], vec![]);
        rows(&u, (&mut table, dim), &named, &g, &mut m, &mut v);
        for r in 0..vocab {
            for c in 0..dim {
                let (mut p, mut s) = ([1.0f32], [0.5f32]);
                if let Some(k) = named.iter().position(|&n| n as usize == r) {
                    apply(&u, &mut p, &g[k * dim + c..][..1], &mut s, &mut []);
                }
                assert_eq!((table[r * dim + c], m[r * dim + c]), (p[0], s[0]), "row {r}, column {c}");
            }
        }
    }

    #[test]
    fn sums_of_squares_have_the_same_bits_on_every_instruction_set() {
        let x: Vec<f32> = (0..10_007).map(|i| ((i * 7919) % 1000) as f32 / 300.0 - 1.5).collect();
        let wide = crate::cpu::host::vectorised(
            #[inline(always)]
            || arbor_core::optim::sum_squares(&x),
        );
        assert_eq!(wide.to_bits(), arbor_core::optim::sum_squares(&x).to_bits());
    }

    #[test]
    fn pieces_give_the_bits_of_one_pass() {
        let u = Update::new(Config::new(Rule::Adam, 0.01), 3);
        let n = 3 * PIECE + 5;
        let g: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let (mut p, mut m, mut v) = (vec![0.5f32; n], vec![0.1; n], vec![0.2; n]);
        let (mut p2, mut m2, mut v2) = (p.clone(), m.clone(), v.clone());
        dense(&u, &mut p, &g, &mut m, &mut v);
        apply(&u, &mut p2, &g, &mut m2, &mut v2);
        assert_eq!((p, m, v), (p2, m2, v2));
    }
}
