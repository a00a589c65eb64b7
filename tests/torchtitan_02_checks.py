"""Checks of mok's TorchTitan 0.2 model converter (mok/integrations/torchtitan_converter.py), run
in a process whose PYTHONPATH puts a TorchTitan 0.2 install first (the test environment holds
0.3; tests/test_integrations_cpu.py and tests/gpu/test_integrations_gpu.py start it):

    python tests/torchtitan_02_checks.py NAME [--device cuda]

Each check raises on failure and prints "ok NAME". TorchTitan 0.2's router counts tokens with
`torch.histc` of int64 ids, which runs on CUDA only, so the checks that run the model need
`--device cuda`.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def _args(**kw):
    base = dict(vocab=128, hidden=128, intermediate=128, layers=2, experts=8, topk=2, seq=16)
    return argparse.Namespace(**(base | kw))


def _moe_layer(shared: int = 0, score_before: bool = False, dim: int = 128, width: int = 128):
    from torchtitan.models.moe import MoE, MoEArgs

    args = MoEArgs(num_experts=8, top_k=2, num_shared_experts=shared,
                   score_before_experts=score_before, load_balance_coeff=None)  # fmt: skip
    return MoE(args, dim=dim, hidden_dim=width)


def check_the_03_entry_names_the_converter(_device) -> None:
    try:
        import mok.integrations.torchtitan  # noqa: F401
    except ImportError as error:
        assert "mok.integrations.torchtitan_converter" in str(error), error
        assert "--model.converters mok" in str(error), error
    else:
        raise AssertionError("mok.integrations.torchtitan imported under TorchTitan 0.2")


def check_a_job_converts_every_moe_layer(_device) -> None:
    """The job's path: `model.converters = ["mok"]` after the custom import; every MoE layer
    becomes a MoKMoE, parameters and their names untouched."""
    import train_torchtitan as example
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters

    from mok.integrations.torchtitan_converter import MoKMoE

    job = JobConfig()
    job.model.converters = ["mok"]
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    model = example.build_02(_args(), torch.device("cpu"), seed=0, mok=False)
    before = {name: p for name, p in model.named_parameters()}
    build_model_converters(job, dims).convert(model)
    layers = [layer.moe for layer in model.layers.values()]
    assert layers and all(type(m) is MoKMoE for m in layers), [type(m) for m in layers]
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)


def check_what_mok_does_not_run_is_refused(_device) -> None:
    from torchtitan.distributed import ParallelDims

    from mok.integrations.torchtitan_converter import MoKConverter

    holder = torch.nn.Sequential(_moe_layer(score_before=True))
    try:
        MoKConverter().convert(holder)
    except ValueError as error:
        assert "MoEArgs.score_before_experts must be False" in str(error), error
    else:
        raise AssertionError("score_before_experts=True was accepted")
    try:
        MoKConverter().convert(torch.nn.Linear(4, 4))
    except ValueError as error:
        assert "no torchtitan.models.moe.MoE layer" in str(error), error
    else:
        raise AssertionError("a model without MoE layers was accepted")
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, etp=1, world_size=2)
    try:
        MoKConverter(None, dims)
    except ValueError as error:
        assert "parallel_dims.ep must be 1, got 2" in str(error), error
    else:
        raise AssertionError("TorchTitan's expert parallelism was accepted")


def check_a_shared_expert_folds_when_as_wide(_device) -> None:
    from mok.integrations.torchtitan_converter import MoKConverter

    for shared, folds in ((1, True), (2, False)):
        holder = torch.nn.Sequential(_moe_layer(shared=shared))
        MoKConverter().convert(holder)
        assert holder[0].folds_shared_expert() is folds, shared


def check_the_model_matches_the_framework(device) -> None:
    """Loss and every expert gradient within 2x the error TorchTitan's own bf16 experts make
    against an fp32 copy (as tests/test_integrations_cpu.py's 0.3 check)."""
    import train_torchtitan as example

    from mok.testing import within_bf16_bound

    args = _args(hidden=256, intermediate=256)
    own = example.build_02(args, device, seed=0, mok=False)
    mine = copy.deepcopy(own)
    from mok.integrations.torchtitan_converter import MoKConverter

    MoKConverter().convert(mine)
    truth = copy.deepcopy(own).float()
    for layer in truth.layers.values():  # fp32 experts: grouped_mm would compute them in bf16
        layer.moe.experts.use_grouped_mm = False
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(3))
    tokens = tokens.to(device)
    results = {}
    for name, model in (("own", own), ("mok", mine), ("fp32", truth)):
        loss = example.loss_of_02(model, tokens)
        loss.backward()
        experts = [layer.moe.experts for layer in model.layers.values()]
        results[name] = [loss.detach()] + [getattr(e, w).grad for e in experts
                                           for w in ("w1", "w3", "w2")]  # fmt: skip
    for got, want, fp32 in zip(results["mok"], results["own"], results["fp32"], strict=True):
        ok, err, base = within_bf16_bound(got.double(), fp32.double(), want.double())
        assert ok, (err, base)


def check_training_repeats_bitwise(device) -> None:
    import train_torchtitan as example

    args = _args(hidden=256, intermediate=256)
    batches = example._training.markov_batches(128, 2, 16, 3)
    runs = []
    for _ in range(2):
        model = example.build_02(args, device, seed=0, mok=True)
        runs.append(example._training.train(model, batches, example.loss_of_02, 1e-3, device))
    assert example._training.same_bits(runs[0], runs[1])


def run_check(site, name: str, device: str = "cpu") -> None:
    """Check `name` in a new process with TorchTitan 0.2 (installed at `site`) first on the path
    (what the tests call; the conftest fixture `torchtitan_02_site` installs it)."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, __file__, name, "--device", device],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=path))  # fmt: skip
    assert done.returncode == 0 and f"ok {name}" in done.stdout, done.stdout + done.stderr[-3000:]


CHECKS = {name[len("check_") :]: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=sorted(CHECKS))
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args()
    import torchtitan
    import train_torchtitan

    version = getattr(torchtitan, "__version__", "?")
    assert train_torchtitan.is_torchtitan_02(), (
        f"TorchTitan 0.2 expected first on the path, got {version}"
    )
    CHECKS[opts.name](torch.device(opts.device))
    print(f"ok {opts.name} (torchtitan {version})")
