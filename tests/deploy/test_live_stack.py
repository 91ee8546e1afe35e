"""A real graphcache server (tiny model, CPU) scraped by a real Prometheus, both on loopback.

One server and one Prometheus for the whole module (module-scoped fixtures). Checks: Prometheus reads
graphcache_ metrics back through its HTTP API; the alert rules evaluate cleanly on live series; every
dashboard query runs and returns data; every metric the dashboard and the alerts name is on the live
/metrics; the Dockerfile's HEALTHCHECK command and the chart's probe paths work against the server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .conftest import CHART, DEPLOY, ROOT, require_tool
from .promql import exposed_sample_names, metric_names
from .test_deploy_static import SYNTHETIC, alert_rules, dashboard_exprs, grafana_to_promql
from .test_dockerfile import only

pytestmark = pytest.mark.slow

ADMIN_TOKEN = "deploy-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        try:
            result = check()
            if result:
                return result
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            last = e
        time.sleep(0.25)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    pytest.fail(
        f"timed out waiting for {what} (last error: {last!r}; exit: {proc.poll() if proc else None})\n{tail}"
    )


def sample_value(exposition: str, name: str) -> float:
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def start_prometheus(tmp: Path, target_port: int) -> dict | None:
    """A real Prometheus (Debian package) scraping 127.0.0.1:target_port every second, with deploy's
    alert rules. Started before the server: Prometheus applies its first targets ~5 s after start, and
    that wait overlaps the server's model load. None when the binary is absent (its tests then skip)."""
    from .conftest import find_tool

    binary = find_tool("prometheus")
    if binary is None:
        return None
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(DEPLOY / "prometheus" / "alerts.yml")],
        "scrape_configs": [
            {
                "job_name": "graphcache",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}],
            }
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = tmp / "prometheus.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return {"api": f"http://127.0.0.1:{port}", "proc": proc, "log": log}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One Prometheus and one `graphcache serve` (embedded tiny model, CPU) on free loopback ports."""
    tmp = tmp_path_factory.mktemp("stack")
    port = free_port()
    prom = start_prometheus(tmp, port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHCACHE_")}
    env.update(
        GRAPHCACHE_CACHE_DIR=str(tmp / "cache"),
        GRAPHCACHE_ADMIN_TOKEN=ADMIN_TOKEN,
        GRAPHCACHE_DEVICE="cpu",
        GRAPHCACHE_MAX_NUM_SEQS="8",
        GRAPHCACHE_MAX_CAPTURE_SIZE="8",
        GRAPHCACHE_LOG_LEVEL="warning",
        # speculation on, so the vllm:spec_decode_* series the dashboard's panels query exist
        GRAPHCACHE_SPECULATIVE_CONFIG='{"method": "ngram", "num_speculative_tokens": 2}',
    )
    log = tmp / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "graphcache.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: httpx.get(base + "/ready", timeout=2).status_code == 200,
            180,
            "graphcache /ready",
            proc,
            log,
        )
        model = httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
        # Traffic, so the request histograms and token counters have samples.
        for i in range(4):
            r = httpx.post(
                base + "/v1/completions",
                timeout=60,
                json={"model": model, "prompt": f"deployment test {i}", "max_tokens": 8},
            )
            assert r.status_code == 200, r.text
        tokens = sample_value(
            httpx.get(base + "/metrics", timeout=10).text, "graphcache_generation_tokens_total"
        )
        assert tokens > 0
        yield {
            "server": {"base": base, "port": port, "proc": proc, "log": log, "tokens": tokens},
            "prometheus": prom,
        }
    finally:
        stop(proc)
        if prom is not None:
            stop(prom["proc"])


@pytest.fixture(scope="module")
def server(stack):
    return stack["server"]


@pytest.fixture(scope="module")
def prometheus(stack):
    prom = stack["prometheus"]
    if prom is None:
        require_tool("prometheus")  # skips, naming scripts/ci-deploy-deps.sh
    api, proc, log = prom["api"], prom["proc"], prom["log"]
    wait_for(
        lambda: httpx.get(api + "/-/ready", timeout=2).status_code == 200, 60, "prometheus ready", proc, log
    )
    # Two scrapes after the traffic, so rate() over the dashboard's 1m windows has two samples and the
    # token counters are seen after the completions.
    tokens = stack["server"]["tokens"]
    wait_for(
        lambda: (
            float(query(api, "count_over_time(graphcache_ready[1m])")[0]["value"][1]) >= 2
            and float(query(api, "graphcache_generation_tokens_total")[0]["value"][1]) == tokens
        ),
        60,
        "two scrapes of graphcache, the last after the traffic",
        proc,
        log,
    )
    return prom


