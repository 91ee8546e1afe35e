"""The small-batch 16-bit GEMM (model/bf16_gemv.py) on the CPU: which calls take the kernel, the torch
fallback they get otherwise, and the kernel itself under Triton's interpreter (conftest turns it on without
CUDA) at every M bucket's default tile.

The interpreter runs fp16 operands (its bf16 products are wrong: numpy has no bf16; the GPU tests run bf16).
Bound: relative L2 error against the fp32 product < 2e-3 (the fp16 output's rounding is ~3e-4 of each value;
the sums are fp32 on both sides), gated < 5e-3 (silu's and both factors' roundings to fp16 on top).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.worker.runner import ModelRunner
from graphcache.model import bf16_gemv
from graphcache.model.bf16_gemv import BUCKETS, DEFAULT_TILES, MAX_ROWS, Tile
from graphcache.model.fp8_linear import Fp8Linear
from graphcache.model.fused_ops import silu_mul
from graphcache.model.triton_support import HAVE_TRITON
from helpers_model import Blocks, cpu_settings, prompt_ids, tiny_checkpoint


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize(
    "rows,bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (17, 32), (33, 64), (64, 64)]
)
def test_rows_round_up_to_their_bucket(rows, bucket):
    assert bf16_gemv.bucket_of(rows) == bucket


@pytest.mark.parametrize("rows", [0, MAX_ROWS + 1])
def test_rows_outside_the_buckets_are_refused(rows):
    with pytest.raises(ValueError, match="1 to 64 rows"):
        bf16_gemv.bucket_of(rows)


def test_default_tiles_cover_every_bucket_and_keep_the_layout_rules():
    assert set(DEFAULT_TILES) == set(BUCKETS)
    for bucket, t in DEFAULT_TILES.items():
        if t.design == "fma":  # one M tile for the bucket; every warp along K, 8 values a thread
            assert t.block_m == bucket and t.block_k % (8 * 32 * t.warps) == 0
        else:  # tl.dot's smallest tile is 16 a side
            assert t.design == "dot" and min(t.block_m, t.block_n, t.block_k) >= 16


def test_measured_tiles_override_the_defaults(monkeypatch):
    tile = Tile("dot", 16, 32, 512, 8, 3)
    monkeypatch.setitem(bf16_gemv.TILES, (16, 4096, 4096), tile)
    assert bf16_gemv.tile_for(11, 4096, 4096) == tile
    assert bf16_gemv.tile_for(11, 4096, 1024) == DEFAULT_TILES[16]  # a shape the table does not name
    assert bf16_gemv.tile_for(1, 4096, 1024) == DEFAULT_TILES[1]
    monkeypatch.setitem(bf16_gemv.TILES, (64, 4096, 4096), None)  # cuBLAS measured faster there
    assert bf16_gemv.tile_for(40, 4096, 4096) is None


def test_the_measured_table_names_buckets_and_tiles_the_kernel_takes():
    """TILES (pasted from the sweep): every key a bucket of the served shapes, every tile of its design's
    row range and covering the bucket's rows (fma: one row a register set, block_m = bucket; dot: >= 16)."""
    assert bf16_gemv.TILES
    for (bucket, n, k), tile in bf16_gemv.TILES.items():
        assert bucket in bf16_gemv.BUCKETS and n % 8 == 0 and k % 8 == 0
        if tile is None:
            continue
        assert tile.design in ("fma", "dot")
        if tile.design == "fma":
            assert tile.block_m == bucket <= 8 and tile.block_k == 8 * 32 * tile.warps
        else:
            assert tile.block_m >= max(16, bucket)


def test_cpu_calls_take_the_torch_path_and_compute_the_same_function():
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen).bfloat16() for s in ((3, 64), (48, 64), (48,)))
    assert not bf16_gemv.runs_kernel(x, w)
    assert torch.equal(bf16_gemv.small_mm(x, w), F.linear(x, w))
    assert torch.equal(bf16_gemv.small_mm(x, w, b), F.linear(x, w, b))
    out = torch.full((3, 48), float("nan"), dtype=torch.bfloat16)
    assert bf16_gemv.small_mm(x, w, out=out) is out and torch.equal(out, x @ w.t())
    assert torch.equal(bf16_gemv.small_silu_mul(x, w), silu_mul(F.linear(x, w), 24, fused=False))
    with pytest.raises(ValueError, match="without a bias"):
        bf16_gemv.small_mm(x, w, b, out=out)


