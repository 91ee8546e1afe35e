"""vLLM's logits controls on a batch of fp32 logits, before temperature and the filters.

In vLLM's order, all on the device, batched, never a Python loop over the vocabulary:
allowed_token_ids -> bad words -> min_tokens -> logit_bias -> repetition, frequency and presence
penalties. Bans are -inf. Penalties need per-row token counts: built each step by one index_add of
the rows' token ids into a [rows with penalties, V] tensor (output tokens; prompt tokens too for the
repetition penalty). A request's static controls (bias, allowed ids, banned ids, stop ids) go to the
device once and are cached for its lifetime (on its SamplingState, state.py). A row whose controls ban
every token falls back to its raw logits (better the model's own choice than token 0).

The rows are the worker's SamplingStates (state.py): params, prompt and output ids, num_generated.

`needs_history(params)`: the row's processing reads tokens it already generated. With async
scheduling the newest token is still on the device when the next step samples, so such rows must
not be overlapped.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import torch

from graphcache.engine.sample.state import SamplingState, has_controls, has_penalty, needs_history
from graphcache.engine.sequence import SamplingParams

__all__ = [
    "LogitsControls",
    "RequestControls",
    "apply_penalties",
    "flat_index",
    "has_controls",
    "has_penalty",
    "needs_history",
    "to_device",
    "token_counts",
]

_NEG_INF = float("-inf")


class RequestControls:
    """A request's static token-id controls on one device, ids outside the vocabulary dropped
    (the core refuses them, see SamplingParams.validate_token_ids; this only keeps a bad id from
    reaching a device-side index)."""

    def __init__(
        self, params: SamplingParams, vocab: int, eos_token_ids: frozenset[int], device: torch.device
    ) -> None:
        self.vocab, self.device = vocab, device

        def in_vocab(t: int) -> bool:
            return 0 <= t < vocab

        bias = {t: float(b) for t, b in params.logit_bias.items() if in_vocab(t)}
        self.bias_ids = to_device(list(bias), torch.int64, device)
        self.bias_values = to_device(list(bias.values()), torch.float32, device)
        self.allowed = None
        if params.allowed_token_ids is not None:
            self.allowed = to_device(
                sorted({t for t in params.allowed_token_ids if in_vocab(t)}), torch.int64, device
            )
        words = [list(w) for w in params.bad_words_token_ids if w and all(map(in_vocab, w))]
        self.banned = to_device(sorted({w[0] for w in words if len(w) == 1}), torch.int64, device)
        # Longer bad words: (the rest of the word, its last token), checked on the host each step.
        self.bad_words = [(w[:-1], w[-1]) for w in words if len(w) > 1]
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.stop_ids = to_device(sorted(t for t in stops if in_vocab(t)), torch.int64, device)


class LogitsControls:
    """The controls of a batch's rows, applied in place; each request's static controls cached on the
    device for as long as its SamplingState lives (the request's life in the worker)."""

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)  # masked with stop_token_ids until min_tokens

    def of(self, seq: SamplingState, vocab: int, device: torch.device) -> RequestControls:
        """seq's static controls for this vocabulary on this device (built on first use)."""
        c = seq.controls
        if c is None or c.vocab != vocab or c.device != device:
            c = seq.controls = RequestControls(seq.params, vocab, self.eos_token_ids, device)
        return c

    def apply(self, x: torch.Tensor, seqs: list[SamplingState], local: list[int]) -> torch.Tensor:
        """x [W, V] fp32 (contiguous, ours) with the controls of seqs[j] applied to x[j] for j in local;
        a row they leave with no finite logit keeps its raw logits. In place unless some row bans."""
        bans = any(
            p.allowed_token_ids is not None or p.bad_words_token_ids or p.min_tokens
            for p in (seqs[j].params for j in local)
        )
        raw = x.clone() if bans else None
        self._apply_in_place(x, [seqs[j] for j in local], local, x.shape[-1])
        if raw is None:  # penalties and bounded biases never leave a row without a finite logit
            return x
        # A row with every token banned: its raw logits instead (no distribution to draw from).
        return torch.where(x.amax(dim=-1, keepdim=True) == _NEG_INF, raw, x)

    def _apply_in_place(
        self, x: torch.Tensor, seqs: list[SamplingState], rows: list[int], vocab: int
    ) -> None:
        """Apply seqs[k]'s controls to x[rows[k]] in place (x: [W, V] fp32, contiguous)."""
        dev = x.device
        flat = x.view(-1)
        allowed_rows, allowed = [], []
        ban_rows, bans = [], []
        bias_rows, bias_ids, bias_values = [], [], []
        word_bans: list[int] = []  # row * V + id: the last token of a bad word about to complete
        for row, seq in zip(rows, seqs, strict=True):
            p = seq.params
            if not (p.logit_bias or p.allowed_token_ids is not None or p.bad_words_token_ids or p.min_tokens):
                continue
            c = self.of(seq, vocab, dev)
            if c.allowed is not None:
                allowed_rows.append(row)
                allowed.append(c.allowed)
            if c.banned.numel():
                ban_rows.append(row)
                bans.append(c.banned)
            out = seq.output_token_ids
            for prefix, last in c.bad_words:
                if len(out) >= len(prefix) and out[len(out) - len(prefix) :] == prefix:
                    word_bans.append(row * vocab + last)
            if seq.num_generated < p.min_tokens and c.stop_ids.numel():
                ban_rows.append(row)
                bans.append(c.stop_ids)
            if c.bias_ids.numel():
                bias_rows.append(row)
                bias_ids.append(c.bias_ids)
                bias_values.append(c.bias_values)
        if allowed_rows:
            keep = torch.zeros(len(allowed_rows), vocab, dtype=torch.bool, device=dev)
            keep.view(-1).index_fill_(0, flat_index(range(len(allowed_rows)), allowed, vocab, dev), True)
            a = to_device(allowed_rows, torch.int64, dev)
            x.index_copy_(0, a, x.index_select(0, a).masked_fill_(~keep, _NEG_INF))
        if ban_rows:
            flat.index_fill_(0, flat_index(ban_rows, bans, vocab, dev), _NEG_INF)
        if word_bans:
            flat.index_fill_(0, to_device(word_bans, torch.int64, dev), _NEG_INF)
        if bias_rows:
            flat.index_add_(0, flat_index(bias_rows, bias_ids, vocab, dev), torch.cat(bias_values))
        penalized = [(row, seq) for row, seq in zip(rows, seqs, strict=True) if has_penalty(seq.params)]
        if penalized:
            apply_penalties(x, [r for r, _ in penalized], [s for _, s in penalized])


