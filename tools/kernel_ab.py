"""Time cubin folders against the shipped cubins in one call, each in turn, with their bits checked.

    python -m tools.kernel_ab --dir NAME=DIR [--dir NAME=DIR ...]
        [--cases qwen3-30b-a3b:2048,qwen3-30b-a3b:16384:mb16384,deepseek-v3:16384] [--rounds 2]
        [--reps 20]

A folder is a copy of the shipped cubins with diagnostic variants built into it:

    cp -r mok/dsl_kernels/cubins DIR
    python -m mok.dsl_kernels.build --arch sm_90a --only moe_forward --set FIELD=VALUE --out DIR

The shipped folder runs first, as `shipped`. Each round runs every folder once, in its own
process with MOK_KERNEL_DIR set to it (the runtime loads a folder once per process). A process
times, per case (a benchmark shape at one GPU's scale, a token count and, with `:mbROWS`,
macrobatches of ROWS routed rows, `:gather` for that replay; with `:main`, the routed weight
gradients accumulated into fp32 main_grads), schedule + forward and
schedule + forward + backward through `mok.functional` (CUDA events, the median of `--reps` after
warm-up) and hashes out and every gradient. The table gives each folder's best time over the
rounds, its ratio to the shipped folder's, and whether its bits are the shipped ones: a build
that changes bits says so, whatever its time. `--budget-s` bounds the whole comparison: no
process starts once the longest so far no longer fits, a process cut by it still gives the
cases it finished, and the table shows what ran.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

SHIPPED = "shipped"
MARK = "KERNEL_AB "  # a worker's result lines start with this
PASSES = ("fwd", "fwdbwd")
WARMUP = 3


def parse_dirs(items: list[str]) -> list[tuple[str, Path]]:
    """`NAME=DIR` items -> [(name, absolute folder)], the shipped cubins first."""
    from mok.runtime.manifest import installed_cubin_dir  # noqa: PLC0415

    dirs = [(SHIPPED, installed_cubin_dir().resolve())]
    for item in items:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            raise ValueError(f"--dir: expected NAME=DIR, got {item!r}")
        path = Path(folder).resolve()
        if not (path / "manifest.json").is_file():
            raise ValueError(f"--dir {item}: {path} holds no manifest.json (a copy of the cubins)")
        if name in {n for n, _ in dirs}:
            raise ValueError(f"--dir {item}: the name {name!r} is taken")
        dirs.append((name, path))
    return dirs


class Case(NamedTuple):
    """A benchmark shape at one GPU's scale, a token count and, where `macrobatch` > 0, ring
    reuse: MoKConfig minibatch_size = macrobatch_size = `macrobatch` with `replay`;
    `main_grads`: the routed weights' gradients accumulated into fp32 main_grads."""

    shape: str
    tokens: int
    macrobatch: int = 0
    replay: str = "gate_up"
    main_grads: bool = False

    def label(self) -> str:
        """The tokens column: `2048`, `16384/mb4096` (`g` at the end: the gather replay),
        `+main` after either with main_grads."""
        text = str(self.tokens)
        if self.macrobatch:
            text += f"/mb{self.macrobatch}" + ("g" if self.replay == "gather" else "")
        return text + ("+main" if self.main_grads else "")

    @classmethod
    def of(cls, row: dict) -> Case:
        """The case of a worker's result row (its fields by name, defaults where absent)."""
        return cls(**{field: row[field] for field in cls._fields if field in row})


FORM = "SHAPE:TOKENS[:mbROWS[:gather]][:main]"


def parse_cases(text: str) -> list[Case]:
    """`SHAPE:TOKENS[:mbROWS[:gather]][:main],...` -> [Case], shapes from benchmarks.shapes;
    ROWS a multiple of 256 below TOKENS x k (else every row is held at once: no ring)."""
    from benchmarks.shapes import SHAPES  # noqa: PLC0415

    topk = {shape.name: shape.topk for shape in SHAPES}
    cases = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        shape, _, rest = item.partition(":")
        tokens, *options = rest.split(":")
        if not tokens.isdigit() or int(tokens) <= 0:
            raise ValueError(f"--cases: expected {FORM}, got {item!r}")
        if shape not in topk:
            raise ValueError(f"--cases: unknown shape {shape!r}; expected one of {sorted(topk)}")
        case = Case(shape, int(tokens))
        if options and options[-1] == "main":
            case = case._replace(main_grads=True)
            options.pop()
        if options:
            rows, *replay = options
            if not (rows.startswith("mb") and rows[2:].isdigit()) or replay not in ([], ["gather"]):
                raise ValueError(f"--cases: expected {FORM}, got {item!r}")
            size, routed = int(rows[2:]), case.tokens * topk[shape]
            if size <= 0 or size % 256 or size >= routed:
                raise ValueError(
                    f"--cases {item}: macrobatch rows must be a positive multiple of 256 below "
                    f"TOKENS x k = {routed}, got {size}"
                )
            case = case._replace(macrobatch=size, replay=replay[0] if replay else "gate_up")
        cases.append(case)
    if not cases:
        raise ValueError("--cases: no case given")
    return cases


