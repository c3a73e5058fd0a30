"""A level-batched binary Tree-LSTM in PyTorch, the peer of `arbor bench` on the CPU and on a GPU:
the same cell (Tai et al. 2015, a forget gate per child), SST data, sizes, root loss and Adagrad
(lr 0.05). Each minibatch runs the leaves at once — one product over their word vectors for
their three gates (input, output, update: a leaf has no children to forget) — then one batched
step per tree level (all vertices whose children are done): one product over `[h_left; h_right]`
for the five gates, the states written in place, as DGL and TreeLSTM reference code do.

usage: torch_tree_lstm.py --data DIR --batch B --hidden H --embed E --sentences N
                          [--mode train|infer] [--device cuda|cpu] [--threads T]
Prints one JSON line like `arbor bench`.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sst import leaves, parse  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--data", required=True)
ap.add_argument("--batch", type=int, default=256)
ap.add_argument("--hidden", type=int, default=150)
ap.add_argument("--embed", type=int, default=300)
ap.add_argument("--sentences", type=int, default=8192)
ap.add_argument("--mode", default="train", choices=["train", "infer"])
ap.add_argument("--device", default="cuda")
ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: every core)")
ap.add_argument("--model", default="tree-lstm", choices=["tree-lstm"])
ap.add_argument("--loss", default="root", choices=["root"])
args = ap.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)
dev = torch.device(args.device)
torch.manual_seed(1)

with open(f"{args.data}/train.txt", encoding="utf-8") as f:
    trees = [parse(line) for line in f if line.strip()]
vocab = {"<pad>": 0, "<unk>": 1}
for t in trees:
    for w in leaves(t, []):
        vocab.setdefault(w, len(vocab))


def flatten(tree):
    """Vertices in post-order: (word id, left, right, height), children as vertex numbers."""
    out, stack = [], [(tree, False)]
    ids = {}
    while stack:
        node, seen = stack.pop()
        label, body = node
        if isinstance(body, str):
            ids[id(node)] = len(out)
            out.append((vocab.get(body, 1), -1, -1, 0))
        elif seen:
            kids = [ids[id(k)] for k in body][:2] + [-1, -1]
            height = 1 + max(out[k][3] for k in kids if k >= 0)
            ids[id(node)] = len(out)
            out.append((0, kids[0], kids[1], height))
        else:
            stack.append((node, True))
            stack.extend((k, False) for k in reversed(body))
    return out, tree[0]


def minibatch(batch):
    """Index tensors of a minibatch: words, per-level vertices and children, roots, labels."""
    words, left, right, height, roots, labels = [], [], [], [], [], []
    for t in batch:
        verts, label = flatten(t)
        base = len(words)
        for w, l, r, h in verts:
            words.append(w)
            left.append(base + l if l >= 0 else -1)
            right.append(base + r if r >= 0 else -1)
            height.append(h)
        roots.append(len(words) - 1)
        labels.append(label)
    n = len(words)
    zero = n  # the row of zeros a missing child reads
    levels = []
    for h in range(max(height) + 1):
        idx = [v for v in range(n) if height[v] == h]
        levels.append(tuple(torch.tensor(x, device=dev) for x in (
            idx, [left[v] if left[v] >= 0 else zero for v in idx], [right[v] if right[v] >= 0 else zero for v in idx])))
    return (torch.tensor(words, device=dev), levels, torch.tensor(roots, device=dev),
            torch.tensor(labels, device=dev), n)


H, E = args.hidden, args.embed
# Sparse gradients: the optimizer touches only the rows a minibatch looked up, as DyNet and arbor do.
emb = torch.nn.Embedding(len(vocab), E, padding_idx=0, sparse=True).to(dev)
W_leaf = torch.nn.Linear(E, 3 * H).to(dev)  # a leaf's i, o, u
U = torch.nn.Linear(2 * H, 5 * H).to(dev)  # an internal node's i, f_left, f_right, o, u
out = torch.nn.Linear(H, 5).to(dev)
params = [*emb.parameters(), *W_leaf.parameters(), *U.parameters(), *out.parameters()]
opt = torch.optim.Adagrad(params, lr=0.05)


def forward(words, levels, roots, n):
    h = torch.zeros(n + 1, H, device=dev)
    c = torch.zeros(n + 1, H, device=dev)
    leaves_idx = levels[0][0]
    i, o, u = W_leaf(emb(words[leaves_idx])).chunk(3, dim=1)
    cl = torch.sigmoid(i) * torch.tanh(u)
    c = c.index_copy(0, leaves_idx, cl)
    h = h.index_copy(0, leaves_idx, torch.sigmoid(o) * torch.tanh(cl))
    for idx, l, r in levels[1:]:
        i, f0, f1, o, u = U(torch.cat([h[l], h[r]], dim=1)).chunk(5, dim=1)
        cn = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(f0) * c[l] + torch.sigmoid(f1) * c[r]
        c = c.index_copy(0, idx, cn)
        h = h.index_copy(0, idx, torch.sigmoid(o) * torch.tanh(cn))
    return out(h[roots])


pool = trees[: args.sentences]
examples = [pool[i % len(pool)] for i in range(args.sentences)]
batches = [minibatch(examples[i:i + args.batch]) for i in range(0, len(examples), args.batch)]


def run(b):
    words, levels, roots, labels, n = b
    if args.mode == "train":
        loss = torch.nn.functional.cross_entropy(forward(words, levels, roots, n), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    else:
        with torch.no_grad():
            forward(words, levels, roots, n).argmax(1)


for b in batches[:3]:
    run(b)
if dev.type == "cuda":
    torch.cuda.synchronize()
start = time.perf_counter()
for b in batches:
    run(b)
if dev.type == "cuda":
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
vertices = sum(b[4] for b in batches)
print(json.dumps({
    "system": "pytorch", "model": "tree-lstm", "peer": "pytorch-level-batched", "threads": torch.get_num_threads(), "mode": args.mode, "device": args.device,
    "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None,
    "batch": args.batch, "hidden": H, "embed": E, "sentences": args.sentences,
    "seconds": round(seconds, 4), "sent_per_s": round(args.sentences / seconds),
    "vertices_per_s": round(vertices / seconds),
}))
