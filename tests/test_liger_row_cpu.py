"""The LigerMoE row of the harness, on a CPU: what can be checked without a GPU or Liger itself.

Where Liger is found (and why not), the worker's arguments and result file, how a worker's end
(finished, error, crash, timeout) becomes the rows, and that a CPU run never attempts the row.
The worker's GPU path (configure, check, timing) needs an H100/H200 and Liger's native core.
"""

import dataclasses
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import liger, moe, peer_worker  # noqa: E402
from benchmarks.shapes import scale_for_run, select_shapes  # noqa: E402

CPU = torch.device("cpu")
LIGER_INSTALLED = any(importlib.util.find_spec(name) for name in liger.PACKAGES)


def fake_site(root: Path, *, entry=True, nvshmem=True, versions=True) -> Path:
    """A site dir shaped like an install of LigerMoE (files only: nothing in it can run)."""
    for package in liger.PACKAGES:
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    if entry:
        moe_file = root.joinpath("liger_kernel", *liger.ENTRY_FILE)
        moe_file.parent.mkdir(parents=True)
        moe_file.write_text("")
    if nvshmem:
        lib = root / "nvidia" / "nvshmem" / "lib"
        lib.mkdir(parents=True)
        (lib / liger.NVSHMEM_HOST).write_bytes(b"not an ELF file")
    if versions:
        for name, version in (("liger_kernel", "0.8.5"), ("liger_cute_kernels", "0.8.5")):
            info = root / f"{name}-{version}.dist-info"
            info.mkdir()
            dist_name = name.replace("_", "-")
            info.joinpath("METADATA").write_text(f"Name: {dist_name}\nVersion: {version}\n")
    return root


def job(**changes) -> liger.LigerJob:
    fields = dict(
        shape="qwen3-30b-a3b",
        tokens=(4096,),
        quick=False,
        seed=0,
        passes=("fwd", "fwdbwd"),
        warmup=5,
        reps=20,
        device_index=0,
        heap_gib=9,
        timeout_s=300.0,
        result_path="/tmp/results",
    )
    return liger.LigerJob(**{**fields, **changes})


@pytest.mark.skipif(LIGER_INSTALLED, reason="LigerMoE is installed here")
def test_absent_liger_says_which_package_and_where(tmp_path):
    found = liger.find_liger()
    assert not found.available
    assert found.reason.startswith("liger not importable: no package liger_kernel on sys.path")
    in_site = liger.find_liger(str(tmp_path))
    assert f"--liger-site {tmp_path} or sys.path" in in_site.reason


def test_site_found_without_importing_it(tmp_path):
    site = fake_site(tmp_path)
    found = liger.find_liger(str(site))
    assert found.available and found.reason is None
    assert found.site == str(site)
    assert found.nvshmem_host == str(site / "nvidia/nvshmem/lib" / liger.NVSHMEM_HOST)
    assert found.cudart is None and found.python_path == (str(site),)
    assert found.versions["liger-kernel"] == "0.8.5"
    assert found.versions["liger-cute-kernels"] == "0.8.5"
    assert found.versions["nvidia-nvshmem-cu12"] is None
    assert "liger-kernel 0.8.5" in found.label() and liger.CONVERSIONS in found.label()
    assert "liger_kernel" not in sys.modules  # located, never imported


def test_site_reasons_name_what_is_missing(tmp_path):
    no_entry = liger.find_liger(str(fake_site(tmp_path / "a", entry=False)))
    assert "ops/cute/ops/moe.py is missing" in no_entry.reason
    no_nvshmem = liger.find_liger(str(fake_site(tmp_path / "b", nvshmem=False)))
    assert no_nvshmem.reason.startswith(f"liger not usable: no {liger.NVSHMEM_HOST}")
    # A copy next to the package (what Liger's own loader tries first) is preferred.
    site = fake_site(tmp_path / "c")
    (site / "liger_cute_kernels" / liger.NVSHMEM_HOST).write_bytes(b"")
    assert liger.find_liger(str(site)).nvshmem_host == str(
        site / "liger_cute_kernels" / liger.NVSHMEM_HOST
    )


