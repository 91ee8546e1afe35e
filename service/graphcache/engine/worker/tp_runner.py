"""Rank 0's runner at tensor_parallel_size N > 1: start the other ranks, and make every one of them run
the same steps and the same cache operations, in the same order (docs/TENSOR_PARALLEL.md).

`TensorParallelRunner.start(settings, metrics)` is the Engine's runner factory at N > 1. It spawns ranks
1..N-1 (engine/worker/tp_worker.py), joins the group with them, loads rank 0's shard, and waits until every
worker has loaded its own. Then it is a Runner like ModelRunner, wrapping rank 0's:
- `execute(plan)` first sends the step's plan to every worker on its pipe (the plan pickles as it is;
  the ids of the step in flight that its rows read, a device tensor, follow through a broadcast on the
  model's group: stream-ordered, no host sync), then runs rank 0's shard, which samples; the collectives
  inside the model keep the ranks in lockstep, and every rank's request table follows the same plans;
- admin operations that touch the cache (warmup, capture, clear, evict) are sent to every worker, applied
  on rank 0, and the workers' outcomes compared with rank 0's: the same outcome everywhere, or the
  ranks have split and the engine dies (GraphCache's agreement keeps the captures themselves agreed);
- cache reads (info, stats, profile, entries) stay on rank 0, whose state equals every rank's; /admin/cache
  adds each rank's pool bytes (Decision.rank_bytes) and decision-log digest.

Failures are loud, never a hang: a step that fails at N > 1 ends the engine (`RankLost`, which the core
treats as a device fault: the ranks cannot be put back in step); a watcher thread sees a worker exit
at any time (idle too) and tells the engine (`watch(engine.fail)`); rank 0 waits for a worker's reply
with a deadline and while watching the process. `close()` (the engine's exit) stops the workers and
leaves the group.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from graphcache.config import Settings
from graphcache.engine.plan import StepOutput, StepPlan
from graphcache.engine.worker.runner import ModelRunner
from graphcache.engine.worker.tp_worker import (
    COLLECTIVE_TIMEOUT_S,
    build_rank_runner,
    free_port,
    worker_main,
)
from graphcache.graphs.cache_reports import CacheStats, ClearReport, EntryInfo, WarmupReport
from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.graphs.policy.agreement import Decision, fingerprint
from graphcache.metrics import Metrics
from graphcache.model.config import read_config
from graphcache.model.parallel import check_shardable
from graphcache.model.tiny import default_model_dir

__all__ = ["RankLost", "TensorParallelRunner"]

log = logging.getLogger("graphcache.tp")
STOP_TIMEOUT_S = 30.0


class RankLost(RuntimeError):
    """A tensor-parallel rank died, failed a step, or split from rank 0: the engine cannot go on."""

    fatal = True  # EngineCore: like a device fault, the engine dies at once (requests end with errors)


@dataclass
class _Worker:
    rank: int
    process: Any  # multiprocessing.Process (spawn)
    conn: Any  # rank 0's end of its pipe

    def describe_exit(self) -> str:
        """Why the worker is gone: what it said on the pipe last, else its exit code."""
        said = ""
        try:
            while self.conn.poll():
                message = self.conn.recv()
                if message[0] == "failed":
                    said = message[1]
        except (EOFError, OSError):
            pass
        return said or self.exit_text()

    def exit_text(self) -> str:
        self.process.join(5.0)  # reap it: exitcode is None until then
        code = self.process.exitcode
        deadline = time.monotonic() + 1.0
        while code is None and time.monotonic() < deadline:  # another thread may be reaping it right now
            time.sleep(0.01)
            code = self.process.exitcode
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        return f"tensor-parallel rank {self.rank} (pid {self.process.pid}) {how}"

    def expect(self, status: str, deadline: float) -> None:
        """A start-up message from the worker: RankLost if it says something else, dies or is late."""
        said, detail = self.reply(status, deadline)
        if said != status:
            raise RankLost(
                f"tensor-parallel rank {self.rank} said {said!r} ({detail!r}) instead of {status!r}"
            )

    def reply(self, op: str, deadline: float) -> tuple[str, Any]:
        """The worker's answer to an admin command, watching the process; RankLost if it died or is late."""
        while time.monotonic() < deadline:
            if self.conn.poll(0.5):
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    break
                if message[0] == "failed":
                    raise RankLost(message[1])
                return message
            if not self.process.is_alive():
                break
        if self.process.is_alive():
            raise RankLost(
                f"tensor-parallel rank {self.rank} did not answer {op} within {COLLECTIVE_TIMEOUT_S:.0f} s"
            )
        raise RankLost(self.describe_exit())


