//! SICK sentence relatedness (Marelli et al. 2014) as Tai et al. (2015) prepared it: a split is a
//! folder of files with one line per sentence pair — `a.toks` and `b.toks` (tokens separated by
//! spaces), `a.parents` and `b.parents` (each token's head, 1-based, `0` for the root: a
//! dependency tree), `a.rels` and `b.rels` where they exist (each token's relation to its head,
//! a Stanford dependency name) and `sim.txt` (the relatedness score, 1 to 5). Each token is a
//! vertex whose children are its dependents, in sentence order, each edge labelled with the
//! dependent's relation ([`RELATIONS`]); dependency trees are n-ary.

use super::{Dataset, Vocab};
use crate::error::{Error, Result};
use crate::graph::InputGraph;
use crate::metrics;
use crate::model::{AsExample, Example, Model, Outputs, Tree};
use crate::trainer::Scores;
use crate::Backend;
use std::path::Path;

/// The lowest relatedness score.
pub const MIN_SCORE: f32 = 1.0;
/// The highest relatedness score.
pub const MAX_SCORE: f32 = 5.0;
/// Score classes 1..=5 of the target distribution.
pub const CLASSES: usize = 5;

/// The Stanford basic dependency relations (de Marneffe and Manning's manual, v3), an edge's
/// label being its place here; a name not listed reads as `dep` (the manual's unspecified
/// dependency). Fixed, so a model's labels mean the same in every split and every checkpoint.
pub const RELATIONS: [&str; 50] = [
    "root",
    "dep",
    "aux",
    "auxpass",
    "cop",
    "arg",
    "agent",
    "comp",
    "acomp",
    "ccomp",
    "xcomp",
    "obj",
    "dobj",
    "iobj",
    "pobj",
    "subj",
    "nsubj",
    "nsubjpass",
    "csubj",
    "csubjpass",
    "cc",
    "conj",
    "expl",
    "mod",
    "amod",
    "appos",
    "advcl",
    "det",
    "predet",
    "preconj",
    "vmod",
    "mwe",
    "mark",
    "advmod",
    "neg",
    "rcmod",
    "quantmod",
    "nn",
    "npadvmod",
    "tmod",
    "num",
    "number",
    "prep",
    "poss",
    "possessive",
    "prt",
    "parataxis",
    "goeswith",
    "punct",
    "pcomp",
];

/// The label of dependency relation `name` ([`RELATIONS`]; `dep` for a name not listed).
pub fn relation(name: &str) -> u32 {
    let at = |n: &str| RELATIONS.iter().position(|r| *r == n);
    at(name).or_else(|| at("dep")).unwrap_or(0) as u32
}

/// One sentence: its dependency tree and a word id per token.
#[derive(Clone, Debug)]
pub struct Sentence {
    /// Token `i` is vertex `i`; its children are its dependents.
    pub graph: InputGraph,
    /// Word id per token.
    pub words: Vec<u32>,
    /// The root token (the head of the sentence).
    pub root: usize,
}

/// A sentence pair and its relatedness score.
#[derive(Clone, Debug)]
pub struct Pair {
    /// Sentence A.
    pub a: Sentence,
    /// Sentence B.
    pub b: Sentence,
    /// Relatedness, from 1 (unrelated) to 5 (the same meaning).
    pub score: f32,
}

impl Sentence {
    /// The sentence as a model reads it: its tree, its words, its root.
    pub fn tree(&self) -> Tree<'_> {
        Tree::new(&self.graph, &self.words, self.root)
    }

    /// The sentence with each edge labelled by its dependent's relation, from a `.rels` line
    /// (one name per token) at `at` (file, line): an error names it if the count differs.
    fn with_relations(self, rels: &str, at: (&str, usize)) -> Result<Sentence> {
        let names: Vec<&str> = rels.split_ascii_whitespace().collect();
        if names.len() != self.words.len() {
            return Err(parse_error(at, format!("{} relations for {} tokens", names.len(), self.words.len())));
        }
        let labels = (0..self.graph.len())
            .map(|v| self.graph.children(v).iter().map(|&c| relation(names[c as usize])).collect())
            .collect();
        let graph = self.graph.with_edge_labels(labels)?;
        Ok(Sentence { graph, ..self })
    }
}

impl Pair {
    /// The pair as a model reads it: both trees, and the target distribution of its score
    /// ([`target_distribution`]).
    pub fn example(&self) -> Example<'_> {
        Example { trees: vec![self.a.tree(), self.b.tree()], target: target_distribution(self.score).to_vec() }
    }
}

impl AsExample for Pair {
    fn example(&self) -> Example<'_> {
        Pair::example(self)
    }

    /// Pearson's correlation of the expected scores with the gold ones (which picks the best
    /// epoch), Spearman's, and the mean squared error.
    fn score(outputs: &Outputs, data: &[Pair]) -> Result<Scores> {
        let (got, gold) = (expected_scores(outputs)?, gold(data));
        Ok(vec![
            ("pearson".into(), metrics::pearson(&got, &gold)),
            ("spearman".into(), metrics::spearman(&got, &gold)),
            ("mse".into(), metrics::mean_squared_error(&got, &gold)),
        ])
    }
}

