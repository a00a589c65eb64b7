"""LigerMoE (liger-kernel's ``moe_fused``) as the ``liger`` row of ``python -m benchmarks.moe``.

The row exists when ``liger_kernel`` and ``liger_cute_kernels`` are importable (installed, on
PYTHONPATH, or in ``--liger-site DIR``) and the run is on CUDA at EP=1. Each shape and token
count runs in its own worker process, ``python -m benchmarks.liger --worker ...``, because:

- NVSHMEM must be loaded before torch: Liger's core is built against NVSHMEM 3.6.5 (cu12) while
  torch may link its own copy, and the first ``libnvshmem_host.so.3`` mapped is the one every
  later lookup of that soname gets;
- ``liger_cute_kernels.configure`` fixes the symmetric capacity (tokens, H, E, k) and the
  NVSHMEM heap once per process: it cannot grow for a larger shape;
- a hang or a native crash in a peer must cost one shape, not the run: the worker has a hard
  timeout and the harness reports how it ended, with the last lines of its output.

A worker's start (its imports, NVSHMEM and ``configure``) takes 10-15 s, most of its time on a
token count, so the harness starts the next token count's worker as soon as one has finished
(``start``; benchmarks.moe's ``start_next_liger``, when the GPU has room for its heap): it
starts beside the rows measured before its turn, then waits, configured, for its gate, and its
own GPU work (inputs, reference, check, timing) runs only in its turn.

The worker builds the same inputs as the harness (``make_inputs``, same seed), checks them
against the same fp32 reference with the same tolerance, and times them with the same timer and
reps; it writes one JSON result that the harness turns into rows. Liger takes router weights in
bf16 (they get a gradient) and expert ids in int32: the worker converts both from the harness'
fp32 / int64, and the row's label says so. Liger's layer has no shared expert and no SwiGLU
clamp: such shapes get a row that says so, never a number.

Only the standard library is imported at module level: the worker loads NVSHMEM before torch.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import faulthandler
import importlib.machinery
import importlib.metadata
import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchmarks import peer_worker
from benchmarks.peer_worker import PeerAvailability, PeerJob

PACKAGES = ("liger_kernel", "liger_cute_kernels")
DISTRIBUTIONS = ("liger-kernel", "liger-cute-kernels", "apache-tvm-ffi", "nvidia-nvshmem-cu12")
ENTRY_POINT = "liger_kernel.ops.cute.ops.moe.moe_fused"
ENTRY_FILE = ("ops", "cute", "ops", "moe.py")  # under liger_kernel/: where moe_fused is defined
NVSHMEM_HOST = "libnvshmem_host.so.3"
CUDART_12 = "libcudart.so.12"
REPO_ROOT = peer_worker.REPO_ROOT
DEFAULT_TIMEOUT_S = 300.0
# How the harness' fp32 / int64 routing becomes Liger's calling convention (said in each row).
CONVERSIONS = "router weights fp32->bf16, expert ids int64->int32"
# Seconds between SIGTERM (the worker dumps its Python stacks) and SIGKILL.
KILL_GRACE_S = 10.0


@dataclass(frozen=True)
class LigerAvailability(PeerAvailability):
    """Where LigerMoE is installed, or why it cannot be used.

    ``site`` is the directory holding ``liger_cute_kernels`` (its NVSHMEM and CUDA runtime
    libraries are looked up next to it), ``python_path`` the directories of both packages (the
    worker's PYTHONPATH), ``reason`` is ``None`` when the row can be attempted.
    """

    nvshmem_host: str | None = None
    cudart: str | None = None

    def label(self) -> str:
        versions = self.versions or {}
        kernel = versions.get("liger-kernel", "?")
        cute = versions.get("liger-cute-kernels", "?")
        return (
            f"LigerMoE moe_fused (liger-kernel {kernel}, liger-cute-kernels {cute}; EP=1, own "
            f"process; {CONVERSIONS}; fwd timed on its no-grad path)"
        )


def _package_dir(name: str, search: list[str]) -> Path | None:
    """Directory of top-level package ``name`` on ``search``, found without importing it."""
    spec = importlib.machinery.PathFinder.find_spec(name, search)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _first_file(candidates: list[Path]) -> str | None:
    return next((str(path) for path in candidates if path.is_file()), None)


def find_liger(extra_site: str | None = None) -> LigerAvailability:
    """Locate LigerMoE in ``extra_site`` (first) or on ``sys.path``; nothing is imported."""
    search = [extra_site, *sys.path] if extra_site else list(sys.path)
    where = f"--liger-site {extra_site} or sys.path" if extra_site else "sys.path"
    dirs = {}
    for name in PACKAGES:
        dirs[name] = _package_dir(name, search)
        if dirs[name] is None:
            return LigerAvailability(
                f"liger not importable: no package {name} on {where} (install liger-kernel and "
                f"liger-cute-kernels, put their site on PYTHONPATH, or pass --liger-site DIR)"
            )
    entry = dirs["liger_kernel"].joinpath(*ENTRY_FILE)
    if not entry.is_file():
        return LigerAvailability(
            f"liger not importable: {entry} is missing ({ENTRY_POINT} is in liger-kernel >= 0.8.5)"
        )
    package = dirs["liger_cute_kernels"]
    site = package.parent
    # Liger's own loader looks next to its package first, then in nvidia-nvshmem's wheel folder.
    wheel_lib = site / "nvidia" / "nvshmem" / "lib"
    nvshmem = _first_file([package / NVSHMEM_HOST, wheel_lib / NVSHMEM_HOST])
    if nvshmem is None:
        return LigerAvailability(
            f"liger not usable: no {NVSHMEM_HOST} in {package} or {wheel_lib} "
            f"(install liger-cute-kernels[cu12])",
            site=str(site),
        )
    # The core needs libcudart.so.12; a CUDA 13 torch brings only .so.13. The carried peer keeps
    # it in _lck_libs/ (out of torch's preload path), a pip install in nvidia-cuda-runtime-cu12.
    cudart = _first_file(
        [site / "_lck_libs" / CUDART_12, site / "nvidia" / "cuda_runtime" / "lib" / CUDART_12]
    )
    versions = {}
    for dist_name in DISTRIBUTIONS:
        found = next(importlib.metadata.distributions(name=dist_name, path=[str(site)]), None)
        versions[dist_name] = found.version if found is not None else None
    python_path = tuple(dict.fromkeys(str(d.parent) for d in dirs.values()))
    return LigerAvailability(None, str(site), versions, python_path, nvshmem_host=nvshmem,
                             cudart=cudart)  # fmt: skip


def unsupported_reason(swiglu_limit: float | None, shared: bool) -> str | None:
    """Why Liger's layer computes another function than this shape's, or ``None``."""
    if shared:
        return "unsupported: LigerMoE's moe_fused has no shared expert (--shared)"
    if swiglu_limit is not None:
        return f"unsupported: LigerMoE's SwiGLU has no clamp (this shape clamps at {swiglu_limit})"
    return None


def symmetric_heap_gib(
    num_tokens: int, num_experts: int, hidden_size: int, topk: int, sm_count: int
) -> int:
    """NVSHMEM symmetric heap for one shape, in GiB (NVSHMEM's 1 GiB default is too small).

    Liger's symmetric buffers, all bf16 rows of ``hidden_size``: four of ``slots`` rows
    (forward x_sorted and y_buf, backward dy_sorted and dx_sorted), slots = T * k + E * 128 (its
    MoEConfig's tile-padded slot count), and five per-SM staging buffers of 8 tiles of 128 rows
    (forward source and destination, backward x, dy and dx). The core is a closed binary, so
    this list is the peer's notes, not its source: 30 % plus 2 GiB of headroom covers NVSHMEM's
    own allocations, and a shape that still runs out fails at configure, in its own process.
    """
    slots = num_tokens * topk + num_experts * 128
    staging_rows = sm_count * 8 * 128
    needed = (4 * slots + 5 * staging_rows) * hidden_size * 2
    return max(4, math.ceil((1.3 * needed + 2 * 2**30) / 2**30))


# ─── the job: what the harness asks one worker to do ──────────────────────────────────────────


@dataclass(frozen=True)
class LigerJob(PeerJob):
    """One shape at one token count for one Liger worker; ``heap_gib`` sizes its NVSHMEM heap.
    ``gate``: a worker started ahead of its turn (``start``) waits, once configured, for this
    file before its first GPU stage ("" for none)."""

    heap_gib: int = 0
    gate: str = ""

    def same_work(self, other: LigerJob) -> bool:
        """Whether ``other`` measures the same thing (its folder, gate and timeout aside)."""
        aside = {"result_path": "", "gate": "", "timeout_s": 0.0}
        return dataclasses.replace(self, **aside) == dataclasses.replace(other, **aside)


def worker_command(job: LigerJob) -> list[str]:
    # -u: the log tail must hold what was printed right before a crash.
    return [sys.executable, "-u", "-m", "benchmarks.liger", *job.argv()]


def worker_env(job: LigerJob, availability: LigerAvailability, base: dict) -> dict:
    """The worker's environment: ``base`` plus Liger's site and NVSHMEM's settings for one PE."""
    env = dict(base)
    path = env.get("PYTHONPATH")
    entries = (*availability.python_path, str(REPO_ROOT), path)
    env["PYTHONPATH"] = os.pathsep.join(p for p in entries if p)
    defaults = {
        # One PE on one host: no remote transport or InfiniBand to probe (and none to reach).
        "NVSHMEM_REMOTE_TRANSPORT": "none",
        "NVSHMEM_IB_ENABLE_IBGDA": "0",
        # NVSHMEM's NCCL interop is for multi-PE collectives; it would load a second NCCL.
        "NVSHMEM_DISABLE_NCCL": "1",
        # A single process bootstraps NVSHMEM (unique id) and NCCL (world of 1) over loopback.
        "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
    }
    for key, value in defaults.items():
        env.setdefault(key, value)
    # NVLink multicast can take shared GPU hosts out of service: never, whatever the caller set.
    env["NVSHMEM_DISABLE_NVLS"] = "1"
    env["NVSHMEM_SYMMETRIC_SIZE"] = f"{job.heap_gib}G"
    # The optional non-RDC Hopper cubin is not in every install (the carried peer drops it):
    # the default RDC kernels are the ones every install has.
    env.pop("LIGER_MOE_SM90_NONRDC", None)
    return env


# ─── the harness side: run one worker, turn its result into per-pass outcomes ────────────────


read_result = peer_worker.read_result


@dataclass
class Started:
    """A worker started ahead of its turn (``start``) for ``job``: it loads Liger and
    configures NVSHMEM while the harness measures the rows before it, then waits for its gate."""

    job: LigerJob
    worker: peer_worker.Started

    def stop(self) -> None:
        self.worker.stop(KILL_GRACE_S)


def start(job: LigerJob, availability: LigerAvailability) -> Started | None:
    """Start ``job``'s worker now, to be run by ``run_job(..., started=...)`` (None if it could
    not start: ``run_job`` then starts one itself)."""

    def command_for(folder: str, gate: str) -> list[str]:
        return worker_command(dataclasses.replace(job, result_path=folder, gate=gate))

    worker = peer_worker.start(
        "liger", command_for, worker_env(job, availability, dict(os.environ))
    )
    return None if isinstance(worker, str) else Started(job, worker)


def run_job(job: LigerJob, availability: LigerAvailability, started: Started | None = None) -> dict:
    """Run one worker (one token count: ``configure`` fixes its capacity) to its end or its
    timeout; its result with ``failure`` set if it failed (benchmarks/peer_worker.py says
    how). ``started``: this job's worker, started ahead (``start``); its gate opens now."""
    (num_tokens,) = job.tokens
    if started is not None and not started.job.same_work(job):
        raise ValueError(f"started worker is for {started.job}, not {job}")

    def command_for(folder: str, tokens: tuple[int, ...]) -> list[str]:
        return worker_command(dataclasses.replace(job, result_path=folder, tokens=tokens))

    env = worker_env(job, availability, dict(os.environ))
    results = peer_worker.run_worker("liger", command_for, env, job.timeout_s, KILL_GRACE_S,
                                     job.tokens, started.worker if started else None)  # fmt: skip
    return results[num_tokens]


def describe_end(result: dict, returncode: int | None, timed_out: bool, timeout_s: float):
    """How a worker that did not finish cleanly ended, or ``None`` if it did."""
    return peer_worker.describe_end("liger", result, returncode, timed_out, timeout_s)


def pass_outcomes(result: dict, passes: tuple[str, ...]) -> dict[str, dict]:
    """Per pass: what the worker measured for it, or its failure for a pass it never reached."""
    return peer_worker.pass_outcomes("liger", result, passes)


# ─── the worker: one shape and token count, one process ──────────────────────────────────────


def _configure(device, shape, num_tokens: int) -> None:
    """A torch.distributed world of one and Liger's runtime with exactly this shape's capacity."""
    from datetime import timedelta

    import torch.distributed as dist
    from liger_cute_kernels import MoEConfig, configure

    # NCCL: configure broadcasts NVSHMEM's unique id as a CUDA tensor over the bootstrap group.
    store = dist.HashStore()
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=120)
    )
    moe_config = MoEConfig(
        max_tokens=num_tokens,
        hidden_size=shape.hidden_size,
        num_experts=shape.num_experts,
        top_k=shape.topk,
        num_hosts=1,
        gpus_per_host=1,
        # The harness runs each forward's backward before the next forward.
        max_inflight=1,
    )
    configure(bootstrap_group=dist.group.WORLD, device=device, moe=moe_config)


def _liger_impls(moe_fused, inputs):
    """(inference, training) ``Impl``s of Liger's layer over the harness' inputs.

    Training: ``moe_fused`` with autograd; its forward keeps the backward's intermediates on
    NVSHMEM's symmetric stack and its backward pops them. A training forward whose backward
    never runs would leave them pushed (``max_inflight`` 1), so the fwd pass is timed on the
    no-grad path, which runs the same forward kernel and pops at once.
    """
    import torch

    from benchmarks.impls import Impl

    top_experts = inputs.top_experts.to(torch.int32).contiguous()
    tensors = {
        "x": inputs.x,
        "router_weights": inputs.router_weights.to(torch.bfloat16).contiguous(),
        "gate": inputs.gate,
        "up": inputs.up,
        "down": inputs.down,
    }
    leaves = {name: t.detach().requires_grad_(True) for name, t in tensors.items()}
    shape = inputs.shape

    def call(operands):
        return moe_fused(operands["x"], top_experts, operands["router_weights"],
                         operands["gate"], operands["up"], operands["down"],
                         shape.num_experts, shape.topk, None)  # fmt: skip

    def inference_forward():
        with torch.no_grad():
            return call(tensors), None

    def training_forward():
        out = call(leaves)
        return out, out

    def backward(out, grad_output):
        grads = torch.autograd.grad(out, list(leaves.values()), grad_output)
        return dict(zip(leaves, grads, strict=True))

    def no_backward(_state, _grad_output):
        raise RuntimeError("the no-grad forward has no backward")

    inference = Impl("liger", "LigerMoE no-grad forward", False, inference_forward, no_backward)
    training = Impl("liger", "LigerMoE autograd", False, training_forward, backward)
    return inference, training


def _load_nvshmem(availability: LigerAvailability) -> None:
    # RTLD_GLOBAL before torch: this copy (the one Liger's core was built against) is the one
    # every later lookup of the soname gets, torch's own and the core's included. Liger loads
    # the bootstrap plugin next to it itself, before NVSHMEM starts.
    ctypes.CDLL(availability.nvshmem_host, mode=ctypes.RTLD_GLOBAL)


def worker_main(job: LigerJob) -> int:
    """Measure one shape; the result file says what happened. Exits without teardown."""
    progress = peer_worker.Progress("liger", job)
    # On the harness' SIGTERM (timeout) the log gets every thread's Python stack.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    try:
        progress.stage("preload_nvshmem")
        availability = find_liger()
        if not availability.available:
            raise RuntimeError(availability.reason)
        _load_nvshmem(availability)
        progress.result["info"].update(
            site=availability.site, versions=availability.versions,
            nvshmem_host=availability.nvshmem_host, heap_gib=job.heap_gib,
        )  # fmt: skip
        progress.stage("import_torch")
        measure_shape(job, availability, progress)
        progress.done()
        code = 0
    except BaseException as error:  # the result says where it stopped and why
        progress.result.update(status="error", error=f"{type(error).__name__}: {error}")
        progress.save()
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: NVSHMEM and NCCL shutdown can hang, and a hang after the result
    # is written must not turn a finished shape into a timeout.
    os._exit(code)


def measure_shape(
    job: LigerJob, availability: LigerAvailability, progress: peer_worker.Progress
) -> None:
    """Inputs, reference, check and timing of one shape, exactly as benchmarks.moe does them."""
    import torch

    from benchmarks.shapes import scale_for_run, select_shapes

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: LigerMoE runs on Hopper or Blackwell GPUs")
    device = torch.device("cuda", job.device_index)
    torch.cuda.set_device(device)
    progress.result["info"].update(
        torch=torch.__version__, gpu=torch.cuda.get_device_name(device),
        capability=list(torch.cuda.get_device_capability(device)),
    )  # fmt: skip

    progress.stage("load_liger")
    if availability.cudart is not None:
        ctypes.CDLL(availability.cudart)  # local: it only satisfies the core's DT_NEEDED
    from liger_kernel.ops.cute.ops.moe import moe_fused

    progress.stage("configure")
    began = time.monotonic()
    shape = scale_for_run(select_shapes(job.shape)[0], world_size=1, quick=job.quick)
    _configure(device, shape, progress.num_tokens)
    progress.result["info"]["configure_s"] = round(time.monotonic() - began, 1)
    if job.gate:  # started ahead of its turn: the harness is still timing other rows
        peer_worker.wait_for_gate(job.gate, progress)

    inputs, reference = peer_worker.inputs_and_reference(job, shape, device, progress)
    inference, training = _liger_impls(moe_fused, inputs)
    impls = {"fwd": inference, "train": training}
    peer_worker.measure_passes(job, impls, inputs, reference, progress)


def main(argv: list[str] | None = None) -> int:
    """``--worker ...``: measure one shape (the harness starts it). Alone: say if Liger is here."""
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return worker_main(LigerJob.from_argv(argv))
    parser = argparse.ArgumentParser(prog="python -m benchmarks.liger", description=__doc__)
    parser.add_argument("--liger-site", default=None, help="a site dir that holds LigerMoE")
    args = parser.parse_args(argv)
    availability = find_liger(args.liger_site)
    print(json.dumps(dataclasses.asdict(availability), indent=2))
    return 0 if availability.available else 1


if __name__ == "__main__":
    sys.exit(main())
