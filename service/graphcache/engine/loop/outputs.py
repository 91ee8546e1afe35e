"""RequestOutputs: the deltas a request streams, and the metrics of a request that ends.

A request's output carries what it has not sent yet: new token ids, the text it may stream so far
(engine/stopping.py), their logprobs, and with its first output its prompt logprobs. A stream's first
output is made at once (time to first token); later ones wait until `stream_outputs()` (the Engine
calls it at most every stream_interval_ms), so the step loop does not build one per token. A
non-streaming request gets only its final output. EngineCore (core.py) owns the request tables and
retires a finished request from them before asking for its final output here.
"""

from __future__ import annotations

import time

from graphcache.engine.sequence import RequestOutput, Sequence
from graphcache.engine.stopping import sendable_text
from graphcache.metrics import Metrics

__all__ = ["RequestOutputs", "request_delta"]


class RequestOutputs:
    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        self._unsent: dict[str, Sequence] = {}  # streams with tokens not in an output yet

    def output(self, seq: Sequence) -> RequestOutput | None:
        """What `seq` has not streamed yet (None: nothing to send now); a finished one's final output."""
        finished = seq.is_finished
        if finished:
            self._unsent.pop(seq.request_id, None)
            self._record_finish(seq)
        elif not seq.stream:
            return None  # everything accumulates into the final output
        elif seq.num_tokens_sent:
            self._unsent[seq.request_id] = seq
            return None
        return request_delta(seq, finished)

    def stream_outputs(self) -> list[RequestOutput]:
        """The outputs of every stream that got tokens since its last output (a final output always
        carries what was not sent)."""
        unsent, self._unsent = self._unsent, {}
        return [out for seq in unsent.values() if (out := request_delta(seq, False)) is not None]

    def _record_finish(self, seq: Sequence) -> None:
        m = self.metrics
        if m is None:
            return
        now = time.monotonic()
        m.requests_finished.labels(seq.finish_reason).inc()  # vllm:request_success mirrors it
        m.e2e.observe(now - seq.arrival_time)
        m.vllm.observe_finished(seq, now)
        if seq.num_output_tokens > 1 and seq.first_token_time is not None and seq.last_token_time is not None:
            # Mean time between output tokens of this request (per request, not per token: a
            # histogram observation per token costs ~1 ms a step at batch 256).
            m.tpot.observe((seq.last_token_time - seq.first_token_time) / (seq.num_output_tokens - 1))


def request_delta(seq: Sequence, finished: bool) -> RequestOutput | None:
    """The output of what `seq` produced since its last one, marked sent (None: nothing new and not finished)."""
    sent = seq.num_tokens_sent
    new_ids = seq.output_token_ids[sent:]
    seq.num_tokens_sent = seq.num_output_tokens
    text = sendable_text(seq, finished)
    if not finished and not new_ids and not text:
        return None
    params = seq.params
    logprobs = seq.output_logprobs[sent : sent + len(new_ids)] if params.logprobs is not None else None
    # The first output is the first with tokens (or the final one): the whole prompt has run by then.
    prompt_logprobs = list(seq.prompt_logprobs) if sent == 0 and params.prompt_logprobs is not None else None
    return RequestOutput(
        seq.request_id,
        text,
        new_ids,
        finished,
        seq.finish_reason,
        seq.num_prompt_tokens,
        seq.num_output_tokens,
        seq.error,
        error_code=seq.error_code,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        num_cached_tokens=seq.num_cached_tokens,
        stopped_on_token=finished and seq.stopped_on_token,
        stop_reason=seq.stop_reason if finished else None,
        embedding=seq.embedding if finished else None,
    )
