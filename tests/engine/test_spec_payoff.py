"""Speculation's step-level rules (engine/spec/payoff.py, engine/sched/speculation.py): no drafts in a step
with prompt work, and whole steps turned off where speculating steps were measured to emit fewer tokens per
second than plain ones at the same batch size.

The payoff rule's own tests feed it chosen rates (no clock); the engine tests check what it is told."""

from __future__ import annotations

import json

import pytest
from graphcache.engine.sched.block_manager import BlockManager
from graphcache.engine.sched.scheduler import Scheduler
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.engine.spec.config import parse_speculative_config
from graphcache.engine.spec.payoff import StepPayoff, rows_bucket
from graphcache.engine.spec.proposer import Proposer
from helpers_model import tiny_checkpoint

from tests.engine.test_spec_engine import core_for, drive, requests


def test_rows_buckets_are_two_per_power_of_two():
    assert [rows_bucket(n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 15, 16, 100, 127, 128)] == [
        1, 1, 2, 3, 4, 4, 6, 6, 8, 8, 12, 12, 16, 96, 96, 128
    ]  # fmt: skip


def run(payoff: StepPayoff, steps: int, spec_rate: float, plain_rate: float, rows: int = 10) -> list[bool]:
    """`steps` decisions at `rows` rows, each observed at once with its mode's rate (1 s a step)."""
    decisions = []
    for _ in range(steps):
        speculated = payoff.decide(rows)
        assert payoff.would_speculate(rows) in (True, False)
        payoff.observe(rows, speculated, round((spec_rate if speculated else plain_rate) * rows), 1.0)
        decisions.append(speculated)
    return decisions


def test_a_bucket_learns_the_plain_rate_then_keeps_speculating_while_it_pays():
    payoff = StepPayoff(min_samples=4, probe_steps=4, probe_every=32)
    d = run(payoff, 200, spec_rate=3.0, plain_rate=1.0)
    assert d[:4] == [True] * 4 and d[4:8] == [False] * 4  # speculate, then a plain run to learn its rate
    assert all(d[8:36])
    plain_share = d[8:].count(False) / len(d[8:])
    assert 0 < plain_share <= 4 / 32 + 0.01  # refreshed by a plain run every probe_every steps
    assert payoff.state()[8]["speculates"]


def test_a_bucket_where_speculation_loses_turns_off_and_probes_less_and_less():
    payoff = StepPayoff(min_samples=4, probe_steps=4, probe_every=32, off_wait=16, max_wait=128)
    d = run(payoff, 600, spec_rate=0.5, plain_rate=1.0)
    assert d[:4] == [True] * 4 and d[4:8] == [False] * 4
    spec_after = [i for i, s in enumerate(d) if s and i >= 8]
    runs = [i for i in spec_after if i - 1 not in spec_after]  # each speculating probe run's first step
    gaps = [b - a for a, b in zip(runs, runs[1:], strict=False)]
    assert len(runs) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # the wait doubles
    assert gaps[-1] <= 128 + 4 + 1
    assert d[8:].count(True) / len(d[8:]) < 0.1
    assert not payoff.state()[8]["speculates"]


def test_a_bucket_within_the_tolerance_stays_on_and_an_off_one_needs_a_win():
    """Steps whose proposals found nothing cost only the overlap they gave up where the GPU bounds them:
    within the tolerance the bucket keeps speculating (text that repeats later finds it on)."""
    payoff = StepPayoff(tolerance=0.05, min_samples=4, probe_steps=4, probe_every=32)
    d = run(payoff, 100, spec_rate=0.97, plain_rate=1.0, rows=100)  # 97 tokens against 100 a step
    assert d[8:].count(True) / len(d[8:]) > 0.85 and payoff.state()[96]["speculates"]
    assert not StepPayoff(tolerance=0.0).state()  # (no bucket before a step)
    strict = StepPayoff(tolerance=0.0, min_samples=4, probe_steps=4, probe_every=32)
    run(strict, 100, spec_rate=0.97, plain_rate=1.0, rows=100)
    assert not strict.state()[96]["speculates"]  # without the tolerance the same rates turn it off
    off = StepPayoff(tolerance=0.05, min_samples=4, probe_steps=4, probe_every=32, off_wait=8, alpha=1.0)
    run(off, 40, spec_rate=0.5, plain_rate=1.0, rows=100)
    assert not off.would_speculate(100)
    run(off, 200, spec_rate=0.97, plain_rate=1.0, rows=100)  # a probe within the tolerance is no win
    assert not off.state()[96]["speculates"]
    run(off, 200, spec_rate=1.2, plain_rate=1.0, rows=100)  # a probe that wins turns it on
    assert off.state()[96]["speculates"]


