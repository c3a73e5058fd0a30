"""The binary Tree-LSTM and the Var-LSTM of arbor's benchmarks, written for DyNet with automatic
batching, on the same SST data, sizes, loss and optimizer (Adagrad) as `arbor bench`.

usage: dynet_models.py --model tree-lstm|var-lstm --data DIR --batch B --hidden H --embed E
                       --sentences N --mode train|infer [--loss root|all] [--threads T]
Prints one JSON line like `arbor bench`.
"""
import argparse
import json
import resource
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="tree-lstm", choices=["tree-lstm", "var-lstm"])
ap.add_argument("--data", required=True)
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--hidden", type=int, default=150)
ap.add_argument("--embed", type=int, default=300)
ap.add_argument("--sentences", type=int, default=2000)
ap.add_argument("--mode", default="train", choices=["train", "infer"])
ap.add_argument("--loss", default="root", choices=["root", "all"])
ap.add_argument("--threads", type=int, default=1)
args = ap.parse_args()

import dynet_config  # noqa: E402

# Autobatching cannot grow the memory pool, so it is sized for batch 256 at hidden 512.
dynet_config.set(autobatch=1, mem=6144, random_seed=1)
import dynet as dy  # noqa: E402
from sst import leaves, parse  # noqa: E402


with open(f"{args.data}/train.txt", encoding="utf-8") as f:
    trees = [parse(l) for l in f if l.strip()]
vocab = {"<pad>": 0, "<unk>": 1}
for t in trees:
    for w in leaves(t, []):
        vocab.setdefault(w, len(vocab))
pool = trees[: args.sentences]
examples = [pool[i % len(pool)] for i in range(args.sentences)]

H, E, C = args.hidden, args.embed, 5
pc = dy.ParameterCollection()
emb = pc.add_lookup_parameters((len(vocab), E))
if args.model == "tree-lstm":
    W = pc.add_parameters((5 * H, E))
    U0 = pc.add_parameters((5 * H, H))
    U1 = pc.add_parameters((5 * H, H))
    b = pc.add_parameters(5 * H)
else:
    W = pc.add_parameters((4 * H, E))
    U = pc.add_parameters((4 * H, H))
    b = pc.add_parameters(4 * H)
Wo = pc.add_parameters((C, H))
bo = pc.add_parameters(C)
trainer = dy.AdagradTrainer(pc, 0.05)


def tree_lstm(node, losses, vertices):
    """Returns (h, c) of `node`; appends vertex losses (loss 'all') and counts vertices."""
    label, body = node
    vertices[0] += 1
    if isinstance(body, str):
        g = W * dy.lookup(emb, vocab.get(body, 1)) + b
        i, o, u = dy.logistic(g[0:H]), dy.logistic(g[3 * H : 4 * H]), dy.tanh(g[4 * H : 5 * H])
        c = dy.cmult(i, u)
    else:
        (h0, c0), (h1, c1) = (tree_lstm(k, losses, vertices) for k in body)
        g = U0 * h0 + U1 * h1 + b
        i, f0, f1 = dy.logistic(g[0:H]), dy.logistic(g[H : 2 * H]), dy.logistic(g[2 * H : 3 * H])
        o, u = dy.logistic(g[3 * H : 4 * H]), dy.tanh(g[4 * H : 5 * H])
        c = dy.cmult(i, u) + dy.cmult(f0, c0) + dy.cmult(f1, c1)
    h = dy.cmult(o, dy.tanh(c))
    if args.loss == "all":
        losses.append(dy.pickneglogsoftmax(Wo * h + bo, label))
    return h, c


def var_lstm(node, losses, vertices):
    words = leaves(node, [])
    h = c = None
    for w in words:
        vertices[0] += 1
        g = W * dy.lookup(emb, vocab.get(w, 1)) + b
        if h is not None:
            g = g + U * h
        i, f, o, u = dy.logistic(g[0:H]), dy.logistic(g[H : 2 * H]), dy.logistic(g[2 * H : 3 * H]), dy.tanh(g[3 * H :])
        c = dy.cmult(i, u) if c is None else dy.cmult(i, u) + dy.cmult(f, c)
        h = dy.cmult(o, dy.tanh(c))
    return h, c


cell = tree_lstm if args.model == "tree-lstm" else var_lstm


def step(batch):
    dy.renew_cg()
    losses, outputs, vertices = [], [], [0]
    for t in batch:
        h, _ = cell(t, losses, vertices)
        if args.mode == "infer":
            outputs.append(Wo * h + bo)
        elif args.loss == "root" or args.model == "var-lstm":
            losses.append(dy.pickneglogsoftmax(Wo * h + bo, t[0]))
    if args.mode == "infer":
        dy.concatenate_cols(outputs).npvalue()
    else:
        loss = dy.esum(losses) / len(batch)
        loss.value()
        loss.backward()
        trainer.update()
    return vertices[0]


for k in range(0, min(len(examples), 3 * args.batch), args.batch):
    step(examples[k : k + args.batch])
start = time.perf_counter()
vertices = 0
for k in range(0, len(examples), args.batch):
    vertices += step(examples[k : k + args.batch])
seconds = time.perf_counter() - start
print(
    json.dumps(
        {
            "system": "dynet",
            "model": args.model,
            "mode": args.mode,
            "batch": args.batch,
            "hidden": H,
            "embed": E,
            "loss": args.loss,
            "sentences": args.sentences,
            "seconds": round(seconds, 4),
            "sent_per_s": round(args.sentences / seconds),
            "vertices_per_s": round(vertices / seconds),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }
    )
)
sys.stdout.flush()
