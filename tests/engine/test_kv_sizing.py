"""How many KV blocks fit (engine/worker/kv_cache.py): kv_cache_memory_fraction of the free memory, or
vLLM's gpu_memory_utilization of the whole GPU less what the server took since it started and a reserve
for what comes after the cache; num_kv_blocks overrides both. The GPU's memory is mocked."""

from __future__ import annotations

import pytest
import torch
from graphcache.config import Settings
from graphcache.engine.worker import kv_cache
from graphcache.engine.worker.kv_cache import num_kv_blocks, utilization_kv_bytes
from graphcache.model.tiny import DEFAULT_SHAPE

GIB = 2**30
CUDA = torch.device("cuda")
BLOCK = 1 << 20  # 1 MiB blocks keep the arithmetic readable


@pytest.fixture
def gpu(monkeypatch):
    """Pretend the GPU has `total` GiB, `free` of them free now."""

    def set_memory(total: float, free: float) -> None:
        monkeypatch.setattr(
            kv_cache.torch.cuda, "mem_get_info", lambda device=None: (int(free * GIB), int(total * GIB))
        )

    return set_memory


def blocks(settings: Settings, **kw) -> int:
    return num_kv_blocks(
        settings, block_bytes=BLOCK, max_blocks_per_seq=4, max_model_len=64, device=CUDA, **kw
    )


def test_the_fraction_of_free_memory_by_default(gpu):
    gpu(total=80, free=60)
    assert blocks(Settings(device="cpu")) == 30 * 1024  # 0.5 x 60 GiB


def test_gpu_memory_utilization_is_a_share_of_the_whole_gpu(gpu):
    gpu(total=80, free=60)  # the weights and buffers took 20 GiB since the start (80 free then)
    s = Settings(device="cpu", gpu_memory_utilization=0.9)
    assert blocks(s, start_free=80 * GIB, reserve=2 * GIB) == int((72 - 20 - 2) * 1024)
    assert (
        utilization_kv_bytes(0.9, total=80 * GIB, start_free=80 * GIB, free=60 * GIB, reserve=2 * GIB)
        == int(0.9 * 80 * GIB) - 22 * GIB
    )


def test_other_processes_memory_is_not_counted(gpu):
    """Two servers at 0.45 share a GPU: the second finds the first's 36 GiB taken at its start, and still gets
    its own 36 GiB budget."""
    gpu(total=80, free=34)  # at start 44 GiB were free; this server's weights took 10
    s = Settings(device="cpu", gpu_memory_utilization=0.45)
    assert blocks(s, start_free=44 * GIB, reserve=1 * GIB) == int((36 - 10 - 1) * 1024)


def test_a_gpu_without_the_asked_share_free_is_refused(gpu):
    gpu(total=80, free=30)
    s = Settings(device="cpu", gpu_memory_utilization=0.9)
    with pytest.raises(RuntimeError, match="lower --gpu-memory-utilization or free the GPU"):
        blocks(s, start_free=40 * GIB)


def test_a_budget_too_small_for_one_sequence_names_the_knob(gpu):
    gpu(total=80, free=70)
    s = Settings(device="cpu", gpu_memory_utilization=0.2)
    with pytest.raises(RuntimeError, match="raise gpu_memory_utilization"):
        blocks(s, start_free=80 * GIB, reserve=10 * GIB)


def test_num_kv_blocks_overrides_both(gpu):
    gpu(total=80, free=60)
    assert (
        blocks(Settings(device="cpu", gpu_memory_utilization=0.9, num_kv_blocks=7), start_free=80 * GIB) == 7
    )


def test_the_activation_reserve_grows_with_the_step():
    from graphcache.model.config import ModelConfig

    shape = DEFAULT_SHAPE
    config = ModelConfig(
        architecture="llama",
        vocab_size=shape.get("vocab", 1024),
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_layers=shape["layers"],
        num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"],
        head_dim=shape["hidden"] // shape["heads"],
        rope_theta=10000.0,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
    )
    small = kv_cache.activation_reserve_bytes(config, max_tokens=64, max_reqs=8, tp_size=1, itemsize=2)
    large = kv_cache.activation_reserve_bytes(config, max_tokens=8192, max_reqs=8, tp_size=1, itemsize=2)
    split = kv_cache.activation_reserve_bytes(config, max_tokens=8192, max_reqs=8, tp_size=2, itemsize=2)
    assert 0 < small < large and split < large
