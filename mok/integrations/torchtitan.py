"""TorchTitan's routed experts run by mok.

A TorchTitan job selects it with

    --override.imports mok.integrations.torchtitan.mok_routed_experts

(or, with mok's knobs, ``'mok.integrations.torchtitan.mok_routed_experts={"recompute": true}'``;
in Python, `apply_overrides` with the entry ``("mok.integrations.torchtitan.mok_routed_experts",
{...})``). Every MoE layer's `RoutedExperts` becomes a `MoKRoutedExperts`: the same parameters
(``inner_experts.w1_EFD`` gate, ``w3_EFD`` up [E, F, D], ``w2_EDF`` down [E, D, F], mok's own
layout, read in place), the same router and shared expert, and the token dispatch, the
SwiGLU experts and the weighted combine all in mok's kernels. TorchTitan's routing contract
is mok's: fp32 scores applied after the experts, int64 expert ids.

The EP group is TorchTitan's EP mesh (``parallel_dims.get_optional_mesh("ep")``), read when
TorchTitan parallelizes the module; without one, a group of one. Parameters held in fp32 are
cast to bf16 for the layer, as TorchTitan's own grouped experts do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.config import derive, override
from torchtitan.models.common.moe import RoutedExperts

from .. import functional
from ..config import MoKConfig
from ..nn import layer_workspace, moe

__all__ = ["MoKRoutedExperts", "mok_routed_experts"]


class MoKRoutedExperts(RoutedExperts):
    """`RoutedExperts` whose dispatch, experts and combine run in mok (same parameters)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        """RoutedExperts' fields, and mok's knobs (`mok.MoKConfig`, SEMANTICS §3)."""

        fwd_num_comm_sms: int = 0
        bwd_num_comm_sms: int = 0
        minibatch_size: int = 131072
        macrobatch_size: int = 131072
        schedule_capacity_multiplier: float = 0.5
        recompute: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        self.mok_config = MoKConfig(
            fwd_num_comm_sms=config.fwd_num_comm_sms,
            bwd_num_comm_sms=config.bwd_num_comm_sms,
            minibatch_size=config.minibatch_size,
            macrobatch_size=config.macrobatch_size,
            schedule_capacity_multiplier=config.schedule_capacity_multiplier,
        )
        self.mok_config.validate()
        self.recompute = config.recompute
        self.ep_group = None  # TorchTitan's EP mesh's group, set by `parallelize`

    def parallelize(self, parallel_dims) -> None:
        super().parallelize(parallel_dims)
        ep_mesh = parallel_dims.get_optional_mesh("ep")
        self.ep_group = None if ep_mesh is None else ep_mesh.get_group()

    def forward(
        self,
        x_BLD: torch.Tensor,
        topk_scores_BLK: torch.Tensor,
        topk_expert_ids_BLK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> torch.Tensor:
        """out [B, L, D] = sum_k score[., k] * expert_{id[., k]}(x) (mok computes it in fp32
        and rounds once to bf16, then to x's dtype). `num_local_tokens_per_expert_E` is not
        needed: mok counts and places the routed rows itself."""
        del num_local_tokens_per_expert_E
        batch, seq, dim = x_BLD.shape
        topk = topk_scores_BLK.shape[-1]
        x = x_BLD.reshape(batch * seq, dim).to(torch.bfloat16).contiguous()
        scores = topk_scores_BLK.reshape(-1, topk).to(torch.float32).contiguous()
        ids = topk_expert_ids_BLK.reshape(-1, topk).to(torch.int64).contiguous()
        experts = self.inner_experts
        gate, up, down = (_local_bf16(w) for w in (experts.w1_EFD, experts.w3_EFD,
                                                   experts.w2_EDF))  # fmt: skip
        num_local_experts = gate.shape[0]
        workspace = layer_workspace(self.mok_config, self.ep_group, x.device, x.shape[0], dim,
                                    topk, num_local_experts)  # fmt: skip
        schedule = functional.build_schedule(workspace, self.mok_config, ids,
                                             num_local_experts=num_local_experts)  # fmt: skip
        out = moe(self.mok_config, workspace, schedule, x, scores, None, None, None, gate, up,
                  down, recompute=self.recompute)  # fmt: skip
        return out.to(x_BLD.dtype).view(batch, seq, dim)


def _local_bf16(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight (a DTensor's local shard), in bf16."""
    if hasattr(weight, "to_local"):
        weight = weight.to_local()
    return weight if weight.dtype == torch.bfloat16 else weight.to(torch.bfloat16)


@override(
    target=RoutedExperts.Config,
    fqns=["*moe.routed_experts"],
    description="mok: dispatch, SwiGLU experts and combine in mok's megakernels",
    exact=True,
)
def mok_routed_experts(
    cfg: RoutedExperts.Config,
    *,
    fwd_num_comm_sms: int = 0,
    bwd_num_comm_sms: int = 0,
    minibatch_size: int = 131072,
    macrobatch_size: int = 131072,
    schedule_capacity_multiplier: float = 0.5,
    recompute: bool = False,
) -> MoKRoutedExperts.Config:
    """The override: every MoE layer's RoutedExperts config becomes MoKRoutedExperts' with the
    same fields and mok's knobs."""
    return derive(
        cfg, MoKRoutedExperts.Config, fwd_num_comm_sms=fwd_num_comm_sms,
        bwd_num_comm_sms=bwd_num_comm_sms, minibatch_size=minibatch_size,
        macrobatch_size=macrobatch_size,
        schedule_capacity_multiplier=schedule_capacity_multiplier, recompute=recompute,
    )  # fmt: skip
