"""The engine thread: everything that runs on the thread that owns the GPU.

`_EngineLoop` is a mixin that `Engine` (engine.py) inherits: its methods run on the engine thread
only (load, serve loop, inbox commands, one step, sampling, output delivery, gauges/stats, death
and shutdown), while engine.py keeps the asyncio facade the HTTP floor calls. It is a mixin, not a
separate object, so there is still one `Engine` with one set of attributes (all defined in
`Engine.__init__`) and `Engine._thread_main` stays patchable (benchmarks/profile_engine.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import queue
import time
from typing import Any

import torch

from service.engine.block_manager import BlockManager
from service.engine.common import (
    DEAD_MESSAGE,
    EngineDead,
    RequestOutput,
    _Abort,
    _AbortAll,
    _Add,
    _Call,
    _jsonable,
    _Stop,
)
from service.engine.sampler import Sampler, check_stop, sendable_text
from service.engine.scheduler import Scheduler, SchedulerOutput
from service.engine.sequence import Sequence

log = logging.getLogger("graphcache.engine")

# Consecutive failed steps before the engine declares itself dead (one bad step is survivable:
# its requests fail, the rest keep going; a run of them means the device or model is broken).
MAX_CONSECUTIVE_STEP_FAILURES = 3


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:   # runs on the consumers' event loop
        q.put_nowait(out)


def _is_unrecoverable(exc: BaseException) -> bool:
    # A CUDA fault poisons the context: every later step would fail too.
    text = f"{type(exc).__name__}: {exc}"
    return "AcceleratorError" in text or "CUDA error" in text or "illegal memory access" in text


class _EngineLoop:
    """The engine-thread half of `Engine` (see the module docstring); state lives in `Engine.__init__`."""

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
