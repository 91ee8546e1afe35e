"""LoRA in the decoder: per projection, every GPU slot's adapter stacked, and the per-token slot index.

Each adapted projection (a layer's qkv_proj, o_proj, gate_up_proj, down_proj) gets a `LoraStack`:
A [S, P * R, in] and B [S, out, P * R] for S slots (--max-loras), P pieces (3 for qkv: q, k, v; 2 for
gate_up; 1 otherwise) and R = --max-lora-rank. Piece j of a slot owns rank rows [j R, j R + r) and the output
rows of its own slice (q's, k's or v's rows of the fused output); everything else is zero, so one shrink
x @ A[slot]^T -> [T, P R] and one expand -> [T, out] give each piece exactly its own delta (a block-diagonal
B), and a rank below R adds zeros. The buffers are allocated once, outside every graph pool, so a captured
graph reads whatever adapters the slots hold at replay.

Which slot a token uses is `LoraIndex.tokens` [T_max] (int64; -1 = the base model, as are padded tokens),
a static buffer the runner fills each step: an input of the graph, not part of its descriptor, so one graph
serves any mix of adapters and base rows. On CUDA the kernels of model/lora_kernels.py run it; the torch
reference here (a gather of each token's A and B, two bmm) is the CPU path and what the kernels are tested
against.

A step with no adapter row skips LoRA altogether: `LoraIndex.active` is read on the host each time the layers
run. A graph cannot read a host flag at replay, so each captured shape has two variants (graphs/descriptor.py,
`lora`): the runner sets `active` from the descriptor while it captures, so the plain variant records no LoRA
kernel (exactly the base model's graph) and the LoRA variant records them; inside the LoRA variant the kernels
exit early per tile of base tokens (slot -1, as every pad). docs/API.md (LoRA) says what is measured.
"""

from __future__ import annotations

import torch

from graphcache.model.lora_checkpoint import LoraPiece
from graphcache.model.lora_kernels import lora_shrink_expand

__all__ = ["LoraIndex", "LoraStack", "lora_add", "lora_add_reference"]


class LoraIndex:
    """The per-token slot of the step, shared by every LoraStack of a model."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens  # [T_max] int64, a static buffer the runner fills (-1 = base)
        # Some real token of this step has a slot (LoraSlots.prepare); while a graph is captured, whether
        # the descriptor is the LoRA variant. False: the layers add nothing and launch nothing.
        self.active = False
        self.use_kernels = False  # model/lora_kernels.py (CUDA with triton)


def lora_add_reference(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor
) -> None:
    """y [T, out] += B[s] @ A[s] @ x[t] for each token t whose slot s = index[t] >= 0; in place.
    x [T, in]; a [S, R, in]; b [S, out, R]; index [T] int64."""
    slot = index.clamp(min=0)
    shrunk = torch.bmm(a.index_select(0, slot), x.unsqueeze(2))  # [T, R, 1]
    delta = torch.bmm(b.index_select(0, slot), shrunk).squeeze(2)  # [T, out]
    y.add_(delta * (index >= 0).unsqueeze(1).to(delta.dtype))


def lora_add(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, kernels: bool
) -> None:
    if kernels:
        lora_shrink_expand(y, x, a, b, index)
    else:
        lora_add_reference(y, x, a, b, index)


class LoraStack:
    """One projection's adapters for every slot (see the module docstring for the layout)."""

    def __init__(
        self,
        index: LoraIndex,
        *,
        slots: int,
        rank: int,
        in_features: int,
        out_slices: list[tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """out_slices: (first output row, rows) of each piece in the fused output."""
        self.index, self.rank, self.out_slices = index, rank, out_slices
        out = sum(n for _, n in out_slices)
        width = rank * len(out_slices)
        self.a = torch.zeros(slots, width, in_features, dtype=dtype, device=device)  # [S, P R, in]
        self.b = torch.zeros(slots, out, width, dtype=dtype, device=device)  # [S, out, P R]

    def slot_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(A's, B's) shape in one slot: [P R, in], [out, P R]."""
        a, b = self.a.shape, self.b.shape
        return (a[1], a[2]), (b[1], b[2])

    def lay_out(self, a: torch.Tensor, b: torch.Tensor, pieces: list[LoraPiece]) -> None:
        """Write these pieces into a slot-shaped A [P R, in] and B [out, P R] that hold zeros (host tensors of
        model/lora_image.py; each piece in its own rank rows and output rows, converted to their dtype)."""
        for p in pieces:
            r, row0 = p.a.shape[0], p.piece * self.rank
            first, rows = self.out_slices[p.piece]
            a[row0 : row0 + r].copy_(p.a)
            b[first : first + rows, row0 : row0 + r].copy_(p.b)

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slot `slot` holds A [P R, in] and B [out, P R] (laid out by lay_out, the stack's dtype): two
        contiguous copies, asynchronous on the current stream when a and b are pinned."""
        self.a[slot].copy_(a, non_blocking=True)
        self.b[slot].copy_(b, non_blocking=True)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def add_(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y [T, out] += this step's adapters' deltas of x [T, in]."""
        index = self.index
        if not index.active:
            return
        lora_add(y, x, self.a, self.b, index.tokens[: x.shape[0]], index.use_kernels)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes
