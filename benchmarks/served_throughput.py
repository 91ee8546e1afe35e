"""Served throughput: the offline benchmark's workload sent to `graphcache serve` over HTTP.

Starts `python -m graphcache serve` on a Qwen2.5-0.5B-shaped random checkpoint (the engine exactly as
a user runs it), waits for /ready, then:
  burst   the 256 requests of benchmarks/offline_throughput.py (token-id prompts 100-1024, outputs
          100-1024, ignore_eos, greedy) all at once, streaming; output tok/s = completion tokens of
          every request / wall time from the first send to the last [DONE];
  clients --clients closed-loop streaming clients for --duration s, each request 256 prompt tokens
          and 128 output tokens.
Per run: output tok/s, TTFT and TPOT p50/p99 (TPOT = (last token time - first token time) /
(tokens - 1) per request), errors (a request that did not end with exactly its max_tokens counts),
and the CPU the server used: cores busy in the server (API) process and in its children (the engine
process with GRAPHCACHE_ENGINE_PROCESS=true), from /proc: a process near 1.0 is what limits the run.
--py-spy-dir DIR adds a profiled burst: py-spy samples both processes (collapsed stacks, and the top
functions by own samples in DIR/py_spy_top.txt).
The client parses only what it needs (usage and the delta's token count come from the last chunk)
and runs in --client-procs processes (a single Python client cannot parse 256 busy streams), all
sending from one agreed start time, so it is not what limits the server.

  python benchmarks/served_throughput.py --make-qwen05b /tmp/qwen05b --out served.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "service"))  # the graphcache package

from benchmarks import step_trace  # noqa: E402
from benchmarks.model_shapes import add_model_args, resolve_model  # noqa: E402
from benchmarks.open_loop_server import bucket_quantile  # noqa: E402


def workload(*args, **kwargs):
    # Imported here: the burst's spawned workers import this module, and offline_throughput imports torch.
    from benchmarks.offline_throughput import workload as offline_workload

    return offline_workload(*args, **kwargs)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all threads (/proc/PID/stat fields 14-15); 0 once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


# The server's own latency histograms (engine clock: arrival -> first token appended; per request, the mean
# time between its output tokens), beside the client's (its first SSE chunk: the server streams every
# token, also one with no text, so on a random checkpoint too the first chunk is the first token's).
SERVER_HISTOGRAMS = {
    "ttft": "graphcache_time_to_first_token_seconds",
    "tpot": "graphcache_time_per_output_token_seconds",
}


# Counters whose increments over a run it reports: the graph cache's replays and misses (its hit ratio), the
# draft model's own graph cache's (0 without a draft model), and speculative decoding's drafts (0 without
# --speculative-config).
SERVER_COUNTERS = {
    "graph_hits": "graphcache_graph_cache_hits",
    "graph_misses": "graphcache_graph_cache_misses",
    "draft_graph_hits": "graphcache_draft_graph_cache_hits",
    "draft_graph_misses": "graphcache_draft_graph_cache_misses",
    "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


def server_buckets(url: str) -> dict[str, list[tuple[float, float]]]:
    """{ttft|tpot: [(upper bound s, cumulative count)]} and {counter key: [(0, total)]} from GET /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for key, name in SERVER_HISTOGRAMS.items():
            if family.name == name:
                out[key] = sorted(
                    (float(x.labels["le"]), x.value) for x in family.samples if x.name.endswith("_bucket")
                )
        for key, name in SERVER_COUNTERS.items():
            if family.name == name:
                out[key] = [(0.0, sum(x.value for x in family.samples if x.name.endswith("_total")))]
    return out


def measured(run, pid: int, url: str) -> dict:
    """run() -> summary dict, plus the CPU cores busy in the server process and in its children over the
    run's own seconds (the burst's client start-up is idle time for the server), the run's window on the
    monotonic clock (perf_counter: the same clock as the engine's step trace), and the server-side TTFT and
    TPOT p50 / p99 of the requests that finished in it."""
    kids = children(pid)
    before = cpu_seconds(pid), [cpu_seconds(k) for k in kids]
    hist0 = server_buckets(url)
    t0 = time.perf_counter()
    row = run()
    row["window"] = (t0, time.perf_counter())
    row["api_cpu"] = (cpu_seconds(pid) - before[0]) / row["seconds"]
    row["children_cpu"] = (
        sum(cpu_seconds(k) - b for k, b in zip(kids, before[1], strict=True)) / row["seconds"]
    )
    hist1 = server_buckets(url)
    for key in SERVER_HISTOGRAMS:
        for q in (0.5, 0.99):
            row[f"server_{key}_ms_p{round(q * 100)}"] = bucket_quantile(
                hist0.get(key, []), hist1.get(key, []), q
            )
    for key in SERVER_COUNTERS:
        row[key] = hist1.get(key, [(0.0, 0.0)])[0][1] - hist0.get(key, [(0.0, 0.0)])[0][1]
    steps = row["graph_hits"] + row["graph_misses"]
    row["graph_hit_ratio"] = row["graph_hits"] / steps if steps else float("nan")
    steps = row["draft_graph_hits"] + row["draft_graph_misses"]
    row["draft_graph_hit_ratio"] = row["draft_graph_hits"] / steps if steps else float("nan")
    return row


