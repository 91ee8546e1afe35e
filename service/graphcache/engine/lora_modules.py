"""The adapters a server knows by name (no torch): `--lora-modules` read, and the names a request may ask.

vLLM's two forms of one module: `name=path`, or a JSON object `{"name": ..., "path": ...,
"base_model_name": ...}`. The API process and the engine (maybe another process) each build the same
`LoraModules` from the settings; adapters loaded at runtime are added to both (the engine first: it reads
and checks the checkpoint, then the API lists the name).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

__all__ = ["LoraModule", "LoraModules", "parse_lora_module"]

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
            raise ValueError(f"lora module {text[:80]!r} is not JSON ({e.msg}); pass name=path or a JSON object") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("path"), str) or not spec["path"]:
            raise ValueError('a JSON lora module needs "name" and "path", e.g. {"name": "sql", "path": "/adapters/sql"}')
        unknown = set(spec) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"lora module keys are name, path and base_model_name; unknown: {sorted(unknown)}")
        base = spec.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError("base_model_name of a lora module must be a string")
        return LoraModule(check_lora_name(spec.get("name"), "lora module name"), spec["path"], base)
    name, sep, path = text.partition("=")
    if not sep or not path.strip():
        raise ValueError(f"lora module {text[:80]!r} is not name=path (e.g. sql=/adapters/sql) nor a JSON object")
    return LoraModule(check_lora_name(name.strip(), "lora module name"), path.strip())


class LoraModules:
    """name -> LoraModule, thread-safe (the API's handlers add and remove at runtime)."""

    def __init__(self, entries: list[str] | tuple[str, ...] = (), reserved: tuple[str, ...] = ()) -> None:
        """entries: `--lora-modules` as given; reserved: names no adapter may take (the served model's)."""
        self._lock = threading.Lock()
        self._modules: dict[str, LoraModule] = {}
        self._reserved = set(reserved)
        for text in entries:
            self.add(parse_lora_module(text))

    def add(self, module: LoraModule) -> None:
        """ValueError when the name is the base model's or already taken."""
        with self._lock:
            if module.name in self._reserved:
                raise ValueError(f"adapter name {module.name!r} is the served model's name; pick another name")
            if module.name in self._modules:
                raise ValueError(f"an adapter named {module.name!r} is already loaded; unload it first or pick another name")
            self._modules[module.name] = module

    def remove(self, name: str) -> LoraModule | None:
        with self._lock:
            return self._modules.pop(name, None)

    def get(self, name: str) -> LoraModule | None:
        return self._modules.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._modules

    def all(self) -> list[LoraModule]:
        with self._lock:
            return list(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)
