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

import httpx

__all__ = ["SERVER_FIGURES", "server_histograms", "server_quantiles"]

SERVER_FIGURES = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
}


def server_histograms(url: str) -> dict[str, list[tuple[float, float]]]:
    """{figure: [(upper bound s, cumulative count)]} from GET /metrics, summed over label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {name: key for key, name in SERVER_FIGURES.items()}
    out: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        key = wanted.get(family.name)
        if key is None:
            continue
        buckets = out.setdefault(key, {})
        for x in family.samples:
            if x.name.endswith("_bucket"):
                le = float(x.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + x.value
    return {key: sorted(b.items()) for key, b in out.items()}


def _quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile over the window's bucket increments (linear within a bucket), in ms."""
    if not before:
        before = [(le, 0.0) for le, _ in after]
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
            row[f"{key}_ms_p{round(q * 100)}"] = _quantile(b, a, q)
        row[f"{key}_count"] = (a[-1][1] - (b[-1][1] if b else 0.0)) if a else 0.0
    return row
