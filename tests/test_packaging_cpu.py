"""An ordinary install (`pip install .`, the wheel) carries every module and cubin of the tree.

.ci/run builds the wheel, installs it in a fresh venv and imports every module from there; these
checks are the quick part of that: what setup.py hands setuptools covers the source tree.
"""

from __future__ import annotations

import json
import runpy
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import setuptools

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_args() -> dict:
    """The keyword arguments setup.py passes to setuptools.setup (setup.py run, not built)."""
    captured = {}
    patch = pytest.MonkeyPatch()
    patch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    try:
        runpy.run_path(str(ROOT / "setup.py"))
    finally:
        patch.undo()
    return captured


def source_packages(package_dir: dict[str, str]) -> set[str]:
    """Every folder holding Python source under a package root, as its installed name."""
    names = set()
    for import_root, folder in package_dir.items():
        for source in (ROOT / folder).rglob("*.py"):
            relative = source.parent.relative_to(ROOT / folder).parts
            names.add(".".join((import_root, *relative)))
    return names


def test_every_source_folder_is_a_found_package(setup_args):
    found = set(setup_args["packages"])
    expected = source_packages(setup_args["package_dir"])
    # A folder of .py files without __init__.py would be neither found nor installed.
    assert expected - found == set(), "source folders not found as packages (no __init__.py?)"
    assert found - expected == set()
    assert {"mok.launchers", "mok.runtime", "mok.dsl_kernels.sm90"} <= found


def test_installed_names_stay_under_mok(setup_args):
    assert setup_args["package_dir"] == {
        "mok": "mok",
        "mok.runtime": "runtime",
        "mok.dsl_kernels": "dsl_kernels",
    }
    assert all(name == "mok" or name.startswith("mok.") for name in setup_args["packages"])


def test_package_data_carries_the_manifest_and_every_cubin():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setup["package-data"]["mok.dsl_kernels"]
    cubins = ROOT / "dsl_kernels" / "cubins"
    manifest = json.loads((cubins / "manifest.json").read_text())
    shipped = ["manifest.json", *(entry["cubin"] for entry in manifest["variants"])]
    for name in shipped:
        assert (cubins / name).is_file(), name
        assert any(fnmatch(f"cubins/{name}", pattern) for pattern in patterns), name


def test_source_checkout_imports_without_an_editable_install():
    """From the checkout's root with a plain (non-editable) install, mok/ shadows the installed
    package: mok.runtime and mok.dsl_kernels must still resolve to the sibling folders. `-S`
    leaves out site's .pth files, and with them the editable install's finder."""
    import os
    import subprocess
    import sys

    import torch

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    site = os.path.dirname(os.path.dirname(torch.__file__))
    code = (
        f"import sys; sys.path.insert(0, {root!r}); sys.path.append({site!r}); "
        "import mok.runtime, mok.dsl_kernels, mok.functional, mok.launchers; "
        "print(mok.runtime.__file__); print(mok.dsl_kernels.__file__)"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         check=True, cwd=root).stdout.split()  # fmt: skip
    assert out == [os.path.join(root, "runtime", "__init__.py"),
                   os.path.join(root, "dsl_kernels", "__init__.py")]  # fmt: skip
