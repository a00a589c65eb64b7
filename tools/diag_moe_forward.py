"""A/B of the forward megakernel's synchronisation costs (measurement only).

Build here (no GPU): `python tools/diag_moe_forward.py build` compiles the megakernel with each
measurement switch off (dsl_kernels/sm90/moe_forward.py) into tools/experiments/. Then on the
GPU: `python tools/diag_moe_forward.py time` times each build's routed forward (and the
separate-kernel path) at the benchmark shapes. Switched-off builds break the contract (races,
or no dispatch): their outputs are not checked, only their time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).parent / "experiments"
SWITCHES = {
    "moe_forward": {},
    "moe_forward_no_reader_fence": {"reader_fence": False},
    "moe_forward_no_writer_fence": {"writer_fence": False},
    "moe_forward_no_fences": {"reader_fence": False, "writer_fence": False},
    "moe_forward_no_copy": {"copy_rows": False},
}
SHAPES = {  # H, I, E, k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 32, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}


def build() -> None:
    from mok.dsl_kernels import build as b
    from mok.dsl_kernels.registry import Variant
    from mok.dsl_kernels.sm90.moe_forward import Sm90MoeForward

    version = b.dsl_version()
    manifest = {"format": b.MANIFEST_FORMAT, "dsl_version": version,
                "source_hash": b.source_hash(version), "variants": []}  # fmt: skip
    OUT.mkdir(exist_ok=True)
    for name, switches in SWITCHES.items():
        variant = Variant(name, Sm90MoeForward, {"stages": 4, **switches},
                          launch_grid="(sm_count, 1, 1)", archs=("sm_90a",))  # fmt: skip
        entry, cubin, _ = b.compile_variant(variant, "sm_90a")
        (OUT / entry["cubin"]).write_bytes(cubin)
        manifest["variants"].append(entry)
        print("built", name)
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def time_shape(shape: str, dims: tuple[int, int, int, int]) -> None:
    import torch

    from mok import functional as F
    from mok.launchers import moe_forward, set_forward_path
    from mok.testing import make_inputs

    fwd = sys.modules["mok.launchers.forward"]
    h, i, e, k = dims
    t = 16384
    inp = make_inputs(t, h, i, e, k, seed=0, device="cuda")
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=torch.device("cuda"), num_local_tokens=t,
                         hidden_size=h, topk=k, num_local_experts=e)  # fmt: skip
    sched = F.build_schedule(ws, config, inp["top_experts"], num_local_experts=e)
    weights = (inp["routed_gate"], inp["routed_up"], inp["routed_down"])

    def run(name):
        if name == "kernels":
            set_forward_path("kernels")
            fwd._routed(ws, sched, inp["x"], *weights, None)
            set_forward_path("megakernel")
        else:
            moe_forward.routed_forward(inp["x"], sched, k, *weights, kernel_name=name,
                                       manifest=OUT / "manifest.json")  # fmt: skip

    for name in ("kernels", *SWITCHES):
        for _ in range(3):
            run(name)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            run(name)
        end.record()
        torch.cuda.synchronize()
        print(f"{shape:16s} {name:30s} {start.elapsed_time(end) / 10:8.3f} ms", flush=True)


def time_all() -> None:
    import torch

    from mok import functional as F
    from mok.launchers import expert_gemm

    for shape, dims in SHAPES.items():
        time_shape(shape, dims)
        expert_gemm.clear_descriptor_cache()
        F.clear_workspace_cache()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    build() if sys.argv[1:] == ["build"] else time_all()
