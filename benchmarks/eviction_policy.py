"""LRU vs GDSF eviction under a tight graph-pool byte budget, on a modelled descriptor trace.

    python benchmarks/eviction_policy.py [--descriptors 200] [--steps 20000] [--budget 0.25]
                                         [--zipf 1.0] [--seed 0] [--out eviction_policy.json]

No GPU and no sleeping: a real `GraphCache` (eager backend) replays a seeded, Zipf-skewed trace of
batch descriptors; a fake step function declares each descriptor's capture cost, the cache's
injected clock adds it up (so `capture_seconds` is the sum of modelled costs), and `measure_bytes`
gives each entry its modelled pool bytes. Every miss is admitted (admission="always"). Lazy entries get
one private pool each (lazy_pool="private"): the policies are compared where evicting an entry frees
exactly its bytes. In the default shared lazy pool an eviction frees bytes only with the pool's last
graph, so under a byte budget the choice of victim would barely matter (docs/graph-pools.md).

The model, from the H200 measurements (BENCHMARKS.md §1, §4 and docs/graph-pools.md):
- uniform-decode descriptors, batch 1, 2, 4, 8, 16, ... 512: 2-60 MiB of pool (growing with the
  batch, +-10% jitter), capture 50-120 ms (capture time barely follows the batch: 44-100 ms measured);
- mixed prefill+decode descriptors, 16-2048 tokens: 20-160 MiB (growing with the tokens, +-10%),
  capture 80-200 ms (more eager breaks per capture).
Popularity is Zipf(s) over a seeded random ranking of the descriptors. Two traces:
- stationary: one ranking for the whole trace;
- shift: the ranking is drawn anew halfway through (what was popular goes cold: tests aging).
The byte budget is a fraction of the working set (all descriptors' bytes); the entry budget is off.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package
from graphcache.choices import EVICTION_POLICIES  # noqa: E402
from graphcache.graphs.cache import GraphCache  # noqa: E402
from graphcache.graphs.capture import is_capturing  # noqa: E402
from graphcache.graphs.descriptor import BatchDescriptor  # noqa: E402
from graphcache.graphs.policy.config import CachePolicyConfig  # noqa: E402

MiB = 1 << 20
DECODE_SIZES = [1, 2, 4, *range(8, 513, 8)]  # 67 uniform-decode capture sizes
MIXED_TOKENS = [*range(16, 513, 16), 640, 768, 1024, 1536, 2048]
MIXED_REQS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def build_descriptors(n: int, rng: random.Random) -> dict[BatchDescriptor, tuple[int, float]]:
    """n descriptors -> (modelled pool bytes, modelled capture seconds)."""
    model: dict[BatchDescriptor, tuple[int, float]] = {}
    for r in DECODE_SIZES[: min(len(DECODE_SIZES), (n + 1) // 3)]:  # a third decode (all 67 for n=200)
        size = (2 + 58 * r / 512) * rng.uniform(0.9, 1.1)
        model[BatchDescriptor(r, r, True)] = (int(size * MiB), rng.uniform(0.050, 0.120))
    mixed = [(t, r) for t in MIXED_TOKENS for r in MIXED_REQS if r <= t]
    for t, r in rng.sample(mixed, n - len(model)):
        size = (20 + 140 * t / 2048) * rng.uniform(0.9, 1.1)
        model[BatchDescriptor(t, r, False)] = (int(size * MiB), rng.uniform(0.080, 0.200))
    return model


def zipf_trace(
    descs: list[BatchDescriptor], steps: int, s: float, rng: random.Random, shift: bool
) -> list[BatchDescriptor]:
    weights = [1 / (k + 1) ** s for k in range(len(descs))]
    trace: list[BatchDescriptor] = []
    for phase_steps in [steps // 2, steps - steps // 2] if shift else [steps]:
        ranked = rng.sample(descs, len(descs))  # a fresh popularity ranking
        trace += rng.choices(ranked, weights=weights, k=phase_steps)
    return trace


def replay(
    policy: str, model: dict[BatchDescriptor, tuple[int, float]], trace: list[BatchDescriptor], budget: int
) -> dict:
    clock = [0.0]

    def step(desc: BatchDescriptor) -> None:
        if is_capturing():  # the eager backend's replays call the step too: only captures cost
            clock[0] += model[desc][1]

    config = CachePolicyConfig(
        max_entries=10_000, max_bytes=budget, eviction_policy=policy, lazy_pool="private"
    )
    cache = GraphCache(
        step,
        backend="eager",
        config=config,
        measure_bytes=lambda d, pool: model[d][0],
        clock=lambda: clock[0],
    )
    t0 = time.perf_counter()
    for desc in trace:
        cache.run(desc)
    s = cache.stats()
    return {
        "policy": policy,
        "hit_ratio": s.hits / max(1, s.hits + s.misses),
        "hits": s.hits,
        "misses": s.misses,
        "captures": s.captures,
        "capture_seconds": s.capture_seconds,
        "evictions": sum(s.evictions.values()),
        "refused": sum(s.failures.values()),
        "entries_at_end": s.entries,
        "pool_bytes_at_end": s.pool_bytes,
        "wall_seconds": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--descriptors", type=int, default=200)
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--budget", type=float, default=0.25, help="byte budget as a fraction of the working set")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent s of descriptor popularity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the results as JSON")
    args = ap.parse_args()

    model = build_descriptors(args.descriptors, random.Random(args.seed))
    working_set = sum(b for b, _ in model.values())
    budget = int(working_set * args.budget)
    descs = sorted(model)
    decode = sum(d.uniform_decode for d in descs)
    print(
        f"{len(descs)} descriptors ({decode} decode, {len(descs) - decode} mixed), working set "
        f"{working_set / MiB:,.0f} MiB, budget {budget / MiB:,.0f} MiB ({args.budget:.0%}), "
        f"{args.steps:,} steps, Zipf s={args.zipf}, seed {args.seed}"
    )
    rows = []
    for trace_name in ("stationary", "shift"):
        trace = zipf_trace(descs, args.steps, args.zipf, random.Random(args.seed + 1), trace_name == "shift")
        for policy in EVICTION_POLICIES:
            rows.append({"trace": trace_name, **replay(policy, model, trace, budget)})

    print()
    print("| trace | policy | hit ratio | captures | capture s | evictions |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['trace']} | {r['policy']} | {r['hit_ratio']:.3f} | {r['captures']:,} | "
            f"{r['capture_seconds']:,.1f} | {r['evictions']:,} |"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "working_set_bytes": working_set,
                    "budget_bytes": budget,
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
