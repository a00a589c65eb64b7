"""tools/gpu_run.sh on a CPU, the GPU and mok's modules stood in for: each benchmark that BENCH
names runs its command, in the order given (a case lost from the script fails here)."""

import os
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STAND_IN_PYTHON = """#!/bin/sh
# python3 on the GPU machine: the modules the script runs are logged, not run; pip is a no-op.
case "$1 $2" in
  "-m pip") exit 0 ;;
  "-m benchmarks."*|"-m mok") echo "$2 $*" >> "$RAN"; echo "shape x"; exit 0 ;;
esac
exec {python} "$@"
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _gpu_run(tmp_path: Path, gpu: str = "NVIDIA H200, 1, 2, 3, 4", drop=(), **env_vars) -> str:
    """One run of tools/gpu_run.sh on a stand-in machine (nvidia-smi printing ``gpu``, python3
    logging the modules it runs to tmp_path/ran.txt); ``env_vars`` over the environment, names
    in ``drop`` out of it. Returns the summary it left in tmp_path/out."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _executable(bin_dir / "nvidia-smi", f'#!/bin/sh\necho "{gpu}"\n')
    _executable(bin_dir / "python3", STAND_IN_PYTHON.format(python=sys.executable))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RAN": str(tmp_path / "ran.txt"),
           "OUT": str(tmp_path / "out"), **env_vars}  # fmt: skip
    for name in drop:
        env.pop(name, None)
    done = subprocess.run(["bash", "tools/gpu_run.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return (tmp_path / "out" / "summary.txt").read_text()


def _counting_kit(tmp_path: Path, name: str, prints: str) -> tuple[Path, Path]:
    """A stand-in peer kit NAME (its archive's .sha256 and an install script that prints
    ``prints``) whose installs are counted, a line each, in the file returned beside it."""
    kit, installs = tmp_path / "kit", tmp_path / "installs.txt"
    kit.mkdir()
    (kit / f"install_{name}.sh").write_text(f"echo run >> {installs}\n{prints}")
    (kit / f"{name}_peer.tar.xz.sha256").write_text(f"aaaa  {name}_peer.tar.xz\n")
    return kit, installs


def test_each_bench_runs_its_command_in_order(tmp_path):
    summary = _gpu_run(tmp_path, BENCH="main warm memory moe macro",
                       WARM_SHAPES="mixtral-8x7b qwen3-30b-a3b", WARM_PAR="1")  # fmt: skip
    ran = tmp_path / "ran.txt"
    modules = [line.split()[0] for line in ran.read_text().splitlines()]
    assert modules == ["mok", "benchmarks.moe", "benchmarks.moe", "benchmarks.memory_kernels",
                       "benchmarks.moe", "benchmarks.moe"]  # fmt: skip
    lines = ran.read_text().splitlines()
    assert "--shapes mixtral-8x7b" in lines[1] and "--shapes qwen3-30b-a3b" in lines[2]
    assert "--json" in lines[4] and "--macrobatch 16384" in lines[5]
    for note in ("warm: up to 1 shapes at once (2 MiB", "warm mixtral-8x7b rc=0", "warm done at",
                 "memory_kernels rc=0", "benchmarks.moe rc=0", "benchmarks.moe --macrobatch rc=0"):  # fmt: skip
        assert note in summary, summary


def test_sonic_kit_caches_default_to_an_ignored_folder_of_the_tree(tmp_path):
    """A later call on the same machine keeps git-ignored folders of the tree, so SonicMoE's
    compile caches there serve a `BENCH=moe` call after a `BENCH=warm` one; a card of over
    100 GB warms four shapes at once."""
    kit = tmp_path / "kit"
    kit.mkdir()
    seen = tmp_path / "seen.txt"
    (kit / "install_sonic.sh").write_text(f'echo "$SONIC_CACHE" > {seen}\n')
    summary = _gpu_run(tmp_path, gpu="NVIDIA H200, 1, 143771 MiB, 3, 4",
                       drop=("SONIC_CACHE", "WARM_PAR"), SONIC_KIT=str(kit), BENCH="warm",
                       WARM_SHAPES="mixtral-8x7b")  # fmt: skip
    assert seen.read_text().strip() == str(REPO / "runs" / "sonic_cache")
    assert "warm: up to 4 shapes at once (143771 MiB" in summary, summary
    ignored = subprocess.run(["git", "check-ignore", "-q", "runs/sonic_cache"], cwd=REPO)
    assert ignored.returncode == 0


def test_a_kit_installed_by_an_earlier_call_is_not_installed_again(tmp_path):
    """A later call on the same machine reuses a kit's site folder while its archive is the
    same (its .sha256 file), with the exports the first install printed; a changed archive, or
    an install whose check failed, installs again."""
    site = tmp_path / "site"
    kit, installs = _counting_kit(
        tmp_path, "liger", 'echo "export LIGER_SITE=$LIGER_SITE"\necho "$CHECK"\n'
    )

    def call(check="[install_liger] import ok"):
        summary = _gpu_run(tmp_path, LIGER_KIT=str(kit), LIGER_SITE=str(site), BENCH="moe",
                           CHECK=check)  # fmt: skip
        assert f"--liger-site {site}" in (tmp_path / "ran.txt").read_text().splitlines()[-1]
        return summary

    first = call()
    assert installs.read_text().count("run") == 1 and "earlier call" not in first
    second = call()
    assert installs.read_text().count("run") == 1
    assert f"LigerMoE kit: installed in {site} by an earlier call" in second, second
    (kit / "liger_peer.tar.xz.sha256").write_text("bbbb  liger_peer.tar.xz\n")
    failed = call(check="[install_liger] IMPORT CHECK FAILED")
    assert installs.read_text().count("run") == 2
    assert "LigerMoE kit: install failed" in failed, failed
    call()  # the failed install left no mark: installed again
    assert installs.read_text().count("run") == 3


def test_the_sonic_kit_is_installed_again_for_another_cache_folder(tmp_path):
    """SonicMoE's install exports its cache folder (QUACK_CACHE_DIR) and seeds it: a later call
    with another $SONIC_CACHE installs again rather than reuse exports naming the old one."""
    site = tmp_path / "site"
    kit, installs = _counting_kit(
        tmp_path, "sonic", 'echo "export QUACK_CACHE_DIR=$SONIC_CACHE/quack"\n'
    )

    def call(cache):
        _gpu_run(tmp_path, SONIC_KIT=str(kit), SONIC_SITE=str(site),
                 SONIC_CACHE=str(tmp_path / cache))  # fmt: skip

    call("cache_a")
    call("cache_a")
    assert installs.read_text().count("run") == 1
    call("cache_b")
    assert installs.read_text().count("run") == 2


def test_each_warm_shape_gets_the_time_left_when_it_starts(tmp_path):
    """A shape that starts after another has run gets a shorter timeout, so the warm-up ends by
    the deadline (a shape started late with the whole budget outlasted the call)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "timeouts.txt"
    # timeout stood in: logs its limit for each benchmarks.moe it starts, which takes 2 s
    _executable(bin_dir / "timeout", f'#!/bin/sh\necho "$1" >> {calls}\nshift\n'
                                     'case "$*" in *benchmarks.moe*) sleep 2 ;; esac\nexec "$@"\n')  # fmt: skip
    summary = _gpu_run(tmp_path, BENCH="warm", WARM_SHAPES="mixtral-8x7b qwen3-30b-a3b",
                       WARM_PAR="1", DEADLINE_S="100")  # fmt: skip
    first, second = (int(line) for line in calls.read_text().split())
    assert first <= 100 and second <= first - 2, (first, second)
    assert "warm qwen3-30b-a3b rc=0" in summary, summary
