"""Dense causal attention for the fresh prompts of a step: the prompt chunks whose whole context is in
the step (no cached prefix), run by a dense prefill kernel over the step's own q/k/v rows instead of
the paged unified kernel (settings.model.prefill_attention; default "unified": off).

Why: the unified Triton kernel (model/unified_attention.py) serves every row of a mixed step, but on
long fresh prompts it runs well below what Hopper's dense attention kernels reach (issue 41:
benchmarks/prefill_attention_bench.py measures each candidate at the 8B and 0.5B shapes). A fresh
prompt needs nothing from the cache: its keys are this step's k/v rows, already rotated (and written
to the cache by the graph segment, as for every row), so a packed-varlen kernel can take them as is.

Which rows: the runner lays out decodes first, then the multi-token requests in plan order, and the
scheduler admits new prompts after the running ones, so the fresh prompts of a step are mostly its
last requests. The planner (model/attention_metadata.py) takes the longest run of fresh requests at
the END of the step as the dense part (`DensePrefill`); the unified kernel runs over the requests
before it (a prefix of requests and of rows, so its launch is unchanged but shorter), the dense kernel
over the rest, both writing into the same `out`. A fresh prompt before a cached one stays on the
unified kernel: correct, just not faster.

Kernels ("dense kernel", picked once by `select_prefill_kernel`):
- "triton": model/prefill_triton.py, FlashAttention-layout tiles of one head over the packed rows, GQA
  by indexing (nothing copied), off-diagonal tiles unmasked;
- "flash": FlashAttention 2 varlen (aten._flash_attention_forward), GQA native;
- "sdpa": torch SDPA one request at a time (causal, enable_gqa): any device; what the CPU runs for
  every setting other than "unified", so the split itself is tested there.
No cuDNN choice: its varlen forward (aten._cudnn_attention_forward on packed rows) took 44-48 ms a call
on the H100 where the unified kernel takes 0.33 (BENCHMARKS.md §25). Only steps on the "triton" attention
kernel split: the flash kernels already are dense varlen kernels, and the sdpa kernel already runs fresh
prompts as plain causal SDPA.

Off by default: on the H100 the triton dense kernel is 1.23x the unified one on 8 x 1,024 fresh tokens but
4% on a realistic mixed step, and it moved the 8B realistic run by under 1% (BENCHMARKS.md §25).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from graphcache.choices import PREFILL_ATTENTION_MODES
from graphcache.model.prefill_triton import dense_causal_attention
from graphcache.model.triton_support import HAVE_TRITON

__all__ = ["DensePrefill", "dense_prefill_attention", "plan_dense_suffix", "select_prefill_kernel"]

_FLASH = getattr(torch.ops.aten, "_flash_attention_forward", None)


@dataclass(frozen=True)
class DensePrefill:
    """The dense part of a step: requests [first_req, R), token rows [start, end), all fresh prompts."""

    kernel: str  # "triton" | "flash" | "sdpa"
    first_req: int
    start: int
    end: int
    lens: tuple[int, ...]  # query length (= context length) of each dense request, in order
    cu: torch.Tensor  # [len(lens) + 1] int32 on the device: cumulative lengths from 0
    max_len: int


def select_prefill_kernel(
    setting: str, device: torch.device, dtype: torch.dtype, head_dim: int, attention_kernel: str
) -> str:
    """The dense kernel for fresh prompts, or "" (none: every row on the step's attention kernel).
    Only the "triton" attention kernel splits (see the module doc). On the CPU every setting other than
    "unified" runs "sdpa". A CUDA kernel that cannot run here raises, naming the fix."""
    if setting not in PREFILL_ATTENTION_MODES:
        raise ValueError(f"prefill_attention={setting!r}: use one of {', '.join(PREFILL_ATTENTION_MODES)}")
    if setting == "unified" or attention_kernel != "triton":
        return ""
    if device.type != "cuda" or setting == "sdpa":
        return "sdpa"
    if setting == "triton":
        if not (HAVE_TRITON and head_dim % 8 == 0 and head_dim <= 256):
            raise RuntimeError(
                "prefill_attention=triton needs triton and head_dim % 8 == 0 (<= 256); use unified or sdpa"
            )
        return setting
    half = dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256
    if setting == "flash" and not (half and _FLASH is not None):
        raise RuntimeError(
            "prefill_attention=flash needs fp16/bf16, head_dim % 8 == 0 (<= 256) and a torch with "
            "aten._flash_attention_forward; use unified, triton or sdpa"
        )
    return setting


def plan_dense_suffix(
    kernel: str, query_start_loc: list[int], seq_lens: list[int], cu_seqlens_q: torch.Tensor
) -> DensePrefill | None:
    """The longest run of fresh requests (query length = context length) at the end of the step, or
    None. query_start_loc [R + 1] and seq_lens [R] are host ints; cu_seqlens_q [>= R + 1] int32 is the
    same query_start_loc on the device (rebased here without a host sync)."""
    if not kernel:
        return None
    num_reqs = len(seq_lens)
    first = num_reqs
    while first > 0 and query_start_loc[first] - query_start_loc[first - 1] == seq_lens[first - 1]:
        first -= 1
    if first == num_reqs:
        return None
    start, end = query_start_loc[first], query_start_loc[num_reqs]
    lens = tuple(seq_lens[first:])
    return DensePrefill(
        kernel=kernel,
        first_req=first,
        start=start,
        end=end,
        lens=lens,
        cu=cu_seqlens_q[first : num_reqs + 1] - start,
        max_len=max(lens),
    )


def dense_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, plan: DensePrefill, scale: float
) -> None:
    """q, out [T, H, D]; k, v [T, K, D] this step's (rotated) keys/values. Writes out[start:end]: each
    dense request's rows attend causally to its own rows."""
    rows = slice(plan.start, plan.end)
    qs, ks, vs = q[rows], k[rows], v[rows]  # [n, H, D], [n, K, D]
    if plan.kernel == "triton":
        dense_causal_attention(qs, ks, vs, out[rows], plan.cu, len(plan.lens), scale)
        return
    if plan.kernel == "flash":
        assert _FLASH is not None  # select_prefill_kernel checked
        o = _FLASH(
            qs, ks, vs, plan.cu, plan.cu, plan.max_len, plan.max_len, 0.0, True, False,
            scale=scale, window_size_left=-1, window_size_right=0,
        )[0]  # fmt: skip
        out[rows].copy_(o)
        return
    for i, length in enumerate(plan.lens):  # "sdpa": one request at a time
        s = plan.start + sum(plan.lens[:i])
        qi = q[s : s + length].transpose(0, 1)[None]  # [1, H, n_i, D]
        ki = k[s : s + length].transpose(0, 1)[None]  # [1, K, n_i, D]
        vi = v[s : s + length].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        out[s : s + length].copy_(o[0].transpose(0, 1))
