"""Compare `benchmarks.moe` JSONs of two source trees timed on one machine, A and B in turn.

    python tools/tree_ab.py --a a1.json a2.json --b b1.json b2.json [--impl mok]

Each JSON is one `python -m benchmarks.moe ... --json FILE` run; runs of one tree are
repeats. For every (shape, tokens, pass) row of `--impl` present in both trees the table gives
each tree's best and worst time, B / A of the best times, and whether the two trees' ranges
overlap (a difference inside the run-to-run spread is noise). The grouped_mm baseline's B / A,
printed first, shows the drift of the machine between the runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def times(paths: list[Path], impl: str) -> dict[tuple[str, int, str], list[float]]:
    """(shape, tokens, pass) -> the timed runs' ms of `impl` in these JSONs."""
    out: dict[tuple[str, int, str], list[float]] = {}
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            if row.get("impl") != impl or row.get("ms") is None:
                continue
            key = (row["shape"]["name"], int(row["num_tokens"]), row["pass"])
            out.setdefault(key, []).append(float(row["ms"]))
    return out


def table(a: dict, b: dict) -> list[str]:
    lines = [f"{'shape':<20} {'tokens':>6} {'pass':<7} {'A ms (best-worst)':>20} "
             f"{'B ms (best-worst)':>20} {'B/A':>6}  verdict"]  # fmt: skip
    for key in sorted(a.keys() & b.keys()):
        ta, tb = a[key], b[key]
        ratio = min(tb) / min(ta)
        overlap = min(tb) <= max(ta) and min(ta) <= max(tb)
        verdict = "within the spread" if overlap else ("B faster" if ratio < 1 else "B slower")
        lines.append(
            f"{key[0]:<20} {key[1]:>6} {key[2]:<7} "
            f"{f'{min(ta):.3f}-{max(ta):.3f}':>20} {f'{min(tb):.3f}-{max(tb):.3f}':>20} "
            f"{ratio:>6.3f}  {verdict}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, nargs="+", required=True, help="tree A's JSONs")
    parser.add_argument("--b", type=Path, nargs="+", required=True, help="tree B's JSONs")
    parser.add_argument("--impl", default="mok", help="the implementation compared (mok)")
    args = parser.parse_args(argv)
    drift_a, drift_b = times(args.a, "torch_grouped_mm"), times(args.b, "torch_grouped_mm")
    if drift_a.keys() & drift_b.keys():
        print("baseline (torch_grouped_mm), the machine's drift between the trees' runs:")
        print("\n".join(table(drift_a, drift_b)))
        print()
    a, b = times(args.a, args.impl), times(args.b, args.impl)
    if not a.keys() & b.keys():
        print(f"no {args.impl} row timed in both trees")
        return 1
    print(f"{args.impl}: A = {', '.join(map(str, args.a))}; B = {', '.join(map(str, args.b))}")
    print("\n".join(table(a, b)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
