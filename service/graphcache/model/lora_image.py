"""A read adapter laid out as the bytes of its GPU slots, in host buffers (pinned on CUDA).

Writing an adapter into a slot happens on the engine thread between steps, so it must cost the running
batch next to nothing. Prepared here, off the engine thread (model/lora_checkpoint.py read and checked it):
for every adapted projection the slot's A [P R, in] and B [out, P R] exactly as model/lora_layers.py lays
them out (pieces in their rank rows and output rows, the rest zero, the scale in B), in the stacks' dtype,
as contiguous views of a few host buffers. A slot write is then two contiguous same-dtype copies per adapted
projection: on CUDA from pinned memory, asynchronous host-to-device copies queued on the engine's stream
before the step's kernels, with no conversion, no temporary and no host wait (a copy from pageable memory
waits for the stream to drain, and a dtype change or a strided destination adds a device temporary).

Pinned buffers are CHUNK_BYTES each (a projection larger than that gets one of its own; off CUDA a buffer
is exactly what it holds): page-locking memory takes driver locks that other threads' CUDA calls (the
engine's launches) wait on, so one large pinning could stall a step where a small one holds them briefly;
PyTorch's caching host allocator keeps freed chunks, so the next adapter read reuses a dropped one's
without pinning anew. They hold the slot's zeros too (a rank
below --max-lora-rank, the block-diagonal B of fused projections): an adapter costs its share of one GPU
slot in host memory, the price of one copy per tensor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graphcache.model.lora_checkpoint import LoraWeights
from graphcache.model.lora_layers import LoraStack

__all__ = ["LoraImage", "pack_lora"]


CHUNK_BYTES = 4 << 20  # a power of two: the caching host allocator rounds every block up to one


@dataclass
class LoraImage:
    name: str
    path: Path
    rank: int
    scale: float
    buffers: list[torch.Tensor]  # [n] each, the stacks' dtype, pinned on CUDA: every view below lies in one
    # (layer, projection) -> (A [P R, in], B [out, P R]) of its slot; projections the adapter leaves out: absent
    slots: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    read_seconds: float = 0.0  # reading and checking the checkpoint
    pack_seconds: float = 0.0  # laying it out here (pinning included)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def pinned(self) -> bool:
        return all(b.is_pinned() for b in self.buffers)

    def targets(self) -> list[str]:
        return sorted({proj for _, proj in self.slots})


def pack_lora(weights: LoraWeights, stacks: dict[tuple[int, str], LoraStack], *, pin: bool) -> LoraImage:
    """`weights` laid out as the slots of `stacks` (the model's, read only: safe off the engine thread)."""
    t0 = time.perf_counter()
    keys = [key for key in stacks if weights.pieces.get(key)]
    dtype = next(iter(stacks.values())).a.dtype if stacks else torch.float32
    chunk = CHUNK_BYTES // dtype.itemsize
    image = LoraImage(weights.name, weights.path, weights.rank, weights.scale, [])
    for group in _chunks(keys, stacks, chunk):
        need = sum(_numel(stacks[key]) for key in group)
        buffer = torch.zeros(max(need, chunk) if pin else need, dtype=dtype, pin_memory=pin)
        image.buffers.append(buffer)
        offset = 0
        for key in group:
            (pr, fan_in), (out, _) = stacks[key].slot_shapes()
            a = buffer[offset : offset + pr * fan_in].view(pr, fan_in)
            offset += pr * fan_in
            b = buffer[offset : offset + out * pr].view(out, pr)
            offset += out * pr
            stacks[key].lay_out(a, b, weights.pieces[key])
            image.slots[key] = (a, b)
    image.pack_seconds = time.perf_counter() - t0
    return image


def _numel(stack: LoraStack) -> int:
    (pr, fan_in), (out, _) = stack.slot_shapes()
    return pr * fan_in + out * pr


def _chunks(keys: list, stacks: dict, chunk: int) -> list[list]:
    """keys in order, grouped so each group's slots fit `chunk` elements (a larger one alone)."""
    groups: list[list] = []
    used = chunk
    for key in keys:
        n = _numel(stacks[key])
        if used + n > chunk:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += n
    return groups
