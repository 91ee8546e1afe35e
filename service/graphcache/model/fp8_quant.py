"""FP8 E4M3 quantization of rows: a scale per row (or per group of columns) so the row's largest |value|
maps to 448, the largest finite E4M3 number. The scale is amax / 448, floored at MIN_SCALE (an all-zero
row still has a normal scale; its values quantize to 0), and xq * scale ~= x.

  weights      w [N, K] -> (wq [N, K] fp8, scale [N, 1] fp32), once at load (--quantization fp8):
               wq = clamp(w / scale), rounded to nearest, llm-compressor's rule, so a layer quantized
               on load holds the bytes of the per-channel FP8 checkpoint of the same weights
  activations  x [T, K] -> (xq [T, K] fp8, scale [T, 1] fp32), every step (dynamic per-token scales)
  groups       x [T, K] -> (xq, scale [T, K / 128]): per token and 128-column group (block-scaled weights)
               for both: xq = clamp(x * inv), inv = 1 / scale, rounded to nearest: one multiply per
               value, so a GEMM can quantize its input on the fly (fp8_gemm.py's decode kernel does)

On CUDA the activation quantization is one Triton kernel per call (a torch version is ~6 kernels). It
computes exactly what the torch version computes (fp32 amax, IEEE division for the scale and its
reciprocal, IEEE multiply, the same cast), so the CPU path and its tests check the GPU's numerics;
tests/gpu/test_fp8_cuda.py compares the two bit for bit. Rows are independent: a padded row's garbage
never reaches a real row (the graphs rely on that).
"""

from __future__ import annotations

import torch

from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = ["FP8", "FP8_MAX", "MIN_SCALE", "quantize_groups", "quantize_rows", "quantize_weight"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# The smallest scale: an all-zero row still has a normal scale (and a finite reciprocal). vLLM's floor too.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (wq [N, K] fp8, scale [N, 1] fp32): one scale per row, wq = clamp(w / scale)."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=MIN_SCALE)  # [N, 1]
    return (w32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def _quantize_torch(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, k = x.shape
    xg = x.float().reshape(t, k // group, group)  # [T, G, group]
    amax = xg.abs().amax(dim=-1, keepdim=True)  # [T, G, 1]
    # Divided by a tensor, not a Python scalar: CUDA torch turns a scalar divisor into a multiply by its
    # reciprocal (1 ulp off), the Triton kernel divides exactly (div_rn), and the CPU divides exactly too.
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_(min=MIN_SCALE)
    xq = (xg * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8).reshape(t, k)
    return xq, scale.view(t, k // group)


def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    stride_x,
    stride_q,
    rows,
    group,
    min_scale,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    # One program per (row, group). Two passes over the group (amax, then quantize) unless it fits one
    # block; the second pass reads the row again from L2. Scales go out group-major: s[g * rows + row].
    row = tl.program_id(0)
    g = tl.program_id(1)
    start = g * group
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = cols < group
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        running = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, group, BLOCK):
            mask = off + cols < group
            x = tl.load(x_ptr + row * stride_x + start + off + cols, mask=mask, other=0.0).to(tl.float32)
            running = tl.maximum(running, tl.abs(x))
        amax = tl.max(running, axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, 448.0), min_scale)
    inv = tl.math.div_rn(1.0, scale)
    tl.store(s_ptr + g * rows + row, scale)
    if ONE_PASS:
        q = tl.clamp(x * inv, -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        for off in range(0, group, BLOCK):
            mask = off + cols < group
            x = tl.load(x_ptr + row * stride_x + start + off + cols, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(x * inv, -448.0, 448.0)
            tl.store(q_ptr + row * stride_q + start + off + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


_KERNEL = None
ONE_PASS_MAX = 16384  # groups up to this many columns (Llama-3-8B's 14336) are held in registers: one read


def _quantize_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = triton.jit(_quantize_kernel, do_not_specialize=["rows"])  # rows vary: no compile per batch
    t, k = x.shape
    groups = k // group
    xq = torch.empty((t, k), dtype=FP8, device=x.device)
    scale = torch.empty((groups, t), dtype=torch.float32, device=x.device)  # group-major, see below
    one_pass = group <= ONE_PASS_MAX
    block = triton.next_power_of_2(group) if one_pass else 2048
    _KERNEL[(t, groups)](
        x,
        xq,
        scale,
        x.stride(0),
        xq.stride(0),
        t,
        group,
        MIN_SCALE,
        BLOCK=block,
        ONE_PASS=one_pass,
        num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16,
    )
    # [T, G] with the token dimension contiguous (what block-scaled GEMMs read); at G = 1 a plain [T, 1].
    return xq, scale.view(t, 1) if groups == 1 else scale.t()


def _quantize(x: torch.Tensor, group: int, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.shape[1] % group:
        raise ValueError(f"quantize wants [rows, K] with K a multiple of {group}, got {tuple(x.shape)}")
    if fused and x.stride(1) == 1:
        return _quantize_triton(x, group)
    return _quantize_torch(x, group)


def quantize_rows(x: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [R, K] -> (xq [R, K] fp8, scale [R, 1] fp32) with xq * scale ~= x, one scale per row.
    fused: the Triton kernel (CUDA; the same numbers as the torch ops)."""
    return _quantize(x, x.shape[-1], fused and HAVE_TRITON)


def quantize_groups(x: torch.Tensor, group: int, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (xq [R, K] fp8, scale [R, K / group] fp32): one scale per row and `group` columns."""
    return _quantize(x, group, fused and HAVE_TRITON)
