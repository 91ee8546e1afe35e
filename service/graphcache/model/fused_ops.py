"""Fused elementwise kernels of a decoder layer (Triton), with the PyTorch ops they replace.

Why: at decode batch sizes a layer's GPU time is mostly launches of tiny kernels. RMSNorm in fp32 is
~7 kernels (cast, square, mean, add, rsqrt, scale, cast, weight), rotary ~16 (two gathers, rotate-half
by chunk/neg/cat, three multiply-adds for q and again for k), the residual adds and SiLU*mul 4 more:
~35 of a layer's ~45 kernels, at 2-3 us each ~2 ms of a 2.4 ms batch-1 step on the H200.
Here each is one kernel:
  add_rmsnorm   residual = x + residual; out = weight * rmsnorm(residual)   (one row per program)
  rotary_       q, k rotated in place by the cos/sin of each token's position
  rotary_cache_ rotary_, and the rotated k and v written to their KV-cache slots
  silu_mul      silu(gate) * up of the [T, 2I] gate_up projection

Numerics follow the PyTorch ops (and so Hugging Face's modeling code) rounding for rounding: the
residual sum is rounded to the model dtype before the norm reads it, the normalized row is rounded
before the weight multiplies it, rotary rounds each product and the sum like `q * cos +
rotate_half(q) * sin` in bf16, SiLU rounds before the multiply. What differs is only the order of
the norm's fp32 sum of squares. The CPU path (and the HF-parity tests) use the PyTorch ops; the
kernels are checked against them (tests/model/test_fused_ops.py, under TRITON_INTERPRET on the CPU).

triton is imported guarded and the kernels are jitted on first use (as in decode_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphcache.model.kv_dtype import is_fp8, write_slots_
from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = ["HAVE_TRITON", "add_rmsnorm", "rotary_", "rotary_cache_", "silu_mul"]


# --- PyTorch references (the CPU path) -------------------------------------------------------------------
def _rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# --- kernels ------------------------------------------------------------------------------------------------
def _add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # h + residual, rounded
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    y = (xf * inv).to(x.dtype)  # rounded like x32.to(dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(w.dtype), mask=mask)


def _rotary_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c,
    stride_cs,
    stride_ch,
    num_q,
    num_k,
    half,
    WRITE_KV: tl.constexpr,
    KV_FP8: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK_D)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.load(cos_ptr + pos * stride_c + d, mask=d < half, other=0.0).to(
        tl.float32
    )  # cos[:half] == cos[half:]
    s = tl.load(sin_ptr + pos * stride_c + d, mask=d < half, other=0.0).to(tl.float32)
    # out = x * cos + rotate_half(x) * sin, each product and the sum rounded to the model dtype; q, then k
    mask = (h < num_q) & (d < half)
    p1 = q_ptr + t * stride_qt + h * stride_qh + d
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + half, mask=mask, other=0.0)
    dt = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(p1, ((a * c).to(dt).to(tl.float32) + (-b * s).to(dt).to(tl.float32)).to(dt), mask=mask)
    tl.store(p1 + half, ((b * c).to(dt).to(tl.float32) + (a * s).to(dt).to(tl.float32)).to(dt), mask=mask)
    mask = (h < num_k) & (d < half)
    p1 = k_ptr + t * stride_kt + h * stride_kh + d
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + half, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    k1 = ((a * c).to(dt).to(tl.float32) + (-b * s).to(dt).to(tl.float32)).to(dt)
    k2 = ((b * c).to(dt).to(tl.float32) + (a * s).to(dt).to(tl.float32)).to(dt)
    tl.store(p1, k1, mask=mask)
    tl.store(p1 + half, k2, mask=mask)
    if WRITE_KV:  # the rotated k and v into this token's cache slot ([num_slots, K, D] caches)
        slot = tl.load(slot_ptr + t)
        kc = kc_ptr + slot * stride_cs + h * stride_ch + d
        pv = v_ptr + t * stride_vt + h * stride_vh + d
        vc = vc_ptr + slot * stride_cs + h * stride_ch + d
        v1 = tl.load(pv, mask=mask, other=0.0)
        v2 = tl.load(pv + half, mask=mask, other=0.0)
        if KV_FP8:  # an FP8 cache (model/kv_dtype.py): saturated at +-448 as kv_dtype.to_cache rounds, then
            # the stores below round to E4M3 (a store casts to its pointer's type)
            k1, k2 = tl.clamp(k1.to(tl.float32), -448.0, 448.0), tl.clamp(k2.to(tl.float32), -448.0, 448.0)
            v1, v2 = tl.clamp(v1.to(tl.float32), -448.0, 448.0), tl.clamp(v2.to(tl.float32), -448.0, 448.0)
        tl.store(kc, k1, mask=mask)
        tl.store(kc + half, k2, mask=mask)
        tl.store(vc, v1, mask=mask)
        tl.store(vc + half, v2, mask=mask)


def _silu_mul_kernel(
    gu_ptr, d_ptr, out_ptr, stride_gu, stride_d, stride_o, inter, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # gate_up + delta, rounded as torch's add
        dg = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
        du = tl.load(d_ptr + row * stride_d + inter + cols, mask=mask, other=0.0)
        g = (g.to(tl.float32) + dg.to(tl.float32)).to(g.dtype)
        u = (u.to(tl.float32) + du.to(tl.float32)).to(u.dtype)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu, rounded
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


_KERNELS = None


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        if not HAVE_TRITON:
            raise RuntimeError("fused ops need triton (pip install triton), or set GRAPHCACHE_FUSED_OPS=off")
        _KERNELS = (triton.jit(_add_rmsnorm_kernel), triton.jit(_rotary_kernel), triton.jit(_silu_mul_kernel))
    return _KERNELS


def _pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


# --- the ops --------------------------------------------------------------------------------------------------
def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] (a layer's output), residual [T, N] or None (the first layer): returns
    (weight * rmsnorm(x + residual), x + residual), the second being the next residual."""
    if not fused:
        h = x if residual is None else x + residual
        return _rmsnorm_torch(h, weight, eps), h
    t, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    _kernels()[0][(t,)](
        x,
        res,
        weight,
        out,
        res_out,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        res_out.stride(0),
        n,
        eps,
        HAS_RES=residual is not None,
        BLOCK=_pow2(n),
        num_warps=4 if n <= 2048 else 8,
    )
    return out, res_out


