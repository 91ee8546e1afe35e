"""Big mixed steps: what capturing mixed descriptors above 256 tokens buys, and what it costs.

For each model shape (--make-model SHAPE:DIR, repeatable; default qwen05b and llama8b under /tmp), one
ModelRunner (max_num_seqs 256, max_num_batched_tokens 8192, mixed buckets 512..8192) runs, at each
size N in --sizes, a realistic mixed step: min(240, N/2) decode rows over 200-1500-token contexts
plus prefill chunks (at most 2048 tokens each, the last over a cached prefix) filling N tokens, in
three modes:
  eager      no graph: every kernel launched from Python (what a step above 256 tokens paid)
  breakable  the bucket's graph, the unified attention kernel as the eager break (a launch a layer)
  full       the bucket's graph with the unified kernel inside (mixed_capture_mode=full)
Columns: step ms (median of CUDA events around runner.execute, input upload included) for each mode;
the capture seconds and graph-pool MiB of each mode's entry (the cache's own measurements, each entry
in a private pool); and padding: the full step at N with N/2 + 1 real tokens (padded up to N: the
worst case just past the previous bucket; at N <= 256 it pads to a fine size instead) against the same
step eager and against N real tokens.
Then the default buckets the rule in engine/worker/capture_sizes.py picks for the shape, and their
summed capture seconds (what startup warmup adds).

  python benchmarks/big_steps.py --make-model qwen05b:/tmp/qwen05b --make-model llama8b:/tmp/llama8b \
      --out big_steps.json
  python benchmarks/big_steps.py --smoke     # the tiny shape on the CPU at small sizes: the script's logic only
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package

import torch  # noqa: E402
from graphcache.config import Settings  # noqa: E402
from graphcache.engine.plan import StepPlan, StepSeq  # noqa: E402
from graphcache.engine.worker.capture_sizes import host_bound_buckets  # noqa: E402
from graphcache.engine.worker.runner import ModelRunner  # noqa: E402
from graphcache.graphs.descriptor import BatchDescriptor, mixed_buckets  # noqa: E402

from benchmarks.model_shapes import make_model  # noqa: E402

MiB = 1 << 20
MODES = ("eager", "breakable", "full")


@dataclass(frozen=True)
class Limits:
    device: str = "cuda"
    max_reqs: int = 256  # max_num_seqs
    max_tokens: int = 8192  # max_num_batched_tokens
    fine_max: int = 256  # max_capture_size: buckets start above it
    decodes: int = 240  # decode rows of a step (at most half its tokens)
    chunk: int = 2048  # prefill chunk tokens
    min_context: int = 200  # decode contexts, uniform in [min_context, max_context)
    max_context: int = 1500
    prefix: int = 512  # cached prefix under the last chunk
    max_model_len: int = 4096
    vocab: int = 10000


GPU = Limits()
SMOKE = Limits(
    device="cpu",
    max_reqs=16,
    max_tokens=128,
    fine_max=32,
    decodes=12,
    chunk=48,
    min_context=8,
    max_context=40,
    prefix=8,
    max_model_len=256,
    vocab=500,
)


def make_runner(model: Path, sizes: list[int], block_size: int, lim: Limits) -> ModelRunner:
    decode_blocks = lim.decodes * -(-lim.max_context // block_size)
    chunk_blocks = 2 * -(-(lim.max_tokens + lim.chunk) // block_size)
    fine = [1, 2, 4, *range(8, lim.fine_max + 1, 8)]
    s = Settings(
        model=model,
        device=lim.device,
        max_num_seqs=lim.max_reqs,
        max_num_batched_tokens=lim.max_tokens,
        max_model_len=lim.max_model_len,
        block_size=block_size,
        num_kv_blocks=decode_blocks + chunk_blocks + 16,
        capture_sizes=fine,
        max_capture_size=lim.fine_max,
        mixed_capture_sizes=[s for s in sizes if s > lim.fine_max],
        warmup_decode_sizes=[],
        warmup_mixed_sizes=[],
        admission="always",
        capture_time_share=1.0,
        cache_lazy_pool="private",
        cache_max_bytes=256 << 30,
        attention_backend="triton" if lim.device == "cuda" else "auto",
    )
    return ModelRunner(s)


def mixed_batch(num_tokens: int, block_size: int, seed: int, lim: Limits) -> list[StepSeq]:
    """min(decodes, N/2) decodes, then chunks of up to `chunk` tokens filling num_tokens (the last one
    over a cached prefix); disjoint block tables. K/V contents do not matter for timing."""
    rng = random.Random(seed)
    per_ctx = -(-lim.max_context // block_size)
    seqs, next_block = [], 0
    num_decodes = min(lim.decodes, num_tokens // 2)
    for _ in range(num_decodes):
        ctx = rng.randint(lim.min_context, lim.max_context - 1)
        seqs.append(
            StepSeq([rng.randrange(lim.vocab)], ctx, list(range(next_block, next_block + per_ctx)), True)
        )
        next_block += per_ctx
    left = num_tokens - num_decodes
    while left:
        n = min(lim.chunk, left)
        left -= n
        start = lim.prefix if left == 0 and n < lim.chunk else 0
        blocks = -(-(start + n) // block_size)
        seqs.append(
            StepSeq(
                [rng.randrange(lim.vocab) for _ in range(n)],
                start,
                list(range(next_block, next_block + blocks)),
                left == 0,
            )
        )
        next_block += blocks
    return seqs


def step_ms(runner: ModelRunner, batch: StepPlan, steps: int) -> tuple[float, str]:
    """Median GPU ms of runner.execute(batch) (CUDA events: idle gaps while the host launches count;
    wall time on the CPU), after two untimed steps (the first captures); the mode of the last step."""
    times, mode = [], ""
    cuda = runner.device.type == "cuda"
    for i in range(steps + 2):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
        t0 = time.perf_counter()
        mode = runner.execute(batch).mode
        if cuda:
            b.record()
            b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) if cuda else (time.perf_counter() - t0) * 1e3)
    return statistics.median(times), mode


def set_mode(runner: ModelRunner, mode: str) -> None:
    runner.cache.clear()
    runner.settings.graph_cache.enforce_eager = mode == "eager"
    runner._mixed_in_graph = mode == "full" and runner.attention_kernel == "triton"  # the CPU smoke: sdpa
    runner._mixed_graph_md.clear()


def entry_of(runner: ModelRunner, num_tokens: int) -> dict:
    for e in runner.cache.entries():
        if int(e.descriptor.split(":")[0]) == num_tokens and not e.descriptor.endswith("decode"):
            return {
                "capture_s": e.capture_seconds,
                "pool_mib": e.bytes / MiB,
                "graphs": e.graphs,
                "mode": e.mode,
            }
    return {}


def run_shape(shape: str, model: Path, sizes: list[int], steps: int, block_size: int, lim: Limits) -> dict:
    t0 = time.perf_counter()
    runner = make_runner(model, sizes, block_size, lim)
    load_s = time.perf_counter() - t0
    c = runner.model_config
    params = sum(p.numel() for name, p in runner.model.named_parameters() if ".layers." in f".{name}")
    rows = []
    batches = {
        n: (
            StepPlan.standalone(mixed_batch(n, block_size, n, lim)),
            StepPlan.standalone(mixed_batch(n // 2 + 1, block_size, n + 1, lim)),
        )
        for n in sizes
    }
    for mode in MODES:
        set_mode(runner, mode)
        for n in sizes:
            full_batch, half_batch = batches[n]
            ms, got = step_ms(runner, full_batch, steps)
            row = next((r for r in rows if r["size"] == n), None)
            if row is None:
                row = {"size": n, "rows": full_batch.num_reqs}
                rows.append(row)
            row[f"{mode}_ms"], row[f"{mode}_ran"] = ms, got
            if mode != "eager":
                row[mode] = entry_of(runner, n)
            if mode in ("eager", "full"):
                row[f"{mode}_half_ms"] = step_ms(runner, half_batch, steps)[0]
        print(f"  {shape}: {mode} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    default = host_bound_buckets(
        mixed_buckets(lim.fine_max, lim.max_tokens), decoder_params=params, num_layers=c.num_layers
    )
    warmup = default_warmup(runner, default, lim)
    del runner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "shape": shape,
        "load_s": load_s,
        "decoder_params": params,
        "layers": c.num_layers,
        "rows": rows,
        "default_buckets": default,
        "default_warmup": warmup,
    }


def default_warmup(runner: ModelRunner, buckets: list[int], lim: Limits) -> dict:
    """What startup adds for the default buckets: their pinned full captures, as the server's warmup
    makes them (largest first, into the shared pinned pool), on a cache emptied first."""
    set_mode(runner, "full")
    descs = [BatchDescriptor(b, min(b, lim.max_reqs), False) for b in buckets]
    t0 = time.perf_counter()
    report = runner.capture(descs, pin=True)
    wall = time.perf_counter() - t0
    return {
        "captures": len(report.captured),
        "failed": report.failed,
        "seconds": wall,
        "pinned_pool_mib": runner.cache.stats().pinned_pool_bytes / MiB,
    }


def print_table(result: dict) -> None:
    print(
        f"\n{result['shape']}: {result['decoder_params'] / 1e9:.2f}B decoder weights, {result['layers']} layers "
        f"(load {result['load_s']:.0f} s)"
    )
    print(
        f"{'N':>5} {'rows':>4} | {'eager':>7} {'break':>7} {'full':>7} ms | {'cap brk':>7} {'cap full':>8} s | "
        f"{'pool brk':>8} {'pool full':>9} MiB | {'N/2+1 eager':>11} {'padded full':>11} {'pad waste':>9}"
    )
    for r in result["rows"]:
        b, f = r.get("breakable", {}), r.get("full", {})
        waste = r["full_half_ms"] / r["full_ms"] if r.get("full_ms") else float("nan")
        print(
            f"{r['size']:>5} {r['rows']:>4} | {r['eager_ms']:7.2f} {r['breakable_ms']:7.2f} {r['full_ms']:7.2f}    | "
            f"{b.get('capture_s', float('nan')):7.2f} {f.get('capture_s', float('nan')):8.2f}   | "
            f"{b.get('pool_mib', float('nan')):8.1f} {f.get('pool_mib', float('nan')):9.1f}     | "
            f"{r['eager_half_ms']:11.2f} {r['full_half_ms']:11.2f} {waste:9.2f}"
        )
        for mode in ("breakable", "full"):
            if r[f"{mode}_ran"] != "replay":
                print(f"      note: {mode} at {r['size']} ran {r[f'{mode}_ran']}, not a replay")
    print(
        "  pad waste = full step at N/2+1 real tokens padded to N / full step at N real tokens "
        "(1.0: padding is free, the step is host-bound)"
    )
    w = result["default_warmup"]
    print(
        f"  default buckets by the rule: {result['default_buckets']}; their startup warmup (full, pinned): "
        f"{w['captures']} captures in {w['seconds']:.2f} s, pinned pool {w['pinned_pool_mib']:.0f} MiB"
        + (f", failed {w['failed']}" if w["failed"] else "")
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--make-model",
        action="append",
        metavar="SHAPE:DIR",
        help="write (once) and measure a random checkpoint of SHAPE (benchmarks/model_shapes.py)",
    )
    ap.add_argument("--sizes", default="256,512,1024,2048,4096,8192")
    ap.add_argument("--steps", type=int, default=9, help="timed steps per cell (median)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU at sizes 32,64,128")
    args = ap.parse_args(argv)
    lim = SMOKE if args.smoke else GPU
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("big_steps.py needs a CUDA GPU (or --smoke for the CPU)")
    specs = args.make_model or (
        ["tiny:/tmp/graphcache-tiny-big-steps"]
        if args.smoke
        else ["qwen05b:/tmp/qwen05b", "llama8b:/tmp/llama8b"]
    )
    sizes = sorted(int(s) for s in (("32,64,128" if args.smoke else args.sizes).split(",")))
    if sizes[-1] > lim.max_tokens:
        raise SystemExit(f"--sizes go up to max_num_batched_tokens {lim.max_tokens}")
    results = []
    for spec in specs:
        shape, _, where = spec.partition(":")
        t0 = time.perf_counter()
        model = make_model(shape, Path(where or f"/tmp/{shape}"))
        print(f"{shape}: checkpoint ready in {time.perf_counter() - t0:.0f} s", flush=True)
        result = run_shape(shape, model, sizes, args.steps if not args.smoke else 1, args.block_size, lim)
        print_table(result)
        results.append(result)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
