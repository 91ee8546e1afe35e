"""The batched LoRA kernels (model/lora_kernels.py) against torch references (model/lora_layers.py's, and a
per-slot one for large steps): step sizes from one token to 8,192, one to four slots mixed with base tokens,
fused pieces (q/k/v, gate/up) laid out block-diagonally as LoraStack does, ranks below the slots' rank, the
slot no token uses poisoned with NaN and so is the kernels' scratch (a kernel that reads either shows),
base rows of y left bit for bit. The plan (tokens grouped by slot into tiles) against its definition. Inside a
captured CUDA graph: one graph replays two adapter mixes equal to eager, through the layers' path too (the
shrink on the side stream beside a base GEMM). On the CPU the same kernels run under Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from graphcache.model.lora_layers import lora_add_reference

SHAPES = [  # (T, in, out, slots, rank)
    (1, 64, 96, 2, 16),
    (3, 128, 200, 3, 48),
    (37, 200, 130, 4, 32),
    (130, 256, 512, 2, 16),
    (512, 512, 1024, 4, 48),
]


def _case(t, k, n, s, r, *, device, dtype, seed=0, used=None):
    """(y, x, a, b, index): dense A [S, R, in] and B [S, out, R]; the slots in `used` (default all but the
    last) and -1 drawn per token; every other slot's A and B are NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(device, dtype)
    a = (torch.randn(s, r, k, generator=g) / k**0.5).to(device, dtype)
    b = (torch.randn(s, n, r, generator=g) / r**0.5).to(device, dtype)
    used = list(range(s - 1)) if used is None else used  # the last slot: no token uses it
    choices = torch.tensor([-1, *used])
    index = choices[torch.randint(0, len(choices), (t,), generator=g)].to(device)
    for slot in set(range(s)) - set(used):
        a[slot], b[slot] = float("nan"), float("nan")
    y = torch.randn(t, n, generator=g).to(device, dtype)
    return y, x, a, b, index


def _stacked_case(t, k, pieces, slots, rank, ranks, *, device, dtype, seed=0, mix=None):
    """LoraStack's layout: P pieces of `rank` rank rows each, piece j of slot s with rank ranks[s] (<= rank)
    and its own output rows (pieces' widths out // P); zeros elsewhere. mix: the slots tokens draw from
    (with -1), default every slot but the last, which holds NaN."""
    g = torch.Generator().manual_seed(seed)
    width = rank * len(pieces)
    n = sum(pieces)
    a = torch.zeros(slots, width, k)
    b = torch.zeros(slots, n, width)
    for s in range(slots):
        first = 0
        for j, rows in enumerate(pieces):
            r = ranks[s]
            a[s, j * rank : j * rank + r] = torch.randn(r, k, generator=g) / k**0.5
            b[s, first : first + rows, j * rank : j * rank + r] = torch.randn(rows, r, generator=g) / r**0.5
            first += rows
    mix = list(range(slots - 1)) if mix is None else mix
    for s in set(range(slots)) - set(mix):
        a[s], b[s] = float("nan"), float("nan")
    choices = torch.tensor([-1, *mix])
    index = choices[torch.randint(0, len(choices), (t,), generator=g)]
    x = torch.randn(t, k, generator=g)
    y = torch.randn(t, n, generator=g)
    return tuple(v.to(device, dtype) for v in (y, x, a, b)) + (index.to(device),)


def _per_slot_reference(y, x, a, b, index):
    """y + B[s] A[s] x per slot in fp32 (a [T, W, in] gather would not fit at 8,192 tokens)."""
    out = y.float().clone()
    for s in index.unique().tolist():
        if s >= 0:
            rows = index == s
            out[rows] += (x[rows].float() @ a[s].float().t()) @ b[s].float().t()
    return out


def _plan_problems(index, ws, slots):
    """What differs between ws's tile table and the plan's definition (empty: none)."""
    from graphcache.model.lora_kernels import block_m, max_tiles

    t = index.shape[0]
    bm, tiles = block_m(t), max_tiles(t, slots)
    slot_of, count = ws.tile_slot[:tiles].tolist(), ws.tile_count[:tiles].tolist()
    rows = ws.tile_rows.tolist()
    got = {s: [] for s in range(slots)}
    problems = []
    for p in range(tiles):
        if count[p] == 0:
            if slot_of[p] != -1:
                problems.append(f"empty tile {p} names slot {slot_of[p]}")
            continue
        got[slot_of[p]].extend(rows[p * bm : p * bm + count[p]])
    seen_empty = False
    for p in range(tiles):  # real tiles first, then the empty ones
        seen_empty |= count[p] == 0
        if seen_empty and count[p] > 0:
            problems.append(f"tile {p} is real after an empty one")
    for s in range(slots):
        want = [i for i, v in enumerate(index.tolist()) if v == s]
        if got[s] != want:
            problems.append(f"slot {s}: tiles hold {got[s][:8]}..., tokens are {want[:8]}...")
        full = [c for p, c in enumerate(count) if c and slot_of[p] == s]
        if full and any(c != bm for c in full[:-1]):
            problems.append(f"slot {s}: tiles other than its last are not full: {full}")
    return problems


