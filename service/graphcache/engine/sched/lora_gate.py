"""Which waiting requests a step may admit when LoRA adapters are served: at most --max-loras distinct
adapters among the running requests (the worker's GPU slots), and no request starves waiting for a slot.

The rule: a request whose adapter is running, or that fits in a free slot, is admitted in queue order. Once
one waits for a slot, every later request with an adapter waits behind it (base requests still pass, they
take no slot), so the running adapters drain, a slot frees, and the first one waiting takes it. Without
that, a steady stream for the running adapters could keep them running forever.
"""

from __future__ import annotations

from collections.abc import Iterable

from graphcache.engine.sequence import Sequence

__all__ = ["LoraGate"]


class LoraGate:
    """One admission pass's view of the adapters: built from the running requests, told of each admission."""

    __slots__ = ("active", "blocked", "max_loras")

    def __init__(self, running: Iterable[Sequence], max_loras: int) -> None:
        self.active = {s.params.lora_name for s in running if s.params.lora_name is not None}
        self.max_loras = max_loras
        self.blocked = False  # a request waits for a slot: adapters queue behind it

    def admits(self, seq: Sequence) -> bool:
        name = seq.params.lora_name
        if name is None:
            return True
        if self.blocked:
            return False
        if name in self.active or len(self.active) < self.max_loras:
            return True
        self.blocked = True
        return False

    def admitted(self, seq: Sequence) -> None:
        if seq.params.lora_name is not None:
            self.active.add(seq.params.lora_name)
