"""Ending a stopping server in time, whatever its threads do: the second stop signal (exit at once)
and the watchdog armed when the server stops (exit at its deadline, naming the threads it did not wait
for). `graphcache serve` (cli.py) uses both."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MAX_THREADS_NAMED", "ExitWatchdog", "exit_now", "running_threads"]

log = logging.getLogger("graphcache")


def exit_now(sig: int) -> None:
    """The second stop signal: one log line, then exit 128 + signal number (as a shell reports a
    process killed by it), skipping the drain, the engine join and interpreter teardown."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    log.warning("second %s during shutdown: exiting now; requests still in flight are cut", name)
    _flush_output()
    os._exit(128 + sig)


def _flush_output() -> None:
    """What os._exit would lose: buffered log records and stdout/stderr."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


MAX_THREADS_NAMED = 12


def running_threads() -> str:
    """The other threads of this process, each with where it is now ("graphcache-input_0 at
    sandbox.py:412 in call"): what a stop that overran waited for, in one line."""
    frames = sys._current_frames()
    me = threading.get_ident()
    named = []
    for thread in threading.enumerate():
        if thread.ident == me or thread.ident is None:
            continue
        frame = frames.get(thread.ident)
        where = (
            f" at {Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"
            if frame is not None
            else ""
        )
        named.append(f"{thread.name}{where}")
    if len(named) > MAX_THREADS_NAMED:
        named = [*named[:MAX_THREADS_NAMED], f"and {len(named) - MAX_THREADS_NAMED} more"]
    return ", ".join(named) or "no other thread"


class ExitWatchdog:
    """Ends the process at a deadline, whatever its threads are doing.

    Python joins worker threads as it exits: asyncio's default executor (asyncio.to_thread: grammar
    compiles) when the event loop closes, concurrent.futures' pools (api/server/executors.py: tokenizing)
    at interpreter exit. Neither can interrupt a thread, so one stuck in a long
    computation keeps a stopped server alive for as long as it runs. Armed when the server stops, a
    daemon thread waits for the earliest deadline armed; past it, it logs which threads still run,
    flushes the logs and calls os._exit with exit_code()'s code. A process that ends in time never
    hears from it (a daemon thread ends with the process). `exit` is _hard_exit but in tests."""

    def __init__(self, exit_code: Callable[[], int], exit: Callable[[int], Any] | None = None) -> None:
        self._exit_code = exit_code
        self._exit = exit if exit is not None else _hard_exit
        # RLock (Condition's default): arm() runs in a signal handler too, maybe over another arm().
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._why = ""
        self._thread: threading.Thread | None = None

    @property
    def deadline(self) -> float | None:
        """The time.monotonic() at which the process ends; None while not armed."""
        return self._deadline

    def arm(self, seconds: float, why: str) -> None:
        """End the process `seconds` from now (logging `why`), or at the deadline armed already if that
        is earlier: arming never postpones the end."""
        deadline = time.monotonic() + seconds
        with self._cond:
            if self._deadline is not None and self._deadline <= deadline:
                return
            self._deadline, self._why = deadline, why
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._wait, name="graphcache-exit-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def _wait(self) -> None:
        with self._cond:
            while (left := self._deadline - time.monotonic()) > 0:  # type: ignore[operator]
                self._cond.wait(left)
            why = self._why
        try:
            code = self._exit_code()
        except Exception:  # noqa: BLE001 - the process must end all the same
            log.exception("the exit code could not be decided; exiting 1")
            code = 1
        log.warning("%s; exiting now (code %d) without waiting for: %s", why, code, running_threads())
        self._exit(code)


def _hard_exit(code: int) -> None:
    """os._exit(code) after what it would skip and the stop needs: a child process the stop did not
    join (the engine process, when the shutdown itself hung; multiprocessing's exit hook would end
    it) is killed, and the logs are flushed."""
    if "multiprocessing" in sys.modules:
        import multiprocessing

        for child in multiprocessing.active_children():
            with contextlib.suppress(Exception):
                child.kill()
    _flush_output()
    os._exit(code)
