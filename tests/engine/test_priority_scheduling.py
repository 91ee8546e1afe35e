"""The priority policy (vLLM's --scheduling-policy priority) on the scheduler, under a tiny KV cache: the
waiting queue admits by (priority, arrival), lower first; a preemption evicts the lowest-priority (highest
value), latest running request; fcfs ignores priorities altogether (its order is unchanged).

The plans are checked by test_scheduler.py's FakeKV (every fed slice read back through the block tables).
"""

from __future__ import annotations

import pytest
from graphcache.engine.sched.block_manager import BlockManager
from graphcache.engine.sched.scheduler import Scheduler
from graphcache.engine.sequence import SamplingParams, Sequence
from test_scheduler import FakeKV, run_all, step


def make(policy: str, num_blocks: int = 64, max_num_seqs: int = 8, max_tokens_step: int = 64) -> Scheduler:
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    return Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens_step,
        max_model_len=256,
        policy=policy,  # type: ignore[arg-type]
    )


def seq(rid: str, priority: int, n_prompt: int = 4, max_tokens: int = 4, arrival: float = 0.0) -> Sequence:
    s = Sequence(
        rid,
        [(5 * i + len(rid)) % 40 + 1 for i in range(n_prompt)],
        SamplingParams(max_tokens=max_tokens, priority=priority),
    )
    s.arrival_time = arrival
    return s


def admission_order(plans) -> list[str]:
    return [new_request.request_id for p in plans for new_request in p.plan.new]


def test_priority_admits_lower_values_first_ties_by_arrival():
    sched = make("priority", max_num_seqs=1)
    seqs = [
        seq("late-urgent", -5, arrival=3.0),
        seq("normal-1", 0, arrival=1.0),
        seq("background", 10, arrival=0.0),
        seq("normal-0", 0, arrival=0.5),
        seq("urgent", -5, arrival=2.0),
    ]
    plans = run_all(sched, seqs)
    assert admission_order(plans) == ["urgent", "late-urgent", "normal-0", "normal-1", "background"]
    assert all(s.num_output_tokens == 4 for s in seqs)


def test_fcfs_ignores_priority():
    sched = make("fcfs", max_num_seqs=1)
    seqs = [seq("a", 10, arrival=0.0), seq("b", -10, arrival=1.0), seq("c", 0, arrival=2.0)]
    assert admission_order(run_all(sched, seqs)) == ["a", "b", "c"]


def test_a_higher_priority_arrival_waits_for_no_one_behind_it():
    """One running slot: the urgent request that arrives while others wait is admitted next."""
    sched = make("priority", max_num_seqs=1)
    kv = FakeKV(sched)
    first, waiting = seq("first", 0, arrival=0.0), seq("waiting", 0, arrival=1.0)
    sched.add(first)
    sched.add(waiting)
    step(sched, kv)
    urgent = seq("urgent", -1, arrival=2.0)
    sched.add(urgent)
    assert [s.request_id for s in sched.waiting] == ["urgent", "waiting"]
    plans = []
    while sched.has_work():
        plans.append(step(sched, kv))
    assert admission_order(plans) == ["urgent", "waiting"]


def _preemptions(policy: str, priorities: dict[str, int]) -> tuple[list[str], list[Sequence]]:
    # 6 blocks of 4 = 24 slots; three requests growing to 12 tokens each cannot all fit.
    sched = make(policy, num_blocks=6)
    seqs = [seq(rid, p, n_prompt=4, max_tokens=8, arrival=i) for i, (rid, p) in enumerate(priorities.items())]
    kv = FakeKV(sched)
    for s in seqs:
        sched.add(s)
    order = []
    for _ in range(500):
        if not sched.has_work():
            break
        plan = step(sched, kv)
        order += [p.request_id for p in plan.preempted]
    assert not sched.has_work()
    assert sched.block_manager.num_free == sched.block_manager.num_usable
    assert all(s.num_output_tokens == 8 for s in seqs)
    return order, seqs


def test_priority_preempts_the_lowest_priority_first():
    order, _ = _preemptions("priority", {"background": 5, "urgent": -1, "normal": 0})
    assert order and order[0] == "background", order
    assert "urgent" not in order


def test_priority_preempts_the_latest_among_equal_priorities():
    order, _ = _preemptions("priority", {"a": 0, "b": 0, "c": 0})
    assert order and order[0] == "c", order


def test_fcfs_preempts_the_newest_whatever_its_priority():
    order, _ = _preemptions("fcfs", {"background": 5, "urgent": -1, "normal": 0})
    assert order and order[0] == "normal", order


def test_a_preempted_request_goes_back_to_its_rank():
    sched = make("priority", num_blocks=6, max_num_seqs=2)  # the later two wait while these run
    kv = FakeKV(sched)
    # 4 + 10 tokens = 4 blocks each: the two cannot both finish in 6 blocks
    running = [seq("keep", 0, max_tokens=10, arrival=0.0), seq("low", 3, max_tokens=10, arrival=1.0)]
    for s in running:
        sched.add(s)
    step(sched, kv)
    later = [seq("mid", 1, arrival=2.0), seq("lowest", 9, arrival=3.0)]
    for s in later:
        sched.add(s)
    for _ in range(50):
        plan = step(sched, kv)
        if plan.preempted:
            break
    assert [s.request_id for s in plan.preempted] == ["low"]
    assert [s.request_id for s in sched.waiting] == ["mid", "low", "lowest"]
    while sched.has_work():
        step(sched, kv)
    assert all(s.num_output_tokens == s.params.max_tokens for s in running + later)


# --------------------------------------------------------------------------- through the engine


async def _finish_order(policy: str) -> list[str]:
    """Which of three queued requests (priorities 5, 0, -5, in that arrival order) finish first, behind a
    slow request that holds the engine's only running slot."""
    import asyncio

    from test_engine import collect, fake_factory, start_engine

    e = start_engine(fake_factory(step_delay=0.01), max_num_seqs=1, scheduling_policy=policy)
    done: list[str] = []

    async def one(rid: str, priority: int) -> None:
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, priority=priority)
        await collect(e, rid, [4, 5, 6], params)
        done.append(rid)

    try:
        blocker = e.generate(
            "blocker", [1, 2, 3], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        )
        first = await blocker.__anext__()  # running: it holds the only slot
        assert not first.finished
        waiting = [
            asyncio.ensure_future(one(rid, p))
            for rid, p in (("background", 5), ("normal", 0), ("urgent", -5))
        ]
        async for _ in blocker:
            pass
        await asyncio.wait_for(asyncio.gather(*waiting), 30)
    finally:
        e.shutdown()
    return done


@pytest.mark.asyncio
async def test_the_engine_admits_waiting_requests_by_priority():
    assert await _finish_order("priority") == ["urgent", "normal", "background"]


@pytest.mark.asyncio
async def test_the_engine_under_fcfs_keeps_arrival_order():
    assert await _finish_order("fcfs") == ["background", "normal", "urgent"]
