"""The server's side of an open-loop window: its vLLM latency histograms on /metrics, diffed over the window.

Engine clock (service/graphcache/vllm_metrics.py): arrival is the engine request's creation in the API
process (after the prompt is tokenized), first token = the step that sampled it completed on the engine.
  ttft     arrival -> first token                       vllm:time_to_first_token_seconds
  queue    arrival -> first scheduled                   vllm:request_queue_time_seconds
  prefill  first scheduled -> first token               vllm:request_prefill_time_seconds
  tpot     a request's mean gap between its tokens      vllm:request_time_per_output_token_seconds
  itl      per token, the same gaps                     vllm:inter_token_latency_seconds
So ttft = queue + prefill, and a client's TTFT minus the server's is the HTTP floor: parsing and
tokenizing before arrival, the output's way back (engine process pipe, event loop, SSE) after it.
Requests count where they reach the phase: a window's TTFT and queue are of the requests that got their
first token in it, tpot / itl / prefill of those that finished in it.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx

__all__ = [
    "SERVER_COUNTS",
    "SERVER_FIGURES",
    "bucket_quantile",
    "server_histograms",
    "server_quantiles",
    "trace_window",
    "triton_compiles",
]

SERVER_FIGURES = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
}


# What can stall every request at once, counted over a window: lazy graph captures on a miss (inside the
# step that missed: graphs/policy/admission.py), and the steps run eagerly vs replayed.
SERVER_COUNTS = {
    "captures": "graphcache_graph_captures_total",
    "capture_stall_s": "graphcache_graph_capture_stall_seconds_sum",
    "captures_deferred": "graphcache_graph_captures_deferred_total",
    "misses": "graphcache_graph_cache_misses_total",
    "eager_steps": 'graphcache_steps_total{mode="eager"}',
    "replay_steps": 'graphcache_steps_total{mode="replay"}',
    "preemptions": "vllm:num_preemptions_total",
}


def triton_compiles() -> int:
    """Kernels in Triton's on-disk cache (one directory per compiled specialization): a rise over a window
    is JIT compiling on the engine thread while serving (the server shares this machine's cache dir)."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    try:
        return sum(1 for p in root.iterdir() if p.is_dir())
    except OSError:
        return 0


def server_histograms(url: str) -> dict[str, list[tuple[float, float]]]:
    """{figure: [(upper bound s, cumulative count)]} from GET /metrics, summed over label sets; "counts":
    [(i, value of the i-th SERVER_COUNTS)]; "triton": [(0, triton_compiles())]."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {name: key for key, name in SERVER_FIGURES.items()}
    count_keys = {name: key for key, name in SERVER_COUNTS.items()}
    out: dict[str, dict[float, float]] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for x in family.samples:
            mode = x.labels.get("mode")
            name = f'{x.name}{{mode="{mode}"}}' if mode is not None else x.name
            if name in count_keys:
                counts[count_keys[name]] = counts.get(count_keys[name], 0.0) + x.value
        key = wanted.get(family.name)
        if key is None:
            continue
        buckets = out.setdefault(key, {})
        for x in family.samples:
            if x.name.endswith("_bucket"):
                le = float(x.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + x.value
    result = {key: sorted(b.items()) for key, b in out.items()}
    result["counts"] = [(float(i), counts.get(k, 0.0)) for i, k in enumerate(SERVER_COUNTS)]
    result["triton"] = [(0.0, float(triton_compiles()))]
    return result


def bucket_quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile over the window's bucket increments (linear within a bucket), in ms.
    before and after: [(upper bound s, cumulative count)] with the same bounds."""
    counts = [(le, a - b) for (le, a), (_, b) in zip(after, before, strict=True)]
    if not counts or counts[-1][1] <= 0:
        return float("nan")
    rank, low, below = q * counts[-1][1], 0.0, 0.0
    for le, cum in counts:
        if cum >= rank:
            if le == float("inf"):
                return low * 1e3
            return (low + (le - low) * (rank - below) / max(cum - below, 1e-12)) * 1e3
        low, below = le, cum
    return low * 1e3


def server_quantiles(before: dict, after: dict) -> dict[str, float]:
    """{figure_ms_p50, figure_ms_p99, figure_count} for each SERVER_FIGURES over the window."""
    row: dict[str, float] = {}
    for key in SERVER_FIGURES:
        a, b = after.get(key, []), before.get(key, [])
        for q in (0.5, 0.99):
            row[f"{key}_ms_p{round(q * 100)}"] = bucket_quantile(b or [(le, 0.0) for le, _ in a], a, q)
        row[f"{key}_count"] = (a[-1][1] - (b[-1][1] if b else 0.0)) if a else 0.0
    a, b = after.get("counts", []), before.get("counts", [])
    for i, key in enumerate(SERVER_COUNTS):
        row[key] = (a[i][1] if a else 0.0) - (b[i][1] if b else 0.0)
    row["triton_compiles"] = after.get("triton", [(0, 0)])[0][1] - before.get("triton", [(0, 0)])[0][1]
    return row


def trace_window(records: list[dict], t0: float, t1: float) -> dict:
    """The engine's steps completed in [t0, t1] (its step trace: perf_counter, one clock with the client's):
    per kind (mixed: a prompt chunk among the rows) the steps a second and the mean period (completion to
    completion, ms), the share of the window's time in mixed steps, the longest period (a stall: a capture,
    a JIT compile, a big step) and the waiting queue's max."""
    steps = [r for r in records if t0 <= r["completed"] <= t1]
    if len(steps) < 2:
        return {}
    span = steps[-1]["completed"] - steps[0]["completed"]
    pairs = list(zip(steps, steps[1:], strict=False))
    periods = [(b["completed"] - a["completed"], b["tokens"] > b["rows"]) for a, b in pairs]
    mixed = [p for p, is_mixed in periods if is_mixed]
    decode = [p for p, is_mixed in periods if not is_mixed]
    return {
        "steps": len(steps),
        "mixed_per_s": len(mixed) / span,
        "mixed_ms": sum(mixed) * 1e3 / max(1, len(mixed)),
        "decode_ms": sum(decode) * 1e3 / max(1, len(decode)),
        "mixed_share": sum(mixed) / span,
        "longest_ms": max(p for p, _ in periods) * 1e3,
        "tokens_mixed_mean": sum(b["tokens"] for _, b in pairs if b["tokens"] > b["rows"])
        / max(1, len(mixed)),
        "rows_mean": sum(r["rows"] for r in steps) / len(steps),
        "waiting_max": max(r["waiting"] for r in steps),
    }
