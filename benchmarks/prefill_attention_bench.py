"""Prefill attention, ONE layer call over fresh prompts (no cached prefix): every dense kernel this torch
has, against the unified Triton kernel the engine runs today (issue 41, item 3: >= 450 TFLOP/s at 8 x 1,024).

    python benchmarks/prefill_attention_bench.py --out prefill_attn.json
    python benchmarks/prefill_attention_bench.py --shapes llama-3-8b --batches 8x1024 --only unified,sdpa_cudnn

Cases: Llama-3-8B (H 32, K 8, D 128) and Qwen2.5-0.5B (H 14, K 2, D 64), bf16, causal, prefill batches
8x1024, 4x2048, 1x4096, 32x256 (sequences x tokens, all the same length). Candidates (each in try/except:
one that fails prints its reason and the table goes on):
  unified         model/unified_attention.py as the engine calls it for a pure-prefill step: packed q
                  [T, H, D], K/V in the paged cache (block --block-size, shuffled block ids) through the
                  block tables, query_start_loc / seq_lens / tables as the runner uploads them,
                  choose_config(G, D, max query len) as the planner picks it
  unified_m128    the same kernel with BLOCK_M 128, BLOCK_N 64, 8 warps, 3 stages (a bigger prefill tile)
  triton_dense    model/prefill_triton.py (the engine's prefill_attention=triton): FlashAttention-layout
                  tiles over packed [T, H, D] / [T, K, D], BLOCK_M 128, BLOCK_N 64, 8 warps, 3 stages;
                  _n128: BLOCK_N 128, 2 stages; _m64: BLOCK_M 64, 4 warps
  sdpa_<b>_gqa    torch SDPA under sdpa_kernel([<b>]) on [B, H, S, D] views, K/V [B, K, S, D], enable_gqa
  sdpa_<b>_rep    the same with K/V repeat_interleave'd to H heads (the copy is timed: the engine pays it)
                  for <b> in cudnn, flash, efficient
  flex            FlexAttention (torch.compile'd flex_attention, causal BlockMask, enable_gqa) on [B, H, S, D]
  flex_packed     the same over the packed [1, H, T, D] tokens with a causal + same-sequence mask (varlen)
  varlen          torch.nn.attention.varlen.varlen_attn on packed [T, H, D] (causal), where torch has it
  cudnn_varlen    aten._cudnn_attention_forward on packed [T, H, D] with cumulative lengths (cuDNN's
                  ragged layout), K/V [T, K, D] (native GQA), else repeated to H heads (_rep); not an
                  engine choice: 44-48 ms a call on the H100 with torch 2.11 / cuDNN 9.19 (BENCHMARKS.md §25)
  fa2_varlen      aten._flash_attention_forward on packed [T, H, D] / [T, K, D] (the engine's "flash")
  fa4_varlen      flash_attn.cute's flash_attn_varlen_func (flash-attn-4, sm90 forward kernel) where it
                  imports: not in the device image, and its nvidia-cutlass-dsl-libs-cu12/cu13 wheel (92 MB)
                  is over what one device call carries (64 MiB), so it normally fails "not installed"
  engine_<k>      model/prefill_attention.py's dense_prefill_attention as the engine runs it with
                  prefill_attention=<k> (triton, flash, sdpa), q/k/v strided views of one qkv output
Every candidate's time includes writing the packed [T, H, D] output the engine reads (a copy where the
kernel returns another layout). Dense candidates need equal lengths; the packed ones (unified, varlen,
cudnn_varlen, fa2_varlen, flex_packed) take any mix, as a real prefill step has.

Then the issue's mixed step (200 decode rows at contexts 100-1,500 + three fresh 416-token chunks), one
layer call: the unified kernel over every row (today) against split_<k>, what prefill_attention=<k> does
(the unified kernel over the decodes, the dense kernel over the chunks); printed first and again at the end.

FLOPs counted: causal, 4 * S^2 / 2 * H * D per sequence of S tokens (QK^T and PV, 2 FLOPs a MAC, half
the square). Time: CUDA events around each call, --iters calls after --warmup, the median. err: max abs
difference against an fp32 reference (torch math over upcast q/k/v) on the first --check sequences.
"target" is 450 TFLOP/s (issue 41).

The two numbers, 8B at 8 x 1,024 (one layer call): 68.7 GFLOP, so 0.087 ms at the 790 TFLOP/s measured
for bf16 matrix work and 0.153 ms at the 450 target; the fewest bytes (q, k, v read, out written) are 168 MB,
0.035 ms at 4.8 TB/s: compute-bound. By this count the issue's 28.3 ms for the unified kernel over a whole
8 x 1,024 prefill step (32 layers, 0.88 ms a call) is about 78 TFLOP/s, not 235: the "unified" row settles it. JSON of every row to --out (the gpu_check phase writes $OUT).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "service"))
from graphcache.model.prefill_attention import dense_prefill_attention, plan_dense_suffix  # noqa: E402
from graphcache.model.prefill_triton import DenseConfig, dense_causal_attention  # noqa: E402
from graphcache.model.unified_attention import (  # noqa: E402
    UnifiedConfig,
    choose_config,
    reference_unified_attention,
    unified_attention,
)

from benchmarks.gpu_timing import gpu_median_ms  # noqa: E402

SHAPES = {"llama-3-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}  # (H, K, D)
BATCHES = {"8x1024": (8, 1024), "4x2048": (4, 2048), "1x4096": (1, 4096), "32x256": (32, 256)}
TARGET_TFLOPS = 450.0
DTYPE = torch.bfloat16


class Case:
    """One prefill batch: packed q/k/v, the paged cache holding k/v, and the runner's step metadata."""

    def __init__(self, heads: tuple[int, int, int], seqs: int, seq_len: int, block_size: int, seed: int = 0):
        self.H, self.K, self.D = heads
        self.B, self.S = seqs, seq_len
        self.T = seqs * seq_len
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.q = torch.randn((self.T, self.H, self.D), generator=gen, device="cuda", dtype=DTYPE)  # [T, H, D]
        self.k = torch.randn((self.T, self.K, self.D), generator=gen, device="cuda", dtype=DTYPE)  # [T, K, D]
        self.v = torch.randn((self.T, self.K, self.D), generator=gen, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        self.scale = self.D**-0.5
        # Paged cache as the runner holds it: [num_blocks, block_size, K, D] pages, shuffled block ids.
        per_seq = -(-seq_len // block_size)
        num_blocks = seqs * per_seq + 1
        ids = torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1  # block 0: spare
        self.tables = ids.view(seqs, per_seq).to(torch.int64)  # [R, B]
        pos = torch.arange(seq_len, device="cuda")
        slots = (self.tables[:, pos // block_size] * block_size + pos % block_size).reshape(-1)  # [T]
        self.k_cache = torch.zeros((num_blocks * block_size, self.K, self.D), device="cuda", dtype=DTYPE)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.k_cache[slots] = self.k
        self.v_cache[slots] = self.v
        self.k_blocks = self.k_cache.view(num_blocks, block_size, self.K, self.D)
        self.v_blocks = self.v_cache.view(num_blocks, block_size, self.K, self.D)
        self.cu = (torch.arange(seqs + 1, device="cuda") * seq_len).to(torch.int32)  # [R + 1]
        self.seq_lens = torch.full((seqs,), seq_len, device="cuda", dtype=torch.int64)  # [R]
        self.flops = seqs * 4 * seq_len * seq_len / 2 * self.H * self.D

    def bhsd(self, x: torch.Tensor) -> torch.Tensor:
        """[T, h, D] packed -> [B, h, S, D] view (no copy)."""
        return x.view(self.B, self.S, x.shape[1], self.D).transpose(1, 2)

    def reference(self, check: int) -> torch.Tensor:
        """fp32 causal attention of the first `check` sequences: [check * S, H, D]."""
        g = self.H // self.K
        rows = []
        for b in range(min(check, self.B)):
            sl = slice(b * self.S, (b + 1) * self.S)
            q = self.q[sl].float().transpose(0, 1)  # [H, S, D]
            k = self.k[sl].float().repeat_interleave(g, dim=1).transpose(0, 1)
            v = self.v[sl].float().repeat_interleave(g, dim=1).transpose(0, 1)
            with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            rows.append(o.transpose(0, 1))
        return torch.cat(rows)


# --------------------------------------------------------------------------------------- candidates


def cand_unified(c: Case, config: UnifiedConfig | None) -> Callable[[], None]:
    cfg = config or choose_config(c.H // c.K, c.D, c.S)

    def run() -> None:
        unified_attention(c.q, c.k_blocks, c.v_blocks, c.out, c.cu, c.seq_lens, c.tables, c.scale, c.B, cfg)

    return run


def cand_triton_dense(c: Case, config: DenseConfig | None) -> Callable[[], None]:
    def run() -> None:
        dense_causal_attention(c.q, c.k, c.v, c.out, c.cu, c.B, c.scale, config)

    return run


def cand_sdpa(c: Case, backend: str, gqa: bool) -> Callable[[], None]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}.get(
        backend, SDPBackend.EFFICIENT_ATTENTION
    )
    q, out = c.bhsd(c.q), c.bhsd(c.out)
    g = c.H // c.K

    def run() -> None:
        with sdpa_kernel([b]):
            if gqa:
                o = F.scaled_dot_product_attention(
                    q, c.bhsd(c.k), c.bhsd(c.v), is_causal=True, scale=c.scale, enable_gqa=True
                )
            else:
                k = c.bhsd(c.k.repeat_interleave(g, dim=1))
                v = c.bhsd(c.v.repeat_interleave(g, dim=1))
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.scale)
        out.copy_(o)

    return run


_FLEX: dict[str, Callable] = {}


def _flex():
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def cand_flex(c: Case) -> Callable[[], None]:
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = create_block_mask(causal, B=None, H=None, Q_LEN=c.S, KV_LEN=c.S, device="cuda")
    fn = _flex()
    q, k, v, out = c.bhsd(c.q), c.bhsd(c.k), c.bhsd(c.v), c.bhsd(c.out)

    def run() -> None:
        out.copy_(fn(q, k, v, block_mask=mask, scale=c.scale, enable_gqa=True))

    return run


def cand_flex_packed(c: Case) -> Callable[[], None]:
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.arange(c.B, device="cuda").repeat_interleave(c.S)  # [T] sequence of each token

    def causal_same_seq(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

    mask = create_block_mask(causal_same_seq, B=None, H=None, Q_LEN=c.T, KV_LEN=c.T, device="cuda")
    fn = _flex()
    q = c.q.transpose(0, 1)[None]  # [1, H, T, D]
    k, v = c.k.transpose(0, 1)[None], c.v.transpose(0, 1)[None]
    out = c.out.transpose(0, 1)[None]

    def run() -> None:
        out.copy_(fn(q, k, v, block_mask=mask, scale=c.scale, enable_gqa=True))

    return run


def cand_varlen(c: Case) -> Callable[[], None]:
    from torch.nn.attention.varlen import varlen_attn  # ImportError: this torch has none

    params = inspect.signature(varlen_attn).parameters
    kw: dict = {"scale": c.scale} if "scale" in params else {}
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    g = c.H // c.K
    gqa = "enable_gqa" in params
    if gqa:
        kw["enable_gqa"] = True

    def run() -> None:
        k = c.k if gqa else c.k.repeat_interleave(g, dim=1)
        v = c.v if gqa else c.v.repeat_interleave(g, dim=1)
        c.out.copy_(varlen_attn(c.q, k, v, c.cu, c.cu, c.S, c.S, **kw))

    return run


def cand_cudnn_varlen(c: Case, gqa: bool) -> Callable[[], None]:
    op = torch.ops.aten._cudnn_attention_forward
    g = c.H // c.K

    def run() -> None:
        k = c.k if gqa else c.k.repeat_interleave(g, dim=1)
        v = c.v if gqa else c.v.repeat_interleave(g, dim=1)
        o = op(c.q, k, v, None, c.cu, c.cu, c.S, c.S, True, 0.0, True, False, scale=c.scale)[0]
        c.out.copy_(o.reshape(c.T, c.H, c.D))

    return run


def cand_engine(c: Case, kernel: str) -> Callable[[], None]:
    """model/prefill_attention.py as the engine runs it with prefill_attention=<kernel>: q/k/v strided
    views of one fused [T, (H + 2K) * D] projection output, as llama.Attention splits them."""
    qkv = torch.cat([c.q.view(c.T, -1), c.k.view(c.T, -1), c.v.view(c.T, -1)], dim=1)
    q, k, v = qkv.split([c.H * c.D, c.K * c.D, c.K * c.D], dim=-1)
    q, k, v = q.view(c.T, c.H, c.D), k.view(c.T, c.K, c.D), v.view(c.T, c.K, c.D)
    starts = [i * c.S for i in range(c.B + 1)]
    plan = plan_dense_suffix(kernel, starts, [c.S] * c.B, c.cu)
    assert plan is not None and plan.first_req == 0

    def run() -> None:
        dense_prefill_attention(q, k, v, c.out, plan, c.scale)

    return run


def cand_fa4_varlen(c: Case) -> Callable[[], None]:
    """FlashAttention 4 (flash-attn-4, CuTe DSL; it has a Hopper forward kernel), where installed."""
    from flash_attn.cute.interface import flash_attn_varlen_func  # ImportError: not on this machine

    def run() -> None:
        res = flash_attn_varlen_func(
            c.q, c.k, c.v, cu_seqlens_q=c.cu, cu_seqlens_k=c.cu, max_seqlen_q=c.S, max_seqlen_k=c.S,
            softmax_scale=c.scale, causal=True,
        )  # fmt: skip
        c.out.copy_(res[0] if isinstance(res, tuple) else res)

    return run


def cand_fa2_varlen(c: Case) -> Callable[[], None]:
    op = torch.ops.aten._flash_attention_forward

    def run() -> None:
        o = op(
            c.q, c.k, c.v, c.cu, c.cu, c.S, c.S, 0.0, True, False,
            scale=c.scale, window_size_left=-1, window_size_right=0,
        )[0]  # fmt: skip
        c.out.copy_(o)

    return run


CANDIDATES: dict[str, Callable[[Case], Callable[[], None]]] = {
    "unified": lambda c: cand_unified(c, None),
    "unified_m128": lambda c: cand_unified(
        c, UnifiedConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    ),
    "triton_dense": lambda c: cand_triton_dense(c, None),
    "triton_dense_n128": lambda c: cand_triton_dense(
        c, DenseConfig(block_m=128, block_n=128, num_warps=8, num_stages=2)
    ),
    "triton_dense_m64": lambda c: cand_triton_dense(
        c, DenseConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    ),
    "sdpa_cudnn_gqa": lambda c: cand_sdpa(c, "cudnn", True),
    "sdpa_cudnn_rep": lambda c: cand_sdpa(c, "cudnn", False),
    "sdpa_flash_gqa": lambda c: cand_sdpa(c, "flash", True),
    "sdpa_flash_rep": lambda c: cand_sdpa(c, "flash", False),
    "sdpa_efficient_gqa": lambda c: cand_sdpa(c, "efficient", True),
    "sdpa_efficient_rep": lambda c: cand_sdpa(c, "efficient", False),
    "flex": cand_flex,
    "flex_packed": cand_flex_packed,
    "varlen": cand_varlen,
    "cudnn_varlen": lambda c: cand_cudnn_varlen(c, True),
    "cudnn_varlen_rep": lambda c: cand_cudnn_varlen(c, False),
    "fa2_varlen": cand_fa2_varlen,
    "fa4_varlen": cand_fa4_varlen,
    "engine_triton": lambda c: cand_engine(c, "triton"),
    "engine_flash": lambda c: cand_engine(c, "flash"),
    "engine_sdpa": lambda c: cand_engine(c, "sdpa"),
}
PACKED = {
    "unified",
    "unified_m128",
    "triton_dense",
    "triton_dense_n128",
    "triton_dense_m64",
    "flex_packed",
    "varlen",
    "cudnn_varlen",
    "cudnn_varlen_rep",
    "fa2_varlen",
    "fa4_varlen",
    "engine_triton",
    "engine_flash",
    "engine_sdpa",
}


def mixed_step(
    heads: tuple[int, int, int], block_size: int, args, decodes: int = 200, chunk: int = 416
) -> list[dict]:
    """The issue's mixed step: 200 decode rows at contexts 100-1,500 plus three fresh 416-token prompt
    chunks (1,448 tokens), as the engine lays it out (decodes first). Times the unified kernel over every
    row (today) against the split the prefill_attention setting makes: the unified kernel over the
    decodes, a dense kernel over the chunks. err: max abs against the fp32 reference over every row."""
    num_heads, num_kv_heads, dim = heads
    group = num_heads // num_kv_heads
    gen = torch.Generator(device="cuda").manual_seed(1)
    q_lens = [1] * decodes + [chunk] * 3
    seq_lens = [100 + (i * 137) % 1400 for i in range(decodes)] + [chunk] * 3
    per = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per) + 1
    ids = (torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1).tolist()
    tables = torch.zeros((len(per), max(per)), dtype=torch.int64)
    nxt = 0
    for r, nb in enumerate(per):
        tables[r, :nb] = torch.tensor(ids[nxt : nxt + nb])
        nxt += nb
    tables = tables.to("cuda")
    kv = torch.randn(
        (2, num_blocks * block_size, num_kv_heads, dim), generator=gen, device="cuda", dtype=DTYPE
    )
    kb = kv[0].view(num_blocks, block_size, num_kv_heads, dim)
    vb = kv[1].view(num_blocks, block_size, num_kv_heads, dim)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    t = starts[-1]
    # This step's k/v rows: each row's own position in its request's context, read back from the cache.
    slot_of = []
    for r, (n, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(s - n, s, device="cuda")
        slot_of.append(tables[r, pos // block_size] * block_size + pos % block_size)
    slots = torch.cat(slot_of)  # [T]
    k, v = kv[0][slots], kv[1][slots]  # [T, K, D]
    q = torch.randn((t, num_heads, dim), generator=gen, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    cu = torch.tensor(starts, device="cuda", dtype=torch.int32)
    lens = torch.tensor(seq_lens, device="cuda")
    scale = dim**-0.5
    ref = reference_unified_attention(q, kb, vb, cu, lens, tables, scale, len(q_lens))

    def unified_all() -> None:
        unified_attention(
            q, kb, vb, out, cu, lens, tables, scale, len(q_lens), choose_config(group, dim, chunk)
        )

    def split(kernel: str) -> Callable[[], None]:
        plan = plan_dense_suffix(kernel, starts, seq_lens, cu)
        assert plan is not None and plan.first_req == decodes
        head_cfg = choose_config(group, dim, 1)

        def run() -> None:
            unified_attention(
                q[: plan.start], kb, vb, out[: plan.start], cu, lens, tables, scale, decodes, head_cfg
            )
            dense_prefill_attention(q, k, v, out, plan, scale)

        return run

    rows = []
    factories: dict[str, Callable[[], Callable[[], None]]] = {"unified": lambda: unified_all}
    for kn in ("triton", "flash"):
        factories[f"split_{kn}"] = lambda kn=kn: split(kn)
    for name, factory in factories.items():
        row: dict = {"candidate": name}
        try:
            run = factory()
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            row["max_abs_err"] = (out.float() - ref).abs().max().item()
            row["ms"] = time_ms(run, args.warmup, args.iters)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        torch.cuda.synchronize()
        rows.append(row)
    return rows


def time_ms(run: Callable[[], None], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    return gpu_median_ms(run, iters)


def measure(c: Case, name: str, ref: torch.Tensor, args) -> dict:
    row: dict = {"candidate": name, "varlen": name in PACKED}
    if time.monotonic() > args.stop_at:
        row["error"] = f"skipped: past --budget-s {args.budget_s}"
        return row
    try:
        run = CANDIDATES[name](c)
        c.out.fill_(float("nan"))  # poisoned: an unwritten row shows as NaN error
        run()
        torch.cuda.synchronize()
        got = c.out[: ref.shape[0]].float()
        err = (got - ref).abs().max().item()
        row["max_abs_err"] = err
        ms = time_ms(run, args.warmup, args.iters)
        row["ms"] = ms
        row["tflops"] = c.flops / (ms * 1e-3) / 1e12
        if not err < args.tol:  # NaN fails too
            row["note"] = f"err {err:.3g} over {args.tol}"
    except Exception as exc:  # a candidate this torch/GPU refuses: say why, keep going
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        if args.verbose:
            traceback.print_exc()
    finally:
        torch.cuda.synchronize()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default=",".join(BATCHES))
    ap.add_argument("--only", default="", help="comma-separated candidates (default: all)")
    ap.add_argument(
        "--block-size", type=int, default=16, help="KV block size of the paged cache (engine default)"
    )
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--check", type=int, default=2, help="sequences compared against the fp32 reference")
    ap.add_argument("--tol", type=float, default=2e-2, help="max abs error that counts as correct (bf16)")
    ap.add_argument("--out", default="", help="JSON file of every row")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=220,
        help="seconds after which candidates left are skipped (the table still prints)",
    )
    ap.add_argument("--no-mixed", dest="mixed", action="store_false", help="skip the mixed-step split table")
    ap.add_argument("--verbose", action="store_true", help="print each failure's traceback")
    args = ap.parse_args()
    args.stop_at = time.monotonic() + args.budget_s
    names = [n for n in (args.only.split(",") if args.only else CANDIDATES) if n]
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}"
    )
    print("FLOPs: causal, 4 * S^2/2 * H * D per sequence; time: CUDA events, median; err: max abs vs fp32")
    results = []
    # The mixed step first: a few seconds, and what the engine setting would change on a real step.
    mixed = []
    for shape in args.shapes.split(",") if args.mixed else ():
        for row in mixed_step(SHAPES[shape], args.block_size, args):
            mixed.append({"shape": shape, "batch": "mixed", **row})
    print_mixed(mixed)
    results.extend(mixed)
    # The library kernels and the unified one first; then this repo's new Triton kernel (a fault there
    # would poison the CUDA context for whatever runs after it); FlexAttention last, as it compiles once
    # per shape (tens of seconds) and a run cut short by --budget-s should keep every other row.
    ours = [n for n in names if "triton" in n]
    flex = [n for n in names if n.startswith("flex")]
    for group in ([n for n in names if n not in ours and n not in flex], ours, flex):
        for shape in args.shapes.split(",") if group else ():
            for batch in args.batches.split(","):
                seqs, seq_len = BATCHES[batch]
                c = Case(SHAPES[shape], seqs, seq_len, args.block_size)
                ref = c.reference(args.check)
                for name in group:
                    row = {"shape": shape, "batch": batch, **measure(c, name, ref, args)}
                    results.append(row)
                    print(_line(row), flush=True)
                del c, ref
                save(
                    args.out, results
                )  # after every case: a run killed by its timeout keeps what it measured
                torch.cuda.empty_cache()
    print()
    print_matrix(results, args.shapes.split(","), args.batches.split(","), names)
    print_mixed(mixed)
    print("best correct candidate per case (varlen = takes packed sequences of any lengths):")
    for shape in args.shapes.split(","):
        for batch in args.batches.split(","):
            rows = [r for r in results if r["shape"] == shape and r["batch"] == batch and "tflops" in r]
            ok = [r for r in rows if "note" not in r]
            base = next((r for r in rows if r["candidate"] == "unified"), None)
            for label, pool in (("any", ok), ("varlen", [r for r in ok if r["varlen"]])):
                if not pool:
                    continue
                best = max(pool, key=lambda r: r["tflops"])
                speedup = f", {base['ms'] / best['ms']:.2f}x unified" if base else ""
                hit = "meets" if best["tflops"] >= TARGET_TFLOPS else "misses"
                print(
                    f"  {shape:<13} {batch:<7} {label:<6} {best['candidate']:<19} {best['tflops']:7.1f} TFLOP/s "
                    f"({hit} {TARGET_TFLOPS:.0f}{speedup})"
                )
    if args.out:
        save(args.out, results)


def save(path: str, results: list[dict]) -> None:
    if path:
        Path(path).write_text(json.dumps({"torch": torch.__version__, "rows": results}, indent=1))


def print_mixed(rows: list[dict]) -> None:
    if rows:
        print("mixed step: 200 decodes (contexts 100-1,500) + 3 fresh 416-token chunks, one layer call:")
    for row in rows:
        if "error" in row:
            print(f"  {row['shape']:<13} {row['candidate']:<14} FAILED {row['error']}")
        else:
            print(
                f"  {row['shape']:<13} {row['candidate']:<14} {row['ms']:8.3f} ms  err {row['max_abs_err']:.2e}"
            )


def print_matrix(results: list[dict], shapes: list[str], batches: list[str], names: list[str]) -> None:
    """TFLOP/s per candidate (rows) and batch (columns), one block per shape; '*' marks an error over
    --tol, '-' a failure (reasons listed once after the blocks)."""
    cell = {(r["shape"], r["batch"], r["candidate"]): r for r in results}
    reasons: dict[str, str] = {}
    for shape in shapes:
        print(f"{shape + ' TFLOP/s':<22}" + "".join(f"{b:>9}" for b in batches))
        for name in names:
            cols = []
            for b in batches:
                r = cell.get((shape, b, name), {})
                if "tflops" in r:
                    cols.append(f"{r['tflops']:8.1f}{'*' if 'note' in r else ' '}")
                else:
                    cols.append(f"{'-':>8} ")
                    reasons.setdefault(name, r.get("error", "not run"))
            print(f"  {name:<20}" + "".join(cols))
    for name, why in reasons.items():
        print(f"  - {name}: {why}")


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['shape']:<13} {row['batch']:<7} {row['candidate']:<19} {'-':>8} {'-':>8} {'-':>9}  FAILED {row['error']}"
    return (
        f"{row['shape']:<13} {row['batch']:<7} {row['candidate']:<19} {row['ms']:8.3f} {row['tflops']:8.1f} "
        f"{row['max_abs_err']:9.2e}  {row.get('note', '')}"
    )


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit(
            "prefill_attention_bench needs CUDA (run it through scripts/gpu_check.sh PHASES=prefill_attn)"
        )
    main()
