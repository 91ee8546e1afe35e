"""The Helm chart, rendered and linted by Helm's own Go SDK (helm-python-sdk), offline.

Three value sets: the defaults, a production-like set (PVC model, existing Secret, MIG GPU, ServiceMonitor,
KEDA) and a third (hostPath model, HPA, generated token from a value, no GPU). Assertions read the
rendered manifests with PyYAML. The env the chart sets is fed back through graphcache.config.Settings, so
a value that the server would misread (a list not in JSON, a number in exponent form) fails here.
"""

from __future__ import annotations

import base64
import os
import re

import pytest
import yaml
from graphcache.config import Settings

from .conftest import CHART

helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed: pip install -e '.[test]'")

# Settings the chart sets itself from other sections; every other Settings field is a `config` key.
CHART_MANAGED = {"model", "served_model_name", "cache_dir", "host", "port", "admin_token", "api_key"}

CUSTOM = {
    "replicaCount": 3,
    "image": {"repository": "registry.example.com/ml/graphcache", "tag": "1.2.3"},
    "gpu": {"resourceName": "nvidia.com/mig-3g.71gb", "count": 2},
    "model": {
        "source": "pvc",
        "path": "Qwen2.5-0.5B-Instruct",
        "servedModelName": "qwen",
        "pvc": {"create": True, "storageClassName": "fast", "accessModes": ["ReadOnlyMany"], "size": "20Gi"},
    },
    "adminToken": {"existingSecret": "gc-admin", "existingSecretKey": "token"},
    "config": {
        "max_num_seqs": 128,
        "capture_sizes": [1, 2, 4, 8, 16],
        "cache_max_bytes": 8589934592,
        "admission": "after_n",
        "enforce_eager": False,
        "warmup_descriptors": ["64:8", "8:8:decode"],
        "kv_cache_memory_fraction": 0.8,
        "log_level": "debug",
        "cors_origins": [],
    },
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}, "interval": "5s"},
    "prometheusRule": {"enabled": True},
    "keda": {"enabled": True, "threshold": 8},
    "podDisruptionBudget": {"minAvailable": 1},
    "extraEnv": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
    "extraArgs": ["--log-level", "debug"],
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "runtimeClassName": "nvidia",
}

THIRD = {
    "model": {"source": "hostPath", "hostPath": {"path": "/data/llm"}, "path": "llama-3.2-1b"},
    "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetRequestsWaiting": "2"},
    "adminToken": {"value": "s3cret-token"},
    "gpu": {"enabled": False},
    "metrics": {"podAnnotations": False},
    "podDisruptionBudget": {"enabled": False},
    "lifecycle": {"preStopSleepSeconds": 0},
    "config": {"device": "cpu", "warmup_decode_sizes": []},
}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


def render(chart, values=None, name="rel", namespace="ml") -> dict[tuple[str, str], dict]:
    """Rendered objects keyed by (kind, name); NOTES.txt under ("NOTES", "")."""
    out: dict[tuple[str, str], dict] = {}
    for path, text in chart.render(values, name=name, namespace=namespace, is_install=True).items():
        if path.endswith("NOTES.txt"):
            out[("NOTES", "")] = {"text": text}
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                key = (doc["kind"], doc["metadata"]["name"])
                assert key not in out, f"duplicate object {key}"
                out[key] = doc
    return out


def container(objs) -> dict:
    dep = objs[("Deployment", "rel-graphcache")]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c) -> dict[str, dict]:
    names = [e["name"] for e in c["env"]]
    assert len(names) == len(set(names)), f"duplicate env names: {names}"
    return {e["name"]: e for e in c["env"]}


def kinds(objs) -> set[str]:
    return {k for k, _ in objs}


# --- lint -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, CUSTOM, THIRD], ids=["defaults", "custom", "third"])
def test_helm_lint_strict(values):
    report = helm.lint(CHART, values, strict=True, namespace="ml", kube_version="v1.30.0")
    assert report["errors"] == [], report
    # Severity 2 = warning, 3 = error; only "icon is recommended" (info) is allowed.
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report["messages"]


def test_chart_metadata(chart):
    meta = chart.metadata
    assert meta["apiVersion"] == "v2" and meta["name"] == "graphcache" and meta["type"] == "application"
    pyproject = (CHART.parents[1] / "pyproject.toml").read_text()
    assert f'version = "{meta["appVersion"]}"' in pyproject, "appVersion should follow the package version"
    assert chart.schema is not None


