"""tools/original_suite.py against a fake original checkout: real subprocesses, no GPU.

The fake checkout's tests are trivial and written here; they stand for the original's kinds of
node (passing, failing, needing EP >= 2, hanging, looping over shapes(world_size)). The fake
checkout also has a mok/ package that must never be imported.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _load_runner():
    spec = importlib.util.spec_from_file_location(
        "original_suite", REPO_ROOT / "tools" / "original_suite.py"
    )
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the class is made.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


runner = _load_runner()

FAKE_TESTS = {
    "tests/__init__.py": "",
    "tests/conftest.py": """
        import os

        import pytest


        @pytest.fixture(scope="session")
        def context():
            # The original's fixture reads these; the runner must set them for one rank.
            return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "cpu"
    """,
    "tests/test_fake.py": """
        import time

        import mok


        def test_passes(context):
            print("MOK_FILE=" + mok.__file__)
            assert context[:2] == (0, 1)


        def test_fails(context):
            assert 1 + 1 == 3, "fake failure"


        def test_needs_two_ranks(context):
            raise AssertionError("the runner must not run a test its table skips")


        def test_hangs():
            time.sleep(600)
    """,
    "tests/test_shapes.py": """
        import pytest

        from .utils import shapes


        def test_small_shapes_only(context):
            names = [row[0] for row in shapes(context[1])]
            print("SHAPES=" + ",".join(names))
            assert names == ["small"]


        def test_skips_itself(context):
            if context[1] < 2:
                pytest.skip("needs two ranks")
    """,
    "tests/utils.py": """
        def shapes(world_size):
            # (name, routed experts, hidden, intermediate, top-k, local tokens), as the original
            return (
                ("huge", 64, 4096, 4096, 8, 512),
                ("small", 4, 256, 256, 2, 512),
                # 64 experts x 128 rows cannot fit one rank's 2 x 16 x 1 routed rows.
                ("crowded", 64, 256, 256, 1, 16),
            )
    """,
    # A package named mok in the checkout: importing it would shadow the mok under test.
    "mok/__init__.py": "raise ImportError('the checkout mok was imported, not the repository')\n",
}

TEST_ADAPTATIONS = (
    runner.Adaptation(
        "tests/test_fake.py::test_needs_two*",
        "skip",
        "its own inputs need two ranks",
        category="EP >= 2",
    ),
    runner.Adaptation(
        "tests/test_shapes.py::test_small_shapes_only",
        "reduce_shapes",
        "two copies of the routed weights",
        weight_copies=2,
        fit_schedule=True,
    ),
)


@pytest.fixture(scope="module", autouse=True)
def quick_pytest():
    # Third-party pytest plugins (hypothesis, benchmark, ...) cost ~3 s a process here; the
    # fake tests need none. The runner passes its environment on to every run.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        yield


@pytest.fixture(scope="module")
def fake_checkout(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("original")
    for name, text in FAKE_TESTS.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


@pytest.fixture(scope="module")
def suite(fake_checkout):
    lines: list[str] = []
    # "huge" holds 3*64*4096*4096*2 bytes = 6 GiB of routed weights, "small" 1.5 MiB: a 1 GiB
    # budget keeps only "small".
    result = runner.run_suite(
        fake_checkout,
        adaptations=TEST_ADAPTATIONS,
        known_differences={"tests/test_fake.py::test_fails": "a documented difference"},
        timeout_s=5.0,
        memory_budget_gib=1.0,
        log=lines.append,
    )
    return result, lines


def _records(result) -> dict[str, object]:
    return {record.node: record for record in result.records}


def test_every_node_gets_its_outcome(suite):
    result, _ = suite
    outcomes = {node: record.outcome for node, record in _records(result).items()}
    assert outcomes == {
        "tests/test_fake.py::test_passes": "passed",
        "tests/test_fake.py::test_fails": "failed",
        "tests/test_fake.py::test_needs_two_ranks": "skipped",
        "tests/test_fake.py::test_hangs": "timeout",
        "tests/test_shapes.py::test_small_shapes_only": "passed",
        "tests/test_shapes.py::test_skips_itself": "skipped",
    }


def test_summary_line_counts_and_names_mok(suite):
    result, _ = suite
    version, commit = runner.mok_identity()
    identity = f"mok {version}" + (f", {commit}" if commit else "")
    assert result.summary == (
        "original suite: 2 passed, 1 failed, 2 skipped (1 EP >= 2, 1 by the test), "
        f"1 timed out of 6 ({identity})"
    )


def test_import_mok_is_this_repository(suite, fake_checkout):
    result, lines = suite
    # The checkout has a mok/: the runner must say it runs a copy of tests/ elsewhere.
    assert result.workdir_note.startswith(f"{fake_checkout.resolve()}/mok exists")
    assert f"note: {result.workdir_note}" in lines
    tail = _records(result)["tests/test_fake.py::test_passes"].tail
    assert f"MOK_FILE={REPO_ROOT / 'mok' / '__init__.py'}" in tail


def test_adaptations_and_details_are_recorded(suite):
    result, _ = suite
    records = _records(result)
    skipped = records["tests/test_fake.py::test_needs_two_ranks"]
    assert skipped.adaptation.startswith("skip (EP >= 2)")
    assert skipped.tail == ""  # never started
    reduced = records["tests/test_shapes.py::test_small_shapes_only"]
    assert reduced.adaptation.startswith("shapes reduced (2 x")
    assert "shape 'huge' dropped" in reduced.tail
    assert "shape 'crowded' dropped: 64 experts x 128 rows > the schedule's 2 x 16 x 1" in (
        reduced.tail
    )
    assert "SHAPES=small" in reduced.tail
    failed = records["tests/test_fake.py::test_fails"]
    assert failed.detail.startswith("a documented difference | ")
    assert "fake failure" in failed.tail
    assert records["tests/test_fake.py::test_hangs"].detail == "killed after 5 s"
    assert "needs two ranks" in records["tests/test_shapes.py::test_skips_itself"].detail


def test_a_failure_is_explained_as_it_happens(suite):
    """The reason and the output's tail follow the failing node's line at once, so a run killed
    before its table still shows why each node failed."""
    result, lines = suite
    failed = _records(result)["tests/test_fake.py::test_fails"]
    at = next(i for i, line in enumerate(lines) if line.endswith("tests/test_fake.py::test_fails"))
    assert lines[at + 1] == f"    {failed.detail}"
    assert "fake failure" in lines[at + 2]
    passed = next(i for i, line in enumerate(lines) if line.endswith("test_fake.py::test_passes"))
    assert not lines[passed + 1].startswith("    ")


def test_a_row_fits_one_rank_unless_its_experts_tiles_exceed_the_capacity():
    plugin_spec = importlib.util.spec_from_file_location(
        "original_suite_plugin", REPO_ROOT / "tools" / "original_suite_plugin.py"
    )
    plugin = importlib.util.module_from_spec(plugin_spec)
    plugin_spec.loader.exec_module(plugin)
    fits = plugin.fits_one_rank
    # The original's table at EP size 1: 384 experts x 128 rows against 2 T k.
    assert fits(("Kimi K2.7 Code", 384, 7168, 2048, 8, 7168), 1)  # 49152 <= 114688
    assert fits(("DeepSeek-V4-Pro", 384, 7168, 3072, 6, 7168), 1)  # 49152 <= 86016
    assert not fits(("Minimum top-k", 384, 7168, 2048, 1, 7168), 1)  # 49152 > 14336
    assert not fits(("Local tokens 16384", 384, 7168, 2048, 8, 2048), 1)  # 49152 > 32768
    assert fits(("Minimum top-k", 384, 7168, 2048, 1, 7168), 8)  # 48 experts a rank
    assert fits(("exactly full", 4, 256, 256, 1, 256), 1)  # 512 <= 512


def test_reduce_shapes_refuses_a_module_without_shapes(fake_checkout):
    adaptation = runner.Adaptation(
        "tests/test_fake.py::test_passes", "reduce_shapes", "no shapes here", weight_copies=1
    )
    result = runner.run_suite(
        fake_checkout,
        adaptations=(adaptation,),
        only=["test_passes"],
        timeout_s=30.0,
        log=lambda line: None,
    )
    (record,) = result.records
    assert record.outcome == "error"
    assert "expects a module-level shapes(world_size)" in record.tail


def test_cli_json_list_and_strict(fake_checkout, tmp_path, capsys):
    out = tmp_path / "suite.json"
    status = runner.main(
        [str(fake_checkout), "--only", "test_passes", "test_fails", "--json", str(out), "--strict"]
    )
    assert status == 1  # --strict: a failure makes the exit status nonzero
    payload = json.loads(out.read_text())
    assert [record["outcome"] for record in payload["records"]] == ["passed", "failed"]
    assert payload["summary"].startswith("original suite: 1 passed, 1 failed, 0 skipped")
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == payload["summary"]

    assert runner.main([str(fake_checkout), "--list", "--only", "test_passes"]) == 0
    listed = capsys.readouterr().out
    assert "tests/test_fake.py::test_passes" in listed
    assert "test_fails" not in listed


def test_bad_arguments_are_named(tmp_path, capsys):
    assert runner.main([str(tmp_path)]) == 2
    assert "expected a tests/ folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Adaptation.action must be 'skip' or 'reduce_shapes'"):
        runner.Adaptation("x", "patch", "no")
    with pytest.raises(ValueError, match="weight_copies must be >= 1"):
        runner.Adaptation("x", "reduce_shapes", "no")


def test_a_checkout_of_tests_only_under_a_configured_folder_runs(tmp_path, monkeypatch):
    """A checkout holding only tests/, given by a relative path, inside a folder whose
    pyproject.toml has pytest settings (as a checkout kept inside this repository): its nodes
    are collected and run as tests/..., not as paths from that folder."""
    outer = tmp_path / "project"
    (outer / "copy" / "tests").mkdir(parents=True)
    (outer / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-q"\n')
    (outer / "copy" / "tests" / "test_one.py").write_text("def test_ok():\n    assert True\n")
    monkeypatch.chdir(outer)
    result = runner.run_suite(Path("copy"), adaptations=(), known_differences={}, timeout_s=30.0,
                              memory_budget_gib=1.0, log=lambda line: None)  # fmt: skip
    assert [(r.node, r.outcome) for r in result.records] == [("tests/test_one.py::test_ok",
                                                              "passed")]  # fmt: skip
    assert result.workdir_note == ""


def test_the_default_budget_is_a_share_of_the_gpus_memory(monkeypatch):
    """Without --memory-budget-gib the weight copies may take 0.4 of the device's memory (an
    H100's 80 GB ran out of memory at 0.88 of it, counting the weight copies alone)."""
    import torch

    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    assert runner.default_memory_budget_gib() == 32.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runner.default_memory_budget_gib() == round(0.4 * runner.NO_GPU_MEMORY_GIB, 1)


def test_a_spent_time_budget_leaves_nodes_not_run_and_still_reports(fake_checkout):
    """--budget-s: with the budget spent (here by the collection), no node starts; each is
    recorded 'not run' (skips still 'skipped'), and the summary says so."""
    lines: list[str] = []
    result = runner.run_suite(
        fake_checkout, adaptations=TEST_ADAPTATIONS, known_differences={}, timeout_s=5.0,
        memory_budget_gib=1.0, budget_s=0.001, log=lines.append,
    )  # fmt: skip
    outcomes = {record.node: record.outcome for record in result.records}
    assert outcomes["tests/test_fake.py::test_needs_two_ranks"] == "skipped"
    assert {o for n, o in outcomes.items() if not n.endswith("needs_two_ranks")} == {"not run"}
    assert "5 not run (time budget)" in result.summary
    assert all(record.tail == "" for record in result.records)
    with pytest.raises(ValueError, match="budget_s must be > 0, got 0"):
        runner.run_suite(fake_checkout, budget_s=0, log=lambda line: None)
