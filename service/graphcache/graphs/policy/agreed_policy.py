"""AgreedPolicy: a CachePolicy whose per-rank inputs every tensor-parallel rank agrees on.

The policy is deterministic over the steps' descriptors, admin calls and what captures measured; only
the last differs per rank (a capture may fail on one rank, and each measures its own bytes and
seconds). So only `agree` changes: each report goes to rank 0 with this rank's state fingerprint, and
every rank applies rank 0's verdict (agreement.py). Every other decision is CachePolicy's own.
"""

from __future__ import annotations

from collections.abc import Callable

from graphcache.graphs.policy.agreement import Agreement, CaptureReport, Verdict, fingerprint
from graphcache.graphs.policy.config import CachePolicyConfig
from graphcache.graphs.policy.journal import CacheJournal
from graphcache.graphs.policy.policy import CachePolicy
from graphcache.graphs.store import GraphStore

__all__ = ["AgreedPolicy"]


class AgreedPolicy(CachePolicy):
    def __init__(
        self,
        config: CachePolicyConfig,
        store: GraphStore,
        journal: CacheJournal,
        clock: Callable[[], float],
        agreement: Agreement,
    ) -> None:
        super().__init__(config, store, journal, clock)
        self.agreement = agreement
        self.size = agreement.size

    def agree(self, report: CaptureReport) -> Verdict:
        """The verdict every rank applies (rank 0's, from every rank's report); at size 1 this report's."""
        if self.size == 1:
            return self.agreement.agree(report)
        state = fingerprint([self.store.descriptors(), list(self.negative), len(self.journal.decisions)])
        verdict = self.agreement.agree(
            CaptureReport(report.ok, report.reason, report.detail, report.bytes, report.seconds, state)
        )
        if verdict.diverged:
            raise RuntimeError(
                verdict.diverged + "; restart the server (every rank starts from an empty cache), "
                "and report it: the runner must apply every step and admin call on all ranks"
            )
        return verdict