def test_kernels_match_the_reference_under_the_triton_interpreter():
    pytest.importorskip("triton")
    script = textwrap.dedent(
        f"""
        import torch
        from graphcache.model.lora_kernels import LoraWorkspace, lora_plan, lora_shrink_expand
        from graphcache.model.lora_layers import lora_add_reference
        from test_lora_kernels import _case, _plan_problems, _stacked_case
        for shape in {SHAPES[:4]!r}:
            y, x, a, b, index = _case(*shape, device="cpu", dtype=torch.float32)
            want, got = y.clone(), y.clone()
            lora_add_reference(want, x, torch.nan_to_num(a), torch.nan_to_num(b), index)
            ws = LoraWorkspace(shape[0], shape[3], shape[4], torch.device("cpu"))
            ws.shrunk.fill_(float("nan"))
            lora_shrink_expand(got, x, a, b, index, ws)
            assert torch.equal(got[index < 0], y[index < 0]), shape
            assert (got - want).abs().max() < 1e-4, (shape, (got - want).abs().max())
            assert not _plan_problems(index, ws, shape[3]), _plan_problems(index, ws, shape[3])
        # fused pieces, ranks below the slots', four slots in use; in > 1024: the shrink's K splits
        for t, pieces, k in (
            (16, (48, 16, 16), 96), (21, (40, 40), 96), (70, (64,), 96), (300, (48, 16, 16), 96),
            (290, (64,), 96), (5, (48, 16, 16), 1300), (40, (32, 32), 2100),
        ):
            y, x, a, b, index = _stacked_case(
                t, k, pieces, 5, 16, (16, 8, 4, 12, 16), device="cpu", dtype=torch.float32, seed=t,
                mix=[0, 1, 2, 3],
            )
            want, got = y.clone(), y.clone()
            lora_add_reference(want, x, torch.nan_to_num(a), torch.nan_to_num(b), index)
            lora_shrink_expand(got, x, a, b, index)
            assert torch.equal(got[index < 0], y[index < 0]), t
            assert (got - want).abs().max() < 1e-4, (t, (got - want).abs().max())
        # the plan alone: every token of a slot once, in order, in full tiles but the last
        for t, slots in ((1, 4), (17, 3), (300, 4), (1000, 7)):
            g = torch.Generator().manual_seed(t)
            index = torch.randint(-1, slots, (t,), generator=g)
            ws = LoraWorkspace(t, slots, 16, torch.device("cpu"))
            lora_plan(index, slots, ws)
            assert not _plan_problems(index, ws, slots), (t, _plan_problems(index, ws, slots))
        y, x, a, b, _ = _case(5, 64, 64, 2, 16, device="cpu", dtype=torch.float32)
        got = y.clone()
        lora_shrink_expand(got, x, a, b, torch.full((5,), -1))
        assert torch.equal(got, y)
        print("ok")
        """
    )
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(here), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_a_projection_without_this_steps_plan_is_refused():
    """The plan is made once a forward by its first projection; a projection of another step size (a plan
    missing or stale) is refused before any launch, naming the fix."""
    pytest.importorskip("triton")
    from graphcache.model.lora_kernels import LoraWorkspace, lora_expand, lora_shrink

    ws = LoraWorkspace(8, 2, 16, torch.device("cpu"))
    x, a, b = torch.zeros(4, 32), torch.zeros(2, 16, 32), torch.zeros(2, 24, 16)
    with pytest.raises(RuntimeError, match="plan each forward"):
        lora_shrink(x, a, ws)
    ws.planned = 8
    with pytest.raises(RuntimeError, match="made for 8 tokens, this projection has 4"):
        lora_expand(torch.zeros(4, 24), b, ws, 1)


