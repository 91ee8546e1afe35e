"""model/paged_inputs.py: the input checks the paged-attention kernels make before a launch."""

from __future__ import annotations

import pytest
import torch
from graphcache.model.paged_inputs import paged_cache_dims


def _inputs(heads=4, kv_heads=2, head_dim=8, block_size=16):
    q = torch.randn(3, heads, head_dim)
    k = torch.randn(5, block_size, kv_heads, head_dim)
    return q, torch.empty_like(q), k, torch.randn_like(k), torch.zeros(3, 2, dtype=torch.int32)


def test_returns_block_size_and_kv_heads():
    assert paged_cache_dims(*_inputs()) == (16, 2)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, o, k, v, t: (q[:, :3], o, k, v, t), "vs k_cache"),  # 3 heads over 2 KV heads
        (lambda q, o, k, v, t: (q, o, k, v[:, :, :1], t), "vs k_cache"),  # v_cache not k_cache's shape
        (lambda q, o, k, v, t: (q[..., ::2], o, k[..., ::2], v[..., ::2], t), "contiguous head_dim"),
        (lambda q, o, k, v, t: (q, o, k, v, t.t().contiguous().t()), "contiguous rows"),
    ],
)
def test_rejects_what_the_kernels_would_misread(change, message):
    with pytest.raises(ValueError, match=message):
        paged_cache_dims(*change(*_inputs()))


def test_rejects_a_block_size_that_is_no_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        paged_cache_dims(*_inputs(block_size=12))
