"""SonicMoE (sonic-moe, Dao-AILab) as the ``sonicmoe`` row of ``python -m benchmarks.moe``.

The row is attempted whenever the package ``sonicmoe`` is importable (installed, on PYTHONPATH,
or in ``--sonic-site DIR``); ``--no-sonic`` leaves it out. It runs on CUDA at EP=1; elsewhere,
and where SonicMoE is not found, its rows say why. Each shape runs in a worker of its own,
``python -m benchmarks.sonic --worker ...`` (benchmarks/peer_worker.py), which measures the
run's token counts in turn (SonicMoE imported and its kernels loaded once), because SonicMoE's
kernels are QuACK's, on the CuTe DSL release that sonic-moe pins, which need not be mok's: one
process imports one ``cutlass``, so the worker puts SonicMoE's site (and the folders its
``.pth`` files name) first on its path; and a crash or hang in a peer costs one shape and token
count (the harness starts a new worker for the token counts after it).

The worker builds the harness' inputs (``make_inputs``, same seed), checks them against the same
fp32 reference with the same tolerance and times them with the same timer and reps. The call is
SonicMoE's public entry for routing given from outside, in training mode:

    out, _ = sonicmoe.moe_general_routing_inputs(
        x,                       # [T, H] bf16
        router_weights.view(-1), # [T * k] fp32, gets a gradient
        token_indices,           # [T * k] int32, ascending: arange(T) each repeated k times
        expert_indices,          # [T * k] int32: top_experts flattened
        W1.permute(1, 2, 0), None,    # (2I, H, E): W1 [E, 2I, H], rows gate_0, up_0, gate_1, ...
        down.permute(1, 2, 0), None,  # (H, I, E)
        E, stream, ActivationType.SWIGLU,
        is_inference_mode_enabled=False, concat_layout=False)

W1 (SonicMoE's own interleaved layout) and the int32 routing are built once, untimed; the gate
and up gradients are W1's gradient's even and odd rows. ``fwd`` is that training forward (it
keeps its pre-activations, as mok's forward keeps its context); ``fwdbwd`` and ``bwd`` add
``torch.autograd.grad`` over x, W1, down and the router weights. SonicMoE has no shared expert
and no SwiGLU clamp: such rows say so, never a number.

Only the standard library is imported at module level: the worker's path decides which
``cutlass`` it gets.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.machinery
import importlib.metadata
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import peer_worker
from benchmarks.peer_worker import PeerAvailability, PeerJob

PACKAGE = "sonicmoe"
DISTRIBUTIONS = ("sonic-moe", "quack-kernels", "nvidia-cutlass-dsl")
ENTRY_POINT = "sonicmoe.moe_general_routing_inputs"
# The first call of a shape autotunes every QuACK GEMM: up to ~100 s on an H200.
DEFAULT_TIMEOUT_S = 900.0
KILL_GRACE_S = 10.0
CONVERSIONS = "W1 = gate/up rows interleaved, expert ids int64->int32, built once untimed"


@dataclass(frozen=True)
class SonicAvailability(PeerAvailability):
    """Where SonicMoE is, or why it cannot be used."""

    def label(self) -> str:
        versions = self.versions or {}
        return (
            f"SonicMoE {ENTRY_POINT} (sonic-moe {versions.get('sonic-moe', '?')}, quack-kernels "
            f"{versions.get('quack-kernels', '?')}; EP=1, own process; training forward; "
            f"{CONVERSIONS})"
        )


def site_dirs(site: str) -> list[str]:
    """``site`` and the folders its ``.pth`` files add (Python reads a ``.pth`` only in a site
    directory, never in a PYTHONPATH entry, so the worker is given them by name)."""
    dirs = [site]
    for pth in sorted(Path(site).glob("*.pth")):
        for line in pth.read_text(errors="replace").splitlines():
            line = line.strip()
            if not line or line.startswith(("#", "import ", "import\t")):
                continue
            folder = Path(site, line)
            if folder.is_dir() and str(folder) not in dirs:
                dirs.append(str(folder))
    return dirs


def find_sonic(extra_site: str | None = None) -> SonicAvailability:
    """Locate SonicMoE in ``extra_site`` (first) or on ``sys.path``; nothing is imported."""
    search = [*site_dirs(extra_site), *sys.path] if extra_site else list(sys.path)
    where = f"--sonic-site {extra_site} or sys.path" if extra_site else "sys.path"
    spec = importlib.machinery.PathFinder.find_spec(PACKAGE, search)
    if spec is None or not spec.submodule_search_locations:
        return SonicAvailability(
            f"sonicmoe not importable: no package {PACKAGE} on {where} (install sonic-moe, put "
            "its site on PYTHONPATH, or pass --sonic-site DIR)"
        )
    site = str(Path(next(iter(spec.submodule_search_locations))).parent)
    versions = {}
    for dist_name in DISTRIBUTIONS:
        found = next(importlib.metadata.distributions(name=dist_name, path=[site]), None)
        versions[dist_name] = found.version if found is not None else None
    return SonicAvailability(None, site, versions, tuple(site_dirs(site)))


def skip_reason(
    availability: SonicAvailability,
    device_type: str,
    world_size: int,
    swiglu_limit: float | None,
    shared: bool,
) -> str | None:
    """Why the row gets no worker here (not found, not CUDA, EP, another function), or None."""
    if not availability.available:
        return availability.reason
    if device_type != "cuda":
        return f"skipped on {device_type}: SonicMoE's kernels need a Hopper GPU"
    if world_size != 1:
        return f"not run: its rows are measured at EP=1 (world size {world_size})"
    if shared:
        return "unsupported: SonicMoE's layer has no shared expert (--shared)"
    if swiglu_limit is not None:
        return f"unsupported: SonicMoE's SwiGLU has no clamp (this shape clamps at {swiglu_limit})"
    return None


# ─── the harness side ─────────────────────────────────────────────────────────────────────────


def worker_command(job: PeerJob) -> list[str]:
    # -u: the log tail must hold what was printed right before a crash.
    return [sys.executable, "-u", "-m", "benchmarks.sonic", *job.argv()]


def worker_env(availability: SonicAvailability, base: dict) -> dict:
    """``base`` with SonicMoE's site (and its .pth folders) first on PYTHONPATH, then the repo."""
    env = dict(base)
    entries = (*availability.python_path, str(peer_worker.REPO_ROOT), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in entries if p)
    return env


