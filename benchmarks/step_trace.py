"""Summarize an engine step trace (settings.engine.step_trace / GRAPHCACHE_STEP_TRACE, engine/loop/core.py).

Where a run's wall time went, per step: schedule, launch (prepare + replay + device sampling),
wait (the host waiting for the step's tokens: the GPU is busy then), post (append, stops, outputs)
and *loop* (everything else in the engine loop: intake, streaming, gauges, delivery). With async
scheduling a step's GPU work overlaps the next step's host work, so a run is GPU-bound when `wait`
is a large share of the period and host-bound when it is near 0.

Against the roofline (benchmarks/roofline.py, given the model: --model DIR or --shape NAME): steps by kind
and decode steps by row count, each with its mean ms, its mean bound (one weight read or its GEMM FLOPs at
peak, whichever is longer, plus its KV read from the record's `context`) and measured / bound.

    python benchmarks/step_trace.py served_steps.jsonl [--from T0 --to T1]   (perf_counter seconds)
    python benchmarks/step_trace.py served_steps.jsonl --shape llama8b [--quantization fp8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # run as a script: the repository root, for `benchmarks.roofline`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.roofline import Roofline  # noqa: E402


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


# Decode steps by rows scheduled: (lowest, highest) of each bucket, None for no upper limit.
DECODE_BUCKETS: tuple[tuple[int, int | None], ...] = (
    (1, 64),
    (65, 128),
    (129, 192),
    (193, 256),
    (257, 384),
    (385, 512),
    (513, None),
)


def bucket_label(lo: int, hi: int | None) -> str:
    return f"<={hi}" if lo <= 1 else f">{lo - 1}" if hi is None else f"{lo}-{hi}"


def kinds_from_records(records: list[dict]) -> list[str]:
    """Step kinds from the trace alone: decode when every row feeds one token, else mixed (a record does not
    say whether any of its rows decode, so a prompt-chunks-only step counts as mixed here; record_step_kinds
    tells them apart in-process)."""
    return ["decode" if r["tokens"] == r["rows"] else "mixed" for r in records]


def against_roofline(
    records: list[dict],
    roof: Roofline,
    kinds: list[str] | None = None,
    t0: float | None = None,
    t1: float | None = None,
) -> dict:
    """{"by_kind": {kind: stats}, "decode_buckets": {label: stats}, "all": stats, "kv_known": bool} over the
    steps scheduled in [t0, t1], stats = {steps, ms, bound_ms, measured_over_bound, rows_mean, tokens_mean}
    ("all": every step, with seconds and bound_s, the sums: what this schedule's steps take and would take
    each at its own bound, so a run's bound over bound_s is the share its step structure allows). ms is by_kind's
    (completion to completion); a step's bound is Roofline.step_bound_s of its tokens, sampled rows and
    context. kinds: record_step_kinds' list when it lines up with the records, else kinds_from_records.
    kv_known is False when the records have no context (an older engine's trace): bounds then leave the KV
    read out."""
    if kinds is None or len(kinds) != len(records):
        kinds = kinds_from_records(records)
    sums: dict[str, dict[str, dict]] = {"by_kind": {}, "decode_buckets": {}, "all": {}}
    kv_known = True
    for i in range(1, len(records)):
        r = records[i]
        if (t0 is not None and records[i - 1]["scheduled"] < t0) or (t1 is not None and r["scheduled"] > t1):
            continue
        context = r.get("context")
        kv_known = kv_known and context is not None
        ms = (r["completed"] - records[i - 1]["completed"]) * 1e3
        bound_ms = roof.step_bound_s(r["tokens"], r["sampled"], context) * 1e3
        groups = [("by_kind", kinds[i]), ("all", "all")]
        if kinds[i] == "decode":
            label = next(
                bucket_label(lo, hi)
                for lo, hi in DECODE_BUCKETS
                if r["rows"] >= lo and (hi is None or r["rows"] <= hi)
            )
            groups.append(("decode_buckets", label))
        for table_name, key in groups:
            g = sums[table_name].setdefault(
                key, {"steps": 0, "ms": 0.0, "bound_ms": 0.0, "rows": 0, "tokens": 0}
            )
            g["steps"] += 1
            g["ms"] += ms
            g["bound_ms"] += bound_ms
            g["rows"] += r["rows"]
            g["tokens"] += r["tokens"]
    out: dict = {"kv_known": kv_known}
    order = {
        "by_kind": KINDS,
        "decode_buckets": tuple(bucket_label(lo, hi) for lo, hi in DECODE_BUCKETS),
        "all": ("all",),
    }
    for table_name, groups in sums.items():
        out[table_name] = {
            key: {
                "steps": (n := g["steps"]),
                "ms": g["ms"] / n,
                "bound_ms": g["bound_ms"] / n,
                "measured_over_bound": g["ms"] / g["bound_ms"] if g["bound_ms"] else 0.0,
                "rows_mean": g["rows"] / n,
                "tokens_mean": g["tokens"] / n,
            }
            for key in order[table_name]
            if (g := groups.get(key))
        }
    every = out.pop("all").get("all")
    if every:
        every.update(
            seconds=every["ms"] * every["steps"] / 1e3, bound_s=every["bound_ms"] * every["steps"] / 1e3
        )
    out["all"] = every or {}
    return out


def roofline_table(rows: dict[str, dict]) -> str:
    """against_roofline's summaries (one per named run) as two markdown tables: steps by kind, then decode
    steps by rows."""
    lines = [
        "| run | kind | steps | rows | tokens | ms | bound ms | measured/bound |",
        "|---" * 8 + "|",
    ]
    for name, s in rows.items():
        note = "" if s.get("kv_known", True) else " (no KV in bound)"
        every = {"all steps": s["all"]} if s.get("all") else {}
        for kind, k in {**s.get("by_kind", {}), **every}.items():
            lines.append(
                f"| {name}{note} | {kind} | {k['steps']} | {k['rows_mean']:.0f} | {k['tokens_mean']:.0f} | "
                f"{k['ms']:.2f} | {k['bound_ms']:.3f} | {k['measured_over_bound']:.2f} |"
            )
    lines += ["", "| run | decode rows | steps | ms | bound ms | measured/bound |", "|---" * 6 + "|"]
    for name, s in rows.items():
        for label, b in s.get("decode_buckets", {}).items():
            lines.append(
                f"| {name} | {label} | {b['steps']} | {b['ms']:.2f} | {b['bound_ms']:.3f} | "
                f"{b['measured_over_bound']:.2f} |"
            )
    return "\n".join(lines)


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--from", dest="t0", type=float)
    ap.add_argument("--to", dest="t1", type=float)
    ap.add_argument("--model", type=Path, help="the run's model directory (its config.json): roofline tables")
    ap.add_argument("--shape", help="or a benchmarks/model_shapes.py shape (llama8b, qwen05b, ...)")
    ap.add_argument("--quantization", default="auto", help="the run's --quantization (fp8: FP8 bound)")
    args = ap.parse_args(argv)
    records = load(args.trace)
    print(table({args.trace.name: summarize(records, args.t0, args.t1)}))
    roof = _roofline_of(args)
    if roof is not None:
        print("\nagainst the H200 roofline (benchmarks/roofline.py; ms per step):")
        print(roofline_table({args.trace.name: against_roofline(records, roof, None, args.t0, args.t1)}))
    return 0


def _roofline_of(args: argparse.Namespace) -> Roofline | None:
    from benchmarks import roofline

    if args.model is not None:
        config = json.loads((args.model / "config.json").read_text())
    elif args.shape is not None:
        config = roofline.config_of_shape(args.shape)
    else:
        return None
    return roofline.for_config(config, args.quantization)


if __name__ == "__main__":
    raise SystemExit(main())
