"""Batched LoRA on CUDA in Triton: shrink (x [T, in] x A[slot]^T -> [T, R]) and expand ([T, R] x B[slot]^T
added into y [T, out]) over a per-token slot index, with fixed grids and no host sync, so they run inside
captured graphs and one graph serves any mix of adapters and base tokens.

Each program owns a tile of tokens (and of rank or output columns) and loops over the slots: a slot none of
its tokens uses costs one compare over the tile's indices, and the tile's tokens each take their own slot's
result (a token has one slot). So a program writes only its own tile: no atomics, the sum order is fixed,
and the result does not depend on which other tokens share the step. A tile with no adapter token at all
(every index -1: base rows, pads) returns after reading its indices: a step without adapter rows pays two
small launches per projection. The shrink keeps fp32 ([T, R] fp32 between the two), the expand rounds it to
the weights' dtype for the tensor cores and adds in fp32 before y's rounding. model/lora_layers.py has the
torch reference the tests hold these to.
"""

from __future__ import annotations

import torch

from graphcache.model.triton_support import HAVE_TRITON, tl, triton

__all__ = ["HAVE_TRITON", "lora_kernel_variant", "lora_shrink_expand"]


def _shrink_kernel(
    x_ptr, a_ptr, idx_ptr, out_ptr,
    T, K, R, S, K_SPLIT,
    stride_xt, stride_as, stride_ar, stride_ok, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # out [splits, T, R] fp32: split z sums the in-columns [z K_SPLIT, (z + 1) K_SPLIT) (the expand adds them)
    pid_m, pid_r, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    idx = tl.load(idx_ptr + offs_m, mask=offs_m < T, other=-1)
    if tl.max(idx, axis=0) >= 0:
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in range(0, S):
            hit = idx == s
            if tl.max(hit.to(tl.int32), axis=0) > 0:
                part = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for k0 in range(pid_k * K_SPLIT, tl.minimum(K, (pid_k + 1) * K_SPLIT), BLOCK_K):
                    k = k0 + offs_k
                    xt = tl.load(
                        x_ptr + offs_m[:, None] * stride_xt + k[None, :],
                        mask=hit[:, None] & (k[None, :] < K), other=0.0,
                    )  # fmt: skip
                    at = tl.load(
                        a_ptr + s * stride_as + offs_r[:, None] * stride_ar + k[None, :],
                        mask=(offs_r[:, None] < R) & (k[None, :] < K), other=0.0,
                    )  # fmt: skip
                    part += tl.dot(xt, tl.trans(at))
                acc = tl.where(hit[:, None], part, acc)
        tl.store(
            out_ptr + pid_k * stride_ok + offs_m[:, None] * stride_ot + offs_r[None, :],
            acc,
            mask=(offs_m[:, None] < T) & (offs_r[None, :] < R),
        )


def _expand_kernel(
    s_ptr, b_ptr, idx_ptr, y_ptr,
    T, N, R, S, SPLITS,
    stride_sk, stride_st, stride_bs, stride_bn, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    idx = tl.load(idx_ptr + offs_m, mask=offs_m < T, other=-1)
    if tl.max(idx, axis=0) >= 0:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, S):
            hit = idx == s
            if tl.max(hit.to(tl.int32), axis=0) > 0:
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for r0 in range(0, R, BLOCK_R):
                    r = r0 + offs_r
                    st = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                    for z in range(0, SPLITS):  # the shrink's partial sums, in a fixed order
                        st += tl.load(
                            s_ptr + z * stride_sk + offs_m[:, None] * stride_st + r[None, :],
                            mask=hit[:, None] & (r[None, :] < R), other=0.0,
                        )  # fmt: skip
                    bt = tl.load(
                        b_ptr + s * stride_bs + offs_n[:, None] * stride_bn + r[None, :],
                        mask=(offs_n[:, None] < N) & (r[None, :] < R), other=0.0,
                    )  # fmt: skip
                    part += tl.dot(st.to(bt.dtype), tl.trans(bt))
                acc = tl.where(hit[:, None], part, acc)
        rows = (offs_m[:, None] < T) & (idx[:, None] >= 0) & (offs_n[None, :] < N)
        y_ptrs = y_ptr + offs_m[:, None] * stride_yt + offs_n[None, :]
        y = tl.load(y_ptrs, mask=rows, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=rows)


_KERNELS = None


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        if not HAVE_TRITON:
            raise RuntimeError("the LoRA kernels need triton (pip install triton)")
        _KERNELS = (triton.jit(_shrink_kernel), triton.jit(_expand_kernel))
    return _KERNELS


def _block_m(t: int) -> int:
    return 16 if t <= 16 else 32 if t <= 256 else 64


def lora_kernel_variant(num_tokens: int) -> tuple[str, int]:
    """What the kernels compile per step size (their token tile): a capture of a LoRA graph whose variant
    has not run yet warms it up outside the capture first (the graph cache's kernel families)."""
    return ("lora", _block_m(num_tokens))


def lora_shrink_expand(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor
) -> None:
    """y [T, out] += B[s] @ A[s] @ x[t] per token t with slot s = index[t] >= 0, in place (CUDA).
    x [T, in]; a [S, R, in]; b [S, out, R] (contiguous); index [T] int64. y and x: unit stride in the last dim."""
    shrink, expand = _kernels()
    t, k = x.shape
    slots, r, _ = a.shape
    n = y.shape[1]
    if t == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    bm = _block_m(t)
    block_r = min(64, max(16, triton.next_power_of_2(r)))
    block_k = 64
    m_tiles = triton.cdiv(t, bm)
    # Split the in-dimension until the shrink has about 128 programs (a decode's few token tiles alone
    # would leave most of the GPU idle), at least 4 K-blocks per split.
    splits = max(1, min(triton.cdiv(k, 4 * block_k), triton.cdiv(128, m_tiles * triton.cdiv(r, block_r))))
    k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_split)
    shrunk = torch.empty(splits, t, r, dtype=torch.float32, device=x.device)  # [splits, T, R] partial sums
    shrink[(m_tiles, triton.cdiv(r, block_r), splits)](
        x, a, index, shrunk,
        t, k, r, slots, k_split,
        x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0), shrunk.stride(1),
        BLOCK_M=bm, BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    block_n = 64
    expand[(m_tiles, triton.cdiv(n, block_n))](
        shrunk, b, index, y,
        t, n, r, slots, splits,
        shrunk.stride(0), shrunk.stride(1), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
