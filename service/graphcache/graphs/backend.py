"""Capture backends: what the store does on the GPU and what it skips on the CPU, chosen once.

"cuda" records CUDA graphs into private allocator pools and gives their memory back to the driver;
"eager" (no CUDA, or enforce_eager) keeps the same capture contract (capture.py) but its "graph" re-runs
the step, its pools are identities without memory, and there is no memory to give back. The store holds
one backend object and calls it unconditionally, so the difference lives here and not in branches
through the store.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

from graphcache.graphs.capture import BreakableGraph, capture, pool_accepts_captures
from graphcache.graphs.pool import EagerPool, all_graph_pools_bytes, pool_bytes

__all__ = ["BACKENDS", "CaptureBackend", "CudaBackend", "EagerBackend", "make_backend"]

BACKENDS = ("cuda", "eager")
_eager_ids = itertools.count(1)  # process-wide: pools of two caches are never equal


class CaptureBackend(Protocol):
    name: Literal["cuda", "eager"]

    def new_pool(self) -> Any:
        """A fresh pool handle, never captured into before."""
        ...

    def capture(self, step: Callable[[], None], pool: Any, warmup: bool) -> BreakableGraph:
        """Record `step` into `pool` (capture.py's contract; warmup: run it eagerly first)."""
        ...

    def accepts_captures(self, handle: Any) -> bool:
        """False once a failed capture left the pool `handle` unusable (capture.py's _spoiled_pools)."""
        ...

    def pool_bytes(self, handle: Any) -> int:
        """What the allocator holds for the pool `handle`."""
        ...

    def first_run(self, graph: BreakableGraph) -> None:
        """Make a just-captured step's outputs right (the capture ran the step that missed)."""
        ...

    def give_back(self) -> None:
        """Return the allocator's unused cached blocks to the driver (after a failed capture)."""
        ...

    def free_memory(self) -> None:
        """Return the memory of closed graphs: collect what still references them, then give back."""
        ...

    def synchronize(self) -> None:
        """Wait for every replay queued so far (before freeing memory they may still use)."""
        ...

    def allocator_pool_bytes(self) -> int:
        """Bytes in every graph pool of the process, from the allocator (not the store's books)."""
        ...


class CudaBackend:
    name: Literal["cuda", "eager"] = "cuda"

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, step: Callable[[], None], pool: Any, warmup: bool) -> BreakableGraph:
        return capture(step, backend="cuda", pool=pool, warmup=warmup)

    def accepts_captures(self, handle: Any) -> bool:
        return pool_accepts_captures(handle)

    def pool_bytes(self, handle: Any) -> int:
        return pool_bytes(handle)

    def first_run(self, graph: BreakableGraph) -> None:
        # The capture ran the step's eager ops over inputs its graph segments had not computed yet
        # (the graphs were only recorded), so what they wrote (e.g. this step's KV slots) is wrong
        # until one replay runs the whole step.
        graph.replay()

    def give_back(self) -> None:
        torch.cuda.empty_cache()

    def free_memory(self) -> None:
        gc.collect()  # a closed graph's segments may still be referenced from a cycle
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def allocator_pool_bytes(self) -> int:
        return all_graph_pools_bytes()


class EagerBackend:
    name: Literal["cuda", "eager"] = "eager"

    def new_pool(self) -> Any:
        return EagerPool(next(_eager_ids))

    def capture(self, step: Callable[[], None], pool: Any, warmup: bool) -> BreakableGraph:
        return capture(step, backend="eager", pool=pool, warmup=warmup)

    def accepts_captures(self, handle: Any) -> bool:
        return True

    def pool_bytes(self, handle: Any) -> int:
        return 0

    def first_run(self, graph: BreakableGraph) -> None:
        pass  # the eager capture already ran the step for real

    def give_back(self) -> None:
        pass

    def free_memory(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def allocator_pool_bytes(self) -> int:
        return 0


def make_backend(name: str) -> CaptureBackend:
    """The backend called `name` ("cuda" | "eager")."""
    if name == "cuda":
        return CudaBackend()
    if name == "eager":
        return EagerBackend()
    raise ValueError(f"backend must be 'cuda' or 'eager', got {name!r}")
