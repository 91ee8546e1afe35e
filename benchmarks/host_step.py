"""The engine's per-step host work at a decode batch of N, without a GPU: what a step costs the Python
that schedules it, builds its batch, fills the runner's input buffers and appends its tokens.

With fused kernels the H200's decode step is GPU-short enough that this host work sets the pace
(BENCHMARKS.md §9.2: 2.2 ms of host work in a 2.8 ms step period at ~146 rows). Each phase is timed
alone over --steps decode steps of --batch sequences at --ctx tokens of context (prefix caching on, as
served), on the tiny CPU model's runner (only its input preparation runs: no forward).

    python benchmarks/host_step.py --batch 256 [--profile 25]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))    # the tiny checkpoint helper

from graphcache.engine.block_manager import BlockManager  # noqa: E402
from graphcache.engine.runner import ModelRunner  # noqa: E402
from graphcache.engine.scheduler import Scheduler  # noqa: E402
from graphcache.engine.sequence import SamplingParams, Sequence  # noqa: E402
from helpers_model import cpu_settings, tiny_checkpoint  # noqa: E402


def setup(batch: int, ctx: int, block_size: int):
    blocks = batch * (-(-(ctx + 1100) // block_size)) + 8
    settings = cpu_settings(tiny_checkpoint(), max_num_seqs=batch, max_num_batched_tokens=max(8192, batch),
                            block_size=block_size, num_kv_blocks=blocks, max_model_len=2048,
                            max_capture_size=max(256, batch))
    runner = ModelRunner(settings)
    bm = BlockManager(blocks, block_size, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=batch, max_num_batched_tokens=max(8192, batch), max_model_len=2048)
    for i in range(batch):
        seq = Sequence(f"r{i}", [(i * 7919 + j) % 30000 + 5 for j in range(ctx)],
                       SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
        sched.add(seq)
    # Prefill until every sequence has its first token: from then on every step is a decode of `batch` rows.
    while sched.waiting or any(not s.output_token_ids for s in sched.running):
        plan = sched.schedule()
        sched.postprocess(plan, [1] * sum(s.need_logits for s in plan.scheduled), time.monotonic())
    return runner, sched


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", type=int, default=0, help="cProfile the steps: print N functions by own time")
    args = ap.parse_args()
    runner, sched = setup(args.batch, args.ctx, args.block_size)
    times = {k: [] for k in ("schedule", "to_batch", "prepare", "postprocess")}
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        batch = plan.to_batch()
        t2 = time.perf_counter()
        runner._prepare_decode(batch.seqs, runner.sizes.pad(len(batch.seqs)) or len(batch.seqs))
        t3 = time.perf_counter()
        sched.postprocess(plan, [7] * len(plan.scheduled), time.monotonic())
        t4 = time.perf_counter()
        for k, a, b in (("schedule", t0, t1), ("to_batch", t1, t2), ("prepare", t2, t3), ("postprocess", t3, t4)):
            times[k].append((b - a) * 1e3)
    if prof:
        prof.disable()
    rows = len(plan.scheduled)
    print(f"decode steps of {rows} rows, context {args.ctx}+, block {args.block_size}: median ms per step")
    print("| phase | ms | us per row |\n|---|---|---|")
    total = 0.0
    for k, v in times.items():
        m = statistics.median(v)
        total += m
        print(f"| {k} | {m:.3f} | {m * 1e3 / rows:.2f} |")
    print(f"| total | {total:.3f} | {total * 1e3 / rows:.2f} |")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
