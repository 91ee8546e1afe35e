"""triton, imported once for every module with Triton kernels (fused ops, decode attention, sampling).

Guarded: without triton (CPU installs may lack it) the modules still import, HAVE_TRITON is False and
their torch paths serve; the kernels are jitted on first use, never at import.
"""

from __future__ import annotations

try:
    # triton ships no type information (no py.typed, no stubs): its names are Any here. It is absent
    # where it has no wheel (it is a Linux x86_64 test dependency), hence import-not-found too.
    import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

    HAVE_TRITON = True
except ImportError:
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "tl", "triton"]
