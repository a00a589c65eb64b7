"""Row moves of the layer ops done with torch ops: gather by slot, scatter to slots, padding."""

from __future__ import annotations

import torch


def gather_routed_rows(x: torch.Tensor, peer_rank, peer_token_idx, topk: int) -> torch.Tensor:
    """Dispatch for a group of one: x_routed[i] = x[peer_token_idx[i] // k], 0 for padding (gathered
    from one appended zero row: cheaper than zeroing C >= T * k rows afterwards)."""
    num_tokens = x.shape[0]
    x_ext = torch.cat([x, x.new_zeros(1, x.shape[1])])
    rows = torch.where(peer_rank >= 0, peer_token_idx.long() // topk, num_tokens)
    return x_ext.index_select(0, rows)


def scatter_to_slots(y: torch.Tensor, peer_rank, peer_token_idx, num_slots: int) -> torch.Tensor:
    """Combine for a group of one: slots[peer_token_idx[i]] = y[i] for every real row i (each slot
    once: deterministic); padding rows (peer_rank -1) go to one extra row, dropped."""
    keys = torch.where(peer_rank >= 0, peer_token_idx, num_slots).long()
    out = y.new_empty(num_slots + 1, *y.shape[1:])
    return out.index_copy_(0, keys, y)[:num_slots]


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t [n, ...] with zero rows appended up to `rows` (t itself when n == rows)."""
    return t if t.shape[0] == rows else torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0]))
