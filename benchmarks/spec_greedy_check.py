"""Greedy equality of speculative decoding, measured (benchmarks/spec_decode.py --greedy-check N).

N greedy requests run without speculation and with each proposer (n-gram; the draft model where one is
given), in waves of --greedy-streams requests at once, through the engine's step loop at the dtype given.
Per proposer: the share of requests whose tokens equal the unspeculated run's, where the others first
differ (position in the output: the distribution), and at each first divergence the target's top-2 margin:
the context both runs agree on (prompt + common output prefix) run once more without speculation, one
token with the top-2 logprobs; their difference is the logit margin there (a logprob difference is a logit
difference: one normalizer). A divergence on a margin near the dtype's rounding (bf16: about 2^-8 of the
logits' size) is a near tie that the verify step's other GEMM shapes flipped, not a wrong token; in
float32 no divergence is expected (docs/API.md, "Speculative decoding", what is guaranteed).
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from functools import partial

import torch
from graphcache.engine.loop.core import EngineCore
from graphcache.engine.sequence import SamplingParams, Sequence

__all__ = [
    "first_divergence",
    "greedy_check",
    "greedy_table",
    "run_greedy",
    "summarize",
    "top2_without_speculation",
]

# First-divergence positions are reported in these buckets (output positions, upper bounds exclusive).
BUCKETS = (1, 4, 16, 64, 256)


def greedy_wave(
    core: EngineCore, prompts: list[list[int]], output_len: int, ids: list[str]
) -> list[Sequence]:
    """prompts[i] as request ids[i], all at once, greedy to output_len tokens (EOS ignored), stepped until
    the core is idle: the finished sequences."""
    wave = []
    for request_id, prompt in zip(ids, prompts, strict=True):
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        seq = Sequence(request_id, list(prompt), params, stream=False)
        core.check(seq)
        core.add_request(seq)
        wave.append(seq)
    while core.has_work():
        core.step()
    return wave


def run_greedy(core: EngineCore, prompts: list[list[int]], output_len: int, streams: int, tag: str) -> list:
    """Each prompt's greedy output (output_len tokens, EOS ignored), `streams` requests at a time."""
    outputs: list[list[int]] = []
    for at in range(0, len(prompts), streams):
        chunk = prompts[at : at + streams]
        ids = [f"greedy-{tag}-{at + i}" for i in range(len(chunk))]
        outputs += [list(s.output_token_ids) for s in greedy_wave(core, chunk, output_len, ids)]
    return outputs


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first output position where a and b differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2(core: EngineCore, context: list[int], tag: str) -> list[tuple[int, float]]:
    """The target's two most likely next tokens after `context` with their logprobs (no speculation: a
    request with logprobs never speculates)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, ignore_eos=True)
    seq = Sequence(tag, list(context), params, stream=False)
    core.check(seq)
    core.add_request(seq)
    while core.has_work():
        core.step()
    return list(seq.output_logprobs[0].top[:2]) if seq.output_logprobs else []


def summarize(
    plain: list[list[int]],
    spec: list[list[int]],
    prompts: list[list[int]],
    margins: Callable[[list[int], str], list[tuple[int, float]]] | None,
) -> dict:
    """Equality share, first-divergence positions (and buckets), and each divergence's top-2 margin."""
    divergences = []
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        at = first_divergence(a, b)
        if at is None:
            continue
        d: dict = {"request": i, "position": at, "plain": a[at] if at < len(a) else None}
        d["spec"] = b[at] if at < len(b) else None
        if margins is not None:
            top = margins(prompts[i] + a[:at], f"margin-{i}")
            if len(top) == 2:
                d["top2"] = top
                d["margin"] = top[0][1] - top[1][1]
                d["flip_in_top2"] = {d["plain"], d["spec"]} == {top[0][0], top[1][0]}
        divergences.append(d)
    positions = sorted(d["position"] for d in divergences)
    margin_values = sorted(d["margin"] for d in divergences if "margin" in d)
    buckets: dict[str, int] = {}
    lo = 0
    for hi in (*BUCKETS, None):
        label = f"[{lo},{hi})" if hi is not None else f"[{lo},inf)"
        buckets[label] = sum(1 for p in positions if p >= lo and (hi is None or p < hi))
        lo = hi or lo
    return {
        "requests": len(plain),
        "identical": len(plain) - len(divergences),
        "identical_share": (len(plain) - len(divergences)) / len(plain) if plain else 1.0,
        "first_divergence": {
            "positions": positions,
            "buckets": buckets,
            "median": statistics.median(positions) if positions else None,
        },
        "margin": {
            "median": statistics.median(margin_values) if margin_values else None,
            "max": margin_values[-1] if margin_values else None,
            "flips_in_top2": sum(1 for d in divergences if d.get("flip_in_top2")),
        },
        "divergences": divergences,
    }


