"""TorchTitan 0.2's MoE layers run by mok, through TorchTitan's model converters.

TorchTitan 0.2 (the line that imports with torch 2.11; TorchTitan 0.3 has its own entry,
`mok.integrations.torchtitan`) applies model converters by name. Importing this module registers
mok's as "mok", so a job selects it with

    --experimental.custom_import mok.integrations.torchtitan_converter --model.converters mok

(in Python: `MoKConverter().convert(model)`, with mok's knobs as keywords). Every
`torchtitan.models.moe.MoE` layer becomes a `MoKMoE`: the same parameters (the experts' ``w1``
gate and ``w3`` up [E, F, D], ``w2`` down [E, D, F]: mok's layout, read in place), the same
router and load-balancing counts, and the token dispatch, the SwiGLU experts and the weighted
combine in mok's kernels. A shared expert that is a SwiGLU `FeedForward` as wide as the routed
experts (one shared expert) runs inside mok's layer; any other runs as TorchTitan's and is added
after. Parameter names, and so checkpoints, stay TorchTitan's.

Refused, with a ValueError naming the setting: scores applied before the experts
(`MoEArgs.score_before_experts`; mok weighs the experts' outputs), and a job that parallelizes
the experts itself (TorchTitan's expert or tensor parallelism, `parallel_dims.ep` or `tp` > 1:
its all-to-all would wrap mok's own dispatch). Data parallelism (FSDP) is fine.
"""

from __future__ import annotations

import torch

try:
    from torchtitan.models.moe import MoE
    from torchtitan.models.moe.moe import FeedForward
    from torchtitan.protocols.model_converter import register_model_converter
except ImportError as error:  # TorchTitan 0.3: overrides instead of these model classes
    raise ImportError(
        "mok.integrations.torchtitan_converter needs TorchTitan 0.2 (its model converters and "
        "torchtitan.models.moe); for TorchTitan 0.3 use mok.integrations.torchtitan "
        "(--override.imports mok.integrations.torchtitan.mok_routed_experts)"
    ) from error

from ..config import MoKConfig
from .torchtitan_layer import foldable_shared_expert, mok_layer, set_knobs

__all__ = ["MoKConverter", "MoKMoE"]

CONVERTER_NAME = "mok"


class MoKMoE(MoE):
    """TorchTitan 0.2's `MoE` (same parameters, router and load-balancing counts) with its routed
    experts, and its shared expert where it is foldable, in one mok layer. Made from an `MoE` in
    place by `MoKConverter`."""

    def folds_shared_expert(self) -> bool:
        """Whether the shared expert runs inside mok's layer (a SwiGLU FeedForward without
        biases, as wide as the routed experts)."""
        return foldable_shared_expert(self.shared_experts, self.experts.w1.shape[1], FeedForward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """MoE.forward's routing and load-balancing counts, then mok's layer: x [B, L, D]."""
        bs, slen, dim = x.shape
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(
            x.view(-1, dim), self.expert_bias
        )
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)
        fold = self.folds_shared_expert()
        experts = self.experts
        out = mok_layer(
            self, x, top_scores.view(bs, slen, -1), selected_experts_indices.view(bs, slen, -1),
            (experts.w1, experts.w3, experts.w2), self.shared_experts if fold else None,
        )  # fmt: skip
        if self.shared_experts is not None and not fold:
            out = out + self.shared_experts(x)
        return out


class MoKConverter:
    """TorchTitan 0.2's model converter "mok": every `MoE` layer of a model becomes a `MoKMoE`
    (in place, parameters untouched). `knobs`: `mok.MoKConfig`'s fields and `recompute`, for
    use from Python; a job gets the defaults."""

    def __init__(self, job_config=None, parallel_dims=None, *, recompute: bool = False, **knobs):
        if parallel_dims is not None:
            for name in ("ep", "tp"):
                size = getattr(parallel_dims, name, 1)
                if size > 1:
                    raise ValueError(
                        f"the mok converter runs TorchTitan's MoE layers with an EP group of one: "
                        f"parallel_dims.{name} must be 1, got {size} (TorchTitan's own "
                        f"parallelism of the experts would wrap mok's dispatch)"
                    )
        self.config = MoKConfig(**knobs)
        self.recompute = recompute

    def convert(self, model: torch.nn.Module) -> None:
        """Every MoE layer of `model` to a MoKMoE, in place; a model without one is refused."""
        layers = [m for m in model.modules() if isinstance(m, MoE)]
        if not layers:
            raise ValueError(
                "the mok converter found no torchtitan.models.moe.MoE layer in the model"
            )
        for layer in layers:
            if layer.score_before_experts:
                raise ValueError(
                    "MoEArgs.score_before_experts must be False for mok (it weighs the experts' "
                    "outputs, not their inputs), got True"
                )
            layer.__class__ = MoKMoE
            set_knobs(layer, self.config, self.recompute)

    def post_optimizer_hook(self, model) -> None:
        """Nothing to do after an optimizer step."""


register_model_converter(MoKConverter, CONVERTER_NAME)
