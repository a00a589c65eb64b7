"""Row padding of the shared expert's one-expert GEMMs."""

from __future__ import annotations

import torch


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t [n, ...] with zero rows appended up to `rows` (t itself when n == rows)."""
    return t if t.shape[0] == rows else torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0]))
