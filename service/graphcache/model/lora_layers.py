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

qkv_proj calls `shrink_(x)` before its base GEMM and `add_to(y)` on what it returns after it. On CUDA the
shrink (A x into the index's workspace) depends on x only, so while a graph is captured it is launched on the
index's side stream, forked from the current stream: in the graph it runs beside the base GEMM, and the
expand (B (A x) added into y) waits for both (lora_kernels.py says why, in numbers). o_proj and down_proj call
`add_beside_(x, residual)` instead: their output is only ever added to the residual stream at the next norm,
so their delta can go straight into the residual, which exists before the GEMM. Shrink and expand then both
run beside the GEMM, and the layer joins the side stream before that norm: none of their LoRA kernels is on
the critical path. gate_up_proj does the same into a zeroed delta buffer that the activation adds
(fused_ops.silu_mul) when it forks, and shrink_/add_to otherwise (a [T, 2I] buffer is not worth it where
nothing overlaps). Forking pays up to `FORK_SHRINK_MAX_TOKENS`; a larger step's GEMM fills the SMs, and
everything runs on the current stream, in order, as outside a capture (eager steps). The workspace is shared
by every stack: a fork waits for all the work the current stream has queued, and the side stream runs its
work in order, so a shrink always starts after the previous projection's expand. Each forward's first
projection (`LoraIndex.planner`, layer 0's qkv: attach_lora) first plans the step (the tokens grouped by slot
into tiles), which every later projection of that forward reads; a stack of an index with no planner plans
before its own shrink.

A step with no adapter row skips LoRA altogether: `LoraIndex.active` is read on the host each time the layers
run. A graph cannot read a host flag at replay, so each captured shape has two variants (graphs/descriptor.py,
`lora`): the runner sets `active` from the descriptor while it captures, so the plain variant records no LoRA
kernel (exactly the base model's graph) and the LoRA variant records them; inside the LoRA variant base
tokens (slot -1, as every pad) are in no tile of the plan, so the kernels do no work for them. docs/API.md
(LoRA) says what is measured.
"""

from __future__ import annotations

import torch

from graphcache.model.lora_checkpoint import LoraPiece
from graphcache.model.lora_kernels import (
    HAVE_TRITON,
    LoraWorkspace,
    lora_expand,
    lora_plan,
    lora_shrink,
)

__all__ = [
    "FORK_SHRINK_MAX_TOKENS",
    "LoraBeside",
    "LoraIndex",
    "LoraShrunk",
    "LoraStack",
    "lora_add_reference",
]

# While a graph is captured, a step of at most this many tokens runs the shrink (and for o, down and gate_up
# the expand too) on the side stream beside the base GEMM; a larger one runs them on the current stream.
# Measured LoRA ms per 32-layer 8B step (H100, rank 16, one slot, benchmarks/lora_kernel_bench.py, BENCHMARKS
# §22-23): in order 1.09, shrinks forked 0.67, this layout 0.26 at T = 1; 1.73 / 1.31 / 1.06 at T = 128; but
# forked shrinks cost 2.71 against 2.09 in order at 192 and 4.25 against 3.49 at 384, where the base GEMM's
# tiles fill the SMs and the side stream only contends with it. Read when a projection runs (the benchmark
# sets it to 0 for its serial variant).
FORK_SHRINK_MAX_TOKENS = 128


class LoraIndex:
    """The per-token slot of the step, shared by every LoraStack of a model, and the kernels' workspace."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens  # [T_max] int64, a static buffer the runner fills (-1 = base)
        # Some real token of this step has a slot (LoraSlots.prepare); while a graph is captured, whether
        # the descriptor is the LoRA variant. False: the layers add nothing and launch nothing.
        self.active = False
        self.use_kernels = False  # model/lora_kernels.py (CUDA with triton)
        self.planner: LoraStack | None = None  # plans each forward (the first projection); None: every stack
        self.workspace: LoraWorkspace | None = None  # CUDA: grown by each stack made (reserve)
        self.side: torch.cuda.Stream | None = None  # CUDA: where a captured shrink runs beside the base GEMM

    def reserve(self, slots: int, width: int) -> None:
        """Make the workspace serve a stack of `slots` slots of width `width` (CUDA with triton; done when
        the stacks are made, before any forward, so the buffers sit outside every graph pool)."""
        device = self.tokens.device
        if device.type != "cuda" or not HAVE_TRITON:
            return
        ws, t = self.workspace, self.tokens.shape[0]
        if ws is None or not ws.fits(t, slots, width):
            slots, width = (slots, width) if ws is None else (max(slots, ws.slots), max(width, ws.width))
            self.workspace = LoraWorkspace(t, slots, width, device)
        if self.side is None:
            self.side = torch.cuda.Stream(device)


def lora_add_reference(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor
) -> None:
    """y [T, out] += B[s] @ A[s] @ x[t] for each token t whose slot s = index[t] >= 0; in place.
    x [T, in]; a [S, R, in]; b [S, out, R]; index [T] int64."""
    slot = index.clamp(min=0)
    shrunk = torch.bmm(a.index_select(0, slot), x.unsqueeze(2))  # [T, R, 1]
    delta = torch.bmm(b.index_select(0, slot), shrunk).squeeze(2)  # [T, out]
    y.add_(delta * (index >= 0).unsqueeze(1).to(delta.dtype))


class LoraShrunk:
    """A projection's shrink, launched before its base GEMM (LoraStack.shrink_); add_to(y) adds the deltas
    once the base GEMM has written y."""

    def __init__(
        self, stack: LoraStack, x: torch.Tensor, side: torch.cuda.Stream | None, splits: int = 1
    ) -> None:
        self.stack, self.x, self.side = stack, x, side  # side: the stream the shrink was forked onto
        self.splits = splits  # the shrink's partial sums (lora_kernels.split_k)

    def add_to(self, y: torch.Tensor) -> None:
        """y [T, out] += this step's adapters' deltas of the shrink's x, in place."""
        self.stack.expand_(y, self)


class LoraBeside:
    """A projection's whole LoRA launched on the side stream beside its base GEMM (LoraStack.add_beside_)."""

    def __init__(self, side: torch.cuda.Stream) -> None:
        self.side = side

    def join(self) -> None:
        """After the base GEMM is launched: the current stream's next work waits for the delta's add."""
        torch.cuda.current_stream().wait_stream(self.side)


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
        index.reserve(slots, width)

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
        """y [T, out] += this step's adapters' deltas of x [T, in] (shrink_, then add_to)."""
        shrunk = self.shrink_(x)
        if shrunk is not None:
            shrunk.add_to(y)

    def shrink_(self, x: torch.Tensor) -> LoraShrunk | None:
        """Before the base GEMM of x [T, in]: None when the step has no adapter row (nothing to add), else
        the shrink launched (on CUDA; while a graph is captured, on the side stream)."""
        index = self.index
        if not index.active:
            return None
        if not index.use_kernels:
            return LoraShrunk(self, x, None)  # the reference runs whole in add_to
        side = self._side_for(x)
        if side is None:
            return LoraShrunk(self, x, None, self._shrink(x))
        side.wait_stream(torch.cuda.current_stream())  # x and the previous projection's expand first
        with torch.cuda.stream(side):
            splits = self._shrink(x)
        return LoraShrunk(self, x, side, splits)

    def add_beside_(
        self, x: torch.Tensor, target: torch.Tensor, zero_first: bool = False
    ) -> LoraBeside | None:
        """Before the base GEMM of x [T, in] whose output only meets `target` [T, out] downstream (o_proj and
        down_proj: the residual stream, summed at the next norm; gate_up_proj: a delta buffer the activation
        adds, with zero_first): target += this step's adapters' deltas of x, in place. In a captured graph of
        up to FORK_SHRINK_MAX_TOKENS tokens (`forks`) shrink and expand both run on the side stream, beside
        the GEMM, and the caller joins after launching the GEMM: no LoRA kernel on the critical path.
        Elsewhere both run here, in order. None: nothing to join."""
        index = self.index
        if not index.active:
            return None
        side = self._side_for(x) if index.use_kernels else None
        if side is None:
            if zero_first:
                target.zero_()
            if index.use_kernels:
                self._expand(target, self._shrink(x))
            else:
                lora_add_reference(target, x, self.a, self.b, index.tokens[: x.shape[0]])
            return None
        side.wait_stream(torch.cuda.current_stream())  # x, target and the previous projection's work first
        with torch.cuda.stream(side):
            if zero_first:
                target.zero_()  # base tokens' rows are never written by the expand
            self._expand(target, self._shrink(x))
        return LoraBeside(side)

    def forks(self, x: torch.Tensor) -> bool:
        """Whether this step's LoRA of x [T, in] runs on the side stream (kernels, in a captured step of at
        most FORK_SHRINK_MAX_TOKENS tokens)."""
        return self.index.active and self.index.use_kernels and self._side_for(x) is not None

    def _side_for(self, x: torch.Tensor) -> torch.cuda.Stream | None:
        """The side stream when this projection forks (a captured step of at most FORK_SHRINK_MAX_TOKENS)."""
        forks = x.shape[0] <= FORK_SHRINK_MAX_TOKENS and torch.cuda.is_current_stream_capturing()
        return self.index.side if forks else None

    def _shrink(self, x: torch.Tensor) -> int:
        index, ws = self.index, self.index.workspace
        if ws is None:
            raise RuntimeError("LoRA kernels without a workspace: make the index's tokens a CUDA tensor")
        if index.planner is None or index.planner is self:
            lora_plan(index.tokens[: x.shape[0]], self.a.shape[0], ws)
        return lora_shrink(x, self.a, ws)

    def expand_(self, y: torch.Tensor, shrunk: LoraShrunk) -> None:
        index = self.index
        if not index.use_kernels:
            lora_add_reference(y, shrunk.x, self.a, self.b, index.tokens[: y.shape[0]])
            return
        if shrunk.side is not None:
            torch.cuda.current_stream().wait_stream(shrunk.side)  # the shrink's rows
        self._expand(y, shrunk.splits)

    def _expand(self, y: torch.Tensor, splits: int) -> None:
        assert self.index.workspace is not None  # _shrink checked
        lora_expand(y, self.b, self.index.workspace, splits)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes
