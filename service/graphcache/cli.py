"""The `graphcache` command: serve, make-tiny-model; `graphcache --version` prints the version.

`graphcache serve` flags are generated from the Settings model, one per setting under its flat name
(Settings.flat_fields()), with the field's description as help, so flags, env vars (GRAPHCACHE_*) and
defaults never drift. Precedence: flag > env > default. Lists are comma-separated on the command line
(`--capture-sizes 1,2,4,8`, `--warmup-decode-sizes ""` for none) and in env
(`GRAPHCACHE_CAPTURE_SIZES=1,2,4,8`; JSON such as '[1,2,4,8]' works there too). `serve MODEL` takes the
model positionally, as `vllm serve` does: a local directory or a hub id (model/source.py), the same
setting as --model.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import difflib
import errno
import json
import logging
import os
import signal
import socket
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from graphcache import __version__
from graphcache.config import GPU_BATCH_DEFAULTS, LARGE_GPU_BYTES, LARGE_GPU_DEFAULTS, Settings
from graphcache.exit_watchdog import ExitWatchdog, exit_now
from graphcache.model.source import ModelSourceError, model_source
from graphcache.vllm_flags import (
    SPELLINGS,
    VllmFlagRefused,
    add_vllm_flags,
    apply_vllm_flags,
    normalize_argv,
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

ENV_PREFIX = "GRAPHCACHE_"
SECRET_FIELDS = {"admin_token", "api_key"}
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


# --------------------------------------------------------------------------- flags from Settings


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """`int | None` -> (int, True); anything else -> (annotation, False)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _list_parser(item_type: type, flag: str):
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        try:
            return [item_type(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} takes comma-separated {item_type.__name__} values, e.g. 1,2,4"
            ) from None

    return parse


def device_defaults(name: str) -> str | None:
    """The default of a setting whose default follows the device, as --help and the README say it ("64 on
    the CPU, 256 on CUDA GPUs under 70 GiB, 512 on GPUs of 70 GiB or more"); None for the others. From the
    constants Settings._gpu_defaults applies (max_capture_size's large-GPU value is with the default
    max_num_seqs)."""
    gpu, large = GPU_BATCH_DEFAULTS.get(name), LARGE_GPU_DEFAULTS.get(name)
    if gpu is None and large is None:
        return None
    cpu = Settings.flat_fields()[name].get_default(call_default_factory=True)
    gpu = cpu if gpu is None else gpu
    if large is None or large == gpu:
        return f"{cpu} on the CPU, {gpu} on CUDA"
    gib = LARGE_GPU_BYTES // 2**30
    return f"{cpu} on the CPU, {gpu} on CUDA GPUs under {gib} GiB, {large} on GPUs of {gib} GiB or more"


def _add_setting_flag(group: argparse._ArgumentGroup, name: str, field) -> None:
    flag = "--" + name.replace("_", "-")
    annotation, optional = _unwrap_optional(field.annotation)
    default = field.get_default(call_default_factory=True)
    shown = "***" if name in SECRET_FIELDS and default else default
    if isinstance(shown, list):
        shown = ",".join(map(str, shown)) or '""'
    shown = device_defaults(name) or shown
    help_text = (field.description or name.replace("_", " ").capitalize()).replace("%", "%%")
    help_text += f" [env {ENV_PREFIX}{name.upper()}; default: {'unset' if shown is None else shown}]"
    kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
    spelling = SPELLINGS.get(name)  # vLLM's spellings of this flag (vllm_flags.py)

    origin = typing.get_origin(annotation)
    if annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif origin is Literal:
        kwargs["choices"] = list(typing.get_args(annotation))
        if {"on", "off"} <= set(kwargs["choices"]):  # --flag alone is on (as vLLM's bool), --no-flag off
            kwargs.update(nargs="?", const="on")
    elif origin is list:
        (item_type,) = typing.get_args(annotation)
        kwargs["type"] = _list_parser(item_type, flag)
        kwargs["metavar"] = "A,B,..."
    elif annotation in (int, float, str):
        kwargs["type"] = annotation
    elif annotation is Path:
        kwargs["type"] = Path
        kwargs["metavar"] = "PATH"
    else:  # a new field type: fail loudly in tests rather than silently dropping the flag
        raise TypeError(
            f"cli.py cannot make a flag for setting {name} ({field.annotation}); teach "
            "_add_setting_flag this type"
        )
    if spelling is not None:
        for key in ("type", "nargs", "const"):
            if getattr(spelling, key) is not None:
                kwargs[key] = getattr(spelling, key)
        if kwargs.get("choices"):
            kwargs["metavar"] = "{" + ",".join(kwargs["choices"]) + "}"
    group.add_argument(flag, *(spelling.aliases if spelling else ()), **kwargs)
    if kwargs.get("const") == "on":
        group.add_argument(
            "--no-" + flag[2:],
            dest=name,
            action="store_const",
            const="off",
            default=argparse.SUPPRESS,
            help=f"The same as {flag} off.",
        )


