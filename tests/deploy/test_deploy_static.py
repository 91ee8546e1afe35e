"""deploy/: Prometheus config and alert rules checked by promtool, the Grafana dashboard and the compose
stack checked for shape, and every metric they query checked against the server's instruments.

The same metric check runs against a live server's /metrics in test_live_stack.py; here it runs against
the exposition of a fresh `Metrics()` registry, so it needs no server.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from graphcache.metrics import Metrics
from prometheus_client import generate_latest

from .conftest import DEPLOY, require_tool
from .promql import exposed_sample_names, metric_names

PROM = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboard.json"
# Series Prometheus makes itself, not the server.
SYNTHETIC = {"up", "ALERTS", "ALERTS_FOR_STATE", "scrape_duration_seconds", "scrape_samples_scraped"}


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_tool("promtool"), *args], capture_output=True, text=True, timeout=60)


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query in the dashboard, panels nested in rows included."""
    dash = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels):
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))

    walk(dash["panels"])
    return out


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana's variables with what they stand for, so promtool can parse the query."""
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m").replace("$__range", "1h")
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def alert_rules() -> list[dict]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


@pytest.fixture(scope="module")
def static_samples() -> set[str]:
    return exposed_sample_names(generate_latest(Metrics().registry).decode())


# --- promtool ---------------------------------------------------------------------------------------


