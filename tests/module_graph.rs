//! The facade's modules (`src/*`, the CLI and the testing kit aside) as a graph of which one
//! names which (`crate::NAME` outside `#[cfg(test)]` code): no module names one that names it
//! back, directly or through others (no import cycle); the engine is a crate of its own over
//! core and batching; files stay short and public types have one name each.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every module of `src/` and the modules it names.
fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut pending = vec![src.clone()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).expect("src/ is readable").flatten() {
            let path = entry.path();
            let rel = path.strip_prefix(&src).expect("under src/").to_string_lossy().into_owned();
            if rel.starts_with("bin") || rel.starts_with("testing") || rel == "lib.rs" {
                continue;
            }
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let module = rel.split(['/', '.']).next().expect("a module name").to_string();
            let text = std::fs::read_to_string(&path).expect("a source file is readable");
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            let named = graph.entry(module.clone()).or_default();
            for (at, _) in code.match_indices("crate::") {
                let name: String = code[at + 7..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
                if !name.is_empty() && name != module {
                    named.insert(name);
                }
            }
        }
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    graph.values_mut().for_each(|named| named.retain(|m| modules.contains(m)));
    graph
}

/// The modules that reach each other both ways, in groups of more than one (Tarjan's
/// algorithm, iteratively).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    let names: Vec<&String> = graph.keys().collect();
    let at = |m: &String| names.iter().position(|n| *n == m).expect("a module");
    let edges: Vec<Vec<usize>> = names.iter().map(|m| graph[*m].iter().map(at).collect()).collect();
    let n = names.len();
    let (mut index, mut low, mut on) = (vec![usize::MAX; n], vec![0; n], vec![false; n]);
    let (mut stack, mut groups, mut next) = (Vec::new(), Vec::new(), 0);
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        let mut work = vec![(root, 0)];
        while let Some(&mut (v, ref mut k)) = work.last_mut() {
            if *k == 0 {
                (index[v], low[v], on[v]) = (next, next, true);
                next += 1;
                stack.push(v);
            }
            if let Some(&w) = edges[v].get(*k) {
                *k += 1;
                if index[w] == usize::MAX {
                    work.push((w, 0));
                } else if on[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                let mut group = BTreeSet::new();
                while let Some(w) = stack.pop() {
                    on[w] = false;
                    group.insert(names[w].clone());
                    if w == v {
                        break;
                    }
                }
                if group.len() > 1 {
                    groups.push(group);
                }
            }
        }
    }
    groups
}

/// The engine is a crate of its own whose library depends on core and batching alone (the
/// facade only as a dev-dependency, for its docs' examples), and no import cycle comes into the
/// facade.
#[test]
fn the_engine_stands_alone_and_no_import_cycle_comes_in() {
    let graph = module_graph();
    assert!(graph.contains_key("trainer") && !graph.contains_key("engine"), "{graph:?}");
    let manifest = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("engine/Cargo.toml"))
        .expect("engine/Cargo.toml");
    let deps = manifest.split("[dependencies]").nth(1).and_then(|d| d.split("\n[").next()).unwrap_or_default();
    let named: Vec<&str> =
        deps.lines().filter_map(|l| l.split(['.', ' ', '=']).next()).filter(|n| !n.is_empty()).collect();
    assert_eq!(named, ["arbor-core", "arbor-batching"], "the engine's dependencies");
    assert_eq!(cycles(&graph), Vec::<BTreeSet<String>>::new(), "{graph:#?}");
}

#[test]
fn a_cycle_is_found_wherever_it_closes() {
    let graph: BTreeMap<String, BTreeSet<String>> = [("a", &["b"][..]), ("b", &["c"]), ("c", &["a", "d"]), ("d", &[])]
        .into_iter()
        .map(|(m, named)| (m.to_string(), named.iter().map(|s| s.to_string()).collect()))
        .collect();
    assert_eq!(cycles(&graph), vec![["a", "b", "c"].map(String::from).into()]);
}

/// Every Rust source file of the workspace (its crates, tests, examples and benches).
fn sources() -> Vec<std::path::PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pending: Vec<_> = ["src", "core", "ops", "batching", "cuda", "engine", "tests", "examples", "benches"]
        .iter()
        .map(|d| root.join(d))
        .filter(|d| d.is_dir())
        .collect();
    let mut out = Vec::new();
    while let Some(dir) = pending.pop() {
        for path in std::fs::read_dir(&dir).expect("a source folder is readable").flatten().map(|e| e.path()) {
            if path.is_dir() && path.file_name().is_some_and(|n| n != "target") {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out
}

/// Rooms that say what they hold: no source file over 800 lines, and no two public types of one
/// name in the library crates (a reader never wonders which `Model` or `Splits` is meant).
#[test]
fn files_stay_short_and_public_types_have_one_name_each() {
    let mut owners: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for path in sources() {
        let text = std::fs::read_to_string(&path).expect("a source file is readable");
        let lines = text.lines().count();
        assert!(lines <= 800, "{} has {lines} lines (at most 800)", path.display());
        let rel = path.to_string_lossy().into_owned();
        if ["/tests/", "/examples/", "/benches/", "/bin/"].iter().any(|d| rel.contains(d)) {
            continue;
        }
        for line in text.split("#[cfg(test)]").next().unwrap_or_default().lines() {
            for kind in ["pub struct ", "pub enum ", "pub trait ", "pub type "] {
                if let Some(rest) = line.trim_start().strip_prefix(kind) {
                    let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                    owners.entry(name).or_default().push(rel.clone());
                }
            }
        }
    }
    let shared: Vec<_> = owners.iter().filter(|(_, files)| files.len() > 1).collect();
    assert!(shared.is_empty(), "public types of one name: {shared:?}");
    assert!(owners.contains_key("Model") && owners.contains_key("Splits"), "the scan found the library's types");
}
