"""The one-row FP8 GEMV's SASS for sm_90, compiled on this machine without a GPU (Triton's own ptxas and
nvdisasm): the instruction mix of its K loop, to see whether x still goes through shared memory (STS, LDS
and BAR inside the loop) before a device call measures it. Put the device's Triton (3.6) first on
PYTHONPATH to see what the device compiles:

    pip download triton==3.6.0 --no-deps -d /tmp/tr36 && pip install --no-deps --target /tmp/tr36site /tmp/tr36/*.whl
    PYTHONPATH=/tmp/tr36site TRITON_INTERPRET=0 .venv/bin/python scripts/fp8_one_row_sass.py [--gated] [--tile 4,1024,4,2]

It also prints the registers a thread (cuobjdump): they set how many programs an SM holds, and so how much of W
is in flight (65536 registers an SM, 128 threads a program at 4 warps).
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

import triton  # noqa: E402
from graphcache.model import fp8_gemm  # noqa: E402
from sass_tools import compile_sm90, cubin_tool  # noqa: E402

POINTERS = {"a_ptr": "*bf16", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32"}
ROPE_POINTERS = ("pos_ptr", "cos_ptr", "sin_ptr", "slot_ptr", "kc_ptr", "vc_ptr")
INTS = ("M", "N", "K", "stride_am", "stride_bn", "stride_cm", "stride_sa_g", "stride_sa_m", "stride_sb_n")
ROPE_INTS = ("stride_cos", "stride_cs", "stride_ch", "rope_heads", "q_heads")
# What Triton's launcher specializes at the 8B shapes: 16-byte aligned pointers, K and the strides multiples of 16.
DIVISIBLE = {*POINTERS, *ROPE_POINTERS, "N", "K", "stride_am", "stride_bn", "stride_cm"}


def compile_one_row(tile=fp8_gemm.ONE_ROW_TILE, gated: bool = False):
    """The weight-only kernel at M = 1 (ONE_ROW, EVEN_K, PDL on), compiled for sm_90."""
    block_n, block_k, warps, stages = tile
    sig = dict(POINTERS) | {p: "*bf16" for p in ROPE_POINTERS} | {i: "i32" for i in (*INTS, *ROPE_INTS)}
    sig = {name: sig[name] for name in (*POINTERS, *INTS, *ROPE_POINTERS, *ROPE_INTS)}  # the kernel's order
    const = dict(
        BLOCK_SCALES=False, ONE_ROW=True, GATED=gated, ROPE=False, HEAD_DIM=2, EVEN_K=True, USE_PDL=True,
        GROUP_N=1, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return compile_sm90(fp8_gemm._kernel(), sig, const, DIVISIBLE, warps, stages)


def sass(kernel) -> list[str]:
    return cubin_tool(kernel, "nvdisasm", "-c").splitlines()


def registers(kernel) -> int:
    usage = " ".join(cubin_tool(kernel, "cuobjdump", "-res-usage").splitlines())
    return int(re.search(r"REG:(\d+)", usage).group(1))


def loop_mix(lines: list[str]) -> tuple[int, Counter]:
    """(instructions, opcode counts) from the first global load to the branch that closes the K loop."""
    start = next(i for i, line in enumerate(lines) if "LDG" in line)
    end = next(i for i in range(start + 10, len(lines)) if re.search(r"@!?P\d BRA", lines[i]))
    ops = Counter()
    for line in lines[start : end + 1]:
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    return end - start + 1, ops


def main() -> int:
    os.environ.setdefault("TRITON_INTERPRET", "0")
    tile = fp8_gemm.GATED_ONE_ROW_TILE if "--gated" in sys.argv else fp8_gemm.ONE_ROW_TILE
    if "--tile" in sys.argv:
        tile = tuple(int(v) for v in sys.argv[sys.argv.index("--tile") + 1].split(","))
    kernel = compile_one_row(tile, gated="--gated" in sys.argv)
    n, ops = loop_mix(sass(kernel))
    print(
        f"triton {triton.__version__}, tile {tile}: {registers(kernel)} registers a thread, K loop: {n} instructions"
    )
    print(", ".join(f"{op} {c}" for op, c in ops.most_common()))
    through_shared = sum(ops[op] for op in ("STS", "LDS", "BAR"))
    print(f"shared-memory and barrier instructions in the loop: {through_shared}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
