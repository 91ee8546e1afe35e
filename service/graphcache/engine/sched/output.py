"""What one Scheduler.schedule() returns: the step's rows as the scheduler sees them (SchedulerOutput), with
the plan the worker gets; ScheduledSeq, one row as a record (tests, traces).

No torch (the scheduler's floor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from graphcache.engine.plan import NewRequest, StepPlan
from graphcache.engine.sequence import Sequence

__all__ = ["ScheduledSeq", "SchedulerOutput"]


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step, as the scheduler picked it (SchedulerOutput.scheduled)."""

    seq: Sequence
    num_tokens: int  # tokens fed this step
    need_logits: bool  # the slice reaches the end of the sequence: sample after this step
    start: int = 0  # position of the first fed token (num_computed_tokens when scheduled)


@dataclass
class SchedulerOutput:
    """One schedule(): the step's rows as the scheduler sees them (row i is seqs[i], columns as in
    StepPlan), what happened to the queues, and `plan`, the same step as plain data for the worker."""

    seqs: list[Sequence] = field(default_factory=list)  # [R] each row's sequence
    starts: list[int] = field(default_factory=list)  # [R] its num_computed_tokens when scheduled
    # [R] the ids each row feeds (None: the token in flight); None until a row feeds known ids (StepPlan's)
    tokens: list[list[int] | None] | None = None
    need_logits: list[bool] | None = None  # [R]; None until a row does not sample
    num_tokens: int = 0  # tokens fed
    new: list[NewRequest] = field(default_factory=list)  # the rows admitted this step
    grown: list[tuple[int, list[int]]] = field(default_factory=list)  # (key, blocks appended) of running rows
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # finished with error: can never fit
    verify: list[tuple[int, int]] = field(default_factory=list)  # (row, drafts) of the speculating rows
    speculated: bool = False  # the step proposed drafts (engine/spec/payoff.py measures such steps apart)
    plan: StepPlan | None = None  # set by schedule() when a step runs

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def sampled(self) -> list[Sequence]:
        """The rows that sample, in row order (the order of the step's sampled ids)."""
        if self.need_logits is None:
            return self.seqs
        return [s for s, wanted in zip(self.seqs, self.need_logits, strict=True) if wanted]

    @cached_property
    def scheduled(self) -> list[ScheduledSeq]:
        """The rows as ScheduledSeq records (tests, traces: built on first use, after schedule())."""
        need, tokens = self.need_logits, self.tokens
        return [
            ScheduledSeq(
                seq,
                1 if tokens is None or tokens[i] is None else len(tokens[i] or ()),
                True if need is None else need[i],
                start,
            )
            for i, (seq, start) in enumerate(zip(self.seqs, self.starts, strict=True))
        ]
