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


# --- what an earlier engine of the process left behind counts as free -----------------------------------


@pytest.fixture
def cached_allocator(monkeypatch):
    """A GPU of 80 GiB, 20 free at the driver, 30 more held by the caching allocator unused (what an engine
    shut down earlier left cached) until empty_cache gives them back; calls are recorded in order."""
    state = {"cached": 30 * GIB, "calls": []}

    def empty_cache() -> None:
        state["calls"].append("empty_cache")
        state["cached"] = 0

    def mem_get_info(device=None) -> tuple[int, int]:
        state["calls"].append("mem_get_info")
        return 50 * GIB - state["cached"], 80 * GIB

    monkeypatch.setattr(kv_cache.torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(kv_cache.torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(kv_cache.gc, "collect", lambda *a: state["calls"].append("gc") or 0)
    return state


def test_blocks_the_allocator_holds_unused_count_as_free(cached_allocator):
    assert blocks(Settings(device="cpu")) == 25 * 1024  # 0.5 x (20 + 30) GiB, not 0.5 x 20
    assert cached_allocator["calls"] == ["empty_cache", "mem_get_info"]


def test_the_start_figure_collects_garbage_first(cached_allocator):
    assert kv_cache.device_free_bytes(CUDA, collect=True) == (50 * GIB, 80 * GIB)
    assert cached_allocator["calls"] == ["gc", "empty_cache", "mem_get_info"]
    s = Settings(device="cpu", gpu_memory_utilization=0.5)
    # 50 free at the start (with what was cached), nothing taken since: the 40 GiB share less the reserve
    assert blocks(s, start_free=50 * GIB, reserve=2 * GIB) == (40 - 2) * 1024


def test_a_shut_down_engine_leaves_nothing_alive(tmp_path):
    """The engine freezes the collector's heap once ready (gc.freeze): its shutdown must still free the
    runner (weights, KV cache, graphs), which reference cycles hold, or the process's next engine sizes its
    KV cache next to the first one's."""
    import gc
    import weakref

    from graphcache.engine.loop.engine import Engine
    from graphcache.metrics import Metrics
    from helpers_model import cpu_settings, tiny_checkpoint

    engine = Engine(cpu_settings(tiny_checkpoint("llama"), warmup_decode_sizes=[1, 2]), Metrics())
    engine.start()
    try:
        assert engine.wait_ready(120), engine.error
        runner = engine.core.runner
        alive = [weakref.ref(runner), weakref.ref(runner.kv_storage), weakref.ref(runner.cache)]
        del runner
    finally:
        engine.shutdown()
    gc.collect()
    assert [r() is None for r in alive] == [True, True, True]


@pytest.mark.cuda
def test_cuda_a_second_engine_in_one_process_gets_the_same_kv_cache():
    """Two engines one after the other in one process, the KV cache sized from free memory: the second gets
    the first's block count within 2%. A first engine still holding its cache (15% of the free memory) would
    cut the second's by 15%, reserved-but-unused blocks by as much; a share this size keeps the tiny model's
    block count (~16 KiB blocks) in the hundreds of thousands, which the block manager lists quickly."""
    import gc

    from graphcache.engine.loop.engine import Engine
    from graphcache.metrics import Metrics
    from helpers_model import cuda_settings, tiny_checkpoint

    settings = cuda_settings(tiny_checkpoint("llama"), num_kv_blocks=None, kv_cache_memory_fraction=0.15)
    counts = []
    for _ in range(2):
        engine = Engine(settings, Metrics())
        engine.start()
        try:
            assert engine.wait_ready(300), engine.error
            counts.append(engine.core.runner.num_kv_blocks)
        finally:
            engine.shutdown()
        del engine
        gc.collect()
    assert abs(counts[1] - counts[0]) <= 0.02 * counts[0], counts
