"""Speculative decoding with a draft model (engine/worker/draft_model.py) through the engine, on the CPU with
tiny random checkpoints that share the target's tokenizer.

Greedy outputs equal those without speculation (64 requests; a smaller draft, the target itself, an
unrelated one); the target's own checkpoint as the draft accepts every draft, an unrelated draft almost
none; sampled requests keep the target's distribution (total variation against the unspeculated engine);
the draft's rolled-back K/V is never read (its cache poisoned between steps: the drafts do not change);
finish, abort and preemption free the draft's state and blocks; a draft with another tokenizer is refused
at load; the target's KV sizing counts the draft's blocks and weights.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.worker import kv_cache
from graphcache.engine.worker.draft_memory import draft_footprint, weight_elements
from graphcache.engine.worker.draft_model import (
    DraftModelProposer,
    DraftVocabMismatch,
    build_draft_proposer,
    fetch_draft_model,
)
from graphcache.engine.worker.runner import ModelRunner
from graphcache.metrics import Metrics
from graphcache.model.config import ModelLoadError
from helpers_model import cpu_settings, prompt_ids, recorded_descriptors, tiny_checkpoint

K = 3


def spec(draft, k: int = K) -> str:
    return json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="module")
def small():
    """A smaller draft of the target's family: one layer, half the width, another seed."""
    return tiny_checkpoint("qwen2", seed=3, hidden=32, layers=1, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def unrelated():
    """Same tokenizer, unrelated weights, untied head: its greedy picks are not the target's."""
    return tiny_checkpoint("llama", seed=5)


def core_for(path, draft=None, metrics: Metrics | None = None, **kw) -> EngineCore:
    settings = cpu_settings(path, speculative_config=None if draft is None else spec(draft), **kw)
    runner = ModelRunner(settings)
    return EngineCore(runner, settings, metrics or Metrics(), proposer=build_draft_proposer(settings, runner))


def drive(core: EngineCore, requests, on_step=None, blocks_taken: int = 0) -> dict:
    for rid, prompt, params in requests:
        seq = Sequence(rid, list(prompt), SamplingParams(**vars(params)))
        core.check(seq)
        core.add_request(seq)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    reasons: dict[str, str | None] = {}
    for _ in range(10_000):
        if not core.has_work():
            break
        for out in core.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if on_step is not None:
            on_step(core)
    assert not core.has_work()
    bm = core.block_manager
    assert bm.num_free == bm.num_usable, "leaked KV blocks"
    proposer = core.scheduler.proposer
    if isinstance(proposer, DraftModelProposer):  # every finished request gave its draft state back
        assert proposer.held_requests == 0
        assert proposer.num_free_blocks == proposer.runner.num_kv_blocks - blocks_taken
    return {rid: (tokens[rid], reasons.get(rid)) for rid in tokens}


def requests(n: int, **params) -> list:
    out = []
    for i in range(n):
        kw = dict(max_tokens=6 + (i * 7) % 13, temperature=0.0) | params
        out.append((f"r{i}", prompt_ids(4 + i % 9, seed=i, vocab=300), SamplingParams(**kw)))
    return out


def acceptance(core: EngineCore) -> float:
    counts = core.spec_metrics.snapshot()
    assert counts["draft_tokens"] > 0, counts
    return counts["accepted"] / counts["draft_tokens"]


@pytest.fixture(scope="module")
def plain_64(path):
    reqs = requests(64, ignore_eos=True)
    return reqs, drive(core_for(path), reqs)


def test_greedy_outputs_equal_without_speculation_with_a_smaller_draft(path, small, plain_64):
    reqs, want = plain_64
    core = core_for(path, small)
    assert drive(core, reqs) == want
    steps = core.scheduler.proposer.runner.cache.stats()
    assert steps.hits + steps.misses > 0  # the draft's steps went through its own graph cache


def test_self_draft_accepts_every_draft(path, plain_64):
    """The target's own checkpoint as the draft proposes the target's greedy picks: acceptance 1.0."""
    reqs, want = plain_64
    core = core_for(path, path, async_scheduling="on")
    assert drive(core, reqs) == want
    assert acceptance(core) == 1.0
    counts = core.spec_metrics.snapshot()
    assert (
        counts["per_pos"][0] == counts["drafts"]
    )  # every draft's first token (shorter drafts: near max_tokens)


def test_unrelated_draft_accepts_almost_nothing_and_outputs_stay_exact(path, unrelated, plain_64):
    reqs, want = plain_64
    core = core_for(path, unrelated)
    assert drive(core, reqs) == want
    assert acceptance(core) < 0.2


def test_drafts_stop_at_max_tokens_and_max_model_len(path, small):
    reqs = [
        (
            f"m{i}",
            prompt_ids(4 + i % 5, seed=40 + i, vocab=300),
            SamplingParams(max_tokens=None if i % 2 else 1 + i, temperature=0.0, ignore_eos=True),
        )
        for i in range(12)
    ]
    want = drive(core_for(path, max_model_len=20), reqs)
    core = core_for(path, small, max_model_len=20)
    assert drive(core, reqs) == want
    assert core.spec_metrics.snapshot()["drafts"] > 0


def pair_tv(a: Counter, b: Counter) -> float:
    keys = set(a) | set(b)
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[k] / na - b[k] / nb) for k in keys)


