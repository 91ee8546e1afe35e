"""Per-kernel GPU time of one step of each kind, set against its roofline bound.

Steps (ModelRunner.execute + greedy argmax, the runner of benchmarks/decode_step.py in eager mode, so
every kernel is visible to the profiler: a graph replay runs the same kernels without launch gaps):
  decode   --decode-rows rows (256), each one token at context --ctx (512)
  mixed    --mixed-decodes decode rows (64) at context --ctx plus one --chunk-token (192) prompt chunk
           continuing a sequence at position --ctx
  prefill  --prefill-seqs (8) prompts of --prefill-len (1024) tokens from position 0
torch.profiler CUDA time per kernel name, per step (mean of --iters steps after 3 warm ones). Bound:
  GEMMs    from the launching aten op's input shapes (record_shapes): max(2MNK FLOPs / --peak-tflops,
           (MK + KN + MN) x 2 bytes / --bandwidth): the op's first kernel carries it
  attention (kernel names with attn / attention / flash / fmha / decode_stage / unified) as one class: KV bytes read
           (per layer, per row: context x KV heads x head dim x 2 (K and V) x 2 bytes) over --bandwidth, or
           causal FLOPs (4 x q tokens x mean keys seen x heads x head dim) over --peak-tflops, the larger
  other    no bound (norms, rotary, activation, sampling, copies): their time is the gap to a fused floor.
Defaults: 4.8 TB/s (the H200's HBM3e) and 790 TFLOP/s bf16 (--bandwidth, --peak-tflops).
"x bound" = time / bound (1.0 = at the roofline).

  python benchmarks/kernel_table.py --make-model qwen05b:/tmp/qwen05b --out kernels_qwen05b.json
  python benchmarks/kernel_table.py --make-model llama8b:/tmp/llama8b --out kernels_llama8b.json
  python benchmarks/kernel_table.py --smoke        # tiny model on the CPU (operators, not kernels)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package

import torch  # noqa: E402
from graphcache.engine.plan import StepPlan, StepSeq  # noqa: E402

from benchmarks.decode_step import fill, make_runner  # noqa: E402
from benchmarks.model_shapes import add_model_args, require_model, smoke_model  # noqa: E402

ATTENTION = ("attn", "attention", "flash", "fmha", "decode_stage", "unified")
GEMM_OPS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1)}  # op -> (A, B) input positions


def steps(runner, args, vocab: int) -> dict[str, tuple[StepPlan, list[tuple[int, int]]]]:
    """{kind: (batch, [(q tokens, start position) per row])}, built on the KV of `fill`."""
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(0, min(vocab, 10000), (n,), generator=g).tolist()

    decode = fill(runner, args.decode_rows, args.ctx, vocab)
    bs = runner.block_size
    per_seq = len(decode[0].block_table)
    first = args.mixed_decodes * per_seq  # blocks of rows not in the mixed batch: the chunk's sequence
    chunk = StepSeq(
        ids(args.ctx + args.chunk)[args.ctx :],
        args.ctx,
        list(range(first, first + -(-(args.ctx + args.chunk) // bs))),
        True,
    )
    per_prompt = -(-args.prefill_len // bs)
    prefill = [
        StepSeq(ids(args.prefill_len), 0, list(range(i * per_prompt, (i + 1) * per_prompt)), True)
        for i in range(args.prefill_seqs)
    ]
    return {
        "decode": (StepPlan.standalone(decode), [(1, args.ctx)] * len(decode)),
        "mixed": (
            StepPlan.standalone(decode[: args.mixed_decodes] + [chunk]),
            [(1, args.ctx)] * args.mixed_decodes + [(args.chunk, args.ctx)],
        ),
        "prefill": (StepPlan.standalone(prefill), [(args.prefill_len, 0)] * args.prefill_seqs),
    }


def profile_step(runner, batch: StepPlan, iters: int, cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        runner.execute(batch).logits.argmax(dim=-1).tolist()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(iters):
            runner.execute(batch).logits.argmax(dim=-1).tolist()
        if cuda:
            torch.cuda.synchronize()
    return prof.events()


def gemm_bound_us(shapes: list, a_b: tuple[int, int], peak: float, bw: float) -> float:
    a, b = shapes[a_b[0]], shapes[a_b[1]]
    if len(a) < 2 or len(b) < 2:
        return 0.0
    batch = a[0] if len(a) == 3 else 1
    m, k, n = a[-2], a[-1], b[-1]
    return max(2 * batch * m * n * k / peak, 2 * batch * (m * k + k * n + m * n) / bw) * 1e6


def attention_bound_us(cfg: dict, rows: list[tuple[int, int]], peak: float, bw: float) -> float:
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layers = cfg["num_hidden_layers"]
    kv_bytes = sum(start + q for q, start in rows) * kv_heads * hd * 2 * 2 * layers
    flops = sum(4 * q * (start + (q + 1) / 2) * heads * hd for q, start in rows) * layers
    return max(kv_bytes / bw, flops / peak) * 1e6


def kernel_rows(events, iters: int, cuda: bool, peak: float, bw: float) -> list[dict]:
    """One row per kernel (CUDA) or operator (CPU smoke): us per step, calls per step, class, bound."""
    time_us, calls, bound = defaultdict(float), defaultdict(int), defaultdict(float)
    for e in events:
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            time_us[e.name] += e.time_range.elapsed_us()
            calls[e.name] += 1
        elif not cuda and e.device_type == torch.autograd.DeviceType.CPU:  # own time: no double counting
            time_us[e.name] += e.self_cpu_time_total
            calls[e.name] += 1
        if e.device_type == torch.autograd.DeviceType.CPU and e.name in GEMM_OPS and e.input_shapes:
            launched = [k.name for k in e.kernels] if cuda else [e.name]
            if launched:
                bound[launched[0]] += gemm_bound_us(e.input_shapes, GEMM_OPS[e.name], peak, bw)
    rows = []
    for name, t in sorted(time_us.items(), key=lambda kv: -kv[1]):
        kind = (
            "attention"
            if any(p in name.lower() for p in ATTENTION)
            else "gemm"
            if bound.get(name)
            else "other"
        )
        rows.append(
            {
                "kernel": name,
                "us": t / iters,
                "calls": calls[name] / iters,
                "class": kind,
                "bound_us": bound[name] / iters if kind == "gemm" else None,
            }
        )
    return rows


def render(kind: str, rows: list[dict], attn_bound: float, top: int) -> str:
    lines = [f"| {kind} kernel | calls | us/step | class | bound us | x bound |", "|---|---|---|---|---|---|"]
    for r in rows[:top]:
        b, us = r["bound_us"], r["us"]
        lines.append(
            f"| {r['kernel'][:70]} | {r['calls']:.0f} | {us:.1f} | {r['class']} | "
            f"{'' if b is None else f'{b:.1f}'} | {'' if not b else f'{us / b:.2f}'} |"
        )
    total = sum(r["us"] for r in rows)
    for cls in ("gemm", "attention", "other"):
        t = sum(r["us"] for r in rows if r["class"] == cls)
        b = (
            sum(r["bound_us"] or 0 for r in rows if r["class"] == cls)
            if cls == "gemm"
            else attn_bound
            if cls == "attention"
            else None
        )
        ratio = f"{t / b:.2f}" if b and t else ""
        lines.append(
            f"| **{cls} total** | | {t:.1f} ({t / max(total, 1e-9):.0%}) | {cls} | "
            f"{'' if b is None else f'{b:.1f}'} | {ratio} |"
        )
    lines.append(f"| **step total** | | {total:.1f} | | | |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--kinds", default="decode,mixed,prefill")
    ap.add_argument("--decode-rows", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--mixed-decodes", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=192)
    ap.add_argument("--prefill-seqs", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top", type=int, default=25, help="kernels listed per step (totals cover all)")
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 TFLOP/s")
    ap.add_argument(
        "--quantization", default="auto", help="as serve's --quantization (fp8: quantized on load)"
    )
    ap.add_argument(
        "--bf16-small-gemm",
        default="on",
        choices=["on", "off"],
        help="settings.engine.bf16_small_gemm (1-64-row GEMMs)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, small steps")
    ap.add_argument("--out", type=Path)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.decode_rows, args.ctx, args.mixed_decodes, args.chunk, args.prefill_seqs, args.prefill_len = (
            8,
            32,
            4,
            16,
            2,
            64,
        )
        args.iters, device = 1, "cpu"
        smoke_model(args)
    model = require_model(args)
    cfg = json.loads((model / "config.json").read_text())
    cuda = device == "cuda"
    peak, bw = args.peak_tflops * 1e12, args.bandwidth
    runner = make_runner(
        model,
        "eager",
        args.decode_rows,
        args.ctx,
        device=device,
        max_model_len=min(4096, cfg["max_position_embeddings"]),
        quantization=args.quantization,
        bf16_small_gemm=args.bf16_small_gemm == "on",
    )
    built = steps(runner, args, cfg["vocab_size"])
    out = {}
    for kind in args.kinds.split(","):
        batch, rows = built[kind]
        table = kernel_rows(profile_step(runner, batch, args.iters, cuda), args.iters, cuda, peak, bw)
        attn = attention_bound_us(cfg, rows, peak, bw)
        out[kind] = {"rows": table, "attention_bound_us": attn, "tokens": sum(q for q, _ in rows)}
        print(
            f"\n=== {model.name} ({args.quantization}): {kind} step, {len(rows)} rows, {out[kind]['tokens']} tokens "
            f"({'CUDA kernels' if cuda else 'CPU operators (smoke)'}, us per step)"
        )
        print(render(kind, table, attn, args.top))
    if args.out:
        args.out.write_text(json.dumps({"model": str(model), "config": cfg, "steps": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
