"""The `graphcache` command line's parser: serve's flags generated from Settings, and the settings they give.

`graphcache serve` flags are generated from the Settings model, one per setting under its flat name
(Settings.flat_fields()), with the field's description as help, so flags, env vars (GRAPHCACHE_*) and
defaults never drift. Precedence: flag > env > default. Lists are comma-separated on the command line
(`--capture-sizes 1,2,4,8`, `--warmup-decode-sizes ""` for none) and in env
(`GRAPHCACHE_CAPTURE_SIZES=1,2,4,8`; JSON such as '[1,2,4,8]' works there too). `serve MODEL` takes the
model positionally, as `vllm serve` does: a local directory or a hub id (model/source.py), the same
setting as --model. vLLM's own flags join the same parser (vllm_flags.py). The commands are cli.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from graphcache import __version__
from graphcache.config import GPU_BATCH_DEFAULTS, LARGE_GPU_BYTES, LARGE_GPU_DEFAULTS, Settings
from graphcache.preflight import StartupError
from graphcache.vllm_flags import (
    SPELLINGS,
    VllmFlagRefused,
    add_vllm_flags,
    apply_vllm_flags,
    normalize_argv,
)

ENV_PREFIX = "GRAPHCACHE_"
SECRET_FIELDS = {"admin_token", "api_key"}


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
