"""deploy/grafana/graphcache-vllm-dashboard.json: PromQL over the series and labels that vLLM's published
Grafana dashboard, the production-stack router and KEDA examples query (vllm:* by model_name and le,
finished_reason; http_*; process_*), run against a live graphcache server scraped by a real Prometheus.

Static checks (shape, promtool parses every query, every vllm: family has a panel) need no server; the
live ones reuse test_live_stack.py's machinery (one `graphcache serve` on the tiny model plus one
Prometheus scraping it every second, with traffic driven before the scrapes) and assert that every query,
with the served model's name for $model_name, returns data.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from graphcache.api.server.app import create_app
from graphcache.config import Settings
from graphcache.engine.spec.metrics import SpecDecodeMetrics
from graphcache.metrics import Metrics
from prometheus_client import generate_latest

from .conftest import DEPLOY
from .promql import exposed_sample_names, metric_names
from .test_deploy_static import SYNTHETIC, assert_panels_well_formed, grafana_to_promql, promtool
from .test_live_stack import prometheus, query, server, stack  # noqa: F401 (module-scoped fixtures)

DASHBOARD = DEPLOY / "grafana" / "graphcache-vllm-dashboard.json"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query, panels nested in rows included."""
    out = []

    def walk(panels):
        for p in panels:
            walk(p.get("panels", []))
            out.extend((p["title"], t["expr"]) for t in p.get("targets", []))

    walk(dashboard()["panels"])
    return out


def queried_names() -> set[str]:
    return {n for _, e in exprs() for n in metric_names(e)} - SYNTHETIC


# --- static -----------------------------------------------------------------------------------------


def test_dashboard_shape():
    dash = dashboard()
    assert dash["uid"] == "graphcache-vllm"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    variables = assert_panels_well_formed(dash)
    assert variables["model_name"]["definition"] == "label_values(vllm:num_requests_running, model_name)"


def test_dashboard_queries_what_vllm_dashboards_query():
    """The panels of vLLM's own dashboard, by the series and labels they use."""
    all_exprs = [e for _, e in exprs()]

    def some(pattern: str) -> bool:
        return any(re.search(pattern, e) for e in all_exprs)

    for metric in (
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "time_per_output_token_seconds",
    ):
        assert some(rf"histogram_quantile\(0\.99, sum by \(le, model_name\) \(rate\(vllm:{metric}_bucket"), (
            metric
        )
    for counter in (
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "prefix_cache_hits_total",
        "prefix_cache_queries_total",
    ):
        assert some(rf"rate\(vllm:{counter}\{{model_name=~\"\$model_name\"\}}"), counter
    for gauge in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "gpu_cache_usage_perc",
    ):
        assert some(rf"vllm:{gauge}\{{model_name=~\"\$model_name\"\}}"), gauge
    assert some(r"sum by \(finished_reason\) \(increase\(vllm:request_success_total")
    for phase in ("queue", "prefill", "decode", "inference"):
        assert some(rf"vllm:request_{phase}_time_seconds_sum"), phase
    for length in ("request_prompt_tokens", "request_generation_tokens"):
        assert some(rf"sum by \(le\) \(increase\(vllm:{length}_bucket"), length


def test_dashboard_queries_parse_as_promql(tmp_path):
    rules = [
        {"record": f"graphcache:vllm_dashboard_query_{i}", "expr": grafana_to_promql(e)}
        for i, (_, e) in enumerate(exprs())
    ]
    f = tmp_path / "vllm_dashboard_rules.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "vllm-dashboard", "rules": rules}]}))
    proc = promtool("check", "rules", str(f))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def speculating_metrics() -> Metrics:
    """The server's registry as an engine with --speculative-config leaves it (the vllm:spec_decode_*
    series exist only then, as in vLLM)."""
    metrics = Metrics()
    metrics.spec_decode = SpecDecodeMetrics(metrics.registry, metrics.vllm, num_speculative_tokens=2)
    return metrics


def test_every_vllm_family_is_on_the_dashboard():
    exposed = exposed_sample_names(generate_latest(speculating_metrics().registry).decode())
    families = {
        re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in exposed if n.startswith("vllm:")
    }
    queried = queried_names()
    uncovered = {
        f
        for f in families
        if not any(q == f or re.fullmatch(re.escape(f) + r"_(total|bucket|sum|count)", q) for q in queried)
    }
    assert len(families) > 20 and uncovered == set(), sorted(uncovered)


def test_dashboard_metrics_exist_on_an_app():
    """Every name the dashboard queries is on the /metrics of an app (HTTP series appear once a request
    was measured; cache_config_info once the KV cache exists, so it is set here as the engine would)."""

    class Stub:
        alive = ready = True
        model_name = "stub"

    metrics = speculating_metrics()  # the spec_decode series: as a server with --speculative-config has them
    metrics.vllm.set_cache_config(block_size=16, num_gpu_blocks=8, cache_dtype="float32")
    client = TestClient(
        create_app(Settings(), engine=Stub(), metrics=metrics)
    )  # no lifespan: no engine start
    assert client.get("/no-such-path").status_code == 404  # measured, as handler "none"
    exposed = exposed_sample_names(client.get("/metrics").text)
    assert queried_names() - exposed == set()


