"""LoRA adapters measured against issue 38's "Done when" bars, in one process (one device call).

Two engines, one after the other, graph mode at the server's defaults (offline_throughput.py's settings),
the realistic offline workload (benchmarks/workloads.py, --realistic-requests, default 512) and one stream
(one greedy request of --stream-prompt / --stream-output tokens, ignore_eos, --stream-rounds times):

1. base: no --enable-lora. The realistic workload (tok/s) and one stream (time per output token).
2. lora: --enable-lora --max-loras 4 --max-lora-rank R with four random rank-R adapters
   (benchmarks/lora_adapters.py):
   a. the realistic workload with no adapter on any request (a batch with no adapter rows);
   b. the same workload, request i through lora{i % 4};
   c. one stream with lora0 and one without;
   d. a runtime load under load: a workload of the same shape (fresh prompts) where request i runs
      through lora{i % 4} for i % 4 < 3 and the base model for the rest (so one GPU slot is idle, as
      when a new adapter arrives on a busy server); a third of the way in (a third of 2b's seconds) a fifth
      adapter is loaded through the engine's runtime path (Engine.load_lora_adapter, then the name listed in
      Engine.lora_modules: what POST /v1/load_lora_adapter calls) and --new-adapter-requests requests name
      it. Its first step writes it into the least recently used slot (lora3's) on the engine thread.
      The load's parts are timed apart: the read (read and checked, laid out as its slots and pinned: off the
      engine thread), the engine thread's command (registering it, between steps) and the slot write (host
      time, and its copies' time on the stream, from CUDA events); the longest steps after the load are
      listed with their host phases and which of these parts overlapped them.
      The step trace (settings.engine.step_trace) gives each step's time: completion minus the later of
      the previous step's completion and its own schedule (the pipeline's period; an idle gap is not a
      step). Steps are grouped by kind (decode: every row feeds one token; mixed; prefill), rows (power of
      two bucket) and tokens (power of two bucket), because a mixed step is naturally longer than a
      decode step of the same rows; the figure is the largest ratio, over the groups, of a group's longest
      step in the window after the load (from the load call to --window seconds later, or past the slot
      write if later) to the group's median step in the --window seconds before it (or every step before
      it where that window has fewer than 3). The plain median and max over all steps in the window around
      the load are printed too (the issue's words; mixed steps make that ratio large without any stall).

Each engine's capacity (its KV blocks and max_num_seqs: offline_throughput.engine_capacity) is printed
with a warning when the two differ by more than 2%: then 1 against 2a compares memory, not LoRA's cost. The
first engine is shut down and its memory given back (offline_throughput.release_device_memory) before the
second starts.

Throughputs are the best of --repeats runs (each repeat a fresh workload seed, so no run finds another's
prompts in the prefix cache; 2a and 2b of one repeat share prompts, and an adapter's KV never matches the
base model's); stream figures are medians over the rounds. The table prints each criterion, the value,
the bar and PASS/FAIL; --out writes everything as JSON.

  python benchmarks/lora_bench.py --make-model llama8b:/tmp/llama8b --out lora.json    # the issue's shape
  python benchmarks/lora_bench.py --smoke                        # the tiny model on the CPU, tiny adapters
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package

import torch  # noqa: E402
from graphcache.engine.loop import admin_calls  # noqa: E402
from graphcache.engine.loop.engine import Engine, SamplingParams  # noqa: E402
from graphcache.engine.lora_modules import LoraModule  # noqa: E402

from benchmarks import offline_throughput, step_trace, workloads  # noqa: E402
from benchmarks.lora_adapters import write_random_adapters  # noqa: E402
from benchmarks.model_shapes import add_model_args, resolve_model  # noqa: E402

ADAPTERS = 4  # the issue's four adapters (--max-loras 4); a fifth is loaded at runtime
NEW_ADAPTER = f"lora{ADAPTERS}"

# --------------------------------------------------------------------------- engines


def engine_args(args: argparse.Namespace, lora_modules: list[str] | None) -> argparse.Namespace:
    """offline_throughput's arguments (its defaults: the server's, graph mode) with this run's model and
    limits; lora_modules: the adapters of an --enable-lora --max-loras 4 engine, or None for a base one."""
    ns = offline_throughput.build_parser().parse_args([])
    for key in (
        "model",
        "device",
        "dtype",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "max_capture_size",
        "lora_rank",
    ):
        setattr(ns, key, getattr(args, key))
    ns.loras = ADAPTERS if lora_modules else 0
    ns.lora_modules = lora_modules
    return ns


def start(args: argparse.Namespace, lora_modules: list[str] | None, name: str):
    """(engine, load + warmup seconds, step kinds, trace offset): an engine with the step trace on and its
    schedule wrapped so each step's kind is recorded (step_trace.record_step_kinds)."""
    offline_throughput.release_device_memory()  # what an earlier engine of this process left cached
    settings = offline_throughput.engine_settings(engine_args(args, lora_modules), enforce_eager=False)
    trace = Path(tempfile.gettempdir()) / f"lora_bench_steps_{name}.jsonl"
    settings = offline_throughput._updated(settings, step_trace=trace)
    print(f"starting the {name} engine ...", file=sys.stderr, flush=True)
    engine, ready_s = offline_throughput.start_engine(settings)
    offset = len(engine.core.step_trace)
    kinds = step_trace.record_step_kinds(engine.core)
    return engine, ready_s, kinds, offset