# --- defaults ---------------------------------------------------------------------------------------


def test_defaults_render_expected_objects(chart):
    objs = render(chart)
    assert kinds(objs) == {
        "NOTES",
        "Deployment",
        "Service",
        "ServiceAccount",
        "Secret",
        "PodDisruptionBudget",
        "Pod",
    }, "ServiceMonitor/HPA/ScaledObject/PVC must be off by default"
    assert objs[("Deployment", "rel-graphcache")]["spec"]["replicas"] == 1


def test_defaults_gpu_resources(chart):
    res = container(render(chart))["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 1
    assert res["requests"]["nvidia.com/gpu"] == 1
    assert res["limits"]["memory"] == "16Gi" and res["requests"]["cpu"] == "2"


def test_defaults_probes(chart):
    c = container(render(chart))
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 300, (
        "startup must allow minutes (image pull done, but model load and warmup are slow)"
    )
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}


def test_defaults_env_and_generated_secret(chart):
    objs = render(chart)
    env = env_of(container(objs))
    assert env["GRAPHCACHE_HOST"]["value"] == "0.0.0.0"
    assert env["GRAPHCACHE_PORT"]["value"] == "8000"
    assert env["GRAPHCACHE_CACHE_DIR"]["value"] == "/var/cache/graphcache"
    assert "GRAPHCACHE_MODEL" not in env, "model.source=none serves the embedded tiny model"
    ref = env["GRAPHCACHE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = objs[("Secret", ref["name"])]
    token = base64.b64decode(secret["data"][ref["key"]]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{32}", token)
    # null config values stay out of the env: the server's defaults apply.
    assert not [
        n
        for n in env
        if n.startswith("GRAPHCACHE_")
        and n.lower()[11:] in Settings.flat_fields()
        and n.lower()[11:] not in CHART_MANAGED
    ]


def test_defaults_security_and_scratch_volumes(chart):
    objs = render(chart)
    spec = objs[("Deployment", "rel-graphcache")]["spec"]["template"]["spec"]
    c = container(objs)
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/var/cache/graphcache", "/tmp", "/dev/shm"} <= mounts
    assert spec["automountServiceAccountToken"] is False


def test_defaults_service_pdb_and_pod_annotations(chart):
    objs = render(chart)
    dep = objs[("Deployment", "rel-graphcache")]
    sel = dep["spec"]["selector"]["matchLabels"]
    svc = objs[("Service", "rel-graphcache")]
    assert svc["spec"]["selector"] == sel
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    pdb = objs[("PodDisruptionBudget", "rel-graphcache")]
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": sel}}
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    assert dep["spec"]["template"]["metadata"]["labels"].items() >= sel.items()


def test_helm_test_pod_hits_health_through_service(chart):
    objs = render(chart)
    pod = objs[("Pod", "rel-graphcache-test-health")]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    cmd = " ".join(pod["spec"]["containers"][0]["command"])
    assert "http://rel-graphcache:8000/health" in cmd
    sel = objs[("Service", "rel-graphcache")]["spec"]["selector"]
    assert not pod["metadata"]["labels"].items() >= sel.items(), "the Service must not route to the test pod"


def test_notes_render(chart):
    text = render(chart)[("NOTES", "")]["text"]
    assert "rel-graphcache" in text and "/v1/models" in text and "helm test rel -n ml" in text


def test_image_defaults_to_app_version(chart):
    c = container(render(chart))
    assert c["image"] == f"graphcache:{chart.metadata['appVersion']}"


# --- custom values ----------------------------------------------------------------------------------


def test_custom_gpu_type_and_count(chart):
    res = container(render(chart, CUSTOM))["resources"]
    assert res["limits"]["nvidia.com/mig-3g.71gb"] == 2 and res["requests"]["nvidia.com/mig-3g.71gb"] == 2
    assert "nvidia.com/gpu" not in res["limits"]


def test_custom_env_from_values(chart):
    c = container(render(chart, CUSTOM))
    env = env_of(c)
    assert c["image"] == "registry.example.com/ml/graphcache:1.2.3"
    assert c["args"] == ["--log-level", "debug"]
    assert env["GRAPHCACHE_MODEL"]["value"] == "/models/Qwen2.5-0.5B-Instruct"
    assert env["GRAPHCACHE_SERVED_MODEL_NAME"]["value"] == "qwen"
    assert env["GRAPHCACHE_MAX_NUM_SEQS"]["value"] == "128"
    assert env["GRAPHCACHE_CAPTURE_SIZES"]["value"] == "[1,2,4,8,16]"
    assert env["GRAPHCACHE_CACHE_MAX_BYTES"]["value"] == "8589934592", "no exponent form for big integers"
    assert env["GRAPHCACHE_ADMISSION"]["value"] == "after_n"
    assert env["GRAPHCACHE_ENFORCE_EAGER"]["value"] == "false"
    assert env["GRAPHCACHE_CORS_ORIGINS"]["value"] == "[]"
    assert env["HF_HUB_OFFLINE"]["value"] == "1"


def test_custom_env_parses_as_server_settings(chart, monkeypatch):
    """The env the chart renders is what the server reads: feed it through Settings."""
    env = env_of(container(render(chart, CUSTOM)))
    for key in list(os.environ):
        if key.startswith("GRAPHCACHE_"):
            monkeypatch.delenv(key)
    for name, e in env.items():
        if name.startswith("GRAPHCACHE_") and "value" in e:
            monkeypatch.setenv(name, e["value"])
    s = Settings()
    assert s.model.path == "/models/Qwen2.5-0.5B-Instruct" and s.model.served_model_name == "qwen"
    assert s.http.host == "0.0.0.0" and s.http.port == 8000
    assert s.engine.max_num_seqs == 128 and s.graph_cache.capture_sizes == [1, 2, 4, 8, 16]
    assert s.graph_cache.max_bytes == 8 << 30 and s.graph_cache.admission == "after_n"
    assert s.graph_cache.enforce_eager is False
    assert (
        s.graph_cache.warmup_descriptors == ["64:8", "8:8:decode"]
        and s.engine.kv_cache_memory_fraction == 0.8
    )
    assert s.http.cors_origins == [] and s.logging.log_level == "debug"


def test_custom_existing_secret_is_used_not_created(chart):
    objs = render(chart, CUSTOM)
    ref = env_of(container(objs))["GRAPHCACHE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "gc-admin", "key": "token"}
    assert "Secret" not in kinds(objs)


def test_custom_model_pvc(chart):
    objs = render(chart, CUSTOM)
    spec = objs[("Deployment", "rel-graphcache")]["spec"]["template"]["spec"]
    vol = next(v for v in spec["volumes"] if v["name"] == "models")
    pvc = objs[("PersistentVolumeClaim", "rel-graphcache-models")]
    assert vol["persistentVolumeClaim"] == {"claimName": "rel-graphcache-models", "readOnly": True}
    assert pvc["spec"]["storageClassName"] == "fast" and pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    mount = next(m for m in container(objs)["volumeMounts"] if m["name"] == "models")
    assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert spec["runtimeClassName"] == "nvidia" and spec["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_existing_claim_creates_no_pvc(chart):
    values = {"model": {"source": "pvc", "pvc": {"existingClaim": "models-ro", "create": True}}}
    objs = render(chart, values)
    assert "PersistentVolumeClaim" not in kinds(objs)
    spec = objs[("Deployment", "rel-graphcache")]["spec"]["template"]["spec"]
    vol = next(v for v in spec["volumes"] if v["name"] == "models")
    assert vol["persistentVolumeClaim"]["claimName"] == "models-ro"
    assert env_of(container(objs))["GRAPHCACHE_MODEL"]["value"] == "/models"


def test_custom_servicemonitor_and_keda(chart):
    objs = render(chart, CUSTOM)
    sm = objs[("ServiceMonitor", "rel-graphcache")]
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "5s", "scrapeTimeout": "10s"}
    ]
    assert sm["spec"]["selector"]["matchLabels"] == objs[("Service", "rel-graphcache")]["spec"]["selector"]
    so = objs[("ScaledObject", "rel-graphcache")]
    trig = so["spec"]["triggers"][0]
    assert trig["type"] == "prometheus"
    assert trig["metadata"]["query"].startswith("sum(graphcache_num_requests_waiting{"), (
        "a total; KEDA divides"
    )
    assert 'namespace="ml"' in trig["metadata"]["query"] and trig["metadata"]["threshold"] == "8"
    assert so["spec"]["scaleTargetRef"]["name"] == "rel-graphcache"
    assert "replicas" not in objs[("Deployment", "rel-graphcache")]["spec"], "the autoscaler owns replicas"
    assert "HorizontalPodAutoscaler" not in kinds(objs)
    pdb = objs[("PodDisruptionBudget", "rel-graphcache")]
    assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]


@pytest.mark.parametrize("flag", [True, False])
def test_servicemonitor_toggled_by_flag(chart, flag):
    assert ("ServiceMonitor" in kinds(render(chart, {"serviceMonitor": {"enabled": flag}}))) is flag


# --- third set --------------------------------------------------------------------------------------


def test_third_hostpath_hpa_token_value_no_gpu(chart):
    objs = render(chart, THIRD)
    dep = objs[("Deployment", "rel-graphcache")]
    spec = dep["spec"]["template"]["spec"]
    c = container(objs)
    vol = next(v for v in spec["volumes"] if v["name"] == "models")
    assert vol["hostPath"] == {"path": "/data/llm", "type": "Directory"}
    assert env_of(c)["GRAPHCACHE_MODEL"]["value"] == "/models/llama-3.2-1b"
    assert env_of(c)["GRAPHCACHE_WARMUP_DECODE_SIZES"]["value"] == "[]"
    assert not any("nvidia.com" in k for k in c["resources"].get("limits", {}))
    assert "lifecycle" not in c, "preStopSleepSeconds=0 turns the preStop hook off"
    assert "prometheus.io/scrape" not in (dep["spec"]["template"]["metadata"].get("annotations") or {})
    hpa = objs[("HorizontalPodAutoscaler", "rel-graphcache")]
    assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["maxReplicas"] == 6
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "graphcache_num_requests_waiting"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "2"}
    assert "replicas" not in dep["spec"] and "ScaledObject" not in kinds(objs)
    assert "PodDisruptionBudget" not in kinds(objs)
    secret = objs[("Secret", "rel-graphcache-admin")]
    assert base64.b64decode(secret["data"]["admin-token"]).decode() == "s3cret-token"


