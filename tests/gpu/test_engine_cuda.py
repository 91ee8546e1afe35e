"""GPU: greedy tokens through graph replay equal enforce_eager tokens; steady-state decode hits the cache.

Run on the H200: `pytest -m cuda tests/gpu/test_engine_cuda.py -s` (-s prints the hit ratios).
GRAPHCACHE_TEST_MODEL=DIR uses that checkpoint instead of the embedded tiny model;
GRAPHCACHE_TEST_DTYPE picks the dtype (default float32: replay runs padded shapes, so cuBLAS may
pick other kernels than eager; fp32 keeps those differences far below any argmax margin).
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest
from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine, SamplingParams
from graphcache.metrics import Metrics

NUM_REQUESTS = 24
MAX_TOKENS = 32


def _settings(tmp: Path, device: str, enforce_eager: bool, async_scheduling: str = "auto") -> Settings:
    model = os.environ.get("GRAPHCACHE_TEST_MODEL")
    # A token budget <= max capture size keeps mixed (prefill chunk + decode) steps inside capturable
    # descriptors, so replay covers mixed batches, not only uniform decode.
    return Settings(
        model=Path(model) if model else None,
        cache_dir=tmp,
        device=device,
        dtype=os.environ.get("GRAPHCACHE_TEST_DTYPE", "float32"),
        enforce_eager=enforce_eager,
        max_num_seqs=32,
        max_num_batched_tokens=128,
        max_model_len=512,
        admission="always",
        capture_time_share=1.0,
        async_scheduling=async_scheduling,
    )


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    hi = min(vocab, 1000) - 1
    return [[rng.randint(1, hi) for _ in range(rng.randint(4, 120))] for _ in range(NUM_REQUESTS)]


async def _generate_all(engine: Engine, prompts, tag: str) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    async def one(i: int) -> list[int]:
        ids = []
        async for out in engine.generate(f"{tag}-{i}", prompts[i], params):
            ids += out.token_ids
            assert not out.finished or out.finish_reason == "length", out
        return ids

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def _start(settings: Settings) -> Engine:
    engine = Engine(settings, Metrics())
    engine.start()
    assert engine.wait_ready(600), engine.error
    return engine


async def check_replay_matches_eager(tmp: Path, device: str) -> dict:
    # The reference is synchronous (no overlap); the graph engine below overlaps (auto: on with CUDA),
    # so equal tokens also show that async scheduling changes no greedy output.
    eager = _start(_settings(tmp, device, enforce_eager=True, async_scheduling="off"))
    try:
        prompts = _prompts(eager.runner.model_config.vocab_size)
        reference = await _generate_all(eager, prompts, "eager")
        assert eager.stats()["steps_by_mode"].get("replay", 0) == 0
    finally:
        eager.shutdown()

    graph = _start(_settings(tmp, device, enforce_eager=False))
    try:
        first = await _generate_all(graph, prompts, "graph1")
        before = (await graph.cache_info())["stats"]
        second = await _generate_all(graph, prompts, "graph2")  # steady state: everything captured
        info = await graph.cache_info()
        after = info["stats"]
        steps = graph.stats()["steps_by_mode"]
    finally:
        graph.shutdown()

    if device == "cuda":  # uniform decode runs as one full graph with the Triton kernel inside
        assert {e["mode"] for e in info["entries"] if e["descriptor"].endswith(":decode")} == {"full"}, info
    replayed = [e for e in info["entries"] if e["hits"] > 0]
    mixed = [e for e in replayed if not e["descriptor"].endswith(":decode")]
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    steady_ratio = hits / max(hits + misses, 1)
    result = {
        "replayed_descriptors": [e["descriptor"] for e in replayed],
        "mixed_replayed": len(mixed),
        "steady_hit_ratio": steady_ratio,
        "overall_hit_ratio": after["hits"] / max(after["hits"] + after["misses"], 1),
        "steps": steps,
    }
    print(f"\nengine replay vs eager: {result}")

    mismatched = [i for i in range(len(prompts)) if first[i] != reference[i] or second[i] != reference[i]]
    assert not mismatched, f"greedy tokens through replay differ from eager for requests {mismatched}"
    assert len(replayed) >= 3, f"only {len(replayed)} descriptors replayed: {result}"
    assert mixed, f"no mixed (prefill+decode) descriptor was replayed: {result}"
    assert steady_ratio >= 0.9, f"steady-state hit ratio {steady_ratio:.2f} < 0.9: {result}"
    return result


@pytest.mark.cuda
async def test_replay_tokens_equal_eager_and_decode_hits_cache(tmp_path):
    await check_replay_matches_eager(tmp_path, "cuda")