DEATH_GRACE_S = 2.0  # after a failed step: how long a dying worker may take to be seen dead


class TensorParallelRunner:
    """Rank 0's ModelRunner, with every step and cache operation mirrored on the worker ranks."""

    def __init__(self, runner: ModelRunner, workers: list[_Worker], metrics: Metrics | None = None) -> None:
        self.runner = runner
        self.size = runner.tp.size
        # Rank 0's facts (the Runner Protocol's), fixed at load; every rank's equal but for its shard of the heads.
        self.tokenizer, self.model_path, self.model_config = (
            runner.tokenizer,
            runner.model_path,
            runner.model_config,
        )
        self.num_kv_blocks, self.block_size, self.max_model_len = (
            runner.num_kv_blocks,
            runner.block_size,
            runner.max_model_len,
        )
        self.vocab_size, self.eos_token_ids = runner.vocab_size, runner.eos_token_ids
        self.device_type, self.dtype = runner.device_type, runner.dtype
        self.metrics = metrics
        self.cache = _AgreedCache(self)
        self.lora = None  # adapters are served at tensor_parallel_size 1 only (lora_slots.py refuses)
        self._workers = workers
        self._broken: str | None = None  # why this runner cannot run another step
        self._on_fatal: Callable[[str], None] | None = None
        self._closing = False
        self._watcher = threading.Thread(target=self._watch_workers, name="graphcache-tp-watch", daemon=True)
        self._watcher.start()

    # --- start-up ------------------------------------------------------------------------
    @classmethod
    def start(cls, settings: Settings, metrics: Metrics | None = None) -> TensorParallelRunner:
        """Spawn ranks 1..N-1, load rank 0's shard with them, wait until every rank is loaded."""
        size = settings.model.tensor_parallel_size
        if settings.model.path is None:  # made once, here: the ranks must not race to write the same files
            model = default_model_dir(settings.model.cache_dir, seed=settings.model.seed)
            settings = settings.updated(model=str(model))
        else:  # a local directory (the engine fetched a hub id already)
            model = Path(settings.model.path).expanduser()
        check_shardable(read_config(model), size)  # before any process starts
        port, ctx = free_port(), mp.get_context("spawn")
        workers: list[_Worker] = []
        runner = None
        try:
            for rank in range(1, size):
                parent, child = ctx.Pipe()
                process = ctx.Process(
                    target=worker_main,
                    args=(rank, settings, port, child),
                    daemon=True,
                    name=f"graphcache-tp-rank{rank}",
                )
                process.start()
                child.close()
                workers.append(_Worker(rank, process, parent))
            log.info(
                "tensor parallel: %d ranks (workers pids %s); loading rank 0's shard",
                size,
                [w.process.pid for w in workers],
            )
            deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
            for w in workers:  # every worker reached the rendezvous (rank 0 cannot leave it once in)
                w.expect("joining", deadline)
            runner = build_rank_runner(settings, 0, port, metrics)
            for w in workers:
                w.expect("ready", deadline)
        except BaseException:
            _stop_workers(workers, graceful=False)
            _leave_group()
            raise
        log.info("tensor parallel: all %d ranks loaded", size)
        return cls(runner, workers, metrics)

    def watch(self, on_fatal: Callable[[str], None]) -> None:
        """Call on_fatal(reason) (any thread) when a worker dies or the ranks split; the Engine passes fail."""
        self._on_fatal = on_fatal
        if self._broken is not None:
            on_fatal(self._broken)

    # --- steps ---------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        if self._broken is not None:
            raise RankLost(self._broken)
        in_flight = self.runner.in_flight_ids(plan)
        self._send(("execute", plan, 0 if in_flight is None else int(in_flight.numel())))
        try:
            if in_flight is not None:
                dist.broadcast(in_flight.contiguous(), src=0)
            return self.runner.execute(plan)
        except Exception as exc:
            # The other ranks ran (or wait in) this step's collectives: there is no putting them back in step.
            # A rank that died shows here as a collective error ("connection closed") a moment before its
            # process can be reaped: wait briefly for one to exit, so the reason names the rank that died.
            ended = connection.wait([w.process.sentinel for w in self._workers], timeout=DEATH_GRACE_S)
            # is_alive() alone can miss it: the watcher thread may be reaping that process right now.
            dead = [w for w in self._workers if w.process.sentinel in ended or not w.process.is_alive()]
            reason = (
                dead[0].describe_exit() if dead else f"the step failed on rank 0: {type(exc).__name__}: {exc}"
            )
            raise self._break(reason) from exc

    # --- admin (engine thread) -------------------------------------------------------------
    def warmup_descriptors(self) -> list[BatchDescriptor]:
        return self.runner.warmup_descriptors()

    def warmup(self, progress: Callable[[int, int, str], None] | None = None) -> WarmupReport:
        return self._admin("warmup", (), lambda: self.runner.warmup(progress=progress))

    def capture(
        self,
        descriptors: list[BatchDescriptor],
        *,
        pin: bool = True,
        progress: Callable[[int, int, str], None] | None = None,
    ) -> WarmupReport:
        descs = list(descriptors)
        return self._admin(
            "capture", (descs, pin), lambda: self.runner.capture(descs, pin=pin, progress=progress)
        )

    def rank_decision_logs(self) -> list[list[Decision]]:
        """Every rank's cache decision log, rank order (equal when the ranks agree: the test hook)."""
        return self._admin(
            "decisions", (), lambda: self.runner.cache.decision_log(), compare=False, collect=True
        )

    def _admin(
        self, op: str, args: tuple, local: Callable[[], Any], *, compare: bool = True, collect: bool = False
    ) -> Any:
        """Send `op` to every worker, run `local` on rank 0, then check every worker did the same: the
        same summary, or the same error. collect=True returns [rank 0's, worker 1's, ...] results."""
        if self._broken is not None:
            raise RankLost(self._broken)
        self._send((op, *args))
        error: Exception | None = None
        result = None
        try:
            result = local()
        except Exception as exc:  # an admin error; the workers must have met the same one
            error = exc
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        try:
            replies = [w.reply(op, deadline) for w in self._workers]
        except RankLost as lost:
            raise self._break(str(lost)) from error
        mine = (
            ("error", f"{type(error).__name__}: {error}")
            if error is not None
            else ("ok", _summary(op, result))
        )
        if compare:
            split = [(w.rank, r) for w, r in zip(self._workers, replies, strict=True) if r != mine]
            if split:
                rank, theirs = split[0]
                raise self._break(
                    f"tensor-parallel ranks split on {op}: rank 0 {mine!r}, rank {rank} {theirs!r}"
                )
        if error is not None:
            raise error
        if collect:
            return [result] + [r[1] for r in replies]
        self.cache.publish_rank_bytes()
        return result

    # --- failure and shutdown ---------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)  # once, whatever the rank count
        for w in self._workers:
            try:
                w.conn.send_bytes(data)
            except (OSError, EOFError):
                raise self._break(w.describe_exit()) from None

    def _break(self, reason: str) -> RankLost:
        """Mark this runner unusable and tell the engine (once); the RankLost to raise."""
        first = self._broken is None
        if first:
            self._broken = reason
            log.error("tensor parallel: %s; the engine stops serving", reason)
            if self._on_fatal is not None:
                self._on_fatal(reason)
        return RankLost(self._broken)

    def _watch_workers(self) -> None:
        sentinels = {w.process.sentinel: w for w in self._workers}
        ended = connection.wait(list(sentinels))
        if not self._closing:
            self._break(sentinels[ended[0]].exit_text())

    def close(self) -> None:
        """Stop the workers (they leave the group and exit 0), then leave the group. Engine thread, at exit."""
        if self._closing:
            return
        self._closing = True
        _stop_workers(self._workers, graceful=self._broken is None)
        _leave_group()


