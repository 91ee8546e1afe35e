"""Sampling one step on the device: GPU and host time of `Sampler.sample_device` on its two paths side
by side (legacy: the torch-composed threshold path; nucleus: the rejection sampler,
engine/sample/nucleus_draw.py, the default for every random row), and what each piece of the torch
path costs.

    python benchmarks/sampler_bench.py --rows 256 --vocab 151936      # Qwen2.5-0.5B shape
    python benchmarks/sampler_bench.py --rows 256 --vocab 128256      # the 8B shape

Table 1, by sampling parameters (median GPU ms of --iters calls, CUDA events; bf16 logits randn * 3):
greedy; temperature only; top_p 0.9; top_k 50; top_k 50 + top_p 0.9; Qwen's generation_config (T 0.7,
top_k 20, top_p 0.8); seeded; half seeded; top_p 0.9 on flat logits (logits / 10: long nuclei); the
realistic mix (T 0.8, top_p 0.95, a quarter seeded). Columns: legacy, nucleus (GPU ms, and the host ms
of the call), and nucleus minus greedy (the goal: <= 0.3 ms at 256 rows). Rows with top_k take the
nucleus sampler too: the same launch finds their k-th largest logit by radix select (kth_select.py;
the select alone is its own line in table 4, beside the torch.topk it replaced).

Table 2: nucleus_draw alone per case, its inputs already on the device: the GPU time a sampled step adds
where the host keeps ahead of the GPU (against greedy's argmax).
Table 3: nucleus_draw alone by launch setting (block, warps), to pick the defaults from one run.
Table 4, the pieces of the legacy path for the top_p 0.9 rows, and the predicted floor of each
(bytes / 4.8 TB/s; 256 x 151,936: bf16 logits 78 MB = 16 us a pass, fp32 156 MB = 32 us a pass):
  copy          index_select + .float(): read bf16, write fp32                  234 MB -> ~49 us
  temperature   nan_to_num, max, sub_, div_ (4 fp32 read+write passes, 1 read) ~1.1 GB -> ~230 us
  penalties     frequency + presence on every row, 64 output tokens each: [R, V] counts (write),
                two read-modify-write passes                                   ~0.8 GB -> ~160 us
  threshold     topk(4096) per row (a partial sort: compute-bound, not a pass), exp/sum passes: 3 fp32
                passes ~100 us plus the topk
  draw          race_draw: one fp32 read pass                                   156 MB -> ~32 us
  logprobs      token_logprobs(k=5): log_softmax fp32 write + topk               ~0.5 GB -> ~100 us
  host sync     tokens .tolist(): a [R] int64 copy and a stream sync           ~10 us (latency)
  kth_logits    top_k 50's k-th logit in torch: index_select, nan_to_num, topk(50), gather
  kth select    the same value by the kernel's radix select (a max pass, then about two passes)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package

import torch  # noqa: E402
from graphcache.engine.sample import sampler as sm  # noqa: E402
from graphcache.engine.sample.controls import apply_penalties  # noqa: E402
from graphcache.engine.sample.filter_threshold import thresholds  # noqa: E402
from graphcache.engine.sample.kth_select import kth_largest_triton, kth_logits  # noqa: E402
from graphcache.engine.sample.logprobs import token_logprobs  # noqa: E402
from graphcache.engine.sample.nucleus_draw import nucleus_draw  # noqa: E402
from graphcache.engine.sample.race_draw import race_draw  # noqa: E402
from graphcache.engine.sample.sampler import Sampler  # noqa: E402
from graphcache.engine.sample.state import SamplingState  # noqa: E402
from graphcache.engine.sequence import SamplingParams  # noqa: E402

CASES = {
    "greedy": lambda i: dict(temperature=0.0),
    "temperature 0.8": lambda i: dict(temperature=0.8),
    "temperature 0.8, top_p 0.9": lambda i: dict(temperature=0.8, top_p=0.9),
    "temperature 0.8, top_k 50": lambda i: dict(temperature=0.8, top_k=50),
    "temperature 0.8, top_k 50, top_p 0.9": lambda i: dict(temperature=0.8, top_k=50, top_p=0.9),
    "Qwen: T 0.7, top_k 20, top_p 0.8": lambda i: dict(temperature=0.7, top_k=20, top_p=0.8),
    "temperature 0.8, seeded": lambda i: dict(temperature=0.8, seed=i),
    "temperature 0.8, half seeded": lambda i: dict(temperature=0.8, seed=i if i % 2 else None),
    "realistic: T 0.8, top_p 0.95, 1/4 seeded": lambda i: dict(
        temperature=0.8, top_p=0.95, seed=i if i % 4 == 0 else None
    ),
}


def gpu_ms(fn, iters: int) -> float:
    return timed(fn, iters)[0]


def timed(fn, iters: int) -> tuple[float, float]:
    """(median GPU ms, median host ms of the call itself: what the engine thread spends launching)."""
    gpu, host = [], []
    for i in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        b.record()
        b.synchronize()
        if i >= 3:
            gpu.append(a.elapsed_time(b))
            host.append((t1 - t0) * 1e3)
    return statistics.median(gpu), statistics.median(host)


def seqs_of(make, rows: int) -> list[SamplingState]:
    """The rows as the worker's request table holds them."""
    return [SamplingState(f"r{i}", SamplingParams(**make(i)), [1, 2, 3]) for i in range(rows)]


