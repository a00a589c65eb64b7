"""Run the original MoK's own tests against this mok, one process per test, at EP size 1.

    python tools/original_suite.py PATH_TO_ORIGINAL_CHECKOUT [--only PATTERN ...] [--timeout S]
                                   [--json OUT] [--list] [--strict] [--memory-budget-gib G]
                                   [--budget-s S]

PATH_TO_ORIGINAL_CHECKOUT is a checkout of the original (Godofnothing/mixture-of-kittens) with
its tests/ folder. Nothing of it is copied into this repository: the runner reads the tests
where they are, or from a temporary copy of tests/ when the checkout has its own mok/ package,
since pytest puts the checkout's root first on sys.path and its mok would shadow this one. In
every run a plugin (tools/original_suite_plugin.py) refuses to start unless `import mok`
resolves to this repository's mok.

The original runs its tests under `torchrun --nproc-per-node=<ep-size> -m pytest -s`; its
`context` fixture reads RANK, WORLD_SIZE and LOCAL_RANK. The runner sets them for one rank
(EP size 1) with a free MASTER_PORT, plus NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1
and NVSHMEM_DISABLE_NVLS=1, and runs `python -m pytest -x -q -s NODE` for each collected node
in its own process, killing its process group after --timeout seconds (default 1800).

Only the EP-size-1 adaptations in ORIGINAL_ADAPTATIONS are applied, each with its reason:
a node that needs a larger EP group is not run (counted as "skipped (EP >= 2)"), and the
tests that loop over the original's shapes(world_size) table drop the rows whose routed
weights, times the copies the test keeps alive, exceed --memory-budget-gib (default 0.4 of the
GPU's memory; at EP size 1 one rank holds every expert). No assertion, tolerance or expected
exception is changed. The documented differences from the original (README) are not adapted;
the runner only names them beside a failing node (KNOWN_DIFFERENCES).

--list prints the collected nodes with the adaptation each gets and runs nothing. --only keeps
the nodes whose id contains the text or matches it as a glob. --json writes every record.
The last line printed is the summary, e.g.
    original suite: 15 passed, 3 failed, 5 skipped (EP >= 2), 0 timed out of 23 (mok 0.1.0, ab12cd3)
The exit status is 0 when the suite ran, whatever its outcomes; with --strict it is 1 when any
node failed, errored or timed out. A checkout or collection that cannot be used exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOLS_DIR = Path(__file__).resolve().parent
PLUGIN_MODULE = "original_suite_plugin"
PLAN_ENV = "MOK_ORIGINAL_SUITE_PLAN"

# The budget for the routed-weight copies a test keeps, as a share of the GPU's memory: the
# rest is the test's activations, fp32 references and mok's workspace. On an 80 GB H100 the
# rows admitted at 0.88 of its memory ran out of memory and at 0.38 ran; on a machine without
# a GPU (nothing runs there) the share of an H200's 139 GiB.
DEFAULT_MEMORY_BUDGET_FRACTION = 0.4
NO_GPU_MEMORY_GIB = 139.0


def default_memory_budget_gib() -> float:
    """DEFAULT_MEMORY_BUDGET_FRACTION of the first CUDA device's memory."""
    total_gib = NO_GPU_MEMORY_GIB
    with contextlib.suppress(Exception):
        import torch  # noqa: PLC0415

        if torch.cuda.is_available():
            total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return round(DEFAULT_MEMORY_BUDGET_FRACTION * total_gib, 1)


DEFAULT_TIMEOUT_S = 1800.0
# Under --budget-s, a node is started only with at least this much of the budget left.
MIN_NODE_S = 15.0
TAIL_LINES = 15
# Outcomes of a node that ran and did not pass: each is explained as it happens.
FAILING = ("failed", "error", "timeout")

# Multicast off: the machines mok is tested on do not allow NVLink multicast (NVLS).
RUN_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class SuiteError(RuntimeError):
    """The checkout or its collection cannot be used; the message says what was found."""


