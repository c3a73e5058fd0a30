"""Scale-out on this machine: 2 data-parallel workers (threads, MPI ranks) and 2 pipeline stages
(1F1B, 2BW) against 1, each run alternately with its baseline (A B A B …); prints the median of
the per-pair ratios of training throughput (`sent_per_s` of `arbor train`, time in training steps).

Needs `cargo build --release --features mpi` (for the MPI rows) first.

usage: scale_out.py [--workload synthetic|sst] [--pairs 3]
Prints one JSON line per pair (to stderr) and a final JSON list of rows (stdout).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
arbor = os.path.join(root, "target", "release", "arbor")
data = os.environ.get("ARBOR_DATA", os.path.join(root, "..", "shared", "data"))
ap = argparse.ArgumentParser()
ap.add_argument("--workload", default="synthetic", choices=["synthetic", "sst"])
ap.add_argument("--pairs", type=int, default=3)
a = ap.parse_args()

workloads = {
    # The default `arbor train` model, two epochs of the synthetic treebank.
    "synthetic": ["--epochs", "2"],
    # The benchmark sizes of BENCHMARKS.md on SST: 40 minibatches of 64 sentences.
    "sst": ["--data", os.path.join(data, "sst"), "--hidden", "150", "--embed", "300", "--batch", "64",
            "--loss", "root", "--optimizer", "adagrad", "--lr", "0.05", "--epochs", "1", "--max-steps", "40"],
}
common = ["train"] + workloads[a.workload]
mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
stacked = ["--layers", "2"]
comparisons = [
    ("data parallel, 2 threads", [arbor] + common, [arbor] + common + ["--workers", "2"]),
    ("data parallel, 2 MPI ranks", [arbor] + common, mpirun + [arbor] + common + ["--distributed", "mpi"]),
    ("pipeline, 2 stages, 1F1B, 4 micro-batches", [arbor] + common + stacked,
     [arbor] + common + stacked + ["--stages", "2", "--schedule", "1f1b", "--micro-batches", "4"]),
    ("pipeline, 2 stages, 2BW, 2 micro-batches", [arbor] + common + stacked,
     [arbor] + common + stacked + ["--stages", "2", "--schedule", "2bw", "--micro-batches", "2"]),
]


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["sent_per_s"]


rows = []
for name, base, cand in comparisons:
    ratios, bases, cands = [], [], []
    for _ in range(a.pairs):
        b, c = run(base), run(cand)
        bases.append(b)
        cands.append(c)
        ratios.append(c / b)
        print(json.dumps({"comparison": name, "one": b, "two": c, "ratio": round(c / b, 3)}), file=sys.stderr)
    rows.append({"workload": a.workload, "comparison": name, "one_sent_per_s": statistics.median(bases),
                 "two_sent_per_s": statistics.median(cands), "median_ratio": round(statistics.median(ratios), 2),
                 "baseline": " ".join(base[base.index(arbor) + 1:]),
                 "command": " ".join(cand).replace(arbor, "arbor")})
print(json.dumps(rows, indent=1))
