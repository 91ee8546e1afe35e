"""Engine steps between a request's arrival and its first token, under steady load, through the real engine.

The open-loop TTFT (benchmarks/open_loop.py) is queue + prefill + delivery; this measures the engine's part
in steps, where no GPU, HTTP or client timing blurs it: an EngineCore (the real scheduler, runner and
sampler) holds `--background` long requests decoding, then one new request arrives before every
`--every`-th step (prompt lengths drawn from the realistic workload's lognormal, capped), and each new
request's count is the number of `EngineCore.step()` calls from its arrival to the call whose outputs carry
its first token. Expected: 1 with synchronous steps (scheduled, run and emitted in the step after its
arrival), 2 with async scheduling (emitted when the next step has been launched), more only where a prompt
is longer than a step's token budget (chunks) or the queue is full (max_num_seqs, KV blocks).

  python benchmarks/first_token_steps.py --smoke                  # tiny model on the CPU, sync and async
  python benchmarks/first_token_steps.py --make-model qwen05b:/tmp/qwen05b --background 200 --arrivals 200
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "service"))  # the graphcache package

from benchmarks.model_shapes import add_model_args, require_model, smoke_model  # noqa: E402


def measure(
    core,
    *,
    background: int,
    arrivals: int,
    every: int = 1,
    prompt_median: float = 220.0,
    prompt_sigma: float = 0.9,
    prompt_cap: int = 2048,
    new_max_tokens: int = 4,
    vocab: int = 500,
    seed: int = 0,
) -> dict:
    """Drive `core` (an EngineCore): background decodes, then arrivals; per arrival the steps to its first
    token and to its first schedule. Every request runs to its end (no KV block may leak)."""
    from graphcache.engine.sequence import SamplingParams, Sequence

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(5, vocab) for _ in range(n)]  # noqa: E731
    long_tokens = (arrivals * every + 64) * 2
    for i in range(background):
        seq = Sequence(
            f"bg{i}", ids(rng.randint(8, 32)), SamplingParams(max_tokens=long_tokens, ignore_eos=True)
        )
        core.check(seq)
        core.add_request(seq)
    step = 0
    while any(s.num_output_tokens == 0 for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # the background requests prefilled: only decodes run now
        step += 1
    arrived: dict[str, tuple[int, Sequence]] = {}
    to_first: dict[str, int] = {}
    to_schedule: dict[str, int] = {}
    tokens_per_step: list[int] = []
    k = 0
    while len(to_first) < arrivals:
        if k < arrivals and step % every == 0:
            length = min(prompt_cap, max(1, round(rng.lognormvariate(math.log(prompt_median), prompt_sigma))))
            seq = Sequence(f"new{k}", ids(length), SamplingParams(max_tokens=new_max_tokens, ignore_eos=True))
            core.check(seq)
            core.add_request(seq)
            arrived[seq.request_id] = (step, seq)
            k += 1
        outputs = core.step()
        step += 1
        plan = core._pending.plan if core._pending is not None else None
        tokens_per_step.append(plan.plan.num_tokens if plan is not None and plan.plan is not None else 0)
        for rid, (at, seq) in arrived.items():
            if rid not in to_schedule and seq.first_scheduled_time is not None:
                to_schedule[rid] = step - at
        for out in outputs:
            if out.request_id in arrived and out.token_ids and out.request_id not in to_first:
                to_first[out.request_id] = step - arrived[out.request_id][0]
    for rid in [f"bg{i}" for i in range(background)]:
        core.abort(rid)
    while core.has_work():
        core.step()
    steps = sorted(to_first.values())
    return {
        "arrivals": arrivals,
        "background": background,
        "steps_to_first_token": dict(sorted(Counter(steps).items())),
        "steps_to_schedule": dict(sorted(Counter(to_schedule.values()).items())),
        "p50": steps[len(steps) // 2],
        "max": steps[-1],
        "tokens_per_step_max": max(tokens_per_step, default=0),
        "leaked_blocks": core.block_manager.num_usable - core.block_manager.num_free,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--background", type=int, default=6, help="requests decoding all along")
    ap.add_argument("--arrivals", type=int, default=24, help="new requests measured")
    ap.add_argument("--every", type=int, default=1, help="a new request before every N-th step")
    ap.add_argument("--prompt-median", type=float, default=220.0)
    ap.add_argument("--prompt-cap", type=int, default=2048)
    ap.add_argument("--async-scheduling", default="off,on", help="comma list of the modes to run")
    ap.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, short prompts")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompt_median, args.prompt_cap = 24.0, 96
        smoke_model(args)
    model = require_model(args)
    from graphcache.config import Settings
    from graphcache.engine.loop.core import EngineCore
    from graphcache.engine.worker.runner import ModelRunner

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rows = []
    for mode in args.async_scheduling.split(","):
        extra = (
            {"device": "cpu", "dtype": "float32", "max_num_seqs": 16, "max_num_batched_tokens": 256}
            if args.smoke
            else {}
        )
        settings = Settings(model=model, async_scheduling=mode, **extra)
        core = EngineCore(ModelRunner(settings), settings)
        row = measure(
            core,
            background=args.background,
            arrivals=args.arrivals,
            every=args.every,
            prompt_median=args.prompt_median,
            prompt_cap=args.prompt_cap,
            vocab=min(vocab, 500),
        )
        rows.append({"async_scheduling": mode, **row})
        print(
            f"async_scheduling={mode}: steps arrival -> first token {row['steps_to_first_token']} (p50 {row['p50']}, "
            f"max {row['max']}); arrival -> scheduled {row['steps_to_schedule']}; leaked blocks {row['leaked_blocks']}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
