"""The batched LoRA kernels (model/lora_kernels.py) against the torch reference (model/lora_layers.py):
several shapes, slot mixes with base tokens, unused slots poisoned with NaN (a kernel that reads a slot no
token uses shows), base rows of y left bit for bit; inside a captured CUDA graph, two adapter mixes
replayed from one graph equal eager. On the CPU the same kernels run under Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from graphcache.model.lora_layers import lora_add_reference

SHAPES = [  # (T, in, out, slots, rank)
    (1, 64, 96, 2, 16),
    (3, 128, 200, 3, 48),
    (37, 200, 130, 4, 32),
    (130, 256, 512, 2, 16),
    (512, 512, 1024, 4, 48),
]


def _case(t, k, n, s, r, *, device, dtype, seed=0, used=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(device, dtype)
    a = (torch.randn(s, r, k, generator=g) / k**0.5).to(device, dtype)
    b = (torch.randn(s, n, r, generator=g) / r**0.5).to(device, dtype)
    used = list(range(s - 1)) if used is None else used  # the last slot: no token uses it
    choices = torch.tensor([-1, *used])
    index = choices[torch.randint(0, len(choices), (t,), generator=g)].to(device)
    for slot in set(range(s)) - set(used):
        a[slot], b[slot] = float("nan"), float("nan")
    y = torch.randn(t, n, generator=g).to(device, dtype)
    return y, x, a, b, index


def test_kernels_match_the_reference_under_the_triton_interpreter():
    pytest.importorskip("triton")
    script = textwrap.dedent(
        f"""
        import torch
        from graphcache.model.lora_kernels import lora_shrink_expand
        from graphcache.model.lora_layers import lora_add_reference
        from test_lora_kernels import _case
        for shape in {SHAPES[:4]!r}:
            y, x, a, b, index = _case(*shape, device="cpu", dtype=torch.float32)
            want, got = y.clone(), y.clone()
            lora_add_reference(want, x, torch.nan_to_num(a), torch.nan_to_num(b), index)
            lora_shrink_expand(got, x, a, b, index)
            assert torch.equal(got[index < 0], y[index < 0]), shape
            assert (got - want).abs().max() < 1e-4, (shape, (got - want).abs().max())
        y, x, a, b, _ = _case(5, 64, 64, 2, 16, device="cpu", dtype=torch.float32)
        got = y.clone()
        lora_shrink_expand(got, x, a, b, torch.full((5,), -1))
        assert torch.equal(got, y)
        print("ok")
        """
    )
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(here), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_match_the_reference_on_cuda(shape, dtype):
    from graphcache.model.lora_kernels import lora_shrink_expand

    y, x, a, b, index = _case(*shape, device="cuda", dtype=dtype, seed=sum(shape))
    want, got = y.float().clone(), y.clone()
    lora_add_reference(want, x.float(), torch.nan_to_num(a.float()), torch.nan_to_num(b.float()), index)
    lora_shrink_expand(got, x, a, b, index)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    assert torch.equal(got[index < 0], y[index < 0])  # base rows untouched, bit for bit
    tol = 0.02 * want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= tol


@pytest.mark.cuda
def test_one_graph_serves_two_adapter_mixes():
    from graphcache.model.lora_kernels import lora_shrink_expand

    t, k, n, s, r = 64, 256, 384, 3, 16
    y0, x, a, b, _ = _case(t, k, n, s, r, device="cuda", dtype=torch.bfloat16, used=[0, 1, 2])
    index = torch.full((t,), -1, dtype=torch.int64, device="cuda")  # the graph's input
    y = y0.clone()
    lora_shrink_expand(y, x, a, b, index)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_shrink_expand(y, x, a, b, index)
    g = torch.Generator().manual_seed(5)
    for mix in ([-1, 0, 1], [2, -1, 2, 0]):
        picks = torch.tensor(mix)[torch.randint(0, len(mix), (t,), generator=g)]
        index.copy_(picks)
        y.copy_(y0)
        graph.replay()
        eager = y0.clone()
        lora_shrink_expand(eager, x, a, b, index)
        torch.cuda.synchronize()
        assert torch.equal(y, eager), mix
