"""vLLM's `vllm:` series beside graphcache's own (vllm_metrics.py), the process collectors and the HTTP
series of prometheus-fastapi-instrumentator, all on the server's registry and its open /metrics.

Reference facts (vLLM v1, vllm/v1/metrics/loggers.py): names, types, label names and buckets, written out
here by hand so a change on either side shows. A served tiny model checks the values against the
requests' own usage and against each other (phases add up; per-token latency sums to the decode time).
"""

from __future__ import annotations

import pytest
import pytest_asyncio
from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine
from graphcache.engine.sequence import SamplingParams, Sequence
from graphcache.metrics import Metrics
from graphcache.vllm_metrics import CountedHistogram, one_two_five
from helpers_api import serving
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

TTFT = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
PER_TOKEN = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

# name -> (type, buckets or None)
VLLM_SERIES = {
    "vllm:num_requests_running": ("gauge", None),
    "vllm:num_requests_waiting": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:gpu_cache_usage_perc": ("gauge", None),
    "vllm:prompt_tokens": ("counter", None),
    "vllm:generation_tokens": ("counter", None),
    "vllm:num_preemptions": ("counter", None),
    "vllm:prefix_cache_queries": ("counter", None),
    "vllm:prefix_cache_hits": ("counter", None),
    "vllm:request_success": ("counter", None),
    "vllm:time_to_first_token_seconds": ("histogram", TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", PER_TOKEN),
    "vllm:time_per_output_token_seconds": ("histogram", PER_TOKEN),
    "vllm:request_time_per_output_token_seconds": ("histogram", PER_TOKEN),
    "vllm:e2e_request_latency_seconds": ("histogram", REQUEST),
    "vllm:request_queue_time_seconds": ("histogram", REQUEST),
    "vllm:request_inference_time_seconds": ("histogram", REQUEST),
    "vllm:request_prefill_time_seconds": ("histogram", REQUEST),
    "vllm:request_decode_time_seconds": ("histogram", REQUEST),
    "vllm:iteration_tokens_total": ("histogram", ITERATION),
    "vllm:request_prompt_tokens": ("histogram", "1-2-5"),
    "vllm:request_generation_tokens": ("histogram", "1-2-5"),
    "vllm:request_max_num_generation_tokens": ("histogram", "1-2-5"),
    "vllm:request_params_max_tokens": ("histogram", "1-2-5"),
    "vllm:request_params_n": ("histogram", [1, 2, 5, 10, 20]),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", "1-2-5"),
    "vllm:prompt_tokens_cached": ("counter", None),
    "vllm:prompt_tokens_by_source": ("counter", None),
    "vllm:prompt_tokens_recomputed": ("counter", None),
    "vllm:engine_sleep_state": ("gauge", None),
    "vllm:external_prefix_cache_queries": ("counter", None),
    "vllm:external_prefix_cache_hits": ("counter", None),
    "vllm:mm_cache_queries": ("counter", None),
    "vllm:mm_cache_hits": ("counter", None),
}
# The label each series adds to model_name and engine.
EXTRA_LABEL = {
    "vllm:request_success": "finished_reason",
    "vllm:prompt_tokens_by_source": "source",
    "vllm:engine_sleep_state": "sleep_state",
}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError((name, labels))


def test_vllm_names_types_labels_and_buckets():
    m = Metrics()
    m.bind_model("org/model-x")
    m.requests_finished.labels("stop").inc()
    fams = families(generate_latest(m.registry).decode())
    for name, (kind, buckets) in VLLM_SERIES.items():
        f = fams[name]
        assert f.type == kind, name
        label_sets = {frozenset(k for k in s.labels if k != "le") for s in f.samples}
        want = {"model_name", "engine"} | ({EXTRA_LABEL[name]} if name in EXTRA_LABEL else set())
        assert label_sets == {frozenset(want)}, (name, label_sets)
        assert {s.labels["model_name"] for s in f.samples} == {"org/model-x"}
        assert {s.labels["engine"] for s in f.samples} == {"0"}
        if buckets is not None:
            les = [float(s.labels["le"]) for s in f.samples if s.name == name + "_bucket"]
            assert les[-1] == float("inf")
            if buckets == "1-2-5":
                assert les[:6] == [1, 2, 5, 10, 20, 50] and les[-2] == 1_000_000
            else:
                assert les[:-1] == buckets, name
    reasons = {
        s.labels["finished_reason"]: s.value
        for s in fams["vllm:request_success"].samples
        if s.name == "vllm:request_success_total"
    }
    assert reasons == {"stop": 1, "length": 0, "abort": 0, "error": 0}
    sources = {s.labels["source"] for s in fams["vllm:prompt_tokens_by_source"].samples}
    assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}
    sleep = {s.labels["sleep_state"]: s.value for s in fams["vllm:engine_sleep_state"].samples}
    assert sleep == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    # The process collectors, as on prometheus_client's default registry (and so on vLLM's /metrics).
    assert {
        "process_resident_memory_bytes",
        "process_cpu_seconds",
        "python_gc_collections",
        "python_info",
    } <= set(fams)
    # graphcache's own series are all still there.
    assert {
        "graphcache_num_requests_running",
        "graphcache_time_to_first_token_seconds",
        "graphcache_requests_finished",
        "graphcache_prefix_cache_queries",
    } <= set(fams)


