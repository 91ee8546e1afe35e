"""The Engine: the thread that owns the GPU, and the asyncio API the HTTP floor talks to.

The engine thread builds the runner (model load, KV cache, warmup) and an EngineCore, then loops:
take commands from the inbox, run `core.step()`, deliver the outputs. Nothing else touches the
device. The asyncio side puts commands in a thread-safe inbox (queue.Queue) and gets results back
through `loop.call_soon_threadsafe` into a per-request asyncio.Queue (streams) or a future (admin
calls). Commands run between steps, so admin work never races a replay.

State is one `EngineState`; `refusal()` answers "may a request enter now?" for every caller. State,
admission, generate() and drain are EngineFrontend's (frontend.py), shared with EngineClient
(process.py), which runs this Engine in a child process (GRAPHCACHE_ENGINE_PROCESS).
No request is ever left hanging: every path that ends a request (finish, abort, step failure,
engine death, shutdown, drain timeout) pushes a final RequestOutput with finished=True.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
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
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.loop.failures import MAX_CONSECUTIVE_STEP_FAILURES, EngineFailure
from graphcache.engine.loop.frontend import EngineFrontend, EngineState
from graphcache.engine.loop.lora_admin import load_adapter, unload_adapter
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
from graphcache.engine.loop.step_trace import write_step_trace
from graphcache.engine.lora_modules import LoraModule
from graphcache.engine.plan import Runner
from graphcache.engine.sequence import RequestOutput, SamplingParams, StructuredSpec, TokenLogprob
from graphcache.engine.worker.draft_model import DraftModelProposer, build_draft_proposer, fetch_draft_model
from graphcache.engine.worker.runner import ModelRunner
from graphcache.engine.worker.tp_runner import TensorParallelRunner
from graphcache.graphs.cache import WarmupReport, warmup_order
from graphcache.graphs.descriptor import BatchDescriptor
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
# Capture time an admin warmup may take between two steps while requests run (at least one capture).
WARMUP_SLICE_S = 0.02


class Engine(EngineFrontend):
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
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._core: EngineCore | None = None  # engine thread: set at load, dropped at exit
        self._tokenizer: Any = None  # kept after the runner is released
        self._draft: DraftModelProposer | None = None  # the draft model (speculative decoding), engine thread
        self._max_model_len: int | None = None
        self._outbox: list[tuple[Handle, RequestOutput]] = []  # routed, not yet delivered
        self._warmups: deque[WarmupJob] = deque()  # admin warmups in progress, oldest first
        self._last_stream_flush = 0.0
        self._stats_refreshed = 0.0
        self.warmup_report: Any = None
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

    # --- admin (run on the engine thread between steps) ------------------------------------
    async def _call(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:  # the exiting engine thread fails what is queued under this lock: none is lost
            refused = self.refusal(admin=True)
            if refused is not None:
                raise refused
            self._inbox.put(Call(fn, fut, loop))
        return await fut

    async def warmup(self, descriptors: list[BatchDescriptor] | None = None) -> dict:
        """Capture (and pin) these descriptors; None: the configured warmup again (settings' decode sizes
        and descriptors, or GRAPHCACHE_WARMUP_PROFILE), e.g. after a clear. The captures interleave with
        serving: at most WARMUP_SLICE_S of them between two steps while requests run (stats()["warmup"]
        shows the progress); the answer comes when all are done."""
        if descriptors is not None:
            descriptors = [
                d if isinstance(d, BatchDescriptor) else BatchDescriptor.parse(str(d)) for d in descriptors
            ]
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            refused = self.refusal(admin=True)
            if refused is not None:
                raise refused
            self._inbox.put(WarmupJob(descriptors, fut, loop))
        return await fut

    async def clear_graphs(self) -> dict:
        return await self._call(lambda: self._admin_result(self._clear_graphs()))

    def _clear_graphs(self) -> Any:
        """Clear the target's graph cache, and the draft model's (its report under "draft")."""
        report = self._loaded_core.runner.cache.clear()
        if self._draft is None:
            return report
        return {**jsonable(report), "draft": jsonable(self._draft.runner.cache.clear())}

    async def reset_prefix_cache(self) -> dict:
        """Forget the cached prefixes nobody holds; the KV cache events say so at once."""
        return await self._call(self._reset_prefix_cache)

    def _reset_prefix_cache(self) -> dict:
        core = self._loaded_core
        dropped = core.block_manager.reset_prefix_cache()
        core.flush_kv_events()
        return {"dropped_blocks": dropped}

    async def load_lora_adapter(self, name: str, path: str) -> tuple[int, str]:
        """Read, check and register a LoRA adapter on the engine thread (engine/loop/lora_admin.py)."""
        module = LoraModule(name, path)
        core = self._loaded_core
        lora = core.runner.lora
        weights = None
        if lora is not None:  # read and checked off the engine thread: the batch never waits on the disk
            try:
                weights = await asyncio.to_thread(lora.read_checked, module)
            except ValueError as e:
                return 400, str(e)
        return await self._call(lambda: load_adapter(lora, core.scheduler, module, weights))

    async def unload_lora_adapter(self, name: str) -> tuple[int, str]:
        core = self._loaded_core
        return await self._call(lambda: unload_adapter(core.runner.lora, core.scheduler, name))

    async def cache_profile(self, min_uses: int = 1) -> dict:
        """The hot set of descriptors (GraphCache.profile): what a restart can warm up."""
        return await self._call(lambda: jsonable(self._loaded_core.runner.cache.profile(min_uses)))

    async def cache_info(self) -> dict:
        return await self._call(lambda: jsonable(self._cache_info()))

    def _cache_info(self) -> dict:
        """The target's graph cache, and the draft model's under "draft" (speculative decoding)."""
        info = self._loaded_core.runner.cache.info()
        if self._draft is not None:
            info["draft"] = self._draft.info()
        return info

    def _admin_result(self, report: Any) -> dict:
        self._refresh_stats(force=True)
        out = jsonable(report)
        return out if isinstance(out, dict) else {"result": out}

    # === the engine thread =================================================================
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
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
