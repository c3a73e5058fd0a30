#!/usr/bin/env bash
# BENCHMARKS.md's GPU table, run on a device machine from binaries built elsewhere: the GPU tests,
# then arbor against the level-batched PyTorch peer, both on the GPU, alternating (compare.py
# --device cuda), then arbor on the host's CPU for reference. Build here first:
#   ../shared/tools/gpu-pack
# then on the device (carry .gpu):  benches/peers/gpu_table.sh [PAIRS]
# PyTorch is the device image's own (`python3`); DyNet's wheel is CPU-only and is not run.
# Writes the JSON summaries to $OUT/gpu.jsonl (or target/bench/gpu.jsonl).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
pairs=${1:-2}
out="${OUT:-$root/target/bench}/gpu.jsonl"
mkdir -p "$(dirname "$out")"
export ARBOR_DATA="$root/.gpu/data"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/nvidia/lib64:/usr/local/cuda/lib64"
export PEER_PYTHON=${PEER_PYTHON:-python3}
arbor="$root/.gpu/bin/arbor"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "host: $(nproc) cores, $(grep -m1 -o 'avx512f' /proc/cpuinfo || echo 'no avx512f')"
fails=0
for t in "$root"/.gpu/tests/gpu-* "$root"/.gpu/tests/nvrtc-* "$root"/.gpu/tests/cuda_codegen-* "$root"/.gpu/tests/arbor_cuda-*; do
  [ -x "$t" ] || continue
  echo "=== $(basename "$t")"
  "$t" --include-ignored --test-threads=1 2>&1 | grep -E "^test result|FAILED|panicked|failed" || true
  [ "${PIPESTATUS[0]}" = 0 ] || fails=$((fails + 1))
done
echo "test binaries failing: $fails"
# The README's main job on the GPU, and its checkpoint scored again.
ck=$(mktemp -d)/run
"$arbor" train --device cuda --epochs 2 --checkpoint "$ck" 2>&1 | tail -3 && "$arbor" eval --device cuda --checkpoint "$ck" || fails=$((fails + 1))
row() { python3 "$root/benches/peers/compare.py" --device cuda --peers pytorch --arbor "$arbor" \
  --data "$ARBOR_DATA/sst" --pairs "$pairs" "$@" 2>&1 | tee -a "$out"; }
row --mode train --batch 64 --sentences 4096
row --mode train --batch 256 --sentences 8192
row --mode train --batch 1 --sentences 300
row --mode infer --batch 64 --sentences 8192
row --mode infer --batch 256 --sentences 16384
row --mode infer --batch 1 --sentences 1000
for b in 64 256; do
  "$arbor" bench --data "$ARBOR_DATA/sst" --hidden 150 --embed 300 --mode train --batch $b --sentences 4096 | tee -a "$out"
done
exit $fails
