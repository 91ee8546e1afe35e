"""Prefix-caching burst: many requests sharing one long system prompt, prefix caching on vs off.

--requests (256) requests, each a --prefix-tokens (1000) token shared prefix plus a short distinct
suffix (--suffix-min..--suffix-max random token ids, seed 0), --max-tokens greedy output tokens with
ignore_eos, all submitted at once to an in-process Engine (as benchmarks/offline_throughput.py builds
it), once with enable_prefix_caching on and once off (same workload, fresh engine each). Per run:

  prefill computed   prompt tokens the engine ran the model on: sum(prompt - num_cached_tokens) over
                     the requests' final outputs (the scheduler sets num_cached_tokens at admission)
  prefix hits/query  the block manager's counters (graphcache_prefix_cache_{hits,queries}_total)
  TTFT p50/p90       submission to the first streamed token, per request
  total s            first submission to the last request finished

  python benchmarks/prefix_burst.py --make-qwen05b /tmp/qwen05b --out prefix_burst.json   # the GPU run
  python benchmarks/prefix_burst.py --tiny --requests 16 --prefix-tokens 200 --max-tokens 8  # CPU smoke
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "service"))  # the graphcache package

import torch  # noqa: E402
from graphcache.config import Settings  # noqa: E402
from graphcache.engine.loop.engine import Engine, SamplingParams  # noqa: E402
from graphcache.metrics import Metrics  # noqa: E402

from benchmarks.offline_throughput import make_qwen05b  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    hi = min(vocab, 10000) - 1  # low ids: every vocab has them, and a random model never sees specials
    prefix = [rng.randint(0, hi) for _ in range(args.prefix_tokens)]
    return [
        prefix + [rng.randint(0, hi) for _ in range(rng.randint(args.suffix_min, args.suffix_max))]
        for _ in range(args.requests)
    ]


def counter(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


async def burst(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    # Warm the engine (first step costs, lazy init) on a prompt that shares nothing with the burst.
    async for _ in engine.generate(
        "warm", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True)
    ):
        pass

    async def one(i: int) -> dict:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        ttft, tokens, cached = None, [], 0
        async for out in engine.generate(f"p{i}", prompts[i], params):
            if ttft is None and out.token_ids:
                ttft = time.perf_counter() - t0
            tokens.extend(out.token_ids)
            cached = max(cached, out.num_cached_tokens or 0)
            if out.finished and out.finish_reason != "length":
                raise RuntimeError(f"request {i} finished with {out.finish_reason}: {out.error}")
        return {"ttft": ttft, "tokens": tokens, "cached": cached}

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return {"seconds": time.perf_counter() - t0, "results": results}


def run(args, prefix_caching: bool, prompts_for) -> dict:
    settings = Settings(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        enforce_eager=args.eager,
        enable_prefix_caching=prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_queue=max(args.requests, 1024),
        **({"cache_dir": args.cache_dir} if args.cache_dir else {}),
    )
    metrics = Metrics()
    engine = Engine(settings, metrics)
    engine.start()
    if not engine.wait_ready(1800):
        raise RuntimeError(f"engine failed: {engine.error}")
    try:
        prompts = prompts_for(engine.runner.vocab_size)
        q0 = counter(metrics, "graphcache_prefix_cache_queries_total")
        h0 = counter(metrics, "graphcache_prefix_cache_hits_total")
        b = asyncio.run(burst(engine, prompts, args.max_tokens))
        queries = counter(metrics, "graphcache_prefix_cache_queries_total") - q0
        hits = counter(metrics, "graphcache_prefix_cache_hits_total") - h0
        stats = engine.stats()
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    res = b["results"]
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(r["cached"] for r in res)
    ttft = [r["ttft"] * 1e3 for r in res if r["ttft"] is not None]
    return {
        "prefix_caching": prefix_caching,
        "requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "prefill_computed_tokens": prompt_tokens - cached,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "ttft_ms_p50": pct(ttft, 0.5),
        "ttft_ms_p90": pct(ttft, 0.9),
        "seconds": b["seconds"],
        "output_tokens": sum(len(r["tokens"]) for r in res),
        "preemptions": stats.get("preemptions"),
        "outputs": [r["tokens"] for r in res],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="Hugging Face model directory")
    ap.add_argument(
        "--make-qwen05b", type=Path, metavar="DIR", help="write (once) and use a Qwen2.5-0.5B-shaped model"
    )
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model (CPU smoke runs)")
    ap.add_argument(
        "--cache-dir", type=Path, help="where the embedded tiny model is written (default: Settings')"
    )
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--suffix-min", type=int, default=8)
    ap.add_argument("--suffix-max", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="on,off", help="comma list of on, off (prefix caching)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no graphs)")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", type=Path, help="write results as JSON here")
    args = ap.parse_args(argv)
    if args.make_qwen05b:
        exists = (args.make_qwen05b / "config.json").exists()
        args.model = args.model or (args.make_qwen05b if exists else make_qwen05b(args.make_qwen05b))
    if args.model is None and not args.tiny:
        ap.error("--model DIR, --make-qwen05b DIR or --tiny")
    if args.tiny and args.max_model_len > 512:
        args.max_model_len = None  # the embedded model's own limit
    if args.tiny:
        args.max_num_batched_tokens = min(args.max_num_batched_tokens, 1024)

    prompts_cache: dict[int, list[list[int]]] = {}

    def prompts_for(vocab: int) -> list[list[int]]:  # one workload for every mode
        return prompts_cache.setdefault(vocab, workload(args, vocab))

    rows = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        print(f"running prefix caching {mode} ...", file=sys.stderr, flush=True)
        rows.append(run(args, mode == "on", prompts_for))
    print(
        f"\n{args.requests} requests x ({args.prefix_tokens} shared + {args.suffix_min}-{args.suffix_max} own) "
        f"prompt tokens, {args.max_tokens} output tokens each"
    )
    print(
        "| prefix caching | prefill computed | cached | prefix hits / queries | TTFT p50 ms | TTFT p90 ms | total s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {'on' if r['prefix_caching'] else 'off'} | {r['prefill_computed_tokens']} | {r['cached_tokens']} "
            f"| {r['prefix_cache_hits']:.0f} / {r['prefix_cache_queries']:.0f} | {r['ttft_ms_p50']:.1f} "
            f"| {r['ttft_ms_p90']:.1f} | {r['seconds']:.2f} |"
        )
    same = None
    if len(rows) == 2:
        same = rows[0]["outputs"] == rows[1]["outputs"]
        print(f"greedy outputs equal with and without prefix caching: {same}")
    if args.out:
        meta = {
            "model": str(args.model or "embedded tiny"),
            "requests": args.requests,
            "prefix_tokens": args.prefix_tokens,
            "suffix": [args.suffix_min, args.suffix_max],
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            "eager": args.eager,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
        }
        results = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
        args.out.write_text(json.dumps({"meta": meta, "results": results, "outputs_equal": same}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