def test_one_two_five_ladder():
    assert one_two_five(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five(4096)[-3:] == (500, 1000, 2000)


def test_mirrors_follow_graphcache_instruments_and_rebinding():
    m = Metrics()
    m.requests_running.set(3)
    m.requests_waiting.set(7)
    m.kv_usage.set(0.25)
    m.prompt_tokens.inc(11)
    m.generation_tokens.inc(5)
    m.preemptions.inc(2)
    m.prefix_cache_queries.inc(64)
    m.prefix_cache_hits.inc(48)
    m.vllm.observe_first_token(0.2)
    m.bind_model("served")
    text = generate_latest(m.registry).decode()
    expect = {
        "vllm:num_requests_running": 3,
        "vllm:num_requests_waiting": 7,
        "vllm:kv_cache_usage_perc": 0.25,
        "vllm:gpu_cache_usage_perc": 0.25,
        "vllm:prompt_tokens_total": 11,
        "vllm:generation_tokens_total": 5,
        "vllm:num_preemptions_total": 2,
        "vllm:prefix_cache_queries_total": 64,
        "vllm:prefix_cache_hits_total": 48,
    }
    for name, want in expect.items():
        assert value(text, name, model_name="served", engine="0") == want, name
    # Rebinding drops what was recorded under the old name: no stale series with the default label.
    assert 'model_name="graphcache-tiny"' not in text
    assert value(text, "vllm:time_to_first_token_seconds_count", model_name="served") == 0


def test_counted_histogram_matches_prometheus_histogram():
    """`observe(v, k)` equals k observations of v by prometheus_client's own Histogram (the reference),
    boundaries included (le is inclusive)."""
    bounds = (0.01, 0.05, 0.1, 1.0)
    ours = CountedHistogram("ours_seconds", "x", bounds, CollectorRegistry())
    ref_registry = CollectorRegistry()
    ref = Histogram("ref_seconds", "x", ["model_name", "engine"], buckets=bounds, registry=ref_registry)
    for v, k in ((0.003, 2), (0.05, 3), (0.07, 1), (0.1, 4), (3.5, 2), (1.0, 1)):
        ours.labels("m", "0").observe(v, k)
        for _ in range(k):
            ref.labels("m", "0").observe(v)

    def buckets(family, name):
        return {
            (s.name.removeprefix(name), s.labels.get("le")): s.value
            for s in family.samples
            if not s.name.endswith("_created")
        }

    (o,) = ours.collect()
    (r,) = ref.collect()
    got, want = buckets(o, "ours_seconds"), buckets(r, "ref_seconds")
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key]), key


