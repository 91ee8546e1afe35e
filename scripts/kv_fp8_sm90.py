"""The kernels that touch an FP8 KV cache, compiled for Hopper (sm_90) on a machine without a GPU, at the 8B
shape (32 heads, 8 KV heads, head dim 128, block 16) with E4M3 K/V: the rotary + cache-write kernel that
writes it (saturating stores), the decode kernel's first stage and the unified kernel at a chunked step's
tiles that read it (widening loads). Triton's lowering of both is checked before any device call. Prints
one line per kernel; exits non-zero on a compile error or a kernel without E4M3 conversions.

    python scripts/kv_fp8_sm90.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from graphcache.model import decode_attention, fused_ops, unified_attention  # noqa: E402
from sass_tools import compile_sm90  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
GROUP = HEADS // KV_HEADS
KV = {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"}
STRIDES = ["stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh", "stride_btr"]


def decode_stage1():
    splits = 4
    sig = {"q_ptr": "*bf16", **KV, "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16"}
    sig |= {"ws_ptr": "*fp32", "qk_scale": "fp32"}
    sig |= dict.fromkeys(["stride_qr", "stride_qh", *STRIDES, "stride_or", "stride_oh"], "i32")
    # in the kernel's parameter order (compile_sm90 numbers the constexprs by it)
    const = dict(NUM_HEADS=HEADS, GROUP=GROUP, GROUP_PAD=16, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM)
    const |= dict(BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=decode_attention.FP8_BLOCK_N, NUM_SPLITS=splits)
    const |= dict(REQ_STRIDE=decode_attention._req_stride(HEADS, HEAD_DIM, splits), DIRECT_OUT=False)
    const |= dict(DOT_PRECISION="tf32")
    w, s = decode_attention.NUM_WARPS, decode_attention.NUM_STAGES
    return decode_attention._decode_stage1, sig, const, w, s


def unified_chunked():
    cfg = unified_attention.choose_config(GROUP, HEAD_DIM, 1024, kv_bytes=1)  # the FP8 cache's tiles
    sig = {"q_ptr": "*bf16", **KV, "out_ptr": "*bf16", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32"}
    sig |= {"bt_ptr": "*i32", "qk_scale": "fp32", "num_reqs": "i32"}
    sig |= dict.fromkeys(["stride_qt", "stride_qh", *STRIDES, "stride_ot", "stride_oh"], "i32")
    const = dict(GROUP=GROUP, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE)
    const |= dict(
        BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_m // GROUP, BLOCK_N=cfg.block_n, DOT_PRECISION="tf32"
    )
    return unified_attention._unified_kernel, sig, const, cfg.num_warps, cfg.num_stages


def rotary_cache_write():
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16"}
    sig |= {"pos_ptr": "*i64", "slot_ptr": "*i64", "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"}
    sig |= dict.fromkeys(
        ["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh"], "i32"
    )
    sig |= dict.fromkeys(["stride_c", "stride_cs", "stride_ch", "num_q", "num_k", "half"], "i32")
    const = dict(WRITE_KV=True, KV_FP8=True, BLOCK_D=HEAD_DIM // 2, BLOCK_H=HEADS)
    return fused_ops._rotary_kernel, sig, const, 4, 3


KERNELS = {
    "rotary + cache write": rotary_cache_write,
    "decode stage 1": decode_stage1,
    "unified, chunked tiles": unified_chunked,
}


def main() -> int:
    for name, build in KERNELS.items():
        fn, sig, const, warps, stages = build()
        aligned = [n for n in sig if n.endswith("_ptr") or n.startswith("stride")]
        kernel = compile_sm90(JITFunction(fn), sig, const, aligned, warps, stages)
        if "e4m3" not in kernel.asm["ptx"]:
            print(f"{name}: compiled, but no E4M3 conversion in its PTX", flush=True)
            return 1
        print(f"{name}: compiled for sm_90, converts E4M3 ({kernel.metadata.shared} bytes of shared memory)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