def test_job_round_trips_through_the_worker_argv():
    for one in (job(), job(quick=True, passes=("bwd",), timeout_s=12.5, device_index=3),
                job(gate="/tmp/folder/gate")):  # fmt: skip
        argv = one.argv()
        assert argv[0] == "--worker"
        assert liger.LigerJob.from_argv(argv) == one


def test_worker_env_sets_one_pe_nvshmem(tmp_path):
    found = liger.find_liger(str(fake_site(tmp_path)))
    base = {"PYTHONPATH": "/elsewhere", "NVSHMEM_DISABLE_NVLS": "0", "LIGER_MOE_SM90_NONRDC": "1"}
    env = liger.worker_env(job(heap_gib=25), found, base)
    assert env["PYTHONPATH"].split(":") == [str(tmp_path), str(liger.REPO_ROOT), "/elsewhere"]
    assert env["NVSHMEM_SYMMETRIC_SIZE"] == "25G"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert env["NVSHMEM_REMOTE_TRANSPORT"] == "none"
    assert "LIGER_MOE_SM90_NONRDC" not in env


def test_symmetric_heap_per_shape():
    # Qwen3-30B-A3B and the DeepSeek-V3 slice at 16384 tokens on a 132-SM H200.
    assert liger.symmetric_heap_gib(16384, 128, 2048, 8, 132) == 9
    assert liger.symmetric_heap_gib(16384, 32, 7168, 8, 132) == 24
    assert liger.symmetric_heap_gib(64, 16, 128, 8, 132) == 4


def test_real_worker_reports_the_stage_it_failed_in(tmp_path):
    """The worker itself, on a site whose NVSHMEM is not a library: it fails before torch."""
    found = liger.find_liger(str(fake_site(tmp_path / "site")))
    result = liger.run_job(job(timeout_s=60.0), found)
    assert result["stage"] == "preload_nvshmem" and result["status"] == "error"
    assert result["failure"].startswith("liger error in stage preload_nvshmem: OSError")
    assert result["job"]["shape"] == "qwen3-30b-a3b"
    assert any("OSError" in line for line in result["log_tail"])
    outcomes = liger.pass_outcomes(result, ("fwd", "fwdbwd"))
    assert [o["status"] for o in outcomes.values()] == [result["failure"]] * 2


@pytest.mark.parametrize(
    "script, expected",
    [
        ("import sys; print('native boom', file=sys.stderr); sys.exit(3)", "crashed (exit 3)"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "crashed (exit signal 11)"),
        ("import time; time.sleep(60)", "timeout: killed after 1 s"),
    ],
    ids=["exit", "signal", "timeout"],
)
def test_worker_end_becomes_failure(monkeypatch, tmp_path, script, expected):
    monkeypatch.setattr(liger, "worker_command", lambda _job: [sys.executable, "-c", script])
    monkeypatch.setattr(peer_worker, "POLL_S", 0.05)
    monkeypatch.setattr(liger, "KILL_GRACE_S", 2.0)
    found = liger.find_liger(str(fake_site(tmp_path)))
    result = liger.run_job(job(timeout_s=1.0), found)
    assert result["failure"] == f"liger {expected} in stage not started"
    if "boom" in script:
        assert result["log_tail"] == ["native boom"]


