"""POST /admin/reset_prefix_cache on a served engine: the cached prefixes go, and the KV cache events tell a
subscriber so (vLLM's AllBlocksCleared last), in the engine thread and in the engine process alike."""

from __future__ import annotations

import msgspec
import pytest
from graphcache.config import Settings
from helpers_api import serving
from test_kv_events import DECODER, AllBlocksCleared, BlockStored, events_config, free_port, replay_all

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
async def test_reset_prefix_cache_drops_the_prefixes_and_publishes_the_clear(tmp_path, engine_process):
    port, replay = free_port(), free_port()
    settings = Settings(
        cache_dir=tmp_path, admin_token=TOKEN, device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
        warmup_decode_sizes=[], block_size=4, engine_process=engine_process,
        kv_events_config=events_config(port, replay),
    )  # fmt: skip
    async with serving(settings) as (client, _):
        body = {"model": "graphcache-tiny", "prompt": list(range(5, 30)), "max_tokens": 2}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        r = await client.post("/admin/reset_prefix_cache", headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["dropped_blocks"] >= 6  # the 25-token prompt's 6 full blocks at least
        assert (await client.post("/admin/reset_prefix_cache")).status_code == 401
        events = [ev for _, payload in replay_all(replay) for ev in DECODER.decode(payload).events]
    stored = [ev for ev in events if isinstance(ev, BlockStored)]
    assert stored and stored[0].token_ids[:24] == list(range(5, 29))
    assert isinstance(events[-1], AllBlocksCleared)
    assert msgspec.msgpack.encode(events[-1])  # a real event, as decoded
