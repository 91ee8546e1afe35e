"""Startup warmup of the real ModelRunner: capture time per descriptor, where it goes, pool bytes.

For a Qwen2.5-0.5B-shaped random checkpoint, each variant builds a `ModelRunner` and runs its
default warmup (every decode capture size <= max_num_seqs, pinned), then prints per descriptor the
capture's mode, wall ms (split into the eager warm-up run and the capture itself) and the pool
bytes the cache measured. Issue 11's targets: median capture <= 25 ms (batch 1-256) and the whole
default warmup < 1.5 s. Variants:
  per_kernel  capture_warmup=per_kernel (an eager run before the first capture of each kernel family)
  always      capture_warmup=always (an eager run before every capture)
Each variant runs twice in this process: `cold` (first: Triton compiles, on-disk cache possibly
empty) and `again` (a second runner: what a restart with a warm Triton cache costs). A heap of
--heap-objects Python objects stands in for a running server's (gc.collect used to cost 138 ms a
capture on one). Then, per batch of --pool-batches, a private (unpinned) capture's pool against
one plain torch.cuda.graph of the same step (target: ours <= plain + 4 MiB), and greedy tokens of
a real decode batch through the cached graphs against an eager runner (the same, or not).

  python benchmarks/warmup_bench.py --make-qwen05b /tmp/qwen05b --out warmup.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package

import torch  # noqa: E402
from graphcache.config import Settings  # noqa: E402
from graphcache.engine.plan import StepPlan, StepSeq  # noqa: E402
from graphcache.engine.worker.runner import ModelRunner  # noqa: E402
from graphcache.graphs.descriptor import BatchDescriptor  # noqa: E402
from graphcache.graphs.pool import pool_bytes  # noqa: E402
from graphcache.model.attention_metadata import AttentionMetadata  # noqa: E402
from graphcache.model.forward_context import forward_context  # noqa: E402

from benchmarks.offline_throughput import make_qwen05b  # noqa: E402

MiB = 1 << 20


def make_runner(model: Path, capture_warmup: str, max_num_seqs: int, **extra) -> ModelRunner:
    return ModelRunner(
        Settings(
            model=model,
            device="cuda",
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=8192,
            max_model_len=2048,
            capture_warmup=capture_warmup,
            **extra,
        )
    )


def warmup_rows(runner: ModelRunner, cprofile: int = 0) -> tuple[float, list[dict]]:
    """Run the runner's warmup; per-descriptor rows. cprofile > 0: print that many functions of a cProfile
    of the warmup, by own time (where capture's host time goes)."""
    torch.cuda.synchronize()
    prof = cProfile.Profile() if cprofile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    report = runner.warmup()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(cprofile)
    rows = []
    for entry in runner.cache.store.entries():
        desc = entry.desc
        t = entry.graph.timings
        rows.append(
            {
                "descriptor": str(desc),
                "tokens": desc.num_tokens,
                "mode": "full" if entry.graph.num_breaks == 0 else "breakable",
                "ms": entry.capture_seconds * 1e3,
                "warmup_ms": t.get("warmup", 0) * 1e3,
                "capture_ms": t.get("capture", 0) * 1e3,
                "bytes": entry.bytes,
            }
        )
    assert not report.failed, report.failed
    return seconds, sorted(rows, key=lambda r: r["tokens"])


def plain_pool_bytes(runner: ModelRunner, desc: BatchDescriptor) -> int:
    """Pool of one torch.cuda.graph over the same step (the full graph's floor)."""
    pool = torch.cuda.graph_pool_handle()
    g = torch.cuda.CUDAGraph()
    runner.inputs.point_at_scratch(runner.table)
    with forward_context(AttentionMetadata.empty()):  # as ModelRunner.capture does
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            runner._step_fn(desc)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g, pool=pool):
            runner._step_fn(desc)
    size = pool_bytes(pool)
    g.reset()
    return size


