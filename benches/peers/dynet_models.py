"""The binary Tree-LSTM and the Var-LSTM of arbor's benchmarks, written for DyNet with automatic
batching the way DyNet's users write them to be fast, on the same SST data, sizes, loss and
optimizer (Adagrad) as `arbor bench`: one `affine_transform` per vertex (an internal node's five
gates from `[h_left; h_right]`, a leaf's three — input, output, update: a leaf has no children to
forget — from its word vector; a Var-LSTM step's four gates from `[x; h]`), and `pick_range` for
the gates.

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
    W_leaf = pc.add_parameters((3 * H, E))  # a leaf's i, o, u from its word
    b_leaf = pc.add_parameters(3 * H)
    U = pc.add_parameters((5 * H, 2 * H))  # an internal node's i, f_left, f_right, o, u
    b = pc.add_parameters(5 * H)
else:
    WU = pc.add_parameters((4 * H, E + H))  # i, f, o, u from [x; h]
    b = pc.add_parameters(4 * H)
Wo = pc.add_parameters((C, H))
bo = pc.add_parameters(C)
trainer = dy.AdagradTrainer(pc, 0.05)


def gate(g, k, f):
    """Gate `k` (H rows) of the stacked gates `g`, through `f`."""
    return f(dy.pick_range(g, k * H, (k + 1) * H))


def tree_lstm(node, losses, vertices):
    """Returns (h, c) of `node`; appends vertex losses (loss 'all') and counts vertices."""
    label, body = node
    vertices[0] += 1
    if isinstance(body, str):
        g = dy.affine_transform([b_leaf, W_leaf, dy.lookup(emb, vocab.get(body, 1))])
        i, o, u = gate(g, 0, dy.logistic), gate(g, 1, dy.logistic), gate(g, 2, dy.tanh)
        c = dy.cmult(i, u)
    else:
        (h0, c0), (h1, c1) = (tree_lstm(k, losses, vertices) for k in body)
        g = dy.affine_transform([b, U, dy.concatenate([h0, h1])])
        i, f0, f1 = gate(g, 0, dy.logistic), gate(g, 1, dy.logistic), gate(g, 2, dy.logistic)
        o, u = gate(g, 3, dy.logistic), gate(g, 4, dy.tanh)
        c = dy.cmult(i, u) + dy.cmult(f0, c0) + dy.cmult(f1, c1)
    h = dy.cmult(o, dy.tanh(c))
    if args.loss == "all":
        losses.append(dy.pickneglogsoftmax(dy.affine_transform([bo, Wo, h]), label))
    return h, c


def var_lstm(node, losses, vertices):
    h = c = dy.zeros(H)
    for w in leaves(node, []):
        vertices[0] += 1
        g = dy.affine_transform([b, WU, dy.concatenate([dy.lookup(emb, vocab.get(w, 1)), h])])
        i, f, o, u = gate(g, 0, dy.logistic), gate(g, 1, dy.logistic), gate(g, 2, dy.logistic), gate(g, 3, dy.tanh)
        c = dy.cmult(i, u) + dy.cmult(f, c)
        h = dy.cmult(o, dy.tanh(c))
    return h, c


cell = tree_lstm if args.model == "tree-lstm" else var_lstm


def step(batch):
    dy.renew_cg()
    losses, outputs, vertices = [], [], [0]
    for t in batch:
        h, _ = cell(t, losses, vertices)
        if args.mode == "infer":
            outputs.append(dy.affine_transform([bo, Wo, h]))
        elif args.loss == "root" or args.model == "var-lstm":
            losses.append(dy.pickneglogsoftmax(dy.affine_transform([bo, Wo, h]), t[0]))
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
            "form": "lean",
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
