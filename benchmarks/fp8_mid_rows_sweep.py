"""FP8 GEMMs at 17-512 rows (the 8B decode steps of a busy server) on the Llama-3-8B linear shapes:
cuBLASLt's row-scaled FP8 GEMM (torch._scaled_mm, what fp8_linear.fp8_mm runs past 16 rows) against a Triton
W8A8 kernel tiled for this row range, and bf16 cuBLAS on the same weights.

  python benchmarks/fp8_mid_rows_sweep.py --out sweep.json   # CUDA: ~1-2 min
  python benchmarks/fp8_mid_rows_sweep.py --smoke            # CPU: Triton's interpreter, one small shape

Why (BENCHMARKS.md §25): on the H100 an 8B FP8 decode step of 134 rows spent 5.63 ms in _scaled_mm's
kernels against 5.74 in bf16's GEMMs, though FP8 halves the bytes to read: at these rows a GEMM is still
bound by reading W (N * K fp8 bytes), and the 128 x 128-tile kernel cuBLASLt picks gives N = 4096 only 32 x
ceil(M / 128) tiles to spread over 132 SMs. The Triton kernel takes x already quantized per row (as the
engine's path does, fp8_quant.quantize_rows) and multiplies on the FP8 tensor cores (tl.dot of e4m3 operands)
with narrow N tiles, so that every SM has a share of W to stream; the M tile covers the rows (M fastest in
the grid, so the programs sharing a W tile run together and W is read from HBM about once).

Each time is the median of replays of one CUDA graph cycling weight copies larger than 4x the L2 (so every
call reads HBM), as weight GB/s and % of --bandwidth. Every variant is first checked against the fp32 product
of the same fp8 operands (rel err < 2e-2). Prints per shape and M the best of each design, then per M the 8B
layer's four GEMMs summed: cuBLASLt's against the best Triton tile per shape.
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
from graphcache.model.fp8_quant import quantize_rows  # noqa: E402
from graphcache.model.triton_support import tl, triton  # noqa: E402

from benchmarks import roofline  # noqa: E402
from benchmarks.fp8_bench import weight_copies  # noqa: E402
from benchmarks.fp8_gemv_sweep import SHAPES  # noqa: E402  (the 8B layer's four GEMMs)
from benchmarks.gpu_timing import graph_us  # noqa: E402

ROWS = (32, 64, 134, 256, 512)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); BLOCK_M is raised to cover M where M is smaller than it.
TILES = [
    (64, 32, 128, 4, 4),
    (64, 64, 128, 4, 4),
    (128, 32, 128, 4, 4),
    (128, 64, 128, 4, 4),
    (128, 64, 128, 8, 3),
    (128, 128, 128, 8, 3),
    (256, 64, 128, 8, 3),
]


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(
    xq_ptr, w_ptr, out_ptr, sa_ptr, sw_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[m, n] = sa[m] * sw[n] * (xq[m] . W[n]): xq [M, K], W [N, K] e4m3, K a multiple of BLOCK_K."""
    pid_m = tl.program_id(0)  # M fastest: the M tiles of one W tile are neighbours in launch order
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = xq_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = (
        w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]
    )  # [BLOCK_K, BLOCK_N], K-major as wgmma wants
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K // BLOCK_K):
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    sa = tl.load(sa_ptr + offs_m, mask=m_mask, other=0.0)
    sw = tl.load(sw_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * sa[:, None] * sw[None, :]
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def w8a8(
    xq: torch.Tensor, sa: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, tile, out_dtype
) -> torch.Tensor:
    """xq [M, K] e4m3 with sa [M, 1]; wq [N, K] e4m3 with sw [N, 1] -> [M, N] out_dtype."""
    m, k = xq.shape
    n = wq.shape[0]
    block_m, block_n, block_k, warps, stages = tile
    if k % block_k:
        raise ValueError(f"K = {k} is not a multiple of BLOCK_K = {block_k}")
    block_m = min(block_m, max(16, triton.next_power_of_2(m)))
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a8_kernel[grid](
        xq, wq, out, sa, sw, m, n, k, xq.stride(0), wq.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def sweep_shape(name: str, n: int, k: int, rows, tiles, cuda: bool, bandwidth: float) -> list[dict]:
    dev = "cuda" if cuda else "cpu"
    ws, qs = weight_copies(n, k, dev)
    out = []
    for m in rows:
        # Triton's interpreter multiplies bf16 wrongly (numpy has no bf16): fp16 there.
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16 if cuda else torch.float16)
        xq, sa = quantize_rows(x, fused=cuda)
        ref = (xq.float() * sa) @ (qs[0][0].float() * qs[0][1]).t()
        designs: list[tuple[str, object]] = [("w8a8", t) for t in tiles]
        if cuda:
            designs = [("bf16_mm", None), ("scaled_mm", None), *designs]

        def call(design, tile, i, x=x, xq=xq, sa=sa):  # this M's operands, bound now
            wq, sw = qs[i]
            if design == "bf16_mm":
                return torch.mm(x, ws[i].t())
            if design == "scaled_mm":  # fp8_linear.fp8_mm
                return torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sw.view(1, -1), out_dtype=x.dtype)
            return w8a8(xq, sa, wq, sw, tile, x.dtype)

        for design, tile in designs:
            row = {"layer": name, "n": n, "k": k, "m": m, "design": design, "tile": tile}
            try:
                got = call(design, tile, 0)
                want = (x.float() @ ws[0].float().t()) if design == "bf16_mm" else ref
                row["rel_err"] = ((got.float() - want).norm() / want.norm()).item()
                fns = [lambda i=i, d=design, t=tile: call(d, t, i) for i in range(len(ws))]
                row["us"] = graph_us(fns, reps=max(1, 24 // len(ws))) if cuda else 0.0
            except Exception as exc:  # noqa: BLE001 - a tile the GPU cannot run is a result too
                row.update(rel_err=None, us=None, error=f"{type(exc).__name__}: {str(exc)[:120]}")
            w_bytes = n * k * (2 if design == "bf16_mm" else 1)
            row["pct_bw"] = 100 * w_bytes / (row["us"] * 1e-6) / (bandwidth * 1e9) if row.get("us") else 0.0
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def report(results: list[dict], rows) -> None:
    ok = [r for r in results if r["us"] and r["rel_err"] is not None and r["rel_err"] < 2e-2]
    print(
        f"\n{'layer':<13} {'M':>4} {'bf16_mm us':>11} {'scaled_mm us (%bw)':>19} {'w8a8 best us (%bw)':>19}  tile"
    )
    sums: dict[int, list[float]] = {}
    for name in SHAPES:
        for m in rows:
            mine = [r for r in ok if r["layer"] == name and r["m"] == m]
            by = {d: min((r for r in mine if r["design"] == d), key=lambda r: r["us"], default=None)
                  for d in ("bf16_mm", "scaled_mm", "w8a8")}  # fmt: skip
            if not all(by.values()):
                continue
            b, s, w = by["bf16_mm"], by["scaled_mm"], by["w8a8"]
            print(f"{name:<13} {m:>4} {b['us']:>11.1f} {s['us']:>10.1f} ({s['pct_bw']:4.0f}%) "
                  f"{w['us']:>10.1f} ({w['pct_bw']:4.0f}%)  {w['tile']}")  # fmt: skip
            acc = sums.setdefault(m, [0.0, 0.0, 0.0])
            acc[0], acc[1], acc[2] = acc[0] + b["us"], acc[1] + s["us"], acc[2] + w["us"]
    print("\nthe 8B layer's four GEMMs, us (x32 layers = a decode step's GEMMs):")
    for m, (b, s, w) in sums.items():
        print(
            f"  M={m:>4}: bf16_mm {b:7.1f}, scaled_mm {s:7.1f}, w8a8 best tiles {w:7.1f} ({s / w:.2f}x scaled_mm)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--bandwidth", type=float, help="GB/s; default by the device: H200 4800, H100 3350")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, one small shape, M = 20, 40")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    rows = [int(r) for r in args.rows.split(",")] if cuda else [20, 40]
    shapes = SHAPES if cuda else {"tiny": (48, 256)}
    tiles = TILES if cuda else [(16, 16, 128, 4, 1), (32, 32, 128, 4, 1)]
    name = torch.cuda.get_device_name() if cuda else "cpu"
    bandwidth = args.bandwidth or roofline.hbm_gb_s(name)
    print(f"{name}: bound {bandwidth:.0f} GB/s", flush=True)
    results = []
    for shape, (n, k) in shapes.items():
        results += sweep_shape(shape, n, k, rows, tiles, cuda, bandwidth)
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        report(results, rows)
    bad = [r for r in results if r["rel_err"] is not None and not r["rel_err"] < 2e-2]
    failed = [r for r in results if r["rel_err"] is None]
    print(f"{len(bad)} of {len(results)} runs over the 2e-2 error bound, {len(failed)} variants failed")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 1 if bad or (not cuda and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
