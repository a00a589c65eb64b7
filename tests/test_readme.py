"""README's two fresh-machine commands exist, and .ci/run runs the test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_COMMAND = "pip install torch==2.13.0 -e . && python -m mok"
TEST_COMMAND = 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest -q'


def test_readme_commands_and_ci_agree():
    readme = (ROOT / "README.md").read_text()
    assert RUN_COMMAND in readme
    assert TEST_COMMAND in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in ci
