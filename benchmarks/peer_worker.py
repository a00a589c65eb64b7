"""A peer's worker process: the job it gets, how it is run to its end, what its end means.

A peer layer (LigerMoE, SonicMoE) runs each shape in a process of its own, because a hang or a
native crash in a peer must cost one shape and token count, not the run, and because a peer may
need libraries that cannot share mok's process (another NVSHMEM, another CuTe DSL). A job may
name several token counts of one shape: one process measures them in turn (its imports and
kernel loads paid once), and if it hangs or dies in one, the harness gives that one the failure
and starts a new process for the rest. The worker rebuilds the harness' inputs from the job,
writes a result file per token count at every stage, and the harness turns those files and
the way the process ended into the peer's rows.

Only the standard library is imported: a worker may have to load a library before torch.
"""

from __future__ import annotations

import argparse
import contextlib
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
    """One shape for one worker, at each of ``tokens`` in turn: everything it needs to rebuild
    the harness' inputs and timing. ``result_path`` is the folder of its result files
    (``result_file``)."""

    shape: str
    tokens: tuple[int, ...]
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
            elif field.name in ("passes", "tokens"):
                args += [flag, ",".join(str(v) for v in value)]
            else:
                args += [flag, str(value)]
        return args

    @classmethod
    def from_argv(cls, argv: list[str]):
        parser = argparse.ArgumentParser(prog="worker")
        parser.add_argument("--worker", action="store_true", required=True)
        parser.add_argument("--quick", action="store_true")
        types = {"shape": str, "passes": str, "tokens": str, "result_path": str, "timeout_s": float,
                 "gate": str}  # fmt: skip
        for field in dataclasses.fields(cls):
            if field.name != "quick":
                flag = "--" + field.name.replace("_", "-")
                parser.add_argument(flag, type=types.get(field.name, int), required=True)
        values = vars(parser.parse_args(argv))
        values.pop("worker")
        values["passes"] = tuple(p for p in values["passes"].split(",") if p)
        values["tokens"] = tuple(int(t) for t in values["tokens"].split(",") if t)
        return cls(**values)


def result_file(folder: str, num_tokens: int) -> str:
    """Where a worker writes its result for one token count."""
    return os.path.join(folder, f"tokens_{num_tokens}.json")


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


POLL_S = 0.5  # how often the harness looks at a running worker's result files


@dataclass
class Started:
    """A worker process started ahead of its turn (``start``): its result folder (removed by
    ``stop``), its log, and the gate file it waits for before its first GPU stage."""

    process: subprocess.Popen
    folder: tempfile.TemporaryDirectory
    log_path: str
    gate: str

    def open_gate(self) -> None:
        Path(self.gate).touch()

    def stop(self, grace_s: float) -> None:
        stop(self.process, grace_s)
        self.folder.cleanup()


def start(peer: str, command_for: Callable[[str, str], list[str]], env: dict) -> Started | str:
    """Start ``command_for(folder, gate)`` now; its worker waits for the gate file (``open_gate``)
    before its first GPU stage (``wait_for_gate``). Or why it could not start."""
    folder = tempfile.TemporaryDirectory(prefix=f"mok_{peer}_")
    log_path = os.path.join(folder.name, "worker_started.log")
    gate = os.path.join(folder.name, "gate")
    process = _start_process(peer, command_for(folder.name, gate), env, log_path)
    if isinstance(process, str):
        folder.cleanup()
        return process
    return Started(process, folder, log_path, gate)


def run_worker(
    peer: str,
    command_for: Callable[[str, tuple[int, ...]], list[str]],
    env: dict,
    timeout_s: float,
    grace_s: float,
    tokens: tuple[int, ...],
    started: Started | None = None,
) -> dict[int, dict]:
    """Run ``command_for(folder, tokens)`` until every token count has a result, each within
    ``timeout_s`` of the previous one's end (the first of a process: of its start). Per token
    count: its result, ``wall_s`` (the worker's time on it, its process start included for the
    first), and ``failure`` if it failed ("<peer> timeout ...", "<peer> crashed ...", "<peer>
    error ..." with the stage it was in) with ``log_tail``, the last lines of its process'
    output. A process that fails leaves the token counts after its failed one to a new one.
    ``started``: a process already started over ``tokens`` (``start``), whose gate opens now;
    it is the first, its time counted from here, and its folder is removed at the end."""
    results: dict[int, dict] = {}
    with contextlib.ExitStack() as stack:
        if started is not None:
            folder = started.folder.name
            stack.callback(started.folder.cleanup)
        else:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"mok_{peer}_"))
        remaining = tuple(tokens)
        while remaining:
            if started is not None:
                log_path, process = started.log_path, started.process
                started.open_gate()
                started = None  # a process after it is started here
            else:
                log_path = os.path.join(folder, f"worker_{remaining[0]}.log")
                process = _start_process(peer, command_for(folder, remaining), env, log_path)
            if isinstance(process, str):  # the process could not be started
                results.update({t: {"passes": {}, "failure": process} for t in remaining})
                break
            returncode, timed_out, finished_at, last_at = _run_process(
                process, timeout_s, grace_s, folder, remaining
            )
            for num_tokens in remaining:
                result = read_result(result_file(folder, num_tokens))
                result["returncode"] = returncode
                if num_tokens in finished_at:
                    result["wall_s"] = finished_at[num_tokens]
                    results[num_tokens] = result
                    continue
                # The first token count this process did not finish: the one it failed in.
                result["wall_s"] = last_at
                failure = describe_end(peer, result, returncode, timed_out, timeout_s)
                result["failure"] = failure or f"{peer} crashed (exit {returncode}) before the end"
                result["log_tail"] = log_tail(log_path)
                results[num_tokens] = result
                break
            remaining = tuple(t for t in remaining if t not in results)
    return results


