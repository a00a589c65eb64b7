"""NCCL ``all_to_all_single`` dispatch and combine, the EP > 1 data movement of the baseline."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAllRows(torch.autograd.Function):
    """Rows [N, H] split by destination rank; backward is the same exchange with splits swapped."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        out = rows.new_empty((sum(output_splits), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), grad.shape[1]))
        dist.all_to_all_single(
            back, grad.contiguous(), input_splits, output_splits, group=ctx.group
        )
        return back, None, None, None


def all_to_all_rows(rows, output_splits: list[int], input_splits: list[int], group):
    """Differentiable ``all_to_all_single`` of token rows (splits are host ints, as NCCL needs)."""
    return _AllToAllRows.apply(rows, output_splits, input_splits, group)


def exchange_counts(
    tokens_per_expert: torch.Tensor, group
) -> tuple[torch.Tensor, list[int], list[int]]:
    """Tell every rank how many rows it gets from each source rank for each of its experts.

    ``tokens_per_expert`` [E_global] counts this rank's slots per global expert. Returns
    received counts [world, E_local] (source rank major) and the send / receive splits per rank.
    The ``.tolist()`` is the host sync torchtitan's EP also pays: NCCL splits are host ints.
    """
    world = dist.get_world_size(group)
    received = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(received, tokens_per_expert, group=group)
    received = received.view(world, -1)
    send_splits = tokens_per_expert.view(world, -1).sum(dim=1).tolist()
    recv_splits = received.sum(dim=1).tolist()
    return received, send_splits, recv_splits
