"""From a validated request body to what the engine runs: prompt ids and one SamplingParams per choice.

Honoured fields land here (protocol.py declares them, openai.py wires the result):
  * the sampling controls map one to one onto SamplingParams (engine/sequence.py);
  * logit_bias keys are token ids as strings (protocol.py parsed them; the engine checks the range);
  * bad_words are tokenized as vLLM does: each word with and without a leading space (a word inside a
    sentence is usually its own "Ġword" token), each tokenization a sequence the output never completes;
  * truncate_prompt_tokens keeps the last k prompt ids (truncation_side "right": the first k);
  * n / best_of / seed: choice i of a prompt runs with seed + i (wrapped into int64, as vLLM's
    parallel sampling does), so seeded choices differ and each is reproducible;
  * best_of > n ranks choices by cumulative logprob: the engine is asked for logprobs (k=0) even if the
    client did not ask, and they are left out of the answer (`ChoicePlan.client_logprobs`);
  * the model's generation defaults (--generation-config: temperature, top_p, top_k, min_p, penalties,
    max_tokens) fill the fields a request leaves out or sends as null; a value it sends wins.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from graphcache.api.openai.protocol import INT64_MAX, INT64_MIN, ChatCompletionRequest, CompletionRequest
from graphcache.api.server.executors import run_input
from graphcache.engine.sequence import RequestOutput, SamplingParams, StructuredSpec, TokenIds

__all__ = [
    "ChoicePlan",
    "bad_words_token_ids",
    "base_params",
    "choice_params",
    "default_max_tokens",
    "defaults_taken",
    "plan",
    "truncate_prompt",
]


@dataclass(frozen=True)
class ChoicePlan:
    """How many sequences run per prompt and what the answer keeps of them."""

    n: int  # choices returned per prompt
    samples: int  # sequences generated per prompt (best_of, else n)
    client_logprobs: bool  # the client asked for logprobs (else they are only used for ranking)
    # echo with max_tokens 0: the answer is the prompt alone (and its logprobs). The engine runs one token
    # to compute the prompt's logprobs; echo_only() drops that token from every output.
    prompt_only: bool = False

    @property
    def ranks(self) -> bool:
        return self.samples > self.n


async def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token sequences: as written without a leading space, and after one."""
    out: list[list[int]] = []
    for word in words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = await run_input(tokenizer.encode, text, False)
            if ids and ids not in out:
                out.append(ids)
    return out


def truncate_prompt(ids: list[int], keep: int | None, side: str, max_model_len: int | None) -> list[int]:
    """The prompt ids truncate_prompt_tokens keeps (-1: max_model_len); unchanged when shorter."""
    if keep is None:
        return ids
    if keep == -1:
        if max_model_len is None:
            return ids
        keep = max_model_len
    if len(ids) <= keep:
        return ids
    return ids[-keep:] if side == "left" else ids[:keep]


def defaults_taken(
    body: CompletionRequest | ChatCompletionRequest, defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """The generation defaults (request field -> value, engine.generation_defaults) this request takes:
    those of the fields it left out or sent as null (null is dropped before validation, so neither is in
    model_fields_set). A chat request sets max_tokens with either of its two names."""
    given = set(body.model_fields_set)
    if "max_completion_tokens" in given:
        given.add("max_tokens")
    return {field: value for field, value in defaults.items() if field not in given}


def default_max_tokens(requested: int | None, default: int | None, room: int | None) -> int | None:
    """max_tokens where the request set none and the model's generation config has max_new_tokens: the
    smaller of it and the request's own default (completions: 16; chat, None: the rest of the context,
    `room` tokens), as vLLM takes it. room < 1 leaves the default alone: the engine's check then names
    the prompt that fills the context."""
    if default is None:
        return requested
    if requested is not None:
        return min(requested, default)
    if room is not None and room >= 1:
        return min(default, room)
    return default


def base_params(
    body: CompletionRequest | ChatCompletionRequest,
    bad_words: list[list[int]],
    structured: StructuredSpec | None,
    defaults: Mapping[str, Any] | None = None,
    room: int | None = None,
) -> SamplingParams:
    """The SamplingParams every choice shares (choice_params adds the per-choice part). `defaults`: the
    model's generation defaults, applied to the fields the request left out; `room`: tokens left in the
    context after the prompt (chat), which bounds a max_tokens taken from them."""
    logprobs = body.engine_logprobs
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and isinstance(body, CompletionRequest) and body.echo and logprobs is not None:
        prompt_logprobs = logprobs  # echo + logprobs: the prompt's logprobs come first (OpenAI's shape)
    taken = defaults_taken(body, defaults or {})

    def field(name: str) -> Any:
        return taken.get(name, getattr(body, name))

    max_tokens = default_max_tokens(body.max_new_tokens, taken.get("max_tokens"), room)
    return SamplingParams(
        max_tokens=1 if max_tokens == 0 else max_tokens,  # 0: see ChoicePlan.prompt_only
        temperature=field("temperature"),
        top_p=field("top_p"),
        top_k=max(field("top_k"), 0),
        seed=body.seed,
        stop=list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        presence_penalty=field("presence_penalty"),
        frequency_penalty=field("frequency_penalty"),
        repetition_penalty=field("repetition_penalty"),
        # The body's validator made the keys ids already; int() says so to the type checker.
        logit_bias={int(k): bias for k, bias in (body.logit_bias or {}).items()},
        min_tokens=body.min_tokens,
        min_p=field("min_p"),
        allowed_token_ids=list(body.allowed_token_ids) if body.allowed_token_ids is not None else None,
        bad_words_token_ids=bad_words,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=structured,
        priority=body.priority,
    )


def plan(body: CompletionRequest | ChatCompletionRequest) -> ChoicePlan:
    return ChoicePlan(
        n=body.n,
        samples=body.num_samples,
        client_logprobs=body.engine_logprobs is not None,
        prompt_only=body.max_new_tokens == 0,
    )


def echo_only(out: RequestOutput) -> RequestOutput:
    """`out` without its generated token (ChoicePlan.prompt_only): no text, ids or logprobs of its own, no
    completion tokens; it finishes as "length" (max_tokens 0 reached at once), as vLLM answers."""
    return dataclasses.replace(
        out,
        text="",
        token_ids=[],
        logprobs=[] if out.logprobs is not None else None,
        completion_tokens=0,
        finish_reason="length" if out.finished else None,
        stop_reason=None,
        stopped_on_token=False,
    )


def choice_params(base: SamplingParams, i: int, plan: ChoicePlan) -> SamplingParams:
    """Choice i's params: seed + i, and logprobs (k=0) when best_of ranks."""
    changes: dict = {}
    if base.seed is not None and i:
        changes["seed"] = (base.seed + i - INT64_MIN) % (INT64_MAX - INT64_MIN + 1) + INT64_MIN
    if plan.ranks and base.logprobs is None:
        changes["logprobs"] = 0
    # The lists are per choice: nothing the engine may touch is shared between two requests. A TokenIds
    # (checked once, immutable) is shared: copying it would make the engine check every copy again.
    allowed = base.allowed_token_ids
    changes.update(
        stop=list(base.stop),
        stop_token_ids=list(base.stop_token_ids),
        logit_bias=dict(base.logit_bias),
        bad_words_token_ids=[list(w) for w in base.bad_words_token_ids],
        allowed_token_ids=allowed if allowed is None or isinstance(allowed, TokenIds) else list(allowed),
    )
    return dataclasses.replace(base, **changes)
