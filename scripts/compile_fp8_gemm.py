"""Compile fp8_gemm's one-row kernel variants for the H200 (sm_90a) on a machine without a GPU.

  python scripts/compile_fp8_gemm.py [--fp16] [--dump DIR]

Triton lowers the kernel to PTX with no driver, and its bundled ptxas assembles the PTX, so a kernel that
would not compile (or spills) shows here before a device run is spent on it. Per variant (plain, gated;
without the norm, the folded norm without and with the residual; ragged K once): registers a thread, spill
bytes, layout conversions left inside the K loop, 16-byte global loads (ld...v4) and global stores in the
PTX. The launcher's specialization is restated: pointers 16-byte aligned, N, K and the strides multiples
of 16. Written against Triton 3.9's compile API (ASTSource, GPUTarget); exit 1 when a variant spills.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the launcher's default (silences 3.9's warning)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

import triton  # noqa: E402
from graphcache.model import fp8_gemm  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SIXTEEN = ("N", "K", "stride_am", "stride_bn", "stride_cm")  # ints the launcher sees divisible by 16


def compile_one(gated: bool, norm: bool, has_res: bool, even_k: bool, ptr16: str, dump: Path | None) -> dict:
    fn = fp8_gemm._kernel()
    _, block_n, block_k, warps, stages = fp8_gemm._tiles(1, None, gated)
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(a_ptr=ptr16, b_ptr="*fp8e4nv", c_ptr=ptr16, sa_ptr="*fp32", sb_ptr="*fp32")
    sig.update(res_ptr=ptr16, g_ptr=ptr16, res_out_ptr=ptr16, eps="fp32")
    consts = dict(
        BLOCK_SCALES=False, ONE_ROW=True, GATED=gated, NORM=norm, HAS_RES=has_res, EVEN_K=even_k,
        USE_PDL=False, GROUP_N=1, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if name.endswith("_ptr") or name in SIXTEEN
    }
    kernel = triton.compile(
        ASTSource(fn, sig, consts, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps, num_stages=stages),
    )
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    name = f"gated{int(gated)}_norm{int(norm)}_res{int(has_res)}_even{int(even_k)}"
    if dump is not None:
        (dump / f"{name}.ttgir").write_text(ttgir)
        (dump / f"{name}.ptx").write_text(ptx)
    loop = ttgir[ttgir.find("scf.for") :]
    loop = loop[: loop.find("scf.yield")]
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell"  # Triton's own, any arch
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        cmd = [str(ptxas), "-v", "-arch=sm_90a", f.name, "-o", os.devnull]
        info = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    return {
        "variant": name,
        "regs": int(re.search(r"Used (\d+) registers", info).group(1)),
        "spill_bytes": int(re.search(r"(\d+) bytes spill stores", info).group(1)),
        "converts_in_loop": loop.count("convert_layout"),
        "ld_v4": len(re.findall(r"ld\.global[.a-z0-9:]*v4", ptx)),
        "st": ptx.count("st.global"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp16", action="store_true", help="fp16 x and output (default bf16)")
    ap.add_argument("--dump", type=Path, help="write each variant's TTGIR and PTX here")
    args = ap.parse_args(argv)
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    ptr16 = "*fp16" if args.fp16 else "*bf16"
    variants = [
        (g, n, r, True) for g in (False, True) for n, r in ((False, False), (True, False), (True, True))
    ]
    variants.append((False, True, True, False))  # ragged K: the masked loads
    spilled = 0
    for v in variants:
        row = compile_one(*v, ptr16, args.dump)
        spilled += row["spill_bytes"] > 0
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
