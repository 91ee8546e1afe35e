"""EngineThread: what the engine thread does once the model is loaded: the step loop and its endings.

`_serve` loops: take the commands of the inbox (requests added and aborted, admin calls, admin warmups),
run `core.step()`, route the outputs to their requests, capture a slice of an admin warmup, refresh the
gauges and stats, then deliver the outputs (one wakeup per event loop per step). `_die` and `_close`
end the engine: every request and admin call still pending gets its final answer, so none is left
hanging. Loading the model and releasing the device are the Engine's (engine.py), the admin calls'
asyncio side is EngineAdmin's (admin_calls.py).
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from graphcache.config import Settings
from graphcache.engine.errors import (
    DEAD_MESSAGE,
    EngineDead,
    InvalidRequest,
)
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.loop.failures import EngineFailure
from graphcache.engine.loop.frontend import EngineFrontend, EngineState
from graphcache.engine.loop.messages import (
    Abort,
    AbortAll,
    Add,
    Call,
    Fail,
    Handle,
    Stop,
    WarmupJob,
    dispatch,
    jsonable,
    settle,
)
from graphcache.engine.loop.request_check import RequestChecker
from graphcache.engine.plan import Runner
from graphcache.engine.sequence import RequestOutput
from graphcache.engine.worker.draft_model import DraftModelProposer
from graphcache.graphs.cache import warmup_order
from graphcache.metrics import Metrics

log = logging.getLogger("graphcache.engine")
# Capture time an admin warmup may take between two steps while requests run (at least one capture).
WARMUP_SLICE_S = 0.02


class EngineThread(EngineFrontend):
    """The engine thread's state and step loop (a base of Engine: engine.py)."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        super().__init__(settings, metrics)
        self._inbox: queue.Queue = queue.Queue()
        self._core: EngineCore | None = None  # engine thread: set at load, dropped at exit
        self._tokenizer: Any = None  # kept after the runner is released
        self._draft: DraftModelProposer | None = None  # the draft model (speculative decoding), engine thread
        self._max_model_len: int | None = None
        self._outbox: list[tuple[Handle, RequestOutput]] = []  # routed, not yet delivered
        self._warmups: deque[WarmupJob] = deque()  # admin warmups in progress, oldest first
        self._last_stream_flush = 0.0
        self._stats_refreshed = 0.0
        self.warmup_seconds = 0.0
        # Test hook, passed to the core: called with each StepPlan before execute; raise to fail it.
        self.step_failpoint: Callable[[Any], None] | None = None

    # --- state -----------------------------------------------------------------------------
    @property
    def runner(self) -> Runner | None:
        """The runner (engine-thread object: read-only use from other threads)."""
        return self._core.runner if self._core is not None else None

    @property
    def core(self) -> EngineCore | None:
        return self._core

    @property
    def _loaded_core(self) -> EngineCore:
        """The core, where the engine thread uses it: between load and release, where it is set
        (admin calls reach the thread only once the engine is ready)."""
        assert self._core is not None, "the engine's core was used before the model loaded or after release"
        return self._core

    @property
    def tokenizer(self):
        return self._core.runner.tokenizer if self._core is not None else self._tokenizer

    @property
    def checker(self) -> RequestChecker | None:
        core = self._core
        return core.checker if core is not None else None

    @property
    def max_model_len(self) -> int | None:
        core = self._core
        if core is not None:
            return core.runner.max_model_len
        return self._max_model_len or self.settings.engine.max_model_len

    # --- the step loop -------------------------------------------------------------------
    def _serve(self) -> None:
        core = self._loaded_core
        while True:
            if not self._process_inbox(block=not core.has_work() and not self._warmups):
                return
            core.step_failpoint = self.step_failpoint
            if core.has_work():
                try:
                    self._route(core.step())
                except EngineFailure as failure:
                    self._route(failure.outputs)  # the failed step's requests end with their error first
                    raise
            self._stream_due()
            if self._warmups:
                self._warmup_slice()
            core.flush_kv_events()  # an abort between steps registers what it computed: tell it now
            # Also after commands alone: an abort that empties the engine must show in the gauges.
            self._update_gauges()
            self._refresh_stats()
            self._flush_outputs()

    def _process_inbox(self, block: bool) -> bool:
        """Run queued commands; False once a stop was asked for."""
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, Stop):
                return False
            if isinstance(cmd, Fail):
                raise EngineFailure(cmd.reason, [])
            self._handle_command(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle_command(self, cmd: Any) -> None:
        core = self._loaded_core
        if isinstance(cmd, Add):
            if cmd.handle.request_id in self._requests:  # else it failed while queued (drain/abort-all)
                try:
                    core.add_request(cmd.handle.seq)
                except (
                    InvalidRequest
                ) as exc:  # the core still holds that id: end this request, not the engine
                    seq = cmd.handle.seq
                    seq.finish("error", exc.message)
                    self._route(
                        [
                            RequestOutput(
                                seq.request_id, "", [], True, "error", seq.num_prompt_tokens, 0, exc.message
                            )
                        ]
                    )
        elif isinstance(cmd, Abort):
            self._route([core.abort(cmd.request_id)])
        elif isinstance(cmd, AbortAll):
            self._route(core.abort_all(cmd.reason, cmd.error))
        elif isinstance(cmd, WarmupJob):
            try:
                descs = core.runner.warmup_descriptors() if cmd.descriptors is None else cmd.descriptors
                cmd.todo = deque(warmup_order(descs))
                if cmd.descriptors is None and self._draft is not None:
                    self._draft.warmup()  # the draft's configured warmup too, at once (a small model's)
            except Exception as exc:  # admin errors go back to the caller, the engine keeps serving
                log.exception("admin warmup failed")
                self._resolve(cmd, exc=exc)
                return
            cmd.total = len(cmd.todo)
            self._warmups.append(cmd)
        elif isinstance(cmd, Call):
            try:
                result = cmd.fn()
            except Exception as exc:  # admin errors go back to the caller, the engine keeps serving
                log.exception("admin command failed")
                self._resolve(cmd, exc=exc)
            else:
                self._resolve(cmd, result=result)

    @staticmethod
    def _resolve(cmd: Call | WarmupJob, result: Any = None, exc: BaseException | None = None) -> None:
        settle(cmd.loop, cmd.future, result, exc)

    def _admin_result(self, report: Any) -> dict:
        """An admin command's answer: its report as JSON (a dict), with the stats refreshed first."""
        self._refresh_stats(force=True)
        out = jsonable(report)
        return out if isinstance(out, dict) else {"result": out}

    def _warmup_slice(self) -> None:
        """Capture the next descriptors of the oldest admin warmup: at least one, then more while the
        slice lasts (all of them when no request is running), so a long warmup never stalls serving."""
        job = self._warmups[0]
        budget = WARMUP_SLICE_S if self._loaded_core.has_work() else float("inf")
        t0 = time.perf_counter()
        try:
            while job.todo:
                job.report.merge(self._loaded_core.runner.capture([job.todo.popleft()], pin=True))
                if time.perf_counter() - t0 >= budget:
                    break
        except Exception as exc:  # admin errors go back to the caller, the engine keeps serving
            log.exception("admin warmup failed")
            self._warmups.popleft()
            self._resolve(job, exc=exc)
            return
        if not job.todo:
            self._warmups.popleft()
            self._resolve(job, result=self._admin_result(job.report))

    # --- outputs ---------------------------------------------------------------------------
    def _route(self, outputs: Iterable[RequestOutput | None]) -> None:
        """Queue each output for its request's consumer; a final one retires the request."""
        for out in outputs:
            if out is None:
                continue
            with self._lock:
                handle = self._requests.get(out.request_id)
                if handle is not None and out.finished:
                    del self._requests[out.request_id]
            if handle is not None:
                self._outbox.append((handle, out))

    def _stream_due(self) -> None:
        """Every stream_interval_ms, route what streams got since their last output. A step emits only
        first and final outputs itself: at batch 256, an output per token and request costs the step
        loop more than the GPU step takes, and the event loop that shares the interpreter as much."""
        now = time.monotonic()
        if now - self._last_stream_flush >= self.settings.engine.stream_interval_ms / 1e3:
            self._last_stream_flush = now
            self._route(self._loaded_core.stream_outputs())

    def _flush_outputs(self) -> None:
        """Deliver queued outputs. Runs after stats/gauges are updated, so a consumer that sees its
        final output also sees its blocks freed in stats(). One wakeup per event loop per step, not
        one per request."""
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            dispatch(outbox)

    def _update_gauges(self) -> None:
        core = self._loaded_core
        with self._lock:
            self._num_running = len(core.scheduler.running)
        core.update_gauges()

    def _refresh_stats(self, force: bool = False) -> None:
        """Engine counters every call (cheap); cache stats at most every 0.25 s (may walk entries)."""
        core = self._loaded_core
        bm, now = core.block_manager, time.monotonic()
        cache_stats = self._stats.get("cache")
        if force or now - self._stats_refreshed >= 0.25:
            self._stats_refreshed = now
            try:
                cache_stats = jsonable(core.runner.cache.stats())
            except Exception as exc:  # stats must never take the engine down
                cache_stats = {"error": str(exc)}
        self._stats = {
            "running": len(core.scheduler.running),
            "waiting": len(core.scheduler.waiting),
            "kv_usage": bm.usage,
            "kv_blocks_total": bm.num_usable,
            "kv_blocks_free": bm.num_free,
            "block_size": bm.block_size,
            "max_model_len": core.scheduler.max_model_len,
            "steps": core.num_steps,
            "steps_by_mode": dict(core.steps_by_mode),
            "preemptions": core.scheduler.num_preemptions,
            "warmup_seconds": self.warmup_seconds,
            "cache": cache_stats,
            # admin warmups in progress: descriptors captured / asked for, over all of them
            "warmup": {
                "jobs": len(self._warmups),
                "done": sum(j.total - len(j.todo) for j in self._warmups),
                "total": sum(j.total for j in self._warmups),
            },
        }

    # --- endings ---------------------------------------------------------------------------
    def _die(self, message: str) -> None:
        """Mark the engine dead. `message` (exception text) is logged and kept in `error` for
        /admin/*; the requests it fails and the probes get DEAD_MESSAGE, which leaks nothing."""
        log.error("engine is dead: %s", message)
        self._error = message
        self._close(EngineState.DEAD, DEAD_MESSAGE)
        self._ready_event.set()

    def _close(self, final: EngineState, message: str) -> None:
        """Enter the final state and fail every request and admin call still pending (engine thread)."""
        self._set_state(final)
        with self._lock:
            handles = list(self._requests.values())
        core = self._core
        if core is not None:
            self._route(core.abort_all("error", message))
        for handle in handles:  # queued but never added to the core
            if not handle.seq.is_finished:
                handle.seq.finish("error", message)
                self._route(
                    [
                        RequestOutput(
                            handle.request_id, "", [], True, "error", handle.seq.num_prompt_tokens, 0, message
                        )
                    ]
                )
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, Call | WarmupJob):
                self._resolve(cmd, exc=EngineDead(message))
        while self._warmups:
            self._resolve(self._warmups.popleft(), exc=EngineDead(message))
        if core is not None:
            self._update_gauges()
            self._refresh_stats(force=True)
        self._flush_outputs()
