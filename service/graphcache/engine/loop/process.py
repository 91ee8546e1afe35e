"""EngineClient: the engine's step loop in a child process, the same interface to the API as `Engine`.

Why: in one process the step loop (schedule, launch, sample, postprocess: Python) and the HTTP event
loop share one interpreter lock; at 256 streams the HTTP side costs the engine a third of its offline
throughput. With GRAPHCACHE_ENGINE_PROCESS=true the child (engine/loop/process_main.py, spawned) runs an
`Engine`; this process keeps HTTP, the request check, admission, detokenization and the streams.

What stays here (EngineFrontend, shared with Engine): the requests in flight and their asyncio
queues, so admission (queue limit against the child's running count), streaming (`consume`:
merging, detokenizing) and drain behave exactly as in-process. The request check uses the child's
`EngineLimits` (sent when it is ready) with a tokenizer loaded here from the same directory.
What crosses the pipe: requests and aborts one way; one message of outputs per engine step, state
snapshots and admin answers the other (process_main.py lists them). Admin calls and the metrics
text are proxied by call id; an exception comes back as the same type (engine/errors.py's) with its
message. If the child dies, this engine turns DEAD: every request and call in flight ends with an
error at once, new ones are refused, /health says 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from graphcache.config import Settings
from graphcache.engine import errors
from graphcache.engine.errors import DEAD_MESSAGE, EngineDead
from graphcache.engine.loop.frontend import EngineFrontend, EngineState
from graphcache.engine.loop.messages import Handle, dispatch, settle, unpack_outputs
from graphcache.engine.loop.request_check import EngineLimits, RequestChecker
from graphcache.engine.sample.grammar_compiler import GrammarLimits
from graphcache.engine.sequence import RequestOutput
from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.metrics import Metrics
from graphcache.model.tokenizer import Tokenizer

__all__ = ["EngineClient"]

log = logging.getLogger("graphcache.engine")
# Exception types an admin call's failure keeps across the pipe; any other becomes a RuntimeError.
_REMOTE_ERRORS = {
    cls.__name__: cls
    for cls in (
        errors.EngineDead,
        errors.EngineDraining,
        errors.EngineNotReady,
        errors.QueueFull,
        ValueError,
        KeyError,
        TypeError,
    )
}
SHUTDOWN_MESSAGE = "the engine was shut down before the request finished"
CHILD_MODULE = "graphcache.engine.loop.process_main"


def run_engine_child(*args) -> None:
    """The spawned child's entry. It imports the engine (torch, the model code) by name, here in the child:
    an import statement would load them into the API process too, which only does HTTP, tokenizing and
    detokenizing (tests/test_floors.py checks `graphcache.api.server.app` loads no torch)."""
    importlib.import_module(CHILD_MODULE).main(*args)


class EngineClient(EngineFrontend):
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        *,
        setup_logging: Callable[[str, str], None] | None = None,
    ) -> None:
        """setup_logging(log_format, log_level): run first in the engine process (module-level: it is
        pickled by name), so its records look like this process's."""
        if (
            settings.model.tensor_parallel_size > 1
        ):  # Settings refuses it too; a direct caller gets the same fix
            raise ValueError(
                "engine_process does not support tensor_parallel_size > 1 yet; set "
                "GRAPHCACHE_ENGINE_PROCESS=false or GRAPHCACHE_TENSOR_PARALLEL_SIZE=1"
            )
        super().__init__(settings, metrics)
        self._setup_logging = setup_logging
        self._checker: RequestChecker | None = None
        self._tokenizer: Any = None
        self._max_model_len: int | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None  # to the child; set by start()
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._closing = False  # shutdown() asked the child to exit: its end of the pipe closing is no death

    # --- what EngineFrontend needs ------------------------------------------------------
    @property
    def checker(self) -> RequestChecker | None:
        return self._checker

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len or self.settings.engine.max_model_len

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before start)."""
        return self._process.pid if self._process is not None else None

    def stats(self) -> dict[str, Any]:
        snap = super().stats()
        snap["engine_pid"] = self.pid
        return snap

    def _enqueue(self, handle: Handle) -> None:
        seq = handle.seq  # checked here already (max_tokens resolved): the engine's re-check passes as is
        self._send(("add", handle.request_id, seq.prompt_token_ids, seq.params, seq.stream, "max_tokens"))

    def abort_all(self, reason: str, error: str) -> None:
        self._send(("abort_all", reason, error))

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op if unknown or finished). Its blocks are freed between steps."""
        if self.alive:
            self._send(("abort", request_id))

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                if self._conn is not None:  # None: never started
                    self._conn.send(message)
        except (OSError, ValueError):  # the child is gone: the reader turns us DEAD
            pass

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the engine process (load, warmup, serve) and return at once."""
        if self._process is not None:
            raise RuntimeError("EngineClient.start() called twice")
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        self._conn, child_conn = ctx.Pipe(duplex=True)
        # daemon: the child dies with this process even if shutdown() never runs.
        self._process = ctx.Process(
            target=run_engine_child,
            args=(child_conn, self.settings, self._setup_logging),
            name="graphcache-engine",
            daemon=True,
        )
        self._process.start()
        child_conn.close()  # ours closed: the pipe reads EOF once the child exits, however it exits
        self._reader = threading.Thread(target=self._read, name="graphcache-engine-reader", daemon=True)
        self._reader.start()

    def stop_accepting(self) -> None:
        super().stop_accepting()
        self._send(("stop_accepting",))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine process and join it. Unfinished requests get finish_reason error."""
        self.stop_accepting()
        self._closing = True
        self._send(("shutdown",))
        process = self._process
        if process is not None:
            process.join(timeout)
            if process.is_alive():
                log.warning("engine process did not stop within %.0fs; killing it", timeout)
                process.kill()
                process.join(5.0)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5.0)
        self._close(EngineState.STOPPED, SHUTDOWN_MESSAGE)

    # --- admin (proxied to the engine process) ------------------------------------------
    async def _call(self, name: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:  # _close fails what is registered under this lock: none is lost
            refused = self.refusal(admin=True)
            if refused is not None:
                raise refused
            call_id = next(self._call_ids)
            self._calls[call_id] = (loop, future)
        self._send(("call", call_id, name, args))
        try:
            return await future
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    async def warmup(self, descriptors: list[BatchDescriptor] | None = None) -> dict:
        """As Engine.warmup, run by the engine process."""
        if descriptors is not None:
            descriptors = [
                d if isinstance(d, BatchDescriptor) else BatchDescriptor.parse(str(d)) for d in descriptors
            ]
        return await self._call("warmup", descriptors)

    async def clear_graphs(self) -> dict:
        return await self._call("clear_graphs")

    async def reset_prefix_cache(self) -> dict:
        return await self._call("reset_prefix_cache")

    async def load_lora_adapter(self, name: str, path: str) -> tuple[int, str]:
        status, message = await self._call("load_lora_adapter", name, path)
        return status, message

    async def unload_lora_adapter(self, name: str) -> tuple[int, str]:
        status, message = await self._call("unload_lora_adapter", name)
        return status, message

    async def cache_profile(self, min_uses: int = 1) -> dict:
        return await self._call("cache_profile", min_uses)

    async def cache_info(self) -> dict:
        return await self._call("cache_info")

    async def metrics_text(self) -> str:
        """The engine process's metrics exposition (graphcache_* and vllm:*, no process collectors)."""
        return await self._call("metrics_text")

    # === the reader thread ==============================================================
    def _read(self) -> None:
        conn = self._conn
        assert conn is not None  # started by start(), after the pipe
        try:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    break
                self._handle(message)
        except BaseException as exc:  # noqa: BLE001 - a reader that dies silently would hang every request
            log.exception("engine pipe reader failed")
            self._die(f"the engine pipe reader failed: {type(exc).__name__}: {exc}")
            return
        if not self._closing:
            self._die(self._exit_reason())

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "out":
            self._deliver(unpack_outputs(message[1]), message[2])
        elif kind == "snapshot":
            self._snapshot(*message[1:])
        elif kind == "ready":
            self._on_ready(*message[1:])
        elif kind == "reply":
            self._reply(*message[1:])

    def _deliver(self, outputs: list[RequestOutput], num_running: int) -> None:
        """One engine step's outputs: retire finished requests, one wakeup per event loop."""
        routed = []
        with self._lock:
            self._num_running = num_running
            for out in outputs:
                handle = self._requests.get(out.request_id)
                if handle is None:
                    continue
                if out.finished:
                    del self._requests[out.request_id]
                routed.append((handle, out))
        dispatch(routed)

    def _on_ready(self, limits: EngineLimits, tokenizer_dir: str, max_model_len: int) -> None:
        self._tokenizer = Tokenizer(tokenizer_dir) if tokenizer_dir else None
        # The engine process read the same file at load (a malformed one failed the load there).
        self._set_generation_defaults(tokenizer_dir or None)
        self._checker = RequestChecker(limits, self._tokenizer, GrammarLimits.from_settings(self.settings))
        self._max_model_len = max_model_len

    def _snapshot(self, state: str, error: str | None, progress: dict | None, stats: dict) -> None:
        self._stats = stats
        self.progress = progress
        if state == EngineState.DEAD.value:
            self._die(error or "the engine process reported an unrecoverable error")
        elif (
            state == EngineState.READY.value
            and self._state is EngineState.LOADING
            and self._checker is not None
        ):
            self._set_state(EngineState.READY)
            self._ready_event.set()

    def _reply(self, call_id: int, result: Any, failure: tuple[str, str] | None) -> None:
        with self._lock:
            pending = self._calls.get(call_id)
        if pending is None:
            return  # the caller was cancelled
        loop, future = pending
        exc = None if failure is None else _REMOTE_ERRORS.get(failure[0], RuntimeError)(failure[1])
        settle(loop, future, result, exc)

    # --- endings ------------------------------------------------------------------------
    def _exit_reason(self) -> str:
        process = self._process
        if process is not None:
            process.join(5.0)
        code = process.exitcode if process is not None else None
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"the engine process was killed by {signal.Signals(-code).name} (exit code {code})"
        return f"the engine process exited unexpectedly (exit code {code})"

    def _die(self, message: str) -> None:
        if self._state is EngineState.DEAD:
            return
        log.error("engine is dead: %s", message)
        self._error = message
        self._close(EngineState.DEAD, DEAD_MESSAGE)

    def _close(self, final: EngineState, message: str) -> None:
        """Enter the final state; end every request and admin call still pending here."""
        self._set_state(final)
        with self._lock:
            handles, self._requests = list(self._requests.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        routed = []
        for handle in handles:
            handle.seq.finish("error", message)
            routed.append(
                (
                    handle,
                    RequestOutput(
                        handle.request_id, "", [], True, "error", handle.seq.num_prompt_tokens, 0, message
                    ),
                )
            )
        dispatch(routed)
        for loop, future in calls:
            settle(loop, future, None, EngineDead(message))
        self._ready_event.set()
