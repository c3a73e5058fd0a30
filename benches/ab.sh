#!/bin/bash
# Two arbor builds against each other: `benches/ab.sh OLD NEW PAIRS <arbor bench flags>` runs
# `arbor bench --model tree-lstm --data $ARBOR_DATA/sst --hidden 150 --embed 300 <flags>` with each
# binary per pair, the order alternating, and prints each pair's sentences/s and NEW/OLD, then
# the medians. Example: benches/ab.sh /tmp/arbor-old target/release/arbor 12 --batch 1 --mode train --sentences 1000
set -euo pipefail
old=$1 new=$2 pairs=$3
shift 3
data=${ARBOR_DATA:-$(dirname "$0")/../../shared/data}
rate() { local bin=$1; shift; "$bin" bench --model tree-lstm --data "$data/sst" --hidden 150 --embed 300 "$@" 2>/dev/null | tail -n 1 | sed 's/.*"sent_per_s":\([0-9.]*\).*/\1/'; }
for i in $(seq "$pairs"); do
  if (( i % 2 )); then b=$(rate "$new" "$@"); a=$(rate "$old" "$@"); else a=$(rate "$old" "$@"); b=$(rate "$new" "$@"); fi
  echo "$a $b"
done | python3 -c '
import statistics, sys
rows = [tuple(map(float, l.split())) for l in sys.stdin]
for a, b in rows:
    print(f"{a:8.1f} {b:8.1f} {b / a:6.3f}")
med = statistics.median
print(f"median old {med(a for a, _ in rows):.1f}, new {med(b for _, b in rows):.1f}, new/old {med(b / a for a, b in rows):.3f}")'