def test_speculation_comes_back_when_it_pays_again_and_buckets_are_apart():
    payoff = StepPayoff(min_samples=4, probe_steps=4, probe_every=32, off_wait=16, max_wait=64)
    run(payoff, 100, spec_rate=0.5, plain_rate=1.0)  # off at 10 rows
    assert not payoff.would_speculate(10)
    assert run(payoff, 4, spec_rate=0.5, plain_rate=1.0, rows=100)[0]  # 96-127 rows: its own bucket
    d = run(payoff, 200, spec_rate=2.0, plain_rate=1.0)  # the text starts repeating: drafts pay
    assert all(d[-100:-8]) or d[-100:].count(True) > 85
    assert payoff.state()[8]["speculates"]


def test_an_idle_or_empty_step_is_not_measured():
    payoff = StepPayoff()
    payoff.observe(0, True, 0, 1.0)
    payoff.observe(4, True, 4, 0.0)
    assert payoff.state() == {}


class RepeatProposer(Proposer):
    """Drafts the row's last token three times (a looping model accepts some)."""

    def propose(self, requests, max_draft_tokens=None):
        limits = max_draft_tokens or [3] * len(requests)
        return [
            [r.output_token_ids[-1]] * m if r.output_token_ids else []
            for r, m in zip(requests, limits, strict=True)
        ]

    def remove(self, request_id: str) -> None:
        pass


def test_no_drafts_in_a_step_with_prompt_work():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    sched.spec = parse_speculative_config(json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    sched.proposer = RepeatProposer()
    for i in range(3):
        sched.add(Sequence(f"s{i}", [5, 6, 7, 8 + i], SamplingParams(max_tokens=20, temperature=0.0)))
    first = sched.schedule()  # two prompts (max_num_seqs 2), the third waits
    assert not first.speculated and len(first.seqs) == 2
    sched.postprocess(first, [11, 12], 0.0)
    second = sched.schedule()  # decodes; the third cannot be admitted (max_num_seqs): no prompt work
    assert second.speculated and second.verify


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("qwen2")


class Recorder(StepPayoff):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, bool, int, float]] = []

    def observe(self, rows, speculated, emitted, seconds):
        self.seen.append((rows, speculated, emitted, seconds))
        super().observe(rows, speculated, emitted, seconds)


def test_the_engine_reports_decode_and_verify_steps_with_what_they_emitted(path):
    core = core_for(
        path, json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    )
    core.scheduler.payoff = recorder = Recorder()
    plans = []
    core.step_failpoint = lambda plan: plans.append(plan)
    reqs = requests(4, ignore_eos=True)
    out = drive(core, reqs)
    assert out == drive(core_for(path, None), reqs)
    assert recorder.seen and all(s > 0 for *_, s in recorder.seen)
    prompt_steps = sum(1 for p in plans if p.num_tokens > p.num_reqs + sum(n for _, n in p.verify))
    assert len(recorder.seen) == len(plans) - prompt_steps  # every step without a prompt chunk, once
    emitted = sum(e for _, _, e, _ in recorder.seen)
    assert emitted <= sum(len(tokens) for tokens, _, _ in out.values())
    assert any(spec for _, spec, _, _ in recorder.seen)
