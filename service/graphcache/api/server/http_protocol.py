"""uvicorn's httptools protocol with the limits it lacks: request-head size, head and body deadlines,
slow connections per client, connections.

uvicorn bounds none of these for httptools (h11 has only a size limit): a client may send headers
without end (64 MB were accepted, all kept in memory), or open connections and never finish a
request head, or finish the head and then send its body a byte every few seconds, each holding a
file descriptor (and a slot of the connection limit) until /health fails with them.
This subclass adds, per connection:

  * head size: a request head (request line + headers) past `max_header_bytes` is answered 431 and
    the connection closed, checked on each read before the parser sees it, so memory stays bounded
    by the limit plus one read;
  * head deadline: a head not complete `header_timeout_s` after its connection opened, or after its
    first byte on a kept-alive connection, closes the connection (an idle kept-alive connection is
    closed by uvicorn's timeout_keep_alive, which cli.py sets to the same value);
  * body deadline: a body not complete `body_timeout_s` after its head completed closes the
    connection, answered 408 if nothing was answered yet;
  * the app starts once the body is in (or 64 KiB of it; at once for a body announced past
    `max_body_bytes`, refused with 413, or a client waiting for 100 Continue), as behind a buffering
    proxy: a trickled body costs a parser and a timer, not a running handler that would unwind
    through the middleware when closed (~1.5 ms each on a 2-core CPU box: a burst of 200 closed at
    once stalled the loop ~0.3 s);
  * slow connections per client: a connection still reading a head or a body `slow_grace_s` into it
    is slow; one client (peer IP; an IPv6 /64) may hold `max_slow_per_client` slow connections, and
    one more that turns slow is closed (408 if it was in its body). A fast request (a head and body
    that arrive at once, as /health's) is never slow. Behind a proxy every client has the proxy's IP:
    see HttpSettings.max_slow_per_client;
  * connections: past `max_connections` open ones, a new connection takes the place of the one that
    has waited longest on its client (a head, a body or the next request not arriving), picked from
    the client holding most such connections, so trickling clients cannot fill the table; when every
    connection is being answered, the new one is closed as it is accepted;
  * uvicorn's limit_concurrency (503 past the limit) counts only connections being answered: it
    counted every connection and task, so connections waiting on slow clients turned /health away.

`guarded_protocol(...)` returns the class to pass as uvicorn.Config(http=...).
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Literal

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

__all__ = ["client_key", "guarded_protocol"]

_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)
_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)

Phase = Literal["head", "body"]


def client_key(client: tuple[str, int] | None) -> str:
    """Whom a connection counts against: its peer IP; an IPv6 peer by its /64 (one host usually
    holds a whole /64, so single addresses would be free for the taking), an IPv4-mapped one as IPv4."""
    if client is None:  # a Unix socket: one local client
        return ""
    host = client[0]
    if ":" not in host:
        return host
    try:
        address = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network((address, 64), strict=False))


class ConnectionBook:
    """What the connections of one server know of each other: which wait on their client (per client,
    oldest first), how many of those are slow per client, and how many apps wait for a body."""

    def __init__(self) -> None:
        self.waiting: dict[str, dict[GuardedHttpToolsProtocol, None]] = {}  # dicts keep the order
        self.waiting_count = 0
        self.slow: dict[str, int] = {}
        self.apps_reading = 0  # apps started before their body was in (its tasks wait on the client)

    def wait(self, conn: GuardedHttpToolsProtocol, restart: bool = False) -> None:
        """`conn` waits on its client; restart: its wait begins now (it goes last in line)."""
        group = self.waiting.setdefault(conn.client_key, {})
        if conn in group:
            if not restart:
                return
            del group[conn]
        else:
            self.waiting_count += 1
        group[conn] = None

    def stop_waiting(self, conn: GuardedHttpToolsProtocol) -> None:
        group = self.waiting.get(conn.client_key)
        if group is None or conn not in group:
            return
        del group[conn]
        self.waiting_count -= 1
        if not group:
            del self.waiting[conn.client_key]

    def victim(self) -> GuardedHttpToolsProtocol | None:
        """The connection to close for a new one: the client with most connections waiting on it
        gives up the one that has waited longest. O(clients), only when the table is full."""
        if not self.waiting:
            return None
        group = max(self.waiting.values(), key=len)
        return next(iter(group))

    def add_slow(self, key: str) -> int:
        self.slow[key] = self.slow.get(key, 0) + 1
        return self.slow[key]

    def remove_slow(self, key: str) -> None:
        left = self.slow[key] - 1
        if left:
            self.slow[key] = left
        else:
            del self.slow[key]


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes = 64 << 10
    max_body_bytes = 1 << 20  # what the app accepts (its 413): only to know a body it will refuse
    header_timeout_s = 10.0
    body_timeout_s = 30.0
    slow_grace_s = 2.0
    max_slow_per_client = 32
    max_connections = 1000
    book = ConnectionBook()  # guarded_protocol gives each server its own

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's 503 check counts every connection and task; on_headers_complete makes its own and
        # hands uvicorn a limit that gives the same answer (0: 503; None: serve).
        self._concurrency_limit = self.limit_concurrency
        self._phase: Phase | None = None
        self._phase_timer: asyncio.TimerHandle | None = None
        self._slow = False
        self._app_reading = False  # counted in book.apps_reading
        self._held: tuple[RequestResponseCycle, object] | None = None  # an app waiting for its body
        self._booked = False  # registered in the book (and in uvicorn's connections)
        self.client_key = ""

    # --- connections ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_bytes = 0
        self._tail = b""
        if len(self.server_state.connections) >= self.max_connections:
            victim = self.book.victim()
            if victim is None:  # every connection is being answered: this one waits its turn elsewhere
                transport.abort()  # never registered: connection_lost finds nothing to discard
                return
            victim.drop(
                f"The server has {self.max_connections} connections open "
                "(GRAPHCACHE_HTTP_MAX_CONNECTIONS) and this one waited longest on its client."
            )
        super().connection_made(transport)
        self.client_key = client_key(self.client)
        self._booked = True
        self._start_phase("head")
        self.book.wait(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        if self.transport is not None:  # None: refused in connection_made, never set up
            super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        self._forget()  # the connection is the websocket protocol's from here on
        super().handle_websocket_upgrade()

    def drop(self, why: str) -> None:
        """Close a connection that waits on its client: a deadline passed, its client holds too many
        slow ones, or a new connection needs its place. 408 (saying `why`) if its request has a head
        and no answer yet."""
        answer = self._phase == "body" and self.cycle is not None and not self.cycle.response_started
        self._forget()
        # Out of uvicorn's count now, not when the close completes (a loop turn later): the accept
        # and 503 checks of connections arriving meanwhile see the room this made.
        self.connections.discard(self)
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # As on a lost connection: the app's receive() gets http.disconnect, its answer is dropped.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if answer:
            message = why.encode()
            self.transport.write(_408 % (len(message), message))
        self.transport.close()

    def _forget(self) -> None:
        """Out of the book: no phase, no timer, not waiting, not slow, no app to start."""
        self._held = None
        self._end_phase()
        if self._booked:
            self._booked = False
            self.book.stop_waiting(self)

    def _sync_waiting(self, restart: bool = False) -> None:
        """In the book's line while the connection waits on its client: reading a head or a body, or
        idle between requests; out of it while an answer is being made (the app has the whole body)."""
        if not self._booked:
            return
        answering = bool(self.pipeline) or (
            self._phase != "body" and self.cycle is not None and not self.cycle.response_complete
        )
        if answering:
            self.book.stop_waiting(self)
        else:
            self.book.wait(self, restart)

    # --- reads ----------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._phase == "head":
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

    # --- parser callbacks: where a head and a body begin and end ---------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._phase != "head":  # the next request on a kept-alive connection: its head starts now
            self._start_phase("head")
            self._sync_waiting(restart=True)

    def on_headers_complete(self) -> None:
        limit = self._concurrency_limit
        if limit is not None:
            # Connections and tasks waiting on their clients are bounded by the deadlines above, not
            # by this limit: counting them let trickling clients turn every request away with 503.
            answering = len(self.connections) - self.book.waiting_count
            running = len(self.tasks) - self.book.apps_reading
            self.limit_concurrency = 0 if answering >= limit or running >= limit else None
        self._start_phase("body")
        super().on_headers_complete()
        if self.pipeline:
            # uvicorn holds a pipelined request (and stops reading) until the answers before it are
            # sent: its body's clock starts when its turn comes (on_response_complete).
            self._cancel_timer()
        self._sync_waiting()

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self._held is not None and len(self.cycle.body) >= HIGH_WATER_LIMIT:
            self._start_held()  # enough to read: the app takes it from here (and bounds it)

    def on_message_complete(self) -> None:
        self._end_phase()
        super().on_message_complete()
        self._start_held()
        self._sync_waiting()

    # --- the app: held until the body is in -----------------------------------------------------------

    def _start_asgi_task(self, cycle: RequestResponseCycle, app) -> None:
        # uvicorn starts the app at the end of the head; held here instead while the body is still to
        # come, until 64 KiB are in (uvicorn stops reading there until the app reads). A GET's end
        # follows its head in the same parser call: no wait.
        if cycle.more_body and len(cycle.body) < HIGH_WATER_LIMIT and self._may_hold(cycle, app):
            self._held = (cycle, app)
            return
        if self._phase == "body" and not self._app_reading:
            self._app_reading = True
            self.book.apps_reading += 1
        super()._start_asgi_task(cycle, app)

    def _may_hold(self, cycle: RequestResponseCycle, app) -> bool:
        """Not a 503 (answered and closed at once), nor a body announced past max_body_bytes (the app
        refuses it before it is sent), nor a client waiting for 100 Continue (sent when the app reads)."""
        if app is service_unavailable or cycle.waiting_for_100_continue:
            return False
        length = next((v for k, v in cycle.scope["headers"] if k == b"content-length"), b"")
        return not (length.isdigit() and int(length) > self.max_body_bytes)

    def _start_held(self) -> None:
        if self._held is not None:
            cycle, app = self._held
            self._held = None
            self._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self._phase == "body" and self._phase_timer is None and not self.pipeline:
            self._start_timer()  # a pipelined request's turn came with its body still arriving
        self._sync_waiting()

    # --- phases: a head or a body being read, its grace and its deadline ------------------------------

    def _start_phase(self, phase: Phase) -> None:
        self._end_phase()
        self._phase = phase
        self._head_bytes = 0
        self._tail = b""
        self._start_timer()

    def _end_phase(self) -> None:
        self._cancel_timer()
        if self._app_reading:
            self._app_reading = False
            self.book.apps_reading -= 1
        if self._slow:
            self._slow = False
            self.book.remove_slow(self.client_key)
        self._phase = None

    def _deadline(self) -> float:
        return self.header_timeout_s if self._phase == "head" else self.body_timeout_s

    def _start_timer(self) -> None:
        # One timer at a time: the grace first (then the rest of the deadline), or only the deadline.
        self._cancel_timer()
        if self.slow_grace_s < self._deadline():
            self._phase_timer = self.loop.call_later(self.slow_grace_s, self._grace_passed)
        else:
            self._phase_timer = self.loop.call_later(self._deadline(), self._deadline_passed)

    def _cancel_timer(self) -> None:
        if self._phase_timer is not None:
            self._phase_timer.cancel()
            self._phase_timer = None

    def _grace_passed(self) -> None:
        self._phase_timer = None
        if self._phase is None or self.transport.is_closing():
            return
        self._slow = True
        if self.book.add_slow(self.client_key) > self.max_slow_per_client:
            # The client's slow connections before this one keep their place.
            self.drop(
                f"This client has {self.max_slow_per_client} other connections sending slowly "
                "(GRAPHCACHE_HTTP_MAX_SLOW_PER_CLIENT)."
            )
            return
        self._phase_timer = self.loop.call_later(self._deadline() - self.slow_grace_s, self._deadline_passed)

    def _deadline_passed(self) -> None:
        self._phase_timer = None
        if self._phase is not None and not self.transport.is_closing():
            self.drop(
                f"The request body did not arrive within {self.body_timeout_s:g}s of its head "
                "(GRAPHCACHE_HTTP_BODY_TIMEOUT_S)."
            )


def guarded_protocol(
    max_header_bytes: int,
    header_timeout_s: float,
    max_connections: int,
    body_timeout_s: float = GuardedHttpToolsProtocol.body_timeout_s,
    slow_grace_s: float = GuardedHttpToolsProtocol.slow_grace_s,
    max_slow_per_client: int = GuardedHttpToolsProtocol.max_slow_per_client,
    max_body_bytes: int = GuardedHttpToolsProtocol.max_body_bytes,
) -> type[GuardedHttpToolsProtocol]:
    """The protocol class with these limits (uvicorn builds one instance per connection), with its own
    book of the server's connections."""
    return type(
        "GraphcacheHttpProtocol",
        (GuardedHttpToolsProtocol,),
        {
            "max_header_bytes": max_header_bytes,
            "max_body_bytes": max_body_bytes,
            "header_timeout_s": header_timeout_s,
            "body_timeout_s": body_timeout_s,
            "slow_grace_s": slow_grace_s,
            "max_slow_per_client": max_slow_per_client,
            "max_connections": max_connections,
            "book": ConnectionBook(),
        },
    )
