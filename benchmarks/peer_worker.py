"""A peer's worker process: the job it gets, how it is run to its end, what its end means.

A peer layer (LigerMoE, SonicMoE) runs each shape in a process of its own, because a hang or a
native crash in a peer must cost one shape, not the run, and because a peer may need libraries
that cannot share mok's process (another NVSHMEM, another CuTe DSL). The worker rebuilds the
harness' inputs from the job, writes its result file at every stage, and the harness turns that
file and the way the process ended into the peer's rows.

Only the standard library is imported: a worker may have to load a library before torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LOG_TAIL_LINES = 12


@dataclass(frozen=True)
class PeerAvailability:
    """Where a peer is installed (``site``; ``python_path``: the worker's first paths), or why
    it cannot be used (``reason``; None when its row can be attempted)."""

    reason: str | None
    site: str | None = None
    versions: dict | None = None
    python_path: tuple[str, ...] = ()

    @property
    def available(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class PeerJob:
    """One shape for one worker: everything it needs to rebuild the harness' inputs and timing."""

    shape: str
    num_tokens: int
    quick: bool
    seed: int
    passes: tuple[str, ...]
    warmup: int
    reps: int
    device_index: int
    timeout_s: float
    result_path: str

    def argv(self) -> list[str]:
        """The worker's arguments, which ``from_argv`` reads back."""
        args = ["--worker"]
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            flag = "--" + field.name.replace("_", "-")
            if field.name == "quick":
                args += [flag] if value else []
            elif field.name == "passes":
                args += [flag, ",".join(value)]
            else:
                args += [flag, str(value)]
        return args

    @classmethod
    def from_argv(cls, argv: list[str]):
        parser = argparse.ArgumentParser(prog="worker")
        parser.add_argument("--worker", action="store_true", required=True)
        parser.add_argument("--quick", action="store_true")
        types = {"shape": str, "passes": str, "result_path": str, "timeout_s": float}
        for field in dataclasses.fields(cls):
            if field.name != "quick":
                flag = "--" + field.name.replace("_", "-")
                parser.add_argument(flag, type=types.get(field.name, int), required=True)
        values = vars(parser.parse_args(argv))
        values.pop("worker")
        values["passes"] = tuple(p for p in values["passes"].split(",") if p)
        return cls(**values)


# ─── the harness side ─────────────────────────────────────────────────────────────────────────


def stop(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the worker's process group (it dumps its stacks), SIGKILL it after a grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def log_tail(path: str) -> list[str]:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-LOG_TAIL_LINES:]


def read_result(path: str) -> dict:
    """The worker's latest result, or an empty one if it never wrote any."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {"status": "not started", "stage": "not started", "passes": {}}


def run_worker(
    peer: str,
    command_for: Callable[[str], list[str]],
    env: dict,
    timeout_s: float,
    grace_s: float,
) -> dict:
    """Run ``command_for(result_path)`` to its end or its timeout; its result, with ``failure``
    set if it failed ("<peer> timeout ...", "<peer> crashed ...", "<peer> error ..." with the
    stage it was in) and then ``log_tail``, the last lines of its output."""
    with tempfile.TemporaryDirectory(prefix=f"mok_{peer}_") as folder:
        result_path = os.path.join(folder, "result.json")
        log_path = os.path.join(folder, "worker.log")
        timed_out, began = False, time.monotonic()
        with open(log_path, "wb") as log:
            try:
                process = subprocess.Popen(
                    command_for(result_path),
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: a kill reaches its children
                )
            except OSError as error:
                return {"passes": {}, "failure": f"{peer} not started: {error}"}
            try:
                returncode = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                stop(process, grace_s)
                returncode = process.returncode
        result = read_result(result_path)
        result["returncode"] = returncode
        result["wall_s"] = round(time.monotonic() - began, 1)
        failure = describe_end(peer, result, returncode, timed_out, timeout_s)
        if failure is not None:
            result["failure"] = failure
            result["log_tail"] = log_tail(log_path)
    return result


def describe_end(
    peer: str, result: dict, returncode: int | None, timed_out: bool, timeout_s: float
) -> str | None:
    """How a worker that did not finish cleanly ended, or ``None`` if it did."""
    stage = result.get("stage", "not started")
    if timed_out:
        return f"{peer} timeout: killed after {timeout_s:.0f} s in stage {stage}"
    if result.get("status") == "error":
        return f"{peer} error in stage {stage}: {result.get('error')}"
    if returncode != 0 or result.get("status") != "done":
        how = f"signal {-returncode}" if returncode is not None and returncode < 0 else returncode
        return f"{peer} crashed (exit {how}) in stage {stage}"
    return None


def pass_outcomes(peer: str, result: dict, passes: tuple[str, ...]) -> dict[str, dict]:
    """Per pass: what the worker measured for it (status, ms, rel_err, max_rel_err), or the
    worker's failure for a pass it never reached."""
    outcomes = {}
    for pass_name in passes:
        done = result.get("passes", {}).get(pass_name)
        if done is not None:
            outcomes[pass_name] = dict(done)
        else:
            outcomes[pass_name] = {"status": result.get("failure") or f"{peer}: pass not run"}
    return outcomes


# ─── the worker side ──────────────────────────────────────────────────────────────────────────


class Progress:
    """The worker's result file, rewritten atomically at each stage: a crash leaves the last."""

    def __init__(self, peer: str, job: PeerJob):
        self.peer = peer
        self.path = job.result_path
        self.result = {"job": dataclasses.asdict(job), "status": "running", "passes": {}}
        self.result["info"] = {}

    def stage(self, name: str) -> None:
        self.result["stage"] = name
        print(f"[{self.peer} worker] {name}", flush=True)
        self.save()

    def save(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as handle:
            json.dump(self.result, handle, indent=2, default=str)
        os.replace(tmp, self.path)


def inputs_and_reference(job: PeerJob, shape, device, progress: Progress) -> tuple:
    """The harness' inputs of this shape (same seed, no shared expert) and their fp32
    reference, with gradients when a pass has a backward."""
    from benchmarks.inputs import make_inputs
    from benchmarks.reference import reference_results

    progress.stage("reference")
    inputs = make_inputs(shape, job.num_tokens, rank=0, world_size=1, device=device,
                         seed=job.seed, shared=False)  # fmt: skip
    reference = reference_results(inputs, any(p != "fwd" for p in job.passes))
    inputs.release_group_tensors()
    return inputs, reference


def measure_passes(job: PeerJob, impls: dict, inputs, reference: dict, progress: Progress) -> None:
    """Check and time a peer as benchmarks.moe does its own rows; each pass's outcome into the
    result. ``impls`` maps "fwd" and "train" to the Impl that times the forward pass and the
    one that times the passes with a backward (they may be one); "train" is checked against
    the whole reference, "fwd" against its output."""
    import torch

    from benchmarks import moe
    from benchmarks.timing import TimingConfig

    progress.stage("check")
    with_grads = any(p != "fwd" for p in job.passes)
    checks = {"fwd": moe.check(impls["fwd"], inputs, {"out": reference["out"]}, None)}
    if with_grads:
        checks["train"] = moe.check(impls["train"], inputs, reference, None)
    reference.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    timing = TimingConfig(warmup=job.warmup, reps=job.reps)
    for pass_name in job.passes:
        progress.stage(f"time_{pass_name}")
        kind = "fwd" if pass_name == "fwd" else "train"
        outcome = dict(checks[kind])
        refused = moe.refusal(checks[kind])
        if refused is not None:
            outcome["status"] = refused
        else:
            try:
                ms = moe.time_pass(impls[kind], inputs, pass_name, timing, None)
                outcome.update(status="ok", ms=ms)
            except Exception as error:  # this pass failed; the next ones still try
                outcome["status"] = f"{progress.peer} error: {type(error).__name__}: {error}"
                import traceback

                traceback.print_exc()
        progress.result["passes"][pass_name] = outcome
        progress.save()
