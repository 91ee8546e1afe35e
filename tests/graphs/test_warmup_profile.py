"""Warmup learned from traffic (issue 11 item 5): per-descriptor use counts, GET /admin/cache/profile,
GRAPHCACHE_WARMUP_PROFILE at start, POST /admin/warmup with a profile or with no body (the configured
warmup again). CPU backend, the real Engine with the embedded tiny model, in-process ASGI."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
import torch
from graphcache.api.server.app import create_app
from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine
from graphcache.engine.worker.warmup_plan import load_warmup_profile
from graphcache.graphs.cache import GraphCache
from graphcache.graphs.descriptor import BatchDescriptor as D
from graphcache.graphs.descriptor import CaptureSizes
from graphcache.graphs.policy.config import CachePolicyConfig
from graphcache.graphs.policy.profile import fill_size_gaps, parse_profile
from graphcache.metrics import Metrics

TOKEN = "profile-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SMALL = {
    "device": "cpu",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "warmup_decode_sizes": [1],
    "capture_sizes": [1, 2, 4, 8, 16],
    "admin_token": TOKEN,
    "admission": "always",
    "capture_time_share": 1.0,
}
# Sequential greedy requests: prefills of 3, 7 and 12 tokens (padded to 4:4, 8:4, 16:4: requests pad to the
# token size, capped at max_num_seqs' 4) and decodes 1:1:decode.
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17], list(range(20, 32))]


@contextlib.asynccontextmanager
async def running(settings: Settings):
    engine = Engine(settings, Metrics())
    app = create_app(settings, engine=engine)
    async with app.router.lifespan_context(app):
        assert await asyncio.to_thread(engine.wait_ready, 120), engine.error
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 4321))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60) as client:
            yield client


async def traffic(client: httpx.AsyncClient) -> None:
    for prompt in PROMPTS:
        r = await client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        )
        assert r.status_code == 200, r.text


async def info(client: httpx.AsyncClient) -> dict:
    r = await client.get("/admin/cache", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def held(cache_info: dict) -> set[str]:
    return {e["descriptor"] for e in cache_info["entries"]}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("graphcache-cache")


# --------------------------------------------------------------------------- the cache


def make_cache(**kw) -> GraphCache:
    x, out = torch.randn(4), torch.empty(4)
    config = CachePolicyConfig(**{"max_entries": 8, "max_bytes": 1 << 30, **kw})
    return GraphCache(lambda d: out.copy_(x * 2), backend="eager", config=config)


def test_uses_survive_eviction_and_clear_and_sort_the_profile():
    cache = make_cache(max_entries=2)
    for d, n in [(D(8, 2), 3), (D(4, 4, True), 5), (D(16, 1), 1), (D(2, 2, True), 2)]:
        for _ in range(n):
            cache.run(d)
    assert cache.stats().evictions["entries"] > 0  # 2 entries held, 4 descriptors used
    prof = cache.profile()
    assert prof["version"] == 1
    assert [(p["descriptor"], p["uses"]) for p in prof["descriptors"]] == [
        ("4:4:decode", 5),
        ("8:2", 3),
        ("2:2:decode", 2),
        ("16:1", 1),
    ]
    for p in prof["descriptors"]:
        assert p["mode"] == "full" and p["bytes"] == 0 and p["capture_ms"] >= 0  # no eager break here
    assert [p["descriptor"] for p in cache.profile(min_uses=3)["descriptors"]] == ["4:4:decode", "8:2"]
    cache.clear()
    assert cache.profile() == prof  # the traffic is remembered: the cache is not
    assert parse_profile(prof) == [D(4, 4, True), D(8, 2), D(2, 2, True), D(16, 1)]


def test_profile_min_uses_zero_adds_warmup_only_descriptors():
    cache = make_cache()
    cache.warmup([D(8, 8, True)])
    cache.run(D(2, 1))
    assert [p["descriptor"] for p in cache.profile()["descriptors"]] == ["2:1"]
    zero = cache.profile(min_uses=0)["descriptors"]
    assert [(p["descriptor"], p["uses"]) for p in zero] == [("2:1", 1), ("8:8:decode", 0)]


def test_fill_size_gaps_adds_the_unmet_sizes_inside_the_used_span():
    def item(desc: str, uses: int) -> dict:
        return {"descriptor": desc, "mode": "full", "uses": uses, "bytes": 0, "capture_ms": 1.0}

    sizes = CaptureSizes([1, 2, 4, 8, 16, 32, 64])
    profile = {
        "version": 1,
        "descriptors": [
            item("2:2:decode", 9),
            item("16:16:decode", 3),  # decode span 2..16: 4 and 8 unmet
            item("4:4", 7),
            item("32:8", 2),
            item("64:8", 1),  # mixed span 4..64, requests capped at 8
            item("8:8", 0),  # held (warmup), not used: no duplicate
            item("1:1:decode", 0),  # unused: does not widen the span
        ],
    }
    filled = fill_size_gaps(profile, sizes)
    assert filled["descriptors"][: len(profile["descriptors"])] == profile["descriptors"]
    added = filled["descriptors"][len(profile["descriptors"]) :]
    assert [p["descriptor"] for p in added] == ["4:4:decode", "8:8:decode", "16:8"]
    assert all(p["uses"] == 0 and p["filled"] and p["mode"] is None for p in added)
    assert parse_profile(filled)[-3:] == [D(4, 4, True), D(8, 8, True), D(16, 8)]
    # Nothing used, or one size per kind: nothing to fill.
    assert fill_size_gaps({"version": 1, "descriptors": [item("8:8:decode", 0)]}, sizes)["descriptors"] == [
        item("8:8:decode", 0)
    ]
    assert fill_size_gaps({"version": 1, "descriptors": [item("8:4", 5)]}, sizes)["descriptors"] == [
        item("8:4", 5)
    ]


def test_lora_variants_round_trip_through_the_profile_and_fill_their_own_gaps():
    cache = make_cache()
    for d, n in [
        (D(4, 4, True, lora=True), 4),
        (D(4, 4, True), 3),
        (D(16, 16, True, lora=True), 2),
        (D(8, 2, lora=True), 1),
    ]:
        for _ in range(n):
            cache.run(d)
    prof = cache.profile()
    assert [p["descriptor"] for p in prof["descriptors"]] == [
        "4:4:decode:lora",
        "4:4:decode",
        "16:16:decode:lora",
        "8:2:lora",
    ]
    assert parse_profile(prof) == [
        D(4, 4, True, lora=True),
        D(4, 4, True),
        D(16, 16, True, lora=True),
        D(8, 2, lora=True),
    ]
    # the LoRA decode span 4..16 is filled in its own kind; the plain decode kind used one size only
    added = fill_size_gaps(prof, CaptureSizes([1, 2, 4, 8, 16]))["descriptors"][len(prof["descriptors"]) :]
    assert [p["descriptor"] for p in added] == ["8:8:decode:lora"]


def test_a_lora_profile_is_refused_where_lora_is_off(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"version": 1, "descriptors": [{"descriptor": "4:4:decode:lora"}]}))
    sizes = CaptureSizes([1, 2, 4, 8])
    assert load_warmup_profile(path, sizes, sizes, 8, lora=True) == [D(4, 4, True, lora=True)]
    with pytest.raises(ValueError, match=r"descriptors\[0\].*LoRA is off"):
        load_warmup_profile(path, sizes, sizes, 8)


@pytest.mark.parametrize(
    ("data", "part"),
    [
        ([], "JSON object"),
        ({"descriptors": []}, "version"),
        ({"version": 1}, "descriptors"),
        ({"version": 1, "descriptors": ["8:8:decode"]}, "descriptors[0]"),
        (
            {"version": 1, "descriptors": [{"descriptor": "8:8"}, {"descriptor": "nope"}]},
            "descriptors[1].descriptor",
        ),
    ],
)
def test_parse_profile_names_the_bad_part(data, part):
    with pytest.raises(ValueError, match=part.replace("[", r"\[").replace("]", r"\]")):
        parse_profile(data)


# --------------------------------------------------------------------------- the server


@pytest.mark.asyncio
async def test_profile_round_trip_warms_exactly_the_hot_set(cache_dir, tmp_path):
    # 1. Traffic on a server warmed with 1:1:decode only: the prefills are lazy captures.
    async with running(Settings(cache_dir=cache_dir, **SMALL)) as client:
        before = (await info(client))["stats"]["captures"]
        await traffic(client)
        after = await info(client)
        lazy = after["stats"]["captures"] - before
        assert lazy >= 3, after
        r = await client.get("/admin/cache/profile", headers=AUTH)
        assert r.status_code == 200, r.text
        profile = r.json()
        assert (await client.get("/admin/cache/profile")).status_code == 401
        assert (await client.get("/admin/cache/profile?min_uses=-1", headers=AUTH)).status_code == 400
        many = (await client.get("/admin/cache/profile?min_uses=1000000", headers=AUTH)).json()
        assert many == {"version": 1, "descriptors": []}

    items = profile["descriptors"]
    assert profile["version"] == 1 and items
    assert {"1:1:decode", "4:4", "8:4", "16:4"} <= {p["descriptor"] for p in items}
    uses = [p["uses"] for p in items]
    assert uses == sorted(uses, reverse=True) and min(uses) >= 1
    for p in items:
        assert set(p) == {"descriptor", "mode", "uses", "bytes", "capture_ms"}
        assert p["mode"] in ("full", "breakable") and p["bytes"] >= 0 and p["capture_ms"] >= 0
    hot = {p["descriptor"] for p in items}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))

    # 2. A new server started with the profile warms exactly that set (the decode sizes are not used)...
    settings = Settings(cache_dir=cache_dir, warmup_profile=path, **{**SMALL, "warmup_decode_sizes": [2, 4]})
    async with running(settings) as client:
        start = await info(client)
        assert held(start) == hot
        assert all(e["pinned"] for e in start["entries"])
        assert start["stats"]["captures"] == len(hot)
        # ... and serves the same traffic with no lazy capture and no miss.
        await traffic(client)
        served = await info(client)
        assert served["stats"]["captures"] == start["stats"]["captures"]
        assert served["stats"]["misses"] == 0 and served["stats"]["hits"] > 0

        # 3. After a clear, POST /admin/warmup with no body (or {}) restores the configured warmup.
        for kwargs in ({}, {"json": {}}):
            assert (await client.post("/admin/clear", headers=AUTH)).status_code == 200
            assert held(await info(client)) == set()
            r = await client.post("/admin/warmup", headers=AUTH, **kwargs)
            assert r.status_code == 200, r.text
            assert set(r.json()["captured"]) == hot and not r.json()["failed"]
            assert held(await info(client)) == hot


@pytest.mark.asyncio
async def test_admin_warmup_accepts_a_profile_and_rejects_bad_ones(cache_dir):
    async with running(Settings(cache_dir=cache_dir, **SMALL)) as client:
        # No body: the configured warmup (warmup_decode_sizes [1]) again, after a clear.
        assert (await client.post("/admin/clear", headers=AUTH)).status_code == 200
        r = await client.post("/admin/warmup", headers=AUTH)
        assert r.status_code == 200, r.text
        assert held(await info(client)) == {"1:1:decode"}

        profile = {
            "version": 1,
            "descriptors": [
                {"descriptor": "16:2", "mode": "breakable", "uses": 9},
                {"descriptor": "4:4:decode"},
            ],
        }
        r = await client.post("/admin/warmup", headers=AUTH, json={"profile": profile})
        assert r.status_code == 200, r.text
        assert set(r.json()["captured"]) == {"16:2", "4:4:decode"}
        assert held(await info(client)) == {"1:1:decode", "16:2", "4:4:decode"}

        bad = [
            ({"profile": {"version": 2, "descriptors": []}}, "profile"),
            ({"profile": {"version": 1, "descriptors": [{"descriptor": "x"}]}}, "profile"),
            (
                {"profile": {"version": 1, "descriptors": [{"descriptor": "8:2"}, {"descriptor": "3:3"}]}},
                "profile.descriptors[1]",
            ),
            (
                {
                    "profile": {"version": 1, "descriptors": [{"descriptor": "16:16:decode"}]}
                },  # > max_num_seqs
                "profile.descriptors[0]",
            ),
            ({"profile": {"version": 1, "descriptors": []}, "sizes": [1]}, None),
            ({"profile": "8:8"}, "profile"),
        ]
        for body, param in bad:
            r = await client.post("/admin/warmup", headers=AUTH, json=body)
            assert r.status_code == 400, (body, r.text)
            if param is not None:
                assert r.json()["error"]["param"] == param, (body, r.json())


@pytest.mark.asyncio
async def test_admin_warmup_takes_an_exported_profile_posted_bare(cache_dir):
    """GET /admin/cache/profile's output posted as it is is that profile, never the configured warmup
    silently in its place; a bare profile's errors name the profile."""
    async with running(Settings(cache_dir=cache_dir, **SMALL)) as client:
        assert (await client.post("/admin/clear", headers=AUTH)).status_code == 200
        profile = {
            "version": 1,
            "descriptors": [{"descriptor": "16:2", "uses": 3}, {"descriptor": "4:4:decode"}],
        }
        r = await client.post("/admin/warmup", headers=AUTH, json=profile)
        assert r.status_code == 200, r.text
        assert set(r.json()["captured"]) == {"16:2", "4:4:decode"}
        assert held(await info(client)) == {"16:2", "4:4:decode"}  # not the configured "1:1:decode"

        exported = (
            await client.get("/admin/cache/profile", headers=AUTH, params={"fill_gaps": False})
        ).json()
        assert (await client.post("/admin/clear", headers=AUTH)).status_code == 200
        r = await client.post("/admin/warmup", headers=AUTH, json=exported)
        assert r.status_code == 200, r.text
        assert held(await info(client)) == {item["descriptor"] for item in exported["descriptors"]}

        for bare in ({"version": 2, "descriptors": []}, {"descriptors": [{"descriptor": "3:3"}]}):
            r = await client.post("/admin/warmup", headers=AUTH, json=bare)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"].startswith("profile"), r.json()


