#!/usr/bin/env python3
"""`--batch auto` against `--batch 25` (issue 47): for each seed, `arbor train --data SST --epochs E
--seed S` with each batch setting (the order swapped every seed), the wall time from the process's
start at every epoch's end and its dev score; prints, per seed, when the fixed run reached its best
dev, when the auto run first reached that dev, and their ratio (the issue's bar: at most 0.75).

usage: benches/batch_auto.py ARBOR_BINARY [EPOCHS] (the data from $ARBOR_DATA, else ../shared/data)
"""
import json
import os
import re
import subprocess
import sys
import time

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
binary = sys.argv[1]
epochs = sys.argv[2] if len(sys.argv) > 2 else "8"
data = os.environ.get("ARBOR_DATA", os.path.join(root, "..", "shared", "data")) + "/sst"


def run(batch, seed):
    """Each epoch's (epoch, dev accuracy, seconds since start), and the summary line."""
    start = time.time()
    cmd = [binary, "train", "--data", data, "--epochs", epochs, "--seed", str(seed), "--batch", batch]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    curve, summary = [], {}
    for line in p.stdout:
        m = re.search(r"epoch (\d+):.*dev root accuracy ([0-9.]+)", line)
        if m:
            curve.append((int(m.group(1)), float(m.group(2)), time.time() - start))
        if line.startswith("{"):
            summary = json.loads(line)
    if p.wait() != 0 or not curve:
        sys.exit(f"{' '.join(cmd)} failed")
    return curve, summary


for seed in (1, 2, 3):
    order = ["25", "auto"] if seed % 2 else ["auto", "25"]
    runs = {b: run(b, seed) for b in order}
    (fixed, fs), (auto, auto_s) = runs["25"], runs["auto"]
    best = max(fixed, key=lambda e: e[1])
    reach = next((e for e in auto if e[1] >= best[1]), None)
    print(json.dumps({
        "seed": seed, "fixed_best_dev": best[1], "fixed_best_at_s": round(best[2], 2), "fixed_test": fs.get("test_acc"),
        "auto_reached_at_s": reach and round(reach[2], 2), "ratio": reach and round(reach[2] / best[2], 3),
        "auto_best_dev": max(e[1] for e in auto), "auto_test": auto_s.get("test_acc"),
        "sent_per_s_fixed": fs.get("sent_per_s"), "sent_per_s_auto": auto_s.get("sent_per_s"),
    }), flush=True)
