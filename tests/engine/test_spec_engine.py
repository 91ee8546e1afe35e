"""Speculative decoding through the engine (CPU, tiny model): n-gram drafts verified in one step, greedy
and sampled rows, verify steps as "T:R:verify" descriptors.

Greedy outputs with speculation equal those without, token for token (EOS, stop strings, stop tokens and
max_tokens cutting inside an accepted run among them); rolled-back K/V is never read (poisoned caches);
the prefix cache never registers a block holding a rejected draft; the spec-decode counters count.
"""

from __future__ import annotations

import json

import pytest
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.sched.block_manager import BlockManager
from graphcache.engine.sched.scheduler import Scheduler
from graphcache.engine.sequence import SamplingParams, Sequence, StructuredSpec
from graphcache.engine.spec.config import parse_speculative_config
from graphcache.engine.spec.proposer import Proposer
from graphcache.engine.worker.runner import ModelRunner
from graphcache.metrics import Metrics
from helpers_model import cpu_settings, prompt_ids, recorded_descriptors, tiny_checkpoint

SPEC = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
)


def drive(core: EngineCore, requests, on_step=None) -> dict:
    for rid, prompt, params in requests:
        seq = Sequence(rid, list(prompt), SamplingParams(**vars(params)))
        core.check(seq)
        core.add_request(seq)
    tokens = {rid: [] for rid, _, _ in requests}
    reasons: dict[str, str | None] = {}
    texts = {rid: "" for rid, _, _ in requests}
    for _ in range(10_000):
        if not core.has_work():
            break
        for out in core.step():
            assert out.request_id not in reasons, f"{out.request_id} emitted after finishing"
            tokens[out.request_id] += out.token_ids
            texts[out.request_id] += out.text
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if on_step is not None:
            on_step(core)
    assert not core.has_work()
    bm = core.block_manager
    assert bm.num_free == bm.num_usable, "leaked KV blocks"
    return {rid: (tokens[rid], reasons.get(rid), texts[rid]) for rid in tokens}


def repeating_prompt(i: int) -> list[int]:
    """A prompt that repeats a short pattern: the n-gram proposer finds drafts, and the tiny random model
    (greedy) tends to loop over its context, so drafts get accepted."""
    base = prompt_ids(3 + i % 4, seed=100 + i, vocab=200)
    return (base * 6)[: 8 + 3 * (i % 5)]


def requests(n: int, **params) -> list:
    out = []
    for i in range(n):
        prompt = repeating_prompt(i) if i % 3 else prompt_ids(6 + i % 7, seed=i, vocab=300)
        kw = dict(max_tokens=10 + (i * 7) % 23, temperature=0.0) | params
        out.append((f"r{i}", prompt, SamplingParams(**kw)))
    return out


def core_for(path, spec: str | None, metrics: Metrics | None = None, **kw) -> EngineCore:
    settings = cpu_settings(path, speculative_config=spec, **kw)
    return EngineCore(ModelRunner(settings), settings, metrics)


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("qwen2")


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_greedy_outputs_equal_without_speculation(path, async_scheduling):
    reqs = requests(64, ignore_eos=True)
    want = drive(core_for(path, None, async_scheduling=async_scheduling), reqs)
    metrics = Metrics()
    core = core_for(path, SPEC, metrics, async_scheduling=async_scheduling)
    verify_steps = []
    core.step_failpoint = lambda plan: verify_steps.append(len(plan.verify)) if plan.verify else None
    got = drive(core, reqs)
    assert got == want
    counts = core.spec_metrics.snapshot()
    assert verify_steps and counts["drafts"] > 0
    assert counts["accepted"] > 0, counts  # the repeating prompts get drafts accepted
    assert counts["draft_tokens"] >= counts["accepted"]


def test_a_verify_step_is_never_overlapped_when_the_batch_outgrows_speculation(path):
    """Async scheduling: a step with verify rows whose admissions take the batch past the verify-batch bound
    (so the next step no longer speculates) is still completed before the next one is planned; planned past
    a verify row in flight, the next step fed rows nothing and overran the token budget (seen on the H200)."""
    budget = 24  # admissions a few at a time: the batch crosses the bound while rows are verifying
    reqs = requests(40, max_tokens=40)
    want = drive(core_for(path, None, max_num_batched_tokens=budget, max_num_seqs=16), reqs)
    core = core_for(path, SPEC, max_num_batched_tokens=budget, max_num_seqs=16, async_scheduling="on")
    core.scheduler.spec_batch_limit = 6
    plans = []
    core.step_failpoint = plans.append
    got = drive(core, reqs)
    assert got == want
    assert any(plan.verify for plan in plans)
    assert max(plan.num_tokens for plan in plans) <= budget
    assert all(t is None or t for plan in plans for t in (plan.tokens or []))  # every row feeds a token


