"""Runs `arbor bench`, the lean DyNet script and (for the Tree-LSTM) the level-batched PyTorch
script in turn (arbor, DyNet, PyTorch, arbor, …) on the same settings and prints the median
throughput ratios against each. Needs `cargo build --release` and `benches/peers/setup.sh` first.
The peers get the same cores: DyNet's build is single-threaded, PyTorch runs on `--peer-threads`
(default: every core, as arbor).
With `--before BINARY` (an older arbor build) every round runs both arbor builds (taking turns at
going first), then DyNet, and the summary adds the before/DyNet and arbor/before ratios: a change
measured against the peer and against itself in one run.

usage: compare.py --model tree-lstm|var-lstm --batch B --hidden H --embed E --sentences N
                  --mode train|infer [--loss root|all] [--pairs 3] [--data DIR] [--arbor BINARY]
                  [--before BINARY] [--peers dynet,pytorch] [--peer-threads T] [--device cpu|cuda]
With `--device cuda` both arbor and PyTorch run on the GPU (DyNet's wheel is CPU-only); the peers'
Python is `$PEER_PYTHON`, else `target/peers-venv`, else this interpreter.
Prints one JSON line per pair (to stderr) and a final JSON summary (stdout).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ap = argparse.ArgumentParser()
ap.add_argument("--model", default="tree-lstm")
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--hidden", type=int, default=150)
ap.add_argument("--embed", type=int, default=300)
ap.add_argument("--sentences", type=int, default=1000)
ap.add_argument("--mode", default="train")
ap.add_argument("--loss", default="root")
ap.add_argument("--pairs", type=int, default=3)
ap.add_argument("--threads", type=int, default=0, help="arbor threads (0: all cores)")
ap.add_argument("--workers", type=int, default=1, help="arbor workers, each on its share of the cores")
ap.add_argument("--arbor", default=os.path.join(root, "target", "release", "arbor"), help="the arbor binary")
ap.add_argument("--before", help="an older arbor binary, run in every round too")
ap.add_argument("--peers", default="dynet,pytorch", help="the peers to run, of dynet and pytorch")
ap.add_argument("--peer-threads", type=int, default=0, help="PyTorch's threads (0: every core)")
ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
ap.add_argument("--data", default=os.environ.get("ARBOR_DATA", os.path.join(root, "..", "shared", "data")) + "/sst")
a = ap.parse_args()

common = ["--model", a.model, "--batch", str(a.batch), "--hidden", str(a.hidden), "--embed", str(a.embed),
          "--sentences", str(a.sentences), "--mode", a.mode, "--loss", a.loss, "--data", a.data]
flags = []
if a.threads:
    flags += ["--threads", str(a.threads)]
if a.workers > 1:
    flags += ["--workers", str(a.workers)]
if a.device == "cuda":
    flags += ["--device", "cuda"]
arbor_cmd = [a.arbor, "bench"] + common + flags
before_cmd = a.before and [a.before, "bench"] + common + flags
venv = os.path.join(root, "target", "peers-venv", "bin", "python")
python = os.environ.get("PEER_PYTHON") or (venv if os.path.exists(venv) else sys.executable)
torch_flags = ["--device", "cuda"] if a.device == "cuda" else ["--device", "cpu", "--threads", str(a.peer_threads or os.cpu_count())]
peers = {
    "dynet": [python, os.path.join(root, "benches", "peers", "dynet_models.py")] + common,
    "pytorch": [python, os.path.join(root, "benches", "peers", "torch_tree_lstm.py")] + torch_flags + common,
}
chosen = [p for p in a.peers.split(",") if p and not (p == "pytorch" and a.model != "tree-lstm")]


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


arbor, before = [], []
peer_rates = {p: [] for p in chosen}
for i in range(a.pairs):
    line = {"pair": i + 1}
    # The two arbor builds take turns at going first, so neither always follows DyNet.
    if before_cmd and i % 2 == 0:
        before.append(run(before_cmd)["sent_per_s"])
    x = run(arbor_cmd)
    if before_cmd and i % 2 == 1:
        before.append(run(before_cmd)["sent_per_s"])
    if before_cmd:
        line["before"] = before[-1]
    arbor.append(x["sent_per_s"])
    line["arbor"] = x["sent_per_s"]
    line["arbor_gflops"], line["arbor_launches_per_step"] = x.get("gflops"), x.get("launches_per_step")
    for p in chosen:
        peer_rates[p].append(run(peers[p])["sent_per_s"])
        line[p] = peer_rates[p][-1]
    print(json.dumps(line), file=sys.stderr)


def median_ratio(xs, ys):
    return round(statistics.median([x / y for x, y in zip(xs, ys)]), 3)


summary = {
    "device": a.device, "model": a.model, "mode": a.mode, "workers": a.workers, "batch": a.batch, "hidden": a.hidden, "embed": a.embed, "loss": a.loss,
    "sentences": a.sentences, "pairs": a.pairs, "arbor_sent_per_s": statistics.median(arbor),
    "arbor_launches_per_step": x.get("launches_per_step"),
}
for p, rates in peer_rates.items():
    summary[f"{p}_sent_per_s"] = statistics.median(rates)
    summary[f"arbor_vs_{p}"] = median_ratio(arbor, rates)
if before:
    summary.update({"before_sent_per_s": statistics.median(before), "after_vs_before": median_ratio(arbor, before)})
    if "dynet" in peer_rates:
        summary["before_vs_dynet"] = median_ratio(before, peer_rates["dynet"])
print(json.dumps(summary))
