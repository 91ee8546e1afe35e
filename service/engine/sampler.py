"""Token selection on a batch of logits, and the stop rules that end a sequence.

Sampling is batched over the rows that need it; greedy rows take argmax of the fp32 logits, so
greedy output does not depend on which other requests share the batch. A seeded request draws
from its own torch.Generator (created on first use, on the logits' device) one row at a time, so
its tokens depend only on its seed and its own logits, never on batch composition. Unseeded rows
share one batched draw.

Stop rules (checked after each new token, in this order): stop token ids and EOS (unless
ignore_eos) -> "stop"; stop strings on the incrementally detokenized text -> "stop", with the stop
string and anything after it cut from the output (OpenAI semantics; the detokenizer does the cut
and holds back a tail that could still become a stop string); max_tokens or max_model_len
-> "length".
"""

from __future__ import annotations

import torch

from service.engine.sequence import Sequence


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

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of `logits` [len(seqs), V] (row i belongs to seqs[i])."""
        assert logits.shape[0] == len(seqs), (logits.shape, len(seqs))
        if not seqs:
            return []
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            probs = probs_from_logits(
                logits.index_select(0, idx),
                temperature=torch.tensor([seqs[i].params.temperature for i in random_rows], device=logits.device),
                top_k=torch.tensor([seqs[i].params.top_k for i in random_rows], device=logits.device),
                top_p=torch.tensor([seqs[i].params.top_p for i in random_rows], device=logits.device),
            )
            seeded = [j for j, i in enumerate(random_rows) if seqs[i].params.seed is not None]
            unseeded = [j for j, i in enumerate(random_rows) if seqs[i].params.seed is None]
            drawn = torch.empty(len(random_rows), dtype=torch.long, device=logits.device)
            if unseeded:
                u = torch.tensor(unseeded, device=logits.device)
                drawn[u] = torch.multinomial(probs.index_select(0, u), 1,
                                             generator=self._shared_generator(logits.device)).squeeze(1)
            for j in seeded:
                seq = seqs[random_rows[j]]
                if seq.generator is None or seq.generator.device != logits.device:
                    seq.generator = torch.Generator(device=logits.device).manual_seed(seq.params.seed)
                drawn[j] = torch.multinomial(probs[j], 1, generator=seq.generator)[0]
            tokens[idx] = drawn
        return tokens.tolist()


def probs_from_logits(logits: torch.Tensor, *, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Softmax(logits / T) restricted to the top-k and then the top-p nucleus, per row.

    top_k 0 = off; top_p 1 = off. The most likely token always survives both filters.
    """
    logits = logits / temperature.clamp_min(1e-5).unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.clamp_max(vocab), torch.full_like(top_k, vocab)).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return filtered.softmax(dim=-1)


# --- stop rules ------------------------------------------------------------------------------
# Text comes from the tokenizer's IncrementalDetokenizer (service/model/tokenizer.py): add(ids)
# returns only text that is safe to emit (no split UTF-8 character, no tail that may still grow
# into a stop string), cuts a stop string and what follows, and sets `.stopped`; finish() flushes.

def check_stop(seq: Sequence, token_id: int, *, eos_token_ids: set[int] | frozenset[int],
               max_model_len: int) -> str | None:
    """Update `seq`'s text with its newest token (already appended) and return a finish reason or None."""
    params = seq.params
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"   # the stop token stays in token ids but adds no text (like OpenAI/vLLM)
    if seq.detokenizer is not None:
        seq.output_text += seq.detokenizer.add([token_id])
        if seq.detokenizer.stopped is not None:
            return "stop"
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def sendable_text(seq: Sequence, finished: bool) -> str:
    """Text not yet streamed; on finish, first flush what the detokenizer held back."""
    if finished and seq.detokenizer is not None:
        seq.output_text += seq.detokenizer.finish()
        seq.detokenizer = None   # flushed once; nothing more will come
    delta = seq.output_text[seq.num_text_sent:]
    seq.num_text_sent = len(seq.output_text)
    return delta
