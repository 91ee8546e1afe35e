"""Settings shared by every floor: env `GRAPHCACHE_*`, CLI flags and defaults in one place.

Settings is grouped by who owns the values: `model` (what runs, where, which kernels), `engine` (batch
limits, KV cache, the step loop), `graph_cache` (capture and cache policy), `grammar` (structured output
limits), `http` (the server and what it accepts) and `logging`. Each section goes whole to its owner; the
sections, their fields, defaults and help text are in graphcache/settings/, one module per section. This
module puts them together: users see one flat namespace: every section field is a `GRAPHCACHE_<NAME>` env
var, a `graphcache serve --name` flag (cli.py) and a Helm `config` key, under its flat name (the field's
alias where it has one, e.g. `cache_max_entries` for `graph_cache.max_entries`). Here are the flat-name
mapping (env, keyword arguments, `updated`), its env source, and the rules that span sections (the GPU
defaults, the batch limits). A new setting goes into the section of the code that reads it; flat names are
unique across sections (checked when this module is imported).

Defaults run the embedded tiny model on whatever device is there.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from pydantic import Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from graphcache.settings.engine import EngineSettings
from graphcache.settings.grammar import GrammarSettings
from graphcache.settings.graph_cache import GraphCacheSettings
from graphcache.settings.http import HttpSettings
from graphcache.settings.log import LoggingSettings
from graphcache.settings.lora import LoraSettings
from graphcache.settings.model import ModelSettings
from graphcache.settings.section import SettingsSection

__all__ = [
    "GPU_BATCH_DEFAULTS",
    "LARGE_GPU_BYTES",
    "LARGE_GPU_DEFAULTS",
    "SECTIONS",
    "Settings",
    "gpu_memory_bytes",
]

# Batch limits for CUDA devices when the user sets none: the offline benchmark's (BENCHMARKS.md: 33k output
# tok/s for a 0.5B model on the H200 at 256 / 8192; the CPU defaults 64 / 1024 leave it idle).
GPU_BATCH_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}
# GPUs with this much memory or more (H100 80 GB, H200 141 GB, MI300) run twice the sequences, with decode
# graphs up to as many rows (max_capture_size): on the H200 the realistic workload's output tok/s rose from
# 36,582 to 60,261 at 0.5B and the 8B shape reached 11,000 against the old tree's 4,743 (BENCHMARKS.md §15),
# where 256 rows leave the GPU waiting on the host (0.5B) or halve the rows each weight read serves (8B).
# vLLM raises its max_num_seqs on these GPUs too (to 1024; 512 is what was measured here).
LARGE_GPU_BYTES = 70 * 2**30
LARGE_GPU_DEFAULTS = {"max_num_seqs": 512, "max_capture_size": 512}


SECTIONS: dict[str, type[SettingsSection]] = {
    "model": ModelSettings,
    "engine": EngineSettings,
    "graph_cache": GraphCacheSettings,
    "grammar": GrammarSettings,
    "http": HttpSettings,
    "logging": LoggingSettings,
    "lora": LoraSettings,
}


@cache
def _flat_names() -> dict[str, tuple[str, str, FieldInfo]]:
    """flat name -> (section, field name, field), in declaration order."""
    names: dict[str, tuple[str, str, FieldInfo]] = {}
    for section, model in SECTIONS.items():
        for field_name, field in model.model_fields.items():
            flat = field.alias or field_name
            if flat in names:
                raise TypeError(
                    f"setting {flat!r} is declared in both {names[flat][0]} and {section}: flat "
                    "names are env vars and flags, so each must be unique"
                )
            names[flat] = (section, field_name, field)
    return names


_flat_names()  # a duplicate flat name fails at import, not at the first Settings()


# --------------------------------------------------------------------------- flat env


class FlatEnvSource(PydanticBaseSettingsSource):
    """GRAPHCACHE_<FLAT NAME> for every section field, as text (case-insensitive, as pydantic-settings reads
    env): each field's own validators parse it, so lists take `1,2,4` as well as JSON."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads every flat name at once

    def __call__(self) -> dict[str, Any]:
        prefix = self.config.get("env_prefix", "").lower()
        env = {k.lower(): v for k, v in os.environ.items()}
        return {flat: env[prefix + flat] for flat in _flat_names() if prefix + flat in env}


# --------------------------------------------------------------------------- Settings


