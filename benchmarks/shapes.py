"""The shapes that matter (SEMANTICS.md §8) and how each is scaled to the GPUs of one run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """One MoE layer of a published model.

    ``experts_one_gpu`` is how many experts one GPU holds when the model does not fit whole:
    the per-GPU share at EP=8 (a "slice" of the layer: H, I and k kept, so each expert sees as
    many routed rows as it would in a real EP=8 deployment). Models whose experts all fit keep
    them all.
    """

    name: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    topk: int
    experts_one_gpu: int
    swiglu_limit: float | None = None


# name, experts, H, I, k, experts held by one GPU (why: see ModelShape)
SHAPES: tuple[ModelShape, ...] = (
    ModelShape("qwen3-30b-a3b", 128, 2048, 768, 8, 128),  # 1.2 GB of weights: all fit
    ModelShape("deepseek-v3", 256, 7168, 2048, 8, 32),  # slice: 256 / EP 8
    ModelShape("mixtral-8x7b", 8, 4096, 14336, 2, 8),  # 2.8 GB: all fit
    ModelShape("kimi-k2", 384, 7168, 2048, 8, 48),  # slice: 384 / EP 8
    ModelShape("glm-5", 256, 6144, 2048, 8, 32),  # slice: 256 / EP 8
    ModelShape("qwen3.5-397b-a17b", 512, 4096, 1024, 10, 64),  # slice: 512 / EP 8
    ModelShape("deepseek-v4-pro", 384, 7168, 3072, 6, 48, swiglu_limit=10.0),  # slice
)

# --quick keeps each model's k and expert ratio but shrinks every dimension so that the whole
# harness (reference included) runs on a CPU in seconds; it proves plumbing, not speed.
QUICK_HIDDEN = 128
QUICK_INTERMEDIATE = 128  # mok needs H and I in multiples of 128
QUICK_MAX_EXPERTS = 16


@dataclass(frozen=True)
class RunShape:
    """A model shape as actually run: ``num_experts`` global, ``experts_per_rank`` on each GPU."""

    name: str
    num_experts: int
    experts_per_rank: int
    hidden_size: int
    intermediate_size: int
    topk: int
    model: ModelShape

    @property
    def swiglu_limit(self) -> float | None:
        return self.model.swiglu_limit

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "num_experts": self.num_experts,
            "experts_per_rank": self.experts_per_rank,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "topk": self.topk,
            "swiglu_limit": self.swiglu_limit,
            "model_num_experts": self.model.num_experts,
            "scaled": self.num_experts != self.model.num_experts,
        }


def scale_for_run(shape: ModelShape, world_size: int, quick: bool) -> RunShape:
    """Experts run on ``world_size`` GPUs: ``experts_one_gpu`` per GPU, never more than the model.

    Raises ValueError when the result is not divisible by the world size.
    """
    per_gpu = min(shape.experts_one_gpu, QUICK_MAX_EXPERTS) if quick else shape.experts_one_gpu
    num_experts = min(shape.num_experts, per_gpu * world_size)
    if num_experts % world_size:
        raise ValueError(
            f"shape {shape.name}: {num_experts} experts do not divide over world size {world_size}"
        )
    hidden = QUICK_HIDDEN if quick else shape.hidden_size
    intermediate = QUICK_INTERMEDIATE if quick else shape.intermediate_size
    return RunShape(
        name=shape.name,
        num_experts=num_experts,
        experts_per_rank=num_experts // world_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        topk=min(shape.topk, num_experts),
        model=shape,
    )


def select_shapes(names: str | None) -> list[ModelShape]:
    """Shapes named in a comma list (``None`` or ``all``: every shape), in table order."""
    if names is None or names == "all":
        return list(SHAPES)
    by_name = {shape.name: shape for shape in SHAPES}
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in by_name]
    if unknown:
        raise ValueError(f"--shapes: unknown {unknown}; expected names from {sorted(by_name)}")
    return [by_name[name] for name in wanted]
