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


def test_slowest_steps_name_the_load_parts_they_overlap():
    """The longest steps after the load, by ratio to their group's median, each with the spans it overlapped
    (the read off the engine thread, the engine thread's command, the slot write)."""
    before = [_step(0.1 * i, "decode", 200, 200, 10.0) for i in range(10)]
    after = [_step(1.2 + 0.1 * i, "decode", 210, 210, 11.0) for i in range(5)]
    after[1] = _step(1.3, "decode", 210, 210, 25.0)  # during the read
    after.append(_step(1.8, "prefill", 8, 4000, 60.0))  # no like step before: listed as the longest
    spans = {"read": (1.25, 1.31), "command": (1.7, 1.7001)}
    w = lora_bench.load_window(before + after, t_load=1.15, window=2.0, writes=[(1.801, 1.803)], spans=spans)
    slowest = w["slowest"]
    assert slowest[0]["ms"] == 25.0 and slowest[0]["ratio"] == pytest.approx(2.5)
    assert slowest[0]["during"] == ["read"] and slowest[0]["after_load_s"] == pytest.approx(0.15)
    assert slowest[-1]["group"].startswith("prefill") and slowest[-1]["ratio"] is None
    assert slowest[-1]["during"] == ["slot write 0"]
    assert len(slowest) == lora_bench.SLOWEST + 1


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
    # the load's parts: read off the engine thread, the command on it
    assert load["load_parts"]["read"]["thread"] != "graphcache-engine"
    assert load["load_parts"]["command"]["thread"] == "graphcache-engine"
    assert load["slowest"] and all("during" in s for s in load["slowest"])
    assert load["worst"] is not None and load["compared_after"] > 0
    assert result["base"]["stream"]["tpot_ms"] > 0 and lora["stream_adapter"]["runs"][0]["tokens"] == 16
    # both engines' capacity, equal here (the CPU's KV cache does not depend on free memory)
    assert result["base"]["kv_blocks"] == lora["kv_blocks"] > 0
    assert result["base"]["max_num_seqs"] == lora["max_num_seqs"] == 4