def greedy_check(
    load: Callable[[str | None], EngineCore],
    configs: dict[str, str],
    prompts: list[list[int]],
    output_len: int,
    streams: int,
    margins: bool = True,
) -> dict:
    """configs: proposer name -> --speculative-config; load(config) -> a warmed core. The first config's
    core runs the prompts without speculation too (the reference; the same weights, dtype and steps as
    any server without --speculative-config); each config's core runs them with its speculation, and its
    divergences' margins are read on that core with speculation off (one load per config)."""
    out: dict = {"requests": len(prompts), "output_len": output_len, "streams": streams, "proposers": {}}
    plain: list[list[int]] | None = None
    for name, spec in configs.items():
        core = load(spec)
        try:
            sched = core.scheduler
            saved = sched.spec, sched.proposer, sched.acceptance
            if plain is None:  # the reference: this core with its speculation off
                sched.spec = sched.proposer = sched.acceptance = None
                plain = run_greedy(core, prompts, output_len, streams, "plain")
                sched.spec, sched.proposer, sched.acceptance = saved
            counts0 = core.spec_metrics.snapshot() if core.spec_metrics is not None else None
            spec_out = run_greedy(core, prompts, output_len, streams, name)
            row = summarize(
                plain, spec_out, prompts, partial(top2_without_speculation, core) if margins else None
            )
            if counts0 is not None and core.spec_metrics is not None:
                c = core.spec_metrics.snapshot()
                draft_tokens = c["draft_tokens"] - counts0["draft_tokens"]
                row["acceptance_rate"] = (
                    (c["accepted"] - counts0["accepted"]) / draft_tokens if draft_tokens else 0.0
                )
                row["draft_tokens"] = draft_tokens
            out["proposers"][name] = row
        finally:
            core.runner.close()
            del core  # the next config's core sizes its KV cache from the memory this one frees
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return out


def top2_without_speculation(core: EngineCore, context: list[int], tag: str) -> list[tuple[int, float]]:
    """top2() on a core whose speculation is turned off meanwhile (and back on after)."""
    sched = core.scheduler
    saved = sched.spec, sched.proposer, sched.acceptance
    sched.spec = sched.proposer = sched.acceptance = None
    try:
        return top2(core, context, tag)
    finally:
        sched.spec, sched.proposer, sched.acceptance = saved


def greedy_table(result: dict, dtype: str) -> str:
    """The check as a markdown table, one row per proposer."""
    head = (
        f"greedy equality, {result['requests']} requests x {result['output_len']} tokens, "
        f"{result['streams']} at a time, dtype {dtype}\n"
        "| proposer | identical | acceptance | first divergence: median, buckets | top-2 margin: median, max | "
        "flips between the top 2 |\n" + "|---" * 6 + "|"
    )
    lines = [head]
    for name, r in result["proposers"].items():
        fd, m = r["first_divergence"], r["margin"]
        buckets = " ".join(f"{k}:{v}" for k, v in fd["buckets"].items() if v)
        med = "" if fd["median"] is None else f"{fd['median']:.0f}"
        margin = "" if m["median"] is None else f"{m['median']:.4f}, {m['max']:.4f}"
        diverged = r["requests"] - r["identical"]
        lines.append(
            f"| {name} | {r['identical']}/{r['requests']} ({r['identical_share']:.1%}) | "
            f"{r.get('acceptance_rate', 0.0):.1%} | {med} {buckets} | {margin} | {m['flips_in_top2']}/{diverged} |"
        )
    return "\n".join(lines)
