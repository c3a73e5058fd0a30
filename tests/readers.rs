//! Data readers: GloVe vectors, and fuzzing of the tree readers — random and mutated inputs never
//! panic and always give an error naming the line.

use arbor::core::ptb::PtbTree;
use arbor::data::{glove, sst, Vocab};
use proptest::prelude::*;

#[test]
fn glove_reads_vocabulary_rows_only() {
    let dir = std::env::temp_dir().join(format!("arbor-glove-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("vectors.txt");
    std::fs::write(&file, "good 0.5 -1\nunseen 9 9\nbad -0.25 2e-1\ngood 7 7\n").unwrap();
    let mut vocab = Vocab::new(false);
    let (good, bad) = (vocab.add("good"), vocab.add("bad"));
    vocab.add("rare");
    let mut table = vec![0.125f32; vocab.len() * 2];
    let found = glove::read_into(&file, &vocab, 2, &mut table).unwrap();
    assert_eq!(found, 2);
    assert_eq!(table[good as usize * 2..good as usize * 2 + 2], [0.5, -1.0]); // the first entry wins
    assert_eq!(table[bad as usize * 2..bad as usize * 2 + 2], [-0.25, 0.2]);
    assert_eq!(table[8..10], [0.125, 0.125]); // `rare` keeps its value
    std::fs::write(&file, "good 0.5 -1\nbad 1 x\n").unwrap();
    let err = glove::read_into(&file, &vocab, 2, &mut table).unwrap_err().to_string();
    assert!(err.contains("vectors.txt:2:") && err.contains("value 2 of `bad`"), "{err}");
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
