"""Where grammars compile: a few big-stack threads, bounded, and the limits they compile under.

llguidance converts schemas and compiles grammars recursively in native code. On a thread with the
default 8 MB stack a deep enough input (a `$ref` chain ~1,000 deep, ~5,000 chained Lark rules) overflows
it: a SIGSEGV that kills the server with every request in flight, not a Python exception. So every
compile, and the first masks computed with it, runs on one of these threads, made with a stack of
`grammar_compile_stack_mib` (256 MiB by default: every such input up to the 1 MiB body limit survives;
the memory is only reserved, pages are touched as the recursion goes). The depth bounds of
engine/sample/grammar_bounds.py refuse such inputs before they get here; the stack is the guard under them.

The threads run at a lower priority than the rest of the server (nice +10), so compiling never
starves the engine thread of a core. The pool is bounded: `grammar_compile_threads` compile at once and `grammar_compile_queue` more may
wait; past that a compile is refused with QueueFull (429) rather than queued without end.

A compile that fails leaves nothing behind: the locals of its frames (the refused matcher) are cleared
before its exception is handed on, and the C heap's free pages go back to the system (malloc_trim), so
memory after refused constraints returns to its baseline (docs/RELIABILITY.md, "Answer size and refused
constraints").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from graphcache.engine.errors import QueueFull

__all__ = ["CompileExecutor", "GrammarLimits", "drop_locals", "heap_bytes", "release_free_heap"]

T = TypeVar("T")
COMPILE_NICENESS = 10  # added to the compile threads' nice value (Linux schedules threads one by one)
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide: set it only around our starts


@dataclass(frozen=True)
class GrammarLimits:
    """The bounds a constraint compiles and runs under (settings/grammar.py's grammar_* settings say why each)."""

    compile_threads: int = 2
    compile_queue: int = 64
    compile_stack_mib: int = 256
    max_depth: int = 128
    lexer_fuel: int = 100_000
    compile_budget_ms: float = 2000.0
    mask_ms_per_token: float = 10.0
    mask_window: int = 8
    cache_entries: int = 128
    cache_bytes: int = 512 << 20

    @classmethod
    def from_settings(cls, settings: Any) -> GrammarLimits:
        """From Settings: its grammar section's fields are this class's."""
        return cls(**settings.grammar.model_dump())


class CompileExecutor:
    """run(fn, *args) on a big-stack compile thread and wait for it. Thread-safe; a call made from a
    compile thread runs inline (it is already on a big stack, and waiting on its own pool could deadlock)."""

    def __init__(self, threads: int, queue_limit: int, stack_mib: int, name: str = "grammar-compile") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._limit = threads + queue_limit
        self._in_flight = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(stack_mib << 20)
            try:
                for i in range(threads):
                    thread = threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                    thread.start()
                    self._threads.append(thread)
            finally:
                threading.stack_size(previous)
        self._idents = {t.ident for t in self._threads}

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        if threading.get_ident() in self._idents:
            return fn(*args)
        with self._lock:
            if self._in_flight >= self._limit:
                raise QueueFull(
                    f"{self._limit} output constraints are already compiling or waiting to; retry "
                    "later (grammar_compile_threads, grammar_compile_queue)"
                )
            self._in_flight += 1
        future: Future = Future()
        self._jobs.put((fn, args, future))
        try:
            return future.result()
        finally:
            with self._lock:
                self._in_flight -= 1

    def _work(self) -> None:
        # Below the engine thread's priority: on a busy box a compile (a bomb refused after ~0.3 s of lexing,
        # a large schema) takes the cores the step loop leaves, not the other way round.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
        while True:
            fn, args, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, which re-raises it
                # A refused constraint's matcher (a regex bomb's: ~15 MB of lexer states) is a local of the
                # frames in the exception's traceback, and the exception sits in reference cycles (future
                # <-> traceback <-> frame) that only the cyclic GC breaks, whenever it runs: 80 refused bombs
                # grew the server by ~280 MB. The frames' locals go now, and the freed heap back to the system.
                drop_locals(exc)
                release_free_heap()
                future.set_exception(exc)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc_function(name: str) -> Any:
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc (or glibc < 2.33 for mallinfo2)
        return None


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    fn = _libc_function("mallinfo2")
    if fn is not None:
        fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()
_MALLOC_TRIM = _libc_function("malloc_trim")


def heap_bytes() -> int | None:
    """Bytes the C heap has handed out right now, all threads together (glibc's mallinfo2: arena bytes in
    use + mmapped blocks), or None where that is not available. llguidance allocates through malloc, so
    the growth over a compile measures what the compiled grammar holds, plus whatever other threads
    allocated meanwhile (an over-count, the safe side for a byte budget)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def drop_locals(exc: BaseException) -> None:
    """Clear the locals of the finished frames in `exc`'s traceback, and in those of the exceptions it
    chains to (__cause__, __context__). The traceback still prints (code and line numbers stay); what
    those frames referenced (a refused compile's matcher) is freed now instead of at the next full GC."""
    seen: set[int] = set()
    chained: BaseException | None = exc
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)  # a frame still executing is skipped
        chained = chained.__cause__ or chained.__context__


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim(0), every arena): a refused
    compile frees its lexer states, but glibc keeps freed memory in the arena of the thread that freed it
    (a compile thread's), where RSS counts it. A no-op off glibc. Measured on a busy 2-core box with four
    clients sending bombs: 4-7 ms on average on a compile thread, 42 ms at most, and /health's latency
    the same with it as without it (other threads allocate from their own arenas meanwhile)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
