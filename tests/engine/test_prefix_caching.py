"""Prefix caching end to end: the runner really attends to KV written by another sequence, and the
engine's greedy outputs are the same with prefix caching on and off while the prefill work drops by
exactly the tokens found in the cache.

References: each sequence run alone in fresh blocks (runner level), and the same workload with
prefix caching off (engine level, the real tiny model on the CPU and the token-level fake runner,
synchronous and with async scheduling)."""

from __future__ import annotations

import pytest
from graphcache.config import Settings
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.sched.block_manager import BlockManager
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.worker.runner import ModelRunner
from helpers_model import Blocks, cpu_settings, prompt_ids, run_alone, tiny_checkpoint
from test_engine import VOCAB, FakeRunner

ATOL = 1e-4


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("llama")


# --- runner: a prefill with start_pos > 0 reads the cached blocks of another sequence -------------


def test_prefill_after_shared_blocks_equals_the_sequence_computed_alone(path):
    runner = ModelRunner(cpu_settings(path))
    bs = runner.block_size
    blocks = Blocks(bs, first=1)
    prefix = prompt_ids(4 * bs, seed=1)  # 4 full blocks
    owner_ids = prefix + prompt_ids(3, seed=2)
    owner_table = blocks.table(len(owner_ids))
    run_alone(runner, owner_ids, owner_table, chunk=5)  # writes the prefix KV (chunked)
    shared = owner_table[:4]
    # Two sequences in one step, both continuing after the owner's 4 blocks in their own blocks.
    tails = [prompt_ids(6, seed=3), prompt_ids(2 * bs + 1, seed=4)]
    tables = [shared + blocks.table(len(t)) for t in tails]
    batch = StepPlan.standalone(
        [StepSeq(t, len(prefix), table, True) for t, table in zip(tails, tables, strict=True)]
    )
    logits = runner.execute(batch).logits.clone()  # a view of a static buffer: keep a copy
    fresh = ModelRunner(cpu_settings(path))
    for row, tail in enumerate(tails):
        ids = prefix + tail
        ref = run_alone(fresh, ids, Blocks(bs, first=1).table(len(ids)))[-1]
        assert (logits[row] - ref).abs().max().item() < ATOL
    # Control: the same step over another prefix's KV gives other logits, so the cache was read.
    other = prompt_ids(4 * bs, seed=9)
    other_table = Blocks(bs, first=60).table(len(other))
    run_alone(runner, other, other_table)
    moved = runner.execute(
        StepPlan.standalone([StepSeq(tails[0], len(prefix), other_table + tables[0][4:], True)])
    ).logits
    assert (moved[0] - logits[0]).abs().max().item() > 1e-2


# --- engine: outputs equal with caching on and off; prefill work drops by the hits ----------------


def with_prefix_caching(core: EngineCore, enabled: bool) -> EngineCore:
    """The core's block manager with prefix caching on or off. (Until EngineCore passes
    settings.engine.enable_prefix_caching to BlockManager itself; harmless after.)"""
    bm = BlockManager(
        core.block_manager.num_blocks, core.block_manager.block_size, enable_prefix_caching=enabled
    )
    core.block_manager = core.scheduler.block_manager = bm
    return core


class CountingRunner:
    """Wraps a runner: counts the tokens fed to the model."""

    def __init__(self, runner) -> None:
        self.runner, self.tokens_fed = runner, 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, plan):
        self.tokens_fed += plan.num_tokens
        return self.runner.execute(plan)


def drive(core: EngineCore, waves: list[list[tuple[str, list[int], SamplingParams]]]) -> dict:
    """Each wave's requests are added together and run to completion; per request (ids, reason)."""
    results = {}
    for wave in waves:
        for rid, prompt, params in wave:
            seq = Sequence(rid, list(prompt), SamplingParams(**vars(params)))
            core.check(seq)
            core.add_request(seq)
            results[rid] = ([], None)
        for _ in range(10_000):
            if not core.has_work():
                break
            for out in core.step():
                ids, _ = results[out.request_id]
                results[out.request_id] = (ids + out.token_ids, out.finish_reason)
        assert not core.has_work()
        assert core.block_manager.num_free == core.block_manager.num_usable, "leaked KV blocks"
    return results


