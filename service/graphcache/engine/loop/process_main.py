"""The engine process: an `Engine` (model, KV cache, step loop on its thread) serving one pipe to the API
process (engine/loop/process.py, GRAPHCACHE_ENGINE_PROCESS). Started by multiprocessing's spawn context.

Messages on the pipe, tuples whose first item names them:
  API -> engine: ("add", id, prompt_ids, params, stream, max_tokens_param), ("abort", id),
    ("abort_all", reason, error), ("call", call_id, name, args), ("stop_accepting",), ("shutdown",)
  engine -> API: ("out", packed outputs, num_running): one per step, sent by the engine thread
    (`pack_outputs`: a plain token delta as a tuple, the rest as RequestOutput);
    ("snapshot", state, error, progress, stats), ("ready", EngineLimits, tokenizer_dir),
    ("reply", call_id, result, None) or ("reply", call_id, None, (exception type name, message))

The main thread reads commands; the engine thread sends outputs (through `PipeSink`, which stands in
for the asyncio loop of a request's consumer: Engine._flush_outputs makes one call per step); a
snapshot thread pushes state, stats and progress when they change (stats at most every
SNAPSHOT_INTERVAL_S); admin calls, coroutines of Engine, run on an event loop thread of their own.
The process ends on "shutdown" or when the pipe closes (the API process is gone).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from prometheus_client import generate_latest

from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine
from graphcache.engine.loop.frontend import EngineState
from graphcache.engine.loop.messages import pack_outputs
from graphcache.engine.sequence import RequestOutput
from graphcache.metrics import Metrics

__all__ = ["ADMIN_CALLS", "SNAPSHOT_INTERVAL_S", "main"]

log = logging.getLogger("graphcache.engine")
SNAPSHOT_INTERVAL_S = 0.25
STATE_POLL_S = 0.02  # how soon a state change (ready, dead) or a load progress step is pushed
# The Engine coroutines the API process may call by name.
ADMIN_CALLS = (
    "warmup",
    "clear_graphs",
    "cache_profile",
    "cache_info",
    "load_lora_adapter",
    "unload_lora_adapter",
    "reset_prefix_cache",
)


class PipeSink:
    """Where the engine thread delivers outputs: `call_soon_threadsafe(deliver, items)` as on an event
    loop, but the step's outputs go to the API process in one message."""

    def __init__(self, send, engine: Engine) -> None:
        self._send, self._engine = send, engine

    def call_soon_threadsafe(self, _deliver, items: list[tuple[Any, RequestOutput]]) -> None:
        self._send(("out", pack_outputs([out for _, out in items]), self._engine.num_running))


class EngineServer:
    def __init__(self, conn: Connection, settings: Settings) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()  # the engine, snapshot and admin threads all send
        self.metrics = Metrics(process_collectors=False)
        self.engine = Engine(settings, self.metrics)
        self.sink = PipeSink(self.send, self.engine)
        self.loop = asyncio.new_event_loop()
        self._stopping = threading.Event()

    def send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, EOFError, ValueError):  # the API process is gone: the reader sees EOF and stops
            pass

    def run(self) -> None:
        self.engine.start()
        threading.Thread(target=self.loop.run_forever, name="graphcache-engine-admin", daemon=True).start()
        snapshots = threading.Thread(
            target=self._push_snapshots, name="graphcache-engine-snapshots", daemon=True
        )
        snapshots.start()
        try:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    log.warning("the API process closed the engine pipe; stopping the engine")
                    break
                if message[0] == "shutdown":
                    break
                self._handle(message)
        finally:
            self.engine.shutdown()
            self._stopping.set()
            snapshots.join(5.0)
            self.loop.call_soon_threadsafe(self.loop.stop)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            self._add(*message[1:])
        elif kind == "abort":
            self.engine.abort(message[1])
        elif kind == "abort_all":
            self.engine.abort_all(message[1], message[2])
        elif kind == "stop_accepting":
            self.engine.stop_accepting()
        elif kind == "call":
            self._call(*message[1:])
        else:
            log.error("unknown message from the API process: %r", kind)

    def _add(
        self, request_id: str, prompt_ids: list[int], params, stream: bool, max_tokens_param: str
    ) -> None:
        """The API process checked and admitted the request (the queue limit is its to enforce); checking
        again here is cheap and compiles a grammar off the engine thread. A refusal ends the request."""
        try:
            self.engine.submit(
                request_id,
                prompt_ids,
                params,
                loop=self.sink,
                outputs=None,
                stream=stream,
                max_tokens_param=max_tokens_param,
                enforce_max_queue=False,
            )
        except Exception as exc:  # noqa: BLE001 - whatever refused it, the request must end, not hang
            message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            refusal = RequestOutput(request_id, "", [], True, "error", len(prompt_ids), 0, message)
            self.send(("out", pack_outputs([refusal]), self.engine.num_running))

    def _call(self, call_id: int, name: str, args: tuple) -> None:
        if name == "metrics_text":  # read-only, thread-safe: answered at once
            self._reply(call_id, lambda: generate_latest(self.metrics.registry).decode())
            return
        if name not in ADMIN_CALLS:
            self.send(("reply", call_id, None, ("ValueError", f"unknown engine call {name!r}")))
            return
        future = asyncio.run_coroutine_threadsafe(getattr(self.engine, name)(*args), self.loop)
        future.add_done_callback(lambda f: self._reply(call_id, f.result))

    def _reply(self, call_id: int, result) -> None:
        try:
            value = result()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the API process with its type and message
            self.send(("reply", call_id, None, (type(exc).__name__, str(exc))))
        else:
            self.send(("reply", call_id, value, None))

    def _push_snapshots(self) -> None:
        """State, error and progress as soon as they change; stats when they changed, at most every
        SNAPSHOT_INTERVAL_S. The limits go once, before the first READY snapshot."""
        engine = self.engine
        last_head, last_stats, stats_at, ready_sent = None, None, 0.0, False
        while not self._stopping.wait(STATE_POLL_S):
            state, checker = engine.state, engine.checker
            if state is EngineState.READY and not ready_sent and checker is not None:
                runner = engine.runner  # None if the engine stopped since
                model_path = str(runner.model_path) if runner is not None else ""
                self.send(("ready", checker.limits, model_path, engine.max_model_len))
                ready_sent = True
            head = (state.value, engine.error, engine.progress)
            now = time.monotonic()
            if head == last_head and now - stats_at < SNAPSHOT_INTERVAL_S:
                continue
            stats, stats_at = engine.stats(), now
            if head != last_head or stats != last_stats:
                self.send(("snapshot", *head, stats))
                last_head, last_stats = head, stats
        self.send(("snapshot", engine.state.value, engine.error, engine.progress, engine.stats()))


def main(
    conn: Connection, settings: Settings, setup_logging: Callable[[str, str], None] | None = None
) -> None:
    """The spawned process's entry point. setup_logging(log_format, log_level): the API process's own
    (api/server/request_log.py), so both processes log alike to the same stream."""
    # Ctrl-C reaches the whole process group, and systemd's default stop SIGTERMs every process of the
    # service: the API process drains, then stops this one through the pipe. If it dies instead, the
    # pipe closes and this process stops too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if setup_logging is not None:
        setup_logging(settings.logging.log_format, settings.logging.log_level)
    EngineServer(conn, settings).run()