def table(results: list[dict]) -> list[str]:
    """Rows of the comparison: per case, pass and folder its best ms over the rounds, the
    ratio to the shipped folder's best, and whether its bits are the shipped ones."""
    best: dict[tuple, float] = {}
    bits: dict[tuple, set] = {}
    names: list[str] = []
    cases: list[tuple] = []
    for r in results:
        case = Case.of(r)
        if r["name"] not in names:
            names.append(r["name"])
        if case not in cases:
            cases.append(case)
        bits.setdefault((case, r["name"]), set()).add(r["hash"])
        for p in PASSES:
            key = (case, p, r["name"])
            best[key] = min(best.get(key, float("inf")), r[p])
    lines = [f"{'shape':<18} {'tokens':>14} {'pass':<7} {'folder':<12} {'best ms':>9} "
             f"{'/ shipped':>9}  bits"]  # fmt: skip
    for case in cases:
        shipped_bits = bits.get((case, SHIPPED), set())
        for p in PASSES:
            base = best.get((case, p, SHIPPED))
            for name in names:
                ms = best.get((case, p, name))
                if ms is None:
                    continue
                ratio = f"{ms / base:9.3f}" if base else f"{'-':>9}"
                own = bits[(case, name)]
                if len(own) > 1:
                    verdict = "differ between rounds"
                elif not shipped_bits:
                    verdict = "no shipped run"
                else:
                    verdict = "same" if own == shipped_bits else "DIFFERENT"
                lines.append(f"{case.shape:<18} {case.label():>14} {p:<7} {name:<12} {ms:9.3f} "
                             f"{ratio}  {verdict}")  # fmt: skip
    return lines


def time_case(case: Case, reps: int, device: str = "cuda", quick: bool = False) -> dict:
    """One case in this process's folder: {pass: median ms} and the outputs' hash
    (benchmarks.timing: CUDA events on a GPU; on a CPU, where mok runs its reference path,
    the host clock: a smoke test). The inputs are drawn on `device` (`quick`: benchmarks.shapes'
    small sizes)."""
    import torch  # noqa: PLC0415

    from benchmarks.shapes import scale_for_run, select_shapes  # noqa: PLC0415
    from benchmarks.timing import TimingConfig, median, synchronize, time_ms  # noqa: PLC0415
    from mok import functional as F  # noqa: PLC0415
    from mok.testing import WEIGHT_NAMES, make_inputs, run_layer_step  # noqa: PLC0415

    shape_name, tokens = case.shape, case.tokens
    shape = scale_for_run(select_shapes(shape_name)[0], 1, quick=quick)
    e, limit, on = shape.num_experts, shape.swiglu_limit, torch.device(device)
    inputs = make_inputs(tokens, shape.hidden_size, shape.intermediate_size, e, shape.topk,
                         device=on, generate_on_device=True)  # fmt: skip
    config = F.MoKConfig()
    if case.macrobatch:
        config = F.MoKConfig(minibatch_size=case.macrobatch, macrobatch_size=case.macrobatch,
                             macrobatch_replay=case.replay)  # fmt: skip
    ws = F.get_workspace(config, None, device=on, num_local_tokens=tokens,
                         hidden_size=shape.hidden_size, topk=shape.topk,
                         num_local_experts=e)  # fmt: skip
    weights = [inputs[n] for n in WEIGHT_NAMES]

    def forward(_state=None):
        schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
        return F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights,
                         swiglu_limit=limit)  # fmt: skip

    main = None
    if case.main_grads:  # fp32, the routed weights' (WEIGHT_NAMES[3:]) shapes; no shared expert
        main = (*(torch.zeros(w.shape, dtype=torch.float32, device=on) for w in weights[3:]),
                None, None, None)  # fmt: skip

    def step(_state=None):
        return run_layer_step(config, ws, inputs, e, swiglu_limit=limit, main_grads=main)

    out, _, grads = step()
    synchronize(on)
    F.check_errors(ws)
    digest = hashlib.sha1()
    for t in (out, *(g for g in grads if isinstance(g, torch.Tensor))):
        digest.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    result = {"hash": digest.hexdigest()[:16]}
    timing = TimingConfig(warmup=WARMUP, reps=reps)
    for name, run in (("fwd", forward), ("fwdbwd", step)):
        result[name] = median(time_ms(on, timing, run))
    F.check_errors(ws)
    return result