def test_finished_request_phases():
    """vLLM's phase definitions on a request with known timestamps: queue 0.5 s, prefill 1.25 s, 9 output
    tokens over 2 s of decode (8 gaps of 0.25 s), finished 0.5 s after its last token."""
    m = Metrics()
    seq = Sequence("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=16), arrival_time=100.0)
    seq.first_scheduled_time, seq.first_token_time, seq.last_token_time = 100.5, 101.75, 103.75
    seq.output_token_ids = list(range(10, 19))
    m.vllm.observe_finished(seq, now=104.25)
    text = generate_latest(m.registry).decode()

    def one(name):
        assert value(text, f"vllm:{name}_count") == 1, name
        return value(text, f"vllm:{name}_sum")

    assert one("e2e_request_latency_seconds") == pytest.approx(4.25)
    assert one("request_queue_time_seconds") == pytest.approx(0.5)
    assert one("request_prefill_time_seconds") == pytest.approx(1.25)
    assert one("request_decode_time_seconds") == pytest.approx(2.0)
    assert one("request_inference_time_seconds") == pytest.approx(3.25)
    assert one("request_prompt_tokens") == 5
    assert one("request_generation_tokens") == 9
    assert one("request_max_num_generation_tokens") == 9
    assert one("request_params_max_tokens") == 16
    assert one("request_time_per_output_token_seconds") == pytest.approx(0.25)
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert value(text, f"vllm:{name}_count") == 8
        assert value(text, f"vllm:{name}_sum") == pytest.approx(2.0)
        assert value(text, f"vllm:{name}_bucket", le="0.2") == 0
        assert value(text, f"vllm:{name}_bucket", le="0.3") == 8


def test_request_aborted_in_queue_has_only_e2e_and_lengths():
    m = Metrics()
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=10.0)
    m.vllm.observe_finished(seq, now=12.0)
    text = generate_latest(m.registry).decode()
    assert value(text, "vllm:e2e_request_latency_seconds_count") == 1
    for name in (
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "inter_token_latency_seconds",
    ):
        assert value(text, f"vllm:{name}_count") == 0, name
    assert value(text, "vllm:request_generation_tokens_sum") == 0


# --- a served tiny model -----------------------------------------------------------------------------

