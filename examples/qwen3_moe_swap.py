"""Swap the experts of a Hugging Face Qwen3-MoE block for `mok.nn.MoKExperts`, then train both.

    pip install transformers matplotlib
    python examples/qwen3_moe_swap.py --steps 300 --png examples/qwen3_moe_swap_loss.png

What it does:

1. Builds a small `Qwen3MoeSparseMoeBlock` (random weights, nothing downloaded) in bf16.
2. Wraps it in `MoKQwen3MoeBlock`: the HF router is kept as is (gate Linear, softmax, top-k,
   renormalisation, exactly as the HF block routes), and the experts run in `MoKExperts`, whose
   weights are copied from the HF experts. Both expert layouts of transformers are handled and
   detected at run time: a ModuleList of `Qwen3MoeMLP` (transformers 4.x) and fused 3-D
   `gate_up_proj` / `down_proj` parameters (transformers 5.x).
3. Checks the swapped forward against the HF forward on random input, both measured against an
   fp64 oracle with the same routing: mok's error must be within `mok.testing`'s bf16 bound.
4. Trains both blocks (same init, same synthetic data: regress a fixed random teacher MLP, MSE,
   AdamW) and plots the two loss curves. Then trains the mok block a second time from the same
   init and checks the two loss curves are bitwise identical.

On CPU tensors mok runs its PyTorch reference path. With `--device cuda`, mok runs its GPU kernels
(forward and backward on one Hopper GPU; the sm_90a backward needs the intermediate size to be a
multiple of 256, hence the default 256); an op whose kernel has not landed raises
`mok.functional.MoKKernelUnavailableError`, which this script lets propagate.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Sequence

import torch
from torch import nn

from mok.nn import MoKExperts
from mok.testing import within_bf16_bound

LAYOUT_MODULELIST = "modulelist"  # experts = ModuleList of Qwen3MoeMLP (gate/up/down_proj Linear)
LAYOUT_FUSED = "fused"  # experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
LAYOUT_FUSED_T = "fused_transposed"  # experts.gate_up_proj [E, H, 2I], experts.down_proj [E, I, H]


class UnknownExpertLayoutError(TypeError):
    """The HF MoE block stores its experts in a layout this example does not know."""


# ---------------------------------------------------------------------------------------------
# The HF block and its expert layout
# ---------------------------------------------------------------------------------------------


def make_qwen3_config(
    hidden_size: int = 256,
    moe_intermediate_size: int = 256,
    num_experts: int = 8,
    top_k: int = 2,
):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=hidden_size,
        moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        hidden_act="silu",
    )
    if hasattr(config, "_experts_implementation"):
        # The block is used standalone (not through from_pretrained), so pick the plain eager
        # experts loop explicitly (transformers 5.x dispatches the experts forward on this).
        config._experts_implementation = "eager"
    return config


def make_hf_block(config, *, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """A `Qwen3MoeSparseMoeBlock` in bf16 with HF's init (normal, std initializer_range)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = Qwen3MoeSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(block.named_parameters()):  # fixed order: same init every run
            param.copy_(torch.randn(param.shape, generator=gen) * config.initializer_range)
    return block.to(device=device, dtype=torch.bfloat16)


