"""Decode attention: our paged Triton kernel vs gather + FlashAttention varlen (the old "flash" path).

    python benchmarks/decode_attention_bench.py                 # the table below, on the GPU
    python benchmarks/decode_attention_bench.py --rep 200       # longer timing runs
    python benchmarks/decode_attention_bench.py --kv-cache-dtype fp8 --shapes llama-3-8b --cases 134:700
                                                                # an FP8 E4M3 cache (flash columns: n/a)
    python benchmarks/decode_attention_bench.py --kv-cache-dtype fp8 --block-n 128   # its tile at bf16's bytes

One decode step of ONE layer: every request has one query token and a context of `ctx` tokens
(current token included) in a paged bf16 cache of block 16 with shuffled block ids. Shapes:
Qwen2.5-0.5B (H=14, K=2, D=64) and Llama-3-8B (H=32, K=8, D=128), batch R in {1, 64, 256} at
ctx 512, and R=64 at ctx 2048. Timed (triton.testing.do_bench, median, L2 flushed before every
call, so the K/V really come from HBM):
- ours:   paged_decode_attention with choose_num_splits(R, K, max_model_len=ctx) (stage 1 + stage 2);
- gather: kv_cache.index_select(1, context_slots) of every request's context (the old path's copy;
          the slot indices are built once, outside the timing, as the planner did once per step);
- flash:  aten._flash_attention_forward varlen over the gathered context (cu_seqlens, causal,
          bottom-right aligned: for one query token the same as full attention);
- g+f:    gather then flash, the old path's per-layer cost.
GB/s counts the bytes that must be read: K and V of every context once (R * ctx * K * D * 2 * bytes of the
cache's dtype). "err" is max |out - reference| / max |reference| against reference_decode_attention (fp32)
over the values the cache holds (an FP8 cache's, widened).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "service"))
from graphcache.model import decode_attention  # noqa: E402
from graphcache.model.decode_attention import (  # noqa: E402
    choose_num_splits,
    decode_workspace,
    paged_decode_attention,
    reference_decode_attention,
)
from graphcache.model.kv_dtype import cache_dtype, to_cache  # noqa: E402

SHAPES = {  # name: (H, K, D)
    "qwen2.5-0.5b": (14, 2, 64),
    "llama-3-8b": (32, 8, 128),
}
CASES = [(1, 512), (64, 512), (256, 512), (64, 2048)]  # (R, ctx)
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
_FLASH = getattr(torch.ops.aten, "_flash_attention_forward", None)


def make_inputs(num_heads, num_kv_heads, head_dim, num_reqs, ctx, kv_dtype=DTYPE, seed=0):
    """The model's layout: one [2, slots, K, D] cache per layer (in kv_dtype), pages are views of it. Each
    request gets ctx tokens in ceil(ctx / block) blocks drawn from a shuffled permutation (plus spare blocks)."""
    gen = torch.Generator().manual_seed(seed)
    per_req = -(-ctx // BLOCK_SIZE)
    num_blocks = num_reqs * per_req + 16
    kv = torch.randn((2, num_blocks * BLOCK_SIZE, num_kv_heads, head_dim), generator=gen).to("cuda", DTYPE)
    kv = to_cache(kv, kv_dtype)  # as the cache stores them (E4M3, saturated, for an FP8 cache)
    k_cache = kv[0].view(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    v_cache = kv[1].view(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    ids = torch.randperm(num_blocks, generator=gen)[: num_reqs * per_req]
    tables = ids.view(num_reqs, per_req).to("cuda", torch.int32)  # [R, B]
    seq_lens = torch.full((num_reqs,), ctx, dtype=torch.int32, device="cuda")  # [R]
    q = torch.randn((num_reqs, num_heads, head_dim), generator=gen).to("cuda", DTYPE)  # [R, H, D]
    # old path: flat slots of every context position (request-major), cumulative lengths
    pos = torch.arange(ctx, device="cuda")
    slots = (tables.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).view(-1)  # [R * ctx]
    cu_q = torch.arange(num_reqs + 1, dtype=torch.int32, device="cuda")
    cu_k = cu_q * ctx
    return q, kv, k_cache, v_cache, tables, seq_lens, slots, cu_q, cu_k


def flash_varlen(q, k, v, cu_q, cu_k, max_k, scale):
    """q [R, H, D], k/v [total_k, K, D] gathered -> [R, H, D] (as attention.py's "flash" path)."""
    return _FLASH(
        q, k, v, cu_q, cu_k, 1, max_k, 0.0, True, False, scale=scale, window_size_left=-1, window_size_right=0
    )[0]


def rel_err(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def bench(fn, rep):
    from triton.testing import do_bench

    return do_bench(fn, warmup=max(5, rep // 4), rep=rep, return_mode="median") * 1e3  # us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rep", type=int, default=50, help="target ms of timed calls per measurement (do_bench)")
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="max_model_len for choose_num_splits (default: each case's ctx)",
    )
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16) or fp8 (E4M3; no flash columns)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="a subset of " + ", ".join(SHAPES))
    ap.add_argument(
        "--cases",
        default=",".join(f"{r}:{c}" for r, c in CASES),
        help="R:ctx pairs (decode rows : context tokens)",
    )
    ap.add_argument("--block-n", type=int, default=0, help="tokens per K/V tile (decode_attention.BLOCK_N)")
    ap.add_argument(
        "--num-stages", type=int, default=0, help="the tile loop's stages (decode_attention.NUM_STAGES)"
    )
    ap.add_argument(
        "--num-splits", type=int, default=0, help="KV splits of every case (default: choose_num_splits')"
    )
    ap.add_argument(
        "--num-warps", type=int, default=0, help="both stages' warps (decode_attention.NUM_WARPS)"
    )
    args = ap.parse_args()
    if args.block_n:  # both caches' tile (an FP8 cache's default: FP8_BLOCK_N)
        decode_attention.BLOCK_N = decode_attention.FP8_BLOCK_N = args.block_n
    if args.num_stages:
        decode_attention.NUM_STAGES = args.num_stages
    if args.num_warps:
        decode_attention.NUM_WARPS = args.num_warps
    kv_dtype = cache_dtype(args.kv_cache_dtype, DTYPE)
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    cases = [tuple(int(v) for v in case.split(":")) for case in args.cases.split(",")]
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    import triton

    flash = _FLASH is not None and kv_dtype == DTYPE  # FlashAttention takes 16-bit K/V only
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    print(
        f"{props.name}, {num_sms} SMs, torch {torch.__version__}, triton {triton.__version__}, "
        f"{DTYPE}, cache {kv_dtype}, block {BLOCK_SIZE}, "
        f"tile {decode_attention._block_n(128, kv_dtype)} tokens (head_dim 128), "
        f"{decode_attention.NUM_STAGES} stages, {decode_attention.NUM_WARPS} warps, "
        f"flash varlen: {'yes' if flash else 'n/a'}"
    )
    cols = (
        "shape",
        "R",
        "ctx",
        "splits",
        "MB",
        "ours us",
        "ours GB/s",
        "gather us",
        "flash us",
        "g+f us",
        "g+f GB/s",
        "speedup",
        "err ours",
        "err flash",
    )
    print(("{:>13} {:>4} {:>5} {:>6} {:>7} " + "{:>9} " * 9).format(*cols))
    for name, (num_heads, num_kv_heads, head_dim) in shapes.items():
        scale = head_dim**-0.5
        for num_reqs, ctx in cases:
            q, kv, k_cache, v_cache, tables, seq_lens, slots, cu_q, cu_k = make_inputs(
                num_heads, num_kv_heads, head_dim, num_reqs, ctx, kv_dtype
            )
            num_splits = args.num_splits or choose_num_splits(
                num_reqs, num_kv_heads, args.max_model_len or ctx, num_sms
            )
            ws = decode_workspace(num_reqs, num_heads, head_dim, num_splits, "cuda")
            out = torch.empty_like(q)

            def ours(
                q=q,
                k_cache=k_cache,
                v_cache=v_cache,
                tables=tables,
                seq_lens=seq_lens,
                out=out,
                scale=scale,
                ws=ws,
                num_splits=num_splits,
            ):
                paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, out, scale, ws, num_splits)

            ours()
            ref = reference_decode_attention(q, k_cache.to(DTYPE), v_cache.to(DTYPE), tables, seq_lens, scale)
            err_ours = rel_err(out, ref)
            mb = num_reqs * ctx * num_kv_heads * head_dim * 2 * kv.element_size() / 1e6
            t_ours = bench(ours, args.rep)

            t_gather = t_flash = t_both = float("nan")
            err_flash = float("nan")
            if flash:

                def gather(kv=kv, slots=slots):
                    return kv.index_select(1, slots).unbind(0)  # [R * ctx, K, D] each

                kc, vc = gather()
                try:
                    err_flash = rel_err(flash_varlen(q, kc, vc, cu_q, cu_k, ctx, scale), ref)

                    def flash(q=q, kc=kc, vc=vc, cu_q=cu_q, cu_k=cu_k, ctx=ctx, scale=scale):
                        flash_varlen(q, kc, vc, cu_q, cu_k, ctx, scale)

                    def both(q=q, cu_q=cu_q, cu_k=cu_k, ctx=ctx, scale=scale, gather=gather):
                        flash_varlen(q, *gather(), cu_q, cu_k, ctx, scale)

                    t_gather, t_flash = bench(gather, args.rep), bench(flash, args.rep)
                    t_both = bench(both, args.rep)
                except (RuntimeError, TypeError) as e:  # e.g. a torch whose op lacks these arguments
                    print(f"  flash varlen failed: {e}".splitlines()[0])
                del kc, vc
            row = "{:>13} {:>4} {:>5} {:>6} {:>7.1f} " + "{:>9.1f} " * 6 + "{:>8.2f}x {:>9.1e} {:>9.1e}"
            print(
                row.format(
                    name,
                    num_reqs,
                    ctx,
                    num_splits,
                    mb,
                    t_ours,
                    mb * 1e3 / t_ours,
                    t_gather,
                    t_flash,
                    t_both,
                    mb * 1e3 / t_both,
                    t_both / t_ours,
                    err_ours,
                    err_flash,
                )
            )
            del q, kv, k_cache, v_cache, ws, out, ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
