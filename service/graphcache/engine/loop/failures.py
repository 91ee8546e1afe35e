"""Failure isolation of the step loop: which failures end only their requests and which end the core.

An exception in a step ends only that step's requests (finish_reason "error", STEP_FAILED_MESSAGE, safe
for clients); a request whose own sampling fails ends alone (the worker reports its row:
engine/worker/sampling.py's `sample_isolating_failures`). A device fault (`is_device_failure`, also the
worker's), or MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row, raises `EngineFailure`: the caller must
stop using the core (the Engine marks itself dead). EngineCore (core.py) applies these rules; they live
here so the step itself reads as the happy path.
"""

from __future__ import annotations

from graphcache.engine.sequence import RequestOutput
from graphcache.engine.worker.sampling import is_device_failure

__all__ = [
    "MAX_CONSECUTIVE_STEP_FAILURES",
    "STEP_FAILED_MESSAGE",
    "EngineFailure",
    "is_device_failure",
]

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