def test_eos_and_stop_tokens_cut_inside_an_accepted_run(path):
    """Each request stops on a token its unspeculated run emits mid-way (as EOS via stop_token_ids, and
    as the model's own EOS), with max_tokens far away: speculation stops at the same token."""
    base = requests(24, ignore_eos=True, max_tokens=40)
    plain = drive(core_for(path, None), base)
    reqs = []
    for rid, prompt, _params in base:
        ids = plain[rid][0]
        stop = ids[len(ids) // 2]
        reqs.append((rid, prompt, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop])))
    want = drive(core_for(path, None), reqs)
    core = core_for(path, SPEC, Metrics())
    got = drive(core, reqs)
    assert got == want
    assert all(reason == "stop" for _, reason, _ in got.values())
    assert core.spec_metrics.snapshot()["accepted"] > 0


def test_max_tokens_and_model_len_cut_runs(path):
    reqs = [
        (f"m{i}", repeating_prompt(i), SamplingParams(max_tokens=1 + i, temperature=0.0, ignore_eos=True))
        for i in range(12)
    ]
    want = drive(core_for(path, None, max_model_len=40), reqs)
    got = drive(core_for(path, SPEC, max_model_len=40), reqs)
    assert got == want
    long = [("long", repeating_prompt(1), SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))]
    want = drive(core_for(path, None, max_model_len=40), long)
    got = drive(core_for(path, SPEC, max_model_len=40), long)
    assert got == want and got["long"][1] == "length"


def test_stop_strings_cut_inside_an_accepted_run(path):
    core = core_for(path, None)
    tok = core.runner.tokenizer
    base = requests(16, ignore_eos=True, max_tokens=30)
    plain = drive(core, base)
    reqs = []
    for rid, prompt, _params in base:
        text = plain[rid][2]
        stop = text[len(text) // 2 : len(text) // 2 + 2] if len(text) > 4 else "zzzz"
        reqs.append(
            (rid, prompt, SamplingParams(max_tokens=30, temperature=0.0, stop=[stop], ignore_eos=True))
        )
    assert tok is not None
    want = drive(core_for(path, None), reqs)
    got = drive(core_for(path, SPEC), reqs)
    assert got == want


def test_logprob_and_penalised_rows_decode_alongside(path):
    """Logprob and penalised requests (no speculation) run in the same steps as speculating ones, one
    token a step, with the outputs they have without speculation."""
    reqs = requests(12, ignore_eos=True)
    reqs += [
        (
            "s1",
            repeating_prompt(2),
            SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True),
        ),
        (
            "s2",
            repeating_prompt(4),
            SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        ),
    ]
    want = drive(core_for(path, None), reqs)
    core = core_for(path, SPEC, Metrics())
    got = drive(core, reqs)
    assert got == want


def test_seeded_sampled_rows_speculate_and_repeat(path):
    """Sampled requests speculate too (rejection sampling); a seeded one gives the same tokens run to
    run, and each ends at its max_tokens."""
    reqs = [
        (
            f"s{i}",
            repeating_prompt(i),
            SamplingParams(max_tokens=16, temperature=0.7, top_k=8, seed=i, ignore_eos=True),
        )
        for i in range(6)
    ]
    runs = []
    for _ in range(2):
        core = core_for(path, SPEC, Metrics())
        runs.append(drive(core, reqs))
        assert core.spec_metrics.snapshot()["drafts"] > 0
    assert runs[0] == runs[1]
    assert all(len(ids) == 16 and reason == "length" for ids, reason, _ in runs[0].values())


POISON = 1e4


