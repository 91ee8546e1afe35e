"""The engine's refusals and failures, as types: the HTTP floor maps each to one status code
(api/errors.py), so nothing is decided by matching message text.

`InvalidRequest` is the only client error: a plain ValueError raised by a bug inside the engine is
a server error, never a 400.
"""

from __future__ import annotations

__all__ = ["DEAD_MESSAGE", "EngineDead", "EngineDraining", "EngineNotReady", "InvalidRequest", "QueueFull"]

# What clients (request errors, unauthenticated probes) are told when the engine dies. The cause
# (an exception text that can carry internal paths and device details) goes to the log and to
# `Engine.error`, which only authenticated /admin/* shows.
DEAD_MESSAGE = "the engine stopped after an unrecoverable error; see the server log"


class InvalidRequest(Exception):
    """The request can never be served as sent (HTTP 400); the message names the fix."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class QueueFull(Exception):
    """The waiting queue is at max_queue: retry later (HTTP 429)."""


class EngineNotReady(Exception):
    """The model is still loading or warming up (HTTP 503)."""


class EngineDraining(EngineNotReady):
    """The engine stopped accepting requests (SIGTERM drain); HTTP 503."""


class EngineDead(Exception):
    """The engine thread hit an unrecoverable error, or was shut down; `Engine.error` says which."""

