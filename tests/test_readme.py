"""README's two fresh-machine commands exist, .ci/run runs the test command and checks the wheel,
and every repository path the docs name is in the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_COMMAND = "pip install torch==2.13.0 -e . && python -m mok"
TEST_COMMAND = 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest -q'
DOCS = ("README.md", "examples/README.md", "docs/SEMANTICS.md", "docs/DESIGN.md", "docs/NOTES.md")
# A `code span` is taken for a path when it starts with one of these folders or with ../; link
# targets ([text](target)) always are, unless they are URLs.
TOP_FOLDERS = {
    "docs",
    "examples",
    "tests",
    "mok",
    "benchmarks",
    "tools",
    ".ci",
    "..",
}


def test_readme_commands_and_ci_agree():
    readme = (ROOT / "README.md").read_text()
    assert RUN_COMMAND in readme
    assert TEST_COMMAND in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in ci


def test_ci_builds_installs_and_checks_the_wheel():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip wheel --no-deps --no-build-isolation" in ci
    assert "python -m venv" in ci and "--system-site-packages" not in ci
    assert "venv/bin/python -m mok" in ci
    assert ci.count(".ci/check_wheel.py") == 2  # without the DSL (core), then with it (all)


def named_paths(text: str) -> list[str]:
    spans = [s for s in re.findall(r"`([^`\s]+)`", text) if s.split("/")[0] in TOP_FOLDERS]
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    # A pytest node id (`tests/x.py::test_y`) names its file.
    paths = [p.split("::")[0].rstrip(",.;:") for p in spans + links]
    return [p for p in paths if "/" in p or p.endswith((".md", ".png"))]


@pytest.mark.parametrize("doc", DOCS)
def test_paths_the_docs_name_are_in_the_repository(doc):
    named = named_paths((ROOT / doc).read_text())
    assert named, f"{doc} names no path: the pattern is broken"
    for path in named:
        # Relative to the repository root or to the doc's own folder; never outside the
        # repository (shared/ sits beside the checkout on these machines, but not in a clone).
        candidates = [(ROOT / path).resolve(), (ROOT / doc).parent.joinpath(path).resolve()]
        inside = [c for c in candidates if c.is_relative_to(ROOT) and c.exists()]
        assert inside, f"{doc} names {path}, which is not in the repository"


def python_blocks(doc: str = "README.md") -> list[tuple[int, str]]:
    """(line, source) of every ```python block of a doc."""
    text = (ROOT / doc).read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]  # fmt: skip


def test_readme_has_python_blocks():
    assert len(python_blocks()) >= 4


@pytest.mark.parametrize("line,source", python_blocks(), ids=lambda v: str(v)[:20])
def test_readme_python_block_runs_as_written(line, source):
    """Every Python block of the README runs as written, each in a fresh namespace. A block
    that starts with `# needs CUDA` runs only where CUDA is (tests/gpu run it on the GPU)."""
    import torch

    if source.startswith("# needs CUDA") and not torch.cuda.is_available():
        pytest.skip(f"README.md:{line} needs CUDA")
    if "transformers" in source:
        pytest.importorskip("transformers")
    if "torchtitan" in source:
        pytest.importorskip("torchtitan")
    exec(compile(source, f"README.md:{line}", "exec"), {"__name__": f"readme_{line}"})