def test_rolled_back_kv_is_never_read(path):
    """After every step, the K/V slots past each running sequence's valid K/V (where rejected drafts
    were written) and the free blocks are poisoned with a large finite value (NaN would leak through the
    masked attention's 0 * NaN even where nothing is read): the outputs do not change, so nothing reads
    them. The same poison without speculation is the control."""
    reqs = requests(16, ignore_eos=True)
    want = drive(core_for(path, None), reqs)
    core = core_for(path, SPEC, Metrics())
    bs = core.block_manager.block_size
    kv = core.runner.kv_cache  # [layers, 2, blocks, bs, K, D]
    poisoned = [0]

    def poison(core: EngineCore) -> None:
        held = set()
        for seq in core.scheduler.running:
            valid = seq.num_computed_tokens
            for level, block in enumerate(seq.block_table):
                held.add(block)
                lo = max(0, valid - level * bs)
                if lo < bs:
                    kv[:, :, block, lo:] = POISON
                    poisoned[0] += 1
        free = [b for b in range(kv.shape[2]) if b not in held and core.block_manager._ref[b] == 0]
        free = [b for b in free if core.block_manager._key[b] is None]  # cached-free blocks stay readable
        if free:
            kv[:, :, free] = POISON

    got = drive(core, reqs, on_step=poison)
    assert got == want
    assert (
        poisoned[0] > 0
        and core.spec_metrics.snapshot()["draft_tokens"] > core.spec_metrics.snapshot()["accepted"]
    )
    assert (kv == POISON).any()


def test_prefix_cache_never_registers_a_rejected_draft(path):
    """Every registered block's tokens are the tokens of a sequence that holds it or held it: checked
    after each step against the sequences' known tokens; a second wave reuses the cache and still equals."""
    reqs = requests(16, ignore_eos=True)
    want = drive(core_for(path, None), reqs)
    core = core_for(path, SPEC, Metrics())
    bm = core.block_manager

    def check(core: EngineCore) -> None:
        for seq in core.scheduler.running:
            ids = seq.all_token_ids
            for level, block in enumerate(seq.block_table):
                key = bm._key[block]
                if key is not None:
                    assert list(key[1]) == ids[level * bm.block_size : (level + 1) * bm.block_size]
                    assert (level + 1) * bm.block_size <= seq.num_computed_tokens

    assert drive(core, reqs, on_step=check) == want
    again = [(f"again-{rid}", p, s) for rid, p, s in reqs]
    got = drive(core, again, on_step=check)
    assert {rid.removeprefix("again-"): v for rid, v in got.items()} == want


def test_disable_by_batch_size_and_structured_rows_do_not_speculate(path):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2})
    core = core_for(path, spec, Metrics())
    reqs = requests(6, ignore_eos=True)
    plans = []
    core.step_failpoint = lambda plan: plans.append(plan)
    assert drive(core, reqs) == drive(core_for(path, None), reqs)
    verify = [p for p in plans if p.verify]
    # 6 requests of different lengths: speculation only once one runs alone (1 < disable_by_batch_size)
    assert verify and all(p.num_reqs == 1 for p in verify)
    assert core.scheduler.may_speculate(Sequence("g", [1], SamplingParams(temperature=0.0)))
    assert core.scheduler.may_speculate(
        Sequence("s", [1], SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1))
    )
    for params in (
        SamplingParams(temperature=0.0, structured=StructuredSpec("json")),
        SamplingParams(temperature=0.7, logit_bias={1: 2.0}),
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, min_tokens=3),
    ):
        assert not core.scheduler.may_speculate(Sequence("x", [1], params)), params


def test_block_manager_trim_gives_back_unregistered_blocks_only():
    from graphcache.engine.sched.block_manager import BlockManager

    bm = BlockManager(16, 4, enable_prefix_caching=True)
    seq = Sequence("t", list(range(9)), SamplingParams(temperature=0.0))
    bm.allocate(seq, 16)  # 4 blocks for 9 known tokens + drafts
    bm.commit(seq, 16)  # only known tokens register: 2 full blocks
    assert [bm._key[b] is not None for b in seq.block_table] == [True, True, False, False]
    free = bm.num_free
    assert bm.trim(seq, 3) == 1 and len(seq.block_table) == 3 and bm.num_free == free + 1
    with pytest.raises(RuntimeError, match="shared or registered"):
        bm.trim(seq, 1)
    bm.free(seq)
    assert bm.num_free == bm.num_usable


def test_verify_steps_replay_verify_descriptors(path):
    """With logits rows to spare (max_num_seqs 32: mixed graphs of up to 32 logits rows), verify steps run
    as "T:R:verify" descriptors through the graph cache (counted, listed), with the same greedy outputs."""
    kw = dict(max_num_seqs=32)
    reqs = requests(24, ignore_eos=True)
    want = drive(core_for(path, None, **kw), reqs)
    core = core_for(path, SPEC, Metrics(), **kw)
    runner = core.runner
    seen = recorded_descriptors(runner.cache)
    got = drive(core, reqs)
    assert got == want
    verify = [d for d in seen if d.verify]
    assert verify and all(str(d).endswith(":verify") and d.num_reqs >= 2 for d in verify)
    stats = runner.cache.stats()
    assert stats.hits + stats.misses >= len(seen)
    listed = json.dumps(runner.cache.info())
    assert ":verify" in listed


