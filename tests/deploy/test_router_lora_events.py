"""KV cache events with a LoRA adapter's lora_id / lora_name, read by the real `vllm-router` (kv_aware).

graphcache's publisher sends one batch holding a base-model block and an adapter's block; two fake
replicas (HTTP 200 to everything) stand behind the router. The router must keep the batch (it refuses a
whole batch it cannot read, which would lose the base block too) and must never credit the adapter's block
to a base-model request. What it credits is read from its debug log ("KV prefix decision ...
credited_prefix_tokens=N"), the one place it says.
"""

from __future__ import annotations

import http.server
import json
import re
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from graphcache.kv_events.config import KVEventsConfig
from graphcache.kv_events.messages import MEDIUM_GPU, BlockStored, KVEventBatch
from graphcache.kv_events.publisher import ZmqEventPublisher
from graphcache.kv_events.recorder import LoraTag, block_hash

from .conftest import find_tool

pytestmark = pytest.mark.slow

BLOCK = 4
BASE_TOKENS = [100, 101, 102, 103]
ADAPTER_TOKENS = [200, 201, 202, 203]
CREDIT = re.compile(r"KV prefix decision.*credited_prefix_tokens=(\d+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Ok(http.server.BaseHTTPRequestHandler):
    """A replica that answers everything (health, models, completions) with 200."""

    def _ok(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": "bench", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _ok

    def log_message(self, *args) -> None:
        return


def _stored(tokens: list[int], lora: LoraTag | None) -> BlockStored:
    lora_id, lora_name = lora if lora is not None else (None, None)
    h = block_hash(None, tokens, lora)
    return BlockStored([h], None, tokens, BLOCK, lora_id, MEDIUM_GPU, lora_name, group_idx=0)


def _read(path: Path) -> str:
    """The router's log without its colour codes (they split `key=value`)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", path.read_text(errors="replace"))


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_the_router_keeps_a_batch_with_an_adapters_block_and_never_credits_it_to_the_base_model(
    tmp_path: Path,
):
    router = find_tool("vllm-router")
    if router is None:
        pytest.skip("vllm-router not installed: pip install -e '.[test]' (it pins vllm-router)")
    servers = []
    for _ in range(2):  # kv_aware scores only with more than one healthy replica
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    kv_port, replay_port, port = _free_port(), _free_port(), _free_port()
    pub = ZmqEventPublisher(
        KVEventsConfig(True, "zmq", f"tcp://*:{kv_port}", replay_endpoint=f"tcp://*:{replay_port}")
    )
    log_path = tmp_path / "router.log"
    args = [
        router,
        *("--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware", "--worker-urls", *urls),
        *("--kv-event-source", f"{urls[0]}=tcp://127.0.0.1:{kv_port}"),
        *("--kv-event-replay-source", f"{urls[0]}=tcp://127.0.0.1:{replay_port}"),
        *("--kv-event-block-size", str(BLOCK), "--kv-event-model", "bench"),
        *("--log-level", "debug", "--prometheus-port", str(_free_port())),
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: "spawned subscriber" in _read(log_path), 60, "the subscriber")
        time.sleep(1)  # the SUB socket's connection (a batch sent before it is replayed, not live)
        pub.publish(
            KVEventBatch(
                time.time(), [_stored(BASE_TOKENS, None), _stored(ADAPTER_TOKENS, LoraTag(1, "sql"))]
            )
        )
        _wait(lambda: "live sequence advanced" in _read(log_path), 30, "the batch")
        for prompt in (BASE_TOKENS * 2, ADAPTER_TOKENS * 2):
            body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": 1}).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
            )
            assert urllib.request.urlopen(req, timeout=30).status == 200
        _wait(lambda: len(CREDIT.findall(_read(log_path))) >= 2, 10, "two decisions")
        text = _read(log_path)
    finally:
        proc.terminate()
        proc.wait(10)
        pub.close()
        for srv in servers:
            srv.shutdown()
    base_credit, adapter_credit = (int(n) for n in CREDIT.findall(text)[:2])
    assert base_credit == BLOCK, text[-3000:]  # the batch was kept: its base-model block counts
    assert adapter_credit == 0, text[-3000:]  # the adapter's block (same batch) is not the base model's