def test_pass_outcomes_keep_what_was_measured_before_a_crash(tmp_path):
    path = tmp_path / "result.json"
    measured = {"status": "ok", "ms": 1.25, "rel_err": {"out": 3e-3}, "max_rel_err": 3e-3}
    path.write_text(
        json.dumps({"status": "running", "stage": "time_fwdbwd", "passes": {"fwd": measured}})
    )
    result = liger.read_result(str(path))
    result["failure"] = liger.describe_end(result, -11, False, 300.0)
    assert result["failure"] == "liger crashed (exit signal 11) in stage time_fwdbwd"
    outcomes = liger.pass_outcomes(result, ("fwd", "fwdbwd"))
    assert outcomes["fwd"] == measured
    assert outcomes["fwdbwd"] == {"status": result["failure"]}
    assert liger.describe_end({"status": "done", "stage": "done"}, 0, False, 300.0) is None
    assert liger.read_result(str(tmp_path / "absent.json"))["stage"] == "not started"


def _liger_args(passes):
    args = moe.parse_args(["--passes", ",".join(passes), "--tokens", "4096"])
    args.liger = liger.LigerAvailability(
        None, "/site", {"liger-kernel": "0.8.5"}, nvshmem_host="/lib.so"
    )
    return args


def test_liger_rows_from_a_worker_result(monkeypatch):
    """What the harness makes of a worker's result on a GPU (the GPU calls stubbed)."""
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(multi_processor_count=132)
    )
    jobs = []
    check = {"rel_err": {"out": 3e-3}, "max_rel_err": 3e-3}

    def fake_run(one, _availability, started=None):
        assert started is None  # nothing was started ahead in this run
        jobs.append(one)
        return {
            "info": {"gpu": "H200"},
            "passes": {"fwd": {"status": "ok", "ms": 2.0, **check}},
            "failure": "liger crashed (exit signal 11) in stage time_fwdbwd",
            "log_tail": ["Segmentation fault"],
        }

    monkeypatch.setattr(liger, "run_job", fake_run)
    args = _liger_args(("fwd", "fwdbwd", "bwd"))
    shape = scale_for_run(select_shapes("qwen3-30b-a3b")[0], world_size=1, quick=False)
    ceilings = {"gemm_bf16_tflops": 800.0, "gemm_bf16_sustained_tflops": 600.0}
    base = {"shape": shape.as_dict(), "num_tokens": 4096, "world_size": 1}
    device = torch.device("cuda", 0)
    rows = moe.liger_rows(shape, 4096, args, device, base, {"fwd": 3.0}, ceilings, lambda row: None)
    assert [one.heap_gib for one in jobs] == [liger.symmetric_heap_gib(4096, 128, 2048, 8, 132)]
    assert jobs[0].passes == ("fwd", "fwdbwd", "bwd") and jobs[0].tokens == (4096,)
    fwd, fwdbwd, bwd = rows
    assert fwd["impl"] == "liger" and fwd["status"] == "ok" and fwd["speedup"] == 1.5
    expected_tflops = moe.flops(shape, 4096, False, "fwd") / 2e-3 / 1e12
    assert fwd["tflops"] == pytest.approx(expected_tflops)
    assert fwd["pct_of_gemm_ceiling"] == pytest.approx(100 * expected_tflops / 800.0)
    assert fwd["peer"] == {"gpu": "H200"} and liger.CONVERSIONS in fwd["label"]
    for row in (fwdbwd, bwd):
        assert row["status"].startswith("liger crashed") and "ms" not in row
    assert fwdbwd["log_tail"] == ["Segmentation fault"] and "log_tail" not in bwd


def test_liger_rows_say_why_without_a_worker(monkeypatch):
    def never(*_args):
        raise AssertionError("no worker for a shape Liger cannot compute")

    monkeypatch.setattr(liger, "run_job", never)
    args = _liger_args(("fwd",))
    clamped = scale_for_run(select_shapes("deepseek-v4-pro")[0], world_size=1, quick=False)
    base = {"shape": clamped.as_dict(), "num_tokens": 4096, "world_size": 1}
    device = torch.device("cuda", 0)
    (row,) = moe.liger_rows(clamped, 4096, args, device, base, {}, {}, lambda row: None)
    assert (
        row["status"] == "unsupported: LigerMoE's SwiGLU has no clamp (this shape clamps at 10.0)"
    )
    args.liger = dataclasses.replace(args.liger, reason="liger not importable: no package x")
    (row,) = moe.liger_rows(clamped, 4096, args, device, base, {}, {}, lambda row: None)
    assert row["status"] == "liger not importable: no package x" and "ms" not in row


