"""The engine's per-step host work at a decode batch of N, without a GPU: everything `EngineCore.step`
does in Python (schedule, batch, input preparation, sampling launch, postprocess, outputs) with the
model's own work stubbed out.

With fused kernels the H200's decode step is GPU-short enough that this host work sets the pace
(BENCHMARKS.md §9.3: offline steps wait ~0.1 ms for the GPU, ~3.3 ms period). Runs the real EngineCore
over the tiny CPU model's ModelRunner with async scheduling on (as on CUDA), prefix caching on, N
streaming requests at --ctx tokens of context; the runner prepares its inputs as usual, but the forward
pass (graph replay or eager) is skipped and the logits buffer is left as it is (greedy sampling of a
fixed row). Per phase: EngineCore.phase_seconds, median over --steps decode steps; "inputs" is the time
spent building the step plan (part of "schedule") and preparing the runner's inputs (part of "execute";
persistent decode rows: constant).

--sampling realistic: every request samples as the realistic workload does (temperature 0.8, top_p 0.95,
every fourth seeded), with the draw kernel stubbed (on the CPU it would be the torch twin's compute): the
host work of a sampled step. --sampling topk: top_k 50 at temperature 0.8, the same stub (k is one more
column of the draw's parameters; the kernel finds the k-th largest logit itself).

    python benchmarks/host_step.py --batch 256 [--sampling realistic|topk] [--profile 25]
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny checkpoint helper

import torch  # noqa: E402
from graphcache.engine.loop.core import EngineCore  # noqa: E402
from graphcache.engine.sched import scheduler as scheduler_mod  # noqa: E402
from graphcache.engine.sequence import SamplingParams, Sequence  # noqa: E402
from graphcache.engine.worker.runner import ModelRunner  # noqa: E402
from helpers_model import cpu_settings, tiny_checkpoint  # noqa: E402

PHASES = ("schedule", "execute", "sample", "postprocess")
INPUT_SECONDS = [0.0]  # the plan (or batch) building + the runner's input preparation


def timed(fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            INPUT_SECONDS[0] += time.perf_counter() - t0

    return wrapper


def time_inputs(runner: ModelRunner) -> None:
    """Count the plan building and input preparation: the part of a step that persistent decode rows
    made independent of the batch (also works on older commits, which built a StepBatch and laid steps
    out in the runner)."""
    if hasattr(scheduler_mod.Scheduler, "_plan"):
        scheduler_mod.Scheduler._plan = timed(scheduler_mod.Scheduler._plan)
    else:
        scheduler_mod.SchedulerOutput.to_batch = timed(scheduler_mod.SchedulerOutput.to_batch)
    inputs = getattr(runner, "inputs", None)
    if inputs is not None:
        inputs.prepare = timed(inputs.prepare)
        return
    runner._prepare_decode = timed(runner._prepare_decode)
    runner._prepare = timed(runner._prepare)
    rows = getattr(runner, "persistent_rows", None)
    if rows is not None:
        rows.apply = timed(rows.apply)


def sampling_params(sampling: str, i: int, max_tokens: int) -> SamplingParams:
    if sampling == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if sampling == "topk":  # top_k 50 at temperature 0.8 (the nucleus path's top-k floor)
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=50, ignore_eos=True)
    seed = i if i % 4 == 0 else None  # benchmarks/workloads.py's realistic mix
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)


def stub_draw_kernel() -> None:
    """The nucleus draw as a launch would cost the host: an output tensor, no work (the CPU's torch twin
    would otherwise be the step's time)."""
    from graphcache.engine.sample import sampler

    sampler.nucleus_draw = lambda logits, rows, params, keys, steps, **kw: torch.zeros_like(rows)


def setup(batch: int, ctx: int, block_size: int, steps: int, sampling: str = "greedy") -> EngineCore:
    max_len = ctx + steps + 64
    blocks = batch * (-(-max_len // block_size)) + 8
    settings = cpu_settings(
        tiny_checkpoint(),
        max_num_seqs=batch,
        max_num_batched_tokens=max(8192, batch),
        block_size=block_size,
        num_kv_blocks=blocks,
        max_model_len=max_len,
        max_capture_size=max(256, batch),
        async_scheduling="on",
    )
    runner = ModelRunner(settings)
    runner._run_model = lambda num_tokens, num_reqs: None  # no forward pass: host work only
    runner.cache.run = lambda desc, real_tokens=None: "replay"
    runner.out_logits.normal_()  # a fixed, non-degenerate row per request
    core = EngineCore(runner, settings)
    for i in range(batch):
        core.add_request(
            Sequence(
                f"r{i}",
                [(i * 7919 + j) % 30000 + 5 for j in range(ctx)],
                sampling_params(sampling, i, steps + 32),
            )
        )
    while core.scheduler.waiting or any(not s.output_token_ids for s in core.scheduler.running):  # prefill
        core.step()
    return core


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sampling", default="greedy", choices=["greedy", "realistic", "topk"])
    ap.add_argument(
        "--profile", type=int, default=0, help="cProfile the steps: print N functions by own time"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.sampling != "greedy":
        stub_draw_kernel()
    core = setup(args.batch, args.ctx, args.block_size, args.steps, args.sampling)
    time_inputs(core.runner)
    per_phase = {k: [] for k in (*PHASES, "inputs", "step")}
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    for _ in range(args.steps):
        before, inputs_before = dict(core.phase_seconds), INPUT_SECONDS[0]
        t0 = time.perf_counter()
        core.step()
        per_phase["step"].append((time.perf_counter() - t0) * 1e3)
        per_phase["inputs"].append((INPUT_SECONDS[0] - inputs_before) * 1e3)
        for k in PHASES:
            per_phase[k].append((core.phase_seconds[k] - before[k]) * 1e3)
    if prof:
        prof.disable()
    rows = len(core.scheduler.running)
    print(
        f"EngineCore.step at a decode batch of {rows}, context {args.ctx}+, block {args.block_size}, model stubbed: "
        f"median ms per step over {args.steps}"
    )
    print("| phase | ms | us per row |\n|---|---|---|")
    for k, v in per_phase.items():
        m = statistics.median(v)
        print(f"| {k} | {m:.3f} | {m * 1e3 / max(rows, 1):.2f} |")
    table, inputs = getattr(core.runner, "table", None), getattr(core.runner, "inputs", None)
    rows = (
        table.rows
        if table is not None
        else getattr(inputs, "rows", None)
        if inputs is not None
        else getattr(core.runner, "persistent_rows", None)
    )
    applied = getattr(rows, "num_applied", None)
    if applied is not None:
        print(f"decode steps run from persistent rows: {applied} of {core.num_steps}")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
