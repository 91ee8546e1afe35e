"""Paged decode attention (model/decode_attention.py) against its torch reference.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before the first
kernel call; the module jits its kernels on first use, so import order does not matter). Sizes are
tiny: the interpreter runs every program in Python. The `cuda` tests (bf16 accuracy at the Qwen
shape, CUDA graph capture and replay with new lengths/tables) run on the GPU box: pytest -m cuda.

Every case poisons what the kernel must not read with NaN: `out` before the call, the cache slots
past each request's length in its last block, whole spare blocks, and the table entries past a
context (and a padded row's whole table row) point at a NaN block. A stray read shows up as NaN.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from graphcache.model.decode_attention import (  # noqa: E402
    BLOCK_N,
    HAVE_TRITON,
    MAX_SPLITS,
    choose_num_splits,
    decode_workspace,
    paged_decode_attention,
    reference_decode_attention,
)

if INTERPRET:
    # Triton 3.6's interpreter converts its (1,)-shaped scalars with int(ndarray), which numpy >= 2.4
    # refuses (triton-lang/triton#9171): a loop with device-computed bounds then fails to interpret.
    # Test-only shim with the upstream fix; compiled kernels on the GPU never go through it.
    import triton.runtime.interpreter as _interp

    if hasattr(_interp, "_patch_lang_tensor"):
        _orig_patch = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor

DEVICE = "cpu" if INTERPRET else "cuda"
NAN = float("nan")


def _case(
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    lens,
    *,
    dtype=torch.float32,
    extra_rows=2,
    spare_blocks=3,
    seed=0,
    device=DEVICE,
    table_dtype=torch.int32,
    len_dtype=torch.int32,
):
    """Random q / paged cache / shuffled block tables for requests of the given lengths (0 = padded row).
    Block tables and seq_lens get `extra_rows` extra rows (R_max > R) the kernel must ignore.
    Returns (q, k_cache, v_cache, block_tables, seq_lens)."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(lens)
    per_req = [-(-n // block_size) for n in lens]
    width = max(per_req) + 2  # table entries past every context
    num_blocks = sum(per_req) + spare_blocks + 1
    ids = torch.randperm(num_blocks, generator=gen)  # non-contiguous, shuffled block ids
    poison = int(ids[-1])  # NaN block: unused table entries point here
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    for spare in ids[sum(per_req) :].tolist():  # spare blocks: referenced by no context
        k_cache[spare] = NAN
        v_cache[spare] = NAN
    tables = torch.full((num_reqs + extra_rows, width), poison, dtype=torch.int64)
    nxt = 0
    for r, (n, nb) in enumerate(zip(lens, per_req, strict=True)):
        tables[r, :nb] = ids[nxt : nxt + nb]
        nxt += nb
        if n % block_size:  # slots past the length in the last block
            last = int(ids[nxt - 1])
            k_cache[last, n % block_size :] = NAN
            v_cache[last, n % block_size :] = NAN
    seq_lens = torch.tensor(list(lens) + [10**6] * extra_rows, dtype=len_dtype)  # ignored rows: absurd
    q = torch.randn((num_reqs, num_heads, head_dim), generator=gen)
    to = dict(device=device)
    return (
        q.to(dtype=dtype, **to),
        k_cache.to(dtype=dtype, **to),
        v_cache.to(dtype=dtype, **to),
        tables.to(dtype=table_dtype, **to),
        seq_lens.to(**to),
    )


def _run(q, k_cache, v_cache, tables, seq_lens, num_splits, scale):
    out = torch.full_like(q, NAN)  # every element must be written
    ws = decode_workspace(q.shape[0] + 1, q.shape[1], q.shape[2], num_splits, q.device)
    ws.fill_(NAN)
    paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, out, scale, ws, num_splits)
    return out


def test_have_triton():
    assert HAVE_TRITON


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("heads", [(14, 2, 64), (4, 4, 32), (8, 2, 16)], ids=lambda h: "H{}K{}D{}".format(*h))
def test_matches_reference_fp32(heads, block_size, num_splits):
    num_heads, num_kv_heads, head_dim = heads
    # 1 token; exactly one block; 0 = padded row; many blocks and > one split's chunk (with 3 splits:
    # chunk 128, the third split is empty); a tile ending mid-block
    lens = [1, block_size, 0, 3 * BLOCK_N + 7, 77]
    q, k_cache, v_cache, tables, seq_lens = _case(
        num_heads, num_kv_heads, head_dim, block_size, lens, seed=block_size + num_splits
    )
    scale = head_dim**-0.5
    out = _run(q, k_cache, v_cache, tables, seq_lens, num_splits, scale)
    ref = reference_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
    assert not out.isnan().any()
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # padded row: zeros
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block_size", [32, 256])
def test_tile_spans_blocks_or_sits_inside_one(block_size):
    """block 32: a 64-token tile spans two blocks; block 256: several tiles per block. int64 tables and
    lengths; 4 splits over a 2-tile context (two empty splits)."""
    lens = [2 * BLOCK_N - 5, 1, block_size + 1]
    q, k_cache, v_cache, tables, seq_lens = _case(
        8, 2, 32, block_size, lens, seed=7, table_dtype=torch.int64, len_dtype=torch.int64
    )
    for num_splits in (1, 4):
        out = _run(q, k_cache, v_cache, tables, seq_lens, num_splits, 0.3)
        ref = reference_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_unreferenced_nan_does_not_leak():
    """NaN everywhere no request reads: spare blocks, tails of last blocks, the table padding's target
    block; a real context that reaches into one of them would make the reference NaN too."""
    lens = [5, 16, 40]
    q, k_cache, v_cache, tables, seq_lens = _case(4, 2, 16, 16, lens, spare_blocks=4, seed=3)
    assert k_cache.isnan().any() and v_cache.isnan().any()
    out = _run(q, k_cache, v_cache, tables, seq_lens, 2, 0.25)
    ref = reference_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    # control: one more token per request reads a poisoned slot (a tail slot or the NaN block)
    longer = seq_lens.clone()
    longer[:3] += 1
    assert reference_decode_attention(q, k_cache, v_cache, tables, longer, 0.25).isnan().any()


def test_all_rows_padded():
    q, k_cache, v_cache, tables, seq_lens = _case(4, 2, 16, 16, [0, 0], seed=4)
    for num_splits in (1, 2):
        out = _run(q, k_cache, v_cache, tables, seq_lens, num_splits, 0.25)
        assert torch.equal(out, torch.zeros_like(out))


def test_fp16():
    q, k_cache, v_cache, tables, seq_lens = _case(6, 2, 32, 16, [1, 50, 129], dtype=torch.float16, seed=5)
    out = _run(q, k_cache, v_cache, tables, seq_lens, 2, 32**-0.5)
    ref = reference_decode_attention(q, k_cache, v_cache, tables, seq_lens, 32**-0.5)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-3)


