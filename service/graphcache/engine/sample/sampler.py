"""Token selection on a batch of logits (the stop rules are in stopping.py).

Sampling is batched over the rows that need it. A row goes one of three ways:
  - greedy, no logits controls: argmax of the model-dtype logits (no fp32 [R, V] copy): the fast path;
  - greedy with controls: argmax of the processed fp32 logits;
  - random: controls, then temperature -> min_p -> top-k -> top-p, then a draw.
Every step is row-wise, so a row's token never depends on which other requests share the batch.

Rows without top-k (temperature, min_p, top-p: what most clients send) take nucleus_draw.py: one
Triton launch on CUDA that races first and checks the nucleus after (rejection sampling), two or three
passes over each row, straight from the model-dtype logits when the row has no logits controls; its
torch twin on the CPU. The draw is an exponential race (race_draw.py): token = argmax z_i - log E_i
over the kept tokens, with E_i = -log u_i and u_i a hash of (row key, i). No softmax and no sampling
state: a seeded row's key is a function of (seed, tokens it generated so far), so its tokens depend
only on its seed and its own logits (not on the batch, the device's RNG or earlier calls); unseeded
rows take keys from the Sampler's host generator, seeded by settings.model.seed.

Rows with top-k keep a threshold path that never sorts the vocabulary: temperature and min_p act on
z = (logits - max) / T, and top-k / top-p become one threshold per row (keep z >= thr), found from a
bounded torch.topk per row with an exact bisection fallback for long nuclei (filter_threshold.py),
then the race (filtered_logits -> filter_threshold -> race_draw). GRAPHCACHE_SAMPLER=fused (or
Sampler(fused=True)) runs that as one Triton kernel (fused_draw.py), not the default: slower than
the torch composition with top-k on the H200 (BENCHMARKS.md).

Logits controls (vLLM's order, all on the device, batched, never a Python loop over the vocabulary):
allowed_token_ids -> bad words -> min_tokens -> logit_bias -> repetition, frequency and presence
penalties. Bans are -inf. Penalties need per-row token counts: built each step by one index_add of
the rows' token ids into a [rows with penalties, V] tensor (output tokens; prompt tokens too for the
repetition penalty). A request's static controls (bias, allowed ids, banned ids, stop ids) go to the
device once and are cached for its lifetime. A row whose controls ban every token falls back to its
raw logits (better the model's own choice than token 0).

`needs_history(params)`: the row's processing reads tokens it already generated. With async
scheduling the newest token is still on the device when the next step samples, so such rows must
not be overlapped.

No validated parameters make sampling raise or produce NaN: the top token always survives the
min_p, top-k and top-p filters (top_p 1e-300 is 0.0 in float32), a temperature too small to divide
by (below MIN_TEMPERATURE, e.g. 1e-300) is greedy, logits are shifted by their row max before the
division so nothing overflows, and a row whose logits hold no usable distribution (all -inf, NaN,
+inf) takes its argmax instead of a draw.
"""

from __future__ import annotations

import math
import os
import random
import weakref
from array import array
from collections.abc import Iterable

import torch

from graphcache.engine.sample.filter_threshold import thresholds
from graphcache.engine.sample.fused_draw import HAVE_TRITON, fused_draw
from graphcache.engine.sample.nucleus_draw import nucleus_draw
from graphcache.engine.sample.race_draw import mix64, race_draw, row_key, to_int64
from graphcache.engine.sequence import SamplingParams, Sequence

# Temperatures below this are greedy: logits / 1e-300 overflows, and sampling at such a
# temperature is argmax anyway. (Also catches NaN, which validation's `< 0` check lets through.)
MIN_TEMPERATURE = 1e-5
_NEG_INF = float("-inf")


