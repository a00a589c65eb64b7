"""Input checks for the public API: every error names the argument, expected and actual value.

Only metadata (dtype, shape, device, layout) is checked here, so the checks also run on fake
tensors under torch.compile; value checks (router weights > 0, expert ids in range) run inside
the ops, where the data is real: on CPU with the functions at the end of this module, on CUDA
inside the kernels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .errors import MoKInputError


def check_type(name: str, value, expected: type | tuple[type, ...]) -> None:
    if not isinstance(value, expected):
        names = (
            " or ".join(t.__name__ for t in expected)
            if isinstance(expected, tuple)
            else expected.__name__
        )
        raise MoKInputError(f"{name} must be a {names}, got {type(value).__name__}")


def check_int(name: str, value, *, minimum: int | None = None, multiple_of: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MoKInputError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value % multiple_of:
        raise ValueError(f"{name} must be a multiple of {multiple_of}, got {value}")
    return value


def check_tensor(
    name: str,
    tensor,
    *,
    dtype: torch.dtype,
    shape: Sequence[int | None],
    device: torch.device | None = None,
    expert_strided: bool = False,
) -> torch.Tensor:
    """dtype, then rank/shape (None matches any size), then device, then contiguity.

    `expert_strided` (a [E, N, K] routed expert weight, or its main_grad): contiguous, or with
    contiguous [N, K] blocks whose experts lie further apart (`check_expert_strides`), as either
    half of one fused [E, 2 N, K] tensor (gate_up[:, :N], gate_up[:, N:])."""
    # The common case first, in a few attribute reads (this runs on every layer call).
    if (
        isinstance(tensor, torch.Tensor)
        and tensor.dtype == dtype
        and tensor.shape == tuple(shape)
        and (device is None or tensor.device == device)
        and tensor.is_contiguous()
    ):
        return tensor
    if not isinstance(tensor, torch.Tensor):
        raise MoKInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise MoKInputError(f"{name} must have dtype {dtype}, got {tensor.dtype}")
    actual = tuple(tensor.shape)
    if len(actual) != len(shape) or any(
        want is not None and want != got for want, got in zip(shape, actual, strict=False)
    ):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {expected}, got {list(actual)}")
    if device is not None and not same_device(tensor.device, device):
        raise ValueError(f"{name} must be on device {device}, got {tensor.device}")
    if expert_strided:
        check_expert_strides(name, tensor)
    elif not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(tensor.stride())}")
    return tensor


def check_expert_strides(name: str, tensor: torch.Tensor) -> None:
    """A [E, N, K] tensor whose experts' [N, K] blocks are contiguous, stride(0) a multiple of K
    and at least N * K: contiguous, or a half of one fused [E, 2 N, K] tensor."""
    if tensor.is_contiguous():
        return
    _, rows, cols = tensor.shape
    strides = tuple(tensor.stride())
    if strides[2] != 1 or strides[1] != cols or strides[0] < rows * cols or strides[0] % cols:
        raise ValueError(
            f"{name} must be contiguous or have strides (R * {cols}, {cols}, 1) with R >= {rows} "
            f"rows per expert (e.g. a half of a fused [E, 2 * {rows}, {cols}] tensor), got "
            f"strides {strides}"
        )


def same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device
    return (a.index if a.index is not None else current()) == (
        b.index if b.index is not None else current()
    )


def tensor_key(t) -> tuple | None:
    """What the metadata checks look at in a tensor (shape, dtype, device, layout, class): two
    tensors with equal keys pass or fail every check alike (None: absent). The strides are in
    it: a plan bound to contiguous weights is never reused for fused halves, or the reverse."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return (t.__class__,)
    return (t.shape, t.dtype, t.device, t.is_contiguous(), t.stride(), t.__class__)


def fused_gate_up(gate, up) -> bool:
    """Whether routed gate and up weights [E, I, H] are laid out as the two halves of one
    [E, 2 I, H] tensor (each with strides (2 I H, H, 1), as gate_up[:, :I] and gate_up[:, I:]
    are, as frameworks hold them): the backward then writes their gradients into the halves of
    one new [E, 2 I, H] tensor. Strides only, no storage or offset test: under torch.compile
    the backward op's fake may see a traced view as a tensor of its own (its strides kept, its
    storage and offset not), and the fake must decide as the op does (the output is new either
    way, so look-alikes from two tensors lose nothing)."""
    if not (isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor)) or gate.dim() != 3:
        return False
    num_experts, inter, hidden = gate.shape
    return (
        num_experts > 0
        and inter > 0
        and hidden > 0
        and up.shape == gate.shape
        and gate.stride() == (2 * inter * hidden, hidden, 1)
        and up.stride() == gate.stride()
    )


class CheckedCalls:
    """Argument sets whose checks passed, by key (`tensor_key`s and plain values): a call whose
    key is here skips the checks, whose outcome its arguments' keys decide. Bounded: cleared
    when full. Each entry holds the objects whose ids its key uses, so an id stays theirs."""

    def __init__(self, size: int = 256):
        self._size = size
        self._keys: dict[tuple, tuple] = {}

    def __contains__(self, key) -> bool:
        return key is not None and key in self._keys

    def add(self, key, *pinned) -> None:
        if key is None:
            return
        if len(self._keys) >= self._size:
            self._keys.clear()
        self._keys[key] = pinned