def test_verify_descriptor_round_trips():
    from graphcache.graphs.descriptor import BatchDescriptor

    d = BatchDescriptor.parse("16:16:verify")
    assert d.verify and not d.uniform_decode and str(d) == "16:16:verify"
    assert d != BatchDescriptor(16, 16) and BatchDescriptor.parse(
        str(BatchDescriptor(16, 16))
    ) == BatchDescriptor(16, 16)
    with pytest.raises(ValueError, match="both decode and verify"):
        BatchDescriptor(4, 4, True, True)


def test_two_cores_on_one_registry_share_the_counters(path):
    metrics = Metrics()
    first = core_for(path, SPEC, metrics)
    second = core_for(path, SPEC, metrics)
    assert first.spec_metrics is second.spec_metrics is metrics.spec_decode


def test_verify_descriptors_are_warmed_up(path):
    """With speculation configured and the default warmup, the runner captures "T:T:verify" descriptors at
    start (T from 2 to the most logits rows), and a verify step then finds its descriptor there."""
    core = core_for(path, SPEC, Metrics(), warmup_decode_sizes=None, max_num_seqs=16)
    runner = core.runner
    warm = [str(d) for d in runner.warmup_descriptors() if d.verify]
    assert warm == ["2:2:verify", "4:4:verify", "8:8:verify", "16:16:verify"]
    runner.warmup()
    assert all(w in json.dumps(runner.cache.info()) for w in warm)
    reqs = requests(6, ignore_eos=True)
    assert drive(core, reqs) == drive(core_for(path, None, warmup_decode_sizes=None, max_num_seqs=16), reqs)


def record_runs(core: EngineCore) -> dict[str, list[tuple[int, list[int]]]]:
    """Per request, each verify run appended: (outputs before it, the run)."""
    runs: dict[str, list[tuple[int, list[int]]]] = {}
    sched = core.scheduler
    inner = sched._append_verified

    def wrapped(seq, emitted, now):
        runs.setdefault(seq.request_id, []).append((len(seq.output_token_ids), list(emitted)))
        inner(seq, emitted, now)

    sched._append_verified = wrapped
    return runs


def stop_inside_a_run(ids: list[int], runs: list[tuple[int, list[int]]]) -> int | None:
    """A token whose first occurrence in `ids` is inside a run, not its last token (None: no such)."""
    for before, run in runs:
        for j, token in enumerate(run[:-1]):
            if token not in ids[: before + j]:
                return token
    return None


@pytest.mark.parametrize("how", ["eos", "stop_token", "max_tokens"])
def test_eos_stop_tokens_and_max_tokens_end_speculating_requests_as_without(path, how):
    """The model's EOS (the scheduler's eos ids set to a token the runs emit), a stop token, or max_tokens
    ends a request: outputs equal those without speculation (the stop is a token first emitted inside a
    run of the unstopped speculative run where there is one)."""
    base = requests(32, ignore_eos=True, max_tokens=40)
    spec = core_for(path, SPEC, Metrics())
    runs = record_runs(spec)
    plain = drive(spec, base)
    reqs, eos = [], set()
    for i, (rid, prompt, _) in enumerate(base):
        ids = plain[rid][0]
        stop = stop_inside_a_run(ids, runs.get(rid, []))
        stop = ids[5 + i % 7] if stop is None else stop
        if how == "eos":
            eos.add(stop)
            params = SamplingParams(max_tokens=40, temperature=0.0)
        elif how == "stop_token":
            params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop])
        else:
            params = SamplingParams(max_tokens=6 + i % 9, temperature=0.0, ignore_eos=True)
        reqs.append((rid, prompt, params))
    cores = [core_for(path, None), core_for(path, SPEC, Metrics())]
    if eos:
        for c in cores:
            c.scheduler.eos_token_ids = frozenset(eos)
    want = drive(cores[0], reqs)
    got = drive(cores[1], reqs)
    assert got == want
    if how == "max_tokens":
        assert all(reason == "length" for _, reason, _ in got.values())
        return  # drafts never run past max_tokens: the run ends there rather than being cut
    assert all(reason == "stop" for _, reason, _ in got.values())
    # (This tiny model loops on tokens it emitted before, so a stop's first occurrence is seldom inside a
    # run: test_postprocess_cuts_a_run_at_a_stop_and_rolls_back cuts one by construction.)


