"""Summarize an engine step trace (settings.engine.step_trace / GRAPHCACHE_STEP_TRACE, engine/loop/core.py).

Where a run's wall time went, per step: schedule, launch (prepare + replay + device sampling),
wait (the host waiting for the step's tokens: the GPU is busy then), post (append, stops, outputs)
and *loop* (everything else in the engine loop: intake, streaming, gauges, delivery). With async
scheduling a step's GPU work overlaps the next step's host work, so a run is GPU-bound when `wait`
is a large share of the period and host-bound when it is near 0.

    python benchmarks/step_trace.py served_steps.jsonl [--from T0 --to T1]   (perf_counter seconds)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def records_of(trace) -> list[dict]:
    """EngineCore.step_trace (tuples) as dicts."""
    try:
        from graphcache.engine.loop.step_trace import STEP_TRACE_FIELDS
    except ImportError:  # the old tree of the A-B phases (gpu_check.sh realistic*_old): one engine module
        from graphcache.engine.core import STEP_TRACE_FIELDS

    return [dict(zip(STEP_TRACE_FIELDS, rec, strict=True)) for rec in trace]


def summarize(records: list[dict], t0: float | None = None, t1: float | None = None) -> dict:
    """Per-step means (ms) over the steps scheduled in [t0, t1]; {} when there are none."""
    steps = [
        r for r in records if (t0 is None or r["scheduled"] >= t0) and (t1 is None or r["scheduled"] <= t1)
    ]
    if not steps:
        return {}
    n = len(steps)
    span = steps[-1]["completed"] - steps[0]["scheduled"]

    def mean_ms(key_from: str, key_to: str) -> float:
        return sum(r[key_to] - r[key_from] for r in steps) * 1e3 / n

    phases = {
        "schedule": mean_ms("scheduled", "launch"),
        "launch": mean_ms("launch", "launched"),
        "wait": mean_ms("complete", "tokens_on_host"),
        "post": mean_ms("tokens_on_host", "completed"),
    }
    # Between launch end and completion start the step's own completion waits for the previous
    # step's (async); the rest of the period is the loop's own work.
    period = span * 1e3 / n
    full = max(r["sampled"] for r in steps)
    first_full = next(r for r in steps if r["sampled"] == full)
    return {
        "steps": n,
        "span_s": span,
        "period_ms": period,
        **{f"{k}_ms": v for k, v in phases.items()},
        "loop_ms": period - sum(phases.values()),
        "rows_mean": sum(r["rows"] for r in steps) / n,
        "sampled_mean": sum(r["sampled"] for r in steps) / n,
        "tokens_mean": sum(r["tokens"] for r in steps) / n,
        "mixed_steps": sum(r["tokens"] > r["rows"] for r in steps),
        "max_sampled": full,
        "s_to_max_sampled": first_full["scheduled"] - steps[0]["scheduled"],
        "waiting_max": max(r["waiting"] for r in steps),
    }


def record_step_kinds(core) -> list[str]:
    """Wrap `core.scheduler.schedule` so each non-empty plan appends its kind to the returned list, in
    launch order (the order of core.step_trace's records): decode (every row feeds one token), prefill
    (every row is a prompt chunk of more than one token) or mixed (both). The trace itself has no per-row
    lengths, so a benchmark running the engine in-process records them here."""
    kinds: list[str] = []
    schedule = core.scheduler.schedule

    def schedule_and_record():
        plan = schedule()
        if plan.scheduled:
            chunks = sum(s.num_tokens > 1 for s in plan.scheduled)
            kinds.append("decode" if chunks == 0 else "prefill" if chunks == len(plan.scheduled) else "mixed")
        return plan

    core.scheduler.schedule = schedule_and_record
    return kinds


KINDS = ("decode", "mixed", "prefill")


def by_kind(records: list[dict], kinds: list[str], t0: float | None = None, t1: float | None = None) -> dict:
    """{kind: {steps, ms, launch_ms, wait_ms, rows_mean, tokens_mean}} over the steps scheduled in [t0, t1].
    ms is the step's share of the pipeline: its completion minus the previous step's completion (with
    async scheduling the host prepares step n+1 while the GPU runs step n, so completions are the
    period). {} when the kinds do not line up with the records (a step failed between schedule and trace)."""
    if len(kinds) != len(records):
        return {}
    out: dict[str, dict] = {}
    for i in range(1, len(records)):
        r = records[i]
        # The window's first step has no predecessor in the window (the gap before it is idle time).
        if (t0 is not None and records[i - 1]["scheduled"] < t0) or (t1 is not None and r["scheduled"] > t1):
            continue
        k = out.setdefault(
            kinds[i], {"steps": 0, "ms": 0.0, "launch_ms": 0.0, "wait_ms": 0.0, "rows": 0, "tokens": 0}
        )
        k["steps"] += 1
        k["ms"] += (r["completed"] - records[i - 1]["completed"]) * 1e3
        k["launch_ms"] += (r["launched"] - r["launch"]) * 1e3
        k["wait_ms"] += (r["tokens_on_host"] - r["complete"]) * 1e3
        k["rows"] += r["rows"]
        k["tokens"] += r["tokens"]
    for k in out.values():
        n = k.pop("steps")
        k.update(
            {key: k[key] / n for key in ("ms", "launch_ms", "wait_ms")},
            steps=n,
            rows_mean=k.pop("rows") / n,
            tokens_mean=k.pop("tokens") / n,
        )
    return out


COLUMNS = (
    "steps",
    "span_s",
    "period_ms",
    "schedule_ms",
    "launch_ms",
    "wait_ms",
    "post_ms",
    "loop_ms",
    "sampled_mean",
    "tokens_mean",
    "mixed_steps",
    "max_sampled",
    "s_to_max_sampled",
)


def table(rows: dict[str, dict]) -> str:
    """A markdown table, one row per named summary."""
    lines = ["| run | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, s in rows.items():
        cells = [f"{s[c]:.3f}" if isinstance(s.get(c), float) else str(s.get(c, "")) for c in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--from", dest="t0", type=float)
    ap.add_argument("--to", dest="t1", type=float)
    args = ap.parse_args()
    print(table({args.trace.name: summarize(load(args.trace), args.t0, args.t1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
