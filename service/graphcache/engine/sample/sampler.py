"""Token selection on a batch of logits: which draw each row takes (the stop rules are in stopping.py,
the logits controls in controls.py).

Sampling is batched over the rows that need it. A row goes one of three ways:
  - greedy, no logits controls: argmax of the model-dtype logits (no fp32 [R, V] copy): the fast path;
    beside random rows and no controls, the draw kernel's argmax in the same launch (the same token;
    NaN, which torch's argmax ranks first, the kernel never takes);
  - greedy with controls: argmax of the processed fp32 logits;
  - random: controls, then temperature -> min_p -> top-k -> top-p, then a draw.
Every step is row-wise, so a row's token never depends on which other requests share the batch.

Random rows (temperature, min_p, top-k, top-p) take nucleus_draw.py: one Triton launch on CUDA that
races first and checks the nucleus after (rejection sampling), two or three passes over each row,
straight from the model-dtype logits when the row has no logits controls; its torch twin on the CPU.
Top-k is one more floor on the kept tokens there: each top-k row's k-th largest logit, which the kernel
finds by radix select (kth_select.py; the host uploads k). The draw is an
exponential race (race_draw.py): token = argmax exp(z_i) / E_i over the kept tokens, with E_i = -log u_i
and u_i a 32-bit hash of (row key, i). No softmax and no sampling state: a seeded row's key is a function of (seed, tokens it generated so far), so its tokens depend
only on its seed and its own logits (not on the batch, the device's RNG or earlier calls); unseeded
rows take keys from the Sampler's host generator, seeded by settings.model.seed.

With Sampler(nucleus=False) (to compare paths) random rows take the threshold path instead, which
never sorts the vocabulary: temperature and min_p act on z = (logits - max) / T, and top-k / top-p become
one threshold per row (keep z >= thr), found from a bounded torch.topk per row with an exact bisection
fallback for long nuclei (filter_threshold.py), then the race (filtered_logits -> filter_threshold ->
race_draw). Both paths keep the same tokens: min_p, then the k largest (every token tied with the k-th
too), then the top-p nucleus of those, renormalized; NaN logits never.

No validated parameters make sampling raise or produce NaN: the top token always survives the
min_p, top-k and top-p filters (top_p 1e-300 is 0.0 in float32), a temperature too small to divide
by (below MIN_TEMPERATURE, e.g. 1e-300) is greedy, logits are shifted by their row max before the
division so nothing overflows, and a row whose logits hold no usable distribution (all -inf, NaN,
+inf) takes its argmax instead of a draw.

A step's rows are the worker's SamplingStates (state.py: each request's params, the ids its controls read,
how many tokens it generated, and the sampler's caches of what its params fix).
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Iterable

import torch

from graphcache.engine.sample.controls import LogitsControls, has_controls, to_device
from graphcache.engine.sample.filter_threshold import thresholds
from graphcache.engine.sample.nucleus_draw import nucleus_draw, step_keys
from graphcache.engine.sample.race_draw import mix64, race_draw, to_int64
from graphcache.engine.sample.state import SamplingState
from graphcache.engine.sequence import SamplingParams
from graphcache.model.triton_support import HAVE_TRITON

# Temperatures below this are greedy: logits / 1e-300 overflows, and sampling at such a
# temperature is argmax anyway. (Also catches NaN, which validation's `< 0` check lets through.)
MIN_TEMPERATURE = 1e-5
_NEG_INF = float("-inf")
_PARAMS_ROW = struct.Struct("<4f")  # a row of nucleus_draw's params
_INT64 = struct.Struct("<q")
_FLT_MAX = 3.4028234663852886e38


def _is_greedy(temperature: float) -> bool:
    return not temperature >= MIN_TEMPERATURE


class Sampler:
    def __init__(
        self,
        default_seed: int | None = None,
        eos_token_ids: Iterable[int] = (),
        nucleus: bool = True,
    ) -> None:
        # Random rows: the rejection sampler (nucleus_draw.py; False only to compare paths).
        self.nucleus = nucleus
        # Unseeded rows' race keys; seeded by settings.model.seed so a server run is repeatable (None: OS entropy).
        self._rng = random.Random(default_seed)
        self._arange: dict[torch.device, torch.Tensor] = {}  # _all_rows' cache, per device
        self.controls = LogitsControls(eos_token_ids)

    @staticmethod
    def plain_greedy(seq: SamplingState) -> bool:
        """The row's token is the argmax of its raw logits (greedy, no logits controls): a batch of such rows
        skips the rest. Cached on the row (its params do not change)."""
        flag = seq.plain_greedy
        if flag is None:
            p = seq.params
            flag = seq.plain_greedy = _is_greedy(p.temperature) and p.min_tokens == 0 and not has_controls(p)
        return flag

    @staticmethod
    def _needs_processing(seq: SamplingState) -> bool:
        # has_controls cached on the row (a per-row call of it was ~40% of this method's host time)
        steady = seq.steady_controls
        if steady is None:
            steady = seq.steady_controls = has_controls(seq.params)
        min_tokens = seq.params.min_tokens
        return steady or (min_tokens > 0 and seq.num_generated < min_tokens)

    @torch.inference_mode()
    def warmup(self, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compile the Triton draw kernels now, not in the first sampled step (a compile there stalls
        every running request for about a second): one draw on each path on random logits (top-p rows
        and top-k rows, whose params carry a 4th column, each from model-dtype logits and from processed
        fp32 logits)."""
        if device.type != "cuda" or not HAVE_TRITON:
            return
        x = torch.randn(2, vocab, device=device).to(dtype)
        for params in (
            SamplingParams(temperature=0.8, top_p=0.9),
            SamplingParams(temperature=0.8, top_p=0.9, logit_bias={0: 1.0}),
            SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
            SamplingParams(temperature=0.8, top_k=5, top_p=0.9, logit_bias={0: 1.0}),
        ):
            self.sample_device(x[:1], [SamplingState("sampler-warmup", params, [0])])
        torch.cuda.synchronize(device)

    def sample(self, logits: torch.Tensor, seqs: list[SamplingState]) -> list[int]:
        """One token per row of `logits` [len(seqs), V] (row i belongs to seqs[i]), on the host."""
        return self.sample_device(logits, seqs).tolist()

    @torch.inference_mode()
    def sample_device(
        self, logits: torch.Tensor, seqs: list[SamplingState], plain_greedy: bool | None = None
    ) -> torch.Tensor:
        """Like sample(), as a [len(seqs)] int64 tensor on the logits' device, without waiting for
        the GPU: host values reach the device through pinned, asynchronous copies. plain_greedy: whether
        every row is (the worker's table knows it for a set of rows; None: asked of each row)."""
        assert logits.shape[0] == len(seqs), (logits.shape, len(seqs))
        if plain_greedy is None:
            plain_greedy = all(map(self.plain_greedy, seqs))  # one cached flag per row
        if plain_greedy:
            # argmax in the model dtype: the same token as over a float copy, without writing [R, V] fp32
            return logits.argmax(dim=-1)
        processed = {i for i, s in enumerate(seqs) if self._needs_processing(s)}
        if not processed and self.nucleus:
            # No row has controls: every row in one launch straight from the logits, greedy rows
            # (temperature 0 in their parameters) taking the kernel's argmax; no fp32 copy, no scatter.
            return self._draw_nucleus(logits, self._all_rows(len(seqs), logits.device), seqs)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(seqs) if i in processed or not _is_greedy(s.params.temperature)]
        dev = logits.device
        idx = to_device(rows, torch.int64, dev)
        work = [seqs[i] for i in rows]
        x = logits.index_select(0, idx).float()  # [W, V] fp32, ours to modify
        if processed:
            x = self.controls.apply(x, work, [j for j, i in enumerate(rows) if i in processed])
        random_local = [j for j, s in enumerate(work) if not _is_greedy(s.params.temperature)]
        chosen = x.argmax(dim=-1) if len(random_local) < len(rows) else torch.empty_like(idx)
        if random_local:
            chosen[to_device(random_local, torch.int64, dev)] = self._draw(
                x, [work[j] for j in random_local], random_local
            )
        return tokens.index_copy_(0, idx, chosen)

    @torch.inference_mode()
    def sample_positions(
        self, logits: torch.Tensor, seqs: list[SamplingState], offsets: list[int]
    ) -> torch.Tensor:
        """One token per row of logits [W, V], as a [W] int64 device tensor: row i is drawn as seqs[i]'s
        token `offsets[i]` output positions from the one its state counts (num_generated; a verify step's
        fed positions: engine/spec/match.py), so a seeded row's draw is the one plain decoding makes at
        that output position. Rows have no logits controls (the scheduler speculates none)."""
        assert logits.shape[0] == len(seqs) == len(offsets), (logits.shape, len(seqs), len(offsets))
        if all(map(self.plain_greedy, seqs)):
            return logits.argmax(dim=-1)
        rows = self._all_rows(len(seqs), logits.device)
        if self.nucleus:
            return self._draw_nucleus(logits, rows, seqs, offsets)
        tokens = logits.argmax(dim=-1)
        local = [i for i, s in enumerate(seqs) if not _is_greedy(s.params.temperature)]
        drawn = self._draw(logits.float(), [seqs[i] for i in local], local, [offsets[i] for i in local])
        return tokens.index_copy_(0, to_device(local, torch.int64, logits.device), drawn)

    @torch.inference_mode()
    def processed_logits(self, logits: torch.Tensor, seqs: list[SamplingState]) -> torch.Tensor:
        """[len(seqs), V] fp32: each row's logits after its controls (before temperature and the
        top-k/top-p/min_p filters): what a greedy row takes the argmax of."""
        x = logits.float().clone()
        local = [i for i, s in enumerate(seqs) if self._needs_processing(s)]
        return self.controls.apply(x, seqs, local) if local else x

    def _all_rows(self, n: int, device: torch.device) -> torch.Tensor:
        """arange(n) on device, from one cached tensor (no upload a step)."""
        rows = self._arange.get(device)
        if rows is None or rows.numel() < n:
            rows = self._arange[device] = torch.arange(max(n, 1024), device=device)
        return rows[:n]

    def _draw_nucleus(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor,
        seqs: list[SamplingState],
        offsets: list[int] | None = None,
    ) -> torch.Tensor:
        """One draw per entry of rows [W] (indices into logits [R, V], any float dtype):
        nucleus_draw.py's rejection sampler, one launch on CUDA, no sync: the host cost of a sampled
        step stays near a greedy one's. offsets: sample_positions'."""
        params, keys, steps = self._draw_tensors(seqs, logits.device, offsets)
        top_k = any(s.draw_row[2] for s in seqs)  # else the kernel skips the lanes' top three and the select
        return nucleus_draw(logits, rows, params, keys, steps, top_k=top_k)

    def _draw_tensors(
        self, seqs: list[SamplingState], device: torch.device, offsets: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(params [W, 4] fp32, keys [W], steps [W] int64) on device: _draw_inputs' buffer in one upload
        (pinned, non_blocking on CUDA), viewed in three parts."""
        n = len(seqs)
        host = torch.frombuffer(self._draw_inputs(seqs, offsets), dtype=torch.uint8)  # [32 W] bytes
        if device.type == "cuda":
            host = host.pin_memory().to(device, non_blocking=True)
        params = host[: 16 * n].view(torch.float32).view(n, 4)  # temperature, top_p, log(min_p), top_k
        return params, host[16 * n : 24 * n].view(torch.int64), host[24 * n :].view(torch.int64)

    def _draw_inputs(self, seqs: list[SamplingState], offsets: list[int] | None = None) -> bytearray:
        """The per-row draw inputs as bytes, built from bytes cached on each request (only seeded rows are
        written one by one): params [W, 4] fp32, then keys [W] and steps [W] int64, each row's race key
        before nucleus_draw.step_keys mixes it, and its step. Unseeded rows: 64 bits of the Sampler's own
        generator (one draw for the batch; settings.model.seed makes a server run repeatable) and step -1
        (the key as it is). Seeded rows: mix64(seed), cached on the request, and the tokens generated so
        far, so a seeded request's tokens depend on nothing but its seed and its own logits (and a step
        sampled again, e.g. after a preemption, gives the same token). offsets: added to seeded rows' steps
        (sample_positions)."""
        n = len(seqs)
        cached = [s.draw_row or self._draw_row(s) for s in seqs]
        buf = bytearray(b"".join([c[0] for c in cached]))
        buf += self._rng.getrandbits(64 * n).to_bytes(8 * n, "little")  # unseeded rows' keys
        buf += b"\xff" * (8 * n)  # step -1: the key as it is
        for j, c in enumerate(cached):
            if c[1] is not None:  # seeded: mix64(seed), and the tokens generated so far
                _INT64.pack_into(buf, 16 * n + 8 * j, c[1])
                step = seqs[j].num_generated + (offsets[j] if offsets is not None else 0)
                _INT64.pack_into(buf, 24 * n + 8 * j, step)
        return buf

    @staticmethod
    def _draw_row(seq: SamplingState) -> tuple[bytes, int | None, bool]:
        """A request's static draw parameters, cached on it: (its params row as nucleus_draw takes it,
        4 fp32 bytes-packed: temperature (0 when greedy), top_p, log(min_p) or -inf, top_k (0: off; on
        where 0 < top_k < V; capped at 2^24, where fp32 still holds every integer, far above any
        vocabulary)), mix64(seed) as int64 or None, and whether top_k is on (> 0)."""
        p = seq.params
        # greedy: 0; above fp32's range: inf, as a float tensor would hold it (struct.pack raises)
        temperature = (
            0.0 if _is_greedy(p.temperature) else p.temperature if p.temperature <= _FLT_MAX else math.inf
        )
        log_min_p = math.log(min(p.min_p, 1.0)) if p.min_p > 0 else _NEG_INF
        top_k = min(max(p.top_k, 0), 1 << 24)
        seed_key = None if p.seed is None else to_int64(mix64(p.seed))
        seq.draw_row = (_PARAMS_ROW.pack(temperature, p.top_p, log_min_p, top_k), seed_key, top_k > 0)
        return seq.draw_row

    def _draw(
        self,
        x: torch.Tensor,
        seqs: list[SamplingState],
        local: list[int],
        offsets: list[int] | None = None,
    ) -> torch.Tensor:
        """One draw per random row: x[local[k]] belongs to seqs[k]; [len(seqs)] int64. offsets:
        sample_positions'."""
        dev, vocab = x.device, x.shape[-1]
        if self.nucleus:
            return self._draw_nucleus(x, to_device(local, torch.int64, dev), seqs, offsets)
        if len(local) < x.shape[0]:
            x = x.index_select(0, to_device(local, torch.int64, dev))
        # Filters only when some row asks for one (each costs a top-k of the rows and a pass or two).
        top_k = [min(max(s.params.top_k, 0), vocab) for s in seqs]  # clamped: the API bounds it below only
        top_p = [s.params.top_p for s in seqs]
        z, thr, top, valid = filtered_logits(
            x,
            temperature=to_device([s.params.temperature for s in seqs], torch.float32, dev),
            top_k=to_device(top_k, torch.int64, dev) if any(0 < k < vocab for k in top_k) else None,
            top_p=to_device(top_p, torch.float32, dev) if any(p < 1 for p in top_p) else None,
            min_p=(
                to_device([s.params.min_p for s in seqs], torch.float32, dev)
                if any(s.params.min_p > 0 for s in seqs)
                else None
            ),
        )
        _, keys, steps = self._draw_tensors(seqs, dev, offsets)
        drawn = race_draw(z, thr, step_keys(keys, steps))  # [W]
        # A row with no distribution (no finite logit, or +inf) takes its argmax, as greedy would.
        return torch.where(valid, drawn, top)