def test_admin_token_off_sets_no_env_and_no_secret(chart):
    objs = render(chart, {"adminToken": {"enabled": False}})
    assert "Secret" not in kinds(objs) and "GRAPHCACHE_ADMIN_TOKEN" not in env_of(container(objs))


# --- guards -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"gpu": {"count": 0}},
        {"config": {"admission": "sometimes"}},
        {"config": {"host": "127.0.0.1"}},  # chart-managed, not a config key
        {"config": {"capture_sizes": "1,2,4"}},  # lists are lists, rendered as JSON
        {"config": {"kv_cache_memory_fraction": 1.5}},
        {"model": {"source": "s3"}},
        {"probes": {"readiness": {"path": "ready"}}},
        {"serviceMonitor": {"interval": "fast"}},
        {"unknownTopLevel": 1},
    ],
    ids=lambda v: str(v)[:40],
)
def test_schema_rejects(chart, bad):
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)
    with pytest.raises(helm.HelmValuesError):
        chart.render(bad, name="rel", namespace="ml")


@pytest.mark.parametrize(
    "values, message",
    [
        ({"autoscaling": {"enabled": True}, "keda": {"enabled": True}}, "exclusive"),
        ({"model": {"source": "pvc"}}, "existingClaim"),
    ],
)
def test_render_fails_with_a_fix(chart, values, message):
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values, name="rel", namespace="ml")


