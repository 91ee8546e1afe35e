"""The sampling defaults a checkpoint recommends: generation_config.json -> request field defaults.

`--generation-config` (GRAPHCACHE_GENERATION_CONFIG) chooses them, as vLLM's flag does:
  * `auto` (default): the model directory's generation_config.json;
  * `vllm`: none (every request field keeps the API's own default);
  * a directory: the generation_config.json in it.
A request that leaves a field out (or sends null) gets the default; a field it sends wins.

The fields read are vLLM's (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as the
default max_tokens) plus presence_penalty and frequency_penalty where a config carries them. Values are
taken as the file writes them. `do_sample` is ignored, as vLLM ignores it: transformers' generate()
defaults to do_sample=false, so honouring it would make every checkpoint whose config omits it greedy,
which neither vLLM nor OpenAI clients expect; a checkpoint that wants greedy decoding sets temperature 0
or top_k 1. A value outside what a request may send (e.g. temperature 3) is left out, with a warning.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

__all__ = ["FIELDS", "GENERATION_CONFIG", "GenerationConfigError", "generation_defaults", "read_defaults"]

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


def _number(low: float, high: float, *, low_open: bool = False) -> Any:
    def check(v: Any) -> float | None:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            return None
        if v < low or v > high or (low_open and v == low):
            return None
        return float(v)

    return check


def _integer(low: int) -> Any:
    def check(v: Any) -> int | None:
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            return None
        return v

    return check


# generation_config.json key -> (request field, check returning the value or None when out of range).
# The ranges are the request fields' (api/openai/sampling_fields.py).
FIELDS: dict[str, tuple[str, Any]] = {
    "temperature": ("temperature", _number(0.0, 2.0)),
    "top_p": ("top_p", _number(0.0, 1.0, low_open=True)),
    "top_k": ("top_k", _integer(-1)),
    "min_p": ("min_p", _number(0.0, 1.0)),
    "repetition_penalty": ("repetition_penalty", _number(0.0, 10.0, low_open=True)),
    "presence_penalty": ("presence_penalty", _number(-2.0, 2.0)),
    "frequency_penalty": ("frequency_penalty", _number(-2.0, 2.0)),
    "max_new_tokens": ("max_tokens", _integer(1)),
}


class GenerationConfigError(ValueError):
    """generation_config.json cannot be read; the message names the file and the fix."""


def read_defaults(file: Path) -> dict[str, Any]:
    """The request-field defaults in `file` (a generation_config.json); {} when it has none."""
    try:
        config = json.loads(file.read_text())
    except OSError as e:
        raise GenerationConfigError(f"cannot read {file} ({e.strerror or e}); fix its permissions") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GenerationConfigError(
            f"{file} is not valid JSON ({e}); fix or re-download it, or pass --generation-config vllm"
        ) from None
    if not isinstance(config, dict):
        raise GenerationConfigError(
            f"{file} holds a JSON {type(config).__name__}, not an object; fix or re-download it"
        )
    defaults: dict[str, Any] = {}
    for key, (field, check) in FIELDS.items():
        if key not in config or config[key] is None:
            continue
        value = check(config[key])
        if value is None:
            log.warning(
                "%s: %s=%r is outside what a request may send; it is not used as a default",
                file,
                key,
                config[key],
            )
            continue
        defaults[field] = value
    return defaults


def generation_defaults(mode: str, model_dir: Path | str | None) -> dict[str, Any]:
    """The defaults in force for `mode` (auto | vllm | a directory) and the loaded model's directory."""
    if mode == "vllm":
        return {}
    if mode == "auto":
        if model_dir is None:
            return {}
        file = Path(model_dir) / GENERATION_CONFIG
        return read_defaults(file) if file.is_file() else {}
    file = Path(mode).expanduser() / GENERATION_CONFIG
    if not file.is_file():
        raise GenerationConfigError(
            f"--generation-config {mode!r} has no {GENERATION_CONFIG}; pass a directory that holds one, "
            "or auto (the model's) or vllm (none)"
        )
    return read_defaults(file)
