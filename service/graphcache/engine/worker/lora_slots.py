"""The worker's LoRA adapters: read ones in host memory, --max-loras GPU slots, each row's slot per step.

- Known adapters (`LoraModules`: --lora-modules, and the ones loaded at runtime) are read and checked when
  they become known, so a bad adapter is refused then, in one line, never in the middle of a step: at start,
  or for a runtime load off the engine thread (`read_checked`, engine/loop/admin_calls.py), the engine
  thread's command then only registering what was read (`add`): the running batch never waits on the disk.
- A read adapter is kept as the bytes of its slots (model/lora_image.py: 4 MiB chunks, pinned on CUDA).
  Host memory holds at most --max-cpu-loras of them (least recently used by a step dropped first; a dropped
  one is read again from its directory when a request needs it, on the engine thread: keep --max-cpu-loras at
  the number of adapters served to avoid that).
- The GPU holds --max-loras slots (model/lora_layers.py). A step's adapters get slots before the step
  runs (`prepare`): one already in a slot keeps it, another takes a free slot or the least recently used
  slot no row of this step needs. The scheduler admits at most --max-loras distinct adapters among the
  running requests (engine/sched/scheduler.py), so a step never needs more slots than there are. Writing
  a slot is two asynchronous host-to-device copies per adapted projection on the engine thread's stream,
  ordered before the step's kernels (captured graphs read the slots at replay); the host does not wait.
- Per step the per-token slot index (-1: base) is written into the model's LoraIndex in the token order of
  engine/worker/input_batch.py: rows that feed one token first, then the others, each in plan order
  (the decode layout is that order too).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import cast

import numpy as np
import torch

from graphcache.config import Settings
from graphcache.engine.lora_modules import LoraModule, LoraModules
from graphcache.engine.plan import StepPlan
from graphcache.engine.worker.staging import StagingBuffer
from graphcache.model.config import ModelConfig, ModelLoadError
from graphcache.model.fp8_linear import Fp8Linear
from graphcache.model.llama import MLP, DecoderLayer, LlamaModel
from graphcache.model.lora_checkpoint import read_lora, resolve_lora_dir
from graphcache.model.lora_image import LoraImage, pack_lora
from graphcache.model.lora_kernels import HAVE_TRITON as HAVE_LORA_KERNELS
from graphcache.model.lora_layers import LoraIndex, LoraStack
from graphcache.model.source import served_name

__all__ = ["LoraSlots", "attach_lora", "build_lora_slots"]

log = logging.getLogger(__name__)


class LoraSlots:
    def __init__(
        self,
        *,
        modules: LoraModules,
        config: ModelConfig,
        stacks: dict[tuple[int, str], LoraStack],
        index: LoraIndex,
        staging: StagingBuffer,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
    ) -> None:
        self.modules, self.config, self.stacks, self.index = modules, config, stacks, index
        self.staging = staging  # host mirror of index.tokens
        self.max_rank, self.max_cpu_loras = max_rank, max_cpu_loras
        self.slot_names: list[str | None] = [None] * max_loras  # slot -> adapter in it
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self.cpu: OrderedDict[str, LoraImage] = OrderedDict()  # read adapters, least recently used first
        self.retired: dict[str, LoraImage] = {}  # unloaded while requests still named them
        self.adapter_of: dict[int, str] = {}  # request key -> its adapter (held requests with one)
        self._last: tuple[list[int], list[int], int] | None = (
            None  # (keys, slots, pad) of the index as written
        )
        self._uploaded = torch.cuda.Event() if staging.dev.device.type == "cuda" else None
        # read adapters kept in pinned memory on CUDA: slot writes are asynchronous copies
        self.pin = staging.dev.device.type == "cuda"
        self.load_seconds: list[float] = []  # each slot write's seconds (metrics read and clear)
        for module in modules.all():
            self.read(module)

    # --- adapters known ---------------------------------------------------------------------
    def read(self, module: LoraModule) -> LoraImage:
        """The adapter from host memory, or read and checked (LoraLoadError naming the fix) and kept there."""
        image = self.cpu.get(module.name)
        if image is not None:
            self.cpu.move_to_end(module.name)
            return image
        image = self.read_checked(module)
        self._keep(module.name, image)
        return image

    def read_checked(self, module: LoraModule) -> LoraImage:
        """Read and check an adapter (LoraLoadError naming the fix) and lay it out as its slots, touching none
        of this object's state: safe off the engine thread (a runtime load reads there, so the running batch
        never waits on the disk, the checks or the pinning)."""
        t0 = time.perf_counter()
        weights = read_lora(
            module.name, resolve_lora_dir(module.name, module.path), self.config, self.max_rank
        )
        read_s = time.perf_counter() - t0
        image = pack_lora(weights, self.stacks, pin=self.pin)
        image.read_seconds = read_s
        log.info(
            "LoRA adapter %s: rank %d, scale %g, %s, read in %.3fs and laid out in %.3fs (%.1f MiB%s) from %s",
            module.name, image.rank, image.scale, "/".join(image.targets()), read_s, image.pack_seconds,
            image.nbytes / 2**20, ", pinned" if image.pinned else "", image.path,
        )  # fmt: skip
        return image

    def _keep(self, name: str, image: LoraImage) -> None:
        self.cpu[name] = image
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)

    def add(self, module: LoraModule, image: LoraImage) -> None:
        """A runtime load on the engine thread, of an adapter read and checked before (read_checked, off this
        thread): make the name known. The engine refuses it while requests of an adapter unloaded under that
        name remain (engine/loop/lora_admin.py); keys of finished ones may still be listed here until the
        next plan drops them, and never run again."""
        self._free(module.name)  # a slot may still hold an unloaded adapter of that name
        self.cpu.pop(module.name, None)
        self.retired.pop(module.name, None)
        self._keep(module.name, image)
        try:
            self.modules.add(module)
        except ValueError:
            self.cpu.pop(module.name, None)
            raise

    def remove(self, name: str, in_use: bool = False) -> bool:
        """A runtime unload. in_use: requests admitted or waiting with it finish with it, so its weights
        stay (retired) until a load of that name replaces them."""
        module = self.modules.remove(name)
        if module is None:
            return False
        if in_use:
            self.retired[name] = self.cpu.get(name) or self.read_checked(module)
        self.cpu.pop(name, None)
        if name not in self.adapter_of.values():
            self._free(name)
        return True

    def _free(self, name: str) -> None:
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self.slot_names[slot] = None
            for stack in self.stacks.values():
                stack.clear(slot)
            self._last = None

    # --- a step ------------------------------------------------------------------------------
    def update(self, plan: StepPlan) -> None:
        """The plan's new requests' adapters; the finished ones forgotten (after RequestTable.update)."""
        for key in plan.finished:
            self.adapter_of.pop(key, None)
        for new in plan.new:
            name = new.params.lora_name
            if name is None:
                self.adapter_of.pop(new.key, None)
            else:
                self.adapter_of[new.key] = name

    def prepare(self, plan: StepPlan, pad_tokens: int) -> None:
        """Slots for the step's adapters, and the per-token index over pad_tokens tokens (pads: -1)."""
        keys, adapter_of = plan.keys, self.adapter_of
        names = [adapter_of.get(k) for k in keys] if adapter_of else [None] * len(keys)
        wanted = {n for n in names if n is not None}
        for name in wanted:
            self._slot_for(name, wanted)
        self.index.active = bool(wanted)
        # no adapter row: the step runs no LoRA kernel (plain graph variant, or skipped eagerly)
        if not wanted:
            self._last = None  # so no index is left to read: the next step with adapters writes its own
            return
        slots = [-1 if n is None else self.slot_of[n] for n in names]
        last = self._last
        if (
            last is not None
            and last[0] == keys
            and last[1] == slots
            and last[2] >= pad_tokens
            and plan.tokens is None
        ):
            return  # a steady decode of the same rows: the index holds it
        tokens = plan.tokens
        fed = [1] * len(keys) if tokens is None else [1 if t is None else len(t) for t in tokens]
        order = [i for i, n in enumerate(fed) if n == 1] + [i for i, n in enumerate(fed) if n != 1]
        per_token = np.repeat(np.asarray([slots[i] for i in order], np.int64), [fed[i] for i in order])
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last upload read the host mirror
        mirror, n = self.staging.np, per_token.shape[0]
        mirror[:n] = per_token
        mirror[n:pad_tokens] = -1
        self.staging.upload(pad_tokens)
        if self._uploaded is not None:
            self._uploaded.record()
        self._last = (list(keys), slots, pad_tokens) if tokens is None else None

    def _slot_for(self, name: str, wanted: set[str]) -> int:
        slot = self.slot_of.get(name)
        if slot is not None:
            self.slot_of.move_to_end(name)
            if name in self.cpu:  # host memory drops the least recently used, not the longest in a slot
                self.cpu.move_to_end(name)
            return slot
        module = self.modules.get(name)
        if module is None:  # unloaded while its requests ran or waited: they finish with it
            image = self.retired.get(name)
            if image is None:
                raise RuntimeError(f"LoRA adapter {name!r} is neither known nor retired; a request names it")
        else:
            image = self.read(module)
        free = [s for s, held in enumerate(self.slot_names) if held is None]
        if free:
            slot = free[0]
        else:
            idle = [n for n in self.slot_of if n not in wanted]  # least recently used first
            if not idle:
                raise RuntimeError(
                    f"the step needs more than {len(self.slot_names)} LoRA adapters (--max-loras); the "
                    "scheduler bounds them, so its plans and the worker have split"
                )
            slot = self.slot_of.pop(idle[0])
        t0 = time.perf_counter()
        self.write(slot, image)
        self.slot_names[slot], self.slot_of[name] = name, slot
        self.load_seconds.append(time.perf_counter() - t0)
        self._last = None
        return slot

    def write(self, slot: int, image: LoraImage) -> None:
        for key, stack in self.stacks.items():
            views = image.slots.get(key)
            if views is not None:
                stack.write(slot, *views)
            else:
                stack.clear(slot)

    def slots_in_use(self) -> int:
        return len(self.slot_of)