# --- values.yaml documents every setting ------------------------------------------------------------


def test_config_keys_are_exactly_the_server_settings():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values["config"]) == set(Settings.flat_fields()) - CHART_MANAGED
    assert all(v is None for v in values["config"].values()), "config defaults defer to the server's"


def _chart_owned_keys(schema: dict, prefix: tuple = ()) -> set[tuple[str, ...]]:
    """Key paths the chart defines (schema objects with `properties`); Kubernetes passthrough objects
    (securityContext, resources' contents, behavior, ...) are documented by Kubernetes."""
    out = set()
    for key, sub in schema.get("properties", {}).items():
        out.add((*prefix, key))
        if isinstance(sub, dict) and "properties" in sub:
            out |= _chart_owned_keys(sub, (*prefix, key))
    return out


def test_values_documented():
    """Every key the chart defines in values.yaml has a comment: on the line above or at its end."""
    import json

    owned = _chart_owned_keys(json.loads((CHART / "values.schema.json").read_text()))
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z_][\w.-]*):(.*)$", line)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        path = tuple(k for _, k in stack)
        if path not in owned:
            continue
        above = lines[i - 1].strip() if i else ""
        if not (above.startswith("#") or "#" in rest):
            undocumented.append(".".join(path))
    assert undocumented == [], "undocumented values: " + ", ".join(undocumented)
    assert len(owned) > 100


