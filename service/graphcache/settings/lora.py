"""LoraSettings (`settings.lora`): LoRA adapters served beside the base model, as vLLM's `--enable-lora`."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from graphcache.settings.section import CommaList, SettingsSection

__all__ = ["LoraSettings"]


class LoraSettings(SettingsSection):
    """Which adapters run and how many fit: the worker's slots (engine/worker/lora_slots.py), the scheduler's
    bound on distinct adapters a step, and the API's model names read these."""

    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters (PEFT checkpoints: adapter_config.json + adapter_model.safetensors) "
        "beside the base model; a request picks one by its `model` name (docs/API.md, LoRA).",
    )
    lora_modules: Annotated[list[str], CommaList] = Field(
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
        False,
        description="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with the admin token), as "
        "vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True.",
    )

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
