"""The size of an answer, bounded before it is built.

A 1 MB request can ask for an answer hundreds of times its size: 110 prompts x `prompt_logprobs` 20 with
`echo` on /v1/completions built a 413 MB JSON body, raised the server's memory by 3.0 GB and held the
event loop for seconds. Everything that multiplies an answer's size is known once the prompts are
tokenized, before anything runs: the prompts' token counts, sequences per prompt (n, or best_of: every
sample is collected with its logprobs before ranking), prompt_logprobs, echo, logprobs / top_logprobs and
the tokens each sequence may generate (max_tokens; a chat that sets none may fill the context). So the
answer's JSON size is estimated from them, and a request whose estimate is over MAX_ANSWER_BYTES is a 400
naming the field of its largest product, the product, and what to lower.

The estimate is an upper bound: every sequence generates its max_tokens, every top list is full, and the
bytes per entry are the high end of what was measured (`ENTRY_BYTES`). Answers under the bound are built
on the response pool, a choice at a time (api/server/answer_json.py), so the event loop keeps answering.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphcache.api.openai.choices import Prompt
from graphcache.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from graphcache.api.openai.sampling import ChoicePlan
from graphcache.api.server.errors import APIError
from graphcache.engine.sequence import SamplingParams

__all__ = ["ENTRY_BYTES", "MAX_ANSWER_BYTES", "Product", "check_answer_size", "estimate"]

# The bound on an answer's estimated JSON. Building it costs more than its size: the logprobs the engine
# hands over are Python objects of ~120 B per entry, and a dict tree built whole for json.dumps another
# ~340 B per entry (a prompt_logprobs entry is ~80 B of JSON: 7x, as the finding's 413 MB -> 3.0 GB).
# Built a choice at a time (answer_json.py), an answer at the bound costs about 3x it at its peak (the
# held logprobs, the JSON pieces, their join): ~400 MB. 128 MiB still serves what clients ask of logprobs:
# lm-eval's loglikelihood batches (128 prompts of 4,096 tokens, echo, logprobs 1: ~60 MiB), one prompt of
# 64k tokens with prompt_logprobs 20 (~115 MiB), a chat with top_logprobs 20 and no max_tokens on a 32k
# context (~70 MiB); a 128k context with top_logprobs 20 needs max_completion_tokens (the 400 says how many).
MAX_ANSWER_BYTES = 128 << 20

# JSON bytes per entry, measured with the shapes of api/openai/choices.py (logprobs at full float precision; token
# texts of 0-6 characters, and `token_id:<id>` with return_tokens_as_token_ids): the high end of each.
ENTRY_BYTES = {
    "prompt_logprobs": 92,  # vLLM's {"<id>": {"logprob", "rank", "decoded_token"}}: 76-92 B per entry
    "completion_logprobs": 40,  # completions: a top_logprobs "<text>": <logprob>, and each token's text,
    # logprob and text_offset spread over its k + 2 entries: 29-39 B per entry
    "chat_logprobs": 135,  # chat: {"token", "logprob", "bytes": [...]} per token and per top entry: 73-135 B
    "token": 8,  # a token's share of the text, or its id in token_ids / prompt_token_ids
}


@dataclass(frozen=True)
class Product:
    """One product of request fields that grows the answer: its bytes, the field the 400 names, what it
    multiplies (for the message) and what lowering it would take."""

    nbytes: int
    param: str
    what: str
    lower: str


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"


def estimate(
    body: CompletionRequest | ChatCompletionRequest,
    plan: ChoicePlan,
    params: SamplingParams,
    prompts: list[Prompt],
    max_model_len: int | None,
) -> list[Product]:
    """The answer's products, largest first. `params`: the SamplingParams the choices share (their
    logprobs, prompt_logprobs and max_tokens with the model's defaults applied)."""
    chat = isinstance(body, ChatCompletionRequest)
    seqs = plan.samples  # sequences per prompt: each one's logprobs are collected
    many = "best_of" if plan.samples > plan.n else "n"
    per_prompt = f"{many} {seqs}"  # every product below is per sequence, summed over the prompts
    prompt_tokens = sum(len(p.ids) for p in prompts)
    of_prompts = f"{len(prompts)} prompt{'s' if len(prompts) > 1 else ''}"
    max_tokens_param = body.max_tokens_param if isinstance(body, ChatCompletionRequest) else "max_tokens"

    def generated(p: Prompt) -> int:
        if plan.prompt_only:
            return 0
        room = None if max_model_len is None else max(max_model_len - len(p.ids), 0)
        if params.max_tokens is None:
            return room or 0
        return params.max_tokens if room is None else min(params.max_tokens, room)

    gen_tokens = sum(generated(p) for p in prompts)
    gen_what = f"{gen_tokens:,} tokens to generate ({of_prompts}, " + (
        f"{max_tokens_param} {params.max_tokens})"
        if params.max_tokens is not None
        else f"{max_tokens_param} unset: the rest of the context)"
    )
    prompt_what = f"{prompt_tokens:,} prompt tokens ({of_prompts})"
    out: list[Product] = []
    kp = params.prompt_logprobs
    if body.prompt_logprobs is not None:
        assert kp is not None  # params carry the body's prompt_logprobs (api/sampling.base_params)
        entries = seqs * prompt_tokens * (kp + 1)
        out.append(
            Product(
                entries * ENTRY_BYTES["prompt_logprobs"],
                "prompt_logprobs",
                f"{per_prompt} x {prompt_what} x (prompt_logprobs {kp} + 1) entries",
                "prompt_logprobs, the prompts' length or their number",
            )
        )
    k = body.engine_logprobs
    if not chat and body.echo and k is not None:  # the prompt's logprobs lead each choice's logprobs
        assert kp is not None  # echo + logprobs ask for the prompt's logprobs (api/sampling.base_params)
        entries = seqs * prompt_tokens * (kp + 2)
        out.append(
            Product(
                entries * ENTRY_BYTES["completion_logprobs"],
                "logprobs",
                f"echo: {per_prompt} x {prompt_what} x (logprobs {kp} + 2) entries",
                "logprobs, the prompts' length or their number, or turn echo off",
            )
        )
    held = params.logprobs
    if held is None and plan.ranks:  # best_of ranks by logprobs the engine returns even when none were asked
        held = 0
    if held is not None and gen_tokens:
        key, per_token = ("chat_logprobs", held + 1) if chat else ("completion_logprobs", held + 2)
        name = "top_logprobs" if chat else "logprobs"
        out.append(
            Product(
                seqs * gen_tokens * per_token * ENTRY_BYTES[key],
                name if k is not None else many,
                f"{per_prompt} x {gen_what} x ({name} {held} + {per_token - held}) entries",
                f"{name}, {many} or {max_tokens_param}"
                if params.max_tokens is not None
                else f"{name} or {many}, or set {'max_completion_tokens' if chat else max_tokens_param}",
            )
        )
    echo_chars = sum(len(p.echo_text.encode("utf-8")) for p in prompts) if body.echo else 0
    ids = (prompt_tokens + gen_tokens) if body.return_token_ids else 0
    text = seqs * (echo_chars + (gen_tokens + ids) * ENTRY_BYTES["token"])
    if text:
        param = "echo" if echo_chars > gen_tokens * ENTRY_BYTES["token"] else max_tokens_param
        out.append(
            Product(
                text,
                param,
                f"{per_prompt} x (echoed text of {echo_chars:,} B + {gen_what}"
                + (" + token ids" if ids else "")
                + ")",
                f"{param}, {many} or the prompts",
            )
        )
    return sorted(out, key=lambda p: -p.nbytes)


def check_answer_size(
    body: CompletionRequest | ChatCompletionRequest,
    plan: ChoicePlan,
    params: SamplingParams,
    prompts: list[Prompt],
    max_model_len: int | None,
    bound: int | None = None,
) -> None:
    """A 400 naming the field of the largest product when the answer would be over `bound` bytes
    (MAX_ANSWER_BYTES); O(prompts), on the event loop before anything is submitted."""
    bound = MAX_ANSWER_BYTES if bound is None else bound
    products = estimate(body, plan, params, prompts, max_model_len)
    total = sum(p.nbytes for p in products)
    if total <= bound:
        return
    top = products[0]
    rest = f" (and {_mib(total - top.nbytes)} more)" if len(products) > 1 else ""
    raise APIError(
        400,
        f"this request's answer would be up to {_mib(total)} of JSON, over the server's bound of "
        f"{_mib(bound)}: {top.what} = {_mib(top.nbytes)}{rest}. Lower {top.lower}, or split the "
        "request.",
        param=top.param,
        code="answer_too_large",
    )
