"""The recomputed forward context's gather (mok/dsl_kernels/kernels/gather_rows.py): out[r] =
src[peer_token_idx[r] // k] for routed rows r < schedule.num_tokens, zeros for padding.
"""

from __future__ import annotations

import torch

from ..validation import tensor_key
from .checks import check_host
from .epilogues import HIDDEN_ALIGNMENT
from .plans import current_stream, plan

MAX_GRID_Y = 65535


def gather_rows(
    src: torch.Tensor,
    peer_rank: torch.Tensor,
    peer_token_idx: torch.Tensor,
    num_tokens: torch.Tensor,
    topk: int,
    *,
    out: torch.Tensor | None = None,
    peers: tuple | None = None,
) -> torch.Tensor:
    """Routed rows bf16 [C, H] of `src` bf16 [T, H] (C = peer_rank's length), into `out` when
    given (its rows at or past num_tokens are left as they are). `peers` = (ep_rank, the EP group's
    peer table, launchers.peer_table): rows of other ranks' tokens are pulled from their x buffers."""
    num_src, hidden = src.shape if src.dim() == 2 else (-1, -1)
    capacity = peer_rank.shape[0] if peer_rank.dim() == 1 else -1
    if hidden % HIDDEN_ALIGNMENT:
        raise ValueError(f"hidden size must be a multiple of {HIDDEN_ALIGNMENT}, got {hidden}")
    check_host("src", src, torch.bfloat16, (num_src, hidden))
    check_host("peer_rank", peer_rank, torch.int32, (capacity,))
    check_host("peer_token_idx", peer_token_idx, torch.int32, (capacity,))
    check_host("num_tokens", num_tokens, torch.int32, (1,))
    if out is None:
        out = torch.empty(capacity, hidden, dtype=src.dtype, device=src.device)
    check_host("out", out, torch.bfloat16, (capacity, hidden))
    if capacity == 0 or num_src == 0:
        return out.zero_()
    key = (
        "gather_rows",
        tensor_key(src),
        tensor_key(peer_rank),
        tensor_key(out),
        topk,
        None if peers is None else (peers[0], peers[1].data_ptr()),
        current_stream(src.get_device()),
    )
    launch = plan(key, lambda: _GatherPlan(src, capacity, topk, peers))
    launch(out, src, peer_rank, peer_token_idx, num_tokens)
    return out


class _GatherPlan:
    """`gather_rows` for one (shapes, topk, peers): bound on its first call (the caller has
    checked the tensors); a call writes the five addresses and launches."""

    def __init__(self, src, capacity: int, topk: int, peers):
        from mok.runtime import get_kernel  # noqa: PLC0415

        num_src, hidden = src.shape
        kernel = get_kernel("gather_rows", device=src.device)
        config = kernel.variant.config
        threads, rows_per_cta = int(config["threads"]), int(config["rows_per_cta"])
        grid_y = min(-(-capacity // rows_per_cta), MAX_GRID_Y)
        self.device_index = src.get_device()
        self.bound = kernel.bind(
            (-(-hidden // (8 * threads)), grid_y, 1),
            {
                "out_ptr": None,
                "src_ptr": None,
                "peer_table_ptr": None if peers is None else peers[1],
                "peer_rank_ptr": None,
                "peer_token_idx_ptr": None,
                "num_tokens_ptr": None,
                "num_rows": capacity,
                "num_src_rows": num_src,
                "hidden_size": hidden,
                "topk": topk,
                "ep_rank": 0 if peers is None else peers[0],
            },
            dynamic=("out_ptr", "src_ptr", "peer_rank_ptr", "peer_token_idx_ptr", "num_tokens_ptr"),
        )

    def __call__(self, out, src, peer_rank, peer_token_idx, num_tokens) -> None:
        self.bound.launch(
            out.data_ptr(),
            src.data_ptr(),
            peer_rank.data_ptr(),
            peer_token_idx.data_ptr(),
            num_tokens.data_ptr(),
            stream=current_stream(self.device_index),
        )
