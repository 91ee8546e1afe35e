"""Fp8Linear: y = x @ W.T (+ b) with W stored in FP8 E4M3, the activations quantized per token each step
(decode-sized steps excepted: below).

W8A8 as vLLM and TensorRT-LLM serve FP8 checkpoints on Hopper: the weight [N, K] is FP8 with a scale per
output row (a per-tensor scale of a checkpoint is expanded to every row, which also lets the loader
fuse q/k/v and gate/up parts with different scales into one weight), or with one scale per 128x128
block (DeepSeek / Qwen3 FP8 checkpoints). Each forward quantizes x per token (fp8_quant.py) and runs one
FP8 GEMM that applies both scales to the fp32 accumulator:

  per-row scales   torch._scaled_mm(xq [T, K], W.t() [K, N], scale_a [T, 1], scale_b [1, N], out bf16)
                   (W.t() of the row-major [N, K] weight is the column-major operand _scaled_mm wants;
                   its rowwise-scaled kernels need K and N multiples of 16, any T, bf16 output)
  decode steps     (<= WEIGHT_ONLY_MAX_ROWS rows, per-row scales) fp8_gemm.weight_only_mm: x is not quantized,
                   W is widened to x's 16 bits in registers (a GEMM of so few rows is bound by reading W,
                   and quantizing x first would cost a pass over it); on every device, so the CPU computes
                   what the GPU does
  block scales     fp8_gemm.py's Triton kernel (x per token and 128 columns, W per 128x128 block)

Everything is static-shaped and host-sync free, so the layers sit inside the captured graphs. On the CPU
(no FP8 GEMM is assumed there) the same operands are dequantized to fp32 and multiplied: the CPU tests
check the numerics a GPU computes, up to fp32 summation order.

Tensor parallel: a column-parallel Fp8Linear holds its rows of W and of the row scales (a shard of
whole rows, like the bf16 layer); a row-parallel one holds its K columns and all N row scales, and
all-reduces its partial outputs before the bias, as RowParallelLinear does (model/parallel.py).
"""

from __future__ import annotations

import torch
from torch import nn

from graphcache.model import fp8_gemm
from graphcache.model.fp8_gemm import block_scaled_mm, emulated_mm, weight_only_mm, weight_only_silu_mul
from graphcache.model.fp8_quant import FP8, quantize_groups, quantize_rows, quantize_weight
from graphcache.model.fused_ops import silu_mul
from graphcache.model.parallel import RowParallelLinear, TensorParallel

__all__ = ["Fp8Linear", "fp8_kernel_variant", "fp8_layouts", "fp8_mm"]