def build_lora_slots(
    settings: Settings,
    model: torch.nn.Module,
    config: ModelConfig,
    *,
    max_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    tp_size: int,
) -> LoraSlots:
    """The model's slot buffers attached, and every --lora-modules adapter read and checked (LoraLoadError
    naming the fix)."""
    lora = settings.lora
    if tp_size > 1:
        raise ModelLoadError(
            "LoRA adapters are served at tensor_parallel_size 1 only; drop --enable-lora or "
            "--tensor-parallel-size, or merge the adapter into the base weights"
        )
    if any(isinstance(m, Fp8Linear) for m in model.modules()):
        raise ModelLoadError(
            "LoRA adapters are not served on FP8 layers; serve the bf16 checkpoint without --quantization fp8, "
            "or merge the adapter into the base weights"
        )
    staging = StagingBuffer((max_tokens,), torch.int64, device)
    staging.np[:] = -1
    staging.dev.fill_(-1)
    index = LoraIndex(staging.dev)
    index.use_kernels = device.type == "cuda" and HAVE_LORA_KERNELS  # else the torch reference
    stacks = attach_lora(
        model, index, slots=lora.max_loras, rank=lora.max_lora_rank, dtype=dtype, device=device
    )
    path = settings.model.path
    base = settings.model.served_model_name or (served_name(path) if path else "graphcache-tiny")
    modules = LoraModules(lora.lora_modules, reserved=(base,))
    slots = LoraSlots(
        modules=modules,
        config=config,
        stacks=stacks,
        index=index,
        staging=staging,
        max_loras=lora.max_loras,
        max_rank=lora.max_lora_rank,
        max_cpu_loras=lora.cpu_loras,
    )
    log.info(
        "LoRA: %d slots of rank %d (%.1f MiB), %d adapters known",
        lora.max_loras, lora.max_lora_rank, sum(st.nbytes for st in stacks.values()) / 2**20, len(modules),
    )  # fmt: skip
    return slots


