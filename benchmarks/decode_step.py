"""One decode step of the engine, measured: wall time (host preparation included) against GPU time.

For a random checkpoint at a real model's shape (--make-model qwen05b:DIR or llama8b:DIR), R sequences are prefilled to a context of --ctx
tokens, then decode steps run through `ModelRunner.execute` + greedy sampling. Per batch size R and
per decode mode it prints:
  wall      median wall time of one synchronized step (prepare + replay/eager + sample + .tolist())
  gpu       median GPU time of the same step (CUDA events around execute+sample)
  wall/gpu  how much host work costs on top of the GPU (issue 10's target: <= 1.25 at R=256)
Modes: full (uniform decode captured as one CUDA graph, decode attention inside it), breakable
(the same kernels, attention as the eager break), varlen (the PR-before path: FlashAttention varlen
over a gathered context as the eager break), eager (no graphs). `plain` is one torch.cuda.graph over
the model forward of the same step, captured by hand: the floor a full capture should match (<= 1.01x).
With --profile R a torch.profiler kernel table of one full-mode step at batch R is printed too.
--small-gemm off,on runs every mode without and with settings.engine.bf16_small_gemm (model/bf16_gemv.py's
kernel for the GEMMs of 1-64 rows), one after the other in this process (the `gemm` column).

  python benchmarks/decode_step.py --make-model qwen05b:/tmp/qwen05b --batches 1,64,256 --ctx 512
  python benchmarks/decode_step.py --make-model llama8b:/tmp/llama8b --batches 1,64,256 --ctx 512
"""

from __future__ import annotations

import argparse
import json
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
from graphcache.model.forward_context import forward_context  # noqa: E402

from benchmarks.gpu_timing import gpu_median_ms  # noqa: E402
from benchmarks.model_shapes import add_model_args, resolve_model  # noqa: E402

MODES = {  # mode -> Settings overrides
    "full": dict(decode_attention_backend="auto", decode_capture_mode="full"),
    "breakable": dict(decode_attention_backend="auto", decode_capture_mode="breakable"),
    "varlen": dict(decode_attention_backend="varlen"),
    "eager": dict(enforce_eager=True),
}


