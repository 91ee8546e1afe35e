"""The engine: one thread that owns the GPU, and the asyncio API the HTTP floor talks to.

Everything that touches the device (model load, KV allocation, warmup and capture, every step,
admin warmup/clear/info) runs on the engine thread. The asyncio side never touches the runner:
it puts commands in a thread-safe inbox (queue.Queue) and gets results back through
`loop.call_soon_threadsafe` into a per-request asyncio.Queue (streams) or a future (admin calls).
Commands are handled between steps, so admin work never races a replay.

No request is ever left hanging: every path that ends a request (finish, abort, step failure,
engine death, shutdown, drain timeout) pushes a final RequestOutput with finished=True.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.config import Settings
from service.engine.block_manager import BlockManager
from service.engine.sampler import Sampler, check_stop, sendable_text
from service.engine.scheduler import Scheduler, SchedulerOutput
from service.engine.sequence import SamplingParams, Sequence
from service.metrics import Metrics

__all__ = ["Engine", "EngineDead", "EngineDraining", "EngineNotReady", "QueueFull", "RequestOutput",
           "SamplingParams"]

log = logging.getLogger("graphcache.engine")

# Consecutive failed steps before the engine declares itself dead (one bad step is survivable:
# its requests fail, the rest keep going; a run of them means the device or model is broken).
MAX_CONSECUTIVE_STEP_FAILURES = 3

# What clients (request errors, unauthenticated probes) are told when the engine dies. The cause
# (an exception text that can carry internal paths and device details) goes to the log and to
# `Engine.error`, which only authenticated /admin/* shows.
DEAD_MESSAGE = "the engine stopped after an unrecoverable error; see the server log"


class QueueFull(Exception):
    """The waiting queue is at max_queue: retry later (HTTP 429)."""


class EngineNotReady(Exception):
    """The model is still loading or warming up (HTTP 503)."""


class EngineDraining(EngineNotReady):
    """The engine stopped accepting requests (SIGTERM drain); HTTP 503."""


class EngineDead(Exception):
    """The engine thread hit an unrecoverable error; `Engine.error` says which (its message does not)."""


@dataclass
class RequestOutput:
    """One streamed delta of a request. The last one has finished=True and a finish_reason."""

    request_id: str
    text: str                      # new text since the previous output
    token_ids: list[int]           # new token ids since the previous output
    finished: bool
    finish_reason: str | None      # stop | length | abort | error (None until finished)
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None       # message when finish_reason == "error" (safe to show a client)


# --- inbox commands ----------------------------------------------------------------------------

@dataclass
class _Handle:
    request_id: str
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    seq: Sequence
    stream: bool = True    # False: only the final output (carrying everything) is delivered


@dataclass
class _Add:
    handle: _Handle


@dataclass
class _Abort:
    request_id: str
    reason: str = "abort"
    error: str | None = None


@dataclass
class _AbortAll:
    reason: str
    error: str


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class _Stop:
    pass


def _default_runner_factory(settings: Settings, metrics: Metrics | None):
    from service.engine.runner import ModelRunner  # imported lazily: it pulls in torch + the model

    return ModelRunner(settings, metrics)


def _jsonable(obj: Any) -> Any:
    """Cache reports (dataclasses holding descriptors, enums, tuples) -> plain JSON types."""
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if type(obj).__name__ == "BatchDescriptor":
        return str(obj)
    if hasattr(obj, "to_dict"):
        return _jsonable(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [_jsonable(v) for v in obj]
    return str(obj)


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:   # runs on the consumers' event loop
        q.put_nowait(out)


def _is_unrecoverable(exc: BaseException) -> bool:
    # A CUDA fault poisons the context: every later step would fail too.
    text = f"{type(exc).__name__}: {exc}"
    return "AcceleratorError" in text or "CUDA error" in text or "illegal memory access" in text


class Engine:
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

    # =========================================================================================
    # Engine thread
    # =========================================================================================
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
                log.exception("engine thread crashed")
                self._die(f"{type(exc).__name__}: {exc}")
                return
            self._close("the engine was shut down before the request finished")
        finally:
            self._release_device()

    def _release_device(self) -> None:
        """Drop the runner (weights, KV cache, graph pools) on the thread that owns them, so a
        process can start another engine (benchmarks, tests) without holding two KV caches."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._tokenizer, self._max_model_len_loaded = runner.tokenizer, runner.max_model_len
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _load(self) -> None:
        s = self.settings
        runner = self._runner_factory(s, self.metrics)
        reserved = int(getattr(runner, "reserved_blocks", 0))
        bm = BlockManager(runner.num_kv_blocks, runner.block_size, first_usable_block=reserved)
        self._scheduler = Scheduler(bm, max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                                    max_model_len=runner.max_model_len)
        self._sampler = Sampler(default_seed=s.seed)
        tok = runner.tokenizer
        eos = getattr(tok, "eos_token_ids", None)
        if eos is None and getattr(runner, "model_config", None) is not None:
            eos = runner.model_config.eos_token_ids
        self._eos_token_ids = frozenset(eos or ())
        cfg = getattr(runner, "model_config", None)
        self._vocab_size = getattr(cfg, "vocab_size", None)
        self._runner = runner
        t0 = time.perf_counter()
        self.warmup_report = runner.warmup()
        self.warmup_seconds = time.perf_counter() - t0
        log.info("engine ready: %d KV blocks x %d tokens, max_model_len %d, warmup %.2fs", bm.num_usable,
                 bm.block_size, runner.max_model_len, self.warmup_seconds)
        self._refresh_stats(force=True)
        with self._lock:
            self._ready = True
        if self.metrics is not None:
            self.metrics.ready.set(1)
        self._ready_event.set()

    def _serve(self) -> None:
        sched = self._scheduler
        while not self._stop_requested:
            self._process_inbox(block=not sched.has_work())
            if self._stop_requested:
                break
            if sched.has_work():
                self._step()
            # Also after commands alone: an abort that empties the engine must show in the gauges.
            self._update_gauges()
            self._refresh_stats()
            self._flush_outputs()

    def _process_inbox(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle_command(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle_command(self, cmd: Any) -> None:
        sched = self._scheduler
        if isinstance(cmd, _Add):
            seq = cmd.handle.seq
            if cmd.handle.request_id not in self._requests:
                return   # failed while queued (drain/abort-all raced the add)
            if self.tokenizer is not None:
                seq.detokenizer = self.tokenizer.detokenizer(seq.prompt_token_ids, seq.params.stop)
                seq.defer_text = not cmd.handle.stream and not seq.params.stop
            sched.add(seq)
        elif isinstance(cmd, _Abort):
            handle = self._requests.get(cmd.request_id)
            if handle is not None and not handle.seq.is_finished:
                sched.finish(handle.seq, cmd.reason, cmd.error)
                self._emit(handle.seq)
        elif isinstance(cmd, _AbortAll):
            for handle in list(self._requests.values()):
                if not handle.seq.is_finished:
                    sched.finish(handle.seq, cmd.reason, cmd.error)
                    self._emit(handle.seq)
        elif isinstance(cmd, _Call):
            try:
                result = cmd.fn()
            except Exception as exc:  # admin errors go back to the caller, the engine keeps serving
                log.exception("admin command failed")
                self._resolve(cmd, exc=exc)
            else:
                self._resolve(cmd, result=result)
        elif isinstance(cmd, _Stop):
            self._stop_requested = True

    @staticmethod
    def _resolve(cmd: _Call, result: Any = None, exc: BaseException | None = None) -> None:
        def settle() -> None:
            if cmd.future.done():
                return   # the awaiting task was cancelled
            if exc is not None:
                cmd.future.set_exception(exc)
            else:
                cmd.future.set_result(result)
        with contextlib.suppress(RuntimeError):   # the loop is closed: nobody is waiting
            cmd.loop.call_soon_threadsafe(settle)

    # --- one step --------------------------------------------------------------------------
    def _step(self) -> None:
        sched = self._scheduler
        plan: SchedulerOutput = sched.schedule()
        for seq in plan.failed:
            log.warning("request %s cannot fit: %s", seq.request_id, seq.error)
            self._emit(seq)
        if plan.preempted and self.metrics is not None:
            self.metrics.preemptions.inc(len(plan.preempted))
        if plan.empty:
            # Work exists but nothing fit this step (should not happen: blocks only come back when
            # requests finish). Do not spin a core on it; the next inbox command or step retries.
            self._update_gauges()
            time.sleep(0.001)
            return
        batch = plan.to_batch()
        sample_seqs = [s.seq for s in plan.scheduled if s.need_logits]
        t0 = time.perf_counter()
        try:
            if self.step_failpoint is not None:
                self.step_failpoint(batch)
            cache_steps = self._cache_step_count()
            logits = self._runner.execute(batch)
            tokens = self._sample(logits[:len(sample_seqs)], sample_seqs)
        except Exception as exc:
            self._step_failed(plan, exc)
            return
        elapsed = time.perf_counter() - t0
        self._consecutive_failures = 0
        mode = getattr(self._runner, "last_mode", None) or "eager"
        self._num_steps += 1
        self._steps_by_mode[mode] = self._steps_by_mode.get(mode, 0) + 1
        m = self.metrics
        if m is not None:
            if self._cache_step_count() == cache_steps:
                m.steps.labels(mode).inc()   # the cache counts steps it ran; count those that bypassed it
            m.step_seconds.labels(mode).observe(elapsed)
            m.batch_size.observe(len(plan.scheduled))
        sched.on_step_done(plan)
        now = time.monotonic()
        if m is not None and sample_seqs:
            m.generation_tokens.inc(sum(t is not None for t in tokens))
        for seq, token in zip(sample_seqs, tokens, strict=True):
            if token is None:   # its own sampling failed (logged): only this request ends
                sched.finish(seq, "error", "sampling the next token for this request failed on the server; "
                                           "retry the request, or with other sampling parameters")
                self._emit(seq)
                continue
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
                if m is not None:
                    m.ttft.observe(now - seq.arrival_time)
                    m.prompt_tokens.inc(seq.num_prompt_tokens)
            seq.last_token_time = now
            reason = check_stop(seq, token, eos_token_ids=self._eos_token_ids, max_model_len=sched.max_model_len)
            if reason is not None:
                sched.finish(seq, reason)
            self._emit(seq)
        self._update_gauges()

    def _sample(self, logits: Any, seqs: list[Sequence]) -> list[int | None]:
        """Sample the batch. The sampler does not raise for validated parameters; if it raises
        anyway, each row is sampled alone, so a request whose row fails ends by itself (None in
        its place) and neither fails the requests batched with it nor counts toward engine death
        (MAX_CONSECUTIVE_STEP_FAILURES). A device fault is not any one request's: it raises."""
        try:
            return self._sampler.sample(logits, seqs)
        except Exception as exc:
            if _is_unrecoverable(exc):
                raise
            if len(seqs) == 1:
                self._sampling_failed(seqs[0], exc)
                return [None]
            log.warning("batched sampling failed (%s: %s); sampling the %d rows one by one",
                        type(exc).__name__, exc, len(seqs))
        tokens: list[int | None] = []
        for i, seq in enumerate(seqs):
            try:
                tokens.extend(self._sampler.sample(logits[i:i + 1], [seq]))
            except Exception as exc:
                if _is_unrecoverable(exc):
                    raise
                self._sampling_failed(seq, exc)
                tokens.append(None)
        return tokens

    @staticmethod
    def _sampling_failed(seq: Sequence, exc: Exception) -> None:
        p = seq.params
        log.error("sampling failed for request %s (temperature=%r top_p=%r top_k=%r seed=%r): %s: %s",
                  seq.request_id, p.temperature, p.top_p, p.top_k, p.seed, type(exc).__name__, exc, exc_info=exc)

    def _step_failed(self, plan: SchedulerOutput, exc: Exception) -> None:
        self._consecutive_failures += 1
        ids = [s.seq.request_id for s in plan.scheduled]
        log.error("step failed (%d in a row) for requests %s: %s: %s", self._consecutive_failures, ids,
                  type(exc).__name__, exc, exc_info=exc)
        message = "the model step for this request failed on the server; retry the request"
        for s in plan.scheduled:
            if not s.seq.is_finished:
                self._scheduler.finish(s.seq, "error", message)
                self._emit(s.seq)
        self._update_gauges()
        if _is_unrecoverable(exc) or self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise RuntimeError(f"{self._consecutive_failures} failed steps in a row, last: "
                               f"{type(exc).__name__}: {exc}") from exc

    # --- outputs ---------------------------------------------------------------------------
    def _emit(self, seq: Sequence) -> None:
        """Push what `seq` has not streamed yet to its consumer; on finish, retire the request."""
        handle = self._requests.get(seq.request_id)
        if handle is None or handle.seq is not seq:
            return
        finished = seq.is_finished
        if not finished and not handle.stream:
            return   # everything accumulates into the final output
        new_ids = seq.output_token_ids[seq.num_tokens_sent:]
        seq.num_tokens_sent = seq.num_output_tokens
        text = sendable_text(seq, finished)
        if not finished and not new_ids and not text:
            return
        out = RequestOutput(seq.request_id, text, new_ids, finished, seq.finish_reason, seq.num_prompt_tokens,
                            seq.num_output_tokens, seq.error)
        if finished:
            with self._lock:
                self._requests.pop(seq.request_id, None)
            m = self.metrics
            if m is not None:
                m.requests_finished.labels(seq.finish_reason).inc()
                m.e2e.observe(time.monotonic() - seq.arrival_time)
                if seq.num_output_tokens > 1 and seq.first_token_time is not None:
                    # Mean time between output tokens of this request (per request, not per token:
                    # a histogram observation per token costs ~1 ms a step at batch 256).
                    m.tpot.observe((seq.last_token_time - seq.first_token_time) / (seq.num_output_tokens - 1))
        self._outbox.append((handle, out))

    def _flush_outputs(self) -> None:
        """Deliver queued outputs. Runs after stats/gauges are updated, so a consumer that sees
        its final output also sees its blocks freed in stats(). One wakeup per event loop per
        step, not one per request: at batch 256 per-request wakeups cost milliseconds a step."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for handle, out in outbox:
            by_loop.setdefault(handle.loop, []).append((handle.outputs, out))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):   # the consumer's loop is closed
                loop.call_soon_threadsafe(_deliver, items)

    def _cache_step_count(self) -> int | None:
        cache = getattr(self._runner, "cache", None)
        if cache is None or self.metrics is None:
            return None
        st = cache.stats()
        return getattr(st, "steps_replay", 0) + getattr(st, "steps_eager", 0)

    def _update_gauges(self) -> None:
        sched = self._scheduler
        with self._lock:
            self._num_running = len(sched.running)
        if self.metrics is not None:
            self.metrics.requests_running.set(len(sched.running))
            self.metrics.requests_waiting.set(len(sched.waiting))
            self.metrics.kv_usage.set(sched.block_manager.usage)

    def _refresh_stats(self, force: bool = False) -> None:
        """Engine counters every call (cheap); cache stats at most every 0.25 s (may walk entries)."""
        sched = self._scheduler
        bm = sched.block_manager
        now = time.monotonic()
        cache_stats = self._stats.get("cache")
        cache = getattr(self._runner, "cache", None)
        if cache is not None and (force or now - self._stats_refreshed >= 0.25):
            self._stats_refreshed = now
            try:
                cache_stats = _jsonable(cache.stats())
            except Exception as exc:  # stats must never take the engine down
                cache_stats = {"error": str(exc)}
        self._stats = {
            "model": self.model_name, "running": len(sched.running), "waiting": len(sched.waiting),
            "kv_usage": bm.usage, "kv_blocks_total": bm.num_usable, "kv_blocks_free": bm.num_free,
            "block_size": bm.block_size, "max_model_len": sched.max_model_len, "steps": self._num_steps,
            "steps_by_mode": dict(self._steps_by_mode), "preemptions": sched.num_preemptions,
            "warmup_seconds": self.warmup_seconds, "cache": cache_stats,
        }

    # --- endings ---------------------------------------------------------------------------
    def _die(self, message: str) -> None:
        """Mark the engine dead. `message` (exception text) is logged and kept in `error` for
        /admin/*; the requests it fails and the probes get DEAD_MESSAGE, which leaks nothing."""
        log.error("engine is dead: %s", message)
        with self._lock:
            self._dead = True
            self._ready = False
            self._error = message
        if self.metrics is not None:
            self.metrics.ready.set(0)
        self._ready_event.set()
        self._close(DEAD_MESSAGE)

    def _close(self, message: str) -> None:
        """Fail every request and admin call still pending (engine thread, at exit)."""
        with self._lock:
            self._accepting = False
            self._stopped = True
            self._ready = False
            handles = list(self._requests.values())
        for handle in handles:
            seq = handle.seq
            if not seq.is_finished:
                if self._scheduler is not None and (seq in self._scheduler.running or seq in self._scheduler.waiting):
                    self._scheduler.finish(seq, "error", message)
                else:
                    seq.finish("error", message)
            self._emit(seq)
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Call):
                self._resolve(cmd, exc=EngineDead(message))
            elif isinstance(cmd, _Add) and not cmd.handle.seq.is_finished:
                cmd.handle.seq.finish("error", message)
                self._emit(cmd.handle.seq)
        if self._scheduler is not None:
            self._update_gauges()
            self._refresh_stats(force=True)
        self._flush_outputs()