@dataclass(frozen=True)
class Adaptation:
    """One EP-size-1 adaptation: which nodes (glob on the node id), what changes and why.

    action "skip": the node is not run; `category` names why in the summary ("EP >= 2").
    action "reduce_shapes": the node runs with the rows of its module's shapes(world_size) whose
    `weight_copies` x (one rank's bf16 routed weights) exceed the memory budget dropped, and,
    with `fit_schedule`, the rows whose routed rows cannot fit one rank's schedule at EP size 1
    (tools/original_suite_plugin.py `fits_one_rank`).
    """

    pattern: str
    action: str
    reason: str
    category: str = ""
    weight_copies: int = 0
    fit_schedule: bool = False

    def __post_init__(self) -> None:
        if self.action not in ("skip", "reduce_shapes"):
            raise ValueError(
                f"Adaptation.action must be 'skip' or 'reduce_shapes', got {self.action!r} "
                f"(pattern {self.pattern!r})"
            )
        if self.action == "skip" and not self.category:
            raise ValueError(f"Adaptation {self.pattern!r}: a skip needs a category, got ''")
        if self.action == "reduce_shapes" and self.weight_copies < 1:
            raise ValueError(
                f"Adaptation {self.pattern!r}: weight_copies must be >= 1 for reduce_shapes, "
                f"got {self.weight_copies}"
            )

    def describe(self) -> str:
        if self.action == "skip":
            return f"skip ({self.category}): {self.reason}"
        fit = "; rows that cannot fit one rank's schedule" if self.fit_schedule else ""
        return (
            f"shapes reduced ({self.weight_copies} x routed weights > budget{fit}): {self.reason}"
        )