# --- PrometheusRule ---------------------------------------------------------------------------------


def test_chart_alerts_copy_matches_deploy():
    """The chart ships deploy/prometheus/alerts.yml as files/alerts.yml (Helm reads files only inside the
    chart); after editing the rules, copy them: cp deploy/prometheus/alerts.yml helm/graphcache/files/."""
    deploy_rules = (CHART.parents[1] / "deploy" / "prometheus" / "alerts.yml").read_text()
    assert (CHART / "files" / "alerts.yml").read_text() == deploy_rules


@pytest.mark.parametrize("flag", [True, False])
def test_prometheusrule_toggled_by_flag(chart, flag):
    objs = render(chart, {"prometheusRule": {"enabled": flag, "labels": {"release": "kps"}}})
    assert ("PrometheusRule" in kinds(objs)) is flag
    if flag:
        rule = objs[("PrometheusRule", "rel-graphcache")]
        assert rule["metadata"]["labels"]["release"] == "kps"
        deploy_rules = yaml.safe_load((CHART.parents[1] / "deploy" / "prometheus" / "alerts.yml").read_text())
        assert rule["spec"]["groups"] == deploy_rules["groups"]
        descriptions = [r["annotations"]["description"] for g in rule["spec"]["groups"] for r in g["rules"]]
        assert any("{{ $labels.instance }}" in d for d in descriptions), "alert templates left for Prometheus"


# --- API key ----------------------------------------------------------------------------------------


def test_api_key_from_existing_secret(chart, monkeypatch):
    """apiKey.existingSecret sets GRAPHCACHE_API_KEY from that Secret (no Secret created, no plain value);
    without it there is no such env var; config.api_key takes no plain key."""
    assert "GRAPHCACHE_API_KEY" not in env_of(container(render(chart)))
    objs = render(chart, {"apiKey": {"existingSecret": "gc-api-keys", "secretKey": "keys"}})
    env = env_of(container(objs))
    assert env["GRAPHCACHE_API_KEY"] == {
        "name": "GRAPHCACHE_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "gc-api-keys", "key": "keys"}},
    }
    assert ("Secret", "gc-api-keys") not in objs
    report = helm.lint(
        CHART,
        {"apiKey": {"existingSecret": "gc-api-keys"}},
        strict=True,
        namespace="ml",
        kube_version="v1.30.0",
    )
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report
    ref = env_of(container(render(chart, {"apiKey": {"existingSecret": "gc-api-keys"}})))[
        "GRAPHCACHE_API_KEY"
    ]
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "gc-api-keys", "key": "api-key"}
    for bad in (
        {"config": {"api_key": "plain-text-key"}},
        {"apiKey": {"secretKey": ""}},
        {"apiKey": {"value": "k"}},
    ):
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(bad)
    # What the Secret holds is what the server reads: one key, or several comma-separated.
    monkeypatch.setenv("GRAPHCACHE_API_KEY", "key-a,key-b")
    assert Settings().http.api_key == ["key-a", "key-b"]


# --- warmup profile ---------------------------------------------------------------------------------


def test_warmup_profile_from_configmap(chart, monkeypatch):
    """warmupProfile.configMap mounts that ConfigMap's key read-only and points GRAPHCACHE_WARMUP_PROFILE
    at the file; without it there is neither; config.warmup_profile and the ConfigMap are exclusive."""
    c = container(render(chart))
    assert "GRAPHCACHE_WARMUP_PROFILE" not in env_of(c)
    assert "warmup-profile" not in {m["name"] for m in c["volumeMounts"]}
    objs = render(chart, {"warmupProfile": {"configMap": "gc-profile"}})
    pod = objs[("Deployment", "rel-graphcache")]["spec"]["template"]["spec"]
    c = container(objs)
    assert env_of(c)["GRAPHCACHE_WARMUP_PROFILE"]["value"] == "/etc/graphcache/warmup/profile.json"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "warmup-profile")
    assert mount == {"name": "warmup-profile", "mountPath": "/etc/graphcache/warmup", "readOnly": True}
    volume = next(v for v in pod["volumes"] if v["name"] == "warmup-profile")
    assert volume["configMap"] == {
        "name": "gc-profile",
        "items": [{"key": "profile.json", "path": "profile.json"}],
    }
    objs = render(chart, {"warmupProfile": {"configMap": "p", "key": "hot.json", "mountPath": "/profiles/"}})
    assert env_of(container(objs))["GRAPHCACHE_WARMUP_PROFILE"]["value"] == "/profiles/hot.json"
    report = helm.lint(
        CHART,
        {"warmupProfile": {"configMap": "gc-profile"}},
        strict=True,
        namespace="ml",
        kube_version="v1.30.0",
    )
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report
    with pytest.raises(helm.HelmError, match="exclusive"):
        chart.render(
            {"warmupProfile": {"configMap": "p"}, "config": {"warmup_profile": "/x.json"}},
            name="rel",
            namespace="ml",
        )
    for bad in (
        {"warmupProfile": {"key": ""}},
        {"warmupProfile": {"mountPath": "relative"}},
        {"warmupProfile": {"configMap": "p", "value": "{}"}},
    ):
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(bad)
    # The env the chart sets is what the server reads.
    monkeypatch.setenv("GRAPHCACHE_WARMUP_PROFILE", "/etc/graphcache/warmup/profile.json")
    assert str(Settings().graph_cache.warmup_profile) == "/etc/graphcache/warmup/profile.json"