def test_sampled_requests_keep_the_targets_distribution(unrelated):
    """The first two tokens of N sampled requests (top-k 3: at most 9 pairs; the second comes from the
    verify step of the first token's draft: max_tokens 3 leaves room for one), drafted by the model's own
    checkpoint (its argmax given the first token), against the unspeculated engine. The target is the
    untied llama (its top logits are close: 3.6, 3.4, 3.1 at this prompt; the tied qwen2 puts nearly all its
    mass on repeating the last token). Bound for two empirical distributions of N draws over C cells:
    E[TV] <= sqrt(C / N) (twice the one-sample bound 1/2 sqrt(C / N)), plus the McDiarmid tail
    sqrt(ln(1e6) / N) (each draw moves TV by at most 1/N): a false failure is about one in a million. At
    N = 600, C = 9 that is 0.12 + 0.15 = 0.27. A verifier that always accepted would make the second token a
    function of the first: 3 pairs, a TV near 0.6."""
    n, cells = 600, 9
    prompt = prompt_ids(6, seed=7, vocab=300)
    reqs = [
        (f"s{i}", prompt, SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=i, ignore_eos=True))
        for i in range(n)
    ]
    # every request admitted in the first step: a step with requests still to admit does not speculate
    kw = dict(max_num_seqs=n, max_num_batched_tokens=8 * n, num_kv_blocks=4 * n, capture_sizes=[1, 2, 4, 8])
    plain = drive(core_for(unrelated, **kw), reqs)
    core = core_for(unrelated, unrelated, **kw)
    spec_runs = drive(core, reqs)
    counts = core.spec_metrics.snapshot()
    assert counts["drafts"] > 0.9 * n and 0 < counts["accepted"] < counts["draft_tokens"], counts
    a = Counter(tuple(ids[:2]) for ids, _ in plain.values())
    b = Counter(tuple(ids[:2]) for ids, _ in spec_runs.values())
    assert len(a | b) <= cells and len(b) >= 6, (a, b)
    bound = math.sqrt(cells / n) + math.sqrt(math.log(1e6) / n)
    assert pair_tv(a, b) < bound, (a, b)


POISON = 1e4


