"""Paged KV write + attention: the eager break of every decoder layer.

The runner sets an `AttentionMetadata` for each step (set_attention_metadata) before it runs or
replays the model. `paged_attention` reads it at call time, not at capture time, so one capture
of a padded shape serves any real batch that fits: only the first `num_real_tokens` tokens are
written to the cache and attended; padded rows of `out` are zeroed.

Token layout of a step (the runner orders it this way): the `num_decodes` requests that feed one
token each come first (token i belongs to request i), then the multi-token (prefill or chunk)
requests, each a contiguous run [query_start_loc[i], query_start_loc[i + 1]).

KV cache per layer: [num_blocks, block_size, K, D]; slot s = block * block_size + offset. The
runner zero-fills it: masked positions get softmax weight 0, and 0 * NaN garbage would be NaN.

Pure torch SDPA, the same on CPU and CUDA. `_decode_attention` / `_prefill_attention` are the
seams where a paged GPU kernel (flash-attn with block tables) can replace the gather + SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from service.graphs.capture import eager_break, is_capturing

__all__ = ["AttentionMetadata", "get_attention_metadata", "paged_attention", "set_attention_metadata"]


@dataclass
class AttentionMetadata:
    # device tensors (views of the runner's static buffers)
    slot_mapping: torch.Tensor       # [num_real_tokens] int64: cache slot of each real token
    seq_lens: torch.Tensor           # [num_reqs] int32/64: context length incl. this step's tokens
    block_tables: torch.Tensor       # [num_reqs, max_blocks] int32/64: KV block ids (unused entries 0)
    # host ints (no device syncs inside the op)
    num_real_tokens: int
    num_reqs: int
    num_decodes: int                 # requests 0..num_decodes-1 feed exactly one token
    query_start_loc: list[int]       # [num_reqs + 1] token offsets of each request
    seq_lens_host: list[int]         # [num_reqs]
    max_decode_seq_len: int = 0      # longest context among the decode requests
    # per-step memo of masks shared by all layers (built by the first layer that needs them)
    _memo: dict = field(default_factory=dict, repr=False)

    @classmethod
    def empty(cls, device: torch.device | str) -> AttentionMetadata:
        """No real tokens: the op writes nothing to the cache (used for warmup captures)."""
        z = torch.zeros(0, dtype=torch.int64, device=device)
        return cls(z, z, z.view(0, 1), 0, 0, 0, [0], [])


_current: AttentionMetadata | None = None


def set_attention_metadata(md: AttentionMetadata | None) -> None:
    global _current
    _current = md


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("no attention metadata for this step: the runner must call "
                           "set_attention_metadata() before running the model")
    return _current


@eager_break
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> None:
    """q [T, H, D], k/v [T, K, D] (T padded), out [T, H, D] written in place.
    k_cache/v_cache [num_blocks, block_size, K, D]. Returns None: this is an eager break."""
    if q.is_cuda and is_capturing():
        # Under CUDA capture the graph segments have not run, so q/k/v hold garbage: writing them
        # would only dirty KV slots. The cache replays right after capturing; that run is real.
        return
    md = get_attention_metadata()
    n = md.num_real_tokens
    if n:
        num_kv, dim = k_cache.shape[2], k_cache.shape[3]
        # Only real tokens write: padded tokens never touch a real KV block.
        k_cache.view(-1, num_kv, dim).index_copy_(0, md.slot_mapping[:n], k[:n])
        v_cache.view(-1, num_kv, dim).index_copy_(0, md.slot_mapping[:n], v[:n])
        if md.num_decodes:
            _decode_attention(q, out, k_cache, v_cache, scale, md)
        for i in range(md.num_decodes, md.num_reqs):
            _prefill_attention(i, q, out, k_cache, v_cache, scale, md)
    if n < out.shape[0]:
        out[n:].zero_()  # padded rows: finite values, so nothing downstream sees NaN garbage


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """block_ids [..., nb] -> [..., L, K, D]: the first `length` slots of those blocks."""
    bs = cache.shape[1]
    nb = -(-length // bs)
    g = cache[block_ids[..., :nb]]                                  # [..., nb, bs, K, D]
    return g.flatten(-4, -3)[..., :length, :, :]                    # [..., L, K, D]


def _decode_attention(q, out, k_cache, v_cache, scale, md: AttentionMetadata) -> None:
    """One query per request: batch them, gather each request's blocks, mask beyond its length."""
    nd, length = md.num_decodes, md.max_decode_seq_len
    num_heads, dim = q.shape[1], q.shape[2]
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    kc = _gather_context(k_cache, md.block_tables[:nd], length).transpose(1, 2)   # [nd, K, L, D]
    vc = _gather_context(v_cache, md.block_tables[:nd], length).transpose(1, 2)   # [nd, K, L, D]
    mask = md._memo.get("decode_mask")
    if mask is None:
        pos = torch.arange(length, device=q.device)
        mask = (pos[None, :] < md.seq_lens[:nd, None]).view(nd, 1, 1, length)  # [nd, 1, 1, L]
        md._memo["decode_mask"] = mask
    # GQA without copying K/V per head: the `group` query heads sharing a KV head become that
    # head's `group` query rows (head h = kv_head * group + g, as HF's repeat_kv lays them out).
    qg = q[:nd].view(nd, num_kv, group, dim)                                       # [nd, K, G, D]
    o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask, scale=scale)   # [nd, K, G, D]
    out[:nd].copy_(o.reshape(nd, num_heads, dim))


def _prefill_attention(i: int, q, out, k_cache, v_cache, scale, md: AttentionMetadata) -> None:
    """Request i's new tokens attend causally to its cached context plus themselves."""
    start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
    n, length = end - start, md.seq_lens_host[i]
    kc = _gather_context(k_cache, md.block_tables[i], length).transpose(0, 1)     # [K, L, D]
    vc = _gather_context(v_cache, md.block_tables[i], length).transpose(0, 1)     # [K, L, D]
    qi = q[start:end].transpose(0, 1)                                              # [H, n, D]
    if n == length:  # no cached context: plain causal, eligible for flash kernels
        o = F.scaled_dot_product_attention(qi[None], kc[None], vc[None], is_causal=True, scale=scale,
                                           enable_gqa=True)[0]
    else:  # query j sits at absolute position length - n + j and sees keys 0..length - n + j
        key_pos = torch.arange(length, device=q.device)
        query_pos = torch.arange(length - n, length, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]                              # [n, L]
        o = F.scaled_dot_product_attention(qi[None], kc[None], vc[None], attn_mask=mask, scale=scale,
                                           enable_gqa=True)[0]
    out[start:end].copy_(o.transpose(0, 1))                                        # [n, H, D]
