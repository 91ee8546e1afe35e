"""The engine's refusals and failures, as types: the HTTP floor maps each to one status code
(api/server/errors.py), so nothing is decided by matching message text.

`InvalidRequest` is the only client error: a plain ValueError raised by a bug inside the engine is
a server error, never a 400.
"""

from __future__ import annotations

__all__ = [
    "CLIENT_ERROR_CODES",
    "CONSTRAINT_TOO_COMPLEX",
    "DEAD_MESSAGE",
    "EngineDead",
    "EngineDraining",
    "EngineNotReady",
    "InvalidRequest",
    "QueueFull",
]

# What clients (request errors, unauthenticated probes) are told when the engine dies. The cause
# (an exception text that can carry internal paths and device details) goes to the log and to
# `Engine.error`, which only authenticated /admin/* shows.
DEAD_MESSAGE = "the engine stopped after an unrecoverable error; see the server log"


# A request that ran and ended with finish_reason "error" carries an error code (RequestOutput.error_code)
# when the request itself caused the error, not the server: the API answers it as a 400, never a 500.
# CONSTRAINT_TOO_COMPLEX: its output constraint's masks cost more than the server's per-token bound, or
# its grammar went past the grammar library's limits while generating.
CONSTRAINT_TOO_COMPLEX = "output_constraint_too_complex"
CLIENT_ERROR_CODES = frozenset({CONSTRAINT_TOO_COMPLEX})


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
