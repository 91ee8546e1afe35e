"""Unified paged attention (model/unified_attention.py) against an independent torch reference.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before the first kernel
call). The reference here is written in this file on purpose (not the module's own): plain masked
softmax attention over a context gathered with Python loops over the block tables.

Every case poisons what the kernel must not read: `out` (including padded rows past the real tokens,
which must stay NaN), cache slots past each request's length, spare blocks, and table entries past
each context (they point at a NaN block); q rows of padding are NaN too. A stray read shows as NaN.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from graphcache.model.unified_attention import (  # noqa: E402
    UnifiedConfig,
    choose_config,
    reference_unified_attention,
    unified_attention,
)

if INTERPRET:
    # Triton 3.6's interpreter converts (1,)-shaped scalars with int(ndarray), which numpy >= 2.4 refuses
    # (triton-lang/triton#9171); test-only shim with the upstream fix (see test_decode_attention.py).
    import triton.runtime.interpreter as _interp

    if hasattr(_interp, "_patch_lang_tensor") and not getattr(_interp, "_graphcache_index_shim", False):
        _orig_patch = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor
        _interp._graphcache_index_shim = True

DEVICE = "cpu" if INTERPRET else "cuda"
NAN = float("nan")


def _case(
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    reqs,
    *,
    dtype=torch.float32,
    pad_tokens=3,
    spare_blocks=2,
    seed=0,
    device=DEVICE,
):
    """reqs: [(query_len, seq_len)] (decode row: (1, L); chunk over a prefix: (n, L > n)).
    Returns (q [T + pad, H, D], k_cache, v_cache, query_start_loc [R + 1] int32, seq_lens [R] int64,
    block_tables [R, B] int64)."""
    gen = torch.Generator().manual_seed(seed)
    per_req = [-(-length // block_size) for _, length in reqs]
    width = max(per_req) + 2  # table entries past every context
    num_blocks = sum(per_req) + spare_blocks + 1
    ids = torch.randperm(num_blocks, generator=gen)  # shuffled, non-contiguous block ids
    poison = int(ids[-1])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    for spare in ids[sum(per_req) :].tolist():  # blocks no context references
        k_cache[spare] = NAN
        v_cache[spare] = NAN
    tables = torch.full((len(reqs), width), poison, dtype=torch.int64)
    nxt = 0
    for r, ((_, length), nb) in enumerate(zip(reqs, per_req, strict=True)):
        tables[r, :nb] = ids[nxt : nxt + nb]
        nxt += nb
        if length % block_size:  # slots past the length in the last block
            k_cache[int(ids[nxt - 1]), length % block_size :] = NAN
            v_cache[int(ids[nxt - 1]), length % block_size :] = NAN
    starts = [0]
    for n, _ in reqs:
        starts.append(starts[-1] + n)
    q = torch.randn((starts[-1] + pad_tokens, num_heads, head_dim), generator=gen)
    q[starts[-1] :] = NAN  # padded rows: never read
    to = dict(device=device)
    return (
        q.to(dtype=dtype, **to),
        k_cache.to(dtype=dtype, **to),
        v_cache.to(dtype=dtype, **to),
        torch.tensor(starts, dtype=torch.int32, **to),
        torch.tensor([s for _, s in reqs], **to),
        tables.to(**to),
    )


def _reference(q, k_cache, v_cache, starts, seq_lens, tables, scale):
    """fp64 masked attention over a context gathered position by position (independent of the module)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    starts, lens, tables = starts.tolist(), seq_lens.tolist(), tables.tolist()
    outs = []
    for r, length in enumerate(lens):
        s, e = starts[r], starts[r + 1]
        slots = [(tables[r][p // block_size], p % block_size) for p in range(length)]
        k = torch.stack([k_cache[b, o] for b, o in slots]).double()  # [L, K, D]
        v = torch.stack([v_cache[b, o] for b, o in slots]).double()
        for t in range(s, e):
            pos = length - (e - s) + (t - s)  # causal, bottom-right
            heads = []
            for h in range(q.shape[1]):
                w = (k[: pos + 1, h // group] @ q[t, h].double() * scale).softmax(0)  # [pos + 1]
                heads.append(w @ v[: pos + 1, h // group])
            outs.append(torch.stack(heads))
    return torch.stack(outs)  # [T, H, D]


def _run(q, k_cache, v_cache, starts, seq_lens, tables, scale, config=None, max_query_len=None):
    out = torch.full_like(q, NAN)
    unified_attention(
        q,
        k_cache,
        v_cache,
        out,
        starts,
        seq_lens,
        tables,
        scale,
        num_reqs=len(seq_lens),
        config=config,
        max_query_len=max_query_len,
    )
    return out


MIXES = {
    "decodes": [(1, 1), (1, 17), (1, 40), (1, 16)],
    "chunks": [(9, 9), (20, 20)],
    "decode+chunks": [(1, 33), (1, 5), (7, 7), (13, 13)],
    "prefix_chunks": [(5, 37), (1, 20), (11, 16), (3, 50)],
}


@pytest.mark.parametrize("mix", MIXES, ids=list(MIXES))
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 64), (7, 1, 128)], ids=lambda h: "H{}K{}D{}".format(*h))
def test_matches_reference_fp32(heads, block_size, mix):
    reqs = MIXES[mix]
    q, k_cache, v_cache, starts, seq_lens, tables = _case(
        *heads, block_size, reqs, seed=block_size + len(mix)
    )
    scale = heads[2] ** -0.5
    max_q = max(n for n, _ in reqs)
    # a small M and N so several query tiles and K/V tiles are exercised at these tiny sizes
    config = UnifiedConfig(block_m=max(16, 1 << (heads[0] // heads[1] - 1).bit_length()) * 2, block_n=16)
    out = _run(q, k_cache, v_cache, starts, seq_lens, tables, scale, config=config, max_query_len=max_q)
    real = int(starts[-1])
    ref = _reference(q, k_cache, v_cache, starts, seq_lens, tables, scale)
    assert torch.isfinite(ref).all()
    assert not out[:real].isnan().any()
    assert out[real:].isnan().all()  # padded rows untouched
    torch.testing.assert_close(out[:real].double(), ref, rtol=1e-4, atol=1e-5)


def test_default_config_and_module_reference():
    """choose_config's tiles (M 64, N 64) on a mix with a tile spanning blocks of 16; the module's own
    reference agrees with this file's."""
    reqs = [(1, 70), (1, 3), (30, 100), (1, 64)]
    q, k_cache, v_cache, starts, seq_lens, tables = _case(8, 2, 64, 16, reqs, seed=11)
    out = _run(q, k_cache, v_cache, starts, seq_lens, tables, 0.125, max_query_len=30)
    ref = _reference(q, k_cache, v_cache, starts, seq_lens, tables, 0.125)
    real = int(starts[-1])
    torch.testing.assert_close(out[:real].double(), ref, rtol=1e-4, atol=1e-5)
    mod = reference_unified_attention(q, k_cache, v_cache, starts, seq_lens, tables, 0.125, len(reqs))
    torch.testing.assert_close(mod.double(), ref, rtol=1e-4, atol=1e-5)
    assert out[real:].isnan().all()


def test_reading_past_the_context_would_show():
    """Control for the poisoning: one more position per request reaches a NaN slot or block."""
    reqs = [(1, 5), (4, 16), (2, 40)]
    q, k_cache, v_cache, starts, seq_lens, tables = _case(4, 2, 16, 16, reqs, seed=3)
    longer = seq_lens + 1
    ref = reference_unified_attention(q, k_cache, v_cache, starts, longer, tables, 0.25, len(reqs))
    assert ref.isnan().any(dim=2).any(dim=1).all()  # every request's last row hits the poison


def test_fp16():
    reqs = [(1, 50), (6, 40), (1, 129)]
    q, k_cache, v_cache, starts, seq_lens, tables = _case(6, 2, 32, 16, reqs, dtype=torch.float16, seed=5)
    out = _run(q, k_cache, v_cache, starts, seq_lens, tables, 32**-0.5, max_query_len=6)
    ref = _reference(q, k_cache, v_cache, starts, seq_lens, tables, 32**-0.5)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out[: int(starts[-1])].double(), ref, rtol=2e-2, atol=2e-3)


def test_bad_block_m_raises():
    q, k_cache, v_cache, starts, seq_lens, tables = _case(8, 1, 16, 16, [(1, 4)], seed=6)
    with pytest.raises(ValueError, match="block_m"):
        _run(q, k_cache, v_cache, starts, seq_lens, tables, 0.25, config=UnifiedConfig(block_m=24))


def test_choose_config():
    assert choose_config(7, 64, 1).block_m == 16
    assert choose_config(7, 64, 192).block_m == 64
    assert choose_config(32, 128, 1).block_m == 32
    assert choose_config(4, 256, 100).block_n == 32
    # An FP8 cache: 128-token K/V tiles up to head_dim 128 (half the bytes a token), in decode and chunked steps.
    assert (
        choose_config(4, 128, 1, kv_bytes=1).block_n == choose_config(4, 128, 192, kv_bytes=1).block_n == 128
    )
    assert choose_config(4, 128, 192).block_n == 64 and choose_config(4, 256, 100, kv_bytes=1).block_n == 32


# ---------------------------------------------------------------------------------------------- GPU

SHAPES = {"qwen": (14, 2, 64), "llama8b": (32, 8, 128)}


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("mix", ["decodes", "mixed", "prefix"])
def test_cuda_bf16(shape, block_size, mix):
    """bf16 at the real head shapes; tolerance: relative Frobenius error < 1e-2 (bf16 operands, fp32
    accumulation), every real row finite, padded rows untouched."""
    gen = torch.Generator().manual_seed(block_size)
    decodes = [(1, int(n)) for n in torch.randint(1, 513, (48,), generator=gen)]
    reqs = {
        "decodes": decodes,
        "mixed": decodes + [(192, 192), (37, 37)],
        "prefix": decodes[:16] + [(192, 512), (100, 300)],
    }[mix]
    q, k_cache, v_cache, starts, seq_lens, tables = _case(
        *SHAPES[shape], block_size, reqs, dtype=torch.bfloat16, seed=7
    )
    max_q = max(n for n, _ in reqs)
    out = _run(q, k_cache, v_cache, starts, seq_lens, tables, SHAPES[shape][2] ** -0.5, max_query_len=max_q)
    real = int(starts[-1])
    ref = reference_unified_attention(
        q.double(),
        k_cache.double(),
        v_cache.double(),
        starts,
        seq_lens,
        tables,
        SHAPES[shape][2] ** -0.5,
        len(reqs),
    ).double()
    assert not out[:real].isnan().any()
    assert out[real:].isnan().all()
    assert _rel_err(out[:real], ref) < 1e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_with_new_metadata():
    """Captured once with fixed T, R and config; replayed with new starts, lengths and tables."""
    heads, block_size, scale = SHAPES["qwen"], 16, 0.125
    cases = [
        _case(*heads, block_size, reqs, dtype=torch.bfloat16, pad_tokens=0, spare_blocks=0, seed=s)
        for s, reqs in (
            (1, [(1, 300)] * 8 + [(56, 100)]),
            (2, [(1, 17)] * 4 + [(30, 30), (27, 400)] + [(1, 5)] * 3),
        )
    ]
    width = max(c[5].shape[1] for c in cases)
    num_blocks = max(c[1].shape[0] for c in cases)
    q_s = torch.empty_like(cases[0][0])
    assert q_s.shape == cases[1][0].shape  # both 64 tokens
    k_s = torch.zeros((num_blocks, block_size, heads[1], heads[2]), dtype=torch.bfloat16, device="cuda")
    v_s, out_s = torch.zeros_like(k_s), torch.empty_like(q_s)
    starts_s = torch.zeros(10, dtype=torch.int32, device="cuda")
    lens_s = torch.zeros(9, dtype=torch.int64, device="cuda")
    tables_s = torch.zeros((9, width), dtype=torch.int64, device="cuda")
    config = UnifiedConfig()

    def load(c):
        q, k, v, st, n, t = c
        q_s.copy_(q)
        k_s[: k.shape[0]].copy_(k)
        v_s[: v.shape[0]].copy_(v)
        starts_s.copy_(st)
        lens_s.copy_(n)
        tables_s.zero_()
        tables_s[:, : t.shape[1]].copy_(t)

    def call():
        unified_attention(q_s, k_s, v_s, out_s, starts_s, lens_s, tables_s, scale, num_reqs=9, config=config)

    load(cases[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for c in (cases[1], cases[0], cases[1]):
        load(c)
        out_s.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_unified_attention(
            q_s.double(), k_s.double(), v_s.double(), starts_s, lens_s, tables_s, scale, 9
        )
        assert not out_s.isnan().any()
        assert _rel_err(out_s, ref) < 1e-2


# ---------------------------------------------------------------------------------- runner / engine


def _mixed_steps(runner):
    """Three steps through a runner: two fresh chunks; a decode + a chunk over a cached prefix + a
    fresh chunk (one mixed launch); two decodes. Returns the logits of every step ([rows, V] each)."""
    from graphcache.engine.plan import StepPlan, StepSeq
    from helpers_model import Blocks, prompt_ids

    a, b, c = prompt_ids(12, seed=1), prompt_ids(14, seed=2), prompt_ids(6, seed=3)
    blocks = Blocks(runner.block_size)
    ta, tb, tc = blocks.table(12), blocks.table(14), blocks.table(6)
    steps = [
        [StepSeq(a[:7], 0, ta, True), StepSeq(b[:5], 0, tb, False)],
        [StepSeq([a[7]], 7, ta, True), StepSeq(b[5:12], 5, tb, True), StepSeq(c[:5], 0, tc, True)],
        [StepSeq([a[8]], 8, ta, True), StepSeq([b[12]], 12, tb, True), StepSeq([c[5]], 5, tc, True)],
    ]
    return [runner.execute(StepPlan.standalone(s)).logits[: len(s)].clone() for s in steps]


def test_runner_mixed_steps_match_sdpa(monkeypatch):
    """The runner with attention kernel "triton" (interpreted on the CPU) gives the SDPA path's logits
    on mixed steps, GQA 4 (Qwen flavour); decode steps also go through it (decode backend varlen)."""
    import graphcache.engine.worker.runner as runner_mod
    from graphcache.engine.worker.runner import ModelRunner
    from helpers_model import cpu_settings, tiny_checkpoint

    path = tiny_checkpoint("qwen2", hidden=64, layers=2, heads=8, kv_heads=2)
    settings = cpu_settings(path, decode_attention_backend="varlen", enforce_eager=True)
    sdpa = ModelRunner(settings)
    assert sdpa.attention_kernel == "sdpa"
    expected = _mixed_steps(sdpa)
    with monkeypatch.context() as m:
        m.setattr(runner_mod, "select_attention_kernel", lambda *args: "triton")
        unified = ModelRunner(settings)
    assert unified.attention_kernel == "triton"
    for got, ref in zip(_mixed_steps(unified), expected, strict=True):
        assert torch.isfinite(got).all()
        assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_runner_mixed_steps_match_flash():
    """bf16 runners with graphs on: logits of the triton kernel within 3% of max |logit| of the gather +
    FlashAttention path's on the same mixed steps (bf16 rounding differs between the kernels)."""
    from graphcache.engine.worker.runner import ModelRunner
    from helpers_model import cpu_settings, gqa_checkpoint

    path = gqa_checkpoint()
    got = {}
    for backend in ("flash", "triton"):
        runner = ModelRunner(
            cpu_settings(
                path,
                device="cuda",
                dtype="bfloat16",
                block_size=16,
                attention_backend=backend,
                decode_attention_backend="varlen",
            )
        )
        assert runner.attention_kernel == backend
        got[backend] = _mixed_steps(runner)
    for unified, flash in zip(got["triton"], got["flash"], strict=True):
        unified, flash = unified.float(), flash.float()
        assert torch.isfinite(unified).all()
        assert (unified - flash).abs().max().item() <= 0.03 * flash.abs().max().item()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_greedy_matches_flash(tmp_path):
    """Engine level, bf16, graphs on: greedy tokens with attention_backend=triton equal those of the
    gather + FlashAttention path ("flash") on requests whose prefills chunk alongside decodes, up to
    bf16 near-ties: the two kernels round differently, so a request may part ways only where the flash
    run's top two tokens were within NEAR_TIE of each other (its logprobs say), and most requests agree
    on every token."""
    import asyncio

    from graphcache.config import Settings
    from graphcache.engine.loop.engine import Engine, SamplingParams
    from graphcache.metrics import Metrics
    from helpers_model import gqa_checkpoint, prompt_ids

    path = gqa_checkpoint()
    prompts = [prompt_ids(20 + 37 * i % 150, seed=i) for i in range(12)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)

    async def generate(backend):
        settings = Settings(
            model=path,
            cache_dir=tmp_path / backend,
            device="cuda",
            dtype="bfloat16",
            attention_backend=backend,
            max_num_seqs=16,
            max_num_batched_tokens=64,
            max_model_len=512,
            admission="always",
            capture_time_share=1.0,
        )
        engine = Engine(settings, Metrics())
        engine.start()
        assert engine.wait_ready(600), engine.error
        try:
            assert engine.runner.attention_kernel == backend

            async def one(i):
                ids, logprobs = [], []
                async for out in engine.generate(f"{backend}-{i}", prompts[i], params):
                    ids += out.token_ids
                    logprobs += out.logprobs or []
                return ids, logprobs

            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
        finally:
            engine.shutdown()

    near_tie = 0.05  # logprob gap: a few bf16 ulps of logits of this size
    flash = asyncio.run(generate("flash"))
    unified = asyncio.run(generate("triton"))
    identical = 0
    for (got, _), (want, want_logprobs) in zip(unified, flash, strict=True):
        assert len(got) == len(want) == params.max_tokens
        split = next((j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if split is None:
            identical += 1
            continue
        top = want_logprobs[split].top
        assert top[0][1] - top[1][1] < near_tie, (
            f"token {split} differs ({got[split]} vs {want[split]}) where flash's top two were "
            f"{top[0][1] - top[1][1]:.3f} apart, not a near-tie"
        )
    assert identical >= len(prompts) * 2 // 3, (
        f"only {identical}/{len(prompts)} requests agree on every token"
    )
