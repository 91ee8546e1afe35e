"""Speculation turned off per request by measured acceptance (engine/spec/acceptance.py), and probed again.

The gate alone: judged after W drafts on decayed counts, off at acceptance <= c, probed after R of its
decode steps, a failed probe doubling the wait. Through the engine (CPU, tiny model): a request whose
drafts are never accepted stops drafting after the judging window, one whose drafts are all accepted keeps
drafting, one whose text "starts repeating" later turns back on at a probe; greedy outputs stay exactly
those without speculation, and the vllm:spec_decode_* counters count only the verify rows that ran.
"""

from __future__ import annotations

import json

import pytest
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.sequence import SamplingParams
from graphcache.engine.spec.acceptance import MAX_BACKOFF, AcceptanceGate, AcceptanceRule
from graphcache.engine.spec.proposer import Proposer
from graphcache.engine.worker.runner import ModelRunner
from graphcache.metrics import Metrics
from helpers_model import cpu_settings, prompt_ids, tiny_checkpoint
from test_spec_engine import drive, requests

K = 3
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": K})
W, R = 4, 6  # judge after 4 drafts; an off request waits 6 decode steps


# --------------------------------------------------------------------------- the gate alone


def off_after(gate: AcceptanceGate, key: int, drafted: int, accepted: int, limit: int = 100) -> int:
    """Verify steps observed until the gate turns `key` off (limit + 1: it never did)."""
    for n in range(1, limit + 1):
        assert gate.allows(key)
        gate.observe(key, drafted, accepted)
        if not gate.is_on(key):
            return n
    return limit + 1


def test_zero_acceptance_turns_off_after_the_judging_window():
    gate = AcceptanceGate(AcceptanceRule(0.1, judge_drafts=W, reprobe_steps=R))
    assert off_after(gate, 1, K, 0) == W and gate.num_turned_off == 1
    assert not gate.allows(1) and not gate.wants(1)


def test_acceptance_above_the_cost_stays_on_and_at_or_below_turns_off():
    c = 0.25
    gate = AcceptanceGate(AcceptanceRule(c, judge_drafts=W, reprobe_steps=R))
    assert off_after(gate, 1, 4, 2) == 101  # rate 0.5 > c
    assert off_after(gate, 2, 4, 1) == W  # rate 0.25 = c: a verify step saves nothing
    assert off_after(gate, 3, 4, 4) == 101
    # c = 0: a verify step is free, so nothing turns off
    free = AcceptanceGate(AcceptanceRule(0.0, judge_drafts=W, reprobe_steps=R))
    assert off_after(free, 1, K, 0) == 101


def test_decayed_counts_follow_the_latest_drafts():
    """A request that accepted everything for a long time and then nothing turns off within a few windows
    (cumulative counts would keep it on for as long as it had accepted)."""
    gate = AcceptanceGate(AcceptanceRule(0.1, judge_drafts=W, reprobe_steps=R))
    for _ in range(200):
        gate.observe(1, K, K)
    assert gate.is_on(1)
    assert off_after(gate, 1, K, 0) <= 4 * W


def steps_off(gate: AcceptanceGate, key: int) -> int:
    """Steps until allows() lets the off request draft again (a probe), the gate's clock ticking."""
    steps = 0
    while True:
        gate.tick()
        steps += 1
        if gate.allows(key):
            return steps
        assert steps < 10_000


def test_reprobe_backs_off_and_a_paying_probe_stays_on():
    gate = AcceptanceGate(AcceptanceRule(0.1, judge_drafts=W, reprobe_steps=R))
    for _ in range(3):
        gate.tick()
    off_after(gate, 1, K, 0)
    waits = []
    for _ in range(5):  # each probe fails: the wait doubles up to MAX_BACKOFF x R, ending on a multiple of R
        waits.append(steps_off(gate, 1))
        assert gate.now % R == 0
        assert gate.is_on(1) and off_after(gate, 1, K, 0) == W
    assert waits[0] == 2 * R - 3  # at least R, to the next multiple of R
    assert waits[1:] == [2 * R, 4 * R, 8 * R, MAX_BACKOFF * R]
    assert gate.num_probes == 5
    for _ in range(MAX_BACKOFF * R - 1):  # wants() says one step ahead when the probe comes
        assert not gate.wants(1)
        gate.tick()
        assert not gate.allows(1)
    assert gate.wants(1)
    gate.tick()
    assert gate.allows(1)
    assert off_after(gate, 1, K, 2) == 101  # the text repeats now: the probe pays, it stays on
    off_after(gate, 1, K, 0)  # and a later turn-off waits R again, not the backed-off wait
    assert steps_off(gate, 1) == R


