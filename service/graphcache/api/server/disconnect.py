"""Awaiting work on behalf of a client that may leave: the work is cancelled when it does.

Starlette does not cancel a handler whose client disconnected, so a handler that awaits something
long (an engine run, a chat template's render) watches the connection itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

__all__ = ["ClientGone", "unless_disconnected"]


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive, aw: Awaitable) -> Any:
    """Await `aw`; if the client disconnects first, cancel it and raise ClientGone.

    The cancelled task is awaited before returning, so whatever it was iterating (an async
    generator) is idle again and can be closed.
    """
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = watcher.done() and not watcher.cancelled() and watcher.exception() is None
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if gone and not (task.done() and not task.cancelled() and task.exception() is None):
        raise ClientGone
    return task.result()
