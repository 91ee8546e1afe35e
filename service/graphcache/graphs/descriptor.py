"""Batch descriptors: the minimal description of a padded batch, the key of a captured graph.

A capture fixes every tensor shape, so a step can replay a capture only if its batch is
padded up to exactly the shapes captured. Two numbers fix those shapes: tokens in the
step (the width of every activation) and requests (rows of logits). `uniform_decode`
separates pure-decode batches (one token per request: T == R) from mixed prefill/decode
ones, because attention metadata is laid out differently for the two. `verify` marks a speculative
decoding verify step ("T:R:verify"): a mixed layout whose logits rows are every fed token (T <= R), so
the target scores each draft; it is captured, counted and profiled as a descriptor of its own.
`lora` marks the LoRA variant of a shape (":lora" last, e.g. "8:8:decode:lora"): on an --enable-lora
engine a step with at least one adapter token replays the variant whose graph records the LoRA kernels,
and a step with none the plain one, captured with the LoRA layers skipped, so it runs exactly the kernels
of an engine without LoRA. Recorded LoRA kernels cost even when every token is a base row (two small
launches per projection that exit early: ~0.6 ms a step at 8B), which is why the variants are two
descriptors (vLLM's has_lora in its BatchDescriptor, cudagraph_specialize_lora); which adapters the
rows use stays a graph input, so one LoRA graph serves any mix.

Mixed steps past the fine sizes (prefill chunks next to a full decode batch: ~1,000-8,000 tokens)
pad to a few coarse buckets (`mixed_buckets`): every size costs a capture and pool memory, and every
padded token costs the GEMMs of a real one, so the ladder bounds the padding a step pays instead of
fitting each step closely.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, replace

__all__ = ["BatchDescriptor", "CaptureSizes", "descriptor_for", "mixed_buckets"]


@dataclass(frozen=True, order=True)
class BatchDescriptor:
    num_tokens: int  # padded token count (graph shape)
    num_reqs: int  # padded request count = rows of logits
    uniform_decode: bool = False  # every request feeds exactly one token
    verify: bool = False  # a speculative verify step: logits rows = every fed token (mixed layout)
    lora: bool = False  # the LoRA variant: some token of the step has an adapter (LoRA kernels recorded)

    def __post_init__(self) -> None:
        if self.num_tokens < 1 or self.num_reqs < 1:
            raise ValueError(f"descriptor needs positive sizes, got {self.num_tokens}:{self.num_reqs}")
        if self.num_reqs > self.num_tokens:
            raise ValueError(
                f"descriptor {self.num_tokens}:{self.num_reqs} has more requests than tokens; "
                "every request feeds at least one token"
            )
        if self.uniform_decode and self.num_reqs != self.num_tokens:
            raise ValueError(
                f"a decode descriptor feeds one token per request: tokens ({self.num_tokens}) "
                f"must equal requests ({self.num_reqs})"
            )
        if self.verify and self.uniform_decode:
            raise ValueError(f"descriptor {self.num_tokens}:{self.num_reqs} cannot be both decode and verify")

    def __str__(self) -> str:
        base = f"{self.num_tokens}:{self.num_reqs}"
        kind = ":decode" if self.uniform_decode else ":verify" if self.verify else ""
        return base + kind + (":lora" if self.lora else "")

    def with_lora(self, lora: bool = True) -> BatchDescriptor:
        """The same shape, LoRA variant or not."""
        return self if self.lora == lora else replace(self, lora=lora)

    @classmethod
    def parse(cls, text: str) -> BatchDescriptor:
        """Inverse of str(): "T:R" (mixed), "T:R:decode" or "T:R:verify", each optionally + ":lora"."""
        parts = text.strip().split(":")
        lora = len(parts) > 2 and parts[-1] == "lora"
        if lora:
            parts = parts[:-1]
        try:
            if len(parts) == 2:
                return cls(int(parts[0]), int(parts[1]), False, False, lora)
            if len(parts) == 3 and parts[2] == "decode":
                return cls(int(parts[0]), int(parts[1]), True, False, lora)
            if len(parts) == 3 and parts[2] == "verify":
                return cls(int(parts[0]), int(parts[1]), False, True, lora)
        except ValueError as e:
            raise ValueError(f"bad batch descriptor {text!r}: {e}") from None
        raise ValueError(
            f'bad batch descriptor {text!r}: write "TOKENS:REQS", "TOKENS:REQS:decode" or '
            '"TOKENS:REQS:verify", each optionally followed by ":lora", e.g. "64:8" or "8:8:decode:lora"'
        )


class CaptureSizes:
    """The sorted sizes a batch may be padded to; larger batches run eagerly."""

    def __init__(self, sizes: Iterable[int]) -> None:
        self.sizes: tuple[int, ...] = tuple(sorted(set(sizes)))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(
                f"capture sizes must be a non-empty list of positive integers, got {list(sizes)}"
            )

    @property
    def max(self) -> int:
        return self.sizes[-1]

    def pad(self, n: int) -> int | None:
        """The smallest capture size >= n, or None when n exceeds the largest one."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def __iter__(self):
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def __repr__(self) -> str:
        return f"CaptureSizes({list(self.sizes)})"


