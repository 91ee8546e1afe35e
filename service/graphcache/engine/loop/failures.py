"""Failure isolation of the step loop: which failures end only their requests and which end the core.

An exception in a step ends only that step's requests (finish_reason "error", STEP_FAILED_MESSAGE, safe
for clients); a request whose own sampling fails ends alone (`sample_isolating_failures`). A device
fault (`is_device_failure`), or MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row, raises
`EngineFailure`: the caller must stop using the core (the Engine marks itself dead). EngineCore
(core.py) applies these rules; they live here so the step itself reads as the happy path.
"""

from __future__ import annotations

import logging

import torch

from graphcache.engine.sample.sampler import Sampler
from graphcache.engine.sequence import RequestOutput, Sequence

__all__ = [
    "MAX_CONSECUTIVE_STEP_FAILURES",
    "STEP_FAILED_MESSAGE",
    "EngineFailure",
    "is_device_failure",
    "sample_isolating_failures",
]

log = logging.getLogger("graphcache.engine")

# Consecutive failed steps before the core gives up (one bad step is survivable: its requests fail,
# the rest keep going; a run of them means the device or the model is broken).
MAX_CONSECUTIVE_STEP_FAILURES = 3
STEP_FAILED_MESSAGE = "the model step for this request failed on the server; retry the request"


class EngineFailure(RuntimeError):
    """The core cannot go on (device fault, or repeated step failures); the cause is chained.
    `outputs`: the final outputs of the failed step's requests, still to be delivered."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


def is_device_failure(exc: BaseException) -> bool:
    """A fault of the device itself (lost GPU, illegal address): the CUDA context is poisoned and
    every later step would fail too. Decided by type: torch raises AcceleratorError for CUDA errors.
    A runner's exception with `fatal = True` counts too (a lost tensor-parallel rank: engine/worker/tp_runner.py)."""
    if getattr(exc, "fatal", False) is True:
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return accelerator_error is not None and isinstance(exc, accelerator_error)


def sample_isolating_failures(
    sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[torch.Tensor, list[int]]:
    """Sample the batch on the device: ([n] int64 ids, rows whose sampling failed). The sampler
    does not raise for validated parameters; if it raises anyway, each row is sampled alone, so a
    request whose row fails ends by itself (its id is a stand-in 0, dropped at completion) and
    neither fails the requests batched with it nor counts toward engine failure. A device fault
    is not any one request's: it raises."""
    try:
        return sampler.sample_device(logits, seqs), []
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


def _log_sampling_failure(seq: Sequence, exc: Exception) -> None:
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