/// Reads `DIR/train`, `DIR/dev` and `DIR/test`.
pub fn read_splits(dir: &Path, lowercase: bool) -> Result<Dataset<Pair>> {
    let mut vocab = Vocab::new(lowercase);
    let train = read(&dir.join("train"), &mut vocab, true)?;
    let dev = read(&dir.join("dev"), &mut vocab, false)?;
    let test = read(&dir.join("test"), &mut vocab, false)?;
    Ok(Dataset { train, dev, test, vocab })
}

/// Reads the pairs of one split folder. With `grow`, new words enter `vocab`; otherwise they map
/// to `<unk>`. Errors name the file and line: files of different lengths, a token count that
/// differs from its parent count, a head out of range, no root or several, a cycle, a score that
/// is not a number from 1 to 5.
pub fn read(dir: &Path, vocab: &mut Vocab, grow: bool) -> Result<Vec<Pair>> {
    // The relations are read where both files exist (older copies of the data lack them).
    let rels = dir.join("a.rels").exists() && dir.join("b.rels").exists();
    let names: &[&str] = if rels {
        &["a.toks", "a.parents", "b.toks", "b.parents", "sim.txt", "a.rels", "b.rels"]
    } else {
        &["a.toks", "a.parents", "b.toks", "b.parents", "sim.txt"]
    };
    let mut files = Vec::with_capacity(names.len());
    for name in names {
        let path = dir.join(name);
        let text: Vec<String> = super::lines::read_all(&path)?.into_iter().map(|(_, line)| line).collect();
        files.push((path.display().to_string(), text));
    }
    let lines: Vec<Vec<&str>> = files.iter().map(|(_, text)| text.iter().map(String::as_str).collect()).collect();
    let pairs = lines[0].len();
    if let Some(k) = (1..names.len()).find(|&k| lines[k].len() != pairs) {
        return Err(Error::Parse {
            file: files[k].0.clone(),
            line: lines[k].len().min(pairs) + 1,
            msg: format!("{} lines where {} has {pairs}: one line per pair in every file", lines[k].len(), names[0]),
        });
    }
    let mut out = Vec::with_capacity(pairs);
    for (i, &a_toks) in lines[0].iter().enumerate() {
        let at = |k: usize| (files[k].0.as_str(), i + 1);
        let id = &mut |w: &str| if grow { vocab.add(w) } else { vocab.get(w) };
        let a = sentence(a_toks, lines[1][i], at(0), at(1), id)?;
        let b = sentence(lines[2][i], lines[3][i], at(2), at(3), id)?;
        let score = parse_score(lines[4][i], at(4))?;
        let (a, b) =
            if rels { (a.with_relations(lines[5][i], at(5))?, b.with_relations(lines[6][i], at(6))?) } else { (a, b) };
        out.push(Pair { a, b, score });
    }
    Ok(out)
}

/// A pair to score, from one line of text: sentence A and sentence B separated by a tab, each
/// either its tokens alone (read as a chain, every token headed by the next, the last the root)
/// or its tokens and their heads as the SICK files give them
/// (`tokens<TAB>heads<TAB>tokens<TAB>heads`, heads counting from 1, 0 for the root). Words not
/// in `vocab` read as `<unk>`; the score is unknown (NaN). Errors name `file` and `line`.
pub fn parse_pair(text: &str, file: &str, line: usize, vocab: &Vocab) -> Result<Pair> {
    let fields: Vec<&str> = text.split('\t').map(str::trim).collect();
    let at = (file, line);
    let chain = |toks: &str| {
        let n = toks.split_ascii_whitespace().count();
        (1..=n).map(|t| if t == n { "0".to_string() } else { (t + 1).to_string() }).collect::<Vec<_>>().join(" ")
    };
    let (a, a_heads, b, b_heads) = match fields[..] {
        [a, b] => (a, chain(a), b, chain(b)),
        [a, a_heads, b, b_heads] => (a, a_heads.to_string(), b, b_heads.to_string()),
        _ => {
            return Err(parse_error(
                at,
                format!(
                    "{} tab-separated fields: expected 2 (sentence A, sentence B) or 4 (tokens and heads of each)",
                    fields.len()
                ),
            ))
        }
    };
    let id = &mut |w: &str| vocab.get(w);
    let a = sentence(a, &a_heads, at, at, id)?;
    let b = sentence(b, &b_heads, at, at, id)?;
    Ok(Pair { a, b, score: f32::NAN })
}

fn parse_error((file, line): (&str, usize), msg: String) -> Error {
    Error::Parse { file: file.into(), line, msg }
}

