"""mok inside transformers and TorchTitan, on CPU (mok's reference path): each framework's own
tiny models built from its own configs, against the framework's own experts path."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from mok.testing import within_bf16_bound

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example(name: str):
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _close(got: torch.Tensor, want_bf16: torch.Tensor, truth: torch.Tensor) -> None:
    """got within 2x the error the framework's bf16 path makes against the fp32 truth."""
    ok, err, base = within_bf16_bound(got.double(), truth.double(), want_bf16.double())
    assert ok, (err, base)


# --- transformers --------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
from transformers.integrations import moe as hf_moe  # noqa: E402

import mok.integrations.transformers as mok_hf  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
             head_dim=64, max_position_embeddings=64)  # fmt: skip


def _hf_config(family: str, hidden: int = 128, inter: int = 128):
    """A tiny config of each family whose experts mok runs (SwiGLU, gate_up_proj [E, 2I, H])."""
    t = transformers
    SMALL = globals()["SMALL"] | dict(hidden_size=hidden, num_attention_heads=hidden // 64)
    if family == "qwen3_moe":
        return t.Qwen3MoeConfig(**SMALL, num_key_value_heads=1, intermediate_size=256,
                                moe_intermediate_size=inter, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    if family == "mixtral":
        return t.MixtralConfig(**SMALL, num_key_value_heads=1, intermediate_size=inter,
                               num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    if family == "deepseek_v3":
        small = {k: v for k, v in SMALL.items() if k != "head_dim"}  # qk_* dims set it
        # MLA keeps a key and value head per query head (DeepSeek-V3: 128 and 128); fewer
        # broke transformers 5.17's SDPA attention on CUDA (a shape error before the experts).
        heads = small["num_attention_heads"]
        return t.DeepseekV3Config(**small, num_key_value_heads=heads, intermediate_size=256,
                                  moe_intermediate_size=inter, n_routed_experts=8,
                                  num_experts_per_tok=2, n_group=2, topk_group=1,
                                  first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=64,
                                  q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                  v_head_dim=32)  # fmt: skip
    if family == "qwen3_next":
        return t.Qwen3NextConfig(**SMALL, num_key_value_heads=1, intermediate_size=256,
                                 moe_intermediate_size=inter, shared_expert_intermediate_size=128,
                                 num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                                 mlp_only_layers=[], layer_types=["full_attention"] * 2)  # fmt: skip
    raise AssertionError(family)


def _hf_model(config, implementation: str | None, seed: int = 0, device="cpu"):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(
        config, experts_implementation=implementation, dtype=torch.bfloat16
    ).to(device)


def test_import_registers_mok():
    assert "mok" in hf_moe.ALL_EXPERTS_FUNCTIONS
    config = _hf_config("qwen3_moe")
    assert _hf_model(config, "mok").config._experts_implementation == "mok"


FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "qwen3_next"]


@pytest.mark.parametrize("family", FAMILIES)
def test_model_forward_backward_matches_framework(family):
    check_hf_model(family, "cpu")


def check_hf_model(family: str, device, **sizes) -> None:
    """Every MoE block of the model runs in mok; the loss and every gradient of the experts'
    fused parameters are within 2x transformers' own bf16 error of the fp32 model's."""
    config = _hf_config(family, **sizes)
    calls = []
    models = {}
    for impl in ("eager", "mok"):
        models[impl] = _hf_model(config, impl, device=device)
    models["fp32"] = _hf_model(config, "eager", device=device).float()
    for model in models.values():
        model.load_state_dict(models["eager"].state_dict())
    experts = [m for m in models["mok"].modules() if hasattr(m, "gate_up_proj")]
    assert experts, family
    for module in experts:
        module.register_forward_hook(lambda *_: calls.append(1))
    tokens = torch.randint(
        0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)
    )
    tokens = tokens.to(device)
    grads = {}
    for impl, model in models.items():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        grads[impl] = [loss.detach()] + [m.gate_up_proj.grad for m in model.modules()
                                         if hasattr(m, "gate_up_proj")] + [
            m.down_proj.grad for m in model.modules() if hasattr(m, "gate_up_proj")]  # fmt: skip
    assert len(calls) == len(experts)
    for got, want, truth in zip(grads["mok"], grads["eager"], grads["fp32"], strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        _close(got, want, truth)


def test_fused_gradient_is_one_tensor_without_copy_back():
    """gate_up_proj's gradient arrives as one [E, 2I, H] tensor (the backward's gate and up
    gradients are its halves, or are joined once)."""
    model = _hf_model(_hf_config("qwen3_moe"), "mok")
    tokens = torch.randint(0, 256, (1, 8))
    model(input_ids=tokens, labels=tokens).loss.backward()
    module = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    assert module.gate_up_proj.grad.shape == module.gate_up_proj.shape


def test_training_is_bitwise_reproducible():
    check_hf_training_repeats(torch.device("cpu"))


def check_hf_training_repeats(device, hidden: int = 128, inter: int = 128) -> None:
    example = _example("train_transformers")
    args = example.argparse.Namespace(vocab=128, hidden=hidden, intermediate=inter, layers=2,
                                      experts=8, topk=2, seq=16)  # fmt: skip
    runs = []
    for _ in range(2):
        model = example.build(args, "mok", device, seed=0)
        batches = example._training.markov_batches(128, 2, 15, 3)
        runs.append(example._training.train(model, batches, example.loss_of_shifted, 1e-3,
                                            device))  # fmt: skip
    assert example._training.same_bits(runs[0], runs[1])
    assert all(math.isfinite(v) for v in runs[0].losses)


def test_example_runs(tmp_path, capsys):
    example = _example("train_transformers")
    code = example.main(["--steps", "4", "--hidden", "128", "--intermediate", "128",
                         "--batch", "2", "--seq", "16", "--vocab", "128", "--no-png",
                         "--out", str(tmp_path)])  # fmt: skip
    printed = capsys.readouterr().out
    assert "bitwise identical" in printed
    assert (tmp_path / "losses.json").exists()
    assert code in (0, 1)  # 4 steps are too few for the curves' 5% check to mean anything


def test_unsupported_experts_are_refused_by_name():
    gpt_oss = transformers.GptOssConfig(**SMALL, num_key_value_heads=1, intermediate_size=128,
                                        num_local_experts=4, num_experts_per_tok=2,
                                        layer_types=["full_attention"] * 2)  # fmt: skip
    model = _hf_model(gpt_oss, "mok")
    tokens = torch.randint(0, 256, (1, 8))
    with pytest.raises(ValueError, match=r"GptOssExperts has has_bias=True, which mok does not"):
        model(input_ids=tokens)


def test_fp32_model_is_refused():
    model = transformers.AutoModelForCausalLM.from_config(
        _hf_config("qwen3_moe"), experts_implementation="mok", dtype=torch.float32
    )
    tokens = torch.randint(0, 256, (1, 8))
    with pytest.raises(ValueError, match=r"runs bf16 models: load the model with "
                       r"dtype=torch.bfloat16; Qwen3MoeExperts got hidden_states torch.float32"):  # fmt: skip
        model(input_ids=tokens)


def test_register_under_another_name_with_a_config():
    from mok import MoKConfig

    mok_hf.register("mok_recompute", MoKConfig(macrobatch_size=256, minibatch_size=256))
    assert "mok_recompute" in hf_moe.ALL_EXPERTS_FUNCTIONS
    with pytest.raises(TypeError, match="config must be a MoKConfig, got dict"):
        mok_hf.register("bad", {})


# --- TorchTitan ----------------------------------------------------------------------------


def _torchtitan():
    pytest.importorskip("torchtitan")
    try:
        import torchtitan.models.qwen3  # noqa: F401, PLC0415
    except ImportError as error:  # e.g. no triton
        pytest.skip(f"torchtitan's models do not import here: {error}")
    return _example("train_torchtitan")


def _tt_args(**kw):
    import argparse

    base = dict(vocab=128, hidden=128, intermediate=128, layers=2, experts=8, topk=2, seq=16)
    return argparse.Namespace(**(base | kw))


def test_torchtitan_override_from_the_command_line():
    """`--override.imports` as a TorchTitan job passes it: every MoE layer's RoutedExperts
    becomes MoKRoutedExperts, with mok's knobs from the entry's JSON."""
    _torchtitan()
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides

    from mok.integrations.torchtitan import MoKRoutedExperts

    entry = (
        "mok.integrations.torchtitan.mok_routed_experts="
        '{"recompute": true, "macrobatch_replay": "gather"}'
    )
    config = ConfigManager().parse_args(
        ["--module", "qwen3", "--config", "qwen3_moe_debug", "--override.imports", entry]
    )
    model_cfg = config.model_spec.model
    model_cfg.update_from_config(config=config)
    lines = apply_overrides(config.override, config)
    moe_layers = [layer for layer in model_cfg.layers if getattr(layer, "moe", None)]
    assert moe_layers and len(lines) == len(moe_layers)
    for layer in moe_layers:
        assert type(layer.moe.routed_experts) is MoKRoutedExperts.Config
        assert layer.moe.routed_experts.recompute is True
        assert layer.moe.routed_experts.macrobatch_replay == "gather"
    # The knobs reach the module's MoKConfig.
    from mok.integrations.torchtitan import _mok_knobs

    class Owner:
        pass

    owner = Owner()
    _mok_knobs(owner, moe_layers[0].moe.routed_experts)
    assert owner.mok_config.macrobatch_replay == "gather"


def test_torchtitan_model_matches_framework():
    check_torchtitan_model(torch.device("cpu"))


def check_torchtitan_model(device, **sizes) -> None:
    example = _torchtitan()
    args = _tt_args(**sizes)
    own = example.build(example.model_config(args), device, seed=0)
    mine = example.build(example.with_mok(example.model_config(args)), device, seed=0)
    mine.load_state_dict(own.state_dict())
    truth = example.build(example.model_config(args), device, seed=0).float()
    truth.load_state_dict(own.state_dict())
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(3))
    tokens = tokens.to(device)
    results = {}
    for name, model in (("own", own), ("mok", mine), ("fp32", truth)):
        loss = example.loss_of(model, tokens)
        loss.backward()
        experts = [layer.moe.routed_experts.inner_experts for layer in model.layers.values()]
        results[name] = [loss.detach()] + [getattr(e, w).grad for e in experts
                                           for w in ("w1_EFD", "w3_EFD", "w2_EDF")]  # fmt: skip
    assert type(mine.layers["0"].moe.routed_experts).__name__ == "MoKRoutedExperts"
    for got, want, fp32 in zip(results["mok"], results["own"], results["fp32"], strict=True):
        _close(got, want, fp32)


def test_torchtitan_training_is_bitwise_reproducible():
    check_torchtitan_training_repeats(torch.device("cpu"))


@pytest.mark.parametrize(
    "check",
    ["the_03_entry_names_the_converter", "a_job_converts_every_moe_layer",
     "what_mok_does_not_run_is_refused", "a_shared_expert_folds_when_as_wide"],
)  # fmt: skip
def test_torchtitan_02_converter(torchtitan_02_site, check):
    """TorchTitan 0.2's model converter "mok" (mok/integrations/torchtitan_converter.py), in a
    process with TorchTitan 0.2 first on the path. Its model runs on CUDA only (0.2's router):
    tests/gpu/test_integrations_gpu.py runs the model and training checks."""
    _torchtitan()
    sys.path.insert(0, str(Path(__file__).parent))
    from torchtitan_02_checks import run_check  # noqa: PLC0415

    run_check(torchtitan_02_site, check)


def check_torchtitan_training_repeats(device, **sizes) -> None:
    example = _torchtitan()
    args = _tt_args(**sizes)
    batches = example._training.markov_batches(128, 2, 16, 3)
    runs = []
    for _ in range(2):
        model = example.build(example.with_mok(example.model_config(args)), device, seed=0)
        runs.append(example._training.train(model, batches, example.loss_of, 1e-3, device))
    assert example._training.same_bits(runs[0], runs[1])


# --- mok.nn.moe_fused: the fused layout both integrations' users hold -----------------------


@pytest.mark.parametrize("accumulate_main_grad", [False, True])
def test_moe_fused_gives_the_bits_of_separate_weights(accumulate_main_grad):
    from mok import functional as F
    from mok.nn import moe, moe_fused
    from mok.testing import make_inputs

    T, H, I, E, k = 64, 128, 128, 4, 2
    inp = make_inputs(T, H, I, E, k)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=k,
                         num_local_experts=E)  # fmt: skip
    schedule = F.build_schedule(ws, config, inp["top_experts"], num_local_experts=E)
    gate_up = torch.cat((inp["routed_gate"], inp["routed_up"]), 1).requires_grad_()
    gate, up = (inp[n].clone().requires_grad_() for n in ("routed_gate", "routed_up"))
    downs = [inp["routed_down"].clone().requires_grad_() for _ in range(2)]
    if accumulate_main_grad:
        start = torch.randn(E, 2 * I, H)
        gate_up.main_grad = start.clone()
        gate.main_grad, up.main_grad = (h.clone() for h in start.split(I, 1))
        for d in downs:
            d.main_grad = torch.zeros(E, H, I)
    xs = [inp["x"].clone().requires_grad_() for _ in range(2)]
    kw = dict(accumulate_main_grad=accumulate_main_grad)
    fused = moe_fused(config, ws, schedule, xs[0], inp["router_weights"], gate_up, downs[0], **kw)
    split = moe(config, ws, schedule, xs[1], inp["router_weights"], None, None, None, gate, up,
                downs[1], **kw)  # fmt: skip
    assert torch.equal(fused, split)
    dy = torch.randn_like(fused)
    fused.backward(dy)
    split.backward(dy)
    assert torch.equal(xs[0].grad, xs[1].grad)
    if accumulate_main_grad:
        assert gate_up.grad is None and downs[0].grad is None
        assert torch.equal(gate_up.main_grad, torch.cat((gate.main_grad, up.main_grad), 1))
        assert torch.equal(downs[0].main_grad, downs[1].main_grad)
    else:
        assert torch.equal(gate_up.grad, torch.cat((gate.grad, up.grad), 1))
        assert torch.equal(downs[0].grad, downs[1].grad)


