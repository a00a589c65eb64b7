"""tools/tree_ab.py: the A/B table of two trees' benchmark JSONs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import tree_ab  # noqa: E402


def _run(tmp_path: Path, name: str, mok_ms: float, base_ms: float) -> Path:
    shape = {"name": "qwen3-30b-a3b"}
    rows = [
        {"shape": shape, "num_tokens": 2048, "pass": "fwd", "impl": "mok", "ms": mok_ms},
        {"shape": shape, "num_tokens": 2048, "pass": "fwd", "impl": "torch_grouped_mm",
         "ms": base_ms},
        {"shape": shape, "num_tokens": 2048, "pass": "fwdbwd", "impl": "mok", "ms": None},
    ]  # fmt: skip
    path = tmp_path / name
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_a_difference_outside_both_spreads_is_named(tmp_path, capsys):
    a = [_run(tmp_path, "a1.json", 0.60, 1.36), _run(tmp_path, "a2.json", 0.61, 1.37)]
    b = [_run(tmp_path, "b1.json", 0.55, 1.36), _run(tmp_path, "b2.json", 0.56, 1.38)]
    assert tree_ab.main(["--a", *map(str, a), "--b", *map(str, b)]) == 0
    out = capsys.readouterr().out
    mok_line = [line for line in out.splitlines() if "B faster" in line]
    assert len(mok_line) == 1 and "0.917" in mok_line[0]  # 0.55 / 0.60
    assert "within the spread" in out  # the baseline's ranges overlap
    assert "fwdbwd" not in out  # an untimed row is left out


def test_overlapping_ranges_are_noise_and_missing_rows_fail(tmp_path, capsys):
    a = [_run(tmp_path, "a1.json", 0.60, 1.0), _run(tmp_path, "a2.json", 0.64, 1.0)]
    b = [_run(tmp_path, "b1.json", 0.62, 1.0)]
    assert tree_ab.main(["--a", *map(str, a), "--b", *map(str, b)]) == 0
    assert "B slower" not in capsys.readouterr().out
    assert tree_ab.main(["--a", str(a[0]), "--b", str(b[0]), "--impl", "sonicmoe"]) == 1