/// A sentence from its tokens line and its parents line (each with its file and line number),
/// `id` giving each word's id.
fn sentence(
    toks: &str,
    parents: &str,
    toks_at: (&str, usize),
    parents_at: (&str, usize),
    id: &mut dyn FnMut(&str) -> u32,
) -> Result<Sentence> {
    // Tokens are separated by ASCII spaces and tabs: a no-break space is part of a word.
    let tokens: Vec<&str> = toks.split_ascii_whitespace().collect();
    if tokens.is_empty() {
        return Err(parse_error(toks_at, "an empty sentence".into()));
    }
    let n = tokens.len();
    let mut heads = Vec::with_capacity(n);
    for (t, field) in parents.split_ascii_whitespace().enumerate() {
        match field.parse::<usize>() {
            Ok(h) if h <= n && h != t + 1 => heads.push(h),
            _ => {
                return Err(parse_error(
                    parents_at,
                    format!("head `{field}` of token {}: expected 0 (the root) or another token, 1 to {n}", t + 1),
                ))
            }
        }
    }
    if heads.len() != n {
        return Err(parse_error(parents_at, format!("{} heads for {n} tokens", heads.len())));
    }
    let roots: Vec<usize> = (0..n).filter(|&t| heads[t] == 0).collect();
    let [root] = roots[..] else {
        let which: Vec<String> = roots.iter().map(|t| (t + 1).to_string()).collect();
        return Err(parse_error(
            parents_at,
            format!("{} roots (tokens [{}]): expected one", roots.len(), which.join(", ")),
        ));
    };
    if let Some(t) = on_a_cycle(&heads) {
        return Err(parse_error(parents_at, format!("token {t} lies on a cycle of heads (tokens count from 1)")));
    }
    let parents: Vec<Option<usize>> = heads.iter().map(|&h| h.checked_sub(1)).collect();
    let graph = InputGraph::from_parents(&parents).map_err(|e| parse_error(parents_at, format!("not a tree: {e}")))?;
    let words = tokens.iter().map(|w| id(w)).collect();
    Ok(Sentence { graph, words, root })
}

/// A token (from 1) on a cycle of `heads` (each token's head, from 1; 0 for the root), if any:
/// every token's path of heads is followed once, without recursion.
fn on_a_cycle(heads: &[usize]) -> Option<usize> {
    #[derive(Clone, Copy, PartialEq)]
    enum Seen {
        No,
        OnPath,
        Done,
    }
    let mut seen = vec![Seen::No; heads.len() + 1];
    seen[0] = Seen::Done;
    let mut path = Vec::new();
    for start in 1..=heads.len() {
        let mut t = start;
        while seen[t] == Seen::No {
            seen[t] = Seen::OnPath;
            path.push(t);
            t = heads[t - 1];
        }
        if seen[t] == Seen::OnPath {
            return Some(t);
        }
        for &p in &path {
            seen[p] = Seen::Done;
        }
        path.clear();
    }
    None
}

fn parse_score(field: &str, at: (&str, usize)) -> Result<f32> {
    match field.trim().parse::<f32>() {
        Ok(s) if (MIN_SCORE..=MAX_SCORE).contains(&s) => Ok(s),
        _ => Err(parse_error(at, format!("score `{field}`: expected a number from {MIN_SCORE} to {MAX_SCORE}"))),
    }
}

/// The expected score `Σ_k k·q_k` of a distribution `q` over the classes 1..=5.
fn expected_score(q: &[f32]) -> f64 {
    q.iter().enumerate().map(|(k, &q)| (k as f64 + f64::from(MIN_SCORE)) * f64::from(q)).sum()
}

/// The expected scores that a model whose head is
/// [`relatedness_head`](crate::nn::relatedness_head) (its output `q` the score distribution)
/// predicts for `pairs`, 256 pairs at a time.
pub fn predict<B: Backend>(model: &mut Model<B>, pairs: &[Pair]) -> Result<Vec<f64>> {
    expected_scores(&model.infer_all(pairs)?)
}

/// The expected scores from a relatedness head's outputs (its distribution `q` over 1..=5).
fn expected_scores(outputs: &Outputs) -> Result<Vec<f64>> {
    Ok(outputs.get("q")?.chunks(CLASSES).map(expected_score).collect())
}

/// The gold scores of `pairs`.
pub fn gold(pairs: &[Pair]) -> Vec<f64> {
    pairs.iter().map(|p| f64::from(p.score)).collect()
}

/// The sparse target distribution of a score over the classes 1..=5 (Tai et al. 2015): the
/// probability mass sits on the two classes around the score, so its expectation is the score.
pub fn target_distribution(score: f32) -> [f32; CLASSES] {
    let score = score.clamp(MIN_SCORE, MAX_SCORE);
    let low = score.floor();
    let mut p = [0.0; CLASSES];
    let k = (low - MIN_SCORE) as usize;
    if low == score {
        p[k] = 1.0;
    } else {
        p[k] = low + 1.0 - score;
        p[k + 1] = score - low;
    }
    p
}
