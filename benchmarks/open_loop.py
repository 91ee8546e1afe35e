"""Open-loop serving: Poisson arrivals at fixed request rates for a window each, latencies client- and server-side.

What `vllm bench serve --request-rate R` reports, against `graphcache serve` (started as
benchmarks/served_throughput.py starts it: its engine settings, /ready, step trace). Per rate, the
realistic workload of benchmarks/workloads.py (lognormal prompt and output lengths, temperature 0.8,
top_p 0.95, a quarter seeded, ignore_eos) is sent with exponential gaps at R requests/s for --duration
seconds (R x duration requests), each request streamed; a fresh seed per window, so no window hits
another's prompts in the prefix cache.

Rates (--rates, comma list):
  R          requests/s
  sat | inf  saturation: --num-requests at once; its req/s done is the saturation rate S
  0.5x       a fraction of the last S measured in this run (so `sat,0.25x,0.5x,0.75x`)
--burst N measures every finite rate twice: as is, then after N requests sent at once with the window's
first arrival (the burst's requests are not in the window's client figures; they are in the server's).

Reported per window, one table row each:
  req/s      finished requests / (last response end - first send)
  out tok/s  completion tokens / the same span
  TTFT       send -> first chunk carrying a token (p50, p99, ms)
  TPOT       (last token chunk - first token chunk) / (tokens - 1), per request (p50, p99, ms)
  ITL        gap between token chunks, spread over the chunk's tokens, per token (p50, p99, ms)
  goodput    requests/s that met the SLO (TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms)
  errors     requests that failed or did not end with exactly their max_tokens (0 expected)
  lag        the client's event-loop lag p99 (benchmarks/open_loop_client.py): near the TTFT p99, the
             client measured itself; add --client-procs
and per window the server's own figures, its /metrics histograms diffed over the window (vLLM's names;
arrival = the engine request's creation in the API process, after tokenizing): TTFT, request TPOT, ITL,
queue (arrival -> first scheduled) and prefill (first scheduled -> first token), p50 / p99, so a client
TTFT splits into queue + prefill + delivery (client TTFT - server TTFT: HTTP, tokenizing, the way back);
and the client's TTFT per --slice-seconds slice of the window by send time (p50 / p99), so a drift or a
warmup transient shows.
The server sends a chunk for every token, its text "" while it has none (on a random checkpoint most
sampled ids are past the tokenizer's 1024 and decode to nothing), so the client sees each request's first
token when it is made without asking for logprobs (--logprobs N asks for them). Chunks are the server's
stream interval apart (settings.engine.stream_interval_ms), so ITL is that interval's granularity.

  python benchmarks/open_loop.py --make-model llama8b:/tmp/llama8b --rates sat,0.5x --duration 60 --burst 512
  python benchmarks/open_loop.py --smoke           # tiny model on the CPU, a handful of requests
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "service"))  # the graphcache package

from benchmarks import step_trace, workloads  # noqa: E402
from benchmarks.model_shapes import add_model_args, require_model, smoke_model  # noqa: E402
from benchmarks.open_loop_client import send  # noqa: E402
from benchmarks.open_loop_server import (  # noqa: E402
    SERVER_COUNTS,
    SERVER_FIGURES,
    server_histograms,
    server_quantiles,
    trace_window,
)
from benchmarks.served_throughput import children, cpu_seconds, pct, running_server  # noqa: E402


def summarize(results: list[dict], t0: float, args) -> dict:
    """The window's client-side row: rates, errors, TTFT / TPOT / ITL p50 / p99, TTFT per slice."""
    good = [r for r in results if r["ok"]]
    span = max(r["end"] for r in results) - min(r.get("start", r["end"]) for r in results)
    ms = {k: [r[k] * 1e3 for r in good if not math.isnan(r[k])] for k in ("ttft", "tpot")}
    itl = [x * 1e3 for r in good for x in r["itl"]]
    met = [
        r
        for r in good
        if r["ttft"] * 1e3 <= args.slo_ttft_ms
        and (r["tpot"] * 1e3 <= args.slo_tpot_ms or math.isnan(r["tpot"]))
    ]
    row = {
        "requests": len(results),
        "errors": len(results) - len(good),
        "seconds": span,
        "req_per_s": len(good) / span,
        "output_tokens_per_s": sum(r["tokens"] for r in good) / span,
        "goodput_req_per_s": len(met) / span,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "first_errors": [r["error"] for r in results if not r["ok"]][:3],
    }
    for key, values in (*ms.items(), ("itl", itl)):
        row[f"{key}_ms_p50"], row[f"{key}_ms_p99"] = pct(values, 0.5), pct(values, 0.99)
    slices: dict[int, list[float]] = {}
    for r in good:
        if not math.isnan(r["ttft"]):
            slices.setdefault(int((r["send_at"] - t0) // args.slice_seconds), []).append(r["ttft"] * 1e3)
    row["ttft_slices"] = [
        {
            "from_s": k * args.slice_seconds,
            "requests": len(v),
            "ttft_ms_p50": pct(v, 0.5),
            "ttft_ms_p99": pct(v, 0.99),
        }
        for k, v in sorted(slices.items())
    ]
    return row


def window(args, url: str, pid: int, vocab: int, k: int, rate: float, burst: int) -> dict:
    """One measured window: (burst requests at once, then) Poisson arrivals at `rate`; the row."""
    shape = workloads.RealisticShape(prompt_cap=args.prompt_cap, output_cap=args.output_cap)
    n = args.num_requests if math.isinf(rate) else max(args.min_requests, math.ceil(rate * args.duration))
    n = min(n, args.max_requests) if args.max_requests else n
    reqs = workloads.realistic(n, vocab, args.seed + 1 + k, shape)
    offsets = workloads.poisson_arrivals(n, rate, args.seed + k)
    extra = workloads.realistic(burst, vocab, args.seed + 50_000 + k, shape) if burst else []
    label = f"{'sat' if math.isinf(rate) else f'{rate:.3g}'}{f' +burst {burst}' if burst else ''}"
    print(f"window {label}: {workloads.describe(reqs)}", file=sys.stderr, flush=True)
    kids = children(pid)
    cpu0 = cpu_seconds(pid), sum(cpu_seconds(c) for c in kids)
    hist0 = server_histograms(url)
    results, lags, t0 = send(
        url, extra + reqs, [0.0] * burst + offsets, procs=args.client_procs, logprobs=args.logprobs
    )
    end = time.perf_counter()
    wall = end - t0  # from the first send: client processes start before it
    row = {"window": label, "rate": rate, "burst": burst, **summarize(results[burst:], t0, args)}
    row["span"] = (t0, end)
    row["burst_errors"] = sum(not r["ok"] for r in results[:burst])
    row["server"] = server_quantiles(hist0, server_histograms(url))
    row["client_lag_ms_p50"], row["client_lag_ms_p99"] = (
        pct([x * 1e3 for x in lags], 0.5),
        pct([x * 1e3 for x in lags], 0.99),
    )
    row["client_lag_ms_max"] = max(lags, default=0.0) * 1e3
    row["api_cpu"] = (cpu_seconds(pid) - cpu0[0]) / wall
    row["children_cpu"] = (sum(cpu_seconds(c) for c in kids) - cpu0[1]) / wall
    return row


def warm_mixed_env(max_tokens: int, max_num_seqs: int) -> dict[str, str]:
    """Server env capturing the mixed descriptors of the fine sizes at start (their rows: min(T, max_num_seqs),
    graphs/descriptor.py descriptor_for), with the entry budget raised so that the pin share (half of it)
    holds them and the decode sizes."""
    from graphcache.settings.graph_cache import default_capture_sizes

    sizes = [t for t in default_capture_sizes(max_tokens) if t >= 8]
    descs = ",".join(f"{t}:{min(t, max_num_seqs)}" for t in sizes)
    return {"GRAPHCACHE_WARMUP_DESCRIPTORS": descs, "GRAPHCACHE_CACHE_MAX_ENTRIES": "256"}


def write_result(args, model: Path, saturation: float | None, rows: list[dict]) -> None:
    if args.out:
        result = {
            "model": str(model),
            "saturation_req_per_s": saturation,
            "duration_s": args.duration,
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=1, default=str))


def parse_rate(spec: str, saturation: float | None) -> float:
    spec = spec.strip().lower()
    if spec in ("sat", "inf"):
        return math.inf
    if spec.endswith("x"):
        if saturation is None:
            raise SystemExit(f"rate {spec!r} is relative to saturation: put `sat` before it in --rates")
        return float(spec[:-1]) * saturation
    return float(spec)


def print_tables(rows: list[dict], args) -> None:
    print(
        f"\nopen loop, realistic workload, windows of {args.duration:g} s, SLO TTFT <= {args.slo_ttft_ms:.0f} ms and "
        f"TPOT <= {args.slo_tpot_ms:.0f} ms (client ms; lag = the client's event-loop lag p99)"
    )
    print(
        "| window | reqs | err | req/s | out tok/s | goodput req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
        "| ITL p50 | ITL p99 | lag p99 | API cpu | engine cpu |"
    )
    print("|---" * 15 + "|")
    for r in rows:
        print(
            f"| {r['window']} | {r['requests']} | {r['errors']} | {r['req_per_s']:.2f} | {r['output_tokens_per_s']:.0f} "
            f"| {r['goodput_req_per_s']:.2f} | {r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} | {r['tpot_ms_p50']:.2f} "
            f"| {r['tpot_ms_p99']:.2f} | {r['itl_ms_p50']:.2f} | {r['itl_ms_p99']:.2f} | {r['client_lag_ms_p99']:.1f} "
            f"| {r['api_cpu']:.2f} | {r['children_cpu']:.2f} |"
        )
    print("\nserver /metrics over each window (ms, p50 / p99, interpolated within buckets)")
    print("| window | " + " | ".join(SERVER_FIGURES) + " |")
    print("|---" * (len(SERVER_FIGURES) + 1) + "|")
    for r in rows:
        s = r["server"]
        cells = [f"{s[f'{k}_ms_p50']:.1f} / {s[f'{k}_ms_p99']:.1f}" for k in SERVER_FIGURES]
        print(f"| {r['window']} | " + " | ".join(cells) + " |")
    counted = (*SERVER_COUNTS, "triton_compiles")
    print(
        "\nwhat stalls every request at once, per window: lazy captures, eager vs replayed steps, Triton JIT"
    )
    print("| window | " + " | ".join(counted) + " |")
    print("|---" * (len(counted) + 1) + "|")
    for r in rows:
        print(f"| {r['window']} | " + " | ".join(f"{r['server'][k]:g}" for k in counted) + " |")
    keys = (
        "steps",
        "mixed_per_s",
        "mixed_ms",
        "decode_ms",
        "mixed_share",
        "longest_ms",
        "tokens_mixed_mean",
        "rows_mean",
        "waiting_max",
    )
    print(
        "\nthe engine's steps per window (step trace; ms completion to completion; mixed = with a prompt chunk)"
    )
    print("| window | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for r in rows:
        print(
            f"| {r['window']} | " + " | ".join(f"{r['steps'].get(k, float('nan')):.4g}" for k in keys) + " |"
        )
    print(
        f"\nclient TTFT per {args.slice_seconds:g} s slice of the window by send time (ms, p50 / p99 (requests))"
    )
    for r in rows:
        cells = [f"{s['ttft_ms_p50']:.0f}/{s['ttft_ms_p99']:.0f} ({s['requests']})" for s in r["ttft_slices"]]
        print(f"{r['window']}: " + "  ".join(cells))
    for r in rows:
        if r["errors"] or r["burst_errors"]:
            print(f"window {r['window']}: {r['burst_errors']} burst errors; first errors {r['first_errors']}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument(
        "--rates", help="comma list: req/s, sat|inf, or 0.5x of sat (default 2,8,32,inf; --smoke: 4,inf)"
    )
    ap.add_argument(
        "--num-requests", type=int, default=512, help="requests of a sat|inf window (all at once)"
    )
    ap.add_argument(
        "--duration",
        "--max-seconds",
        type=float,
        default=60.0,
        help="a finite rate's window: rate x this many requests",
    )
    ap.add_argument("--min-requests", type=int, default=32, help="... but at least this many")
    ap.add_argument("--max-requests", type=int, default=0, help="... and at most this many (0: no cap)")
    ap.add_argument(
        "--burst", type=int, default=0, help="also measure each finite rate after N requests at once"
    )
    ap.add_argument("--slice-seconds", type=float, default=10.0, help="TTFT over time: slices of the window")
    ap.add_argument(
        "--client-procs", type=int, default=1, help="client processes the requests are split over"
    )
    ap.add_argument(
        "--warm-mixed",
        type=int,
        default=0,
        metavar="T",
        help="the server captures a mixed graph of every capture size 8..T at start (GRAPHCACHE_WARMUP_DESCRIPTORS; "
        "T = its max_capture_size, 512 on an H200) instead of at their second miss while serving",
    )
    ap.add_argument("--prompt-cap", type=int, default=2048)
    ap.add_argument("--output-cap", type=int, default=1024)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument(
        "--logprobs", type=int, default=-1, help="logprobs asked per request (-1: none, as most clients)"
    )
    ap.add_argument(
        "--max-num-seqs", type=int, default=256, help="the server's GRAPHCACHE_MAX_NUM_SEQS (0: its default)"
    )
    ap.add_argument("--max-model-len", type=int, default=4096, help="the server's GRAPHCACHE_MAX_MODEL_LEN")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--log", type=Path, default=Path("open_loop_server.log"))
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the tiny model (temp dir unless --model/--make-model), rates 4,inf, 6 requests each, short prompts and outputs",
    )
    ap.add_argument("--out", type=Path)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.rates = args.rates or "4,inf"
        args.num_requests, args.min_requests, args.max_requests = 6, 6, 6  # however fast this machine is
        args.prompt_cap, args.output_cap = 96, 16
        args.max_num_seqs, args.max_model_len = 4, 512
        args.duration = min(args.duration, 2.0)
        args.slice_seconds = min(args.slice_seconds, 1.0)
        smoke_model(args)
    model = require_model(args)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    if args.warm_mixed:
        os.environ.update(warm_mixed_env(args.warm_mixed, args.max_num_seqs or 512))
    specs = (args.rates or "2,8,32,inf").split(",")
    rows: list[dict] = []
    saturation = None
    with running_server(model, args.port, args.log, args.max_num_seqs, args.max_model_len) as (
        proc,
        url,
        trace,
    ):
        warm = workloads.realistic(
            4, vocab, args.seed + 10_000, workloads.RealisticShape(prompt_cap=64, output_cap=8)
        )
        send(url, warm, [0.0] * len(warm), logprobs=args.logprobs)  # first requests, HTTP stack
        for k, spec in enumerate(specs):
            rate = parse_rate(spec, saturation)
            bursts = [0] if math.isinf(rate) or not args.burst else [0, args.burst]
            for j, burst in enumerate(bursts):
                rows.append(r := window(args, url, proc.pid, vocab, 2 * k + j, rate, burst))
                if math.isinf(rate):
                    saturation = r["req_per_s"]
                print(
                    f"window {r['window']}: {r['requests']} requests, {r['errors']} errors, TTFT p50/p99 "
                    f"{r['ttft_ms_p50']:.0f}/{r['ttft_ms_p99']:.0f} ms (server {r['server']['ttft_ms_p50']:.0f}/"
                    f"{r['server']['ttft_ms_p99']:.0f}), TPOT p50 {r['tpot_ms_p50']:.2f} ms",
                    flush=True,
                )
                write_result(args, model, saturation, rows)  # so far: a run cut short keeps its windows
    records = step_trace.load(trace) if trace.exists() else []  # written as the server stopped
    for r in rows:
        r["steps"] = trace_window(records, *r["span"])
    print_tables(rows, args)
    write_result(args, model, saturation, rows)
    return 0 if all(r["errors"] == 0 and r["burst_errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
