"""The real server, end to end, on whatever device is there (run on the H200 by scripts/gpu_check.sh).

    python benchmarks/server_check.py --make-qwen05b /tmp/qwen05b --out server_check.json

Starts `graphcache serve` on a loopback port, waits for /ready, runs the bounded load generator
(benchmarks/load.py: streaming + non-streaming, completions + chat, exact token counts), then
checks what an operator would: the graph metrics moved, the pool-bytes gauge equals the graph-pool
bytes measured from the allocator inside the server (/admin/cache `allocator_pool_bytes`),
admin warmup and clear change both, and SIGTERM exits cleanly. Prints a table; JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package
from benchmarks.load import LoadConfig, format_summary, run_load  # noqa: E402

TOKEN = "server-check-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(client: httpx.Client) -> dict[str, float]:
    """Flat {name{labels}: value} of every sample on /metrics."""
    out = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def admin(client: httpx.Client, method: str, path: str, body: dict | None = None) -> dict:
    r = client.request(method, path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300)
    r.raise_for_status()
    return r.json()


def wait_ready(
    client: httpx.Client, proc: subprocess.Popen, limit_s: float = 400, log_name: str = "its log"
) -> float:
    """Poll /ready (503 until the model is loaded and warmup is done); seconds waited. Exits if the server does."""
    t0 = time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited early (rc={proc.returncode}); see {log_name}")
        try:
            if client.get("/ready").status_code == 200:
                return time.perf_counter() - t0
        except httpx.TransportError:
            pass
        if time.perf_counter() - t0 > limit_s:
            raise SystemExit(f"server not ready after {limit_s:g} s")
        time.sleep(0.25)


def pool_check(client: httpx.Client, label: str) -> dict:
    cache = admin(client, "GET", "/admin/cache")
    m = scrape(client)
    row = {
        "when": label,
        "entries": cache["totals"]["entries"],
        "gauge_entries": m["graphcache_graph_cache_entries"],
        "cache_bytes": cache["totals"]["pool_bytes"],
        "gauge_bytes": m["graphcache_graph_pool_bytes"],
        "allocator_bytes": cache.get("allocator_pool_bytes"),
    }
    row["gauge_equals_allocator"] = (
        row["allocator_bytes"] is not None and row["gauge_bytes"] == row["allocator_bytes"]
    )
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: the embedded tiny model)")
    ap.add_argument(
        "--make-qwen05b", type=Path, metavar="DIR", help="write a Qwen2.5-0.5B-shaped random model"
    )
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("server_check.json"))
    ap.add_argument("--log", type=Path, default=Path("server.log"))
    args = ap.parse_args()

    model = args.model
    if args.make_qwen05b:
        from benchmarks.offline_throughput import make_qwen05b

        model = (
            args.make_qwen05b
            if (args.make_qwen05b / "config.json").exists()
            else make_qwen05b(args.make_qwen05b)
        )
    port = free_port()
    env = dict(
        os.environ,
        GRAPHCACHE_PORT=str(port),
        GRAPHCACHE_ADMIN_TOKEN=TOKEN,
        GRAPHCACHE_MAX_NUM_SEQS="64",
        GRAPHCACHE_LOG_LEVEL="info",
        GRAPHCACHE_CACHE_DIR=str(Path("/tmp/graphcache-check")),
    )
    if model:
        env["GRAPHCACHE_MODEL"] = str(model)
    log = args.log.open("w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "graphcache.cli", "serve"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    result: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d", time.gmtime())}
    try:
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=30) as client:
            wait_ready(client, proc, log_name=str(args.log))
            result["ready_s"] = time.perf_counter() - t0
            rows = [pool_check(client, "after warmup")]
            before = scrape(client)
            report = asyncio.run(
                run_load(
                    LoadConfig(
                        url=base,
                        concurrency=args.concurrency,
                        duration_s=args.duration,
                        max_tokens=args.max_tokens,
                    )
                )
            )
            summary = report.summary()
            print(format_summary(summary))
            after = scrape(client)
            rows.append(pool_check(client, "after load"))
            moved = {
                k: after.get(k, 0) - before.get(k, 0)
                for k in (
                    "graphcache_graph_cache_hits_total",
                    "graphcache_graph_cache_misses_total",
                    "graphcache_steps_total{mode=replay}",
                    "graphcache_steps_total{mode=eager}",
                    "graphcache_graph_captures_total",
                    "graphcache_generation_tokens_total",
                    "graphcache_requests_finished_total{reason=length}",
                )
            }
            warm = admin(client, "POST", "/admin/warmup", {"descriptors": ["256:8", "128:4"]})
            rows.append(pool_check(client, "after admin warmup 256:8,128:4"))
            clear = admin(client, "POST", "/admin/clear")
            rows.append(pool_check(client, "after admin clear"))
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        result.update(
            load=summary,
            metric_deltas=moved,
            pool_checks=rows,
            admin_warmup=warm,
            admin_clear=clear,
            sigterm_rc=rc,
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    print("\n| when | entries (cache/gauge) | pool bytes cache | gauge | allocator | gauge == allocator |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['when']} | {r['entries']}/{r['gauge_entries']:.0f} | {r['cache_bytes']} | {r['gauge_bytes']:.0f} "
            f"| {r['allocator_bytes']} | {r['gauge_equals_allocator']} |"
        )
    print("\nmetric deltas during load:", json.dumps(moved))
    print(f"ready after {result['ready_s']:.1f} s; SIGTERM exit code {rc}")
    args.out.write_text(json.dumps(result, indent=2, default=str))
    ok = summary["errors"] == 0 and rc == 0 and all(r["gauge_equals_allocator"] for r in rows)
    print("SERVER CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