def rotary_(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, K, D] (views with a contiguous last dim; rotated in place when fused),
    cos/sin [P, D] in q's dtype, positions [T] int64: rotate-half rotary, as Hugging Face applies it."""
    if not fused:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, D]
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    _launch_rotary(q, k, cos, sin, positions, None)
    return q, k


def rotary_cache_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_ on q and k, then k and v [T, K, D] written to their cache slots: k_slots[slot_mapping[t]]
    = k[t] (k_slots, v_slots [num_slots, K, D]; slot_mapping [T] int64). Fused: one kernel for all of it,
    where the ops it replaces are three (rotary and two index_copy_), each a launch of a decode layer."""
    if not fused:
        q, k = rotary_(q, k, cos, sin, positions, False)
        write_slots_(k_slots, slot_mapping, k)  # index_copy_, rounded to an FP8 cache's E4M3
        write_slots_(v_slots, slot_mapping, v)
        return q, k
    if v.stride(2) != 1 or k_slots.stride() != v_slots.stride() or k_slots.stride(2) != 1:
        raise ValueError("rotary_cache_ needs v's head dimension contiguous and k/v caches of one layout")
    _launch_rotary(q, k, cos, sin, positions, (v, slot_mapping, k_slots, v_slots))
    return q, k


def _launch_rotary(q, k, cos, sin, positions, cache) -> None:
    """The rotary kernel, in place; cache (v, slot_mapping, k_slots, v_slots) or None: also the slot writes."""
    t, num_q, d = q.shape
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1:
        raise ValueError("rotary_ needs the head dimension contiguous")
    v, slots, kc, vc = cache if cache is not None else (k, positions, k, k)  # unread without WRITE_KV
    _kernels()[1][(t,)](
        q,
        k,
        v,
        cos,
        sin,
        positions,
        slots,
        kc,
        vc,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        kc.stride(0),
        kc.stride(1),
        num_q,
        k.shape[1],
        d // 2,
        WRITE_KV=cache is not None,
        KV_FP8=is_fp8(kc),
        BLOCK_D=_pow2(d // 2),
        BLOCK_H=_pow2(max(num_q, k.shape[1])),
        num_warps=4,
    )


def silu_mul(
    gate_up: torch.Tensor, inter: int, fused: bool, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I]; delta [T, 2I] (gate_up_proj's LoRA delta,
    model/lora_layers.py add_beside_) is added to gate_up first."""
    if not fused:
        if delta is not None:
            gate_up = gate_up + delta
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up
    t = gate_up.shape[0]
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(inter))
    d = gate_up if delta is None else delta
    _kernels()[2][(t, triton.cdiv(inter, block))](
        gate_up, d, out, gate_up.stride(0), d.stride(0), out.stride(0), inter,
        HAS_DELTA=delta is not None, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out
