"""The megakernels' diagnostic timeline (mok/dsl_kernels/common/timeline.py,
tools/phase_timeline.py) on CPU: the build option that makes it, the loader's folder override,
and the words' place past the counters as the kernel computes it. The shipped cubins have none
of it (`python -m mok.dsl_kernels.build --check` compares them with the sources)."""

from __future__ import annotations

import pytest
import torch

from mok.launchers.megakernel_walk import (
    FORWARD_COUNTER_TAIL,
    TIMELINE_STAMPS,
    megakernel_counters,
    timeline_words,
)
from mok.runtime import manifest


@pytest.mark.parametrize("capacity", [128, 384, 1000])
def test_the_words_are_where_the_kernel_writes_them(capacity):
    ctas = 5
    counters = megakernel_counters(capacity, FORWARD_COUNTER_TAIL, torch.device("cpu"), ctas)
    words = timeline_words(counters, capacity, FORWARD_COUNTER_TAIL, ctas)
    assert tuple(words.shape) == (ctas, TIMELINE_STAMPS)
    # common/timeline.py timeline_address: past the counters' int32 words from the next 8-byte
    # boundary, STAMPS int64 words a CTA.
    counter_words = 2 * (-(-capacity // 128)) + FORWARD_COUNTER_TAIL
    base = counters.tensor.data_ptr()
    for cta, slot in ((0, 0), (3, 7), (ctas - 1, TIMELINE_STAMPS - 1)):
        kernel_at = base + (counter_words + 1) // 2 * 8 + (cta * TIMELINE_STAMPS + slot) * 8
        assert words[cta, slot].data_ptr() == kernel_at
    assert words.data_ptr() + words.numel() * 8 <= base + counters.tensor.numel() * 4
    plain = megakernel_counters(capacity, FORWARD_COUNTER_TAIL, torch.device("cpu"))
    assert plain.tensor.numel() == counter_words  # no timeline: the counters alone


def test_the_kernel_folder_override(monkeypatch, tmp_path):
    monkeypatch.delenv(manifest.KERNEL_DIR_ENV_VAR, raising=False)
    shipped = manifest.default_manifest_path()
    monkeypatch.setenv(manifest.KERNEL_DIR_ENV_VAR, str(tmp_path))
    assert manifest.default_manifest_path() == tmp_path / manifest.MANIFEST_FILENAME
    monkeypatch.delenv(manifest.KERNEL_DIR_ENV_VAR)
    assert manifest.default_manifest_path() == shipped


def test_the_diagnostic_build_is_checked_before_compiling(tmp_path, capsys):
    pytest.importorskip(
        "cutlass", reason="nvidia-cutlass-dsl is not installed (pip install -e .[dev])"
    )
    from mok.dsl_kernels import build

    assert build.main(["--only", "moe_forward", "--set", "bogus=1", "--out", str(tmp_path)]) == 2
    assert "--set ['bogus']: not config fields of moe_forward" in capsys.readouterr().err
    assert build.main(["--set", "timeline=True", "--out", str(tmp_path)]) == 2
    assert build.main(["--only", "moe_forward", "--set", "timeline=True"]) == 2  # shipped dir
    assert "--set needs --only" in capsys.readouterr().err


def test_the_stamps_and_slots_agree_on_both_sides():
    pytest.importorskip(
        "cutlass", reason="nvidia-cutlass-dsl is not installed (pip install -e .[dev])"
    )
    from mok.dsl_kernels.common import timeline
    from mok.dsl_kernels.sm90 import moe_backward, moe_forward
    from mok.launchers.megakernel_walk import BACKWARD_COUNTER_TAIL
    from tools import phase_timeline

    assert timeline.STAMPS == TIMELINE_STAMPS
    assert phase_timeline.SLOTS == moe_forward.TIMELINE_SLOTS
    assert phase_timeline.BACKWARD_SLOTS == moe_backward.TIMELINE_SLOTS
    for kernel in (moe_forward, moe_backward):
        assert len(kernel.TIMELINE_SLOTS) <= TIMELINE_STAMPS
    assert moe_forward.COUNTER_TAIL == FORWARD_COUNTER_TAIL
    assert moe_backward.COUNTER_TAIL == BACKWARD_COUNTER_TAIL
    for phases, slots in ((phase_timeline.PHASES, phase_timeline.SLOTS),
                          (phase_timeline.BACKWARD_PHASES, phase_timeline.BACKWARD_SLOTS)):  # fmt: skip
        assert {slot for _, a, b in phases for slot in (a, b)} <= set(slots)


def test_a_diagnostic_folder_takes_several_variants_in_one_build(tmp_path, capsys):
    """`--only A,B --set F=V`: both variants rebuilt with the field into the folder's manifest
    (merged with the copy's other entries), each with its own cubin; a name not registered,
    or a field one of them lacks, fails before anything is written."""
    pytest.importorskip(
        "cutlass", reason="nvidia-cutlass-dsl is not installed (pip install -e .[dev])"
    )
    import json
    import shutil

    from mok.dsl_kernels import build
    from mok.runtime.manifest import installed_cubin_dir

    shipped = installed_cubin_dir()
    folder = tmp_path / "cubins"
    shutil.copytree(shipped, folder)
    names = "moe_forward,moe_backward"
    assert build.main(["--arch", "sm_90a", "--only", "moe_forward,nope", "--set",
                       "timeline=True", "--out", str(folder)]) == 2  # fmt: skip
    assert "['nope']: not registered variants" in capsys.readouterr().err
    assert build.main(["--arch", "sm_90a", "--only", f"{names},expert_gemm_down", "--set",
                       "timeline=True", "--out", str(folder)]) == 2  # fmt: skip
    assert "not config fields of expert_gemm_down" in capsys.readouterr().err
    for name in names.split(","):  # nothing written by the refused builds
        cubin = f"{name}.sm_90a.cubin"
        assert (folder / cubin).read_bytes() == (shipped / cubin).read_bytes()
    assert build.main(["--arch", "sm_90a", "--only", names, "--set", "timeline=True",
                       "--out", str(folder)]) == 0  # fmt: skip
    entries = json.loads((folder / "manifest.json").read_text())["variants"]
    shipped_entries = json.loads((shipped / "manifest.json").read_text())["variants"]
    assert len(entries) == len(shipped_entries)
    for name in names.split(","):
        cubin = f"{name}.sm_90a.cubin"
        assert (folder / cubin).read_bytes() != (shipped / cubin).read_bytes()
        (entry,) = [e for e in entries if e["name"] == name and e["arch"] == "sm_90a"]
        assert entry["config"]["timeline"] is True
    untouched = "expert_gemm_down.sm_90a.cubin"
    assert (folder / untouched).read_bytes() == (shipped / untouched).read_bytes()
