"""The scheduler's speculative decoding (--speculative-config): who drafts in a step, how many draft tokens
each verify row feeds, and the rollback after the verify step ran.

`SpeculativeScheduling` is the Scheduler's base class. The plain step (scheduler.py) calls it at four
points, and nothing else of speculation reaches the step:
  - schedule(): `_propose` once per step, before the budget loop, asks the proposer for drafts of the
    decodes that may speculate; `_fit_draft` cuts each row's drafts to the token budget left and the
    blocks it can get without preempting anyone (a row with no draft left decodes plainly);
  - postprocess(): `_observe_run` reports each verify row's (drafted, accepted) to the acceptance gate,
    then `_append_verified` rolls the row's K/V back to its valid positions, appends its run through the
    stop checks and gives back the blocks past the sequence (`trimmed`, sent in the next plan);
  - finish() and preemption: `_release_drafts` drops what the proposer (and, on finish, the gate) holds;
  - the plan: `_take_trimmed` hands the worker the tables cut back since the last plan.
Where the step turns speculation off: by batch size (`speculates`: disable_by_batch_size, else
spec_batch_limit, the most running requests whose verify rows still fit the verify graphs); in a step with
prompt work (a prompt chunk running or a request to admit: verify rows beside a prompt chunk leave the
verify graphs for the eager prompt-logits path, and the prompt dominates the step anyway); by the measured
payoff of speculating steps at the batch size (engine/spec/payoff.py); per request by its sampling
parameters (`may_speculate`) and by its measured acceptance (engine/spec/acceptance.py).

No torch (the scheduler's floor).
"""

from __future__ import annotations

from graphcache.engine.sched.block_manager import BlockManager
from graphcache.engine.sequence import Sequence, has_controls
from graphcache.engine.spec.acceptance import AcceptanceGate
from graphcache.engine.spec.config import SpeculativeConfig
from graphcache.engine.spec.payoff import StepPayoff
from graphcache.engine.spec.proposer import Proposer
from graphcache.engine.stopping import check_stop

__all__ = ["SpeculativeScheduling"]


