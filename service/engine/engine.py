"""The engine: one thread that owns the GPU, and the asyncio API the HTTP floor talks to.

Everything that touches the device (model load, KV allocation, warmup and capture, every step,
admin warmup/clear/info) runs on the engine thread. The asyncio side never touches the runner:
it puts commands in a thread-safe inbox (queue.Queue) and gets results back through
`loop.call_soon_threadsafe` into a per-request asyncio.Queue (streams) or a future (admin calls).
Commands are handled between steps, so admin work never races a replay.

The engine thread's work lives in loop.py (mixin `_EngineLoop`, which `Engine` inherits); the
types both sides share (exceptions, RequestOutput, inbox commands) live in common.py and are
re-exported here.

No request is ever left hanging: every path that ends a request (finish, abort, step failure,
engine death, shutdown, drain timeout) pushes a final RequestOutput with finished=True.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as SequenceT
from pathlib import Path
from typing import Any

from service.config import Settings
from service.engine.common import (
    DEAD_MESSAGE,
    EngineDead,
    EngineDraining,
    EngineNotReady,
    QueueFull,
    RequestOutput,
    _Abort,
    _AbortAll,
    _Add,
    _Call,
    _Handle,
    _jsonable,
    _Stop,
)
from service.engine.loop import MAX_CONSECUTIVE_STEP_FAILURES as MAX_CONSECUTIVE_STEP_FAILURES
from service.engine.loop import _EngineLoop
from service.engine.sampler import Sampler
from service.engine.scheduler import Scheduler
from service.engine.sequence import SamplingParams, Sequence
from service.metrics import Metrics

__all__ = ["Engine", "EngineDead", "EngineDraining", "EngineNotReady", "QueueFull", "RequestOutput",
           "SamplingParams"]

log = logging.getLogger("graphcache.engine")


def _default_runner_factory(settings: Settings, metrics: Metrics | None):
    from service.engine.runner import ModelRunner  # imported lazily: it pulls in torch + the model

    return ModelRunner(settings, metrics)


class Engine(_EngineLoop):
    def __init__(self, settings: Settings, metrics: Metrics | None = None, *,
                 runner_factory: Callable[[Settings, Metrics | None], Any] | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self._runner_factory = runner_factory or _default_runner_factory
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()          # guards _requests, _num_running and the state flags
        self._requests: dict[str, _Handle] = {}
        self._num_running = 0
        self._ready = False
        self._dead = False
        self._stopped = False                  # the engine thread has exited (shutdown or death)
        self._accepting = True
        self._stop_requested = False
        self._error: str | None = None
        self._ready_event = threading.Event()  # set when ready or dead: wait_ready() returns
        # Set by the engine thread at load:
        self._runner: Any = None
        self._tokenizer: Any = None            # kept after shutdown releases the runner
        self._max_model_len_loaded: int | None = None
        self._scheduler: Scheduler | None = None
        self._sampler: Sampler | None = None
        self._eos_token_ids: frozenset[int] = frozenset()
        self._vocab_size: int | None = None
        self._stats: dict[str, Any] = {"ready": False}
        self._stats_refreshed = 0.0
        self._num_steps = 0
        self._steps_by_mode: dict[str, int] = {}
        self._consecutive_failures = 0
        self._outbox: list[tuple[_Handle, RequestOutput]] = []   # engine thread: outputs of this iteration
        self.warmup_report: Any = None
        self.warmup_seconds = 0.0
        # Test hook: called with each StepBatch on the engine thread before execute; raise to fail the step.
        self.step_failpoint: Callable[[Any], None] | None = None

    # --- properties ------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready and not self._dead

    @property
    def alive(self) -> bool:
        return not self._dead

    @property
    def error(self) -> str | None:
        """Why the engine died, in detail (exception text): for the log and /admin/* only."""
        return self._error

    @property
    def tokenizer(self):
        return self._runner.tokenizer if self._runner is not None else self._tokenizer

    @property
    def runner(self):
        """The ModelRunner (engine-thread object: read-only use from other threads)."""
        return self._runner

    @property
    def model_name(self) -> str:
        if self.settings.served_model_name:
            return self.settings.served_model_name
        if self.settings.model is not None:
            return Path(self.settings.model).name
        return "graphcache-tiny"

    @property
    def max_model_len(self) -> int | None:
        if self._runner is not None:
            return self._runner.max_model_len
        return self._max_model_len_loaded or self.settings.max_model_len

    def stats(self) -> dict[str, Any]:
        """JSON-able snapshot, refreshed by the engine thread after each step (never blocks)."""
        snap = dict(self._stats)
        snap.update(ready=self.ready, alive=self.alive, error=self._error, in_flight=len(self._requests))
        return snap

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the engine thread (load, warmup, serve) and return at once."""
        if self._thread is not None:
            raise RuntimeError("Engine.start() called twice")
        self._thread = threading.Thread(target=self._thread_main, name="graphcache-engine", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until ready (True) or dead/timeout (False). For CLIs, tests and benchmarks."""
        self._ready_event.wait(timeout)
        return self.ready

    def stop_accepting(self) -> None:
        self._accepting = False

    async def drain(self, timeout: float) -> dict[str, int]:
        """Stop accepting, let in-flight requests finish for `timeout` s, then fail the rest cleanly."""
        self.stop_accepting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        in_flight = len(self._requests)
        while self._requests and loop.time() < deadline and self.alive:
            await asyncio.sleep(0.02)
        left = len(self._requests)
        if left and self.alive:
            log.warning("drain timeout (%.1fs): failing %d unfinished requests", timeout, left)
            self._inbox.put(_AbortAll("error", f"the server is shutting down; the request did not finish "
                                               f"within the {timeout:g}s drain timeout"))
            grace = loop.time() + 5.0
            while self._requests and loop.time() < grace and self.alive:
                await asyncio.sleep(0.02)
        return {"in_flight": in_flight, "finished": in_flight - left, "aborted": left}

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread and join it. Unfinished requests get finish_reason error."""
        self._accepting = False
        self._stop_requested = True
        self._inbox.put(_Stop())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("engine thread did not stop within %.0fs", timeout)

    # --- requests ----------------------------------------------------------------------------
    def _check_serving(self) -> None:
        if self._dead:
            raise EngineDead(DEAD_MESSAGE)
        if not self._accepting:
            self._count_rejected("draining")
            raise EngineDraining("the server is shutting down and takes no new requests")
        if not self._ready:
            raise EngineNotReady("the model is still loading or warming up; retry when /ready returns 200")

    def _count_rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.requests_rejected.labels(reason).inc()

    def validate(self, prompt_token_ids: SequenceT[int], params: SamplingParams) -> None:
        """Raise ValueError naming the fix when a request can never be served."""
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; send at least one token")
        limit = self.max_model_len
        if limit is not None and n + params.max_tokens > limit:
            raise ValueError(f"the prompt has {n} tokens and max_tokens is {params.max_tokens}: {n + params.max_tokens} "
                             f"exceeds the model's maximum context length {limit}; shorten the prompt or lower "
                             f"max_tokens to at most {max(limit - n, 0)}")
        if self._vocab_size is not None and any(not 0 <= t < self._vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self._vocab_size})")
        bm = self._scheduler.block_manager if self._scheduler is not None else None
        if bm is not None and bm.blocks_for(n + params.max_tokens) > bm.num_usable:
            raise ValueError(f"prompt + max_tokens = {n + params.max_tokens} tokens needs more KV cache than the "
                             f"server has ({bm.max_tokens_capacity()} tokens); lower max_tokens")

    def generate(self, request_id: str, prompt_token_ids: SequenceT[int],
                 params: SamplingParams | None = None, *, stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Submit a request; iterate the result for its output deltas. Must be called on an event loop.

        stream=False delivers a single final output holding all text and token ids (non-streaming
        clients, offline benchmarks): one event-loop wakeup per request instead of one per token.
        Raises at once (not on first iteration): ValueError (invalid), QueueFull, EngineNotReady,
        EngineDraining, EngineDead. Leaving the iteration early (client disconnect) aborts the
        request and frees its KV blocks.
        """
        params = params if params is not None else SamplingParams()
        self._check_serving()
        try:
            self.validate(prompt_token_ids, params)
        except ValueError:
            self._count_rejected("invalid")
            raise
        loop = asyncio.get_running_loop()
        seq = Sequence(request_id, list(prompt_token_ids), params)
        handle = _Handle(request_id, loop, asyncio.Queue(), seq, stream)
        with self._lock:
            self._check_serving()   # again under the lock: death fails everything in _requests
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in flight; use a unique id")
            if len(self._requests) - self._num_running >= self.settings.max_queue:
                self._count_rejected("queue_full")
                raise QueueFull(f"{self.settings.max_queue} requests are already waiting; retry later")
            self._requests[request_id] = handle
        self._inbox.put(_Add(handle))
        return self._stream(handle)

    async def _stream(self, handle: _Handle) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out: RequestOutput = await handle.outputs.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:   # the consumer left (disconnect, cancel, break): free its blocks now
                self.abort(handle.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op if unknown or finished). Its blocks are freed between steps."""
        if not self._dead:
            self._inbox.put(_Abort(request_id))

    # --- admin (run on the engine thread between steps) ------------------------------------
    async def _call(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:   # the exiting engine thread fails what is queued under this lock: none is lost
            if self._dead:
                raise EngineDead(DEAD_MESSAGE)
            if self._stopped:
                raise EngineDead("the engine was shut down")
            if not self._ready:
                raise EngineNotReady("the model is still loading or warming up")
            self._inbox.put(_Call(fn, fut, loop))
        return await fut

    async def warmup(self, descriptors: list) -> dict:
        """Capture (and pin) these descriptors (BatchDescriptor or "T:R[:decode]" strings)."""
        from service.graphs.descriptor import BatchDescriptor

        descs = [d if isinstance(d, BatchDescriptor) else BatchDescriptor.parse(str(d)) for d in descriptors]
        return await self._call(lambda: self._admin_result(self._runner.cache.warmup(descs, pin=True)))

    async def clear_graphs(self) -> dict:
        return await self._call(lambda: self._admin_result(self._runner.cache.clear()))

    async def cache_info(self) -> dict:
        return await self._call(lambda: _jsonable(self._runner.cache.info()))

    def _admin_result(self, report: Any) -> dict:
        self._refresh_stats(force=True)
        out = _jsonable(report)
        return out if isinstance(out, dict) else {"result": out}
