"""Lines, summary table, JSON with provenance and the PNG chart of one harness run."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess

import torch


def ceilings_line(ceilings: dict) -> str:
    """The measured ceilings, and why the GEMM rate is no ceiling where it is not one."""
    gemm = (
        f"dense bf16 GEMM {ceilings['gemm_bf16_size']}^3 {ceilings['gemm_bf16_tflops']:.4g} "
        f"TFLOP/s (burst), {ceilings['gemm_bf16_sustained_tflops']:.4g} TFLOP/s (sustained)"
    )
    if ceilings.get("gemm_fp8_tflops"):
        gemm += f", dense fp8 e4m3 GEMM {ceilings['gemm_fp8_tflops']:.4g} TFLOP/s (burst)"
    elif ceilings.get("gemm_fp8_note"):
        gemm += f", no fp8 GEMM ({ceilings['gemm_fp8_note']})"
    note = ceilings.get("gemm_ceiling_note")
    if note:
        gemm += f" [{note}: no % of GEMM shown]"
    peer = ""
    if ceilings.get("peer_copy_gbs"):
        peer = f", peer copy {ceilings['peer_copy_gbs']:.4g} GB/s (written to the next rank)"
    return f"ceilings: {gemm}, copy {ceilings['copy_gbs']:.4g} GB/s (read + write){peer}"


def progress_line(rows: list[dict], seconds: float, total_seconds: float) -> str:
    """Where one shape and token count's wall time went (its rows, each peer's worker
    process), and the run's so far: what tells whether a table fits a time limit."""
    if not rows:
        return f"  ({seconds:.0f} s; {total_seconds:.0f} s into the run)"
    head = rows[0]
    workers = {row["impl"]: row for row in rows if "worker_s" in row}
    parts = "".join(
        f", {impl} worker {row['worker_s']:.0f} s{_stages(row.get('worker_stage_s'))}"
        f"{_compiles(row.get('worker_compiles'))}"
        for impl, row in workers.items()
    )
    return (
        f"  ({head['shape']['name']} {head['num_tokens']} tokens: {seconds:.0f} s{parts}; "
        f"{total_seconds:.0f} s into the run)"
    )


def _stages(stage_s: dict | None) -> str:
    """ " (stage at S s, ...)": when each of a worker's stages began on this token count."""
    if not stage_s:
        return ""
    return " (" + ", ".join(f"{name} at {s:.0f}" for name, s in stage_s.items()) + ")"


def _compiles(compiles: dict | None) -> str:
    """ " [compiled: NAME +N, ...]": what a worker's caches gained on this token count."""
    grown = {name: n for name, n in (compiles or {}).items() if n}
    if not grown:
        return ""
    return " [compiled: " + ", ".join(f"{name} +{n}" for name, n in grown.items()) + "]"


def format_row(row: dict) -> str:
    """One line per (shape, pass, impl): ms, the roofline floor and ms / floor where the run
    measured its ceilings, TFLOP/s, % of the GEMM ceiling (burst, and sustained under the power
    limit; an MXFP8 row's % of the FP8 GEMM too) where there is one, speedup (an MXFP8 row's
    against mok bf16 too), the forward context's size where known. A failed row's status, and
    under it the last lines of its worker's output when it has them."""
    shape = row["shape"]
    head = (
        f"{shape['name']:<18} E={shape['num_experts']:<3} H={shape['hidden_size']:<5} "
        f"I={shape['intermediate_size']:<5} k={shape['topk']:<2} T={row['num_tokens']:<6} "
        f"{row['pass']:<6} {row['impl']:<20}"
    )
    if row["status"] != "ok":
        tail = "".join(f"\n    | {line}" for line in row.get("log_tail") or ())
        return f"{head} {row['status']}{tail}"
    speedup = f"{row['speedup']:.2f}x vs baseline" if row.get("speedup") else "no baseline"
    ceiling = ""
    if "pct_of_gemm_ceiling" in row:
        ceiling = (
            f"{row['pct_of_gemm_ceiling']:5.1f}% of GEMM "
            f"({row['pct_of_sustained_gemm']:5.1f}% sustained)  "
        )
    if "pct_of_fp8_ceiling" in row:
        ceiling += f"{row['pct_of_fp8_ceiling']:5.1f}% of FP8 GEMM  "
    if "ratio_vs_mok_bf16" in row:
        speedup += f", {row['ratio_vs_mok_bf16']:.2f}x vs mok bf16"
    context = f"  ctx {row['context_bytes'] / 2**20:.1f} MiB" if "context_bytes" in row else ""
    if "vs_compute_only" in row:
        speedup += f", {row['vs_compute_only']:.2f}x of compute-only"
    if "peer_bytes" in row:
        share = (
            f" ({row['pct_of_peer_copy']:.0f}% of peer copy)" if "pct_of_peer_copy" in row else ""
        )
        context += f"  peers {row['peer_bytes'] / 1e6:.1f} MB {row['peer_gbs']:.4g} GB/s{share}"
    floor = ""
    if "x_floor" in row:
        floor = f"floor {row['floor_ms']:8.3f} ms {row['x_floor']:6.2f} x floor "
    return (
        f"{head} {row['ms']:9.3f} ms {floor}{row['tflops']:7.3g} TFLOP/s {ceiling}"
        f"{speedup}  err {row['max_rel_err']:.1e}{context}"
    )