def run_job(job: PeerJob, availability: SonicAvailability) -> dict[int, dict]:
    """Workers over the job's token counts (benchmarks/peer_worker.py run_worker): per token
    count, its result, ``failure`` set if it failed."""

    def command_for(folder: str, tokens: tuple[int, ...]) -> list[str]:
        return worker_command(dataclasses.replace(job, result_path=folder, tokens=tokens))

    env = worker_env(availability, dict(os.environ))
    return peer_worker.run_worker(
        "sonicmoe", command_for, env, job.timeout_s, KILL_GRACE_S, job.tokens
    )


def pass_outcomes(result: dict, passes: tuple[str, ...]) -> dict[str, dict]:
    return peer_worker.pass_outcomes("sonicmoe", result, passes)


# ─── the worker: one shape, its token counts in turn, one process ─────────────────────────────


def sonic_impl(moe_general_routing_inputs, activation, inputs, stream):
    """The ``Impl`` of SonicMoE's training layer over the harness' inputs.

    ``moe_general_routing_inputs`` and ``activation`` (ActivationType.SWIGLU) are SonicMoE's;
    ``stream`` the CUDA stream handle it launches on. W1 and the int32 routing are built here,
    once.
    """
    import torch

    from benchmarks.impls import Impl

    num_tokens, topk = inputs.top_experts.shape
    experts, inter, hidden = inputs.gate.shape
    # SonicMoE's W1 [E, 2I, H]: row 2i is gate row i, row 2i + 1 up row i.
    w1 = torch.stack([inputs.gate, inputs.up], dim=2).reshape(experts, 2 * inter, hidden)
    leaves = {
        "x": inputs.x.detach().requires_grad_(True),
        "w1": w1.contiguous().requires_grad_(True),
        "down": inputs.down.detach().requires_grad_(True),
        "router_weights": inputs.router_weights.detach().requires_grad_(True),
    }
    device = inputs.x.device
    token_indices = torch.arange(num_tokens, device=device, dtype=torch.int32)
    token_indices = token_indices.repeat_interleave(topk)
    expert_indices = inputs.top_experts.reshape(-1).to(torch.int32)

    def forward():
        out, _expert_frequency = moe_general_routing_inputs(
            leaves["x"], leaves["router_weights"].view(-1), token_indices, expert_indices,
            leaves["w1"].permute(1, 2, 0), None, leaves["down"].permute(1, 2, 0), None,
            experts, stream, activation,
            is_inference_mode_enabled=False, concat_layout=False,
        )  # fmt: skip
        return out, out

    def backward(out, grad_output):
        d_x, d_w1, d_down, d_router = torch.autograd.grad(out, list(leaves.values()), grad_output)
        return {"x": d_x, "router_weights": d_router, "gate": d_w1[:, 0::2],
                "up": d_w1[:, 1::2], "down": d_down}  # fmt: skip

    return Impl("sonicmoe", "SonicMoE training layer", False, forward, backward)