def realistic(args: argparse.Namespace, vocab: int, seed: int) -> list[workloads.Request]:
    shape = workloads.RealisticShape(prompt_cap=args.prompt_cap, output_cap=args.output_cap)
    return workloads.realistic(args.realistic_requests, vocab, seed, shape)


def workload_row(row: dict) -> dict:
    """The figures of one offline_throughput._run_engine row worth keeping."""
    keep = ("seconds", "output_tokens", "tokens_per_s", "steps", "ms_per_step", "by_kind", "trace")
    return {k: row[k] for k in keep if k in row}


async def run_workload(engine: Engine, requests, kinds, offset, lora_names=None) -> dict:
    return workload_row(
        await offline_throughput._run_engine(engine, requests, kinds, offset, 0, lora_names=lora_names)
    )


# --------------------------------------------------------------------------- one stream


def stream_prompt(args: argparse.Namespace, vocab: int, r: int) -> list[int]:
    """Round r's prompt: random ids below 10000 (as workloads.py), the same on every engine."""
    return workloads.random_prompt(random.Random(args.seed * 1000 + r), args.stream_prompt, vocab)


async def one_stream(engine: Engine, prompt: list[int], args, lora: str | None, tag: str) -> dict:
    """One greedy request alone; TPOT = (last token's arrival - first's) / tokens after the first."""
    params = SamplingParams(
        max_tokens=args.stream_output,
        temperature=0.0,
        ignore_eos=True,
        **({"lora_name": lora} if lora is not None else {}),
    )
    t0 = time.perf_counter()
    first = last = None
    n = n_first = 0
    async for out in engine.generate(f"stream-{tag}", prompt, params):
        if out.token_ids:
            last = time.perf_counter()
            n += len(out.token_ids)
            if first is None:
                first, n_first = last, n
        if out.finished and out.finish_reason != "length":
            raise RuntimeError(f"stream {tag} finished with {out.finish_reason}: {out.error}")
    assert first is not None and last is not None
    return {
        "tokens": n,
        "ttft_ms": (first - t0) * 1e3,
        "tpot_ms": (last - first) * 1e3 / max(n - n_first, 1),
    }


async def streams(engine: Engine, args, vocab: int, lora: str | None, name: str) -> dict:
    runs = [
        await one_stream(engine, stream_prompt(args, vocab, r), args, lora, f"{name}-{r}")
        for r in range(args.stream_rounds)
    ]
    return {"runs": runs, "tpot_ms": statistics.median(r["tpot_ms"] for r in runs)}