def test_transformers_model_under_torch_compile_fullgraph():
    """The mok experts trace into one graph (custom ops; the workspace is made while tracing)."""
    model = _hf_model(_hf_config("qwen3_moe"), "mok")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    eager = model(input_ids=tokens, labels=tokens).loss
    compiled = torch.compile(model, fullgraph=True)
    loss = compiled(input_ids=tokens, labels=tokens).loss
    loss.backward()
    # inductor compiles the rest of the model differently: the losses agree to bf16 noise
    assert torch.isfinite(loss) and abs(loss.item() - eager.item()) < 1e-2 * eager.item()
    module = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    assert module.gate_up_proj.grad is not None
    assert module.gate_up_proj.grad.shape == module.gate_up_proj.shape


def _tt_moe_config(shared_width: int, dim: int = 128, width: int = 128):
    """A TorchTitan MoE layer config with a SwiGLU shared expert (DeepSeek-V3's kind)."""
    _torchtitan()
    from functools import partial

    from torchtitan.models.common.config_utils import (
        make_ffn_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )

    init = {"weight": partial(torch.nn.init.normal_, std=0.05), "bias": torch.nn.init.zeros_}
    experts_init = {n: partial(torch.nn.init.normal_, std=0.05)
                    for n in ("w1_EFD", "w2_EDF", "w3_EFD")}  # fmt: skip
    return make_moe_config(
        num_experts=8,
        router=make_router_config(
            dim=dim,
            num_experts=8,
            gate_param_init=init,
            top_k=2,
            score_func="softmax",
            route_norm=True,
        ),
        routed_experts=make_routed_experts_config(
            dim=dim,
            hidden_dim=width,
            num_experts=8,
            top_k=2,
            param_init=experts_init,
            comm_backend="standard",
        ),
        shared_experts=make_ffn_config(
            dim=dim, hidden_dim=shared_width, w1_param_init=init, w2w3_param_init=init
        ),
    )


