"""Decode-sized FP8 GEMMs (M <= 16 rows) on the Llama-3-8B linear shapes: which kernel design streams W fastest.

  python benchmarks/fp8_gemv_sweep.py --out sweep.json      # CUDA (H200): the whole sweep, ~2-3 min
  python benchmarks/fp8_gemv_sweep.py --smoke               # CPU: Triton's interpreter, each design once

At M <= 16 a GEMM is bound by reading W once (W [N, K] fp8: N * K bytes over ~4.8 TB/s), so each
design is timed per shape and reported as weight GB/s. Weights rotate over enough copies (> 4x the
50 MB L2) that every call reads HBM; calls are replays of one CUDA graph (no launch gaps counted,
the gaps between kernels of a graph are). Designs, each a tile sweep (BLOCK_N, BLOCK_K, warps, stages),
against torch.mm on bf16 weights (cuBLAS; the bf16 decode's GEMMs) and torch._scaled_mm (rowwise):
  quant    fp8 x fp8 tl.dot, x quantized per row inside the kernel (the decode path before this sweep)
  prequant fp8 x fp8 tl.dot on an x quantized before (what a producer kernel that quantizes would leave)
  dequant  W converted to bf16 in registers, bf16 tl.dot with x as it is (fp8_gemm's path up to 16 rows)
  fma      (M = 1) W converted to fp32, multiply-add and a sum over each K tile, no tensor cores
  fma2     (M = 1) fma with a [BLOCK_N, BLOCK_K] fp32 accumulator summed once after the loop (no
           cross-warp reduction, so no barrier, inside the loop) (fp8_gemm's ONE_ROW)
  split    dequant with K split over SPLIT_K programs, fp32 atomics into a zeroed buffer (+ zero, cast)
  prod     fp8_gemm's own kernel (weight_only_mm) with its one-row tile set to the variant's
  gated    (gate_up, M = 1) the same with silu(gate) * up in its epilogue (weight_only_silu_mul)
--chain: the four GEMMs of a layer back to back as the model runs them at one row (qkv -> o -> gate_up with
its activation -> down -> the next layer's qkv: each reads the one before), per layer, with and without
programmatic dependent launch (fp8_gemm.PDL). M = 1 runs every design, more rows dequant only (to fit one
device call). The last lines name the dequant tile with the least summed time over the four shapes at M = 1 (fp8_gemm.DECODE_TILE's pick).
Every design's output is checked against the fp32 product of the same operands first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
if "--smoke" in sys.argv:  # before triton is imported: the kernel runs in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from graphcache.model import fp8_gemm  # noqa: E402
from graphcache.model.fp8_quant import MIN_SCALE, quantize_rows  # noqa: E402
from graphcache.model.triton_support import tl, triton  # noqa: E402

from benchmarks.fp8_bench import weight_copies  # noqa: E402
from benchmarks.gpu_timing import graph_us  # noqa: E402

SHAPES = {
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
}
MODES = {"quant": 0, "dequant": 1, "fma": 2, "prequant": 3, "fma2": 4}


@triton.jit(do_not_specialize=["M"])
def _sweep_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sw_ptr,
    sa_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    min_scale,
    MODE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # x [M, K] bf16, w [N, K] fp8 row-major read as [BLOCK_K, BLOCK_N] tiles, sw [N] fp32; out [M, N]
    # (bf16, or fp32 accumulated atomically when SPLIT_K > 1). K % (BLOCK_K * SPLIT_K) == 0 assumed.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_len = K // SPLIT_K
    k0 = pid_k * k_len
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + k0 + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + k0 + offs_k[:, None]
    if MODE == 0:
        running = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for j in range(0, K // BLOCK_K):
            xa = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + j * BLOCK_K + offs_k[None, :], mask=m_mask[:, None]
            )
            running = tl.maximum(running, tl.abs(xa.to(tl.float32)))
        sa = tl.maximum(tl.max(running, axis=1) / 448.0, min_scale)
        inv = 1.0 / sa
    if MODE == 2:
        acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        x1_ptrs = x_ptr + k0 + offs_k
        for _ in range(0, k_len // BLOCK_K):
            x1 = tl.load(x1_ptrs).to(tl.float32)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
            acc1 += tl.sum(w.to(tl.float32) * x1[:, None], axis=0)
            x1_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        sw = tl.load(sw_ptr + offs_n, mask=n_mask, other=0.0)
        tl.store(out_ptr + offs_n, (acc1 * sw).to(out_ptr.dtype.element_ty), mask=n_mask)
    elif MODE == 4:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        x2_ptrs = x_ptr + k0 + offs_k
        w2_ptrs = w_ptr + offs_n[:, None] * stride_wn + k0 + offs_k[None, :]
        for _ in range(0, k_len // BLOCK_K):
            x2 = tl.load(x2_ptrs).to(tl.float32)
            w2 = tl.load(w2_ptrs, mask=n_mask[:, None], other=0.0)
            acc2 += w2.to(tl.float32) * x2[None, :]
            x2_ptrs += BLOCK_K
            w2_ptrs += BLOCK_K
        sw = tl.load(sw_ptr + offs_n, mask=n_mask, other=0.0)
        tl.store(out_ptr + offs_n, (tl.sum(acc2, axis=1) * sw).to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, k_len // BLOCK_K):
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
            if MODE == 3:
                acc = tl.dot(x, w, acc)
            elif MODE == 0:
                xq = tl.clamp(x.to(tl.float32) * inv[:, None], -448.0, 448.0).to(w_ptr.dtype.element_ty)
                acc = tl.dot(xq, w, acc)
            else:
                acc = tl.dot(x, w.to(x.dtype), acc)  # e4m3 values are exact in bf16 (and fp16)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        sw = tl.load(sw_ptr + offs_n, mask=n_mask, other=0.0)
        acc = acc * sw[None, :]
        if MODE == 0:
            acc = acc * sa[:, None]
        if MODE == 3:
            acc = acc * tl.load(sa_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
        o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        o_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            tl.atomic_add(o_ptrs, acc, mask=o_mask)


def launch(x, wq, sw, mode: str, tile, split: int = 1, sa=None, out_dtype=None) -> torch.Tensor:
    """prequant: x is already fp8 with scales sa [M] (the other designs take the 16-bit x)."""
    m, k = x.shape
    n = wq.shape[0]
    block_n, block_k, warps, stages = tile
    out_dtype = out_dtype or x.dtype
    out = (
        torch.zeros((m, n), dtype=torch.float32, device=x.device)
        if split > 1
        else torch.empty((m, n), dtype=out_dtype, device=x.device)
    )
    _sweep_kernel[(triton.cdiv(n, block_n), split)](
        x, wq, out, sw, sw if sa is None else sa, m, n, k, x.stride(0), wq.stride(0), out.stride(0), MIN_SCALE,
        MODE=MODES[mode], SPLIT_K=split, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out.to(out_dtype) if split > 1 else out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def sweep_shape(name, n, k, rows, plan: dict, cuda: bool) -> list[dict]:
    dev = "cuda" if cuda else "cpu"
    ws, qs = weight_copies(n, k, dev)
    out: list[dict] = []
    for m in rows:
        # Triton's interpreter multiplies bf16 wrongly (numpy has no bf16): fp16 operands there.
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16 if cuda else torch.float16)
        out += sweep_rows(name, x, ws, qs, plan, cuda)
    return out


def sweep_rows(name, x, ws, qs, plan: dict, cuda: bool) -> list[dict]:
    """Every design of plan ({design: [(tile, split)]}) on x [M, K] against the rotating weights ws (bf16)
    and qs (fp8, scales). A variant that fails (a tile over the shared memory, say) is recorded as such."""
    (m, k), n, copies, out = x.shape, ws[0].shape[0], len(ws), []
    wd = (qs[0][0].float() * qs[0][1]).t()
    ref = x.float() @ wd
    xq, sa = quantize_rows(x.float())
    ref_quant = (xq.float() * sa) @ wd  # what the quant designs compute: x rounded to fp8 per row
    xq8, sa8 = quantize_rows(x, fused=cuda)  # prequant's input: x quantized before (by its producer)

    def call(design, tile, split, i):
        if design in ("prod", "gated"):
            attr = "GATED_ONE_ROW_TILE" if design == "gated" else "ONE_ROW_TILE"
            setattr(fp8_gemm, attr, tile)
            mm = fp8_gemm.weight_only_silu_mul if design == "gated" else fp8_gemm.weight_only_mm
            return mm(x, *qs[i], x.dtype)
        if design == "bf16_mm":
            return torch.mm(x, ws[i].t())
        if design == "scaled_mm":
            return _scaled(x, *qs[i])
        if design == "prequant":
            return launch(xq8, *qs[i], "prequant", tile, sa=sa8.view(-1), out_dtype=x.dtype)
        return launch(x, *qs[i], "dequant" if design == "split" else design, tile, split)

    for design, variants in plan.items():
        for tile, split in variants:
            if (design.startswith("fma") and m != 1) or k % ((tile[1] if tile else 1) * split):
                continue
            if design == "gated" and name not in ("gate_up_proj", "tiny"):
                continue
            row = {"layer": name, "n": n, "k": k, "m": m, "design": design, "tile": tile, "split": split}
            try:
                got = call(design, tile, split, 0)
                want = ref_quant if design in ("quant", "prequant", "scaled_mm") else ref
                if design == "gated":  # silu(gate) * up of the fp32 product
                    g, u = ref.split(n // 2, dim=-1)
                    want = torch.nn.functional.silu(g) * u
                row["rel_err"] = rel_err(got, want)
                fns = [lambda i=i, d=design, t=tile, s=split: call(d, t, s, i) for i in range(copies)]
                row["us"] = graph_us(fns, reps=max(1, 24 // copies)) if cuda else 0.0
            except Exception as exc:  # noqa: BLE001 - a variant the GPU cannot run is a result too
                row.update(rel_err=None, us=None, error=f"{type(exc).__name__}: {str(exc)[:120]}")
            row["weight_gb_s"] = n * k / row["us"] / 1e3 if row.get("us") else 0.0
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def chain_us(layers: int = 32) -> list[dict]:
    """us per layer of `layers` layers' four one-row GEMMs in one CUDA graph (each layer its own weights,
    enough copies to overflow the L2), data flowing layer to layer, PDL off and on."""
    qs = {name: weight_copies(n, k)[1] for name, (n, k) in SHAPES.items()}
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)

    def run():
        h = x
        for i in range(layers):
            qkv = fp8_gemm.weight_only_mm(h, *qs["qkv_proj"][i % len(qs["qkv_proj"])], h.dtype)
            o = fp8_gemm.weight_only_mm(qkv[:, :4096], *qs["o_proj"][i % len(qs["o_proj"])], h.dtype)
            act = fp8_gemm.weight_only_silu_mul(o, *qs["gate_up_proj"][i % len(qs["gate_up_proj"])], h.dtype)
            h = fp8_gemm.weight_only_mm(act, *qs["down_proj"][i % len(qs["down_proj"])], h.dtype)
        return h

    out = []
    for pdl in (False, True):
        fp8_gemm.PDL = pdl
        row = {"design": "chain", "pdl": pdl, "layers": layers}
        try:
            # No output check: without norms the values fall to 0 within a few layers (silu(g) * u is
            # quadratic near 0), and no kernel's time depends on its values.
            row["us_per_layer"] = graph_us([run], reps=2) / layers
        except Exception as exc:  # noqa: BLE001 - PDL may not launch on this Triton or driver
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        out.append(row)
        print(json.dumps(row), flush=True)
    fp8_gemm.PDL = None  # back to the default (on where the GPU has it)
    return out


def plan_of(cuda: bool) -> dict:
    """{design: [(tile, split)]}: tile = (BLOCK_N, BLOCK_K, warps, stages)."""
    if not cuda:
        two = [((16, 32, 4, 2), 1), ((32, 64, 4, 2), 1)]
        return {
            "quant": two, "prequant": two, "dequant": two, "fma": two, "fma2": two,
            "split": [((16, 32, 4, 2), 2)], "prod": two, "gated": two,
        }  # fmt: skip
    now = (32, 256, 4, 4)  # fp8_gemm.DECODE_TILE before this sweep
    dot = [(bn, bk, w, st) for bn in (16, 32, 64) for bk in (256, 512) for w, st in ((4, 4), (8, 3))]
    fma = [(bn, bk, w, 3) for bn in (8, 16, 32) for bk in (512, 1024) for w in (4, 8)]
    # A [BLOCK_N, BLOCK_K] accumulator: 8-32 fp32 registers a thread at these tiles.
    fma2 = [(bn, bk, w, st) for bn, bk in ((4, 1024), (4, 2048), (8, 512), (8, 1024), (16, 512))
            for w in (4, 8) for st in (2, 3)]  # fmt: skip
    # fp8_gemm's one-row kernel: 4 warps, BLOCK_K a multiple of 1024 (W and x share one layout, see there).
    one_row = [(2, 1024, 4, 2), (4, 1024, 4, 2), (8, 1024, 4, 2), (2, 2048, 4, 2), (4, 2048, 4, 2)]
    return {
        "bf16_mm": [(None, 1)],
        "scaled_mm": [(None, 1)],
        "quant": [(now, 1), ((64, 256, 8, 3), 1)],
        "prequant": [(now, 1), ((64, 256, 8, 3), 1)],
        "dequant": [(t, 1) for t in dot],
        "fma": [(t, 1) for t in fma],
        "fma2": [(t, 1) for t in fma2],
        "prod": [(t, 1) for t in one_row],
        "gated": [(t, 1) for t in one_row],
        "split": [(t, s) for t in ((16, 256, 4, 4), now, (64, 256, 4, 4)) for s in (2, 4)],
    }


def _scaled(x, wq, sw):
    xq, sa = quantize_rows(x, fused=True)
    return torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sw.view(1, -1), out_dtype=torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--designs", help="comma-separated: only these designs (default: all)")
    ap.add_argument("--chain", action="store_true", help="also time a layer's four GEMMs in a chain (CUDA)")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, one small shape, two tiles")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    rows = [int(r) for r in args.rows.split(",")] if cuda else [1, 3]
    plan, shapes = plan_of(cuda), SHAPES if cuda else {"tiny": (64, 256)}
    if args.designs:
        plan = {d: v for d, v in plan.items() if d in args.designs.split(",")}
    results = []
    for name, (n, k) in shapes.items():
        results += sweep_shape(name, n, k, [r for r in rows if r == 1], plan, cuda)
    # At more rows only the designs that run there (no fma), to keep the sweep inside one device call.
    more = {d: v for d, v in plan.items() if d in ("bf16_mm", "dequant")}
    for name, (n, k) in shapes.items():
        results += sweep_shape(name, n, k, [r for r in rows if r != 1], more, cuda)
    # Triton's interpreter rounds some values to fp8 unlike the GPU (tests/model/test_fp8.py's rounding slips):
    # on the CPU the quant designs are held to 15%, elsewhere every design to 5% of its exact product.
    ran = [r for r in results if r["rel_err"] is not None]
    bad = [r for r in ran if not r["rel_err"] < (0.15 if "quant" in r["design"] and not cuda else 0.05)]
    print(f"\n{'layer':<13} {'M':>3} {'design':<10} {'best tile':<20} {'us':>7} {'GB/s':>6}  (bf16_mm us)")
    for name in shapes:
        for m in rows:
            mine = [r for r in ran if r["layer"] == name and r["m"] == m and r not in bad]
            base = next((r["us"] for r in mine if r["design"] == "bf16_mm"), 0.0)
            for design in plan:
                cand = [r for r in mine if r["design"] == design]
                if cand:
                    b = min(cand, key=lambda r: r["us"] or r["rel_err"])
                    tile = f"{b['tile']}" + (f"/{b['split']}" if b["split"] > 1 else "")
                    print(
                        f"{name:<13} {m:>3} {design:<10} {tile:<20} {b['us']:7.1f} {2 * b['weight_gb_s'] if design == 'bf16_mm' else b['weight_gb_s']:6.0f}  ({base:.1f})"
                    )
    # One tile for every shape: the dequant tile with the least summed time over the shapes at M = 1
    # (what a decode step runs once each per layer).
    sums: dict = {}
    for r in ran:
        if r["design"] == "dequant" and r["m"] == 1 and r not in bad:
            sums.setdefault(tuple(r["tile"]), []).append(r["us"])
    full = {t: sum(v) for t, v in sums.items() if len(v) == len(shapes)}
    if full:
        best = min(full, key=full.get)
        print(f"best dequant tile over the shapes at M = 1: {list(best)}, {full[best]:.1f} us a layer")
    failed = [r for r in results if r["rel_err"] is None]
    print(
        f"{len(bad)} of {len(ran)} runs over their error bound, {len(failed)} variants failed"
        + (f": {bad[:3]}" if bad else "")
    )
    if args.chain and cuda:
        results += chain_us()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