# --------------------------------------------------------------------------- the runtime load


def step_times(records: list[dict], kinds: list[str]) -> list[dict]:
    """Each traced step (kinds[i] is records[i]'s kind) with its time: completion minus the later of the
    previous completion and its own schedule, so an idle gap before a step is not counted as its time."""
    out = []
    for i in range(1, min(len(records), len(kinds))):
        r, prev = records[i], records[i - 1]
        ms = (r["completed"] - max(prev["completed"], r["scheduled"])) * 1e3
        out.append({**r, "kind": kinds[i], "ms": ms})
    return out


def bucket(n: int) -> int:
    """The power of two at or above n."""
    return 1 << max(n - 1, 0).bit_length()


def group_of(step: dict) -> str:
    return f"{step['kind']}:rows<={bucket(step['rows'])}:tokens<={bucket(step['tokens'])}"


SLOWEST = 5  # the longest steps after the load, listed


def load_window(
    steps: list[dict],
    t_load: float,
    window: float,
    writes: list[tuple[float, float]],
    spans: dict[str, tuple[float, float]] | None = None,
) -> dict:
    """The load's effect on step times (module docstring, 2d): per group of like steps, the longest after
    the load over the median before it; the worst group; the plain window median and max; and the SLOWEST
    steps after the load against their group's median, each with the named `spans` (perf_counter start, end:
    the load's parts) and slot writes its time overlapped."""
    t_end = max([t_load + window] + [w[1] + 0.5 for w in writes])
    after = [s for s in steps if t_load <= s["scheduled"] <= t_end]
    before_all = [s for s in steps if s["completed"] < t_load]
    before = [s for s in before_all if s["scheduled"] >= t_load - window]
    groups = []
    for g in sorted({group_of(s) for s in after}):
        ref = [s["ms"] for s in before if group_of(s) == g]
        if len(ref) < 3:
            ref = [s["ms"] for s in before_all if group_of(s) == g]
        if len(ref) < 3:
            continue  # no like steps before the load to compare with
        mine = [s["ms"] for s in after if group_of(s) == g]
        med = statistics.median(ref)
        groups.append(
            {
                "group": g,
                "steps_before": len(ref),
                "steps_after": len(mine),
                "median_before_ms": med,
                "max_after_ms": max(mine),
                "ratio": max(mine) / med,
            }
        )
    worst = max(groups, key=lambda x: x["ratio"]) if groups else None
    around = [s["ms"] for s in steps if t_load - window <= s["scheduled"] <= t_end]
    out: dict = {
        "window_s": [t_load - window, t_end],
        "groups": groups,
        "worst": worst,
        "steps_after": len(after),
        "compared_after": sum(g["steps_after"] for g in groups),
        "median_ms": statistics.median(around) if around else None,
        "max_ms": max(around) if around else None,
    }
    out["plain_ratio"] = out["max_ms"] / out["median_ms"] if around else None
    write_steps = []
    for i, (w0, w1) in enumerate(writes):  # the steps whose host work held each slot write
        for s in steps:
            if s["scheduled"] <= w0 <= s["completed"]:
                g = [x for x in groups if x["group"] == group_of(s)]
                write_steps.append(
                    {
                        "write": i,
                        "write_ms": (w1 - w0) * 1e3,
                        "step_ms": s["ms"],
                        "group": group_of(s),
                        "ratio": s["ms"] / g[0]["median_before_ms"] if g else None,
                    }
                )
                break
    out["slot_writes"] = write_steps
    named = dict(spans or {})
    named.update({f"slot write {i}": w for i, w in enumerate(writes)})
    medians = {g["group"]: g["median_before_ms"] for g in groups}
    # by ratio to their group's median; the longest step of all too (its group may have none before)
    ranked = sorted(
        (s for s in after if group_of(s) in medians), key=lambda s: -s["ms"] / medians[group_of(s)]
    )
    listed = ranked[:SLOWEST]
    longest = max(after, key=lambda s: s["ms"], default=None)
    if longest is not None and all(s is not longest for s in listed):
        listed.append(longest)
    out["slowest"] = [slow_step(s, t_load, medians.get(group_of(s)), named) for s in listed]
    return out