CACHE_ENV = ("QUACK_CACHE_DIR", "TRITON_CACHE_DIR", "CUTE_DSL_CACHE_DIR")
QUACK_JIT_MODULES = ("quack.gemm", "quack.gemm_act", "quack.gemm_dact")


def compile_counts() -> dict[str, int]:
    """What SonicMoE has compiled so far: the files in each of its caches (QuACK's kernels and
    autotuning choices, Triton's, the CuTe DSL's; ``<VAR> files``) and QuACK's in-process
    kernel builds (``quack builds``: misses of its ``functools`` caches, each a JIT compile
    or a load from its file cache). The difference over a token count says whether its first
    call's time went to compiling."""
    counts = {}
    for var in CACHE_ENV:
        folder = os.environ.get(var)
        if folder and os.path.isdir(folder):
            counts[f"{var} files"] = sum(len(files) for _, _, files in os.walk(folder))
    builds = 0
    for name in QUACK_JIT_MODULES:
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            info = getattr(value, "cache_info", None)
            if callable(info) and hasattr(value, "cache_clear"):
                try:
                    builds += info().misses
                except Exception:  # a count for the log: never the worker's failure
                    continue
    counts["quack builds"] = builds
    return counts


def measure_shape(job: PeerJob, progress: peer_worker.Progress) -> None:
    """Import SonicMoE once, then for each token count inputs, reference, check and timing as
    benchmarks.moe does them."""
    progress.stage("import_sonicmoe")
    import torch
    from sonicmoe import moe_general_routing_inputs
    from sonicmoe.enums import ActivationType

    from benchmarks.shapes import scale_for_run, select_shapes

    progress.result["info"].update(
        versions=find_sonic().versions, torch=torch.__version__,
        sonicmoe=str(Path(sys.modules[PACKAGE].__file__).parent),
    )  # fmt: skip
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: SonicMoE's kernels need a Hopper GPU")
    device = torch.device("cuda", job.device_index)
    torch.cuda.set_device(device)
    progress.result["info"]["gpu"] = torch.cuda.get_device_name(device)
    shape = scale_for_run(select_shapes(job.shape)[0], world_size=1, quick=job.quick)
    stream = torch.cuda.current_stream(device).cuda_stream
    for num_tokens in job.tokens:
        progress.begin(num_tokens)
        before = compile_counts()
        inputs, reference = peer_worker.inputs_and_reference(job, shape, device, progress)
        impl = sonic_impl(moe_general_routing_inputs, ActivationType.SWIGLU, inputs, stream)
        peer_worker.measure_passes(job, {"fwd": impl, "train": impl}, inputs, reference, progress)
        after = compile_counts()
        progress.result["compiles"] = {k: after[k] - before.get(k, 0) for k in after}
        progress.done()
        del inputs, reference, impl
        torch.cuda.empty_cache()


def worker_main(job: PeerJob) -> int:
    """Measure one shape at the job's token counts; the result files say what happened."""
    import faulthandler
    import signal
    import traceback

    progress = peer_worker.Progress("sonicmoe", job)
    # On the harness' SIGTERM (timeout) the log gets every thread's Python stack.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    try:
        measure_shape(job, progress)
        return 0
    except BaseException as error:  # the result says where it stopped and why
        progress.result.update(status="error", error=f"{type(error).__name__}: {error}")
        progress.save()
        traceback.print_exc()
        return 1


def main(argv: list[str] | None = None) -> int:
    """``--worker ...``: measure one shape (the harness starts it). Alone: say if SonicMoE is
    here."""
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return worker_main(PeerJob.from_argv(argv))
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sonic", description=__doc__)
    parser.add_argument("--sonic-site", default=None, help="a site dir that holds SonicMoE")
    availability = find_sonic(parser.parse_args(argv).sonic_site)
    print(json.dumps(dataclasses.asdict(availability), indent=2))
    return 0 if availability.available else 1


if __name__ == "__main__":
    sys.exit(main())