def test_promtool_check_config():
    proc = promtool("check", "config", str(PROM / "prometheus.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 rule files found" in proc.stdout + proc.stderr


def test_promtool_check_rules():
    proc = promtool("check", "rules", str(PROM / "alerts.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_alert_unit_tests():
    """alerts_test.yml: each alert fires on its trigger, with its labels and annotations, and not on a
    healthy twin series."""
    proc = promtool("test", "rules", str(PROM / "alerts_test.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tested = set(re.findall(r"alertname: (\w+)", (PROM / "alerts_test.yml").read_text()))
    assert tested == {r["alert"] for r in alert_rules()}, "every alert has a unit test"


def test_promtool_rejects_a_broken_rule(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("groups: [{name: x, rules: [{alert: X, expr: 'rate(graphcache_steps_total[5m]'}]}]\n")
    assert promtool("check", "rules", str(bad)).returncode != 0


def test_alert_coverage_and_labels():
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    # The list: eviction thrashing, low hit ratio, pool near budget, capture failures, slow TTFT,
    # not ready.
    assert {
        "GraphcacheEvictionThrashing",
        "GraphcacheLowHitRatio",
        "GraphcachePoolNearBudget",
        "GraphcacheCaptureFailures",
        "GraphcacheSlowTimeToFirstToken",
        "GraphcacheNotReady",
    } <= names
    for r in rules:
        assert r["labels"]["severity"] in {"info", "warning", "critical"}, r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]


# --- dashboard --------------------------------------------------------------------------------------


def assert_panels_well_formed(dash: dict) -> dict:
    """The shape every shipped Grafana dashboard keeps: a `datasource` variable for Prometheus, every
    panel on it with non-empty queries, inside the 24-column grid. Returns the variables by name."""
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
    return variables


def test_dashboard_shape():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "graphcache" and dash["title"] == "graphcache"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for wanted in (
        "hit ratio",
        "pool bytes vs budget",
        "captures",
        "evictions",
        "step time by mode",
        "time to first token",
        "time per output token",
        "queue",
    ):
        assert wanted in titles, f"dashboard lacks a {wanted!r} panel"
    assert_panels_well_formed(dash)


def test_dashboard_quantiles_cover_ttft_and_tpot():
    exprs = [e for _, e in dashboard_exprs()]
    for metric in (
        "graphcache_time_to_first_token_seconds_bucket",
        "graphcache_time_per_output_token_seconds_bucket",
    ):
        phis = {
            float(m) for e in exprs if metric in e for m in re.findall(r"histogram_quantile\(([\d.]+)", e)
        }
        assert {0.5, 0.99} <= phis, (metric, phis)
    assert any("graphcache_step_seconds_bucket" in e and "mode" in e for e in exprs)
    assert any("graphcache_graph_pool_budget_bytes" in e for e in exprs)


def test_dashboard_queries_parse_as_promql(tmp_path):
    """promtool parses every dashboard query (as a recording rule), Grafana variables substituted."""
    rules = [
        {"record": f"graphcache:dashboard_query_{i}", "expr": grafana_to_promql(e)}
        for i, (_, e) in enumerate(dashboard_exprs())
    ]
    f = tmp_path / "dashboard_rules.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = promtool("check", "rules", str(f))
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- metric names: everything queried is exposed ----------------------------------------------------


def test_promql_metric_name_extraction():
    e = (
        'histogram_quantile(0.95, sum by (le, mode) (rate(graphcache_step_seconds_bucket{job=~"$job", '
        'mode="replay"}[$__rate_interval]))) / on (instance) group_left graphcache_ready offset 5m > bool 1e3'
    )
    assert metric_names(e) == {"graphcache_step_seconds_bucket", "graphcache_ready"}
    assert metric_names('up{job=~".*graphcache.*"} == 0') == {"up"}
    assert metric_names("sum without (reason) (rate(a_total[10m])) and (rate(b_total[10m]) > 0.05)") == {
        "a_total",
        "b_total",
    }


def test_static_exposition_names(static_samples):
    # counters gain _total, histograms _bucket/_sum/_count: the mapping the checks below rely on
    assert {
        "graphcache_graph_cache_hits_total",
        "graphcache_step_seconds_bucket",
        "graphcache_step_seconds_count",
        "graphcache_graph_pool_bytes",
    } <= static_samples
    assert "graphcache_graph_cache_hits" not in static_samples


def test_dashboard_metrics_exist(static_samples):
    missing = {
        (title, n)
        for title, e in dashboard_exprs()
        for n in metric_names(e)
        if n not in static_samples and n not in SYNTHETIC
    }
    assert not missing, f"dashboard queries metrics the server does not expose: {sorted(missing)}"


def test_alert_metrics_exist(static_samples):
    missing = {
        (r["alert"], n)
        for r in alert_rules()
        for n in metric_names(r["expr"])
        if n not in static_samples and n not in SYNTHETIC
    }
    assert not missing, f"alerts query metrics the server does not expose: {sorted(missing)}"


def test_every_instrument_is_on_the_dashboard(static_samples):
    """Each graphcache_ metric family appears in at least one panel (a new instrument gets a panel). The
    vllm:, process_ and python_ series are on graphcache-vllm-dashboard.json (test_vllm_dashboard.py)."""
    queried = {n for _, e in dashboard_exprs() for n in metric_names(e)}
    families = {
        re.sub(r"_(total|bucket|sum|count|created)$", "", n)
        for n in static_samples
        if n.startswith("graphcache_")
    }
    uncovered = {
        f
        for f in families
        if not any(q == f or re.fullmatch(re.escape(f) + r"_(total|bucket|sum|count)", q) for q in queried)
    }
    assert uncovered <= {"graphcache_graph_backend_info"}, sorted(uncovered)


# --- compose and Grafana provisioning ---------------------------------------------------------------


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def test_compose_stack():
    compose = yaml.load((DEPLOY / "compose.yaml").read_text(), Loader=_ComposeLoader)
    services = compose["services"]
    assert set(services) == {"graphcache", "prometheus", "grafana"}
    gc = services["graphcache"]
    assert gc["build"] == {"context": "..", "dockerfile": "Dockerfile"}
    assert (DEPLOY / gc["build"]["context"] / gc["build"]["dockerfile"]).is_file()
    assert "8000:8000" in gc["ports"] and any(v.endswith(":/models:ro") for v in gc["volumes"])
    # GRAPHCACHE_MODEL="" parses as Path("."), not "unset": pass it through only when the shell sets it.
    assert gc["environment"]["GRAPHCACHE_MODEL"] is None
    assert gc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    for name in ("prometheus", "grafana"):
        image = services[name]["image"]
        assert re.search(r":v?\d+\.\d+\.\d+$", image), f"{name} image pinned: {image}"
        for vol in services[name]["volumes"]:
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (DEPLOY / src).exists(), f"{name} mounts a missing {src}"
    prom_cmd = " ".join(services["prometheus"]["command"])
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom_cmd
    scrape = yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]
    gc_job = next(j for j in scrape if j["job_name"] == "graphcache")
    assert gc_job["static_configs"][0]["targets"] == ["graphcache:8000"], "the compose service name and port"
    cpu = yaml.load((DEPLOY / "compose.cpu.yaml").read_text(), Loader=_ComposeLoader)
    assert cpu["services"]["graphcache"]["environment"]["GRAPHCACHE_DEVICE"] == "cpu"


def test_grafana_provisioning_points_at_the_dashboard():
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    dash = json.loads(DASHBOARD.read_text())
    current = next(v for v in dash["templating"]["list"] if v["name"] == "datasource")["current"]["value"]
    assert current == source["uid"]
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/graphcache.yml").read_text())
    path = prov["providers"][0]["options"]["path"]
    compose = yaml.load((DEPLOY / "compose.yaml").read_text(), Loader=_ComposeLoader)
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboard.json:{path}/graphcache.json:ro" in mounts


def test_deploy_doc_scrape_job_is_valid(tmp_path):
    """The kubernetes_sd scrape job in docs/DEPLOY.md parses. Debian's promtool is built without
    Kubernetes service discovery, so the SD block is swapped for a static target; the relabelings stay."""
    doc = (DEPLOY.parent / "docs" / "DEPLOY.md").read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    jobs = yaml.safe_load(block)
    assert jobs[0]["kubernetes_sd_configs"] == [{"role": "pod"}]
    jobs[0]["static_configs"] = [{"targets": ["10.0.0.1:8000"]}]
    del jobs[0]["kubernetes_sd_configs"]
    f = tmp_path / "k8s.yml"
    f.write_text(yaml.safe_dump({"scrape_configs": jobs}))
    proc = promtool("check", "config", str(f))
    assert proc.returncode == 0, proc.stdout + proc.stderr
