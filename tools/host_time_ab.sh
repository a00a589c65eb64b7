#!/usr/bin/env bash
# Host time of an eager step, A/B: `python -m benchmarks.host_time` in alternating processes of
# a base tree and this one (each run from its own root, so each imports its own mok), then the
# medians, and per process the lone step less (and over) that process's floor. The host's
# spread between processes of one tree is up to 2x, so only many alternating processes tell a
# change of tens of microseconds. Usage (repo root, GPU machine):
#   bash tools/host_time_ab.sh BASE_DIR [PAIRS] [ARGS...]     # e.g. a `git archive` of main
set -uo pipefail
base=$(cd "$1" && pwd); pairs=${2:-4}; shift $(( $# < 2 ? $# : 2 ))
here=$(pwd); log=$(mktemp)
for n in $(seq "$pairs"); do
  order=("$base" "$here"); (( n % 2 == 0 )) && order=("$here" "$base")
  for tree in "${order[@]}"; do
    label=$([ "$tree" = "$base" ] && echo base || echo new)
    (cd "$tree" && python3 -m benchmarks.host_time "$@") 2>&1 | sed "s/^/$label $n: /" | tee -a "$log"
  done
done
python3 - "$log" <<'EOF'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"(base|new) \d+: (host time per eager|autograd floor|stack of \d+ layers, per layer).*?: ([\d.]+) ms host", line)
    if m:
        rows.setdefault((m[2], m[1]), []).append(float(m[3]))
print(f"{'measure':34} {'tree':5} {'median ms':>9}  runs")
for (what, tree), v in sorted(rows.items()):
    print(f"{what[:34]:34} {tree:5} {statistics.median(v):9.3f}  {' '.join(f'{x:.3f}' for x in v)}")
# A process's mode slows its floor too: the lone step less the floor of the same process, and
# over it, per process.
for tree in ("base", "new"):
    steps, floors = rows.get(("host time per eager", tree)), rows.get(("autograd floor", tree))
    if steps and floors and len(steps) == len(floors):
        less = [a - b for a, b in zip(steps, floors)]
        over = [a / b for a, b in zip(steps, floors)]
        print(f"{'lone step - floor (same process)':34} {tree:5} {statistics.median(less):9.3f}  "
              f"{' '.join(f'{x:.3f}' for x in less)}")
        print(f"{'lone step / floor (same process)':34} {tree:5} {statistics.median(over):9.2f}  "
              f"{' '.join(f'{x:.2f}' for x in over)}")
EOF
rm -f "$log"
