"""The Engine: the thread that owns the GPU, and the asyncio API the HTTP floor talks to.

The engine thread builds the runner (model load, KV cache, warmup) and an EngineCore, then loops:
take commands from the inbox, run `core.step()`, deliver the outputs (engine_thread.py). Nothing else
touches the device. The asyncio side puts commands in a thread-safe inbox (queue.Queue) and gets results
back through `loop.call_soon_threadsafe` into a per-request asyncio.Queue (streams) or a future (admin
calls: admin_calls.py). Commands run between steps, so admin work never races a replay.

State is one `EngineState`; `refusal()` answers "may a request enter now?" for every caller. State,
admission, generate() and drain are EngineFrontend's (frontend.py), shared with EngineClient
(process.py), which runs this Engine in a child process (GRAPHCACHE_ENGINE_PROCESS).
This module owns the engine thread's lifetime: start, load (fetch, runner, core, warmup), serve, then
die or stop, and release the device.
No request is ever left hanging: every path that ends a request (finish, abort, step failure,
engine death, shutdown, drain timeout) pushes a final RequestOutput with finished=True.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from graphcache.config import Settings
from graphcache.engine.errors import (
    DEAD_MESSAGE,
    EngineDead,
    EngineDraining,
    EngineNotReady,
    InvalidRequest,
    QueueFull,
)
from graphcache.engine.loop.admin_calls import EngineAdmin
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.loop.failures import MAX_CONSECUTIVE_STEP_FAILURES, EngineFailure
from graphcache.engine.loop.frontend import EngineState
from graphcache.engine.loop.messages import Abort, AbortAll, Add, Fail, Handle, Stop
from graphcache.engine.loop.step_trace import write_step_trace
from graphcache.engine.plan import Runner
from graphcache.engine.sequence import RequestOutput, SamplingParams, StructuredSpec, TokenLogprob
from graphcache.engine.worker.draft_model import build_draft_proposer, fetch_draft_model
from graphcache.engine.worker.runner import ModelRunner
from graphcache.engine.worker.tp_runner import TensorParallelRunner
from graphcache.graphs.cache import WarmupReport
from graphcache.metrics import Metrics
from graphcache.model.source import fetch_hub_model, model_source

__all__ = [
    "DEAD_MESSAGE",
    "MAX_CONSECUTIVE_STEP_FAILURES",
    "Engine",
    "EngineDead",
    "EngineDraining",
    "EngineNotReady",
    "EngineState",
    "InvalidRequest",
    "QueueFull",
    "RequestOutput",
    "SamplingParams",
    "StructuredSpec",
    "TokenLogprob",
]

log = logging.getLogger("graphcache.engine")
GIL_SWITCH_INTERVAL_S = 0.0005


class Engine(EngineAdmin):
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        *,
        runner_factory: Callable[[Settings, Metrics | None], Runner] | None = None,
    ) -> None:
        super().__init__(settings, metrics)
        if (
            runner_factory is None and settings.model.tensor_parallel_size > 1
        ):  # rank 0 of N processes it starts
            runner_factory = TensorParallelRunner.start
        self._runner_factory: Callable[[Settings, Metrics | None], Runner] = (
            runner_factory or ModelRunner
        )  # tests pass a fake
        self._thread: threading.Thread | None = None
        self.warmup_report: Any = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the engine thread (load, warmup, serve) and return at once."""
        if self._thread is not None:
            raise RuntimeError("Engine.start() called twice")
        # The engine thread shares the interpreter lock with the HTTP event loop. When a step's wait
        # for the GPU ends, the engine thread must get the lock back at once, not after the 5 ms
        # default switch interval of a busy event loop (that alone would cap a 4 ms step loop).
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._thread_main, name="graphcache-engine", daemon=True)
        self._thread.start()

    def fail(self, reason: str) -> None:
        """Any thread: the engine cannot serve any more (a tensor-parallel rank died): the engine thread
        dies at its next turn (within 0.5 s when idle), failing what is in flight; /health turns 503."""
        if self.alive:
            self._inbox.put(Fail(reason))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread and join it. Unfinished requests get finish_reason error."""
        self.stop_accepting()
        self._inbox.put(Stop())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("engine thread did not stop within %.0fs", timeout)

    # --- requests ----------------------------------------------------------------------------
    def _enqueue(self, handle: Handle) -> None:
        self._inbox.put(Add(handle))

    def abort_all(self, reason: str, error: str) -> None:
        self._inbox.put(AbortAll(reason, error))

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op if unknown or finished). Its blocks are freed between steps."""
        if self.alive:
            self._inbox.put(Abort(request_id))

    # --- the engine thread's lifetime: load, serve, die or stop, release ----------------------
    def _thread_main(self) -> None:
        try:
            try:
                self._load()
            except BaseException as exc:  # noqa: BLE001 - any load failure must be reported, not hang /ready
                log.exception("engine failed to load the model")
                self._die(f"model load failed: {type(exc).__name__}: {exc}")
                return
            try:
                self._serve()
            except BaseException as exc:  # noqa: BLE001
                if not isinstance(exc, EngineFailure):
                    log.exception("engine thread crashed")
                self._die(f"{type(exc).__name__}: {exc}")
                return
            self._close(EngineState.STOPPED, "the engine was shut down before the request finished")
        finally:
            self._release_device()

    def _fetched_settings(self) -> Settings:
        """The settings the runner loads from: a hub id fetched into the Hugging Face cache (/ready says
        "downloading" meanwhile) and replaced by its snapshot directory, the served name kept; a local
        directory or the embedded model as they are."""
        model = self.settings.model
        if model.path is None:
            return self.settings
        source = model_source(model.path)
        if not source.is_hub:
            if model.revision:
                log.warning(
                    "revision %r is ignored: model %s is a local directory", model.revision, model.path
                )
            return self.settings
        repo = source.spec
        self.progress = {"phase": "downloading", "model": repo}

        def download_progress(report: dict[str, Any]) -> None:  # /ready's body while downloading
            self.progress = {"phase": "downloading", "model": repo, **report}

        folder = fetch_hub_model(repo, model.revision, download_progress)
        return self.settings.updated(model=str(folder), served_model_name=self.model_name)

    def _load(self) -> None:
        settings = fetch_draft_model(
            self._fetched_settings(), lambda report: setattr(self, "progress", report)
        )
        self.progress = {"phase": "loading model"}
        log.info("loading model %s", settings.model.path or "(the embedded tiny model)")
        from graphcache.model.loader import reporting_shards  # torch: the engine thread has it anyway

        def shard_progress(done: int, total: int, name: str) -> None:  # /ready's body while loading
            self.progress = {
                "phase": f"loading weights {done}/{total}",
                "done": done,
                "total": total,
                "file": name,
            }

        with reporting_shards(shard_progress):
            runner = self._runner_factory(settings, self.metrics)
        try:
            self._draft = build_draft_proposer(settings, runner, self.metrics)  # speculative decoding's draft
            core = EngineCore(runner, settings, self.metrics, proposer=self._draft)
            self._set_generation_defaults(str(runner.model_path))
        except BaseException:
            self._draft = None
            runner.close()
            raise
        if self.generation_defaults:
            log.info(
                "sampling defaults from generation_config.json (--generation-config %s): %s; a request's "
                "own value wins; --generation-config vllm ignores them",
                settings.model.generation_config,
                ", ".join(f"{k}={v}" for k, v in self.generation_defaults.items()),
            )
        runner.watch(self.fail)  # tensor parallel: a worker rank that dies kills this engine, even idle
        core.step_failpoint = self.step_failpoint
        self._core, self._tokenizer, self._max_model_len = core, runner.tokenizer, runner.max_model_len

        def warmup_progress(done: int, total: int, desc: str) -> None:
            # /ready's body and the gauges; the cache logs each capture (ms, bytes)
            self.progress = {"phase": "warmup", "done": done, "total": total, "descriptor": desc}
            if self.metrics is not None:
                self.metrics.warmup_done.set(done)
                self.metrics.warmup_total.set(total)

        self.progress = {"phase": "warmup", "done": 0, "total": None}
        t0 = time.perf_counter()
        if self.embedding is not None:
            # Embedding requests are prefill only and run eagerly: the graphs of decode steps would never run.
            e = self.embedding
            log.info(
                "serving embeddings: %s pooling, normalize %s (%s); no warmup captures",
                e.pooling,
                e.normalize,
                e.source,
            )
            self.warmup_report = WarmupReport()
        else:
            self.warmup_report = runner.warmup(progress=warmup_progress)  # the sampler's kernels too
        if self._draft is not None:
            self._draft.warmup()  # the draft's own graphs (its report is its cache's: /admin/cache "draft")
        self.warmup_seconds = time.perf_counter() - t0
        bm = core.block_manager
        log.info(
            "engine ready: %d KV blocks x %d tokens, max_model_len %d, warmup %.2fs",
            bm.num_usable,
            bm.block_size,
            runner.max_model_len,
            self.warmup_seconds,
        )
        self._refresh_stats(force=True)
        self.progress = None
        self._set_state(EngineState.READY)
        self._ready_event.set()

    # --- endings ---------------------------------------------------------------------------
    def _release_device(self) -> None:
        """Drop the core and runner (weights, KV cache, graph pools) on the thread that owns them, so
        a process can start another engine (benchmarks, tests) without holding two KV caches."""
        core, self._core = self._core, None
        self._draft = None
        if core is None:
            return
        if core.step_trace is not None:
            write_step_trace(self.settings.engine.step_trace, core.step_trace)
        core.close()
        try:
            core.runner.close()  # tensor parallel: stop the worker ranks
        except Exception:  # noqa: BLE001 - the engine is exiting either way
            log.exception("closing the runner failed")
        del core
        # The heap was frozen once the engine was ready (frontend.py: gc.freeze), the runner's reference
        # cycles with it (the graph cache's step function is a method of the runner): frozen objects are
        # never collected, so without unfreezing, weights, KV cache and graph pools would outlive the engine.
        gc.unfreeze()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