def test_speculative_decoding_panels_compute_vllms_ratios(tmp_path):
    """The panel's queries, evaluated by promtool over counters growing as one step of SpecDecodeMetrics'
    test does every 15 s (4 drafts, 9 draft tokens, 5 accepted; per position 3, 1, 1): acceptance rate 5/9,
    per position 3/4, 1/4, 1/4, mean accepted length 1 + 5/4 (vLLM's, the bonus token included), mean
    draft length 9/4."""
    queries = {
        title: [e for t, e in exprs() if t == title]
        for title in ("Draft acceptance rate", "Mean accepted length")
    }
    (rate, per_pos), (length, drafted) = queries.values()
    base = 'model_name="m", engine="0"'
    series = [
        (f"vllm:spec_decode_num_drafts_total{{{base}}}", 4),
        (f"vllm:spec_decode_num_draft_tokens_total{{{base}}}", 9),
        (f"vllm:spec_decode_num_accepted_tokens_total{{{base}}}", 5),
    ] + [
        (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{base}, position="{p}"}}', n)
        for p, n in enumerate((3, 1, 1))
    ]

    def case(expr: str, samples: list[tuple[str, float]]) -> dict:
        return {
            "expr": grafana_to_promql(expr),
            "eval_time": "5m",
            "exp_samples": [{"labels": labels, "value": value} for labels, value in samples],
        }

    test = {
        "rule_files": [],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [{"series": name, "values": f"0+{step}x40"} for name, step in series],
                "promql_expr_test": [
                    case(rate, [('{model_name="m"}', 5 / 9)]),
                    case(
                        per_pos,
                        [(f'{{model_name="m", position="{p}"}}', n / 4) for p, n in enumerate((3, 1, 1))],
                    ),
                    case(length, [('{model_name="m"}', 1 + 5 / 4)]),
                    case(drafted, [('{model_name="m"}', 9 / 4)]),
                ],
            }
        ],
    }
    f = tmp_path / "spec_panels_test.yml"
    f.write_text(yaml.safe_dump(test))
    proc = promtool("test", "rules", str(f))
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- live: a graphcache server scraped by Prometheus ------------------------------------------------


@pytest.fixture(scope="module")
def model_name(server) -> str:  # noqa: F811
    return httpx.get(server["base"] + "/v1/models", timeout=5).json()["data"][0]["id"]


def live(expr: str, model: str) -> str:
    """The query as Grafana sends it with `model` picked: a regex (=~), in a PromQL string literal."""
    as_regex = re.sub(r"([.+*?()\[\]{}|^$])", r"\\\\\1", model)
    return grafana_to_promql(expr.replace("$model_name", as_regex))


@pytest.mark.slow
def test_every_dashboard_query_returns_data(prometheus, model_name):  # noqa: F811
    empty = [(title, expr) for title, expr in exprs() if not query(prometheus["api"], live(expr, model_name))]
    assert empty == []


@pytest.mark.slow
def test_model_name_variable_lists_the_served_model(prometheus, model_name):  # noqa: F811
    r = httpx.get(
        prometheus["api"] + "/api/v1/label/model_name/values",
        params={"match[]": "vllm:num_requests_running"},
        timeout=10,
    )
    assert r.status_code == 200 and r.json()["data"] == [model_name]


@pytest.mark.slow
def test_prometheus_holds_the_traffic(prometheus, model_name):  # noqa: F811
    """The stack drove 4 completions of max_tokens=8: Prometheus has them under vLLM's names and labels."""
    sel = f'{{model_name="{model_name}", engine="0"}}'
    api = prometheus["api"]
    (finished,) = query(api, f"sum(vllm:request_success_total{sel})")
    assert float(finished["value"][1]) == 4
    (e2e,) = query(api, f"vllm:e2e_request_latency_seconds_count{sel}")
    assert float(e2e["value"][1]) == 4
    reasons = {s["metric"]["finished_reason"] for s in query(api, f"vllm:request_success_total{sel}")}
    assert reasons == {"stop", "length", "abort", "error"}
    (tokens,) = query(api, f"vllm:generation_tokens_total{sel}")
    (own,) = query(api, "graphcache_generation_tokens_total")
    assert float(tokens["value"][1]) == float(own["value"][1]) > 0, (
        "the vllm: mirror equals graphcache's count"
    )
    (http,) = query(api, 'sum(http_requests_total{handler="/v1/completions", method="POST"})')
    assert float(http["value"][1]) == 4


@pytest.mark.slow
def test_vllm_dashboard_metrics_on_live_server(server):  # noqa: F811
    r = httpx.get(server["base"] + "/metrics", timeout=10)
    assert r.status_code == 200
    assert queried_names() - exposed_sample_names(r.text) == set()
