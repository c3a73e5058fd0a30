#!/usr/bin/env bash
# The current comparison of BENCHMARKS.md's first table: arbor against the lean DyNet and the
# level-batched PyTorch peers, alternating, on SST (h150 e300, root loss, Adagrad), then the GEMM
# peak of the same machine. Needs `cargo build --release` and `benches/peers/setup.sh` first.
# `benches/peers/table.sh [PAIRS]` appends one JSON summary per row to target/bench/peers.jsonl
# and prints it.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
pairs=${1:-3}
out="$root/target/bench/peers.jsonl"
mkdir -p "$(dirname "$out")"
row() { python3 "$root/benches/peers/compare.py" --pairs "$pairs" "$@" 2>/dev/null | tee -a "$out"; }
row --model tree-lstm --mode train --batch 64 --sentences 2048
row --model tree-lstm --mode train --batch 64 --sentences 2048 --workers 2
row --model tree-lstm --mode train --batch 256 --sentences 4096
row --model tree-lstm --mode train --batch 1 --sentences 500
row --model tree-lstm --mode infer --batch 64 --sentences 4096
row --model tree-lstm --mode infer --batch 1 --sentences 1000
row --model var-lstm --mode train --batch 64 --sentences 2048
(cd "$root" && cargo bench --bench kernels -- gemm_peak 2>/dev/null | grep -E "gemm_peak|512|1024" | tee -a "$out.peak")
