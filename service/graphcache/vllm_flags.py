"""vLLM's `serve` flags on `graphcache serve`, so a vLLM command line starts graphcache.

Flags named as a setting (`--max-num-seqs`, `--tensor-parallel-size`, `--gpu-memory-utilization`, ...) are that
setting's generated flag (cli.py); SPELLINGS lets those flags take vLLM's spellings too (`-tp 2`, `--dtype half`,
`--max-model-len 32k`, `--async-scheduling` without a value, several `--served-model-name`s). Every other flag a
vLLM deployment commonly sets is in FLAGS (vllm_flag_table.py), with what graphcache does with it:

  * mapped onto settings: `--num-gpu-blocks-override` is num_kv_blocks, `--cudagraph-capture-sizes` capture_sizes;
  * accepted as it is where graphcache already behaves so (`--enable-auto-tool-choice`: tool_choice "auto" always
    works; `--disable-log-requests`: no prompt is ever logged);
  * accepted with one warning line saying what graphcache does instead (`--swap-space`: preemption recomputes);
  * refused with one line naming why and the fix, where ignoring it would serve something else than asked
    (`--pipeline-parallel-size 2`, `--ssl-keyfile`).

`normalize_argv` first turns spellings vLLM's parser takes and argparse does not into ours: `--max_model_len`
(underscores) and bools given a value (`--enforce-eager=true`, `--enable-prefix-caching false`). docs/API.md
("vLLM's serve flags") lists the same table for people.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from graphcache.vllm_flag_table import (
    FLAGS,
    MAX_LOGPROBS,
    Effect,
    VllmFlag,
    VllmFlagRefused,
    human_readable_int,
    quantization_word,
    shown,
)

__all__ = [
    "FLAGS",
    "MAX_LOGPROBS",
    "SPELLINGS",
    "Applied",
    "Effect",
    "Spelling",
    "VllmFlag",
    "VllmFlagRefused",
    "add_vllm_flags",
    "apply_vllm_flags",
    "human_readable_int",
    "normalize_argv",
]


# --------------------------------------------------------------------------- vLLM spellings of setting flags


@dataclass(frozen=True)
class Spelling:
    """How a generated setting flag also takes vLLM's spelling: extra option strings, a text parser (applied
    before argparse checks choices), argparse's nargs/const, and a conversion of the parsed value into the
    setting's (value, warning or None)."""

    aliases: tuple[str, ...] = ()
    type: Callable[[str], Any] | None = None
    nargs: str | None = None
    const: Any = None
    convert: Callable[[Any], tuple[Any, str | None]] | None = None


