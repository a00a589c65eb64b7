"""tools/kernel_ab.py: its arguments and its comparison table (the timing needs a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mok.runtime.manifest import installed_cubin_dir
from mok.testing import make_inputs
from tools import kernel_ab


def _row(name, round_, fwd, fwdbwd, digest, shape="qwen3-30b-a3b", tokens=2048):
    return {"name": name, "round": round_, **kernel_ab.Case(shape, tokens)._asdict(), "fwd": fwd,
            "fwdbwd": fwdbwd, "hash": digest}  # fmt: skip


def test_table_gives_best_times_ratios_and_bits():
    results = [
        _row("shipped", 1, 0.70, 2.20, "aa"),
        _row("variant", 1, 0.75, 2.40, "aa"),
        _row("changed", 1, 0.60, 2.00, "bb"),
        _row("shipped", 2, 0.68, 2.10, "aa"),
        _row("variant", 2, 0.71, 2.50, "aa"),
        _row("changed", 2, 0.61, 2.05, "bb"),
    ]
    lines = kernel_ab.table(results)
    rows = {(line.split()[2], line.split()[3]): line.split() for line in lines[1:]}
    assert rows[("fwd", "shipped")][4:] == ["0.680", "1.000", "same"]
    assert rows[("fwd", "variant")][4:] == ["0.710", "1.044", "same"]  # 0.71 / 0.68
    assert rows[("fwdbwd", "variant")][4:] == ["2.400", "1.143", "same"]  # 2.40 / 2.10
    # A faster build that changes the bits is named, whatever its time.
    assert rows[("fwd", "changed")][4:] == ["0.600", "0.882", "DIFFERENT"]


def test_table_flags_bits_that_change_between_rounds():
    results = [_row("shipped", 1, 0.7, 2.2, "aa"), _row("shipped", 2, 0.7, 2.2, "ab")]
    assert all("differ between rounds" in line for line in kernel_ab.table(results)[1:])


def test_cases_and_folders_are_checked(tmp_path):
    cases = kernel_ab.parse_cases(
        "qwen3-30b-a3b:2048, deepseek-v3:16384,qwen3-30b-a3b:4096:mb4096:gather,kimi-k2:64:mb256,"
        "qwen3-30b-a3b:2048:main,qwen3-30b-a3b:4096:mb4096:gather:main"
    )
    assert cases == [
        ("qwen3-30b-a3b", 2048, 0, "gate_up", False),
        ("deepseek-v3", 16384, 0, "gate_up", False),
        ("qwen3-30b-a3b", 4096, 4096, "gather", False),
        ("kimi-k2", 64, 256, "gate_up", False),
        ("qwen3-30b-a3b", 2048, 0, "gate_up", True),
        ("qwen3-30b-a3b", 4096, 4096, "gather", True),
    ]
    assert [case.label() for case in cases] == [
        "2048", "16384", "4096/mb4096g", "64/mb256", "2048+main", "4096/mb4096g+main",
    ]  # fmt: skip
    for bad, message in (("qwen3-30b-a3b", "SHAPE:TOKENS"), ("qwen3-30b-a3b:0", "SHAPE:TOKENS"),
                         ("llama:2048", "unknown shape 'llama'"), ("", "no case"),
                         ("qwen3-30b-a3b:2048:4096", "mbROWS"),
                         ("qwen3-30b-a3b:2048:mb4096:all", "mbROWS"),
                         ("qwen3-30b-a3b:2048:main:mb4096", "mbROWS"),
                         ("qwen3-30b-a3b:2048:gather", "mbROWS"),
                         ("qwen3-30b-a3b:2048:mb1000", "multiple of 256 below TOKENS x k = 16384"),
                         ("qwen3-30b-a3b:2048:mb16384", "below TOKENS x k = 16384, got 16384")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            kernel_ab.parse_cases(bad)
    with pytest.raises(ValueError, match="no manifest.json"):
        kernel_ab.parse_dirs([f"x={tmp_path}"])
    with pytest.raises(ValueError, match="NAME=DIR"):
        kernel_ab.parse_dirs([str(tmp_path)])
    (tmp_path / "manifest.json").write_text("{}")
    dirs = kernel_ab.parse_dirs([f"x={tmp_path}"])
    assert [name for name, _ in dirs] == ["shipped", "x"]
    assert (dirs[0][1] / "manifest.json").is_file()  # the installed cubins
    with pytest.raises(ValueError, match="is taken"):
        kernel_ab.parse_dirs([f"shipped={tmp_path}"])


def test_a_case_runs_and_hashes_its_bits_on_the_cpu():
    """The worker's whole path (inputs, schedule, forward, backward, hash) at the quick sizes on
    mok's CPU path: two runs give the same bits."""
    case = kernel_ab.Case("qwen3-30b-a3b", 64)
    first = kernel_ab.time_case(case, reps=1, device="cpu", quick=True)
    again = kernel_ab.time_case(case, reps=1, device="cpu", quick=True)
    assert first["hash"] == again["hash"] and len(first["hash"]) == 16
    assert first["fwd"] > 0 and first["fwdbwd"] > 0
    other = kernel_ab.time_case(kernel_ab.Case("deepseek-v4-pro", 64), reps=1, device="cpu",
                                quick=True)  # fmt: skip
    assert other["hash"] != first["hash"]  # a shape with its clamp, other bits
    # Macrobatches: the same bits as every row at once.
    ring = kernel_ab.time_case(case._replace(macrobatch=256), reps=1, device="cpu", quick=True)
    assert ring["hash"] == first["hash"]
    # fp32 main_grads: the routed weights' gradients are the fp32 sums, other bits.
    main = kernel_ab.time_case(case._replace(main_grads=True), reps=1, device="cpu", quick=True)
    assert main["hash"] != first["hash"] and main["fwdbwd"] > 0
    # The inputs it draws on the device: distinct experts per token.
    inputs = make_inputs(64, 128, 128, 16, 8, device="cpu", generate_on_device=True)
    assert inputs["top_experts"].shape == (64, 8)
    ids = inputs["top_experts"].sort(dim=1).values
    assert bool((ids[:, 1:] != ids[:, :-1]).all())


