"""Offline generation throughput: graphcache eager vs graph cache vs Hugging Face `generate`.

nano-vllm's benchmark shape: 256 requests, random prompt lengths 100-1024 and output lengths
100-1024 (seed 0), random token ids, ignore_eos, so every request produces exactly its output
length. The engine runs in-process (no HTTP): Engine + ModelRunner, all requests submitted at
once, the clock running from submission to the last token (after load, warmup and a short warm
request, like nano-vllm's "Benchmark: " request).

  python benchmarks/offline_throughput.py --make-qwen05b /tmp/qwen05b          # write the model
  python benchmarks/offline_throughput.py --model /tmp/qwen05b --out bench.json  # eager, graph, hf

Output tokens/s counts requested output tokens. HF `generate` runs fixed-size batches (left
padded, --hf-batch-size) to the longest output of each batch; its table row counts only the
requested tokens (what a user gets), and the JSON also has the raw generated count.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package

import torch  # noqa: E402
from graphcache.config import Settings  # noqa: E402
from graphcache.engine.loop.engine import Engine, SamplingParams  # noqa: E402
from graphcache.metrics import Metrics  # noqa: E402

from benchmarks import step_trace  # noqa: E402

# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B).
QWEN05B = dict(arch="qwen2", hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, head_dim=64,
               max_positions=32768, rope_theta=1_000_000.0, tie_word_embeddings=True)
QWEN05B_VOCAB = 151936


def make_qwen05b(out: Path) -> Path:
    from graphcache.model.tiny import make_tiny_model

    kwargs = dict(QWEN05B)
    params = inspect.signature(make_tiny_model).parameters
    if "model_vocab_size" in params:   # embedding/LM head at the real size (0.5B has a 151936 vocab)
        kwargs["model_vocab_size"] = QWEN05B_VOCAB
    else:
        print(f"note: make_tiny_model has no model_vocab_size; the LM head uses the trained BPE vocab, not "
              f"{QWEN05B_VOCAB} (decoder layers are 0.5B-shaped, the head is smaller)", file=sys.stderr)
    return make_tiny_model(out, seed=0, **kwargs)


def workload(n: int, vocab: int, in_range: tuple[int, int], out_range: tuple[int, int], seed: int):
    rng = random.Random(seed)
    # Low ids only: a random-weight model never sees special tokens, and every vocab has ids < 10000.
    hi = min(vocab, 10000) - 1
    prompts = [[rng.randint(0, hi) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    outputs = [rng.randint(*out_range) for _ in range(n)]
    return prompts, outputs


def engine_settings(args, enforce_eager: bool) -> Settings:
    return Settings(model=args.model, device=args.device, dtype=args.dtype, enforce_eager=enforce_eager,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=args.max_model_len, max_queue=max(args.num_seqs, 1024),
                    max_capture_size=args.max_capture_size)


async def _run_engine(engine: Engine, prompts, outputs, temperature: float) -> tuple[float, int, dict]:
    warm = engine.generate("warm", prompts[0][:16], SamplingParams(max_tokens=8, ignore_eos=True))
    async for _ in warm:
        pass

    async def one(i: int) -> int:
        params = SamplingParams(max_tokens=outputs[i], temperature=temperature, ignore_eos=True)
        n = 0
        # stream=False: one output per request, so the benchmark measures the engine, not 256
        # consumer coroutines waking up once per token.
        async for out in engine.generate(f"r{i}", prompts[i], params, stream=False):
            n += len(out.token_ids)
            if out.finished and out.finish_reason != "length":
                raise RuntimeError(f"request {i} finished with {out.finish_reason}: {out.error}")
        return n

    core = engine.core
    phases0, steps0 = dict(core.phase_seconds), core.num_steps
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    elapsed = time.perf_counter() - t0
    trace = step_trace.summarize(step_trace.records_of(core.step_trace), t0)
    steps = max(core.num_steps - steps0, 1)
    # Host ms per step by phase (sample includes waiting for the GPU); the rest of the wall time is
    # the engine loop itself (inbox, gauges, stats, delivery) and idle time between requests.
    phases = {k: (v - phases0[k]) * 1e3 / steps for k, v in core.phase_seconds.items()}
    timing = {"steps": steps, "ms_per_step": elapsed * 1e3 / steps, "phase_ms_per_step": phases, "trace": trace}
    return elapsed, sum(counts), await engine.cache_info(), timing   # cache info fresh, from the engine thread


def bench_engine(args, mode: str, prompts, outputs) -> dict:
    settings = engine_settings(args, enforce_eager=mode == "eager")
    # The step trace (benchmarks/step_trace.py) is read from the core; the file is written at shutdown.
    settings = settings.model_copy(update={"step_trace": Path(tempfile.gettempdir()) / f"offline_steps_{mode}.jsonl"})
    if mode == "graph-noprefix":   # the same graph engine with automatic prefix caching off (issue 12)
        settings = settings.model_copy(update={"enable_prefix_caching": False})
    engine = Engine(settings, Metrics())
    t0 = time.perf_counter()
    engine.start()
    if not engine.wait_ready(1800):
        raise RuntimeError(f"engine failed: {engine.error}")
    ready_s = time.perf_counter() - t0
    report = engine.warmup_report
    try:
        elapsed, tokens, cache_info, timing = asyncio.run(_run_engine(engine, prompts, outputs, args.temperature))
        stats = engine.stats()
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    cache = cache_info.get("stats", {})
    return {"mode": mode, "seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed,
            "load_and_warmup_s": ready_s, "warmup_s": getattr(report, "seconds", 0.0),
            "graphs_warmed": len(getattr(report, "captured", []) or []),
            "warmup_pool_bytes": getattr(report, "pool_bytes", 0),
            "graph_pool_bytes": cache_info.get("totals", {}).get("pool_bytes", 0),
            "graph_entries": cache_info.get("totals", {}).get("entries", 0),
            "steps_by_mode": stats.get("steps_by_mode"), "preemptions": stats.get("preemptions"),
            **timing,
            "hit_ratio": cache.get("hits", 0) / max(cache.get("hits", 0) + cache.get("misses", 0), 1),
            "cache_stats": cache}


def bench_hf(args, prompts, outputs) -> dict:
    from transformers import AutoModelForCausalLM

    device = "cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None   # ignore_eos: every request runs to its length
    model.generation_config.pad_token_id = 0
    cache_impl = args.hf_cache

    def run_batch(batch_prompts, max_new: int):
        width = max(len(p) for p in batch_prompts)
        ids = torch.zeros(len(batch_prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(batch_prompts):   # left padding: generation continues every row at the end
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        kw = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=args.temperature > 0)
        if args.temperature > 0:
            kw["temperature"] = args.temperature
        if cache_impl == "static":
            kw["cache_implementation"] = "static"
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kw)
        return out.shape[1] - width

    try:   # warm (and check the static cache works for this model/version; else fall back)
        run_batch([prompts[0][:16]], 4)
    except Exception as exc:  # noqa: BLE001 - report and fall back rather than lose the baseline
        if cache_impl != "static":
            raise
        print(f"note: HF static cache failed ({type(exc).__name__}: {exc}); using the dynamic cache",
              file=sys.stderr)
        cache_impl = "dynamic"
        run_batch([prompts[0][:16]], 4)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    generated = useful = 0
    bs = args.hf_batch_size
    for start in range(0, len(prompts), bs):
        outs = outputs[start:start + bs]
        new = run_batch(prompts[start:start + bs], max(outs))
        generated += new * len(outs)
        useful += sum(outs)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    model = None  # drop the weights before the next mode (the closure holds the same cell)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"mode": "hf", "seconds": elapsed, "output_tokens": useful, "tokens_per_s": useful / elapsed,
            "generated_tokens": generated, "hf_cache": cache_impl, "hf_batch_size": bs,
            "load_and_warmup_s": 0.0, "warmup_s": 0.0, "graph_pool_bytes": 0}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="Hugging Face model directory")
    ap.add_argument("--make-qwen05b", type=Path, metavar="DIR",
                    help="write a random Qwen2.5-0.5B-shaped checkpoint to DIR (and use it if --model is unset)")
    ap.add_argument("--modes", default="eager,graph,hf", help="comma list of eager, graph, graph-noprefix "
                    "(prefix caching off), hf")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default, same for all modes)")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-capture-size", type=int, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--hf-cache", default="static", choices=["static", "dynamic"])
    ap.add_argument("--out", type=Path, help="write results as JSON here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)

    if args.make_qwen05b:
        path = make_qwen05b(args.make_qwen05b)
        print(f"wrote {path}")
        args.model = args.model or path
        if args.modes == "none":
            return 0
    if args.model is None:
        ap.error("--model DIR (or --make-qwen05b DIR) is required")

    config = json.loads((args.model / "config.json").read_text())
    prompts, outputs = workload(args.num_seqs, config["vocab_size"], (args.min_input, args.max_input),
                                (args.min_output, args.max_output), args.seed)
    results = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        if mode in ("eager", "graph", "graph-noprefix"):
            results.append(bench_engine(args, mode, prompts, outputs))
        elif mode == "hf":
            results.append(bench_hf(args, prompts, outputs))
        else:
            ap.error(f"unknown mode {mode!r}; use eager, graph, graph-noprefix, hf")
        r = results[-1]
        print(f"  {mode}: {r['output_tokens']} tokens in {r['seconds']:.1f}s = {r['tokens_per_s']:.0f} tok/s",
              file=sys.stderr, flush=True)

    print(f"\n{'mode':<15}{'output tok/s':>14}{'seconds':>10}{'tokens':>10}{'warmup s':>10}{'pool MiB':>10}")
    for r in results:
        print(f"{r['mode']:<15}{r['tokens_per_s']:>14.0f}{r['seconds']:>10.1f}{r['output_tokens']:>10}"
              f"{r['warmup_s']:>10.2f}{r['graph_pool_bytes'] / 2**20:>10.1f}")
    engine_rows = [r for r in results if "phase_ms_per_step" in r]
    if engine_rows:
        print("\nper step (host ms; sample includes waiting for the GPU):")
        print(f"{'mode':<15}{'steps':>7}{'wall':>8}{'schedule':>10}{'execute':>9}{'sample':>8}{'postproc':>10}"
              f"{'other':>7}")
        for r in engine_rows:
            ph = r["phase_ms_per_step"]
            steps = r["steps"]
            other = r["ms_per_step"] - sum(ph.values())
            print(f"{r['mode']:<15}{steps:>7}{r['ms_per_step']:>8.2f}{ph['schedule']:>10.2f}{ph['execute']:>9.2f}"
                  f"{ph['sample']:>8.2f}{ph['postprocess']:>10.2f}{other:>7.2f}")
    traced = {r["mode"]: r["trace"] for r in engine_rows if r.get("trace")}
    if traced:
        print("\nstep trace (benchmarks/step_trace.py; ms per step):")
        print(step_trace.table(traced))
    by = {r["mode"]: r for r in results}
    if "graph" in by:
        for base in ("eager", "hf"):
            if base in by:
                print(f"graph / {base}: {by['graph']['tokens_per_s'] / by[base]['tokens_per_s']:.2f}x")
    if args.out:
        meta = {"model": str(args.model), "num_seqs": args.num_seqs, "input": [args.min_input, args.max_input],
                "output": [args.min_output, args.max_output], "seed": args.seed,
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__}
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