def worker(name: str, cases: list[Case], reps: int, round_: int, device: str,
           quick: bool) -> None:  # fmt: skip
    """Time every case in this process (MOK_KERNEL_DIR set by the caller); one line each."""
    import torch  # noqa: PLC0415

    for case in cases:
        result = time_case(case, reps, device, quick)
        row = {"name": name, "round": round_, **case._asdict(), **result}
        print(MARK + json.dumps(row), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()


def _text(output) -> str:
    """A timed-out process's captured output (bytes, str or None) as text."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", action="append", default=[], metavar="NAME=DIR",
                        help="a cubin folder to time against the shipped one (repeatable)")  # fmt: skip
    parser.add_argument("--cases", default="qwen3-30b-a3b:2048,qwen3-30b-a3b:16384,deepseek-v3:16384",
                        help=f"comma list of {FORM} (mbROWS: macrobatches of ROWS routed rows, "
                             "gate/up replayed, or their gather replay; main: fp32 main_grads)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per process")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole comparison: a process is started only while "
                             "the longest one so far still fits, and the table gives what ran")  # fmt: skip
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke test of the plumbing on mok's CPU path (with --quick)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="the benchmarks' small sizes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        parser.error(f"--rounds and --reps must be >= 1, got {args.rounds} and {args.reps}")
    try:
        cases = parse_cases(args.cases)
        if args.worker is not None:
            worker(args.worker, cases, args.reps, args.round, args.device, args.quick)
            return 0
        dirs = parse_dirs(args.dir)
    except ValueError as error:
        parser.error(str(error))
    import torch  # noqa: PLC0415

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the workers time mok's kernels)")
    results, failed, skipped = [], [], []
    start, longest = time.monotonic(), 0.0
    for round_ in range(1, args.rounds + 1):
        for name, folder in dirs:
            began = time.monotonic()
            left = float("inf") if args.budget_s is None else args.budget_s - (began - start)
            if left < longest:
                skipped.append(f"{name} round {round_}")
                continue
            timeout = min(args.timeout, max(1.0, left))
            cmd = [sys.executable, "-m", "tools.kernel_ab", "--worker", name, "--round",
                   str(round_), "--cases", args.cases, "--reps", str(args.reps), "--device",
                   args.device, *(["--quick"] if args.quick else [])]  # fmt: skip
            env = {**os.environ, "MOK_KERNEL_DIR": str(folder)}
            try:
                done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                      timeout=timeout)  # fmt: skip
                out, problem = done.stdout, None
                if done.returncode != 0:
                    problem = f"rc={done.returncode}, {done.stderr.strip()[-500:]}"
            except subprocess.TimeoutExpired as expired:  # its finished cases still count
                out, problem = _text(expired.stdout), f"over {timeout:.0f} s"
            longest = max(longest, time.monotonic() - began)
            rows = [json.loads(line[len(MARK):]) for line in out.splitlines()
                    if line.startswith(MARK)]  # fmt: skip
            for row in rows:
                print(f"  round {round_} {name:<12} {row['shape']:<18} {Case.of(row).label():>14} "
                      f"fwd {row['fwd']:8.3f} fwdbwd {row['fwdbwd']:8.3f} bits {row['hash']}",
                      flush=True)  # fmt: skip
            results.extend(rows)
            if problem:
                failed.append(f"{name} round {round_}: {problem}")
    print("\n".join(table(results)))
    if skipped:
        print(f"not run (--budget-s {args.budget_s:g}): " + ", ".join(skipped))
    for line in failed:
        print("FAILED", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
