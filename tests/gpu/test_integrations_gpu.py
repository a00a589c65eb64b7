"""mok inside transformers and TorchTitan on the GPU: the CPU file's checks with the models on
CUDA (H and I multiples of 256, as the sm_90a kernels need), and the README's CUDA block."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_integrations_cpu as cases  # noqa: E402
import test_readme  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
SIZES = dict(hidden=256, inter=256)


@pytest.mark.parametrize("family", cases.FAMILIES)
def test_transformers_model_on_gpu(family):
    cases.check_hf_model(family, CUDA, **SIZES)


def test_transformers_training_repeats_bitwise_on_gpu():
    cases.check_hf_training_repeats(CUDA, **SIZES)


def test_torchtitan_model_on_gpu():
    cases.check_torchtitan_model(CUDA, hidden=256, intermediate=256)


def test_torchtitan_training_repeats_bitwise_on_gpu():
    cases.check_torchtitan_training_repeats(CUDA, hidden=256, intermediate=256)


@pytest.mark.parametrize("check", ["the_model_matches_the_framework", "training_repeats_bitwise"])
def test_torchtitan_02_on_gpu(torchtitan_02_site, check):
    """TorchTitan 0.2 (which imports with torch 2.11) through mok's model converter: the model
    against TorchTitan's own experts, and training twice bitwise (tests/torchtitan_02_checks.py)."""
    from torchtitan_02_checks import run_check

    run_check(torchtitan_02_site, check, "cuda")


@pytest.mark.parametrize(
    "line,source", [b for b in test_readme.python_blocks() if b[1].startswith("# needs CUDA")]
)
def test_readme_cuda_blocks(line, source):
    exec(compile(source, f"README.md:{line}", "exec"), {"__name__": f"readme_{line}"})