def slow_step(step: dict, t_load: float, median: float | None, spans: dict[str, tuple[float, float]]) -> dict:
    """One step after the load: when (s after the load call), its group, ms, ratio to the group's median
    before, its host phases (ms: schedule, launch = the runner's layout + replay, the wait for its tokens;
    from the step trace when it has them) and the spans that overlap it."""
    start, end = max(step["scheduled"], step["completed"] - step["ms"] / 1e3), step["completed"]
    phases = {}
    if all(k in step for k in ("launch", "launched", "complete", "tokens_on_host")):
        phases = {
            "schedule_ms": (step["launch"] - step["scheduled"]) * 1e3,
            "launch_ms": (step["launched"] - step["launch"]) * 1e3,
            "wait_ms": (step["tokens_on_host"] - step["complete"]) * 1e3,
        }
    return {
        "after_load_s": step["scheduled"] - t_load,
        "group": group_of(step),
        "ms": step["ms"],
        "ratio": step["ms"] / median if median else None,
        **phases,
        "during": [name for name, (a, b) in spans.items() if a < end and b > start],
    }


def time_slot_writes(engine: Engine) -> tuple[list[tuple[float, float]], list]:
    """(start, end) perf_counter of each LoRA slot write from now on (LoraSlots.write, engine thread), and on
    CUDA each write's pair of timing events on the engine's stream (gpu_ms: its copies' time there)."""
    lora = engine.core.runner.lora
    writes: list[tuple[float, float]] = []
    events: list = []
    inner = lora.write
    cuda = lora.stacks and next(iter(lora.stacks.values())).a.is_cuda

    def timed(slot, image):
        pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        if pair:
            pair[0].record()
        t = time.perf_counter()
        inner(slot, image)
        writes.append((t, time.perf_counter()))
        if pair:
            pair[1].record()
        events.append(pair)

    lora.write = timed
    return writes, events


def gpu_ms(events: list) -> list[float | None]:
    out = []
    for pair in events:
        if pair is None:
            out.append(None)
        else:
            pair[1].synchronize()
            out.append(pair[0].elapsed_time(pair[1]))
    return out


def time_load_parts(engine: Engine) -> dict:
    """The runtime load's parts from now on, filled in as they run: "read" (LoraSlots.read_checked: the
    checkpoint read and checked, laid out as its slots, pinned; its thread) and "command" (the engine
    thread's load command, admin_calls.load_adapter; its thread), each with its perf_counter span."""
    lora = engine.core.runner.lora
    parts: dict = {}
    read, command = lora.read_checked, admin_calls.load_adapter

    def timed_read(module):
        t = time.perf_counter()
        image = read(module)
        parts["read"] = {
            "span": (t, time.perf_counter()),
            "thread": threading.current_thread().name,
            "read_ms": image.read_seconds * 1e3,
            "layout_ms": image.pack_seconds * 1e3,
            "mib": image.nbytes / 2**20,
            "pinned": image.pinned,
        }
        return image

    def timed_command(*args):
        t = time.perf_counter()
        try:
            return command(*args)
        finally:
            parts["command"] = {"span": (t, time.perf_counter()), "thread": threading.current_thread().name}

    lora.read_checked = timed_read
    admin_calls.load_adapter = timed_command  # the name EngineAdmin.load_lora_adapter calls (restored after)
    parts["restore"] = lambda: setattr(admin_calls, "load_adapter", command)
    return parts


