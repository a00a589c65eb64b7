"""Shared test setup: GPU markers skip cleanly on machines without a GPU."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip)


TORCHTITAN_02 = "torchtitan==0.2.2"


@pytest.fixture(scope="session")
def torchtitan_02_site(tmp_path_factory):
    """A folder holding TorchTitan 0.2 (installed now with pip, without its dependencies: the
    test environment's are 0.3's, which 0.2's model code imports too), for the checks of mok's
    0.2 model converter, which run in processes that put it first on PYTHONPATH
    (tests/torchtitan_02_checks.py). Skips with pip's reason where it cannot be installed; pip's
    environment settings apply (PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR for a machine without a
    network, with the wheel in DIR)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    site = tmp_path_factory.mktemp("torchtitan_02")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
         "--disable-pip-version-check", "--target", str(site), TORCHTITAN_02],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"pip could not install {TORCHTITAN_02}: {done.stderr.strip()[-400:]}")
    return site
