"""A read adapter laid out as its slots (model/lora_image.py): each adapted projection's
A [P R, in] and B [out, P R] exactly as LoraStack lays a slot out (pieces in their rank rows and output rows,
zeros elsewhere, the stacks' dtype) in a few buffers, and a slot write from it overwrites every byte an earlier
adapter left."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from graphcache.model import lora_image
from graphcache.model.lora_checkpoint import LoraPiece, LoraWeights
from graphcache.model.lora_layers import LoraIndex, LoraStack

RANK, SLOTS, HIDDEN, KV, INTER = 8, 2, 12, 4, 20


def _stacks(dtype: torch.dtype) -> dict[tuple[int, str], LoraStack]:
    index = LoraIndex(torch.full((4,), -1, dtype=torch.int64))

    def stack(fan_in, slices):
        return LoraStack(
            index,
            slots=SLOTS,
            rank=RANK,
            in_features=fan_in,
            out_slices=slices,
            dtype=dtype,
            device=torch.device("cpu"),
        )

    return {
        (0, "qkv"): stack(HIDDEN, [(0, HIDDEN), (HIDDEN, KV), (HIDDEN + KV, KV)]),
        (0, "gate_up"): stack(HIDDEN, [(0, INTER), (INTER, INTER)]),
        (0, "down"): stack(INTER, [(0, HIDDEN)]),
    }


def _weights(name: str, r: int, pieces: dict[tuple[int, str], list[tuple[int, int, int]]], seed: int):
    """pieces: key -> (piece, in, out) each; random fp32 A [r, in] and B [out, r]."""
    g = torch.Generator().manual_seed(seed)
    w = LoraWeights(name, Path(name), r, 1.0)
    for key, ps in pieces.items():
        w.pieces[key] = [
            LoraPiece(p, torch.randn(r, fan_in, generator=g), torch.randn(fan_out, r, generator=g))
            for p, fan_in, fan_out in ps
        ]
    return w


def _expected_slot(stack: LoraStack, pieces: list[LoraPiece] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot's A and B built by hand: zeros, each piece's fp32 values cast to the stack's dtype."""
    (pr, fan_in), (out, _) = stack.slot_shapes()
    a = torch.zeros(pr, fan_in, dtype=stack.a.dtype)
    b = torch.zeros(out, pr, dtype=stack.a.dtype)
    for p in pieces or []:
        r, first, rows = p.a.shape[0], *stack.out_slices[p.piece]
        a[p.piece * RANK : p.piece * RANK + r] = p.a.to(a.dtype)
        b[first : first + rows, p.piece * RANK : p.piece * RANK + r] = p.b.to(b.dtype)
    return a, b


FULL = {
    (0, "qkv"): [(0, HIDDEN, HIDDEN), (1, HIDDEN, KV), (2, HIDDEN, KV)],
    (0, "gate_up"): [(0, HIDDEN, INTER), (1, HIDDEN, INTER)],
    (0, "down"): [(0, INTER, HIDDEN)],
}
PARTIAL = {(0, "qkv"): [(2, HIDDEN, KV)], (0, "gate_up"): [(1, HIDDEN, INTER)]}  # v and up only, no down


@pytest.mark.parametrize("chunk_bytes", [4 << 20, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_image_is_the_slot_layout_in_chunks(dtype, chunk_bytes, monkeypatch):
    """Every adapted projection's A and B are contiguous views, each projection within one buffer, no two
    overlapping; buffers of CHUNK_BYTES (here also a chunk smaller than one projection: one buffer each)."""
    monkeypatch.setattr(lora_image, "CHUNK_BYTES", chunk_bytes)
    stacks = _stacks(dtype)
    weights = _weights("p", 3, FULL, seed=1)
    image = lora_image.pack_lora(weights, stacks, pin=False)
    assert set(image.slots) == set(FULL) and not image.pinned
    assert all(b.dtype == dtype for b in image.buffers)
    assert len(image.buffers) == (1 if chunk_bytes > 4096 else len(FULL))
    spans = []
    for key, (a, b) in image.slots.items():
        assert a.is_contiguous() and b.is_contiguous()
        (buffer,) = [x for x in image.buffers if _within(a, x) and _within(b, x)]
        spans += [(a.data_ptr(), a.data_ptr() + a.nbytes), (b.data_ptr(), b.data_ptr() + b.nbytes)]
        want_a, want_b = _expected_slot(stacks[key], weights.pieces[key])
        assert torch.equal(a, want_a) and torch.equal(b, want_b)
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    # off CUDA the buffers are exactly the adapted projections' slots (pinned ones are whole chunks)
    assert image.nbytes == sum(stacks[k].a[0].nbytes + stacks[k].b[0].nbytes for k in FULL)


def _within(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= view.data_ptr() and view.data_ptr() + view.nbytes <= start + buffer.nbytes


def test_image_leaves_out_projections_the_adapter_does_not_adapt():
    image = lora_image.pack_lora(_weights("p", 3, PARTIAL, seed=4), _stacks(torch.float32), pin=False)
    assert set(image.slots) == set(PARTIAL) and image.targets() == ["gate_up", "qkv"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_write_from_the_image_replaces_what_the_slot_held(dtype):
    stacks = _stacks(dtype)
    full = lora_image.pack_lora(_weights("f", RANK, FULL, seed=2), stacks, pin=False)
    partial_weights = _weights("p", 3, PARTIAL, seed=3)
    partial = lora_image.pack_lora(partial_weights, stacks, pin=False)
    for key, stack in stacks.items():  # the worker's write (LoraSlots.write): the image, else a clear
        stack.write(1, *full.slots[key])
    before_other = {k: (s.a[0].clone(), s.b[0].clone()) for k, s in stacks.items()}
    for key, stack in stacks.items():
        if key in partial.slots:
            stack.write(1, *partial.slots[key])
        else:
            stack.clear(1)
    for key, stack in stacks.items():
        want_a, want_b = _expected_slot(stack, partial_weights.pieces.get(key))
        assert torch.equal(stack.a[1], want_a) and torch.equal(stack.b[1], want_b), key
        assert torch.equal(stack.a[0], before_other[key][0]) and torch.equal(stack.b[0], before_other[key][1])
