"""Sampling one step on the device: GPU time of `Sampler.sample_device` for a batch of rows over a
large vocabulary, by sampling parameters (issue 10 item 4).

    python benchmarks/sampler_bench.py --rows 256 --vocab 151936

Rows: greedy; temperature only (no filter: one race-draw kernel, no softmax); top_p 0.9 and top_k 50
(one threshold per row from a bounded top-k, filter_threshold.py); seeded temperature rows, and half
seeded / half unseeded (the same single race kernel: keys from (seed, step) or the host generator);
top_p 0.9 over a flat distribution (logits / 10: the nucleus is longer than the top-k prefix, so every
row takes the exact bisection fallback). Also the probability computation alone with no filter and
with the filters forced on (top_k 0, top_p 1). Median GPU ms of --iters calls (CUDA events), bf16 logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package

import torch  # noqa: E402
from graphcache.engine.sample.sampler import Sampler, probs_from_logits  # noqa: E402
from graphcache.engine.sequence import SamplingParams, Sequence  # noqa: E402

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "temperature 0.8, top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "temperature 0.8, top_k 50": dict(temperature=0.8, top_k=50),
    "temperature 0.8, seeded": dict(temperature=0.8, seed=1),
    "temperature 0.8, half seeded": "half",
}


def gpu_ms(fn, iters: int) -> float:
    times = []
    for i in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    logits = (torch.randn(args.rows, args.vocab, device=dev) * 3).to(torch.bfloat16)
    sampler = Sampler(default_seed=0)
    rows = []
    for name, params in CASES.items():
        if params == "half":
            seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.8, seed=i if i % 2 else None))
                    for i in range(args.rows)]
        else:
            seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(**params)) for i in range(args.rows)]
        rows.append({"case": name, "ms": gpu_ms(lambda s=seqs: sampler.sample_device(logits, s), args.iters)})
    flat = logits / 10
    seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.8, top_p=0.9)) for i in range(args.rows)]
    rows.append({"case": "top_p 0.9, flat logits (exact fallback)",
                 "ms": gpu_ms(lambda: sampler.sample_device(flat, seqs), args.iters)})
    x = logits.float()
    t = torch.full((args.rows,), 0.8, device=dev)
    forced = dict(top_k=torch.zeros(args.rows, dtype=torch.long, device=dev), top_p=torch.ones(args.rows, device=dev))
    rows.append({"case": "probs only, filters off (fast path)",
                 "ms": gpu_ms(lambda: probs_from_logits(x, temperature=t, top_k=None, top_p=None), args.iters)})
    rows.append({"case": "probs only, filters forced (top_k 0, top_p 1)",
                 "ms": gpu_ms(lambda: probs_from_logits(x, temperature=t, **forced), args.iters)})
    print(f"{args.rows} rows x {args.vocab} vocab, bf16 logits, {torch.cuda.get_device_name()}")
    print(f"{'case':<48} {'GPU ms':>8}")
    for r in rows:
        print(f"{r['case']:<48} {r['ms']:8.3f}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