def query(api: str, promql: str) -> list[dict]:
    r = httpx.get(api + "/api/v1/query", params={"query": promql}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (promql, body)
    return body["data"]["result"]


# --- Prometheus reads graphcache metrics back -------------------------------------------------------


def test_prometheus_scrapes_graphcache(prometheus, server):
    (up,) = query(prometheus["api"], 'up{job="graphcache"}')
    assert up["value"][1] == "1"
    (ready,) = query(prometheus["api"], 'graphcache_ready{job="graphcache"}')
    assert ready["value"][1] == "1" and ready["metric"]["job"] == "graphcache"
    (tokens,) = query(prometheus["api"], "graphcache_generation_tokens_total")
    assert float(tokens["value"][1]) == server["tokens"], "Prometheus holds the server's own count"
    captures = query(prometheus["api"], "graphcache_graph_captures_total")
    assert float(captures[0]["value"][1]) >= 1, "warmup captured graphs"
    modes = {s["metric"]["mode"] for s in query(prometheus["api"], "graphcache_step_seconds_count")}
    assert modes == {"replay", "eager"}


def test_alert_rules_evaluate_on_live_series(prometheus):
    """Every rule of deploy/prometheus/alerts.yml is loaded and evaluates without error."""
    want = {r["alert"] for r in alert_rules()}

    def evaluated():
        groups = httpx.get(prometheus["api"] + "/api/v1/rules", timeout=5).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        done = all(not r["lastEvaluation"].startswith("0001") for r in rules)
        return rules if done and {r["name"] for r in rules} == want else None

    rules = wait_for(evaluated, 30, "alert rules evaluated", prometheus["proc"], prometheus["log"])
    assert {r["name"]: r["health"] for r in rules} == dict.fromkeys(want, "ok"), {
        r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"
    }
    firing = [r["name"] for r in rules if r["state"] == "firing"]
    assert firing == [], f"a healthy server fires no alert: {firing}"


def test_dashboard_queries_return_data(prometheus):
    """Each dashboard query, with Grafana's variables filled in, returns at least one series."""
    empty = []
    for title, expr in dashboard_exprs():
        if not query(prometheus["api"], grafana_to_promql(expr)):
            empty.append((title, expr))
    assert empty == []


# --- names on the live /metrics ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_samples(server) -> set[str]:
    r = httpx.get(server["base"] + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return exposed_sample_names(r.text)


def test_dashboard_metrics_on_live_server(live_samples):
    queried = {n for _, e in dashboard_exprs() for n in metric_names(e)} - SYNTHETIC
    assert len(queried) > 15
    assert queried - live_samples == set()


def test_alert_metrics_on_live_server(live_samples):
    queried = {n for r in alert_rules() for n in metric_names(r["expr"])} - SYNTHETIC
    assert queried - live_samples == set()


def test_autoscaling_metric_on_live_server(live_samples):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["autoscaling"]["metricName"] in live_samples
    assert "graphcache_num_requests_waiting" in live_samples


# --- container and chart health checks against the server ------------------------------------------


def test_dockerfile_healthcheck_command(server):
    cmd = json.loads(only("HEALTHCHECK").split("CMD", 1)[1])
    assert cmd[0] == "python"
    run = [sys.executable, *cmd[1:]]
    env = dict(os.environ, GRAPHCACHE_PORT=str(server["port"]))
    assert subprocess.run(run, env=env, timeout=30, capture_output=True).returncode == 0
    env["GRAPHCACHE_PORT"] = str(free_port())  # nothing listens there
    assert subprocess.run(run, env=env, timeout=30, capture_output=True).returncode != 0


def test_chart_probe_paths_answer(server):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for probe in ("startup", "liveness", "readiness"):
        path = values["probes"][probe]["path"]
        assert httpx.get(server["base"] + path, timeout=5).status_code == 200, (probe, path)


def test_admin_token_from_env_guards_admin(server):
    """The chart passes the Secret as GRAPHCACHE_ADMIN_TOKEN; the server honours it."""
    assert httpx.get(server["base"] + "/admin/cache", timeout=5).status_code in (401, 403)
    r = httpx.get(
        server["base"] + "/admin/cache", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
    )
    assert r.status_code == 200, r.text


def test_server_log_has_no_errors(server):
    text = server["log"].read_text()
    assert not re.search(r"\b(ERROR|CRITICAL|Traceback)\b", text), text[-2000:]
