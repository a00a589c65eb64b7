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

try:
    from torchtitan.config import derive, override
except ImportError as error:  # TorchTitan 0.2: no override mechanism
    raise ImportError(
        "mok.integrations.torchtitan needs TorchTitan 0.3 (its override mechanism, "
        "torchtitan.config.override); for TorchTitan 0.2 use its model converter: "
        "--experimental.custom_import mok.integrations.torchtitan_converter "
        "--model.converters mok"
    ) from error
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe import MoE, RoutedExperts

from ..config import MoKConfig
from .torchtitan_layer import foldable_shared_expert, mok_layer, set_knobs

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
    macrobatch_replay: str = "gate_up"
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
        return mok_layer(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK,
                         _routed_weights(self.inner_experts))  # fmt: skip


def _routed_weights(experts) -> tuple:
    """(gate, up, down) of a TorchTitan 0.3 GroupedExperts."""
    return experts.w1_EFD, experts.w3_EFD, experts.w2_EDF


def _mok_knobs(owner, config) -> None:
    """`owner`'s MoKConfig, recompute flag and (until `parallelize`) EP group of one."""
    knobs = MoKConfig(
        fwd_num_comm_sms=config.fwd_num_comm_sms,
        bwd_num_comm_sms=config.bwd_num_comm_sms,
        minibatch_size=config.minibatch_size,
        macrobatch_size=config.macrobatch_size,
        schedule_capacity_multiplier=config.schedule_capacity_multiplier,
        macrobatch_replay=config.macrobatch_replay,
    )
    set_knobs(owner, knobs, config.recompute)


class MoKMoE(_MoKLayer, MoE):
    """TorchTitan's `MoE` (same parameters, router and load-balancing counts) with its routed
    experts, and its shared expert where it is foldable, in one mok layer."""

    @dataclass(kw_only=True, slots=True)
    class Config(MoE.Config, MoKKnobs):
        """MoE's fields, and mok's knobs."""

    def folds_shared_expert(self) -> bool:
        """Whether the shared expert runs inside mok's layer: a SwiGLU FeedForward without
        biases, as wide as the routed experts."""
        width = self.routed_experts.inner_experts.w1_EFD.shape[1]
        return foldable_shared_expert(self.shared_experts, width, FeedForward)

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
                            _routed_weights(self.routed_experts.inner_experts),
                            self.shared_experts if fold else None)  # fmt: skip
        if self.shared_experts is not None and not fold:
            out_BLD = out_BLD + self.shared_experts(x_BLD)
        return out_BLD


def _ep_group(parallel_dims):
    """The process group of TorchTitan's EP mesh, or None (a group of one) without one."""
    ep_mesh = parallel_dims.get_optional_mesh("ep")
    return None if ep_mesh is None else ep_mesh.get_group()


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
