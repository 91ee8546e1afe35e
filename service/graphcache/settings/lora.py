"""LoraSettings (`settings.lora`): LoRA adapters served beside the base model, as vLLM's `--enable-lora`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Annotated

from pydantic import BeforeValidator, Field, field_validator, model_validator

from graphcache.settings.section import SettingsSection

__all__ = ["LoraModule", "LoraSettings", "check_lora_name", "parse_lora_module"]

# A name is a model id in the API: the characters of model ids and hub ids, nothing that needs quoting.
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/@+")
MAX_NAME_CHARS = 256


@dataclass(frozen=True, slots=True)
class LoraModule:
    name: str  # what a request's `model` names
    path: str  # a local directory or a hub id
    base_model_name: str | None = None  # the parent in /v1/models (default: the served model's name)


def check_lora_name(name: object, param: str = "lora_name") -> str:
    """The name itself, or ValueError naming the rule it breaks."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise ValueError(f"{param} must be a non-empty string of at most {MAX_NAME_CHARS} characters")
    if not set(name) <= _NAME_CHARS:
        raise ValueError(f"{param} {name!r} may hold only letters, digits and - _ . : / @ +")
    return name


def parse_lora_module(text: str) -> LoraModule:
    """One `--lora-modules` entry; ValueError naming the form when it is neither."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"lora module {text[:80]!r} is not JSON ({e.msg}); pass name=path or a JSON object"
            ) from None
        if not isinstance(spec, dict) or not isinstance(spec.get("path"), str) or not spec["path"]:
            raise ValueError(
                'a JSON lora module needs "name" and "path", e.g. {"name": "sql", "path": "/adapters/sql"}'
            )
        unknown = set(spec) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(
                f"lora module keys are name, path and base_model_name; unknown: {sorted(unknown)}"
            )
        base = spec.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError("base_model_name of a lora module must be a string")
        return LoraModule(check_lora_name(spec.get("name"), "lora module name"), spec["path"], base)
    name, sep, path = text.partition("=")
    if not sep or not path.strip():
        raise ValueError(
            f"lora module {text[:80]!r} is not name=path (e.g. sql=/adapters/sql) nor a JSON object"
        )
    return LoraModule(check_lora_name(name.strip(), "lora module name"), path.strip())


def _module_list(v: object) -> object:
    """Modules as text (env, flags): one JSON object, a JSON list (of name=path strings or objects), or
    name=path entries separated by commas; JSON objects in a list are kept as their JSON text."""
    if isinstance(v, str):
        text = v.strip()
        if text.startswith("{"):
            return [text]
        if text.startswith("["):
            try:
                v = json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(
                    "lora_modules is a JSON list, name=path entries or one JSON object"
                ) from None
        else:
            return [item.strip() for item in text.split(",") if item.strip()]
    if isinstance(v, list | tuple):
        return [json.dumps(item) if isinstance(item, dict) else item for item in v]
    return v


class LoraSettings(SettingsSection):
    """Which adapters run and how many fit: the worker's slots (engine/worker/lora_slots.py), the scheduler's
    bound on distinct adapters a step, and the API's model names read these."""

    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters (PEFT checkpoints: adapter_config.json + adapter_model.safetensors) "
        "beside the base model; a request picks one by its `model` name (docs/API.md, LoRA).",
    )
    lora_modules: Annotated[list[str], BeforeValidator(_module_list)] = Field(
        default_factory=list,
        description="Adapters served from the start, each `name=path` (a local directory or a hub id) or "
        'vLLM\'s JSON form \'{"name": ..., "path": ..., "base_model_name": ...}\'. Needs enable_lora.',
    )
    max_loras: int = Field(
        1, ge=1, le=256, description="Adapters on the GPU at once (slots; one step mixes at most this many)."
    )
    max_lora_rank: int = Field(
        16, ge=1, le=512, description="The largest adapter rank served; slots are padded to it."
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="Adapters kept read in host memory (least recently used dropped first); "
        "default: max_loras. At least max_loras.",
    )
    allow_runtime_lora_updating: bool = Field(
        default_factory=lambda: (
            os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")
        ),
        description="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with the admin token), as "
        "vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (which also turns it on).",
    )

    @field_validator("lora_modules")
    @classmethod
    def _modules(cls, v: list[str]) -> list[str]:
        names = [parse_lora_module(text).name for text in v]  # ValueError naming the form
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(
                f"lora_modules names {sorted(dup)} more than once; give each adapter its own name"
            )
        return v

    @model_validator(mode="after")
    def _check(self) -> LoraSettings:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora: add --enable-lora (GRAPHCACHE_ENABLE_LORA=1)")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}); "
                "raise --max-cpu-loras or leave it unset"
            )
        return self

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras
