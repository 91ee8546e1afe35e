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

import torch

from graphcache.choices import StepMode
from graphcache.engine.plan import StepOutput, StepPlan
from graphcache.engine.sample.controls import to_device
from graphcache.engine.sample.logprobs import prompt_token_logprobs, token_logprobs
from graphcache.engine.sample.sampler import Sampler
from graphcache.engine.sample.state import SamplingState
from graphcache.engine.sample.structured import apply_grammar_mask
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
    ) -> StepOutput:
        """logits: [len(rows.states), V] the need_logits rows' logits (processed in place); prompt_logits:
        every fed token's logits of the plan's PromptLogits rows."""
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
        host, ready = tokens, None
        if tokens.is_cuda:  # small asynchronous copies (logprobs queued above); the core waits on the event
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return StepOutput(
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
