"""The top-k select (engine/sample/kth_select.py): the kernel's radix select against the torch twin
(kth_logits, itself against a sort), in Triton's interpreter on the CPU and on the served shape on CUDA."""

from __future__ import annotations

import os

import pytest
import torch
from graphcache.engine.sample import kth_select as ks
from helpers_sampling import NEG_INF

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
needs_interpreter = pytest.mark.skipif(
    not (INTERPRET and ks.HAVE_TRITON), reason="needs triton's interpreter"
)
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and ks.HAVE_TRITON), reason="needs CUDA and triton"
)


def sorted_kth(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The reference: a full sort, NaN as -inf; -inf where k is off (outside 1..V-1)."""
    x = x.float().nan_to_num(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
    on = (k > 0) & (k < x.shape[1])
    vals = x.sort(dim=-1, descending=True).values.gather(1, (k.clamp(1, x.shape[1]) - 1).view(-1, 1)).view(-1)
    return torch.where(on, vals, NEG_INF)


def hard_rows(dtype: torch.dtype, vocab: int = 300) -> torch.Tensor:
    """[8, vocab] of dtype: NaN, -inf and +inf scattered; ties at the k-th; all-negative and
    near-equal rows (their keys share many digits); a row of one value."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(8, vocab, generator=g) * 3
    x[0, ::7] = float("nan")
    x[1, ::3] = NEG_INF
    x[2] = -(x[2].abs() + 1)  # every value negative: keys with their bits flipped
    x[3] = 5.0 + torch.randn(vocab, generator=g) * 1e-3  # near-equal: a long shared prefix
    x[4, 40:60] = 7.0  # twenty tied at the top
    x[5] = 2.0  # one value
    x[6, 17] = float("inf")
    x[7] = x[7] * 1e-30  # fp32 subnormals and tiny normals (zeros in 16-bit dtypes)
    return x.to(dtype)


K = torch.tensor([3, 50, 7, 299, 20, 150, 1, 120])


def test_kth_logits_matches_a_sort():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = hard_rows(dtype)
        assert torch.equal(ks.kth_logits(x, K), sorted_kth(x, K)), dtype
    off = ks.kth_logits(hard_rows(torch.float32), torch.tensor([0, 300, -1, 301, 1, 1, 1, 1]))
    assert (off[:4] == NEG_INF).all()


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [64, 512])  # k above 64 runs without the lanes' bound
def test_kernel_select_matches_a_sort_in_the_interpreter(dtype, block):
    x = hard_rows(dtype)
    for k in (K, K.flip(0), torch.tensor([1, 2, 299, 64, 65, 0, 300, 10])):
        got = ks.kth_largest_triton(x, torch.arange(8), k, block=block, warps=1)
        assert torch.equal(got, sorted_kth(x, k)), (dtype, block, k)


@needs_interpreter
def test_kernel_select_reads_the_given_rows_in_the_interpreter():
    x = hard_rows(torch.bfloat16)
    rows = torch.tensor([5, 0, 5, 3])
    k = torch.tensor([4, 9, 300, 33])
    got = ks.kth_largest_triton(x, rows, k, block=64, warps=1)
    assert torch.equal(got, sorted_kth(x[rows], k))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("scale", [3.0, 0.05])
def test_cuda_kernel_select_matches_a_sort_on_the_served_shape(scale):
    """256 rows x 151,936, bf16 (the decode step's logits; scale 0.05: long runs of ties), k from 1 to
    above the lanes (8,192), and the hard rows at each dtype."""
    g = torch.Generator().manual_seed(17)
    x = (torch.randn(256, 151936, generator=g) * scale).to(torch.bfloat16)
    k = torch.tensor([20, 50, 1, 0] * 63 + [5000, 9000, 151935, 151936])
    got = ks.kth_largest_triton(x.cuda(), torch.arange(256, device="cuda"), k.cuda())
    assert torch.equal(got.cpu(), sorted_kth(x, k))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        h = hard_rows(dtype, vocab=151936)
        got = ks.kth_largest_triton(h.cuda(), torch.arange(8, device="cuda"), K.cuda())
        assert torch.equal(got.cpu(), sorted_kth(h, K)), dtype
