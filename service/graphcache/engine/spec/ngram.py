"""NgramProposer: prompt lookup. Draft the tokens that followed the request's own suffix earlier on.

The rule is vLLM's (vllm/v1/spec_decode/ngram_proposer.py): for a context t[0:L] (prompt + output so
far), find the longest n in [prompt_lookup_min, prompt_lookup_max] whose suffix t[L-n:L] occurred
earlier (ending at e <= L-2; overlapping the suffix is allowed), take that n-gram's FIRST occurrence
(vLLM keeps the earliest position among the longest matches), and propose t[e+1 : e+1+k], fewer where
the context ends first; k is also capped so the context never passes max_model_len. Example (min 2,
max 3, k 4): [1, 2, 3, 4, 2, 3] -> no earlier [4, 2, 3]; [2, 3] first ends at 2 -> [4, 2, 3].

vLLM searches the whole context each step (a KMP pass, O(L), in numba). Here each request keeps an index
that is updated as tokens append, so a step costs O(max - min + 1) whatever the context length:
  - keys: a 64-bit polynomial hash of each n-gram, salted by n, keyed to the end of its first occurrence;
  - the bulk of the context in two sorted arrays (keys, first ends; 16 bytes per token per n, where a
    Python dict costs ~100), built vectorised in numpy and searched by bisect behind a bitmap of the
    keys (2 bytes per key) that rules most misses out in one read;
  - the tokens appended since in a small dict, folded into the arrays once it outgrows them (so each
    token is re-sorted O(log L) times in all);
  - a hit is checked against the tokens themselves, so a hash collision can cost a proposal, never
    propose a wrong continuation.
benchmarks/ngram_propose.py measures it (microseconds per request at 256 requests, 0.5k to 32k tokens).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable, Sequence

import numpy as np

from graphcache.engine.spec.config import MAX_PROMPT_LOOKUP, SpeculativeConfig
from graphcache.engine.spec.proposer import DraftRequest, Proposer

__all__ = ["NgramIndex", "NgramProposer"]

MASK64 = (1 << 64) - 1
BASE = 0x9E3779B97F4A7C15  # odd, so multiplying by it permutes 64-bit words
TAIL_MIN = 256  # the dict of new n-grams is folded into the sorted arrays past max(this, their tokens)


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: the per-n salts, so equal hashes of different lengths do not meet."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


# POWERS[j] = BASE^j: the weight of the j-th last token of an n-gram.
POWERS = [pow(BASE, j, 1 << 64) for j in range(MAX_PROMPT_LOOKUP)]
SALTS = [_mix64(n) for n in range(MAX_PROMPT_LOOKUP + 1)]  # SALTS[n]: xored into an n-gram's hash


class NgramIndex:
    """One request's context and the first occurrence of each of its n-grams, min_n <= n <= max_n.

    An n-gram ending at e hashes to sum_j (t[e-j] + 1) * BASE^j (mod 2^64), j < n, xored with SALTS[n];
    the vectorised build and the per-token insert compute the same keys. The step path touches no numpy
    (a numpy call costs more than the whole lookup): the tokens and the sorted keys are array.arrays,
    searched by bisect; numpy reads them in place for the bulk build."""

    __slots__ = (
        "frozen_bits",
        "frozen_ends",
        "frozen_keys",
        "frozen_len",
        "frozen_shift",
        "max_n",
        "min_n",
        "suffix_keys",
        "tail",
        "tokens",
    )

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._reset()

    def _reset(self) -> None:
        self.tokens = array("q")  # [length]: the context
        # Grams ending before frozen_len: sorted keys [G] and the end of each one's first occurrence [G].
        self.frozen_keys = array("Q")
        self.frozen_ends = array("q")
        self.frozen_len = 0
        # A bitmap of the frozen keys' top bits: most lookups miss (the longest n first), and one byte
        # read rules a key out where bisect would take log2(G) steps.
        self.frozen_bits = b""
        self.frozen_shift = 64
        self.tail: dict[int, int] = {}  # key -> first end, for grams ending at frozen_len or later
        self.suffix_keys: list[int] = []  # keys of the grams ending at length - 1: [i] is n = min_n + i

    @property
    def length(self) -> int:
        return len(self.tokens)

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Take in what the request appended since the last call (prompt + output only ever grow)."""
        n_prompt = len(prompt)
        total = n_prompt + len(output)
        length = len(self.tokens)
        if total < length:  # not an append (never expected): start over rather than guess
            self._reset()
            length = 0
        if total == length:
            return
        if length < n_prompt:
            self.extend([*prompt[length:], *output])
        else:
            self.extend(output[length - n_prompt :])

    def extend(self, new: Iterable[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(new)
        end = len(self.tokens)
        if end == start:
            return
        if end - self.frozen_len > max(TAIL_MIN, self.frozen_len):
            self._freeze()
            self.suffix_keys = self._keys_at(end - 1)
            return
        tail, keys = self.tail, []
        for e in range(start, end):
            keys = self._keys_at(e)
            for key in keys:
                tail.setdefault(key, e)
        self.suffix_keys = keys

    def propose(self, k: int) -> list[int]:
        """Up to k tokens after the first earlier occurrence of the longest matching suffix; [] if none."""
        tokens = self.tokens
        L = len(tokens)
        for i in range(len(self.suffix_keys) - 1, -1, -1):  # the longest n first
            e = self._first_end(self.suffix_keys[i])
            if e is None or e >= L - 1:  # none, or only the suffix itself
                continue
            n = self.min_n + i
            if tokens[e - n + 1 : e + 1] != tokens[L - n : L]:
                continue  # a hash collision: no proposal from this n rather than a wrong one
            return tokens[e + 1 : min(e + 1 + k, L)].tolist()
        return []

    # --- internals

    def _keys_at(self, e: int) -> list[int]:
        """The keys of the grams ending at e, shortest first (n = min_n .. min(max_n, e + 1))."""
        keys, h = [], 0
        for j, t in enumerate(reversed(self.tokens[max(0, e - self.max_n + 1) : e + 1])):
            h = (h + (t + 1) * POWERS[j]) & MASK64
            if j + 1 >= self.min_n:
                keys.append(h ^ SALTS[j + 1])
        return keys

    def _first_end(self, key: int) -> int | None:
        keys = self.frozen_keys
        bit = key >> self.frozen_shift
        if keys and (self.frozen_bits[bit >> 3] >> (bit & 7)) & 1:  # frozen grams end first: look there first
            i = bisect_left(keys, key)
            if i < len(keys) and keys[i] == key:
                return self.frozen_ends[i]
        return self.tail.get(key)

    def _freeze(self) -> None:
        """Every gram of the context into the sorted arrays, vectorised; the tail empties."""
        L = len(self.tokens)
        v = np.frombuffer(self.tokens, dtype=np.int64).astype(np.uint64) + np.uint64(1)  # [L]
        h = v.copy()  # [L]: h[e] = the hash of the n-gram ending at e, for the current n (e >= n - 1)
        keys, ends = [], []
        for n in range(1, min(self.max_n, L) + 1):
            if n > 1:  # numpy's uint64 arithmetic wraps: mod 2^64, as _keys_at's mask
                h[n - 1 :] += v[: L - n + 1] * np.uint64(POWERS[n - 1])
            if n >= self.min_n:
                keys.append(h[n - 1 :] ^ np.uint64(SALTS[n]))
                ends.append(np.arange(n - 1, L, dtype=np.int64))
        self.frozen_keys, self.frozen_ends = array("Q"), array("q")
        if keys:
            all_keys, all_ends = np.concatenate(keys), np.concatenate(ends)  # [G]
            order = np.argsort(all_keys)  # quicksort: twice np.unique's stable sort; ties resolved below
            sorted_keys = all_keys[order]
            first = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])  # [U]: each key's run
            unique = sorted_keys[first]  # [U]
            self.frozen_keys.frombytes(unique.tobytes())
            # the earliest end in each run of equal keys (keys of different n differ by their salt)
            self.frozen_ends.frombytes(np.minimum.reduceat(all_ends[order], first).tobytes())
            # 16 bits or more per key: a miss passes the bitmap 1 time in 16 at most
            width = max(16, (16 * unique.size - 1).bit_length())
            present = np.zeros(1 << width, dtype=bool)
            present[unique >> np.uint64(64 - width)] = True
            self.frozen_bits = np.packbits(present, bitorder="little").tobytes()
            self.frozen_shift = 64 - width
        self.frozen_len = L
        self.tail = {}


