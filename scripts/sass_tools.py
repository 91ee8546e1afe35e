"""Offline sm_90 compiles for the SASS scripts (bf16_gemv_sass, fp8_one_row_sass): a Triton kernel compiled on
this machine without a GPU, with what Triton's launcher would specialize, and Triton's own cuobjdump /
nvdisasm run on its cubin."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(kernel, sig: dict[str, str], const: dict, divisible: Iterable[str], warps: int, stages: int):
    """kernel (a triton.jit function) for sm_90: sig names the runtime arguments in the kernel's order with
    their types, const its constexprs' values (after them), divisible the arguments the launcher would see as
    multiples of 16 (16-byte aligned pointers, sizes and strides)."""
    names = [*sig, *const]
    src = ASTSource(
        fn=kernel,
        signature=sig | dict.fromkeys(const, "constexpr"),
        constexprs={(names.index(k),): v for k, v in const.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible},
    )
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )


def cubin_tool(kernel, tool: str, *args: str) -> str:
    """The stdout of Triton's bundled `tool` (nvdisasm, cuobjdump) on the compiled kernel's cubin."""
    binary = Path(triton.__file__).parent / "backends/nvidia/bin" / tool
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(binary), *args, f.name], capture_output=True, text=True, check=True).stdout
