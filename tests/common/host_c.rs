//! C programs compiled and run on the host: how the tests run the CUDA backend's kernels
//! (whose bodies are also C) without a GPU.

use std::process::Command;

/// Compiles the C program `source` for the host as `dir/name`, which it returns.
pub fn compile_on_host(dir: &std::path::Path, name: &str, source: &str) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let (c, exe) = (dir.join(format!("{name}.c")), dir.join(name));
    std::fs::write(&c, source).unwrap();
    let cc = Command::new("cc").args(["-std=c99", "-O1", "-o"]).arg(&exe).arg(&c).arg("-lm").output().expect("cc runs");
    assert!(cc.status.success(), "{}:\n{}", c.display(), String::from_utf8_lossy(&cc.stderr));
    exe
}

/// A C array definition `ty name[] = {v…};` (one zero when `v` is empty).
pub fn c_array(ty: &str, name: &str, v: &[impl std::fmt::Display]) -> String {
    let items: Vec<String> = v.iter().map(|x| format!("{x}")).collect();
    format!("{ty} {name}[] = {{{}}};\n", if items.is_empty() { "0".into() } else { items.join(", ") })
}

/// Compiles the C program `source` for the host (in a fresh folder named for `name` and this
/// process, removed after), runs it and returns the numbers it printed, one a line.
pub fn run_on_host(name: &str, source: &str) -> Vec<f32> {
    let dir = std::env::temp_dir().join(format!("arbor-{name}-{}", std::process::id()));
    let exe = compile_on_host(&dir, name, source);
    let out = Command::new(&exe).output().expect("the host program runs");
    std::fs::remove_dir_all(&dir).ok();
    String::from_utf8_lossy(&out.stdout).lines().map(|l| l.parse().expect("a number a line")).collect()
}
