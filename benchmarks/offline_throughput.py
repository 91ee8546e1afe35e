"""Offline generation throughput: graphcache eager vs graph cache vs Hugging Face `generate`.

Workloads (benchmarks/workloads.py; --workload nano,realistic runs both on one model load per mode):
  nano       nano-vllm's benchmark shape: 256 requests, random prompt lengths 100-1024 and output
             lengths 100-1024 (seed 0), greedy; --temperature, --top-p, --top-k and --seeded-every
             sample instead (e.g. --temperature 0.7 --top-p 0.8 --top-k 20, Qwen's generation_config,
             times top-k decode steps against greedy ones; the hf mode takes --temperature only).
  realistic  ShareGPT-like lognormal lengths (prompt median 220, sigma 0.9, cap 2048; output median
             200, sigma 0.75, cap 1024), temperature 0.8, top_p 0.95, every fourth request seeded,
             2 x max_num_seqs requests (the device's default unless --max-num-seqs), so prompt chunks
             join decode rows through the run.
Random token ids, ignore_eos, so every request produces exactly its output length. The engine runs
in-process (no HTTP): Engine + ModelRunner, all requests submitted at once, the clock running from
submission to the last token (after load, warmup and a short warm request, like nano-vllm's
"Benchmark: " request). Each engine row also splits its steps by kind (decode: every row feeds one
token; prefill: every row is a prompt chunk; mixed: both) with their mean ms (step_trace.by_kind).

Each run is set against its H200 roofline (benchmarks/roofline.py, from the model's config, the workload's
prompt and output lengths and --quantization / GRAPHCACHE_QUANTIZATION): the main table ends with the
bound's seconds, its output tok/s and the achieved share (bound seconds / measured seconds), and the engine
rows' steps by kind and decode steps by row count are each set against their own bound
(step_trace.against_roofline). JSON: bound_s, bound_tok_s, achieved, roofline (the bound's terms) and
roofline_steps per row.

  python benchmarks/offline_throughput.py --make-model qwen05b:/tmp/qwen05b                 # eager, graph, hf
  python benchmarks/offline_throughput.py --make-model llama8b:/tmp/llama8b --modes graph,eager \
      --workload nano,realistic --out bench.json
  python benchmarks/offline_throughput.py --smoke                 # tiny model on the CPU, a few requests
  python benchmarks/offline_throughput.py --make-model llama8b:/tmp/llama8b --modes graph --workload realistic \
      --loras 4 --lora-rank 16                       # four rank-16 adapters over the requests (issue 38)

Output tokens/s counts requested output tokens. HF `generate` runs fixed-size batches (left
padded, --hf-batch-size) to the longest output of each batch; its table row counts only the
requested tokens (what a user gets), and the JSON also has the raw generated count. HF runs the
nano workload only (one sampling setting per batch).
This file, workloads.py, model_shapes.py, step_trace.py and roofline.py use only engine APIs of commit 87f2733,
so they run against that tree too (scripts/gpu_check.sh phase realistic_old copies them there).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package

import torch  # noqa: E402
from graphcache.config import Settings  # noqa: E402
from graphcache.engine.loop.engine import Engine, SamplingParams  # noqa: E402
from graphcache.metrics import Metrics  # noqa: E402

from benchmarks import roofline, step_trace, workloads  # noqa: E402
from benchmarks.model_shapes import add_model_args, make_model, resolve_model, smoke_model  # noqa: E402


def make_qwen05b(out: Path) -> Path:
    return make_model("qwen05b", out)


def workload(n: int, vocab: int, in_range: tuple[int, int], out_range: tuple[int, int], seed: int):
    """The nano workload as (prompts, output lengths)."""
    reqs = workloads.nano(n, vocab, in_range, out_range, seed)
    return [r.prompt for r in reqs], [r.max_tokens for r in reqs]


def build_workloads(args, vocab: int) -> dict[str, list[workloads.Request]]:
    out = {}
    for name in [w.strip() for w in args.workload.split(",") if w.strip()]:
        if name == "nano":
            out[name] = workloads.nano(
                args.num_seqs,
                vocab,
                (args.min_input, args.max_input),
                (args.min_output, args.max_output),
                args.seed,
                args.temperature,
                args.top_p,
                args.seeded_every,
                args.top_k,
            )
        elif name == "realistic":
            shape = workloads.RealisticShape(prompt_cap=args.prompt_cap, output_cap=args.output_cap)
            n = args.realistic_requests or 2 * (args.max_num_seqs or default_max_num_seqs(args))
            out[name] = workloads.realistic(n, vocab, args.seed, shape)
        else:
            raise SystemExit(f"unknown workload {name!r}; use nano, realistic")
        print(f"workload {name}: {workloads.describe(out[name])}", file=sys.stderr)
    return out


def default_max_num_seqs(args) -> int:
    """The running sequences the engine takes on this device when --max-num-seqs is not given."""
    return engine_settings(args, enforce_eager=False).engine.max_num_seqs


def engine_settings(args, enforce_eager: bool) -> Settings:
    """The engine's settings; batch limits left unset (None) take the server's defaults for the device."""
    limits = dict(max_num_seqs=args.max_num_seqs, max_capture_size=args.max_capture_size)
    return Settings(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        enforce_eager=enforce_eager,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_queue=max(args.num_seqs, 2048),
        **{k: v for k, v in limits.items() if v is not None},
        # only when given: the old tree's Settings (realistic_old) has no such field
        **({"speculative_config": args.speculative_config} if args.speculative_config else {}),
        **lora_settings(args),
    )


def lora_settings(args) -> dict:
    """--loras N: N random adapters of --lora-rank (benchmarks/lora_adapters.py), every request through one
    of them in turn; none (and no LoRA setting, so older trees run this file) without it."""
    if not getattr(args, "loras", 0):
        return {}
    if getattr(args, "lora_modules", None) is None:
        from benchmarks.lora_adapters import write_random_adapters

        out = Path(tempfile.mkdtemp(prefix="bench-loras-"))
        args.lora_modules = write_random_adapters(args.model, out, args.loras, args.lora_rank)
    return dict(
        enable_lora=True, lora_modules=args.lora_modules, max_loras=args.loras, max_lora_rank=args.lora_rank
    )


async def run_request(
    engine: Engine, request_id: str, r: workloads.Request, lora_name: str | None, label: str
) -> int:
    """One workload request through the engine (through adapter lora_name; None: the base model), to its
    max_tokens: its output token count. A finish other than "length" raises, naming label."""
    params = SamplingParams(
        max_tokens=r.max_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        seed=r.seed,
        ignore_eos=True,
        **({"lora_name": lora_name} if lora_name is not None else {}),
    )
    n = 0
    # stream=False: one output per request, so the benchmark measures the engine, not 256
    # consumer coroutines waking up once per token.
    async for out in engine.generate(request_id, r.prompt, params, stream=False):
        n += len(out.token_ids)
        if out.finished and out.finish_reason != "length":
            raise RuntimeError(f"{label} finished with {out.finish_reason}: {out.error}")
    return n


async def _run_engine(
    engine: Engine,
    requests: list[workloads.Request],
    kinds: list[str],
    offset: int,
    loras: int = 0,
    roof: roofline.Roofline | None = None,
    lora_names: Sequence[str | None] | None = None,
) -> dict:
    """One workload, all at once; kinds[k] is the kind of step trace record offset + k; roof: the steps'
    roofline (roofline_steps). Request i runs through adapter lora{i % loras}, or lora_names[i] when
    given (None: the base model)."""
    if lora_names is None:
        lora_names = [f"lora{i % loras}" if loras else None for i in range(len(requests))]
    warm = engine.generate("warm", requests[0].prompt[:16], SamplingParams(max_tokens=8, ignore_eos=True))
    async for _ in warm:
        pass

    async def one(i: int) -> int:
        return await run_request(engine, f"r{i}-{id(requests)}", requests[i], lora_names[i], f"request {i}")

    core = engine.core
    phases0, steps0 = dict(core.phase_seconds), core.num_steps
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(len(requests))))
    elapsed = time.perf_counter() - t0
    records = step_trace.records_of(core.step_trace)
    trace = step_trace.summarize(records, t0)
    steps = max(core.num_steps - steps0, 1)
    # Host ms per step by phase (sample includes waiting for the GPU); the rest of the wall time is
    # the engine loop itself (inbox, gauges, stats, delivery) and idle time between requests.
    phases = {k: (v - phases0[k]) * 1e3 / steps for k, v in core.phase_seconds.items()}
    return {
        **speculation_of(core),
        "seconds": elapsed,
        "output_tokens": sum(counts),
        "tokens_per_s": sum(counts) / elapsed,
        "steps": steps,
        "ms_per_step": elapsed * 1e3 / steps,
        "phase_ms_per_step": phases,
        "trace": trace,
        "by_kind": step_trace.by_kind(records[offset:], list(kinds), t0),
        **(
            {"roofline_steps": step_trace.against_roofline(records[offset:], roof, list(kinds), t0)}
            if roof is not None
            else {}
        ),
        "cache_info": await engine.cache_info(),
        "stats": engine.stats(),
    }  # fresh, from the engine thread


def speculation_of(core) -> dict:
    """With --speculative-config: the spec-decode counters and the payoff rule's buckets (engine/spec/payoff.py)
    after the run; {} without (or on a tree without them)."""
    metrics, payoff = getattr(core, "spec_metrics", None), getattr(core.scheduler, "payoff", None)
    out = {}
    if metrics is not None:
        out["spec_counters"] = metrics.snapshot()
    if payoff is not None:
        out["spec_payoff"] = payoff.state()
    return out


async def _run_all(
    engine: Engine,
    runs: dict[str, list[workloads.Request]],
    kinds: list[str],
    offset: int,
    loras: int = 0,
    roof: roofline.Roofline | None = None,
):
    out = {}
    for name, requests in runs.items():
        stats0 = engine.stats().get("steps_by_mode") or {}
        out[name] = await _run_engine(engine, requests, kinds, offset, loras, roof)
        out[name]["steps_by_mode"] = {
            k: v - stats0.get(k, 0) for k, v in (out[name]["stats"].get("steps_by_mode") or {}).items()
        }
    return out


def _updated(settings: Settings, **flat) -> Settings:
    """Settings with flat names replaced; a flat Settings (the A-B's older tree) has no `updated`."""
    if hasattr(settings, "updated"):
        return settings.updated(**flat)
    return settings.model_copy(update=flat)


def start_engine(settings: Settings) -> tuple[Engine, float]:
    """An engine of `settings`, loaded and warmed up, and the seconds that took; RuntimeError if it failed."""
    engine = Engine(settings, Metrics())
    t0 = time.perf_counter()
    engine.start()
    if not engine.wait_ready(1800):
        error = engine.error
        engine.shutdown()
        raise RuntimeError(f"engine failed: {error}")
    return engine, time.perf_counter() - t0


def engine_capacity(engine: Engine) -> dict:
    """What bounds the engine's batch: its KV blocks (the runner's, read before shutdown) and max_num_seqs.
    Two engines a run compares must match here, or their throughputs measure their memory, not their
    steps. None where this tree's engine does not say (the A-B's older tree)."""
    runner = getattr(getattr(engine, "core", None), "runner", None)
    settings = engine.settings
    section = getattr(settings, "engine", settings)  # a flat Settings in the A-B's older tree
    return {
        "kv_blocks": getattr(runner, "num_kv_blocks", None),
        "max_num_seqs": getattr(section, "max_num_seqs", None),
    }


def stop_engine(engine: Engine) -> None:
    """Shut the engine down (its thread releases the device). The caller then drops its last reference and
    calls release_device_memory, so the next engine of the process finds the GPU memory free."""
    engine.shutdown()


def release_device_memory() -> None:
    """Free what a stopped engine's objects still hold and give the caching allocator's unused blocks back to
    the driver, where the next engine measures free memory. Call it once no reference to the engine is
    left: empty_cache cannot give back blocks a live tensor holds. gc.unfreeze: an engine freezes the
    collector's heap once ready (a tree whose engine does not unfreeze it at shutdown keeps its runner's
    cycles alive otherwise)."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def capacity_warning(capacities: dict[str, dict]) -> str | None:
    """A warning line when the engines named here (name -> engine_capacity) differ by more than 2% in KV
    blocks, or in max_num_seqs: then their comparison measures capacity too."""
    blocks = {k: c.get("kv_blocks") for k, c in capacities.items() if c.get("kv_blocks")}
    seqs = {k: c.get("max_num_seqs") for k, c in capacities.items() if c.get("max_num_seqs")}
    uneven_blocks = len(blocks) > 1 and max(blocks.values()) > 1.02 * min(blocks.values())
    uneven_seqs = len(set(seqs.values())) > 1
    if not (uneven_blocks or uneven_seqs):
        return None
    each = ", ".join(
        f"{k}: {c.get('kv_blocks')} KV blocks, max_num_seqs {c.get('max_num_seqs')}"
        for k, c in capacities.items()
    )
    return f"WARNING: the engines compared had different capacity ({each}); their ratios measure memory too"


def bench_engine(args, mode: str, runs: dict[str, list[workloads.Request]]) -> list[dict]:
    """One engine (one model load) in `mode`, each workload of `runs` in turn: a row per workload."""
    settings = engine_settings(args, enforce_eager=mode == "eager")
    # The step trace (benchmarks/step_trace.py) is read from the core; the file is written at shutdown.
    settings = _updated(settings, step_trace=Path(tempfile.gettempdir()) / f"offline_steps_{mode}.jsonl")
    if mode == "graph-noprefix":  # the same graph engine with automatic prefix caching off
        settings = _updated(settings, enable_prefix_caching=False)
    engine, ready_s = start_engine(settings)
    report = engine.warmup_report
    capacity = engine_capacity(engine)
    offset = len(engine.core.step_trace)  # records before the kinds are recorded (none when idle)
    kinds = step_trace.record_step_kinds(engine.core)
    rows = []
    try:
        for name, row in asyncio.run(
            _run_all(engine, runs, kinds, offset, getattr(args, "loras", 0), getattr(args, "roofline", None))
        ).items():
            cache_info, stats = row.pop("cache_info"), row.pop("stats")
            cache = cache_info.get("stats", {})
            rows.append(
                {
                    "mode": mode,
                    "workload": name,
                    "loras": getattr(args, "loras", 0),
                    **row,
                    "load_and_warmup_s": ready_s,
                    **capacity,
                    "warmup_s": getattr(report, "seconds", 0.0),
                    "graphs_warmed": len(getattr(report, "captured", []) or []),
                    "warmup_pool_bytes": getattr(report, "pool_bytes", 0),
                    "graph_pool_bytes": cache_info.get("totals", {}).get("pool_bytes", 0),
                    "graph_entries": cache_info.get("totals", {}).get("entries", 0),
                    "preemptions": stats.get("preemptions"),
                    "hit_ratio": cache.get("hits", 0) / max(cache.get("hits", 0) + cache.get("misses", 0), 1),
                    "cache_stats": cache,
                }
            )
    finally:
        stop_engine(engine)
        del engine
        release_device_memory()
    return rows


def bench_hf(args, prompts, outputs) -> dict:
    from transformers import AutoModelForCausalLM

    device = "cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    dtype = {
        "auto": torch.bfloat16 if device == "cuda" else torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float32": torch.float32,
    }[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every request runs to its length
    model.generation_config.pad_token_id = 0
    cache_impl = args.hf_cache

    def run_batch(batch_prompts, max_new: int):
        width = max(len(p) for p in batch_prompts)
        ids = torch.zeros(len(batch_prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(batch_prompts):  # left padding: generation continues every row at the end
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        kw = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=args.temperature > 0)
        if args.temperature > 0:
            kw["temperature"] = args.temperature
        if cache_impl == "static":
            kw["cache_implementation"] = "static"
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kw)
        return out.shape[1] - width

    try:  # warm (and check the static cache works for this model/version; else fall back)
        run_batch([prompts[0][:16]], 4)
    except Exception as exc:  # noqa: BLE001 - report and fall back rather than lose the baseline
        if cache_impl != "static":
            raise
        print(
            f"note: HF static cache failed ({type(exc).__name__}: {exc}); using the dynamic cache",
            file=sys.stderr,
        )
        cache_impl = "dynamic"
        run_batch([prompts[0][:16]], 4)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    generated = useful = 0
    bs = args.hf_batch_size
    for start in range(0, len(prompts), bs):
        outs = outputs[start : start + bs]
        new = run_batch(prompts[start : start + bs], max(outs))
        generated += new * len(outs)
        useful += sum(outs)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    model = None  # drop the weights before the next mode (the closure holds the same cell)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "mode": "hf",
        "seconds": elapsed,
        "output_tokens": useful,
        "tokens_per_s": useful / elapsed,
        "generated_tokens": generated,
        "hf_cache": cache_impl,
        "hf_batch_size": bs,
        "load_and_warmup_s": 0.0,
        "warmup_s": 0.0,
        "graph_pool_bytes": 0,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument(
        "--modes",
        default="eager,graph,hf",
        help="comma list of eager, graph, graph-noprefix (prefix caching off), hf",
    )
    ap.add_argument(
        "--workload", default="nano", help="comma list of nano, realistic (benchmarks/workloads.py)"
    )
    ap.add_argument("--num-seqs", type=int, default=256, help="nano: requests")
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument(
        "--realistic-requests",
        type=int,
        default=0,
        help="realistic: requests (0 = 2 x max_num_seqs, the flag's or the device default's)",
    )
    ap.add_argument("--prompt-cap", type=int, default=2048, help="realistic: longest prompt")
    ap.add_argument("--output-cap", type=int, default=1024, help="realistic: longest output")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="nano: 0 = greedy (default, same for all modes)"
    )
    ap.add_argument("--top-p", type=float, default=1.0, help="nano: top_p of every request")
    ap.add_argument("--top-k", type=int, default=0, help="nano: top_k of every request (0: off)")
    ap.add_argument("--seeded-every", type=int, default=0, help="nano: every k-th request seeded (0: none)")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--max-num-seqs", type=int, help="default: the server's for the device (config.py)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-capture-size", type=int, help="default: the server's for the device")
    ap.add_argument(
        "--speculative-config", help="the engine modes' --speculative-config JSON (benchmarks/spec_decode.py)"
    )
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--hf-cache", default="static", choices=["static", "dynamic"])
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a CPU-sized run: the tiny model (written to a temp dir "
        "unless --model/--make-model), 6 nano and 8 realistic requests with short caps, eager",
    )
    ap.add_argument(
        "--loras",
        type=int,
        default=0,
        help="serve N random LoRA adapters (--enable-lora --max-loras N) and spread the requests over them",
    )
    ap.add_argument("--lora-rank", type=int, default=16, help="rank of the --loras adapters")
    ap.add_argument("--out", type=Path, help="write results as JSON here")
    return ap


SMOKE = dict(
    device="cpu",
    modes="eager",
    num_seqs=6,
    min_input=8,
    max_input=48,
    min_output=4,
    max_output=12,
    max_num_seqs=4,
    realistic_requests=8,
    prompt_cap=96,
    output_cap=16,
    max_num_batched_tokens=256,
    max_model_len=512,
    max_capture_size=8,
)


def apply_smoke(args: argparse.Namespace) -> None:
    for key, value in SMOKE.items():
        setattr(args, key, value)
    smoke_model(args)


def quantization_of(args) -> str:
    """The engine's quantization setting (GRAPHCACHE_QUANTIZATION): settings.model.quantization, or a flat
    Settings' (the A-B's older tree), auto when the tree has none."""
    settings = engine_settings(args, enforce_eager=False)
    section = getattr(settings, "model", None)
    return str(getattr(section, "quantization", None) or getattr(settings, "quantization", None) or "auto")


def own_device_bounds(
    results: list[dict], runs: dict[str, list[workloads.Request]], roof: roofline.Roofline
) -> str | None:
    """On a GPU other than the H200 that roofline.py has figures for (the H100 the device tool lends when no
    H200 comes), each row's bound on that GPU too: own_bound_s, own_achieved. Returns the GPU's label."""
    named = roofline.device_named(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    if named is None or named[1] == roof.device:
        return None
    label, device = named
    add_bounds(results, runs, dataclasses.replace(roof, device=device), prefix="own_")
    for r in results:
        r["own_device"] = label
    return label


def kv_cache_dtype_of(args) -> str:
    """The engine's kv_cache_dtype (GRAPHCACHE_KV_CACHE_DTYPE), auto on a tree without the setting."""
    settings = engine_settings(args, enforce_eager=False)
    return str(getattr(getattr(settings, "model", None), "kv_cache_dtype", None) or "auto")