class FixedProposer(Proposer):
    num_speculative_tokens = 3

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, requests, max_draft_tokens=None):
        return [self.drafts[:m] for m in (max_draft_tokens or [3] * len(requests))]

    def remove(self, request_id: str) -> None:
        pass


def spec_scheduler(drafts: list[int]) -> Scheduler:
    sched = Scheduler(
        BlockManager(32, 4),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        eos_token_ids=frozenset({99}),
    )
    sched.spec = parse_speculative_config(json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    sched.proposer = FixedProposer(drafts)
    return sched


def test_postprocess_cuts_a_run_at_a_stop_and_rolls_back():
    """A verify run with EOS inside: the outputs end at it, the request finishes and frees every block; the
    prefix cache holds only blocks of computed, known tokens."""
    sched = spec_scheduler([8, 99, 10])
    seq = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=20))
    sched.add(seq)
    out = sched.schedule()  # the prefill
    sched.postprocess(out, [7], 0.0)
    out = sched.schedule()  # the verify row: [7, 8, 99, 10]
    assert out.plan is not None and out.plan.verify == ((0, 3),) and out.plan.tokens == [[7, 8, 99, 10]]
    assert seq.num_computed_tokens == 9 and len(seq.block_table) == 3
    sched.postprocess(out, [[8, 99, 10]], 0.0)  # d0 and d1 accepted, then 10: EOS (99) cuts before 10
    assert seq.output_token_ids == [7, 8, 99] and seq.finish_reason == "stop"
    bm = sched.block_manager
    assert bm.num_free == bm.num_usable
    for key in bm._cache:  # registered: the prompt's first block only (the second holds uncomputed 99)
        assert key[1] == (1, 2, 3, 4)


def test_postprocess_rolls_back_a_rejection_and_trims_blocks():
    sched = spec_scheduler([8, 98, 97])
    seq = Sequence("b", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=20))
    sched.add(seq)
    out = sched.schedule()
    sched.postprocess(out, [7], 0.0)
    out = sched.schedule()  # [7, 8, 98, 97]: positions 5..8, 3 blocks
    assert len(seq.block_table) == 3
    sched.postprocess(out, [[8, 11]], 0.0)  # d0 accepted, d1 rejected: the correction 11
    assert seq.output_token_ids == [7, 8, 11] and not seq.is_finished
    assert seq.num_computed_tokens == 7 == seq.num_tokens - 1  # K/V of 7 and 8 kept; 98, 97 rolled back
    assert len(seq.block_table) == 2 and sched.trimmed == [(seq.key, 2)]
    kept = list(seq.block_table)
    out = sched.schedule()
    assert out.plan is not None and out.plan.trimmed == ((seq.key, 2),)
    assert out.plan.tokens == [[11, 8, 98, 97]] and seq.block_table[:2] == kept
    assert out.plan.grown == ((seq.key, seq.block_table[2:]),)


@pytest.mark.parametrize("streams", [1, 4])
def test_verify_steps_replay_their_warmed_descriptors(path, streams):
    """After the default warmup, every verify step finds its descriptor in the cache (hit ratio 1 on the CPU's
    eager backend; the issue asks >= 0.99 on the H200): copy prompts speculated 1 and 4 at a time, their
    verify descriptors all among the warmed ones, each counted as a hit, none captured while serving."""
    core = core_for(path, SPEC, Metrics(), warmup_decode_sizes=None, max_num_seqs=16)
    runner = core.runner
    runner.warmup()
    warm = {e.descriptor for e in runner.cache.entries()}
    seen = recorded_descriptors(runner.cache)
    reqs = [
        (
            f"c{i}",
            repeating_prompt(3 * i + 1),
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        )
        for i in range(streams)
    ]
    drive(core, reqs)
    verify = [str(d) for d in seen if d.verify]
    assert verify and core.spec_metrics.snapshot()["accepted"] > 0
    assert set(verify) <= warm, sorted(set(verify) - warm)
    hits = {e.descriptor: e.hits for e in runner.cache.entries()}
    assert all(hits[d] > 0 for d in set(verify))
    captured = {e.descriptor for e in runner.cache.entries()} - warm  # while serving: prefill shapes only
    assert not any(d.endswith(":verify") for d in captured), captured
