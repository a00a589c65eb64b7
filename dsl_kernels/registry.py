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

    @property
    def symbol_prefix(self) -> str:
        return f"mok_{self.name}"


def variants() -> list[Variant]:
    """The registry (imports the DSL: call it only when building or testing)."""
    from .common.moe_combine_backward import MoeCombineBackward
    from .common.moe_combine_forward import MoeCombineForward
    from .common.mxfp8_quantize_rowwise import Mxfp8QuantizeRowwise
    from .common.mxfp8_quantize_transposed import Mxfp8QuantizeTransposed

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
        Variant(
            "moe_combine_forward",
            MoeCombineForward,
            {"threads": 128},
            launch_grid="(ceil(hidden_size / (8 * 128)), num_tokens, 1)",
        ),
        Variant(
            "moe_combine_backward",
            MoeCombineBackward,
            {"threads": 128},
            launch_grid="(ceil(hidden_size / (8 * 128)), num_tokens, 1)",
        ),
    ]
