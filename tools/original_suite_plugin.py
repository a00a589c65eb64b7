"""pytest plugin that tools/original_suite.py loads (`-p original_suite_plugin`) into each run.

It does two things and nothing else, both driven by the JSON plan whose path the runner puts in
MOK_ORIGINAL_SUITE_PLAN:

- refuses to run (pytest.UsageError) when `mok` would be imported from anywhere but the mok
  checkout named in the plan, so a user's copy of the original can never be what is tested;
- for the test nodes the plan names, wraps the test module's `shapes(world_size)` so that rows
  whose routed weights (times the copies that test keeps alive) exceed the plan's memory budget
  are dropped, and, where the plan says `fit_schedule`, the rows whose routed rows cannot fit
  one rank's schedule (`fits_one_rank`), printing each dropped row. Assertions, tolerances and
  expected exceptions are never touched: the test runs its own code on fewer input shapes.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

PLAN_ENV = "MOK_ORIGINAL_SUITE_PLAN"
BF16_BYTES = 2


def _plan(config: pytest.Config) -> dict | None:
    # Read once per session at configure time (never at import), and kept on the config.
    plan = getattr(config, "_mok_original_suite_plan", None)
    if plan is None:
        path = os.environ.get(PLAN_ENV)
        if not path:
            return None
        plan = json.loads(Path(path).read_text())
        config._mok_original_suite_plan = plan
    return plan


def pytest_configure(config: pytest.Config) -> None:
    plan = _plan(config)
    if plan is None:
        return
    spec = importlib.util.find_spec("mok")
    # find_spec locates the package without running its __init__, so this check costs nothing.
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    expected_root = Path(plan["mok_root"]).resolve()
    if origin is None or expected_root not in origin.parents:
        raise pytest.UsageError(
            f"import mok resolves to {origin}, expected a file under {expected_root}/mok: "
            "something on sys.path (the checkout's own mok/?) shadows the mok under test"
        )
    print(f"original-suite: import mok -> {origin}", flush=True)


def routed_weight_bytes(row: tuple, world_size: int) -> int:
    """Bytes of one rank's bf16 routed weights (gate, up: I x H; down: H x I) for a shapes() row.

    A row is the original's (name, routed experts, hidden, intermediate, top-k, local tokens).
    """
    _, num_experts, hidden_size, intermediate_size, _, _ = row
    num_local_experts = num_experts // world_size
    return 3 * num_local_experts * hidden_size * intermediate_size * BF16_BYTES


# The schedule's expert segments are padded to this many rows (mok's sm_90a tile; the
# original's is 256) and hold at most 2 T k rows at EP size 1 (max(2, ceil(P m)) T k, P = 1).
ROUTED_ROW_ALIGNMENT = 128
MIN_CAPACITY_FACTOR = 2


def fits_one_rank(row: tuple, world_size: int) -> bool:
    """Whether a shapes() row's routing can fit one rank's schedule: False when each of the
    rank's experts, taking at least one padded tile, already needs more rows than the
    smallest capacity the original's rule gives (2 T k). The rows of the original's table
    route T k >= E rows over E experts at random, so every expert receives rows."""
    _, num_experts, _, _, topk, num_local_tokens = row
    num_local_experts = num_experts // world_size
    capacity = MIN_CAPACITY_FACTOR * num_local_tokens * topk
    return num_local_experts * ROUTED_ROW_ALIGNMENT <= capacity


def _reduced_shapes(
    original_shapes, node_id: str, weight_copies: int, budget_bytes: int, fit_schedule: bool
):
    def shapes(world_size: int):
        kept = []
        for row in original_shapes(world_size):
            if not (isinstance(row, tuple) and len(row) == 6 and isinstance(row[0], str)):
                raise pytest.UsageError(
                    f"{node_id}: shapes() row {row!r} is not (name, experts, hidden, intermediate, "
                    "topk, tokens); the original changed, update tools/original_suite.py's table"
                )
            if fit_schedule and not fits_one_rank(row, world_size):
                _, num_experts, _, _, topk, tokens = row
                print(
                    f"original-suite: shape {row[0]!r} dropped: {num_experts // world_size} "
                    f"experts x {ROUTED_ROW_ALIGNMENT} rows > the schedule's "
                    f"{MIN_CAPACITY_FACTOR} x {tokens} x {topk} at EP size {world_size}",
                    flush=True,
                )
                continue
            need = weight_copies * routed_weight_bytes(row, world_size)
            if need > budget_bytes:
                print(
                    f"original-suite: shape {row[0]!r} dropped: {weight_copies} x routed weights "
                    f"= {need / 2**30:.1f} GiB > budget {budget_bytes / 2**30:.1f} GiB",
                    flush=True,
                )
                continue
            kept.append(row)
        return tuple(kept)

    return shapes


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    plan = _plan(config)
    if plan is None:
        return
    reductions = plan.get("reduce_shapes", {})
    for item in items:
        reduction = reductions.get(item.nodeid)
        if reduction is None:
            continue
        module = item.module
        original_shapes = getattr(module, "shapes", None)
        if not callable(original_shapes):
            raise pytest.UsageError(
                f"{item.nodeid}: the shape reduction expects a module-level shapes(world_size) "
                f"in {module.__name__}, found {original_shapes!r}; the original changed, update "
                "tools/original_suite.py's table"
            )
        module.shapes = _reduced_shapes(
            original_shapes,
            item.nodeid,
            reduction["weight_copies"],
            reduction["budget_bytes"],
            reduction.get("fit_schedule", False),
        )
