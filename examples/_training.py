"""What the framework examples share: synthetic token data, the training loop, timing, the plot.

The data are random tokens with structure a model can learn: each sequence walks a fixed random
Markov chain over the vocabulary (every token has 4 likely successors), so the loss falls from
log(vocab) towards the chain's entropy. Everything is seeded: two runs see the same batches.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def add_model_args(parser) -> None:
    """The flags both examples take: device, steps, model sizes, batch and learning rate."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)


def markov_batches(vocab_size: int, batch: int, seq_len: int, steps: int, seed: int = 0):
    """`steps` int64 [batch, seq_len + 1] batches of a fixed random Markov chain (CPU)."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=gen)
    batches = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, vocab_size, (batch,), generator=gen)
        for i in range(seq_len):
            pick = torch.randint(0, 4, (batch,), generator=gen)
            tokens[:, i + 1] = successors[tokens[:, i], pick]
        batches.append(tokens)
    return batches


def chain_entropy() -> float:
    """The loss a perfect model of `markov_batches` reaches: log 4 per predicted token."""
    return math.log(4)


@dataclass
class Run:
    losses: list[float]
    step_ms: float  # median over the steps after the first 3
    state: dict[str, torch.Tensor]  # the trained parameters


def train(
    model: torch.nn.Module,
    batches: Sequence[torch.Tensor],
    loss_of: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    lr: float,
    device: torch.device,
) -> Run:
    """AdamW over `batches`; the loss after each step and the median step time."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, times = [], []
    for tokens in batches:
        tokens = tokens.to(device)
        _sync(device)
        start = time.perf_counter()
        loss = loss_of(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    step_ms = 1e3 * statistics.median(times[3:] if len(times) > 3 else times)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Run(losses, step_ms, state)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def same_bits(a: Run, b: Run) -> bool:
    """Whether two runs' losses and trained parameters are bitwise identical."""
    if a.losses != b.losses or a.state.keys() != b.state.keys():
        return False
    return all(torch.equal(a.state[k], b.state[k]) for k in a.state)


def report(name: str, framework: Run, mok: Run, mok_again: Run, baseline: str) -> bool:
    """Print the comparison; True when the mok runs are bitwise identical and the two curves
    agree within bf16 noise (the mean of the last 10 losses within 5% of each other)."""
    tail = min(10, len(mok.losses))
    mean_fw = statistics.fmean(framework.losses[-tail:])
    mean_mok = statistics.fmean(mok.losses[-tail:])
    close = abs(mean_fw - mean_mok) <= 0.05 * max(mean_fw, mean_mok)
    bitwise = same_bits(mok, mok_again)
    print(f"{name}: loss {baseline} / mok: first {framework.losses[0]:.4f} / "
          f"{mok.losses[0]:.4f}; mean of the last {tail} {mean_fw:.4f} / {mean_mok:.4f} "
          f"(floor {chain_entropy():.4f}) -> {'within 5%' if close else 'APART'}")  # fmt: skip
    print(f"{name}: mok run 1 vs run 2 ({len(mok.losses)} losses and every parameter, "
          f"torch.equal): {'bitwise identical' if bitwise else 'DIFFERENT'}")  # fmt: skip
    print(f"{name}: step time (median) {baseline} {framework.step_ms:.2f} ms, mok "
          f"{mok.step_ms:.2f} ms")  # fmt: skip
    return close and bitwise


def plot(path: str, title: str, curves: dict[str, Sequence[float]]) -> None:
    """The loss curves as a PNG at `path` (needs matplotlib)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1.2)
    ax.axhline(chain_entropy(), color="grey", linestyle=":", label="data entropy (log 4)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