def test_empty_proposals_rest_a_request_and_a_draft_resets_the_count():
    gate = AcceptanceGate(AcceptanceRule(0.1, judge_drafts=W, reprobe_steps=R))
    for _ in range(W - 1):
        gate.proposed(1, 0)
    gate.proposed(1, 2)  # a match: the count starts over
    for _ in range(W - 1):
        gate.proposed(1, 0)
    assert gate.is_on(1)
    gate.proposed(1, 0)
    assert not gate.is_on(1) and gate.num_rested == 1 and gate.num_turned_off == 0
    assert steps_off(gate, 1) == R
    for _ in range(W):  # the probe finds nothing again: backed off
        gate.proposed(1, 0)
    assert steps_off(gate, 1) == 2 * R


def test_reprobe_zero_stays_off_and_remove_forgets():
    gate = AcceptanceGate(AcceptanceRule(0.1, judge_drafts=W, reprobe_steps=0))
    off_after(gate, 1, K, 0)
    for _ in range(10_000):
        gate.tick()
        assert not gate.allows(1)
    gate.remove(1)
    assert gate.allows(1) and len(gate) == 0


def test_defaults_per_method_and_bad_rules():
    assert AcceptanceRule.for_method("ngram", None, 8, 64).token_cost == 0.1
    assert AcceptanceRule.for_method("draft_model", None, 8, 64).token_cost == 0.3
    assert AcceptanceRule.for_method("ngram", 0.02, 8, 64) == AcceptanceRule(0.02, 8, 64)
    with pytest.raises(ValueError, match="judge_drafts >= 1"):
        AcceptanceRule(0.1, judge_drafts=0)


# --------------------------------------------------------------------------- through the engine


