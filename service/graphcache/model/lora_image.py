"""A read adapter laid out as the bytes of its GPU slots, in one host buffer (pinned on CUDA).

Writing an adapter into a slot happens on the engine thread between steps, so it must cost the running
batch next to nothing. Prepared here, off the engine thread (model/lora_checkpoint.py read and checked it):
for every adapted projection the slot's A [P R, in] and B [out, P R] exactly as model/lora_layers.py lays
them out (pieces in their rank rows and output rows, the rest zero, the scale in B), in the stacks' dtype,
as views of one contiguous buffer. A slot write is then two contiguous same-dtype copies per adapted
projection: on CUDA from pinned memory, asynchronous host-to-device copies queued on the engine's stream
before the step's kernels, with no conversion, no temporary and no host wait (a copy from pageable memory
waits for the stream to drain, and a dtype change or a strided destination adds a device temporary).

The buffer holds the slot's zeros too (a rank below --max-lora-rank, the block-diagonal B of fused
projections), so it is as large as the adapter's share of one GPU slot: the price of one copy per tensor.
The caching host allocator keeps a freed buffer for the next adapter of that size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graphcache.model.lora_checkpoint import LoraWeights
from graphcache.model.lora_layers import LoraStack

__all__ = ["LoraImage", "pack_lora"]


@dataclass
class LoraImage:
    name: str
    path: Path
    rank: int
    scale: float
    buffer: torch.Tensor  # [n] the stacks' dtype, pinned on CUDA: every view below lies in it
    # (layer, projection) -> (A [P R, in], B [out, P R]) of its slot; projections the adapter leaves out: absent
    slots: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    read_seconds: float = 0.0  # reading and checking the checkpoint
    pack_seconds: float = 0.0  # laying it out here (pinning included)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    @property
    def pinned(self) -> bool:
        return self.buffer.is_pinned()

    def targets(self) -> list[str]:
        return sorted({proj for _, proj in self.slots})


def pack_lora(weights: LoraWeights, stacks: dict[tuple[int, str], LoraStack], *, pin: bool) -> LoraImage:
    """`weights` laid out as the slots of `stacks` (the model's, read only: safe off the engine thread)."""
    t0 = time.perf_counter()
    keys = [key for key in stacks if weights.pieces.get(key)]
    dtype = next(iter(stacks.values())).a.dtype if stacks else torch.float32
    sizes = [stacks[key].slot_shapes() for key in keys]
    total = sum(a[0] * a[1] + b[0] * b[1] for a, b in sizes)
    buffer = torch.zeros(total, dtype=dtype, pin_memory=pin)
    image = LoraImage(weights.name, weights.path, weights.rank, weights.scale, buffer)
    offset = 0
    for key, (a_shape, b_shape) in zip(keys, sizes, strict=True):
        n_a, n_b = a_shape[0] * a_shape[1], b_shape[0] * b_shape[1]
        a = buffer[offset : offset + n_a].view(a_shape)
        b = buffer[offset + n_a : offset + n_a + n_b].view(b_shape)
        offset += n_a + n_b
        stacks[key].lay_out(a, b, weights.pieces[key])
        image.slots[key] = (a, b)
    image.pack_seconds = time.perf_counter() - t0
    return image
