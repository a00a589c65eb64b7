"""Forward epilogue of the MoE layer: the fixed-order weighted top-k sum of expert outputs."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from .args import global_pointer
from .ptx import add_rn, mul_rn

VECTOR = 8  # bf16 per 16-byte load
HIDDEN_ALIGN = 64  # documented alignment of hidden_size


@dataclass(frozen=True)
class MoeCombineForward:
    """out[t, :] = bf16(shared[t, :] + sum_{j=0..k-1} weight[t, j] * slots[t*k + j, :]).

    Kernel parameters (in this order): `out_ptr` (bf16 [num_tokens, hidden_size]),
    `shared_ptr` (bf16 [num_tokens, hidden_size], may be null when has_shared == 0),
    `weight_ptr` (fp32 [num_tokens, topk]), `slots_ptr` (bf16 [num_tokens * topk, hidden_size]),
    `num_tokens`, `hidden_size`, `topk`, `has_shared` (int32; 0 = no shared expert).

    Exact arithmetic (a PyTorch reference reproduces it bit for bit), per element, in fp32:
        acc = float(shared[t, h]) if has_shared else +0.0
        for j in 0..topk-1:  acc = acc + (weight[t, j] * float(slots[t*k + j, h]))
        out[t, h] = bf16(acc)   (round to nearest even)
    Each product and each sum is rounded separately (mul.rn.f32 then add.rn.f32, never an fma),
    i.e. torch: `acc = acc + w[:, j, None] * slots[:, j, :].float()` in fp32, then `.bfloat16()`.

    Constraints (the caller checks them; the kernel does not):
    - hidden_size % 64 == 0, hidden_size > 0; topk >= 1; num_tokens >= 0 (0: launch nothing).
    - out, shared and slots 16-byte aligned and contiguous; weight 4-byte aligned.
    - num_tokens <= 65535 (grid.y limit). Offsets are 64-bit: no limit on the tensor sizes.
    - launch: grid (ceil(hidden_size / (8 * threads)), num_tokens, 1), block (threads, 1, 1),
      no dynamic smem, cluster (1, 1, 1).

    Work split: thread = 8 consecutive columns of one token (16-byte loads and stores).
    """

    threads: int = 128

    def validate(self) -> None:
        if self.threads not in (64, 128, 256, 512):
            raise ValueError(f"threads must be one of 64, 128, 256, 512, got {self.threads}")

    def compile_arguments(self) -> tuple:
        """Placeholders for `__call__`, in order (see common/args.py)."""
        return (
            global_pointer(BFloat16, 16),
            global_pointer(BFloat16, 16),
            global_pointer(Float32, 4),
            global_pointer(BFloat16, 16),
            Int32(0),
            Int32(0),
            Int32(0),
            Int32(0),
        )

    @cute.jit
    def __call__(
        self,
        out_ptr: cute.Pointer,
        shared_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        slots_ptr: cute.Pointer,
        num_tokens: Int32,
        hidden_size: Int32,
        topk: Int32,
        has_shared: Int32,
    ):
        columns_per_cta = VECTOR * self.threads
        self.kernel(
            out_ptr, shared_ptr, weight_ptr, slots_ptr, num_tokens, hidden_size, topk, has_shared
        ).launch(
            grid=[(hidden_size + columns_per_cta - 1) // columns_per_cta, num_tokens, 1],
            block=[self.threads, 1, 1],
        )

    @cute.kernel
    def kernel(
        self,
        out_ptr: cute.Pointer,
        shared_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        slots_ptr: cute.Pointer,
        num_tokens: Int32,
        hidden_size: Int32,
        topk: Int32,
        has_shared: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, token, _ = cute.arch.block_idx()
        # The documented alignment lets CuTe prove every 8-element chunk is 16-byte aligned;
        # 64-bit row strides keep row * hidden_size from overflowing int32.
        hidden_size = cute.assume(hidden_size, divby=HIDDEN_ALIGN)
        row_stride = cute.assume(Int64(hidden_size), divby=HIDDEN_ALIGN)
        chunks = hidden_size // VECTOR

        # ---- views: [rows, hidden] -> (8, hidden/8, rows) chunks ----
        def chunked(ptr, num_rows):
            return cute.make_tensor(
                ptr,
                cute.make_layout((VECTOR, chunks, num_rows), stride=(1, VECTOR, row_stride)),
            )

        mOut = chunked(out_ptr, num_tokens)
        mShared = chunked(shared_ptr, num_tokens)
        mSlots = chunked(slots_ptr, num_tokens * topk)
        mWeight = cute.make_tensor(weight_ptr, cute.make_layout(num_tokens * topk))

        chunk = bidx * self.threads + tidx
        if chunk < chunks:
            # ---- acc = shared (or +0.0) ----
            acc = cute.make_rmem_tensor((VECTOR,), Float32)
            acc.fill(0.0)
            if has_shared != 0:
                acc.store(mShared[None, chunk, token].load().to(Float32))

            # ---- acc = acc + w_j * slot_j, j = 0..topk-1 in order ----
            for j in cutlass.range(topk, unroll=2):
                row = token * topk + j
                weight = mWeight[row]
                slot = cute.make_rmem_tensor((VECTOR,), Float32)
                slot.store(mSlots[None, chunk, row].load().to(Float32))
                for i in cutlass.range_constexpr(VECTOR):
                    acc[i] = add_rn(acc[i], mul_rn(weight, slot[i]))

            # ---- out = bf16(acc), round to nearest even ----
            mOut[None, chunk, token].store(acc.load().to(BFloat16))
