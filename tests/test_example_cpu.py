"""examples/qwen3_moe_swap.py on CPU (skipped where transformers is not installed, as in CI)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "qwen3_moe_swap.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("qwen3_moe_swap", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_main_cpu(example, tmp_path):
    argv = ["--steps", "5", "--device", "cpu"]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--png", str(tmp_path / "loss.png")]
    result = example.main(argv)
    assert result["layout"] in (example.LAYOUT_MODULELIST, example.LAYOUT_FUSED,
                                example.LAYOUT_FUSED_T)  # fmt: skip
    assert result["forward_check"]["ok"]
    for key in ("hf_losses", "mok_losses"):
        losses = result[key]
        assert len(losses) == 5 and all(math.isfinite(v) for v in losses)
    assert result["hf_losses"][0] == pytest.approx(result["mok_losses"][0], rel=2e-2)
    assert result["deterministic"] is True
    assert result["mok_losses"] == result["mok_losses_again"]
    if "--png" in argv:
        assert (tmp_path / "loss.png").stat().st_size > 0


class _LegacyBlock(nn.Module):
    """transformers 4.x's block layout: gate Linear, ModuleList of MLPs, routing in the block."""

    def __init__(self, fused_block, config):
        super().__init__()
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = nn.Linear(hidden, self.num_experts, bias=False, dtype=torch.bfloat16)
        mlps = [Qwen3MoeMLP(config, intermediate_size=inter) for _ in range(self.num_experts)]
        self.experts = nn.ModuleList(mlps).to(torch.bfloat16)
        with torch.no_grad():
            self.gate.weight.copy_(fused_block.gate.weight)
            gate_up, down = fused_block.experts.gate_up_proj, fused_block.experts.down_proj
            for e, mlp in enumerate(self.experts):
                mlp.gate_proj.weight.copy_(gate_up[e, :inter])
                mlp.up_proj.weight.copy_(gate_up[e, inter:])
                mlp.down_proj.weight.copy_(down[e])


def test_legacy_modulelist_layout(example):
    config = example.make_qwen3_config()
    fused = example.make_hf_block(config, seed=0)
    if example.detect_expert_layout(fused) != example.LAYOUT_FUSED:
        pytest.skip("installed transformers does not use the fused expert layout")
    legacy = _LegacyBlock(fused, config)
    assert example.detect_expert_layout(legacy) == example.LAYOUT_MODULELIST
    swapped_fused, swapped_legacy = (
        example.MoKQwen3MoeBlock(fused),
        example.MoKQwen3MoeBlock(legacy),
    )
    for name in ("gate_weight", "up_weight", "down_weight"):
        assert torch.equal(getattr(swapped_fused.experts, name),
                           getattr(swapped_legacy.experts, name))  # fmt: skip
    x = torch.randn(2, 16, config.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        out_legacy, logits = swapped_legacy(x)  # 4.x blocks return (out, router_logits)
        out_fused = swapped_fused(x)
    assert logits.shape == (32, config.num_experts)
    assert torch.equal(out_legacy, out_fused)


def test_unknown_layout_raises(example):
    block = nn.Module()
    block.experts = nn.Linear(4, 4)
    with pytest.raises(example.UnknownExpertLayoutError, match="unknown expert layout"):
        example.detect_expert_layout(block)