@pytest.mark.parametrize(
    ("content", "expect"),
    [
        (
            json.dumps({"version": 1, "descriptors": [{"descriptor": "8:2"}, {"descriptor": "5:1"}]}),
            "descriptors[1]",
        ),
        (json.dumps({"version": 1, "descriptors": [{"descriptor": "8:1"}, {"nope": 1}]}), "descriptors[1]"),
        (json.dumps({"version": 7, "descriptors": []}), "version"),
        ("{not json", "cannot be read as JSON"),
        (None, "cannot be read as JSON"),  # no such file
    ],
)
def test_bad_profile_file_is_a_startup_error(cache_dir, tmp_path, content, expect):
    path = tmp_path / "bad-profile.json"
    if content is not None:
        path.write_text(content)
    engine = Engine(Settings(cache_dir=cache_dir, warmup_profile=path, **SMALL))
    engine.start()
    try:
        assert not engine.wait_ready(120)
        assert not engine.alive
        assert str(path) in engine.error and expect in engine.error, engine.error
    finally:
        engine.shutdown()


@pytest.mark.asyncio
async def test_profile_fills_the_size_gaps_traffic_did_not_meet(cache_dir, tmp_path):
    """Prefills of 3 and 12 tokens use mixed 4:4 and 16:4; 8:4, inside that span, is filled. A server
    warmed with the profile then serves a 7-token prefill (8:4) with no lazy capture."""
    async with running(Settings(cache_dir=cache_dir, **SMALL)) as client:
        for prompt in (PROMPTS[0], PROMPTS[2]):
            r = await client.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0}
            )
            assert r.status_code == 200, r.text
        bare = (await client.get("/admin/cache/profile?fill_gaps=false", headers=AUTH)).json()
        profile = (await client.get("/admin/cache/profile", headers=AUTH)).json()
    assert {"4:4", "16:4"} <= {p["descriptor"] for p in bare["descriptors"]}
    assert "8:4" not in {p["descriptor"] for p in bare["descriptors"]}
    gaps = [p for p in profile["descriptors"] if p.get("filled")]
    assert [p["descriptor"] for p in gaps] == ["8:4"] and gaps[0]["uses"] == 0
    path = tmp_path / "filled.json"
    path.write_text(json.dumps(profile))
    async with running(Settings(cache_dir=cache_dir, warmup_profile=path, **SMALL)) as client:
        start = await info(client)
        assert "8:4" in held(start)
        r = await client.post(
            "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        served = await info(client)
        assert served["stats"]["captures"] == start["stats"]["captures"]
