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

``mok.integrations.torchtitan.mok_moe`` overrides the whole `MoE` layer instead (`MoKMoE`, the
same parameters and router): it also folds the shared expert into mok's layer when it is a
SwiGLU `FeedForward` as wide as the routed experts (DeepSeek-V3's), so that its GEMMs run in
the same launches and its output joins the fixed-order fp32 sum; any other shared expert runs
as TorchTitan's and is added after. Use one of the two overrides, not both (TorchTitan refuses
nested overrides).

The EP group is TorchTitan's EP mesh (``parallel_dims.get_optional_mesh("ep")``), read when
TorchTitan parallelizes the module; without one, a group of one. Parameters held in fp32 are
cast to bf16 for the layer, as TorchTitan's own grouped experts do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.config import derive, override
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe import MoE, RoutedExperts

from .. import functional
from ..config import MoKConfig
from ..nn import layer_workspace, moe

__all__ = ["MoKMoE", "MoKRoutedExperts", "mok_moe", "mok_routed_experts"]


@dataclass(kw_only=True)
class MoKKnobs:
    """mok's knobs as TorchTitan config fields (`mok.MoKConfig`, SEMANTICS §3). No slots of
    its own: the slotted configs that take it as a second base give its fields theirs."""

    fwd_num_comm_sms: int = 0
    bwd_num_comm_sms: int = 0
    minibatch_size: int = 131072
    macrobatch_size: int = 131072
    schedule_capacity_multiplier: float = 0.5
    recompute: bool = False


class _MoKLayer:
    """What both overrides' modules add to TorchTitan's: mok's knobs from their config, and the
    EP group from TorchTitan's EP mesh when it parallelizes them."""

    def __init__(self, config):
        super().__init__(config)
        _mok_knobs(self, config)

    def parallelize(self, parallel_dims) -> None:
        super().parallelize(parallel_dims)
        self.ep_group = _ep_group(parallel_dims)


class MoKRoutedExperts(_MoKLayer, RoutedExperts):
    """`RoutedExperts` whose dispatch, experts and combine run in mok (same parameters)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config, MoKKnobs):
        """RoutedExperts' fields, and mok's knobs."""

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
        return mok_layer(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, self.inner_experts)


def mok_layer(owner, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, experts, shared=None):
    """The layer in mok: `owner`'s MoKConfig, EP group and recompute; `experts` a
    GroupedExperts; `shared` a FeedForward folded in as mok's shared expert, or None."""
    batch, seq, dim = x_BLD.shape
    topk = topk_scores_BLK.shape[-1]
    x = x_BLD.reshape(batch * seq, dim).to(torch.bfloat16).contiguous()
    scores = topk_scores_BLK.reshape(-1, topk).to(torch.float32).contiguous()
    ids = topk_expert_ids_BLK.reshape(-1, topk).to(torch.int64).contiguous()
    gate, up, down = (_local_bf16(w) for w in (experts.w1_EFD, experts.w3_EFD, experts.w2_EDF))
    shared_weights = (None, None, None)
    if shared is not None:
        shared_weights = tuple(_local_bf16(lin.weight) for lin in (shared.w1, shared.w3,
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


def _mok_knobs(owner, config) -> None:
    """`owner`'s MoKConfig, recompute flag and (until `parallelize`) EP group of one."""
    owner.mok_config = MoKConfig(
        fwd_num_comm_sms=config.fwd_num_comm_sms,
        bwd_num_comm_sms=config.bwd_num_comm_sms,
        minibatch_size=config.minibatch_size,
        macrobatch_size=config.macrobatch_size,
        schedule_capacity_multiplier=config.schedule_capacity_multiplier,
    )
    owner.mok_config.validate()
    owner.recompute = config.recompute
    owner.ep_group = None


class MoKMoE(_MoKLayer, MoE):
    """TorchTitan's `MoE` (same parameters, router and load-balancing counts) with its routed
    experts, and its shared expert where it is foldable, in one mok layer."""

    @dataclass(kw_only=True, slots=True)
    class Config(MoE.Config, MoKKnobs):
        """MoE's fields, and mok's knobs."""

    def folds_shared_expert(self) -> bool:
        """Whether the shared expert runs inside mok's layer: a SwiGLU FeedForward without
        biases, as wide as the routed experts."""
        shared = self.shared_experts
        if type(shared) is not FeedForward:
            return False
        linears = (shared.w1, shared.w2, shared.w3)
        if any(getattr(lin, "bias", None) is not None for lin in linears):
            return False
        width = self.routed_experts.inner_experts.w1_EFD.shape[1]
        return shared.w1.weight.shape[0] == width

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        """MoE.forward's routing and load-balancing counts, then mok's layer."""
        topk_scores_BLK, topk_expert_ids_BLK, scores_BLE = self.router(x_BLD, self.expert_bias_E)
        routing_map_BLE = torch.zeros_like(scores_BLE, dtype=torch.bool).scatter_(
            -1, topk_expert_ids_BLK, True
        )
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(routing_map_BLE.sum(dim=(0, 1)))
        fold = self.folds_shared_expert()
        out_BLD = mok_layer(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK,
                            self.routed_experts.inner_experts,
                            self.shared_experts if fold else None)  # fmt: skip
        if self.shared_experts is not None and not fold:
            out_BLD = out_BLD + self.shared_experts(x_BLD)
        return out_BLD


def _ep_group(parallel_dims):
    """The process group of TorchTitan's EP mesh, or None (a group of one) without one."""
    ep_mesh = parallel_dims.get_optional_mesh("ep")
    return None if ep_mesh is None else ep_mesh.get_group()


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
def mok_routed_experts(cfg: RoutedExperts.Config, **knobs) -> MoKRoutedExperts.Config:
    """The override: every MoE layer's RoutedExperts config becomes MoKRoutedExperts' with the
    same fields and mok's knobs (`knobs`: MoKKnobs' fields, from the import entry's JSON; any
    other name is refused by `derive`)."""
    return derive(cfg, MoKRoutedExperts.Config, **knobs)


@override(
    target=MoE.Config,
    fqns=["*moe"],
    description="mok: the MoE layer's routed experts and a foldable shared expert in mok",
    exact=True,
)
def mok_moe(cfg: MoE.Config, **knobs) -> MoKMoE.Config:
    """The override: every MoE layer's config becomes MoKMoE's with the same fields (router,
    routed and shared experts) and mok's knobs (as `mok_routed_experts`')."""
    return derive(cfg, MoKMoE.Config, **knobs)
