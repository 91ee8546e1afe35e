"""Defaults fit the device: CPU defaults on the CPU, the measured GPU defaults on CUDA (batch limits,
the engine in its own process), and what the user sets always wins (Settings._gpu_defaults)."""

from __future__ import annotations

import pytest
import torch
from graphcache import config
from graphcache.config import GPU_BATCH_DEFAULTS, Settings


def test_cpu_keeps_the_small_defaults():
    s = Settings(device="cpu")
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == (64, 1024)


def test_cuda_takes_the_gpu_defaults_unless_set():
    s = Settings(device="cuda")
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == (
        GPU_BATCH_DEFAULTS["max_num_seqs"],
        GPU_BATCH_DEFAULTS["max_num_batched_tokens"],
    )
    s = Settings(device="cuda", max_num_seqs=32)
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == (
        32,
        GPU_BATCH_DEFAULTS["max_num_batched_tokens"],
    )
    s = Settings(device="cuda", max_num_batched_tokens=128)  # rows never exceed an explicit token budget
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == (128, 128)


def test_env_counts_as_set(monkeypatch):
    monkeypatch.setenv("GRAPHCACHE_MAX_NUM_SEQS", "16")
    s = Settings(device="cuda")
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == (
        16,
        GPU_BATCH_DEFAULTS["max_num_batched_tokens"],
    )


def test_auto_follows_the_machine():  # the real probe: this machine's device
    s = Settings(device="auto")
    memory = config.gpu_memory_bytes()
    large = memory is not None and memory >= config.LARGE_GPU_BYTES
    expected = (64, 1024) if memory is None else (512 if large else 256, 8192)
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == expected


def test_engine_process_defaults_on_with_cuda_at_tp1_only():
    assert Settings(device="cpu").engine.engine_process is False
    assert Settings(device="cuda").engine.engine_process is True
    assert (
        Settings(device="cuda", engine_process=False).engine.engine_process is False
    )  # the user's choice wins
    assert (
        Settings(device="cuda", tensor_parallel_size=2).engine.engine_process is False
    )  # not supported there yet
    assert Settings(device="auto").engine.engine_process is torch.cuda.is_available()


def test_updated_replaces_by_flat_name_and_leaves_the_rest():
    s = Settings(device="cpu", port=8000, cache_max_entries=5)
    t = s.updated(port=9000, cache_max_entries=7)
    assert (t.http.port, t.graph_cache.max_entries, t.http.host) == (9000, 7, s.http.host)
    assert (s.http.port, s.graph_cache.max_entries) == (8000, 5)  # a copy: the original is unchanged
    with pytest.raises(TypeError, match="no_such_setting"):
        s.updated(no_such_setting=1)


@pytest.fixture
def gpu_of(monkeypatch):
    """Pretend the first CUDA device has this many GiB (config.gpu_memory_bytes is the only probe)."""

    def set_memory(gib: float) -> None:
        monkeypatch.setattr(config, "gpu_memory_bytes", lambda: int(gib * 2**30))

    return set_memory


def test_large_gpus_run_twice_the_sequences_with_decode_graphs_to_match(gpu_of):
    gpu_of(141)  # H200
    s = Settings(device="auto")
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == (512, 8192)
    assert s.graph_cache.max_capture_size == 512
    assert config.LARGE_GPU_BYTES > 48 * 2**30  # an L40S (48 GB) keeps the 256 defaults
    gpu_of(48)
    s = Settings(device="cuda")
    assert (s.engine.max_num_seqs, s.graph_cache.max_capture_size) == (256, 256)


def test_what_the_user_sets_wins_on_a_large_gpu(gpu_of):
    gpu_of(80)  # H100
    s = Settings(device="cuda", max_num_seqs=128)
    assert (s.engine.max_num_seqs, s.graph_cache.max_capture_size) == (128, 256)  # never below 256
    s = Settings(device="cuda", max_capture_size=64)
    assert (s.engine.max_num_seqs, s.graph_cache.max_capture_size) == (512, 64)
    s = Settings(device="cuda", max_num_seqs=1024)  # captures stop at the measured 512
    assert s.graph_cache.max_capture_size == 512
    s = Settings(device="cuda", max_num_batched_tokens=300)  # rows never exceed an explicit token budget
    assert (s.engine.max_num_seqs, s.graph_cache.max_capture_size) == (300, 300)
    assert Settings(device="cpu").engine.max_num_seqs == 64  # the CPU is never probed


def test_no_cuda_means_no_gpu_defaults_under_auto(gpu_of, monkeypatch):
    monkeypatch.setattr(config, "gpu_memory_bytes", lambda: None)
    s = Settings(device="auto")
    assert (s.engine.max_num_seqs, s.graph_cache.max_capture_size) == (64, 256)
