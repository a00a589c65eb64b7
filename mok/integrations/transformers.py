"""Hugging Face transformers' routed experts run by mok.

    import mok.integrations.transformers  # registers "mok"
    model = AutoModelForCausalLM.from_config(config, experts_implementation="mok",
                                             dtype=torch.bfloat16)

Importing this module registers ``"mok"`` with transformers' `ExpertsInterface`, so every MoE
block whose experts module carries `@use_experts_implementation` with SwiGLU experts (gate and
up concatenated as ``gate_up_proj`` [E, 2I, H], gate rows first; ``down_proj`` [E, H, I]; no
bias; SiLU) runs its routed experts in mok: Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral,
DeepSeek-V3, OLMoE and the other families with that layout. Parameter names, checkpoints and
the model's router stay transformers'. ``gate_up_proj`` goes to `mok.nn.moe_fused` whole, its
halves read in place, and its gradient comes back whole, written by the kernels (no copy).

Anything else (biases, transposed or interleaved layouts, a custom gate such as GPT-OSS's
clamped one, experts without a gate, a post-expert norm, transformers' own expert
parallelism, a model dtype other than bf16) raises `ValueError` naming what is unsupported.

Router weights arrive in the model's dtype or fp32 depending on the family; mok takes them as
fp32 (> 0). The model runs on the device its tensors are on: the shipped kernels on a
supported GPU, mok's PyTorch reference on CPU.
"""

from __future__ import annotations

import torch
from transformers.integrations import moe as _hf_moe

from .. import functional
from ..config import FEATURE_ALIGNMENT, MoKConfig
from ..nn import layer_workspace, moe_fused

__all__ = ["NAME", "experts_forward", "register"]

NAME = "mok"
# One object, so that calls without a config share mok's per-config caches.
_DEFAULT_CONFIG = MoKConfig()
_SILU = ("silu", "swish")


def register(name: str = NAME, config: MoKConfig | None = None) -> None:
    """Register mok as transformers experts implementation `name` (``"mok"`` on import), run
    with `config` (default `MoKConfig()`). Register before the model is built: transformers
    checks the name when it builds the model."""
    config = _DEFAULT_CONFIG if config is None else config
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config must be a MoKConfig, got {type(config).__name__}")
    config.validate()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return experts_forward(self, hidden_states, top_k_index, top_k_weights, config=config)

    forward.__name__ = forward.__qualname__ = f"{name}_experts_forward"
    forward.__doc__ = experts_forward.__doc__
    _hf_moe.ExpertsInterface.register(name, forward)


def experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    config: MoKConfig | None = None,
) -> torch.Tensor:
    """transformers' experts backend: out [T, H] = sum_j w[t, j] * expert_{idx[t, j]}(x_t).

    `module`: a transformers experts module (``gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I]); `hidden_states` bf16 [T, H]; `top_k_index` int64 [T, k]; `top_k_weights`
    [T, k] (> 0), any float dtype. Returns bf16 [T, H]."""
    _check_module(module, hidden_states)
    config = _DEFAULT_CONFIG if config is None else config
    gate_up, down = module.gate_up_proj, module.down_proj
    num_tokens, topk = top_k_index.shape
    num_experts = gate_up.shape[0]
    router_weights = top_k_weights.to(torch.float32).contiguous()
    x = hidden_states.contiguous()
    top_experts = top_k_index.contiguous()
    workspace = layer_workspace(config, None, x.device, num_tokens, x.shape[1], topk,
                                num_experts)  # fmt: skip
    schedule = functional.build_schedule(workspace, config, top_experts,
                                         num_local_experts=num_experts)  # fmt: skip
    return moe_fused(config, workspace, schedule, x, router_weights, gate_up, down)


def _check_module(module: torch.nn.Module, hidden_states: torch.Tensor) -> None:
    """Raise ValueError naming what mok does not run in this experts module."""
    kind = type(module).__name__
    flags = (("has_gate", True), ("has_bias", False), ("is_transposed", False),
             ("is_concatenated", True), ("has_post_expert_norm", False),
             ("_is_expert_parallel", False))  # fmt: skip
    for flag, wanted in flags:
        value = getattr(module, flag, wanted)
        if bool(value) != wanted:
            raise ValueError(
                f"experts_implementation='mok' runs SwiGLU experts with gate_up_proj [E, 2I, H] "
                f"(gate rows first), no bias, no post-expert norm, on one device; {kind} has "
                f"{flag}={value}, which mok does not support"
            )
    if type(module)._apply_gate is not _hf_moe._default_apply_gate:
        raise ValueError(
            f"experts_implementation='mok' runs SiLU(gate) * up; {kind} defines its own "
            f"_apply_gate, which mok does not support"
        )
    if getattr(module, "limit", None) is not None:
        raise ValueError(
            f"experts_implementation='mok': {kind} clamps its gate (limit={module.limit}), "
            f"which mok does not support"
        )
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    if act not in _SILU:
        raise ValueError(
            f"experts_implementation='mok' runs SiLU-gated experts; {kind}'s config has "
            f"hidden_act={act!r}"
        )
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        raise ValueError(
            f"experts_implementation='mok' needs gate_up_proj and down_proj tensors; {kind} has "
            f"{type(gate_up).__name__} and {type(down).__name__}"
        )
    if hidden_states.dtype != torch.bfloat16 or gate_up.dtype != torch.bfloat16:
        raise ValueError(
            f"experts_implementation='mok' runs bf16 models: load the model with "
            f"dtype=torch.bfloat16; {kind} got hidden_states {hidden_states.dtype} and "
            f"gate_up_proj {gate_up.dtype}"
        )
    num_experts, two_inter, hidden = gate_up.shape
    for what, size in (("hidden size", hidden), ("intermediate size", two_inter // 2)):
        if two_inter % 2 or size % FEATURE_ALIGNMENT:
            raise ValueError(
                f"experts_implementation='mok' needs the {what} to be a multiple of "
                f"{FEATURE_ALIGNMENT}; {kind}'s gate_up_proj is {list(gate_up.shape)}"
            )
    if list(down.shape) != [num_experts, hidden, two_inter // 2]:
        raise ValueError(
            f"experts_implementation='mok' needs down_proj [E, H, I] = "
            f"{[num_experts, hidden, two_inter // 2]}; {kind} has {list(down.shape)}"
        )


register()
