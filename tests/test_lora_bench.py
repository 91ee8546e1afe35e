"""benchmarks/lora_bench.py: issue 38's LoRA figures. The whole script in its CPU smoke form (two engines on the
tiny model, tiny adapters, a runtime load under load), and its step-window arithmetic on a made-up trace."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import lora_bench  # noqa: E402


def _step(t: float, kind: str, rows: int, tokens: int, ms: float) -> dict:
    return {"scheduled": t, "completed": t + ms / 1e3, "kind": kind, "rows": rows, "tokens": tokens, "ms": ms}


def test_load_window_compares_like_steps():
    """A mixed step after the load is compared with mixed steps of its size, not with decode steps; the slot
    write is found in the step that held it."""
    before = [_step(0.1 * i, "decode", 200, 200, 10.0) for i in range(10)]
    before += [_step(0.05 + 0.1 * i, "mixed", 200, 1100, 30.0) for i in range(4)]
    after = [_step(1.2 + 0.1 * i, "decode", 210, 210, 11.0) for i in range(5)]
    after.append(_step(1.8, "mixed", 210, 1200, 45.0))  # holds the slot write
    w = lora_bench.load_window(before + after, t_load=1.15, window=2.0, writes=[(1.801, 1.803)])
    groups = {g["group"]: g for g in w["groups"]}
    assert groups["decode:rows<=256:tokens<=256"]["ratio"] == pytest.approx(1.1)
    assert groups["mixed:rows<=256:tokens<=2048"]["ratio"] == pytest.approx(1.5)
    assert w["worst"]["ratio"] == pytest.approx(1.5) and w["compared_after"] == 6
    # all kinds at once: the mixed step against the window's median, a decode step's
    assert w["plain_ratio"] == pytest.approx(45 / 10.5)
    (write,) = w["slot_writes"]
    assert write["step_ms"] == 45.0 and write["ratio"] == pytest.approx(1.5)


def test_step_times_skip_idle_gaps():
    records = [
        {"scheduled": 0.0, "completed": 0.01},
        {"scheduled": 0.005, "completed": 0.02},  # pipelined: 10 ms after the previous completion
        {"scheduled": 5.0, "completed": 5.03},  # after an idle gap: its own 30 ms
    ]
    times = lora_bench.step_times(records, ["decode"] * 3)
    assert [round(s["ms"], 6) for s in times] == [10.0, 30.0]


@pytest.mark.slow
def test_lora_bench_smoke(tmp_path):
    """Both engines run every part: each criterion gets a value, the fifth adapter's requests run to their
    length and its slot write is found in the trace."""
    out = tmp_path / "lora.json"
    assert lora_bench.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["notes"] == [] and all(c["value"] is not None for c in result["criteria"])
    assert len(result["criteria"]) == 7
    lora = result["lora"]
    assert [r["output_tokens"] for r in lora["mixed"]] == [8 * 16]  # every request ran to its capped length
    assert lora["no_adapter"][0]["output_tokens"] == result["base"]["realistic"][0]["output_tokens"] == 8 * 16
    load = lora["runtime_load"]
    assert load["new_adapter_tokens"] == 3 * 16 and len(load["slot_writes"]) == 1
    assert load["worst"] is not None and load["compared_after"] > 0
    assert result["base"]["stream"]["tpot_ms"] > 0 and lora["stream_adapter"]["runs"][0]["tokens"] == 16
    # both engines' capacity, equal here (the CPU's KV cache does not depend on free memory)
    assert result["base"]["kv_blocks"] == lora["kv_blocks"] > 0
    assert result["base"]["max_num_seqs"] == lora["max_num_seqs"] == 4
