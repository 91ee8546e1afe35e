"""Cache decisions agreed by every tensor-parallel rank, and the decision log each rank keeps.

Why: at tensor_parallel_size N every rank holds its own GraphCache, and every captured graph holds
collectives (the all-reduces of model/parallel.py). If rank 0 replayed 8:8:decode while rank 1 ran
eagerly, or one rank evicted what the other replayed, a collective would wait forever for a rank that
took another path: a hang, not an error. So the caches must capture, replay, evict and refuse the same
descriptors in the same order.

How: the cache is a deterministic state machine over (the steps' descriptors, admin calls, budgets,
and what captures measured). The first two reach every rank in the same order (rank 0 broadcasts each
step's batch and each admin call, docs/TENSOR_PARALLEL.md). The last is the only per-rank input: a
capture may fail on one rank only, and measures its own pool bytes and seconds. At each capture the
ranks therefore send rank 0 a `CaptureReport`; rank 0 decides the `Verdict` and broadcasts it:
- a capture fails on every rank if it failed on any (the graph a rank did capture is dropped), with the
  failing rank's reason, and the negative cache remembers it on every rank;
- bytes are the max over ranks (a budget breach on any rank refuses everywhere), seconds too (GDSF);
- every report carries the rank's state fingerprint; a mismatch means the caches already diverged,
  and every rank raises the same error instead of hanging at the next collective.
Hits, admission, eviction and budget refusals then follow from identical state on every rank, so they
need no message: a replay costs no collective beyond the model's own.

Every rank logs each decision as a `Decision` (admit, refuse, evict, pin, warmup, clear); the logs of
all ranks are equal (the 2-process test compares them). At size 1 `Agreement` is the identity: the
cache's own report is the verdict and no collective is ever called.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Agreement", "CaptureReport", "Decision", "GroupAgreement", "Verdict", "decide", "fingerprint"]


@dataclass(frozen=True)
class Decision:
    """One decision of the cache, as every rank applies it (small and picklable)."""

    op: str  # "admit" | "refuse" | "evict" | "pin" | "warmup" | "clear"
    desc: str = ""  # the descriptor ("8:8:decode"); "" for clear
    reason: str = ""  # refuse: budget | oom | error; evict: entries | bytes | manual | clear
    bytes: int = 0  # admit: the agreed size (max over ranks)
    rank_bytes: tuple[
        int, ...
    ] = ()  # admit: each rank's measured growth of its pool (a private pool: all of it)
    pinned: bool = False


@dataclass(frozen=True)
class CaptureReport:
    """What one rank saw of a capture step (a pre-check, a capture, or a pool measurement)."""

    ok: bool
    reason: str = ""  # when not ok: "oom" | "error" | "budget"
    detail: str = ""
    bytes: int = 0
    seconds: float = 0.0
    state: int = 0  # the rank's cache fingerprint before this step


@dataclass(frozen=True)
class Verdict:
    """Rank 0's decision on a capture step, the same on every rank."""

    ok: bool
    reason: str = ""
    detail: str = ""
    bytes: int = 0  # max over ranks
    seconds: float = 0.0  # max over ranks
    rank_bytes: tuple[int, ...] = field(default_factory=tuple)
    diverged: str = ""  # non-empty: the ranks' caches differ (a bug); every rank raises it


def decide(reports: list[CaptureReport]) -> Verdict:
    """Rank 0's rule: any failure fails all (first failing rank's reason); sizes are the max."""
    states = {r.state for r in reports}
    if len(states) > 1:
        return Verdict(
            False,
            "error",
            diverged=f"graph caches diverged across ranks (fingerprints "
            f"{[r.state for r in reports]}): a step or admin call reached some ranks only",
        )
    rank_bytes = tuple(r.bytes for r in reports)
    for rank, r in enumerate(reports):
        if not r.ok:
            where = f"rank {rank}: " if len(reports) > 1 else ""
            return Verdict(False, r.reason, where + r.detail, max(rank_bytes), rank_bytes=rank_bytes)
    return Verdict(
        True, bytes=max(rank_bytes), seconds=max(r.seconds for r in reports), rank_bytes=rank_bytes
    )


def fingerprint(items: list[Any]) -> int:
    """A digest equal on ranks with equal state (crc32 of the repr: hash() differs per process)."""
    return zlib.crc32(repr(items).encode())


class Agreement:
    """One process: its own report is the verdict. No collective, ever."""

    rank, size = 0, 1

    def agree(self, report: CaptureReport) -> Verdict:
        return decide([report])


class GroupAgreement(Agreement):
    """Ranks of a torch.distributed group: gather the reports on rank 0, which decides and broadcasts.

    Object collectives pickle through the group's backend (gloo on the CPU; with NCCL, call
    torch.cuda.set_device first). They run only at captures, never on a replay."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist, self.group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0

    def agree(self, report: CaptureReport) -> Verdict:
        dist = self._dist
        gathered: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(report, gathered, dst=self._root, group=self.group)
        box: list[Any] = [decide(gathered) if gathered is not None else None]  # gathered on rank 0 only
        dist.broadcast_object_list(box, src=self._root, group=self.group)
        return box[0]
