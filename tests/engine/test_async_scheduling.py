"""Async scheduling (EngineCore.step with overlap): step n+1 is scheduled and launched before step n's
tokens are known. The outputs must be exactly those of the synchronous core: same greedy tokens,
same finish reasons, no token after a stop, aborts and preemption included. Driven through
EngineCore directly (no thread), with the token-level fake runner of test_engine and the real tiny
model on the CPU."""

from __future__ import annotations

import pytest
from graphcache.config import Settings
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.worker.runner import ModelRunner
from helpers_model import cpu_settings, prompt_ids, tiny_checkpoint
from test_engine import VOCAB, FakeRunner


def drive(
    core: EngineCore, requests: list[tuple[str, list[int], SamplingParams]], abort_at: dict | None = None
):
    """Add every request, step until done; per request (token ids, finish reason)."""
    for rid, prompt, params in requests:
        seq = Sequence(rid, list(prompt), SamplingParams(**vars(params)))
        core.check(seq)
        core.add_request(seq)
    tokens = {rid: [] for rid, _, _ in requests}
    reasons: dict[str, str] = {}
    for step in range(10_000):
        if not core.has_work():
            break
        for rid in (abort_at or {}).get(step, []):
            out = core.abort(rid)
            if out is not None:
                tokens[rid] += out.token_ids
                reasons[rid] = out.finish_reason
        for out in core.step():
            assert rid_not_finished(reasons, out.request_id), f"{out.request_id} emitted after finishing"
            tokens[out.request_id] += out.token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert not core.has_work()
    assert core.block_manager.num_free == core.block_manager.num_usable, "leaked KV blocks"
    return {rid: (tokens[rid], reasons.get(rid)) for rid in tokens}


def rid_not_finished(reasons: dict, rid: str) -> bool:
    return rid not in reasons


def fake_core(async_on: bool, **runner_kw) -> EngineCore:
    settings = Settings(
        max_num_seqs=6, max_num_batched_tokens=24, async_scheduling="on" if async_on else "off"
    )
    return EngineCore(FakeRunner(settings, **runner_kw), settings)


def workload(n: int = 12):
    reqs = []
    for i in range(n):
        prompt = [(5 * i + 3 * j) % (VOCAB - 2) + 1 for j in range(3 + (7 * i) % 20)]
        params = SamplingParams(max_tokens=4 + (5 * i) % 17, temperature=0, ignore_eos=i % 3 != 0)
        if i % 4 == 1:
            params.stop_token_ids = [prompt[0] % (VOCAB - 1)]
        reqs.append((f"r{i}", prompt, params))
    return reqs


def test_async_equals_sync_on_the_fake_runner():
    sync = drive(fake_core(False), workload())
    core = fake_core(True)
    overlapped = drive(core, workload())
    assert overlapped == sync
    # It did overlap: decodes were fed the in-flight step's token on the "device".
    assert sum(p.num_reqs if p.tokens is None else p.tokens.count(None) for p in core.runner.plans) > 20
    assert any(reason == "stop" for _, reason in sync.values())  # stops happened mid-flight
    assert all(reason in ("stop", "length") for _, reason in sync.values())


def test_async_equals_sync_under_preemption():
    # 14 blocks of 4 tokens for 12 requests: the scheduler preempts (by recompute) all the time.
    sync_core, async_core = fake_core(False, num_kv_blocks=14), fake_core(True, num_kv_blocks=14)
    sync = drive(sync_core, workload())
    overlapped = drive(async_core, workload())
    assert overlapped == sync
    assert async_core.scheduler.num_preemptions > 0


def test_async_abort_in_flight_emits_nothing_after():
    reqs = [
        (f"a{i}", [1 + i, 2, 3], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        for i in range(4)
    ]
    sync = drive(fake_core(False), reqs, abort_at={5: ["a1"], 9: ["a3"]})
    overlapped = drive(fake_core(True), reqs, abort_at={5: ["a1"], 9: ["a3"]})
    assert overlapped["a1"][1] == overlapped["a3"][1] == "abort"
    assert overlapped["a0"] == sync["a0"] and overlapped["a2"] == sync["a2"]
    # An abort lands between steps: the aborted request's tokens are a prefix of its full run.
    full = drive(fake_core(True), reqs)
    assert full["a1"][0][: len(overlapped["a1"][0])] == overlapped["a1"][0]


@pytest.mark.slow
def test_async_equals_sync_greedy_on_the_real_tiny_model():
    path = tiny_checkpoint("qwen2")
    reqs = [
        (
            f"q{i}",
            prompt_ids(4 + 3 * i, seed=i),
            SamplingParams(max_tokens=6 + 2 * i, temperature=0, ignore_eos=True),
        )
        for i in range(6)
    ]
    results = []
    for mode in ("off", "on"):
        settings = cpu_settings(path, max_num_seqs=4, async_scheduling=mode)
        results.append(drive(EngineCore(ModelRunner(settings), settings), reqs))
    assert results[0] == results[1]
