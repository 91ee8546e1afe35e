"""Issue 11's server load test: graph-cache economics under mixed traffic, then a restart warmed by
the profile that traffic taught.

    python benchmarks/cache_load.py --make-qwen05b /tmp/qwen05b --clients 64 --duration 60 --out cache_load.json

Run 1 starts `graphcache serve` with its defaults (decode warmup only) and drives --clients
streaming clients for --duration seconds over prompts of mixed lengths (a few words to ~200).
It reports, over the load: graph-cache hit ratio (hits / (hits + misses): steps that could replay),
lazy captures and the distinct padded token sizes they were for, deferred misses, entries and pool
bytes, the worst and total capture stall (from /admin/cache), and the client-side latencies. Then
it exports GET /admin/cache/profile and stops the server. Run 2 starts a server with
GRAPHCACHE_WARMUP_PROFILE = that export (min_uses=0: the hot set and the warmed set) and
replays the same load: the target is no lazy capture.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package
from benchmarks.load import LoadConfig, format_summary, run_load  # noqa: E402
from benchmarks.server_check import TOKEN, admin, free_port, scrape, wait_ready  # noqa: E402

WORDS = (
    "graph",
    "cache",
    "replay",
    "capture",
    "block",
    "token",
    "batch",
    "stream",
    "decode",
    "prefill",
    "kernel",
    "pool",
    "budget",
    "warmup",
    "profile",
    "eviction",
    "scheduler",
    "request",
    "latency",
    "throughput",
)
MiB = 1 << 20


def mixed_prompts(n: int, seed: int) -> tuple[str, ...]:
    """n prompts whose lengths spread over two orders of magnitude (log-uniform, 3 to ~200 words, about
    5 to 600 tokens with the embedded tokenizer)."""
    rng = random.Random(seed)
    return tuple(" ".join(rng.choice(WORDS) for _ in range(int(3 * 70 ** rng.random()))) for _ in range(n))


def start_server(model: Path | None, port: int, log: Path, extra_env: dict[str, str]) -> subprocess.Popen:
    """`graphcache serve` on `model` (None: the embedded tiny model)."""
    env = dict(
        os.environ,
        GRAPHCACHE_PORT=str(port),
        GRAPHCACHE_ADMIN_TOKEN=TOKEN,
        GRAPHCACHE_LOG_LEVEL="info",
        **extra_env,
    )
    if model is not None:
        env["GRAPHCACHE_MODEL"] = str(model)
    return subprocess.Popen(
        [sys.executable, "-m", "graphcache.cli", "serve"],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def one_run(args, name: str, extra_env: dict[str, str], prompts: tuple[str, ...]) -> tuple[dict, dict]:
    port = free_port()
    t0 = time.perf_counter()
    proc = start_server(args.model, port, args.log_dir / f"cache_load_{name}.log", extra_env)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            ready_s = wait_ready(client, proc, log_name=str(args.log_dir / f"cache_load_{name}.log"))
            before_cache, before = admin(client, "GET", "/admin/cache"), scrape(client)
            load = asyncio.run(
                run_load(
                    LoadConfig(
                        url=f"http://127.0.0.1:{port}",
                        concurrency=args.clients,
                        duration_s=args.duration,
                        max_tokens=args.max_tokens,
                        mode="stream",
                        prompts=prompts,
                    )
                )
            )
            summary = load.summary()
            print(f"--- {name}\n{format_summary(summary)}", flush=True)
            cache, after = admin(client, "GET", "/admin/cache"), scrape(client)
            # min_uses=0: the learned hot set plus what warmup captured and traffic has not used yet
            profile = admin(client, "GET", "/admin/cache/profile?min_uses=0")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    s, s0 = cache["stats"], before_cache["stats"]
    hits, misses = s["hits"] - s0["hits"], s["misses"] - s0["misses"]
    warmed = {e["descriptor"] for e in before_cache["entries"]}
    lazy = [e for e in cache["entries"] if e["descriptor"] not in warmed]
    row = {
        "run": name,
        "ready_s": round(ready_s, 2),
        "startup_s": round(time.perf_counter() - t0, 2),
        "warmup_entries": len(warmed),
        "requests": summary["completed"],
        "errors": summary["errors"],
        "output_tok_s": summary["output_tok_s"],
        "ttft_p50_s": summary["ttft_s"]["p50"],
        "ttft_p99_s": summary["ttft_s"]["p99"],
        "tpot_p50_s": summary["tpot_s"]["p50"],
        "tpot_p99_s": summary["tpot_s"]["p99"],
        "hits": hits,
        "misses": misses,
        "hit_ratio": hits / max(1, hits + misses),
        "steps_replay": delta("graphcache_steps_total{mode=replay}"),
        "steps_eager": delta("graphcache_steps_total{mode=eager}"),
        "lazy_captures": s["lazy_captures"] - s0["lazy_captures"],
        "lazy_token_sizes": sorted({int(e["descriptor"].split(":")[0]) for e in lazy}),
        "deferred": s["deferred"] - s0["deferred"],
        "stall_seconds": s["stall_seconds"] - s0["stall_seconds"],
        "worst_stall_s": s["worst_stall_seconds"],
        "entries": cache["totals"]["entries"],
        "pool_mib": cache["totals"]["pool_bytes"] / MiB,
        "allocator_pool_mib": cache["allocator_pool_bytes"] / MiB,
    }
    print(json.dumps(row), flush=True)
    return row, profile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--make-qwen05b", type=Path, metavar="DIR")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="extra server env, both runs"
    )
    ap.add_argument("--log-dir", type=Path, default=Path("."))
    ap.add_argument("--out", type=Path, default=Path("cache_load.json"))
    args = ap.parse_args()
    if args.make_qwen05b:
        from benchmarks.offline_throughput import make_qwen05b

        mk = args.make_qwen05b
        args.model = mk if (mk / "config.json").exists() else make_qwen05b(mk)
    base_env = {"GRAPHCACHE_MAX_NUM_SEQS": str(args.clients), **dict(kv.split("=", 1) for kv in args.env)}
    prompts = mixed_prompts(args.prompts, seed=0)
    first, profile = one_run(args, "learn", base_env, prompts)
    profile_path = args.log_dir / "cache_load_profile.json"
    profile_path.write_text(json.dumps(profile, indent=1))
    second, _ = one_run(
        args, "profile", {**base_env, "GRAPHCACHE_WARMUP_PROFILE": str(profile_path.resolve())}, prompts
    )
    rows = [first, second]
    cols = [
        "run",
        "startup_s",
        "warmup_entries",
        "requests",
        "errors",
        "output_tok_s",
        "hit_ratio",
        "lazy_captures",
        "deferred",
        "worst_stall_s",
        "stall_seconds",
        "entries",
        "pool_mib",
    ]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    print(
        "lazy token sizes (run 1):", first["lazy_token_sizes"], "- distinct:", len(first["lazy_token_sizes"])
    )
    args.out.write_text(
        json.dumps({"command": " ".join(sys.argv), "rows": rows, "profile": profile}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