def _summary_cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["status"] != "ok":
        return row["status"].split(":")[0]  # its kind; the row's line above has all of it
    speed = f" ({row['speedup']:.2f}x)" if row.get("speedup") else ""
    return f"{row['ms']:.3f} ms{speed}"


def _summary_key(row: dict) -> tuple[str, int, str]:
    return row["shape"]["name"], row["num_tokens"], row["pass"]


def summary_table(rows: list[dict]) -> str:
    """Shape x tokens x pass rows, one column per impl: ms (speedup) or the kind of its status.

    Every column is as wide as its widest cell: nothing is cut.
    """
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    keys = list(dict.fromkeys(_summary_key(row) for row in rows))
    by_key = {(*_summary_key(row), row["impl"]): row for row in rows}
    table = [["shape", "T", "pass", *impls]]
    for shape, num_tokens, pass_name in keys:
        cells = [_summary_cell(by_key.get((shape, num_tokens, pass_name, impl))) for impl in impls]
        table.append([shape, str(num_tokens), pass_name, *cells])
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = []
    for line in table:
        head = f"{line[0]:<{widths[0]}}  {line[1]:>{widths[1]}}  {line[2]:<{widths[2]}}"
        cells = "".join(f"  {c:>{w}}" for c, w in zip(line[3:], widths[3:], strict=True))
        lines.append(head + cells)
    return "\n".join(lines)


def _command(args: list[str]) -> str | None:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def provenance(device: torch.device, world_size: int) -> dict:
    """Where and with what this run was measured."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = _command(["git", "-C", repo, "rev-parse", "HEAD"])
    dirty = _command(["git", "-C", repo, "status", "--porcelain"])
    info = {
        "git_commit": commit,
        "git_dirty": bool(dirty) if commit else None,
        "hostname": socket.gethostname(),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "world_size": world_size,
        "gpu": None,
        "driver": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["sm_count"] = props.multi_processor_count
        info["gpu_memory_bytes"] = props.total_memory
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = _command(query)
        info["driver"] = driver.splitlines()[0] if driver else None
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def write_json(path: str, record: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump(record, handle, indent=2, default=str)
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def write_png(path: str, rows: list[dict], ceilings: dict, title: str) -> str:
    """Bar chart of TFLOP/s per (shape, tokens, pass), one bar per impl; returns a note of what
    it did."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib not installed: no PNG written to {path}"
    measured = [row for row in rows if row["status"] == "ok"]
    if not measured:
        return "no measured rows: no PNG written"
    impls = list(dict.fromkeys(row["impl"] for row in measured))

    def group_of(row: dict) -> str:
        return f"{row['shape']['name']}\nT={row['num_tokens']} {row['pass']}"

    groups = list(dict.fromkeys(group_of(r) for r in measured))
    values = {(group_of(r), r["impl"]): r["tflops"] for r in measured}
    width = 0.8 / len(impls)
    fig, axes = plt.subplots(figsize=(max(6, 1.2 * len(groups)), 4.5))
    for i, impl in enumerate(impls):
        xs = [g + i * width for g in range(len(groups))]
        axes.bar(xs, [values.get((group, impl), 0.0) for group in groups], width, label=impl)
    if ceilings.get("gemm_is_ceiling", True):
        gemm = ceilings["gemm_bf16_tflops"]
        axes.axhline(gemm, color="k", linestyle="--", label="dense GEMM")
        sustained = ceilings.get("gemm_bf16_sustained_tflops")
        if sustained:
            axes.axhline(sustained, color="k", linestyle=":", label="dense GEMM, sustained")
    axes.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, fontsize=7)
    axes.set_ylabel("TFLOP/s per GPU")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