API_KEY = "sk-metrics-test"


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> Settings:
    return Settings(
        cache_dir=tmp_path_factory.mktemp("cache"),
        device="cpu",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        warmup_decode_sizes=[1, 2],
        capture_sizes=[1, 2, 4],
        drain_timeout_s=2.0,
        served_model_name="tiny-served",
        api_key=[API_KEY],
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(settings):
    async with serving(settings, Engine(settings, Metrics())) as (client, app):
        auth = {"Authorization": f"Bearer {API_KEY}"}
        usages = []
        for i, stream in enumerate((False, False, True)):
            body = {
                "model": "tiny-served",
                "prompt": f"metrics test {i}",
                "max_tokens": 6,
                "stream": stream,
                "ignore_eos": True,
            }
            if stream:
                body["stream_options"] = {"include_usage": True}
                async with client.stream("POST", "/v1/completions", json=body, headers=auth) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_lines():
                        pass
                usages.append(None)
            else:
                r = await client.post("/v1/completions", json=body, headers=auth)
                assert r.status_code == 200, r.text
                usages.append(r.json()["usage"])
        unauthorized = await client.post("/v1/completions", json={"model": "tiny-served", "prompt": "x"})
        assert unauthorized.status_code == 401
        scrape = await client.get("/metrics")  # no API key: /metrics stays open like the probes
        assert scrape.status_code == 200, scrape.text
        yield {"text": scrape.text, "usages": usages}


@pytest.mark.asyncio(loop_scope="module")
async def test_served_vllm_series(served):
    text = served["text"]
    labels = {"model_name": "tiny-served", "engine": "0"}
    assert value(text, "vllm:request_success_total", finished_reason="length", **labels) == 3
    assert value(text, "vllm:e2e_request_latency_seconds_count", **labels) == 3
    assert value(text, "vllm:request_generation_tokens_sum", **labels) == 18
    prompt = sum(u["prompt_tokens"] for u in served["usages"] if u)
    assert value(text, "vllm:request_prompt_tokens_sum", **labels) >= prompt > 0
    assert value(text, "vllm:prompt_tokens_total", **labels) == value(
        text, "vllm:request_prompt_tokens_sum", **labels
    )
    assert value(text, "vllm:generation_tokens_total", **labels) == 18
    assert value(text, "vllm:time_to_first_token_seconds_count", **labels) == 3
    assert value(text, "vllm:inter_token_latency_seconds_count", **labels) == 3 * 5
    # Per-token latency sums to the decode time; the phases add up: inference = prefill + decode.
    assert value(text, "vllm:inter_token_latency_seconds_sum", **labels) == pytest.approx(
        value(text, "vllm:request_decode_time_seconds_sum", **labels)
    )
    assert value(text, "vllm:request_inference_time_seconds_sum", **labels) == pytest.approx(
        value(text, "vllm:request_prefill_time_seconds_sum", **labels)
        + value(text, "vllm:request_decode_time_seconds_sum", **labels)
    )
    # The steps together computed each prompt and each output token fed back (6 outputs: 5 fed back).
    assert value(text, "vllm:iteration_tokens_total_count", **labels) >= 6
    assert (
        value(text, "vllm:iteration_tokens_total_sum", **labels)
        == value(text, "vllm:request_prompt_tokens_sum", **labels) + 3 * 5
    )
    assert value(text, "vllm:num_requests_running", **labels) == 0
    info = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info")
    (sample,) = info.samples
    assert (
        sample.value == 1
        and int(sample.labels["block_size"]) >= 1
        and int(sample.labels["num_gpu_blocks"]) >= 1
    )
    # graphcache's own series keep counting the same traffic.
    assert value(text, "graphcache_generation_tokens_total") == 18
    # n per request (three requests of n = 1), and the prompt tokens split by where their KV came from.
    assert value(text, "vllm:request_params_n_count", **labels) == 3
    assert value(text, "vllm:request_params_n_sum", **labels) == 3
    computed = value(text, "vllm:prompt_tokens_by_source_total", source="local_compute", **labels)
    cached = value(text, "vllm:prompt_tokens_by_source_total", source="local_cache_hit", **labels)
    assert value(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer", **labels) == 0
    assert computed + cached == value(text, "vllm:prompt_tokens_total", **labels)
    assert value(text, "vllm:prompt_tokens_cached_total", **labels) == cached
    assert value(text, "vllm:request_prefill_kv_computed_tokens_sum", **labels) == computed > 0
    assert value(text, "vllm:request_prefill_kv_computed_tokens_count", **labels) == 3
    assert value(text, "vllm:prompt_tokens_recomputed_total", **labels) == 0  # nothing was preempted
    assert value(text, "vllm:engine_sleep_state", sleep_state="awake", **labels) == 1
    for name in ("external_prefix_cache", "mm_cache"):
        for kind in ("queries", "hits"):
            assert value(text, f"vllm:{name}_{kind}_total", **labels) == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_served_http_and_process_series(served):
    text = served["text"]
    ok = value(text, "http_requests_total", handler="/v1/completions", method="POST", status="2xx")
    assert ok == 3
    assert value(text, "http_requests_total", handler="/v1/completions", method="POST", status="4xx") == 1
    assert value(text, "http_request_duration_highr_seconds_count") >= 4
    assert value(text, "http_request_duration_seconds_count", handler="/v1/completions", method="POST") >= 4
    # Scrapes and probes are left out of the HTTP series.
    assert not any(
        s.labels.get("handler") in ("/metrics", "/health", "/ready")
        for f in text_string_to_metric_families(text)
        for s in f.samples
    )
    assert value(text, "process_resident_memory_bytes") > 0
