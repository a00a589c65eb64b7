"""Train a small TorchTitan Qwen3-MoE model with its routed experts in mok, against TorchTitan's
own experts path.

    pip install torchtitan==0.3.0 triton matplotlib
    python examples/train_torchtitan.py --device cuda --steps 200

The model is built from TorchTitan's own Qwen3 config builders (random init, nothing
downloaded). mok comes in through TorchTitan's override mechanism, the same entry a training
job passes as ``--override.imports mok.integrations.torchtitan.mok_routed_experts``. With
TorchTitan 0.2 (which imports with torch 2.11) the model is built from its `Qwen3ModelArgs` and
mok comes in through its model converter, the one a job selects with ``--experimental.custom_import
mok.integrations.torchtitan_converter --model.converters mok``; 0.2's router runs on CUDA only
(`torch.histc` of int64 ids). Both models
start from the same weights (bf16) and see the same random token batches (a fixed random
Markov chain, `_training.markov_batches`). The mok model trains twice; its two runs must be
bitwise identical. Attention is SDPA (causal) in both, since FlexAttention has no backward on
CPU. Outputs go to --out (default runs/torchtitan/, untracked): the loss curves' PNG and the
losses as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _training  # noqa: E402

OVERRIDE = "mok.integrations.torchtitan.mok_routed_experts"


def model_config(args):
    """A TorchTitan Qwen3-MoE config (TorchTitan's builders), SDPA attention."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear  # noqa: PLC0415
    from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: PLC0415
    from torchtitan.models.qwen3 import (  # noqa: PLC0415
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    head_dim = 64
    cfg = Qwen3Model.Config(
        vocab_size=args.vocab, dim=args.hidden, norm=_qwen3_norm(args.hidden),
        tok_embeddings=Embedding.Config(num_embeddings=args.vocab, embedding_dim=args.hidden,
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=args.hidden, out_features=args.vocab,
                              param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            n_layers=args.layers, dim=args.hidden, n_heads=args.hidden // head_dim,
            n_kv_heads=max(1, args.hidden // head_dim // 2), head_dim=head_dim,
            moe_hidden_dim=args.intermediate, num_experts=args.experts, top_k=args.topk,
            attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=args.seq, theta=1e6),
        ),
    )  # fmt: skip
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def build(cfg, device, seed: int):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device=device)
    model.init_states(buffer_device=device)
    return model.to(torch.bfloat16)


def with_mok(cfg):
    """`cfg` with every MoE layer's routed experts overridden by mok (TorchTitan's mechanism)."""
    from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: PLC0415

    lines = apply_overrides(OverrideConfig(imports=[OVERRIDE]), cfg)
    if not lines:
        raise RuntimeError(f"{OVERRIDE} overrode nothing in this config")
    return cfg


def loss_of(model, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1], device=tokens.device).expand_as(inputs)
    logits = model(inputs, positions, None)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def is_torchtitan_02() -> bool:
    """TorchTitan 0.2 (model converters, `Qwen3ModelArgs`) rather than 0.3 (overrides)."""
    try:
        import torchtitan.config.override  # noqa: F401, PLC0415
    except ImportError:
        return True
    return False


def build_02(args, device, seed: int, mok: bool):
    """TorchTitan 0.2's Qwen3-MoE model (its `Qwen3ModelArgs`, the MoE settings of its Qwen3
    configs), bf16; `mok`: its MoE layers converted by mok's model converter."""
    from torchtitan.models.moe import MoEArgs  # noqa: PLC0415
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs  # noqa: PLC0415

    head_dim = 64
    moe = MoEArgs(num_experts=args.experts, top_k=args.topk, score_func="softmax",
                  route_norm=True, score_before_experts=False, load_balance_coeff=None,
                  num_shared_experts=0,
                  use_grouped_mm=device.type == "cuda")  # fmt: skip
    model_args = Qwen3ModelArgs(
        dim=args.hidden, n_layers=args.layers, n_heads=args.hidden // head_dim,
        n_kv_heads=max(1, args.hidden // head_dim // 2), head_dim=head_dim,
        vocab_size=args.vocab, max_seq_len=args.seq, hidden_dim=4 * args.hidden,
        moe_enabled=True, moe_inter_dim=args.intermediate, moe_args=moe,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Qwen3Model(model_args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model = model.to(torch.bfloat16)
    if mok:
        from mok.integrations.torchtitan_converter import MoKConverter  # noqa: PLC0415

        MoKConverter().convert(model)
    return model


def loss_of_02(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                             tokens[:, 1:].flatten())  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _training.add_model_args(p)
    p.add_argument("--out", default="runs/torchtitan", help="folder for the PNG and JSON")
    p.add_argument("--no-png", action="store_true", help="skip the plot (no matplotlib)")
    args = p.parse_args(argv)
    import torchtitan  # noqa: PLC0415

    device = torch.device(args.device)
    batches = _training.markov_batches(args.vocab, args.batch, args.seq, args.steps)
    print(f"torchtitan {getattr(torchtitan, '__version__', '?')}, torch {torch.__version__}, "
          f"device {device}; Qwen3-MoE {args.layers} layers, D={args.hidden} F={args.intermediate} "
          f"E={args.experts} k={args.topk}, {args.batch}x{args.seq} tokens a step, bf16")  # fmt: skip
    titan_02 = is_torchtitan_02()
    loss = loss_of_02 if titan_02 else loss_of

    def make(mok: bool):
        if titan_02:
            return build_02(args, device, seed=0, mok=mok)
        return build(with_mok(model_config(args)) if mok else model_config(args), device, seed=0)

    framework_model = make(mok=False)
    init = {k: v.clone() for k, v in framework_model.state_dict().items()}
    framework = _training.train(framework_model, batches, loss, args.lr, device)
    del framework_model
    runs = []
    for _ in range(2):
        model = make(mok=True)
        model.load_state_dict(init)
        routed = [type(layer.moe if titan_02 else layer.moe.routed_experts).__name__
                  for layer in model.layers.values()]  # fmt: skip
        runs.append(_training.train(model, batches, loss, args.lr, device))
        del model
    print(f"{'MoE layers' if titan_02 else 'routed experts per layer'}: {routed}")
    ok = _training.report("torchtitan", framework, runs[0], runs[1], "TorchTitan")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "losses.json"), "w") as f:
        json.dump(
            {
                "torchtitan": framework.losses,
                "mok": runs[0].losses,
                "step_ms": {"torchtitan": framework.step_ms, "mok": runs[0].step_ms},
            },
            f,
        )
    if not args.no_png:
        png = os.path.join(args.out, "loss.png")
        _training.plot(
            png,
            f"TorchTitan Qwen3-MoE ({device.type}): TorchTitan vs mok experts",
            {"TorchTitan experts": framework.losses, "mok": runs[0].losses},
        )
        print(f"wrote {png}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