def apply_penalties(x: torch.Tensor, rows: list[int], seqs: list[SamplingState]) -> None:
    """Repetition (prompt + output tokens: logit / p if > 0 else logit * p), then frequency (minus
    penalty * count in the output) and presence (minus penalty once if in the output), on x[rows]
    in place (x: [W, V] fp32; seqs[k] for x[rows[k]])."""
    dev, vocab = x.device, x.shape[-1]
    n = len(rows)
    out_counts = token_counts([s.output_token_ids for s in seqs], vocab, dev)  # [n, V]
    seen_out = out_counts > 0

    def column(values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, dev).view(n, 1)

    whole = n == x.shape[0]  # every row (the usual case): in place, no gather
    sub = x
    if not whole:
        idx = to_device(rows, torch.int64, dev)
        sub = x.index_select(0, idx)
    # Each penalty only when some row has it: each is a few passes over [n, V].
    if any(s.params.repetition_penalty != 1 for s in seqs):
        prompts = [s.prompt_token_ids if s.params.repetition_penalty != 1 else [] for s in seqs]
        seen = seen_out | (token_counts(prompts, vocab, dev) > 0)
        rep = column([s.params.repetition_penalty for s in seqs])
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if any(s.params.frequency_penalty != 0 for s in seqs):
        sub = sub.sub_(column([s.params.frequency_penalty for s in seqs]) * out_counts)
    if any(s.params.presence_penalty != 0 for s in seqs):
        sub = sub.sub_(column([s.params.presence_penalty for s in seqs]) * seen_out)
    if whole:
        if sub is not x:
            x.copy_(sub)
    else:
        x.index_copy_(0, idx, sub)


def token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] fp32: how often each id occurs in each list (ids outside the
    vocabulary are not counted). One upload and one index_add for the whole batch."""
    lengths = [len(t) for t in token_lists]
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    total = sum(lengths)
    if total == 0:
        return counts
    host = array("q")
    for t in token_lists:
        host.extend(t)
    ids = to_device(host, torch.int64, device)
    valid = ((ids >= 0) & (ids < vocab)).float()
    row = torch.repeat_interleave(to_device(lengths, torch.int64, device), output_size=total)
    counts.view(-1).index_add_(0, row * vocab + ids.clamp(0, vocab - 1), valid)
    return counts


def flat_index(
    rows: Iterable[int], ids: list[torch.Tensor], vocab: int, device: torch.device
) -> torch.Tensor:
    """Positions in a row-major [*, vocab] tensor: ids[k] (device int64) in row rows[k]."""
    rows = list(rows)
    lengths = [t.numel() for t in ids]
    row = torch.repeat_interleave(
        to_device(rows, torch.int64, device),
        to_device(lengths, torch.int64, device),
        output_size=sum(lengths),
    )
    return row * vocab + torch.cat(ids)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list (or array) on `device`. On CUDA through pinned memory and non_blocking: a plain
    torch.tensor(..., device=cuda) copies from pageable memory, which waits for the whole stream."""
    if isinstance(values, array):
        host = torch.frombuffer(values, dtype=dtype) if len(values) else torch.empty(0, dtype=dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
