"""Beam search as vLLM's API offers it (`use_beam_search`, `n` = beam width, `length_penalty`, `ignore_eos`).

vLLM runs beam search in its serving layer, over one-token generations with logprobs; so does this module,
on the engine's ordinary requests: each step submits one request per live beam (prompt + the beam's
tokens, max_tokens 1, the top 2 x width logprobs), every beam's candidates extend it by one token, and
the width best by cumulative logprob live on. A candidate ending in an end-of-sequence id is complete
(unless ignore_eos) and leaves the live set. After max_tokens steps (or once no beam lives) the
complete and live beams are ranked by cumulative logprob / length ** length_penalty, the length counting
the prompt and the beam without its final end-of-sequence id (vLLM's score), and the best `width`
returned, best first. The beams of one step share their prompt's and their common prefix's KV through
the prefix cache, so a step computes about one token per beam.

The candidates are the model's raw log probabilities, before any logits control: a request that would
need a control, a grammar, logprobs or streaming is refused by `check` with a 400 naming the field.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from fastapi import Request
from starlette.responses import Response

from graphcache.api.openai.choices import Prompt
from graphcache.api.openai.fanout import FanOut, Sampled, Sub, usage
from graphcache.api.server import answer_json
from graphcache.api.server.disconnect import ClientGone, unless_disconnected
from graphcache.api.server.executors import run_response
from graphcache.engine.errors import InvalidRequest
from graphcache.engine.sequence import SamplingParams

__all__ = ["Beam", "answer", "beam_score", "check", "search"]

# The largest beam width: each step runs this many requests of 2 x width logprobs each.
MAX_BEAM_WIDTH = 32


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)  # generated so far (an end-of-sequence id last if ended)
    cumulative_logprob: float = 0.0
    ended: bool = False  # its last token is an end-of-sequence id


def beam_score(beam: Beam, num_prompt_tokens: int, length_penalty: float) -> float:
    """vLLM's beam score: cumulative logprob over (prompt + beam, without a final end-of-sequence id) ** penalty."""
    length = num_prompt_tokens + len(beam.tokens) - (1 if beam.ended else 0)
    return beam.cumulative_logprob / max(length, 1) ** length_penalty


def check(body) -> None:
    """InvalidRequest naming the field beam search cannot be combined with (body: either generation body)."""
    if not body.use_beam_search:
        if body.length_penalty != 1.0:
            raise InvalidRequest(
                "length_penalty only weighs beam search: set use_beam_search", param="length_penalty"
            )
        return
    if body.n > MAX_BEAM_WIDTH:
        raise InvalidRequest(f"the beam width (n) is at most {MAX_BEAM_WIDTH}", param="n")
    conflicts = {
        "stream": body.stream,
        "best_of": body.best_of is not None and body.best_of != body.n,
        "logprobs": body.engine_logprobs is not None,
        "prompt_logprobs": body.prompt_logprobs is not None,
        "echo": getattr(body, "echo", False),
        "logit_bias": bool(body.logit_bias),
        "allowed_token_ids": body.allowed_token_ids is not None,
        "bad_words": bool(body.bad_words),
        "min_tokens": body.min_tokens > 0,
        "stop": bool(body.stop),
        "stop_token_ids": bool(body.stop_token_ids),
        "tools": bool(getattr(body, "tools_active", False)),
    }
    for param, conflict in conflicts.items():
        if conflict:
            raise InvalidRequest(
                f"{param} cannot be combined with use_beam_search (beams are ranked by the model's raw "
                "log probabilities, one token at a time, and answered whole); leave one of them out",
                param=param,
            )
    if body.structured_constraints():
        raise InvalidRequest(
            "an output constraint cannot be combined with use_beam_search; leave one of them out",
            param="use_beam_search",
        )


async def search(
    engine,
    prompt_ids: list[int],
    width: int,
    max_tokens: int,
    length_penalty: float,
    ignore_eos: bool,
    max_tokens_param: str = "max_tokens",
    priority: int = 0,
) -> list[Beam]:
    """The `width` best beams after `prompt_ids`, best first (each at most max_tokens tokens); every step's
    requests carry the request's scheduling `priority`."""
    eos = frozenset(() if ignore_eos else engine.tokenizer.eos_token_ids)
    step = SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2 * width, priority=priority
    )
    live, ended = [Beam()], []
    for _ in range(max_tokens):
        base = f"beam-{uuid.uuid4().hex}"
        subs = [Sub(f"{base}-{i}", 0, [*prompt_ids, *b.tokens], step) for i, b in enumerate(live)]
        fan = FanOut(engine, subs, stream=False, max_tokens_param=max_tokens_param)
        try:
            outs = await fan.collect(await fan.start())
        finally:
            fan.abort()
        candidates = [
            Beam([*b.tokens, token], b.cumulative_logprob + logprob, token in eos)
            for b, out in zip(live, outs, strict=True)
            for token, logprob in _top(out, 2 * width)
        ]
        candidates.sort(key=lambda c: -c.cumulative_logprob)
        ended += [c for c in candidates if c.ended]
        live = [c for c in candidates if not c.ended][:width]
        if not live:
            break
    ranked = sorted(ended + live, key=lambda b: -beam_score(b, len(prompt_ids), length_penalty))
    return ranked[:width]


def _top(out: Sampled, k: int) -> list[tuple[int, float]]:
    """The k most likely next tokens of a one-token request (its sampled token among them)."""
    entry = out.logprobs[0]
    top = dict(entry.top[:k])
    top.setdefault(entry.token_id, entry.logprob)
    return sorted(top.items(), key=lambda t: -t[1])[:k]


def _as_sampled(engine, beam: Beam, prompt_index: int, num_prompt_tokens: int, skip_special: bool) -> Sampled:
    """A beam as its choice's Sampled record (its text without a final end-of-sequence id)."""
    kept = beam.tokens[:-1] if beam.ended else beam.tokens
    return Sampled(
        prompt_index,
        parts=[engine.tokenizer.decode(kept, skip_special)],
        token_ids=list(beam.tokens),
        finish_reason="stop" if beam.ended else "length",
        prompt_tokens=num_prompt_tokens,
        completion_tokens=len(beam.tokens),
    )


async def answer(
    request: Request, engine, body, shape, prompts: list[Prompt], max_tokens: list[int]
) -> Response:
    """The whole answer of a beam-search request: `body.n` beams per prompt (prompt p's beam i is choice
    p * n + i, best first); max_tokens[p]: prompt p's token limit. A client that leaves ends the search."""

    async def beams_of_all() -> list[Sampled]:
        out: list[Sampled] = []
        for p, prompt in enumerate(prompts):
            beams = await search(
                engine,
                list(prompt.ids),
                body.n,
                max_tokens[p],
                float(body.length_penalty),
                body.ignore_eos,
                getattr(body, "max_tokens_param", "max_tokens"),
                body.priority,
            )
            out += [_as_sampled(engine, b, p, len(prompt.ids), body.skip_special_tokens) for b in beams]
        return out

    try:
        kept = await unless_disconnected(request.receive, beams_of_all())
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; keeps the access log honest
    return await run_response(answer_json.answer_response, shape, kept, usage(kept))