def test_only_plain_linear_layers_on_the_kernel_path_are_taken():
    linear = torch.nn.Linear(64, 32, bias=False).bfloat16()
    x = torch.randn(2, 64).bfloat16()
    assert not bf16_gemv.takes(linear, x, True)  # the CPU: never the kernel
    assert not bf16_gemv.takes(linear, x, False)
    assert not bf16_gemv.takes(Fp8Linear.quantized(linear), x, True)
    assert torch.equal(bf16_gemv.linear(linear, x, True), linear(x))


def test_the_kernel_needs_cuda_16_bits_contiguous_rows_and_at_most_64_of_them():
    w = torch.empty(32, 64, dtype=torch.bfloat16, device="meta")
    cuda_like = dict(dtype=torch.bfloat16, device="meta")

    def takes(x, w=w):  # runs_kernel with is_cuda faked: what the GPU would decide
        sixteen = x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
        rows = x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS
        return sixteen and rows and x.stride(1) == 1

    assert takes(torch.empty(64, 64, **cuda_like))
    assert not takes(torch.empty(65, 64, **cuda_like))
    assert not takes(torch.empty(2, 64, dtype=torch.float32, device="meta"))
    assert not takes(torch.empty(64, 2, **cuda_like).t())
    assert not bf16_gemv.runs_kernel(torch.empty(2, 64, **cuda_like), w)  # meta is not CUDA


needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


@needs_triton
@pytest.mark.parametrize("bucket", BUCKETS)
def test_interpreted_kernel_equals_the_fp32_product(bucket):
    """Each bucket's default tile on 1 row, the bucket's rows and one row count between, at a K with full
    tiles and a tail (1120 = 1024 + 96) and an N that is not a multiple of BLOCK_N (edge rows clamped)."""
    tile = DEFAULT_TILES[bucket]
    n, k = 40, 1120
    gen = torch.Generator().manual_seed(bucket)
    w = (torch.randn(n, k, generator=gen) / k**0.5).half()
    for m in sorted({1, max(1, bucket - 1), bucket}):
        x = torch.randn(m, k, generator=gen).half()
        out = torch.full((m, n), float("nan"), dtype=torch.float16)
        got = bf16_gemv.launch(x, w, tile, out=out)
        assert got is out and torch.isfinite(got).all()
        assert rel_err(got, x.float() @ w.float().t()) < 2e-3, (bucket, m)


@needs_triton
@pytest.mark.parametrize("tile", [DEFAULT_TILES[1], DEFAULT_TILES[4], DEFAULT_TILES[16]], ids=str)
def test_interpreted_gated_kernel_equals_silu_mul_of_the_product(tile):
    n, k, m = 24, 1120, 3
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(2 * n, k, generator=gen) / k**0.5 * 3).half()
    x = torch.randn(m, k, generator=gen).half()
    got = bf16_gemv.launch(x, w, tile, gated=True)
    g, u = (x.float() @ w.float().t()).split(n, dim=-1)
    assert got.shape == (m, n) and torch.isfinite(got).all()
    assert rel_err(got, F.silu(g) * u) < 5e-3


def test_the_setting_is_cuda_only_and_the_model_switch_changes_nothing_on_the_cpu():
    """The runner turns the kernel on only on CUDA; switched on by hand on the CPU, every layer keeps its
    torch op (no kernel there), so the logits are the same bit for bit."""
    path = tiny_checkpoint("llama")
    on = ModelRunner(cpu_settings(path, enforce_eager=True, bf16_small_gemm=True))
    off = ModelRunner(cpu_settings(path, enforce_eager=True))
    assert on.settings.engine.bf16_small_gemm and not on.model.small_gemm
    assert on.model.use_small_gemm(True) == 0  # nothing to compile on the CPU
    assert all(m.small_gemm for m in on.model.modules() if hasattr(m, "small_gemm"))
    blocks, prompt = Blocks(4), prompt_ids(7, seed=3)
    table = blocks.table(len(prompt) + 4)
    plan = StepPlan.standalone([StepSeq(list(prompt), 0, table, True)])
    assert torch.equal(on.execute(plan).logits, off.execute(plan).logits)
    decode = StepPlan.standalone([StepSeq([5], len(prompt), table, True)])
    assert torch.equal(on.execute(decode).logits, off.execute(decode).logits)
