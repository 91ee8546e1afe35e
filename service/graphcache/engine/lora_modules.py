"""The adapters a server knows by name (no torch): the names a request may ask, as a registry that runtime
loads and unloads change (settings/lora.py reads `--lora-modules` in vLLM's two forms). The API process and the engine (maybe another process) each build the same
`LoraModules` from the settings; adapters loaded at runtime are added to both (the engine first: it reads
and checks the checkpoint, then the API lists the name).
"""

from __future__ import annotations

import threading

from graphcache.settings.lora import LoraModule, check_lora_name, parse_lora_module

__all__ = ["LoraModule", "LoraModules", "check_lora_name", "parse_lora_module"]


class LoraModules:
    """name -> LoraModule, thread-safe (the API's handlers add and remove at runtime).

    Each add gets the next integer id, from 1 in `--lora-modules` order, then runtime loads (vLLM's
    lora_int_id, what its KV cache events carry as lora_id). An id is never reused: a name loaded again gets
    a new one (its KV differs). A removed name keeps its last id, for the requests that still run with it.
    """

    def __init__(self, entries: list[str] | tuple[str, ...] = (), reserved: tuple[str, ...] = ()) -> None:
        """entries: `--lora-modules` as given; reserved: names no adapter may take (the served model's)."""
        self._lock = threading.Lock()
        self._modules: dict[str, LoraModule] = {}
        self._reserved = set(reserved)
        self._ids: dict[str, int] = {}  # name -> id of its latest load (kept after a remove)
        self._last_id = 0
        for text in entries:
            self.add(parse_lora_module(text))

    def add(self, module: LoraModule) -> None:
        """ValueError when the name is the base model's or already taken."""
        with self._lock:
            if module.name in self._reserved:
                raise ValueError(
                    f"adapter name {module.name!r} is the served model's name; pick another name"
                )
            if module.name in self._modules:
                raise ValueError(
                    f"an adapter named {module.name!r} is already loaded; unload it first or pick another name"
                )
            self._modules[module.name] = module
            self._last_id += 1
            self._ids[module.name] = self._last_id

    def remove(self, name: str) -> LoraModule | None:
        with self._lock:
            return self._modules.pop(name, None)

    def lora_id(self, name: str) -> int | None:
        """The id of the adapter's latest load (None: never loaded)."""
        return self._ids.get(name)

    def get(self, name: str) -> LoraModule | None:
        return self._modules.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._modules

    def all(self) -> list[LoraModule]:
        with self._lock:
            return list(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)