def test_the_whole_comparison_runs_on_the_cpu(tmp_path, capsys, monkeypatch):
    """Folders in turn, one worker process each, their rows gathered into the table: the
    plumbing end to end (on the CPU every folder runs mok's reference path, so the bits match)."""
    import shutil

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # workers run `-m tools.kernel_ab`
    shutil.copy(installed_cubin_dir() / "manifest.json", tmp_path / "manifest.json")
    rc = kernel_ab.main(["--dir", f"copy={tmp_path}", "--cases", "qwen3-30b-a3b:64",
                         "--rounds", "1", "--reps", "1", "--device", "cpu", "--quick"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    table = out[out.index("shape ") :].splitlines()
    assert len(table) == 1 + 2 * 2  # header, 2 passes x 2 folders
    assert all(line.endswith("same") for line in table[1:])
    assert "round 1 copy" in out


def test_a_budget_keeps_what_ran_and_starts_nothing_that_cannot_fit(tmp_path, capsys, monkeypatch):
    """--budget-s: a process cut by it still gives the cases it finished; no process starts
    once the longest so far no longer fits; the table and the list of what did not run print."""
    import subprocess
    import time

    (tmp_path / "manifest.json").write_text("{}")
    row = {"name": "shipped", "round": 1, **kernel_ab.Case("qwen3-30b-a3b", 64)._asdict(),
           "fwd": 1.0, "fwdbwd": 3.0, "hash": "aa"}  # fmt: skip
    calls = []

    def cut_worker(cmd, timeout, **_):
        calls.append(cmd[cmd.index("--worker") + 1])
        time.sleep(0.3)
        raise subprocess.TimeoutExpired(
            cmd, timeout, output=(kernel_ab.MARK + json.dumps(row) + "\n").encode()
        )

    monkeypatch.setattr(kernel_ab.subprocess, "run", cut_worker)
    rc = kernel_ab.main(["--dir", f"copy={tmp_path}", "--cases", "qwen3-30b-a3b:64", "--rounds", "2",
                         "--device", "cpu", "--budget-s", "0.5"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1 and calls == ["shipped"], out
    assert "round 1 shipped" in out and "qwen3-30b-a3b                  64 fwd     shipped" in out
    assert "not run (--budget-s 0.5): copy round 1, shipped round 2, copy round 2" in out
    assert "FAILED shipped round 1: over 1 s" in out
