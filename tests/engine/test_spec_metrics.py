"""vllm:spec_decode_* (engine/spec/metrics.py) on the server's registry, as vLLM v1 names them.

Reference facts (vllm/v1/spec_decode/metrics.py, SpecDecodingProm): counters vllm:spec_decode_num_drafts,
_num_draft_tokens, _num_accepted_tokens, _num_accepted_tokens_per_pos (label `position`, 0..k-1), with
the engine's labels; a draft is a request that carried draft tokens in a step; per position, the drafts
whose token there was accepted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from graphcache.engine.spec.metrics import SpecDecodeMetrics
from graphcache.metrics import Metrics
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the spec_decode series."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.startswith("vllm:spec_decode"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counts_follow_vllms_definitions():
    registry = CollectorRegistry()
    names = SimpleNamespace(model_name="m")
    spec = SpecDecodeMetrics(registry, names, num_speculative_tokens=3)
    labels = (("engine", "0"), ("model_name", "m"))
    zero = scrape(registry)  # declared at once, as vLLM does, positions included
    assert zero[("vllm:spec_decode_num_drafts_total", labels)] == 0
    assert {k[1] for k in zero if k[0].endswith("per_pos_total")} == {
        (*labels, ("position", str(p))) for p in range(3)
    }
    spec.observe([3, 3, 0, 2, 1], [3, 1, 0, 0, 1])  # the row without drafts is no draft
    spec.observe([], [])
    assert spec.snapshot() == {"drafts": 4, "draft_tokens": 9, "accepted": 5, "per_pos": [3, 1, 1]}
    names.model_name = "served"  # Metrics.bind_model after construction: read at scrape
    got = scrape(registry)
    labels = (("engine", "0"), ("model_name", "served"))
    assert got[("vllm:spec_decode_num_drafts_total", labels)] == 4
    assert got[("vllm:spec_decode_num_draft_tokens_total", labels)] == 9
    assert got[("vllm:spec_decode_num_accepted_tokens_total", labels)] == 5
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [got[(per_pos, (*labels, ("position", str(p))))] for p in range(3)] == [3, 1, 1]
    # what dashboards compute: acceptance rate 5/9, mean accepted length 1 + 5/4 (the bonus included)
    assert 1 + got[("vllm:spec_decode_num_accepted_tokens_total", labels)] / 4 == 2.25


def test_beside_the_servers_vllm_series():
    metrics = Metrics(process_collectors=False)
    metrics.bind_model("tiny")
    SpecDecodeMetrics(metrics.registry, metrics.vllm, num_speculative_tokens=2).observe([2], [2])
    text = generate_latest(metrics.registry).decode()
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 2.0' in text
    assert "vllm:num_requests_running" in text  # the existing series are untouched


def test_impossible_counts_are_refused():
    spec = SpecDecodeMetrics(CollectorRegistry(), SimpleNamespace(model_name="m"), 2)
    for drafted, accepted in (([2], [3]), ([3], [3]), ([1], [-1]), ([1, 1], [1])):
        with pytest.raises(ValueError):
            spec.observe(drafted, accepted)
    assert spec.snapshot()["drafts"] == 0
