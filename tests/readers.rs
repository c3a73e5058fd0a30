//! Data readers: GloVe vectors, SICK pairs, and fuzzing of the tree and SICK readers — random and
//! mutated inputs never panic and always give an error naming the line.

use arbor::data::{glove, sst, Vocab};
use arbor::ptb::PtbTree;
use proptest::prelude::*;

#[test]
fn glove_reads_vocabulary_rows_only() {
    let dir = std::env::temp_dir().join(format!("arbor-glove-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("vectors.txt");
    std::fs::write(&file, "good 0.5 -1\nunseen 9 9\nbad -0.25 2e-1\nunseen 7 7\n").unwrap();
    let mut vocab = Vocab::new(false);
    let (good, bad) = (vocab.add("good"), vocab.add("bad"));
    vocab.add("rare");
    let mut table = vec![0.125f32; vocab.len() * 2];
    let found = glove::read_into(&file, &vocab, 2, &mut table).unwrap();
    assert_eq!(found, glove::Found { words: 2, merged: 0 });
    assert_eq!(table[good as usize * 2..good as usize * 2 + 2], [0.5, -1.0]);
    assert_eq!(table[bad as usize * 2..bad as usize * 2 + 2], [-0.25, 0.2]);
    assert_eq!(table[8..10], [0.125, 0.125]); // `rare` keeps its value
    std::fs::write(&file, "good 0.5 -1\nbad 1 x\n").unwrap();
    let err = glove::read_into(&file, &vocab, 2, &mut table).unwrap_err().to_string();
    assert!(err.contains("vectors.txt:2:") && err.contains("value 2 of `bad` is not a finite number"), "{err}");
    // A vocabulary word listed twice is refused (words outside the vocabulary are skipped).
    std::fs::write(&file, "good 0.5 -1\ngood 7 7\n").unwrap();
    let err = glove::read_into(&file, &vocab, 2, &mut table).unwrap_err().to_string();
    assert!(err.contains("vectors.txt:2:") && err.contains("`good` is listed a second time"), "{err}");
    std::fs::write(&file, "good 0.5 -1 3\n").unwrap();
    let err = glove::read_into(&file, &vocab, 2, &mut table).unwrap_err().to_string();
    assert!(err.contains(":1:") && err.contains("3 values, expected 2"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

const SST_LINE: &str = "(3 (2 (2 The) (2 film)) (4 (3 (2 is) (4 great)) (2 .)))";

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_text_never_panics(text in "[()0-9a-z \\x{a0}é]{0,60}") {
        let mut vocab = Vocab::new(false);
        match sst::parse_line(&text, "fuzz.txt", 3, &mut vocab, true) {
            Ok(ex) => prop_assert_eq!(ex.words.len(), ex.graph.len()),
            Err(e) => prop_assert!(e.to_string().starts_with("fuzz.txt:3: "), "{}", e),
        }
    }

    #[test]
    fn mutated_trees_never_panic(pos in 0usize..SST_LINE.len(), op in 0u8..4, ch in "[()a-z0-9 ]") {
        let mut text: Vec<char> = SST_LINE.chars().collect();
        let c = ch.chars().next().unwrap();
        let pos = pos.min(text.len() - 1);
        match op {
            0 => { text.remove(pos); }
            1 => text.insert(pos, c),
            2 => text[pos] = c,
            _ => text.truncate(pos),
        }
        let text: String = text.into_iter().collect();
        match PtbTree::parse(&text, "fuzz.txt", 9) {
            Ok(t) => prop_assert_eq!(t.graph.roots(), vec![t.root()]),
            Err(e) => prop_assert!(e.to_string().starts_with("fuzz.txt:9: column "), "{}", e),
        }
    }
}

/// The SICK splits of Tai et al. (2015): every pair read, each sentence a dependency tree over
/// its tokens rooted at its head, scores from 1 to 5; the first training pair as its files say.
#[test]
fn sick_reads_dependency_tree_pairs() {
    use arbor::data::{data_dir, sick};
    let s = sick::read_splits(&data_dir().join("sick"), false).expect("SICK data (ARBOR_DATA)");
    assert_eq!((s.train.len(), s.dev.len(), s.test.len()), (4500, 500, 4927));
    let mut widest = 0;
    for p in s.train.iter().chain(&s.dev).chain(&s.test) {
        for t in [&p.a, &p.b] {
            assert_eq!(t.graph.len(), t.words.len());
            assert_eq!(t.graph.roots(), [t.root]);
            t.graph.check_rooted(t.root).expect("every token hangs from the root");
            widest = widest.max((0..t.graph.len()).map(|v| t.graph.children(v).len()).max().unwrap_or(0));
        }
        assert!((1.0..=5.0).contains(&p.score), "{}", p.score);
    }
    assert!(widest >= 4, "dependency trees are n-ary (widest {widest})");
    // "A group of kids is playing in a yard and an old man is standing in the background",
    // heads "2 6 2 3 6 0 6 9 7 9 13 13 9 15 6 15 18 16", score 4.5.
    let first = &s.train[0];
    let words: Vec<&str> = first.a.words.iter().map(|&w| s.vocab.words()[w as usize].as_str()).collect();
    assert_eq!(words.join(" "), "A group of kids is playing in a yard and an old man is standing in the background");
    assert_eq!(first.a.root, 5);
    assert_eq!(first.a.graph.children(5), [1, 4, 6, 14]);
    assert_eq!(first.a.graph.children(8), [7, 9, 12]);
    // Relations "det nsubj prep pobj aux root prep det pobj cc det amod conj aux xcomp prep det
    // pobj" label each edge by its dependent's relation.
    let labels: Vec<&str> = (0..4).map(|k| sick::RELATIONS[first.a.graph.edge_label(5, k) as usize]).collect();
    assert_eq!(labels, ["nsubj", "aux", "prep", "xcomp"]);
    assert_eq!(sick::RELATIONS[first.a.graph.edge_label(8, 2) as usize], "conj");
    assert_eq!(sick::relation("no-such-relation"), sick::relation("dep"));
    assert_eq!(first.score, 4.5);
    assert_eq!(sick::target_distribution(4.5), [0.0, 0.0, 0.0, 0.5, 0.5]);
    assert_eq!(sick::target_distribution(1.0), [1.0, 0.0, 0.0, 0.0, 0.0]);
    let p = sick::target_distribution(3.2);
    let expected: f32 = p.iter().enumerate().map(|(k, q)| (k + 1) as f32 * q).sum();
    assert!((expected - 3.2).abs() < 1e-6 && (p.iter().sum::<f32>() - 1.0).abs() < 1e-6, "{p:?}");
}

/// A small SICK split: two pairs.
const SICK_FILES: [(&str, &str); 5] = [
    ("a.toks", "a b c\nd e\n"),
    ("a.parents", "2 0 2\n0 1\n"),
    ("b.toks", "f g\nh\n"),
    ("b.parents", "0 1\n0\n"),
    ("sim.txt", "4.5\n1\n"),
];

/// Reads the split of [`SICK_FILES`] written to `dir` with `file` holding `text` instead; the
/// number of pairs read.
fn read_sick_with(dir: &std::path::Path, file: &str, text: &str) -> arbor::Result<usize> {
    std::fs::create_dir_all(dir).unwrap();
    for (name, body) in SICK_FILES {
        std::fs::write(dir.join(name), if name == file { text } else { body }).unwrap();
    }
    arbor::data::sick::read(dir, &mut Vocab::new(false), true).map(|pairs| pairs.len())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A SICK file with one character removed, added or replaced is read or refused with an
    /// error naming that file and a line, never a panic.
    #[test]
    fn mutated_sick_files_never_panic(file in 0usize..5, pos in 0usize..12, op in 0u8..3, ch in "[0-9a-z \\n.-]") {
        let dir = std::env::temp_dir().join(format!("arbor-sick-fuzz-{}", std::process::id()));
        let (name, text) = SICK_FILES[file];
        let mut t: Vec<char> = text.chars().collect();
        let (pos, c) = (pos.min(t.len() - 1), ch.chars().next().unwrap());
        match op {
            0 => { t.remove(pos); }
            1 => t.insert(pos, c),
            _ => t[pos] = c,
        }
        let read = read_sick_with(&dir, name, &t.into_iter().collect::<String>());
        std::fs::remove_dir_all(&dir).unwrap();
        if let Err(e) = read {
            let msg = e.to_string();
            prop_assert!(SICK_FILES.iter().any(|(n, _)| msg.contains(&format!("{n}:"))), "{}", msg);
        }
    }
}

/// Malformed SICK files give an error naming the file and line, never a panic.
#[test]
fn malformed_sick_files_name_file_and_line() {
    let dir = std::env::temp_dir().join(format!("arbor-sick-{}", std::process::id()));
    let read_with = |file: &str, text: &str| read_sick_with(&dir, file, text);
    assert_eq!(read_with("", "").unwrap(), 2);
    for (file, text, wanted) in [
        ("sim.txt", "4.5\n", "sim.txt:2: 1 lines where a.toks has 2"),
        ("sim.txt", "4.5\n6\n", "sim.txt:2: score `6`"),
        ("sim.txt", "4.5\nx\n", "sim.txt:2: score `x`"),
        ("a.parents", "2 0 2\n0\n", "a.parents:2: 1 heads for 2 tokens"),
        ("a.parents", "2 0 2\n0 3\n", "a.parents:2: head `3` of token 2"),
        ("a.parents", "2 0 2\n1 0\n", "a.parents:2: head `1` of token 1"),
        ("a.parents", "0 0 2\n0 1\n", "a.parents:1: 2 roots (tokens [1, 2])"),
        ("a.parents", "2 3 2\n0 1\n", "a.parents:1: 0 roots"),
        ("b.parents", "0 1\n0 1\n", "b.parents:2: 2 heads for 1 tokens"),
        ("b.toks", "f g\n\n", "b.toks:2: an empty sentence"),
    ] {
        let err = read_with(file, text).expect_err(wanted).to_string();
        assert!(err.contains(wanted), "{file} {text:?}: {err}");
    }
    // A cycle with a root elsewhere: tokens 1 and 3 head each other.
    let err = read_with("a.parents", "3 0 1\n0 1\n").unwrap_err().to_string();
    assert!(err.contains("a.parents:1: token 1 lies on a cycle"), "{err}");
    // Relations, where both files exist: one per token.
    std::fs::write(dir.join("b.rels"), "root det\nroot\n").unwrap();
    std::fs::write(dir.join("a.rels"), "det root nsubj\nroot\n").unwrap();
    let err = read_with("", "").unwrap_err().to_string();
    assert!(err.contains("a.rels:2: 1 relations for 2 tokens"), "{err}");
    std::fs::write(dir.join("a.rels"), "det root nsubj\nroot amod\n").unwrap();
    assert_eq!(read_with("", "").unwrap(), 2);
    std::fs::remove_dir_all(&dir).ok();
}
