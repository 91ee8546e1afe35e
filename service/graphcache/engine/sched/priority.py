"""The order of the scheduler's queues under its policy (vLLM's --scheduling-policy): fcfs or priority.

fcfs: the waiting queue in arrival order, a preempted sequence back at its front; a preemption evicts the
newest running sequence not yet scheduled this step.
priority: the waiting queue ordered by (priority, arrival), lower first, a preempted sequence going back to
its place in that order; running sequences are scheduled in the same order, and a preemption evicts the
unscheduled running sequence with the highest (priority, arrival): the lowest priority, latest arrival.
Admission never preempts (as vLLM's).

No torch (the scheduler's floor).
"""

from __future__ import annotations

import bisect
from collections import deque

from graphcache.choices import SchedulingPolicy
from graphcache.engine.sequence import Sequence

__all__ = ["enqueue", "preemption_victim", "rank"]


def rank(seq: Sequence) -> tuple[int, float]:
    """A sequence's place under the priority policy: lower priority value first, then earlier arrival."""
    return seq.params.priority, seq.arrival_time


def enqueue(waiting: deque[Sequence], seq: Sequence, policy: SchedulingPolicy, front: bool) -> None:
    """Into the waiting queue: fcfs at the back (new) or the front (preempted); priority at its rank."""
    if policy == "priority":
        waiting.insert(bisect.bisect_right(waiting, rank(seq), key=rank), seq)
    elif front:
        waiting.appendleft(seq)
    else:
        waiting.append(seq)


def preemption_victim(
    running: list[Sequence], scheduled_ids: set[int], policy: SchedulingPolicy
) -> Sequence | None:
    """The running sequence a preemption evicts, among those not scheduled this step (scheduled_ids:
    their id()s): fcfs the newest, priority the highest (priority, arrival)."""
    candidates = (s for s in reversed(running) if id(s) not in scheduled_ids)
    if policy == "priority":
        return max(candidates, key=rank, default=None)
    return next(candidates, None)