# The copies are read off each test's loop: at EP size 1 "W" = 3 E H I bf16 bytes, all experts.
# A loop keeps the previous shape's inputs and results alive until the next ones are assigned,
# so the peak holds both shapes' tensors. Estimates, to be confirmed on the GPU
# (--memory-budget-gib raises the budget to try a dropped shape).
_PREV_AND_NEW = "the loop holds the previous shape's tensors while it makes the next shape's"
# The layer tests also drop the rows whose routed rows cannot fit one rank at EP size 1: there
# one rank receives all T * k rows of all E experts, and the schedule holds 2 T k of them (the
# original's capacity, max(2, ceil(P * multiplier)) T k, at P = 1), while every expert that
# receives a row takes at least one 128-row tile (256 in the original): with E * 128 > 2 T k
# ("Minimum top-k", "Minimum local tokens", "Local tokens 1024" and "Local tokens 16384": 384
# experts) neither implementation fits; at the EP sizes the original runs them, each rank
# holds E / P experts.
_FITS = "and rows whose routed rows cannot fit one rank (E * 128 > 2 T k)"
_TOPK_OF_FOUR = (
    "asks top-k of 4 x EP size experts with k up to 8 (torch.topk fails before mok runs at "
    "EP size 1)"
)
ORIGINAL_ADAPTATIONS: tuple[Adaptation, ...] = (
    Adaptation(
        "tests/test_misc.py::test_ep_subgroups_do_not_use_world",
        "skip",
        "needs a world of >= 8 ranks divisible by 4 (two EP subgroups of 4); "
        "it skips itself at EP size 1",
        category="EP >= 2",
    ),
    Adaptation(
        "tests/test_misc.py::test_e2e_fixed_first_topk_experts_default_capacity",
        "skip",
        "routes every token to experts 0..7 of its 4 x EP size experts: needs EP size >= 2",
        category="EP >= 2",
    ),
    Adaptation(
        "tests/test_misc.py::test_e2e_requested_shapes_and_local_expert_counts",
        "skip",
        f"{_TOPK_OF_FOUR}: its first cases need EP size >= 2",
        category="EP >= 2",
    ),
    Adaptation(
        "tests/test_misc.py::test_e2e_different_topk",
        "skip",
        f"{_TOPK_OF_FOUR}: its top-6 and top-8 cases need EP size >= 2",
        category="EP >= 2",
    ),
    Adaptation(
        "tests/test_misc.py::test_e2e_finiteness_different_seeds",
        "skip",
        f"{_TOPK_OF_FOUR}: top-8 needs EP size >= 2",
        category="EP >= 2",
    ),
    Adaptation(
        "tests/test_misc.py::test_workspace_cache_reuse_and_isolation",
        "skip",
        "expects its schedule_capacity_multiplier 0.5 and 1.5 workspaces to differ, but both "
        "give capacity max(2, ceil(P * m)) T k = 2 T k at EP size 1, the cache's key in the "
        "original as in mok: needs EP size >= 2",
        category="EP >= 2",
    ),
    Adaptation(
        "tests/test_functional.py::test_forward_bf16",
        "reduce_shapes",
        f"inputs W; {_PREV_AND_NEW}; {_FITS}",
        weight_copies=2,
        fit_schedule=True,
    ),
    Adaptation(
        "tests/test_ops.py::test_dispatch_mlp_swiglu_combine_fwd_bf16",
        "reduce_shapes",
        f"inputs W; {_PREV_AND_NEW}; {_FITS}",
        weight_copies=2,
        fit_schedule=True,
    ),
    Adaptation(
        "tests/test_functional.py::test_forward_mxfp8",
        "reduce_shapes",
        f"inputs W, MXFP8 weights W/2, mok's bf16 dequantised copy W; {_PREV_AND_NEW}; {_FITS}",
        weight_copies=3,
        fit_schedule=True,
    ),
    Adaptation(
        "tests/test_ops.py::test_dispatch_mlp_swiglu_combine_fwd_mxfp8",
        "reduce_shapes",
        f"inputs W, MXFP8 weights W/2, mok's bf16 dequantised copy W; {_PREV_AND_NEW}; {_FITS}",
        weight_copies=3,
        fit_schedule=True,
    ),
    Adaptation(
        "tests/test_ops.py::test_mxfp8_quantize",
        "reduce_shapes",
        "quantises one [E, I, H] weight at a time but its fp32 reference makes ~4 fp32 copies "
        "(8 bf16 matrices = ~3 W)",
        weight_copies=3,
    ),
    Adaptation(
        "tests/test_functional.py::test_backward_bf16",
        "reduce_shapes",
        f"inputs W, mok's weight gradients W, the reference's W; {_PREV_AND_NEW}; {_FITS}",
        weight_copies=4,
        fit_schedule=True,
    ),
    Adaptation(
        "tests/test_ops.py::test_dispatch_mlp_swiglu_combine_bwd_bf16",
        "reduce_shapes",
        f"inputs W, mok's weight gradients W, the reference's W; {_PREV_AND_NEW}; {_FITS}",
        weight_copies=4,
        fit_schedule=True,
    ),
    Adaptation(
        "tests/test_functional_e2e.py::test_e2e_bf16",
        "reduce_shapes",
        f"inputs W, mok's weight gradients W, the reference's W; {_PREV_AND_NEW}; {_FITS}",
        weight_copies=4,
        fit_schedule=True,
    ),
    Adaptation(
        "tests/test_functional.py::test_backward_mxfp8",
        "reduce_shapes",
        "inputs W, MXFP8 weights and their transposes W, mok's dequantised copy W, "
        f"two gradient sets 2 W; {_PREV_AND_NEW}; {_FITS}",
        weight_copies=6,
        fit_schedule=True,
    ),
    Adaptation(
        "tests/test_ops.py::test_dispatch_mlp_swiglu_combine_bwd_mxfp8",
        "reduce_shapes",
        "inputs W, MXFP8 weights and their transposes W, mok's dequantised copy W, "
        f"two gradient sets 2 W; {_PREV_AND_NEW}; {_FITS}",
        weight_copies=6,
        fit_schedule=True,
    ),
    Adaptation(
        "tests/test_functional_e2e.py::test_e2e_mxfp8",
        "reduce_shapes",
        "inputs W, MXFP8 weights and their transposes W, mok's dequantised copy W, "
        f"two gradient sets 2 W; {_PREV_AND_NEW}; {_FITS}",
        weight_copies=6,
        fit_schedule=True,
    ),
)

