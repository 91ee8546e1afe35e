"""The benchmarks users run, in CPU smoke form: the realistic offline workload, the open-loop client and the
per-kernel table run end to end against the tiny model, so an engine or API change that breaks them shows
here rather than on a lent GPU."""

from __future__ import annotations

import json
import socket
import sys
from functools import partial
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import (  # noqa: E402
    bf16_gemv_sweep,
    fp8_gemv_sweep,
    kernel_table,
    offline_throughput,
    open_loop,
    spec_decode,
    workloads,
)
from benchmarks.spec_greedy_check import (  # noqa: E402
    first_divergence,
    run_greedy,
    summarize,
    top2_without_speculation,
)


def test_realistic_workload_shape():
    reqs = workloads.realistic(400, 151936, seed=0)
    prompts = sorted(len(r.prompt) for r in reqs)
    outputs = sorted(r.max_tokens for r in reqs)
    assert 150 < prompts[200] < 300 and prompts[-1] <= 2048 and prompts[0] >= 16  # median near 220, capped
    assert 140 < outputs[200] < 280 and outputs[-1] <= 1024
    assert sum(r.seed is not None for r in reqs) == 100
    assert {(r.temperature, r.top_p) for r in reqs} == {(0.8, 0.95)}
    assert max(max(r.prompt) for r in reqs) < 10000
    nano = workloads.nano(5, 1024, (10, 20), (3, 9), seed=0)
    assert offline_throughput.workload(5, 1024, (10, 20), (3, 9), 0) == (
        [r.prompt for r in nano],
        [r.max_tokens for r in nano],
    )
    assert {r.top_k for r in nano} == {0} and {r.top_k for r in reqs} == {0}  # off unless asked
    sampled = workloads.nano(5, 1024, (10, 20), (3, 9), seed=0, temperature=0.7, top_p=0.8, top_k=20)
    assert {(r.temperature, r.top_p, r.top_k) for r in sampled} == {(0.7, 0.8, 20)}
    assert [r.prompt for r in sampled] == [r.prompt for r in nano]


@pytest.mark.slow
def test_offline_realistic_smoke(tmp_path, capsys):
    out = tmp_path / "offline.json"
    assert offline_throughput.main(["--smoke", "--workload", "nano,realistic", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["workload"] for r in rows] == ["nano", "realistic"]
    realistic = rows[1]
    assert realistic["output_tokens"] == 8 * 16  # every request ran to its (capped) length
    kinds = realistic["by_kind"]
    assert (
        kinds["decode"]["steps"] > 0
        and sum(k["steps"] for k in kinds.values()) == realistic["trace"]["steps"] - 1
    )
    # The run against its H200 roofline (benchmarks/roofline.py), in the JSON and at the end of the table
    for r in rows:
        assert r["bound_s"] > 0 and r["achieved"] == pytest.approx(r["bound_s"] / r["seconds"])
        assert r["bound_tok_s"] == pytest.approx(r["output_tokens"] / r["bound_s"])
        assert r["roofline"]["output_tokens"] == r["output_tokens"] and not r["roofline"]["fp8"]
    steps = realistic["roofline_steps"]
    assert steps["kv_known"] and steps["by_kind"]["decode"]["steps"] == kinds["decode"]["steps"]
    assert sum(b["steps"] for b in steps["decode_buckets"].values()) == kinds["decode"]["steps"]
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if "output tok/s" in line)
    old_columns = "mode workload output tok/s seconds tokens warmup s pool MiB"  # what others parse
    assert " ".join(header.split()) == old_columns + " KV blocks max seqs bound s bound tok/s share"
    # each engine's capacity, so a run shows when the engines it compares could hold different batches
    assert all(r["kv_blocks"] > 0 and r["max_num_seqs"] == 4 for r in rows)
    assert "WARNING" not in printed
    assert "| eager realistic | <=64 |" in printed
    assert steps["all"]["steps"] == sum(k["steps"] for k in steps["by_kind"].values())
    assert "eager realistic: its steps took" in printed  # the share the run's step structure allows


