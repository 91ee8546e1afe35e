"""The seam scheduler -> worker (engine/plan.py): a StepPlan is plain data, with no callable anywhere in it,
that pickles as it is (what a tensor-parallel rank receives); the scheduler's Sequence holds no sampler
state; the plans alone tell a worker everything it holds (checked against the scheduler's own state)."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
from graphcache.config import Settings
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.plan import GrammarMask, NewRequest, PromptLogits, StepPlan, StepSeq
from graphcache.engine.sequence import SamplingParams, Sequence
from test_async_scheduling import drive, workload
from test_engine import FakeRunner


def _walk(value, path="plan"):
    """Every value inside a plan, with where it sits."""
    yield path, value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _walk(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(k, f"{path}[key]")
            yield from _walk(v, f"{path}[{k!r}]")
    elif isinstance(value, list | tuple | set | frozenset):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")


def _plans() -> list[StepPlan]:
    """Plans of every shape: a real run's (admissions, chunks, steady decodes, finishes, preemption),
    and one with every optional field set."""
    settings = Settings(max_num_seqs=6, max_num_batched_tokens=24, async_scheduling="on")
    core = EngineCore(FakeRunner(settings, num_kv_blocks=14), settings)
    drive(core, workload())
    full = StepPlan(
        keys=[3, 4],
        starts=[0, 9],
        tokens=[[1, 2, 3], None],
        need_logits=[True, True],
        new=(
            NewRequest(
                3,
                "r3",
                [1, 2, 3],
                [],
                SamplingParams(logit_bias={5: 1.0}, bad_words_token_ids=[[4, 5]], seed=7, prompt_logprobs=1),
                [0],
            ),
        ),
        grown=((4, [8]),),
        finished=(1, 2),
        prompt_logits=(PromptLogits(0, 0, [2, 3], 1),),
        grammar=GrammarMask((1,), np.zeros((1, 2), np.int32)),
    )
    return [*core.runner.plans, full, StepPlan.standalone([StepSeq([1, 2], 0, [0])])]


def test_a_plan_holds_no_callable_and_pickles_as_it_is():
    plans = _plans()
    shapes = {(p.tokens is None, bool(p.new), bool(p.grown), bool(p.finished)) for p in plans}
    assert len(shapes) >= 5, shapes  # steady decodes, admissions, grown tables and finishes all seen
    for plan in plans:
        for where, value in _walk(plan):
            assert not callable(value) or isinstance(value, type), f"{where} is callable: {value!r}"
        again = pickle.loads(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
        if plan.grammar is None:
            assert again == plan
        else:
            assert np.array_equal(again.grammar.bits, plan.grammar.bits)
            assert dataclasses.replace(again, grammar=None) == dataclasses.replace(plan, grammar=None)


def test_a_plan_is_frozen():
    plan = StepPlan(keys=[1], starts=[0])
    try:
        plan.keys = [2]  # type: ignore[misc]
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("StepPlan must be frozen")


def test_a_sequence_holds_no_sampler_state():
    names = {f.name for f in dataclasses.fields(Sequence)}
    assert not names & {"plain_greedy", "steady_controls", "draw_row", "controls"}, names


def test_the_worker_table_follows_the_scheduler_from_the_plans_alone():
    """After every step the fake worker's table holds exactly the scheduler's running requests, with
    their block tables (built from NewRequest tables and grown blocks only)."""
    settings = Settings(max_num_seqs=6, max_num_batched_tokens=24, async_scheduling="on")
    core = EngineCore(FakeRunner(settings, num_kv_blocks=14), settings)
    for rid, prompt, params in workload():
        core.add_request(Sequence(rid, list(prompt), SamplingParams(**vars(params))))
    table = core.runner.table
    while core.has_work():
        core.step()
        scheduled = core._pending.plan.seqs if core._pending is not None else []
        for seq in scheduled:
            if not seq.is_finished and seq.block_table:
                assert table.get(seq.key).block_table == seq.block_table, seq
    assert core.scheduler.num_preemptions > 0
