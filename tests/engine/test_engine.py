"""Engine: the engine thread + asyncio API, with a fake runner (always) and the real one (tiny model, CPU).

The fake runner keeps a token-level "KV cache" addressed by the block tables the step plans give its
request table and derives each next token from what it reads back, so wrong slices, positions or block
tables change the output; it samples with the worker's own sampling stage. The real-runner tests need
graphcache.engine.worker.runner and graphcache.model.tiny.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from graphcache.config import Settings
from graphcache.engine.loop.engine import (
    DEAD_MESSAGE,
    MAX_CONSECUTIVE_STEP_FAILURES,
    Engine,
    EngineDead,
    EngineDraining,
    EngineNotReady,
    InvalidRequest,
    QueueFull,
    SamplingParams,
)
from graphcache.engine.worker.request_table import RequestTable
from graphcache.engine.worker.sampling import StepSampler
from graphcache.graphs.cache import WarmupReport
from graphcache.metrics import Metrics
from graphcache.model.detokenizer import IncrementalDetokenizer

VOCAB = 64


class FakeTokenizer:
    """Token id -> "<id>"; drives the real IncrementalDetokenizer."""

    eos_token_ids = [VOCAB - 1]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)

    def detokenizer(self, prompt_ids=None, stop=None, skip_special_tokens=True):
        return IncrementalDetokenizer(self, prompt_ids, stop, skip_special_tokens)


class FakeCache:
    def __init__(self, owner: list):
        self.owner = owner  # [thread]: admin calls must run on the engine thread

    def _check(self):
        assert threading.current_thread() is self.owner[0], "cache touched off the engine thread"

    def warmup(self, descs, *, pin=True):
        self._check()
        return {"captured": [str(d) for d in descs]}

    def clear(self):
        self._check()
        return {"evicted": 0}

    def info(self):
        self._check()
        return {"entries": []}

    def stats(self):
        return {"hits": 0}


class FakeRunner:
    def __init__(
        self,
        settings: Settings,
        metrics=None,
        *,
        num_kv_blocks=64,
        block_size=4,
        max_model_len=128,
        step_delay=0.0,
    ):
        self.owner = [threading.current_thread()]
        self.tokenizer = FakeTokenizer()
        self.model_config = None
        self.vocab_size = None
        self.eos_token_ids = frozenset(FakeTokenizer.eos_token_ids)
        self.device_type, self.dtype, self.model_path = "cpu", "float32", "fake-model"
        self.num_kv_blocks, self.block_size, self.max_model_len = num_kv_blocks, block_size, max_model_len
        self.cache = FakeCache(self.owner)
        self.step_delay = step_delay
        self.slots: dict[int, int] = {}
        self.plans = []
        self.table = RequestTable()  # no device rows: every step is laid out here, from the table
        self.sampling = StepSampler(self.eos_token_ids, settings.model.seed)
        self._sampled = None  # the ids the last step sampled (the step in flight's)

    def warmup(self, progress=None):
        if self.device_type == "cuda":  # as ModelRunner.warmup: the sampler's kernels compile here
            self.sampling.warmup(self.vocab_size, self.dtype, torch.device("cuda"))
        return {"captured": 0}

    def capture(self, descriptors, *, pin=True, progress=None):
        self.cache.warmup(descriptors, pin=pin)  # checks the thread
        return WarmupReport(captured=[str(d) for d in descriptors])

    def warmup_descriptors(self):
        return []

    def watch(self, on_fatal):
        pass

    def close(self):
        pass

    def execute(self, plan):
        assert threading.current_thread() is self.owner[0]
        self.plans.append(plan)
        if self.step_delay:
            time.sleep(self.step_delay)
        prev, self._sampled = self._sampled, None
        table = self.table
        table.update(plan)
        bs = self.block_size
        rows = []
        for i, key in enumerate(plan.keys):
            fed, start, blocks = plan.fed(i), plan.starts[i], table.get(key).block_table
            # async scheduling: the in-flight step's token, as the GPU would
            ids = [int(prev[table.in_flight_row_of(key)])] if fed is None else fed
            for j, tok in enumerate(ids):
                pos = start + j
                self.slots[blocks[pos // bs] * bs + pos % bs] = tok
            if plan.need_logits is None or plan.need_logits[i]:
                end = start + len(ids)
                history = [self.slots[blocks[p // bs] * bs + p % bs] for p in range(end)]
                nxt = (sum((p + 1) * t for p, t in enumerate(history)) * 31 + end) % (VOCAB - 1)
                row = torch.zeros(VOCAB)
                row[nxt] = 10.0
                rows.append(row)
        logits = torch.stack(rows) if rows else torch.zeros(0, VOCAB)
        out = self.sampling(plan, table.sampled(plan), logits, "eager")
        self._sampled = out.sampled
        table.sampled_by_step(plan.sampled_keys())
        return out


def fake_factory(**kw):
    return lambda settings, metrics: FakeRunner(settings, metrics, **kw)


def start_engine(factory, **settings_kw) -> Engine:
    settings = Settings(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, **settings_kw})
    engine = Engine(settings, Metrics(), runner_factory=factory)
    engine.start()
    assert engine.wait_ready(120), engine.error
    return engine


async def collect(engine, rid, prompt, params):
    text, ids, last = "", [], None
    async for out in engine.generate(rid, prompt, params):
        text += out.text
        ids += out.token_ids
        last = out
    return ids, text, last


def prompts(n, vocab=VOCAB - 1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, vocab, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


# --- real runner (tiny model on CPU) -------------------------------------------------------------


def real_factory():
    runner_mod = pytest.importorskip("graphcache.engine.worker.runner")
    pytest.importorskip("graphcache.model.tiny")
    return runner_mod.ModelRunner


@pytest.fixture(scope="module")
def real_engine(tmp_path_factory):
    factory = real_factory()
    engine = start_engine(
        lambda s, m: factory(s, m),
        cache_dir=tmp_path_factory.mktemp("gc"),
        device="cpu",
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=256,
        warmup_decode_sizes=[],
    )
    yield engine
    engine.shutdown()


@pytest.fixture(params=["fake", "real"])
def engine(request, tmp_path):
    if request.param == "real":
        yield request.getfixturevalue("real_engine")
        return
    e = start_engine(fake_factory())
    yield e
    e.shutdown()


# --- tests -------------------------------------------------------------------------------------


async def test_batching_does_not_change_greedy_outputs(engine):
    vocab = engine.runner.model_config.vocab_size if engine.runner.model_config else VOCAB - 1
    ps = prompts(16, vocab=vocab)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [(await collect(engine, f"alone-{i}", p, params))[0] for i, p in enumerate(ps)]
    together = await asyncio.gather(*(collect(engine, f"batch-{i}", p, params) for i, p in enumerate(ps)))
    assert [t[0] for t in together] == alone
    assert all(t[2].finish_reason == "length" and t[2].completion_tokens == 12 for t in together)
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


async def test_non_streaming_request_gets_one_output_with_everything():
    e = start_engine(fake_factory())
    try:
        params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
        ids, text, _ = await collect(e, "s", [1, 2, 3], params)
        outs = [o async for o in e.generate("ns", [1, 2, 3], params, stream=False)]
        assert len(outs) == 1 and outs[0].finished and outs[0].token_ids == ids and outs[0].text == text
    finally:
        e.shutdown()


async def test_non_streaming_text_detokenized_at_finish_equals_streamed_text(real_engine):
    """Non-streaming requests without stop strings detokenize once at the end (defer_text): the
    text must be exactly what streaming produced token by token, with and without EOS stops."""
    vocab = real_engine.runner.model_config.vocab_size
    for i, p in enumerate(prompts(4, vocab=vocab, seed=3)):
        for params in (
            SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=0.9, seed=i),
            SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[]),
        ):
            ids, text, last = await collect(real_engine, f"s-{i}", p, params)
            outs = [o async for o in real_engine.generate(f"ns-{i}", p, params, stream=False)]
            assert len(outs) == 1 and outs[0].token_ids == ids
            assert outs[0].text == text and outs[0].finish_reason == last.finish_reason


async def test_output_fields_and_stop_string():
    e = start_engine(fake_factory())
    try:
        ids, text, last = await collect(
            e, "a", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        )
        assert text == "".join(f"<{t}>" for t in ids) and last.finished
        assert (last.prompt_tokens, last.completion_tokens) == (3, 6)
        stop = f"<{ids[2]}>"
        ids2, text2, last2 = await collect(
            e, "b", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0, stop=[stop], ignore_eos=True)
        )
        assert last2.finish_reason == "stop" and text2 == text[: text.index(stop)]
    finally:
        e.shutdown()


async def test_consumer_leaving_aborts_and_frees_blocks():
    e = start_engine(fake_factory(step_delay=0.01))
    try:
        it = e.generate(
            "leaver", list(range(1, 20)), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        )
        async for _ in it:
            break
        await it.aclose()  # what a disconnect does to the response's generator
        for _ in range(200):
            if e.stats()["kv_blocks_free"] == e.stats()["kv_blocks_total"] and not e.stats()["running"]:
                break
            await asyncio.sleep(0.01)
        assert e.stats()["kv_blocks_free"] == e.stats()["kv_blocks_total"]
        assert e.metrics.requests_finished.labels("abort")._value.get() == 1
        # explicit abort by id
        task = asyncio.create_task(collect(e, "x", [1, 2], SamplingParams(max_tokens=100, ignore_eos=True)))
        await asyncio.sleep(0.05)
        e.abort("x")
        _, _, last = await asyncio.wait_for(task, 5)
        assert last.finish_reason == "abort"
    finally:
        e.shutdown()


async def test_queue_full_and_not_ready_and_validation():
    e = Engine(
        Settings(max_num_seqs=1, max_num_batched_tokens=16, max_queue=2),
        Metrics(),
        runner_factory=fake_factory(step_delay=0.02),
    )
    with pytest.raises(EngineNotReady):
        e.generate("early", [1], SamplingParams())
    e.start()
    assert e.wait_ready(10)
    try:
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        streams = [e.generate("r0", [1, 2], params)]
        await asyncio.sleep(0.1)  # r0 running; the next two wait
        streams += [e.generate(f"r{i}", [1, 2], params) for i in (1, 2)]
        with pytest.raises(QueueFull):
            e.generate("r3", [1, 2], params)
        with pytest.raises(InvalidRequest, match="maximum context length is 128"):
            e.generate("long", [1] * 120, SamplingParams(max_tokens=20))
        with pytest.raises(InvalidRequest, match="already in flight"):
            e.generate("r1", [1], params)
        with pytest.raises(InvalidRequest, match="temperature"):
            e.generate("bad", [1], SamplingParams(temperature=-1))
        for s in streams:
            async for out in s:
                last = out
            assert last.finish_reason == "length"
    finally:
        e.shutdown()


async def test_drain_finishes_short_and_fails_long_requests_cleanly():
    e = start_engine(fake_factory(step_delay=0.01))
    try:
        short = asyncio.create_task(
            collect(e, "short", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
        )
        long = asyncio.create_task(
            collect(e, "long", [1, 2], SamplingParams(max_tokens=120, ignore_eos=True))
        )
        await asyncio.sleep(0.02)
        report = await e.drain(timeout=0.3)
        assert report["aborted"] == 1
        with pytest.raises(EngineDraining):
            e.generate("late", [1], SamplingParams())
        assert (await short)[2].finish_reason == "length"
        last = (await asyncio.wait_for(long, 5))[2]
        assert last.finish_reason == "error" and "drain" in last.error
    finally:
        e.shutdown()
    assert not e._thread.is_alive()


async def test_step_exception_fails_only_that_steps_requests():
    # max_num_seqs=1: "victim" runs alone in the failing step while "bystander" waits its turn.
    e = start_engine(fake_factory(step_delay=0.005), max_num_seqs=1)
    try:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        calls = []

        def fail_once(batch):
            calls.append(batch)
            if len(calls) == 1:
                raise RuntimeError("injected step failure")

        e.step_failpoint = fail_once
        victim = asyncio.create_task(collect(e, "victim", [1, 2, 3], params))
        await asyncio.sleep(0)  # victim is submitted first
        bystander = asyncio.create_task(collect(e, "bystander", [4, 5, 6], params))
        (_, _, v), (ids, _, b) = await asyncio.wait_for(asyncio.gather(victim, bystander), 10)
        assert v.finish_reason == "error" and v.error
        assert b.finish_reason == "length" and len(ids) == 5
        _, _, ok = await collect(e, "after", [1, 2, 3], params)
        assert ok.finish_reason == "length" and e.alive and e.ready
        assert e.stats()["kv_blocks_free"] == e.stats()["kv_blocks_total"]
        assert e.metrics.requests_finished.labels("error")._value.get() == 1
    finally:
        e.shutdown()


async def test_edge_sampling_values_are_served_next_to_others():
    """top_p / temperature that underflow float32 (valid: > 0) and a top_k past int64 used to make
    the batched sampler raise, failing every request in the step (and, three in a row, the engine)."""
    e = start_engine(fake_factory(step_delay=0.002))
    try:
        normal = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        edge = [
            SamplingParams(max_tokens=4, top_p=1e-300, ignore_eos=True),
            SamplingParams(max_tokens=4, top_p=5e-324, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=4, temperature=1e-300, ignore_eos=True),
            SamplingParams(max_tokens=4, top_k=10**30, ignore_eos=True),
        ]
        jobs = [collect(e, f"normal{i}", [1, 2, 3 + i], normal) for i in range(3)]
        jobs += [collect(e, f"edge{j}.{i}", [4, 5, 6], p) for i in range(3) for j, p in enumerate(edge)]
        results = await asyncio.wait_for(asyncio.gather(*jobs), 20)
        assert all(r[2].finish_reason == "length" for r in results), [r[2] for r in results]
        assert e.alive and e.ready and e.metrics.requests_finished.labels("error")._value.get() == 0
    finally:
        e.shutdown()


class RowFailingSampler:
    """Wraps the real sampler; raises whenever request `bad` is among the rows (a sampler bug that
    one request's parameters trigger)."""

    def __init__(self, inner, bad: str):
        self.inner, self.bad, self.calls = inner, bad, 0

    def sample_device(self, logits, seqs, plain_greedy=None):
        self.calls += 1
        if any(s.request_id == self.bad for s in seqs):
            raise RuntimeError("multinomial: invalid probability distribution")
        return self.inner.sample_device(logits, seqs, plain_greedy)


async def test_a_request_whose_sampling_fails_ends_alone_and_never_kills_the_engine():
    e = start_engine(fake_factory(step_delay=0.002))
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        for round_ in range(MAX_CONSECUTIVE_STEP_FAILURES + 2):  # more than the death threshold
            bad = f"bad{round_}"
            sampling = e.core.runner.sampling  # the worker samples
            sampling.sampler = RowFailingSampler(
                sampling.sampler if round_ == 0 else sampling.sampler.inner, bad
            )
            results = await asyncio.wait_for(
                asyncio.gather(
                    collect(e, f"ok{round_}.a", [1, 2, 3], params),
                    collect(e, bad, [4, 5, 6], params),
                    collect(e, f"ok{round_}.b", [7, 8, 9], params),
                ),
                10,
            )
            (ids_a, _, a), (_, _, b), (ids_c, _, c) = results
            assert b.finish_reason == "error" and "sampling" in b.error and "multinomial" not in b.error
            assert a.finish_reason == c.finish_reason == "length" and len(ids_a) == len(ids_c) == 8
            # Alone in its batch too (each request is its own step here once the others finish).
            _, _, alone = await asyncio.wait_for(collect(e, bad, [4, 5, 6], params), 10)
            assert alone.finish_reason == "error"
            assert e.alive and e.ready
        assert e.core.consecutive_failures == 0
        assert e.stats()["kv_blocks_free"] == e.stats()["kv_blocks_total"]
    finally:
        e.shutdown()


async def test_device_fault_while_sampling_still_counts():
    e = start_engine(fake_factory())
    try:

        class Broken:
            def sample_device(self, logits, seqs, plain_greedy=None):
                raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

        e.core.runner.sampling.sampler = Broken()
        _, _, last = await asyncio.wait_for(collect(e, "r", [1, 2], SamplingParams(max_tokens=4)), 10)
        assert last.finish_reason == "error"
        for _ in range(100):
            if not e.alive:
                break
            await asyncio.sleep(0.01)
        assert not e.alive and "illegal memory access" in e.error
    finally:
        e.shutdown()


async def test_after_shutdown_nothing_hangs():
    e = start_engine(fake_factory())
    e.shutdown()
    assert not e.ready and e.runner is None and e.tokenizer is not None and e.max_model_len == 128
    with pytest.raises(EngineDead):
        await asyncio.wait_for(e.cache_info(), 2)
    with pytest.raises(EngineDraining):
        e.generate("late", [1], SamplingParams())


async def test_repeated_step_failures_kill_the_engine_and_fail_everyone():
    e = start_engine(fake_factory(step_delay=0.005), max_num_seqs=1)
    try:

        def always(batch):
            raise RuntimeError("device broken")

        e.step_failpoint = always
        results = await asyncio.wait_for(
            asyncio.gather(*(collect(e, f"r{i}", [1, 2], SamplingParams(max_tokens=4)) for i in range(6))), 10
        )
        assert all(r[2].finish_reason == "error" for r in results)
        # The cause is for the log and e.error (admin) only: what requests are told leaks nothing.
        assert not any("device broken" in r[2].error for r in results)
        assert any(r[2].error == DEAD_MESSAGE for r in results)  # those still waiting when it died
        for _ in range(100):
            if not e.alive:
                break
            await asyncio.sleep(0.01)
        assert not e.alive and "device broken" in e.error
        assert e.load_error is None  # it served first: a run-time death, for liveness, not a failed load
        with pytest.raises(EngineDead) as info:
            e.generate("late", [1], SamplingParams())
        assert str(info.value) == DEAD_MESSAGE
        with pytest.raises(EngineDead):
            e.generate("after", [1], SamplingParams())
        with pytest.raises(EngineDead):
            await e.cache_info()
    finally:
        e.shutdown()


async def test_load_failure_marks_dead():
    def broken(settings, metrics):
        raise FileNotFoundError("no config.json in /nowhere")

    e = Engine(Settings(), Metrics(), runner_factory=broken)
    e.start()
    assert not e.wait_ready(10)
    assert not e.alive and "config.json" in e.error
    assert e.load_error is not None and "no config.json in /nowhere" in e.load_error  # serve exits on it
    with pytest.raises(EngineDead):
        e.generate("r", [1], SamplingParams())
    e.shutdown()


async def test_admin_commands_run_on_the_engine_thread():
    e = start_engine(fake_factory())
    try:
        assert await e.cache_info() == {"entries": []}
        assert await e.clear_graphs() == {"evicted": 0}
        assert (await e.warmup(["8:8:decode", "16:2"]))["captured"] == ["16:2", "8:8:decode"]  # largest first
    finally:
        e.shutdown()


async def test_preemption_under_kv_exhaustion_finishes_everyone():
    e = start_engine(fake_factory(num_kv_blocks=12, block_size=4, max_model_len=64))
    try:
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        ps = prompts(8)
        ps = [p[:20] for p in ps]
        alone = [(await collect(e, f"a{i}", p, params))[0] for i, p in enumerate(ps)]
        together = await asyncio.wait_for(
            asyncio.gather(*(collect(e, f"b{i}", p, params) for i, p in enumerate(ps))), 30
        )
        assert [t[0] for t in together] == alone
        assert e.stats()["preemptions"] > 0
        assert e.metrics.preemptions._value.get() > 0
        assert e.stats()["kv_blocks_free"] == e.stats()["kv_blocks_total"]
    finally:
        e.shutdown()


async def test_metrics_recorded():
    e = start_engine(fake_factory())
    try:
        await collect(e, "m", [1, 2, 3, 4], SamplingParams(max_tokens=5, ignore_eos=True))
        m = e.metrics
        assert m.ready._value.get() == 1
        assert m.prompt_tokens._value.get() == 4 and m.generation_tokens._value.get() == 5
        assert m.requests_finished.labels("length")._value.get() == 1
        assert m.steps.labels("eager")._value.get() >= 5
        samples = {s.name: s.value for metric in m.registry.collect() for s in metric.samples}
        assert samples["graphcache_time_to_first_token_seconds_count"] == 1
        assert samples["graphcache_time_per_output_token_seconds_count"] == 1  # one mean per request
        assert samples["graphcache_e2e_request_latency_seconds_count"] == 1
    finally:
        e.shutdown()


async def test_real_runner_preemption_keeps_greedy_outputs(tmp_path):
    factory = real_factory()
    e = start_engine(
        lambda s, m: factory(s, m),
        cache_dir=tmp_path,
        device="cpu",
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        num_kv_blocks=10,
        block_size=8,
        warmup_decode_sizes=[],
    )
    try:
        vocab = e.runner.model_config.vocab_size
        ps = [p[:24] for p in prompts(8, vocab=vocab, seed=3)]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        alone = [(await collect(e, f"a{i}", p, params))[0] for i, p in enumerate(ps)]
        together = await asyncio.wait_for(
            asyncio.gather(*(collect(e, f"b{i}", p, params) for i, p in enumerate(ps))), 120
        )
        assert e.stats()["preemptions"] > 0, "the test should exhaust the KV cache"
        assert [t[0] for t in together] == alone
        assert e.stats()["kv_blocks_free"] == e.stats()["kv_blocks_total"]
    finally:
        e.shutdown()


async def test_gauges_follow_an_abort_that_leaves_the_engine_idle():
    e = start_engine(fake_factory(step_delay=0.01))
    try:
        task = asyncio.create_task(
            collect(e, "x", [1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True))
        )
        await asyncio.sleep(0.1)
        assert e.metrics.requests_running._value.get() == 1 and e.metrics.kv_usage._value.get() > 0
        e.abort("x")
        await asyncio.wait_for(task, 5)
        await asyncio.sleep(0.05)
        assert e.metrics.requests_running._value.get() == 0
        assert e.metrics.kv_usage._value.get() == 0
    finally:
        e.shutdown()


async def test_a_slow_stream_consumer_gets_merged_deltas_with_nothing_lost():
    e = start_engine(fake_factory(step_delay=0.002))
    try:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        fast_ids, fast_text, _ = await collect(e, "fast", [1, 2, 3], params)
        outs = []
        async for out in e.generate("slow", [1, 2, 3], params):
            outs.append(out)
            await asyncio.sleep(0.02)  # the engine runs ~10 steps meanwhile
        assert len(outs) < 40, "deltas were not merged"
        assert sum((o.token_ids for o in outs), []) == fast_ids
        assert "".join(o.text for o in outs) == fast_text
        assert outs[-1].finished and outs[-1].completion_tokens == 40
    finally:
        e.shutdown()


@pytest.mark.parametrize("interval_ms,max_outputs", [(0, 41), (60, 12)])
async def test_stream_interval_batches_deliveries_but_not_the_first_and_last(interval_ms, max_outputs):
    e = start_engine(fake_factory(step_delay=0.003), stream_interval_ms=interval_ms)
    try:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        t0 = time.monotonic()
        outs, first_at = [], None
        async for out in e.generate("s", [1, 2, 3], params):
            first_at = first_at or time.monotonic() - t0
            outs.append(out)
        assert len(outs) <= max_outputs and sum(len(o.token_ids) for o in outs) == 40
        assert len(outs[0].token_ids) <= 2, "the first token waited for the interval"
        assert outs[-1].finished
    finally:
        e.shutdown()


async def test_admin_warmup_interleaves_with_serving():
    """A long admin warmup captures a slice at a time between steps: a running stream keeps getting
    tokens (no gap near the whole warmup's length), and the answer lists every descriptor."""
    e = start_engine(fake_factory(step_delay=0.01), stream_interval_ms=0)
    runner = e.runner
    original = runner.capture

    def slow_capture(descriptors, *, pin=True, progress=None):
        time.sleep(0.02 * len(descriptors))  # a capture takes 20 ms
        return original(descriptors, pin=pin)

    runner.capture = slow_capture
    try:
        descs = [f"{n}:{n}:decode" for n in range(1, 41)]  # 40 captures: 0.8 s in all
        params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)  # ~1.2 s of steps
        times = []

        async def stream():
            async for _ in e.generate("s", [1, 2, 3], params):
                times.append(time.monotonic())

        task = asyncio.create_task(stream())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        report = await e.warmup(descs)
        warmup_s = time.monotonic() - t0
        await task
        assert len(report["captured"]) == 40
        during = [b - a for a, b in zip(times, times[1:], strict=False) if t0 <= a <= t0 + warmup_s]
        assert during, "the stream got no token while the warmup ran"
        assert max(during) < warmup_s / 3, (max(during), warmup_s)
        assert e.stats()["warmup"] == {"jobs": 0, "done": 0, "total": 0}
    finally:
        e.shutdown()


