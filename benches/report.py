"""Turns target/bench/results.jsonl (from benches/run_all.sh) into the tables of BENCHMARKS.md
(printed as Markdown) and benches/results/throughput.svg (sentences/s against batch size)."""
import json
import math
import os

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
rows = [json.loads(l) for l in open(os.path.join(root, "target", "bench", "results.jsonl")) if l.strip()]
cmp = [r for r in rows if "median_ratio" in r]
scaling = [r for r in rows if r.get("scaling")]

print("| model | hidden | batch | mode | arbor sent/s | DyNet sent/s | ratio (median of 3 pairs) |")
print("|---|---|---|---|---|---|---|")
for r in cmp:
    print(f"| {r['model']} | {r['hidden']} | {r['batch']} | {r['mode']} | {r['arbor_sent_per_s']:.0f} | "
          f"{r['dynet_sent_per_s']:.0f} | **{r['median_ratio']:.2f}×** |")
print()
if scaling:
    print("| vertices per tree | trees per batch | vertices/s | µs per vertex |")
    print("|---|---|---|---|")
    for r in scaling:
        per_tree = round(r["vertices_per_s"] * r["seconds"] / r["sentences"])
        print(f"| {per_tree} | {r['sentences']} | {r['vertices_per_s']:.0f} | {1e6 / r['vertices_per_s']:.2f} |")

# Throughput against batch size, hidden 150, log-log axes.
series = {}
for r in cmp:
    if r["model"] == "tree-lstm" and r["hidden"] == 150:
        series.setdefault(f"arbor {r['mode']}", []).append((r["batch"], r["arbor_sent_per_s"]))
        series.setdefault(f"DyNet {r['mode']}", []).append((r["batch"], r["dynet_sent_per_s"]))
if series:
    W, H, P = 640, 400, 60
    xs = [math.log2(b) for s in series.values() for b, _ in s]
    ys = [math.log10(v) for s in series.values() for _, v in s]
    x0, x1, y0, y1 = min(xs), max(xs), math.floor(min(ys)), math.ceil(max(ys))
    px = lambda b: P + (W - 2 * P) * (math.log2(b) - x0) / max(x1 - x0, 1e-9)
    py = lambda v: H - P - (H - 2 * P) * (math.log10(v) - y0) / max(y1 - y0, 1e-9)
    colors = {"arbor train": "#1f77b4", "arbor infer": "#aec7e8", "DyNet train": "#d62728", "DyNet infer": "#ff9896"}
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{W/2}" y="24" text-anchor="middle">Tree-LSTM on SST, hidden 150, embed 300: sentences/s by batch</text>',
           f'<path d="M{P} {P} V{H-P} H{W-P}" stroke="black" fill="none"/>']
    for e in range(y0, y1 + 1):
        svg.append(f'<text x="{P-6}" y="{py(10**e)+4:.1f}" text-anchor="end">{10**e:g}</text>')
        svg.append(f'<path d="M{P} {py(10**e):.1f} H{W-P}" stroke="#ddd"/>')
    for b in sorted({b for s in series.values() for b, _ in s}):
        svg.append(f'<text x="{px(b):.1f}" y="{H-P+16}" text-anchor="middle">{b}</text>')
    svg.append(f'<text x="{W/2}" y="{H-18}" text-anchor="middle">batch (trees)</text>')
    for k, (name, pts) in enumerate(sorted(series.items())):
        pts.sort()
        c = colors.get(name, "black")
        svg.append(f'<polyline points="{" ".join(f"{px(b):.1f},{py(v):.1f}" for b, v in pts)}" stroke="{c}" stroke-width="2" fill="none"/>')
        svg.append(f'<text x="{W-P-90}" y="{P+16*k+4}" fill="{c}">{name}</text>')
    svg.append("</svg>")
    os.makedirs(os.path.join(root, "benches", "results"), exist_ok=True)
    with open(os.path.join(root, "benches", "results", "throughput.svg"), "w") as f:
        f.write("\n".join(svg) + "\n")
