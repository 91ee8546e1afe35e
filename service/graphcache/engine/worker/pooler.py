"""The pooling rows of a step (embedding requests, engine/pooling.py): which final hidden states the step
keeps, how they fold into each request's vector across chunks, and the vectors of the rows that end.

The runner runs a step with pooling rows eagerly: the decoder layers once over the step's tokens, then the
final norm over the need_logits rows (for the LM head, as any step) and the token rows `PoolRows.token_rows`
names. Per pooling row and chunk:
  * mean: the chunk's rows are summed (float32) into the request's `pool_sum`, counted in `pool_count`;
  * cls: the first position's row (the chunk that starts at 0) is kept;
  * last: nothing until its last chunk, whose last row is the vector.
A row whose chunk ends its prompt (need_logits) gives its vector: the mean (sum / count), the kept row or the
last row, cut to its `dimensions` and L2-normalized when asked, in float32. Only those vectors leave the
device (one copy of [rows ending, hidden]); the hidden states of other tokens never do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcache.engine.plan import StepPlan
from graphcache.engine.pooling import PoolingSpec
from graphcache.engine.worker.request_table import RequestState, RequestTable

__all__ = ["PoolRows", "pool_rows", "pool_vectors"]


@dataclass(frozen=True, slots=True)
class PoolRows:
    """What a step's pooling rows read (host lists, built from the plan and the layout)."""

    token_rows: list[int]  # [E] the token rows whose final hidden state the step keeps
    # Per pooling row with rows kept or a vector to give: (its state, its spec, its first index into the kept
    # rows, how many, whether its prompt ends this step).
    segments: list[tuple[RequestState, PoolingSpec, int, int, bool]]


def pool_rows(plan: StepPlan, layout_pool_rows: tuple[tuple[int, int], ...], table: RequestTable) -> PoolRows:
    """The token rows the plan's pooling rows keep: a mean row's whole chunk, a cls row's position 0, a last
    row's last token when its prompt ends in this chunk (layout_pool_rows: StepLayout.pool_rows)."""
    need = plan.need_logits
    token_rows: list[int] = []
    segments = []
    for row, (first, fed) in zip(plan.pooling, layout_pool_rows, strict=True):
        state = table.get(plan.keys[row])
        spec = state.sampling.params.pooling
        assert spec is not None, "a pooling row's request has a PoolingSpec (the scheduler lists only those)"
        ends = need is None or need[row]
        at = len(token_rows)
        if spec.mode == "mean":
            token_rows.extend(range(first, first + fed))
        elif spec.mode == "cls":
            if plan.starts[row] == 0:
                token_rows.append(first)
        elif ends:  # last
            token_rows.append(first + fed - 1)
        count = len(token_rows) - at
        if count or ends:
            segments.append((state, spec, at, count, ends))
    return PoolRows(token_rows, segments)


def pool_vectors(hidden: torch.Tensor, rows: PoolRows) -> tuple[list[int], torch.Tensor | None]:
    """Fold the kept final hidden states (hidden: [E, H], rows.token_rows' order) into the requests' states;
    returns (keys of the rows whose prompt ended, [their count, H] float32 vectors on the device, cut and
    normalized as each asks, zeros past a cut), or ([], None)."""
    keys: list[int] = []
    vectors: list[torch.Tensor] = []
    width = hidden.shape[-1]
    for state, spec, at, count, ends in rows.segments:
        part = hidden[at : at + count].float()  # [count, H]
        if spec.mode == "mean":
            chunk = part.sum(0)
            state.pool_sum = chunk if state.pool_sum is None else state.pool_sum + chunk
            state.pool_count += count
        elif spec.mode == "cls" and count:
            state.pool_sum, state.pool_count = part[0], 1
        if not ends:
            continue
        if spec.mode == "last":
            vector = part[-1]
        else:
            assert state.pool_sum is not None and state.pool_count, "every prompt position was pooled"
            vector = state.pool_sum / state.pool_count
        keep = min(spec.dimensions or width, width)
        vector = vector[:keep]
        if spec.normalize:  # F.normalize's rule: a zero vector stays zero
            vector = vector / vector.norm().clamp_min(1e-12)
        if keep < width:
            vector = torch.cat([vector, vector.new_zeros(width - keep)])
        keys.append(state.key)
        vectors.append(vector)
        state.pool_sum, state.pool_count = None, 0
    return keys, (torch.stack(vectors) if vectors else None)