def attach_lora(
    model: torch.nn.Module,
    index: LoraIndex,
    *,
    slots: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[tuple[int, str], LoraStack]:
    """Give every decoder layer's projections their LoraStack (a sparse MLP gets none); (layer, projection)
    -> stack, projection in qkv, o, gate_up, down."""
    llama = cast(LlamaModel, model)
    stacks: dict[tuple[int, str], LoraStack] = {}

    def stack(in_features: int, slices: list[tuple[int, int]]) -> LoraStack:
        return LoraStack(
            index,
            slots=slots,
            rank=rank,
            in_features=in_features,
            out_slices=slices,
            dtype=dtype,
            device=device,
        )

    for i, module in enumerate(llama.layers):
        layer = cast(DecoderLayer, module)
        attn = layer.attn
        hidden = llama.config.hidden_size
        q, kv = attn.q_size, attn.kv_size
        attn.lora_qkv = stacks[(i, "qkv")] = stack(hidden, [(0, q), (q, kv), (q + kv, kv)])
        attn.lora_o = stacks[(i, "o")] = stack(q, [(0, hidden)])
        if isinstance(layer.mlp, MLP):
            inter = layer.mlp.inter
            layer.mlp.lora_gate_up = stacks[(i, "gate_up")] = stack(hidden, [(0, inter), (inter, inter)])
            layer.mlp.lora_down = stacks[(i, "down")] = stack(inter, [(0, hidden)])
    if stacks:
        index.planner = stacks[(0, "qkv")]  # each forward's first adapted projection plans the step
    return stacks
