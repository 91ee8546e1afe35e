"""Speculative decoding measured: with and without it, at one stream and at 8, and what its step times predict.

Three parts, each printed as a table (this is a script, not a timed test):

1. Streams. S requests at once (--streams, default 1,8), --rounds times, greedy, through the engine's own
   step loop (EngineCore over one ModelRunner, warmed up as `serve` warms it: graphs as served), each S
   without speculation and with the n-gram proposer; with --draft-model PATH (or --self-draft: the
   target's own checkpoint as its draft) also with {"method": "draft_model", "model": PATH}. Per run:
   output tokens/s, TPOT (mean over requests of (last token - first token) / (tokens - 1)), mean accepted
   length (vLLM's: 1 + accepted / drafts), acceptance rate (accepted / draft tokens), verify steps, the
   proposer's host ms per verify step, the TPOT predicted by (draft time + verify time) / mean accepted
   length (the issue's model, which assumes every step verifies) and by the steps the run took (verify
   steps at the verify time, plain ones at the decode time, drafting, over the tokens).
   The workload ("copy"): each prompt is a random block of --block tokens repeated to --prompt-len, as a
   file with repeated structure that an answer copies. A random-weight model does not copy; under greedy
   decoding it tends to loop on its own output, which the n-gram proposer then matches: the acceptance
   printed is what such a model gives, not what a trained model on real text gives.
   --prime N extends each prompt by the target's own greedy continuation of N tokens (speculation off):
   a model that falls into a cycle is then already in it when the measured output starts, so the n-gram
   proposer finds a match from the first step, as the issue's TPOT model (every step verifies) assumes.
   The untied random llama8b rarely cycles even primed; `llama8btied` (the same shape, head tied to the
   embedding) repeats its last token from the first step, the 8B workload on which every step can verify.
2. Step times. One plain decode step and one verify step of k drafts (k in --ks, default 1,2,4,8) at
   --rows (default 1,8), hand-built StepPlans through the same runner (the verify step replays its
   "T:R:verify" graph where the runner has one, as served): CUDA events on the GPU, perf_counter on the
   CPU, median of --step-iters. The verify cost per token, c = (verify / decode - 1) / k, is what
   settings.engine.speculative_token_cost wants (docs/DEPLOY.md). With a draft model: its decode step.
3. --realistic: benchmarks/offline_throughput.py's realistic workload at the server's defaults, graph
   mode, without and with --speculative-config (n-gram): the throughput ratio (the issue asks >= 0.97).
4. --greedy-check N (instead of 1-3): N greedy copy-prompt requests without speculation and with each
   proposer at --dtype: the share with identical tokens, where the others first diverge, and the target's
   top-2 logit margin there (benchmarks/spec_greedy_check.py). float32: all equal is expected; bfloat16:
   near ties may flip (docs/API.md, "Speculative decoding").

  python benchmarks/spec_decode.py --smoke                                    # tiny model, CPU, seconds
  python benchmarks/spec_decode.py --make-model llama8b:/tmp/llama8b --out spec.json
  python benchmarks/spec_decode.py --make-model qwen05b:/tmp/qwen05b --self-draft
  python benchmarks/spec_decode.py --make-model llama8btied:/tmp/llama8btied --streams 1 --ks 4 --rows 1
  python benchmarks/spec_decode.py --make-model llama8b:/tmp/llama8b --realistic --streams none
  python benchmarks/spec_decode.py --make-model llama8b:/tmp/llama8b --greedy-check 64 --dtype float32 --self-draft
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package

import torch  # noqa: E402
from graphcache.config import Settings  # noqa: E402
from graphcache.engine.loop.core import EngineCore  # noqa: E402
from graphcache.engine.plan import StepPlan, StepSeq  # noqa: E402
from graphcache.engine.sequence import Sequence  # noqa: E402
from graphcache.engine.spec.acceptance import AcceptanceGate, AcceptanceRule  # noqa: E402
from graphcache.engine.spec.build import build_proposer  # noqa: E402
from graphcache.engine.worker.runner import ModelRunner  # noqa: E402
from graphcache.metrics import Metrics  # noqa: E402

try:  # the draft-model proposer; an older tree (gpu_check's baseline copy) has none
    from graphcache.engine.worker.draft_model import build_draft_proposer  # noqa: E402
except ImportError:
    build_draft_proposer = None  # type: ignore[assignment]

from benchmarks import offline_throughput  # noqa: E402
from benchmarks.model_shapes import add_model_args, path_or_make, resolve_model  # noqa: E402
from benchmarks.spec_greedy_check import greedy_check, greedy_table, greedy_wave, run_greedy  # noqa: E402

# --------------------------------------------------------------------------- the workload


def copy_prompts(n: int, vocab: int, length: int, block: int, seed: int) -> list[list[int]]:
    """n prompts, each a random block of `block` ids (< 10000, as benchmarks/workloads.py) repeated to
    `length` tokens: text an answer would copy, and n-grams the proposer finds in the prompt."""
    rng = random.Random(seed)
    hi = min(vocab, 10000) - 1
    out = []
    for _ in range(n):
        unit = [rng.randint(0, hi) for _ in range(block)]
        out.append((unit * (length // block + 1))[:length])
    return out


def primed(core: EngineCore, prompts: list[list[int]], n: int, streams: int) -> list[list[int]]:
    """Each prompt followed by the target's own greedy continuation of n tokens, without speculation (the
    speculation state is left off: run_streams' callers set it per run)."""
    print(f"priming {len(prompts)} prompts with {n} greedy tokens ...", file=sys.stderr, flush=True)
    speculation(core, None)
    outputs = run_greedy(core, prompts, n, streams, "prime")
    return [p + o for p, o in zip(prompts, outputs, strict=True)]