def _is_greedy(temperature: float) -> bool:
    return not temperature >= MIN_TEMPERATURE


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def _top_k_on(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab


def _has_controls(p: SamplingParams) -> bool:
    """Logits controls that act every step (min_tokens acts only until that many tokens are out)."""
    return (
        _has_penalty(p)
        or bool(p.logit_bias)
        or p.allowed_token_ids is not None
        or bool(p.bad_words_token_ids)
    )


def needs_history(params: SamplingParams) -> bool:
    """Does this request's sampling read tokens it already generated (penalties, min_tokens, bad
    words of more than one token)? Then a step must not sample it before the previous step's token
    is on the host (no async overlap). Single-token bad words, logit_bias, allowed_token_ids and
    min_p do not."""
    return (
        _has_penalty(params)
        or params.min_tokens > 0
        or any(len(word) > 1 for word in params.bad_words_token_ids)
    )


def _num_generated(seq: Sequence) -> int:
    """Output tokens before the one being sampled. Scheduling a step counts its token in
    num_inflight, so a token of an earlier step still in flight is num_inflight - 1 (0 when the
    sampler is called outside a scheduled step)."""
    return seq.num_output_tokens + max(seq.num_inflight - 1, 0)


class _Controls:
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
        self.bias_ids = _to_device(list(bias), torch.int64, device)
        self.bias_values = _to_device(list(bias.values()), torch.float32, device)
        self.allowed = None
        if params.allowed_token_ids is not None:
            self.allowed = _to_device(
                sorted({t for t in params.allowed_token_ids if in_vocab(t)}), torch.int64, device
            )
        words = [list(w) for w in params.bad_words_token_ids if w and all(map(in_vocab, w))]
        self.banned = _to_device(sorted({w[0] for w in words if len(w) == 1}), torch.int64, device)
        # Longer bad words: (the rest of the word, its last token), checked on the host each step.
        self.bad_words = [(w[:-1], w[-1]) for w in words if len(w) > 1]
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.stop_ids = _to_device(sorted(t for t in stops if in_vocab(t)), torch.int64, device)


def _fused_by_default() -> bool:
    """GRAPHCACHE_SAMPLER=fused selects the fused kernel (fused_draw.py) on CUDA; anything else, the
    torch-composed draw (filtered_logits + race_draw), which the CPU always takes."""
    return os.environ.get("GRAPHCACHE_SAMPLER", "legacy").strip().lower() == "fused"


class Sampler:
    def __init__(
        self,
        default_seed: int | None = None,
        eos_token_ids: Iterable[int] = (),
        fused: bool | None = None,
        nucleus: bool = True,
    ) -> None:
        # Random rows without top-k: the rejection sampler (nucleus_draw.py; False only to compare paths).
        self.nucleus = nucleus
        # CUDA random rows with top-k: one fused Triton kernel (True) or the torch-composed path (False).
        self.fused = _fused_by_default() if fused is None else fused
        # Unseeded rows' race keys; seeded by settings.model.seed so a server run is repeatable (None: OS entropy).
        self._rng = random.Random(default_seed)
        self.eos_token_ids = frozenset(eos_token_ids)  # masked with stop_token_ids until min_tokens
        # Per request (dies with its Sequence): its static controls on the device.
        self._controls: weakref.WeakKeyDictionary[Sequence, _Controls] = weakref.WeakKeyDictionary()

    def _controls_of(self, seq: Sequence, vocab: int, device: torch.device) -> _Controls:
        c = self._controls.get(seq)
        if c is None or c.vocab != vocab or c.device != device:
            c = self._controls[seq] = _Controls(seq.params, vocab, self.eos_token_ids, device)
        return c

    @staticmethod
    def _plain_greedy(seq: Sequence) -> bool:
        flag = seq.plain_greedy
        if flag is None:
            p = seq.params
            flag = seq.plain_greedy = _is_greedy(p.temperature) and p.min_tokens == 0 and not _has_controls(p)
        return flag

    def _needs_processing(self, seq: Sequence) -> bool:
        p = seq.params
        return _has_controls(p) or _num_generated(seq) < p.min_tokens

    @torch.inference_mode()
    def warmup(self, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compile the Triton draw kernels now, not in the first sampled step (a compile there stalls
        every running request for about a second): one draw on each path on random logits (top-p rows
        from model-dtype logits, from processed fp32 logits, and a top-k row's threshold path)."""
        if device.type != "cuda" or not HAVE_TRITON:
            return
        x = torch.randn(2, vocab, device=device).to(dtype)
        for params in (
            SamplingParams(temperature=0.8, top_p=0.9),
            SamplingParams(temperature=0.8, top_p=0.9, logit_bias={0: 1.0}),
            SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
        ):
            self.sample_device(x[:1], [Sequence("sampler-warmup", [0], params)])
        torch.cuda.synchronize(device)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of `logits` [len(seqs), V] (row i belongs to seqs[i]), on the host."""
        return self.sample_device(logits, seqs).tolist()

    @torch.inference_mode()
    def sample_device(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Like sample(), as a [len(seqs)] int64 tensor on the logits' device, without waiting for
        the GPU: host values reach the device through pinned, asynchronous copies."""
        assert logits.shape[0] == len(seqs), (logits.shape, len(seqs))
        # argmax in the model dtype: the same token as over a float copy, without writing [R, V] fp32
        tokens = logits.argmax(dim=-1)
        if all(map(self._plain_greedy, seqs)):  # one cached flag per row: the common batch costs no more
            return tokens
        processed = {i for i, s in enumerate(seqs) if self._needs_processing(s)}
        rows = [i for i, s in enumerate(seqs) if i in processed or not _is_greedy(s.params.temperature)]
        if not rows:
            return tokens
        dev, vocab = logits.device, logits.shape[-1]
        idx = _to_device(rows, torch.int64, dev)
        work = [seqs[i] for i in rows]
        if not processed:  # every row random: drawn from the logits as they are, no fp32 copy
            if self.nucleus and not any(_top_k_on(s.params, vocab) for s in work):
                return tokens.index_copy_(0, idx, self._draw_nucleus(logits, idx, work))
            if self._use_fused(logits):
                return tokens.index_copy_(0, idx, self._draw_fused(logits, idx, work))
        x = logits.index_select(0, idx).float()  # [W, V] fp32, ours to modify
        if processed:
            x = self._process(x, work, [j for j, i in enumerate(rows) if i in processed])
        random_local = [j for j, s in enumerate(work) if not _is_greedy(s.params.temperature)]
        chosen = x.argmax(dim=-1) if len(random_local) < len(rows) else torch.empty_like(idx)
        if random_local:
            chosen[_to_device(random_local, torch.int64, dev)] = self._draw(
                x, [work[j] for j in random_local], random_local
            )
        return tokens.index_copy_(0, idx, chosen)

    @torch.inference_mode()
    def processed_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """[len(seqs), V] fp32: each row's logits after its controls (before temperature and the
        top-k/top-p/min_p filters): what a greedy row takes the argmax of."""
        x = logits.float().clone()
        local = [i for i, s in enumerate(seqs) if self._needs_processing(s)]
        return self._process(x, seqs, local) if local else x

    def _process(self, x: torch.Tensor, seqs: list[Sequence], local: list[int]) -> torch.Tensor:
        """x [W, V] fp32 (contiguous, ours) with the controls of seqs[j] applied to x[j] for j in local."""
        bans = any(
            p.allowed_token_ids is not None or p.bad_words_token_ids or p.min_tokens
            for p in (seqs[j].params for j in local)
        )
        raw = x.clone() if bans else None
        self._apply_controls(x, [seqs[j] for j in local], local, x.shape[-1])
        if raw is None:  # penalties and bounded biases never leave a row without a finite logit
            return x
        # A row with every token banned: its raw logits instead (no distribution to draw from).
        return torch.where(x.amax(dim=-1, keepdim=True) == _NEG_INF, raw, x)

    def _use_fused(self, logits: torch.Tensor) -> bool:
        return self.fused and logits.is_cuda and HAVE_TRITON

    def _draw_fused(self, logits: torch.Tensor, rows: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One draw per entry of rows [W] (indices into logits [R, V], any float dtype), seqs[k] for
        rows[k], in one kernel: the same distribution and the same tokens as the torch path (up to an
        fp32 near tie in the race). Two uploads of the per-row parameters, no sync."""
        floats, ints = self.draw_params(seqs, logits.shape[-1])
        dev = logits.device
        f = floats.pin_memory().to(dev, non_blocking=True)
        i = ints.pin_memory().to(dev, non_blocking=True)
        tokens, _ = fused_draw(logits, rows, f[0], i[0], f[1], f[2], i[1])
        return tokens

    def _draw_nucleus(self, logits: torch.Tensor, rows: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One draw per entry of rows [W] (indices into logits [R, V], any float dtype) for rows without
        top-k: nucleus_draw.py's rejection sampler, one launch on CUDA. Per row only a cached tuple is
        read on the host (the keys of unseeded rows come from one draw of the generator, a seeded
        row's key is mixed from its step on the device); two uploads, no sync."""
        n = len(seqs)
        draw_rows = [s.draw_row or self._draw_row(s) for s in seqs]
        params = torch.tensor([r[0] for r in draw_rows], dtype=torch.float32)  # [W, 3]
        ints = torch.empty(2, n, dtype=torch.int64)  # keys, steps
        ints[0] = torch.frombuffer(
            bytearray(self._rng.getrandbits(64 * n).to_bytes(8 * n, "little")), dtype=torch.int64
        )
        ints[1] = -1
        for j, (r, s) in enumerate(zip(draw_rows, seqs, strict=True)):
            if r[1] is not None:
                ints[0, j], ints[1, j] = r[1], _num_generated(s)
        if logits.is_cuda:
            params = params.pin_memory().to(logits.device, non_blocking=True)
            ints = ints.pin_memory().to(logits.device, non_blocking=True)
        return nucleus_draw(logits, rows, params, ints[0], ints[1])

    @staticmethod
    def _draw_row(seq: Sequence) -> tuple[tuple[float, float, float], int | None]:
        """A request's static draw parameters, cached on it: ((temperature, top_p, log(min_p) or -inf),
        mix64(seed) as int64 or None)."""
        p = seq.params
        log_min_p = math.log(min(p.min_p, 1.0)) if p.min_p > 0 else _NEG_INF
        seed_key = None if p.seed is None else to_int64(mix64(p.seed))
        seq.draw_row = ((p.temperature, p.top_p, log_min_p), seed_key)
        return seq.draw_row

    def draw_params(self, seqs: list[Sequence], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused kernel's per-row parameters on the host: floats [3, n] (temperature, 0 for a greedy
        row; top_p; log(min_p) or -inf), ints [2, n] (top_k, vocab when off; race key). What
        fused_draw.DrawParams.write takes for a captured draw. Draws the unseeded rows' keys."""
        floats = torch.tensor(
            [
                [0.0 if _is_greedy(s.params.temperature) else s.params.temperature for s in seqs],
                [s.params.top_p for s in seqs],
                [math.log(min(s.params.min_p, 1.0)) if s.params.min_p > 0 else _NEG_INF for s in seqs],
            ],
            dtype=torch.float32,
        )
        ints = torch.tensor(
            [[k if 0 < k < vocab else vocab for k in (s.params.top_k for s in seqs)], self._row_keys(seqs)],
            dtype=torch.int64,
        )
        return floats, ints

    def _draw(self, x: torch.Tensor, seqs: list[Sequence], local: list[int]) -> torch.Tensor:
        """One draw per random row: x[local[k]] belongs to seqs[k]; [len(seqs)] int64."""
        dev, vocab = x.device, x.shape[-1]
        if self.nucleus and not any(_top_k_on(s.params, vocab) for s in seqs):
            return self._draw_nucleus(x, _to_device(local, torch.int64, dev), seqs)
        if self._use_fused(x):
            return self._draw_fused(x, _to_device(local, torch.int64, dev), seqs)
        if len(local) < x.shape[0]:
            x = x.index_select(0, _to_device(local, torch.int64, dev))
        # Filters only when some row asks for one (each costs a top-k of the rows and a pass or two).
        top_k = [min(max(s.params.top_k, 0), vocab) for s in seqs]  # clamped: the API bounds it below only
        top_p = [s.params.top_p for s in seqs]
        z, thr, top, valid = filtered_logits(
            x,
            temperature=_to_device([s.params.temperature for s in seqs], torch.float32, dev),
            top_k=_to_device(top_k, torch.int64, dev) if any(0 < k < vocab for k in top_k) else None,
            top_p=_to_device(top_p, torch.float32, dev) if any(p < 1 for p in top_p) else None,
            min_p=(
                _to_device([s.params.min_p for s in seqs], torch.float32, dev)
                if any(s.params.min_p > 0 for s in seqs)
                else None
            ),
        )
        drawn = race_draw(z, thr, _to_device(self._row_keys(seqs), torch.int64, dev))  # [W]
        # A row with no distribution (no finite logit, or +inf) takes its argmax, as greedy would.
        return torch.where(valid, drawn, top)

    def _row_keys(self, seqs: list[Sequence]) -> list[int]:
        """Each row's 64-bit race key (as int64). Seeded: from (seed, tokens generated so far) only, so
        a seeded request's tokens depend on nothing but its seed and its own logits (and a step that
        is sampled again, e.g. after a preemption, gives the same token). Unseeded: the next 64 bits of
        the Sampler's own generator (settings.model.seed makes a server run repeatable), so that the whole
        batch is one race kernel rather than a race plus a multinomial."""
        return [
            to_int64(
                row_key(s.params.seed, _num_generated(s))
                if s.params.seed is not None
                else self._rng.getrandbits(64)
            )
            for s in seqs
        ]

    def _apply_controls(self, x: torch.Tensor, seqs: list[Sequence], rows: list[int], vocab: int) -> None:
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
            c = self._controls_of(seq, vocab, dev)
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
            if _num_generated(seq) < p.min_tokens and c.stop_ids.numel():
                ban_rows.append(row)
                bans.append(c.stop_ids)
            if c.bias_ids.numel():
                bias_rows.append(row)
                bias_ids.append(c.bias_ids)
                bias_values.append(c.bias_values)
        if allowed_rows:
            keep = torch.zeros(len(allowed_rows), vocab, dtype=torch.bool, device=dev)
            keep.view(-1).index_fill_(0, _flat_index(range(len(allowed_rows)), allowed, vocab, dev), True)
            a = _to_device(allowed_rows, torch.int64, dev)
            x.index_copy_(0, a, x.index_select(0, a).masked_fill_(~keep, _NEG_INF))
        if ban_rows:
            flat.index_fill_(0, _flat_index(ban_rows, bans, vocab, dev), _NEG_INF)
        if word_bans:
            flat.index_fill_(0, _to_device(word_bans, torch.int64, dev), _NEG_INF)
        if bias_rows:
            flat.index_add_(0, _flat_index(bias_rows, bias_ids, vocab, dev), torch.cat(bias_values))
        penalized = [(row, seq) for row, seq in zip(rows, seqs, strict=True) if _has_penalty(seq.params)]
        if penalized:
            _apply_penalties(x, [r for r, _ in penalized], [s for _, s in penalized])


def _apply_penalties(x: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """Repetition (prompt + output tokens: logit / p if > 0 else logit * p), then frequency (minus
    penalty * count in the output) and presence (minus penalty once if in the output), on x[rows]."""
    dev, vocab = x.device, x.shape[-1]
    n = len(rows)
    out_counts = _token_counts([s.output_token_ids for s in seqs], vocab, dev)  # [n, V]
    seen_out = out_counts > 0

    def column(values: list[float]) -> torch.Tensor:
        return _to_device(values, torch.float32, dev).view(n, 1)

    whole = n == x.shape[0]  # every row (the usual case): in place, no gather
    idx = None if whole else _to_device(rows, torch.int64, dev)
    sub = x if whole else x.index_select(0, idx)
    # Each penalty only when some row has it: each is a few passes over [n, V].
    if any(s.params.repetition_penalty != 1 for s in seqs):
        prompts = [s.prompt_token_ids if s.params.repetition_penalty != 1 else [] for s in seqs]
        seen = seen_out | (_token_counts(prompts, vocab, dev) > 0)
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


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
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
    ids = _to_device(host, torch.int64, device)
    valid = ((ids >= 0) & (ids < vocab)).float()
    row = torch.repeat_interleave(_to_device(lengths, torch.int64, device), output_size=total)
    counts.view(-1).index_add_(0, row * vocab + ids.clamp(0, vocab - 1), valid)
    return counts


def _flat_index(
    rows: Iterable[int], ids: list[torch.Tensor], vocab: int, device: torch.device
) -> torch.Tensor:
    """Positions in a row-major [*, vocab] tensor: ids[k] (device int64) in row rows[k]."""
    rows = list(rows)
    lengths = [t.numel() for t in ids]
    row = torch.repeat_interleave(
        _to_device(rows, torch.int64, device),
        _to_device(lengths, torch.int64, device),
        output_size=sum(lengths),
    )
    return row * vocab + torch.cat(ids)


def _to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list (or array) on `device`. On CUDA through pinned memory and non_blocking: a plain
    torch.tensor(..., device=cuda) copies from pageable memory, which waits for the whole stream."""
    if isinstance(values, array):
        host = torch.frombuffer(values, dtype=dtype) if len(values) else torch.empty(0, dtype=dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def filtered_logits(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The filtered distribution of each row as log-weights: (z, thr, top, valid).

    z [R, V] fp32 = (logits - row max) / T with NaN and min_p-dropped tokens at -inf; the kept tokens
    are those with z >= thr [R] (top-k then top-p, filter_threshold.py; None: no such filter); top [R]
    int64: the argmax; valid [R] bool: the row has a finite max (else z is NaN and the row is one-hot
    on top). softmax(z where kept) is the row's distribution; the race draw uses z as it is.
    """
    # NaN -> -inf in one pass (a fresh tensor, modified in place below); +inf stays +inf.
    z = logits.float().nan_to_num(nan=_NEG_INF, posinf=float("inf"), neginf=_NEG_INF)
    row_max, top = z.max(dim=-1, keepdim=True)  # [R, 1] each, one pass
    # Shift before dividing: every value is <= 0, so a small T can push logits to -inf but never
    # to +inf (softmax is shift-invariant, so the distribution is unchanged).
    temperature = temperature.float().nan_to_num(nan=1.0).clamp_min(MIN_TEMPERATURE).unsqueeze(1)
    z.sub_(row_max).div_(temperature)
    if min_p is not None:
        # p_i < min_p * p_max  <=>  exp(z_i - z_max) < min_p  <=>  z_i < log(min_p) (z_max is 0 here);
        # log(0) = -inf drops nothing, and the top token (0 >= log(min_p <= 1)) always stays.
        z.masked_fill_(z < min_p.float().clamp(0, 1).log().unsqueeze(1), _NEG_INF)
    thr = None if top_k is None and top_p is None else thresholds(z, top_k, top_p)
    return z, thr, top.view(-1), row_max.view(-1).isfinite()


def probs_from_logits(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax(logits / T) restricted by min_p, then to the top-k, then to the top-p nucleus, per row.

    min_p 0 or None = off (drops tokens whose probability is below min_p * the top one's); top_k 0 or
    None = off; top_p >= 1 or None = off. Nothing sorts the vocabulary (filter_threshold.py: a bounded
    top-k per row, and an exact fallback for rows whose nucleus is longer). Tokens tied with the last
    kept one are all kept. The most likely token always survives every filter, whatever top_p is
    (0.0 included: a tiny top_p underflows in float32). Every row is a distribution (no NaN, sums
    to 1): a row with no finite logit, or one that overflows, is one-hot on its argmax.
    """
    z, thr, top, _ = filtered_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if thr is not None:
        z.masked_fill_(z < thr.view(-1, 1), _NEG_INF)
    return _finite_rows(z.softmax(dim=-1), top.view(-1, 1))


def _finite_rows(probs: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """probs [R, V] with every row that is no distribution (all -inf or +inf logits) made one-hot on its
    argmax `top` [R, 1], like greedy. In place, without a sync or another [R, V] tensor."""
    bad = ~(probs.isfinite().all(dim=-1, keepdim=True) & (probs.sum(dim=-1, keepdim=True) > 0))
    probs.masked_fill_(bad, 0.0)
    return probs.scatter_(1, top, torch.where(bad, 1.0, probs.gather(1, top)))