def pool_rows(model: Path, batches: list[int], max_num_seqs: int) -> list[dict]:
    runner = make_runner(model, "always", max_num_seqs, warmup_decode_sizes=[])
    rows = []
    for b in batches:
        desc = BatchDescriptor(runner.sizes.pad(b), runner.sizes.pad(b), True)
        runner.capture([desc], pin=False)  # a private pool, as a lazy capture gets
        ours = runner.cache.store.get(desc).bytes
        plain = plain_pool_bytes(runner, desc)
        rows.append({"batch": b, "ours_bytes": ours, "plain_bytes": plain, "over_mib": (ours - plain) / MiB})
        print(json.dumps(rows[-1]), flush=True)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def greedy_tokens(runner: ModelRunner, batch: int, ctx: int, steps: int) -> list[list[int]]:
    """Prefill `batch` sequences of ctx random tokens, then `steps` decode steps; greedy ids per step."""
    g = torch.Generator().manual_seed(1)
    per_seq = -(-(ctx + steps + 1) // runner.block_size)
    seqs = [
        StepSeq(
            torch.randint(0, 10000, (ctx,), generator=g).tolist(),
            0,
            list(range(i * per_seq, (i + 1) * per_seq)),
            True,
        )
        for i in range(batch)
    ]
    out = [runner.execute(StepPlan.standalone(seqs)).logits.argmax(-1).tolist()]
    for step in range(steps):
        seqs = [StepSeq([out[-1][i]], ctx + step, s.block_table, True) for i, s in enumerate(seqs)]
        out.append(runner.execute(StepPlan.standalone(seqs)).logits.argmax(-1).tolist())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--make-qwen05b", type=Path, metavar="DIR")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--variants", default="per_kernel,always")
    ap.add_argument("--heap-objects", type=int, default=2_000_000)
    ap.add_argument("--pool-batches", default="1,8,64,256")
    ap.add_argument("--cprofile", type=int, default=0, help="cProfile each 'again' warmup: print N functions")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = args.model or make_qwen05b(args.make_qwen05b)
    heap = [{"i": i} for i in range(args.heap_objects)]  # a server-sized heap for gc to walk
    summary, detail = [], {}
    for name in args.variants.split(","):
        for run in ("cold", "again"):
            runner = make_runner(model, name, args.max_num_seqs)
            seconds, rows = warmup_rows(runner, args.cprofile if run == "again" else 0)
            decode_ms = [r["ms"] for r in rows if r["tokens"] <= 256]
            row = {
                "variant": name,
                "run": run,
                "descriptors": len(rows),
                "warmup_s": seconds,
                "median_ms": statistics.median(decode_ms),
                "max_ms": max(decode_ms),
                "median_warmup_run_ms": statistics.median(r["warmup_ms"] for r in rows),
                "median_capture_ms": statistics.median(r["capture_ms"] for r in rows),
                "pool_mib": runner.cache.stats().pool_bytes / MiB,
            }
            if run == "again":
                tokens = greedy_tokens(runner, 3, 64, 6)
                eager = make_runner(model, "always", args.max_num_seqs, enforce_eager=True)
                row["greedy_equal_eager"] = tokens == greedy_tokens(eager, 3, 64, 6)
                del eager
            summary.append(row)
            detail[f"{name}/{run}"] = rows
            print(json.dumps(row), flush=True)
            del runner
            gc.collect()
            torch.cuda.empty_cache()
    pools = pool_rows(model, [int(b) for b in args.pool_batches.split(",")], args.max_num_seqs)
    print(
        f"\n{'variant':<10} {'run':<6} {'n':>3} {'warmup s':>9} {'median ms':>9} {'max ms':>7} {'eager-run ms':>12} "
        f"{'capture ms':>10} {'pool MiB':>8} greedy=eager"
    )
    for r in summary:
        print(
            f"{r['variant']:<10} {r['run']:<6} {r['descriptors']:>3} {r['warmup_s']:9.2f} {r['median_ms']:9.1f} "
            f"{r['max_ms']:7.1f} {r['median_warmup_run_ms']:12.1f} {r['median_capture_ms']:10.1f} "
            f"{r['pool_mib']:8.1f} {r.get('greedy_equal_eager', '')}"
        )
    print(f"\n{'batch':>5} {'ours MiB':>9} {'plain MiB':>9} {'over MiB':>8}")
    for r in pools:
        print(
            f"{r['batch']:>5} {r['ours_bytes'] / MiB:9.2f} {r['plain_bytes'] / MiB:9.2f} {r['over_mib']:8.2f}"
        )
    del heap
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "pools": pools, "detail": detail}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
