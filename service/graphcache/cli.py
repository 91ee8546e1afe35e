"""The `graphcache` command: serve, make-tiny-model; `graphcache --version` prints the version.

This module holds the commands: `main` parses the command line (the parser and the settings it gives
are cli_parser.py's), `serve` checks the settings before anything loads or binds (preflight.py), then
runs the server until a signal drains it; `make-tiny-model` writes the embedded test model.
The flags, the startup checks and their errors are re-exported here: `graphcache.cli` is the command
line's public import path.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import typing
from typing import Any

from pydantic import ValidationError

from graphcache.cli_parser import (
    ServeArgs,
    build_parser,
    device_defaults,
    parse_command_line,
    serve_args,
    serve_parser,
    settings_from_args,
)
from graphcache.config import Settings
from graphcache.exit_watchdog import ExitWatchdog, exit_now
from graphcache.preflight import (
    StartupError,
    bind_port,
    check_model_dir,
    check_tensor_parallel,
    local_model_dir,
    run_preflight,
)

__all__ = [
    "ServeArgs",
    "StartupError",
    "bind_port",
    "build_parser",
    "check_model_dir",
    "check_tensor_parallel",
    "device_defaults",
    "local_model_dir",
    "main",
    "parse_command_line",
    "serve_args",
    "serve_parser",
    "settings_from_args",
]


log = logging.getLogger("graphcache.cli")


# Past drain_timeout_s the engine fails what is left and handlers answer; uvicorn cuts connections
# only if that has not happened this much later (engine grace 5 s + slack).
DRAIN_BACKSTOP_S = 10.0
# The whole stop, from the first signal, ends by drain_timeout_s + DRAIN_BACKSTOP_S + this, whatever
# is still running (ExitWatchdog): the app's shutdown (the engine joined) fits in it when nothing hangs.
SHUTDOWN_SLACK_S = 5.0
# Once the app has shut down (engine stopped, logs written), what is left is the event loop's and the
# interpreter's teardown, which join worker threads; past this the process exits without them.
EXIT_JOIN_GRACE_S = 3.0
# Exit codes of serve: 2 a setting or the preflight refused to start (nothing loaded, nothing bound);
# 3 the engine failed to load after the port was bound (a supervisor restarts or reports it).
EXIT_REFUSED = 2
EXIT_LOAD_FAILED = 3
MAX_CAUSE_CHARS = 600


# --------------------------------------------------------------------------- commands


def _serve(settings: Settings, warnings: typing.Sequence[str] = ()) -> int:
    try:
        sock = run_preflight(settings)
    except StartupError as e:
        print(f"graphcache: {e}", file=sys.stderr)
        return EXIT_REFUSED
    port = sock.getsockname()[1]
    if port != settings.http.port:  # port 0: the one the OS picked, so logs and /admin say the real port
        settings = settings.updated(port=port)

    import uvicorn

    from graphcache.api.server.app import create_app
    from graphcache.api.server.http_protocol import guarded_protocol
    from graphcache.api.server.request_log import setup_logging

    setup_logging(settings.logging.log_format, settings.logging.log_level)
    for line in warnings:  # vLLM flags graphcache handles its own way: one line each
        log.warning("%s", line)
    log.info("listening on http://%s:%d (bound before loading the model)", settings.http.host, port)
    app = create_app(settings)

    # The stop ends in time whatever worker threads do: the event loop and the interpreter join them
    # as they exit, and one stuck in a long computation (a chat template rendering for minutes, a
    # grammar compiling) would keep the process alive after the drain, forever.
    stopping: dict[str, Any] = {"signal": None, "shut_down": False, "code": None}

    def watchdog_exit_code() -> int:
        """The exit code when the watchdog ends the process: the one serve decided, or the one it
        would decide (a load failure, with its line), or 0 once the app shut down (only threads were
        left); a shutdown that did not finish is not graceful: 128 + the signal, as a kill."""
        if stopping["code"] is not None:
            return stopping["code"]
        load_error = app.state.engine.load_error
        if load_error is not None:
            print(f"graphcache: {load_failure_line(load_error)}", file=sys.stderr)
            return EXIT_LOAD_FAILED
        if stopping["shut_down"]:
            return 0
        return 128 + (stopping["signal"] or signal.SIGTERM)

    watchdog = ExitWatchdog(watchdog_exit_code)
    stop_deadline_s = settings.http.drain_timeout_s + DRAIN_BACKSTOP_S + SHUTDOWN_SLACK_S

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:
                # A second SIGINT/SIGTERM while draining (Ctrl-C twice, `kill` twice): whoever sent it
                # wants out now, in-flight requests or not. No drain, no engine join: exit at once.
                exit_now(sig)
            stopping["signal"] = sig
            watchdog.arm(stop_deadline_s, f"the stop did not finish within {stop_deadline_s:.0f}s")
            # From the signal on, requests arriving on open keep-alive connections get 503.
            app.state.engine.stop_accepting()
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            # A model that fails to load leaves nothing to serve: exit (non-zero, below) rather than
            # answer /health forever, so systemd, `docker run --restart` and Kubernetes see the failure.
            if app.state.engine.load_error is not None:
                self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None) -> None:
            # A stop for a failed load has no signal: its deadline starts here.
            watchdog.arm(stop_deadline_s, f"the stop did not finish within {stop_deadline_s:.0f}s")
            # The engine drains while uvicorn waits for open connections: requests still running at
            # drain_timeout_s are ended by the engine with an error their handlers send cleanly
            # (an error body, or an SSE error event and [DONE]), so the connections close by
            # themselves; uvicorn's own timeout (which would cut them) is only a backstop.
            drain = asyncio.create_task(app.state.drain())
            await super().shutdown(sockets)
            await drain
            # The engine is stopped and the logs written; what is left joins worker threads.
            stopping["shut_down"] = True
            watchdog.arm(
                EXIT_JOIN_GRACE_S,
                f"worker threads still ran {EXIT_JOIN_GRACE_S:.0f}s after the server shut down",
            )

    # The HTTP limits uvicorn lacks (head size and timeout, body deadline, slow connections per client,
    # open connections): api/server/http_protocol.py.
    http = settings.http
    protocol = guarded_protocol(
        http.max_header_bytes,
        http.header_timeout_s,
        http.max_connections,
        body_timeout_s=http.body_timeout_s,
        slow_grace_s=http.slow_grace_s,
        max_slow_per_client=http.max_slow_per_client,
        max_body_bytes=http.max_body_bytes,
    )
    config = uvicorn.Config(
        app,
        host=http.host,
        port=http.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        # uvicorn takes float seconds (it waits with asyncio's timeouts); its annotations say int.
        timeout_graceful_shutdown=http.drain_timeout_s + DRAIN_BACKSTOP_S,  # type: ignore[arg-type]
        log_level=settings.logging.log_level.lower(),
        http=protocol,
        h11_max_incomplete_event_size=http.max_header_bytes,
        timeout_keep_alive=http.header_timeout_s,  # type: ignore[arg-type]
        limit_concurrency=http.max_connections,
    )
    server = DrainingServer(config)
    # uvicorn re-raises the signal that stopped it once it is done; a graceful stop exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    server.run(sockets=[sock])
    load_error = app.state.engine.load_error
    if load_error is not None:
        stopping["code"] = EXIT_LOAD_FAILED  # the line below is printed once, by whoever exits
        print(f"graphcache: {load_failure_line(load_error)}", file=sys.stderr)
        return EXIT_LOAD_FAILED
    if not server.started:
        log.error("the server did not start on %s:%s (see the errors above)", settings.http.host, port)
        stopping["code"] = 1
        return 1
    stopping["code"] = 0
    return 0


def load_failure_line(error: str) -> str:
    """The engine's load error as the one line serve exits with: the cause (the exception's message,
    which names the fix where the loader knows it), its first line only, bounded."""
    cause = (error.strip().splitlines() or ["unknown cause"])[0]
    cause = cause.removeprefix("model load failed: ")
    # Our own load errors say what is wrong and the fix; their type name adds nothing.
    for known in ("ModelLoadError: ", "ModelSourceError: "):
        cause = cause.removeprefix(known)
    if len(cause) > MAX_CAUSE_CHARS:  # the middle goes: the start says what failed, the end the fix
        half = MAX_CAUSE_CHARS // 2
        cause = f"{cause[:half]} ... {cause[-half:]}"
    if ";" not in cause:  # the message names no fix: point at the traceback logged above
        cause += "; the log above has the traceback: fix its cause and start again"
    return f"the engine failed to load the model: {cause}"


def _make_tiny_model(args: argparse.Namespace) -> int:
    from graphcache.model.tiny import make_default_model

    try:  # the embedded default's shape, so `serve --model DIR` behaves like the default model
        path = make_default_model(args.dir, arch=args.arch, seed=args.seed)
    except ValueError as e:  # e.g. an unknown arch: the message lists the known ones
        print(f"graphcache make-tiny-model: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, list(sys.argv[1:] if argv is None else argv))
    if args.command == "serve":
        try:
            read = serve_args(args)
        except StartupError as e:
            print(f"graphcache serve: {e}", file=sys.stderr)
            return 2
        except ValidationError as e:
            for err in e.errors():
                # ("http", "admin_token") -> admin_token: the flat name the user set
                loc = err["loc"][1:] if err["loc"] and err["loc"][0] in Settings.model_fields else err["loc"]
                where = ".".join(map(str, loc))
                message = err["msg"].removeprefix("Value error, ")  # never err["input"]: it may be a secret
                what = f"invalid setting {where}" if where else "invalid settings"  # a rule over several
                print(f"graphcache serve: {what}: {message}", file=sys.stderr)
            return 2
        # Before anything imports huggingface_hub (it reads HF_HUB_CACHE once); the engine process inherits it.
        os.environ.update(read.env)
        return _serve(read.settings, read.warnings)
    if args.command == "make-tiny-model":
        return _make_tiny_model(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
