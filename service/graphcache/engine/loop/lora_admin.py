"""LoRA on the engine thread: the gauges of each update (vllm:lora_requests_info, slots in use, slot load
times), and runtime loads and unloads (POST /v1/load_lora_adapter, /v1/unload_lora_adapter), run on the engine
thread between steps. A load's adapter was read, checked and laid out as its slots off the engine thread
before (engine/loop/admin_calls.py, LoraSlots.read_checked): the command here only registers it, so the
running batch never waits on the disk, and a bad adapter is refused whole before its name is known anywhere
(no request can name it half-loaded).

An unload takes the name away at once (no new request may name it); requests already admitted or waiting
with it finish with it (the worker keeps its weights for them) and may share its prefix-cache blocks (the
same weights, the same KV). A load of that name starts a prefix cache of its own (the blocks of the one
before are never matched again); it waits for the requests still in the engine with the name before
(refused, retry), so no request runs one adapter over the other's KV.
"""

from __future__ import annotations

from graphcache.engine.lora_modules import LoraModule
from graphcache.engine.sched.scheduler import Scheduler
from graphcache.engine.worker.lora_slots import LoraSlots
from graphcache.metrics import Metrics
from graphcache.model.lora_image import LoraImage

__all__ = ["load_adapter", "record_lora_gauges", "unload_adapter"]


def _users(sched: Scheduler, name: str) -> int:
    return sum(1 for s in (*sched.waiting, *sched.running) if s.params.lora_name == name)


NOT_SERVED = (400, "LoRA adapters are not served: start the server with --enable-lora")


def load_adapter(
    lora: LoraSlots | None, sched: Scheduler, module: LoraModule, image: LoraImage | None
) -> tuple[int, str]:
    """(HTTP status, vLLM's answer): 200, or 400 naming the fix (LoRA off, the name taken or still in use).
    image: the adapter read and checked off the engine thread (None only when LoRA is off)."""
    if lora is None or image is None:
        return NOT_SERVED
    if module.name in lora.modules:
        return 400, f"The lora adapter '{module.name}' has already been loaded."
    if _users(sched, module.name):
        return 400, (
            f"requests still run with the adapter '{module.name}' unloaded before; retry once they finish"
        )
    try:
        lora.add(module, image)
    except ValueError as e:  # the name (LoraModules)
        return 400, str(e)
    sched.block_manager.forget_adapter(module.name)
    return 200, f"Success: LoRA adapter '{module.name}' added successfully."


def unload_adapter(lora: LoraSlots | None, sched: Scheduler, name: str) -> tuple[int, str]:
    """(HTTP status, vLLM's answer): 200, or 404 when no adapter of that name is loaded."""
    if lora is None:
        return NOT_SERVED
    if not lora.remove(name, in_use=_users(sched, name) > 0):
        return 404, f"The lora adapter '{name}' cannot be found."
    return 200, f"Success: LoRA adapter '{name}' removed successfully."


def record_lora_gauges(lora: LoraSlots | None, sched: Scheduler, metrics: Metrics) -> None:
    """Slots, slot load times and vllm:lora_requests_info from the worker and the scheduler's queues."""
    if lora is None:
        return
    metrics.lora_slots.set(len(lora.slot_names))
    metrics.lora_slots_in_use.set(lora.slots_in_use())
    for seconds in lora.load_seconds:
        metrics.lora_load_seconds.observe(seconds)
    lora.load_seconds.clear()
    running = {s.params.lora_name for s in sched.running if s.params.lora_name is not None}
    waiting = {s.params.lora_name for s in sched.waiting if s.params.lora_name is not None}
    metrics.vllm.set_lora_info(len(lora.slot_names), list(running), list(waiting))