class SpeculativeScheduling:
    """Speculation's state and steps, as a base of the Scheduler (whose block manager, running list and
    limits it reads, and whose finish() ends a request a verified run stops)."""

    # The Scheduler's (set in its __init__), read here.
    block_manager: BlockManager
    running: list[Sequence]
    max_model_len: int
    eos_token_ids: frozenset[int]

    def __init__(self) -> None:
        # EngineCore sets spec and proposer when --speculative-config is given: who drafts.
        self.spec: SpeculativeConfig | None = None
        self.proposer: Proposer | None = None
        # (key, table length) of the tables cut back since the last plan (rolled-back drafts' blocks).
        self.trimmed: list[tuple[int, int]] = []
        # Which requests still draft, by their measured acceptance (engine/spec/acceptance.py); None: all may.
        self.acceptance: AcceptanceGate | None = None
        # disable_by_batch_size when the config sets none (EngineCore: SpeculativeConfig.verify_batch_limit)
        self.spec_batch_limit: int | None = None
        # Whole steps by their measured payoff at the batch size (engine/spec/payoff.py); None: not judged.
        self.payoff: StepPayoff | None = None

    def finish(
        self, seq: Sequence, reason: str, error: str | None = None, error_code: str | None = None
    ) -> None:
        raise NotImplementedError  # the Scheduler's: ends `seq` wherever it is and frees its blocks

    # --- who speculates --------------------------------------------------------------------------
    def may_speculate(self, seq: Sequence) -> bool:
        """Whether `seq` may carry drafts: greedy or sampled (temperature, top-k, top-p, min-p) with no
        logits controls (penalties, logit_bias, allowed or bad words), no min_tokens, no logprobs and no
        structured output; the rest decode one token a step."""
        p = seq.params
        return (
            p.min_tokens == 0
            and p.logprobs is None
            and p.prompt_logprobs is None
            and p.structured is None
            and seq.grammar is None
            and not has_controls(p)
        )

    def drafts_next(self, seq: Sequence) -> bool:
        """Whether `seq` drafts at its next decode step: it may speculate and its acceptance keeps it on."""
        gate = self.acceptance
        return self.may_speculate(seq) and (gate is None or gate.wants(seq.key))

    def speculates(self) -> bool:
        """Whether a step now may speculate (configured, and under disable_by_batch_size or, unset, under
        spec_batch_limit)."""
        spec = self.spec
        return (
            spec is not None
            and self.proposer is not None
            and spec.speculates(len(self.running), self.spec_batch_limit)
        )

    def speculates_next(self, rows: int) -> bool:
        """Whether the next step, of about `rows` decode rows, is likely to speculate (the engine core keeps
        a step whose rows may draft from overlapping the next one only then)."""
        return self.speculates() and (self.payoff is None or self.payoff.would_speculate(rows))

    # --- schedule(): the drafts of a step --------------------------------------------------------
    def _speculating_step(self, decodes: int, prompt_work: bool) -> bool:
        """Whether this step proposes drafts for its `decodes` decode rows (the payoff rule counts the
        decision: ask once per step)."""
        if not decodes or prompt_work or not self.speculates():
            return False
        return self.payoff is None or self.payoff.decide(decodes)

    def _propose(self, decodes: list[tuple[Sequence, int]]) -> dict[int, list[int]] | None:
        """Drafts for the decodes that may speculate, by id(seq): rows whose last token is on the host
        (none in flight), at most k tokens, and never past max_tokens or max_model_len (a row emits up to
        its drafts + 1 tokens). The caller checked _speculating_step."""
        spec, proposer = self.spec, self.proposer
        if spec is None or proposer is None:
            return None
        k, max_len, gate = spec.num_speculative_tokens, self.max_model_len, self.acceptance
        if gate is not None:
            gate.tick()
        seqs, limits = [], []
        for seq, total in decodes:
            if not self.may_speculate(seq) or (gate is not None and not gate.allows(seq.key)):
                continue
            if seq.num_inflight:
                continue
            room = max_len - total - 1
            limit = seq.params.max_tokens
            if limit is not None:
                room = min(room, limit - len(seq.output_token_ids) - 1)
            if room > 0:
                seqs.append(seq)
                limits.append(min(k, room))
        if not seqs:
            return None
        proposed = proposer.propose(seqs, limits)
        if gate is not None:
            for seq, d in zip(seqs, proposed, strict=True):
                gate.proposed(seq.key, len(d))
        return {id(seq): d for seq, d in zip(seqs, proposed, strict=True) if d}

    def _fit_draft(self, seq: Sequence, draft: list[int] | None, budget: int) -> list[int] | None:
        """The drafts a verify row [last token, drafts] feeds: cut to the token budget left, and none where
        the blocks for them are not free (drafts never preempt anyone: the row decodes plainly)."""
        if not draft:
            return None
        draft = draft[: budget - 1]
        if draft and not self.block_manager.can_allocate(seq, seq.num_computed_tokens + 1 + len(draft)):
            return None
        return draft or None

    # --- postprocess(): after a verify step ------------------------------------------------------
    def _drafted(self, verify: list[tuple[int, int]], seqs: list[Sequence]) -> dict[int, int] | None:
        """{id(seq): drafts fed} of a step's verify rows, where the acceptance gate watches them."""
        if self.acceptance is None or not verify:
            return None
        return {id(seqs[row]): n for row, n in verify}

    def _observe_run(self, drafted: dict[int, int] | None, seq: Sequence, emitted: list[int]) -> None:
        """The gate's measurement of one verify row: accepted = the run less its last token."""
        if drafted is not None and self.acceptance is not None:
            self.acceptance.observe(seq.key, drafted[id(seq)], len(emitted) - 1)

    def _append_verified(self, seq: Sequence, emitted: list[int], now: float) -> None:
        """A verify row's tokens (postprocess): roll back, append through the stop checks, trim."""
        # Fed: the last token (position L - 1) and n drafts; valid K/V: L - 1 + accepted + 1 positions.
        seq.num_computed_tokens = seq.num_tokens + len(emitted) - 1
        eos, max_len = self.eos_token_ids, self.max_model_len
        for token in emitted:
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            reason = check_stop(seq, token, eos_token_ids=eos, max_model_len=max_len)
            if reason is not None:
                # Cut inside the run: what follows the stop was never emitted; the K/V kept is the valid one.
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
                self.finish(seq, reason)
                return
        bm = self.block_manager
        keep = bm.blocks_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            bm.trim(seq, keep)
            self.trimmed.append((seq.key, keep))

    # --- finish, preemption, the plan ------------------------------------------------------------
    def _release_drafts(self, seq: Sequence, finished: bool) -> None:
        """`seq` leaves the running batch: the proposer's state for it goes (a draft model's cache frees its
        blocks; a preempted request rebuilds it on resume); a finished one's acceptance record too."""
        if self.proposer is not None:
            self.proposer.remove(seq.request_id)
        if finished and self.acceptance is not None:
            self.acceptance.remove(seq.key)

    def _take_trimmed(self, finished: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """The tables cut back since the last plan, less those of requests dropped meanwhile (no table left)."""
        gone = set(finished)
        trimmed = tuple(t for t in self.trimmed if t[0] not in gone)
        self.trimmed = []
        return trimmed
