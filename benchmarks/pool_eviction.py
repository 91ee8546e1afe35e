"""Does evicting a capture give memory back? Shared graph pool vs one pool per entry.

    python benchmarks/pool_eviction.py --out pool_eviction.json

For each mode, capture N descriptors (largest first) of a breakable workload, then
measure torch.cuda.memory_reserved() (after empty_cache) relative to the start:
after capturing all, after evicting the largest one, after evicting all. Also the
capture time per entry. Modes:
  shared     every capture on one graph_pool_handle() (what vLLM/SGLang do)
  per_entry  a fresh pool per capture (what GraphCache does for lazily admitted entries
             under lazy_pool="private")
  cache      GraphCache(lazy_pool="private"), warmup(pin=False): private pools, budgets off;
             also checks that the bytes it reports equal the allocator's
  lazy       GraphCache(lazy_pool="shared", the default), warmup(pin=False): the N sizes share
             the one lazy pool (expect ~ the shared figure, and 0 freed by evicting the largest);
             the survivors' replays are checked against eager after that eviction
  pinned     GraphCache(lazy_pool="private"), warmup(pin=True): the N sizes share the one pinned
             pool (expect ~ the shared figure); then lazily admitted sizes in between (private
             pools), the largest of them evicted for real ("after/freed by evicting largest" refer
             to it), pinned replays checked against eager, and clear() ("after evicting all")
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package
from graphcache.graphs.cache import GraphCache  # noqa: E402
from graphcache.graphs.capture import capture, eager_break, release_workspaces  # noqa: E402
from graphcache.graphs.descriptor import BatchDescriptor  # noqa: E402
from graphcache.graphs.policy.config import CachePolicyConfig  # noqa: E402
from graphcache.graphs.pool import pool_bytes  # noqa: E402

MiB = 1 << 20


@eager_break
def mix(x: torch.Tensor, out: torch.Tensor) -> None:
    # x, out [T, H]: the "attention" stand-in, written into a static buffer
    out.copy_(torch.softmax(x, dim=-1))


class Workload:
    """L layers: linear -> gelu -> eager break -> residual; static buffers of the largest size."""

    def __init__(self, layers: int, hidden: int, max_tokens: int) -> None:
        kw = dict(device="cuda", dtype=torch.bfloat16)
        self.w = [torch.randn(hidden, hidden, **kw) / hidden**0.5 for _ in range(layers)]
        self.x = torch.randn(max_tokens, hidden, **kw)  # [T_max, H]
        self.mixed = torch.empty(max_tokens, hidden, **kw)
        self.out = torch.empty(max_tokens, hidden, **kw)

    def step(self, tokens: int) -> None:
        h = self.x[:tokens]
        for w in self.w:
            h = F.gelu(h @ w)
            mix(h, self.mixed[:tokens])
            h = h + self.mixed[:tokens]
        self.out[:tokens].copy_(h)


def reserved() -> int:
    gc.collect()
    torch.cuda.synchronize()
    release_workspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def run_capture_mode(work: Workload, sizes: list[int], shared: bool) -> dict:
    base = reserved()
    stream = torch.cuda.Stream()
    shared_pool = torch.cuda.graph_pool_handle() if shared else None
    graphs, pools, times = {}, {}, []
    for t in sizes:  # largest first
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            work.step(t)  # warm outside the capture, as GraphCache does
        torch.cuda.current_stream().wait_stream(stream)
        pool = shared_pool if shared else torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphs[t] = capture(lambda t=t: work.step(t), backend="cuda", pool=pool, stream=stream)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        pools[t] = pool
        graphs[t].replay()
    after_capture = reserved() - base
    pool_total = pool_bytes(shared_pool) if shared else sum(pool_bytes(p) for p in pools.values())
    graphs.pop(sizes[0]).close()  # evict the largest
    after_one = reserved() - base
    for g in graphs.values():
        g.close()
    graphs.clear()
    after_all = reserved() - base
    return {
        "after_capture_mib": after_capture / MiB,
        "pool_mib": pool_total / MiB,
        "after_evict_largest_mib": after_one / MiB,
        "after_evict_all_mib": after_all / MiB,
        "freed_by_evict_largest_mib": (after_capture - after_one) / MiB,
        "capture_ms_median": statistics.median(times),
        "capture_ms_total": sum(times),
    }


def run_cache_mode(work: Workload, sizes: list[int], lazy_pool: str) -> dict:
    base = reserved()
    cache = GraphCache(
        lambda d: work.step(d.num_tokens),
        backend="cuda",
        config=CachePolicyConfig(max_entries=len(sizes) + 1, max_bytes=1 << 45, lazy_pool=lazy_pool),
    )
    descs = [BatchDescriptor(t, t, True) for t in sizes]
    cache.warmup(descs, pin=False)
    after_capture = reserved() - base
    reported = cache.stats().pool_bytes
    measured = sum(pool_bytes(h) for h in {cache.store.get(d).pool.handle for d in descs})
    times = [e.capture_seconds * 1e3 for e in cache.entries()]
    cache.evict(descs[0])
    after_one = reserved() - base
    match, worst = _replays_match(cache, work, descs[1:])  # survivors over the freed/reused memory
    rep = cache.clear()
    after_all = reserved() - base
    return {
        "after_capture_mib": after_capture / MiB,
        "pool_mib": reported / MiB,
        "reported_equals_allocator": reported == measured,
        "after_evict_largest_mib": after_one / MiB,
        "after_evict_all_mib": after_all / MiB,
        "freed_by_evict_largest_mib": (after_capture - after_one) / MiB,
        "clear_bytes_freed_mib": rep.bytes_freed / MiB,
        "replays_match_eager": match,
        "replay_worst_rel_err": worst,
        "capture_ms_total": cache.stats().capture_seconds * 1e3,
        "capture_ms_median": statistics.median(times),
    }


def _replays_match(cache: GraphCache, work: Workload, descs: list[BatchDescriptor]) -> tuple[bool, float]:
    """Every graph of `descs` vs eager, 2 inputs, outputs poisoned with NaN first; (all match, worst rel err)."""
    ok, worst = True, 0.0
    for _ in range(2):
        work.x.copy_(torch.randn_like(work.x))
        for d in descs:
            t = d.num_tokens
            work.out.fill_(float("nan"))
            cache.run(d)
            got = work.out[:t].float().clone()
            work.out.fill_(float("nan"))
            work.step(t)
            ref = work.out[:t].float()
            err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            worst = max(worst, err)
            ok = ok and not got.isnan().any().item() and err <= 2e-2  # bf16, scale-relative
    return ok, worst


def run_pinned_mode(work: Workload, sizes: list[int]) -> dict:
    base = reserved()
    lazy_sizes = [(a + b) // 2 for a, b in zip(sizes, sizes[1:], strict=False)][:4]  # largest first
    descs = [BatchDescriptor(t, t, True) for t in sizes]
    lazy = [BatchDescriptor(t, t, True) for t in lazy_sizes]
    cache = GraphCache(
        lambda d: work.step(d.num_tokens),
        backend="cuda",
        config=CachePolicyConfig(max_entries=len(descs) + len(lazy), max_bytes=1 << 45, lazy_pool="private"),
    )
    cache.warmup(descs)  # pin=True: one shared pinned pool
    after_capture = reserved() - base
    pinned = cache.stats().pinned_pool_bytes
    pinned_equals_allocator = (
        pinned == pool_bytes(cache.store.pools.shared["pinned"].handle) == cache.stats().pool_bytes
    )
    times = [e.capture_seconds * 1e3 for e in cache.entries()]
    growth = {e.descriptor: e.bytes / MiB for e in cache.entries()}
    for d in lazy:
        cache.run(d)  # lazily admitted: one private pool each
    after_lazy = reserved() - base
    lazy_bytes = [cache.store.get(d).bytes for d in lazy]
    lazy_equals_allocator = all(
        cache.store.get(d).bytes == pool_bytes(cache.store.get(d).pool.handle) for d in lazy
    )
    cache.evict(lazy[0])  # the largest lazily admitted entry
    after_one = reserved() - base
    match, worst = _replays_match(cache, work, descs)
    rep = cache.clear()
    after_all = reserved() - base
    return {
        "after_capture_mib": after_capture / MiB,
        "pool_mib": pinned / MiB,
        "pinned_pool_growth_mib": growth,
        "reported_equals_allocator": pinned_equals_allocator and lazy_equals_allocator,
        "lazy_sizes": lazy_sizes,
        "lazy_mib": [b / MiB for b in lazy_bytes],
        "after_lazy_mib": after_lazy / MiB,
        "after_evict_largest_mib": after_one / MiB,
        "freed_by_evict_largest_mib": (after_lazy - after_one) / MiB,
        "evicted_lazy_entry_mib": lazy_bytes[0] / MiB,
        "after_evict_all_mib": after_all / MiB,
        "clear_bytes_freed_mib": rep.bytes_freed / MiB,
        "pinned_replays_match_eager": match,
        "pinned_replay_worst_rel_err": worst,
        "capture_ms_total": sum(times),
        "capture_ms_median": statistics.median(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument(
        "--sizes", default="2048,1536,1024,768,512,256,128,64", help="token counts, largest first"
    )
    ap.add_argument("--out", type=Path, default=Path("pool_eviction.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("pool_eviction needs a CUDA GPU")
    sizes = sorted((int(s) for s in args.sizes.split(",")), reverse=True)
    work = Workload(args.layers, args.hidden, sizes[0])
    work.step(sizes[0])
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "layers": args.layers,
        "hidden": args.hidden,
        "sizes": sizes,
        "modes": {},
    }
    result["modes"]["shared"] = run_capture_mode(work, sizes, shared=True)
    result["modes"]["per_entry"] = run_capture_mode(work, sizes, shared=False)
    result["modes"]["cache"] = run_cache_mode(work, sizes, "private")
    result["modes"]["lazy"] = run_cache_mode(work, sizes, "shared")
    result["modes"]["pinned"] = run_pinned_mode(work, sizes)
    print(
        f"{len(sizes)} captures, {args.layers} layers, hidden {args.hidden}, bf16; MiB reserved above start "
        f"(after empty_cache)"
    )
    print(
        "| mode | after capture | pool bytes | after evicting largest | freed by that | after evicting all "
        "| capture ms median | capture ms total |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in result["modes"].items():
        print(
            f"| {mode} | {r['after_capture_mib']:.1f} | {r['pool_mib']:.1f} | {r['after_evict_largest_mib']:.1f} "
            f"| {r['freed_by_evict_largest_mib']:.1f} | {r['after_evict_all_mib']:.1f} "
            f"| {r['capture_ms_median']:.1f} | {r['capture_ms_total']:.0f} |"
        )
    for mode in ("cache", "lazy"):
        r = result["modes"][mode]
        print(
            f"{mode}: reported pool bytes == allocator: {r['reported_equals_allocator']}; survivors replay == "
            f"eager after evicting the largest: {r['replays_match_eager']} (worst rel err "
            f"{r['replay_worst_rel_err']:.1e})"
        )
    p = result["modes"]["pinned"]
    print(
        f"pinned: pinned pool {p['pool_mib']:.1f} MiB (shared mode: {result['modes']['shared']['pool_mib']:.1f}); "
        f"+ lazily admitted {p['lazy_sizes']}: {', '.join(f'{m:.1f}' for m in p['lazy_mib'])} MiB; evicting "
        f"the largest ({p['evicted_lazy_entry_mib']:.1f} MiB) freed {p['freed_by_evict_largest_mib']:.1f} MiB; "
        f"clear freed {p['clear_bytes_freed_mib']:.1f} MiB; reported == allocator: {p['reported_equals_allocator']}; "
        f"pinned replays == eager after that: {p['pinned_replays_match_eager']} "
        f"(worst rel err {p['pinned_replay_worst_rel_err']:.1e})"
    )
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