def mixed_buckets(above: int, up_to: int) -> list[int]:
    """The coarse mixed sizes in (above, up_to]: 2^k and 3 * 2^(k-1) (384, 512, 768, 1024, 1536, ...),
    then up_to itself when the ladder does not end on it, so every step up to up_to has a bucket.
    Neighbours differ by x1.5 or x1.33: a step pads by at most half its tokens (just past a bucket),
    about a fifth on average, with two buckets per doubling (10 from 256 to 8192)."""
    ladder: set[int] = set()
    power = 1
    while power <= up_to:
        ladder.update((power, power * 3 // 2) if power >= 2 else (power,))
        power *= 2
    sizes = sorted(s for s in ladder if above < s <= up_to)
    if up_to > above and (not sizes or sizes[-1] != up_to):
        sizes.append(up_to)
    return sizes


def descriptor_for(
    num_tokens: int,
    num_reqs: int,
    uniform_decode: bool,
    sizes: CaptureSizes,
    max_reqs: int | None = None,
    mixed_sizes: CaptureSizes | None = None,
) -> BatchDescriptor | None:
    """The padded descriptor a batch replays under, or None when it is too big (run it eagerly).

    sizes: what decode batches pad to; mixed_sizes: what mixed batches pad to (default: sizes;
    the runner passes sizes plus the coarse buckets above them).
    decode: T = R = pad(num_reqs). mixed: T = pad(num_tokens) and R = T (at most max_reqs, the
    logits buffer's rows): one mixed capture per token size, not one per (tokens, requests) cell.
    Requests only set the logits rows; the padded rows cost the LM head next to nothing, since at
    T <= the largest capture size its GEMM is bound by reading the head's weights, not by rows.
    R >= pad(num_reqs) holds: num_reqs <= num_tokens and num_reqs <= max_reqs, and pad is monotonic.
    """
    if num_reqs < 1 or num_tokens < num_reqs:
        raise ValueError(f"batch of {num_tokens} tokens and {num_reqs} requests is impossible")
    if uniform_decode:
        if num_tokens != num_reqs:
            raise ValueError(
                f"a uniform-decode batch feeds one token per request, got {num_tokens} tokens "
                f"for {num_reqs} requests"
            )
        padded = sizes.pad(num_reqs)
        return None if padded is None else BatchDescriptor(padded, padded, True)
    padded_tokens = (sizes if mixed_sizes is None else mixed_sizes).pad(num_tokens)
    if padded_tokens is None:
        return None
    padded_reqs = padded_tokens if max_reqs is None else min(padded_tokens, max_reqs)
    if padded_reqs < num_reqs:
        raise ValueError(f"batch of {num_reqs} requests exceeds max_reqs {max_reqs}")
    return BatchDescriptor(padded_tokens, padded_reqs, False)
