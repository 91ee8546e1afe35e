"""model/bf16_gemv.py's kernel compiled for sm_90 on this machine without a GPU (Triton's own ptxas, cuobjdump
and nvdisasm): per tile the registers a thread, the shared memory, the K loop's instruction mix and the
kernel's totals, to see before a device call whether a design stays in registers (fma: LDG and FFMA only in
the loop, no STS/LDS/BAR/SHFL) or pipelines W through shared memory (dot: LDGSTS with HMMA, or HGMMA at
BLOCK_N 64). Put the device's Triton (3.6) first on PYTHONPATH to see what the device compiles:

    pip download triton==3.6.0 --no-deps -d /tmp/tr36 && pip install --no-deps --target /tmp/tr36site /tmp/tr36/*.whl
    PYTHONPATH=/tmp/tr36site .venv/bin/python scripts/bf16_gemv_sass.py [--gated] [--uneven-k]

Seen with Triton 3.6 (2026-12-05): fma (1, 2, 1024, 4 warps) 30 registers, its loop 3 LDG.E.128 and 14 FFMA;
dot (16, 16, 256, 4 warps, 4 stages) 40 registers, 48 KB shared, LDGSTS + HMMA in the loop.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from graphcache.model import bf16_gemv  # noqa: E402
from graphcache.model.bf16_gemv import Tile  # noqa: E402
from sass_tools import compile_sm90, cubin_tool  # noqa: E402

from benchmarks.bf16_gemv_sweep import ROWS, candidates  # noqa: E402

POINTERS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16"}
INTS = ("M", "N", "K", "stride_xm", "stride_wn", "stride_ym")
# What Triton's launcher specializes at the 8B shapes: 16-byte aligned pointers, N, K and the strides multiples of 16.
DIVISIBLE = {*POINTERS, "N", "K", "stride_xm", "stride_wn", "stride_ym"}
TOTALS = ("LDG", "LDGSTS", "LDS", "STS", "BAR", "SHFL", "HMMA", "HGMMA", "FFMA", "LDL", "STL", "LDSM")
OPCODE = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def compile_tile(t: Tile, gated: bool = False, even_k: bool = True):
    sig = dict(POINTERS) | dict.fromkeys(INTS, "i32")
    const = dict(
        DOT=t.design == "dot",
        GATED=gated,
        EVEN_K=even_k,
        USE_PDL=False,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
    )
    return compile_sm90(bf16_gemv._kernel(), sig, const, DIVISIBLE, t.warps, t.stages)


def k_loop(lines: list[str]) -> Counter:
    """Opcode counts of the longest backward-branch loop (the K loop)."""
    best: Counter = Counter()
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
        start = next((j for j, s in enumerate(lines) if m and s.startswith(m.group(1) + ":")), None)
        if start is not None and start < i and i - start > sum(best.values()):
            best = Counter(op.group(1) for s in lines[start : i + 1] if (op := OPCODE.search(s)))
    return best


def main() -> int:
    gated, even_k = "--gated" in sys.argv, "--uneven-k" not in sys.argv
    print(f"triton {triton.__version__}, sm_90, gated={gated}, EVEN_K={even_k}")
    tiles = list(dict.fromkeys(t for m in ROWS for t in candidates(m)))
    for t in tiles:
        try:
            kernel = compile_tile(t, gated, even_k)
        except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses is a result too
            print(f"{tuple(t)}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
            continue
        usage = cubin_tool(kernel, "cuobjdump", "-res-usage")
        regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
        lines = cubin_tool(kernel, "nvdisasm", "-c").splitlines()
        total = Counter(op.group(1) for s in lines if (op := OPCODE.search(s)))
        loop = k_loop(lines)
        print(
            f"{tuple(t)}: {regs and regs.group(1)} registers, stack {stack and stack.group(1)}, "
            f"shared {kernel.metadata.shared} B\n  K loop: "
            + ", ".join(f"{o} {c}" for o, c in loop.most_common(10))
            + "\n  kernel: "
            + ", ".join(f"{o} {total[o]}" for o in TOTALS if total[o])
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
