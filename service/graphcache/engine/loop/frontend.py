"""What the API layer sees of an engine, wherever its step loop runs: state, admission, streams, drain.

Two engines implement it: `Engine` (engine.py: the step loop on a thread of this process) and
`EngineClient` (process.py: the step loop in a child process). Both keep, in this process, the
requests in flight (`_requests`: id -> Handle) and the running count, so both admit a request, refuse
it, stream it and drain the same way; they differ only in how a command reaches the step loop
(`_enqueue`, `abort_all`, `abort`) and where the request check's limits come from (`checker`).
"""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import threading
from collections.abc import AsyncIterator
from collections.abc import Sequence as SequenceT
from pathlib import Path
from typing import Any

from graphcache.config import Settings
from graphcache.engine.errors import (
    DEAD_MESSAGE,
    EngineDead,
    EngineDraining,
    EngineNotReady,
    InvalidRequest,
    QueueFull,
)
from graphcache.engine.loop.messages import Handle, consume
from graphcache.engine.loop.request_check import RequestChecker
from graphcache.engine.lora_modules import LoraModules
from graphcache.engine.sequence import RequestOutput, SamplingParams, Sequence, TokenIds
from graphcache.metrics import Metrics
from graphcache.model.embedding_config import EmbeddingConfig, served_embedding
from graphcache.model.generation_defaults import generation_defaults
from graphcache.model.source import served_name

__all__ = ["EngineFrontend", "EngineState"]

log = logging.getLogger("graphcache.engine")


class EngineState(enum.Enum):
    LOADING = "loading"  # the thread is loading the model and warming up
    READY = "ready"  # serving
    DRAINING = "draining"  # serving what is in flight, refusing new requests (SIGTERM)
    STOPPED = "stopped"  # the thread exited after shutdown()
    DEAD = "dead"  # the thread exited on an unrecoverable error


