"""The benchmark harness on a CPU: smoke run with --quick, and the baseline against the reference.

Sizes are the --quick ones (H 128, I 128, <= 16 experts, 64 tokens) so the file runs in seconds
on a 2-core CI machine; the math checked is the same at every size.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# benchmarks/ is a top-level folder of the repository, not part of the installed package: a bare
# `pytest` (rootdir tests/ on sys.path) must find it from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import moe, mok_impls, report  # noqa: E402
from benchmarks.baselines import grouped_mm_works  # noqa: E402
from benchmarks.impls import baseline_impl  # noqa: E402
from benchmarks.inputs import make_inputs  # noqa: E402
from benchmarks.reference import MAX_REL_ERR, compare, reference_results  # noqa: E402
from benchmarks.shapes import SHAPES, scale_for_run, select_shapes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def test_quick_run_writes_rows_and_provenance(tmp_path):
    path = tmp_path / "bench.json"
    argv = ["--quick", "--device", "cpu", "--shapes", "qwen3-30b-a3b,mixtral-8x7b"]
    assert moe.main([*argv, "--json", str(path), "--reps", "2", "--warmup", "0"]) == 0
    record = json.loads(path.read_text())
    provenance = record["provenance"]
    for key in ("git_commit", "hostname", "date_utc", "torch", "cuda", "gpu", "driver"):
        assert key in provenance
    assert provenance["torch"] == torch.__version__
    assert record["ceilings"]["gemm_bf16_tflops"] > 0
    assert record["ceilings"]["gemm_bf16_sustained_tflops"] > 0
    assert record["ceilings"]["copy_gbs"] > 0
    rows = record["rows"]
    timed = [row for row in rows if row["baseline"]]
    assert {(r["shape"]["name"], r["pass"]) for r in timed} == {
        (name, p) for name in ("qwen3-30b-a3b", "mixtral-8x7b") for p in moe.PASSES
    }
    for row in timed:
        assert row["status"] == "ok", row["status"]
        assert row["ms"] > 0 and row["tflops"] > 0 and row["speedup"] == 1.0
        assert row["max_rel_err"] <= MAX_REL_ERR
    # A CPU's bf16 matmul rate is no ceiling of the layer: no row is put as a % of it.
    assert record["ceilings"]["gemm_is_ceiling"] is False
    assert "not a ceiling" in record["ceilings"]["gemm_ceiling_note"]
    assert not any("pct_of_gemm_ceiling" in row for row in rows)
    # Every row has its floor (what it counts, the context beside it); a timed one ms / floor.
    assert "floor_model" in record
    for row in rows:
        assert row["floor_ms"] > 0 and row["floor"]["ms"] == row["floor_ms"]
        assert row["floor"]["bytes_total"] == sum(row["floor"]["bytes"].values())
        assert row["floor"]["saved_context_bytes"] > 0
        if row["status"] == "ok":
            assert row["x_floor"] == pytest.approx(row["ms"] / row["floor_ms"])
    # mok has no CPU kernel: its rows are its CPU reference path, named so, or say why not;
    # a row that did not pass its check never carries a time. One mok row per shape and pass.
    mok_rows = [row for row in rows if row["impl"].startswith("mok")]
    mok_keys = [(r["shape"]["name"], r["pass"]) for r in mok_rows]
    assert sorted(mok_keys) == sorted({(r["shape"]["name"], r["pass"]) for r in timed})
    for row in mok_rows:
        assert row["impl"] == "mok_cpu_path" if row["status"] == "ok" else "ms" not in row


@pytest.mark.parametrize("use_grouped_mm", [True, False], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize("name", ["deepseek-v4-pro", "mixtral-8x7b"])  # clamp on / k=2, E=8
def test_baseline_matches_fp32_reference(name, use_grouped_mm):
    if use_grouped_mm and not grouped_mm_works(CPU)[0]:
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    shape = scale_for_run(select_shapes(name)[0], world_size=1, quick=True)
    inputs = make_inputs(shape, 48, rank=0, world_size=1, device=CPU, seed=3, shared=True)
    reference = reference_results(inputs, with_grads=True)
    impl = baseline_impl(inputs, align=8, use_grouped_mm=use_grouped_mm, detail="test")
    out, state = impl.forward()
    results = {"out": out, **impl.backward(state, inputs.grad_output)}
    errors = compare(results, reference)
    assert set(errors) == set(reference)  # out, d_x, d_router_weights, every weight gradient
    for key, error in errors.items():
        assert error < 1e-2, f"{key}: rel err {error}"
    assert out.dtype == torch.bfloat16 and out.shape == inputs.x.shape


def test_wrong_result_is_refused_not_timed(monkeypatch):
    real = moe.baseline_impl

    def broken(*args, **kwargs):
        impl = real(*args, **kwargs)
        forward = impl.forward

        def off_by_ten_percent():
            out, state = forward()
            return out * 1.1, state

        impl.forward = off_by_ten_percent
        return impl

    monkeypatch.setattr(moe, "baseline_impl", broken)
    args = moe.parse_args(["--quick", "--device", "cpu", "--passes", "fwd", "--reps", "1"])
    args.timing = moe.TimingConfig(warmup=0, reps=1)
    ceilings = {"gemm_bf16_tflops": 1.0, "gemm_bf16_sustained_tflops": 1.0}
    probe = grouped_mm_works(CPU)
    rows = moe.run_shape(SHAPES[2], 64, args, CPU, 0, 1, None, ceilings, probe, lambda row: None)
    baseline = [row for row in rows if row["baseline"]]
    assert baseline and all(row["status"].startswith("check failed") for row in baseline)
    assert all("ms" not in row for row in baseline)


def test_shapes_scale_per_gpu():
    deepseek = select_shapes("deepseek-v3")[0]
    one = scale_for_run(deepseek, world_size=1, quick=False)
    two = scale_for_run(deepseek, world_size=2, quick=False)
    assert (one.num_experts, one.hidden_size, one.intermediate_size, one.topk) == (
        32,
        7168,
        2048,
        8,
    )
    assert (two.num_experts, two.experts_per_rank) == (64, 32)
    mixtral = scale_for_run(select_shapes("mixtral-8x7b")[0], world_size=2, quick=False)
    assert (mixtral.num_experts, mixtral.experts_per_rank) == (8, 4)
    with pytest.raises(ValueError, match="unknown"):
        select_shapes("no-such-model")


def _row(impl: str, pass_name: str, **fields) -> dict:
    shape = scale_for_run(select_shapes("qwen3-30b-a3b")[0], world_size=1, quick=True)
    return {"shape": shape.as_dict(), "num_tokens": 64, "pass": pass_name, "impl": impl, **fields}


def test_row_shows_gemm_percent_only_against_a_ceiling():
    timed = {"status": "ok", "ms": 2.0, "tflops": 0.5, "speedup": 1.0, "max_rel_err": 4e-3}
    on_cpu = report.format_row(_row("torch_grouped_mm", "fwd", **timed))
    assert "% of GEMM" not in on_cpu and "0.5 TFLOP/s" in on_cpu
    ceiling = {"pct_of_gemm_ceiling": 62.5, "pct_of_sustained_gemm": 83.3}
    on_gpu = report.format_row(_row("torch_grouped_mm", "fwd", **timed, **ceiling))
    assert " 62.5% of GEMM ( 83.3% sustained)" in on_gpu
    assert moe.gemm_ceiling_note(CPU, quick=False).startswith("on cpu")
    assert moe.gemm_ceiling_note(torch.device("cuda"), quick=True).startswith("--quick")
    assert moe.gemm_ceiling_note(torch.device("cuda"), quick=False) is None
    ceilings = {"gemm_bf16_size": 512, "gemm_bf16_tflops": 0.1, "copy_gbs": 9.0}
    ceilings.update(gemm_bf16_sustained_tflops=0.1, gemm_ceiling_note="on cpu ...")
    assert "[on cpu ...: no % of GEMM shown]" in report.ceilings_line(ceilings)


def test_summary_columns_are_never_cut():
    long_status = "kernel not available (issue 4): MoKKernelUnavailableError: not landed"
    rows = [
        _row("torch_grouped_mm", "fwd", status="ok", ms=1234.567, speedup=1.0),
        _row("mok", "fwd", status=long_status),
        _row("liger", "fwd", status="liger timeout: killed after 300 s in stage time_fwd"),
    ]
    table = report.summary_table(rows)
    header, line = table.splitlines()
    assert header.split()[:3] == ["shape", "T", "pass"] and line.split()[:3] == [
        "qwen3-30b-a3b",
        "64",
        "fwd",
    ]
    assert "1234.567 ms (1.00x)" in line
    assert "kernel not available (issue 4)" in line and line.endswith("liger timeout")
    # Each column is right-aligned under its name: the two lines end at the same column.
    assert len(header) == len(line) and header.endswith("liger")


def test_mxfp8_row_is_skipped_on_cpu_with_its_reason(tmp_path, capsys):
    assert moe.parse_args([]).mxfp8 is False
    path = tmp_path / "bench.json"
    argv = ["--quick", "--device", "cpu", "--shapes", "mixtral-8x7b", "--mxfp8", "--reps", "1"]
    assert moe.main([*argv, "--warmup", "0", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["ceilings"]["gemm_fp8_tflops"] is None
    assert "needs CUDA" in record["ceilings"]["gemm_fp8_note"]
    rows = [row for row in record["rows"] if row["impl"] == "mok-mxfp8"]
    assert [row["pass"] for row in rows] == list(moe.PASSES)
    for row in rows:
        assert row["status"].startswith("skipped on cpu") and "ms" not in row
    printed = capsys.readouterr().out
    assert "mok-mxfp8            skipped on cpu: " in printed and "no fp8 GEMM (" in printed


def test_mxfp8_row_times_forward_and_backward(monkeypatch):
    # The GPU row's logic, run on mok's CPU MXFP8 layer (far too slow to benchmark, not to test).
    monkeypatch.setattr(mok_impls, "MXFP8_DEVICES", ("cpu",))
    argv = ["--quick", "--device", "cpu", "--passes", "fwd,fwdbwd", "--mxfp8", "--reps", "1"]
    args = moe.parse_args(argv)
    args.timing = moe.TimingConfig(warmup=0, reps=1)
    ceilings = {"gemm_bf16_tflops": 1.0, "gemm_bf16_sustained_tflops": 1.0, "gemm_fp8_tflops": 2.0}
    probe = grouped_mm_works(CPU)
    rows = moe.run_shape(SHAPES[2], 64, args, CPU, 0, 1, None, ceilings, probe, lambda row: None)
    by_key = {(row["impl"], row["pass"]): row for row in rows}
    bf16, fwd = by_key["mok_cpu_path", "fwd"], by_key["mok-mxfp8", "fwd"]
    assert fwd["status"] == "ok", fwd["status"]
    # E4M3 operands put it ~6e-2 off the fp32 layer: over the bf16 rows' limit, under its own.
    assert MAX_REL_ERR < fwd["max_rel_err"] <= mok_impls.MXFP8_MAX_REL_ERR
    assert fwd["pct_of_fp8_ceiling"] == pytest.approx(fwd["pct_of_gemm_ceiling"] / 2)
    assert fwd["ratio_vs_mok_bf16"] == pytest.approx(bf16["ms"] / fwd["ms"])
    # The original's MXFP8 context: (H + 3I) * 33/32 bytes a routed row against 2H + 6I.
    assert fwd["context_bytes"] * 64 == bf16["context_bytes"] * 33 > 0
    assert "pct_of_fp8_ceiling" not in bf16 and "ratio_vs_mok_bf16" not in bf16
    line = report.format_row(fwd)
    assert "% of FP8 GEMM" in line and "x vs mok bf16" in line and " ctx " in line
    fwdbwd = by_key["mok-mxfp8", "fwdbwd"]
    assert fwdbwd["status"] == "ok", fwdbwd["status"]
    assert fwdbwd["ratio_vs_mok_bf16"] == pytest.approx(by_key["mok_cpu_path", "fwdbwd"]["ms"]
                                                        / fwdbwd["ms"])  # fmt: skip
    assert "fp8 e4m3 GEMM 2 TFLOP/s" in report.ceilings_line(
        {**ceilings, "gemm_bf16_size": 512, "copy_gbs": 9.0}
    )


def test_ep_timeline_maps_each_rank_stream_by_its_marker():
    from tools.ep_timeline import lanes_of

    def kernel(name, stream, ts, dur, grid=1):
        return {"name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "grid": [grid]}}

    # Two ranks on CUPTI streams 13 and 7; rank r's marker fill has grid (r + 1) * 1000. A float
    # fill with a small grid is a step kernel of its stream's rank; another stream's is no rank's.
    kernels = [
        kernel("void FillFunctor<float> a", 13, 0.0, 5.0, grid=1000),
        kernel("void FillFunctor<float> b", 7, 1.0, 5.0, grid=2000),
        kernel("void FillFunctor<float> small", 7, 2.0, 1.0, grid=3),
        kernel("mok_moe_forward_0", 7, 30.0, 20.0),
        kernel("mok_ep_barrier_0", 13, 10.0, 15.0),
        kernel("mok_moe_forward_0", 13, 26.0, 20.0),
        kernel("elsewhere", 99, 0.5, 1.0),
    ]
    lanes = lanes_of(kernels, 2)  # times from the first step kernel's start (ts 2.0)
    assert lanes == {
        0: [("barrier", 8.0, 23.0), ("moe_forward", 24.0, 44.0)],
        1: [("fill", 0.0, 1.0), ("moe_forward", 28.0, 48.0)],
    }


class _FakeEvent:
    """torch.cuda.Event for benchmarks.host_time's timing loop on a CPU: 1 ms between any two."""

    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass

    def elapsed_time(self, other):
        return 1.0


