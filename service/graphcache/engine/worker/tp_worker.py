"""A tensor-parallel rank: joining the group, building its runner, and the loop of ranks > 0.

At tensor_parallel_size N > 1 graphcache runs one process per rank (docs/TENSOR_PARALLEL.md). Rank 0 is
the server (HTTP, scheduler, engine; engine/worker/tp_runner.py); it starts ranks 1..N-1 as spawned processes
running `worker_main`. Each worker joins the group, loads its shard, says "ready" on its pipe, then
applies the commands rank 0 sends, in order, to its own ModelRunner:

    ("execute", StepPlan, in-flight ids)                          no reply (the model's collectives
                                                                   keep the ranks in lockstep)
    ("capture", descriptors, pin) / ("warmup",) / ("clear",) / ("evict", descriptor)
                                                                   reply ("ok", summary) | ("error", text)
    ("decisions",)                                                 reply ("ok", this rank's decision log)
    ("stop",)                                                      leave the group, exit 0

A worker says ("joining", pid) before the group's rendezvous and ("ready", KV blocks) once loaded (or
("failed", why) and exits 1).

The pipe is the control plane: host-side, ordered, and a worker blocked on it waits for as long as the
server idles (a collective would time out). It ends with EOF when rank 0 dies: the worker exits.
A step that fails on a worker alone cannot be survived (the other ranks' collectives would wait for
it): the worker reports it on the pipe and exits 1, and rank 0's engine dies loudly.

Workers ignore SIGINT and SIGTERM: a Ctrl-C reaches the whole process group, but stopping is rank 0's
call (it drains, then sends "stop").
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from graphcache.config import Settings
from graphcache.engine.worker.runner import ModelRunner, resolve_device
from graphcache.graphs.cache import GraphCache
from graphcache.graphs.policy.agreement import GroupAgreement
from graphcache.metrics import Metrics
from graphcache.model.parallel import TensorParallel

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "apply_admin",
    "build_rank_runner",
    "free_port",
    "worker_main",
]

log = logging.getLogger("graphcache.tp")

# How long a rank waits in a collective (and rank 0 for a worker's reply) before it gives up: long enough
# for a rank to load its shard or capture a warmup on a busy machine; a dead peer on gloo fails at once.
COLLECTIVE_TIMEOUT_S = 300.0


def free_port() -> int:
    """A free TCP port on localhost for the group's rendezvous (every rank is on this host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_type(settings: Settings) -> str:
    return resolve_device(settings.model.device).type


def build_rank_runner(
    settings: Settings, rank: int, port: int, metrics: Metrics | None = None
) -> ModelRunner:
    """Join the group of settings.model.tensor_parallel_size ranks and load this rank's shard: NCCL for the
    model's collectives on CUDA (rank r on GPU r), gloo on the CPU; cache agreements run on a gloo group
    (host-side objects, never inside a CUDA stream or capture). Every rank must call this together."""
    size = settings.model.tensor_parallel_size
    on_cuda = device_type(settings) == "cuda"
    if on_cuda:
        torch.cuda.set_device(rank)
    elif "OMP_NUM_THREADS" not in os.environ:  # N ranks share the host's cores: no oversubscription
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group(
        "nccl" if on_cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    control = (
        dist.new_group(backend="gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)) if on_cuda else None
    )
    return ModelRunner(
        settings,
        metrics,
        tp=TensorParallel.from_group(),
        graph_cache_factory=partial(GraphCache, agreement=GroupAgreement(control)),
    )


def apply_admin(runner: ModelRunner, op: str, args: tuple) -> Any:
    """An admin command on one rank's runner; the summary every rank returns (compared by rank 0)."""
    if op == "capture":
        descs, pin = args
        report = runner.capture(list(descs), pin=pin)
        return sorted(report.captured), sorted(report.failed)
    if op == "warmup":
        report = runner.warmup()
        return sorted(report.captured), sorted(report.failed)
    if op == "clear":
        return runner.cache.clear().entries
    if op == "evict":
        return runner.cache.evict(args[0])
    if op == "decisions":
        return runner.cache.decision_log()
    raise ValueError(f"unknown tensor-parallel command {op!r}")


def worker_main(rank: int, settings: Settings, port: int, conn: Any) -> None:
    """Rank `rank` > 0: build the runner, then apply rank 0's commands until "stop" (or rank 0 is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        logging.basicConfig(
            level=settings.logging.log_level.upper(),
            format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s",
        )
        # Rank 0 joins the rendezvous only once every worker got this far: a worker that fails sooner
        # (an import, a bad setting) is reported at once instead of after the rendezvous timeout.
        _send(conn, ("joining", os.getpid()))
        runner = build_rank_runner(settings, rank, port)
    except BaseException as exc:  # noqa: BLE001 - rank 0 must hear why, whatever it was
        log.exception("rank %d failed to load", rank)
        _send(conn, ("failed", f"rank {rank} failed to load: {type(exc).__name__}: {exc}"))
        os._exit(1)
    _send(conn, ("ready", runner.num_kv_blocks))
    code = _serve(runner, rank, conn)
    # Leave the group only on gloo. On NCCL, destroy_process_group waits for the other ranks, and rank 0
    # leaves only after this process has exited, so the two wait on each other (a TP=2 run on two H200s
    # hung there for 30 s until rank 1 was killed; the likely cause, not confirmed on 2 GPUs since).
    # os._exit frees the communicator's resources with the process.
    if dist.is_initialized() and dist.get_backend() != "nccl":
        dist.destroy_process_group()
    os._exit(code)  # no interpreter teardown: nothing of ours is left to flush, and torch's can hang


def _serve(runner: ModelRunner, rank: int, conn: Any) -> int:
    device = runner.device
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):
            log.error("rank 0 went away; rank %d exits", rank)
            return 1
        op, args = cmd[0], cmd[1:]
        if op == "stop":
            return 0
        if op == "execute":
            plan, num_in_flight = args
            try:
                in_flight = None
                if num_in_flight:  # rows fed the token in flight: the ids rank 0's last step sampled
                    in_flight = torch.empty(num_in_flight, dtype=torch.int64, device=device)
                    dist.broadcast(in_flight, src=0)
                runner.execute(plan, in_flight)
            except Exception as exc:
                log.exception("step failed on rank %d", rank)
                _send(conn, ("failed", f"a step failed on rank {rank}: {type(exc).__name__}: {exc}"))
                return 1
            continue
        try:
            reply = ("ok", apply_admin(runner, op, args))
        except (
            Exception
        ) as exc:  # rank 0 compares: the same error on every rank is an admin error, not a split
            log.warning("%s failed on rank %d: %s: %s", op, rank, type(exc).__name__, exc)
            reply = ("error", f"{type(exc).__name__}: {exc}")
        if not _send(conn, reply):
            return 1


def _send(conn: Any, message: tuple) -> bool:
    try:
        conn.send(message)
        return True
    except (OSError, EOFError):
        return False