def _settings_epilog() -> str:
    lines = ["settings (each is a `serve` flag and a GRAPHCACHE_* env var; flags override env):"]
    for name, field in Settings.flat_fields().items():
        lines.append(f"  {ENV_PREFIX + name.upper():<40} {field.description or ''}")
    return "\n".join(lines)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line on stderr naming the fix (exit 2), as serve's other
    refusals, not the usage block."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message}; `{self.prog} --help` lists the flags\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="graphcache",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="graphcache: an OpenAI-compatible LLM server with a managed CUDA-graph cache.",
        epilog=_settings_epilog(),
    )
    parser.add_argument(
        "--version",
        action="version",
        version=__version__,
        help="Print the version (of the installed package) and exit.",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=OneLineErrorParser
    )

    serve = sub.add_parser(
        "serve",
        help="Run the HTTP server (OpenAI API, /admin, /metrics, /health, /ready).",
        description="Run the HTTP server. The port is bound at once; GET /ready turns 200 "
        "when the model is loaded and the warmup captures are done.",
    )
    serve.add_argument(
        "model_arg",
        nargs="?",
        metavar="MODEL",
        default=None,
        help="The model, as `vllm serve MODEL` takes it: a Hugging Face model directory, or a hub id "
        "(org/name, fetched into the Hugging Face cache; see --revision). The same setting as --model "
        "(GRAPHCACHE_MODEL); unset: the embedded tiny model.",
    )
    group = serve.add_argument_group("settings")
    for name, field in Settings.flat_fields().items():
        _add_setting_flag(group, name, field)
    add_vllm_flags(serve, taken=serve._option_string_actions)

    tiny = sub.add_parser(
        "make-tiny-model",
        help="Write the embedded tiny model (random weights) to DIR.",
        description="Write a tiny Hugging Face-style model directory (config.json, "
        "model.safetensors, tokenizer.json) for tests and demos.",
    )
    tiny.add_argument("dir", type=Path, help="Directory to write (created if missing).")
    tiny.add_argument(
        "--arch",
        default="llama",
        help="Architecture of the tiny model: llama, mistral, qwen2 or qwen3 "
        "(as graphcache.model.tiny supports). [default: llama]",
    )
    tiny.add_argument("--seed", type=int, default=0, help="Seed of the random weights. [default: 0]")
    return parser


@dataclasses.dataclass
class ServeArgs:
    """A `serve` command line read: the settings, the warning lines of the vLLM flags it carried (logged at
    start), and the environment variables those flags set for libraries (huggingface_hub)."""

    settings: Settings
    warnings: list[str]
    env: dict[str, str]


def serve_args(args: argparse.Namespace) -> ServeArgs:
    """Flags given on the command line override env, which overrides defaults. The positional MODEL is
    the model setting, like --model; both given and different is a StartupError. vLLM's flags
    (vllm_flags.py) set settings too; one that cannot be honoured is a StartupError, and one graphcache
    handles otherwise is a warning line. A vLLM flag and a setting's own flag setting one setting to
    different values is a StartupError."""
    flat = Settings.flat_fields()
    overrides = {k: v for k, v in vars(args).items() if k in flat}
    warnings: list[str] = []
    for name, value in list(overrides.items()):
        spelling = SPELLINGS.get(name)
        if spelling is not None and spelling.convert is not None:
            overrides[name], warning = spelling.convert(value)
            if warning:
                warnings.append(f"--{name.replace('_', '-')}: {warning}")
    positional = getattr(args, "model_arg", None)
    if positional is not None:
        flag = overrides.get("model")
        if flag is not None and not _same_model(flag, positional):
            raise StartupError(
                f"MODEL {positional!r} and --model {flag!r} name different models; pass the model once "
                "(MODEL or --model)"
            )
        overrides["model"] = positional
    try:
        applied = apply_vllm_flags(args)
    except VllmFlagRefused as e:
        raise StartupError(str(e)) from None
    for name, value in applied.settings.items():
        if name in overrides and overrides[name] != value:
            raise StartupError(
                f"--{name.replace('_', '-')} and a vLLM flag set {name} to different values; pass one of them"
            )
        overrides[name] = value
    settings = Settings(**overrides)
    warnings += applied.finish(settings)
    return ServeArgs(settings, warnings, applied.env)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings of a `serve` command line (serve_args without its warnings and environment)."""
    return serve_args(args).settings


def _same_model(a: str, b: str) -> bool:
    """The same text, or the same existing directory written two ways (./m and m)."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


# --------------------------------------------------------------------------- startup preflight


class StartupError(Exception):
    """Serve cannot start: the message is one line, "<what is wrong>; <the fix>"."""


MODEL_DIR_HINT = (
    "pass MODEL (--model, GRAPHCACHE_MODEL) a Hugging Face model directory (config.json, "
    "*.safetensors, tokenizer.json) or a hub id (org/name), or leave it unset to use the embedded tiny model"
)


def check_model_dir(path: Path, max_model_len: int | None = None) -> None:
    """What would make loading the model at `path` fail, found without loading it: the directory, its
    config.json (parsed; the architecture supported), the weights files and tokenizer.json present,
    max_model_len within the model's limit. Raises StartupError. File checks come first and need no
    torch; only the architecture check imports graphcache.model.config (which imports torch)."""
    where = str(path)
    if not path.exists():
        raise StartupError(f"model directory {where!r} does not exist; {MODEL_DIR_HINT}")
    if not path.is_dir():
        raise StartupError(f"model path {where!r} is a file, not a directory; {MODEL_DIR_HINT}")
    try:
        names = set(os.listdir(path))
    except OSError as e:
        raise StartupError(
            f"model directory {where!r} is not readable ({e.strerror or e}); fix its "
            f"permissions (e.g. chmod -R a+rX {where}) or run as a user who can read it"
        ) from None
    if "config.json" not in names:
        raise StartupError(
            f"model directory {where!r} has no config.json; {MODEL_DIR_HINT} (the directory "
            "itself, not its parent: e.g. the snapshot directory huggingface-cli downloaded)"
        )
    index = path / "model.safetensors.index.json"
    if index.name in names:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise StartupError(
                f"{index} is unreadable or malformed ({type(e).__name__}: {e}); re-download it"
            ) from None
        missing = [n for n in shards if not (path / n).is_file()]
        if missing:
            raise StartupError(
                f"{index.name} in {where!r} lists {len(missing)} shard(s) that are missing, "
                f"e.g. {missing[:3]}; finish the download (re-run huggingface-cli download)"
            )
    elif not any(n.endswith(".safetensors") for n in names):
        bins = sorted(n for n in names if n.endswith(".bin"))
        fix = (
            f"convert {bins[:3]} to safetensors"
            if bins
            else "download the model's *.safetensors weights into it"
        )
        raise StartupError(f"model directory {where!r} has no *.safetensors weights; {fix}")
    if "tokenizer.json" not in names:
        raise StartupError(
            f"model directory {where!r} has no tokenizer.json; graphcache needs the fast "
            "tokenizer file: download it with the model, or write it with transformers' "
            f"AutoTokenizer.from_pretrained(...).save_pretrained({where!r})"
        )

    from graphcache.model.config import ModelLoadError, read_config  # imports torch; loads nothing
    from graphcache.model.quantization import resolve_quantization

    try:
        config = read_config(path)
        resolve_quantization(config)  # an unsupported quantization_config, before anything loads
    except ModelLoadError as e:
        raise StartupError(f"model {where!r}: {e}") from None
    if max_model_len is not None:
        limit = config.max_position_embeddings
        if config.sliding_window:
            limit = min(limit, config.sliding_window)
        if max_model_len > limit:
            raise StartupError(
                f"max_model_len {max_model_len} exceeds the model's limit {limit} "
                "(max_position_embeddings / sliding_window); lower --max-model-len "
                "(GRAPHCACHE_MAX_MODEL_LEN) or leave it unset"
            )