async def load_under_load(
    engine: Engine, args, vocab: int, kinds, offset, new_path: str, delay: float
) -> dict:
    """2d: the slot-idle mix, the fifth adapter loaded after `delay` s, then requests that name it."""
    requests = realistic(args, vocab, args.seed + args.repeats)
    names = [f"lora{i % ADAPTERS}" if i % ADAPTERS < ADAPTERS - 1 else None for i in range(len(requests))]
    extra = workloads.realistic(
        args.new_adapter_requests,
        vocab,
        args.seed + 100,
        workloads.RealisticShape(prompt_cap=args.prompt_cap, output_cap=args.output_cap),
    )
    writes, write_events = time_slot_writes(engine)
    parts = time_load_parts(engine)
    marks: dict = {}

    async def load_then_send() -> int:
        await asyncio.sleep(delay)
        marks["t_load"] = time.perf_counter()
        # what POST /v1/load_lora_adapter does (api/server/lora_admin.py): the engine reads and checks the
        # adapter off its thread, registers it between steps, then the API lists the name
        status, message = await engine.load_lora_adapter(NEW_ADAPTER, new_path)
        if status != 200:
            raise RuntimeError(f"runtime load failed: {status} {message}")
        engine.lora_modules.add(LoraModule(NEW_ADAPTER, new_path))
        marks["load_call_ms"] = (time.perf_counter() - marks["t_load"]) * 1e3

        counts = await asyncio.gather(
            *(
                offline_throughput.run_request(engine, f"new-{i}", r, NEW_ADAPTER, f"new-adapter request {i}")
                for i, r in enumerate(extra)
            )
        )
        return sum(counts)

    try:
        row, new_tokens = await asyncio.gather(
            offline_throughput._run_engine(engine, requests, kinds, offset, 0, lora_names=names),
            load_then_send(),
        )
    finally:
        parts.pop("restore")()
    records = step_trace.records_of(engine.core.step_trace)[offset:]
    spans = {name: part["span"] for name, part in parts.items()}
    window = load_window(step_times(records, kinds), marks["t_load"], args.window, writes, spans)
    stream_ms = gpu_ms(write_events)
    for w in window["slot_writes"]:
        w["gpu_ms"] = stream_ms[w["write"]]
    load_parts = {name: {k: v for k, v in part.items() if k != "span"} for name, part in parts.items()}
    for name, part in parts.items():
        load_parts[name]["ms"] = (part["span"][1] - part["span"][0]) * 1e3
    return {
        **workload_row(row),
        "load_after_s": delay,
        "load_call_ms": marks["load_call_ms"],
        "load_parts": load_parts,
        "new_adapter_tokens": new_tokens,
        "new_adapter_requests": len(extra),
        **window,
    }


# --------------------------------------------------------------------------- the two engines


def best(rows: list[dict]) -> float:
    return max(r["tokens_per_s"] for r in rows)


async def base_runs(engine: Engine, args, vocab: int, kinds: list[str], offset: int) -> dict:
    """1: the realistic workload and one stream on an engine without --enable-lora."""
    out: dict = {"realistic": []}
    for r in range(args.repeats):
        reqs = realistic(args, vocab, args.seed + r)
        out["realistic"].append(await run_workload(engine, reqs, kinds, offset))
    out["stream"] = await streams(engine, args, vocab, None, "base")
    return out


async def lora_runs(engine: Engine, args, vocab: int, kinds: list[str], offset: int, new_path: str) -> dict:
    """2a-2d on the --enable-lora engine (module docstring)."""
    out: dict = {"no_adapter": [], "mixed": []}
    for r in range(args.repeats):  # a: no adapter rows; b: request i through lora{i % 4}, the same prompts
        reqs = realistic(args, vocab, args.seed + r)
        out["no_adapter"].append(await run_workload(engine, reqs, kinds, offset))
        names = [f"lora{i % ADAPTERS}" for i in range(len(reqs))]
        out["mixed"].append(await run_workload(engine, reqs, kinds, offset, names))
    out["stream_base"] = await streams(engine, args, vocab, None, "lora-engine-base")
    out["stream_adapter"] = await streams(engine, args, vocab, "lora0", "lora-engine-adapter")
    delay = min(r["seconds"] for r in out["mixed"]) / 3
    out["runtime_load"] = await load_under_load(engine, args, vocab, kinds, offset, new_path, delay)
    return out