def make_runner(
    model: Path,
    mode: str,
    max_reqs: int,
    ctx: int,
    device: str = "cuda",
    max_model_len: int = 4096,
    **overrides,
) -> ModelRunner:
    """overrides: more settings by flat name (e.g. quantization="fp8")."""
    s = Settings(
        model=model,
        device=device,
        max_num_seqs=max_reqs,
        max_num_batched_tokens=max(8192, max_reqs),
        max_model_len=max_model_len,
        num_kv_blocks=max_reqs * (-(-(ctx + 64) // 16)) + 16,
        warmup_decode_sizes=[],
        admission="always",
        capture_time_share=1.0,
        **{**MODES[mode], **overrides},
    )
    # admission always, no capture-time budget: the first timed steps capture every batch (under the
    # server's defaults a capture after the first may be deferred, and replay_ms finds no entry)
    return ModelRunner(s)


def fill(runner: ModelRunner, batch: int, ctx: int, vocab: int = 10000) -> list[StepSeq]:
    """Prefill `batch` sequences of ctx tokens (chunks of 8 sequences) and return their decode seqs."""
    g = torch.Generator().manual_seed(0)
    bs, per_seq = runner.block_size, -(-(ctx + 64) // runner.block_size)
    seqs = []
    for i in range(batch):
        table = list(range(i * per_seq, (i + 1) * per_seq))
        ids = torch.randint(0, min(vocab, 10000), (ctx,), generator=g).tolist()
        seqs.append(StepSeq(ids, 0, table, True))
    for start in range(0, batch, 8):
        runner.execute(StepPlan.standalone(seqs[start : start + 8]))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    del bs
    return [
        StepSeq([int(torch.randint(0, min(vocab, 10000), (1,), generator=g))], ctx, s.block_table, True)
        for s in seqs
    ]


def time_steps(runner: ModelRunner, decode: list[StepSeq], steps: int) -> tuple[float, float]:
    """Median wall and GPU ms of one decode step (execute + greedy sample + tolist)."""
    walls, gpus = [], []
    batch = StepPlan.standalone(decode)
    for i in range(steps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        result = runner.execute(batch)
        tokens = result.logits.argmax(dim=-1)
        end.record()
        tokens.tolist()
        wall = time.perf_counter() - t0
        if i >= 3:  # the first steps capture
            walls.append(wall * 1e3)
            gpus.append(start.elapsed_time(end))
    return statistics.median(walls), statistics.median(gpus)


def replay_ms(runner: ModelRunner, batch: int, steps: int) -> float:
    """GPU time of the cached capture's replay alone (no input upload, no sampling): what the cache adds
    over a plain graph of the same step."""
    desc = BatchDescriptor(runner.sizes.pad(batch), runner.sizes.pad(batch), True)
    graph = runner.cache.store.get(desc).graph
    with forward_context(runner.decode_metadata(desc.num_reqs)):  # what a breakable replay's breaks read
        return gpu_median_ms(graph.replay, steps)


def plain_graph_ms(runner: ModelRunner, batch: int, steps: int) -> float:
    """One torch.cuda.graph around the runner's model forward for a decode batch of `batch`:
    the bare replay a full capture must match."""
    desc = BatchDescriptor(runner.sizes.pad(batch), runner.sizes.pad(batch), True)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        runner._step_fn(desc)  # the static buffers still hold the last timed step's batch
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        runner._step_fn(desc)
    ms = gpu_median_ms(g.replay, steps)
    g.reset()
    return ms


def kernel_table(runner: ModelRunner, decode: list[StepSeq], rows: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    batch = StepPlan.standalone(decode)
    runner.execute(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.execute(batch).logits.argmax(dim=-1).tolist()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--modes", default="full,breakable,varlen,eager")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", type=int, default=256, help="kernel table at this batch (0 = none)")
    ap.add_argument("--small-gemm", default="on", help="on, off or off,on: settings.engine.bf16_small_gemm")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = resolve_model(args)
    batches = [int(b) for b in args.batches.split(",")]
    rows, tables = [], {}
    for mode, small in [(m, g) for g in args.small_gemm.split(",") for m in args.modes.split(",")]:
        runner = make_runner(model, mode, max(batches), args.ctx, bf16_small_gemm=small == "on")
        for b in batches:
            decode = fill(runner, b, args.ctx)
            wall, gpu = time_steps(runner, decode, args.steps)
            row = {
                "mode": mode,
                "small_gemm": small,
                "batch": b,
                "wall_ms": wall,
                "gpu_ms": gpu,
                "wall_over_gpu": wall / gpu,
                "attention": runner.decode_kernel if mode != "varlen" else runner.attention_kernel,
            }
            if mode in ("full", "breakable"):
                row["replay_ms"] = replay_ms(runner, b, args.steps)
            if mode == "full":
                row["plain_graph_ms"] = plain_graph_ms(runner, b, args.steps)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if mode in ("full", "varlen") and b == args.profile:
                tables[mode if small == "off" else f"{mode}, small gemm"] = kernel_table(runner, decode)
        del runner
        torch.cuda.empty_cache()
    for mode, table in tables.items():
        print(f"\n=== kernel table, {mode}, batch {args.profile}, ctx {args.ctx} (5 steps)\n{table}")
    print(
        f"\n{'mode':<10} {'gemm':>4} {'batch':>5} {'wall ms':>8} {'gpu ms':>8} {'wall/gpu':>8} {'replay':>8} {'plain':>8} "
        f"{'rep/plain':>9} attention"
    )
    for r in rows:
        replay = f"{r['replay_ms']:8.3f}" if "replay_ms" in r else f"{'':>8}"
        plain = f"{r['plain_graph_ms']:8.3f}" if "plain_graph_ms" in r else f"{'':>8}"
        ratio = f"{r['replay_ms'] / r['plain_graph_ms']:9.3f}" if "plain_graph_ms" in r else f"{'':>9}"
        print(
            f"{r['mode']:<10} {r['small_gemm']:>4} {r['batch']:>5} {r['wall_ms']:8.3f} {r['gpu_ms']:8.3f} {r['wall_over_gpu']:8.2f} "
            f"{replay} {plain} {ratio} {r['attention']}"
        )
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "tables": tables}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