def detect_expert_layout(hf_block: nn.Module) -> str:
    """One of LAYOUT_*; raises UnknownExpertLayoutError saying what was found otherwise."""
    experts = getattr(hf_block, "experts", None)
    projs = ("gate_proj", "up_proj", "down_proj")
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        linears = [getattr(m, p, None) for m in experts for p in projs]
        if all(isinstance(lin, nn.Linear) for lin in linears):
            if any(lin.bias is not None for lin in linears):
                raise UnknownExpertLayoutError("expert Linear layers with a bias are not supported")
            return LAYOUT_MODULELIST
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor):
        if gate_up.dim() == 3 and down.dim() == 3:
            # Flags of transformers' @use_experts_implementation; mok needs the plain SwiGLU.
            needed = {
                "is_concatenated": True,
                "has_bias": False,
                "has_gate": True,
                "has_post_expert_norm": False,
            }
            for name, want in needed.items():
                got = getattr(experts, name, want)
                if got != want:
                    raise UnknownExpertLayoutError(
                        f"fused experts with {name}={got} are not supported (need {want})"
                    )
            return LAYOUT_FUSED_T if getattr(experts, "is_transposed", False) else LAYOUT_FUSED
    found = None
    if isinstance(experts, nn.Module):
        found = [(n, list(p.shape)) for n, p in experts.named_parameters()][:6]
    raise UnknownExpertLayoutError(
        f"unknown expert layout in {type(hf_block).__name__}: experts is "
        f"{type(experts).__name__} with parameters {found}; supported: a ModuleList of MLPs with "
        f"gate_proj/up_proj/down_proj Linear layers, or fused 3-D gate_up_proj [E, 2I, H] and "
        f"down_proj [E, H, I] parameters"
    )


def expert_weights(
    hf_block: nn.Module, layout: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The HF expert weights as mok wants them: gate, up [E, I, H]; down [E, H, I] ([out, in])."""
    experts = hf_block.experts
    if layout == LAYOUT_MODULELIST:
        gate = torch.stack([m.gate_proj.weight for m in experts])
        up = torch.stack([m.up_proj.weight for m in experts])
        down = torch.stack([m.down_proj.weight for m in experts])
    elif layout in (LAYOUT_FUSED, LAYOUT_FUSED_T):
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if layout == LAYOUT_FUSED_T:  # stored [in, out]
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        # HF splits the projection's output with .chunk(2, dim=-1): gate first, then up.
        gate, up = gate_up.chunk(2, dim=1)
    else:
        raise UnknownExpertLayoutError(f"unknown layout {layout!r}")
    return gate.detach().contiguous(), up.detach().contiguous(), down.detach().contiguous()


def _hidden_act(hf_block: nn.Module, layout: str) -> str | None:
    experts = hf_block.experts
    owner = experts[0] if layout == LAYOUT_MODULELIST else experts
    config = getattr(owner, "config", None)
    return getattr(config, "hidden_act", None)


# ---------------------------------------------------------------------------------------------
# The swapped block
# ---------------------------------------------------------------------------------------------


class MoKQwen3MoeBlock(nn.Module):
    """A Qwen3-MoE sparse block whose experts run in mok; routing is the HF block's own.

    Built from an HF `Qwen3MoeSparseMoeBlock` (its router and expert weights are copied; the HF
    block is left untouched). forward(hidden_states [B, S, H]) returns what the HF block returns:
    the output tensor (transformers 5.x) or (output, router_logits) (transformers 4.x).
    """

    def __init__(self, hf_block: nn.Module) -> None:
        super().__init__()
        self.layout = detect_expert_layout(hf_block)
        act = _hidden_act(hf_block, self.layout)
        if act not in (None, "silu"):
            raise ValueError(f"mok experts are SwiGLU (silu); the HF block uses {act!r}")
        self.gate = copy.deepcopy(hf_block.gate)  # the HF router, same weights
        if isinstance(self.gate, nn.Linear):
            # transformers 4.x: the block itself does softmax / top-k / renormalisation.
            self.top_k = hf_block.top_k
            self.norm_topk_prob = hf_block.norm_topk_prob
        else:
            # transformers 5.x: the router module returns (logits, top-k weights, top-k ids).
            self.top_k = self.gate.top_k
            self.norm_topk_prob = self.gate.norm_topk_prob
        gate_w, up_w, down_w = expert_weights(hf_block, self.layout)
        num_experts, inter, hidden = gate_w.shape
        self.experts = MoKExperts(
            num_experts, hidden, inter, self.top_k, device=gate_w.device, dtype=torch.bfloat16
        )
        with torch.no_grad():
            self.experts.gate_weight.copy_(gate_w)
            self.experts.up_weight.copy_(up_w)
            self.experts.down_weight.copy_(down_w)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router_logits, top-k weights, top-k ids int64), computed exactly as HF does."""
        if not isinstance(self.gate, nn.Linear):
            return self.gate(x)
        # Verbatim transformers 4.x Qwen3MoeSparseMoeBlock.forward routing.
        router_logits = self.gate(x)
        routing_weights = nn.functional.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        return router_logits, routing_weights.to(x.dtype), selected_experts

    def forward(self, hidden_states: torch.Tensor):
        batch, seq, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden).contiguous()
        router_logits, weights, ids = self.route(x)
        # mok wants fp32 router weights (> 0) and int64 ids; HF's weights (cast back to the
        # activation dtype) are kept bit for bit, and gradients flow back through .float().
        out = self.experts(x, weights.float(), ids.to(torch.int64)).reshape(batch, seq, hidden)
        return (out, router_logits) if self.layout == LAYOUT_MODULELIST else out


