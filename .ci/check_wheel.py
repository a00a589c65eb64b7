"""Check an installed mok against the checkout it was built from (run by .ci/run from a venv).

    python check_wheel.py SOURCE_ROOT core   # torch + cuda-python only: mok imports without the DSL
    python check_wheel.py SOURCE_ROOT all    # with the dev extra: every module imports

Run it from outside the checkout, so that `import mok` finds the installed copy. It checks:
- mok is imported from site-packages, not from SOURCE_ROOT;
- every .py file of the source packages is an installed module (walked with pkgutil), and the
  installed package has no module the sources lack;
- every module imports (`core`: each one outside mok.dsl_kernels and mok.integrations, and
  the kernel sources fail only for want of the DSL, the integrations only for want of their
  framework: both come with the dev extra; of the two TorchTitan entries, one per TorchTitan
  line, the one for the line not installed raises ImportError naming the other);
- the manifest and every cubin it names are installed, byte-equal to the checkout's.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from importlib import resources
from pathlib import Path

# mok's entries for the two TorchTitan lines: 0.3's overrides, 0.2's model converter.
TORCHTITAN_ENTRIES = ("mok.integrations.torchtitan", "mok.integrations.torchtitan_converter")


def source_modules(source_root: Path) -> set[str]:
    """Every .py file under the checkout's mok/, as its import name."""
    names = set()
    for source in (source_root / "mok").rglob("*.py"):
        parts = source.relative_to(source_root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.add(".".join(parts))
    return names


def installed_modules() -> set[str]:
    import mok

    # walk_packages imports each package (its __init__) to list the package's children; one that
    # fails to import is listed without them, which the comparison with the sources then reports.
    return {"mok", *(info.name for info in pkgutil.walk_packages(mok.__path__, "mok."))}


def main() -> int:
    source_root, mode = Path(sys.argv[1]).resolve(), sys.argv[2]
    import mok

    location = Path(mok.__file__).resolve()
    if source_root in location.parents:
        raise SystemExit(f"mok imported from the checkout ({location}), not the installed wheel")
    print(f"mok from {location.parent}")

    expected, installed = source_modules(source_root), installed_modules()
    if expected != installed:
        raise SystemExit(
            f"installed modules differ from the sources: missing {sorted(expected - installed)}, "
            f"extra {sorted(installed - expected)}"
        )

    failures, other_version = [], []
    for name in sorted(installed):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            needs_dsl = error.name == "cutlass" or str(error.name).startswith("cutlass.")
            # An integration imports its framework, which only the dev extra installs.
            framework = name.startswith("mok.integrations.") and str(error.name).split(".")[0] in (
                "transformers",
                "torchtitan",
                "triton",
            )
            if mode == "core" and needs_dsl and name.startswith("mok.dsl_kernels."):
                continue
            if not (mode == "core" and framework):
                failures.append(f"{name}: {error!r}")
        except ImportError as error:
            # Each TorchTitan entry is for one TorchTitan line (0.3: overrides, 0.2: model
            # converters) and names the other when imported under it; one of them must import.
            if name in TORCHTITAN_ENTRIES and "needs TorchTitan" in str(error):
                other_version.append(name)
            else:
                failures.append(f"{name}: {error!r}")
        except Exception as error:  # report every module that fails, then stop
            failures.append(f"{name}: {error!r}")
    if mode == "all" and len(other_version) == len(TORCHTITAN_ENTRIES):
        failures.append(f"neither TorchTitan entry imports: {other_version}")
    if failures:
        raise SystemExit("modules that do not import:\n  " + "\n  ".join(failures))
    print(f"{len(installed)} modules installed, each imports ({mode})")

    cubins = resources.files("mok.dsl_kernels") / "cubins"
    manifest = json.loads((cubins / "manifest.json").read_text())
    source_cubins = source_root / "mok" / "dsl_kernels" / "cubins"
    if (cubins / "manifest.json").read_bytes() != (source_cubins / "manifest.json").read_bytes():
        raise SystemExit("installed manifest.json differs from the checkout's")
    names = [entry["cubin"] for entry in manifest["variants"]]
    wrong = [
        name
        for name in names
        if not (cubins / name).is_file()
        or (cubins / name).read_bytes() != (source_cubins / name).read_bytes()
    ]
    if wrong:
        raise SystemExit(f"cubins missing from the install or unequal to the checkout's: {wrong}")
    print(f"manifest and {len(names)} cubins installed, byte-equal to the checkout's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
