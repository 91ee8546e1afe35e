"""Shared checks of the GPU tests (tests/gpu): NaN in the caching allocator's free memory, so an output
a kernel did not write shows, and the graph-replay-vs-eager logits tolerance."""

from __future__ import annotations

import torch
from graphcache.engine.plan import StepPlan, StepSeq
from helpers_model import Blocks, prompt_ids

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


def assert_decode_replays_match(graph, eager, num_seqs: int, seed: int, steps: int, what: str) -> None:
    """num_seqs short prompts (prompt_ids seeded seed + i) prefilled one at a time on both runners, then
    `steps` decode steps of all of them: each must replay a captured graph on `graph` (its output buffer
    poisoned with NaN first) and match `eager`'s logits (assert_replay_close); the next tokens are eager's
    greedy picks, fed to both."""
    blocks = Blocks(16)
    prompts = [prompt_ids(6 + i, seed=seed + i) for i in range(num_seqs)]
    tables = [blocks.table(len(p) + 8) for p in prompts]
    tokens = [list(p) for p in prompts]
    for i, (p, t) in enumerate(zip(prompts, tables, strict=True)):
        graph.execute(StepPlan.standalone([StepSeq(list(p), 0, t, True)]))
        first = eager.execute(StepPlan.standalone([StepSeq(list(p), 0, t, True)])).logits[0]
        tokens[i].append(int(first.argmax()))
    for step in range(steps):
        seqs = [StepSeq([tokens[i][-1]], len(tokens[i]) - 1, tables[i], True) for i in range(num_seqs)]
        graph.out_logits.fill_(float("nan"))
        result = graph.execute(StepPlan.standalone(seqs))
        assert result.mode == "replay", f"{what}: decode step {step} ran {result.mode}"
        got = result.logits.clone()
        want = eager.execute(StepPlan.standalone(seqs)).logits
        assert_replay_close(got, want, f"{what}: {num_seqs} seqs, step {step}")
        for i, t in enumerate(want.argmax(-1).tolist()):
            tokens[i].append(t)
