"""Mixed-step attention, ONE layer call: the unified Triton kernel vs gather + FlashAttention varlen
(attention.py's "flash") vs FlashAttention over the pages ("flash_paged", block 256) vs, for pure
decode, the uniform-decode Triton kernel.

    python benchmarks/mixed_attention_bench.py                       # the table, on the GPU
    python benchmarks/mixed_attention_bench.py --block-m 32 --block-n 64 --num-warps 8
    python benchmarks/mixed_attention_bench.py --sweep               # best tile shape per case
    python benchmarks/mixed_attention_bench.py --kv-cache-dtype fp8  # an FP8 E4M3 cache (no flash columns)

Cases (bf16, paged cache of --block-size with shuffled block ids; decode contexts 512):
  64d+192c    64 decode rows + one 192-token chunk over a 320-token cached prefix (seq_len 512)
  240d+1024c  240 decode rows + one fresh 1,024-token chunk
  256d        256 decode rows
  8x1024      8 fresh prefills of 1,024 tokens
at Qwen2.5-0.5B (H 14, K 2, D 64) and Llama-3-8B (H 32, K 8, D 128). Times: triton.testing.do_bench
(CUDA events, median, L2 flushed before every call), in ms per layer call. "bound" is the larger of
bytes / 4.8 TB/s (K/V of every context once, q read and out written once) and FLOPs / 790 TFLOP/s
(4 * H * D per visible (query, key) pair, causal); "x bound" = triton time over it. "err" is the
relative Frobenius error of the triton output against an fp32 torch reference. "launch us" is the
wall time per unified_attention call over 200 back-to-back calls (one sync at the end): the larger of
its host cost (Python + Triton launcher, paid per layer in the eager break) and its GPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "service"))
from graphcache.model.decode_attention import (  # noqa: E402
    choose_num_splits,
    decode_workspace,
    paged_decode_attention,
)
from graphcache.model.kv_dtype import cache_dtype, to_cache  # noqa: E402
from graphcache.model.unified_attention import (  # noqa: E402
    UnifiedConfig,
    choose_config,
    reference_unified_attention,
    unified_attention,
)

SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "llama-3-8b": (32, 8, 128)}  # (H, K, D)
CASES = {  # name: [(query_len, seq_len)] per request
    "64d+192c": [(1, 512)] * 64 + [(192, 512)],
    "240d+1024c": [(1, 512)] * 240 + [(1024, 1024)],
    "256d": [(1, 512)] * 256,
    "8x1024": [(1024, 1024)] * 8,
}
DTYPE = torch.bfloat16
HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS = 790e12
_FLASH = getattr(torch.ops.aten, "_flash_attention_forward", None)
_FLASH_PAGES = _FLASH is not None and "block_table" in str(_FLASH.default._schema)


class Step:
    """One step's tensors in the model's layout: a [2, slots, K, D] cache whose pages are views."""

    def __init__(self, heads, reqs, block_size, kv_dtype=DTYPE, seed=0):
        num_heads, num_kv_heads, head_dim = heads
        gen = torch.Generator().manual_seed(seed)
        per_req = [-(-s // block_size) for _, s in reqs]
        num_blocks = sum(per_req) + 8
        kv = torch.randn((2, num_blocks * block_size, num_kv_heads, head_dim), generator=gen).to(
            "cuda", DTYPE
        )
        self.kv = to_cache(kv, kv_dtype)  # as the cache stores them (E4M3, saturated, for an FP8 cache)
        self.k_blocks = self.kv[0].view(num_blocks, block_size, num_kv_heads, head_dim)
        self.v_blocks = self.kv[1].view(num_blocks, block_size, num_kv_heads, head_dim)
        ids = torch.randperm(num_blocks, generator=gen)
        tables = torch.zeros((len(reqs), max(per_req)), dtype=torch.int64)
        nxt = 0
        for r, nb in enumerate(per_req):
            tables[r, :nb] = ids[nxt : nxt + nb]
            nxt += nb
        self.tables = tables.to("cuda")  # [R, B] int64
        self.tables32 = self.tables.to(torch.int32)
        q_lens = [n for n, _ in reqs]
        seq_lens = [s for _, s in reqs]
        self.num_reqs, self.num_tokens, self.max_q, self.max_k = (
            len(reqs),
            sum(q_lens),
            max(q_lens),
            max(seq_lens),
        )
        self.seq_lens = torch.tensor(seq_lens, device="cuda")  # [R] int64
        self.seq_lens32 = self.seq_lens.to(torch.int32)
        self.cu_q = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)  # [R + 1]
        self.cu_k = torch.tensor([0] + seq_lens, device="cuda").cumsum(0).to(torch.int32)
        self.q = torch.randn((self.num_tokens, num_heads, head_dim), generator=gen).to("cuda", DTYPE)
        self.out = torch.empty_like(self.q)
        # The gather path's slot list, built once outside the timing (the planner builds it once a step).
        self.slots = torch.cat(
            [
                (
                    self.tables[r, torch.arange(s, device="cuda") // block_size] * block_size
                    + torch.arange(s, device="cuda") % block_size
                )
                for r, s in enumerate(seq_lens)
            ]
        )
        self.scale = head_dim**-0.5
        pairs = sum(n * (s - n) + n * (n + 1) // 2 for n, s in reqs)
        self.flops = 4 * num_heads * head_dim * pairs
        self.bytes = (  # K and V of every context once in the cache's dtype; q read and out written in bf16
            sum(seq_lens) * num_kv_heads * head_dim * 2 * self.kv.element_size()
            + 2 * self.num_tokens * num_heads * head_dim * 2
        )


def bench(fn, rep):
    from triton.testing import do_bench

    return do_bench(fn, warmup=max(5, rep // 4), rep=rep, return_mode="median")  # ms


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def flash_call(st: Step, k, v, **paged):
    return _FLASH(
        st.q,
        k,
        v,
        st.cu_q,
        st.cu_k,
        st.max_q,
        st.max_k,
        0.0,
        True,
        False,
        scale=st.scale,
        window_size_left=-1,
        window_size_right=0,
        **paged,
    )[0]


def time_triton(st: Step, config, rep):
    def run():
        unified_attention(
            st.q,
            st.k_blocks,
            st.v_blocks,
            st.out,
            st.cu_q,
            st.seq_lens,
            st.tables,
            st.scale,
            st.num_reqs,
            config,
        )

    run()
    return bench(run, rep)


def launch_us(st: Step, config, calls=200):
    def run():
        unified_attention(
            st.q,
            st.k_blocks,
            st.v_blocks,
            st.out,
            st.cu_q,
            st.seq_lens,
            st.tables,
            st.scale,
            st.num_reqs,
            config,
        )

    run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rep", type=int, default=50, help="target ms of timed calls per measurement (do_bench)")
    ap.add_argument("--block-size", type=int, default=16, help="KV block size of the triton and gather paths")
    ap.add_argument(
        "--block-m", type=int, default=0, help="unified kernel: query rows per tile (0: choose_config)"
    )
    ap.add_argument("--block-n", type=int, default=0, help="unified kernel: K/V tokens per inner tile")
    ap.add_argument("--num-warps", type=int, default=0)
    ap.add_argument("--num-stages", type=int, default=0)
    ap.add_argument(
        "--sweep", action="store_true", help="also time a grid of tile shapes; print the best per case"
    )
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16) or fp8 (E4M3; no flash columns)")
    args = ap.parse_args()
    kv_dtype = cache_dtype(args.kv_cache_dtype, DTYPE)
    flash, flash_pages = (_FLASH is not None, _FLASH_PAGES) if kv_dtype == DTYPE else (False, False)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    import triton

    props = torch.cuda.get_device_properties(0)
    print(
        f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}, "
        f"{DTYPE}, cache {kv_dtype}, block {args.block_size}, flash varlen: {flash}, flash paged: {flash_pages}"
    )
    head = (
        "shape",
        "case",
        "tokens",
        "bound ms",
        "triton ms",
        "x bound",
        "tile",
        "gather ms",
        "g+flash ms",
        "f_paged ms",
        "decode ms",
        "vs g+f",
        "err",
        "launch us",
    )
    fmt = "{:>13} {:>11} {:>6} {:>9} {:>9} {:>7} {:>12} {:>9} {:>10} {:>10} {:>9} {:>7} {:>8} {:>9}"
    print(fmt.format(*head))
    sweeps = []
    for shape in args.shapes.split(","):
        heads = SHAPES[shape]
        group = heads[0] // heads[1]
        for case in args.cases.split(","):
            reqs = CASES[case]
            st = Step(heads, reqs, args.block_size, kv_dtype)
            base = choose_config(group, heads[2], st.max_q, torch.empty((), dtype=kv_dtype).element_size())
            config = UnifiedConfig(
                block_m=args.block_m or base.block_m,
                block_n=args.block_n or base.block_n,
                num_warps=args.num_warps or base.num_warps,
                num_stages=args.num_stages or base.num_stages,
            )
            t_triton = time_triton(st, config, args.rep)
            k_ref, v_ref = st.k_blocks.to(DTYPE), st.v_blocks.to(DTYPE)  # the values the cache holds
            ref = reference_unified_attention(
                st.q, k_ref, v_ref, st.cu_q, st.seq_lens, st.tables, st.scale, st.num_reqs
            )
            del k_ref, v_ref
            err = rel_err(st.out, ref)
            del ref
            bound = max(st.bytes / HBM_BYTES_PER_S, st.flops / BF16_FLOPS) * 1e3
            t_gather = t_gf = t_paged = t_decode = float("nan")
            if flash:

                def gather(st=st):
                    return st.kv.index_select(1, st.slots).unbind(0)  # [sum(L), K, D] each

                def gf(st=st, gather=gather):
                    flash_call(st, *gather())

                gf()
                t_gather, t_gf = bench(gather, args.rep), bench(gf, args.rep)
            if flash_pages:
                pst = Step(heads, reqs, 256)

                def paged(pst=pst):
                    flash_call(
                        pst, pst.k_blocks, pst.v_blocks, seqused_k=pst.seq_lens32, block_table=pst.tables32
                    )

                try:
                    paged()
                    t_paged = bench(paged, args.rep)
                except (RuntimeError, TypeError) as e:
                    print(f"  flash_paged failed: {e}".splitlines()[0])
                del pst
            if st.max_q == 1:  # the uniform-decode kernel, as decode steps run it
                splits = choose_num_splits(st.num_reqs, heads[1], st.max_k, props.multi_processor_count)
                ws = decode_workspace(st.num_reqs, heads[0], heads[2], splits, "cuda")

                def decode(st=st, ws=ws, splits=splits):
                    paged_decode_attention(
                        st.q, st.k_blocks, st.v_blocks, st.tables, st.seq_lens, st.out, st.scale, ws, splits
                    )

                decode()
                t_decode = bench(decode, args.rep)
            tile = f"{config.block_m}/{config.block_n}/w{config.num_warps}s{config.num_stages}"
            print(
                fmt.format(
                    shape,
                    case,
                    st.num_tokens,
                    f"{bound:.4f}",
                    f"{t_triton:.4f}",
                    f"{t_triton / bound:.2f}",
                    tile,
                    f"{t_gather:.4f}",
                    f"{t_gf:.4f}",
                    f"{t_paged:.4f}",
                    f"{t_decode:.4f}",
                    f"{t_gf / t_triton:.2f}x",
                    f"{err:.1e}",
                    f"{launch_us(st, config):.1f}",
                )
            )
            if args.sweep:
                best = min(
                    ((time_triton(st, c, args.rep), c) for c in sweep_configs(group)), key=lambda tc: tc[0]
                )
                sweeps.append((shape, case, bound, best))
            del st
            torch.cuda.empty_cache()
    if sweeps:
        print("\nsweep: best tile per case (block_m/block_n/warps/stages)")
        for shape, case, bound, (t, c) in sweeps:
            print(
                f"{shape:>13} {case:>11} {t:.4f} ms ({t / bound:.2f}x bound) "
                f"{c.block_m}/{c.block_n}/w{c.num_warps}s{c.num_stages}"
            )


def sweep_configs(group: int):
    for block_m in (16, 32, 64, 128):
        if block_m < group:
            continue
        for block_n in (32, 64, 128):
            for num_warps in (4, 8):
                for num_stages in (2, 3):
                    yield UnifiedConfig(block_m, block_n, num_warps, num_stages)


if __name__ == "__main__":
    main()