def py_spy_top(paths: list[Path], out: Path, top: int = 40) -> None:
    """Own samples per function (the leaf frame of each collapsed stack), and samples that include it."""
    from collections import Counter

    lines = []
    for path in paths:
        own, incl, total = Counter(), Counter(), 0
        if not path.exists():
            lines.append(f"== {path.name}: no samples (py-spy failed?)")
            continue
        for line in path.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not n.isdigit():
                continue
            frames = stack.split(";")
            total += int(n)
            own[frames[-1]] += int(n)
            for f in set(frames):
                incl[f] += int(n)
        lines.append(f"== {path.name}: {total} samples; own")
        lines += [f"{n / max(total, 1):6.1%}  {f}" for f, n in own.most_common(top)]
        lines.append(f"== {path.name}: inclusive")
        lines += [f"{n / max(total, 1):6.1%}  {f}" for f, n in incl.most_common(top)]
    out.write_text("\n".join(lines) + "\n")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    usage = None
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if line == "data: [DONE]":
                break
            if first is None:
                first = now
            last = now
            chunks += 1
            if '"usage": {' in line:
                usage = json.loads(line[6:])["usage"]
    ok = usage is not None and usage["completion_tokens"] == max_tokens
    tokens = usage["completion_tokens"] if usage else 0
    return {
        "ok": ok,
        "tokens": tokens,
        "ttft": (first or t0) - t0,
        "chunks": chunks,
        "span": (last - first) if first and last else 0.0,
        "tpot": ((last - first) / (tokens - 1)) if first and last and tokens > 1 else None,
        "error": None if ok else f"usage {usage}",
    }


def summary(name: str, results: list[dict], seconds: float) -> dict:
    good = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in good)
    ttft = [r["ttft"] * 1e3 for r in good]
    tpot = [r["tpot"] * 1e3 for r in good if r["tpot"] is not None]
    return {
        "run": name,
        "requests": len(results),
        "errors": len(results) - len(good),
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "ttft_ms_p50": pct(ttft, 0.5),
        "ttft_ms_p99": pct(ttft, 0.99),
        "tpot_ms_p50": pct(tpot, 0.5),
        "tpot_ms_p99": pct(tpot, 0.99),
        "chunks_p50": pct([r["chunks"] for r in good], 0.5),
        "first_to_last_s_p50": pct([r["span"] for r in good], 0.5),
        "first_errors": [r["error"] for r in results if not r["ok"]][:3],
    }


_start_barrier = None  # set in each burst worker by _init_worker


def _init_worker(barrier) -> None:
    global _start_barrier
    _start_barrier = barrier


async def _burst_part(url: str, prompts, outputs) -> list[dict]:
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        # Everything that takes time (the interpreter, imports, the client) is ready: wait for the others.
        _start_barrier.wait()
        results = await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, outputs, strict=True)))
        for r in results:
            r["end"] = time.time()
        return list(results)


def _burst_worker(job: tuple) -> list[dict]:
    url, prompts, outputs = job
    return asyncio.run(_burst_part(url, prompts, outputs))


def burst(url: str, prompts, outputs, procs: int) -> dict:
    """All requests at once, split over `procs` client processes that start sending together: each worker
    waits at a barrier once it is ready, and the clock starts when the last one is. (Before 2026-12-01 the
    workers started at a fixed time 3 s after they were spawned; on the H200 box some were still importing
    then, and the engine's step trace showed the requests arriving in three waves over 1.2 s.)"""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(procs + 1)
    jobs = [(url, prompts[i::procs], outputs[i::procs]) for i in range(procs)]
    # One job per worker: each blocks at the barrier until all are there, so none can take a second job.
    with ctx.Pool(procs, initializer=_init_worker, initargs=(barrier,)) as pool:
        pending = pool.map_async(_burst_worker, jobs)
        barrier.wait(timeout=120)
        start = time.time()
        results = [r for part in pending.get() for r in part]
    seconds = max(r.get("end", start) for r in results) - start
    return summary(f"burst {len(prompts)} streaming", results, seconds)


async def clients(url: str, n: int, duration: float, vocab: int) -> dict:
    prompts, _ = workload(n * 4, vocab, (256, 256), (128, 128), seed=1)
    results: list[dict] = []
    deadline = time.perf_counter() + duration
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def loop(i: int) -> None:
            k = 0
            while time.perf_counter() < deadline:
                results.append(await one(client, prompts[(i + k * n) % len(prompts)], 128))
                k += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(loop(i) for i in range(n)))
        return summary(f"{n} streaming clients", results, time.perf_counter() - t0)