# --- Ingress ----------------------------------------------------------------------------------------

INGRESS = {
    "enabled": True,
    "className": "nginx",
    "annotations": {
        "nginx.ingress.kubernetes.io/proxy-buffering": "off",
        "cert-manager.io/cluster-issuer": "letsencrypt",
    },
    "hosts": [
        {
            "host": "llm.example.com",
            "paths": [{"path": "/v1", "pathType": "Prefix"}, {"path": "/health", "pathType": "Exact"}],
        },
        {"host": "", "paths": [{"path": "/"}]},
    ],
    "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}],
}


def test_ingress_off_by_default(chart):
    assert "Ingress" not in kinds(render(chart))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["ingress"]["enabled"] is False


def test_ingress_routes_hosts_and_paths_to_the_service(chart):
    objs = render(chart, {"ingress": INGRESS})
    ing = objs[("Ingress", "rel-graphcache")]
    assert ing["apiVersion"] == "networking.k8s.io/v1"
    assert ing["metadata"]["annotations"] == INGRESS["annotations"]
    assert ing["spec"]["ingressClassName"] == "nginx"
    assert ing["spec"]["tls"] == INGRESS["tls"]
    first, catch_all = ing["spec"]["rules"]
    assert first["host"] == "llm.example.com" and "host" not in catch_all, "host '' = any host: no host field"
    assert [(p["path"], p["pathType"]) for p in first["http"]["paths"]] == [
        ("/v1", "Prefix"),
        ("/health", "Exact"),
    ]
    assert catch_all["http"]["paths"][0]["pathType"] == "Prefix", "pathType defaults to Prefix"
    svc = objs[("Service", "rel-graphcache")]
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    for rule in ing["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend["name"] == svc["metadata"]["name"] and backend["port"]["name"] in port_names
    assert "llm.example.com/v1" in objs[("NOTES", "")]["text"]


def test_ingress_without_class_or_tls(chart):
    ing = render(chart, {"ingress": {"enabled": True}})[("Ingress", "rel-graphcache")]
    assert "ingressClassName" not in ing["spec"] and "tls" not in ing["spec"]
    assert ing["spec"]["rules"][0]["host"] == "graphcache.example.com"


# --- Grafana dashboard ConfigMap --------------------------------------------------------------------

DASHBOARDS = CHART / "dashboards"


def test_chart_dashboards_match_deploy():
    """The chart ships deploy/grafana's dashboards as dashboards/*.json (Helm reads files only inside the
    chart); after editing one, copy it: cp deploy/grafana/graphcache-vllm-dashboard.json helm/graphcache/dashboards/."""
    shipped = sorted(p.name for p in DASHBOARDS.glob("*.json"))
    assert "graphcache-vllm-dashboard.json" in shipped
    for name in shipped:
        deploy_copy = CHART.parents[1] / "deploy" / "grafana" / name
        assert deploy_copy.is_file(), f"{name} in the chart has no deploy/grafana/{name}"
        assert (DASHBOARDS / name).read_bytes() == deploy_copy.read_bytes(), (
            f"cp deploy/grafana/{name} helm/graphcache/dashboards/"
        )


def test_grafana_dashboard_configmap(chart):
    import json

    assert "ConfigMap" not in kinds(render(chart)), "off by default"
    objs = render(chart, {"grafanaDashboard": {"enabled": True}})
    cm = objs[("ConfigMap", "rel-graphcache-dashboards")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1", "the sidecar's default label"
    assert cm["metadata"]["namespace"] == "ml"
    assert set(cm["data"]) == {p.name for p in DASHBOARDS.glob("*.json")}
    for name, text in cm["data"].items():
        assert json.loads(text) == json.loads((CHART.parents[1] / "deploy" / "grafana" / name).read_text())
    custom = {
        "enabled": True,
        "namespace": "monitoring",
        "label": "dashboards",
        "labelValue": "llm",
        "labels": {"team": "ml"},
        "annotations": {"grafana_folder": "LLM"},
    }
    cm = render(chart, {"grafanaDashboard": custom})[("ConfigMap", "rel-graphcache-dashboards")]
    assert cm["metadata"]["namespace"] == "monitoring"
    labels = cm["metadata"]["labels"]
    assert labels["dashboards"] == "llm" and labels["team"] == "ml" and "grafana_dashboard" not in labels
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}


# --- model from a hub -------------------------------------------------------------------------------

HUB_SHA = "7ae557604adf67be50417f59c2c2f167def9a775"
HUB = {
    "model": {
        "source": "hub",
        "hub": {
            "repoId": "Qwen/Qwen2.5-0.5B-Instruct",
            "revision": HUB_SHA,
            "token": {"existingSecret": "hf-token", "secretKey": "hf"},
            "endpoint": "https://hub-mirror.example.com",
        },
    },
    "ingress": INGRESS,
    "grafanaDashboard": {"enabled": True},
}


def pod_spec(objs) -> dict:
    return objs[("Deployment", "rel-graphcache")]["spec"]["template"]["spec"]


def test_helm_lint_hub_ingress_dashboard():
    report = helm.lint(CHART, HUB, strict=True, namespace="ml", kube_version="v1.30.0")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report["messages"]


def test_hub_model_init_container_fills_an_emptydir(chart):
    objs = render(chart, HUB)
    spec = pod_spec(objs)
    (init,) = spec["initContainers"]
    assert init["name"] == "hub-download" and init["image"] == container(objs)["image"], (
        "the server's own image"
    )
    assert init["command"][:2] == ["python", "-c"]
    assert init["command"][2] == (CHART / "files" / "hub_download.py").read_text()
    assert init["securityContext"] == container(objs)["securityContext"]
    env = env_of(init)
    assert env["HUB_REPO_ID"]["value"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert env["HUB_REVISION"]["value"] == HUB_SHA
    assert env["HUB_LOCAL_DIR"]["value"] == "/models"
    assert env["HF_ENDPOINT"]["value"] == "https://hub-mirror.example.com"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "hf"}
    assert env["HF_HOME"]["value"].startswith("/var/cache/graphcache/"), "the root filesystem is read-only"
    assert "*.safetensors" in yaml.safe_load(env["HUB_ALLOW_PATTERNS"]["value"])
    vol = next(v for v in spec["volumes"] if v["name"] == "models")
    assert vol == {"name": "models", "emptyDir": {"sizeLimit": "50Gi"}}
    init_mount = next(m for m in init["volumeMounts"] if m["name"] == "models")
    assert init_mount["mountPath"] == "/models" and not init_mount.get("readOnly")
    main_mount = next(m for m in container(objs)["volumeMounts"] if m["name"] == "models")
    assert main_mount["readOnly"] is True
    main_env = env_of(container(objs))
    assert main_env["GRAPHCACHE_MODEL"]["value"] == "/models"
    assert main_env["GRAPHCACHE_SERVED_MODEL_NAME"]["value"] == "Qwen/Qwen2.5-0.5B-Instruct", (
        "the repo id by default"
    )
    assert "HF_TOKEN" not in main_env, "only the download needs the token"
    assert "PersistentVolumeClaim" not in kinds(objs)
    assert "hub-download" in objs[("NOTES", "")]["text"]
    assert "initContainers" not in pod_spec(render(chart)), "no init container unless source=hub"


def test_hub_model_on_a_created_claim(chart):
    values = {
        "model": {
            "source": "hub",
            "path": "qwen",
            "servedModelName": "qwen-small",
            "hub": {"repoId": "Qwen/Qwen2.5-0.5B-Instruct", "volume": "pvc", "allowPatterns": []},
            "pvc": {"create": True, "size": "30Gi"},
        }
    }
    objs = render(chart, values)
    spec = pod_spec(objs)
    vol = next(v for v in spec["volumes"] if v["name"] == "models")
    assert vol["persistentVolumeClaim"] == {"claimName": "rel-graphcache-models", "readOnly": False}, (
        "the init container writes the claim"
    )
    pvc = objs[("PersistentVolumeClaim", "rel-graphcache-models")]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "30Gi"
    env = env_of(spec["initContainers"][0])
    assert env["HUB_LOCAL_DIR"]["value"] == "/models/qwen" and env["HUB_ALLOW_PATTERNS"]["value"] == "[]"
    assert "HF_TOKEN" not in env and "HF_ENDPOINT" not in env
    main_env = env_of(container(objs))
    assert main_env["GRAPHCACHE_MODEL"]["value"] == "/models/qwen"
    assert main_env["GRAPHCACHE_SERVED_MODEL_NAME"]["value"] == "qwen-small"
    assert next(m for m in container(objs)["volumeMounts"] if m["name"] == "models")["readOnly"] is True
    report = helm.lint(CHART, values, strict=True, namespace="ml", kube_version="v1.30.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize(
    "values, message",
    [
        ({"model": {"source": "hub"}}, "repoId"),
        ({"model": {"source": "hub", "hub": {"repoId": "a/b", "volume": "pvc"}}}, "existingClaim"),
    ],
)
def test_hub_render_fails_with_a_fix(chart, values, message):
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values, name="rel", namespace="ml")


