"""What an embedding (pooling) request asks of the engine: how its prompt's hidden states become one vector.

A pooling request is a prefill-only request: it runs its prompt through the same scheduler and worker steps as
any other (chunked prefill included, batched with other requests), and instead of a sampled token it ends
with the final hidden state (after the model's final norm) pooled over its tokens: the last token's row
("last", decoder embedding models such as Qwen3-Embedding), the mean of every row ("mean") or the first
row ("cls"). The worker accumulates a mean across chunks (engine/worker/pooling_state.py); the vector is cut
to `dimensions` (Matryoshka models) and L2-normalized on the device, then leaves it once, at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphcache.choices import POOLING_MODES, PoolingMode
from graphcache.engine.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class PoolingSpec:
    """How one request's embedding is made (SamplingParams.pooling; None there: a generation request)."""

    mode: PoolingMode = "last"
    normalize: bool = True  # L2-normalize the (cut) vector
    dimensions: int | None = None  # keep the first `dimensions` values (Matryoshka); None: all

    def validate(self) -> None:
        if self.mode not in POOLING_MODES:
            raise InvalidRequest(
                f"pooling mode must be one of {', '.join(POOLING_MODES)}, got {self.mode!r}", param="pooling"
            )
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise InvalidRequest(
                f"dimensions must be an integer >= 1, got {self.dimensions!r}", param="dimensions"
            )

    @property
    def every_token(self) -> bool:
        """Whether every prompt position's hidden state is read (mean, cls): then no position may come from
        the prefix cache, whose cached blocks are not computed again."""
        return self.mode != "last"