def _assert_close(got, want, y, index, what):
    assert torch.isfinite(got).all(), what
    assert torch.equal(got[index < 0], y[index < 0]), what  # base rows untouched, bit for bit
    tol = 0.02 * want.abs().max().item()
    err = (got.float() - want).abs().max().item()
    assert err <= tol, f"{what}: max error {err} > {tol}"


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_match_the_reference_on_cuda(shape, dtype):
    from graphcache.model.lora_kernels import LoraWorkspace, lora_shrink_expand

    y, x, a, b, index = _case(*shape, device="cuda", dtype=dtype, seed=sum(shape))
    want, got = y.float().clone(), y.clone()
    lora_add_reference(want, x.float(), torch.nan_to_num(a.float()), torch.nan_to_num(b.float()), index)
    ws = LoraWorkspace(shape[0], shape[3], shape[4], x.device)
    ws.shrunk.fill_(float("nan"))
    lora_shrink_expand(got, x, a, b, index, ws)
    torch.cuda.synchronize()
    _assert_close(got, want, y, index, f"{shape} {dtype}")


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 3, 16, 100, 1000, 8192])
@pytest.mark.parametrize("pieces", [(512,), (384, 128, 128), (640, 640)], ids=["o", "qkv", "gate_up"])
@pytest.mark.parametrize("slots_used", [1, 4])
def test_step_sizes_pieces_and_mixes_on_cuda(t, pieces, slots_used):
    """bf16, in 1300, 5 slots of rank 16 (ranks 16, 8, 4, 12 in use), tokens over slots_used slots and base
    tokens, the fifth slot NaN; the scratch poisoned with NaN first."""
    from graphcache.model.lora_kernels import LoraWorkspace, lora_plan, lora_shrink_expand

    k, rank = 1300, 16  # not a multiple of the K blocks; 2 K splits up to 256 tokens
    y, x, a, b, index = _stacked_case(
        t, k, pieces, 5, rank, (16, 8, 4, 12, 16), device="cuda", dtype=torch.bfloat16,
        seed=t + len(pieces), mix=list(range(slots_used)),
    )  # fmt: skip
    ws = LoraWorkspace(t, 5, rank * len(pieces), x.device)
    ws.shrunk.fill_(float("nan"))
    got = y.clone()
    lora_shrink_expand(got, x, a, b, index, ws)
    want = _per_slot_reference(y, x, a, b, index)
    torch.cuda.synchronize()
    _assert_close(got, want, y, index, f"T {t}, pieces {pieces}, {slots_used} slots")
    if t <= 1000:
        lora_plan(index, 5, ws)
        assert not _plan_problems(index.cpu(), ws, 5)


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 16, 512])
@pytest.mark.parametrize("proj", ["qkv", "o", "gate_up", "down"])
def test_the_8b_shapes_on_cuda(t, proj):
    """The Llama-3-8B projections at rank 16, four slots, base tokens among them."""
    from graphcache.model.lora_kernels import lora_shrink_expand

    k, pieces = {
        "qkv": (4096, (4096, 1024, 1024)),
        "o": (4096, (4096,)),
        "gate_up": (4096, (14336, 14336)),
        "down": (14336, (4096,)),
    }[proj]
    y, x, a, b, index = _stacked_case(
        t,
        k,
        pieces,
        5,
        16,
        (16, 16, 8, 16, 16),
        device="cuda",
        dtype=torch.bfloat16,
        seed=t,
        mix=[0, 1, 2, 3],
    )
    got = y.clone()
    lora_shrink_expand(got, x, a, b, index)
    want = _per_slot_reference(y, x, a, b, index)
    torch.cuda.synchronize()
    _assert_close(got, want, y, index, f"{proj} T {t}")


