"""Mixture-of-experts on a real GPU: the Triton grouped GEMM (model/moe_kernel.py) against the PyTorch
reference, inside a CUDA graph, and a small MoE model's graph replay against eager.
Run on the lent H200: pytest -m cuda tests/gpu/test_moe_cuda.py

The kernel tests route random tokens (the same routing goes to both sides) at the benchmark's
Qwen3-30B-A3B layer shape and at small odd shapes, with the caching allocator poisoned by NaN first
(a row the kernels skip would show), and a second input through the same shapes. The model test runs
in fp32: bf16 noise between padded and unpadded GEMMs could flip a near-tie in the routing and change
a token's experts, which is not what the test is about.
"""

from __future__ import annotations

import pytest
import torch
from graphcache.engine.worker.runner import ModelRunner
from graphcache.model.moe import experts_reference, route
from helpers_cuda import poison_allocator
from helpers_model import cuda_settings, tiny_checkpoint

from gpu.test_runner_cuda import _drive

pytestmark = pytest.mark.cuda
QWEN3_30B = dict(e=128, k=8, hidden=2048, inter=768)  # one Qwen3-30B-A3B MoE layer
SMALL = dict(e=8, k=2, hidden=200, inter=72)  # odd sizes: masked column and reduction tiles


def _inputs(t: int, e: int, k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, hidden, generator=g, device="cuda").to(dtype)
    w_gate_up = (torch.randn(e, 2 * inter, hidden, generator=g, device="cuda") / hidden**0.5).to(dtype)
    w_down = (torch.randn(e, hidden, inter, generator=g, device="cuda") / inter**0.5).to(dtype)
    weights, ids = route(torch.randn(t, e, generator=g, device="cuda"), k, True, torch.float32)
    return x, w_gate_up, w_down, weights, ids


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert torch.isfinite(got).all(), f"{what}: non-finite rows (a row the kernels skipped)"
    # fp32: exact products (ieee dots), only the summation order differs; bf16: rounded intermediates may
    # differ by an ulp where the accumulation order does.
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), want.float(), msg=lambda m: f"{what}: {m}", **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ["qwen3_30b", "small"])
@pytest.mark.parametrize("t", [1, 7, 64, 300, 2048])  # decode sizes (BLOCK_M 16) up to prefill (BLOCK_M 64)
def test_fused_experts_match_reference(dtype, shape, t):
    from graphcache.model.moe_kernel import fused_experts

    dims = QWEN3_30B if shape == "qwen3_30b" else SMALL
    for seed in (0, 1):
        args = _inputs(t, **dims, dtype=dtype, seed=seed)
        want = experts_reference(*args)
        poison_allocator()
        got = fused_experts(*args)
        _check(got, want, dtype, f"{shape} T={t} seed={seed}")


@pytest.mark.parametrize("t", [1, 48, 512])
def test_fused_experts_replay_in_a_cuda_graph(t):
    """Captured once (a host sync or a data-dependent size would fail the capture), replayed on new
    routing and inputs copied into the static buffers: equal to the reference each time."""
    from graphcache.model.moe_kernel import fused_experts

    dims, dtype = QWEN3_30B, torch.bfloat16
    static = _inputs(t, **dims, dtype=dtype, seed=0)
    fused_experts(*static)  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(*static)
    for seed in (1, 2):
        fresh = _inputs(t, **dims, dtype=dtype, seed=seed)
        for buf, new in zip(static, fresh, strict=True):
            buf.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        _check(out, experts_reference(*fresh), dtype, f"replay T={t} seed={seed}")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_model_replay_equals_eager(arch):
    """Mixed prefill/decode steps and decode batches (full decode graphs: the MoE layers inside the
    captured graph) against an enforce_eager runner, step by step."""
    path = tiny_checkpoint(
        arch,
        hidden=256,
        layers=3,
        heads=8,
        kv_heads=2,
        intermediate=512,
        experts=16,
        experts_per_tok=4,
        moe_intermediate=128,
        tie_word_embeddings=False,
    )
    graph = ModelRunner(cuda_settings(path, dtype="float32", decode_capture_mode="full"))
    eager = ModelRunner(cuda_settings(path, dtype="float32", enforce_eager=True))
    assert graph.backend == "cuda" and type(graph.model.layers[0].mlp).__name__ == "SparseMoE"
    modes = _drive(graph, eager, seed=1)
    assert set(modes) == {"replay"}, modes
    entries = graph.cache.entries()
    assert {e.mode for e in entries if e.descriptor.endswith(":decode")} == {"full"}
