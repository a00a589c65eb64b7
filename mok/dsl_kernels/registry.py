"""Every kernel variant the build compiles: kernel class + config + variant name.

The variant name is the cubin's file stem, the manifest key and (prefixed with `mok_`) the
kernel's entry symbol. `launch_grid` documents how the host computes the grid; the runtime
implements exactly that formula.
"""

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Variant:
    name: str
    kernel: type
    config: dict[str, Any] = field(default_factory=dict)
    launch_grid: str = ""
    # Empty: every arch the build is asked for. Set for arch-specific engines (wgmma: sm_90a).
    archs: tuple[str, ...] = ()

    @property
    def symbol_prefix(self) -> str:
        return f"mok_{self.name}"


def variants() -> list[Variant]:
    """The registry (imports the DSL: call it only when building or testing)."""
    from .kernels.all_gather_top_experts import AllGatherTopExperts
    from .kernels.backward_finish import BackwardFinish
    from .kernels.ep_barrier import EpBarrier
    from .kernels.flag_wait_probe import FlagWaitProbe
    from .kernels.gather_rows import GatherRows
    from .kernels.macrobatch_schedule import MacrobatchSchedule
    from .kernels.moe_combine_backward import MoeCombineBackward
    from .kernels.moe_combine_forward import MoeCombineForward
    from .kernels.mxfp8_dequantize import Mxfp8Dequantize
    from .kernels.mxfp8_quantize_rowwise import Mxfp8QuantizeRowwise
    from .kernels.mxfp8_quantize_transposed import Mxfp8QuantizeTransposed
    from .kernels.mxfp8_round_trip import Mxfp8RoundTrip
    from .kernels.router_grad_push import RouterGradPush
    from .kernels.schedule import Schedule
    from .kernels.sm_holder import SmHolder
    from .sm90.copy_probe import MODES, Sm90CopyProbe
    from .sm90.expert_gemm import Sm90ExpertGemm
    from .sm90.expert_gemm_bwd import Sm90ExpertGemmBwd
    from .sm90.expert_gemm_bwd_weights import Sm90ExpertGemmBwdWeights
    from .sm90.expert_gemm_bwd_weights_window import Sm90ExpertGemmBwdWeightsWindow
    from .sm90.moe_backward import Sm90MoeBackward
    from .sm90.moe_forward import Sm90MoeForward
    from .sm90.row_tma_probe import Sm90RowTmaProbe
    from .sm90.wgmma_probe import ENGINES, Sm90WgmmaProbe

    return [
        Variant(
            "mxfp8_quantize_rowwise",
            Mxfp8QuantizeRowwise,
            launch_grid="(num_cols / 128, num_rows / 128, 1)",
        ),
        Variant(
            "mxfp8_quantize_transposed",
            Mxfp8QuantizeTransposed,
            launch_grid="(num_cols / 128, num_rows / 128, 1)",
        ),
        # bf16 -> bf16 MXFP8 round trips (along rows, down columns) and the dequantisers.
        Variant(
            "mxfp8_round_trip_rowwise",
            Mxfp8RoundTrip,
            launch_grid="(num_cols / 128, num_rows / 128, 1)",
        ),
        Variant(
            "mxfp8_round_trip_columns",
            Mxfp8RoundTrip,
            {"along_rows": True},
            launch_grid="(num_cols / 128, num_rows / 128, 1)",
        ),
        Variant(
            "mxfp8_dequantize_rowwise",
            Mxfp8Dequantize,
            launch_grid="(num_cols / 128, num_rows / 128, 1)",
        ),
        Variant(
            "mxfp8_dequantize_transposed",
            Mxfp8Dequantize,
            {"transposed": True},
            launch_grid="(num_cols / 128, num_rows / 128, batch)",
        ),
        Variant(
            "moe_combine_forward",
            MoeCombineForward,
            {"threads": 128, "tokens_per_cta": 4},
            launch_grid="(ceil(hidden_size / (8 * 128)), ceil(num_tokens / 4), 1)",
        ),
        Variant(
            "moe_combine_backward",
            MoeCombineBackward,
            {"threads": 128, "tokens_per_cta": 4},
            launch_grid="(ceil(hidden_size / (8 * 128)), ceil(num_tokens / 4), 1)",
        ),
        # The recomputed forward context's gather (common/gather_rows.py).
        Variant(
            "gather_rows",
            GatherRows,
            {"threads": 128, "rows_per_cta": 4},
            launch_grid="(ceil(hidden_size / (8 * 128)), min(ceil(num_rows / 4), 65535), 1)",
        ),
        # The receive schedule's count and placement tasks in one launch (kernels/schedule.py);
        # ids64, a group of one's: the caller's int64 routing in place of the all-gather's copy.
        *(
            Variant(name, Schedule, config, launch_grid="(max(1, ceil(num_entries / 4096)), 1, 1)")
            for name, config in (("schedule", {}), ("schedule_ids64", {"ids64": True}))
        ),
        Variant("flag_wait_probe", FlagWaitProbe, launch_grid="(1, 1, 1)"),
        # Each macrobatch's schedule sizes (common/macrobatch_schedule.py), for ring reuse.
        Variant("macrobatch_schedule", MacrobatchSchedule, launch_grid="(1, 1, 1)"),
        # Holds num_ctas (<= SM count) whole SMs for the forward-progress test
        # (kernels/sm_holder.py).
        Variant("sm_holder", SmHolder, launch_grid="(num_ctas, 1, 1)"),
        # The router-weight gradient pushed to each token's rank (common/router_grad_push.py).
        Variant(
            "router_grad_push",
            RouterGradPush,
            {"threads": 128},
            launch_grid="(ceil(num_rows / 128), 1, 1)",
        ),
        # A group of one's push and backward epilogue in one launch (common/backward_finish.py).
        Variant(
            "backward_finish",
            BackwardFinish,
            {"threads": 128, "tokens_per_cta": 4},
            launch_grid="(ceil(hidden_size / 1024) * ceil(num_tokens / 4) + ceil(num_rows / 128), 1, 1)",
        ),
        Variant("ep_barrier", EpBarrier, launch_grid="(1, 1, 1)"),
        Variant(
            "all_gather_top_experts",
            AllGatherTopExperts,
            launch_grid="(ctas_per_peer, world_size, 1)",
        ),
        # Grouped expert GEMMs (sm90/expert_gemm.py) for the shared expert and the recomputed
        # context: wgmma + setmaxnreg, Hopper only (sm100 needs the tcgen05/TMEM engine).
        Variant(
            "expert_gemm_gate_up_swiglu",
            Sm90ExpertGemm,
            {"epilogue": "swiglu", "stages": 3},
            launch_grid="(min(sm_count, capacity / 128 * intermediate_size / 128), 1, 1)",
            archs=("sm_90a",),
        ),
        Variant(
            "expert_gemm_down",
            Sm90ExpertGemm,
            {"epilogue": "store", "stages": 3},
            launch_grid="(min(sm_count, capacity / 128 * hidden_size / 256), 1, 1)",
            archs=("sm_90a",),
        ),
        # The megakernels (sm90/moe_forward.py, sm90/moe_backward.py): one persistent CTA an SM.
        # moe_backward_window: one macrobatch of ring reuse, its weight tasks continued from and
        # into fp32 partials.
        *(
            Variant(name, kernel, {"stages": 3, **extra}, "(sm_count, 1, 1)", ("sm_90a",))
            for name, kernel, extra in (
                ("moe_forward", Sm90MoeForward, {}),
                ("moe_forward_mxfp8", Sm90MoeForward, {"mxfp8": True}),
                ("moe_backward", Sm90MoeBackward, {}),
                ("moe_backward_window", Sm90MoeBackward, {"window": True}),
                ("moe_backward_mxfp8", Sm90MoeBackward, {"mxfp8": True}),
            )
        ),
        # The shared expert's activation-gradient GEMMs (sm90/expert_gemm_bwd.py).
        Variant(
            "expert_gemm_bwd_d_hidden_swiglu",
            Sm90ExpertGemmBwd,
            {"job": "d_hidden_swiglu", "stages": 3},
            launch_grid="(min(sm_count, capacity / 128 * intermediate_size / 256), 1, 1)",
            archs=("sm_90a",),
        ),
        Variant(
            "expert_gemm_bwd_d_x",
            Sm90ExpertGemmBwd,
            {"job": "d_x", "stages": 3},
            launch_grid="(min(sm_count, capacity / 128 * hidden_size / 256), 1, 1)",
            archs=("sm_90a",),
        ),
        # Weight gradients out[e] = A_e^T B_e (sm90/expert_gemm_bwd_weights.py): one CTA per
        # output tile over the expert's whole token range, zeros for an expert without tokens.
        # The bf16 output is stored by the epilogue crew: 3 ring stages.
        *(
            Variant(
                name,
                Sm90ExpertGemmBwdWeights,
                {"stages": stages, "output": output},
                launch_grid="(min(sm_count, num_experts * m_size / 128 * n_size / 256), 1, 1)",
                archs=("sm_90a",),
            )
            for name, output, stages in (
                ("expert_gemm_bwd_weights", "fp32", 4),
                ("expert_gemm_bwd_weights_bf16", "bf16", 3),
                ("expert_gemm_bwd_weights_accumulate", "fp32_accumulate", 4),
            )
        ),
        # The same sums one macrobatch at a time (sm90/expert_gemm_bwd_weights_window.py):
        # each expert's part in the macrobatch, continued from and into an fp32 partial.
        *(
            Variant(
                name,
                Sm90ExpertGemmBwdWeightsWindow,
                {"stages": stages, "output": output},
                launch_grid="(min(sm_count, num_experts * m_size / 128 * n_size / 256), 1, 1)",
                archs=("sm_90a",),
            )
            for name, output, stages in (
                ("expert_gemm_bwd_weights_window_bf16", "bf16", 3),
                ("expert_gemm_bwd_weights_window_accumulate", "fp32_accumulate", 4),
            )
        ),
        # Probes, one CTA an SM: the compute ceilings of the MXFP8 engines (sm90/wgmma_probe.py,
        # tools/wgmma_probe.py), how fast one SM moves rows (sm90/copy_probe.py,
        # tools/copy_probe.py) and rows gathered by one-row TMA boxes (sm90/row_tma_probe.py,
        # tools/row_tma_probe.py).
        *(
            Variant(name, kernel, config, launch_grid="(num_ctas, 1, 1)", archs=("sm_90a",))
            for name, kernel, config in (
                *((f"wgmma_probe_{e}", Sm90WgmmaProbe, {"engine": e}) for e in ENGINES),
                *((f"copy_probe_{m}", Sm90CopyProbe, {"mode": m}) for m in MODES),
                ("row_tma_probe", Sm90RowTmaProbe, {}),
            )
        ),
    ]