def bench(args, vocab: int, name: str, modules: list[str] | None, new_path: str = "") -> dict:
    """One engine (no --enable-lora when modules is None), its runs, and the engine shut down."""
    engine, ready_s, kinds, offset = start(args, modules, name)
    capacity = offline_throughput.engine_capacity(engine)
    print(f"{name} engine: {capacity}", file=sys.stderr, flush=True)
    try:
        if modules is None:
            out = asyncio.run(base_runs(engine, args, vocab, kinds, offset))
        else:
            out = asyncio.run(lora_runs(engine, args, vocab, kinds, offset, new_path))
        return {"load_and_warmup_s": ready_s, **capacity, **out}
    finally:
        offline_throughput.stop_engine(engine)
        del engine  # main releases the device memory once this frame is gone


# --------------------------------------------------------------------------- the verdicts


def criteria(base: dict | None, lora: dict | None) -> list[dict]:
    """Each bar of issue 38 (and two comparisons it implies) with its value; value None: not measured."""

    def ratio(a, b):
        return a / b if a is not None and b else None

    b_tps = best(base["realistic"]) if base else None
    a_tps = best(lora["no_adapter"]) if lora else None
    m_tps = best(lora["mixed"]) if lora else None
    b_tpot = base["stream"]["tpot_ms"] if base else None
    lb_tpot = lora["stream_base"]["tpot_ms"] if lora else None
    la_tpot = lora["stream_adapter"]["tpot_ms"] if lora else None
    load = lora["runtime_load"]["worst"] if lora and lora["runtime_load"].get("worst") else None
    rows = [
        ("no-adapter batch, LoRA engine / no --enable-lora (tok/s)", ratio(a_tps, b_tps), ">=", 0.98),
        ("4 adapters mixed / no-adapter batch, same engine (tok/s)", ratio(m_tps, a_tps), ">=", 0.85),
        ("4 adapters mixed / no --enable-lora (tok/s)", ratio(m_tps, b_tps), ">=", 0.85),
        ("one stream, adapter / no adapter, same engine (TPOT)", ratio(la_tpot, lb_tpot), "<=", 1.10),
        ("one stream, adapter / no --enable-lora (TPOT)", ratio(la_tpot, b_tpot), "<=", 1.10),
        ("one stream, no adapter, LoRA engine / no --enable-lora (TPOT)", ratio(lb_tpot, b_tpot), "<=", 1.02),
        (
            "runtime load: max step after / median before, like steps",
            load["ratio"] if load else None,
            "<=",
            2.0,
        ),
    ]
    out = []
    for name, value, op, bar in rows:
        ok = None if value is None else (value >= bar if op == ">=" else value <= bar)
        out.append({"criterion": name, "value": value, "bar": f"{op} {bar}", "pass": ok})
    return out


