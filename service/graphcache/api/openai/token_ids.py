"""Token-id lists from the body, checked once per request, off the event loop.

A request's token-id controls (allowed_token_ids, logit_bias keys) and prompts sent as ids are
checked here, once, before the request fans out into one engine request per choice (n, best_of):
the engine checks every one of those again, so what reaches it must already be small.

  * allowed_token_ids is a set: it is deduplicated (sorted), so after the range check it never
    holds more ids than the vocabulary, whatever the body repeated.
  * a prompt of ids is first held against max_model_len (a length, no per-id work), then its ids
    against the vocabulary: an id outside it is a 400 naming the prompt, never a tokenizer failure
    on decoding it for `echo` (Python ints are unbounded: 2**64 does not fit the tokenizer's C type).
  * logit_bias keys are bounded in number (protocol.py) and range-checked here.

What passes comes back as the engine's TokenIds (engine/sequence.py): immutable, so every choice
shares the one checked copy, and the engine's per-choice check trusts it instead of walking it again.

The functions are plain and synchronous; openai.py runs them on the input pool (api/server/executors.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from graphcache.api.server.errors import APIError
from graphcache.engine.errors import InvalidRequest
from graphcache.engine.sequence import TokenIds

__all__ = ["check_bias_ids", "check_prompt_ids", "shared_prompt_ids", "unique_token_ids", "vocab_size"]

MAX_ID_CHARS = 32  # a logit_bias key named in an error is cut here (keys may have any length)


def vocab_size(engine) -> int | None:
    """The model's logits width (what the engine checks ids against), or None when not known."""
    checker = getattr(engine, "checker", None)
    limits = getattr(checker, "limits", None)
    return getattr(limits, "vocab_size", None)


def _range_error(param: str, vocab: int) -> APIError:
    # The offending value is not echoed: it may be any size.
    return APIError(
        400, f"{param} must hold token ids of this model's vocabulary, 0 to {vocab - 1}.", param=param
    )


def _in_range(ids: Sequence[int], vocab: int) -> bool:
    return not ids or (min(ids) >= 0 and max(ids) < vocab)


def unique_token_ids(ids: Sequence[int], vocab: int | None, param: str = "allowed_token_ids") -> TokenIds:
    """`ids` sorted without repeats, each in [0, vocab); at most `vocab` ids by then."""
    unique = sorted(set(ids))
    if vocab is not None and not _in_range(unique, vocab):
        raise _range_error(param, vocab)
    try:
        return TokenIds(unique, vocab, param)
    except InvalidRequest as e:  # a negative id with no vocabulary known (protocol.py refuses those first)
        raise APIError(400, e.message, param=param) from None


def shared_prompt_ids(ids: Sequence[int], vocab: int | None) -> TokenIds | list[int]:
    """A prompt's ids as one TokenIds that all its choices share (checked once here, not once per choice
    by the engine); as a plain list when an id is outside the vocabulary, for the engine to refuse with
    its own message (a tokenizer whose ids outrun the model's logits)."""
    try:
        return TokenIds(ids, vocab, "prompt")
    except InvalidRequest:
        return list(ids)


def check_prompt_ids(
    ids: Sequence[int], vocab: int | None, max_model_len: int | None, param: str = "prompt"
) -> list[int]:
    """A prompt of token ids as a list, refused when it cannot fit the context window or holds an id
    outside the vocabulary."""
    if max_model_len is not None and len(ids) >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{len(ids)} tokens; shorten the prompt.",
            param=param,
            code="context_length_exceeded",
        )
    out = list(ids)
    if vocab is not None and not _in_range(out, vocab):
        raise _range_error(param, vocab)
    return out


def check_bias_ids(bias: dict[int, float] | None, vocab: int | None) -> None:
    """logit_bias keys (token ids, parsed by protocol.py) inside the vocabulary; the keys outside it are
    named, with the vocabulary's size (as vLLM's 400 names them), each cut to MAX_ID_CHARS digits."""
    if not bias or vocab is None:
        return
    outside = sorted(k for k in bias if not 0 <= k < vocab)
    if outside:
        shown = [
            str(k) if len(str(k)) <= MAX_ID_CHARS else str(k)[:MAX_ID_CHARS] + "..." for k in outside[:5]
        ]
        more = f" and {len(outside) - 5} more" if len(outside) > 5 else ""
        raise APIError(
            400,
            f"logit_bias key{'s' if len(outside) > 1 else ''} {', '.join(shown)}{more} "
            f"{'is not a token id' if len(outside) == 1 else 'are not token ids'} of this model's vocabulary "
            f"(vocabulary size {vocab}: ids 0 to {vocab - 1}).",
            param="logit_bias",
        )
