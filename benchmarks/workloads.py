"""Benchmark workloads: what each request asks for (token-id prompt, output length, sampling).

nano      nano-vllm's benchmark: prompt and output lengths uniform in 100-1024, one temperature (and
          top_p, top_k) for all.
realistic ShareGPT-like traffic. Prompt lengths lognormal, median 220 tokens, sigma 0.9 (the middle
          half 120-400, a tail to the 2,048 cap, which 0.7% of draws reach); output lengths lognormal,
          median 200, sigma 0.75 (middle half 120-330, capped at 1,024, 1.5% of draws); both floored at 16.
          (Quantiles of the distributions, not measurements; describe() prints what a run drew.) Sampling
          temperature 0.8, top_p 0.95; every fourth request carries a seed (a seeded row takes the
          sampler's per-row generator path). Outputs run to their length (ignore_eos): a random-weight
          model's EOS is noise, and the lengths are the workload.
Prompt ids are drawn below 10000 (and below the vocab): a random-weight model never sees special
tokens, and every vocab has ids < 10000. Arrival times (open-loop serving) are Poisson: exponential
gaps at a rate in requests/s, or all at 0 for rate inf.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0  # 0 = off


@dataclass(frozen=True)
class RealisticShape:
    prompt_median: float = 220.0
    prompt_sigma: float = 0.9
    prompt_cap: int = 2048
    output_median: float = 200.0
    output_sigma: float = 0.75
    output_cap: int = 1024
    floor: int = 16
    temperature: float = 0.8
    top_p: float = 0.95
    seeded_every: int = 4


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    hi = min(vocab, 10000) - 1
    return [rng.randint(0, hi) for _ in range(length)]


def nano(
    n: int,
    vocab: int,
    in_range: tuple[int, int],
    out_range: tuple[int, int],
    seed: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seeded_every: int = 0,
    top_k: int = 0,
) -> list[Request]:
    """The same prompts and lengths as offline_throughput.workload (same draws, same order). seeded_every k
    > 0: every k-th request carries a seed (the sampler's per-row generator path), as in realistic.
    top_k > 0: every request's top_k (0: off)."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, rng.randint(*in_range), vocab) for _ in range(n)]
    lengths = [rng.randint(*out_range) for _ in prompts]
    return [
        Request(
            p,
            m,
            temperature,
            top_p,
            seed * 100_003 + i if seeded_every and i % seeded_every == 0 else None,
            top_k,
        )
        for i, (p, m) in enumerate(zip(prompts, lengths, strict=True))
    ]


def realistic(n: int, vocab: int, seed: int, shape: RealisticShape = RealisticShape()) -> list[Request]:
    rng = random.Random(seed)

    def length(median: float, sigma: float, cap: int) -> int:
        return max(shape.floor, min(cap, round(rng.lognormvariate(math.log(median), sigma))))

    out = []
    for i in range(n):
        prompt = random_prompt(rng, length(shape.prompt_median, shape.prompt_sigma, shape.prompt_cap), vocab)
        max_tokens = length(shape.output_median, shape.output_sigma, shape.output_cap)
        seed_i = seed * 100_003 + i if i % shape.seeded_every == 0 else None
        out.append(Request(prompt, max_tokens, shape.temperature, shape.top_p, seed_i))
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds from the start: n exponential gaps at `rate` requests/s (all 0 for inf)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def describe(requests: list[Request]) -> str:
    """Prompt / output length percentiles of a workload (what was sent, for the log)."""

    def pcts(xs: list[int]) -> str:
        xs = sorted(xs)
        return (
            "/".join(str(xs[min(len(xs) - 1, int(q * len(xs)))]) for q in (0.5, 0.9, 0.99)) + f" max {xs[-1]}"
        )

    seeded = sum(r.seed is not None for r in requests)
    return (
        f"{len(requests)} requests; prompt p50/p90/p99 {pcts([len(r.prompt) for r in requests])}; "
        f"output p50/p90/p99 {pcts([r.max_tokens for r in requests])}; {seeded} seeded"
    )
