"""The LoRA kernels alone (issue 38) at the Llama-3-8B projections, rank 16, 4 slots: the kernels before
(split-K shrink, expand looping over the slots; kept below as `legacy_shrink_expand`) against
model/lora_kernels.py's (tokens grouped by slot; the shrink serial before the base GEMM, or forked beside it
as the layers do in a graph), each next to the base GEMM of the same shape as the yardstick.

  python benchmarks/lora_kernel_bench.py --out lora_kernels.json      # CUDA: ~3-5 minutes on an H100
  python benchmarks/lora_kernel_bench.py --ts 1,512 --projections qkv   # a subset

Per projection (qkv 4096 -> 6144 in 3 pieces, o 4096 -> 4096, gate_up 4096 -> 28672 in 2, down 14336 -> 4096),
step size T (--ts, default 1, 8, 64, 512, 8192) and slots mixed (--mixes: 1 = every token slot 0; 4 = each
token a random one of four), one CUDA graph holds a chain of R projections (R = 32 at T <= 64, 16 at 512,
4 above; each its own base weight and LoRA stack, as layers are, so W streams from HBM), replayed --iters
times with CUDA events around each replay; the figure is the median replay over R:

- base: torch.mm(x, W^T) into y (F.linear's GEMM);
- legacy: base + the old two kernels;
- serial: base + plan (once a chain, as once a forward) + shrink + expand, all on one stream
  (lora_layers.FORK_SHRINK_MAX_TOKENS = 0);
- fork: the same launched through LoraStack as the model does: the shrink on the side stream beside the base
  GEMM, the expand after both (FORK_SHRINK_MAX_TOKENS above T; the model forks only up to its default, 128);
- beside: LoraStack.add_beside_, as o_proj, down_proj and gate_up_proj do: shrink and expand both on the
  side stream beside the GEMM, the delta added into a separate [T, out] tensor (the model's residual; for
  gate_up a delta buffer zeroed first, which the activation adds), joined after.

LoRA ms = (variant - base), and its ratio to base. At the end, per T and mix: the four projections summed
over 32 layers (what a decode or mixed step of that size pays), the model's layout among them (fork for qkv,
beside for the others, up to 128 tokens; serial above), and the plan alone. Each variant's output is
checked against the per-slot fp32 reference first. --out writes every row as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

import torch  # noqa: E402
from graphcache.model import lora_layers  # noqa: E402
from graphcache.model.lora_kernels import LoraWorkspace, lora_plan  # noqa: E402
from graphcache.model.lora_layers import LoraIndex, LoraStack  # noqa: E402
from graphcache.model.triton_support import tl, triton  # noqa: E402

PROJECTIONS = {  # name: (in, pieces' output rows)
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
LAYERS = 32
VARIANTS = ("legacy", "serial", "fork", "beside")
BESIDE = ("o", "down", "gate_up")  # what the model runs beside (o, down: into the residual; gate_up: a delta)

# --------------------------------------------------------------------------- the kernels before


def _legacy_shrink(
    x_ptr, a_ptr, idx_ptr, out_ptr, T, K, R, S, K_SPLIT,
    stride_xt, stride_as, stride_ar, stride_ok, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_r, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    idx = tl.load(idx_ptr + offs_m, mask=offs_m < T, other=-1)
    if tl.max(idx, axis=0) >= 0:
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in range(0, S):
            hit = idx == s
            if tl.max(hit.to(tl.int32), axis=0) > 0:
                part = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for k0 in range(pid_k * K_SPLIT, tl.minimum(K, (pid_k + 1) * K_SPLIT), BLOCK_K):
                    k = k0 + offs_k
                    xt = tl.load(
                        x_ptr + offs_m[:, None] * stride_xt + k[None, :],
                        mask=hit[:, None] & (k[None, :] < K),
                        other=0.0,
                    )
                    at = tl.load(
                        a_ptr + s * stride_as + offs_r[:, None] * stride_ar + k[None, :],
                        mask=(offs_r[:, None] < R) & (k[None, :] < K),
                        other=0.0,
                    )
                    part += tl.dot(xt, tl.trans(at))
                acc = tl.where(hit[:, None], part, acc)
        tl.store(out_ptr + pid_k * stride_ok + offs_m[:, None] * stride_ot + offs_r[None, :], acc,
                 mask=(offs_m[:, None] < T) & (offs_r[None, :] < R))  # fmt: skip


def _legacy_expand(
    s_ptr, b_ptr, idx_ptr, y_ptr, T, N, R, S, SPLITS,
    stride_sk, stride_st, stride_bs, stride_bn, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    idx = tl.load(idx_ptr + offs_m, mask=offs_m < T, other=-1)
    if tl.max(idx, axis=0) >= 0:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, S):
            hit = idx == s
            if tl.max(hit.to(tl.int32), axis=0) > 0:
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for r0 in range(0, R, BLOCK_R):
                    r = r0 + offs_r
                    st = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                    for z in range(0, SPLITS):
                        st += tl.load(
                            s_ptr + z * stride_sk + offs_m[:, None] * stride_st + r[None, :],
                            mask=hit[:, None] & (r[None, :] < R),
                            other=0.0,
                        )
                    bt = tl.load(
                        b_ptr + s * stride_bs + offs_n[:, None] * stride_bn + r[None, :],
                        mask=(offs_n[:, None] < N) & (r[None, :] < R),
                        other=0.0,
                    )
                    part += tl.dot(st.to(bt.dtype), tl.trans(bt))
                acc = tl.where(hit[:, None], part, acc)
        rows = (offs_m[:, None] < T) & (idx[:, None] >= 0) & (offs_n[None, :] < N)
        y_ptrs = y_ptr + offs_m[:, None] * stride_yt + offs_n[None, :]
        y = tl.load(y_ptrs, mask=rows, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=rows)


_LEGACY = None


def legacy_shrink_expand(y, x, a, b, index) -> None:
    """The kernels before this change, as they were launched (main at 108fc1e)."""
    global _LEGACY
    if _LEGACY is None:
        _LEGACY = (triton.jit(_legacy_shrink), triton.jit(_legacy_expand))
    shrink, expand = _LEGACY
    t, k = x.shape
    slots, r, _ = a.shape
    n = y.shape[1]
    bm = 16 if t <= 16 else 32 if t <= 256 else 64
    block_r = min(64, max(16, triton.next_power_of_2(r)))
    block_k = 64
    m_tiles = triton.cdiv(t, bm)
    splits = max(1, min(triton.cdiv(k, 4 * block_k), triton.cdiv(128, m_tiles * triton.cdiv(r, block_r))))
    k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_split)
    shrunk = torch.empty(splits, t, r, dtype=torch.float32, device=x.device)
    shrink[(m_tiles, triton.cdiv(r, block_r), splits)](
        x, a, index, shrunk, t, k, r, slots, k_split,
        x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0), shrunk.stride(1),
        BLOCK_M=bm, BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    expand[(m_tiles, triton.cdiv(n, 64))](
        shrunk, b, index, y, t, n, r, slots, splits,
        shrunk.stride(0), shrunk.stride(1), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=bm, BLOCK_N=64, BLOCK_R=block_r,
    )  # fmt: skip


# --------------------------------------------------------------------------- timing


def chain_ms(step, reps: int, iters: int) -> float:
    """Median ms of one step(i) from replays of a CUDA graph holding step(0) .. step(reps - 1)."""
    for i in range(reps):
        step(i)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            step(i)
    graph.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    graph.reset()
    return statistics.median(times)


def reference(y0, x, a, b, index) -> torch.Tensor:
    out = y0.float().clone()
    for s in index.unique().tolist():
        if s < 0:
            continue
        rows = index == s
        out[rows] += (x[rows].float() @ a[s].float().t()) @ b[s].float().t()
    return out


def run_case(proj: str, t: int, mix: int, args) -> dict:
    k, pieces = PROJECTIONS[proj]
    n, rank, slots = sum(pieces), args.rank, args.slots
    reps = args.reps or (32 if t <= 64 else 16 if t <= 512 else 4)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(t * 10 + mix)
    weights = [torch.randn(n, k, device=dev, dtype=dtype, generator=g) / k**0.5 for _ in range(reps)]
    index = LoraIndex(torch.full((t,), -1, dtype=torch.int64, device=dev))
    index.use_kernels = index.active = True
    slices, first = [], 0
    for rows in pieces:
        slices.append((first, rows))
        first += rows
    stacks = [
        LoraStack(index, slots=slots, rank=rank, in_features=k, out_slices=slices, dtype=dtype, device=dev)
        for _ in range(reps)
    ]
    index.planner = stacks[0]
    for st in stacks:  # dense random A and B: the kernels' cost does not depend on the pieces' zeros
        st.a.copy_(torch.randn(st.a.shape, device=dev, generator=g) / k**0.5)
        st.b.copy_(torch.randn(st.b.shape, device=dev, generator=g) / st.a.shape[1] ** 0.5)
    picks = torch.zeros(t, dtype=torch.int64) if mix == 1 else torch.randint(0, mix, (t,))
    index.tokens.copy_(picks)
    x = torch.randn(t, k, device=dev, dtype=dtype, generator=g)
    y = torch.empty(t, n, device=dev, dtype=dtype)

    def base(i: int) -> None:
        torch.mm(x, weights[i].t(), out=y)

    def legacy(i: int) -> None:
        base(i)
        legacy_shrink_expand(y, x, stacks[i].a, stacks[i].b, index.tokens)

    def layered(i: int) -> None:
        lora = stacks[i].shrink_(x)
        base(i)
        assert lora is not None
        lora.add_to(y)

    residual = torch.randn(t, n, device=dev, dtype=dtype, generator=g)
    zero_first = proj == "gate_up"  # its delta buffer, which the activation adds

    def beside(i: int) -> None:
        joined = stacks[i].add_beside_(x, residual, zero_first=zero_first)
        base(i)
        if joined is not None:
            joined.join()

    row: dict = {"proj": proj, "t": t, "slots_mixed": mix, "n": n, "k": k, "rank": rank, "reps": reps}
    want = reference(x @ weights[0].t(), x, stacks[0].a, stacks[0].b, index.tokens)
    residual0 = residual.clone()
    for name, fn in (("legacy", legacy), ("serial", layered), ("beside", beside)):
        fn(0)
        added = residual.float() - (0.0 if zero_first else residual0.float())
        got = y.float() + (added if name == "beside" else 0.0)
        err = (got - want).abs().max().item() / want.abs().max().item()
        row[f"{name}_rel_err"] = err
        if err > 0.02:
            print(
                f"WARNING {proj} T={t} mix={mix}: {name} differs from the reference by {err:.3g}", flush=True
            )
    row["base_ms"] = chain_ms(base, reps, args.iters)
    row["legacy_ms"] = chain_ms(legacy, reps, args.iters)
    default_max = lora_layers.FORK_SHRINK_MAX_TOKENS
    for name, fn, fork_max in (("serial", layered, 0), ("fork", layered, t), ("beside", beside, t)):
        lora_layers.FORK_SHRINK_MAX_TOKENS = fork_max
        try:
            row[f"{name}_ms"] = chain_ms(fn, reps, args.iters)
        finally:
            lora_layers.FORK_SHRINK_MAX_TOKENS = default_max
    ws = LoraWorkspace(t, slots, 16, dev)
    row["plan_ms"] = chain_ms(lambda i: lora_plan(index.tokens, slots, ws), 16, args.iters)
    for v in VARIANTS:
        row[f"{v}_lora_ms"] = row[f"{v}_ms"] - row["base_ms"]
        row[f"{v}_ratio"] = row[f"{v}_lora_ms"] / row["base_ms"]
    weights.clear()
    stacks.clear()
    torch.cuda.empty_cache()
    return row


def report(rows: list[dict]) -> list[str]:
    lines = [
        f"LoRA kernels, Llama-3-8B projections, rank {rows[0]['rank']}, {torch.cuda.get_device_name()}: "
        "ms a projection (LoRA = variant - base; ratio = LoRA / base)",
        "| proj | T | slots | base ms | legacy LoRA ms (ratio) | serial LoRA ms (ratio) | fork LoRA ms (ratio) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = " | ".join(f"{r[f'{v}_lora_ms']:.4f} ({r[f'{v}_ratio']:.3f})" for v in VARIANTS)
        lines.append(f"| {r['proj']} | {r['t']} | {r['slots_mixed']} | {r['base_ms']:.4f} | {cells} |")
    lines += [
        "",
        f"Per step of {LAYERS} layers (the four projections summed x {LAYERS}, + one plan): LoRA ms and "
        "LoRA / base GEMMs",
        "| T | slots | base GEMMs ms | legacy | serial | fork | beside | model's layout | plan ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t, mix in sorted({(r["t"], r["slots_mixed"]) for r in rows}):
        group = [r for r in rows if r["t"] == t and r["slots_mixed"] == mix]
        if len(group) != len(PROJECTIONS):
            continue
        base = LAYERS * sum(r["base_ms"] for r in group)
        plan = group[0]["plan_ms"]
        cells = []
        for v in VARIANTS:
            lora = LAYERS * sum(r[f"{v}_lora_ms"] for r in group) + (plan if v != "legacy" else 0.0)
            cells.append(f"{lora:.3f} ({lora / base:.3f})")
        model = LAYERS * sum(r[f"{_model_variant(r['proj'], t)}_lora_ms"] for r in group) + plan
        cells.append(f"{model:.3f} ({model / base:.3f})")
        lines.append(f"| {t} | {mix} | {base:.3f} | {' | '.join(cells)} | {plan:.4f} |")
    return lines


def _model_variant(proj: str, t: int) -> str:
    """The variant the model runs for this projection at T tokens in a graph (model/lora_layers.py)."""
    if t > lora_layers.FORK_SHRINK_MAX_TOKENS:
        return "serial"
    return "beside" if proj in BESIDE else "fork"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--projections", default=",".join(PROJECTIONS))
    ap.add_argument("--ts", default="1,8,64,512,8192", help="step sizes (tokens)")
    ap.add_argument("--mixes", default="1,4", help="slots the tokens are spread over")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=4, help="slots allocated (--max-loras)")
    ap.add_argument("--reps", type=int, default=0, help="projections a graph (0: by T)")
    ap.add_argument("--iters", type=int, default=20, help="replays timed (median)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lora_kernel_bench needs a CUDA GPU (the kernels' correctness runs on the CPU in the tests)")
    rows = []
    for proj in args.projections.split(","):
        for t in (int(v) for v in args.ts.split(",")):
            for mix in (int(v) for v in args.mixes.split(",")):
                row = run_case(proj, t, mix, args)
                rows.append(row)
                print(json.dumps(row), flush=True)
    lines = report(rows)
    print("\n".join(lines), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "table": lines}, indent=1))


if __name__ == "__main__":
    main()