async def test_step_trace_records_every_step_and_is_written_at_stop(tmp_path):
    """settings.engine.step_trace: one record per completed step, times in order, written when the engine stops
    (benchmarks/step_trace.py summarizes it)."""
    import json

    from graphcache.engine.loop.step_trace import STEP_TRACE_FIELDS

    path = tmp_path / "steps.jsonl"
    e = start_engine(fake_factory(), step_trace=path)
    try:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        await asyncio.gather(*(collect(e, f"r{i}", p, params) for i, p in enumerate(prompts(3))))
        steps = e.core.num_steps
    finally:
        e.shutdown()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == steps >= 5
    for r in records:
        assert tuple(r) == STEP_TRACE_FIELDS
        times = [r[k] for k in STEP_TRACE_FIELDS[:6]]
        assert times == sorted(times), r
        assert r["rows"] >= r["sampled"] >= 1 and r["tokens"] >= r["rows"]
        assert r["context"] >= r["tokens"]  # each row attends to its fed tokens and those before them
    assert sum(r["sampled"] for r in records) == 15  # 3 requests x 5 tokens


def test_engine_start_compiles_the_sampler_kernels_on_cuda(monkeypatch):
    """On CUDA the sampler's Triton kernels compile at warmup (Sampler.warmup), not in the first
    sampled step, where the compile would stall every running request."""
    from graphcache.engine.sample.sampler import Sampler

    calls = []
    monkeypatch.setattr(
        Sampler, "warmup", lambda self, vocab, dtype, device: calls.append((vocab, dtype, device))
    )

    class CudaShapedRunner(FakeRunner):
        def __init__(self, settings, metrics=None):
            super().__init__(settings, metrics)
            self.device_type, self.dtype, self.vocab_size = "cuda", torch.bfloat16, VOCAB

    engine = start_engine(lambda s, m: CudaShapedRunner(s, m))
    try:
        assert calls == [(VOCAB, torch.bfloat16, torch.device("cuda"))]
    finally:
        engine.shutdown()
    calls.clear()
    cpu = start_engine(fake_factory())  # the CPU compiles nothing
    cpu.shutdown()
    assert calls == []