# Named beside a node that does not pass; never used to skip or change a test.
KNOWN_DIFFERENCES: dict[str, str] = {
    "tests/test_functional.py::test_build_schedule": (
        "documented difference: mok pads expert segments to 128 rows, the original's "
        "reference to 256"
    ),
    "tests/test_ops.py::test_schedule": (
        "documented difference: mok pads expert segments to 128 rows, the original's "
        "reference to 256"
    ),
    "tests/test_ops.py::test_all_gather_top_experts": (
        "documented difference: mok's multicast pointers are 0 and never used, so the test's "
        "'multicast pointer 0' case does not raise; and at EP size 1 its 'All minimums' row "
        "has one expert, every id 0, whose relative error the test takes as 0 / 0"
    ),
    "tests/test_misc.py::test_compile_fullgraph": (
        "documented difference: mok's graph holds mok.build_schedule, mok.forward and "
        "mok.backward, not the raw ops in sequence"
    ),
    "tests/test_misc.py::test_fake_tensor_metadata": (
        "documented difference: the raw ops' routed context holds the schedule's capacity "
        "rows, not macrobatch_size rows"
    ),
    "tests/test_ops.py::test_bwd_epilogue": (
        "documented difference: mok takes any num_local_tokens, so a shared d_x of fewer rows "
        "is read as a larger k, not refused"
    ),
}


@dataclass
class NodeRecord:
    node: str
    outcome: str  # passed, failed, skipped, timeout, error
    seconds: float
    adaptation: str  # the adaptation's description, '' when none
    detail: str  # the skip reason, or the last telling line of the output
    tail: str  # the last TAIL_LINES lines of the node's output
    skip_category: str = ""  # why it was skipped, for the summary: "EP >= 2", "by the test"


def matching_adaptation(node: str, adaptations: Sequence[Adaptation]) -> Adaptation | None:
    """The first adaptation whose pattern is the node id or a glob matching it."""
    for adaptation in adaptations:
        if fnmatch.fnmatchcase(node, adaptation.pattern):
            return adaptation
    return None


def _selected(node: str, only: Sequence[str]) -> bool:
    return not only or any(text in node or fnmatch.fnmatchcase(node, text) for text in only)


