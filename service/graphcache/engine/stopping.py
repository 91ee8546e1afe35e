"""The stop rules that end a sequence, and the text it may stream so far. Pure Python: the
scheduler's postprocess runs them after every step.

Stop rules (checked after each new token, in this order): stop token ids and EOS (unless
ignore_eos) -> "stop"; stop strings on the incrementally detokenized text -> "stop", with the stop
string and anything after it cut from the output (OpenAI semantics; the detokenizer does the cut
and holds back a tail that could still become a stop string; include_stop_str_in_output puts the
stop string back, so the text ends with it); max_tokens or max_model_len -> "length".

min_tokens (vLLM semantics): stop and EOS ids do not stop a sequence with fewer than min_tokens
outputs (the sampler also masks them until then), and stop strings are looked for only once it
has more than min_tokens outputs (a stop string must end in text of a later token).

Text comes from the tokenizer's IncrementalDetokenizer (model/detokenizer.py): add(ids) returns only
text that is safe to emit (no split UTF-8 character, no tail that may still grow into a stop
string), cuts a stop string and what follows, and sets `.stopped`; finish() flushes.
"""

from __future__ import annotations

from graphcache.engine.sequence import Sequence

GRAMMAR_BROKEN = "the sampled token broke the output's grammar; retry the request"


def grammar_accepts(seq: Sequence, token_id: int) -> bool:
    """Advance seq's grammar matcher (engine/sample/structured.py) past its new token. False: the token broke
    the grammar (the request ends with an error); True when accepted, or when seq has no grammar."""
    return seq.grammar is None or bool(seq.grammar.consume_token(token_id))


def grammar_done(seq: Sequence) -> bool:
    """seq's grammar is complete: nothing but EOS may follow, so the request stops now. A matcher in its
    error state is not complete (it is stopped too): grammar_accepts refuses its next token instead."""
    matcher = seq.grammar
    return matcher is not None and matcher.is_stopped() and not matcher.is_error()


def grammar_failure(seq: Sequence) -> str:
    """Why seq's grammar refused its token (engine/sample/grammar_matcher.py says), else the generic message."""
    return getattr(seq.grammar, "failure", None) or GRAMMAR_BROKEN


def grammar_failure_code(seq: Sequence) -> str | None:
    """CONSTRAINT_TOO_COMPLEX when seq's own constraint is why its grammar refused (a client error),
    None for a refused token (GRAMMAR_BROKEN: the server's)."""
    return getattr(seq.grammar, "failure_code", None)


def check_stop(
    seq: Sequence, token_id: int, *, eos_token_ids: set[int] | frozenset[int], max_model_len: int
) -> str | None:
    """Update `seq`'s text with its newest token (already appended) and return a finish reason or None."""
    params = seq.params
    num_out = len(seq.output_token_ids)  # runs for every sampled row every step: lengths read once
    may_stop = num_out >= params.min_tokens
    if may_stop and (
        token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids)
    ):
        seq.stopped_on_token = True
        # stop_reason names a client's stop token; EOS (checked first, as vLLM does) leaves it None.
        if params.ignore_eos or token_id not in eos_token_ids:
            seq.stop_reason = token_id
        return "stop"  # the stop token stays in token ids but adds no text (like OpenAI/vLLM)
    detok = seq.detokenizer
    if detok is not None and not seq.defer_text:
        if params.min_tokens and detok.stop:
            seq.output_text += detok.add([token_id], find_stop=num_out > params.min_tokens)
        else:
            seq.output_text += detok.add([token_id])
        if detok.stopped is not None:
            seq.stop_reason = detok.stopped
            if params.include_stop_str_in_output:
                seq.output_text += detok.stopped  # cut by the detokenizer, with everything after it
            return "stop"
    limit = params.max_tokens  # None: the rest of the context window
    if (limit is not None and num_out >= limit) or len(seq.prompt_token_ids) + num_out >= max_model_len:
        return "length"
    return None


def sendable_text(seq: Sequence, finished: bool) -> str:
    """Text not yet streamed; on finish, first flush what the detokenizer held back."""
    if finished and seq.detokenizer is not None:
        if seq.defer_text:  # one pass over the whole output; a final stop token adds no text
            ids = seq.output_token_ids
            ids = ids[:-1] if seq.stopped_on_token and ids else ids
            seq.output_text += seq.detokenizer.add(list(ids))
        seq.output_text += seq.detokenizer.finish()
        seq.detokenizer = None  # flushed once; nothing more will come
    delta = seq.output_text[seq.num_text_sent :]
    seq.num_text_sent = len(seq.output_text)
    return delta
