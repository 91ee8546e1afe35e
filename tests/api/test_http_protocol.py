"""api/server/http_protocol.py against fake transports on the test's event loop: body deadlines, the bound on
slow connections per client, which connection gives way when the table is full, and uvicorn's 503
counting only connections being answered. Peers have made-up addresses, so each client is distinct.

The real server under 200 trickling connections: tests/reliability/test_slow_bodies.py.
"""

from __future__ import annotations

import asyncio

import pytest
from graphcache.api.server.http_protocol import client_key, guarded_protocol
from uvicorn.config import Config
from uvicorn.server import ServerState

# Deadlines here are short, and every wait for one is bounded with a wide margin.
WAIT_S = 10.0


class FakeTransport(asyncio.Transport):
    """What the protocol writes; a close reaches connection_lost a loop turn later, as a socket's does."""

    def __init__(self, peer: tuple[str, int]) -> None:
        super().__init__()
        self.peer = peer
        self.sent = b""
        self.closed = False
        self.aborted = False
        self.protocol: asyncio.Protocol | None = None

    def get_extra_info(self, name, default=None):
        return {"peername": self.peer, "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data) -> None:
        if not self.closed:  # as asyncio's transports: a write after close goes nowhere
            self.sent += bytes(data)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.aborted = True
        self.close()

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Server:
    """One protocol class (one book) and uvicorn's shared state, as one `graphcache serve` has."""

    def __init__(self, limit_concurrency: int | None = None, **limits) -> None:
        limits = {
            "max_header_bytes": 16 << 10,
            "header_timeout_s": 10.0,
            "max_connections": 100,
            "body_timeout_s": 10.0,
            "slow_grace_s": 0.05,
            "max_slow_per_client": 2,
            **limits,
        }
        self.cls = guarded_protocol(**limits)
        self.release = asyncio.Event()
        self.started: list[str] = []  # paths of the requests the app was started for
        self.config = Config(
            self.app, interface="asgi3", lifespan="off", limit_concurrency=limit_concurrency, log_config=None
        )
        self.state = ServerState()

    async def app(self, scope, receive, send) -> None:
        """Echoes the body; /block answers once `release` is set."""
        self.started.append(scope["path"])
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/block":
            await self.release.wait()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def connect(self, ip: str, port: int = 40000) -> FakeTransport:
        protocol = self.cls(config=self.config, server_state=self.state, app_state={})
        transport = FakeTransport((ip, port))
        transport.protocol = protocol
        protocol.connection_made(transport)
        return transport

    @staticmethod
    def send(transport: FakeTransport, data: bytes) -> None:
        transport.protocol.data_received(data)

    async def close(self, *transports: FakeTransport) -> None:
        """Every connection closed and every app task finished; the book is empty again."""
        self.release.set()
        for t in transports:
            t.close()
        await until(lambda: not self.state.tasks and not self.state.connections, "all closed")
        book = self.cls.book
        assert (book.waiting_count, book.waiting, book.slow, book.apps_reading) == (0, {}, {}, 0)


def head(path: str = "/upload", length: int = 5) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()


async def until(condition, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not condition():
        assert loop.time() < deadline, f"not within {WAIT_S}s: {what}"
        await asyncio.sleep(0.01)


async def test_slow_connections_past_the_per_client_bound_are_closed():
    server = Server(max_slow_per_client=2)
    mine = []
    for i in range(4):
        t = server.connect("10.0.0.1", 40000 + i)
        server.send(t, head() + b"a")  # 1 of 5 body bytes
        mine.append(t)
    other = server.connect("10.0.0.2")
    server.send(other, head() + b"a")

    await until(lambda: all(t.closed for t in mine[2:]), "the 3rd and 4th slow ones closed")
    for t in mine[2:]:
        assert t.sent.startswith(b"HTTP/1.1 408 "), t.sent[:80]
        assert b"GRAPHCACHE_HTTP_MAX_SLOW_PER_CLIENT" in t.sent
    assert not any(t.closed for t in mine[:2]), "the client's first two slow connections keep their place"
    assert not other.closed, "another client's slow connection is not this client's"

    # A fast request from the same client is never slow: it is answered.
    fast = server.connect("10.0.0.1", 41000)
    server.send(fast, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    await until(lambda: fast.sent, "the fast request answered")
    assert fast.sent.startswith(b"HTTP/1.1 200 ")

    # A slow body that completes within its deadline is served.
    server.send(mine[0], b"bcde")
    await until(lambda: mine[0].sent.endswith(b"abcde"), "the slow body echoed")
    assert mine[0].sent.startswith(b"HTTP/1.1 200 ")
    await server.close(*mine, other, fast)


async def test_a_body_past_its_deadline_gets_408_and_a_head_past_its_deadline_is_closed():
    server = Server(body_timeout_s=0.3, header_timeout_s=0.3, max_slow_per_client=10)
    loop = asyncio.get_running_loop()
    start = loop.time()
    body = server.connect("10.0.0.1", 40001)
    server.send(body, head() + b"a")
    bare = server.connect("10.0.0.1", 40002)
    server.send(bare, b"POST /upload HTTP/1.1\r\nHost: x\r\n")  # the head never ends
    await until(lambda: body.closed and bare.closed, "both closed")
    assert loop.time() - start >= 0.25
    assert body.sent.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), body.sent[:80]
    assert b"GRAPHCACHE_HTTP_BODY_TIMEOUT_S" in body.sent
    assert b"connection: close" in body.sent
    assert bare.sent == b""  # no request yet to answer
    await server.close(body, bare)


async def test_a_body_answered_early_is_closed_at_its_deadline_without_a_second_answer():
    server = Server(body_timeout_s=0.3, max_slow_per_client=10)

    async def answers_without_reading(scope, receive, send):
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    server.config = Config(answers_without_reading, interface="asgi3", lifespan="off", log_config=None)
    t = server.connect("10.0.0.1")
    server.send(t, head(length=100_000) + b"a" * 70_000)  # 64 KiB in: the app starts, answers, reads none
    await until(lambda: t.sent, "answered early")
    await until(lambda: t.closed, "closed at the body deadline")
    assert t.sent.startswith(b"HTTP/1.1 401 ") and b"408" not in t.sent
    await server.close(t)


async def test_the_app_starts_once_the_body_is_in():
    server = Server(max_slow_per_client=10)
    trickled = server.connect("10.0.0.1", 1)
    server.send(trickled, head("/trickled", 3) + b"a")
    await asyncio.sleep(0.1)  # past the grace: slow, and still no handler running for it
    assert server.started == []
    server.send(trickled, b"bc")
    await until(lambda: trickled.sent, "answered once the body is in")
    assert server.started == ["/trickled"] and trickled.sent.endswith(b"abc")

    # 100-continue: the client sends its body only when the app reads, so the app starts at once.
    expects = server.connect("10.0.0.1", 2)
    server.send(
        expects, b"POST /expects HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n"
    )
    await until(lambda: expects.sent, "100 Continue sent")
    assert expects.sent == b"HTTP/1.1 100 Continue\r\n\r\n" and server.started[-1] == "/expects"
    server.send(expects, b"xyz")
    await until(lambda: expects.sent.endswith(b"xyz"), "the body echoed")

    # 64 KiB in: the app starts and reads the rest as it comes (uvicorn stops reading there).
    big = server.connect("10.0.0.1", 3)
    server.send(big, head("/big", 100_000) + b"b" * 70_000)
    await until(lambda: server.started[-1] == "/big", "the app started for a big body")
    server.send(big, b"b" * 30_000)
    await until(lambda: big.sent.endswith(b"b" * 100), "the big body echoed")
    # A body announced past max_body_bytes: the app refuses it (413) before it is sent.
    huge = server.connect("10.0.0.1", 4)
    server.send(huge, head("/huge", (1 << 20) + 1))
    await until(lambda: server.started[-1] == "/huge", "the app started for an oversized body")
    await server.close(trickled, expects, big, huge)


async def test_a_new_connection_takes_the_place_of_the_longest_waiting_of_the_busiest_client():
    server = Server(max_connections=4, max_slow_per_client=10)
    a1 = server.connect("10.0.0.1", 1)
    server.send(a1, head() + b"a")
    await asyncio.sleep(0.01)
    b1 = server.connect("10.0.0.2", 1)  # waits longer than a2, but its client holds fewer
    server.send(b1, head() + b"a")
    a2 = server.connect("10.0.0.1", 2)
    server.send(a2, head() + b"a")
    a3 = server.connect("10.0.0.1", 3)  # sends nothing yet: waiting on its head

    newcomer = server.connect("10.0.0.3")
    assert not newcomer.closed
    assert a1.closed and a1.sent.startswith(b"HTTP/1.1 408 "), "10.0.0.1's oldest gives way"
    assert b"GRAPHCACHE_HTTP_MAX_CONNECTIONS" in a1.sent
    assert not (b1.closed or a2.closed or a3.closed)
    server.send(newcomer, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    await until(lambda: newcomer.sent, "the newcomer answered")
    assert newcomer.sent.startswith(b"HTTP/1.1 200 ")
    await server.close(a1, b1, a2, a3, newcomer)


async def test_when_every_connection_is_being_answered_a_new_one_is_refused():
    server = Server(max_connections=2)
    busy = [server.connect("10.0.0.1", i) for i in (1, 2)]
    for t in busy:
        server.send(t, head("/block", 1) + b"x")  # complete: the app holds them
    await asyncio.sleep(0.01)
    extra = server.connect("10.0.0.2")
    assert extra.aborted and extra.sent == b""
    assert not any(t.closed for t in busy)
    server.release.set()
    await until(lambda: all(t.sent for t in busy), "the held requests answered")
    # Answered and idle, they wait on their clients again: a newcomer takes the older one's place.
    late = server.connect("10.0.0.2", 2)
    assert not late.aborted and busy[0].closed and not busy[1].closed
    await server.close(*busy, extra, late)


async def test_503_counts_only_connections_being_answered():
    server = Server(limit_concurrency=2, max_connections=50, max_slow_per_client=50)
    tricklers = [server.connect("10.0.0.1", i) for i in range(10)]
    for t in tricklers:
        server.send(t, head() + b"a")
    await asyncio.sleep(0.1)  # past the grace: all slow, none answered
    health = server.connect("10.0.0.2")
    server.send(health, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    await until(lambda: health.sent, "/health answered")
    assert health.sent.startswith(b"HTTP/1.1 200 "), health.sent[:80]

    # The limit still holds for requests being answered: two held, the third is a 503.
    held = [server.connect("10.0.0.3", i) for i in (1, 2)]
    for t in held:
        server.send(t, head("/block", 1) + b"x")
    await asyncio.sleep(0.01)
    third = server.connect("10.0.0.3", 3)
    server.send(third, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    await until(lambda: third.sent, "the third answered")
    assert third.sent.startswith(b"HTTP/1.1 503 "), third.sent[:80]
    await server.close(*tricklers, health, *held, third)


@pytest.mark.parametrize(
    "peer, key",
    [
        (("192.0.2.7", 1), "192.0.2.7"),
        (("2001:db8:1:2:aaaa::1", 1), "2001:db8:1:2::/64"),
        (("2001:db8:1:2:bbbb::9", 1), "2001:db8:1:2::/64"),
        (("::ffff:192.0.2.7", 1), "192.0.2.7"),
        (("fe80::1%eth0", 1), "fe80::/64"),
        (None, ""),
    ],
)
def test_client_key(peer, key):
    assert client_key(peer) == key
