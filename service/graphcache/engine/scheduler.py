"""Continuous batching: which sequences run in the next step, and how many tokens each feeds.

Each step has a token budget (`max_num_batched_tokens`) and a row budget (`max_num_seqs`):
1. Running sequences first, decodes before unfinished prefill chunks, so decode latency never
   waits behind someone's long prompt. Each takes min(tokens it still needs, budget left).
2. Then waiting sequences (FCFS) are admitted into the leftover budget. A prompt longer than the
   budget is prefilled in chunks over several steps (chunked prefill); the result is a mixed
   batch of decodes and prefill chunks, which the runner supports.
When a running sequence needs a block and none is free, the newest running sequence not yet
scheduled this step is preempted by recompute: its blocks are freed, its outputs kept, and it goes
to the front of the waiting queue to re-prefill prompt + outputs later (vLLM's RECOMPUTE mode).
No admissions happen in a step that preempted (that would just thrash).

Deadlock guard: a sequence that cannot fit even in an otherwise empty cache is finished with an
error instead of being preempted and re-admitted forever.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from graphcache.engine.batch import PLACEHOLDER_TOKEN, StepBatch, StepSeq
from graphcache.engine.block_manager import BlockManager
from graphcache.engine.sequence import Sequence, SequenceStatus
from graphcache.engine.stopping import check_stop


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int        # tokens fed this step
    need_logits: bool      # the slice reaches the end of the sequence: sample after this step
    start: int = 0         # position of the first fed token (num_computed_tokens when scheduled)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)   # finished with error: can never fit

    @property
    def empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def to_batch(self) -> StepBatch:
        seqs = []
        for s in self.scheduled:
            ids = s.seq.token_slice(s.start, s.start + s.num_tokens)
            # A decode whose input is the token still being sampled by the step in flight (async
            # scheduling): a placeholder; the runner takes it from that step's device output.
            if len(ids) < s.num_tokens:
                ids = ids + [PLACEHOLDER_TOKEN] * (s.num_tokens - len(ids))
            # The block table is passed, not copied: the runner reads it during execute(), before
            # the engine changes any table again.
            seqs.append(StepSeq(token_ids=ids, start_pos=s.start, block_table=s.seq.block_table,
                                need_logits=s.need_logits))
        return StepBatch(seqs=seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: frozenset[int] = frozenset()) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token per sequence)")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # admission order: the last one is the newest
        self.num_preemptions = 0

    # --- queue management -----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Finish `seq` wherever it is and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.finish(reason, error)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0      # recompute: re-prefill prompt + outputs on resume
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _never_fits(self, seq: Sequence, num_tokens: int) -> bool:
        return self.block_manager.blocks_for(num_tokens) > self.block_manager.num_usable

    def _fail_too_big(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> None:
        bm = self.block_manager
        self.finish(seq, "error", f"request needs {bm.blocks_for(num_tokens)} KV blocks for {num_tokens} tokens "
                    f"but the cache has {bm.num_usable}; raise num_kv_blocks or lower max_model_len")
        out.failed.append(seq)

    # --- the step plan --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        # 1. Running: decodes first, then in-progress prefill chunks; each in admission order. A token
        # still being sampled (num_inflight, async scheduling) counts as known: its sequence decodes it.
        decodes, prefills = [], []
        for s in self.running:
            if s.num_inflight and self._finishes_by_length(s):
                continue   # the token in flight ends it: scheduling it again would compute past its end
            (decodes if s.num_computed_tokens == s.num_tokens + s.num_inflight - 1 else prefills).append(s)
        bm = self.block_manager
        capacity_per_block = bm.block_size
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:   # preempted earlier in this loop
                continue
            total = seq.num_tokens + seq.num_inflight
            n = min(total - seq.num_computed_tokens, budget)
            target = seq.num_computed_tokens + n
            if target > len(seq.block_table) * capacity_per_block:   # most decodes skip this: room left
                while not bm.can_allocate(seq, target):
                    victim = next((s for s in reversed(self.running) if id(s) not in scheduled_ids), None)
                    if victim is seq and len(self.running) == 1:
                        # Alone in the cache and still no room: it never fits. Fail, don't spin.
                        self._fail_too_big(seq, target, out)
                        break
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                bm.allocate(seq, target)
            self._commit(out, seq, n, target, need_logits=target == total)
            scheduled_ids.add(id(seq))
            budget -= n

        # 2. Waiting: admit FCFS into what is left, unless this step had to preempt.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_inflight:
                break  # preempted with a token in flight: it re-prefills once that token has landed
            if self._never_fits(seq, seq.num_tokens):
                self._fail_too_big(seq, seq.num_tokens, out)
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            target = seq.num_computed_tokens + n
            if not self.block_manager.can_allocate(seq, target):
                break  # FCFS: nobody jumps the queue; blocks come back as others finish
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            self.block_manager.allocate(seq, target)
            self._commit(out, seq, n, target, need_logits=target == seq.num_tokens)
            scheduled_ids.add(id(seq))
            budget -= n
        return out

    @staticmethod
    def _commit(out: SchedulerOutput, seq: Sequence, n: int, target: int, need_logits: bool) -> None:
        """Schedule n tokens of seq: their K/V count as computed from now on (the step that writes
        them runs before any later step reads them), and a token to sample is now in flight."""
        out.scheduled.append(ScheduledSeq(seq, n, need_logits, start=seq.num_computed_tokens))
        seq.num_computed_tokens = target
        if need_logits:
            seq.num_inflight += 1

    def _finishes_by_length(self, seq: Sequence) -> bool:
        limit = seq.params.max_tokens
        return ((limit is not None and seq.num_output_tokens + seq.num_inflight >= limit)
                or seq.num_tokens + seq.num_inflight >= self.max_model_len)

    def postprocess(self, out: SchedulerOutput, tokens: list[int | None], now: float) -> list[Sequence]:
        """The step ran. Append the token sampled for each need_logits sequence (`tokens` in that
        order; None: its sampling failed, it ends with an error), check the stop rules, finish and
        free. Returns the sequences that got a token or finished, in batch order: the ones with
        something to stream. A sequence that finished meanwhile (abort, or a stop found in the step
        before, with async scheduling) drops its token: nothing is emitted past a finish."""
        sampled = [s.seq for s in out.scheduled if s.need_logits]
        assert len(tokens) == len(sampled), (len(tokens), len(sampled))
        changed = []
        for seq, token in zip(sampled, tokens, strict=True):
            seq.num_inflight -= 1
            if seq.is_finished:
                continue
            changed.append(seq)
            if token is None:
                self.finish(seq, "error", "sampling the next token for this request failed on the server; "
                                          "retry the request, or with other sampling parameters")
                continue
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            reason = check_stop(seq, token, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len)
            if reason is not None:
                self.finish(seq, reason)
        return changed
