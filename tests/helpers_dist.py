"""Run a function on N local processes joined by a gloo group: the CPU stand-in for N GPUs over NCCL.

`run_ranks(fn, n, *args)` spawns n processes running fn(rank, n, port, *args) and waits for all of them
under a deadline; a rank that raises fails the test with its traceback, and a rank still running at the
deadline (a collective that waits for a rank that went elsewhere: a hang) is killed and fails it too.
Ranks join the group with `gloo_group(rank, n, port)`. Results come back as files the ranks write.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Generous: 2 spawned interpreters import torch and build models on a busy 2-core machine.
DEFAULT_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int, world_size: int, port: int) -> Iterator[None]:
    """The default process group over TCP on localhost, destroyed on the way out."""
    torch.set_num_threads(1)  # n ranks on 2 shared cores: no oversubscription
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=DEFAULT_TIMEOUT_S),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """fn(rank, world_size, port, *args) on world_size spawned processes; raises if any fails or hangs."""
    ctx = mp.start_processes(
        fn, args=(world_size, free_port(), *args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):  # raises ProcessRaisedException / ProcessExitedException
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks still running after {timeout:.0f} s: a collective is waiting for a rank "
                    "that took another path (a hang)"
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