def test_workspace_too_small_raises():
    q, k_cache, v_cache, tables, seq_lens = _case(4, 2, 16, 16, [3, 4], seed=6)
    ws = decode_workspace(1, 4, 16, 2, q.device)
    with pytest.raises(ValueError, match="workspace"):
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, torch.empty_like(q), 0.25, ws, 2)


def test_choose_num_splits():
    assert choose_num_splits(256, 2, 4096) == 1  # 512 programs: > 2 waves already
    assert choose_num_splits(64, 2, 4096) == 3  # ceil(264 / 128)
    assert choose_num_splits(1, 2, 32768) == MAX_SPLITS  # capped
    assert choose_num_splits(1, 2, 512) == 512 // BLOCK_N  # never more splits than tiles
    assert choose_num_splits(1, 8, 16) == 1
    assert choose_num_splits(0, 8, 4096) >= 1
    assert choose_num_splits(4, 8, 4096, num_sms=16) == 1


# ---------------------------------------------------------------------------------------------- GPU

QWEN = (14, 2, 64)  # Qwen2.5-0.5B: H, K, D


def _rel_err(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_reqs", [1, 64, 256])
def test_cuda_bf16_qwen(num_reqs):
    gen = torch.Generator().manual_seed(num_reqs)
    lens = [512] + torch.randint(1, 513, (num_reqs - 1,), generator=gen).tolist()
    if num_reqs > 1:
        lens[-1] = 0
    q, k_cache, v_cache, tables, seq_lens = _case(*QWEN, 16, lens, dtype=torch.bfloat16, seed=num_reqs)
    num_splits = choose_num_splits(num_reqs, QWEN[1], 512)
    out = _run(q, k_cache, v_cache, tables, seq_lens, num_splits, QWEN[2] ** -0.5)
    ref = reference_decode_attention(q, k_cache, v_cache, tables, seq_lens, QWEN[2] ** -0.5)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < 2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_with_new_lengths_and_tables():
    num_heads, num_kv_heads, head_dim = QWEN
    num_reqs, block_size, scale = 64, 16, QWEN[2] ** -0.5
    num_splits = choose_num_splits(num_reqs, num_kv_heads, 512)
    inputs = []
    for seed in (1, 2):  # same shapes, different lengths / block ids / q
        gen = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, 513, (num_reqs,), generator=gen).tolist()
        lens[seed] = 0
        inputs.append(
            _case(
                num_heads,
                num_kv_heads,
                head_dim,
                block_size,
                lens,
                dtype=torch.bfloat16,
                extra_rows=0,
                spare_blocks=0,
                seed=seed,
            )
        )
    # static buffers big enough for either input (same table width / block count by padding)
    width = max(t.shape[1] for _, _, _, t, _ in inputs)
    num_blocks = max(k.shape[0] for _, k, _, _, _ in inputs)
    q_s = torch.empty_like(inputs[0][0])
    k_s = torch.zeros((num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.bfloat16, device="cuda")
    v_s = torch.zeros_like(k_s)
    tables_s = torch.zeros((num_reqs, width), dtype=torch.int32, device="cuda")
    lens_s = torch.zeros(num_reqs, dtype=torch.int32, device="cuda")
    out_s = torch.empty_like(q_s)
    ws = decode_workspace(num_reqs, num_heads, head_dim, num_splits, "cuda")

    def load(i):
        q, k, v, t, n = inputs[i]
        q_s.copy_(q)
        k_s[: k.shape[0]].copy_(k)
        v_s[: v.shape[0]].copy_(v)
        tables_s.zero_()
        tables_s[:, : t.shape[1]].copy_(t)
        lens_s.copy_(n)

    def call():
        paged_decode_attention(q_s, k_s, v_s, tables_s, lens_s, out_s, scale, ws, num_splits)

    load(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for i in (1, 0, 1):
        load(i)
        out_s.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_decode_attention(q_s, k_s, v_s, tables_s, lens_s, scale)
        assert not out_s.isnan().any()
        assert _rel_err(out_s, ref) < 2e-2
