"""Paged attention: the eager break of every decoder layer, the decode and in-graph attention ops,
and the choice of kernel. The per-step metadata they read, and its planner, are
model/attention_metadata.py: built by the runner once per step, read here once per layer.

Split of work (why): every graph-mode step replays this break once per layer, and at small batches
the step is host-bound, so each torch call made here costs ~10 us x layers x steps. Hence:
- the KV write is NOT here: llama.Attention writes this step's k/v into the cache inside the graph
  segment (index_copy_ by the runner's static `slot_mapping`; padded rows go to a scratch slot no
  sequence owns), so it costs nothing on the host at replay;
- everything shared by all layers (flat slot indices of each request's context, masks, cumulative
  lengths) is built ONCE per step by `AttentionPlanner.plan` (model/attention_metadata.py; the
  runner calls it) and read here;
- the break itself is a handful of torch calls: gather the context slots, one attention kernel,
  (SDPA path) one copy into `out`. No host syncs, no per-layer mask building, no zeroing.

Four kernels, one plan each (`select_attention_kernel` picks one at start; uniform decode steps
have their own, `select_decode_kernel`):
- "triton" (CUDA with triton, power-of-two block_size; model/unified_attention.py): ONE Triton
  launch per layer over ALL requests of the step, decode rows and chunks alike (causal, bottom-right
  aligned), reading K/V in place through the block tables (no gather) with the query heads of each
  KV head packed into one tile, writing straight into `out`. Its plan is a few views of buffers the
  runner already uploaded. With settings.model.prefill_attention other than "unified", the step's
  trailing fresh prompts go to a dense kernel instead (model/prefill_attention.py) and this launch
  covers the requests before them.
- "flash_paged" (CUDA, fp16/bf16, block_size a multiple of 256, FlashAttention's paged-KV page
  size): FlashAttention varlen over ALL requests of the step at once, decode and prefill alike
  (causal, bottom-right aligned), reading the paged cache through the block tables and writing
  straight into `out`: per layer ONE kernel, nothing gathered.
- "flash" (same, any block_size): the same call over a gathered copy of every request's context:
  per layer one gather + one kernel. Only the real context is gathered (sum of seq_lens).
- "sdpa" (CPU, fp32, or a torch without the varlen op): torch SDPA. Decodes batched as one call over
  [num_decodes, L] gathered slots with an additive mask; prefills one call each.

Token layout of a step (the runner orders it this way): the `num_decodes` requests that feed one
token each come first (token i belongs to request i), then the multi-token (prefill or chunk)
requests, each a contiguous run [query_start_loc[i], query_start_loc[i + 1]). Rows past the real
tokens are padding: the break leaves their `out` rows untouched. That is safe: padded rows only
ever meet their own row (norms, rotary and matmuls are row-wise), they write K/V only to the
scratch slot, the scratch slot is never gathered, and no logits row reads them.

KV cache per layer: [2, num_slots, K, D] (k, v), slot = block * block_size + offset. It is
zero-filled and only real tokens write real slots, so every gathered slot holds finite values:
masked positions get softmax weight 0, and 0 * NaN would still be NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphcache.choices import ATTENTION_BACKENDS, DECODE_ATTENTION_BACKENDS, DECODE_KERNELS
from graphcache.graphs.capture import eager_break, is_capturing
from graphcache.model.attention_metadata import AttentionMetadata, DecodeMetadata, PrefillPlan
from graphcache.model.decode_attention import HAVE_TRITON, paged_decode_attention
from graphcache.model.forward_context import current_attention_metadata
from graphcache.model.kv_dtype import gather_slots
from graphcache.model.prefill_attention import dense_prefill_attention
from graphcache.model.unified_attention import unified_attention

__all__ = [
    "decode_attention",
    "graph_attention",
    "paged_attention",
    "select_attention_kernel",
    "select_decode_kernel",
]

_FLASH_INPLACE = getattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace", None)
# Older torch (2.11 on the H200 box) has only the out-of-place op; it may lack block tables too.
_FLASH = getattr(torch.ops.aten, "_flash_attention_forward", None)
_FLASH_PAGES = any(
    "block_table" in str(op._schema)
    for op in ([_FLASH_INPLACE.default] if _FLASH_INPLACE is not None else [])
    + ([_FLASH.default] if _FLASH is not None else [])
)


def _flash_into(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_tokens: int,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    **paged,
) -> None:
    """FlashAttention varlen (causal, bottom-right aligned) of the first num_tokens rows into out.
    In place where torch has the in-place op; else one extra copy of the [num_tokens, H, D] result."""
    if _FLASH_INPLACE is not None:
        _FLASH_INPLACE(
            out,
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            True,
            False,
            scale=scale,
            window_size_left=-1,
            window_size_right=0,
            **paged,
        )
        return
    assert _FLASH is not None  # a flash kernel is chosen only where torch has one of the two ops
    o = _FLASH(
        q[:num_tokens],
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        True,
        False,
        scale=scale,
        window_size_left=-1,
        window_size_right=0,
        **paged,
    )[0]
    out[:num_tokens].copy_(o)


FLASH_PAGE_MULTIPLE = 256  # FlashAttention 2 takes a paged KV cache only in pages of a multiple of 256


def select_attention_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int, backend: str = "auto"
) -> str:
    """ "triton" (the unified paged kernel) where it runs, else "flash_paged" / "flash" where the
    FlashAttention varlen kernel applies, else "sdpa". `backend` (settings.model.attention_backend) other
    than "auto" forces a kernel (A/B runs); a forced kernel that cannot run here raises."""
    triton_ok = (
        device.type == "cuda"
        and HAVE_TRITON
        and dtype in (torch.float16, torch.bfloat16, torch.float32)
        and block_size & (block_size - 1) == 0
        and head_dim % 8 == 0
        and head_dim <= 256
    )
    flash_ok = (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and (_FLASH_INPLACE is not None or _FLASH is not None)
    )
    paged_ok = flash_ok and _FLASH_PAGES and block_size % FLASH_PAGE_MULTIPLE == 0
    if backend == "auto":
        return "triton" if triton_ok else "flash_paged" if paged_ok else "flash" if flash_ok else "sdpa"
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r}: use one of {', '.join(ATTENTION_BACKENDS)}")
    if backend == "triton" and not triton_ok:
        raise RuntimeError(
            "attention_backend=triton needs CUDA, triton, a power-of-two block_size and "
            "head_dim % 8 == 0 (<= 256); use auto, flash or sdpa"
        )
    if (backend == "flash" and not flash_ok) or (backend == "flash_paged" and not paged_ok):
        pages = f", and block_size a multiple of {FLASH_PAGE_MULTIPLE}" if backend == "flash_paged" else ""
        raise RuntimeError(
            f"attention_backend={backend} needs CUDA, fp16/bf16, head_dim % 8 == 0 and <= 256, "
            f"a torch with aten._flash_attention_forward (with block_table for paged){pages}"
        )
    return backend


def select_decode_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int, backend: str = "auto"
) -> str:
    """The kernel of uniform-decode steps: "triton" (model/decode_attention.py: paged, split-KV,
    query heads packed per KV head; CUDA), "torch" (static-shape masked attention over the
    whole block table: capturable but O(max_model_len), the CPU path), or "varlen" (no decode path:
    decode steps use the general kernel as an eager break, as mixed batches do)."""
    pow2 = block_size & (block_size - 1) == 0
    triton_ok = (
        device.type == "cuda"
        and HAVE_TRITON
        and dtype in (torch.float16, torch.bfloat16, torch.float32)
        and pow2
        and head_dim % 8 == 0
        and head_dim <= 256
    )
    if backend == "auto":
        return "triton" if triton_ok else "torch" if device.type == "cpu" else "varlen"
    if backend == "triton" and not triton_ok:
        raise RuntimeError(
            "decode_attention_backend=triton needs CUDA, triton, a power-of-two "
            "block_size and head_dim % 8 == 0 (<= 256); use auto"
        )
    if backend not in DECODE_KERNELS:
        raise ValueError(
            f"decode_attention_backend={backend!r}: use one of {', '.join(DECODE_ATTENTION_BACKENDS)}"
        )
    return backend


def decode_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    md: DecodeMetadata,
    scale: float,
) -> None:
    """q, out [R, H, D] (one token per request; R = the padded batch); k_blocks, v_blocks
    [num_blocks, block_size, K, D]. Writes every row of out (padded rows: zeros)."""
    num_reqs = md.seq_lens.shape[0]
    if md.kernel == "triton":
        assert md.workspace is not None  # the runner allocates it for the triton kernel
        paged_decode_attention(
            q[:num_reqs],
            k_blocks,
            v_blocks,
            md.block_tables,
            md.seq_lens,
            out[:num_reqs],
            scale,
            md.workspace,
            md.num_splits,
        )
        return
    # torch: every request attends over its whole block table ([R, B * bs] keys), masked past its
    # length. Static shapes, so it captures; the cost grows with max_model_len, not the context.
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_blocks.shape[2]
    length = md.block_tables.shape[1] * k_blocks.shape[1]
    assert md.positions is not None  # the runner allocates it for the torch kernel
    flat = md.block_tables.reshape(-1)
    k = (
        gather_slots(k_blocks, 0, flat, q.dtype).view(num_reqs, length, kv_heads, dim).transpose(1, 2)
    )  # [R, K, L, D]
    v = gather_slots(v_blocks, 0, flat, q.dtype).view(num_reqs, length, kv_heads, dim).transpose(1, 2)
    seq_lens = md.seq_lens.clamp_min(1)  # padded rows attend to slot 0, then are zeroed
    beyond = md.positions[:length] >= seq_lens[:, None]  # [R, L]
    mask = torch.zeros(beyond.shape, dtype=q.dtype, device=q.device).masked_fill_(beyond, float("-inf"))
    qg = q[:num_reqs].view(num_reqs, kv_heads, heads // kv_heads, dim)  # [R, K, G, D]
    o = F.scaled_dot_product_attention(
        qg, k, v, attn_mask=mask[:, None, None, :], scale=scale
    )  # [R, K, G, D]
    real = (md.seq_lens > 0).to(q.dtype).view(num_reqs, 1, 1, 1)
    out[:num_reqs].view(num_reqs, kv_heads, heads // kv_heads, dim).copy_(o * real)


def graph_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    md: DecodeMetadata | AttentionMetadata,
    scale: float,
) -> None:
    """Attention recorded inside the graph ("full" runtime mode): the decode kernel for a uniform
    decode (DecodeMetadata), the unified kernel for a mixed step (AttentionMetadata from
    AttentionPlanner.plan_in_graph: its grid is fixed by the descriptor's padded sizes, and what the
    step really holds is read from the static buffers at replay)."""
    if isinstance(md, DecodeMetadata):
        decode_attention(q, out, k_blocks, v_blocks, md, scale)
        return
    if md.kernel != "triton":
        raise RuntimeError(
            f"attention kernel {md.kernel!r} cannot run inside a graph: mixed_capture_mode=full "
            "needs the triton kernel (the runner falls back to breakable for the others)"
        )
    # The triton plan (plan_in_graph) sets all three.
    assert md.cu_seqlens_q is not None and md.seqused_k is not None and md.block_table is not None
    unified_attention(
        q,
        k_blocks,
        v_blocks,
        out,
        md.cu_seqlens_q,
        md.seqused_k,
        md.block_table,
        scale,
        md.num_reqs,
        md.unified_config,
    )


@eager_break
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    scale: float,
) -> None:
    """q [T, H, D]; k, v [T, K, D] this step's keys/values (T padded; already written to the cache
    by the graph segment); out [T, H, D] written in place (real rows only); kv_cache [2, S, K, D]
    the layer's cache as flat slots; k_blocks, v_blocks [num_blocks, block_size, K, D] the same
    memory as pages (views made once by the model: no view ops here). Returns None: an eager break."""
    if is_capturing() and q.is_cuda:  # thread-local flag first: no tensor attribute read per replay
        # Under CUDA capture the graph segments have not run, so q/k/v hold garbage; the cache
        # replays right after capturing, and that run is real.
        return
    md = current_attention_metadata()
    if isinstance(md, DecodeMetadata):  # decode kernels in breakable mode: read at replay like the rest
        decode_attention(q, out, k_blocks, v_blocks, md, scale)
        return
    if not md.num_real_tokens:
        return
    if md.kernel == "triton":
        # All requests in one launch, straight from the pages; rows past cu_seqlens_q[R] (padding)
        # are neither read nor written. With a dense part (fresh prompts at the end of the step), the
        # launch covers the requests and rows before it, and the dense kernel the rest.
        dense = md.dense
        unified_reqs = dense.first_req if dense is not None else md.num_reqs
        if unified_reqs:
            rows = dense.start if dense is not None else q.shape[0]
            unified_attention(
                q[:rows],
                k_blocks,
                v_blocks,
                out[:rows],
                md.cu_seqlens_q,
                md.seqused_k,
                md.block_table,
                scale,
                unified_reqs,
                md.unified_config,
            )
        if dense is not None:
            dense_prefill_attention(q, k, v, out, dense, scale)
        return
    if md.kernel == "flash_paged":
        # All requests at once, straight from the pages. Rows past cu_seqlens_q[-1] (padding) are
        # neither read nor written.
        _flash_into(
            out,
            q,
            k_blocks,
            v_blocks,
            md.num_real_tokens,
            md.cu_seqlens_q,
            md.cu_seqlens_k,
            md.max_q,
            md.max_k,
            scale,
            seqused_k=md.seqused_k,
            block_table=md.block_table,
        )
        return
    if md.kernel == "flash":
        # All requests at once. Rows past cu_seqlens_q[-1] (padding) are neither read nor written.
        kc, vc = gather_slots(kv_cache, 1, md.context_slots, q.dtype).unbind(0)  # [total_k, K, D] each
        _flash_into(
            out, q, kc, vc, md.num_real_tokens, md.cu_seqlens_q, md.cu_seqlens_k, md.max_q, md.max_k, scale
        )
        return
    if md.num_decodes:
        _decode_attention(q, out, kv_cache, scale, md)
    for p in md.prefills:
        _prefill_attention(p, q, k, v, out, kv_cache, scale)


def _decode_attention(q, out, kv_cache, scale, md: AttentionMetadata) -> None:
    """One query per request, all decodes in one SDPA call over their gathered contexts."""
    nd = md.num_decodes
    assert md.decode_slots is not None  # the sdpa plan sets it whenever the step has decodes
    kc, vc = (
        gather_slots(kv_cache, 1, md.decode_slots, q.dtype)  # [2, nd * L, K, D]
        .view(md.decode_kv_shape)
        .transpose(2, 3)
        .unbind(0)
    )  # [nd, K, L, D] each
    # GQA without copying K/V per head: the G query heads sharing a KV head become that head's
    # query rows (head h = kv_head * G + g, as HF's repeat_kv lays them out).
    qg = q[:nd].view(md.decode_q_shape)  # [nd, K, G, D]
    o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=md.decode_mask, scale=scale)  # [nd, K, G, D]
    # o may be strided ([nd, G, K, D] memory on CUDA kernels): copy through out's own view
    out[:nd].view(md.decode_q_shape).copy_(o)  # [nd, K, G, D]


def _prefill_attention(p: PrefillPlan, q, k, v, out, kv_cache, scale) -> None:
    """Request p's new tokens attend causally to its cached context plus themselves."""
    qi = q[p.start : p.end].transpose(0, 1)[None]  # [1, H, n, D]
    if p.context_slots is None:  # no cached context: this step's own rows; eligible for flash kernels
        ki = k[p.start : p.end].transpose(0, 1)[None]  # [1, K, n, D]
        vi = v[p.start : p.end].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kc, vc = (
            gather_slots(kv_cache, 1, p.context_slots, q.dtype).transpose(1, 2)[:, None].unbind(0)
        )  # [1, K, L, D] each
        o = F.scaled_dot_product_attention(qi, kc, vc, attn_mask=p.mask, scale=scale, enable_gqa=True)
    out[p.start : p.end].copy_(o[0].transpose(0, 1))  # [n, H, D]