@contextlib.contextmanager
def suite_root(checkout: Path) -> Iterator[tuple[Path, str]]:
    """The folder to run pytest in (a copy of the checkout's tests/, always: its node ids then
    read tests/... wherever the checkout lies, also under a folder whose own pytest settings
    would make pytest's rootdir), and a note when the copy also keeps the checkout's mok off
    the path."""
    tests_dir = checkout / "tests"
    if not tests_dir.is_dir():
        raise SuiteError(f"checkout {checkout}: expected a tests/ folder in it, found none")
    shadows = (checkout / "mok").exists() or (checkout / "mok.py").exists()
    with tempfile.TemporaryDirectory(prefix="mok-original-suite-") as tmp:
        workdir = Path(tmp)
        # A copy, not a symlink: pytest may resolve a symlinked tests/ back into the checkout,
        # whose root it would then put ahead of this mok on sys.path.
        shutil.copytree(tests_dir, workdir / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("conftest.py", "pytest.ini"):
            if (checkout / name).is_file():
                shutil.copy2(checkout / name, workdir / name)
        if not (workdir / "pytest.ini").exists():
            # Pins pytest's rootdir here, so node ids read tests/... as in the checkout.
            (workdir / "pytest.ini").write_text("[pytest]\n")
        note = ""
        if shadows:
            note = (f"{checkout}/mok exists: running a copy of its tests/ from {workdir} "
                    f"so that import mok is {REPO_ROOT / 'mok'}")  # fmt: skip
        yield workdir, note


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _base_env(plan_path: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    # This mok first, then the plugin; the checkout is never put on the path by the runner.
    paths = [str(REPO_ROOT), str(TOOLS_DIR)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(RUN_ENV)
    if plan_path is not None:
        env[PLAN_ENV] = str(plan_path)
    return env


def _pytest_command(*args: str) -> list[str]:
    # No cache provider: nothing is written into the user's checkout.
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", PLUGIN_MODULE, *args]


def collect(workdir: Path, env: dict[str, str], timeout_s: float) -> list[str]:
    """The node ids pytest collects under workdir/tests."""
    command = _pytest_command("--collect-only", "-q", "tests")
    try:
        done = subprocess.run(
            command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as error:
        raise SuiteError(f"collection in {workdir} took more than {timeout_s} s") from error
    nodes = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if done.returncode != 0 or not nodes:
        output = (done.stdout + done.stderr).strip().splitlines()
        raise SuiteError(
            f"collection in {workdir} failed (pytest exit {done.returncode}, expected 0 with "
            f"nodes; got {len(nodes)} nodes):\n" + "\n".join(output[-30:])
        )
    return nodes


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|error|errors|xfailed|xpassed)\b")


def outcome_from_output(output: str, returncode: int) -> str:
    """passed / failed / skipped / error from pytest's last summary line and exit status."""
    counts: Counter[str] = Counter()
    for line in reversed(output.splitlines()):
        found = _COUNT.findall(line)
        if found:
            for number, word in found:
                counts[word.rstrip("s") if word.startswith("error") else word] += int(number)
            break
    if counts["failed"] or counts["xpassed"]:
        return "failed"
    if counts["error"] or returncode not in (0, 1):
        return "error"
    if counts["passed"] or counts["xfailed"]:
        return "passed"
    if counts["skipped"]:
        return "skipped"
    return "error"


def _detail_line(output: str, outcome: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if outcome == "skipped":
        reasons = [line for line in lines if line.startswith("SKIPPED")]
        return reasons[-1] if reasons else ""
    if outcome in ("failed", "error"):
        # The first "E" line is the exception pytest reports, whole; the short summary line
        # ("FAILED node - ...") is cut to the terminal's width.
        raised = [line.removeprefix("E").strip() for line in lines if line.startswith("E ")]
        if raised:
            return raised[0]
        summary = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        if summary:
            return summary[-1]
    return lines[-1] if lines else ""


def run_node(node: str, workdir: Path, env: dict[str, str], timeout_s: float) -> NodeRecord:
    """One node in its own process (and process group, so a timeout kills all it started)."""
    node_env = dict(env)
    # One rank of a world of one: what torchrun --nproc-per-node=1 would set.
    node_env.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        # Wide enough that pytest's skip and failure summary lines are not cut.
        COLUMNS="250",
    )
    command = _pytest_command("-x", "-q", "-s", "-rfEs", node)
    start = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=workdir,
        env=node_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
        outcome = outcome_from_output(output, process.returncode)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        outcome = "timeout"
    seconds = time.monotonic() - start
    detail = f"killed after {timeout_s:g} s" if outcome == "timeout" else ""
    detail = detail or _detail_line(output, outcome)
    tail = "\n".join(output.rstrip().splitlines()[-TAIL_LINES:])
    return NodeRecord(node, outcome, round(seconds, 2), "", detail, tail)


def mok_identity() -> tuple[str, str]:
    """(mok's version, short git commit with -dirty when tracked files changed, or '')."""
    version = "unknown"
    init = (REPO_ROOT / "mok" / "__init__.py").read_text()
    found = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", init, re.MULTILINE)
    if found:
        version = found.group(1)
    commit = ""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        git = ["git", "-C", str(REPO_ROOT)]
        commit = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        if status.strip():
            commit += "-dirty"
    return version, commit


def summary_line(records: Sequence[NodeRecord], version: str, commit: str) -> str:
    counts = Counter(record.outcome for record in records)
    categories = Counter(record.skip_category for record in records if record.outcome == "skipped")
    skipped = f"{counts['skipped']} skipped"
    if len(categories) == 1:
        skipped += f" ({next(iter(categories))})"
    elif categories:
        skipped += " (" + ", ".join(f"{n} {why}" for why, n in sorted(categories.items())) + ")"
    parts = [f"{counts['passed']} passed", f"{counts['failed']} failed", skipped]
    parts.append(f"{counts['timeout']} timed out")
    if counts["error"]:
        parts.append(f"{counts['error']} errors")
    if counts["not run"]:
        parts.append(f"{counts['not run']} not run (time budget)")
    return f"original suite: {', '.join(parts)} of {len(records)} ({_identity(version, commit)})"


def _identity(version: str, commit: str) -> str:
    return f"mok {version}" + (f", {commit}" if commit else "")


def format_table(records: Sequence[NodeRecord]) -> str:
    width = max((len(record.node) for record in records), default=4)
    lines = [f"{'outcome':<8} {'seconds':>8}  {'node':<{width}}  detail"]
    for record in records:
        note = record.detail
        if record.adaptation and record.outcome != "skipped":
            note = f"[{record.adaptation.split(':')[0]}] {note}"
        lines.append(f"{record.outcome:<8} {record.seconds:>8.1f}  {record.node:<{width}}  {note}")
    return "\n".join(lines)


@dataclass
class SuiteResult:
    records: list[NodeRecord]
    summary: str
    workdir_note: str
    nodes: list[str]


def run_suite(
    checkout: Path | str,
    *,
    adaptations: Sequence[Adaptation] = ORIGINAL_ADAPTATIONS,
    known_differences: dict[str, str] | None = None,
    only: Sequence[str] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_budget_gib: float | None = None,
    list_only: bool = False,
    budget_s: float | None = None,
    log: Callable[[str], None] = print,
) -> SuiteResult:
    """Collect the checkout's tests, then run each selected node in its own process."""
    checkout = Path(checkout).resolve()
    if not checkout.is_dir():
        raise SuiteError(f"checkout must be a folder, got {checkout} (not a folder)")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if budget_s is not None and budget_s <= 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s}")
    deadline = None if budget_s is None else time.monotonic() + budget_s
    if memory_budget_gib is None:
        memory_budget_gib = default_memory_budget_gib()
    if memory_budget_gib <= 0:
        raise ValueError(f"memory_budget_gib must be > 0, got {memory_budget_gib}")
    known_differences = KNOWN_DIFFERENCES if known_differences is None else known_differences
    version, commit = mok_identity()
    budget_bytes = int(memory_budget_gib * 2**30)

    with suite_root(checkout) as (workdir, note), tempfile.TemporaryDirectory() as plan_dir:
        if note:
            log(f"note: {note}")
        plan_path = Path(plan_dir) / "plan.json"
        plan_path.write_text(json.dumps({"mok_root": str(REPO_ROOT), "reduce_shapes": {}}))
        env = _base_env(plan_path)
        nodes = [node for node in collect(workdir, env, timeout_s) if _selected(node, only)]
        if only and not nodes:
            raise SuiteError(f"--only {list(only)} matched none of the collected nodes")

        plan = {"mok_root": str(REPO_ROOT), "reduce_shapes": {}}
        records: list[NodeRecord] = []
        for node in nodes:
            adaptation = matching_adaptation(node, adaptations)
            label = adaptation.describe() if adaptation else ""
            if list_only:
                log(f"{node}  {label}".rstrip())
                continue
            left = None if deadline is None else deadline - time.monotonic()
            if adaptation is not None and adaptation.action == "skip":
                record = NodeRecord(
                    node, "skipped", 0.0, label, adaptation.reason, "", adaptation.category
                )
            elif left is not None and left < MIN_NODE_S:
                record = NodeRecord(
                    node, "not run", 0.0, label, "the run's time budget ran out", ""
                )
            else:
                plan["reduce_shapes"] = {}
                if adaptation is not None:
                    plan["reduce_shapes"][node] = {
                        "weight_copies": adaptation.weight_copies,
                        "budget_bytes": budget_bytes,
                        "fit_schedule": adaptation.fit_schedule,
                    }
                plan_path.write_text(json.dumps(plan))
                record = run_node(
                    node, workdir, env, timeout_s if left is None else min(timeout_s, left)
                )
                record.adaptation = label
                if record.outcome == "skipped":
                    record.skip_category = "by the test"
                if record.outcome != "passed" and node in known_differences:
                    record.detail = f"{known_differences[node]} | {record.detail}"
            records.append(record)
            log(f"{record.outcome:<8} {record.seconds:>7.1f}s  {node}")
            # A failure's reason as it happens: a run cut short still shows why each node failed.
            if record.outcome in FAILING:
                log(f"    {record.detail}")
                log(textwrap.indent(record.tail, "    | "))

    summary = summary_line(records, version, commit)
    if list_only:
        summary = f"original suite: {len(nodes)} nodes collected ({_identity(version, commit)})"
    return SuiteResult(records, summary, note, nodes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the original MoK's tests against this mok at EP size 1, one process "
        "per test.",
    )
    parser.add_argument("checkout", type=Path, help="a checkout of the original, with tests/")
    parser.add_argument(
        "--only", nargs="+", default=[], metavar="NAME", help="run nodes containing/matching NAME"
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a node")
    parser.add_argument(
        "--budget-s",
        type=float,
        help="seconds for the whole run: a node gets at most what is left, none starts with "
        f"under {MIN_NODE_S:g} s left (recorded 'not run'), and the table and JSON still come",
    )
    parser.add_argument("--json", type=Path, help="write every record to this JSON file")
    parser.add_argument("--list", action="store_true", help="list the nodes and adaptations")
    parser.add_argument("--strict", action="store_true", help="exit 1 on any non-pass, non-skip")
    parser.add_argument(
        "--memory-budget-gib",
        type=float,
        default=None,
        help="GPU memory a reduce_shapes test may plan its weight copies for (default: "
        f"{DEFAULT_MEMORY_BUDGET_FRACTION} of the GPU's memory)",
    )
    args = parser.parse_args(argv)
    if args.memory_budget_gib is None:
        args.memory_budget_gib = default_memory_budget_gib()
    try:
        result = run_suite(
            args.checkout,
            only=args.only,
            timeout_s=args.timeout,
            memory_budget_gib=args.memory_budget_gib,
            list_only=args.list,
            budget_s=args.budget_s,
        )
    except (SuiteError, ValueError) as error:
        print(f"original suite: not run: {error}", file=sys.stderr)
        return 2
    if not args.list:
        print()
        print(format_table(result.records))
    if args.json is not None:
        version, commit = mok_identity()
        payload = {
            "summary": result.summary,
            "mok_version": version,
            "mok_commit": commit,
            "checkout": str(args.checkout.resolve()),
            "workdir_note": result.workdir_note,
            "memory_budget_gib": args.memory_budget_gib,
            "timeout_s": args.timeout,
            "adaptations": [asdict(adaptation) for adaptation in ORIGINAL_ADAPTATIONS],
            "records": [asdict(record) for record in result.records],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(result.summary)
    if args.strict and any(record.outcome in (*FAILING, "not run") for record in result.records):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
