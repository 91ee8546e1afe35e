"""Breakable capture: record a step as CUDA graph segments split by eager breaks.

An op decorated with `eager_break` cannot live in a graph (attention over per-request
lengths read from host state). Inside `capture()` a call to it ends the current graph
segment, runs the op eagerly, records it with non-owning views of its tensor arguments,
and begins the next segment. `BreakableGraph.replay()` then runs graph, op, graph, ...
in order on the current stream.

Contracts (see ../../docs/ARCHITECTURE.md):
- eager ops write into buffers they are given: returning a tensor during capture raises,
  because a fresh tensor would sit at a new address on every replay;
- one active capture per thread; a nested capture raises;
- if the step raises, the stream leaves capture mode, partial graphs are dropped, and the
  next capture and replay work.

Backend "eager" (no CUDA) keeps the same API and contract checks; its replay calls the
step eagerly over the same static buffers.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree

__all__ = [
    "BreakableGraph",
    "CaptureError",
    "EagerStep",
    "capture",
    "capture_stream",
    "eager_break",
    "is_capturing",
    "pool_accepts_captures",
    "release_workspaces",
]

log = logging.getLogger(__name__)
Backend = Literal["cuda", "eager"]


class CaptureError(RuntimeError):
    """A step broke the capture contract; the message names the fix."""


class _ThreadState(threading.local):
    active: _Capture | None = None  # the capture running on this thread


_state = _ThreadState()


def is_capturing() -> bool:
    """True while this thread is inside `capture()`."""
    return _state.active is not None


def eager_break(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `fn` as an eager break. Outside a capture it just calls through."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        active = _state.active
        if active is None:
            return fn(*args, **kwargs)
        return active.run_break(fn, args, kwargs)

    return wrapper


class EagerStep:
    """One eager op recorded for replay: fn with non-owning views of its CUDA tensor args."""

    __slots__ = ("fn", "args", "kwargs", "name")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.name = getattr(fn, "__qualname__", repr(fn))

    def replay(self) -> None:
        self.fn(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"EagerStep({self.name})"


def _non_owning(x: Any) -> Any:
    """A view of a CUDA tensor's memory that does not keep its storage alive.

    A recorded eager step must not pin memory: evicting an entry has to return its pool,
    and a stored owning reference to an activation would keep that block allocated.
    The memory stays valid as long as the graphs of the same capture (and thus its pool)
    live, which is exactly as long as this step can be replayed. Same construction as
    torch._inductor.cudagraph_trees.
    """
    if not (isinstance(x, torch.Tensor) and x.is_cuda):
        return x
    storage = x.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), x.device, storage.nbytes())
    metadata = {
        "data_ptr": storage.data_ptr(),
        "nbytes": storage.nbytes(),
        "device": x.device,
        "size": x.shape,
        "stride": x.stride(),
        "storage_offset": x.storage_offset(),
        "dtype": x.dtype,
    }
    return torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata(metadata, alias)


def _check_no_tensor(fn: Callable[..., Any], result: Any, backend: Backend) -> None:
    # On the eager backend any tensor counts: it stands in for a device tensor, so the
    # CPU tests catch the same contract violation the GPU would.
    for leaf in pytree.tree_leaves(result):
        if isinstance(leaf, torch.Tensor) and (backend == "eager" or leaf.is_cuda):
            raise CaptureError(
                f"eager-break op {getattr(fn, '__qualname__', fn)!r} returned a tensor during capture; its address "
                "would change on every replay. Fix: write into a caller-provided output buffer and return None."
            )


class _Capture:
    """State of the capture running on one thread: finished segments and the open graph."""

    def __init__(self, backend: Backend, pool: Any = None, error_mode: str = "thread_local") -> None:
        self.backend, self.pool, self.error_mode = backend, pool, error_mode
        self.segments: list[Any] = []  # torch.cuda.CUDAGraph | EagerStep, in replay order
        self.open_graph: torch.cuda.CUDAGraph | None = None
        self.graph_call_failed = False  # a capture_begin or capture_end raised

    def begin_segment(self) -> None:
        g = torch.cuda.CUDAGraph()
        self.segments.append(g)  # appended first so abort() resets it whatever happens next
        try:
            g.capture_begin(pool=self.pool, capture_error_mode=self.error_mode)
        except BaseException:
            self.graph_call_failed = True  # capture_begin may have begun the generators' capture
            raise
        self.open_graph = g

    def end_segment(self) -> None:
        assert self.open_graph is not None
        self.open_graph.capture_end()  # if this raises, open_graph stays set for abort()
        self.open_graph = None

    def run_break(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.backend == "eager":
            result = fn(*args, **kwargs)
            _check_no_tensor(fn, result, "eager")
            self.segments.append(EagerStep(fn, (), {}))  # replay re-runs the step, not the op
            return result
        self.end_segment()
        result = fn(*args, **kwargs)  # inputs sit at static addresses in this capture's pool
        _check_no_tensor(fn, result, "cuda")
        args, kwargs = pytree.tree_map(_non_owning, (args, kwargs))
        self.segments.append(EagerStep(fn, args, kwargs))
        self.begin_segment()
        return result

    def abort(self) -> None:
        """Leave capture mode and drop every partial graph; never raises."""
        g, self.open_graph = self.open_graph, None
        if g is not None:
            try:
                g.capture_end()
            except Exception as e:  # e.g. capture invalidated by an OOM or a sync inside it
                log.warning("ending an aborted capture failed (%s); discarding it", e)
                self.graph_call_failed = True
                _spoil_pool(self.pool, g)
        _end_pool_recording(self.pool)
        if self.graph_call_failed:
            _reset_rng_capture_state()
        for seg in self.segments:
            if isinstance(seg, torch.cuda.CUDAGraph):
                try:
                    seg.reset()
                except Exception as e:
                    log.warning("resetting a partial graph failed: %s", e)
        self.segments.clear()


# Pools a failed capture_end left recording. torch (2.11) ends a capture's pool routing in the device
# allocator and in the pinned host allocator only after cudaStreamEndCapture succeeds; the device one
# _end_pool_recording ends, the host one has no Python call, and every later capture_begin into that
# pool then fails ("beginAllocateToPool: already recording"). So such a pool takes no capture again:
# its owner moves to a fresh one (store.py) and keeps the old one's graphs until they go.
_spoiled_pools: set[Any] = set()
# The failed captures' graphs, never freed: the host allocator's routing entry keeps a filter that
# reads its graph's capture id on every pinned allocation, so the graph must outlive the process.
_spoiled_graphs: list[torch.cuda.CUDAGraph] = []


def _spoil_pool(pool: Any, graph: torch.cuda.CUDAGraph) -> None:
    _spoiled_pools.add(tuple(pool))
    _spoiled_graphs.append(graph)


def pool_accepts_captures(pool: Any) -> bool:
    """False for a pool a failed capture left recording (see _spoiled_pools): capture into a fresh one."""
    return tuple(pool) not in _spoiled_pools


def _reset_rng_capture_state() -> None:
    """After a capture_begin or capture_end that failed: capture_end skips the CUDA generators' capture
    epilogue when it fails, and capture_begin may fail after their prologue, so they still count
    themselves as capturing and every later random op raises ("Offset increment outside graph
    capture"). One empty capture into a fresh pool runs the prologue and epilogue again. Never raises."""
    g, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the CUDA Graph is empty"
            g.capture_begin(pool=pool)
            g.capture_end()
        g.reset()
    except Exception as e:
        log.warning("resetting the CUDA generators after a failed capture failed: %s", e)
        _end_pool_recording(pool)


def _end_pool_recording(pool: Any) -> None:
    """A capture_end that failed (at cudaStreamEndCapture) or a capture_begin that failed after
    beginAllocateToPool leaves the allocator routing this stream's allocations into `pool`, and the next
    capture into it fails ("already recording"). Ends that; a pool that is not recording raises, ignored."""
    with contextlib.suppress(Exception):
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)