def test_cpu_quick_run_never_attempts_liger(monkeypatch, tmp_path):
    def never(*_args, **_kwargs):
        raise AssertionError("the liger row is for CUDA runs only")

    monkeypatch.setattr(liger, "find_liger", never)
    monkeypatch.setattr(liger, "run_job", never)
    path = tmp_path / "bench.json"
    argv = ["--quick", "--device", "cpu", "--shapes", "mixtral-8x7b", "--passes", "fwd"]
    assert moe.main([*argv, "--reps", "1", "--warmup", "0", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["liger"] is None
    assert record["rows"] and all(row["impl"] != "liger" for row in record["rows"])
    args = moe.parse_args(["--no-liger"])
    assert moe.liger_availability(args, torch.device("cuda"), 1) is None
    assert moe.liger_availability(moe.parse_args([]), torch.device("cuda"), 2) is None


def test_worker_impls_check_and_time_like_the_harness():
    """The worker's two Impls over a PyTorch stand-in with moe_fused's signature and dtypes."""
    from benchmarks.inputs import make_inputs
    from benchmarks.reference import MAX_REL_ERR, moe_reference, reference_results
    from benchmarks.timing import TimingConfig

    calls = []

    def stand_in(x, expert_ids, weights, gate, up, down, num_experts, topk, pg):
        assert expert_ids.dtype == torch.int32 and weights.dtype == torch.bfloat16
        assert (num_experts, topk, pg) == (gate.shape[0], expert_ids.shape[1], None)
        calls.append(torch.is_grad_enabled())
        out = moe_reference(x, expert_ids.long(), weights.float(), gate, up, down)
        return out.to(torch.bfloat16)

    shape = scale_for_run(select_shapes("mixtral-8x7b")[0], world_size=1, quick=True)
    inputs = make_inputs(shape, 32, rank=0, world_size=1, device=CPU, seed=1, shared=False)
    reference = reference_results(inputs, with_grads=True)
    inference, training = liger._liger_impls(stand_in, inputs)
    fwd = moe.check(inference, inputs, {"out": reference["out"]}, None)
    train = moe.check(training, inputs, reference, None)
    assert set(fwd["rel_err"]) == {"out"}
    assert set(train["rel_err"]) == {"out", "x", "router_weights", "gate", "up", "down"}
    assert max(fwd["max_rel_err"], train["max_rel_err"]) < MAX_REL_ERR
    assert moe.refusal(train) is None and calls == [False, True]
    timing = TimingConfig(warmup=0, reps=1)
    for pass_name, impl in (("fwd", inference), ("fwdbwd", training), ("bwd", training)):
        assert moe.time_pass(impl, inputs, pass_name, timing, None) > 0


# A worker over several token counts: writes each one's result file, and hangs in the token count
# named by HANG until a marker file exists (so that only its first process hangs there).
MULTI_WORKER = """
import json, os, sys, time
folder, hang, tokens = sys.argv[1], int(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")]
print("worker over", tokens, flush=True)
for t in tokens:
    path = os.path.join(folder, f"tokens_{t}.json")
    with open(path, "w") as f:
        json.dump({"status": "running", "stage": "check", "passes": {}}, f)
    marker = os.path.join(folder, "hung_once")
    if t == hang and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(60)
    with open(path, "w") as f:
        json.dump({"status": "done", "stage": "done",
                   "passes": {"fwd": {"status": "ok", "ms": t / 1000}}}, f)
"""


@pytest.mark.parametrize("hang", [0, 64, 128])
def test_one_worker_over_token_counts_and_a_new_one_after_a_hang(monkeypatch, hang):
    """A hang costs its own token count: the harness kills the worker after the timeout and
    starts another for the token counts after it."""
    monkeypatch.setattr(peer_worker, "POLL_S", 0.05)
    commands = []

    def command_for(folder, tokens):
        commands.append(tokens)
        return [sys.executable, "-c", MULTI_WORKER, folder, str(hang),
                ",".join(str(t) for t in tokens)]  # fmt: skip

    results = peer_worker.run_worker("peer", command_for, {**os.environ}, 2.0, 1.0, (32, 64, 128))
    assert sorted(results) == [32, 64, 128]
    for t in (32, 64, 128):
        outcomes = peer_worker.pass_outcomes("peer", results[t], ("fwd", "bwd"))
        if t == hang:
            failure = "peer timeout: killed after 2 s in stage check"
            assert results[t]["failure"] == failure and results[t]["log_tail"]
            assert outcomes == {"fwd": {"status": failure}, "bwd": {"status": failure}}
            assert results[t]["wall_s"] >= 2.0
        else:
            assert "failure" not in results[t] and results[t]["wall_s"] < 2.0
            assert outcomes["fwd"] == {"status": "ok", "ms": t / 1000}
            assert outcomes["bwd"] == {"status": "peer: pass not run"}
    after = {0: [], 64: [(128,)], 128: []}[hang]
    assert commands == [(32, 64, 128), *after]


# A worker started ahead of its turn: it writes its stage, waits for the gate (bounded, as
# peer_worker.wait_for_gate), then finishes its token count.
GATED_WORKER = """
import json, os, sys, time
folder, gate = sys.argv[1], sys.argv[2]
path = os.path.join(folder, "tokens_4096.json")
with open(path, "w") as f:
    json.dump({"status": "running", "stage": "wait_gate", "passes": {}}, f)
began = time.monotonic()
while not os.path.exists(gate):
    assert time.monotonic() - began < 30, "gate never opened"
    time.sleep(0.01)
with open(path, "w") as f:
    json.dump({"status": "done", "stage": "done", "passes": {"fwd": {"status": "ok", "ms": 1.5}}}, f)
"""


def test_started_worker_waits_for_its_gate_and_is_run_from_there(monkeypatch):
    monkeypatch.setattr(peer_worker, "POLL_S", 0.05)

    def command_for(folder, gate):
        return [sys.executable, "-c", GATED_WORKER, folder, gate]

    started = peer_worker.start("peer", command_for, {**os.environ})
    result_path = peer_worker.result_file(started.folder.name, 4096)
    deadline = time.monotonic() + 30
    while peer_worker.read_result(result_path)["stage"] != "wait_gate":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.2)
    assert started.process.poll() is None  # still waiting: nothing opened its gate

    def never(*_args):
        raise AssertionError("a started worker's token count needs no new process")

    results = peer_worker.run_worker("peer", never, {**os.environ}, 20.0, 1.0, (4096,), started)
    assert results[4096]["status"] == "done" and "failure" not in results[4096]
    assert results[4096]["passes"]["fwd"]["ms"] == 1.5 and results[4096]["wall_s"] < 20
    assert not os.path.exists(started.folder.name)  # removed with its results read


def test_started_worker_stopped_unused_leaves_nothing(monkeypatch):
    started = peer_worker.start(
        "peer",
        lambda folder, gate: [sys.executable, "-c", GATED_WORKER, folder, gate],
        {**os.environ},
    )
    started.stop(1.0)
    assert started.process.poll() is not None and not os.path.exists(started.folder.name)


def test_gate_wait_is_bounded_and_names_what_it_waited_for(tmp_path):
    progress = peer_worker.Progress("liger", job(result_path=str(tmp_path)))
    gate = str(tmp_path / "gate")
    with pytest.raises(
        TimeoutError, match=f"gate {gate} not opened by the harness .pid {os.getppid()}."
    ):
        peer_worker.wait_for_gate(gate, progress, limit_s=0.1)
    assert progress.result["stage"] == "wait_gate"
    (tmp_path / "gate").touch()
    peer_worker.wait_for_gate(gate, progress, limit_s=0.1)
    assert progress.info["gate_wait_s"] >= 0


def _upcoming(names_and_tokens):
    return tuple((select_shapes(name)[0], t) for name, t in names_and_tokens)


def test_next_liger_worker_is_started_for_the_next_pair_it_supports(monkeypatch):
    """After a pair's Liger rows, the next pair's worker that Liger can run starts ahead, if
    the GPU has its heap and the headroom free; liger_rows then runs it, or stops one that
    is for another pair."""
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(multi_processor_count=132)
    )
    free = {"bytes": 140 * 2**30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _d: (free["bytes"], 141 * 2**30))
    events = []

    class FakeStarted:
        def __init__(self, one):
            self.job = one

        def stop(self):
            events.append(("stop", self.job.shape, self.job.tokens))

    def fake_start(one, _availability):
        events.append(("start", one.shape, one.tokens))
        return FakeStarted(one)

    def fake_run(one, _availability, started=None):
        events.append(("run", one.shape, one.tokens, started is not None))
        return {"passes": {"fwd": {"status": "ok", "ms": 2.0, "rel_err": {}, "max_rel_err": 0}}}

    monkeypatch.setattr(liger, "start", fake_start)
    monkeypatch.setattr(liger, "run_job", fake_run)
    args = _liger_args(("fwd",))
    device = torch.device("cuda", 0)
    qwen = scale_for_run(select_shapes("qwen3-30b-a3b")[0], world_size=1, quick=False)
    base = {"shape": qwen.as_dict(), "num_tokens": 4096, "world_size": 1}

    def rows_at(num_tokens, upcoming):
        args.upcoming = _upcoming(upcoming)
        ceilings = {"gemm_bf16_tflops": 800.0, "gemm_bf16_sustained_tflops": 600.0}
        moe.liger_rows(qwen, num_tokens, args, device, base, {}, ceilings, lambda row: None)

    # The clamped shape has no Liger worker: the one after it is started.
    rows_at(2048, [("deepseek-v4-pro", 2048), ("qwen3-30b-a3b", 4096)])
    assert events == [("run", "qwen3-30b-a3b", (2048,), False), ("start", "qwen3-30b-a3b", (4096,))]
    assert args.liger_started.job.heap_gib == liger.symmetric_heap_gib(4096, 128, 2048, 8, 132)
    events.clear()
    rows_at(4096, [])  # its turn: run from where it waits; nothing after it
    assert events == [("run", "qwen3-30b-a3b", (4096,), True)] and args.liger_started is None
    events.clear()
    rows_at(2048, [("qwen3-30b-a3b", 16384)])
    events.clear()
    rows_at(4096, [])  # started for 16384 tokens (a pair skipped, say): stopped, not used
    assert events == [("stop", "qwen3-30b-a3b", (16384,)), ("run", "qwen3-30b-a3b", (4096,), False)]
    events.clear()
    free["bytes"] = (9 + moe.LIGER_START_HEADROOM_GIB) * 2**30 - 1  # 16384 tokens: a 9 GiB heap
    rows_at(2048, [("qwen3-30b-a3b", 16384)])
    assert events == [("run", "qwen3-30b-a3b", (2048,), False)] and args.liger_started is None
    # Liger found but unusable (its rows say why): none runs, and none is started ahead.
    events.clear()
    free["bytes"] = 140 * 2**30
    args.liger = liger.LigerAvailability("liger_cute_kernels not importable")
    rows_at(2048, [("qwen3-30b-a3b", 4096)])
    assert events == [] and args.liger_started is None