@pytest.mark.parametrize(
    "bad",
    [
        {"model": {"hub": {"volume": "s3"}}},
        {"model": {"hub": {"endpoint": "ftp://mirror"}}},
        {"model": {"hub": {"repoId": "has spaces/x"}}},
        {"model": {"hub": {"token": {"value": "hf_plaintext"}}}},
        {"ingress": {"hosts": [{"host": "a", "paths": [{"path": "no-slash"}]}]}},
        {"ingress": {"hosts": [{"host": "a", "paths": [{"path": "/", "pathType": "Regex"}]}]}},
        {"ingress": {"class": "nginx"}},
        {"grafanaDashboard": {"labels": {"team": 1}}},
        {"grafanaDashboard": {"label": "not a label"}},
    ],
    ids=lambda v: str(v)[:50],
)
def test_schema_rejects_new_sections(chart, bad):
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)


def test_hub_download_script_runs_with_the_rendered_env(chart, tmp_path):
    """The init container's exact command and env, run here against a stand-in huggingface_hub (no hub is
    reachable from the test machines): the arguments reach snapshot_download, and a download without
    config.json fails naming the fix."""
    import json
    import subprocess
    import sys

    (init,) = pod_spec(render(chart, HUB))["initContainers"]
    fake = tmp_path / "fake"
    (fake / "huggingface_hub").mkdir(parents=True)
    (fake / "huggingface_hub" / "__init__.py").write_text(
        "import json, os\n"
        "def snapshot_download(**kw):\n"
        "    os.makedirs(kw['local_dir'], exist_ok=True)\n"
        "    if os.environ.get('FAKE_WITH_CONFIG') == '1':\n"
        "        open(os.path.join(kw['local_dir'], 'config.json'), 'w').write('{}')\n"
        "    json.dump(kw, open(os.environ['FAKE_RECORD'], 'w'))\n"
        "    return kw['local_dir']\n"
    )
    env = {e["name"]: e["value"] for e in init["env"] if "value" in e}
    env.update(
        HUB_LOCAL_DIR=str(tmp_path / "models"),
        HF_HOME=str(tmp_path / "hf"),
        PYTHONPATH=str(fake),
        FAKE_RECORD=str(tmp_path / "call.json"),
        FAKE_WITH_CONFIG="1",
        PATH=os.environ["PATH"],
    )
    cmd = [sys.executable, *init["command"][1:]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    call = json.loads((tmp_path / "call.json").read_text())
    assert call == {
        "repo_id": "Qwen/Qwen2.5-0.5B-Instruct",
        "revision": HUB_SHA,
        "local_dir": str(tmp_path / "models"),
        "allow_patterns": yaml.safe_load(env["HUB_ALLOW_PATTERNS"]),
    }
    assert "config.json" in proc.stdout
    env.update(FAKE_WITH_CONFIG="0", HUB_LOCAL_DIR=str(tmp_path / "empty"), HUB_ALLOW_PATTERNS="[]")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "no config.json" in proc.stderr and "allowPatterns" in proc.stderr
    assert json.loads((tmp_path / "call.json").read_text())["allow_patterns"] is None, (
        "[] = the whole repository"
    )
