"""The forward context: per-step data the model's layers read without it being threaded through
every call: the attention metadata the eager break needs, the step's batch descriptor, and its
runtime mode (the same idea as vLLM's `ForwardContext`).

Runtime mode: "full" = the step is (or is captured as) one graph with attention inside, so the layer
calls the decode kernel directly; "breakable" = graph segments around an eager attention break;
"eager" = no graph. The runner sets it, so layers read it instead of inspecting the metadata.

Set in a `with` block around one forward (or one capture): thread-local, so only the engine thread
sees it, and restoring the previous value on exit, so nesting and exceptions leave no stale step behind.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "RUNTIME_MODES",
    "ForwardContext",
    "RuntimeMode",
    "current_attention_metadata",
    "current_forward_context",
    "current_runtime_mode",
    "forward_context",
]

RuntimeMode = Literal["full", "breakable", "eager"]
RUNTIME_MODES: tuple[str, ...] = ("full", "breakable", "eager")


@dataclass(frozen=True)
class ForwardContext:
    attention: Any  # AttentionMetadata or DecodeMetadata of the step
    descriptor: Any = None  # the step's BatchDescriptor (graphs/descriptor.py); None for an eager step
    mode: RuntimeMode = "eager"


class _Local(threading.local):
    context: ForwardContext | None = None  # of the step running on this thread, or None


_local = _Local()


@contextlib.contextmanager
def forward_context(attention: Any, descriptor: Any = None, mode: RuntimeMode = "eager") -> Iterator[None]:
    """Make `attention` (the step's metadata), `descriptor` and `mode` current for this thread."""
    if mode not in RUNTIME_MODES:
        raise ValueError(f"runtime mode must be one of {', '.join(RUNTIME_MODES)}, got {mode!r}")
    previous, _local.context = _local.context, ForwardContext(attention, descriptor, mode)
    try:
        yield
    finally:
        _local.context = previous


def current_forward_context() -> ForwardContext:
    ctx = _local.context
    if ctx is None:
        raise RuntimeError(
            "no forward context on this thread: run the model inside "
            "`with forward_context(metadata):` (the runner does this for every step and capture)"
        )
    return ctx


def current_attention_metadata() -> Any:
    return current_forward_context().attention


def current_runtime_mode() -> RuntimeMode:
    return current_forward_context().mode