@pytest.fixture
def fake_cuda_timing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


def test_host_time_reports_the_process_cpu_time_beside_the_host_time(fake_cuda_timing):
    """benchmarks.host_time's timing loop (CUDA-only) on the CPU, its CUDA calls faked: a step
    that sleeps takes host time but almost no CPU time."""
    import time  # noqa: PLC0415

    from benchmarks import host_time  # noqa: PLC0415

    result = host_time._timed(lambda: time.sleep(0.005), [], [], steps=5, warmup=1, profile=None)
    assert result["host_ms"] >= 5.0
    assert result["host_cpu_ms"] < result["host_ms"] / 2
    assert result["gpu_ms"] == 1.0 / 5 and result["gpu_idle_ms"] == 1.0


def test_host_time_backward_on_caller_turns_autograd_multithreading_off_for_the_steps(
    fake_cuda_timing,
):
    """`--backward-on-caller`: each timed step runs with autograd's multithreading off, and it
    is on again afterwards."""
    from benchmarks import host_time  # noqa: PLC0415

    seen = []

    def step():
        seen.append(torch._C._is_multithreading_enabled())

    host_time._timed(step, [], [], steps=2, warmup=1, profile=None, backward_on_caller=True)
    assert seen == [False] * 5
    host_time._timed(step, [], [], steps=2, warmup=1, profile=None)
    assert seen[5:] == [True] * 5
    assert torch._C._is_multithreading_enabled()


