"""AgreedPolicy: a CachePolicy whose per-rank inputs every tensor-parallel rank agrees on.

The policy is deterministic over the steps' descriptors, admin calls and what captures measured; only
the last differs per rank (a capture may fail on one rank, and each measures its own bytes and
seconds). So only `agree` changes: each report goes to rank 0 with this rank's state fingerprint, and
every rank applies rank 0's verdict (agreement.py). Everything else is the wrapped policy's.
"""

from __future__ import annotations

from typing import Any

from graphcache.graphs.agreement import Agreement, CaptureReport, Verdict, fingerprint
from graphcache.graphs.policy import CachePolicy

__all__ = ["AgreedPolicy"]


class AgreedPolicy:
    def __init__(self, policy: CachePolicy, agreement: Agreement) -> None:
        self.policy, self.agreement = policy, agreement
        self.size = agreement.size

    def agree(self, report: CaptureReport) -> Verdict:
        """The verdict every rank applies (rank 0's, from every rank's report); at size 1 this report's."""
        if self.size == 1:
            return self.agreement.agree(report)
        p = self.policy
        state = fingerprint([list(p.entries), list(p.negative), len(p.journal.decisions)])
        verdict = self.agreement.agree(
            CaptureReport(report.ok, report.reason, report.detail, report.bytes, report.seconds, state)
        )
        if verdict.diverged:
            raise RuntimeError(
                verdict.diverged + "; restart the server (every rank starts from an empty cache), "
                "and report it: the runner must apply every step and admin call on all ranks"
            )
        return verdict

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)  # every decision but the agreed inputs is the policy's own