class EngineFrontend:
    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self._model_name: str | None = None
        # --enable-lora: the adapters a request may name (runtime loads add to it once the engine read them)
        self.lora_modules = (
            LoraModules(settings.lora.lora_modules, reserved=(self.model_name,))
            if settings.lora.enable_lora
            else None
        )
        if (
            metrics is not None
        ):  # the vllm: series' model_name label, also for engines built outside create_app
            metrics.bind_model(self.model_name)
        self._lock = threading.Lock()  # guards _state, _requests, _num_running
        self._state = EngineState.LOADING
        self._requests: dict[str, Handle] = {}
        self._num_running = 0
        self._error: str | None = None
        self._was_ready = False  # a death before the first READY is a failed load, not a run-time fault
        self._ready_event = threading.Event()  # set when ready or dead: wait_ready() returns
        self._stats: dict[str, Any] = {}
        self.progress: dict[str, Any] | None = None  # while loading: the phase, and warmup n/total
        # Request-field defaults from the model's generation_config.json (--generation-config), set once
        # loaded: a request that leaves a field out gets its default here (api/openai/sampling.py).
        self.generation_defaults: dict[str, Any] = {}
        # Set once loaded: how the model's embeddings are made when it is served as an embedding model
        # (--runner pooling, or detected: model/embedding_config.py); None: it serves text generation.
        self.embedding: EmbeddingConfig | None = None

    # --- what the engine implements --------------------------------------------------------
    @property
    def checker(self) -> RequestChecker | None:
        """The request check over the loaded engine's limits; None until loaded (and after release)."""
        raise NotImplementedError

    @property
    def tokenizer(self):
        raise NotImplementedError

    def _enqueue(self, handle: Handle) -> None:
        """Hand an admitted request to the step loop."""
        raise NotImplementedError

    def abort_all(self, reason: str, error: str) -> None:
        """End every request in the step loop with `reason` and `error` (drain timeout)."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    # --- state -----------------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def ready(self) -> bool:
        return self._state is EngineState.READY

    @property
    def alive(self) -> bool:
        return self._state is not EngineState.DEAD

    @property
    def error(self) -> str | None:
        """Why the engine died, in detail (exception text): for the log and /admin/* only."""
        return self._error

    @property
    def load_error(self) -> str | None:
        """Why the engine died before it ever served (the model or warmup failed to load); None while
        loading, once it has served, or after a run-time death (liveness covers that one)."""
        if self._state is EngineState.DEAD and not self._was_ready:
            return self._error or "the engine died while loading the model"
        return None

    @property
    def num_running(self) -> int:
        """Requests in the running batch, as of the last step."""
        return self._num_running

    def refusal(self, *, admin: bool = False) -> Exception | None:
        """Why a request (or, admin=True, an admin command) may not enter now; None if it may."""
        state = self._state
        if state is EngineState.DEAD:
            return EngineDead(DEAD_MESSAGE)
        if state is EngineState.STOPPED:
            return (
                EngineDead("the engine was shut down") if admin else EngineDraining("the server is shut down")
            )
        if state is EngineState.DRAINING and not admin:
            return EngineDraining("the server is shutting down and takes no new requests")
        if state is EngineState.LOADING:
            return EngineNotReady("the model is still loading or warming up; retry when /ready returns 200")
        return None

    def _set_state(self, state: EngineState) -> None:
        with self._lock:
            if self._state in (EngineState.DEAD, EngineState.STOPPED):
                return  # final
            self._state = state
            first_ready = state is EngineState.READY and not self._was_ready
            self._was_ready = self._was_ready or state is EngineState.READY
        if first_ready:
            # Loading and warmup leave a large heap that lives as long as the process; frozen, it is out
            # of every later collection, whose full passes otherwise stall requests 0.5-0.9 s on a CPU.
            # (engine.py unfreezes it when the engine releases the device, so the runner can be collected.)
            gc.freeze()
        if self.metrics is not None:
            self.metrics.ready.set(1 if state is EngineState.READY else 0)

    @property
    def model_name(self) -> str:
        """The served model id: --served-model-name, else the hub id or the directory's name (the
        model setting is classified once: every request compares its model field with this)."""
        if self._model_name is None:
            model = self.settings.model
            if model.served_model_name:
                self._model_name = model.served_model_name
            elif model.path is not None:
                self._model_name = served_name(model.path)
            else:
                self._model_name = "graphcache-tiny"
        return self._model_name

    def _set_generation_defaults(self, model_dir: Path | str | None) -> None:
        """The sampling defaults of --generation-config for the loaded model (its directory): read once
        the model is loaded, before requests are admitted."""
        self.generation_defaults = generation_defaults(self.settings.model.generation_config, model_dir)
        self.embedding = served_embedding(self.settings, model_dir, self.settings.model.path or "")

    def stats(self) -> dict[str, Any]:
        """JSON-able snapshot, refreshed by the step loop (never blocks)."""
        snap = dict(self._stats)
        snap.update(
            model=self.model_name,
            ready=self.ready,
            alive=self.alive,
            state=self._state.value,
            error=self._error,
            in_flight=len(self._requests),
        )
        return snap

    # --- lifecycle -------------------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until ready (True) or dead/timeout (False). For CLIs, tests and benchmarks."""
        self._ready_event.wait(timeout)
        return self.ready

    def stop_accepting(self) -> None:
        if self._state in (EngineState.LOADING, EngineState.READY):
            self._set_state(EngineState.DRAINING)

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
            self.abort_all(
                "error",
                f"the server is shutting down; the request did not finish "
                f"within the {timeout:g}s drain timeout",
            )
            grace = loop.time() + 5.0
            while self._requests and loop.time() < grace and self.alive:
                await asyncio.sleep(0.02)
        return {"in_flight": in_flight, "finished": in_flight - left, "aborted": left}

    # --- requests ----------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_token_ids: SequenceT[int],
        params: SamplingParams | None = None,
        *,
        loop: Any,
        outputs: Any,
        stream: bool = True,
        max_tokens_param: str = "max_tokens",
        enforce_max_queue: bool = True,
    ) -> Handle:
        """Check and admit a request (any thread, no event loop needed); the step loop then delivers its
        outputs with `loop.call_soon_threadsafe(deliver, [(outputs, out), ...])`: an asyncio loop and
        queue, or (in the engine process) a sink that sends them to the API process. Raises at once:
        InvalidRequest, QueueFull, EngineNotReady, EngineDraining, EngineDead."""
        checker = self.checker
        refused = self.refusal()
        if refused is not None or checker is None:
            raise refused or EngineDead(DEAD_MESSAGE)
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params if params is not None else SamplingParams(),
            stream=stream,
        )
        prompt_checked = isinstance(prompt_token_ids, TokenIds) and prompt_token_ids.checked_for(
            checker.limits.vocab_size
        )
        checker.check(seq, max_tokens_param, prompt_checked)  # read-only: the limits never change after load
        handle = Handle(request_id, loop, outputs, seq)
        with self._lock:
            refused = self.refusal()  # again under the lock: death fails everything in _requests
            if refused is not None:
                raise refused
            if request_id in self._requests:
                raise InvalidRequest(f"request id {request_id!r} is already in flight; use a unique id")
            if (
                enforce_max_queue
                and len(self._requests) - self._num_running >= self.settings.engine.max_queue
            ):
                raise QueueFull(f"{self.settings.engine.max_queue} requests are already waiting; retry later")
            self._requests[request_id] = handle
        self._enqueue(handle)
        return handle

    def generate(
        self,
        request_id: str,
        prompt_token_ids: SequenceT[int],
        params: SamplingParams | None = None,
        *,
        stream: bool = True,
        max_tokens_param: str = "max_tokens",
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request; iterate the result for its output deltas. Must be called on an event loop.

        stream=False delivers a single final output holding all text and token ids (one event-loop
        wakeup per request instead of one per token). Raises at once (not on first iteration):
        InvalidRequest, QueueFull, EngineNotReady, EngineDraining, EngineDead. Leaving the iteration
        early (client disconnect) aborts the request and frees its KV blocks.
        """
        handle = self.submit(
            request_id,
            prompt_token_ids,
            params,
            loop=asyncio.get_running_loop(),
            outputs=asyncio.Queue(),
            stream=stream,
            max_tokens_param=max_tokens_param,
        )
        return consume(handle, self.tokenizer, self.abort)
