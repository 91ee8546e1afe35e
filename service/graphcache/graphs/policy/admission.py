"""When a miss while serving may capture: the admission rule, and a budget of capture time.

A lazy capture runs on the engine thread inside the step that missed, so every running request
waits for it (tens of ms). Two limits keep that from stalling serving:
- the rule: "always" captures at the first miss, "after_n" at the N-th miss of a descriptor,
  "never" only through warmup/admin; "auto" (default) captures uniform-decode descriptors at
  once (few, and hit on every later step) but a mixed prefill/decode descriptor only at its N-th
  miss, since many mixed shapes are seen once during a burst and never again;
- the budget: lazy captures may take at most `time_share` of serving time, a token bucket of
  capture seconds that refills at `time_share` seconds per second, up to `burst_seconds`. A miss
  over budget is served eagerly and captured at a later miss ("deferred", not remembered as failed).
Warmup and admin captures are never limited: they run outside serving.

Tensor parallel: the rule depends on counts only, equal on every rank. The budget depends on each
rank's clock, so it is agreed with the other ranks like any pre-check (agreed_policy.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.graphs.policy.config import CachePolicyConfig

__all__ = ["Admission"]


class Admission:
    def __init__(self, config: CachePolicyConfig, clock: Callable[[], float]) -> None:
        """config: the rule and the budget (validated there); clock: seconds, for the budget's refill."""
        self.rule, self.min_misses = config.admission, config.admission_min_misses
        self.time_share, self.burst_seconds, self.clock = (
            config.capture_time_share,
            config.capture_burst_seconds,
            clock,
        )
        self._misses: Counter[BatchDescriptor] = Counter()
        self._balance = self.burst_seconds  # capture seconds available now
        self._refilled_at = clock()

    def wants(self, desc: BatchDescriptor) -> bool:
        """The rule alone: does this miss (counted here) ask for a capture?"""
        if self.rule == "never":
            return False
        self._misses[desc] += 1
        if self.rule == "always" or (self.rule == "auto" and desc.uniform_decode):
            return True
        return self._misses[desc] >= self.min_misses

    def within_budget(self) -> bool:
        """True while lazy captures have used no more than their share of time (always at share 1)."""
        if self.time_share >= 1:
            return True
        now = self.clock()
        self._balance = min(self.burst_seconds, self._balance + (now - self._refilled_at) * self.time_share)
        self._refilled_at = now
        return self._balance > 0

    def spend(self, seconds: float) -> None:
        """A lazy capture took `seconds` (may leave the balance negative: the next ones wait longer)."""
        self._balance -= seconds

    def reset(self) -> None:
        """clear(): miss counts start over (the budget keeps its balance: it is about time)."""
        self._misses.clear()

    def info(self) -> dict:
        return {
            "rule": self.rule,
            "min_misses": self.min_misses,
            "time_share": self.time_share,
            "burst_seconds": self.burst_seconds,
            "balance_seconds": round(self._balance, 6),
        }