class Settings(BaseSettings):
    """Built from flat names (`Settings(max_num_seqs=8)`, env, flags) or whole sections
    (`Settings(http=HttpSettings(port=0))`); read by section (`settings.engine.max_num_seqs`).
    Precedence: keyword arguments (the CLI's flags) > env > defaults."""

    # hide_input_in_errors: a refused admin_token must not be printed by a ValidationError's str().
    model_config = SettingsConfigDict(env_prefix="GRAPHCACHE_", extra="ignore", hide_input_in_errors=True)

    # Every section builds with no arguments, but mypy reads a pydantic model's __init__ through
    # dataclass_transform, which knows only `Field(default=...)`: the sections' `Field(None, ...)` fields
    # look required to it, so the section classes do not pass as zero-argument factories.
    model: ModelSettings = Field(default_factory=ModelSettings)  # type: ignore[arg-type]
    engine: EngineSettings = Field(default_factory=EngineSettings)  # type: ignore[arg-type]
    graph_cache: GraphCacheSettings = Field(default_factory=GraphCacheSettings)  # type: ignore[arg-type]
    grammar: GrammarSettings = Field(default_factory=GrammarSettings)  # type: ignore[arg-type]
    http: HttpSettings = Field(default_factory=HttpSettings)  # type: ignore[arg-type]
    logging: LoggingSettings = Field(default_factory=LoggingSettings)  # type: ignore[arg-type]
    lora: LoraSettings = Field(default_factory=LoraSettings)  # type: ignore[arg-type]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, FlatEnvSource(settings_cls)

    @classmethod
    def flat_fields(cls) -> dict[str, FieldInfo]:
        """Every setting by its flat name (env var without the prefix, flag, Helm key), in declaration order."""
        return {flat: field for flat, (_, _, field) in _flat_names().items()}

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any) -> Any:
        """Flat names into their sections; a whole section (a dict or a section) is taken as given."""
        if not isinstance(data, dict):
            return data
        flat = _flat_names()
        nested: dict[str, Any] = {name: {} for name in SECTIONS}
        for key, value in data.items():
            if key in SECTIONS and isinstance(value, dict | SettingsSection):
                section = (
                    value.model_dump(exclude_unset=True) if isinstance(value, SettingsSection) else value
                )
                nested[key].update(section)
            elif key in flat:
                section_name, field_name, _ = flat[key]
                nested[section_name][field_name] = value
        return nested

    @model_validator(mode="after")
    def _check(self) -> Settings:
        # The rules that span sections, once: the device decides the engine's defaults, which the batch
        # limits are checked against.
        self._gpu_defaults()
        engine = self.engine
        if engine.max_num_batched_tokens < engine.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token per sequence)")
        if engine.engine_process and self.model.tensor_parallel_size > 1:
            raise ValueError(
                "engine_process does not support tensor_parallel_size > 1 yet: set "
                "GRAPHCACHE_ENGINE_PROCESS=false (--no-engine-process) to split the model, or "
                "GRAPHCACHE_TENSOR_PARALLEL_SIZE=1 to run the engine in its own process"
            )
        return self

    def _gpu_defaults(self) -> None:
        """On CUDA, engine settings not set by the user take their GPU defaults: the batch limits
        GPU_BATCH_DEFAULTS (measured on the H200; the CPU defaults would leave a GPU mostly idle), raised to
        LARGE_GPU_DEFAULTS (max_num_seqs and max_capture_size) on GPUs of LARGE_GPU_BYTES or more, and
        engine_process on at tensor parallel size 1 (the step loop outruns one interpreter shared with the
        HTTP server). The device is probed only when it matters: device=auto and at least one of these left
        to its default."""
        engine, given = self.engine, self.engine.model_fields_set
        unset = [f for f in GPU_BATCH_DEFAULTS if f not in given]
        capture_unset = "max_capture_size" not in self.graph_cache.model_fields_set
        process = "engine_process" not in given and self.model.tensor_parallel_size == 1
        if (not unset and not process and not capture_unset) or self.model.device == "cpu":
            return
        memory = gpu_memory_bytes()
        if self.model.device == "auto" and memory is None:
            return
        large = memory is not None and memory >= LARGE_GPU_BYTES
        defaults = {**GPU_BATCH_DEFAULTS, **(LARGE_GPU_DEFAULTS if large else {})}
        for name in unset:
            value = defaults[name]
            if name == "max_num_seqs":  # never more rows than an explicit token budget allows
                value = min(value, engine.max_num_batched_tokens)
            object.__setattr__(engine, name, value)
        if large and capture_unset:  # decode graphs for every row count the scheduler may run
            size = max(
                self.graph_cache.max_capture_size, min(engine.max_num_seqs, defaults["max_capture_size"])
            )
            object.__setattr__(self.graph_cache, "max_capture_size", size)
        if process:
            object.__setattr__(engine, "engine_process", True)

    def updated(self, **flat: Any) -> Settings:
        """A copy with some settings replaced by flat name, unvalidated (as model_copy(update=...)): for
        values the server itself fills in (the bound port, the written tiny model) and for benchmarks."""
        names = _flat_names()
        unknown = sorted(set(flat) - set(names))
        if unknown:
            raise TypeError(f"unknown settings {unknown}; the settings are {', '.join(names)}")
        sections: dict[str, dict[str, Any]] = {}
        for key, value in flat.items():
            section, field_name, _ = names[key]
            sections.setdefault(section, {})[field_name] = value
        return self.model_copy(
            update={name: getattr(self, name).model_copy(update=update) for name, update in sections.items()}
        )


def gpu_memory_bytes() -> int | None:
    """The first CUDA device's memory in bytes, None without CUDA (torch is imported only here: the config
    floor does not need it otherwise)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)