def bind_port(host: str, port: int) -> socket.socket:
    """The listening address, bound now (SO_REUSEADDR, as uvicorn binds), so that a port in use is
    found before the model loads and the port is ours from the start. Raises StartupError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(
            f"host {host!r} does not resolve ({e.strerror}); set --host or GRAPHCACHE_HOST "
            "to an address of this machine, e.g. 127.0.0.1, or 0.0.0.0 for all"
        ) from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise StartupError(
                f"port {port} on {host} is in use; pick another with --port or GRAPHCACHE_PORT, "
                "or stop the process that holds it"
            ) from None
        if e.errno == errno.EACCES:
            raise StartupError(
                f"port {port} on {host} needs privileges to bind; pick a port above 1023 with "
                "--port or GRAPHCACHE_PORT"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise StartupError(
                f"address {host} is not on this machine; set --host or GRAPHCACHE_HOST to one "
                "of its addresses, e.g. 127.0.0.1, or 0.0.0.0 for all"
            ) from None
        raise StartupError(
            f"cannot bind {host}:{port} ({e.strerror or e}); check --host and --port"
        ) from None
    sock.set_inheritable(True)
    return sock


def local_model_dir(settings: Settings) -> Path | None:
    """The local model directory the settings name, or None for the embedded tiny model and for a hub id
    (fetched and checked by the engine at start, so /ready can report the download). A path that does
    not exist is a StartupError naming it."""
    if settings.model.path is None:
        return None
    try:
        return model_source(settings.model.path).local
    except ModelSourceError as e:
        raise StartupError(str(e)) from None


def _preflight(settings: Settings) -> socket.socket:
    """Everything that would make serve fail and can be found without loading the model, in order:
    the model directory (when the model is a local directory; the embedded tiny model needs no check, a
    hub id is fetched by the engine), then the port. Returns the bound socket."""
    local = local_model_dir(settings)
    if local is not None:
        check_model_dir(local, settings.engine.max_model_len)
    check_speculative_config(settings)
    if settings.model.tensor_parallel_size > 1:
        check_tensor_parallel(settings)
    return bind_port(settings.http.host, settings.http.port)


def check_speculative_config(settings: Settings) -> None:
    """--speculative-config's keys, checked before anything loads (the setting itself only knows it is one
    JSON object: the settings floor cannot import the engine). Raises StartupError."""
    from graphcache.engine.spec.config import SpeculativeConfigError, parse_speculative_config

    try:
        config = parse_speculative_config(settings.engine.speculative_config)
    except SpeculativeConfigError as e:
        raise StartupError(f"{e} (--speculative-config, GRAPHCACHE_SPECULATIVE_CONFIG)") from None
    if config is None or config.method != "draft_model" or config.model is None:
        return
    if settings.model.tensor_parallel_size > 1:
        raise StartupError(
            'speculative_config.method "draft_model" runs with tensor_parallel_size 1 only (the draft model '
            "would need its own sharded ranks); set --tensor-parallel-size 1 or use method ngram"
        )
    draft = model_source(config.model).local  # a hub id is fetched (and checked) by the engine
    if draft is not None:
        check_model_dir(draft, settings.engine.max_model_len)
        check_draft_tokenizer(local_model_dir(settings), draft)


def check_draft_tokenizer(target: Path | None, draft: Path) -> None:
    """A local draft's tokenizer maps tokens to the target's ids (a local target's; the embedded model and
    a hub target are checked by the engine at load). Raises StartupError."""
    if target is None:
        return
    from graphcache.model.tokenizer import Tokenizer

    try:
        same = Tokenizer(target).vocabulary() == Tokenizer(draft).vocabulary()
    except (OSError, ValueError, RuntimeError) as e:  # a tokenizer that does not load: the engine says why
        log.debug("draft tokenizer check skipped: %s", e)
        return
    if not same:
        raise StartupError(
            f"speculative_config.model {str(draft)!r}: its tokenizer differs from the target's; name a draft "
            "model of the target's family with the same tokenizer, or use method ngram"
        )


def check_tensor_parallel(settings: Settings) -> None:
    """The model splits tensor_parallel_size ways (whole heads, KV heads and MLP columns per rank), and
    on CUDA there are that many GPUs (a hub model's split is checked by the engine once it is fetched).
    Raises StartupError."""
    from graphcache.model.config import ModelLoadError, read_config
    from graphcache.model.parallel import check_shardable
    from graphcache.model.tiny import DEFAULT_SHAPE

    size = settings.model.tensor_parallel_size
    local = local_model_dir(settings)
    if local is not None or settings.model.path is None:
        config: Any  # a ModelConfig, or the embedded model's shape in the fields check_shardable reads
        if local is not None:
            config, where = read_config(local), f"model {str(settings.model.path)!r}"
        else:  # the embedded tiny model, by its shape (not written yet)
            shape = DEFAULT_SHAPE
            config = types.SimpleNamespace(
                num_heads=shape["heads"],
                num_kv_heads=shape["kv_heads"],
                intermediate_size=shape["intermediate"],
            )
            where = "the embedded tiny model"
        try:
            check_shardable(config, size)
        except ModelLoadError as e:
            raise StartupError(
                f"{where}: {e} (--tensor-parallel-size, GRAPHCACHE_TENSOR_PARALLEL_SIZE)"
            ) from None
    import torch

    wants_cuda = settings.model.device == "cuda" or (
        settings.model.device == "auto" and torch.cuda.is_available()
    )
    if wants_cuda and torch.cuda.device_count() < size:
        raise StartupError(
            f"tensor_parallel_size {size} needs {size} GPUs, torch sees {torch.cuda.device_count()}; "
            "lower --tensor-parallel-size (GRAPHCACHE_TENSOR_PARALLEL_SIZE) or make more GPUs "
            "visible (CUDA_VISIBLE_DEVICES)"
        )


# --------------------------------------------------------------------------- commands


def _serve(settings: Settings, warnings: typing.Sequence[str] = ()) -> int:
    try:
        sock = _preflight(settings)
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


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `serve` subcommand's parser of build_parser()'s."""
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """argv read by the parser, with vLLM's spellings of serve's flags taken (vllm_flags.normalize_argv); an
    unknown flag is one line naming the closest known one."""
    serve = serve_parser(parser)
    if "serve" in argv:
        at = argv.index("serve") + 1
        argv = [*argv[:at], *normalize_argv(argv[at:], serve)]
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = next((u for u in unknown if u.startswith("-")), unknown[0])
        known = serve._option_string_actions if getattr(args, "command", None) == "serve" else {}
        close = difflib.get_close_matches(flag.partition("=")[0], list(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        which = "flag" if flag.startswith("-") else "argument"
        prog = serve.prog if known else parser.prog
        parser.exit(
            2,
            f"{prog}: unknown {which} {flag!r}{hint}; `{prog} --help` lists the flags, and docs/API.md the "
            "vLLM flags it takes\n",
        )
    return args


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