@pytest.mark.cuda
def test_one_graph_serves_two_adapter_mixes():
    from graphcache.model.lora_kernels import LoraWorkspace, lora_shrink_expand

    t, k, n, s, r = 64, 256, 384, 3, 16
    y0, x, a, b, _ = _case(t, k, n, s, r, device="cuda", dtype=torch.bfloat16, used=[0, 1, 2])
    index = torch.full((t,), -1, dtype=torch.int64, device="cuda")  # the graph's input
    ws = LoraWorkspace(t, s, r, x.device)
    y = y0.clone()
    lora_shrink_expand(y, x, a, b, index, ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_shrink_expand(y, x, a, b, index, ws)
    g = torch.Generator().manual_seed(5)
    for mix in ([-1, 0, 1], [2, -1, 2, 0]):
        picks = torch.tensor(mix)[torch.randint(0, len(mix), (t,), generator=g)]
        index.copy_(picks)
        y.copy_(y0)
        graph.replay()
        eager = y0.clone()
        lora_shrink_expand(eager, x, a, b, index, ws)
        torch.cuda.synchronize()
        assert torch.equal(y, eager), mix


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 16, 300])
@pytest.mark.parametrize("second", ["add_to", "residual", "delta"])
def test_layers_fork_the_shrink_beside_the_base_gemm_in_a_graph(t, second):
    """Two stacks as a model chains them (the second's x is the first's output), the first planning for
    both, each shrink launched before a base GEMM: captured (shrinks on the side stream up to
    FORK_SHRINK_MAX_TOKENS, in order on one stream for t = 300), the graph replays
    two mixes like eager (everything on one stream; within 1e-2: cuBLAS may pick another algorithm on the
    capture stream, the LoRA kernels alone replay bit for bit above), and both equal the torch reference.
    The second stack adds its delta into y after the GEMM (qkv_proj), or beside the GEMM into a residual
    (o_proj, down_proj) or a zeroed delta buffer (gate_up_proj), each then summed with y."""
    from graphcache.model.lora_layers import LoraIndex, LoraStack

    k, n, slots, rank = 256, 256, 4, 16
    index = LoraIndex(torch.full((t,), -1, dtype=torch.int64, device="cuda"))
    index.use_kernels = True
    stacks = [
        LoraStack(index, slots=slots, rank=rank, in_features=k, out_slices=slices, dtype=torch.bfloat16,
                  device=torch.device("cuda"))
        for slices in ([(0, 128), (128, 64), (192, 64)], [(0, n)])
    ]  # fmt: skip
    index.planner = stacks[0]
    g = torch.Generator().manual_seed(t)
    for st in stacks:
        st.a.copy_(torch.randn(st.a.shape, generator=g) / k**0.5)
        st.b.copy_(torch.randn(st.b.shape, generator=g) / rank**0.5)
    w = [(torch.randn(n, k, generator=g) / k**0.5).to("cuda", torch.bfloat16) for _ in stacks]
    x = torch.randn(t, k, generator=g).to("cuda", torch.bfloat16)
    residual = torch.randn(t, n, generator=g).to("cuda", torch.bfloat16)

    def forward() -> torch.Tensor:
        h = x
        for i, (st, weight) in enumerate(zip(stacks, w, strict=True)):
            if i == 0 or second == "add_to":
                lora = st.shrink_(h)
                out = h @ weight.t()  # the base GEMM
                if lora is not None:
                    lora.add_to(out)
                h = out
                continue
            target = residual.clone() if second == "residual" else torch.full_like(residual, float("nan"))
            joined = st.add_beside_(h, target, zero_first=second == "delta")
            out = h @ weight.t()
            if joined is not None:
                joined.join()
            h = out + target - (residual if second == "residual" else 0)
        return h

    def reference() -> torch.Tensor:
        h = x.float()
        for st, weight in zip(stacks, w, strict=True):
            out = h @ weight.float().t()
            lora_add_reference(out, h, st.a.float(), st.b.float(), index.tokens)
            h = out.bfloat16().float()
        return h

    index.active = True
    forward()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = forward()
    for mix in ([-1, 0, 1], [3, -1, 2, 0, 1]):
        picks = torch.tensor(mix)[torch.randint(0, len(mix), (t,), generator=g)]
        index.tokens.copy_(picks)
        graph.replay()
        eager = forward()
        want = reference()
        torch.cuda.synchronize()
        assert torch.isfinite(static_out).all(), mix
        scale = eager.float().abs().max().item()
        assert (static_out.float() - eager.float()).abs().max().item() <= 1e-2 * scale, mix
        err = (static_out.float() - want).abs().max().item()
        assert err <= 0.03 * want.abs().max().item(), (mix, err)


def test_add_beside_adds_the_delta_into_its_target_on_the_cpu():
    """The CPU path of add_beside_ (the torch reference, nothing to join): target += delta, or target = delta
    with zero_first (a poisoned buffer, as the model's gate_up delta is allocated uninitialized)."""
    from graphcache.model.lora_layers import LoraIndex, LoraStack

    t, k, n, slots, rank = 5, 24, 16, 2, 4
    index = LoraIndex(torch.tensor([0, -1, 1, 1, -1]))
    stack = LoraStack(index, slots=slots, rank=rank, in_features=k, out_slices=[(0, n)], dtype=torch.float32,
                      device=torch.device("cpu"))  # fmt: skip
    g = torch.Generator().manual_seed(7)
    stack.a.copy_(torch.randn(stack.a.shape, generator=g))
    stack.b.copy_(torch.randn(stack.b.shape, generator=g))
    x, residual = torch.randn(t, k, generator=g), torch.randn(t, n, generator=g)
    delta = torch.zeros(t, n)
    lora_add_reference(delta, x, stack.a, stack.b, index.tokens)
    assert delta[0].abs().sum() > 0 and delta[1].abs().sum() == 0

    target = residual.clone()
    assert stack.add_beside_(x, target) is None  # inactive: nothing added
    assert torch.equal(target, residual)
    index.active = True
    assert stack.add_beside_(x, target) is None
    torch.testing.assert_close(target, residual + delta)
    poisoned = torch.full((t, n), float("nan"))
    assert stack.add_beside_(x, poisoned, zero_first=True) is None
    torch.testing.assert_close(poisoned, delta)
    assert not stack.forks(x)  # no kernels, no capture
