"""An ordinary install (`pip install .`, the wheel) carries every module and cubin of the tree.

.ci/run builds the wheel, installs it in a fresh venv and imports every module from there; these
checks are the quick part of that: the packages pyproject.toml finds cover the source tree.
"""

from __future__ import annotations

import json
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[1]


def found_packages() -> set[str]:
    """The packages setuptools installs, found as pyproject.toml's [tool.setuptools.packages.find]
    tells it."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    return set(setuptools.find_packages(where=str(ROOT), **find["find"]))


def source_packages() -> set[str]:
    """Every folder holding Python source under mok/, as its import name."""
    return {
        ".".join(source.parent.relative_to(ROOT).parts) for source in (ROOT / "mok").rglob("*.py")
    }


def test_every_source_folder_is_a_found_package():
    found = found_packages()
    # A folder of .py files without __init__.py would be neither found nor installed.
    assert source_packages() - found == set(), "source folders not found (no __init__.py?)"
    assert found - source_packages() == set()
    assert {"mok.launchers", "mok.runtime", "mok.dsl_kernels.sm90"} <= found


def test_installed_names_stay_under_mok():
    assert all(name == "mok" or name.startswith("mok.") for name in found_packages())


def test_package_data_carries_the_manifest_and_every_cubin():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setup["package-data"]["mok.dsl_kernels"]
    cubins = ROOT / "mok" / "dsl_kernels" / "cubins"
    manifest = json.loads((cubins / "manifest.json").read_text())
    shipped = ["manifest.json", *(entry["cubin"] for entry in manifest["variants"])]
    for name in shipped:
        assert (cubins / name).is_file(), name
        assert any(fnmatch(f"cubins/{name}", pattern) for pattern in patterns), name


def test_source_checkout_imports_without_an_editable_install():
    """From the checkout's root with no install at all (`-S` leaves out site's .pth files, and
    with them an editable install's finder), mok.runtime and mok.dsl_kernels are the folders
    under mok/: the folders are the import names."""
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
    assert out == [os.path.join(root, "mok", "runtime", "__init__.py"),
                   os.path.join(root, "mok", "dsl_kernels", "__init__.py")]  # fmt: skip
