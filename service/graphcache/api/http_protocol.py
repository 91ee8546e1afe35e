"""uvicorn's httptools protocol with the limits it lacks: request-head size, head timeout, connections.

uvicorn bounds none of these for httptools (h11 has only a size limit): a client may send headers
without end (64 MB were accepted, all kept in memory), or open connections and never finish a
request head, each holding a file descriptor until the process runs out and /health fails with it.
This subclass adds, per connection:

  * head size: a request head (request line + headers) past `max_header_bytes` is answered 431 and
    the connection closed, checked on each read before the parser sees it, so memory stays bounded
    by the limit plus one read;
  * head timeout: a head not complete `header_timeout_s` after its connection opened, or after its
    first byte on a kept-alive connection, closes the connection (an idle kept-alive connection is
    closed by uvicorn's timeout_keep_alive, which cli.py sets to the same value);
  * connections: a connection past `max_connections` open ones is closed as it is accepted, so the
    descriptors the server holds stay bounded (uvicorn's limit_concurrency answers 503 to requests
    past the limit, but only once their head is complete).

`guarded_protocol(...)` returns the class to pass as uvicorn.Config(http=...).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["guarded_protocol"]

_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes = 64 << 10
    header_timeout_s = 10.0
    max_connections = 1000

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_bytes = 0
        self._tail = b""
        self._in_head = True
        self._head_timer: asyncio.TimerHandle | None = None
        if len(self.server_state.connections) >= self.max_connections:
            transport.abort()  # never registered: connection_lost finds nothing to discard
            return
        super().connection_made(transport)
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self.transport is not None:  # None: refused in connection_made, never set up
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            if self._head_too_big(data):
                message = (
                    f"The request head is larger than {self.max_header_bytes} bytes "
                    "(GRAPHCACHE_HTTP_MAX_HEADER_BYTES)."
                ).encode()
                self.transport.write(_431 % (len(message), message))
                self.transport.close()
                return
            self._head_bytes += len(data)
            self._tail = data[-3:]
        super().data_received(data)

    def _head_too_big(self, data: bytes) -> bool:
        """Would the head in progress pass the limit with `data`? One read may also hold the end of
        the head and a body: then only the bytes up to the blank line count."""
        if self._head_bytes + len(data) <= self.max_header_bytes:
            return False
        seen = self._tail + data  # the blank line may straddle two reads
        ends = [i + len(mark) for mark in (b"\r\n\r\n", b"\n\n") if (i := seen.find(mark)) >= 0]
        if not ends:
            return True
        return self._head_bytes - len(self._tail) + min(ends) > self.max_header_bytes

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:  # the next request on a kept-alive connection: its head starts now
            self._in_head = True
            self._head_bytes = 0
            self._tail = b""
            self._start_head_timer()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._tail = b""
        self._cancel_head_timer()
        super().on_headers_complete()

    def _start_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(
    max_header_bytes: int, header_timeout_s: float, max_connections: int
) -> type[GuardedHttpToolsProtocol]:
    """The protocol class with these limits (uvicorn builds one instance per connection)."""
    return type(
        "GraphcacheHttpProtocol",
        (GuardedHttpToolsProtocol,),
        {
            "max_header_bytes": max_header_bytes,
            "header_timeout_s": header_timeout_s,
            "max_connections": max_connections,
        },
    )
