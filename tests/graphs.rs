//! Graph classification: the TU reader on MUTAG and on malformed files, and a short
//! cross-validated GGNN run (data through ARBOR_DATA, default ../shared/data).

use arbor::data::tu;
use arbor::optim::{Config, Rule};
use arbor::zoo::{cross_validate_graphs, GraphCell, GraphTraining};
use arbor::CpuBackend;
use std::path::PathBuf;

fn mutag() -> PathBuf {
    arbor::data::data_dir().join("mutag")
}

#[test]
fn mutag_reads_as_documented() {
    let d = tu::read(&mutag(), "MUTAG").expect("MUTAG in ARBOR_DATA/mutag");
    assert_eq!(d.graphs.len(), 188);
    assert_eq!(d.graphs.iter().map(|g| g.node_labels.len()).sum::<usize>(), 3371);
    // 7442 directed lines = 3721 undirected edges, each stored at both ends.
    assert_eq!(d.graphs.iter().flat_map(|g| &g.neighbours).map(Vec::len).sum::<usize>(), 7442);
    assert_eq!((d.node_label_count, d.classes), (7, 2));
    assert_eq!(d.graphs.iter().filter(|g| g.label == 1).count(), 125); // label 1 → class 1, −1 → 0
    let g = &d.graphs[0];
    let unrolled = g.unroll(3);
    assert_eq!(unrolled.len(), 4 * g.node_labels.len());
    let v = g.node_labels.len() + 2; // node 2 at step 1
    assert_eq!(unrolled.children(v)[0] as usize, 2);
    assert_eq!(unrolled.children(v).len(), 1 + g.neighbours[2].len());
}

#[test]
fn malformed_tu_files_name_file_and_line() {
    let dir = std::env::temp_dir().join(format!("arbor-tu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str| std::fs::write(dir.join(format!("T_{name}.txt")), text).unwrap();
    write("graph_indicator", "1\n1\n2\n");
    write("graph_labels", "1\n-1\n");
    write("node_labels", "0\n1\n2\n");
    write("A", "1, 2\n2, 1\n");
    let d = tu::read(&dir, "T").unwrap();
    assert_eq!(d.graphs[0].neighbours, vec![vec![1], vec![0]]);
    assert_eq!((d.graphs[0].label, d.graphs[1].label), (1, 0));
    write("A", "1, 2\n2, 3\n");
    let err = tu::read(&dir, "T").unwrap_err().to_string();
    assert!(err.contains("T_A.txt:2:") && err.contains("joins graphs 1 and 2"), "{err}");
    write("A", "1 2\n");
    assert!(tu::read(&dir, "T").unwrap_err().to_string().contains("T_A.txt:1:"));
    write("A", "-9223372036854775808, 2\n");
    assert!(tu::read(&dir, "T").unwrap_err().to_string().contains("outside"));
    write("A", "1, 2\n");
    write("graph_indicator", "1\n-9223372036854775808\n2\n");
    assert!(tu::read(&dir, "T").unwrap_err().to_string().contains("T_graph_indicator.txt:2:"));
    write("graph_indicator", "1\nx\n2\n");
    let err = tu::read(&dir, "T").unwrap_err().to_string();
    assert!(err.contains("T_graph_indicator.txt:2:") && err.contains("`x`"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn ggnn_learns_mutag() {
    let d = tu::read(&mutag(), "MUTAG").unwrap();
    let cfg = GraphTraining {
        cell: GraphCell::Ggnn,
        steps: 3,
        features: 8,
        hidden: 16,
        epochs: 40,
        batch: 25,
        folds: 3,
        seed: 1,
        optimizer: Config::new(Rule::Adam, 0.01),
        clip: Some(5.0),
        checkpoint: None,
        meta: serde_json::Value::Null,
    };
    let r = cross_validate_graphs(&CpuBackend::new(), &d, &cfg, &mut |_, _| {}).unwrap();
    assert_eq!(r.fold_scores.len(), 3);
    // Stated bar for this short 3-fold run; always answering the majority class gives 0.665.
    assert!(r.mean >= 0.75, "cross-validated accuracy {} ({:?})", r.mean, r.fold_scores);
}

mod fuzz {
    use super::tu;
    use proptest::prelude::*;

    const FILES: [(&str, &str); 4] = [
        ("graph_indicator", "1\n1\n1\n2\n2\n"),
        ("graph_labels", "1\n-1\n"),
        ("node_labels", "0\n1\n0\n2\n2\n"),
        ("A", "1, 2\n2, 1\n2, 3\n3, 2\n4, 5\n5, 4\n"),
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn mutated_tu_files_never_panic(file in 0usize..4, pos in 0usize..40, op in 0u8..3, ch in "[0-9,\\- x\\n]") {
            let dir = std::env::temp_dir().join(format!("arbor-tu-fuzz-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            for (k, (name, text)) in FILES.iter().enumerate() {
                let mut t: Vec<char> = text.chars().collect();
                if k == file {
                    let pos = pos.min(t.len() - 1);
                    let c = ch.chars().next().unwrap();
                    match op {
                        0 => { t.remove(pos); }
                        1 => t.insert(pos, c),
                        _ => t[pos] = c,
                    }
                }
                std::fs::write(dir.join(format!("F_{name}.txt")), t.into_iter().collect::<String>()).unwrap();
            }
            let read = tu::read(&dir, "F");
            std::fs::remove_dir_all(&dir).unwrap();
            match read {
                Ok(d) => {
                    for g in &d.graphs {
                        prop_assert_eq!(g.neighbours.len(), g.node_labels.len());
                        let unrolled = g.unroll(2);
                        prop_assert_eq!(unrolled.len(), 3 * g.node_labels.len());
                    }
                }
                Err(e) => {
                    let msg = e.to_string();
                    prop_assert!(msg.contains("F_") && msg.contains(".txt"), "{}", msg);
                }
            }
        }
    }
}
