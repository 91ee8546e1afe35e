"""A served tensor_parallel_size=2 engine on the CPU (gloo): the real Engine spawns the worker rank itself
(engine/worker/tp_runner.py, engine/worker/tp_worker.py). Greedy outputs equal the unsharded engine's (completions,
a stream, a chunked long prompt, with async scheduling's placeholder ids crossing to the worker);
admin clear and warmup while requests run leave both ranks' cache decision logs equal; a killed worker
makes the engine die loudly (the request in flight ends with an error, new ones are refused), no hang.

Deadlines are generous (a busy 2-core machine), and every wait has one: a hang fails, never blocks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine, EngineDead
from graphcache.engine.sequence import SamplingParams
from graphcache.engine.worker.tp_runner import TensorParallelRunner
from graphcache.graphs.descriptor import BatchDescriptor as D
from graphcache.graphs.policy.agreement import Decision
from graphcache.metrics import Metrics

LOAD_TIMEOUT_S = 300.0
PROMPTS = [[5, 6, 7, 8, 9], [300, 12, 77, 4], list(range(20, 150))]  # the last: 130 tokens, chunked by 64


def _settings(cache_dir, tp: int, **overrides) -> Settings:
    base = dict(
        device="cpu",
        dtype="float32",
        tensor_parallel_size=tp,
        cache_dir=str(cache_dir),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        capture_sizes=[1, 2, 4, 8, 16, 32, 64],
        max_capture_size=64,
        warmup_decode_sizes=[1, 2],
        max_model_len=256,
        num_kv_blocks=64,
        block_size=16,
    )
    return Settings(**(base | overrides))


def _start(settings: Settings, metrics: Metrics | None = None) -> Engine:
    engine = Engine(settings, metrics)
    engine.start()
    assert engine.wait_ready(LOAD_TIMEOUT_S), engine.error
    return engine


async def _generate(
    engine: Engine, rid: str, prompt: list[int], max_tokens: int, stream: bool = False
) -> list[int]:
    ids, last = [], None
    async for out in engine.generate(
        rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), stream=stream
    ):
        ids += out.token_ids
        last = out
    assert last.finish_reason == "length", (last.finish_reason, last.error)
    return ids


async def _run_all(engine: Engine, max_tokens: int = 12) -> list[list[int]]:
    """The prompts one by one (completions), then all at once as streams (a batch with mixed lengths)."""
    alone = [await _generate(engine, f"a{i}", p, max_tokens) for i, p in enumerate(PROMPTS)]
    together = await asyncio.gather(
        *(_generate(engine, f"s{i}", p, max_tokens, stream=True) for i, p in enumerate(PROMPTS))
    )
    return alone + list(together)


async def _decision_logs(engine: Engine) -> list[list[Decision]]:
    """Every rank's log, on the engine thread (the test hook: engine commands are ordered with the steps)."""
    return await engine._call(lambda: engine.runner.rank_decision_logs())


