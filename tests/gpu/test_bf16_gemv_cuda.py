"""The small-batch bf16 GEMM (model/bf16_gemv.py) on a real GPU (the lent H200).
Run: pytest -m cuda tests/gpu/test_bf16_gemv_cuda.py

- small_mm at every M bucket (and a row count inside each) on every Llama-3-8B and Qwen2.5-0.5B linear shape,
  and every tile the sweep tries, against the fp32 product of the same bf16 operands: rtol 1e-2 and atol 1e-2
  of the largest |product| (one bf16 rounding of the output is 2^-8 relative; the sums are fp32 on both sides),
  the allocator's free memory poisoned with NaN first (an element the kernel did not write would show), random
  non-zero inputs, two draws each.
- small_silu_mul on the gate_up shapes against silu(gate) * up of the fp32 product: rtol 2e-2 (each factor is
  rounded to bf16 before the product, as fused_ops.silu_mul does).
- A CUDA graph holding small_mm and small_silu_mul, replayed on two different inputs copied into its static
  buffer, equals the eager calls on those inputs (bit for bit: the same kernel and tile).
- With programmatic dependent launch (bf16_gemv.PDL) a chain of GEMMs in a graph equals the chain without it.
- A runner with settings.engine.bf16_small_gemm: its graph replays of decode steps of 1, 3 and 20 rows equal the
  plain runner's eager logits within tests/helpers_cuda.py's bf16 tolerance.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from graphcache.engine.worker.runner import ModelRunner
from graphcache.model import bf16_gemv
from graphcache.model.bf16_gemv import BUCKETS
from graphcache.model.fused_ops import silu_mul
from helpers_cuda import assert_decode_replays_match, poison_allocator
from helpers_model import cuda_settings, tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.bf16_gemv_sweep import SHAPES, candidates  # noqa: E402

pytestmark = pytest.mark.cuda

ROWS = sorted({*BUCKETS, 3, 5, 12, 20, 50})  # every bucket, and row counts inside one (padding rows)


@functools.cache
def weight(n: int, k: int) -> torch.Tensor:
    torch.manual_seed(n * 7 + k)
    return (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()


@pytest.fixture(scope="module", autouse=True)
def _free_weights():
    yield
    weight.cache_clear()  # ~2 GB of weights (the 8B LM head alone is 1 GB): not held into the next test file
    torch.cuda.empty_cache()


def close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-2) -> None:
    assert torch.isfinite(got).all(), "non-finite output: an element was not written"
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=rtol * want.abs().max().item())


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", ROWS)
def test_small_mm_equals_the_fp32_product(shape, m):
    n, k = SHAPES[shape]
    w = weight(n, k)
    for seed in (0, 1):
        torch.manual_seed(seed)
        x = (torch.randn(m, k, device="cuda") * (1 + seed)).bfloat16()
        assert bf16_gemv.runs_kernel(x, w)
        poison_allocator()
        close(bf16_gemv.small_mm(x, w), x.float() @ w.float().t())


@pytest.mark.parametrize("shape", [s for s in SHAPES if "gate_up" in s])
@pytest.mark.parametrize("m", ROWS)
def test_small_silu_mul_equals_silu_mul_of_the_product(shape, m):
    n, k = SHAPES[shape]
    w = weight(n, k)
    torch.manual_seed(m)
    x = torch.randn(m, k, device="cuda").bfloat16()
    poison_allocator()
    got = bf16_gemv.small_silu_mul(x, w)
    g, u = (x.float() @ w.float().t()).split(n // 2, dim=-1)
    assert got.shape == (m, n // 2)
    close(got, F.silu(g) * u, rtol=2e-2)


@pytest.mark.parametrize("tile", list(dict.fromkeys(t for b in BUCKETS for t in candidates(b))), ids=str)
def test_every_sweep_tile_is_right_at_ragged_edges(tile):
    """N odd (997: a ragged last tile at every BLOCK_N), K with a partial tile (4096 + 96), rows 1, one short of
    the tile, the tile, and one more (two M tiles)."""
    n, k = 997, 4192
    w = weight(2 * n, k)  # gated: [gate | up], 997 rows each; plain: its first 997 rows
    for m in sorted({1, max(1, tile.block_m - 1), tile.block_m, tile.block_m + 1}):
        x = torch.randn(m, k, device="cuda").bfloat16()
        poison_allocator()
        close(bf16_gemv.launch(x, w[:n], tile), x.float() @ w[:n].float().t())
        g, u = (x.float() @ w.float().t()).split(n, dim=-1)
        close(bf16_gemv.launch(x, w, tile, gated=True), F.silu(g) * u, rtol=2e-2)


def test_a_bucket_measured_slower_than_cublas_runs_torch(monkeypatch):
    """TILES None (the sweep found cuBLAS faster there): torch's product, and silu_mul's own kernel after it."""
    n, k = SHAPES["05b.gate_up"]
    w = weight(n, k)
    x = torch.randn(3, k, device="cuda").bfloat16()
    monkeypatch.setitem(bf16_gemv.TILES, (4, n, k), None)
    assert torch.equal(bf16_gemv.small_mm(x, w), F.linear(x, w))
    assert torch.equal(bf16_gemv.small_silu_mul(x, w), silu_mul(F.linear(x, w), n // 2, fused=True))


def test_into_a_strided_logits_buffer():
    """The LM head writes into the runner's logits rows: a [R, V] view with unit column stride."""
    n, k = SHAPES["05b.lm_head"]
    w = weight(n, k)
    x = torch.randn(5, k, device="cuda").bfloat16()
    buf = torch.full((8, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = buf[:5]
    assert bf16_gemv.small_mm(x, w, out=out) is out
    close(out, x.float() @ w.float().t())
    assert buf[5:].isnan().all()


@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_graph_replay_on_two_inputs_equals_eager(m):
    n, k = SHAPES["8b.o"]
    w, wg = weight(n, k), weight(*SHAPES["05b.gate_up"])
    x = torch.randn(m, k, device="cuda").bfloat16()
    xg = torch.randn(m, wg.shape[1], device="cuda").bfloat16()
    bf16_gemv.small_mm(x, w), bf16_gemv.small_silu_mul(xg, wg)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, yg = bf16_gemv.small_mm(x, w), bf16_gemv.small_silu_mul(xg, wg)
    for seed in (1, 2):
        torch.manual_seed(seed)
        new, new_g = torch.randn_like(x, dtype=torch.float32), torch.randn_like(xg, dtype=torch.float32)
        x.copy_(new), xg.copy_(new_g)
        y.fill_(float("nan")), yg.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, bf16_gemv.small_mm(x, w)) and torch.equal(yg, bf16_gemv.small_silu_mul(xg, wg))
        close(y, x.float() @ w.float().t())


def test_chained_gemms_with_programmatic_dependent_launch_read_what_the_one_before_wrote(monkeypatch):
    """With bf16_gemv.PDL each kernel starts while the one before drains and waits for its writes: a chain
    o -> o -> o of 1 and 16 rows, captured in a graph and replayed, equals the chain without PDL."""
    w = weight(*SHAPES["8b.o"])
    for m in (1, 16):
        x = torch.randn(m, w.shape[1], device="cuda").bfloat16()

        def chain(x=x):  # W [N, K] / sqrt(K): each GEMM keeps x's scale, so 3 deep stays far from 0
            return bf16_gemv.small_mm(bf16_gemv.small_mm(bf16_gemv.small_mm(x, w), w), w)

        monkeypatch.setattr(bf16_gemv, "PDL", False)
        want = chain()
        monkeypatch.setattr(bf16_gemv, "PDL", True)
        chain()  # compiled before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = chain()
        got.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


def test_runner_with_the_small_gemm_replays_what_the_plain_runner_computes():
    path = tiny_checkpoint("llama", hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512)
    kw = dict(
        num_kv_blocks=256, max_model_len=256, capture_sizes=[1, 2, 4, 8, 16, 24, 32], max_capture_size=32
    )
    small = ModelRunner(cuda_settings(path, bf16_small_gemm=True, **kw))
    plain = ModelRunner(cuda_settings(path, enforce_eager=True, bf16_small_gemm=False, **kw))
    assert small.model.small_gemm and not plain.model.small_gemm
    for num_seqs in (1, 3, 20):
        assert_decode_replays_match(small, plain, num_seqs, seed=10 * num_seqs, steps=3, what="small gemm")
