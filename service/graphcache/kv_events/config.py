"""--kv-events-config: vLLM's JSON object, its keys and defaults, checked once with the fix in each refusal."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig: the same keys, the same defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" once events are enabled and no publisher is named (as vLLM does)
    endpoint: str = "tcp://*:5557"  # PUB socket: "*" binds, a host connects
    replay_endpoint: str | None = None  # ROUTER socket a subscriber asks for missed batches on
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; past it they are dropped
    topic: str = ""  # first frame of every message

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_EXAMPLE = '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\''


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    """The flag's JSON -> KVEventsConfig; None when unset. ValueError names the key and the fix."""
    if text is None or not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"not JSON ({e.msg} at character {e.pos}); pass one object, e.g. {_EXAMPLE}"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"a JSON {type(raw).__name__}, not an object; pass one object, e.g. {_EXAMPLE}")
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; the keys are {sorted(known)}")
    values: dict[str, Any] = dict(raw)
    if values.get("enable_kv_cache_events") and "publisher" not in values:
        values["publisher"] = "zmq"
    _check(values)
    return KVEventsConfig(**values)


def _check(values: dict[str, Any]) -> None:
    if not isinstance(values.get("enable_kv_cache_events", False), bool):
        raise ValueError("enable_kv_cache_events must be true or false")
    if values.get("publisher", "null") not in PUBLISHERS:
        raise ValueError(f"publisher {values['publisher']!r} is not one of {list(PUBLISHERS)}")
    for name in ("endpoint", "topic"):
        if name in values and not isinstance(values[name], str):
            raise ValueError(f"{name} must be a string")
    replay = values.get("replay_endpoint")
    if replay is not None and not isinstance(replay, str):
        raise ValueError('replay_endpoint must be a string like "tcp://*:5558" or null')
    for name in ("endpoint", "replay_endpoint"):
        value = values.get(name)
        if isinstance(value, str) and "://" not in value:
            raise ValueError(f'{name} {value!r} is not a ZeroMQ address; e.g. "tcp://*:5557"')
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        value = values.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
