"""The n-gram proposer's host cost per request (engine/spec/ngram.py), at a decode batch of --requests.

Each request has a context of C tokens (a 32k vocabulary, a quarter of it copied from earlier spans),
then decodes --steps tokens: each step appends one token to every request and proposes for the whole
batch. The output copies its context (an editor resending code): the next token of an earlier span, and
one time in ten a random token and a jump elsewhere, so most steps find a match and take the hit path
(the check against the tokens, the continuation). Times are the process's CPU time (time.process_time),
so other work on a shared host inflates them less than wall time. Columns, in microseconds per request:
  build     the first propose: the request's index built from its whole context (once per request)
  step      a decode step's propose (sync one token + lookup), median over the steps, per lookup range
  rescan    the same rule by a stateless vectorised numpy search of the whole context each step (what
            the index avoids: O(C) per step, as vLLM's KMP pass is), for comparison
and hits: the share of steps that proposed a draft (the default range).

    python benchmarks/ngram_propose.py [--requests 256] [--contexts 512,2048,8192,32768] [--k 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from graphcache.engine.spec.ngram import NgramProposer  # noqa: E402

VOCAB = 32_000


class Request:
    """The proposer's view of a request (DraftRequest)."""

    def __init__(self, request_id: str, prompt: list[int]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.output_token_ids: list[int] = []


def context(rng: np.random.Generator, n: int) -> list[int]:
    """n tokens: random 64-token spans, one in four a copy of an earlier span."""
    out: list[int] = []
    while len(out) < n:
        if len(out) >= 256 and rng.random() < 0.25:
            a = int(rng.integers(0, len(out) - 64))
            out += out[a : a + 64]
        else:
            out += rng.integers(0, VOCAB, 64).tolist()
    return out[:n]


def rescan(tokens: np.ndarray, low: int, high: int, k: int) -> list[int]:
    """The proposer's rule, stateless: candidates ending where the last token recurs, filtered backwards."""
    L = tokens.size
    ends = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])  # [c]: earlier ends of a 1-gram match
    best = None
    for n in range(1, high + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[L - n]]
        if ends.size == 0:
            break
        if n >= low:
            best = int(ends[0])  # the first occurrence of the longest match so far
    return [] if best is None else tokens[best + 1 : min(best + 1 + k, L)].tolist()


def measure(requests: int, ctx: int, k: int, steps: int, lookups: list[tuple[int, int]], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [context(rng, ctx) for _ in range(requests)]
    row: dict = {"context": ctx}
    for low, high in lookups:
        reqs = [Request(f"r{i}", list(p)) for i, p in enumerate(prompts)]
        proposer = NgramProposer(k, low, high)
        t0 = time.process_time()
        proposer.propose(reqs)
        build = (time.process_time() - t0) / requests * 1e6
        times, hits = [], 0
        draw = np.random.default_rng(seed + 1)
        cursors = draw.integers(0, ctx - 1, requests)  # [requests]: where each output copies from
        for _ in range(steps):
            for i, req in enumerate(reqs):
                if draw.random() < 0.1:
                    req.output_token_ids.append(int(draw.integers(0, VOCAB)))
                    cursors[i] = draw.integers(0, ctx - 1)
                else:
                    req.output_token_ids.append(req.prompt_token_ids[cursors[i]])
                    cursors[i] = (cursors[i] + 1) % ctx
            t0 = time.process_time()
            drafts = proposer.propose(reqs)
            times.append((time.process_time() - t0) / requests * 1e6)
            hits += sum(1 for d in drafts if d)
        row[f"build {low}..{high}"] = build
        row[f"step {low}..{high}"] = statistics.median(times)
        if (low, high) == lookups[0]:
            row["hits"] = hits / (steps * requests)
            arrays = [np.array(r.prompt_token_ids + r.output_token_ids) for r in reqs]
            t0 = time.process_time()
            for tokens in arrays:
                rescan(tokens, low, high, k)
            row["rescan"] = (time.process_time() - t0) / requests * 1e6
            # the same rule, so the same drafts (a check, outside the timings)
            assert [rescan(tokens, low, high, k) for tokens in arrays] == drafts
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--contexts", default="512,2048,8192,32768")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lookups", default="5:5,2:5", help="min:max ranges (the first: vLLM's default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    lookups = [tuple(int(x) for x in r.split(":")) for r in args.lookups.split(",")]
    rows = [
        measure(args.requests, int(c), args.k, args.steps, lookups, args.seed)  # type: ignore[arg-type]
        for c in args.contexts.split(",")
    ]
    columns = [c for c in rows[0] if c != "hits"] + ["hits"]
    print(
        f"n-gram proposer, {args.requests} requests, k={args.k}: CPU us per request "
        f"(step: median of {args.steps} steps)"
    )
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{row[c]:.0f}" if c == "context" else f"{row[c]:.2f}" for c in columns]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