def add_bounds(
    results: list[dict], runs: dict[str, list[workloads.Request]], roof: roofline.Roofline, prefix: str = ""
) -> None:
    """Each row's run bound (its workload's requests): bound_s, bound_tok_s, achieved, roofline (each key
    after `prefix`)."""
    bounds = {
        name: roof.run_bound((len(r.prompt), r.max_tokens) for r in requests)
        for name, requests in runs.items()
    }
    for r in results:
        b = bounds[r["workload"]]
        values = dict(
            bound_s=b.seconds,
            bound_tok_s=b.tokens_per_s,
            achieved=b.achieved(r["seconds"]),
            roofline=b.as_dict(),
        )
        r.update({prefix + key: v for key, v in values.items()})


def kind_table(rows: list[dict]) -> str:
    """Steps by kind per (mode, workload): count, mean ms and, as launch/wait, the host's launch and its
    wait for the tokens (step_trace.by_kind), markdown. A kind whose launch exceeds its ms is host-bound."""
    head = (
        "| mode | workload | "
        + " | ".join(f"{k} steps | {k} ms (launch/wait)" for k in step_trace.KINDS)
        + " |"
    )
    lines = [head, "|---" * (2 + 2 * len(step_trace.KINDS)) + "|"]
    for r in rows:
        cells = []
        for k in step_trace.KINDS:
            s = r["by_kind"].get(k)
            cells += (
                [str(s["steps"]), f"{s['ms']:.2f} ({s['launch_ms']:.2f}/{s['wait_ms']:.2f})"]
                if s
                else ["0", ""]
            )
        lines.append(f"| {r['mode']} | {r['workload']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.smoke:
        apply_smoke(args)
    args.model = resolve_model(args)
    if args.modes == "none":
        return 0
    if args.model is None:
        ap.error("--model DIR (or --make-model SHAPE:DIR, or --smoke) is required")

    config = json.loads((args.model / "config.json").read_text())
    runs = build_workloads(args, config["vocab_size"])
    args.roofline = roofline.for_config(config, quantization_of(args), args.dtype, kv_cache_dtype_of(args))
    results = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        if mode in ("eager", "graph", "graph-noprefix"):
            rows = bench_engine(args, mode, runs)
        elif mode == "hf":
            if "nano" not in runs:
                print("note: hf runs the nano workload only; skipped", file=sys.stderr)
                continue
            rows = [
                dict(
                    bench_hf(args, [r.prompt for r in runs["nano"]], [r.max_tokens for r in runs["nano"]]),
                    workload="nano",
                )
            ]
        else:
            ap.error(f"unknown mode {mode!r}; use eager, graph, graph-noprefix, hf")
        results += rows
        for r in rows:
            print(
                f"  {mode} {r['workload']}: {r['output_tokens']} tokens in {r['seconds']:.1f}s = "
                f"{r['tokens_per_s']:.0f} tok/s",
                file=sys.stderr,
                flush=True,
            )

    add_bounds(results, runs, args.roofline)
    own = own_device_bounds(results, runs, args.roofline)
    print(
        f"\n{'mode':<15}{'workload':<10}{'output tok/s':>14}{'seconds':>10}{'tokens':>10}{'warmup s':>10}"
        f"{'pool MiB':>10}{'KV blocks':>11}{'max seqs':>10}{'bound s':>10}{'bound tok/s':>13}{'share':>8}"
    )
    for r in results:
        print(
            f"{r['mode']:<15}{r['workload']:<10}{r['tokens_per_s']:>14.0f}{r['seconds']:>10.1f}{r['output_tokens']:>10}"
            f"{r['warmup_s']:>10.2f}{r['graph_pool_bytes'] / 2**20:>10.1f}"
            f"{r.get('kv_blocks') or '':>11}{r.get('max_num_seqs') or '':>10}"
            f"{r['bound_s']:>10.2f}{r['bound_tok_s']:>13.0f}{r['achieved']:>8.1%}"
        )
    warning = capacity_warning({r["mode"]: r for r in results if "kv_blocks" in r})
    if warning:
        print(warning)
    roof = args.roofline
    print(
        f"(bound: H200 roofline, benchmarks/roofline.py: {roof.weight_bytes / 1e9:.2f} GB of weights"
        f"{' in FP8' if roof.fp8 else ''}, {roof.kv_bytes_per_token} KV bytes a token"
        f"{' (FP8 cache)' if roof.kv_fp8 else ''}; share = bound s / seconds; "
        "prefix-cache hits not counted)"
    )
    for name, b in {r["workload"]: r["roofline"] for r in results}.items():
        print(
            f"  {name}: GEMMs {b['gemm_s']:.2f} s + KV {b['kv_s']:.2f} s, weight floor {b['weight_floor_s']:.2f} s "
            f"({b['max_steps']} steps); set by {b['bound_limit']}"
        )
    for r in results if own else ():
        print(
            f"  {r['mode']} {r['workload']} against this {own}'s own roofline: bound {r['own_bound_s']:.2f} s, "
            f"share {r['own_achieved']:.1%}"
        )
    engine_rows = [r for r in results if "phase_ms_per_step" in r]
    if engine_rows:
        print("\nper step (host ms; sample includes waiting for the GPU):")
        print(
            f"{'mode':<15}{'workload':<10}{'steps':>7}{'wall':>8}{'schedule':>10}{'execute':>9}{'sample':>8}"
            f"{'postproc':>10}{'other':>7}"
        )
        for r in engine_rows:
            ph = r["phase_ms_per_step"]
            other = r["ms_per_step"] - sum(ph.values())
            print(
                f"{r['mode']:<15}{r['workload']:<10}{r['steps']:>7}{r['ms_per_step']:>8.2f}{ph['schedule']:>10.2f}"
                f"{ph['execute']:>9.2f}{ph['sample']:>8.2f}{ph['postprocess']:>10.2f}{other:>7.2f}"
            )
        print(
            "\nsteps by kind (decode: one token a row; prefill: prompt chunks only; mixed: both; "
            "ms = completion to completion):"
        )
        print(kind_table(engine_rows))
    traced = {f"{r['mode']} {r['workload']}": r["trace"] for r in engine_rows if r.get("trace")}
    if traced:
        print("\nstep trace (benchmarks/step_trace.py; ms per step):")
        print(step_trace.table(traced))
    steps_vs_bound = {
        f"{r['mode']} {r['workload']}": r["roofline_steps"] for r in engine_rows if r.get("roofline_steps")
    }
    if steps_vs_bound:
        print(
            "\nsteps against their H200 roofline (step_trace.against_roofline; ms = completion to completion):"
        )
        print(step_trace.roofline_table(steps_vs_bound))
        for r in engine_rows:
            every = (r.get("roofline_steps") or {}).get("all")
            if every and every["bound_s"]:
                print(
                    f"  {r['mode']} {r['workload']}: its steps took {every['seconds']:.2f} s and need "
                    f"{every['bound_s']:.2f} s at their own bounds; the run's bound ({r['bound_s']:.2f} s) is "
                    f"{r['bound_s'] / every['bound_s']:.1%} of that, the most a run of these steps can reach"
                )
    for name in dict.fromkeys(r["workload"] for r in results):
        by = {r["mode"]: r for r in results if r["workload"] == name}
        if "graph" in by:
            for base in ("eager", "hf"):
                if base in by:
                    print(
                        f"{name}: graph / {base}: {by['graph']['tokens_per_s'] / by[base]['tokens_per_s']:.2f}x"
                    )
    if args.out:
        meta = {
            "model": str(args.model),
            "workloads": {k: workloads.describe(v) for k, v in runs.items()},
            "num_seqs": args.num_seqs,
            "input": [args.min_input, args.max_input],
            "output": [args.min_output, args.max_output],
            "seed": args.seed,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "roofline": {
                "hbm_bytes_per_s": roof.device.hbm_bytes_per_s,
                "bf16_flops": roof.device.bf16_flops,
                "fp8_flops": roof.device.fp8_flops,
                "fp8": roof.fp8,
                "weight_bytes": roof.weight_bytes,
                "kv_bytes_per_token": roof.kv_bytes_per_token,
            },
            "torch": torch.__version__,
        }
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
