"""ASGI tests of /admin/*: the auth gate (token, loopback opt-in, off by default) and the cache
commands (inspect, warm up, clear) on the real Engine with the embedded tiny model on the CPU."""

from __future__ import annotations

import contextlib

import httpx
import pytest
import pytest_asyncio
from graphcache.config import Settings
from helpers_api import serving
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKEN = "s3cret-admin-token"
SMALL = {
    "device": "cpu",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "warmup_decode_sizes": [1],
    "capture_sizes": [1, 2, 4, 8, 16],
}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextlib.asynccontextmanager
async def running(settings: Settings, client_addr: str = "127.0.0.1"):
    async with serving(settings, client_addr=client_addr) as (client, _):
        yield client


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("graphcache-cache")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(cache_dir):
    async with running(Settings(cache_dir=cache_dir, admin_token=TOKEN, **SMALL)) as c:
        yield c


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def gauge(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


# --------------------------------------------------------------------------- auth


@pytest.mark.parametrize("path", ["/admin/cache"])
async def test_token_required(client, path):
    err = error_of(await client.get(path), 401)
    assert err["type"] == "authentication_error" and "Bearer" in err["message"]
    err = error_of(await client.get(path, headers={"Authorization": "Bearer wrong"}), 403)
    assert err["code"] == "invalid_token"
    error_of(await client.get(path, headers={"Authorization": f"Basic {TOKEN}"}), 401)
    error_of(await client.post("/admin/clear"), 401)
    error_of(await client.post("/admin/warmup", json={"sizes": [1]}), 401)
    assert (await client.get(path, headers=AUTH)).status_code == 200


async def test_admin_off_without_token(cache_dir):
    async with running(Settings(cache_dir=cache_dir, **SMALL)) as c:
        err = error_of(await c.get("/admin/cache"), 403)
        assert "GRAPHCACHE_ADMIN_TOKEN" in err["message"] and err["code"] == "admin_disabled"


async def test_loopback_opt_in(cache_dir):
    settings = Settings(cache_dir=cache_dir, admin_allow_loopback=True, **SMALL)
    async with running(settings) as local:
        assert (await local.get("/admin/cache")).status_code == 200
    async with running(settings, client_addr="10.1.2.3") as remote:
        error_of(await remote.get("/admin/cache"), 403)


# --------------------------------------------------------------------------- commands


async def test_cache_info_shape(client):
    info = (await client.get("/admin/cache", headers=AUTH)).json()
    assert {"entries", "totals", "budgets"} <= set(info)
    for entry in info["entries"]:
        assert {"descriptor", "bytes", "capture_seconds", "hits", "last_use", "pinned"} <= set(entry)
        assert entry["pool"] in ("pinned", "lazy", "private")
    assert info["totals"]["entries"] == len(info["entries"])
    assert info["lazy_pool"] == "shared"  # the default (GRAPHCACHE_CACHE_LAZY_POOL)
    assert {"pool_bytes", "pinned_pool_bytes", "lazy_pool_bytes"} <= set(info["totals"])


async def test_warmup_then_clear_agree_with_metrics(client):
    r = await client.post("/admin/warmup", headers=AUTH, json={"sizes": [2, 4], "descriptors": ["16:2"]})
    assert r.status_code == 200, r.text
    report = r.json()
    assert set(report["captured"]) | set(report.get("cached", [])) == {"2:2:decode", "4:4:decode", "16:2"}
    assert "seconds" in report and not report["failed"]
    info = (await client.get("/admin/cache", headers=AUTH)).json()
    held = {e["descriptor"] for e in info["entries"]}
    assert {"2:2:decode", "4:4:decode", "16:2"} <= held
    metrics = (await client.get("/metrics")).text
    assert gauge(metrics, "graphcache_graph_cache_entries") == info["totals"]["entries"]

    r = await client.post("/admin/clear", headers=AUTH)
    assert r.status_code == 200 and r.json()["entries"] == len(held)
    info = (await client.get("/admin/cache", headers=AUTH)).json()
    assert info["entries"] == [] and info["totals"]["entries"] == 0
    assert gauge((await client.get("/metrics")).text, "graphcache_graph_cache_entries") == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sizes": [3]}, "sizes[0]"),  # not a capture size: never replayed
        ({"sizes": [16]}, "sizes[0]"),  # more requests than max_num_seqs pads to
        ({"sizes": ["2"]}, "sizes[0]"),
        ({"descriptors": ["banana"]}, "descriptors[0]"),
        ({"descriptors": ["4:8"]}, "descriptors[0]"),  # more requests than tokens
        ({"descriptors": ["1000000:1"]}, "descriptors[0]"),
        ({"descriptors": ["8:4:decode"]}, "descriptors[0]"),
    ],
)
async def test_warmup_rejects_bad_shapes(client, body, param):
    err = error_of(await client.post("/admin/warmup", headers=AUTH, json=body), 400)
    assert err["param"] == param
