"""Weight loading reports its progress: one log line per weight file, and /ready's body says
"loading weights 3/8" while the engine loads (model/loader.py's reporting_shards)."""

from __future__ import annotations

import json
import logging
import threading

import httpx
import torch
from graphcache.api.server.app import create_app
from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine
from graphcache.metrics import Metrics
from graphcache.model.loader import load_model, reporting_shards
from graphcache.model.tiny import make_default_model
from safetensors.torch import load_file, save_file


def split_into_shards(path, count: int) -> list[str]:
    """Rewrite the directory's model.safetensors as `count` shards with an index, as HF checkpoints are."""
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    weight_map = {}
    for i, file in enumerate(files):
        part = {n: tensors[n] for n in names[i::count]}
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return files


def test_load_model_reports_each_shard_and_logs_it(tmp_path, caplog):
    path = make_default_model(tmp_path / "tiny")
    whole, _ = load_model(path)
    files = split_into_shards(path, 3)
    seen: list[tuple[int, int, str]] = []
    with (
        caplog.at_level(logging.INFO, logger="graphcache.model.loader"),
        reporting_shards(lambda *a: seen.append(a)),
    ):
        sharded, _ = load_model(path)
    assert seen == [(i + 1, 3, f) for i, f in enumerate(files)]
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded weights")] == [
        f"loaded weights {i + 1}/3 ({f})" for i, f in enumerate(files)
    ]
    for (name, a), b in zip(whole.state_dict().items(), sharded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the shards load the same model
    seen.clear()
    load_model(path)  # outside the context: nobody is called
    assert seen == []


async def test_ready_body_shows_the_weight_progress_while_loading():
    reached, release = threading.Event(), threading.Event()

    def loading_runner(settings, metrics):
        from graphcache.model import loader

        report = loader._shard_progress.get()  # what load_model would call after each file
        report(3, 8, "model-00003-of-00008.safetensors")
        reached.set()
        release.wait(30)
        raise RuntimeError("stop here; this test only looks at the progress")

    e = Engine(Settings(), Metrics(), runner_factory=loading_runner)
    app = create_app(e.settings, engine=e)
    e.start()
    try:
        assert reached.wait(30)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            r = await client.get("/ready")
        assert r.status_code == 503
        assert r.json() == {
            "status": "loading",
            "progress": {
                "phase": "loading weights 3/8",
                "done": 3,
                "total": 8,
                "file": "model-00003-of-00008.safetensors",
            },
        }
    finally:
        release.set()
        e.wait_ready(30)
        e.shutdown()
