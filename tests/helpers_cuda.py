"""Shared checks of the GPU tests (tests/gpu): NaN in the caching allocator's free memory, so an output
a kernel did not write shows, and the graph-replay-vs-eager logits tolerance."""

from __future__ import annotations

import torch

# bf16 logits of replay and eager runners may differ (padded and unpadded GEMM shapes may pick different
# kernels): by at most this share of the largest eager logit.
REL_TOL = 0.03


def poison_allocator() -> None:
    """Fill free blocks of the caching allocator (small and large pools) with NaN. Blocks of several
    sizes, at most 1 GiB: one block the size of everything reserved fails when earlier tests left the
    reserve fragmented."""
    junk = [
        torch.full((n,), float("nan"), device="cuda") for n in (1 << 12, 1 << 16, 1 << 20) for _ in range(8)
    ]
    junk.append(torch.full((1 << 28,), float("nan"), device="cuda"))
    del junk


def assert_replay_close(graph_logits: torch.Tensor, eager_logits: torch.Tensor, what: str) -> None:
    """graph_logits [B, V] (replay) against eager_logits [B, V]: finite, within REL_TOL of the largest
    eager logit, and the same argmax wherever the eager top-2 gap exceeds that tolerance (a near-tie may
    flip under bf16 rounding)."""
    graph_logits, eager_logits = graph_logits.float(), eager_logits.float()
    assert torch.isfinite(graph_logits).all(), f"{what}: non-finite logits from replay"
    tol = REL_TOL * eager_logits.abs().max().item()
    err = (graph_logits - eager_logits).abs().max().item()
    assert err <= tol, f"{what}: max |graph - eager| = {err:.4f} > {tol:.4f}"
    top2 = eager_logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > tol
    assert torch.equal(graph_logits.argmax(-1)[clear], eager_logits.argmax(-1)[clear]), what
