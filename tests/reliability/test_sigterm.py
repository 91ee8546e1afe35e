"""SIGTERM while requests run (what Kubernetes sends on a rollout): requests in flight either finish
or get a clean error (a JSON error, or an SSE error event followed by [DONE]) within the drain
timeout; new requests are refused; the process exits 0 without an ERROR or a traceback in its log.
A second signal during the drain exits at once. Each test owns its server: it kills it."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import pytest

from .support import assert_clean_error, completion_body


async def run_request(
    base_url: str, stream: bool, max_tokens: int, started: asyncio.Event | None = None
) -> dict:
    """One request, read to its end; the outcome, classified."""
    body = completion_body(
        "drain me",
        max_tokens,
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    outcome: dict = {"stream": stream, "kind": None, "detail": ""}
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as client:
            if not stream:
                if started is not None:
                    started.set()
                response = await client.post("/v1/completions", json=body)
                outcome["status"] = response.status_code
                if response.status_code == 200:
                    usage = response.json()["usage"]
                    ok = usage["completion_tokens"] == max_tokens
                    outcome["kind"] = "finished" if ok else "short"
                    outcome["detail"] = json.dumps(usage)
                else:
                    outcome["code"] = assert_clean_error(response)["code"]
                    outcome["kind"], outcome["detail"] = "clean_error", response.text[:300]
                    outcome["retry_after"] = response.headers.get("retry-after")
                return outcome
            async with client.stream("POST", "/v1/completions", json=body) as response:
                outcome["status"] = response.status_code
                if response.status_code != 200:
                    await response.aread()
                    outcome["code"] = assert_clean_error(response)["code"]
                    outcome["kind"], outcome["detail"] = "clean_error", response.text[:300]
                    outcome["retry_after"] = response.headers.get("retry-after")
                    return outcome
                events = []
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        events.append(line[5:].strip())
                        if started is not None and len(events) == 1:
                            started.set()
                if not events or events[-1] != "[DONE]":
                    outcome["kind"], outcome["detail"] = "cut", (events[-1:] or ["<nothing>"])[0][:200]
                    return outcome
                payloads = [json.loads(e) for e in events[:-1]]
                if any("error" in p for p in payloads):
                    error = next(p for p in payloads if "error" in p)
                    assert set(error) == {"error"} and {"message", "type"} <= set(error["error"]), error
                    outcome["code"] = error["error"].get("code")
                    outcome["kind"], outcome["detail"] = "clean_error", json.dumps(error)[:300]
                    return outcome
                usage = next((p["usage"] for p in payloads if p.get("usage")), None)
                finish = [
                    c.get("finish_reason")
                    for p in payloads
                    for c in p.get("choices", [])
                    if c.get("finish_reason")
                ]
                ok = usage is not None and usage["completion_tokens"] == max_tokens and finish == ["length"]
                outcome["kind"] = "finished" if ok else "short"
                outcome["detail"] = json.dumps({"usage": usage, "finish": finish})
                return outcome
    except httpx.HTTPError as exc:
        outcome["kind"], outcome["detail"] = "transport", f"{type(exc).__name__}: {exc}"
        return outcome


async def new_request_after_sigterm(base_url: str) -> str:
    """What a client arriving after the signal sees: refused connection or a clean 503, nothing else.
    A connection the kernel accepted into the listen backlog just before the server closed its socket is
    reset unread (seen once on a busy 2-core machine: httpx.ReadError, no byte of a response): the request
    never reached the server, so it counts as refused; a response that is not a clean 503 still fails."""
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as client:
            response = await client.post("/v1/completions", json=completion_body(max_tokens=4))
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return "refused"
    if response.status_code == 503:
        assert_clean_error(response, 503)
        return "503"
    return f"unexpected {response.status_code}: {response.text[:200]}"


# The exit watchdog's line (exit_watchdog.ExitWatchdog): the stop outlasted its deadline and left threads behind.
WATCHDOG_LINE = "without waiting for"


def assert_clean_exit_log(server) -> None:
    """A graceful stop is not an error: no ERROR record and no traceback in the server's log, and the
    exit watchdog had nothing to cut short."""
    text = server.log_path.read_text(errors="replace")
    assert WATCHDOG_LINE not in text, f"the exit watchdog fired on a clean exit:\n{server.log_tail()}"
    assert "Traceback" not in text, f"traceback on a clean exit:\n{server.log_tail()}"
    assert not re.search(r"^\S+ \S+ (ERROR|CRITICAL) ", text, re.MULTILINE), (
        f"ERROR on a clean exit:\n{text[-3000:]}"
    )


@pytest.mark.timeout(240)
async def test_sigterm_drains_in_flight_requests_and_exits_zero(server_factory):
    # The work (~1-2 s each when idle) must finish inside the drain timeout even on a loaded 2-core
    # CI machine, where it once took over 10 s: the timeout is a generous margin, not a measurement.
    drain_timeout = 60.0
    server = server_factory(drain_timeout_s=drain_timeout, max_num_seqs=4)
    # Far beyond the moment of SIGTERM: streams are past their first token, 299 still to come.
    started = [asyncio.Event() for _ in range(6)]
    tasks = [
        asyncio.create_task(
            run_request(server.base_url, stream=i % 2 == 0, max_tokens=300, started=started[i])
        )
        for i in range(6)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=30)
    await asyncio.sleep(0.2)

    t0 = time.monotonic()
    server.terminate()
    late = await new_request_after_sigterm(server.base_url)
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=drain_timeout + 20)
    code = await asyncio.to_thread(server.wait_exit, drain_timeout + 20)
    elapsed = time.monotonic() - t0

    assert late in ("refused", "503"), late
    assert [o["kind"] for o in outcomes] == ["finished"] * 6, outcomes
    assert code == 0, f"exit code {code}:\n{server.log_tail()}"
    assert elapsed < drain_timeout + 10, f"took {elapsed:.1f}s to drain and exit"
    assert_clean_exit_log(server)


@pytest.mark.timeout(120)
async def test_sigterm_past_the_drain_timeout_ends_requests_cleanly(server_factory):
    """Work that cannot finish within the drain timeout: each request still gets a well-formed end
    (an error body, or an SSE error event and [DONE]), never a connection cut mid-stream or a hang."""
    drain_timeout = 1.0
    server = server_factory(drain_timeout_s=drain_timeout, max_num_seqs=2)
    started = [asyncio.Event() for _ in range(2)]
    # Two run (they signal started), then four wait in the queue: none can finish 1800 tokens in 1 s.
    # The two are sent first and awaited before the rest, so they are the ones admitted (sent all at
    # once, arrival order decides, and a stream queued behind 1800-token requests never starts in time).
    tasks = [
        asyncio.create_task(
            run_request(server.base_url, stream=i % 2 == 0, max_tokens=1800, started=started[i])
        )
        for i in range(2)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=30)
    tasks += [
        asyncio.create_task(run_request(server.base_url, stream=i % 2 == 0, max_tokens=1800))
        for i in range(2, 6)
    ]
    await asyncio.sleep(0.3)

    t0 = time.monotonic()
    server.terminate()
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=drain_timeout + 30)
    answered = time.monotonic() - t0
    code = await asyncio.to_thread(server.wait_exit, 30)

    bad = [o for o in outcomes if o["kind"] not in ("finished", "clean_error")]
    assert not bad, f"requests cut or lost at shutdown: {bad}\n{server.log_tail()}"
    assert any(o["kind"] == "clean_error" for o in outcomes), outcomes
    # Everyone has an answer within the drain timeout plus the engine's grace (5 s) and slack.
    assert answered < drain_timeout + 10, f"answers took {answered:.1f}s"
    assert code == 0, f"exit code {code}:\n{server.log_tail()}"
    # Cut by the drain timeout: 503 `shutting_down` with Retry-After (or, for a stream, an error event
    # with that code), not a 500 `engine_error`: the client should retry elsewhere. (A request the
    # signal caught before it reached the engine is refused at the door: `draining`.)
    errors = [o for o in outcomes if o["kind"] == "clean_error"]
    codes = [o["code"] for o in errors]
    assert "shutting_down" in codes and set(codes) <= {"shutting_down", "draining"}, errors
    for o in errors:
        if o["status"] != 200:
            assert o["status"] == 503 and int(o["retry_after"]) >= 1, o
    assert_clean_exit_log(server)


@pytest.mark.timeout(60)
def test_sigterm_on_an_idle_server_exits_zero_at_once(server_factory):
    server = server_factory(drain_timeout_s=10.0)
    t0 = time.monotonic()
    server.terminate()
    code = server.wait_exit(15)
    assert code == 0, f"exit code {code}:\n{server.log_tail()}"
    assert time.monotonic() - t0 < 5.0
    assert_clean_exit_log(server)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
async def test_a_second_signal_during_the_drain_exits_at_once(server_factory, second):
    """Ctrl-C twice (or `kill` twice): the second signal does not wait for the drain (60 s here) but
    exits at once, non-zero (128 + the signal, as a shell reports a kill), with one log line."""
    drain_timeout = 60.0
    server = server_factory(drain_timeout_s=drain_timeout, max_num_seqs=2)
    started = asyncio.Event()
    task = asyncio.create_task(run_request(server.base_url, stream=True, max_tokens=1800, started=started))
    try:
        await asyncio.wait_for(started.wait(), timeout=30)
        server.terminate()  # the first: the drain begins (it would last 60 s)
        await asyncio.sleep(1.0)
        assert server.running, f"exited on the first signal:\n{server.log_tail()}"
        t0 = time.monotonic()
        server.proc.send_signal(second)
        code = await asyncio.to_thread(server.wait_exit, 20)
        elapsed = time.monotonic() - t0
    finally:
        task.cancel()
    assert code == 128 + second, f"exit code {code}:\n{server.log_tail()}"
    assert elapsed < 10, f"took {elapsed:.1f}s to exit after the second signal"
    lines = [
        line
        for line in server.log_path.read_text(errors="replace").splitlines()
        if f"second {signal.Signals(second).name}" in line
    ]
    assert len(lines) == 1, server.log_tail()


# --- a stop that worker threads cannot hold up -------------------------------------------------------
# Python joins worker threads as it exits (asyncio's default executor, the API's concurrent.futures
# pools), and no thread can be interrupted: one stuck in a long computation (a chat template rendering
# for minutes, a grammar compiling) once kept a stopped server alive 90 s past SIGTERM (issue 35).
# Whatever runs, the process ends by drain_timeout_s + DRAIN_BACKSTOP_S (uvicorn's wait for open
# connections) + SHUTDOWN_SLACK_S; the margin is for a busy 2-core CI machine.
STOP_MARGIN_S = 5.0
# Nested loops: 10^10 iterations of jinja, hours of pure Python, wherever the template renders.
ENDLESS_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def stop_bound(drain_timeout: float) -> float:
    from graphcache.cli import DRAIN_BACKSTOP_S, SHUTDOWN_SLACK_S

    return drain_timeout + DRAIN_BACKSTOP_S + SHUTDOWN_SLACK_S + STOP_MARGIN_S


async def post_in_background(base_url: str, path: str, body: dict) -> asyncio.Task:
    """The request, sent; still unanswered a second later (the test fails if it was answered)."""

    async def send() -> str:
        try:
            async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:
                response = await client.post(path, json=body)
            return f"{response.status_code}: {response.text[:300]}"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"

    task = asyncio.create_task(send())
    await asyncio.sleep(1.5)
    assert not task.done(), f"{path} was answered at once, nothing in flight: {task.result()}"
    return task


async def sigterm_and_time_the_exit(server, drain_timeout: float) -> tuple[int | None, float]:
    t0 = time.monotonic()
    server.terminate()
    code = await asyncio.to_thread(server.wait_exit, stop_bound(drain_timeout) + 30)
    return code, time.monotonic() - t0


@pytest.mark.timeout(180)
async def test_sigterm_exits_in_time_while_a_chat_template_renders(server_factory):
    """The issue's case: a request whose own chat template runs for hours is rendering at SIGTERM.
    Where the template renders (a thread of the API, a worker process) is not this test's business:
    the process ends within the bound, exit code 0. The trust and timeout settings let the template
    be accepted and keep rendering (unknown GRAPHCACHE_* settings are ignored)."""
    drain_timeout = 1.0
    server = server_factory(
        drain_timeout_s=drain_timeout,
        max_num_seqs=2,
        trust_request_chat_template=True,
        chat_template_timeout_s=600,
    )
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "chat_template": ENDLESS_TEMPLATE,
    }
    request = await post_in_background(server.base_url, "/v1/chat/completions", body)
    try:
        code, elapsed = await sigterm_and_time_the_exit(server, drain_timeout)
    finally:
        request.cancel()
    assert code is not None, f"still running {elapsed:.0f}s after SIGTERM:\n{server.log_tail()}"
    assert elapsed < stop_bound(drain_timeout), f"took {elapsed:.1f}s to exit:\n{server.log_tail()}"
    assert code == 0, f"exit code {code}:\n{server.log_tail()}"


# Serve with a route that occupies a thread of the API's input pool (spinning in pure Python, as a
# template renders) and one of asyncio's default executor (blocked, as a grammar compile in C may be)
# for good: the two joins Python makes on its way out, each held forever.
STUCK_THREADS_SERVER = """
import asyncio, sys, threading
import graphcache.api.server.app as app_module
from graphcache.api.server.executors import run_input

create_app = app_module.create_app
forever = threading.Event()

def spin():
    while not forever.is_set():
        pass

def patched_create_app(*args, **kwargs):
    app = create_app(*args, **kwargs)

    @app.post("/test/stuck-threads")
    async def stuck_threads():
        await asyncio.gather(run_input(spin), asyncio.to_thread(forever.wait))

    return app

app_module.create_app = patched_create_app
from graphcache.cli import main
sys.exit(main())
"""


@pytest.mark.timeout(180)
async def test_sigterm_exits_in_time_whatever_worker_threads_do(cache_dir, log_dir):
    from .conftest import BASE_SETTINGS
    from .support import PYTHON, ServerProcess

    drain_timeout = 1.0
    settings = {**BASE_SETTINGS, "drain_timeout_s": drain_timeout, "log_level": "info"}
    server = ServerProcess(cache_dir, log_dir, name="stuck-threads", **settings)
    server.command = [PYTHON, "-c", STUCK_THREADS_SERVER]
    try:
        server.start()
        request = await post_in_background(server.base_url, "/test/stuck-threads", {})
        try:
            code, elapsed = await sigterm_and_time_the_exit(server, drain_timeout)
        finally:
            request.cancel()
    finally:
        server.kill()
    assert code is not None, f"still running {elapsed:.0f}s after SIGTERM:\n{server.log_tail()}"
    assert elapsed < stop_bound(drain_timeout), f"took {elapsed:.1f}s to exit:\n{server.log_tail()}"
    # The app shut down (engine stopped) before the watchdog ended the wait for the threads: graceful.
    assert code == 0, f"exit code {code}:\n{server.log_tail()}"
    text = server.log_path.read_text(errors="replace")
    lines = [line for line in text.splitlines() if WATCHDOG_LINE in line]
    assert len(lines) == 1, server.log_tail()
    assert "graphcache-input" in lines[0], lines[0]  # who held the exit (and where: the line says)
    assert text.index("engine stopped") < text.index(WATCHDOG_LINE)  # the engine's shutdown ran first


# --- the watchdog itself -------------------------------------------------------------------------------


class Exits:
    """ExitWatchdog's exit, recorded instead of ending pytest."""

    def __init__(self) -> None:
        self.codes: list[tuple[int, float]] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append((code, time.monotonic()))
        self.done.set()


@pytest.mark.timeout(30)
def test_the_watchdog_exits_at_its_deadline_with_the_code_of_that_moment(caplog):
    from graphcache.exit_watchdog import ExitWatchdog

    exits, state = Exits(), {"code": 7}
    watchdog = ExitWatchdog(lambda: state["code"], exit=exits)
    t0 = time.monotonic()
    watchdog.arm(0.5, "test deadline")
    state["code"] = 3  # read when it fires, not when armed
    assert exits.done.wait(10)
    code, at = exits.codes[0]
    elapsed = at - t0
    assert code == 3 and 0.5 <= elapsed < 5, (code, elapsed)
    assert "test deadline; exiting now (code 3)" in caplog.text


@pytest.mark.timeout(30)
def test_arming_again_never_postpones_the_exit_but_may_advance_it():
    from graphcache.exit_watchdog import ExitWatchdog

    exits = Exits()
    watchdog = ExitWatchdog(lambda: 0, exit=exits)
    t0 = time.monotonic()
    watchdog.arm(60, "far")
    far = watchdog.deadline
    watchdog.arm(120, "farther")  # later: ignored
    assert watchdog.deadline == far
    watchdog.arm(0.3, "near")  # earlier: the waiting thread wakes for it
    assert exits.done.wait(10)
    assert exits.codes[0][1] - t0 < 5, exits.codes


@pytest.mark.timeout(30)
def test_the_watchdog_exits_1_when_the_code_cannot_be_decided():
    from graphcache.exit_watchdog import ExitWatchdog

    def broken() -> int:
        raise RuntimeError("no engine")

    exits = Exits()
    ExitWatchdog(broken, exit=exits).arm(0.1, "test")
    assert exits.done.wait(10) and exits.codes[0][0] == 1


def test_running_threads_names_each_thread_and_where_it_is(monkeypatch):
    from graphcache.exit_watchdog import running_threads

    release = threading.Event()

    def held_here() -> None:
        release.wait(30)

    thread = threading.Thread(target=held_here, name="test-held-thread", daemon=True)
    thread.start()
    # Only this test's thread beside the caller: a long pytest run holds dozens of pool threads, and the
    # line names the first few only.
    monkeypatch.setattr(threading, "enumerate", lambda: [threading.current_thread(), thread])
    try:
        line = running_threads()
    finally:
        release.set()
        thread.join(10)
    assert "\n" not in line
    assert "test-held-thread at threading.py:" in line and " in wait" in line, line  # Event.wait's frame
    assert threading.current_thread().name not in line, line  # the caller is not a thread it waits for
