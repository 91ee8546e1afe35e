"""Token selection on a batch of logits (the stop rules are in stopping.py).

Sampling is batched over the rows that need it; greedy rows take argmax of the fp32 logits, so
greedy output does not depend on which other requests share the batch. A seeded request draws
from its own torch.Generator (created on first use, on the logits' device) one row at a time, so
its tokens depend only on its seed and its own logits, never on batch composition. Unseeded rows
share one batched draw.

No validated parameters make sampling raise or produce NaN: the top token always survives the
top-k and top-p filters (top_p 1e-300 is 0.0 in float32), a temperature too small to divide by
(below MIN_TEMPERATURE, e.g. 1e-300) is greedy, logits are shifted by their row max before the
division so nothing overflows, and a row whose logits hold no usable distribution (all -inf,
NaN, +inf) takes its argmax instead of a draw.
"""

from __future__ import annotations

import torch

from graphcache.engine.sequence import Sequence

# Temperatures below this are greedy: logits / 1e-300 overflows, and sampling at such a
# temperature is argmax anyway. (Also catches NaN, which validation's `< 0` check lets through.)
MIN_TEMPERATURE = 1e-5
_SEED_MASK = (1 << 64) - 1   # torch.Generator.manual_seed takes 64 bits


def _is_greedy(temperature: float) -> bool:
    return not temperature >= MIN_TEMPERATURE


class Sampler:
    def __init__(self, default_seed: int | None = None) -> None:
        # Unseeded rows: a generator per device; seeded by settings.seed so a server run is repeatable.
        self._default_seed = default_seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator | None:
        if self._default_seed is None:
            return None
        g = self._shared.get(device)
        if g is None:
            g = self._shared[device] = torch.Generator(device=device).manual_seed(self._default_seed)
        return g

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
        random_rows = [i for i, s in enumerate(seqs) if not _is_greedy(s.params.temperature)]
        if random_rows:
            dev = logits.device
            idx = _to_device(random_rows, torch.int64, dev)
            vocab = logits.shape[-1]
            probs = probs_from_logits(
                logits.index_select(0, idx),
                temperature=_to_device([seqs[i].params.temperature for i in random_rows], torch.float32, dev),
                # Clamped here: a top_k past int64 (the API bounds it below only) must not overflow the tensor.
                top_k=_to_device([min(max(seqs[i].params.top_k, 0), vocab) for i in random_rows], torch.int64, dev),
                top_p=_to_device([seqs[i].params.top_p for i in random_rows], torch.float32, dev),
            )
            seeded = [j for j, i in enumerate(random_rows) if seqs[i].params.seed is not None]
            unseeded = [j for j, i in enumerate(random_rows) if seqs[i].params.seed is None]
            drawn = torch.empty(len(random_rows), dtype=torch.long, device=logits.device)
            if unseeded:
                u = _to_device(unseeded, torch.int64, logits.device)
                drawn[u] = torch.multinomial(probs.index_select(0, u), 1,
                                             generator=self._shared_generator(logits.device)).squeeze(1)
            for j in seeded:
                seq = seqs[random_rows[j]]
                if seq.generator is None or seq.generator.device != logits.device:
                    seq.generator = torch.Generator(device=logits.device).manual_seed(seq.params.seed & _SEED_MASK)
                drawn[j] = torch.multinomial(probs[j], 1, generator=seq.generator)[0]
            tokens[idx] = drawn
        return tokens


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device`. On CUDA through pinned memory and non_blocking: a plain
    torch.tensor(..., device=cuda) copies from pageable memory, which waits for the whole stream."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def probs_from_logits(logits: torch.Tensor, *, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Softmax(logits / T) restricted to the top-k and then the top-p nucleus, per row.

    top_k 0 = off; top_p >= 1 = off. The most likely token always survives both filters, whatever
    top_p is (0.0 included: a tiny top_p underflows in float32). Every row is a distribution (no
    NaN, sums to 1): a row with no finite logit, or one that overflows, is one-hot on its argmax.
    """
    logits = logits.float()
    logits = logits.masked_fill(logits.isnan(), float("-inf"))
    top = logits.argmax(dim=-1, keepdim=True)
    # Shift before dividing: every value is <= 0, so a small T can push logits to -inf but never
    # to +inf (softmax is shift-invariant, so the distribution is unchanged).
    row_max = logits.max(dim=-1, keepdim=True).values
    temperature = temperature.float().nan_to_num(nan=1.0).clamp_min(MIN_TEMPERATURE).unsqueeze(1)
    logits = (logits - row_max) / temperature
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    top_k = top_k.clamp(0, vocab)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p; never the first one.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    top_p = top_p.float().unsqueeze(1)
    drop = (mass_before >= top_p) & (top_p < 1) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = filtered.softmax(dim=-1)
    # Rows that are still no distribution (all -inf or +inf logits): their argmax, like greedy.
    # In place, without a sync or another [rows, V] tensor.
    bad = ~(probs.isfinite().all(dim=-1, keepdim=True) & (probs.sum(dim=-1, keepdim=True) > 0))
    probs.masked_fill_(bad, 0.0)
    return probs.scatter_(1, top, torch.where(bad, 1.0, probs.gather(1, top)))