def _start_process(peer, command, env, log_path) -> subprocess.Popen | str:
    """The worker's process, its output into ``log_path``, or why it could not start."""
    with open(log_path, "wb") as log:
        try:
            return subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a kill reaches its children
            )
        except OSError as error:
            return f"{peer} not started: {error}"


def _run_process(process, timeout_s, grace_s, folder, tokens):
    """Watch one worker process over ``tokens``: (returncode, timed out, {token count: seconds
    it took} for those finished, seconds since the last finished one or the start)."""
    last = time.monotonic()
    finished_at: dict[int, float] = {}
    timed_out = False
    try:
        while True:
            try:
                returncode = process.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                returncode = None
            now = time.monotonic()
            for num_tokens in tokens:
                if num_tokens not in finished_at and _finished(folder, num_tokens):
                    finished_at[num_tokens], last = round(now - last, 1), now
            if returncode is not None:
                break
            if now - last > timeout_s:
                timed_out = True
                stop(process, grace_s)
                returncode = process.returncode
                break
    except BaseException:  # the harness stops (a signal, an error): so does its worker
        stop(process, grace_s)
        raise
    return returncode, timed_out, finished_at, round(time.monotonic() - last, 1)


def _finished(folder: str, num_tokens: int) -> bool:
    return read_result(result_file(folder, num_tokens)).get("status") == "done"


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
    """The worker's result file for the token count it is on, rewritten atomically at each
    stage: a crash leaves the last. Stages before the first token count's (imports) go into
    that one's file, so a failure there is reported against it."""

    def __init__(self, peer: str, job: PeerJob):
        self.peer = peer
        self.job = job
        self.info: dict = {}
        self._open(job.tokens[0])

    def _open(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.path = result_file(self.job.result_path, num_tokens)
        self.started = time.monotonic()
        # stage_s: each stage's start, in seconds from this token count's (the process') start
        self.result = {"job": dataclasses.asdict(self.job), "num_tokens": num_tokens,
                       "status": "running", "passes": {}, "info": self.info,
                       "stage_s": {}}  # fmt: skip

    def begin(self, num_tokens: int) -> None:
        """Go on to ``num_tokens`` (the first one's file, with what was staged before it,
        stays open for it)."""
        if num_tokens != self.num_tokens:
            self._open(num_tokens)

    def done(self) -> None:
        """This token count is measured: its file says so (the harness watches for it)."""
        self.result["status"] = "done"
        self.stage("done")

    def stage(self, name: str) -> None:
        seconds = time.monotonic() - self.started
        self.result["stage"] = name
        self.result["stage_s"][name] = round(seconds, 1)
        print(
            f"[{self.peer} worker] {self.num_tokens} tokens: {name} at {seconds:.1f} s", flush=True
        )
        self.save()

    def save(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as handle:
            json.dump(self.result, handle, indent=2, default=str)
        os.replace(tmp, self.path)


GATE_WAIT_S = 3600.0  # the longest a started worker waits for its turn (``Started``)


def wait_for_gate(gate: str, progress: Progress, limit_s: float | None = None) -> None:
    """A worker started ahead of its turn (``start``) waits here, before its first GPU work, for
    the harness to open its gate; bounded, and it gives up if the harness is gone."""
    limit_s = GATE_WAIT_S if limit_s is None else limit_s
    progress.stage("wait_gate")
    harness, began = os.getppid(), time.monotonic()
    while not os.path.exists(gate):
        waited = time.monotonic() - began
        if os.getppid() != harness:
            raise RuntimeError(f"the harness (pid {harness}) ended before opening gate {gate}")
        if waited > limit_s:
            raise TimeoutError(f"gate {gate} not opened by the harness (pid {harness}) "
                               f"within {limit_s:.0f} s")  # fmt: skip
        time.sleep(0.02)
    progress.info["gate_wait_s"] = round(time.monotonic() - began, 1)


def inputs_and_reference(job: PeerJob, shape, device, progress: Progress) -> tuple:
    """The harness' inputs of this shape at the token count ``progress`` is on (same seed, no
    shared expert) and their fp32 reference, with gradients when a pass has a backward."""
    from benchmarks.inputs import make_inputs
    from benchmarks.reference import reference_results

    progress.stage("reference")
    inputs = make_inputs(shape, progress.num_tokens, rank=0, world_size=1, device=device,
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