# --- the capture stream and its cuBLAS workspace ---
# cuBLAS keeps one workspace per (handle, stream), allocated on first use through the caching
# allocator, and a captured GEMM bakes in its address. Allocated inside a capture, it would land
# in that capture's pool: 32 MiB per entry on Hopper, and a dangling pointer for every other graph
# that reused it once that pool is freed. So all captures run on one persistent stream per device
# whose workspace is allocated *outside* any capture (by an eager run of the step on that stream,
# the "priming" below): it sits in ordinary allocator memory, shared by every graph, freed by none.
_capture_streams: dict[int, torch.cuda.Stream] = {}
_primed_streams: set[int] = set()  # streams whose cuBLAS workspaces exist outside every pool


def capture_stream() -> torch.cuda.Stream:
    """The persistent capture stream of the current device (created on first use)."""
    device = torch.cuda.current_device()
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream()
    return _capture_streams[device]


def release_workspaces() -> None:
    """Free cuBLAS's cached workspaces (e.g. to measure memory from a quiet baseline).

    Only while no captured graph lives: every graph shares the capture stream's workspace and
    would replay into freed memory. The next capture re-primes the stream."""
    torch._C._cuda_clearCublasWorkspaces()
    _primed_streams.clear()


def _replay_call(seg: Any) -> Callable[[], None]:
    if isinstance(seg, EagerStep):
        return functools.partial(seg.fn, *seg.args, **seg.kwargs)
    # Bind the C++ replay directly: skips a Python frame per segment on the hot path.
    return functools.partial(torch._C._CUDAGraph.replay, seg)