@pytest.mark.parametrize("shared_width, folded", [(128, True), (256, False)])
def test_torchtitan_moe_override_folds_a_shared_expert_of_the_routed_width(shared_width, folded):
    """mok_moe: a shared expert as wide as the routed ones runs inside mok's layer, another runs
    as TorchTitan's; output and every gradient within 2x TorchTitan's own bf16 error."""
    import mok.integrations.torchtitan as mok_tt

    layers = {}
    for name, make in (("own", lambda c: c), ("mok", mok_tt.mok_moe), ("fp32", lambda c: c)):
        torch.manual_seed(0)
        layer = make(_tt_moe_config(shared_width)).build()
        layer.init_states()
        layers[name] = layer.float() if name == "fp32" else layer.to(torch.bfloat16)
    for layer in layers.values():
        layer.load_state_dict(layers["own"].state_dict())
    assert type(layers["mok"]).__name__ == "MoKMoE"
    assert layers["mok"].folds_shared_expert() is folded
    x = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(2))
    results = {}
    for name, layer in layers.items():
        xin = x.clone() if name == "fp32" else x.to(torch.bfloat16)
        out = layer(xin)
        out.float().square().sum().backward()
        results[name] = [out.detach().float()] + [p.grad for _, p in layer.named_parameters()]
    for got, want, fp32 in zip(results["mok"], results["own"], results["fp32"], strict=True):
        _close(got.float(), want.float(), fp32.float())


def test_torchtitan_override_refuses_an_unknown_knob():
    _torchtitan()
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.qwen3 import qwen3_configs

    config = qwen3_configs["debugmodel_moe"]("flex")
    entry = ("mok.integrations.torchtitan.mok_routed_experts", {"recomputee": True})
    with pytest.raises(ValueError, match=r"not on MoKRoutedExperts.Config: \['recomputee'\]"):
        apply_overrides(OverrideConfig(imports=[entry]), config)
