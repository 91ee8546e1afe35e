"""Decode-step latency: eager vs one full CUDA graph vs our breakable capture vs meta's
breakable-cuda-graphs 0.1.0, on Llama-shaped stacks with random bf16 weights.

    python benchmarks/capture_bench.py --out bench.json           # both shapes, batch 1..512

Every variant runs the same step code; attention (scatter k/v into a 1024-slot static
cache already holding 512 tokens + SDPA with an additive mask) is the eager break. It
is an eager op in the breakable variants and is captured into the graph by the full one
(eager_break calls through outside our capture). Times: median of N replays, CUDA events.
Each graph variant is dropped before the next is captured (see capture.py on cuBLAS
workspaces).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package
from graphcache.graphs.capture import capture, eager_break  # noqa: E402
from graphcache.graphs.pool import pool_bytes  # noqa: E402

try:
    import breakable_cuda_graphs as bcg
except ImportError:  # reported as n/a
    bcg = None

SHAPES = {  # the public configs' sizes
    "qwen2.5-0.5b": dict(layers=24, hidden=896, heads=14, kv_heads=2, head_dim=64, inter=4864, vocab=151936),
    "llama-3.2-1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, inter=8192, vocab=128256),
}
CTX, SLOTS, EPS = 512, 1024, 1e-6
MiB = 1 << 20


def write_kv(k, v, k_cache, v_cache, slot) -> None:
    """k/v [B, KV, 1, D] into caches [B, KV, S, D] at slot [1] (a static device index)."""
    k_cache.index_copy_(2, slot, k)
    v_cache.index_copy_(2, slot, v)


def attend(q, k_cache, v_cache, mask, out) -> None:
    """q [B, KV, G, D] (GQA folded into the query length), mask [1, 1, 1, S] additive, out [B, KV, G, D]."""
    out.copy_(F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask))


def write_and_attend(q, k, v, k_cache, v_cache, slot, mask, out) -> None:
    write_kv(k, v, k_cache, v_cache, slot)
    attend(q, k_cache, v_cache, mask, out)


# Where the break sits. The KV write indexes by a static device tensor (the slot), so it is
# capturable: only attention itself needs host-side lengths. "split" keeps the write in the
# graph segment (our model does this); "fused" puts it in the break, as vLLM/SGLang's
# attention ops do, costing two more eager kernels per layer.
ATTN = {
    "split": (write_kv, eager_break(attend)),
    "fused": (None, eager_break(write_and_attend)),
    "meta": (write_kv, bcg.no_graph(attend) if bcg is not None else None),
}


class Stack:
    """Random-weight decoder stack; weights shared by every batch size."""

    def __init__(self, cfg: dict, device: str = "cuda") -> None:
        self.c = c = cfg
        kw = dict(device=device, dtype=torch.bfloat16)
        H, D, NH, KV, FF = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"], c["inter"]

        def w(*shape):
            return torch.randn(*shape, **kw) / math.sqrt(shape[0])

        self.embed = torch.randn(c["vocab"], H, **kw) * 0.02  # tied lm_head, as both models
        self.layers = [
            dict(
                ln1=torch.ones(H, **kw),
                ln2=torch.ones(H, **kw),
                wqkv=w(H, (NH + 2 * KV) * D),
                wo=w(NH * D, H),
                wgu=w(H, 2 * FF),
                wdown=w(FF, H),
            )
            for _ in range(c["layers"])
        ]
        self.norm = torch.ones(H, **kw)
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
        ang = torch.cat([CTX * inv, CTX * inv])
        self.cos, self.sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)  # [D] at position CTX
        self.slot = torch.tensor([CTX], device=device)
        self.mask = torch.full((1, 1, 1, SLOTS), float("-inf"), **kw)
        self.mask[..., : CTX + 1] = 0

    def buffers(self, B: int) -> None:
        """Static buffers and a KV cache for batch B (outside any graph pool)."""
        c, kw = self.c, dict(device="cuda", dtype=torch.bfloat16)
        self.B = B
        self.ids = torch.randint(0, c["vocab"], (B,), device="cuda")
        self.logits = torch.empty(B, c["vocab"], **kw)
        self.attn_out = torch.empty(B, c["kv_heads"], c["heads"] // c["kv_heads"], c["head_dim"], **kw)
        for L in self.layers:
            L["k"] = torch.randn(B, c["kv_heads"], SLOTS, c["head_dim"], **kw)
            L["v"] = torch.randn(B, c["kv_heads"], SLOTS, c["head_dim"], **kw)

    def drop_buffers(self) -> None:
        for L in self.layers:
            L.pop("k", None)
            L.pop("v", None)
        self.ids = self.logits = self.attn_out = None

    def rope(self, x):  # x [B, N, D]
        x1, x2 = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat((-x2, x1), dim=-1) * self.sin

    def step(self, attn: str) -> None:
        c, B = self.c, self.B
        H, D, NH, KV = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"]
        h = F.embedding(self.ids, self.embed)  # [B, H]
        for L in self.layers:
            x = F.rms_norm(h, (H,), L["ln1"], EPS)
            q, k, v = (x @ L["wqkv"]).split([NH * D, KV * D, KV * D], dim=-1)
            q, k = self.rope(q.view(B, NH, D)), self.rope(k.view(B, KV, D))
            q, k, v = q.view(B, KV, NH // KV, D), k.view(B, KV, 1, D), v.view(B, KV, 1, D)
            write, brk = ATTN[attn]
            if write is None:
                brk(q, k, v, L["k"], L["v"], self.slot, self.mask, self.attn_out)
            else:
                write(k, v, L["k"], L["v"], self.slot)
                brk(q, L["k"], L["v"], self.mask, self.attn_out)
            h = h + self.attn_out.view(B, NH * D) @ L["wo"]
            gate, up = (F.rms_norm(h, (H,), L["ln2"], EPS) @ L["wgu"]).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ L["wdown"]
        torch.matmul(F.rms_norm(h, (H,), self.norm, EPS), self.embed.t(), out=self.logits)


def host_ms(fn, iters: int) -> float:
    """Median host time to enqueue one step, GPU kept busy so launches never wait on it."""
    times = []
    for _ in range(iters):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU spin: the queue never drains while we enqueue
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def max_diff(model: Stack, replay, ref: torch.Tensor) -> float:
    model.logits.fill_(float("nan"))
    replay()
    torch.cuda.synchronize()
    return (model.logits.float() - ref).abs().max().item()


def _timed_capture(fn) -> tuple[object, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def _free() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def bench_batch(model: Stack, B: int, iters: int, warmup: int) -> dict:
    model.buffers(B)
    row: dict = {"batch": B}
    step_eager = lambda: model.step("split")  # noqa: E731 (outside capture: calls through)
    row["eager_ms"] = median_ms(step_eager, iters, warmup)
    model.logits.fill_(float("nan"))
    step_eager()
    ref = model.logits.float().clone()

    # one full CUDA graph: the attention op is captured too (host state frozen at capture)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step_eager()
    torch.cuda.current_stream().wait_stream(s)
    full = torch.cuda.CUDAGraph()

    def cap_full(graph=full):
        with torch.cuda.graph(graph, stream=s):
            step_eager()

    _, row["full_capture_ms"] = _timed_capture(cap_full)
    row["full_pool_mib"] = pool_bytes(full.pool()) / MiB
    row["full_ms"] = median_ms(full.replay, iters, warmup)
    row["full_maxdiff"] = max_diff(model, full.replay, ref)
    del full
    _free()

    # ours: the break holds attention only ("split"), or the KV write too ("fused")
    for name, attn in (("ours", "split"), ("ours_fused", "fused")):
        pool = torch.cuda.graph_pool_handle()
        g, row[f"{name}_capture_ms"] = _timed_capture(
            lambda attn=attn, pool=pool: capture(lambda: model.step(attn), backend="cuda", pool=pool)
        )
        assert g.num_breaks == len(model.layers) and len(g.segments) == 2 * g.num_breaks + 1
        row[f"{name}_pool_mib"] = pool_bytes(pool) / MiB
        row[f"{name}_ms"] = median_ms(g.replay, iters, warmup)
        row[f"{name}_host_ms"] = host_ms(g.replay, min(iters, 20))
        row[f"{name}_maxdiff"] = max_diff(model, g.replay, ref)
        g.close()
        del g
        _free()

    # meta-pytorch breakable-cuda-graphs 0.1.0
    if bcg is None:
        row.update(meta_ms=None, meta_capture_ms=None, meta_pool_mib=None, meta_maxdiff=None)
    else:
        bg = bcg.BreakableCUDAGraph()

        def cap_meta():
            with bcg.breakable_graph(bg):
                model.step("meta")

        _, row["meta_capture_ms"] = _timed_capture(cap_meta)
        row["meta_pool_mib"] = pool_bytes(bg.pool()) / MiB
        row["meta_ms"] = median_ms(bg.replay, iters, warmup)
        row["meta_maxdiff"] = max_diff(model, bg.replay, ref)
        bg.reset()
        del bg
    model.drop_buffers()
    _free()
    return row


def fmt(x, spec=".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def print_table(shape: str, rows: list[dict]) -> None:
    print(
        f"\n## {shape}  (ms: median decode step, CUDA events; host = CPU time to enqueue one replay; "
        "capture ms; pool MiB; max |logits - eager|)"
    )
    print(
        "| batch | eager | full | ours | ours/full | ours host | fused | fused/full | meta | meta/full "
        "| capture full/ours/meta ms | pool full/ours/meta MiB | maxdiff full/ours/fused/meta |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:

        def over(k, r=r):
            return None if r.get(k) is None else r[k] / r["full_ms"]

        print(
            f"| {r['batch']} | {fmt(r['eager_ms'])} | {fmt(r['full_ms'])} | {fmt(r['ours_ms'])} | "
            f"{fmt(over('ours_ms'), '.3f')} | {fmt(r['ours_host_ms'])} | {fmt(r['ours_fused_ms'])} | "
            f"{fmt(over('ours_fused_ms'), '.3f')} | {fmt(r['meta_ms'])} | {fmt(over('meta_ms'), '.3f')} | "
            f"{fmt(r['full_capture_ms'], '.0f')}/{fmt(r['ours_capture_ms'], '.0f')}/"
            f"{fmt(r['meta_capture_ms'], '.0f')} | {fmt(r['full_pool_mib'], '.1f')}/"
            f"{fmt(r['ours_pool_mib'], '.1f')}/{fmt(r['meta_pool_mib'], '.1f')} | "
            f"{fmt(r['full_maxdiff'], '.3g')}/{fmt(r['ours_maxdiff'], '.3g')}/"
            f"{fmt(r['ours_fused_maxdiff'], '.3g')}/{fmt(r['meta_maxdiff'], '.3g')} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--batches", default="1,8,32,128,512")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("capture_bench.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("capture_bench needs a CUDA GPU")
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)  # same SDPA backend (mem-efficient) in every variant
    torch.manual_seed(0)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "breakable_cuda_graphs": getattr(bcg, "__version__", None),
        "ctx_tokens": CTX,
        "kv_slots": SLOTS,
        "iters": args.iters,
        "command": " ".join(sys.argv),
        "shapes": {},
    }
    for shape in args.shapes.split(","):
        model = Stack(SHAPES[shape])
        rows = []
        for B in (int(b) for b in args.batches.split(",")):
            rows.append(bench_batch(model, B, args.iters, args.warmup))
            print(f"  {shape} batch {B}: done", file=sys.stderr, flush=True)
        result["shapes"][shape] = rows
        print_table(shape, rows)
        del model
        _free()
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
