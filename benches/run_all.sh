#!/usr/bin/env bash
# Runs every benchmark of BENCHMARKS.md and appends JSON lines to target/bench/results.jsonl:
# arbor vs DyNet (3 alternating pairs per setting) over batch × hidden × mode, Var-LSTM, and the
# per-vertex scaling run on Tree-FC. Then `python3 benches/report.py` writes the tables and plot.
#   benches/peers/setup.sh && cargo build --release && benches/run_all.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/target/bench"
mkdir -p "$out"
results="$out/results.jsonl"
: > "$results"
cmp() { python3 "$root/benches/peers/compare.py" "$@" 2>>"$out/pairs.log" | tee -a "$results"; }
for hidden in 150 512; do
  for batch in 1 16 64 256; do
    for mode in train infer; do
      n=$(( batch == 1 ? 100 : (batch == 16 ? 400 : 1024) ))
      [ "$hidden" = 512 ] && n=$(( n / 2 ))
      cmp --model tree-lstm --batch "$batch" --hidden "$hidden" --embed 300 --mode "$mode" --sentences "$n" --pairs 3
    done
  done
done
for mode in train infer; do
  cmp --model var-lstm --batch 64 --hidden 150 --embed 300 --mode "$mode" --sentences 1024 --pairs 3
done
# Scaling: the same number of vertices (about 65,000) in trees of 31 to 16,383 vertices.
for leaves in 16 64 256 1024 4096 8192; do
  trees=$(( 32768 / leaves ))
  "$root/target/release/arbor" bench --model tree-fc --leaves "$leaves" --sentences "$trees" --batch "$trees" \
    --hidden 256 --embed 256 --mode train 2>/dev/null | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); d["scaling"]=True; print(json.dumps(d))' | tee -a "$results"
done