def by_case(logits, flat, rows: int, iters: int) -> list[dict]:
    samplers = {
        "legacy": Sampler(default_seed=0, nucleus=False),
        "nucleus": Sampler(default_seed=0),
    }
    out = []
    cases = [(name, logits, seqs_of(make, rows)) for name, make in CASES.items()]
    cases.append(
        ("top_p 0.9, flat logits (long nuclei)", flat, seqs_of(CASES["temperature 0.8, top_p 0.9"], rows))
    )
    for name, x, seqs in cases:
        row: dict = {"case": name}
        for label, sampler in samplers.items():
            row[f"{label}_ms"], row[f"{label}_host_ms"] = timed(
                lambda x=x, s=seqs, sm=sampler: sm.sample_device(x, s), iters
            )
        out.append(row)
    return out


def kernel_by_case(logits, flat, rows: int, iters: int) -> list[dict]:
    """nucleus_draw alone per case (its inputs uploaded once, as the sampler lays them out): the GPU
    time a sampled decode step adds where the host keeps ahead (greedy: the argmax it replaces)."""
    dev = logits.device
    idx = torch.arange(rows, device=dev)
    argmax_ms = gpu_ms(lambda: logits.argmax(dim=-1), iters)
    out = [{"case": "greedy (logits.argmax)", "ms": argmax_ms, "top_k_on_ms": argmax_ms}]
    cases = [(name, logits, make) for name, make in CASES.items() if name != "greedy"]
    cases.append(("top_p 0.9, flat logits (long nuclei)", flat, CASES["temperature 0.8, top_p 0.9"]))
    for name, x, make in cases:
        seqs = seqs_of(make, rows)
        top_k = any(q.params.top_k > 0 for q in seqs)  # as the sampler tells the kernel
        params, keys, steps = Sampler(default_seed=0)._draw_tensors(seqs, dev)  # the sampler's one upload

        def draw(x=x, p=params, k=keys, s=steps, top_k=top_k):
            return nucleus_draw(x, idx, p, k, s, top_k=top_k)

        # top_k_on: the kernel with its top-k code in, as in a batch where some other row has top-k
        on = gpu_ms(lambda x=x, p=params, k=keys, s=steps: nucleus_draw(x, idx, p, k, s, top_k=True), iters)
        out.append({"case": name, "ms": gpu_ms(draw, iters), "top_k_on_ms": on})
    return out


def pieces(logits, rows: int, iters: int) -> list[dict]:
    dev = logits.device
    idx = torch.arange(rows, device=dev)
    t = torch.full((rows,), 0.8, device=dev)
    p = torch.full((rows,), 0.9, device=dev)
    keys = torch.arange(rows, dtype=torch.int64, device=dev) * 7919
    x = logits.index_select(0, idx).float()
    z, _, _, _ = sm.filtered_logits(x, temperature=t, top_k=None, top_p=None)
    thr = thresholds(z, None, p)
    pen = [
        SamplingState(
            f"r{i}",
            SamplingParams(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.3),
            [1, 2, 3],
            list(range(i, i + 64)),
        )
        for i in range(rows)
    ]
    tokens = logits.argmax(dim=-1)
    k50 = torch.full((rows,), 50, dtype=torch.int64, device=dev)
    return [
        {
            "piece": "copy (index_select + float)",
            "ms": gpu_ms(lambda: logits.index_select(0, idx).float(), iters),
        },
        {
            "piece": "temperature (nan_to_num, max, shift, divide)",
            "ms": gpu_ms(lambda: sm.filtered_logits(x, temperature=t, top_k=None, top_p=None), iters),
        },
        {
            "piece": "penalties (frequency + presence, 64 tokens a row)",
            "ms": gpu_ms(lambda: apply_penalties(x.clone(), list(range(rows)), pen), iters),
        },
        {
            "piece": "threshold (top_p 0.9: topk prefix + passes)",
            "ms": gpu_ms(lambda: thresholds(z, None, p), iters),
        },
        {"piece": "draw (race over z >= thr)", "ms": gpu_ms(lambda: race_draw(z, thr, keys), iters)},
        {
            "piece": "logprobs (token_logprobs, k=5)",
            "ms": gpu_ms(lambda: token_logprobs(logits, tokens, 5), iters),
        },
        {"piece": "host sync (tokens .tolist())", "ms": gpu_ms(lambda: tokens.tolist(), iters)},
        {
            "piece": "kth_logits (torch: top_k 50's k-th logit by torch.topk, with a host read of k)",
            "ms": gpu_ms(lambda: kth_logits(logits, k50), iters),
        },
        {
            "piece": "kth_largest_triton (the nucleus kernel's select alone, with its max pass)",
            "ms": gpu_ms(lambda: kth_largest_triton(logits, idx, k50), iters),
        },
        {"piece": "(x.clone(): one fp32 read+write, for scale)", "ms": gpu_ms(lambda: x.clone(), iters)},
    ]


