"""The MoE layer in mok for TorchTitan's modules, whatever the TorchTitan version: what the 0.3
overrides (mok.integrations.torchtitan) and the 0.2 model converter
(mok.integrations.torchtitan_converter) both call. No TorchTitan import."""

from __future__ import annotations

import torch

from .. import functional
from ..config import MoKConfig
from ..nn import layer_workspace, moe


def mok_layer(owner, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, routed, shared=None):
    """out [B, L, D] = shared(x) + sum_k score[., k] * expert_{id[., k]}(x), computed by mok in
    fp32 and rounded once to bf16, then to x's dtype. `owner` holds the MoKConfig
    (`mok_config`), the EP group (`ep_group`, None: a group of one) and `recompute`; `routed` =
    (gate, up, down) [E, F, D], [E, F, D], [E, D, F], read in place; `shared` a SwiGLU module with
    Linears `w1`, `w3`, `w2` folded in as mok's shared expert, or None."""
    batch, seq, dim = x_BLD.shape
    topk = topk_scores_BLK.shape[-1]
    x = x_BLD.reshape(batch * seq, dim).to(torch.bfloat16).contiguous()
    scores = topk_scores_BLK.reshape(-1, topk).to(torch.float32).contiguous()
    ids = topk_expert_ids_BLK.reshape(-1, topk).to(torch.int64).contiguous()
    gate, up, down = (local_bf16(w) for w in routed)
    shared_weights = (None, None, None)
    if shared is not None:
        shared_weights = tuple(local_bf16(lin.weight) for lin in (shared.w1, shared.w3,
                                                                  shared.w2))  # fmt: skip
    num_local_experts = gate.shape[0]
    config = owner.mok_config
    workspace = layer_workspace(config, owner.ep_group, x.device, x.shape[0], dim, topk,
                                num_local_experts)  # fmt: skip
    schedule = functional.build_schedule(workspace, config, ids,
                                         num_local_experts=num_local_experts)  # fmt: skip
    out = moe(config, workspace, schedule, x, scores, *shared_weights, gate, up, down,
              recompute=owner.recompute)  # fmt: skip
    return out.to(x_BLD.dtype).view(batch, seq, dim)


def set_knobs(owner, config: MoKConfig, recompute: bool) -> None:
    """`owner`'s MoKConfig (validated), recompute flag and EP group of one."""
    config.validate()
    owner.mok_config = config
    owner.recompute = recompute
    owner.ep_group = None


def foldable_shared_expert(shared, width: int, swiglu_class) -> bool:
    """Whether `shared` runs inside mok's layer: a `swiglu_class` (TorchTitan's FeedForward)
    without biases whose hidden width is the routed experts' `width`."""
    if type(shared) is not swiglu_class:
        return False
    linears = (shared.w1, shared.w2, shared.w3)
    if any(getattr(lin, "bias", None) is not None for lin in linears):
        return False
    return shared.w1.weight.shape[0] == width


def local_bf16(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight (a DTensor's local shard), in bf16."""
    if hasattr(weight, "to_local"):
        weight = weight.to_local()
    return weight if weight.dtype == torch.bfloat16 else weight.to(torch.bfloat16)
