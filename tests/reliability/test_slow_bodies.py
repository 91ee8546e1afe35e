"""The real server against clients that send their bodies slowly (issue 35, item 4):

- 105 connections each sending a body byte every 5 s filled GRAPHCACHE_HTTP_MAX_CONNECTIONS (100), and
  /health and every new request got 503 for a whole 60 s run. Now 200 such connections, reopened as
  soon as the server closes them, cannot deny /health (200 in under 1 s throughout) nor a completion;
- a body slower than GRAPHCACHE_HTTP_BODY_TIMEOUT_S is answered 408 and closed within the deadline
  and a margin.

The unit-level behaviour (per-client bound, which connection gives way): tests/api/test_http_protocol.py.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import subprocess
import threading
import time

import httpx
import pytest

from .support import PYTHON, completion_body

MAX_CONNECTIONS = 100
BODY_TIMEOUT_S = 4.0
SLOW_GRACE_S = 1.0
MAX_SLOW_PER_CLIENT = 8
TRICKLERS = 200
TRICKLE_EVERY_S = 2.0
ATTACK_S = 12.0  # past several body deadlines and grace periods
BODY_BYTES = 1000


@pytest.fixture(scope="module")
def server_settings():
    return {
        "http_max_connections": MAX_CONNECTIONS,
        "http_body_timeout_s": BODY_TIMEOUT_S,
        "http_header_timeout_s": BODY_TIMEOUT_S,
        "http_slow_grace_s": SLOW_GRACE_S,
        "http_max_slow_per_client": MAX_SLOW_PER_CLIENT,
        "max_model_len": 256,
    }


def _slow_head(port: int) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {BODY_BYTES}\r\n\r\n"
    ).encode()


# The attacker, in its own process: on a thread of the test it would hold the test's interpreter lock
# in bursts of 200 connects, and /health's latency would measure the test, not the server.
TRICKLER_SCRIPT = r"""
import json, socket, sys, time
port, count, seconds, every_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
head = sys.argv[5].encode()
slots = [None] * count
stats = {"opened": 0, "closed_by_server": 0, "answered_408": 0}

def open_one():
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=2)
        sock.sendall(head + b"{")
    except OSError:
        return None
    sock.setblocking(False)
    stats["opened"] += 1
    return sock

def alive(sock):
    try:
        data = sock.recv(4096)
    except BlockingIOError:
        return True
    except OSError:  # reset: refused or cut
        data = b""
    stats["answered_408"] += data.startswith(b"HTTP/1.1 408")
    stats["closed_by_server"] += 1
    sock.close()
    return False

end = time.monotonic() + seconds
next_byte = time.monotonic() + every_s
while time.monotonic() < end:
    send_byte = time.monotonic() >= next_byte
    if send_byte:
        next_byte += every_s
    for i, sock in enumerate(slots):
        if sock is not None and not alive(sock):
            sock = slots[i] = None
        if sock is None:
            slots[i] = open_one()
        elif send_byte:
            try:
                sock.send(b" ")
            except OSError:
                pass  # a reset shows at the next tick
    time.sleep(0.5)
for sock in slots:
    if sock is not None:
        sock.close()
print(json.dumps(stats), flush=True)
"""


class Tricklers:
    """TRICKLERS connections from another process for `seconds`, each a complete head announcing
    BODY_BYTES, then one body byte every TRICKLE_EVERY_S; one the server closes is opened again at the
    next tick (0.5 s), as an attacker would. `stats`: what the server did to them."""

    def __init__(self, port: int, seconds: float) -> None:
        self.seconds = seconds
        self.args = [str(port), str(TRICKLERS), str(seconds), str(TRICKLE_EVERY_S), _slow_head(port).decode()]
        self.proc: subprocess.Popen | None = None
        self.stats: dict[str, int] = {}

    def __enter__(self) -> Tricklers:
        self.proc = subprocess.Popen(
            [PYTHON, "-c", TRICKLER_SCRIPT, *self.args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        return self

    def __exit__(self, *exc) -> None:
        try:
            out, err = self.proc.communicate(timeout=self.seconds + 60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
        assert self.proc.returncode == 0, err.decode(errors="replace")[-2000:]
        self.stats = json.loads(out.decode().strip().splitlines()[-1])


class FreshHealthPoller:
    """GET /health every 100 ms, each on a new connection (as a kubelet probe), on its own thread:
    the status and latency of every try, an exception counting as a failure."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.results: list[tuple[int | str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-poller", daemon=True)

    def _run(self) -> None:
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(base_url=self.base_url, timeout=10, limits=limits) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    outcome: int | str = client.get("/health").status_code
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                self.results.append((outcome, time.perf_counter() - start))
                self._stop.wait(0.1)

    def __enter__(self) -> FreshHealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the /health poller did not stop"


@pytest.mark.timeout(180)
def test_trickling_bodies_cannot_deny_health_or_completions(server):
    with FreshHealthPoller(server.base_url) as poller, Tricklers(server.port, ATTACK_S) as tricklers:
        time.sleep(ATTACK_S / 2)
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            response = client.post("/v1/completions", json=completion_body("hello", max_tokens=4))
        # Leaving the block waits for the tricklers' end (ATTACK_S) before the poller stops.
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] is not None

    failures = [(outcome, round(t, 3)) for outcome, t in poller.results if outcome != 200]
    assert not failures, f"/health failed {len(failures)} of {len(poller.results)} times: {failures[:10]}"
    worst = max(t for _, t in poller.results)
    assert worst < 1.0, f"/health took {worst:.2f}s under trickling bodies"
    assert len(poller.results) >= 20  # it really polled throughout (100 ms apart, 12 s)

    # The attack ran at full strength: the server closed trickling connections over and over (the
    # per-client bound and the body deadline answer 408; a full table closes the longest waiting).
    stats = tricklers.stats
    assert stats["opened"] >= TRICKLERS, stats
    assert stats["closed_by_server"] >= TRICKLERS - MAX_SLOW_PER_CLIENT, stats
    assert stats["answered_408"] > 0, stats


def _recv_all(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sends until it closes the connection (or the timeout: then socket.timeout)."""
    sock.settimeout(timeout_s)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.timeout(120)
def test_a_body_slower_than_the_deadline_is_answered_408_and_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(_slow_head(server.port) + b"{")
        start = time.monotonic()
        # A byte a second: alive, but the body (BODY_BYTES) cannot complete before the deadline. Until
        # the server answers (or the margin is spent).
        answered_at = None
        while time.monotonic() < start + BODY_TIMEOUT_S + 10:
            if select.select([sock], [], [], 1.0)[0]:
                answered_at = time.monotonic()
                break
            try:
                sock.sendall(b" ")
            except OSError:
                answered_at = time.monotonic()
                break
        assert answered_at is not None, f"still open {BODY_TIMEOUT_S + 10:.0f}s after the head"
        answer = _recv_all(sock, 10)  # and then closed: b"" after the answer
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout"), answer[:200]
    assert b"GRAPHCACHE_HTTP_BODY_TIMEOUT_S" in answer
    # By the deadline (one slow connection: not the per-client bound, which would close it at the grace).
    assert answered_at - start >= BODY_TIMEOUT_S * 0.75, answered_at - start

    # A normal request right after is served.
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        assert client.get("/health").status_code == 200