def ngram_config(args) -> str:
    return json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max,
        }
    )


def settings_for(args, model: Path, spec: str | None) -> Settings:
    """The server's settings for the device, but for the model, its length and the speculative config;
    batch limits left unset take the device's defaults (graphs as served)."""
    flat = dict(
        model=model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        speculative_config=spec,
    )
    if args.max_num_seqs:
        flat["max_num_seqs"] = args.max_num_seqs
    if args.max_capture_size:
        flat["max_capture_size"] = args.max_capture_size
    if args.max_num_batched_tokens:
        flat["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.num_kv_blocks:
        flat["num_kv_blocks"] = args.num_kv_blocks
    if args.token_cost is not None:
        flat["speculative_token_cost"] = args.token_cost
    flat["speculative_step_payoff"] = args.step_payoff == "on"
    return Settings(**flat)


def load_core(settings: Settings) -> EngineCore:
    """A runner warmed up as `serve` warms it, and a core over it (the speculative config's proposer)."""
    runner = ModelRunner(settings)
    try:
        runner.warmup()
        # method draft_model: the engine builds the draft beside the runner and warms its graphs too
        draft = build_draft_proposer(settings, runner) if build_draft_proposer is not None else None
        if draft is not None:
            draft.warmup()
        return EngineCore(runner, settings, Metrics(), proposer=draft)
    except BaseException:
        runner.close()
        raise


def speculation(core: EngineCore, rule: AcceptanceRule | None) -> None:
    """Speculation on with a fresh proposer and acceptance gate of `rule` (the one the core was built
    with), or off (rule None: no proposer, every step plain, as without --speculative-config)."""
    sched = core.scheduler
    if rule is None:
        sched.spec = sched.proposer = sched.acceptance = None
        return
    assert core.spec is not None
    sched.spec = core.spec
    sched.proposer = build_proposer(core.spec, core.runner.max_model_len)
    sched.acceptance = AcceptanceGate(rule)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- part 1: streams


def run_streams(core: EngineCore, prompts: list[list[int]], streams: int, args) -> dict:
    """`streams` requests at once, args.rounds times; the counts and times of the run."""
    sched = core.scheduler
    propose_s = [0.0]
    if sched.proposer is not None:
        inner = sched.proposer.propose

        def timed(reqs, limits=None):
            t = time.perf_counter()
            try:
                return inner(reqs, limits)
            finally:
                propose_s[0] += time.perf_counter() - t

        sched.proposer.propose = timed  # type: ignore[method-assign]
    kinds = {"verify": 0, "decode": 0, "other": 0}

    def count(plan: StepPlan) -> None:
        kinds["verify" if plan.verify else "decode" if plan.uniform_decode else "other"] += 1

    core.step_failpoint = count
    counts0 = core.spec_metrics.snapshot() if core.spec_metrics is not None else None
    seqs: list[Sequence] = []
    dev = core.runner.device_type
    sync(dev)
    t0 = time.perf_counter()
    for r in range(args.rounds):
        wave = [prompts[(r * streams + i) % len(prompts)] for i in range(streams)]
        ids = [f"s{streams}-r{r}-{i}-{id(kinds)}" for i in range(streams)]
        seqs += greedy_wave(core, wave, args.output_len, ids)
    sync(dev)
    elapsed = time.perf_counter() - t0
    core.step_failpoint = None
    tokens = sum(len(s.output_token_ids) for s in seqs)
    tpots = [
        (s.last_token_time - s.first_token_time) / (len(s.output_token_ids) - 1)
        for s in seqs
        if len(s.output_token_ids) > 1 and s.first_token_time is not None and s.last_token_time is not None
    ]
    row = {
        "streams": streams,
        "requests": len(seqs),
        "output_tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "tpot_ms": 1e3 * statistics.mean(tpots) if tpots else float("nan"),
        "steps": dict(kinds),
        "propose_ms": propose_s[0] * 1e3,
        "outputs": [list(s.output_token_ids) for s in seqs],
    }
    if counts0 is not None and core.spec_metrics is not None and sched.proposer is not None:
        c = core.spec_metrics.snapshot()
        drafts, draft_tokens = c["drafts"] - counts0["drafts"], c["draft_tokens"] - counts0["draft_tokens"]
        accepted = c["accepted"] - counts0["accepted"]
        row.update(
            drafts=drafts,
            draft_tokens=draft_tokens,
            accepted=accepted,
            acceptance_rate=accepted / draft_tokens if draft_tokens else 0.0,
            mean_accepted_length=1 + accepted / drafts if drafts else 1.0,
            mean_draft_length=draft_tokens / drafts if drafts else 0.0,
        )
    return row


# --------------------------------------------------------------------------- part 2: step times


def fill_rows(runner: ModelRunner, rows: int, ctx: int, seed: int = 0) -> list[StepSeq]:
    """Prefill `rows` sequences of ctx tokens (random ids) in blocks of their own; their decode rows."""
    g = random.Random(seed)
    hi = min(runner.vocab_size, 10000)
    per_seq = -(-(ctx + 64) // runner.block_size)
    seqs = []
    for i in range(rows):
        table = list(range(i * per_seq, (i + 1) * per_seq))
        seqs.append(StepSeq([g.randrange(hi) for _ in range(ctx)], 0, table, True))
    for s in seqs:
        runner.execute(StepPlan.standalone([s]))
    sync(runner.device_type)
    return [StepSeq([g.randrange(hi)], ctx, s.block_table, True) for s in seqs]


def time_plan(runner: ModelRunner, plan: StepPlan, iters: int) -> float:
    """Median ms of one step: execute (layout, replay or eager, sampling) until its ids are on the host."""
    cuda = runner.device_type == "cuda"
    times = []
    for i in range(iters + 3):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t = time.perf_counter()
        out = runner.execute(plan)
        if cuda:
            b.record()
            b.synchronize()
        elif out.ready is not None:
            out.ready.synchronize()
        ms = a.elapsed_time(b) if cuda else (time.perf_counter() - t) * 1e3
        if i >= 3:  # the first steps may capture
            times.append(ms)
    return statistics.median(times)


def step_times(runner: ModelRunner, rows_list: list[int], ks: list[int], ctx: int, iters: int) -> list[dict]:
    """Per rows: the plain decode step and the verify step of each k (the same rows, k drafts each)."""
    out = []
    max_rows = runner.max_reqs if hasattr(runner, "max_reqs") else max(rows_list)
    for rows in rows_list:
        if rows > max_rows:
            continue
        decode = fill_rows(runner, rows, ctx)
        plain = StepPlan.standalone(decode, sample=True)
        row = {"rows": rows, "decode_ms": time_plan(runner, plain, iters), "verify_ms": {}, "replayed": {}}
        for k in ks:
            hi = min(runner.vocab_size, 10000)
            seqs = [
                StepSeq(s.token_ids + [(t * 7 + j) % hi for j in range(k)], ctx, s.block_table)
                for t, s in enumerate(decode)
            ]
            plan = replace(StepPlan.standalone(seqs, sample=True), verify=tuple((i, k) for i in range(rows)))
            desc = runner.verify_descriptor(plan.num_tokens, plan.num_reqs)
            row["replayed"][k] = desc is not None
            row["verify_ms"][k] = time_plan(runner, plan, iters)
        out.append(row)
    return out


def verify_ms_at(times: list[dict], rows: int, k: float) -> float | None:
    """The verify time at `rows` for a mean draft length k, interpolated between the measured ks."""
    row = next((t for t in times if t["rows"] == rows), None)
    if row is None or not row["verify_ms"]:
        return None
    pts = sorted((int(kk), v) for kk, v in row["verify_ms"].items())
    if k <= pts[0][0]:
        return pts[0][1]
    for (k0, v0), (k1, v1) in zip(pts, pts[1:], strict=False):
        if k <= k1:
            return v0 + (v1 - v0) * (k - k0) / (k1 - k0)
    return pts[-1][1]


def decode_ms_at(times: list[dict], rows: int) -> float | None:
    return next((t["decode_ms"] for t in times if t["rows"] == rows), None)


def predict(row: dict, times: list[dict], draft_decode: list[dict] | None) -> None:
    """The TPOT the step times predict for a speculative run (module docstring), into row."""
    s, mal = row["streams"], row.get("mean_accepted_length")
    k = row.get("mean_draft_length") or 0
    verify, decode = verify_ms_at(times, s, k), decode_ms_at(times, s)
    if not mal or not k or verify is None or decode is None:
        return
    steps = row["steps"]
    host_draft = row["propose_ms"] / max(steps["verify"], 1)  # the n-gram proposer: host ms per verify step
    draft = host_draft
    if draft_decode is not None:  # a draft model: k of its decode steps per verify step
        d = decode_ms_at(draft_decode, s)
        draft = k * d if d is not None else host_draft
    row["verify_step_ms"], row["draft_step_ms"] = verify, draft
    row["pred_tpot_ms"] = (draft + verify) / mal
    per_stream = row["output_tokens"] / s - row["requests"] / s  # tokens after each first token
    busy = steps["verify"] * (verify + draft) + steps["decode"] * decode
    row["pred_steps_tpot_ms"] = busy / max(per_stream, 1)


# --------------------------------------------------------------------------- part 3: the realistic workload


def realistic_ratio(args, model: Path) -> dict:
    """offline_throughput's realistic workload, graph mode, server defaults: without, then with n-gram."""
    rows = {}
    offline_throughput.release_device_memory()  # the stream parts' runners, dropped by now
    for name, spec in (("plain", None), ("ngram", ngram_config(args))):
        out = Path(tempfile.mkdtemp(prefix="spec-realistic-")) / "r.json"
        argv = ["--model", str(model), "--modes", "graph", "--workload", "realistic", "--out", str(out)]
        argv += ["--device", args.device, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
        if args.realistic_requests:
            argv += ["--realistic-requests", str(args.realistic_requests)]
        if args.smoke:
            argv += [
                "--max-num-seqs",
                "4",
                "--realistic-requests",
                "8",
                "--prompt-cap",
                "96",
                "--output-cap",
                "16",
            ]
            argv += ["--max-num-batched-tokens", "256", "--max-capture-size", "8"]
        if spec is not None:
            argv += ["--speculative-config", spec]
        print(f"realistic {name} ...", file=sys.stderr, flush=True)
        if offline_throughput.main(argv) != 0:
            raise RuntimeError(f"offline_throughput failed for {name}")
        (rows[name],) = json.loads(out.read_text())["results"]
    ratio = rows["ngram"]["tokens_per_s"] / rows["plain"]["tokens_per_s"]
    return {
        "plain_tokens_per_s": rows["plain"]["tokens_per_s"],
        "ngram_tokens_per_s": rows["ngram"]["tokens_per_s"],
        "ratio": ratio,
        "ngram_counters": rows["ngram"].get("spec_counters"),
        "ngram_payoff": rows["ngram"].get("spec_payoff"),
        "by_kind": {name: r.get("by_kind") for name, r in rows.items()},
        # the two engines' capacity (offline_throughput.engine_capacity): unequal, the ratio measures memory
        "capacity": {name: {k: r.get(k) for k in ("kv_blocks", "max_num_seqs")} for name, r in rows.items()},
    }


# --------------------------------------------------------------------------- tables


def fmt(v, spec: str = ".2f") -> str:
    return "" if v is None else format(v, spec)


def streams_table(rows: list[dict]) -> str:
    head = (
        "| proposer | streams | tok/s | TPOT ms | mean acc len | acceptance | verify steps | plain steps | "
        "draft ms/step | verify ms | pred TPOT ms | pred (steps) ms | same tokens |"
    )
    lines = [head, "|---" * 13 + "|"]
    for r in rows:
        lines.append(
            f"| {r['proposer']} | {r['streams']} | {r['tokens_per_s']:.0f} | {r['tpot_ms']:.2f} | "
            f"{fmt(r.get('mean_accepted_length'))} | {fmt(r.get('acceptance_rate'), '.1%')} | "
            f"{r['steps']['verify']} | {r['steps']['decode']} | {fmt(r.get('draft_step_ms'), '.3f')} | "
            f"{fmt(r.get('verify_step_ms'))} | {fmt(r.get('pred_tpot_ms'))} | {fmt(r.get('pred_steps_tpot_ms'))} | "
            f"{r.get('same_tokens', '')} |"
        )
    return "\n".join(lines)


def steps_table(times: list[dict], label: str) -> str:
    ks = sorted({int(k) for t in times for k in t["verify_ms"]})
    head = f"| {label} rows | decode ms | " + " | ".join(f"verify k={k} ms (c)" for k in ks) + " |"
    lines = [head, "|---" * (2 + len(ks)) + "|"]
    for t in times:
        cells = []
        for k in ks:
            v = t["verify_ms"].get(k)
            c = (v / t["decode_ms"] - 1) / k if v is not None else None
            graph = "" if t["replayed"].get(k) else " eager"
            cells.append(f"{fmt(v)} ({fmt(c, '.3f')}){graph}")
        lines.append(f"| {t['rows']} | {t['decode_ms']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--streams", default="1,8", help="comma list of concurrent requests, or none")
    ap.add_argument("--rounds", type=int, default=2, help="batches of `streams` requests per run")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--block", type=int, default=64, help="the repeated block of each copy prompt")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument(
        "--prime",
        type=int,
        default=0,
        help="extend each copy prompt by the target's own greedy continuation of N tokens first (see part 1)",
    )
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the runs")
    ap.add_argument(
        "--lookup-min",
        type=int,
        default=1,
        help="ngram prompt_lookup_min (1: a random model's loops match early)",
    )
    ap.add_argument("--lookup-max", type=int, default=4, help="ngram prompt_lookup_max")
    ap.add_argument(
        "--token-cost", type=float, help="settings.engine.speculative_token_cost (default: the server's)"
    )
    ap.add_argument(
        "--step-payoff",
        choices=["on", "off"],
        default="on",
        help="settings.engine.speculative_step_payoff (off, with --token-cost 0: every step verifies, as the "
        "issue's TPOT prediction assumes)",
    )
    ap.add_argument(
        "--draft-model",
        help="also run method draft_model with this draft: a directory, or SHAPE:DIR to write a random one "
        "(benchmarks/model_shapes.py; llama1b is an unrelated draft for llama8b)",
    )
    ap.add_argument("--self-draft", action="store_true", help="the target's own checkpoint as the draft")
    ap.add_argument("--ks", default="1,2,4,8", help="verify step times: drafts per row")
    ap.add_argument("--rows", default="1,8", help="verify step times: rows")
    ap.add_argument("--ctx", type=int, default=512, help="verify step times: context of each row")
    ap.add_argument("--step-iters", type=int, default=20)
    ap.add_argument(
        "--realistic", action="store_true", help="the realistic offline workload, without and with"
    )
    ap.add_argument("--realistic-requests", type=int, default=0, help="0: offline_throughput's default")
    ap.add_argument(
        "--greedy-check",
        type=int,
        default=0,
        metavar="N",
        help="only check greedy equality: N requests without and with each proposer (part 4)",
    )
    ap.add_argument("--greedy-streams", type=int, default=8, help="--greedy-check: requests at once")
    ap.add_argument(
        "--no-margins", action="store_true", help="--greedy-check: skip the top-2 margin at divergences"
    )
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, help="default: the server's for the device")
    ap.add_argument("--max-capture-size", type=int, help="default: the server's for the device")
    ap.add_argument("--max-num-batched-tokens", type=int, help="default: the server's for the device")
    ap.add_argument("--num-kv-blocks", type=int, help="default: the server's sizing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, a few short requests")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    return ap


SMOKE = dict(
    device="cpu",
    streams="1,2",
    rounds=1,
    prompt_len=48,
    block=8,
    output_len=32,
    ks="1,2,4",
    rows="1,2",
    ctx=32,
    step_iters=3,
    max_model_len=256,
    max_num_seqs=16,
    max_capture_size=16,
    max_num_batched_tokens=256,
    num_kv_blocks=256,
)


def run_greedy_check(args, model: Path, draft: Path | None, result: dict) -> int:
    """Part 4: print the greedy-equality table, write it (and every divergence) as JSON."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = copy_prompts(args.greedy_check, vocab, args.prompt_len, args.block, args.seed)
    configs = {"ngram": ngram_config(args)}
    if draft is not None:
        name = "self-draft" if args.self_draft else "draft"
        configs[name] = json.dumps(
            {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.k}
        )
    print(f"greedy check: {len(prompts)} requests, {list(configs)} ...", file=sys.stderr, flush=True)
    # Equality is the question, not when speculation pays: every step that can speculate does (the payoff
    # rule would turn a wave off while its n-gram finds nothing yet, and the check would verify nothing).
    args.step_payoff = "off"
    check = greedy_check(
        lambda spec: load_core(settings_for(args, model, spec)),
        configs,
        prompts,
        args.output_len,
        args.greedy_streams,
        margins=not args.no_margins,
    )
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device == "cuda" else "float32")
    result.update(greedy_check=check, dtype=dtype)
    print(f"\n{result['device']} {result.get('gpu', '')}, k={args.k}")
    print(greedy_table(check, dtype))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str))
    idle = [name for name, row in check["proposers"].items() if not row.get("draft_tokens")]
    if idle:  # equal outputs then prove nothing about speculation
        print(
            f"NOT A CHECK: {', '.join(idle)} verified no draft token (on CUDA a step speculates only while "
            "every running row's verify row fits the largest verify graph, max_num_seqs tokens: fewer than "
            "max_num_seqs / (k + 1) + 1 rows; raise --max-num-seqs or lower --greedy-streams)"
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        ap.set_defaults(**SMOKE)  # flags given beside --smoke still win
    args = ap.parse_args(argv)
    if args.smoke and not (args.model or args.make_model or args.make_qwen05b):
        args.make_model = f"tiny:{tempfile.mkdtemp(prefix='spec-smoke-')}"
    model = resolve_model(args)
    if model is None:
        ap.error("--model DIR (or --make-model SHAPE:DIR, or --smoke) is required")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    streams = [] if args.streams == "none" else [int(s) for s in args.streams.split(",") if s.strip()]
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    rows_list = [int(r) for r in args.rows.split(",") if r.strip()]
    draft = model if args.self_draft else path_or_make(args.draft_model)
    result: dict = {"model": str(model), "device": args.device, "k": args.k, "streams": [], "notes": []}
    if torch.cuda.is_available() and args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    if args.greedy_check:
        return run_greedy_check(args, model, draft, result)

    if streams or ks:
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        prompts = copy_prompts(
            max(streams or [1]) * args.rounds, vocab, args.prompt_len, args.block, args.seed
        )
        print("loading the target (n-gram configured) ...", file=sys.stderr, flush=True)
        core = load_core(settings_for(args, model, ngram_config(args)))
        assert core.scheduler.acceptance is not None
        rule = core.scheduler.acceptance.rule
        if args.prime:
            prompts = primed(core, prompts, args.prime, max(streams or [1]))
            result["prime"] = args.prime
        for s in streams:
            speculation(core, None)
            plain = run_streams(core, prompts, s, args) | {"proposer": "none"}
            speculation(core, rule)
            ngram = run_streams(core, prompts, s, args) | {"proposer": "ngram"}
            ngram["same_tokens"] = ngram["outputs"] == plain["outputs"]
            result["streams"] += [plain, ngram]
            print(
                f"  streams {s}: {plain['tokens_per_s']:.0f} / {ngram['tokens_per_s']:.0f} tok/s",
                file=sys.stderr,
            )
        times = step_times(core.runner, rows_list, ks, args.ctx, args.step_iters) if ks else []
        result["step_times"] = times
        core.runner.close()
        del core
        draft_times = None
        if draft is not None:
            spec = json.dumps(
                {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.k}
            )
            try:
                dcore = load_core(settings_for(args, model, spec))
            except Exception as exc:  # noqa: BLE001 - the draft_model proposer may not be in this tree
                note = f"draft_model runs skipped: {type(exc).__name__}: {str(exc)[:300]}"
                print(note, file=sys.stderr)
                result["notes"].append(note)
            else:
                plain_by = {r["streams"]: r for r in result["streams"] if r["proposer"] == "none"}
                for s in streams:
                    row = run_streams(dcore, prompts, s, args) | {
                        "proposer": "self-draft" if args.self_draft else "draft"
                    }
                    if s in plain_by:
                        row["same_tokens"] = row["outputs"] == plain_by[s]["outputs"]
                    result["streams"].append(row)
                dcore.runner.close()
                del dcore
            if args.self_draft:
                draft_times = times  # the draft is the target: its decode step is the target's
            elif ks:
                druns = ModelRunner(settings_for(args, draft, None))
                druns.warmup()
                draft_times = step_times(druns, rows_list, [], args.ctx, args.step_iters)
                druns.close()
                del druns
            result["draft_step_times"] = draft_times
        for r in result["streams"]:
            if r["proposer"] != "none":
                predict(r, times, draft_times if r["proposer"] != "ngram" else None)
    if args.realistic:
        result["realistic"] = realistic_ratio(args, model)

    print(
        f"\nspeculative decoding, {result['device']} {result.get('gpu', '')}, k={args.k}, greedy, copy prompts"
        + (f" primed with {args.prime} greedy tokens" if args.prime else "")
    )
    if result["streams"]:
        print(streams_table(result["streams"]))
    if result.get("step_times"):
        print("\nstep times (median ms; c = (verify / decode - 1) / k, the verify cost per draft token):")
        print(steps_table(result["step_times"], "target"))
    if result.get("draft_step_times") and not args.self_draft:
        print(steps_table(result["draft_step_times"], "draft"))
    if "realistic" in result:
        r = result["realistic"]
        print(
            f"\nrealistic offline workload: {r['plain_tokens_per_s']:.0f} tok/s plain, "
            f"{r['ngram_tokens_per_s']:.0f} with n-gram configured: ratio {r['ratio']:.3f} (issue: >= 0.97)"
        )
        for name, c in r["capacity"].items():
            print(f"  {name} engine: {c['kv_blocks']} KV blocks, max_num_seqs {c['max_num_seqs']}")
        for name, kinds in r["by_kind"].items():
            for kind, k in (kinds or {}).items():
                print(
                    f"  {name} {kind}: {k['steps']} steps x {k['ms']:.2f} ms (launch {k['launch_ms']:.2f}, "
                    f"wait {k['wait_ms']:.2f}), rows {k['rows_mean']:.0f}, tokens {k['tokens_mean']:.0f}"
                )
        print(f"  n-gram counters: {r['ngram_counters']}")
        for bucket, b in (r["ngram_payoff"] or {}).items():
            print(f"  payoff rows>={bucket}: {b}")
        warning = offline_throughput.capacity_warning(r["capacity"])
        if warning:
            print(warning)
    for note in result["notes"]:
        print("note:", note)
    if args.out:
        for r in result["streams"]:
            r.pop("outputs", None)
        args.out.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
