//! The built-in synthetic treebank: seeded random binary trees over a small vocabulary of
//! positive, negative, neutral and negating words, every vertex labelled by a composition rule,
//! so a model must learn composition (negation flips what follows it) to get the roots right.
//!
//! Rule: a word's value is +1 (positive), −1 (negative) or 0 (neutral, negator). A phrase
//! `(a b)` whose left part is a negator word takes −value(b); otherwise it takes the sign of
//! value(a) + value(b). Labels: 0 negative, 1 neutral, 2 positive.

use super::{TreeExample, Vocab, PAD};
use crate::graph::InputGraph;
use crate::rng::Rng;

/// Number of classes.
pub const CLASSES: usize = 3;

const POSITIVE: [&str; 6] = ["good", "great", "fine", "lovely", "superb", "fun"];
const NEGATIVE: [&str; 6] = ["bad", "awful", "dull", "poor", "weak", "boring"];
const NEUTRAL: [&str; 6] = ["the", "a", "film", "plot", "actor", "story"];
const NEGATORS: [&str; 2] = ["not", "never"];

/// The vocabulary of the synthetic treebank.
pub fn vocab() -> Vocab {
    let mut v = Vocab::new(false);
    for w in POSITIVE.iter().chain(&NEGATIVE).chain(&NEUTRAL).chain(&NEGATORS) {
        v.add(w);
    }
    v
}

/// `count` trees of 2 to `max_words` words, from `seed`.
pub fn generate(count: usize, max_words: usize, seed: u64) -> Vec<TreeExample> {
    let vocab = vocab();
    let mut rng = Rng::new(seed);
    (0..count).map(|_| tree(&vocab, &mut rng, max_words.max(2))).collect()
}

fn tree(vocab: &Vocab, rng: &mut Rng, max_words: usize) -> TreeExample {
    let n = 2 + rng.below(max_words - 1);
    let mut children: Vec<Vec<Option<usize>>> = Vec::with_capacity(2 * n - 1);
    let mut words = Vec::with_capacity(2 * n - 1);
    let mut values: Vec<i32> = Vec::with_capacity(2 * n - 1);
    let mut negator = Vec::with_capacity(2 * n - 1);
    for _ in 0..n {
        let (word, value, neg) = match rng.below(10) {
            0..=2 => (POSITIVE[rng.below(POSITIVE.len())], 1, false),
            3..=5 => (NEGATIVE[rng.below(NEGATIVE.len())], -1, false),
            6..=7 => (NEUTRAL[rng.below(NEUTRAL.len())], 0, false),
            _ => (NEGATORS[rng.below(NEGATORS.len())], 0, true),
        };
        children.push(Vec::new());
        words.push(vocab.get(word));
        values.push(value);
        negator.push(neg);
    }
    // Random bracketing: merge a random adjacent pair until one tree remains.
    let mut frontier: Vec<usize> = (0..n).collect();
    while frontier.len() > 1 {
        let i = rng.below(frontier.len() - 1);
        let (a, b) = (frontier[i], frontier[i + 1]);
        let value = if negator[a] { -values[b] } else { (values[a] + values[b]).signum() };
        children.push(vec![Some(a), Some(b)]);
        words.push(PAD);
        values.push(value);
        negator.push(false);
        frontier.splice(i..i + 2, [children.len() - 1]);
    }
    let labels = values.iter().map(|&v| (v + 1) as u32).collect();
    let graph = InputGraph::from_children(children).expect("merging adjacent trees gives a tree");
    TreeExample { graph, words, labels }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trees_follow_the_composition_rule() {
        let v = vocab();
        let data = generate(200, 10, 3);
        let mut roots = [0usize; CLASSES];
        for ex in &data {
            assert_eq!(ex.graph.roots(), vec![ex.root()]);
            assert_eq!(ex.words.len(), ex.graph.len());
            for p in 0..ex.graph.len() {
                let kids = ex.graph.children(p);
                if kids.is_empty() {
                    assert_ne!(ex.words[p], PAD);
                    continue;
                }
                let (a, b) = (kids[0] as usize, kids[1] as usize);
                let is_neg = ex.graph.children(a).is_empty() && NEGATORS.contains(&v.word(ex.words[a]).unwrap());
                let val = |x: usize| ex.labels[x] as i32 - 1;
                let want = if is_neg { -val(b) } else { (val(a) + val(b)).signum() };
                assert_eq!(val(p), want, "vertex {p}");
            }
            roots[ex.labels[ex.root()] as usize] += 1;
        }
        // Every class occurs at the root often enough to learn.
        assert!(roots.iter().all(|&c| c > 30), "{roots:?}");
        assert_eq!(generate(5, 10, 3), generate(5, 10, 3));
    }
}
