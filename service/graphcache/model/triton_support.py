"""triton, imported once for every module with Triton kernels (fused ops, decode attention, sampling).

Guarded: without triton (CPU installs may lack it) the modules still import, HAVE_TRITON is False and
their torch paths serve; the kernels are jitted on first use, never at import.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "tl", "triton"]
