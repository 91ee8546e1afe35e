"""The proposer contract: who drafts the tokens a verify step scores.

Two kinds, because they need different things from the engine:

- **Host proposers** (`Proposer`; n-gram, the draft model, suffix trees later) read each request's token
  ids and return token lists, and keep whatever per-request state they like, keyed by request id. The
  n-gram one runs on the host; the draft model (engine/worker/draft_model.py) runs its own model with its
  own KV cache on the engine thread inside `propose`, catching up on the accepted tokens by itself (the
  longest common prefix with what its cache holds), so the engine hands it nothing after a verify step.

- **Device proposers** (`DeviceProposer`; an EAGLE / MTP head later) run a model
  with its own paged KV cache, and an EAGLE head also reads the target's hidden states. Not built yet:
  `DraftStepInputs` says what the engine must hand one after each verify step, so the worker integration
  is written once against it. Their drafts stay on the device (`DeviceDrafts`): the verify step takes
  them from there, and rejection.py takes their probabilities when they sample (one-hot when greedy).

Both feed the same verify step. A host proposer's drafts are one-hot (deterministic) proposals: the verify
step draws every fed position with the plain sampler and keeps the drafts that match (match.py), which is
rejection sampling's exact equivalent for such proposals; drafts with probabilities take rejection.py.

What the engine owns, whatever the proposer: which requests speculate this step and with how many tokens
(`max_draft_tokens`: 0 for a row that must not, e.g. structured output, a step over disable_by_batch_size,
the room left under max_model_len or max_tokens), and the rollback of rejected tokens in its own state
(sequence lengths, block tables, prefix-cache hashes). A proposer only ever sees accepted tokens in
`output_token_ids`, so host proposers have nothing to roll back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the scheduler may import this module: no torch at run time
    import torch

__all__ = ["DeviceDrafts", "DeviceProposer", "DraftRequest", "DraftStepInputs", "Proposer"]


class DraftRequest(Protocol):
    """What a proposer reads of one running request (engine.sequence.Sequence has these)."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]:
        """The accepted output so far; it only ever grows while the request runs."""
        ...


class Proposer(ABC):
    """A host proposer: drafts for a batch of requests, as token lists."""

    num_speculative_tokens: int  # k: the most tokens one draft holds

    @abstractmethod
    def propose(
        self, requests: Sequence[DraftRequest], max_draft_tokens: Sequence[int] | None = None
    ) -> list[list[int]]:
        """One draft per request, in order: 0 to min(k, max_draft_tokens[i]) token ids to verify after
        the request's last token. An empty draft: the row runs as a plain decode row."""

    @abstractmethod
    def remove(self, request_id: str) -> None:
        """Forget a request (finished, aborted, or preempted if the proposer wants it rebuilt)."""

    def retain(self, request_ids: Iterable[str]) -> None:
        """Forget every request not in `request_ids` (a sweep against leaks; remove() is the normal path)."""
        del request_ids


# --------------------------------------------------------------------------- the device seam (not built yet)


@dataclass(frozen=True)
class DraftStepInputs:
    """What the worker hands a device proposer once the verify step of B speculating requests is sampled,
    all on the device (N = the tokens it must consume this time, over all B requests).

    token_ids      [N] int64: for each request in turn, the tokens appended to it since the proposer's
                   last call: the drafts the verify step accepted, then the one token it emitted after
                   them (the correction or the bonus); a request's first call: its whole context. What
                   to recompute is the proposer's choice: a draft model already wrote KV for the
                   accepted drafts it fed itself while drafting (all but the last); an EAGLE head
                   recomputes them all from the target's hidden states.
    query_start    [B + 1] int32: request b's tokens are token_ids[query_start[b]:query_start[b + 1]].
    positions      [N] int64: each token's position in its sequence.
    seq_lens       [B] int32: each sequence's length once these tokens are in.
    block_tables   [B, max_blocks] int32: the request's KV blocks. The proposer's own paged cache is
                   allocated block for block with the target's, so one table addresses both, and the
                   engine's rollback (the sequence length back to the accepted tokens; blocks past it
                   freed) rolls back the draft's KV too. Slots past seq_lens hold stale KV of rejected
                   drafts: attention never reads past seq_lens, and the next write overwrites them.
    num_accepted   [B] int64: drafts the verify step accepted (the proposer drops what it kept of the
                   rejected ones).
    target_hidden_states  [N, H] or None: the target's hidden state that predicted each of token_ids
                   (the row before it in the verify step; EAGLE-3: the concatenated aux layers). Only
                   proposers with needs_target_hidden_states get it: the verify step must keep it then.
    """

    request_ids: Sequence[str]
    token_ids: torch.Tensor
    query_start: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_accepted: torch.Tensor
    target_hidden_states: torch.Tensor | None = None


@dataclass(frozen=True)
class DeviceDrafts:
    """A device proposer's drafts for the B requests of DraftStepInputs, k tokens each.

    token_ids  [B, k] int64: what the next verify step scores after each request's last token.
    probs      [B, k, V] float32 or None: the draft distribution each token was sampled from, for
               rejection_sample's draft_probs; None when drafting is greedy (one-hot proposals, exact).
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None = None


class DeviceProposer(Protocol):
    """A proposer with a model on the device. The engine's part: size the proposer's KV cache beside the
    target's (kv_bytes_per_token, same block size and block count), hand it DraftStepInputs after each
    verify step, and give its draft steps (B rows x k tokens, one forward per token, or one for a
    parallel-drafting head) their own descriptors in the graph cache, captured and counted like the rest."""

    num_speculative_tokens: int
    needs_target_hidden_states: bool  # EAGLE / MTP: the verify step keeps the target's hidden states

    def kv_bytes_per_token(self) -> int:
        """Bytes of the proposer's KV per cached token (all its layers), to split memory with the target."""
        ...

    def propose_device(self, inputs: DraftStepInputs) -> DeviceDrafts:
        """Consume inputs.token_ids (writing their KV) and draft k tokens per request, on the device."""
        ...

    def remove(self, request_id: str) -> None:
        """Forget a request's proposer state (its KV blocks are the engine's: freed with the target's)."""
        ...