def block_output(result) -> torch.Tensor:
    """The hidden states from either block's return value (tensor, or (tensor, logits))."""
    return result[0] if isinstance(result, tuple) else result


# ---------------------------------------------------------------------------------------------
# Checks and training
# ---------------------------------------------------------------------------------------------


def oracle_fp64(swapped: MoKQwen3MoeBlock, hidden_states: torch.Tensor) -> torch.Tensor:
    """fp64 truth of the MoE output for the routing the (bf16) HF router picks."""
    hidden = hidden_states.shape[-1]
    x = hidden_states.reshape(-1, hidden)
    with torch.no_grad():
        _, weights, ids = swapped.route(x)
        x64 = x.double()
        gate = swapped.experts.gate_weight.double()
        up = swapped.experts.up_weight.double()
        down = swapped.experts.down_weight.double()
        out = torch.zeros_like(x64)
        for j in range(ids.shape[1]):
            g = torch.einsum("th,tih->ti", x64, gate[ids[:, j]])
            u = torch.einsum("th,tih->ti", x64, up[ids[:, j]])
            y = torch.einsum("ti,thi->th", nn.functional.silu(g) * u, down[ids[:, j]])
            out += weights[:, j : j + 1].double() * y
    return out.reshape(hidden_states.shape)


def check_forward(hf_block, swapped, *, num_tokens: int, seed: int, device) -> dict:
    """Swapped vs HF forward on random input; both against the fp64 oracle (mok.testing bound)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = swapped.experts.hidden_size
    x = torch.randn(1, num_tokens, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        hf_out = block_output(hf_block(x))
        mok_out = block_output(swapped(x))
    truth = oracle_fp64(swapped, x)
    ok, mok_err, hf_err = within_bf16_bound(mok_out, truth, hf_out)
    max_diff = (mok_out.float() - hf_out.float()).abs().max().item()
    return {"ok": ok, "mok_rel_err": mok_err, "hf_rel_err": hf_err, "max_abs_diff": max_diff}


class Teacher:
    """A fixed random SwiGLU MLP (fp32) that the MoE blocks learn to imitate.

    Narrower than one expert, so each expert can represent it and the loss can go far down.
    """

    def __init__(self, hidden: int, inter: int, *, seed: int, device) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.w1 = (torch.randn(inter, hidden, generator=gen) / hidden**0.5).to(device)
        self.w3 = (torch.randn(inter, hidden, generator=gen) / hidden**0.5).to(device)
        self.w2 = (torch.randn(hidden, inter, generator=gen) / inter**0.5).to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return (nn.functional.silu(x @ self.w1.T) * (x @ self.w3.T)) @ self.w2.T


def train(
    block: nn.Module,
    teacher: Teacher,
    *,
    steps: int,
    batch: int,
    seq: int,
    lr: float,
    data_seed: int,
    device,
) -> list[float]:
    """AdamW on MSE(block(x), teacher(x)); a fresh batch per step from a seeded generator."""
    opt = torch.optim.AdamW(block.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(data_seed)
    hidden = teacher.w1.shape[1]
    losses = []
    for _ in range(steps):
        x = torch.randn(batch, seq, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
        target = teacher(x)
        loss = nn.functional.mse_loss(block_output(block(x)).float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def plot(hf_losses: Sequence[float], mok_losses: Sequence[float], png: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(hf_losses, label="HF Qwen3MoeSparseMoeBlock", linewidth=2.0)
    ax.plot(mok_losses, label="same block, experts by mok.nn.MoKExperts", linewidth=1.2, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--png", default=None, help="write the loss curves here (needs matplotlib)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--teacher-width", type=int, default=32, help="teacher MLP's hidden width")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the example; returns the losses and the check results (see the module docstring)."""
    args = parse_args(argv)
    import transformers

    device = torch.device(args.device)
    t0 = time.perf_counter()
    config = make_qwen3_config(args.hidden, args.moe_intermediate, args.experts, args.top_k)
    hf_block = make_hf_block(config, seed=args.seed, device=device)
    swapped = MoKQwen3MoeBlock(hf_block)
    print(
        f"transformers {transformers.__version__}: expert layout {swapped.layout!r}; "
        f"H={args.hidden} I={args.moe_intermediate} E={args.experts} k={args.top_k} bf16, "
        f"device {device}"
    )

    fwd = check_forward(hf_block, swapped, num_tokens=args.batch * args.seq, seed=args.seed + 1,
                        device=device)  # fmt: skip
    print(
        f"forward check: mok vs fp64 rel err {fwd['mok_rel_err']:.2e}, HF bf16 vs fp64 "
        f"{fwd['hf_rel_err']:.2e}, max |mok - HF| {fwd['max_abs_diff']:.2e} -> "
        f"{'PASS' if fwd['ok'] else 'FAIL'}"
    )
    if not fwd["ok"]:
        raise AssertionError(f"swapped forward is not within the bf16 bound of HF's: {fwd}")

    teacher = Teacher(args.hidden, args.teacher_width, seed=args.seed + 2, device=device)
    kw = dict(steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr,
              data_seed=args.seed + 3, device=device)  # fmt: skip

    def fresh_mok_block() -> MoKQwen3MoeBlock:
        # Same seed, same init as hf_block had before its training.
        return MoKQwen3MoeBlock(make_hf_block(config, seed=args.seed, device=device))

    timings = {}
    t = time.perf_counter()
    hf_losses = train(hf_block, teacher, **kw)
    timings["hf"] = time.perf_counter() - t
    t = time.perf_counter()
    mok_losses = train(fresh_mok_block(), teacher, **kw)
    timings["mok"] = time.perf_counter() - t
    mok_losses_again = train(fresh_mok_block(), teacher, **kw)
    deterministic = mok_losses == mok_losses_again

    last = max(1, min(20, args.steps // 10))
    print(f"loss HF / mok: initial {hf_losses[0]:.6f} / {mok_losses[0]:.6f}; final (step "
          f"{args.steps}) {hf_losses[-1]:.6f} / {mok_losses[-1]:.6f}; mean of the last {last} "
          f"steps {_mean(hf_losses[-last:]):.6f} / {_mean(mok_losses[-last:]):.6f}")  # fmt: skip
    print(f"mok run 1 vs run 2, {args.steps} losses compared with ==: "
          f"bitwise identical: {deterministic}")  # fmt: skip
    if args.png:
        plot(hf_losses, mok_losses, args.png,
             f"Qwen3-MoE block (transformers {transformers.__version__}, E={args.experts}, "
             f"k={args.top_k}, bf16, {args.device}): HF vs mok experts")  # fmt: skip
        print(f"wrote {args.png}")
    total = time.perf_counter() - t0
    print(
        f"time: HF train {timings['hf']:.1f}s, mok train {timings['mok']:.1f}s, total {total:.1f}s"
    )
    return {
        "transformers_version": transformers.__version__,
        "layout": swapped.layout,
        "forward_check": fwd,
        "hf_losses": hf_losses,
        "mok_losses": mok_losses,
        "mok_losses_again": mok_losses_again,
        "deterministic": deterministic,
    }


if __name__ == "__main__":
    main()
