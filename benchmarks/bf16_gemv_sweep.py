"""Small-batch bf16 GEMMs (M = 1..64 rows) on the Llama-3-8B and Qwen2.5-0.5B linear shapes: cuBLAS against
model/bf16_gemv.py's kernel over a small grid of tiles, and the best tile per (M bucket, N, K).

  python benchmarks/bf16_gemv_sweep.py --out sweep.json     # CUDA (H200): the whole sweep, ~2-3 min
  python benchmarks/bf16_gemv_sweep.py --smoke              # CPU: Triton's interpreter, one small shape

At these row counts a GEMM is bound by reading W once (N * K * 2 bytes), so each variant is reported as GB/s
(W + x + y bytes over the time) and as a share of --bandwidth (H200.md: 4.8 TB/s, the H200's datasheet HBM3e
rate). Weights rotate over enough copies that their bytes exceed 4x the device's L2 (read off the device: the
H200 reports ~60 MB; the 8B LM head alone is 1 GB), so every call reads HBM; x stays in L2, as in the model.
Each time is the median of 5 replays of one CUDA graph holding ~200 calls (launch gaps inside a graph count,
as in a captured decode step). Every variant's output is checked against the fp32 product first (rel err <
1e-2 in bf16) before it is timed. gate_up also runs gated (silu(gate) * up in the epilogue, [M, I] out)
against cuBLAS + torch's silu * up.

Prints, per shape and M: cuBLAS, the best tile, both in us, GB/s and % of the bandwidth, and the best tile with
programmatic dependent launch (pdl: in a graph of back-to-back GEMMs each launches while the one before drains;
bf16_gemv.PDL); per M, the 8B layer's four GEMMs summed (what a decode step runs 32 times); then the TILES table
for model/bf16_gemv.py.
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
import torch.nn.functional as F  # noqa: E402
from graphcache.model import bf16_gemv  # noqa: E402
from graphcache.model.bf16_gemv import Tile  # noqa: E402

from benchmarks import roofline  # noqa: E402
from benchmarks.gpu_timing import graph_us  # noqa: E402

SHAPES = {  # name: (N, K) of W [N, K]
    "8b.qkv": (6144, 4096),
    "8b.o": (4096, 4096),
    "8b.gate_up": (28672, 4096),
    "8b.down": (4096, 14336),
    "8b.lm_head": (128256, 4096),
    "05b.qkv": (1152, 896),
    "05b.o": (896, 896),
    "05b.gate_up": (9728, 896),
    "05b.down": (896, 4864),
    "05b.lm_head": (151936, 896),
}
LAYER_8B = ("8b.qkv", "8b.o", "8b.gate_up", "8b.down")
ROWS = (1, 2, 4, 8, 16, 32, 64)


def fma(m, n, k, w, s):
    return Tile("fma", m, n, k, w, s)


def dot(m, n, k, w, s):
    return Tile("dot", m, n, k, w, s)


def candidates(bucket: int) -> list[Tile]:
    """The grid per M bucket: fma at 1-8 rows (BLOCK_K = 8 x 32 x warps: W and x in one layout), W-as-A tl.dot
    from 8 rows up (x padded to 16); bf16_gemv.DEFAULT_TILES always among them."""
    grid = {
        1: [fma(1, 2, 1024, 4, 2), fma(1, 4, 1024, 4, 2), fma(1, 4, 512, 2, 2), fma(1, 8, 256, 1, 2),
            dot(16, 16, 256, 4, 4)],
        2: [fma(2, 2, 1024, 4, 2), fma(2, 4, 512, 2, 2), dot(16, 16, 256, 4, 4)],
        4: [fma(4, 2, 1024, 4, 2), fma(4, 2, 512, 2, 2), dot(16, 16, 256, 4, 4)],
        8: [fma(8, 2, 512, 2, 2), dot(16, 16, 256, 4, 4), dot(16, 32, 256, 4, 4)],
        16: [dot(16, 16, 256, 4, 4), dot(16, 16, 512, 4, 3), dot(16, 32, 256, 4, 4), dot(16, 64, 128, 4, 4)],
        32: [dot(32, 16, 256, 4, 4), dot(32, 32, 256, 4, 4), dot(32, 64, 128, 4, 4)],
        64: [dot(64, 16, 256, 4, 4), dot(64, 32, 256, 4, 4), dot(64, 64, 128, 4, 4)],
    }[bucket]  # fmt: skip
    default = bf16_gemv.DEFAULT_TILES[bucket]
    return grid if default in grid else [default, *grid]


def l2_bytes() -> int:
    """The device's L2 (the H200 reports ~60 MB); 50 MiB where torch does not say."""
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20))