NUCLEUS_SWEEP = [
    dict(block=4096, warps=16),
    dict(block=2048, warps=8),
    dict(block=2048, warps=16),
    dict(block=8192, warps=16),
    dict(block=4096, warps=32),
    dict(block=8192, warps=32),
]


def nucleus_sweep(logits, flat, rows: int, iters: int) -> list[dict]:
    """nucleus_draw alone for top_p 0.9 and 0.95 (normal and flat rows) and temperature only, by launch setting."""
    dev = logits.device
    idx = torch.arange(rows, device=dev)
    t = torch.full((rows,), 0.8, device=dev)
    keys = torch.arange(rows, dtype=torch.int64, device=dev) * 7919
    lmp = torch.full((rows,), float("-inf"), device=dev)
    out = []
    for setting in NUCLEUS_SWEEP:
        steps = torch.full((rows,), -1, dtype=torch.int64, device=dev)

        def run(x, p, s=setting, steps=steps):
            params = torch.stack([t, torch.full((rows,), p, device=dev), lmp], dim=1)
            return nucleus_draw(x, idx, params, keys, steps, **s)

        out.append(
            {
                "setting": ", ".join(f"{a}={b}" for a, b in setting.items()),
                "top_p 0.9": gpu_ms(lambda: run(logits, 0.9), iters),
                "top_p 0.95": gpu_ms(lambda: run(logits, 0.95), iters),
                "top_p 0.9 flat": gpu_ms(lambda: run(flat, 0.9), iters),
                "temperature": gpu_ms(lambda: run(logits, 1.0), iters),
            }
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true", help="skip tables 3 and 4")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, device=dev, generator=g) * 3).to(torch.bfloat16)
    flat = logits / 10
    cases = by_case(logits, flat, args.rows, args.iters)
    greedy = cases[0]["nucleus_ms"]
    print(f"{args.rows} rows x {args.vocab} vocab, bf16 logits, {torch.cuda.get_device_name()}")
    print("GPU ms (host ms of the call), median; nucleus = the default path")
    print(f"{'case':<42} {'legacy':>15} {'nucleus':>15} {'nucleus-greedy':>15}")
    for r in cases:
        cols = " ".join(f"{r[f'{k}_ms']:7.3f} ({r[f'{k}_host_ms']:5.2f})" for k in ("legacy", "nucleus"))
        print(f"{r['case']:<42} {cols} {r['nucleus_ms'] - greedy:15.3f}")
    kernel = kernel_by_case(logits, flat, args.rows, args.iters)
    print(
        "\nnucleus_draw alone, inputs on the device (GPU ms; top-k code on: as beside a top-k row)\n"
        f"{'case':<42} {'GPU ms':>8} {'- greedy':>8} {'top-k on':>8}"
    )
    for r in kernel:
        print(f"{r['case']:<42} {r['ms']:8.3f} {r['ms'] - kernel[0]['ms']:8.3f} {r['top_k_on_ms']:8.3f}")
    if args.no_sweep:
        if args.out:
            args.out.write_text(json.dumps({"cases": cases, "kernel": kernel}, indent=1))
        return 0
    nswept = nucleus_sweep(logits, flat, args.rows, args.iters)
    print(
        f"\nnucleus_draw alone by launch setting (GPU ms)\n{'setting':<24} {'p0.9':>7} {'p0.95':>7} {'flat':>7} {'temp':>7}"
    )
    for r in nswept:
        print(
            f"{r['setting']:<24} {r['top_p 0.9']:7.3f} {r['top_p 0.95']:7.3f} {r['top_p 0.9 flat']:7.3f} {r['temperature']:7.3f}"
        )
    parts = pieces(logits, args.rows, args.iters)
    print(f"\npieces of the legacy path (top_p 0.9 rows)\n{'piece':<52} {'GPU ms':>8}")
    for r in parts:
        print(f"{r['piece']:<52} {r['ms']:8.3f}")
    if args.out:
        args.out.write_text(
            json.dumps({"cases": cases, "kernel": kernel, "pieces": parts, "nucleus_sweep": nswept}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