class ScriptedProposer(Proposer):
    """Drafts from each request's plain greedy output: `right(rid, n)` decides whether the draft after n
    outputs is that output's continuation (all accepted) or a token it never emits (none accepted)."""

    num_speculative_tokens = K

    def __init__(self, plain: dict[str, list[int]], right) -> None:
        self.plain, self.right = plain, right
        self.calls: dict[str, list[int]] = {}  # per request, its output length at each proposal
        self.right_tokens: dict[str, int] = {}  # per request, the draft tokens that were its continuation

    def propose(self, reqs, max_draft_tokens=None):
        out = []
        for req, m in zip(reqs, max_draft_tokens or [K] * len(reqs), strict=True):
            rid, n = req.request_id, len(req.output_token_ids)
            self.calls.setdefault(rid, []).append(n)
            ids = self.plain[rid]
            if self.right(rid, n):
                out.append(ids[n : n + m])
                self.right_tokens[rid] = self.right_tokens.get(rid, 0) + len(out[-1])
            else:
                never = next(t for t in range(1, 10_000) if t not in ids)
                out.append([never] * m)
        return out

    def remove(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("qwen2")


def core_for(path, spec: str | None, metrics: Metrics | None = None, **kw) -> EngineCore:
    kw = dict(speculative_judge_drafts=W, speculative_reprobe_steps=R) | kw
    settings = cpu_settings(path, speculative_config=spec, **kw)
    return EngineCore(ModelRunner(settings), settings, metrics)


def verify_rows(core: EngineCore) -> dict[str, int]:
    """Per request, the verify rows it ran in (counted from the plans)."""
    seen: dict[str, int] = {}
    by_key = {}

    def record(plan):
        for seq in core.scheduler.running:
            by_key[seq.key] = seq.request_id
        for row, _ in plan.verify:
            rid = by_key[plan.keys[row]]
            seen[rid] = seen.get(rid, 0) + 1

    core.step_failpoint = record
    return seen


REQS = [
    (
        f"a{i}",
        prompt_ids(6 + i, seed=40 + i, vocab=300),
        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
    )
    for i in range(4)
]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_never_accepted_stops_drafting_always_accepted_keeps_on(path, async_scheduling):
    plain = drive(core_for(path, None, async_scheduling=async_scheduling), REQS)
    ids = {rid: v[0] for rid, v in plain.items()}
    metrics = Metrics()
    core = core_for(path, SPEC, metrics, async_scheduling=async_scheduling, speculative_reprobe_steps=0)
    right = {"a0": False, "a1": True, "a2": False, "a3": True}
    core.scheduler.proposer = proposer = ScriptedProposer(ids, lambda rid, n: right[rid])
    rows = verify_rows(core)
    assert drive(core, REQS) == plain  # exact, drafts accepted or not
    assert rows["a0"] == rows["a2"] == W  # judged after W drafts, never again (R = 0)
    assert rows["a1"] > 10 and rows["a3"] > 10  # every step drafts K, all accepted: 60 tokens in ~15 steps
    assert core.scheduler.acceptance is not None and core.scheduler.acceptance.num_turned_off == 2
    assert len(core.scheduler.acceptance) == 0  # finished requests are forgotten
    counts = core.spec_metrics.snapshot()
    assert counts["drafts"] == sum(rows.values())
    assert counts["accepted"] == proposer.right_tokens["a1"] + proposer.right_tokens["a3"]
    assert counts["draft_tokens"] == counts["accepted"] + W * K * 2


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_reprobe_turns_a_request_back_on_when_its_text_repeats(path, async_scheduling):
    """Drafts are wrong for the first 20 outputs, right after: the request turns off after W drafts, is
    probed every R steps (wrong again: backed off), and stays on once its probe's drafts are accepted."""
    plain = drive(core_for(path, None, async_scheduling=async_scheduling), REQS[:1])
    ids = {rid: v[0] for rid, v in plain.items()}
    core = core_for(path, SPEC, Metrics(), async_scheduling=async_scheduling)
    core.scheduler.proposer = proposer = ScriptedProposer(ids, lambda rid, n: n >= 20)
    rows = verify_rows(core)
    assert drive(core, REQS[:1]) == plain
    gate = core.scheduler.acceptance
    assert gate is not None and gate.num_turned_off >= 1 and gate.num_probes >= 1
    calls = proposer.calls["a0"]
    assert calls[:W] == list(range(1, W + 1))  # the prefill's token, then one token a wrong draft
    assert calls[W] > W + 1  # off: no proposals until the probe
    after = [n for n in calls if n >= 20]
    # on to the end: each draft accepted whole (K, fewer where max_tokens is near), no step without one
    assert after and all(b - a == min(K, 60 - a - 1) + 1 for a, b in zip(after, after[1:], strict=False))
    assert rows["a0"] == len(calls)
    assert core.spec_metrics.snapshot()["drafts"] == len(calls)


def test_ngram_outputs_and_counters_stay_consistent_with_the_rule(path):
    """The n-gram proposer on mixed prompts with an aggressive rule (c = 0.9): some requests turn off,
    outputs equal those without speculation, and the gate saw exactly the counters' verify rows."""
    reqs = requests(24, ignore_eos=True)
    want = drive(core_for(path, None), reqs)
    core = core_for(  # all 24 running at once: a step with requests still to admit does not speculate
        path, SPEC, Metrics(), speculative_token_cost=0.9, speculative_judge_drafts=2, max_num_seqs=24
    )
    observed = []
    gate = core.scheduler.acceptance
    assert gate is not None
    inner = gate.observe
    gate.observe = lambda key, d, a: (observed.append((d, a)), inner(key, d, a))[1]  # type: ignore[method-assign]
    assert drive(core, reqs) == want
    counts = core.spec_metrics.snapshot()
    assert counts["drafts"] == len(observed) > 0
    assert counts["draft_tokens"] == sum(d for d, _ in observed)
    assert counts["accepted"] == sum(a for _, a in observed)
    assert gate.num_turned_off > 0


def test_settings_reach_the_gate(path):
    core = core_for(
        path, SPEC, speculative_token_cost=0.02, speculative_judge_drafts=5, speculative_reprobe_steps=9
    )
    assert core.scheduler.acceptance is not None
    assert core.scheduler.acceptance.rule == AcceptanceRule(0.02, 5, 9)
    default = EngineCore(
        ModelRunner(cpu_settings(path, speculative_config=SPEC)), cpu_settings(path, speculative_config=SPEC)
    )
    assert default.scheduler.acceptance is not None and default.scheduler.acceptance.rule == AcceptanceRule(
        0.1, 8, 64
    )
    assert core_for(path, None).scheduler.acceptance is None