class NgramProposer(Proposer):
    """Prompt lookup over each request's prompt + output, with one NgramIndex per request."""

    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        max_model_len: int | None = None,
    ) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max <= MAX_PROMPT_LOOKUP:
            raise ValueError(
                f"prompt lookup {prompt_lookup_min}..{prompt_lookup_max}: need 1 <= min <= max <= "
                f"{MAX_PROMPT_LOOKUP}"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.max_model_len = max_model_len
        self._indexes: dict[str, NgramIndex] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig, max_model_len: int | None = None) -> NgramProposer:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        return cls(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max, max_model_len
        )

    @property
    def num_indexed(self) -> int:
        """Requests with an index (for tests and /admin)."""
        return len(self._indexes)

    def propose(
        self, requests: Sequence[DraftRequest], max_draft_tokens: Sequence[int] | None = None
    ) -> list[list[int]]:
        drafts: list[list[int]] = []
        for i, request in enumerate(requests):
            prompt, output = request.prompt_token_ids, request.output_token_ids
            total = len(prompt) + len(output)
            k = self.num_speculative_tokens
            if max_draft_tokens is not None:
                k = min(k, max_draft_tokens[i])
            if self.max_model_len is not None:
                k = min(k, self.max_model_len - total)
            if k <= 0 or total < self.min_n:  # a row that may not speculate costs nothing, index included
                drafts.append([])
                continue
            index = self._indexes.get(request.request_id)
            if index is None:
                index = self._indexes[request.request_id] = NgramIndex(self.min_n, self.max_n)
            index.sync(prompt, output)
            drafts.append(index.propose(k))
        return drafts

    def remove(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def retain(self, request_ids: Iterable[str]) -> None:
        keep = set(request_ids)
        for request_id in [r for r in self._indexes if r not in keep]:
            del self._indexes[request_id]
