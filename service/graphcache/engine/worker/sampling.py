"""The worker's sampling stage: a step's logits -> its StepOutput (sampled ids, logprobs), on the device.

After the forward pass the runner hands the need_logits rows' logits here, with the table's rows
(engine/worker/request_table.py: each request's SamplingState). In order: a copy of the raw logits of the
rows that asked for logprobs (logprobs are of the raw distribution); the plan's grammar masks, in place;
the sampler (engine/sample/sampler.py), one batched draw, a request whose own sampling fails ending alone;
the logprobs of the sampled tokens and of the plan's prompt positions; then the copies of all of that to
the host, queued behind the step on the stream, and an event to wait on. Nothing here waits for the
device: the engine core waits once, when it completes the step (async scheduling launches the next step
first).

Failure isolation (`sample_isolating_failures`): the sampler does not raise for validated parameters; if it
raises anyway, each row is sampled alone, so a request whose row fails ends by itself (its id is a
stand-in 0, reported in StepOutput.failed). A device fault (`is_device_failure`) is not any one
request's: it raises.
"""

from __future__ import annotations

import logging
from itertools import accumulate

import torch

from graphcache.choices import StepMode
from graphcache.engine.plan import StepOutput, StepPlan
from graphcache.engine.sample.controls import to_device
from graphcache.engine.sample.logprobs import prompt_token_logprobs, token_logprobs
from graphcache.engine.sample.sampler import Sampler
from graphcache.engine.sample.state import SamplingState
from graphcache.engine.sample.structured import apply_grammar_mask
from graphcache.engine.spec.match import accept_matching, position_offsets
from graphcache.engine.worker.request_table import SampledRows

__all__ = ["StepSampler", "is_device_failure", "sample_isolating_failures"]

log = logging.getLogger("graphcache.engine")


def is_device_failure(exc: BaseException) -> bool:
    """A fault of the device itself (lost GPU, illegal address): the CUDA context is poisoned and
    every later step would fail too. Decided by type: torch raises AcceleratorError for CUDA errors.
    A runner's exception with `fatal = True` counts too (a lost tensor-parallel rank: engine/worker/tp_runner.py)."""
    if getattr(exc, "fatal", False) is True:
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return accelerator_error is not None and isinstance(exc, accelerator_error)


