"""Log probabilities in the shapes OpenAI's clients parse (and vLLM's prompt_logprobs).

The engine gives one `TokenLogprob(token_id, logprob, rank, top=[(id, logprob), ...])` per token
(engine/sequence.py); here they become:

  * completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry per token;
    with echo the prompt's tokens come first, the very first one with `None` (nothing predicts it);
    `top_logprobs[i]` maps token text -> logprob for the top k and the sampled token;
    `text_offset[i]` is where token i starts in the choice's text (the prompt's when echoed);
  * chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`;
  * vLLM's `prompt_logprobs`: per prompt token None (the first) or {"<id>": {"logprob", "rank",
    "decoded_token"}} for the token itself and the top k.

A token's text is its own decoding (special tokens included), or `token_id:<id>` with
return_tokens_as_token_ids (a token that is part of a multi-byte character decodes to U+FFFD alone).
"""

from __future__ import annotations

from graphcache.engine.sequence import TokenLogprob

__all__ = [
    "TokenText",
    "chat_logprobs",
    "completion_logprobs",
    "extend_completion_logprobs",
    "vllm_prompt_logprobs",
]


class TokenText:
    """Token id -> its text, decoded once per request."""

    def __init__(self, tokenizer, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.as_ids else self.tokenizer.decode([token_id], False)
            self._cache[token_id] = text
        return text


def completion_logprobs(
    text_of: TokenText, ids: list[int], entries: list[TokenLogprob | None] | None, offset: int = 0
) -> tuple[dict, int]:
    """OpenAI's completions logprobs for `ids` (entries aligned with them; None where unknown) with text
    offsets from `offset`; and the offset after the last token."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    entries = list(entries or [])
    for i, token_id in enumerate(ids):
        entry = entries[i] if i < len(entries) else None
        token = text_of(token_id)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry.logprob)
        top = {text_of(t): lp for t, lp in entry.top}
        top.setdefault(token, entry.logprob)
        out["top_logprobs"].append(top)
    return out, offset


def extend_completion_logprobs(into: dict, more: dict) -> dict:
    for key in into:
        into[key] += more[key]
    return into


def _chat_entry(text_of: TokenText, token_id: int, logprob: float) -> dict:
    token = text_of(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(
    text_of: TokenText, ids: list[int], entries: list[TokenLogprob] | None, top_k: int
) -> list[dict]:
    """The `content` list of a chat choice's logprobs: one entry per token with its top_k alternatives."""
    content = []
    for token_id, entry in zip(ids, entries or [], strict=False):
        item = _chat_entry(text_of, token_id, entry.logprob)
        item["top_logprobs"] = [_chat_entry(text_of, t, lp) for t, lp in entry.top[:top_k]]
        content.append(item)
    return content


def vllm_prompt_logprobs(
    text_of: TokenText, ids: list[int], entries: list[TokenLogprob | None] | None
) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: None for the first token, else {"<id>": {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    out: list[dict | None] = []
    for entry in entries[: len(ids)]:
        if entry is None:
            out.append(None)
            continue
        ranked = {
            str(entry.token_id): {
                "logprob": entry.logprob,
                "rank": entry.rank,
                "decoded_token": text_of(entry.token_id),
            }
        }
        for rank, (t, lp) in enumerate(entry.top, start=1):
            ranked.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": text_of(t)})
        out.append(ranked)
    return out