def fp8_mm(
    xq: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(xq [T, K] fp8 * scale_a [T, 1]) @ (w [N, K] fp8 * scale_b [N, 1]).T -> [T, N] out_dtype."""
    if not xq.is_cuda:
        return emulated_mm(xq, w, scale_a, scale_b, out_dtype)
    return torch._scaled_mm(xq, w.t(), scale_a=scale_a, scale_b=scale_b.view(1, -1), out_dtype=out_dtype)


class Fp8Linear(nn.Module):
    """An FP8 linear layer. block None: `weight_scale` [N, 1], one scale per output row; block (bn, bk):
    `weight_scale_inv` [ceil(N / bn), ceil(K / bk)], one per block (DeepSeek's name: a multiplier, like
    weight_scale). tp: set on a row-parallel layer at tensor-parallel size > 1 (all-reduce, then bias)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        *,
        block: tuple[int, int] | None = None,
        tp: TensorParallel | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = block
        self.tp = tp if tp is not None and tp.enabled else None
        self.fused = False  # the Triton activation quantization (LlamaModel.use_fused_ops)

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        self.weight = param(out_features, in_features, dtype=FP8)
        if block is None:
            self.weight_scale = param(out_features, 1, dtype=torch.float32)
        else:
            bn, bk = block
            self.weight_scale_inv = param(-(-out_features // bn), -(-in_features // bk), dtype=torch.float32)
        self.bias = param(out_features, dtype=dtype) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, block: tuple[int, int] | None = None) -> Fp8Linear:
        """An uninitialized Fp8Linear of `linear`'s shape, bias, dtype, device and tensor-parallel role."""
        tp = linear.tp if isinstance(linear, RowParallelLinear) else None
        return cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            linear.weight.dtype,
            block=block,
            tp=tp,
            device=linear.weight.device,
        )

    @classmethod
    @torch.no_grad()
    def quantized(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear`'s weight quantized with one scale per output row (amax / 448); the bias is kept."""
        fp8 = cls.like(linear)
        wq, scale = quantize_weight(linear.weight.data)
        fp8.weight.data.copy_(wq)
        fp8.weight_scale.data.copy_(scale)
        if linear.bias is not None and fp8.bias is not None:
            fp8.bias.data.copy_(linear.bias.data)
        return fp8

    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] fp32: what the GEMM multiplies by (for tests and checks)."""
        w = self.weight.float()
        if self.block is None:
            return w * self.weight_scale
        bn, bk = self.block
        s = self.weight_scale_inv.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        return w * s[: self.out_features, : self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.block is None and x.shape[0] <= fp8_gemm.WEIGHT_ONLY_MAX_ROWS:  # decode: x not quantized
            y = weight_only_mm(x, self.weight, self.weight_scale, x.dtype, kernel=self.fused)
        elif self.block is None:
            xq, scale_a = quantize_rows(x, self.fused)  # [T, K] fp8, [T, 1]
            y = fp8_mm(xq, self.weight, scale_a, self.weight_scale, x.dtype)
        else:
            xq, scale_a = quantize_groups(x, self.block[1], self.fused)  # [T, K] fp8, [T, K / bk]
            y = block_scaled_mm(xq, self.weight, scale_a, self.weight_scale_inv, self.block, x.dtype)
        if self.tp is not None:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def silu_mul_forward(self, x: torch.Tensor, inter: int) -> torch.Tensor:
        """fused_ops.silu_mul(self(x), inter) for a [gate | up] layer: x [T, K] -> [T, inter]. At decode
        sizes the activation runs in the GEMM's epilogue (fp8_gemm.weight_only_silu_mul: one kernel)."""
        plain = self.block is None and self.bias is None and self.tp is None
        if plain and x.shape[0] <= fp8_gemm.WEIGHT_ONLY_MAX_ROWS and 2 * inter == self.out_features:
            return weight_only_silu_mul(x, self.weight, self.weight_scale, x.dtype, kernel=self.fused)
        return silu_mul(self(x), inter, self.fused)

    def folds_rope(self, x: torch.Tensor, rope: fp8_gemm.RopeArgs) -> bool:
        """Whether qkv_rope_forward runs its one kernel here (fp8_gemm.folds_rope, fused ops on, per-row
        scales, no bias, not row-parallel)."""
        plain = self.block is None and self.bias is None and self.tp is None
        return self.fused and plain and fp8_gemm.folds_rope(x, self.weight, rope)

    def qkv_rope_forward(self, x: torch.Tensor, rope: fp8_gemm.RopeArgs) -> torch.Tensor:
        """self(x) for the qkv layer of one token with rotary and the KV write done by the GEMM's epilogue
        (fp8_gemm.weight_only_qkv_rope; folds_rope must hold): [1, K] -> [1, (H + 2K) * D]."""
        return fp8_gemm.weight_only_qkv_rope(x, self.weight, self.weight_scale, x.dtype, rope)

    def extra_repr(self) -> str:
        scales = "per-row scales" if self.block is None else f"{self.block[0]}x{self.block[1]} block scales"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, {scales}"


def fp8_layouts(model: nn.Module) -> frozenset[tuple[int, int] | None]:
    """The weight layouts of `model`'s Fp8Linear layers: None (per-row scales) and / or (bn, bk) block scales;
    empty for a 16-bit model."""
    return frozenset(m.block for m in model.modules() if isinstance(m, Fp8Linear))


def fp8_kernel_variant(layouts: frozenset[tuple[int, int] | None], num_tokens: int) -> tuple:
    """What the FP8 layers' kernels compile per step size (() for a 16-bit model): a graph capture of a step
    whose variant has not run yet warms it up outside the capture first (a Triton kernel's first load inside
    a capture invalidates it). Per-row scales: the one-row kernels, the 16-row decode tile, or x quantized
    (quantize_rows, then fp8_mm); block scales: the GEMM's BLOCK_M."""
    if not layouts:
        return ()
    rows: int | str | None = None
    # Per-row scales: weight only (the GEMM kernel's BLOCK_M) up to WEIGHT_ONLY_MAX_ROWS, else x quantized.
    if None in layouts:
        rows = fp8_gemm.block_m(num_tokens, None) if num_tokens <= fp8_gemm.WEIGHT_ONLY_MAX_ROWS else "a8"
    blocks = sorted(fp8_gemm.block_m(num_tokens, b[1]) for b in layouts if b is not None)
    return ("fp8", rows, *blocks)
