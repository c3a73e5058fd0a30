//! Scores of real-valued predictions against gold values: Pearson's and Spearman's correlations
//! and the mean squared error (as SICK relatedness is reported).

/// Pearson's correlation of `a` and `b` (NaN when either is constant or they are empty).
pub fn pearson(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len().min(b.len()) as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let (mut ab, mut aa, mut bb) = (0.0, 0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (x - ma, y - mb);
        (ab, aa, bb) = (ab + x * y, aa + x * x, bb + y * y);
    }
    ab / (aa * bb).sqrt()
}

/// Spearman's rank correlation: Pearson's of the ranks, ties sharing their mean rank.
pub fn spearman(a: &[f64], b: &[f64]) -> f64 {
    pearson(&ranks(a), &ranks(b))
}

/// The mean of `(a_i − b_i)²`.
pub fn mean_squared_error(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>() / a.len().min(b.len()) as f64
}

/// The rank of each value (1-based; tied values get their mean rank).
fn ranks(x: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&i, &j| x[i].total_cmp(&x[j]));
    let mut out = vec![0.0; x.len()];
    let mut start = 0;
    while start < order.len() {
        let end = (start..order.len()).find(|&k| x[order[k]] != x[order[start]]).unwrap_or(order.len());
        let rank = (start + end + 1) as f64 / 2.0;
        order[start..end].iter().for_each(|&i| out[i] = rank);
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_match_hand_computed_values() {
        let (a, b) = ([1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 5.0, 4.0]);
        // Means 2.5 and 3.75; covariance sum 3.5; sums of squares 5 and 4.75.
        assert!((pearson(&a, &b) - 3.5 / (5.0f64 * 4.75).sqrt()).abs() < 1e-12);
        // Ranks of b with the tie: 1, 2.5, 4, 2.5.
        assert_eq!(ranks(&b), [1.0, 2.5, 4.0, 2.5]);
        assert!((spearman(&a, &b) - pearson(&a, &[1.0, 2.5, 4.0, 2.5])).abs() < 1e-12);
        assert!((spearman(&a, &[10.0, 20.0, 30.0, 40.0]) - 1.0).abs() < 1e-12);
        assert!((mean_squared_error(&a, &b) - (1.0 + 4.0 + 4.0 + 0.0) / 4.0).abs() < 1e-12);
        assert!(pearson(&a, &[1.0; 4]).is_nan(), "a constant has no correlation");
    }
}
