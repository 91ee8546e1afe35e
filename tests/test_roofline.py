"""benchmarks/roofline.py's bounds on hand-computed cases, and step_trace's tables of steps against them on a
synthetic trace (issue 41: each run and each step kind / decode row bucket set against its own bound)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import roofline, step_trace  # noqa: E402

# hidden 4, 2 layers, 2 heads / 1 KV head of 2, MLP 8, vocab 10, untied. Per layer: q and o 4x4 each, k and v
# 4x2 each (48), the MLP 3 x 4 x 8 (96): 288 linear parameters; the LM head 40, and the embedding 40 more.
TINY = {
    "hidden_size": 4,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 2,
    "intermediate_size": 8,
    "vocab_size": 10,
    "tie_word_embeddings": False,
}
# Round ceilings: 1,000 bytes/s, 1,000 bf16 FLOP/s, 2,000 FP8 FLOP/s.
SLOW = roofline.Device(hbm_bytes_per_s=1000.0, bf16_flops=1000.0, fp8_flops=2000.0)


def tiny(fp8: bool = False) -> roofline.Roofline:
    return roofline.Roofline(roofline.ModelShape.from_config(TINY), fp8=fp8, device=SLOW)


def test_run_bound_of_a_hand_computed_case():
    roof = tiny()
    assert roof.shape.active_linear_params == roof.shape.linear_params == 288
    assert roof.weight_bytes == (288 + 2 * 40) * 2  # bf16: linear layers, embedding and LM head
    assert roof.kv_bytes_per_token == 2 * 2 * 1 * 2 * 2  # K and V x layers x kv heads x head dim x 2 bytes
    # (prompt 3, 2 outputs): feeds 4 tokens, samples 2, reads 3 (prefill) + 4 (its one fed output) KV tokens;
    # (prompt 1, 4 outputs): feeds 4, samples 4, reads 1 + 2 + 3 + 4.
    b = roof.run_bound([(3, 2), (1, 4)])
    assert (b.fed_tokens, b.output_tokens, b.max_steps) == (8, 6, 4)
    assert b.gemm_flops == 2 * 288 * 8 + 2 * 40 * 6 == 5088
    assert b.kv_bytes == 17 * 16
    assert b.gemm_s == pytest.approx(5.088) and b.kv_s == pytest.approx(0.272)
    assert b.weight_floor_s == pytest.approx(4 * 0.736)  # 4 steps x one weight read
    assert b.seconds == pytest.approx(5.36) and b.limit == "gemm+kv"
    assert b.tokens_per_s == pytest.approx(6 / 5.36)
    assert b.achieved(10.72) == pytest.approx(0.5)
    assert b.as_dict()["bound_s"] == b.seconds


def test_weight_floor_sets_the_bound_of_one_long_request():
    fast = roofline.Device(hbm_bytes_per_s=1000.0, bf16_flops=1e6, fp8_flops=2e6)
    roof = roofline.Roofline(roofline.ModelShape.from_config(TINY), device=fast)
    b = roof.run_bound([(1, 20)])  # 20 steps x 0.736 s outweigh its GEMMs and 210 tokens' KV (3.36 s)
    assert b.kv_s == pytest.approx(3.36)
    assert b.limit == "weights" and b.seconds == pytest.approx(20 * 0.736)
    with pytest.raises(ValueError, match="at least one token"):
        tiny().run_bound([(5, 0)])


def test_fp8_halves_the_linear_weights_and_doubles_their_peak():
    roof = tiny(fp8=True)
    assert roof.weight_bytes == 288 + 2 * 40 * 2  # the embedding and LM head stay 16-bit
    b = roof.run_bound([(3, 2), (1, 4)])
    assert b.gemm_s == pytest.approx(2 * 288 * 8 / 2000 + 2 * 40 * 6 / 1000)
    assert b.seconds == pytest.approx(2.784 + 0.272)
    assert roofline.is_fp8("fp8", TINY) and not roofline.is_fp8("auto", TINY)
    assert roofline.is_fp8("auto", {**TINY, "quantization_config": {"quant_method": "fp8"}})
    assert not roofline.is_fp8("none", {**TINY, "quantization_config": {"quant_method": "fp8"}})


def test_step_bound_is_the_longer_of_weights_and_flops_plus_the_kv_read():
    roof = tiny()
    # 2 decode rows at contexts 4 and 6: FLOPs 2 x 288 x 2 + 2 x 40 x 2 = 1.312 s > the 0.736 s weight read
    assert roof.step_bound_s(2, 2, 10) == pytest.approx(1.312 + 10 * 16 / 1000)
    # one row: the weight read; no context, no KV read
    assert roof.step_bound_s(1, 1, None) == pytest.approx(0.736)


def test_moe_counts_every_expert_in_the_weights_and_the_routed_ones_in_the_flops():
    cfg = {**TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 3}
    shape = roofline.ModelShape.from_config(cfg)
    # per layer: attention 48; router 4 x 4; experts 3 x 4 x 3 = 36 each
    assert shape.linear_params == 2 * (48 + 16 + 4 * 36)
    assert shape.active_linear_params == 2 * (48 + 16 + 2 * 36)
    mixtral = roofline.ModelShape.from_config({**TINY, "num_local_experts": 8, "num_experts_per_tok": 2})
    assert mixtral.moe_intermediate == 8 and mixtral.experts == 8  # Mixtral's experts are intermediate_size


def test_the_8b_shape_reads_its_16_gb():
    roof = roofline.for_config(roofline.config_of_shape("llama8b"))
    assert roof.weight_bytes == pytest.approx(16.06e9, rel=1e-3)  # 8.03B parameters in bf16
    assert roof.weight_read_s * 1e3 == pytest.approx(3.346, abs=1e-3)
    assert roof.kv_bytes_per_token == 131072
    fp8_cache = roofline.for_config(roofline.config_of_shape("llama8b"), kv_cache_dtype="fp8")
    assert fp8_cache.kv_bytes_per_token == 65536 and fp8_cache.weight_bytes == roof.weight_bytes
    tied = roofline.ModelShape.from_config(roofline.config_of_shape("qwen05b"))
    assert tied.tied and tied.embedding_tables == 1
    with pytest.raises(SystemExit, match="no roofline for shape 'tiny'"):
        roofline.config_of_shape("tiny")


def test_an_h100_run_is_also_set_against_the_h100_roofline(monkeypatch):
    """The same 8B run needs longer on the H100 (KV and weights at 3.35 TB/s; GEMMs at about the same peak),
    and the offline bench adds that bound (own_*) on an H100, none on an H200 or an unknown GPU."""
    from benchmarks import offline_throughput, workloads

    assert roofline.device_named("NVIDIA H100 80GB HBM3") == ("H100", roofline.H100)
    assert roofline.device_named("NVIDIA H200")[1] is roofline.H200
    assert roofline.device_named("NVIDIA A100-SXM4-80GB") is None
    assert [roofline.hbm_gb_s(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "Tesla T4")] == [
        3350,
        4800,
        4800,
    ]
    h200 = roofline.for_config(roofline.config_of_shape("llama8b"))
    h100 = roofline.Roofline(h200.shape, device=roofline.H100)
    lengths = [(220, 198)] * 64
    a, b = h200.run_bound(lengths), h100.run_bound(lengths)
    assert b.kv_s == pytest.approx(a.kv_s * 4.8 / 3.35) and b.gemm_s == pytest.approx(a.gemm_s * 990 / 989)
    runs = {"realistic": [workloads.Request(prompt=[1] * p, max_tokens=n) for p, n in lengths]}
    torch = offline_throughput.torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, label in (("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", None), ("Tesla T4", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, name=name: name)
        rows = [{"workload": "realistic", "seconds": 20.0}]
        offline_throughput.add_bounds(rows, runs, h200)
        assert offline_throughput.own_device_bounds(rows, runs, h200) == label
        if label:
            assert rows[0]["own_device"] == "H100" and rows[0]["own_bound_s"] == pytest.approx(b.seconds)
            assert rows[0]["own_achieved"] == pytest.approx(b.seconds / 20.0)
            assert rows[0]["own_achieved"] > rows[0]["achieved"]
        else:
            assert "own_bound_s" not in rows[0]


TIMES = ("scheduled", "launch", "launched", "complete", "tokens_on_host", "completed")


def record(t: float, rows: int, tokens: int, sampled: int, context: int | None) -> dict:
    """A trace record whose every time is t (the tables read completion to completion)."""
    r = dict.fromkeys(TIMES, t)
    r.update(rows=rows, tokens=tokens, sampled=sampled, waiting=0, running=rows)
    if context is not None:
        r["context"] = context
    return r


def synthetic_trace(context: bool = True) -> tuple[list[dict], list[str]]:
    """Steps completing at the times given (ms apart as written): a first step (no predecessor: not counted),
    two decode steps of 10 and 64 rows, one of 100, one of 600, a mixed step and a prefill step."""
    steps = [  # (ms after the previous, rows, tokens, sampled, context, kind)
        (0, 4, 400, 4, 400, "prefill"),
        (4, 10, 10, 10, 1000, "decode"),
        (6, 64, 64, 64, 6400, "decode"),
        (9, 100, 100, 100, 10000, "decode"),
        (30, 600, 600, 600, 60000, "decode"),
        (50, 300, 1800, 297, 40000, "mixed"),
        (80, 8, 4000, 8, 4000, "prefill"),
    ]
    t, records, kinds = 100.0, [], []
    for ms, rows, tokens, sampled, ctx, kind in steps:
        t += ms / 1e3
        records.append(record(t, rows, tokens, sampled, ctx if context else None))
        kinds.append(kind)
    return records, kinds


def test_step_trace_sets_each_kind_and_decode_bucket_against_its_bound():
    roof = roofline.for_config(roofline.config_of_shape("llama8b"))
    records, kinds = synthetic_trace()
    s = step_trace.against_roofline(records, roof, kinds)
    assert s["kv_known"]
    assert list(s["by_kind"]) == ["decode", "mixed", "prefill"]
    decode = s["by_kind"]["decode"]
    assert decode["steps"] == 4 and decode["ms"] == pytest.approx((4 + 6 + 9 + 30) / 4)
    assert s["by_kind"]["prefill"]["steps"] == 1  # the first step has no predecessor: not timed
    buckets = s["decode_buckets"]
    assert list(buckets) == ["<=64", "65-128", ">512"]
    assert buckets["<=64"]["steps"] == 2 and buckets["<=64"]["ms"] == pytest.approx(5.0)
    # 10 rows: the 3.346 ms weight read (its FLOPs take 0.16 ms) plus 1,000 tokens of KV; 64 rows: the same
    # read plus 6,400 tokens of KV
    kv_ms = 131072 / 4.8e12 * 1e3
    bound = (roof.weight_read_s * 1e3 + 1000 * kv_ms + roof.weight_read_s * 1e3 + 6400 * kv_ms) / 2
    assert buckets["<=64"]["bound_ms"] == pytest.approx(bound)
    assert buckets["<=64"]["measured_over_bound"] == pytest.approx(5.0 / bound)
    big = buckets[">512"]  # 600 rows: compute-bound GEMMs
    assert big["bound_ms"] == pytest.approx((roof.gemm_s(600, 600) + roof.kv_s(60000)) * 1e3)
    assert big["bound_ms"] > roof.weight_read_s * 1e3
    mixed = s["by_kind"]["mixed"]
    assert mixed["tokens_mean"] == 1800 and mixed["ms"] == pytest.approx(50.0)
    every = s["all"]  # every timed step: what the schedule took and would take at each step's own bound
    assert every["steps"] == 6 and every["seconds"] == pytest.approx((4 + 6 + 9 + 30 + 50 + 80) / 1e3)
    kinds_bound_ms = sum(k["bound_ms"] * k["steps"] for k in s["by_kind"].values())
    assert every["bound_s"] == pytest.approx(kinds_bound_ms / 1e3)
    table = step_trace.roofline_table({"run": s})
    assert "| run | decode | 4 |" in table and "| run | >512 | 1 | 30.00 |" in table
    assert "| run | all steps | 6 |" in table


def test_step_trace_without_kinds_or_context():
    """A trace file alone: kinds from the records (chunk-only steps count as mixed); an older engine's
    records (no context) leave the KV read out and say so."""
    roof = roofline.for_config(roofline.config_of_shape("llama8b"))
    records, _ = synthetic_trace(context=False)
    s = step_trace.against_roofline(records, roof)
    assert not s["kv_known"]
    assert s["by_kind"]["decode"]["steps"] == 4 and s["by_kind"]["mixed"]["steps"] == 2
    assert s["decode_buckets"]["<=64"]["bound_ms"] == pytest.approx(roof.weight_read_s * 1e3)
    assert "(no KV in bound)" in step_trace.roofline_table({"old": s})


def test_step_trace_cli_prints_the_roofline_tables(tmp_path, capsys):
    records, _ = synthetic_trace()
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert step_trace.main([str(path), "--shape", "llama8b", "--quantization", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "against the H200 roofline" in out and "| steps.jsonl | 65-128 | 1 | 9.00 |" in out
    assert step_trace.main([str(path)]) == 0  # no model: the timing table only
    assert "roofline" not in capsys.readouterr().out