def test_capacity_warning_names_engines_that_differ():
    same = {
        "graph": {"kv_blocks": 1000, "max_num_seqs": 512},
        "eager": {"kv_blocks": 1015, "max_num_seqs": 512},
    }
    assert offline_throughput.capacity_warning(same) is None
    third = {
        "base": {"kv_blocks": 3000, "max_num_seqs": 512},
        "lora": {"kv_blocks": 1000, "max_num_seqs": 512},
    }
    warning = offline_throughput.capacity_warning(third)
    assert warning is not None and "base: 3000 KV blocks" in warning and "lora: 1000 KV blocks" in warning
    seqs = {"a": {"kv_blocks": 1000, "max_num_seqs": 256}, "b": {"kv_blocks": 1000, "max_num_seqs": 512}}
    assert offline_throughput.capacity_warning(seqs) is not None
    assert offline_throughput.capacity_warning({"old": {"kv_blocks": None, "max_num_seqs": None}}) is None


@pytest.mark.slow
def test_open_loop_smoke(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "open_loop.json"
    assert (
        open_loop.main(
            [
                "--smoke",
                "--make-model",  # ids past the tokenizer, as the real shapes: chunks of tokens with no text
                f"tinywide:{tmp_path / 'model'}",
                "--rates",
                "sat,0.5x",
                "--burst",
                "2",
                "--port",
                str(port),
                "--log",
                str(tmp_path / "server.log"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    sat, half, after_burst = result["rows"]
    assert [r["window"] for r in (sat, after_burst)] == ["sat", f"{half['rate']:.3g} +burst 2"]
    assert (
        half["rate"]
        == pytest.approx(result["saturation_req_per_s"] / 2)
        == pytest.approx(sat["req_per_s"] / 2)
    )
    for row in (sat, half, after_burst):
        assert row["errors"] == 0 and row["burst_errors"] == 0 and row["requests"] == 6
        assert row["ttft_ms_p50"] > 0 and row["itl_ms_p50"] >= 0 and row["output_tokens_per_s"] > 0
        assert sum(s["requests"] for s in row["ttft_slices"]) == 6
        server = row["server"]
        # the server's TTFT splits into queue + prefill; every window's requests reached /metrics
        assert server["ttft_count"] >= 6 and server["queue_count"] >= 6 and server["ttft_ms_p50"] > 0
        assert row["steps"]["steps"] > 0


@pytest.mark.slow
def test_spec_decode_smoke(tmp_path):
    """Streams without and with the n-gram proposer (both turn-off rules off: c = 0 and no payoff timing, so
    the tiny model's loops are drafted whatever a busy CPU's step times say), step times per k, the
    draft-model rows (run, or skipped with the reason where this tree has no draft-model proposer) and the
    realistic ratio."""
    out = tmp_path / "spec.json"
    argv = [
        "--smoke",
        "--token-cost",
        "0",
        "--step-payoff",
        "off",
        "--self-draft",
        "--realistic",
        "--out",
        str(out),
    ]
    assert spec_decode.main(argv) == 0
    result = json.loads(out.read_text())
    rows = {(r["proposer"], r["streams"]): r for r in result["streams"]}
    assert {("none", 1), ("ngram", 1), ("none", 2), ("ngram", 2)} <= set(rows)
    for s in (1, 2):
        ngram = rows[("ngram", s)]
        assert (
            ngram["same_tokens"] is True
            and ngram["output_tokens"] == rows[("none", s)]["output_tokens"] == 32 * s
        )
        assert 0 <= ngram["acceptance_rate"] <= 1 and ngram["mean_accepted_length"] >= 1
    ngram = rows[("ngram", 2)]
    assert ngram["drafts"] > 0 and ngram["pred_tpot_ms"] > 0 and ngram["verify_step_ms"] > 0
    assert [t["rows"] for t in result["step_times"]] == [1, 2]
    assert all(set(t["verify_ms"]) == {"1", "2", "4"} and t["decode_ms"] > 0 for t in result["step_times"])
    assert ("self-draft", 1) in rows or any("draft_model" in n for n in result["notes"])
    assert result["realistic"]["ratio"] > 0
    capacity = result["realistic"]["capacity"]
    assert capacity["plain"]["kv_blocks"] == capacity["ngram"]["kv_blocks"] > 0


@pytest.mark.slow
def test_spec_decode_greedy_check_smoke(tmp_path):
    """--greedy-check on the CPU (float32): every request's tokens equal without and with each proposer, so
    no divergence is listed; the table's JSON holds the share, the positions and the margins."""
    out = tmp_path / "greedy.json"
    argv = ["--smoke", "--greedy-check", "6", "--greedy-streams", "3", "--token-cost", "0", "--self-draft"]
    assert spec_decode.main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["dtype"] == "float32"
    check = result["greedy_check"]
    assert check["requests"] == 6 and set(check["proposers"]) == {"ngram", "self-draft"}
    for row in check["proposers"].values():
        assert row["identical"] == 6 and row["identical_share"] == 1.0 and row["divergences"] == []
    assert check["proposers"]["self-draft"]["acceptance_rate"] == 1.0


def test_prime_extends_each_prompt_by_the_targets_own_greedy_continuation(tmp_path):
    """--prime: each copy prompt followed by what the target decodes greedily from it (speculation off, so
    the continuation is the plain model's), and the scheduler left without a proposer."""
    model = tmp_path / "tiny"
    args = spec_decode.build_parser().parse_args(["--smoke", "--make-model", f"tiny:{model}"])
    for key, value in spec_decode.SMOKE.items():
        setattr(args, key, value)
    core = spec_decode.load_core(
        spec_decode.settings_for(args, spec_decode.resolve_model(args), spec_decode.ngram_config(args))
    )
    try:
        prompts = spec_decode.copy_prompts(2, 1000, 24, 6, seed=3)
        longer = spec_decode.primed(core, prompts, 5, 2)
        again = run_greedy(core, prompts, 5, 1, "again")
    finally:
        core.runner.close()
    assert core.scheduler.proposer is None
    assert [p[:24] for p in longer] == prompts and [p[24:] for p in longer] == again
    assert all(len(p) == 29 for p in longer)


def test_greedy_check_reports_a_divergence_with_the_targets_top2_margin(tmp_path):
    """A divergence (made by hand: the speculative output changed at position 3) is found at its position,
    bucketed, and given the target's top-2 there from the real tiny model: the plain token is its top-1."""
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None and first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    model = tmp_path / "tiny"
    args = spec_decode.build_parser().parse_args(["--smoke", "--make-model", f"tiny:{model}"])
    for key, value in spec_decode.SMOKE.items():
        setattr(args, key, value)
    core = spec_decode.load_core(spec_decode.settings_for(args, spec_decode.resolve_model(args), None))
    try:
        prompts = spec_decode.copy_prompts(2, 1000, 24, 6, seed=1)
        plain = run_greedy(core, prompts, 8, 2, "plain")
        spec = [list(plain[0]), plain[1][:3] + [(plain[1][3] + 1) % 1000] + plain[1][4:]]
        row = summarize(plain, spec, prompts, partial(top2_without_speculation, core))
    finally:
        core.runner.close()
    assert row["identical"] == 1 and row["first_divergence"]["positions"] == [3]
    assert row["first_divergence"]["buckets"]["[1,4)"] == 1
    (d,) = row["divergences"]
    assert d["request"] == 1 and d["plain"] == plain[1][3] and d["top2"][0][0] == plain[1][3]
    assert d["margin"] >= 0 and row["margin"]["median"] == d["margin"]


@pytest.mark.slow
def test_kernel_table_smoke(tmp_path):
    out = tmp_path / "kernels.json"
    assert kernel_table.main(["--smoke", "--kinds", "decode,prefill", "--out", str(out)]) == 0
    steps = json.loads(out.read_text())["steps"]
    for kind in ("decode", "prefill"):
        classes = {r["class"] for r in steps[kind]["rows"]}
        assert "gemm" in classes and steps[kind]["attention_bound_us"] > 0


def test_kernel_table_takes_fp8(tmp_path):
    out = tmp_path / "kernels.json"
    assert (
        kernel_table.main(["--smoke", "--kinds", "decode", "--quantization", "fp8", "--out", str(out)]) == 0
    )


def test_bf16_gemv_sweep_smoke(tmp_path):
    """Every candidate tile of the small bf16 GEMM sweep in Triton's interpreter, checked against the fp32
    product (exit 0), gate_up gated too."""
    out = tmp_path / "sweep.json"
    assert bf16_gemv_sweep.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert {r["design"] for r in results} == {"cublas", "kernel", "pdl", "cublas_gated", "gated"}
    assert all(r["rel_err"] is not None and r["rel_err"] < 1e-2 for r in results)


def test_fp8_gemv_sweep_smoke(tmp_path):
    """Every design's kernel in Triton's interpreter, checked against its exact product (exit 0)."""
    out = tmp_path / "sweep.json"
    assert fp8_gemv_sweep.main(["--smoke", "--out", str(out)]) == 0
    designs = {r["design"] for r in json.loads(out.read_text())}
    assert {"quant", "prequant", "dequant", "fma", "split"} <= designs