@pytest.mark.timeout(900)
async def test_tp2_engine_serves_like_tp1_and_keeps_ranks_consistent(tmp_path):
    reference = _start(_settings(tmp_path, 1))
    try:
        expected = await _run_all(reference)
    finally:
        reference.shutdown()
    assert any(len(set(ids)) > 2 for ids in expected)  # real generations, not one repeated token

    metrics = Metrics()
    engine = _start(_settings(tmp_path, 2, async_scheduling="on"), metrics)  # placeholders cross to rank 1
    try:
        runner = engine.runner
        assert isinstance(runner, TensorParallelRunner) and runner.size == 2
        assert await _run_all(engine) == expected

        # A request that ends with its prefill while 3 others decode: the next decode step has the same rows
        # as the mixed one, which every rank must know (persistent decode rows; rows alone cross to rank 1).
        decoding_started = asyncio.Event()

        async def decode(rid: str, prompt: list[int]) -> list[int]:
            ids = []
            async for out in engine.generate(
                rid, prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            ):
                ids += out.token_ids
                decoding_started.set()
            return ids

        decoding = [asyncio.create_task(decode(f"d{i}", p)) for i, p in enumerate(PROMPTS[:2] + PROMPTS[:1])]
        await decoding_started.wait()
        assert len(await _generate(engine, "one", PROMPTS[2], 1)) == 1
        assert [ids[:12] for ids in await asyncio.gather(*decoding)] == [
            expected[0],
            expected[1],
            expected[0],
        ]

        # Admin clear and warmup while requests run: both ranks apply them in the same order as the steps.
        running = [asyncio.create_task(_generate(engine, f"bg{i}", p, 40)) for i, p in enumerate(PROMPTS[:2])]
        await asyncio.sleep(0.2)
        cleared = await engine.clear_graphs()
        warmed = await engine.warmup([D(4, 4, True), D(2, 2, True)])
        again = await engine.warmup(None)  # the configured warmup, as after a clear
        long_again = await asyncio.gather(*running)
        assert cleared["entries"] >= 1 and "4:4:decode" in warmed["captured"], (cleared, warmed)
        assert not again["failed"]
        assert long_again[0][:12] == expected[0] and long_again[1][:12] == expected[1]

        logs = await _decision_logs(engine)
        assert len(logs) == 2 and logs[0] == logs[1], "the ranks' cache decision logs differ"
        ops = [d.op for d in logs[0]]
        assert "clear" in ops and ops.count("admit") >= 4, ops

        info = await engine.cache_info()
        ranks = info["tensor_parallel"]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert ranks[0]["decisions"] == ranks[1]["decisions"] == len(logs[0])
        assert ranks[0]["decision_digest"] == ranks[1]["decision_digest"]
        assert [r["pool_bytes"] for r in ranks] == await engine._call(
            lambda: runner.runner.cache.rank_pool_bytes()
        )
        assert metrics.graph_pool_rank_bytes.labels("1")._value.get() == ranks[1]["pool_bytes"]

        # A worker that dies mid-request: the request ends with an error, the engine dies, no hang.
        worker = runner._workers[0].process
        outputs: list = []

        async def doomed() -> None:
            async for out in engine.generate(
                "doomed", PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            ):
                outputs.append(out)
                if len(outputs) == 1:
                    os.kill(worker.pid, signal.SIGKILL)

        await asyncio.wait_for(doomed(), timeout=120)
        assert outputs[-1].finished and outputs[-1].finish_reason == "error", outputs[-1]
        deadline = time.monotonic() + 60
        while engine.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not engine.alive
        assert "rank 1" in (engine.error or ""), engine.error
        with pytest.raises(EngineDead):
            engine.generate("after", PROMPTS[0], SamplingParams(max_tokens=2))
    finally:
        engine.shutdown()
    assert not worker.is_alive()


@pytest.mark.timeout(600)
async def test_idle_engine_dies_when_its_worker_is_killed(tmp_path):
    engine = _start(_settings(tmp_path, 2, warmup_decode_sizes=[]))
    try:
        worker = engine.runner._workers[0].process
        os.kill(worker.pid, signal.SIGTERM)  # ignored: stopping is rank 0's call
        await asyncio.sleep(1.0)
        assert worker.is_alive() and engine.alive
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while engine.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not engine.alive, "an idle engine must notice its worker died (the watcher thread)"
        assert "rank 1" in (engine.error or "")
    finally:
        engine.shutdown()


def test_serve_refuses_an_unshardable_tensor_parallel_size_before_loading(capsys, tmp_path):
    from graphcache.cli import main
    from helpers_model import tiny_checkpoint

    assert main(["serve", "--tensor-parallel-size", "4", "--port", "0", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "the embedded tiny model" in err and "set tensor_parallel_size to a divisor of 2" in err, err
    assert not any(tmp_path.iterdir()), "nothing may be loaded or written before the refusal"
    model = tiny_checkpoint("llama")  # 4 heads, 2 KV heads
    assert (
        main(
            ["serve", "--model", str(model), "--tensor-parallel-size", "3", "--port", "0", "--device", "cpu"]
        )
        == 2
    )
    assert "does not divide the model's num_attention_heads (4)" in capsys.readouterr().err
