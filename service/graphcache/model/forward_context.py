"""The forward context: per-step data the model's layers read without it being threaded through
every call (today: the attention metadata the eager break needs).

Set in a `with` block around one forward (or one capture): thread-local, so only the engine thread
sees it, and restoring the previous value on exit, so nesting and exceptions leave no stale step
behind. The same idea as vLLM's `set_forward_context`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["current_attention_metadata", "forward_context"]


class _Local(threading.local):
    attention: Any = None   # AttentionMetadata of the step running on this thread, or None


_local = _Local()


@contextlib.contextmanager
def forward_context(attention: Any) -> Iterator[None]:
    """Make `attention` (an AttentionMetadata) the current step's metadata for this thread."""
    previous, _local.attention = _local.attention, attention
    try:
        yield
    finally:
        _local.attention = previous


def current_attention_metadata() -> Any:
    md = _local.attention
    if md is None:
        raise RuntimeError("no forward context on this thread: run the model inside "
                           "`with forward_context(metadata):` (the runner does this for every step and capture)")
    return md