def test_rolled_back_draft_kv_is_never_read(path, small):
    """After every step the draft's K/V past what each request has in common with its accepted context
    (where rejected drafts were written) and its free blocks are poisoned with a large finite value: the
    drafts it proposes are the same as without the poison, so it never reads them (it re-feeds from the
    common prefix)."""
    reqs = requests(24, ignore_eos=True)

    def run(poisoned: bool):
        core = core_for(path, small)
        proposer = core.scheduler.proposer
        proposed: list = []
        inner = proposer.propose
        proposer.propose = lambda reqs_, limits=None: proposed.append(inner(reqs_, limits)) or proposed[-1]
        kv, bs = proposer.runner.kv_cache, proposer.block_size
        hits = [0]

        def poison(core: EngineCore) -> None:
            used = set()
            for rid, state in proposer._states.items():
                seq = core.requests.get(rid)
                context = [] if seq is None else list(seq.prompt_token_ids) + list(seq.output_token_ids)
                keep = 0
                while keep < min(len(state.held), len(context)) and state.held[keep] == context[keep]:
                    keep += 1
                for level, block in enumerate(state.blocks):
                    used.add(block)
                    lo = max(0, keep - level * bs)
                    if lo < bs:
                        kv[:, :, block, lo:] = POISON
                        hits[0] += 1
            free = [b for b in range(proposer.runner.num_kv_blocks) if b not in used]
            kv[:, :, free] = POISON

        out = drive(core, reqs, on_step=poison if poisoned else None)
        return out, proposed, hits[0], core

    want, drafts, _, _ = run(False)
    got, poisoned_drafts, hits, core = run(True)
    assert got == want
    assert poisoned_drafts == drafts
    counts = core.spec_metrics.snapshot()
    assert hits > 0 and counts["draft_tokens"] > counts["accepted"] > 0, counts


def test_preemption_and_abort_free_the_drafts_state(path, small):
    """A cache too small for every request at once preempts: the preempted request's draft state goes
    (the scheduler removes it) and comes back on resume; outputs equal the unspeculated run's; an aborted
    request's state goes at once."""
    reqs = requests(12, ignore_eos=True, max_tokens=30)
    want = drive(core_for(path, num_kv_blocks=40), reqs)
    core = core_for(path, small, num_kv_blocks=40)
    removed: list[str] = []
    proposer = core.scheduler.proposer
    inner = proposer.remove
    proposer.remove = lambda rid: (removed.append(rid), inner(rid))[1]
    got = drive(core, reqs)
    assert got == want
    assert core.scheduler.num_preemptions > 0
    assert len(removed) > len(reqs)  # every finish, and each preemption
    # abort: a running request's draft state is dropped with it
    core = core_for(path, small)
    proposer = core.scheduler.proposer
    for rid, prompt, params in requests(3, ignore_eos=True, max_tokens=40):
        seq = Sequence(rid, list(prompt), params)
        core.check(seq)
        core.add_request(seq)
    for _ in range(4):
        core.step()
    assert proposer.held_requests == 3
    core.abort("r1")
    assert proposer.held_requests == 2 and "r1" not in proposer._states
    core.abort_all("abort")
    assert proposer.held_requests == 0 and proposer.num_free_blocks == proposer.runner.num_kv_blocks


def test_a_draft_without_free_blocks_decodes_plainly(path, small):
    """When the draft's own cache has no block for a row, that row gets no draft this step (and the
    target's outputs do not change)."""
    reqs = requests(8, ignore_eos=True, max_tokens=12)
    want = drive(core_for(path), reqs)
    core = core_for(path, small)
    proposer = core.scheduler.proposer
    taken = len(proposer._free) - 6
    proposer._free = proposer._free[-6:]  # all but 6 of its blocks are gone
    got = drive(core, reqs, blocks_taken=taken)
    assert got == want
    assert proposer.num_no_room > 0
    assert core.spec_metrics.snapshot()["drafts"] > 0


def test_a_draft_with_another_tokenizer_is_refused_naming_the_fix(path):
    other = tiny_checkpoint("qwen2", vocab_size=512)
    settings = cpu_settings(path, speculative_config=spec(other))
    runner = ModelRunner(settings)
    with pytest.raises(DraftVocabMismatch, match="same tokenizer, or use method ngram"):
        build_draft_proposer(settings, runner)