def test_host_time_cpus_list_is_parsed_and_bad_lists_are_refused(capsys):
    from benchmarks import host_time  # noqa: PLC0415

    assert host_time.parse_cpus("6") == {6}
    assert host_time.parse_cpus("4-7,12") == {4, 5, 6, 7, 12}
    for bad in ("", "a", "3-x", "-2"):
        with pytest.raises(ValueError, match="--cpus must"):
            host_time.parse_cpus(bad)
    with pytest.raises(SystemExit):
        host_time.main(["--cpus", "1-a"])
    assert "--cpus 1-a" in capsys.readouterr().err


def test_floor_of_a_small_shape_by_hand():
    from benchmarks import roofline  # noqa: PLC0415
    from benchmarks.shapes import ModelShape, RunShape  # noqa: PLC0415

    model = ModelShape("toy", 4, 256, 128, 2, 4)
    shape = RunShape("toy", 4, 4, 256, 128, 2, model)  # E 4, H 256, I 128, k 2; T 32 below
    # Weights: 4 experts * 3 * 256 * 128 bf16 = 786432 bytes; an activation 32 * 256 * 2 =
    # 16384; router weights 32 * 2 fp32 = 256; ids 32 * 2 int64 = 512.
    fwd = {"weights_read": 786432, "x_read": 16384, "out_written": 16384,
           "router_weights_read": 256, "expert_ids_read": 512}  # fmt: skip
    bwd = {"weights_read": 786432, "weight_grads_written": 786432, "grad_output_read": 16384,
           "x_read": 16384, "d_x_written": 16384, "router_weights_read": 256,
           "expert_ids_read": 512, "d_router_weights_written": 256}  # fmt: skip
    assert roofline.pass_bytes(shape, 32, False, "fwd") == fwd
    assert roofline.pass_bytes(shape, 32, False, "bwd") == bwd
    assert sum(fwd.values()) == 819968 and sum(bwd.values()) == 1623040
    # A shared expert is one more expert's weights (and their gradients).
    assert roofline.pass_bytes(shape, 32, True, "bwd")["weight_grads_written"] == 983040
    # FLOPs: 2 * 32 tokens * 2 * 3 * 256 * 128 = 12582912 a forward, 2x that a backward.
    assert roofline.flops(shape, 32, False, "fwd") == 12582912
    assert roofline.flops(shape, 32, False, "bwd") == 25165824
    # The context mok saves: 32 * 2 routed rows * (2 * 256 + 6 * 128) bytes, never in a floor.
    assert roofline.saved_context_bytes(shape, 32) == 81920

    # 0.1 TFLOP/s and 1 GB/s: both passes memory-bound, 0.819968 ms and 1.62304 ms.
    slow_copy = {"gemm_bf16_sustained_tflops": 0.1, "copy_gbs": 1.0}
    floor = roofline.pass_floor(shape, 32, False, "fwd", slow_copy)
    assert floor["bound"] == "memory" and floor["ms"] == pytest.approx(0.819968)
    assert floor["compute_ms"] == pytest.approx(0.12582912)
    assert floor["bytes"] == fwd and floor["bytes_total"] == 819968
    assert floor["saved_context_bytes"] == 81920
    both = roofline.pass_floor(shape, 32, False, "fwdbwd", slow_copy)
    assert both["ms"] == pytest.approx(0.819968 + 1.62304)
    assert both["flops"] == 3 * 12582912 and both["bytes_total"] == 819968 + 1623040
    assert both["bytes"]["weights_read"] == 2 * 786432 and set(both["parts"]) == {"fwd", "bwd"}
    # 10 GB/s: compute-bound, 0.12582912 ms and 0.25165824 ms.
    fast_copy = {"gemm_bf16_sustained_tflops": 0.1, "copy_gbs": 10.0}
    floor = roofline.pass_floor(shape, 32, False, "bwd", fast_copy)
    assert floor["bound"] == "compute" and floor["ms"] == pytest.approx(0.25165824)
    assert roofline.pass_floor(shape, 32, False, "fwd", {"copy_gbs": 1.0}) is None
    with pytest.raises(ValueError, match="pass_name"):
        roofline.pass_bytes(shape, 32, False, "fwdbwd")

    # A timed row carries its floor and ms / floor, and prints both beside its ms.
    args = moe.parse_args(["--quick", "--device", "cpu"])
    fields = moe.timed_fields(
        shape, args, 32, "fwd", 1.639936, {**slow_copy, "gemm_is_ceiling": False}
    )
    assert fields["x_floor"] == pytest.approx(2.0)
    row = {"shape": shape.as_dict(), "num_tokens": 32, "pass": "fwd", "impl": "x", **fields,
           **moe.floor_fields(shape, args, 32, "fwd", slow_copy), "max_rel_err": 1e-3}  # fmt: skip
    assert row["floor_ms"] == pytest.approx(0.819968)
    assert "1.640 ms floor    0.820 ms   2.00 x floor" in report.format_row(row)


