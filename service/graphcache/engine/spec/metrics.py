"""SpecDecodeMetrics: vLLM's speculative-decoding counters, on the server's registry.

Names, help texts and labels follow vLLM v1 (vllm/v1/spec_decode/metrics.py, SpecDecodingProm), with
vllm_metrics.py's labels (model_name, engine); prometheus_client exposes each counter with `_total`:
  vllm:spec_decode_num_drafts                  requests that carried at least one draft token, per step
  vllm:spec_decode_num_draft_tokens            draft tokens scored
  vllm:spec_decode_num_accepted_tokens         draft tokens accepted (bonus tokens not counted)
  vllm:spec_decode_num_accepted_tokens_per_pos by `position` 0..k-1: drafts whose token at that position
                                               was accepted
so acceptance rate = accepted / draft_tokens and mean accepted length = 1 + accepted / drafts (vLLM's
definition, the emitted correction or bonus token included); per position: per_pos / drafts.

Like vLLM, the series exist only where speculation is configured: the engine builds this when it builds
its proposer. A collector rather than prometheus Counters: one observe() per step adds a batch's counts
in a few numpy operations, and the model_name label is read at scrape (after Metrics.bind_model, like
vllm_metrics' mirrors), so it never goes stale.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Protocol, TypedDict

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from graphcache.vllm_metrics import ENGINE, LABELS

__all__ = ["SpecDecodeCounts", "SpecDecodeMetrics"]

NAMES = {
    "drafts": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    "draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    "accepted": ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    "per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position."),
}


class SpecDecodeCounts(TypedDict):
    drafts: int
    draft_tokens: int
    accepted: int
    per_pos: list[int]  # [k]


class ModelNamed(Protocol):
    """Whatever names the served model: VllmMetrics (Metrics.vllm) does."""

    model_name: str


class SpecDecodeMetrics(Collector):
    """The four counters. observe() runs on the engine thread; collect() on the scrape's."""

    def __init__(self, registry: CollectorRegistry, labels: ModelNamed, num_speculative_tokens: int) -> None:
        self.labels = labels
        self.num_speculative_tokens = num_speculative_tokens
        self._lock = threading.Lock()
        self._drafts = self._draft_tokens = self._accepted = 0
        self._per_pos = np.zeros(num_speculative_tokens, dtype=np.int64)  # [k]
        registry.register(self)

    def observe(self, num_draft_tokens: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One verify step: per request, the drafts it carried and how many were accepted (host ints or
        arrays; rows with no drafts are not drafts and count nowhere)."""
        drafted = np.asarray(num_draft_tokens, dtype=np.int64)  # [B]
        accepted = np.asarray(num_accepted, dtype=np.int64)  # [B]
        if drafted.shape != accepted.shape:
            raise ValueError(f"num_draft_tokens {drafted.shape} and num_accepted {accepted.shape} differ")
        if drafted.size == 0:
            return
        if ((accepted < 0) | (accepted > drafted) | (drafted > self.num_speculative_tokens)).any():
            raise ValueError(
                f"need 0 <= num_accepted <= num_draft_tokens <= {self.num_speculative_tokens} per request"
            )
        spec = drafted > 0
        # per position i: the rows that accepted more than i drafts = a reversed cumulative histogram
        at_least = np.bincount(accepted[spec], minlength=self.num_speculative_tokens + 1)[::-1].cumsum()[::-1]
        with self._lock:
            self._drafts += int(spec.sum())
            self._draft_tokens += int(drafted.sum())
            self._accepted += int(accepted.sum())
            self._per_pos += at_least[1:]

    def snapshot(self) -> SpecDecodeCounts:
        """The counts (for tests, logs and /admin): drafts, draft_tokens, accepted, per_pos (a list)."""
        with self._lock:
            return SpecDecodeCounts(
                drafts=self._drafts,
                draft_tokens=self._draft_tokens,
                accepted=self._accepted,
                per_pos=self._per_pos.tolist(),
            )

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = self.snapshot()
        values = [self.labels.model_name, ENGINE]
        for key, value in (
            ("drafts", counts["drafts"]),
            ("draft_tokens", counts["draft_tokens"]),
            ("accepted", counts["accepted"]),
        ):
            name, doc = NAMES[key]
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(values, value)
            yield family
        name, doc = NAMES["per_pos"]
        family = CounterMetricFamily(name, doc, labels=[*LABELS, "position"])
        for position, value in enumerate(counts["per_pos"]):
            family.add_metric([*values, str(position)], value)
        yield family
