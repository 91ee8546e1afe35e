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

Priority policy (vLLM's --scheduling-policy priority): the queues' order and the preemption victim
follow (priority, arrival) instead of arrival alone (priority.py).

Deadlock guard: a sequence that cannot fit even in an otherwise empty cache is finished with an
error instead of being preempted and re-admitted forever.

Prefix caching (block_manager.py; on when the block manager has it on):
- Admission looks up the longest cached prefix of full blocks of all_token_ids (a preempted
  sequence's outputs included: it may find its own blocks again), takes those blocks and starts
  computing after them. At least one token is always computed, so the step has logits to sample:
  the match stops before the block holding the last token, which is recomputed into a private
  block (a shared block is never written). The KV budget check counts only the blocks that leave
  the free pool. A request with prompt_logprobs skips the lookup: it needs logits at every position.
- Full blocks are registered when their tokens are committed (see _commit), so other sequences can
  find them from the next step on.
- In-flight sharing: a waiting sequence whose next full block is being computed right now (it is
  registered this step) or will be computed by a running sequence's prefill (that sequence's next
  full block has the same key) waits, and FCFS keeps everyone behind it waiting too. It is admitted
  once the block is cached, and takes it then. So n identical prompts submitted together compute
  their shared full blocks once, and each computes only its last partial block.

Speculative decoding (--speculative-config) is the base class's (speculation.py): drafts enter the
budget loop as longer decode rows, and postprocess hands verify rows' runs back to it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from graphcache.choices import SchedulingPolicy
from graphcache.engine.plan import GrammarMask, NewRequest, PromptLogits, StepPlan
from graphcache.engine.sched.block_manager import BlockManager, PrefixMatch
from graphcache.engine.sched.lora_gate import LoraGate
from graphcache.engine.sched.output import SchedulerOutput
from graphcache.engine.sched.priority import enqueue, preemption_victim, rank
from graphcache.engine.sched.speculation import SpeculativeScheduling
from graphcache.engine.sequence import Sequence, SequenceStatus
from graphcache.engine.stopping import (
    check_stop,
    grammar_accepts,
    grammar_done,
    grammar_failure,
    grammar_failure_code,
)


class Scheduler(SpeculativeScheduling):
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        policy: SchedulingPolicy = "fcfs",
    ) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token per sequence)")
        super().__init__()  # speculation's state: none until EngineCore configures it
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.policy = policy
        self.waiting: deque[Sequence] = deque()  # fcfs: arrival order; priority: rank order
        self.running: list[Sequence] = []  # admission order: the last one is the newest
        self.num_preemptions = 0
        self.num_recomputed_tokens = (
            0  # tokens computed again after preemption (vllm:prompt_tokens_recomputed)
        )
        # Keys of the requests the worker may drop (finished or preempted) since the last plan.
        self.dropped: list[int] = []
        # Unfinished requests with a grammar, or asking for prompt logprobs: a step without any looks at
        # no row for them.
        self._grammar_seqs: set[Sequence] = set()
        self._prompt_logprob_seqs: set[Sequence] = set()
        self._pooling_seqs: set[Sequence] = set()  # unfinished embedding requests (engine/pooling.py)
        # The grammar rows' masks (EngineCore sets it to StructuredOutput.masks once it has a grammar).
        self.grammar_masks: Callable[[list[Sequence]], GrammarMask | None] | None = None
        # --enable-lora (EngineCore sets it): at most this many distinct adapters among the running requests
        self.max_loras: int | None = None

    # --- queue management -----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        enqueue(self.waiting, seq, self.policy, front=False)
        if seq.grammar is not None:
            self._grammar_seqs.add(seq)
        if seq.params.prompt_logprobs is not None:
            self._prompt_logprob_seqs.add(seq)
        if seq.params.pooling is not None:
            self._pooling_seqs.add(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(
        self, seq: Sequence, reason: str, error: str | None = None, error_code: str | None = None
    ) -> None:
        """Finish `seq` wherever it is and free its blocks at once. An error (a failed step among
        them) drops the prefix-cache entries of the blocks it computed: their step may not have run."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq, keep_cached=reason != "error")
        seq.grammar = None  # the matcher's memory goes with the request
        self._grammar_seqs.discard(seq)
        self._prompt_logprob_seqs.discard(seq)
        self._pooling_seqs.discard(seq)
        self._release_drafts(seq, finished=True)
        seq.finish(reason, error, error_code)
        self.dropped.append(seq.key)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_freed_computed = seq.num_computed_tokens
        seq.num_computed_tokens = 0  # recompute: re-prefill prompt + outputs on resume
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        enqueue(self.waiting, seq, self.policy, front=True)
        out.preempted.append(seq)
        self.dropped.append(seq.key)  # the worker drops it; it comes back as a NewRequest
        self._release_drafts(seq, finished=False)

    def _never_fits(self, seq: Sequence, num_tokens: int) -> bool:
        return self.block_manager.blocks_for(num_tokens) > self.block_manager.num_usable

    def _fail_too_big(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> None:
        bm = self.block_manager
        self.finish(
            seq,
            "error",
            f"request needs {bm.blocks_for(num_tokens)} KV blocks for {num_tokens} tokens "
            f"but the cache has {bm.num_usable}; raise num_kv_blocks or lower max_model_len",
        )
        out.failed.append(seq)

    # --- the step plan --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.block_manager.begin_step()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        # 1. Running: decodes first, then in-progress prefill chunks; each in admission order. A token
        # still being sampled (num_inflight, async scheduling) counts as known: its sequence decodes it.
        # This loop and the next run for every running sequence every step (up to max_num_seqs rows):
        # they read each sequence's lengths once and inline the checks, since the
        # host's time per step grows with these rows.
        decodes: list[tuple[Sequence, int]] = []  # (sequence, tokens known incl. in flight)
        prefills: list[tuple[Sequence, int]] = []
        max_len = self.max_model_len
        for s in self.running:
            inflight, num_out = s.num_inflight, len(s.output_token_ids)
            total = len(s.prompt_token_ids) + num_out + inflight
            if inflight:  # the token in flight ends it: scheduling it again would compute past its end
                limit = s.params.max_tokens
                if (limit is not None and num_out + inflight >= limit) or total >= max_len:
                    continue
            (decodes if s.num_computed_tokens == total - 1 else prefills).append((s, total))
        bm = self.block_manager
        capacity_per_block = bm.block_size
        drafts = None
        if self.proposer is not None:
            prompt_work = bool(prefills) or (bool(self.waiting) and len(self.running) < self.max_num_seqs)
            out.speculated = self._speculating_step(len(decodes), prompt_work)
            drafts = self._propose(decodes) if out.speculated else None
        rows = decodes + prefills
        if self.policy == "priority":  # the highest priorities get the budget and the blocks first
            rows.sort(key=lambda row: rank(row[0]))
        for seq, total in rows:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            draft = self._fit_draft(seq, drafts.get(id(seq)), budget) if drafts else None
            if draft:  # a verify row: [last token, drafts]
                total += len(draft)
            n = min(total - seq.num_computed_tokens, budget)
            target = seq.num_computed_tokens + n
            if target > len(seq.block_table) * capacity_per_block:  # most decodes skip this: room left
                while not bm.can_allocate(seq, target):
                    victim = preemption_victim(self.running, scheduled_ids, self.policy)
                    assert victim is not None  # seq itself is running and not scheduled yet
                    if victim is seq and len(self.running) == 1:
                        # Alone in the cache and still no room: it never fits. Fail, don't spin.
                        self._fail_too_big(seq, target, out)
                        break
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                have = len(seq.block_table)
                bm.allocate(seq, target)
                out.grown.append((seq.key, seq.block_table[have:]))
            if draft:
                out.verify.append((len(out.seqs), len(draft)))
            self._commit(out, seq, n, target, need_logits=target == total, draft=draft)
            scheduled_ids.add(id(seq))
            budget -= n

        # 2. Waiting: admit in queue order (fcfs or priority) into what is left, unless this step had to preempt.
        promised: set | None = None  # next full-block keys of running sequences (built on first need)
        # --max-loras: requests whose adapter gets no GPU slot wait, in order, at the front (lora_gate.py)
        lora = LoraGate(self.running, self.max_loras) if self.max_loras is not None else None
        lora_waits: list[Sequence] = []
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if lora is not None and not lora.admits(seq):
                lora_waits.append(self.waiting.popleft())
                continue
            if seq.num_inflight:
                break  # preempted with a token in flight: it re-prefills once that token has landed
            if self._never_fits(seq, seq.num_tokens):
                self._fail_too_big(seq, seq.num_tokens, out)
                continue
            match = self._match_prefix(seq)
            if match.next_key is not None:
                if promised is None:
                    promised = {k for r in self.running if (k := bm.next_key(r)) is not None}
                if match.stopped_on_fresh or match.next_key in promised:
                    break  # in-flight sharing: its next block is being computed; take it from the cache later
            num_cached = len(match.blocks) * bm.block_size  # always < seq.num_tokens
            n = min(seq.num_tokens - num_cached, budget)
            target = num_cached + n
            if not bm.can_admit(match.blocks, target):
                break  # nobody jumps the queue (its order); blocks come back as others finish
            self.waiting.popleft()
            if lora is not None:
                lora.admitted(seq)
            seq.status = SequenceStatus.RUNNING
            first_admission = seq.first_scheduled_time is None
            if first_admission:
                seq.first_scheduled_time = time.monotonic()
                seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
            elif seq.num_freed_computed:  # back from preemption: what the prefix cache lost is recomputed
                self.num_recomputed_tokens += max(0, seq.num_freed_computed - num_cached)
                seq.num_freed_computed = 0
            self.running.append(seq)
            if self._uses_prefix_cache(seq):
                bm.record_lookup(seq.num_tokens, num_cached)
            bm.take_cached(seq, match.blocks)
            seq.num_computed_tokens = num_cached
            bm.allocate(seq, target)
            out.new.append(
                NewRequest(
                    seq.key,
                    seq.request_id,
                    seq.prompt_token_ids,
                    list(seq.output_token_ids),
                    seq.params,
                    list(seq.block_table),
                )
            )
            self._commit(out, seq, n, target, need_logits=target == seq.num_tokens)
            scheduled_ids.add(id(seq))
            budget -= n
            if promised is not None and (k := bm.next_key(seq)) is not None:
                promised.add(k)
        if lora_waits:
            self.waiting.extendleft(reversed(lora_waits))
        if out.seqs:
            out.plan = self._plan(out)
        return out

    def _plan(self, out: SchedulerOutput) -> StepPlan:
        """The step as data for the worker; takes the keys dropped since the last plan."""
        finished, self.dropped = tuple(self.dropped), []
        trimmed = self._take_trimmed(finished)
        prompt_logits: tuple[PromptLogits, ...] = ()
        if self._prompt_logprob_seqs and out.tokens is not None:
            prompt_logits = self._prompt_logits(out, out.tokens)
        pooling: tuple[int, ...] = ()
        if self._pooling_seqs:
            pooling = tuple(row for row, seq in enumerate(out.seqs) if seq.params.pooling is not None)
        grammar = None
        if self._grammar_seqs and self.grammar_masks is not None:
            grammar = self.grammar_masks(out.sampled)
        return StepPlan(
            keys=[seq.key for seq in out.seqs],
            starts=out.starts,
            tokens=out.tokens,
            need_logits=out.need_logits,
            new=tuple(out.new),
            grown=tuple(out.grown),
            finished=finished,
            prompt_logits=prompt_logits,
            grammar=grammar,
            verify=tuple(out.verify),
            trimmed=trimmed,
            pooling=pooling,
        )

    def _prompt_logits(
        self, out: SchedulerOutput, tokens: list[list[int] | None]
    ) -> tuple[PromptLogits, ...]:
        """The rows whose chunk covers prompt positions with no prompt logprob yet (entry i comes from
        position i - 1; entries already recorded, e.g. before a preemption's recompute, are not asked again)."""
        spans = []
        for row, seq in enumerate(out.seqs):
            k, fed = seq.params.prompt_logprobs, tokens[row]
            if k is None or fed is None:
                continue
            start = out.starts[row]
            lo = max(start, len(seq.prompt_logprobs) - 1, 0)  # first position still needed
            hi = min(start + len(fed), seq.num_prompt_tokens - 1)  # positions predicting prompt tokens
            if lo < hi:
                spans.append(PromptLogits(row, lo - start, seq.prompt_token_ids[lo + 1 : hi + 1], k))
        return tuple(spans)

    def _uses_prefix_cache(self, seq: Sequence) -> bool:
        # prompt_logprobs needs logits at every prompt position, mean and cls pooling the hidden state of
        # every position: nothing may be skipped. Last-token pooling always computes its last token.
        p = seq.params
        return (
            self.block_manager.enable_prefix_caching
            and p.prompt_logprobs is None
            and (p.pooling is None or not p.pooling.every_token)
        )

    def _match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The cached full blocks a waiting sequence may take: at most up to the block before the
        one holding its last token, which it must compute itself to get logits.

        Why the last (partial) block is recomputed instead of shared copy-on-write: the sequences
        that share a prompt would all append into that block, so each needs its own copy before
        its first write; the runner has no device block-copy kernel, and the copy would save fewer
        than block_size tokens of a batched prefill step, which cost next to nothing."""
        if not self._uses_prefix_cache(seq):
            return PrefixMatch()
        return self.block_manager.match_prefix(
            seq, max_blocks=(seq.num_tokens - 1) // self.block_manager.block_size
        )

    def _commit(
        self,
        out: SchedulerOutput,
        seq: Sequence,
        n: int,
        target: int,
        need_logits: bool,
        draft: list[int] | None = None,
    ) -> None:
        """Schedule n tokens of seq: their K/V count as computed from now on, and a token to sample
        is now in flight.

        The full blocks these tokens complete are registered in the prefix cache here, before the
        step that writes them has run. That is safe: a sequence admitted later in this same
        schedule() never matches them (match_prefix skips blocks registered this step), so the
        first reader is a later step, and steps run in order (one stream on the device, and with
        async scheduling step n+1 is launched after step n on that stream), so the write comes
        first. If the step fails instead, its requests finish with an error and their computed
        blocks are unregistered (finish -> free(keep_cached=False)) before anything reads them.
        (A step that fails only when its tokens are fetched, after the next one was launched, is a
        device fault: the engine stops serving.)

        draft: a verify row's drafts, fed after its last token (n counts them). Their K/V counts as
        computed until the step is verified (postprocess rolls back); the prefix cache never registers
        them, since commit() registers only blocks of tokens known on the host, and drafts are not."""
        start = seq.num_computed_tokens
        seqs = out.seqs
        seqs.append(seq)
        out.starts.append(start)
        tokens = out.tokens
        if n == 1 and seq.num_inflight:  # fed the token the step in flight samples for it
            if tokens is not None:
                tokens.append(None)
        else:
            if tokens is None:
                tokens = out.tokens = [None] * (len(seqs) - 1)
            if draft:
                tokens.append(seq.token_slice(start, start + n - len(draft)) + draft)
            else:
                tokens.append(seq.token_slice(start, start + n))
        if out.need_logits is not None:
            out.need_logits.append(need_logits)
        elif not need_logits:
            out.need_logits = [True] * (len(seqs) - 1) + [False]
        out.num_tokens += n
        seq.num_computed_tokens = target
        self.block_manager.commit(seq, target)
        if need_logits:
            seq.num_inflight += 1

    def postprocess(
        self, out: SchedulerOutput, tokens: list[int | list[int] | None], now: float
    ) -> list[Sequence]:
        """The step ran. Append the token sampled for each need_logits sequence (`tokens` in that
        order; None: its sampling failed, it ends with an error), check the stop rules, finish and
        free. Returns the sequences that got a token or finished, in batch order: the ones with
        something to stream. A sequence that finished meanwhile (abort, or a stop found in the step
        before, with async scheduling) drops its token: nothing is emitted past a finish.

        A verify row's entry is a list: its accepted drafts and the token after them. Its K/V is first
        rolled back to the tokens whose K/V is valid (its last token and the accepted drafts: the
        rejected drafts' slots are garbage), then each token is appended through the stop checks like
        one step each (a stop inside the run cuts it there), and blocks past the sequence go back."""
        sampled = out.sampled
        assert len(tokens) == len(sampled), (len(tokens), len(sampled))
        changed = []
        eos, max_len, finished = self.eos_token_ids, self.max_model_len, SequenceStatus.FINISHED
        drafted = self._drafted(out.verify, out.seqs)
        for seq, token in zip(sampled, tokens, strict=True):
            seq.num_inflight -= 1
            if seq.status is finished:
                continue
            changed.append(seq)
            if isinstance(token, list):  # a verify row's run (speculation.py)
                self._observe_run(drafted, seq, token)
                self._append_verified(seq, token, now)
                continue
            if token is None:
                self.finish(
                    seq,
                    "error",
                    "sampling the next token for this request failed on the server; "
                    "retry the request, or with other sampling parameters",
                )
                continue
            if seq.params.pooling is not None:  # prefill only: its step's pooled vector is its answer
                seq.first_token_time = seq.last_token_time = now
                self.finish(seq, "stop")
                continue
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            grammar = seq.grammar  # None for most: the grammar calls are skipped inline (a per-row loop)
            if grammar is not None and not grammar_accepts(seq, token):
                self.finish(seq, "error", grammar_failure(seq), grammar_failure_code(seq))
                continue
            reason = check_stop(seq, token, eos_token_ids=eos, max_model_len=max_len)
            if reason is None and grammar is not None and grammar_done(seq):
                reason = "stop"  # structured output complete: only EOS could follow
            if reason is not None:
                self.finish(seq, reason)
        return changed
