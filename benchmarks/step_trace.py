"""Summarize an engine step trace (settings.step_trace / GRAPHCACHE_STEP_TRACE, engine/loop/core.py).

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
    from graphcache.engine.loop.core import STEP_TRACE_FIELDS

    return [dict(zip(STEP_TRACE_FIELDS, rec, strict=True)) for rec in trace]


def summarize(records: list[dict], t0: float | None = None, t1: float | None = None) -> dict:
    """Per-step means (ms) over the steps scheduled in [t0, t1]; {} when there are none."""
    steps = [r for r in records if (t0 is None or r["scheduled"] >= t0) and (t1 is None or r["scheduled"] <= t1)]
    if not steps:
        return {}
    n = len(steps)
    span = steps[-1]["completed"] - steps[0]["scheduled"]

    def mean_ms(key_from: str, key_to: str) -> float:
        return sum(r[key_to] - r[key_from] for r in steps) * 1e3 / n

    phases = {"schedule": mean_ms("scheduled", "launch"), "launch": mean_ms("launch", "launched"),
              "wait": mean_ms("complete", "tokens_on_host"), "post": mean_ms("tokens_on_host", "completed")}
    # Between launch end and completion start the step's own completion waits for the previous
    # step's (async); the rest of the period is the loop's own work.
    period = span * 1e3 / n
    full = max(r["sampled"] for r in steps)
    first_full = next(r for r in steps if r["sampled"] == full)
    return {
        "steps": n, "span_s": span, "period_ms": period, **{f"{k}_ms": v for k, v in phases.items()},
        "loop_ms": period - sum(phases.values()),
        "rows_mean": sum(r["rows"] for r in steps) / n, "sampled_mean": sum(r["sampled"] for r in steps) / n,
        "tokens_mean": sum(r["tokens"] for r in steps) / n,
        "mixed_steps": sum(r["tokens"] > r["rows"] for r in steps),
        "max_sampled": full, "s_to_max_sampled": first_full["scheduled"] - steps[0]["scheduled"],
        "waiting_max": max(r["waiting"] for r in steps),
    }


COLUMNS = ("steps", "span_s", "period_ms", "schedule_ms", "launch_ms", "wait_ms", "post_ms", "loop_ms",
           "sampled_mean", "tokens_mean", "mixed_steps", "max_sampled", "s_to_max_sampled")


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