def _dtype(text: str) -> str:
    return {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(text, text)


def _quantization(text: str) -> str:
    if quantization_word(text):
        return "fp8" if text.strip().lower() == "fp8" else "auto"
    raise argparse.ArgumentTypeError(
        f"{shown(text)!r} is not served: graphcache serves checkpoints as they are (FP8 ones in FP8) with "
        "auto, or quantizes a bf16/fp16 checkpoint to FP8 with fp8 (README, Quantization)"
    )


def _argparse_int(text: str) -> int:
    try:
        return human_readable_int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _max_model_len(text: str) -> int | None:
    if text.strip().lower() in {"auto", "-1"}:
        return None
    return _argparse_int(text)


def _max_model_len_value(value: int | None) -> tuple[int | None, str | None]:
    if value is None:
        return None, "max_model_len auto: graphcache uses the model's own limit (config.json)"
    return value, None


def _on_off(text: str) -> str:
    return {"true": "on", "false": "off"}.get(text.strip().lower(), text)


def _served_names(names: list[str]) -> tuple[str, str | None]:
    if len(names) == 1:
        return names[0], None
    others = ", ".join(repr(n) for n in names[1:])
    return names[0], (
        f"graphcache answers to one model name: {names[0]!r}; requests naming {shown(others)} get 404"
    )


SPELLINGS: dict[str, Spelling] = {
    "dtype": Spelling(type=_dtype),
    "quantization": Spelling(aliases=("-q",), type=_quantization),
    "tensor_parallel_size": Spelling(aliases=("-tp",)),
    "max_model_len": Spelling(type=_max_model_len, convert=_max_model_len_value),
    "max_num_batched_tokens": Spelling(type=_argparse_int),
    "async_scheduling": Spelling(type=_on_off, nargs="?", const="on"),
    "served_model_name": Spelling(nargs="+", convert=_served_names),
    # vLLM's `--lora-modules a=/x b=/y` and its JSON objects (commas inside): one module per value
    "lora_modules": Spelling(type=str, nargs="+"),
}


# --------------------------------------------------------------------------- parser and arguments


def add_vllm_flags(parser: argparse.ArgumentParser, taken: Iterable[str]) -> None:
    """FLAGS as one argument group of `serve`; a flag whose name a setting already has (a later setting named
    as vLLM's) is left to that setting."""
    taken = set(taken)
    group = parser.add_argument_group(
        "vLLM flags",
        "vLLM's serve flags without a graphcache setting of that name, accepted so a vLLM command line "
        "starts graphcache: each says what graphcache does with it (docs/API.md, vLLM's serve flags).",
    )
    for flag in FLAGS:
        names = [n for n in flag.names if n not in taken]
        if not names or flag.names[0] in taken:
            continue
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": argparse.SUPPRESS, "help": flag.help}
        if flag.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif flag.kind == "list":
            kwargs["nargs"] = "+"
        elif flag.kind == "optional":
            kwargs.update(nargs="?", const=True)
        elif flag.kind == "append":
            kwargs["action"] = "append"
        if flag.kind != "bool":
            kwargs["metavar"] = "VALUE"
        group.add_argument(*names, **kwargs)


def _display(flag: VllmFlag, value: Any) -> str:
    name = flag.names[0]
    if flag.kind == "bool":
        return name if value else "--no-" + name[2:]
    if flag.secret or value is True:
        return name if value is True else f"{name} ***"
    return f"{name} {shown(value)}"


@dataclass
class Applied:
    """The vLLM flags of one command line: settings by flat name, environment variables, warning lines, and
    the checks that wait for the settings (`finish`)."""

    settings: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    checks: list[tuple[str, Callable[[Any], str | None]]] = field(default_factory=list)

    def finish(self, settings: Any) -> list[str]:
        """Every warning line, the checks' included, once the Settings are built."""
        late = [f"vLLM flag {shown}: {text}" for shown, check in self.checks if (text := check(settings))]
        return [*self.warnings, *late]


def apply_vllm_flags(args: argparse.Namespace) -> Applied:
    """The vLLM flags given on the command line. Raises VllmFlagRefused with one line naming the flag, why,
    and the fix."""
    out = Applied()
    settings, env, warnings = out.settings, out.env, out.warnings
    given = vars(args)
    for flag in FLAGS:
        if flag.dest not in given:
            continue
        value = given[flag.dest]
        shown = _display(flag, value)
        try:
            effect = flag.apply(value)
        except VllmFlagRefused as e:
            raise VllmFlagRefused(f"{shown}: {e}") from None
        for name, setting in effect.settings.items():
            if name in settings and settings[name] != setting:
                raise VllmFlagRefused(f"{shown} contradicts another vLLM flag setting {name}; pass one")
            settings[name] = setting
        env.update(effect.env)
        if effect.warning:
            warnings.append(f"vLLM flag {shown}: {effect.warning}")
        if effect.check is not None:
            out.checks.append((shown, effect.check))
    return out


def normalize_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's spellings argparse does not take, as ours: `--max_model_len` -> `--max-model-len` (a known flag
    only), and a bool flag given a value: `--flag=true` / `--flag true` -> `--flag`, `=false` / `false` ->
    `--no-flag`."""
    options = set(parser._option_string_actions)
    bools = {
        s
        for a in parser._actions
        if isinstance(a, argparse.BooleanOptionalAction)
        for s in a.option_strings
        if not s.startswith("--no-")
    }
    # Flags whose value is optional (`--async-scheduling` alone is on): a following word that is not one of
    # their values (the MODEL) is left to be an argument of its own.
    optional = {
        s: ({str(c).lower() for c in a.choices} | {"true", "false"}, a.const)
        for a in parser._actions
        if a.nargs == "?" and a.choices
        for s in a.option_strings
    }
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--") or token == "--":
            out.append(token)
            continue
        name, eq, value = token.partition("=")
        dashed = name.replace("_", "-")
        if dashed != name and dashed in options:
            name = dashed
        if name in bools:
            if not eq and i < len(argv) and argv[i].strip().lower() in {"true", "false"}:
                value, eq = argv[i], "="
                i += 1
            if eq and value.strip().lower() in {"true", "false"}:
                out.append(name if value.strip().lower() == "true" else "--no-" + name[2:])
                continue
        if name in optional and not eq and i < len(argv) and not argv[i].startswith("-"):
            values, const = optional[name]
            if argv[i].strip().lower() not in values:
                out.append(f"{name}={const}")
                continue
        out.append(name + eq + value)
    return out