class BreakableGraph:
    """A finished capture: segments replayed in order (cuda) or the step re-run (eager)."""

    def __init__(
        self,
        backend: Backend,
        segments: list[Any],
        *,
        step: Callable[[], None] | None = None,
        pool: Any = None,
    ) -> None:
        self.backend, self.pool, self._step = backend, pool, step
        self.segments = segments
        self.timings: dict[str, float] = {}  # where the capture's host time went (capture() fills it)
        self.num_breaks = sum(isinstance(s, EagerStep) for s in segments)
        self.num_graphs = len(segments) - self.num_breaks
        if backend == "cuda":
            self._calls = [_replay_call(s) for s in segments]
        else:
            assert step is not None, "an eager-backend graph re-runs its step: pass step="
            self._calls = [step]

    @property
    def break_names(self) -> list[str]:
        return [s.name for s in self.segments if isinstance(s, EagerStep)]

    def replay(self) -> None:
        # Eager steps run outside the forward that created their tensors; if that forward ran
        # under inference_mode, an in-place write to its (inference) tensors is only legal
        # inside inference_mode. Replays never need autograd, so always replay inside it.
        with torch.inference_mode():
            for call in self._calls:
                call()

    def close(self) -> None:
        """Drop the graphs so their pool can be released (then empty_cache returns it)."""
        for seg in self.segments:
            if isinstance(seg, torch.cuda.CUDAGraph):
                seg.reset()
        self.segments, self._calls, self._step = [], [], None

    def __repr__(self) -> str:
        return f"BreakableGraph(backend={self.backend}, graphs={self.num_graphs}, breaks={self.num_breaks})"


def capture(
    step: Callable[[], None],
    *,
    backend: Backend,
    pool: Any = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "thread_local",
    warmup: bool = False,
) -> BreakableGraph:
    """Capture `step` (reads and writes static buffers only, returns None) as a BreakableGraph.

    cuda: every segment on `pool` (default: a fresh private one) and on `stream` (default: the
    device's persistent capture stream; capture cannot run on the legacy default stream).
    capture_error_mode "thread_local" so a stray CUDA call from another thread cannot invalidate
    the capture. warmup: run `step` once eagerly on the capture stream first, so lazy
    initialisation (kernels' first-call setup, Triton compiles) never happens inside the capture.
    The first capture on a stream always warms up: that run allocates the stream's cuBLAS
    workspace outside every pool (see capture_stream). The graph's `timings` say where the
    capture's time went (warmup run, capture, in seconds of host time).
    """
    if _state.active is not None:
        raise CaptureError(
            "capture() called inside another capture on this thread; nested captures are "
            "not supported. Fix: capture each step separately, one after another."
        )
    if backend == "eager":
        return _capture_eager(step)
    if backend != "cuda":
        raise ValueError(f"unknown capture backend {backend!r}; use 'cuda' or 'eager'")
    if torch.cuda.is_current_stream_capturing():
        raise CaptureError(
            "capture() called while the current stream is already capturing "
            "(inside torch.cuda.graph?). Fix: call it outside any other graph capture."
        )
    stream = stream if stream is not None else capture_stream()
    t0 = time.perf_counter()
    stream.wait_stream(torch.cuda.current_stream())  # buffers written on the caller's stream first
    if warmup or stream.cuda_stream not in _primed_streams:
        with torch.cuda.stream(stream):
            step()
        _primed_streams.add(stream.cuda_stream)
    t1 = time.perf_counter()
    # No gc.collect(), synchronize() or empty_cache() per capture (torch.cuda.graph does all three):
    # a full collection of a server-sized heap cost 138 ms a capture, and nothing here needs it.
    # Automatic collection is held off instead, so none lands inside the capture and skews it.
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    active = _Capture("cuda", pool, capture_error_mode)
    _state.active = active
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream):
            try:
                active.begin_segment()
                step()
                active.end_segment()
            except BaseException:
                active.abort()  # must run on the capture stream: capture_end checks it
                raise
    finally:
        _state.active = None
        if gc_was_enabled:
            gc.enable()
    torch.cuda.current_stream().wait_stream(stream)
    graph = BreakableGraph("cuda", active.segments, pool=pool)
    graph.timings = {"warmup": t1 - t0, "capture": time.perf_counter() - t1}
    return graph


def _capture_eager(step: Callable[[], None]) -> BreakableGraph:
    active = _Capture("eager")
    _state.active = active
    try:
        step()  # breaks are counted and the contract checked, exactly as under CUDA
    finally:
        _state.active = None
    return BreakableGraph("eager", active.segments, step=step)
