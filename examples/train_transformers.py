"""Train a small Hugging Face transformers Qwen3-MoE model with its routed experts in mok,
against transformers' own experts path.

    pip install transformers matplotlib
    python examples/train_transformers.py --device cuda --steps 200

The model is built from transformers' own `Qwen3MoeConfig` (random init, nothing downloaded).
mok comes in through transformers' experts interface, in one line:

    import mok.integrations.transformers  # registers "mok"
    model = AutoModelForCausalLM.from_config(config, experts_implementation="mok")

Both models start from the same weights (bf16) and see the same random token batches (a fixed
random Markov chain, `_training.markov_batches`); the baseline is transformers' default experts
implementation (`--baseline`). The mok model trains twice; its two runs must be bitwise
identical. Outputs go to --out (default runs/transformers/, untracked): the loss curves' PNG and
the losses as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _training  # noqa: E402


def model_config(args, experts_implementation: str | None):
    from transformers import Qwen3MoeConfig  # noqa: PLC0415

    head_dim = 64
    return Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // head_dim,
        num_key_value_heads=max(1, args.hidden // head_dim // 2), head_dim=head_dim,
        num_experts=args.experts, num_experts_per_tok=args.topk, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=args.seq,
        router_aux_loss_coef=0.0, experts_implementation=experts_implementation,
    )  # fmt: skip


def build(args, experts_implementation: str | None, device, seed: int):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    config = model_config(args, experts_implementation)
    model = AutoModelForCausalLM.from_config(
        config, experts_implementation=experts_implementation, dtype=torch.bfloat16
    )
    return model.to(device)


def loss_of_shifted(model, tokens):
    """transformers shifts labels itself: feed the same tokens as inputs and labels."""
    return model(input_ids=tokens, labels=tokens).loss


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _training.add_model_args(p)
    p.add_argument("--baseline", default=None,
                   help="transformers' experts implementation to compare with (default: its "
                        "default, grouped_mm where it runs)")  # fmt: skip
    p.add_argument("--out", default="runs/transformers", help="folder for the PNG and JSON")
    p.add_argument("--no-png", action="store_true", help="skip the plot (no matplotlib)")
    args = p.parse_args(argv)
    import transformers  # noqa: PLC0415

    import mok.integrations.transformers  # noqa: F401, PLC0415  (registers "mok")

    device = torch.device(args.device)
    batches = _training.markov_batches(args.vocab, args.batch, args.seq - 1, args.steps)
    framework_model = build(args, args.baseline, device, seed=0)
    baseline = framework_model.config._experts_implementation
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {device}; "
          f"Qwen3-MoE {args.layers} layers, H={args.hidden} I={args.intermediate} "
          f"E={args.experts} k={args.topk}, {args.batch}x{args.seq} tokens a step, bf16; "
          f"baseline experts_implementation={baseline!r}")  # fmt: skip
    init = {k: v.clone() for k, v in framework_model.state_dict().items()}
    framework = _training.train(framework_model, batches, loss_of_shifted, args.lr, device)
    del framework_model
    runs = []
    for _ in range(2):
        model = build(args, "mok", device, seed=0)
        model.load_state_dict(init)
        runs.append(_training.train(model, batches, loss_of_shifted, args.lr, device))
        used = model.config._experts_implementation
        del model
    print(f"mok model's experts_implementation: {used!r}")
    ok = _training.report("transformers", framework, runs[0], runs[1], baseline)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "losses.json"), "w") as f:
        json.dump(
            {
                baseline: framework.losses,
                "mok": runs[0].losses,
                "step_ms": {baseline: framework.step_ms, "mok": runs[0].step_ms},
            },
            f,
        )
    if not args.no_png:
        png = os.path.join(args.out, "loss.png")
        _training.plot(
            png,
            f"transformers Qwen3-MoE ({device.type}): {baseline} vs mok experts",
            {f"transformers {baseline}": framework.losses, "mok": runs[0].losses},
        )
        print(f"wrote {png}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