class _AgreedCache:
    """The cache as the engine sees it at N > 1: operations go to every rank; reads are rank 0's."""

    def __init__(self, tp: TensorParallelRunner) -> None:
        self._tp = tp
        self._published = -1  # decision-log length the rank gauge was computed at

    def clear(self) -> ClearReport:
        return self._tp._admin("clear", (), lambda: self._tp.runner.cache.clear())

    def evict(self, desc: BatchDescriptor) -> bool:
        return self._tp._admin("evict", (desc,), lambda: self._tp.runner.cache.evict(desc))

    def warmup(
        self,
        descs: list[BatchDescriptor],
        *,
        pin: bool = True,
        progress: Callable[[int, int, str], None] | None = None,
    ) -> WarmupReport:
        return self._tp.capture(descs, pin=pin, progress=progress)

    # Reads: rank 0's cache, whose state equals every rank's.
    def stats(self) -> CacheStats:
        self.publish_rank_bytes()
        return self._tp.runner.cache.stats()

    def entries(self) -> list[EntryInfo]:
        return self._tp.runner.cache.entries()

    def profile(self, min_uses: int = 1) -> dict:
        return self._tp.runner.cache.profile(min_uses)

    def decision_log(self) -> list[Decision]:
        return self._tp.runner.cache.decision_log()

    def rank_pool_bytes(self) -> list[int]:
        return self._tp.runner.cache.rank_pool_bytes()

    def info(self) -> dict:
        """Rank 0's cache info plus each rank's pool bytes and decision log (count and digest)."""
        info = self._tp.runner.cache.info()
        logs = self._tp.rank_decision_logs()
        pool = self._tp.runner.cache.rank_pool_bytes()
        info["tensor_parallel"] = {
            "size": self._tp.size,
            "ranks": [
                {
                    "rank": r,
                    "pool_bytes": pool[r],
                    "decisions": len(log_r),
                    "decision_digest": fingerprint(log_r),
                }
                for r, log_r in enumerate(logs)
            ],
        }
        return info

    def publish_rank_bytes(self) -> None:
        """The per-rank pool-bytes gauge, recomputed when the decision log grew: each rank's own
        measurement of the pools held (with a shared lazy pool, an evicted entry's growth stays until
        the pool's last graph goes, so summing the admits held would undercount)."""
        metrics, cache = self._tp.metrics, self._tp.runner.cache
        if metrics is None:
            return
        decisions = cache.decision_log()
        if len(decisions) == self._published:
            return
        self._published = len(decisions)
        for rank, held in enumerate(cache.rank_pool_bytes()):
            metrics.graph_pool_rank_bytes.labels(str(rank)).set(held)


def _summary(op: str, result: Any) -> Any:
    """What every rank must agree on after an admin command (what apply_admin returns on a worker)."""
    if op in ("capture", "warmup"):
        return sorted(result.captured), sorted(result.failed)
    if op == "clear":
        return result.entries
    if op == "decisions":
        return None
    return result


def _stop_workers(workers: list[_Worker], *, graceful: bool) -> None:
    for w in workers:
        if graceful:
            with contextlib.suppress(OSError, EOFError):
                w.conn.send(("stop",))
    deadline = time.monotonic() + (STOP_TIMEOUT_S if graceful else 0.0)
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
        if w.process.is_alive():
            if graceful:
                log.warning(
                    "tensor-parallel rank %d did not stop within %.0f s; killing it", w.rank, STOP_TIMEOUT_S
                )
            w.process.kill()
            w.process.join(5.0)
        w.conn.close()


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
