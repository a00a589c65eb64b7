"""Which packages the wheel holds: found under three source folders, never listed by hand.

Everything else (metadata, dependencies, package data) is in pyproject.toml. setup.py exists
because pyproject's `packages.find` names a package after its path, and two of mok's source
folders are installed under another name: runtime/ as mok.runtime, dsl_kernels/ as
mok.dsl_kernels, so that nothing generic like `runtime` lands in site-packages.
"""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
# Installed import name -> source folder. A subpackage (any folder with an __init__.py below
# one of these) is found and installed under its root's name.
PACKAGE_ROOTS = {"mok": "mok", "mok.runtime": "runtime", "mok.dsl_kernels": "dsl_kernels"}


def found_packages() -> list[str]:
    packages = []
    for name, folder in PACKAGE_ROOTS.items():
        packages += [name, *(f"{name}.{sub}" for sub in find_packages(where=HERE / folder))]
    return packages


setup(package_dir=PACKAGE_ROOTS, packages=found_packages())