def profiled_burst(args, url: str, prompts, outputs, pid: int) -> dict:
    """The burst again, with py-spy sampling the server process and each child for its first 8 s."""
    args.py_spy_dir.mkdir(parents=True, exist_ok=True)
    paths, spies = [], []
    for name, p in [("api", pid), *((f"child{k}", c) for k, c in enumerate(children(pid)))]:
        paths.append(args.py_spy_dir / f"py_spy_{name}.txt")
        spies.append(
            subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "--pid",
                    str(p),
                    "--duration",
                    "8",
                    "--rate",
                    "250",
                    "--format",
                    "raw",
                    "--nonblocking",
                    "--gil",
                    "--nolineno",
                    "--output",
                    str(paths[-1]),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
    row = measured(lambda: burst(url, prompts, outputs, args.client_procs), pid, url)
    for spy in spies:
        spy.wait(60)
    py_spy_top(paths, args.py_spy_dir / "py_spy_top.txt")
    row["run"] += " (py-spy)"
    return row


@contextlib.contextmanager
def running_server(model: Path, port: int, log: Path, max_num_seqs: int = 256, max_model_len: int = 4096):
    """`python -m graphcache serve` on `model` with the offline benchmark's engine settings (GRAPHCACHE_* in the
    environment override them), ready (/ready 200): yields (process, base url, step trace path). The engine's
    step trace is written to log.steps.jsonl when the server stops. The server imports this tree's graphcache."""
    trace_path = log.with_suffix(".steps.jsonl")
    trace_path.unlink(missing_ok=True)
    env = {
        "GRAPHCACHE_MODEL": str(model),
        # max_num_seqs 0: the server's own default (512 on an H200, config.py's LARGE_GPU_DEFAULTS)
        **({"GRAPHCACHE_MAX_NUM_SEQS": str(max_num_seqs)} if max_num_seqs else {}),
        "GRAPHCACHE_MAX_NUM_BATCHED_TOKENS": "8192",
        "GRAPHCACHE_MAX_MODEL_LEN": str(max_model_len),
        "GRAPHCACHE_LOG_LEVEL": "warning",
        "GRAPHCACHE_STEP_TRACE": str(trace_path.resolve()),
        **os.environ,
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "service"), env.get("PYTHONPATH")) if p)
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "graphcache", "serve", "--port", str(port)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"server exited or not ready in 600 s: see {log}")
            time.sleep(1)
        yield proc, url, trace_path
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=8, help="client processes for the burst")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--log", type=Path, default=Path("served_server.log"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--py-spy-dir", type=Path, help="add a burst profiled by py-spy (needs py-spy on PATH)")
    args = ap.parse_args()
    args.model = resolve_model(args)
    model = args.model
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    with running_server(model, args.port, args.log) as (proc, url, trace_path):
        prompts, outputs = workload(args.num_seqs, vocab, (100, 1024), (100, 1024), seed=0)
        burst(url, prompts[:4], [8] * 4, 2)  # warm: first requests, HTTP stack
        rows = [
            measured(lambda: burst(url, prompts, outputs, args.client_procs), proc.pid, url),
            measured(lambda: asyncio.run(clients(url, args.clients, args.duration, vocab)), proc.pid, url),
        ]
        if args.py_spy_dir is not None:
            rows.append(profiled_burst(args, url, prompts, outputs, proc.pid))
    print(
        f"\n{'run':<24}{'tok/s':>9}{'reqs':>6}{'err':>5}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}"
        f"{'chunks p50':>11}{'span p50 s':>11}{'API cpu':>9}{'child cpu':>10}"
    )
    for r in rows:
        print(
            f"{r['run']:<24}{r['tokens_per_s']:>9.0f}{r['requests']:>6}{r['errors']:>5}{r['ttft_ms_p50']:>10.0f}"
            f"{r['ttft_ms_p99']:>8.0f}{r['tpot_ms_p50']:>10.2f}{r['tpot_ms_p99']:>8.2f}{r['chunks_p50']:>11}"
            f"{r['first_to_last_s_p50']:>11.2f}{r['api_cpu']:>9.2f}{r['children_cpu']:>10.2f}"
        )
    print("\nserver-side latency (its /metrics histograms, interpolated within buckets; ms) and graph cache:")
    print(
        "| run | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | graph hits | misses | hit ratio | draft model's "
        "hit ratio | draft tokens | accepted |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['run']} | {r['server_ttft_ms_p50']:.0f} | {r['server_ttft_ms_p99']:.0f} | "
            f"{r['server_tpot_ms_p50']:.2f} | {r['server_tpot_ms_p99']:.2f} | {r['graph_hits']:.0f} | "
            f"{r['graph_misses']:.0f} | {r['graph_hit_ratio']:.4f} | {r['draft_graph_hit_ratio']:.4f} | "
            f"{r['spec_draft_tokens']:.0f} | "
            f"{r['spec_accepted_tokens']:.0f} |"
        )
    if trace_path.exists():
        records = step_trace.load(trace_path)
        traced = {r["run"]: step_trace.summarize(records, *r["window"]) for r in rows}
        for r in rows:
            r["trace"] = traced[r["run"]]
        print("\nengine step trace (benchmarks/step_trace.py; ms per step):")
        print(step_trace.table({k: v for k, v in traced.items() if v}))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
