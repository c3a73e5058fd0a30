#!/usr/bin/env bash
# On a device machine: the GPU tests, the README's job on the GPU, then every arbor build in
# .gpu/bin (arbor, and any arbor-* beside it: older builds to compare) on the same SST rows with
# `--profile` (the host's time per step by activity), taking turns, then the level-batched
# PyTorch peer on the same GPU. With GRAPHS=1, `arbor@graphs` joins the builds: `arbor` with
# each launch list issued as a CUDA graph (ARBOR_CUDA_GRAPHS=1), against `arbor` without.
# Build and pack here first (`../shared/tools/gpu-pack`, or copy the stripped binaries and test
# binaries into .gpu/bin and .gpu/tests), then on the device (carry .gpu):
# [GRAPHS=1] benches/peers/gpu_profile.sh [ROUNDS_AT_BATCH_1]
# Writes one JSON line per run to $OUT/gpu.jsonl (or target/bench/gpu.jsonl).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
gpu="$root/.gpu"
rounds=${1:-2}
out="${OUT:-$root/target/bench}/gpu.jsonl"
mkdir -p "$(dirname "$out")"
export ARBOR_DATA="$gpu/data" PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/nvidia/lib64:/usr/local/cuda/lib64"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "host: $(nproc) cores, $(grep -m1 -o avx512f /proc/cpuinfo || echo 'no avx512f')"
for t in "$gpu"/tests/*; do
  echo "=== $(basename "$t")"
  timeout 150 "$t" --include-ignored --test-threads=1 2>&1 | grep -E "test result|FAILED|panicked"
done
ck=$(mktemp -d)/run
timeout 120 "$gpu/bin/arbor" train --device cuda --epochs 2 --checkpoint "$ck" 2>&1 | tail -1
timeout 60 "$gpu/bin/arbor" eval --device cuda --checkpoint "$ck" 2>&1 | tail -1
builds=$(cd "$gpu/bin" && ls arbor arbor-* 2>/dev/null)
[ "${GRAPHS:-0}" = 1 ] && builds=$(printf '%s\narbor@graphs' "$builds")
# One run of build $1 with the remaining bench arguments, its JSON line kept and summarized.
run() {
  local bin=$1 graphs=0; shift
  [ "${bin%@graphs}" != "$bin" ] && graphs=1
  ARBOR_CUDA_GRAPHS=$graphs timeout 120 "$gpu/bin/${bin%@graphs}" bench --data "$ARBOR_DATA/sst" --device cuda --profile "$@" 2>/dev/null | tail -1 \
    | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); d["bin"]=sys.argv[1]; print(json.dumps(d))' "$bin" \
    | tee -a "$out" | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["bin"], d["mode"], d["batch"],
        d["sent_per_s"], d["launches_per_step"], d.get("device_launches_per_step"), d.get("device_submissions_per_step"),
        d["profile_ms_per_step"])'
}
# Every build on one row, `$1` rounds, the order reversed every other round.
row() {
  local n=$1; shift
  for r in $(seq "$n"); do
    order=$builds
    [ $((r % 2)) = 0 ] && order=$(echo "$builds" | tac)
    for bin in $order; do run "$bin" "$@"; done
  done
}
row "$rounds" --batch 1 --sentences 600 --mode train
row 1 --batch 64 --sentences 4096 --mode train
row 1 --batch 256 --sentences 8192 --mode train
row "$rounds" --batch 1 --sentences 1000 --mode infer
row 1 --batch 64 --sentences 8192 --mode infer
row 1 --batch 256 --sentences 16384 --mode infer
peer() {
  timeout 120 python3 "$root/benches/peers/torch_tree_lstm.py" --device cuda --hidden 150 --embed 300 \
    --data "$ARBOR_DATA/sst" "$@" 2>/dev/null | tail -1 | tee -a "$out"
}
peer --batch 1 --sentences 300 --mode train
peer --batch 64 --sentences 4096 --mode train
peer --batch 256 --sentences 8192 --mode train
peer --batch 1 --sentences 1000 --mode infer