def test_tensor_parallel_is_refused_with_the_reason(path, small):
    settings = cpu_settings(path, speculative_config=spec(small)).updated(tensor_parallel_size=2)
    with pytest.raises(RuntimeError, match="tensor_parallel_size 1 only"):
        build_draft_proposer(settings, object())  # refused before the target is looked at


def test_the_targets_kv_sizing_counts_the_draft(path, small, monkeypatch):
    """On the CPU the default cache is capped in bytes: with a draft, each block costs the target's
    bytes and the draft's."""
    target = ModelRunner(cpu_settings(path, num_kv_blocks=None))
    t_block = target.kv_storage[:, :, 0].numel() * target.kv_storage.element_size()
    draft_runner = ModelRunner(cpu_settings(small))
    d_block = draft_runner.kv_storage[:, :, 0].numel() * draft_runner.kv_storage.element_size()
    cap = 300 * (t_block + d_block)
    monkeypatch.setattr(kv_cache, "CPU_KV_CACHE_MAX_BYTES", cap)
    alone = ModelRunner(cpu_settings(path, num_kv_blocks=None))
    assert alone.num_kv_blocks == min(cap // t_block, 8 * alone.max_blocks_per_seq)
    settings = cpu_settings(path, num_kv_blocks=None, speculative_config=spec(small))
    with_draft = ModelRunner(settings)
    assert with_draft.num_kv_blocks == 300
    proposer = build_draft_proposer(settings, with_draft)
    assert proposer.runner.num_kv_blocks == with_draft.num_kv_blocks  # block for block
    fp = draft_footprint(
        settings,
        block_size=4,
        dtype=torch.float32,
        kv_dtype=torch.float32,
        max_tokens=256,
        max_reqs=8,
        max_model_len=256,
    )
    assert fp is not None and fp.block_bytes == d_block
    assert fp.weight_bytes == weight_elements(small) * 4
    assert fp.weight_bytes == sum(p.numel() * 4 for p in proposer.runner.model.parameters())


def test_a_draft_with_fewer_positions_than_max_model_len_is_refused(path):
    short = tiny_checkpoint("qwen2", seed=9, max_positions=128)
    settings = cpu_settings(path, speculative_config=spec(short))  # max_model_len 256
    with pytest.raises(ModelLoadError, match="lower --max-model-len to 128"):
        ModelRunner(settings)


def test_a_hub_draft_is_fetched_like_the_target(path, small, monkeypatch):
    import graphcache.engine.worker.draft_model as draft_model

    fetched, reports = [], []

    def fake_fetch(repo, revision, progress):
        fetched.append((repo, revision))
        progress({"files_done": 1, "files_total": 1})
        return small

    monkeypatch.setattr(draft_model, "fetch_hub_model", fake_fetch)
    settings = cpu_settings(path, speculative_config=spec("some-org/draft-0.1b"))
    out = fetch_draft_model(settings, reports.append)
    assert fetched == [("some-org/draft-0.1b", None)]
    assert json.loads(out.engine.speculative_config)["model"] == str(small)
    assert reports[-1]["model"] == "some-org/draft-0.1b" and reports[-1]["draft"] is True
    local = cpu_settings(path, speculative_config=spec(small))
    assert fetch_draft_model(local, reports.append) is local  # a local directory: as it is


def test_a_failed_draft_step_costs_only_that_steps_drafts(path, small):
    """A draft step that raises: the requests decode plainly that step, the draft's state starts over
    (blocks back, keys dropped), and the outputs are the unspeculated ones."""
    reqs = requests(8, ignore_eos=True, max_tokens=16)
    want = drive(core_for(path), reqs)
    core = core_for(path, small)
    proposer = core.scheduler.proposer
    inner, calls = proposer.runner.execute, [0]

    def flaky(plan, in_flight=None):
        calls[0] += 1
        if calls[0] in (3, 9):
            raise RuntimeError("injected draft step failure")
        return inner(plan, in_flight)

    proposer.runner.execute = flaky
    assert drive(core, reqs) == want
    assert proposer.num_failures == 2
    assert core.spec_metrics.snapshot()["accepted"] > 0


class _Req:
    """What a proposer reads of a request (spec/proposer.py DraftRequest)."""

    def __init__(self, rid: str, prompt: list[int]) -> None:
        self.request_id, self.prompt_token_ids, self.output_token_ids = rid, prompt, []


def test_catching_up_past_the_token_budget_chunks_and_drafts_the_same(path, small):
    """Contexts longer than the draft's step budget are fed in chunks before a final step that holds every
    row's last chunk: the drafts equal those of a draft whose budget holds everything at once, round after
    round (each round appends the first draft and a token the draft did not propose, so the next round
    keeps a common prefix and rolls the rest back)."""

    def proposer(**kw) -> DraftModelProposer:
        settings = cpu_settings(path, speculative_config=spec(small), **kw)
        built = build_draft_proposer(settings, ModelRunner(settings))
        assert built is not None
        return built

    tight = proposer(max_num_batched_tokens=16, capture_sizes=[1, 2, 4, 8], max_capture_size=8)
    roomy = proposer()
    assert tight.runner.max_tokens == 16 and roomy.runner.max_tokens >= 256
    reqs = {
        name: [_Req(f"q{i}", prompt_ids(9 + 2 * i, seed=60 + i, vocab=300)) for i in range(8)]
        for name in "ab"
    }
    for round_ in range(4):
        got, want = tight.propose(reqs["a"]), roomy.propose(reqs["b"])
        assert got == want, round_
        assert all(len(d) == K for d in got)
        for a, b, d in zip(reqs["a"], reqs["b"], want, strict=True):
            a.output_token_ids = b.output_token_ids = [*b.output_token_ids, d[0], (d[1] + 1) % 300]
    assert tight.num_steps > roomy.num_steps  # the first round took several extend steps


def test_a_draft_bigger_than_the_target_loads_with_a_warning(path, unrelated, caplog):
    settings = cpu_settings(path, speculative_config=spec(unrelated))
    with caplog.at_level("WARNING", logger="graphcache.engine.worker.draft_model"):
        proposer = build_draft_proposer(settings, ModelRunner(settings))
    assert proposer is not None
    assert weight_elements(unrelated) > weight_elements(path)
    assert any("speculation is unlikely to pay" in r.getMessage() for r in caplog.records)


def test_draft_decode_steps_replay_their_warmed_descriptors(path, small):
    """After the target's and the draft's default warmup, every decode step of the draft (its k - 1 steps per
    propose) and every verify step of the target find their descriptors in their own caches, none captured
    while serving (a catch-up extend step's mixed shape may be); the draft's cache counts its own hits."""
    core = core_for(path, small, warmup_decode_sizes=None, warmup_mixed_sizes=None, max_num_seqs=8)
    draft = core.scheduler.proposer
    assert isinstance(draft, DraftModelProposer)
    core.runner.warmup()
    draft.warmup()
    caches = {"target": core.runner.cache, "draft": draft.runner.cache}
    warm = {name: {e.descriptor for e in c.entries()} for name, c in caches.items()}
    seen = {name: recorded_descriptors(cache) for name, cache in caches.items()}
    drive(core, requests(8, ignore_eos=True))
    decodes = {str(d) for d in seen["draft"] if d.uniform_decode}
    verify = {str(d) for d in seen["target"] if d.verify}
    assert decodes and verify and acceptance(core) > 0
    assert decodes <= warm["draft"], sorted(decodes - warm["draft"])
    assert verify <= warm["target"], sorted(verify - warm["target"])
    for name, cache in caches.items():
        captured = {e.descriptor for e in cache.entries()} - warm[name]
        assert not any(d.endswith((":decode", ":verify")) for d in captured), (name, captured)
    hits = {e.descriptor: e.hits for e in draft.runner.cache.entries()}
    assert all(hits[d] > 0 for d in decodes) and draft.runner.cache.stats().hits > 0