def report(result: dict) -> str:
    base, lora = result.get("base"), result.get("lora")
    lines = [f"LoRA (issue 38) on {result['device']}, model {result['model']}, rank {result['rank']}", ""]
    engines = {name: result[name] for name in ("base", "lora") if result.get(name)}
    lines += ["| engine | KV blocks | max_num_seqs |", "|---|---|---|"]
    lines += [f"| {name} | {e.get('kv_blocks')} | {e.get('max_num_seqs')} |" for name, e in engines.items()]
    lines.append("")  # a difference past 2% is a note, printed last
    lines += ["| run | tok/s (best) | tok/s (each) | seconds | TPOT ms |", "|---|---|---|---|---|"]

    def tps(rows: list[dict]) -> str:
        each = ", ".join(format(r["tokens_per_s"], ".0f") for r in rows)
        return f"{best(rows):.0f} | {each} | {rows[0]['seconds']:.1f}"

    if base:
        lines.append(f"| 1 base: realistic | {tps(base['realistic'])} | |")
        lines.append(f"| 1 base: one stream | | | | {base['stream']['tpot_ms']:.2f} |")
    if lora:
        lines.append(f"| 2a LoRA engine, no adapter | {tps(lora['no_adapter'])} | |")
        lines.append(f"| 2b LoRA engine, 4 adapters mixed | {tps(lora['mixed'])} | |")
        lines.append(
            f"| 2c LoRA engine: one stream, no adapter | | | | {lora['stream_base']['tpot_ms']:.2f} |"
        )
        lines.append(f"| 2c LoRA engine: one stream, lora0 | | | | {lora['stream_adapter']['tpot_ms']:.2f} |")
        d = lora["runtime_load"]
        lines.append(f"| 2d 3 adapters + base, {NEW_ADAPTER} loaded at {d['load_after_s']:.1f}s | "
                     f"{d['tokens_per_s']:.0f} | | {d['seconds']:.1f} | |")  # fmt: skip
        lines += ["", f"2d: load call {d['load_call_ms']:.0f} ms; {d['new_adapter_requests']} requests on "
                  f"{NEW_ADAPTER} ({d['new_adapter_tokens']} tokens); window median {fmt(d['median_ms'])} ms, max "
                  f"{fmt(d['max_ms'])} ms (all kinds: {fmt(d['plain_ratio'])}x); {d['compared_after']} of "
                  f"{d['steps_after']} steps after the load compared with like steps before"]  # fmt: skip
        lines += load_part_lines(d)
        for w in d["slot_writes"]:
            lines.append(f"    slot write {w['write_ms']:.2f} ms (host), {fmt(w.get('gpu_ms'))} ms on the stream, in a "
                         f"{w['step_ms']:.1f} ms {w['group']} step ({fmt(w['ratio'])}x its group's median before)")  # fmt: skip
        lines += ["", "| longest steps after the load | s after | group | ms | ratio | schedule ms | launch ms | "
                  "wait ms | during |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for i, s in enumerate(d.get("slowest", [])):
            lines.append(f"| {i + 1} | {s['after_load_s']:.2f} | {s['group']} | {s['ms']:.2f} | {fmt(s['ratio'])} | "
                         f"{fmt(s.get('schedule_ms'))} | {fmt(s.get('launch_ms'))} | {fmt(s.get('wait_ms'))} | "
                         f"{', '.join(s['during']) or '-'} |")  # fmt: skip
        lines += ["", "| group (kind:rows:tokens) | before | after | median before ms | max after ms | ratio |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for g in d["groups"]:
            lines.append(f"| {g['group']} | {g['steps_before']} | {g['steps_after']} | {g['median_before_ms']:.2f} | "
                         f"{g['max_after_ms']:.2f} | {g['ratio']:.2f} |")  # fmt: skip
    lines += ["", "| criterion | value | bar | result |", "|---|---|---|---|"]
    for c in result["criteria"]:
        verdict = "n/a" if c["pass"] is None else "PASS" if c["pass"] else "FAIL"
        lines.append(f"| {c['criterion']} | {fmt(c['value'], '.3f')} | {c['bar']} | {verdict} |")
    for note in result["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def load_part_lines(d: dict) -> list[str]:
    """2d's load, part by part (time_load_parts): where the read ran, what it cost, the engine thread's share."""
    parts = d.get("load_parts", {})
    read, command = parts.get("read"), parts.get("command")
    lines = []
    if read:
        lines.append(f"    read {read['ms']:.1f} ms on thread {read['thread']!r} (checkpoint read and checked "
                     f"{read['read_ms']:.1f} ms, laid out as its slots {read['layout_ms']:.1f} ms: "
                     f"{read['mib']:.1f} MiB, {'pinned' if read['pinned'] else 'pageable'})")  # fmt: skip
    if command:
        lines.append(f"    load command {command['ms']:.2f} ms on thread {command['thread']!r} (registering it, "
                     "between steps)")  # fmt: skip
    return lines


def fmt(v, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--realistic-requests", type=int, default=512, help="requests of the realistic workload")
    ap.add_argument("--prompt-cap", type=int, default=2048, help="realistic: longest prompt")
    ap.add_argument("--output-cap", type=int, default=1024, help="realistic: longest output")
    ap.add_argument("--repeats", type=int, default=2, help="realistic runs per configuration (best counts)")
    ap.add_argument("--stream-prompt", type=int, default=512, help="one stream: prompt tokens")
    ap.add_argument("--stream-output", type=int, default=256, help="one stream: output tokens")
    ap.add_argument("--stream-rounds", type=int, default=3, help="one stream: requests (median TPOT)")
    ap.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank and --max-lora-rank")
    ap.add_argument(
        "--new-adapter-requests", type=int, default=32, help="2d: requests naming the fifth adapter"
    )
    ap.add_argument(
        "--window", type=float, default=2.0, help="2d: seconds after (and before) the load compared"
    )
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--max-num-seqs", type=int, help="default: the server's for the device")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-capture-size", type=int, help="default: the server's for the device")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, tiny adapters, seconds")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    return ap


SMOKE = dict(
    device="cpu",
    realistic_requests=8,
    prompt_cap=96,
    output_cap=16,
    repeats=1,
    stream_prompt=32,
    stream_output=16,
    stream_rounds=2,
    lora_rank=4,
    new_adapter_requests=3,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    max_model_len=512,
    max_capture_size=8,
)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        ap.set_defaults(**SMOKE)  # flags given beside --smoke still win
    args = ap.parse_args(argv)
    if args.smoke and not (args.model or args.make_model or args.make_qwen05b):
        args.make_model = f"tiny:{tempfile.mkdtemp(prefix='lora-smoke-')}"
    args.model = resolve_model(args)
    if args.model is None:
        ap.error("--model DIR (or --make-model SHAPE:DIR, or --smoke) is required")
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    adapters = Path(tempfile.mkdtemp(prefix="lora-bench-adapters-"))
    t0 = time.perf_counter()
    modules = write_random_adapters(args.model, adapters, ADAPTERS + 1, args.lora_rank)
    print(
        f"{ADAPTERS + 1} rank-{args.lora_rank} adapters written in {time.perf_counter() - t0:.1f}s",
        file=sys.stderr,
    )
    new_path = modules.pop().split("=", 1)[1]  # the fifth: loaded at runtime (2d)
    result: dict = {
        "model": str(args.model),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available() and args.device != "cpu"
        else "cpu",
        "torch": torch.__version__,
        "rank": args.lora_rank,
        "realistic_requests": args.realistic_requests,
        "workload": workloads.describe(realistic(args, vocab, args.seed)),
        "notes": [],
    }
    for name, engine_modules in (("base", None), ("lora", modules)):
        try:
            result[name] = bench(args, vocab, name, engine_modules, new_path)
        except Exception as exc:  # noqa: BLE001 - the other engine's figures still count; the table says what failed
            result[name] = None
            result["notes"].append(f"{name} engine failed: {type(exc).__name__}: {str(exc)[:400]}")
            print(f"{name} engine failed", file=sys.stderr)
            traceback.print_exc()
        gc.collect()  # a failed engine's frames (the traceback) may hold its last reference
        offline_throughput.release_device_memory()
    engines = {name: result[name] for name in ("base", "lora") if result.get(name)}
    warning = offline_throughput.capacity_warning(engines)
    if warning:
        result["notes"].append(warning)
    result["criteria"] = criteria(result["base"], result["lora"])
    print(report(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str))
    return 0 if result["base"] is not None and result["lora"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
