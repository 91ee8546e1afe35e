"""deploy/compose.router.yaml: the router in front of every replica, each replica publishing the KV cache
events the router subscribes to, with settings the server accepts (no Docker engine here: static checks)."""

from __future__ import annotations

import json

import yaml
from graphcache.config import Settings
from graphcache.kv_events.config import parse_kv_events_config

from .conftest import DEPLOY


def test_compose_router_points_at_every_replica_and_its_events():
    compose = yaml.safe_load((DEPLOY / "compose.router.yaml").read_text())
    services = compose["services"]
    replicas = sorted(name for name in services if name.startswith("replica-"))
    assert len(replicas) >= 2
    args = services["router"]["command"]
    i = args.index("--worker-urls")
    assert args[i + 1 : i + 1 + len(replicas)] == [f"http://{r}:8000" for r in replicas]
    policy = next(a for a in args if a.startswith("--policy="))
    assert policy == "--policy=${ROUTER_POLICY:-kv_aware}"
    for name in replicas:
        env = services[name]["environment"]
        events = parse_kv_events_config(env["GRAPHCACHE_KV_EVENTS_CONFIG"])
        assert events is not None and events.publishes
        port = events.endpoint.rsplit(":", 1)[1]
        replay = events.replay_endpoint.rsplit(":", 1)[1]
        assert f"--kv-event-source=http://{name}:8000=tcp://{name}:{port}" in args
        assert f"--kv-event-replay-source=http://{name}:8000=tcp://{name}:{replay}" in args
        assert f"--kv-event-block-size={env['GRAPHCACHE_BLOCK_SIZE']}" in args
        assert f"--kv-event-model={env['GRAPHCACHE_SERVED_MODEL_NAME']}" in args
        settings = Settings(
            kv_events_config=env["GRAPHCACHE_KV_EVENTS_CONFIG"], block_size=int(env["GRAPHCACHE_BLOCK_SIZE"])
        )
        assert json.loads(settings.engine.kv_events_config)["enable_kv_cache_events"] is True
    assert services["router"]["build"]["dockerfile"] == "router.Dockerfile"
    dockerfile = (DEPLOY / "router.Dockerfile").read_text()
    assert "vllm-router==0.1.17" in dockerfile and "USER 10001" in dockerfile
