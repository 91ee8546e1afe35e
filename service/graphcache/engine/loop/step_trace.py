"""The step trace (settings.engine.step_trace): when each step's phases ran, written at shutdown.

EngineCore (core.py) appends one record per completed step to a bounded deque; the Engine writes it
as JSON lines when it stops, and benchmarks/step_trace.py reads the same fields back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

__all__ = ["STEP_TRACE_FIELDS", "STEP_TRACE_MAX", "write_step_trace"]

log = logging.getLogger("graphcache.engine")

# The records a long-running server keeps (the newest).
STEP_TRACE_MAX = 100_000

# One record of EngineCore.step_trace (times: perf_counter seconds of the engine's process).
STEP_TRACE_FIELDS = (
    "scheduled",
    "launch",
    "launched",
    "complete",
    "tokens_on_host",
    "completed",
    "rows",
    "tokens",
    "sampled",
    "waiting",
    "running",
    # the KV positions the step's rows attend to: sum over rows of start + tokens fed (a decode row at
    # position s attends to s + 1), so a benchmark can bound the step's KV read (benchmarks/roofline.py)
    "context",
)


def write_step_trace(path, records: Iterable[tuple]) -> None:
    """settings.engine.step_trace: one JSON object per step (STEP_TRACE_FIELDS), oldest first. Never raises:
    the engine is stopping when it writes, and a benchmark's missing file says enough."""
    try:
        with open(path, "w") as f:
            for rec in records:
                f.write(json.dumps(dict(zip(STEP_TRACE_FIELDS, rec, strict=True))) + "\n")
    except OSError as exc:
        log.error("could not write the step trace to %s: %s", path, exc)
