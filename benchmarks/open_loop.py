"""Open-loop serving: Poisson arrivals at fixed request rates, latency percentiles and goodput per rate.

What `vllm bench serve --request-rate R` reports, against `graphcache serve` (started as
benchmarks/served_throughput.py starts it: its engine settings, /ready, step trace). Per rate, the
realistic workload of benchmarks/workloads.py (lognormal prompt and output lengths, temperature 0.8,
top_p 0.95, a quarter seeded, ignore_eos) is sent with exponential gaps at R requests/s (inf: all at
once), each request streamed; a fresh seed per rate, so no rate hits another's prompts in the prefix
cache. Reported per rate, one table row:
  req/s      finished requests / (last response end - first send)
  out tok/s  completion tokens / the same span
  TTFT       send -> first chunk carrying a token (p50, p99, ms)
  TPOT       (last token chunk - first token chunk) / (tokens - 1), per request (p50, p99, ms)
  ITL        gap between token chunks, spread over the chunk's tokens, per token (p50, p99, ms)
  goodput    requests/s that met the SLO (TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms)
  errors     requests that failed or did not end with exactly their max_tokens (0 expected)
plus the server's own TTFT / TPOT p50 / p99 (its /metrics histograms over the rate's window).
Every request asks for logprobs=0 by default: on a random checkpoint most sampled ids are past the
tokenizer's 1024 and decode to no text, and the server sends no chunk for a delta without text or
logprobs, so without them the client would see a request's first token late and ITL not at all
(--logprobs -1 turns them off; the server then also skips the log_softmax). Chunks are the server's
stream interval apart (settings.engine.stream_interval_ms), so ITL is that interval's granularity.
One client process (asyncio + httpx): at the highest rates its JSON parsing adds to the latencies it
measures; served_throughput.py's burst is the fair saturation figure.

  python benchmarks/open_loop.py --make-model qwen05b:/tmp/qwen05b --rates 2,8,32,inf --out open_loop.json
  python benchmarks/open_loop.py --smoke           # tiny model on the CPU, a handful of requests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "service"))  # the graphcache package

from benchmarks import workloads  # noqa: E402
from benchmarks.model_shapes import add_model_args, resolve_model  # noqa: E402
from benchmarks.served_throughput import measured, pct, running_server  # noqa: E402


async def one(client: httpx.AsyncClient, req: workloads.Request, send_at: float, logprobs: int) -> dict:
    """Sleep until send_at (perf_counter), stream the request; per-token-chunk arrival times."""
    await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
    body = {
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if req.seed is not None:
        body["seed"] = req.seed
    if logprobs >= 0:
        body["logprobs"] = logprobs
    t0 = time.perf_counter()
    times, counts, usage = [], [], None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}", "end": t0}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices") or ())
                if n:
                    times.append(now)
                    counts.append(n)
    except httpx.HTTPError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "end": time.perf_counter()}
    tokens = usage["completion_tokens"] if usage else 0
    ok = tokens == req.max_tokens and sum(counts) == tokens
    itl = [(b - a) / n for a, b, n in zip(times, times[1:], counts[1:], strict=False) for _ in range(n)]
    return {
        "ok": ok,
        "tokens": tokens,
        "start": t0,
        "end": time.perf_counter(),
        "ttft": times[0] - t0 if times else math.nan,
        "tpot": (times[-1] - times[0]) / (tokens - 1) if times and tokens > 1 else math.nan,
        "itl": itl,
        "error": None if ok else f"{tokens} tokens ({sum(counts)} in chunks), wanted {req.max_tokens}",
    }


async def run_rate(
    url: str, requests: list[workloads.Request], rate: float, seed: int, logprobs: int
) -> list[dict]:
    offsets = workloads.poisson_arrivals(len(requests), rate, seed)
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0), limits=limits) as client:
        t0 = time.perf_counter() + 0.05
        return list(
            await asyncio.gather(
                *(one(client, r, t0 + o, logprobs) for r, o in zip(requests, offsets, strict=True))
            )
        )


def summarize(rate: float, results: list[dict], slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    good = [r for r in results if r["ok"]]
    span = max(r["end"] for r in results) - min(r.get("start", r["end"]) for r in results)
    ms = {k: [r[k] * 1e3 for r in good if not math.isnan(r[k])] for k in ("ttft", "tpot")}
    itl = [x * 1e3 for r in good for x in r["itl"]]
    met = [
        r
        for r in good
        if r["ttft"] * 1e3 <= slo_ttft_ms and (r["tpot"] * 1e3 <= slo_tpot_ms or math.isnan(r["tpot"]))
    ]
    row = {
        "rate": rate,
        "requests": len(results),
        "errors": len(results) - len(good),
        "seconds": span,
        "req_per_s": len(good) / span,
        "output_tokens_per_s": sum(r["tokens"] for r in good) / span,
        "goodput_req_per_s": len(met) / span,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "first_errors": [r["error"] for r in results if not r["ok"]][:3],
    }
    for key, values in (*ms.items(), ("itl", itl)):
        row[f"{key}_ms_p50"], row[f"{key}_ms_p99"] = pct(values, 0.5), pct(values, 0.99)
    return row


def requests_for(args, rate: float, k: int, vocab: int) -> list[workloads.Request]:
    n = (
        args.num_requests
        if math.isinf(rate)
        else min(args.num_requests, max(args.min_requests, math.ceil(rate * args.max_seconds)))
    )
    shape = workloads.RealisticShape(prompt_cap=args.prompt_cap, output_cap=args.output_cap)
    return workloads.realistic(n, vocab, args.seed + 1 + k, shape)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument(
        "--rates",
        help="comma list of request rates (req/s); inf = all at once (default 2,8,32,inf; --smoke: 4,inf)",
    )
    ap.add_argument(
        "--num-requests", type=int, default=512, help="requests per rate at most (all of them at inf)"
    )
    ap.add_argument(
        "--max-seconds", type=float, default=60.0, help="a finite rate sends rate x this many requests"
    )
    ap.add_argument("--min-requests", type=int, default=32, help="... but at least this many")
    ap.add_argument("--prompt-cap", type=int, default=2048)
    ap.add_argument("--output-cap", type=int, default=1024)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument(
        "--logprobs", type=int, default=0, help="logprobs asked per request (-1: none; see above)"
    )
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the server's GRAPHCACHE_MAX_NUM_SEQS")
    ap.add_argument("--max-model-len", type=int, default=4096, help="the server's GRAPHCACHE_MAX_MODEL_LEN")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--log", type=Path, default=Path("open_loop_server.log"))
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the tiny model (temp dir unless --model/--make-model), "
        "rates 4,inf, 6 requests each, short prompts and outputs",
    )
    ap.add_argument("--out", type=Path)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.rates = args.rates or "4,inf"
        args.num_requests, args.min_requests, args.prompt_cap, args.output_cap = 6, 6, 96, 16
        args.max_num_seqs, args.max_model_len = 4, 512
        if not (args.model or args.make_model or args.make_qwen05b):
            args.make_model = f"tiny:{tempfile.mkdtemp(prefix='bench-smoke-')}"
    model = resolve_model(args)
    if model is None:
        raise SystemExit("--model DIR (or --make-model SHAPE:DIR, or --smoke) is required")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rates = [float(r) for r in (args.rates or "2,8,32,inf").split(",")]
    rows = []
    with running_server(model, args.port, args.log, args.max_num_seqs, args.max_model_len) as (proc, url, _):
        warm = workloads.realistic(
            4, vocab, args.seed + 10_000, workloads.RealisticShape(prompt_cap=64, output_cap=8)
        )
        asyncio.run(run_rate(url, warm, math.inf, 0, args.logprobs))  # first requests, HTTP stack
        for k, rate in enumerate(rates):
            reqs = requests_for(args, rate, k, vocab)
            print(f"rate {rate}: {workloads.describe(reqs)}", file=sys.stderr, flush=True)

            def run(rate=rate, reqs=reqs, k=k) -> dict:
                results = asyncio.run(run_rate(url, reqs, rate, args.seed + k, args.logprobs))
                return summarize(rate, results, args.slo_ttft_ms, args.slo_tpot_ms)

            rows.append(measured(run, proc.pid, url))
    print(
        f"\nopen loop, realistic workload, SLO TTFT <= {args.slo_ttft_ms:.0f} ms and TPOT <= {args.slo_tpot_ms:.0f} ms "
        f"(client-side ms; server = its /metrics histograms)"
    )
    print(
        "| rate | reqs | err | req/s | out tok/s | goodput req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
        "| ITL p50 | ITL p99 | server TTFT p50 | p99 | server TPOT p50 | p99 |"
    )
    print("|---" * 16 + "|")
    for r in rows:
        print(
            f"| {r['rate']:g} | {r['requests']} | {r['errors']} | {r['req_per_s']:.2f} | {r['output_tokens_per_s']:.0f} "
            f"| {r['goodput_req_per_s']:.2f} | {r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} | {r['tpot_ms_p50']:.2f} "
            f"| {r['tpot_ms_p99']:.2f} | {r['itl_ms_p50']:.2f} | {r['itl_ms_p99']:.2f} | {r['server_ttft_ms_p50']:.0f} "
            f"| {r['server_ttft_ms_p99']:.0f} | {r['server_tpot_ms_p50']:.2f} | {r['server_tpot_ms_p99']:.2f} |"
        )
    for r in rows:
        if r["errors"]:
            print(f"rate {r['rate']:g}: first errors {r['first_errors']}")
    if args.out:
        args.out.write_text(json.dumps({"model": str(model), "rows": rows}, indent=1, default=str))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