def filtered_logits(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The filtered distribution of each row as log-weights: (z, thr, top, valid).

    z [R, V] fp32 = (logits - row max) * (1 / T) with NaN and min_p-dropped tokens at -inf; the kept tokens
    are those with z >= thr [R] (top-k then top-p, filter_threshold.py; None: no such filter); top [R]
    int64: the argmax; valid [R] bool: the row has a finite max (else z is NaN and the row is one-hot
    on top). softmax(z where kept) is the row's distribution; the race draw uses z as it is.
    """
    # NaN -> -inf in one pass (a fresh tensor, modified in place below); +inf stays +inf.
    z = logits.float().nan_to_num(nan=_NEG_INF, posinf=float("inf"), neginf=_NEG_INF)
    row_max, top = z.max(dim=-1, keepdim=True)  # [R, 1] each, one pass
    # Shift before scaling: every value is <= 0, so a small T can push logits to -inf but never
    # to +inf (softmax is shift-invariant, so the distribution is unchanged). Times the fp32 reciprocal
    # of T, as nucleus_draw.py scales: a row takes the same z, hence the same token, on either path.
    temperature = temperature.float().nan_to_num(nan=1.0).clamp_min(MIN_TEMPERATURE).unsqueeze(1)
    z.sub_(row_max).mul_(1.0 / temperature)
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