def shared_prefix_waves(prefix: list[int], tail, max_tokens: int = 5):
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    first = [("w0", prefix + tail(5, 0), greedy)]
    second = [
        ("w1", prefix + tail(7, 1), greedy),  # a different suffix after the cached prefix
        ("w1-same", prefix + tail(5, 0), greedy),  # w0's prompt again
        ("w1-long", prefix + tail(30, 2), greedy),  # longer than a step's token budget: chunked
        *[(f"w1-n{i}", prefix + tail(3, 3), greedy) for i in range(3)],  # n=3: identical, together
        ("w1-unrelated", tail(9, 4), greedy),
    ]
    cold = tail(20, 5)  # a prefix nobody computed yet: 5 full blocks of 4
    third = [(f"w2-n{i}", cold + tail(2, 6), greedy) for i in range(3)]  # n=3 together: one computes it
    return [first, second, third]


def test_greedy_outputs_equal_with_prefix_caching_on_and_off_on_the_tiny_model(path):
    prefix = prompt_ids(24, seed=11)  # 6 full blocks of 4
    waves = shared_prefix_waves(prefix, lambda n, seed: prompt_ids(n, seed=100 + seed))
    runs = {}
    for enabled in (False, True):
        settings = cpu_settings(path, max_num_batched_tokens=32, max_num_seqs=8, async_scheduling="off")
        runner = CountingRunner(ModelRunner(settings))
        core = with_prefix_caching(EngineCore(runner, settings), enabled)
        runs[enabled] = (drive(core, waves), runner.tokens_fed, core.block_manager)
    (off, fed_off, bm_off), (on, fed_on, bm_on) = runs[False], runs[True]
    assert on == off
    assert all(reason == "length" and len(ids) == 5 for ids, reason in on.values())
    assert bm_off.prefix_cache_hits == 0
    # Every token is computed once per sequence either way (no preemption), except the cached ones.
    assert fed_off - fed_on == bm_on.prefix_cache_hits
    # The second wave finds the 24-token prefix in 5 requests, and w1-same all of w0's prompt but
    # the block holding its last token (28 tokens). In the third, two of the three identical
    # prompts wait one step and take the 20 tokens the first one computed.
    assert bm_on.prefix_cache_hits == 24 * 5 + 28 + 2 * 20


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_fake_runner_outputs_equal_with_prefix_caching_on_and_off(async_on):
    # The fake model derives each token from the whole history it reads back through the block
    # table, so a wrongly shared or overwritten block changes the outputs.
    prefix = [(7 * j) % (VOCAB - 2) + 1 for j in range(17)]
    waves = shared_prefix_waves(
        prefix, lambda n, seed: [(3 * j + 11 * seed) % (VOCAB - 2) + 1 for j in range(n)], max_tokens=9
    )
    runs = {}
    for enabled in (False, True):
        settings = Settings(
            max_num_seqs=6, max_num_batched_tokens=24, async_scheduling="on" if async_on else "off"
        )
        runner = CountingRunner(FakeRunner(settings))
        core = with_prefix_caching(EngineCore(runner, settings), enabled)
        runs[enabled] = (drive(core, waves), runner.tokens_fed, core.block_manager.prefix_cache_hits)
    assert runs[True][0] == runs[False][0]
    assert runs[True][2] > 0 and runs[False][1] - runs[True][1] == runs[True][2]


def test_fake_runner_outputs_equal_under_preemption_with_shared_prefixes():
    # 16 blocks of 4 for 8 requests that share 4 blocks and grow to ~9 blocks each: constant preemption.
    prefix = [(5 * j) % (VOCAB - 2) + 1 for j in range(16)]
    waves = shared_prefix_waves(
        prefix, lambda n, seed: [(j + 13 * seed) % (VOCAB - 2) + 1 for j in range(n)], max_tokens=12
    )
    runs = {}
    for enabled in (False, True):
        settings = Settings(max_num_seqs=6, max_num_batched_tokens=24, async_scheduling="off")
        core = with_prefix_caching(EngineCore(FakeRunner(settings, num_kv_blocks=16), settings), enabled)
        runs[enabled] = (drive(core, waves), core.scheduler.num_preemptions)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] > 0
