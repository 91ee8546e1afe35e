"""The rotary epilogue of fp8_gemm's one-token qkv GEMM (ROPE): which rows a program streams, and what it
stores. A q or k head's program takes the dims d and d + D/2 that rotate together (BLOCK_N of each), a v
head's 2 x BLOCK_N consecutive rows; the epilogue rounds as fused_ops' rotary kernel does and writes k and
v to the token's cache slot, so the GEMM leaves what the GEMM then fused_ops.rotary_cache_ leave.
Plain functions here, jitted by fp8_gemm._kernel with the kernel that calls them (tests/model/test_fp8.py runs
them under Triton's interpreter, tests/gpu/test_fp8_cuda.py on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcache.model.triton_support import tl

__all__ = ["RopeArgs", "rope_rows", "rope_store"]


@dataclass(frozen=True)
class RopeArgs:
    """What fused_ops.rotary_cache_ takes after the qkv GEMM of one token: positions and slot_mapping [1]
    int64, cos / sin [P, D], k_slots / v_slots [num_slots, K, D] (one layout, D contiguous), and this
    rank's heads (the GEMM's rows are [q | k | v] heads of head_dim)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    k_slots: torch.Tensor
    v_slots: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def operands(self) -> tuple:
        """The kernel's rotary arguments: tensors, then rotated heads, q heads, head_dim."""
        tensors = (self.positions, self.cos, self.sin, self.slot_mapping, self.k_slots, self.v_slots)
        return (*tensors, self.num_heads + self.num_kv_heads, self.num_heads, self.head_dim)


def rope_rows(pid, rope_heads, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """A ROPE program's rows: (first-half rows [BLOCK_N], the second half's offset (D / 2 in a q or k head,
    BLOCK_N in a v head), is_rope [BLOCK_N] (a q or k program), its head, its dims [BLOCK_N] in the head)."""
    per_head = HEAD_DIM // 2 // BLOCK_N  # programs a rotated head
    lanes = tl.arange(0, BLOCK_N)
    n_rope = rope_heads * per_head
    head = pid // per_head
    dim = (pid % per_head) * BLOCK_N + lanes
    is_rope = (lanes * 0 + pid) < n_rope  # as a tensor: the interpreter takes no scalar in a mask
    v_base = rope_heads * HEAD_DIM + (pid - n_rope) * 2 * BLOCK_N
    offs = tl.where(is_rope, head * HEAD_DIM + dim, v_base + lanes)
    up = tl.where(pid < n_rope, HEAD_DIM // 2, BLOCK_N)
    return offs, up, is_rope, head, dim


def rope_store(
    c_ptr, a, b, offs, up, is_rope, head, dim, pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr,
    stride_cos, stride_cs, stride_ch, rope_heads, q_heads, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """a, b [1, BLOCK_N] fp32: the rows offs and offs + up. Rotated (q, k) as fused_ops' rotary kernel
    rounds (each product and the sum in c's dtype, from the GEMM's rounded outputs) or as they are (v),
    into c, and k, v into the token's cache slot ([num_slots, K, D] caches, slot_mapping[0])."""
    dt = c_ptr.dtype.element_ty
    a = a.to(dt).to(tl.float32)
    b = b.to(dt).to(tl.float32)
    pos = tl.load(pos_ptr)
    rot = is_rope[None, :]
    c = tl.load(cos_ptr + pos * stride_cos + dim[None, :]).to(tl.float32)  # cos[:D/2] == cos[D/2:]
    s = tl.load(sin_ptr + pos * stride_cos + dim[None, :]).to(tl.float32)
    a_out = tl.where(rot, (a * c).to(dt).to(tl.float32) + (-b * s).to(dt).to(tl.float32), a).to(dt)
    b_out = tl.where(rot, (b * c).to(dt).to(tl.float32) + (a * s).to(dt).to(tl.float32), b).to(dt)
    rows = offs[None, :]
    tl.store(c_ptr + rows, a_out)
    tl.store(c_ptr + rows + up, b_out)
    slot = tl.load(slot_ptr)
    is_k = rot & ((dim[None, :] * 0 + head) >= q_heads)
    kc = kc_ptr + slot * stride_cs + (head - q_heads) * stride_ch + dim[None, :]
    tl.store(kc, a_out, mask=is_k)
    tl.store(kc + HEAD_DIM // 2, b_out, mask=is_k)
    rel = rows - rope_heads * HEAD_DIM  # v rows: their place in the v heads
    rel_b = rel + up
    is_v = ~rot
    tl.store(vc_ptr + slot * stride_cs + (rel // HEAD_DIM) * stride_ch + rel % HEAD_DIM, a_out, mask=is_v)
    tl.store(vc_ptr + slot * stride_cs + (rel_b // HEAD_DIM) * stride_ch + rel_b % HEAD_DIM, b_out, mask=is_v)
