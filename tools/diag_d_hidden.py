"""Run the d_hidden_swiglu GEMM at the Qwen3-30B-A3B shape (for ncu: the 2nd launch is warm).

ncu --kernel-name regex:d_hidden --launch-skip 1 --launch-count 1 --set full \
    python -m tools.diag_d_hidden
"""

import torch

from mok.launchers import expert_gemm_bwd

E, H, INTER, ROWS = 128, 2048, 768, 16384 * 8
gen = torch.Generator(device="cuda").manual_seed(0)


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)


dy, gate, up = randn(ROWS, H), randn(ROWS, INTER), randn(ROWS, INTER)
down_w = randn(E, H, INTER, scale=0.02)
tpe = torch.full((E,), ROWS // E, dtype=torch.int32, device="cuda")
for _ in range(3):
    expert_gemm_bwd.d_hidden_swiglu(dy, down_w, gate, up, tpe)
torch.cuda.synchronize()
