"""The EP benchmarks on CPU: peer traffic per pass (benchmarks/ep_traffic.py) and the settings
sweep (benchmarks/ep_sweep.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from ep_worker import run_on_gloo_group

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (not installed)

from benchmarks import ep_traffic, moe, report  # noqa: E402


def test_remote_rows_count_only_rows_that_leave_their_rank():
    # Two ranks, two experts each: owner = expert // 2.
    rank0 = torch.tensor([[0, 1], [1, 1]])  # three of rank 0's rows go to rank 1
    rank1 = torch.tensor([[0, 0], [1, 0]])  # three of rank 1's rows go to rank 0
    assert ep_traffic.remote_rows_per_rank([rank0, rank1], 2) == [3, 3]
    # Three ranks: rank 2 gets rows from both others, rank 0 none; local rows never count.
    owners = [torch.tensor([0, 2, 2]), torch.tensor([1, 1, 2]), torch.tensor([2, 2, 1])]
    assert ep_traffic.remote_rows_per_rank(owners, 3) == [0, 1, 3]


def test_pass_bytes_are_rows_pulled_and_pushed():
    h = 2048
    got = ep_traffic.pass_bytes(10, h)
    assert got["fwd"] == 10 * (h * 2 + h * 2)  # x pulled, y pushed (bf16)
    assert got["bwd"] == 10 * (h * 2 + h * 2 + 4 + 4)  # dY, d_x (bf16); weight, d_router (fp32)
    assert got["fwdbwd"] == got["fwd"] + got["bwd"]


def _traffic_worker(rank, world_size, top_experts_all, num_local_experts, hidden_size):
    import torch.distributed as dist  # noqa: PLC0415

    return ep_traffic.rank_pass_bytes(top_experts_all[rank], num_local_experts, hidden_size,
                                      dist.group.WORLD)  # fmt: skip


def test_rank_pass_bytes_is_the_busiest_rank_on_every_rank():
    generator = torch.Generator().manual_seed(3)
    world_size, tokens, topk, num_local_experts, hidden = 2, 40, 4, 3, 256
    scores = torch.rand(world_size, tokens, world_size * num_local_experts, generator=generator)
    scores[1, :, :num_local_experts] += 1.0  # rank 1's tokens all go to rank 0's experts
    top = scores.topk(topk, dim=-1).indices
    results = run_on_gloo_group(_traffic_worker, world_size, top, num_local_experts, hidden)
    rows = ep_traffic.remote_rows_per_rank(list(top // num_local_experts), world_size)
    # Each of rank 1's tokens picks all three of rank 0's experts: rank 0 is the busiest.
    assert rows[0] == tokens * num_local_experts > rows[1]
    want = ep_traffic.pass_bytes(rows[0], hidden)
    assert results == [want, want]


def test_an_ep_row_shows_its_peer_traffic_beside_the_peer_copy_bandwidth():
    ceilings = {"peer_copy_gbs": 400.0}
    fields = moe.ep_traffic_fields(8_000_000, 0.1, ceilings)
    assert fields["peer_gbs"] == 80.0 and fields["pct_of_peer_copy"] == 20.0
    row = {
        "shape": {"name": "qwen3-30b-a3b", "num_experts": 64, "hidden_size": 2048,
                  "intermediate_size": 768, "topk": 8},
        "num_tokens": 16384, "pass": "fwd", "impl": "mok", "status": "ok", "ms": 0.1,
        "tflops": 100.0, "max_rel_err": 1e-3, **fields,
    }  # fmt: skip
    assert "peers 8.0 MB 80 GB/s (20% of peer copy)" in report.format_row(row)
    line = report.ceilings_line({
        "gemm_bf16_size": 8192, "gemm_bf16_tflops": 800.0, "gemm_bf16_sustained_tflops": 660.0,
        "copy_gbs": 3000.0, **ceilings,
    })  # fmt: skip
    assert line.endswith("peer copy 400 GB/s (written to the next rank)")


def test_sweep_times_only_settings_whose_outputs_equal_the_defaults():
    from benchmarks import ep_sweep  # noqa: PLC0415

    base = {"out": torch.ones(4)}
    timed, closed = [], []

    def runs(settings):
        value = settings.get("minibatch_size")
        if value == 300:
            raise ValueError("MoKConfig.minibatch_size must be a positive multiple of 256")
        outputs = {"out": base["out"] * (2 if value == 512 else 1)}

        def time(pass_name):
            timed.append((value, pass_name))
            return {None: 5.0, 256: 3.0, 768: 4.0}[value]

        return outputs, time, lambda: closed.append(value)

    values = {"minibatch_size": ((256, 300, 512, 768), "fwdbwd")}
    rows = ep_sweep.sweep_shape(runs, values, emit=lambda row: None)
    assert [row["status"].split(":")[0] for row in rows] == [
        "ok", "error", "outputs differ from the defaults'", "ok"
    ]  # fmt: skip
    assert timed == [(256, "fwdbwd"), (768, "fwdbwd")]  # never the differing or refused one
    assert closed == [None, 256, 512, 768]  # every group made is released
    assert ep_sweep.best_values(rows) == {"minibatch_size": 256}


def test_sweep_runs_on_a_cpu(tmp_path):
    from benchmarks import ep_sweep  # noqa: PLC0415

    path = tmp_path / "sweep.json"
    argv = ["--quick", "--device", "cpu", "--shapes", "qwen3-30b-a3b", "--json", str(path)]
    assert ep_sweep.main([*argv, "--reps", "1", "--warmup", "0"]) == 0
    (shape,) = json.loads(path.read_text())["shapes"]
    assert {row["setting"] for row in shape["rows"]} == set(ep_sweep.SWEEPS)
    assert all(row["status"] == "ok" and row["ms"] > 0 for row in shape["rows"])
    for setting, value in shape["fastest"].items():
        assert value in ep_sweep.QUICK_VALUES[setting]


def _moe_shape_worker(rank, world_size):
    import torch.distributed as dist  # noqa: PLC0415

    from benchmarks.baselines import grouped_mm_works  # noqa: PLC0415
    from benchmarks.shapes import select_shapes  # noqa: PLC0415
    from benchmarks.timing import TimingConfig  # noqa: PLC0415

    cpu = torch.device("cpu")
    args = moe.parse_args(["--quick", "--device", "cpu", "--no-liger", "--reps", "1"])
    args.timing = TimingConfig(warmup=0, reps=1)
    ceilings = {"gemm_is_ceiling": False}
    (model,) = select_shapes("qwen3-30b-a3b")
    return moe.run_shape(model, 64, args, cpu, rank, world_size, dist.group.WORLD, ceilings,
                         grouped_mm_works(cpu), emit=lambda row: None)  # fmt: skip


def test_an_ep_run_sets_each_mok_row_beside_its_compute_only_share():
    """Two gloo ranks: the compute-only rows (an EP = 1 layer of each rank's share, checked)
    come first, and each mok row carries its ratio to them and its peer traffic."""
    results = run_on_gloo_group(_moe_shape_worker, 2)
    for rows in results:
        only = {r["pass"]: r for r in rows if r["impl"] == "mok_compute_only"}
        mok = {r["pass"]: r for r in rows if r["impl"] == "mok_cpu_path"}
        assert set(only) == set(mok) == set(moe.PASSES)
        for name, row in mok.items():
            assert only[name]["status"] == "ok" and row["status"] == "ok", (name, row)
            assert row["vs_compute_only"] == row["ms"] / only[name]["ms"]
            assert row["peer_bytes"] > 0 and "peer_gbs" in row
    assert [r.get("ms") for r in results[0]] == [r.get("ms") for r in results[1]]  # slowest rank