def check_chunk_divides_routes(chunk_bytes: int, num_local_tokens: int, topk: int) -> None:
    """The original's rule: all_gather_top_experts_chunk_bytes divides one rank's int32 route
    bytes (T * k * 4). Applied at the token counts the original takes (T >= 512, a multiple of
    256); at the others (mok's any T) a chunk need not divide them."""
    route_bytes = num_local_tokens * topk * 4
    if num_local_tokens >= 512 and num_local_tokens % 256 == 0 and route_bytes % chunk_bytes:
        raise ValueError(
            f"all_gather_top_experts_chunk_bytes must divide one rank's route bytes "
            f"(num_local_tokens * topk * 4 = {route_bytes}), got {chunk_bytes}"
        )


def check_swiglu_limit(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MoKInputError(f"swiglu_limit must be a float or None, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"swiglu_limit must be a finite number > 0 or None, got {value!r}")
    return float(value)


# Value checks of CPU inputs: CUDA inputs are checked by the kernels that load them, without a
# host sync (mok/launchers/status.py).
def check_router_weight_values(router_weights: torch.Tensor) -> None:
    """Router weights must be finite and > 0 (the original silently returned 0 gradient); CPU
    tensors, naming the first bad value and its index."""
    bad = ~(torch.isfinite(router_weights) & (router_weights > 0))
    if bool(bad.any()):
        index = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"router_weights must be finite and > 0, got {float(router_weights[index])} at "
            f"index {list(index)}"
        )


def check_expert_id_values(top_experts: torch.Tensor, num_experts: int) -> None:
    """Expert ids in [0, num_experts) (CPU tensors), naming the first bad id and its index."""
    bad = (top_experts < 0) | (top_experts >= num_experts)
    if bool(bad.any()):
        index = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"top_experts must hold expert ids in [0, {num_experts}) (num_local_experts * EP "
            f"size), got {int(top_experts[index])} at index {list(index)}"
        )


# Rules of the CUDA path that the CPU path applies too (mok.ops, mok.original), so they live
# here, below both.

# The sm_90a GEMMs take two 128-column blocks of H a tile.
HIDDEN_ALIGNMENT = 256

# Macrobatch edges fall on the GEMMs' 128-row tiles (mok.config.ROUTED_ROW_ALIGNMENT).
MACROBATCH_ALIGNMENT = 128


def check_macrobatch(
    macrobatch_size: int, num_tokens: int, topk: int, op: str, minibatch_size: int | None = None
) -> bool:
    """Check `MoKConfig.macrobatch_size` for an op (on the GPU path and, mok.ops' CPU branch
    calls this too, on the CPU path alike): a positive multiple of 128 (macrobatch edges are row
    tile edges) and of `minibatch_size` when given. Returns True when ring reuse applies: a
    macrobatch below the routed rows T * k, whose routed buffers hold `macrobatch_size` rows
    and whose backward replays every macrobatch but the first (mok/launchers/macrobatch.py)."""
    if isinstance(macrobatch_size, bool) or not isinstance(macrobatch_size, int):
        raise MoKInputError(
            f"MoKConfig.macrobatch_size must be an int ({op}), got {type(macrobatch_size).__name__}"
        )
    if macrobatch_size <= 0 or macrobatch_size % MACROBATCH_ALIGNMENT:
        raise ValueError(
            f"MoKConfig.macrobatch_size must be a positive multiple of {MACROBATCH_ALIGNMENT} "
            f"routed rows ({op}: macrobatch edges fall on the GEMMs' row tiles), got "
            f"{macrobatch_size}"
        )
    if minibatch_size is not None and macrobatch_size % minibatch_size:
        raise ValueError(
            f"MoKConfig.macrobatch_size must be a multiple of minibatch_size ({minibatch_size}) "
            f"({op}), got {macrobatch_size}"
        )
    return macrobatch_size < num_tokens * topk


def context_rows(macrobatch_size: int, capacity: int, num_tokens: int, topk: int) -> int:
    """Routed rows of the forward context: the schedule capacity, or with ring reuse (a
    macrobatch below T * k, which is at most the capacity) the macrobatch's."""
    if macrobatch_size < num_tokens * topk:
        return min(macrobatch_size, capacity)
    return capacity


def forward_context_rows(macrobatch_size: int, macrobatch_replay: str, capacity: int,
                         num_tokens: int, topk: int) -> tuple[int, int]:  # fmt: skip
    """(x_routed's rows, gate/up/hidden's rows) of the forward context: `context_rows` both,
    but every row of gate, up and hidden with ring reuse and macrobatch_replay "gather"."""
    rows = context_rows(macrobatch_size, capacity, num_tokens, topk)
    return rows, capacity if macrobatch_replay == "gather" else rows
