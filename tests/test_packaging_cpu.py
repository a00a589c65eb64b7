"""An ordinary install (`pip install .`, the wheel) carries every package of the source tree."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_for_the_wheel():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    for import_root, folder in setup["package-dir"].items():
        if import_root != "mok":
            continue
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            name = ".".join((import_root, *relative))
            assert name in listed, f"{name} is missing from [tool.setuptools] packages"
    for import_root, folder in setup["package-dir"].items():
        assert (ROOT / folder / "__init__.py").exists(), import_root