class StepSampler:
    """Samples a step's rows; one per runner that samples (rank 0 under tensor parallelism)."""

    def __init__(self, eos_token_ids: frozenset[int], seed: int | None = None) -> None:
        self.sampler = Sampler(default_seed=seed, eos_token_ids=eos_token_ids)

    def warmup(self, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compile the sampler's kernels before the first request (CUDA only; Sampler.warmup)."""
        self.sampler.warmup(vocab, dtype, device)

    def __call__(
        self,
        plan: StepPlan,
        rows: SampledRows,
        logits: torch.Tensor,
        mode: StepMode,
        prompt_logits: torch.Tensor | None = None,
        verify_logits: torch.Tensor | None = None,
    ) -> StepOutput:
        """logits: [len(rows.states), V] the need_logits rows' logits (processed in place); prompt_logits:
        every fed token's logits of the plan's PromptLogits rows; verify_logits: every fed token's logits of
        the plan's verify rows (plan.verify order)."""
        lp_rows = rows.logprob_rows
        if lp_rows:  # a copy of their rows: the sampler may process logits in place
            lp_index = to_device(lp_rows, torch.int64, logits.device)
            raw = logits.index_select(0, lp_index)  # [m, V]
        if plan.grammar is not None:  # after the raw logprob rows were copied: it masks in place
            apply_grammar_mask(logits, plan.grammar)
        tokens, failed = sample_isolating_failures(self.sampler, logits, rows.states, rows.plain_greedy)
        logprobs = None
        if lp_rows:
            logprobs = token_logprobs(raw, tokens.index_select(0, lp_index), rows.logprob_k).to_host()
        prompt_logprobs = prompt_token_logprobs(prompt_logits, plan)
        spec_tokens = spec_accepted = None
        if plan.verify:
            if verify_logits is None:
                raise ValueError("a plan with verify rows needs the logits of their fed tokens")
            spec_tokens, spec_accepted = verify_drafts(self.sampler, plan, verify_logits, rows.states)
        host, ready = tokens, None
        if tokens.is_cuda:  # small asynchronous copies (logprobs queued above); the core waits on the event
            host = _to_host(tokens)
            if spec_tokens is not None and spec_accepted is not None:
                spec_tokens, spec_accepted = _to_host(spec_tokens), _to_host(spec_accepted)
            ready = torch.cuda.Event()
            ready.record()
        out = StepOutput(
            mode,
            logits,
            tokens,
            host,
            ready,
            failed,
            lp_rows,
            logprobs,
            prompt_logprobs,
            prompt_logits,
        )
        out.spec_tokens, out.spec_accepted = spec_tokens, spec_accepted
        return out


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def verify_drafts(
    sampler: Sampler, plan: StepPlan, verify_logits: torch.Tensor, states: list[SamplingState]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's verify rows' emitted tokens, on the device: ([B, K + 1] int64 padded with -1, [B]
    accepted). verify_logits [sum(n_b + 1), V]: each verify row's fed positions' logits, packed in
    plan.verify order; states: the step's sampled rows' states (SampledRows.states). Every position is
    drawn with its row's parameters at its output position and the matching drafts are kept
    (engine/spec/match.py: exact for the one-hot drafts every proposer makes)."""
    tokens = plan.tokens
    assert tokens is not None  # verify rows feed known tokens
    drafts = []
    for row, n in plan.verify:
        fed = tokens[row]
        assert fed is not None and len(fed) == n + 1, (row, n, fed)
        drafts.append(fed[1:])
    need = plan.need_logits
    sampled_index = list(range(len(plan.keys))) if need is None else list(accumulate(need, initial=0))
    return verify_rows(sampler, drafts, verify_logits, [states[sampled_index[row]] for row, _ in plan.verify])


def verify_rows(
    sampler: Sampler, drafts: list[list[int]], logits: torch.Tensor, states: list[SamplingState]
) -> tuple[torch.Tensor, torch.Tensor]:
    """B rows' drafts verified: logits [sum(n_b + 1), V] (row b's fed positions, packed), states [B] (each
    row's, num_generated counting its last fed position's token) -> ([B, K + 1] int64 tokens padded with
    -1, [B] int64 accepted)."""
    per_position = [st for st, d in zip(states, drafts, strict=True) for _ in range(len(d) + 1)]
    sampled = sampler.sample_positions(logits, per_position, position_offsets(drafts))
    return accept_matching(drafts, sampled)


def sample_isolating_failures(
    sampler: Sampler, logits: torch.Tensor, seqs: list[SamplingState], plain_greedy: bool | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Sample the batch on the device: ([n] int64 ids, rows whose sampling failed). See the module's
    docstring: a row that fails alone ends alone, a device fault raises."""
    try:
        return sampler.sample_device(logits, seqs, plain_greedy), []
    except Exception as exc:
        if is_device_failure(exc):
            raise
        if len(seqs) > 1:
            log.warning(
                "batched sampling failed (%s: %s); sampling the %d rows one by one",
                type(exc).__name__,
                exc,
                len(seqs),
            )
    rows, failed = [], []
    for i, seq in enumerate(seqs):
        try:
            rows.append(sampler.sample_device(logits[i : i + 1], [seq]))
        except Exception as exc:
            if is_device_failure(exc):
                raise
            _log_sampling_failure(seq, exc)
            failed.append(i)
            rows.append(torch.zeros(1, dtype=torch.int64, device=logits.device))
    return torch.cat(rows), failed


def _log_sampling_failure(seq: SamplingState, exc: Exception) -> None:
    p = seq.params
    log.error(
        "sampling failed for request %s (temperature=%r top_p=%r top_k=%r seed=%r): %s: %s",
        seq.request_id,
        p.temperature,
        p.top_p,
        p.top_k,
        p.seed,
        type(exc).__name__,
        exc,
        exc_info=exc,
    )