def weights(n: int, k: int, dev: str, dtype: torch.dtype) -> list[torch.Tensor]:
    w = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5
    if dev != "cuda":
        return [w]
    l2 = l2_bytes()
    copies = max(1, -(-4 * l2 // (n * k * w.element_size())))
    return [w] + [(w * (1 + 0.01 * i)).contiguous() for i in range(1, copies)]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def sweep_shape(name: str, n: int, k: int, rows, cuda: bool, bandwidth: float) -> list[dict]:
    dev = "cuda" if cuda else "cpu"
    # Triton's interpreter multiplies bf16 wrongly (numpy has no bf16): fp16 operands there.
    dtype = torch.bfloat16 if cuda else torch.float16
    ws = weights(n, k, dev, dtype)
    gated_too = "gate_up" in name
    calls = max(1, min(200, int(2e9 // (n * k * 2))))  # ~2 GB of W a replay: the 8B LM head 2 calls, o 200
    out: list[dict] = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        ref = x.float() @ ws[0].float().t()
        g, u = ref.split(n // 2, dim=-1)
        ref_gated = F.silu(g) * u
        variants: list[tuple[str, Tile | None]] = [("cublas", None)]
        variants += [("kernel", t) for t in candidates(bf16_gemv.bucket_of(m))]
        more = [("pdl", None)] + ([("cublas_gated", None), ("gated", None)] if gated_too else [])
        for design, tile in variants + more:
            if design in (
                "gated",
                "pdl",
            ):  # at the best plain tile of this M (each such tile: one more compile)
                plain = best(out, name, m, "kernel")
                tile = Tile(*plain["tile"]) if plain else bf16_gemv.DEFAULT_TILES[bf16_gemv.bucket_of(m)]

            def call(i, design=design, tile=tile, x=x, ws=ws):
                if design == "cublas":
                    return torch.mm(x, ws[i].t())
                if design == "cublas_gated":
                    h = torch.mm(x, ws[i].t())
                    return F.silu(h[:, : n // 2]) * h[:, n // 2 :]
                return bf16_gemv.launch(x, ws[i], tile, gated=design == "gated", pdl=design == "pdl")

            gated = design in ("gated", "cublas_gated")
            out_n = n // 2 if gated else n
            nbytes = (n * k + m * k + m * out_n) * x.element_size()
            row = {"shape": name, "n": n, "k": k, "m": m, "design": design, "tile": tile and list(tile)}
            try:
                row["rel_err"] = rel_err(call(0), ref_gated if gated else ref)
                fns = [lambda i=i: call(i) for i in range(len(ws))]
                row["us"] = graph_us(fns, max(1, calls // len(fns))) if cuda else 0.0
            except Exception as exc:  # noqa: BLE001 - a tile the GPU cannot run (shared memory) is a result too
                row.update(rel_err=None, us=None, error=f"{type(exc).__name__}: {str(exc)[:160]}")
            row["gb_s"] = nbytes / row["us"] / 1e3 if row.get("us") else 0.0
            row["pct_bw"] = 100 * row["gb_s"] / bandwidth
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def best(results: list[dict], shape: str, m: int, design: str) -> dict | None:
    ok = [r for r in results if r["shape"] == shape and r["m"] == m and r["design"] == design and r.get("us")]
    ok = [r for r in ok if r["rel_err"] is not None and r["rel_err"] < 1e-2]
    return min(ok, key=lambda r: r["us"]) if ok else None


def report(results: list[dict], shapes: dict, rows, bandwidth: float) -> dict:
    print(f"\nbandwidth bound {bandwidth:.0f} GB/s; us, GB/s, % of it; x = cuBLAS us / kernel us")
    print(f"{'shape':<13} {'M':>3} {'cuBLAS us':>9} {'GB/s':>6} {'%':>4}   {'kernel us':>9} {'GB/s':>6} {'%':>4} "
          f"{'x':>5} {'pdl us':>7}  best tile")  # fmt: skip
    table: dict[tuple[int, int, int], Tile | None] = {}
    for name in shapes:
        for m in rows:
            for base, mine in (("cublas", "kernel"), ("cublas_gated", "gated")):
                c, b = best(results, name, m, base), best(results, name, m, mine)
                if b is None:
                    continue
                if mine == "kernel":  # None where cuBLAS beat every tile: small_mm runs torch's product there
                    faster = c is None or b["us"] < c["us"]
                    table[(bf16_gemv.bucket_of(m), b["n"], b["k"])] = Tile(*b["tile"]) if faster else None
                cu = f"{c['us']:9.1f} {c['gb_s']:6.0f} {c['pct_bw']:4.0f}" if c else f"{'-':>21}"
                speed = c["us"] / b["us"] if c else 0.0
                label = name + (" (gated)" if mine == "gated" else "")
                p = best(results, name, m, "pdl") if mine == "kernel" else None
                pdl = f"{p['us']:7.1f}" if p else f"{'':>7}"
                print(f"{label:<13} {m:>3} {cu}   {b['us']:9.1f} {b['gb_s']:6.0f} {b['pct_bw']:4.0f} {speed:5.2f} "
                      f"{pdl}  {tuple(b['tile'])}")  # fmt: skip
    if all(s in shapes for s in LAYER_8B):
        print("\n8B layer, four GEMMs summed (gate_up plain; gated in brackets against cuBLAS + silu * up):")
        layer_bytes = sum(SHAPES[s][0] * SHAPES[s][1] * 2 for s in LAYER_8B)
        shares: dict[int, tuple[float, float]] = {}  # M: (cuBLAS, faster of the two) % of the bandwidth
        for m in rows:
            cu = [best(results, s, m, "cublas") for s in LAYER_8B]
            kr = [best(results, s, m, "kernel") for s in LAYER_8B]
            if None in cu or None in kr:
                continue
            cu_us, kr_us = sum(r["us"] for r in cu), sum(r["us"] for r in kr)  # type: ignore[index]
            cg, kg = best(results, "8b.gate_up", m, "cublas_gated"), best(results, "8b.gate_up", m, "gated")
            gated = ""
            if cg and kg:
                cu_g = cu_us - cu[2]["us"] + cg["us"]  # type: ignore[index]
                kr_g = kr_us - kr[2]["us"] + kg["us"]  # type: ignore[index]
                gated = f"  (gated: cuBLAS {cu_g:.1f}, kernel {kr_g:.1f})"
            mix_us = sum(min(c["us"], k["us"]) for c, k in zip(cu, kr, strict=True))  # type: ignore[index]

            def pct(us: float) -> str:
                return f"{us:6.1f} us ({100 * layer_bytes / us / 1e3 / bandwidth:4.1f}%)"

            pd = [best(results, s, m, "pdl") for s in LAYER_8B]
            pdl = f", kernel with PDL {pct(sum(r['us'] for r in pd))}" if None not in pd else ""  # type: ignore[index]
            print(f"  M={m:>2}: cuBLAS {pct(cu_us)}, kernel {pct(kr_us)}{pdl}, faster of the two per GEMM (TILES) "
                  f"{pct(mix_us)}{gated}")  # fmt: skip
            shares[m] = tuple(100 * layer_bytes / us / 1e3 / bandwidth for us in (cu_us, mix_us))  # type: ignore[assignment]
        met = [m for m, (_, mine) in shares.items() if mine >= 85.0]
        print(f"issue 41's bar, 85% of {bandwidth:.0f} GB/s on the 8B layer with TILES: met at M = {met or 'none'}; "
              + ", ".join(f"M={m} {c:.0f}% -> {mine:.0f}%" for m, (c, mine) in shares.items()))  # fmt: skip
    print("\nTILES = {  # (bucket, N, K): Tile, paste into model/bf16_gemv.py")
    for (bucket, n, k), t in sorted(table.items()):
        print(f"    ({bucket}, {n}, {k}): {t!r},")
    print("}")
    return {f"{b},{n},{k}": t and list(t) for (b, n, k), t in table.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--shapes", help="comma-separated names (default: all), e.g. 8b.qkv,8b.o")
    ap.add_argument(
        "--bandwidth",
        type=float,
        help="GB/s bound; default by the device's name: H200 4800, H100 3350 (datasheets)",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, one small shape, M = 1, 3, 20")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    args.bandwidth = args.bandwidth or (None if cuda else 4800.0)
    rows = [int(r) for r in args.rows.split(",")] if cuda else [1, 3, 20]
    shapes = SHAPES if cuda else {"tiny.gate_up": (64, 256), "tiny.o": (48, 352)}
    if args.shapes:
        shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        if args.bandwidth is None:  # an H100 when the lent H200 did not come: its own bound, not the H200's
            args.bandwidth = roofline.hbm_gb_s(props.name)
        print(
            f"{props.name}: {props.multi_processor_count} SMs, L2 {l2_bytes() / 2**20:.0f} MiB, "
            f"bound {args.bandwidth:.0f} GB/s",
            flush=True,
        )
    results: list[dict] = []
    for name, (n, k) in shapes.items():
        results += sweep_shape(name, n, k, rows, cuda, args.bandwidth)
        if cuda:  # the shape's weight copies are gone with its call: give their memory back
            torch.cuda.empty_cache()
    bad = [r for r in results if r["rel_err"] is not None and not r["rel_err"] < 1e-2]
    failed = [r for r in results if r["rel_err"] is None]
    table = report(results, shapes, rows, args.bandwidth) if cuda else {}
    print(f"{len(bad)} of {len(results)} runs over the 1e-2 error bound, {len(failed)} variants failed"
          + (f": {bad[:3]}" if bad else ""))  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"results": results, "tiles": table}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