def test_tokens_take_one_count_or_a_comma_list():
    assert moe.parse_args(["--tokens", "4096"]).tokens == [4096]
    assert moe.parse_args(["--tokens", "2048, 4096,16384"]).tokens == [2048, 4096, 16384]
    assert moe.parse_args([]).tokens == [16384] and moe.parse_args(["--quick"]).tokens == [64]
    assert moe.parse_tokens("64,64,32") == [64, 32]  # each count once, in the order given
    for bad in ("", "0", "64,", "2k", "-8", "64;128"):
        with pytest.raises(ValueError, match="--tokens: expected positive integers"):
            moe.parse_tokens(bad)
    with pytest.raises(SystemExit):
        moe.parse_args(["--tokens", "4096,x"])


def test_quick_run_with_two_token_counts_has_rows_for_both(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["--quick", "--device", "cpu", "--shapes", "mixtral-8x7b", "--tokens", "32,48"]
    assert moe.main([*argv, "--reps", "1", "--warmup", "0", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["args"]["tokens"] == [32, 48]
    timed = [row for row in record["rows"] if row["baseline"]]
    assert sorted((row["num_tokens"], row["pass"]) for row in timed) == sorted(
        (t, p) for t in (32, 48) for p in moe.PASSES
    )
    for row in timed:
        assert row["status"] == "ok", row["status"]
        # The floor is the one of the row's own token count.
        assert row["floor"]["bytes"]["x_read"] == row["num_tokens"] * 128 * 2 * (
            2 if row["pass"] == "fwdbwd" else 1
        )
    printed = capsys.readouterr().out
    assert " T=32 " in printed and " T=48 " in printed
    # Each shape and token count says how long it took and how far into the run it ended.
    progress = re.findall(r"\(mixtral-8x7b (\d+) tokens: (\d+) s; (\d+) s into the run\)", printed)
    assert [int(t) for t, _, _ in progress] == [32, 48], printed
    assert int(progress[1][2]) >= int(progress[0][2]) >= int(progress[0][1])


def test_time_limit_leaves_what_would_end_past_it_and_says_so(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["--quick", "--device", "cpu", "--shapes", "mixtral-8x7b", "--passes", "fwd",
            "--tokens", "32,48", "--reps", "1", "--warmup", "0", "--no-sonic"]  # fmt: skip
    # Far off: both token counts run.
    assert moe.main([*argv, "--time-limit", "3600", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["not_reached"] == [] and {r["num_tokens"] for r in record["rows"]} == {32, 48}
    capsys.readouterr()
    # Already past: nothing starts, and the JSON says what was left.
    assert moe.main([*argv, "--time-limit", "1e-9", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["rows"] == []
    assert record["not_reached"] == [{"shape": "mixtral-8x7b", "num_tokens": 32},
                                     {"shape": "mixtral-8x7b", "num_tokens": 48}]  # fmt: skip
    printed = capsys.readouterr().out
    assert "(mixtral-8x7b 48 tokens: not started," in printed
    assert "not reached (--time-limit 0 s): mixtral-8x7b 32, mixtral-8x7b 48" in printed
    with pytest.raises(SystemExit):
        moe.parse_args(["--time-limit", "0"])


def test_sigterm_stops_the_run_and_it_still_writes_what_it_measured(tmp_path):
    """`timeout` sends SIGTERM: the pair in progress and those after it are listed as not
    reached, the table is printed and the JSON written, and the process exits 0."""
    path = tmp_path / "bench.json"
    command = [sys.executable, "-m", "benchmarks.moe", "--quick", "--device", "cpu", "--shapes",
               "mixtral-8x7b", "--passes", "fwd", "--tokens", ",".join(str(32 + 16 * i) for i in range(40)),
               "--reps", "3", "--warmup", "0", "--no-sonic", "--json", str(path)]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
    lines = []
    for line in process.stdout:  # the first pair's progress line: one pair measured
        lines.append(line)
        if "into the run)" in line:
            process.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + process.stdout.read()
    assert process.wait(timeout=120) == 0, out
    record = json.loads(path.read_text())
    measured = sorted({row["num_tokens"] for row in record["rows"]})
    left = [entry["num_tokens"] for entry in record["not_reached"]]
    assert measured and measured[0] == 32 and left and left[-1] == 32 + 16 * 39
    assert sorted(measured + left) == [32 + 16 * i for i in range(40)]
    assert record["interrupted"].startswith("interrupted by SIGTERM")
    assert "not reached (interrupted by SIGTERM" in out and "shape " in out


def test_a_stopped_harness_stops_its_peer_worker(monkeypatch, tmp_path):
    """An exception in the harness while a worker runs (a SIGTERM, say) ends the worker too."""
    from benchmarks import peer_worker

    monkeypatch.setattr(peer_worker, "POLL_S", 0.05)
    pid_file = tmp_path / "pid"
    script = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )

    def finished(_folder, _num_tokens):
        if pid_file.exists() and pid_file.read_text():
            raise KeyboardInterrupt
        return False

    monkeypatch.setattr(peer_worker, "_finished", finished)
    with pytest.raises(KeyboardInterrupt):
        peer_worker.run_worker("peer", lambda _f, _t: [sys.executable, "-c", script],
                               {**os.environ}, 30.0, 1.0, (32,))  # fmt: skip
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_time_limit_expects_the_harness_part_plus_each_peer_worker_that_will_run():
    clock = moe.PairClock()
    assert clock.expect(("liger", "sonic")) == 0.0  # nothing measured yet: the first pair starts
    # A shape's first pair: SonicMoE compiled for 23 s and LigerMoE took 13 s of its 44 s.
    clock.record(44.0, {"liger": 13.0, "sonic": 23.0})
    assert clock.expect(("liger", "sonic")) == 44.0
    assert clock.expect(("liger",)) == 21.0  # a later pair: SonicMoE's rows were kept
    assert clock.expect(()) == 8.0  # a clamped shape: no peer runs for it
    clock.record(17.0, {"liger": 15.0})  # each part keeps its longest
    assert (clock.harness_s, clock.peer_s) == (8.0, {"liger": 15.0, "sonic": 23.0})
    assert clock.describe(("liger",)) == "harness 8 s + liger 15 s"
    # A peer with no call yet counts as long as the longest whole pair.
    fresh = moe.PairClock()
    fresh.record(30.0, {"liger": 12.0})
    assert fresh.expect(("liger", "sonic")) == 18.0 + 12.0 + 30.0


def test_pair_peers_names_the_workers_a_pair_will_start():
    from benchmarks.liger import LigerAvailability
    from benchmarks.shapes import select_shapes
    from benchmarks.sonic import SonicAvailability

    args = moe.parse_args(["--tokens", "2048"])
    args.liger, args.sonic = LigerAvailability(None, "/site"), SonicAvailability(None, "/site")
    args.sonic_results = {}
    cuda = torch.device("cuda", 0)
    qwen, clamped = select_shapes("qwen3-30b-a3b,deepseek-v4-pro")
    assert moe.pair_peers(qwen, args, cuda, 1) == ("liger", "sonic")
    args.sonic_results["qwen3-30b-a3b"] = {}  # its later token counts: SonicMoE's rows kept
    assert moe.pair_peers(qwen, args, cuda, 1) == ("liger",)
    assert moe.pair_peers(clamped, args, cuda, 1) == ()  # neither peer has the SwiGLU clamp
    assert moe.pair_peers(qwen, args, torch.device("cpu"), 1) == ("liger",)
    args.liger = LigerAvailability("not installed")  # found, but its row cannot be attempted
    args.sonic = None  # --no-sonic
    args.sonic_results = {}
    assert moe.pair_peers(qwen, args, cuda, 1) == ()


def test_progress_line_names_each_peer_worker_time():
    rows = [
        {**_row("mok", "fwd"), "num_tokens": 2048},
        {**_row("sonicmoe", "fwd"), "num_tokens": 2048, "worker_s": 83.4},
        {**_row("liger", "fwd"), "num_tokens": 2048, "worker_s": 41.0,
         "worker_stage_s": {"reference": 12.3, "check": 20.0, "time_fwd": 38.6}},
    ]  # fmt: skip
    line = report.progress_line(rows, 130.2, 400.0)
    assert (
        "2048 tokens: 130 s, sonicmoe worker 83 s, liger worker 41 s (reference at 12, check at "
        "20, time_fwd at 39); 400 s into the run" in line
    )
    # What a worker compiled on this token count; caches that did not grow are left out.
    rows[1]["worker_compiles"] = {"TRITON_CACHE_DIR files": 12, "quack builds": 0,
                                  "QUACK_CACHE_DIR files": 4}  # fmt: skip
    line = report.progress_line(rows, 130.2, 400.0)
    assert (
        "sonicmoe worker 83 s [compiled: TRITON_CACHE_DIR files +12, QUACK_CACHE_DIR files +4], "
        "liger worker 41 s" in line
    )


def test_sonic_compile_counts_count_cache_files_and_quack_builds(tmp_path, monkeypatch):
    import functools  # noqa: PLC0415
    import types  # noqa: PLC0415

    from benchmarks import sonic  # noqa: PLC0415

    (tmp_path / "triton" / "a").mkdir(parents=True)
    for name in ("a/k1.cubin", "a/k1.json", "top.json"):
        (tmp_path / "triton" / name).write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "missing"))  # not there: left out
    monkeypatch.delenv("CUTE_DSL_CACHE_DIR", raising=False)
    module = types.ModuleType("quack.gemm")

    @functools.cache
    def build(n):
        return n

    module.build, module.other = build, 3
    monkeypatch.setitem(sys.modules, "quack.gemm", module)
    assert sonic.compile_counts() == {"TRITON_CACHE_DIR files": 3, "quack builds": 0}
    build(1), build(1), build(2)  # two misses (builds), one hit
    (tmp_path / "triton" / "a" / "k2.cubin").write_text("")
    assert sonic.compile_counts() == {"TRITON_CACHE_DIR files": 4, "quack builds": 2}


def test_sonic_rows_say_why_when_sonicmoe_is_not_importable(tmp_path, capsys):
    from benchmarks import sonic  # noqa: PLC0415

    assert importlib.util.find_spec("sonicmoe") is None  # not installed here
    path = tmp_path / "bench.json"
    argv = ["--quick", "--device", "cpu", "--shapes", "mixtral-8x7b", "--passes", "fwd,bwd"]
    assert moe.main([*argv, "--reps", "1", "--warmup", "0", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["sonic"]["reason"].startswith("sonicmoe not importable: no package sonicmoe")
    rows = [row for row in record["rows"] if row["impl"] == "sonicmoe"]
    assert [row["pass"] for row in rows] == ["fwd", "bwd"]
    for row in rows:
        assert row["status"] == record["sonic"]["reason"] and "ms" not in row
        assert row["floor_ms"] > 0  # the floor is the shape's, timed or not
    printed = capsys.readouterr().out
    assert "sonicmoe: sonicmoe not importable" in printed
    assert "sonicmoe             sonicmoe not importable" in printed
    # --no-sonic: no rows at all.
    assert moe.main([*argv, "--no-sonic", "--reps", "1", "--warmup", "0", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["sonic"] is None and all(row["impl"] != "sonicmoe" for row in record["rows"])
    # Found, the row still needs CUDA, EP = 1 and this shape's function.
    found = sonic.SonicAvailability(None, "/site", {"sonic-moe": "0.1.2"})
    assert sonic.skip_reason(found, "cpu", 1, None, False).startswith("skipped on cpu")
    assert sonic.skip_reason(found, "cuda", 2, None, False).startswith("not run: ")
    assert "no shared expert" in sonic.skip_reason(found, "cuda", 1, None, True)
    assert "no clamp" in sonic.skip_reason(found, "cuda", 1, 10.0, False)
    assert sonic.skip_reason(found, "cuda", 1, None, False) is None


def fake_sonic_site(root: Path) -> Path:
    """A site shaped like SonicMoE's kit: the package (empty: nothing in it runs), a .pth that
    names a second folder, dist-info versions."""
    (root / "sonicmoe").mkdir(parents=True)
    (root / "sonicmoe" / "__init__.py").write_text("")
    (root / "extra" / "python_packages").mkdir(parents=True)
    (root / "extra.pth").write_text("# a comment\nextra/python_packages\nimport os\nmissing\n")
    info = root / "sonic_moe-0.1.2.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text("Name: sonic-moe\nVersion: 0.1.2\n")
    return root


def test_sonic_found_in_a_site_and_its_worker_reports_where_it_stopped(tmp_path):
    from benchmarks import sonic  # noqa: PLC0415
    from benchmarks.peer_worker import PeerJob  # noqa: PLC0415

    site = fake_sonic_site(tmp_path / "site")
    found = sonic.find_sonic(str(site))
    assert found.available and found.site == str(site)
    assert found.python_path == (str(site), str(site / "extra" / "python_packages"))
    assert found.versions == {"sonic-moe": "0.1.2", "quack-kernels": None,
                              "nvidia-cutlass-dsl": None}  # fmt: skip
    assert "sonic-moe 0.1.2" in found.label() and "sonicmoe" not in sys.modules
    env = sonic.worker_env(found, {"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"].split(":") == [*found.python_path, str(sonic.peer_worker.REPO_ROOT),
                                            "/elsewhere"]  # fmt: skip
    job = PeerJob("qwen3-30b-a3b", (64, 96), True, 0, ("fwd", "fwdbwd"), 0, 1, 0, 120.0, "")
    assert PeerJob.from_argv(job.argv()) == job
    # The worker imports the site's (empty) sonicmoe: its entry point is not there. The first
    # token count gets the failure; a second worker, for the second, fails the same way.
    results = sonic.run_job(job, found)
    assert sorted(results) == [64, 96]
    result = results[64]
    assert result["stage"] == "import_sonicmoe" and result["status"] == "error"
    assert result["failure"].startswith("sonicmoe error in stage import_sonicmoe: ImportError")
    assert result["wall_s"] > 0  # the worker's wall time, which its rows carry as worker_s
    assert list(result["stage_s"]) == ["import_sonicmoe"]  # when each stage began
    assert 0 <= result["stage_s"]["import_sonicmoe"] <= result["wall_s"]
    assert results[96]["failure"] == result["failure"]
    outcomes = sonic.pass_outcomes(result, job.passes)
    assert [o["status"] for o in outcomes.values()] == [result["failure"]] * 2


def test_sonic_impl_checks_and_times_like_the_harness():
    """The worker's Impl over a PyTorch stand-in for moe_general_routing_inputs: SonicMoE's
    documented semantics on the layouts it is given (W1 (2I, H, E) interleaved, W2 (H, I, E))."""
    from benchmarks import sonic  # noqa: PLC0415
    from benchmarks.reference import moe_reference  # noqa: PLC0415
    from benchmarks.timing import TimingConfig  # noqa: PLC0415

    def stand_in(x, scores, token_indices, expert_indices, w1, b1, w2, b2, num_experts,
                 stream, activation, *, is_inference_mode_enabled, concat_layout):  # fmt: skip
        assert token_indices.dtype == expert_indices.dtype == torch.int32
        assert scores.dtype == torch.float32 and scores.dim() == 1
        assert bool((token_indices[1:] >= token_indices[:-1]).all())  # sorted ascending
        assert (b1, b2, stream, activation) == (None, None, 7, "swiglu")
        assert not is_inference_mode_enabled and not concat_layout
        assert w1.shape[2] == w2.shape[2] == num_experts
        weights_1 = w1.permute(2, 0, 1)  # [E, 2I, H]
        topk = scores.numel() // x.shape[0]
        out = moe_reference(x, expert_indices.long().view(-1, topk), scores.view(-1, topk),
                            weights_1[:, 0::2], weights_1[:, 1::2], w2.permute(2, 0, 1))  # fmt: skip
        return out.to(torch.bfloat16), None

    shape = scale_for_run(select_shapes("qwen3-30b-a3b")[0], world_size=1, quick=True)
    inputs = make_inputs(shape, 32, rank=0, world_size=1, device=CPU, seed=1, shared=False)
    reference = reference_results(inputs, with_grads=True)
    impl = sonic.sonic_impl(stand_in, "swiglu", inputs, 7)
    fwd = moe.check(impl, inputs, {"out": reference["out"]}, None)
    train = moe.check(impl, inputs, reference, None)
    assert set(train["rel_err"]) == {"out", "x", "router_weights", "gate", "up", "down"}
    assert max(fwd["max_rel_err"], train["max_rel_err"]) < MAX_REL_ERR
    timing = TimingConfig(warmup=0, reps=1)
    for pass_name in moe.PASSES:
        assert moe.time_pass(impl, inputs, pass_name, timing, None) > 0


def test_macrobatch_rows_time_ring_reuse_against_the_mok_row(tmp_path, capsys):
    """--macrobatch: a row per size and replay, checked like the others, each with its ratio
    to the mok row and its context; a size holding every routed row says it is the mok row."""
    assert moe.parse_args([]).macrobatch == []
    assert moe.parse_args(["--macrobatch", "256, 16384,256"]).macrobatch == [256, 16384]
    for bad in ("100", "384", "x"):
        with pytest.raises(SystemExit):
            moe.parse_args(["--macrobatch", bad])
    assert "--macrobatch: expected multiples of 256" in capsys.readouterr().err
    path = tmp_path / "bench.json"
    argv = ["--quick", "--device", "cpu", "--shapes", "qwen3-30b-a3b", "--macrobatch", "256,512"]
    assert moe.main([*argv, "--reps", "1", "--warmup", "0", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    by_impl = {}
    for row in rows:
        by_impl.setdefault(row["impl"], []).append(row)
    ring, gather = by_impl["mok_cpu_path-mb256"], by_impl["mok_cpu_path-mb256-gather"]
    for row in ring + gather:
        assert row["status"] == "ok" and row["max_rel_err"] <= MAX_REL_ERR
        assert row["ratio_vs_mok_bf16"] > 0
    # T * k = 512 routed rows at --quick: 256 holds half of them, 512 every one.
    ctx = {row["impl"]: row["context_bytes"] for row in ring + gather if row["pass"] == "fwd"}
    mok_ctx = next(r["context_bytes"] for r in by_impl["mok_cpu_path"] if r["pass"] == "fwd")
    assert ctx["mok_cpu_path-mb256"] < ctx["mok_cpu_path-mb256-gather"] < mok_ctx
    for name in ("mok_cpu_path-mb512", "mok_cpu_path-mb512-gather"):
        assert all(r["status"].startswith("every routed row at once (512 >= T * k = 512)")
                   and "ms" not in r for r in by_impl[name])  # fmt: skip
