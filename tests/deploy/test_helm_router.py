"""The chart's optional vllm-router front door, rendered and linted by Helm's Go SDK: a Deployment and
Service that find this release's replicas by their pod labels (with the Role that lets them), or take
static worker URLs and, for kv_aware, the replicas' KV-event endpoints."""

from __future__ import annotations

import pytest

from .conftest import CHART
from .test_helm import helm, render

ROUTER = {
    "replicaCount": 3,
    "router": {"enabled": True, "image": {"repository": "registry.example.com/vllm-router"}},
}

KV_AWARE = {
    "replicaCount": 2,
    "config": {
        "kv_events_config": '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}',
        "block_size": 16,
    },
    "router": {
        "enabled": True,
        "image": {"repository": "registry.example.com/vllm-router", "tag": "0.1.17"},
        "policy": "kv_aware",
        "serviceDiscovery": False,
        "workerUrls": ["http://gc-0.gc:8000", "http://gc-1.gc:8000"],
        "kvEvents": {
            "sources": ["http://gc-0.gc:8000=tcp://gc-0.gc:5557", "http://gc-1.gc:8000=tcp://gc-1.gc:5557"],
            "replaySources": ["http://gc-0.gc:8000=tcp://gc-0.gc:5558"],
        },
    },
}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


def args_of(objs) -> list[str]:
    dep = objs[("Deployment", "rel-graphcache-router")]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["vllm-router"]
    return c["args"]


@pytest.mark.parametrize("values", [ROUTER, KV_AWARE], ids=["discovery", "kv_aware"])
def test_helm_lint_strict_with_the_router(values):
    report = helm.lint(CHART, values, strict=True, namespace="ml", kube_version="v1.30.0")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report["messages"]


def test_router_is_off_by_default(chart):
    assert not [k for k in render(chart) if k[1].endswith("-router")]


def test_router_finds_the_replicas_by_label_with_read_only_rbac(chart):
    objs = render(chart, ROUTER)
    for kind in ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"):
        assert (kind, "rel-graphcache-router") in objs, kind
    args = args_of(objs)
    assert "--service-discovery" in args and "--policy=cache_aware" in args
    i = args.index("--selector")
    replica_pods = objs[("Deployment", "rel-graphcache")]["spec"]["template"]["metadata"]["labels"]
    selector = dict(a.split("=", 1) for a in args[i + 1 : i + 3])
    assert selector == {"app.kubernetes.io/name": "graphcache", "app.kubernetes.io/instance": "rel"}
    assert all(replica_pods[k] == v for k, v in selector.items())
    assert "--service-discovery-port=8000" in args and "--service-discovery-namespace=ml" in args
    assert "--health-check-endpoint=/health" in args and "--retry-max-retries=3" in args
    # The router's pods are never selected as replicas, by the graphcache Service or the router itself.
    router_pods = objs[("Deployment", "rel-graphcache-router")]["spec"]["template"]["metadata"]["labels"]
    gc_selector = objs[("Service", "rel-graphcache")]["spec"]["selector"]
    assert not all(router_pods.get(k) == v for k, v in gc_selector.items())
    role = objs[("Role", "rel-graphcache-router")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = objs[("RoleBinding", "rel-graphcache-router")]
    assert binding["subjects"][0]["name"] == "rel-graphcache-router"
    dep = objs[("Deployment", "rel-graphcache-router")]["spec"]["template"]["spec"]
    assert (
        dep["serviceAccountName"] == "rel-graphcache-router" and dep["automountServiceAccountToken"] is True
    )
    svc = objs[("Service", "rel-graphcache-router")]
    assert svc["spec"]["ports"][0]["port"] == 80 and svc["spec"]["selector"] == {
        k: router_pods[k] for k in svc["spec"]["selector"]
    }


def test_kv_aware_takes_static_workers_and_their_event_endpoints(chart):
    objs = render(chart, KV_AWARE)
    args = args_of(objs)
    assert "--service-discovery" not in args and ("Role", "rel-graphcache-router") not in objs
    i = args.index("--worker-urls")
    assert args[i + 1 : i + 3] == ["http://gc-0.gc:8000", "http://gc-1.gc:8000"]
    assert "--kv-event-source=http://gc-0.gc:8000=tcp://gc-0.gc:5557" in args
    assert "--kv-event-replay-source=http://gc-0.gc:8000=tcp://gc-0.gc:5558" in args
    assert "--kv-event-block-size=16" in args and "--policy=kv_aware" in args
    gc = objs[("Deployment", "rel-graphcache")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in gc["env"]}
    assert '"enable_kv_cache_events": true' in env["GRAPHCACHE_KV_EVENTS_CONFIG"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"router": {"enabled": True}}, "router.image.repository"),
        (
            {"router": {"enabled": True, "image": {"repository": "r"}, "policy": "kv_aware"}},
            "needs router.kvEvents.sources",
        ),
    ],
)
def test_router_render_fails_with_a_fix(chart, values, message):
    with pytest.raises(Exception, match=message):
        render(chart, values)


@pytest.mark.parametrize(
    "bad",
    [
        {"router": {"policy": "fastest"}},
        {"router": {"kvEvents": {"sources": ["gc-0:5557"]}}},
        {"router": {"healthCheck": {"intervalSecs": 0}}},
    ],
)
def test_schema_rejects_bad_router_values(chart, bad):
    with pytest.raises(Exception):  # noqa: B017 - the SDK raises its own error type for schema failures
        render(chart, bad)
