"""Publishing KV event batches over ZeroMQ, vLLM's protocol, off the engine thread.

`publish(batch)` only puts the batch on a bounded queue (never blocks: past max_queue_size the batch is
dropped and counted in `dropped`, and subscribers see the gap in the sequence numbers). One daemon
thread takes batches off the queue, encodes them (messages.py) and sends each as three frames on a PUB
socket: (topic, 8-byte big-endian sequence number, msgpack payload); it keeps the last buffer_steps
(seq, payload) pairs for replay.

Replay (replay_endpoint): a ROUTER socket. A subscriber (REQ or DEALER) sends the first sequence number
it missed as 8 big-endian bytes; the ROUTER sees (identity, b"", start) and answers one message per kept
batch from there, (identity, b"", seq, payload), then (identity, b"", END_SEQ, b"") with END_SEQ = -1.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque

import zmq

from graphcache.kv_events.config import KVEventsConfig
from graphcache.kv_events.messages import KVEventBatch, encode_batch

log = logging.getLogger("graphcache.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 100  # how often the thread looks at the replay socket and the stop flag when idle
SHUTDOWN_TIMEOUT_S = 1.0


class NullEventPublisher:
    """publisher "null": events are recorded nowhere (vLLM's default)."""

    dropped = 0
    published = 0

    def publish(self, batch: KVEventBatch) -> None:
        return

    def close(self) -> None:
        return


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._pub = self._socket(zmq.PUB, config.endpoint)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._replay = self._socket(zmq.ROUTER, config.replay_endpoint) if config.replay_endpoint else None
        self.dropped = 0  # batches the full queue turned away
        self.published = 0  # batches sent
        self._next_seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="graphcache-kv-events", daemon=True)
        self._thread.start()
        log.info(
            "publishing KV cache events on %s (replay: %s, topic %r)",
            config.endpoint,
            config.replay_endpoint or "off",
            config.topic,
        )

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        host = endpoint.split("://", 1)[1].rsplit(":", 1)[0]
        try:
            if host in ("*", "0.0.0.0", "[::]", "::") or endpoint.startswith(("ipc://", "inproc://")):
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(0)
            raise ValueError(
                f"cannot open the KV events socket {endpoint!r}: {e}; pick a free port in --kv-events-config"
            ) from None
        return sock

    def publish(self, batch: KVEventBatch) -> None:
        """Any thread, never blocks: queue the batch, or drop and count it when the queue is full."""
        if self._stop.is_set():
            return
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, 8, ...: said, without a line per batch
                log.warning(
                    "KV events: %d batches dropped so far (the publisher's queue of %d is full); "
                    "subscribers replay the gap, or raise max_queue_size in --kv-events-config",
                    self.dropped,
                    self.config.max_queue_size,
                )

    def close(self) -> None:
        """Send what is queued (at most SHUTDOWN_TIMEOUT_S), then stop the thread and close the sockets."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(queue.Full):  # wakes the thread; on a full queue it sees the flag in time
            self._queue.put_nowait(None)
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():  # a send stuck at the high-water mark: the sockets have linger 0
            log.warning("the KV events publisher did not stop within %.1fs", SHUTDOWN_TIMEOUT_S)
            return
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)

    # --- the publisher thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    self._serve_replays()
                try:
                    batch = self._queue.get(timeout=_POLL_MS / 1000)
                except queue.Empty:
                    if self._stop.is_set():
                        return
                    continue
                if batch is None:
                    return
                self._send(batch)
        except Exception:  # noqa: BLE001 - the engine keeps serving without events; say why once
            log.exception("the KV events publisher stopped")

    def _send(self, batch: KVEventBatch) -> None:
        payload = encode_batch(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big", signed=True), payload), copy=False)
        self._buffer.append((seq, payload))
        self.published += 1

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("ignored a malformed KV events replay request (%d frames)", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big", signed=True), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | NullEventPublisher | None:
    """The configured publisher; None when events are off (the block manager then records nothing)."""
    if config is None or not config.enable_kv_cache_events:
        return None
    if config.publisher == "zmq":
        return ZmqEventPublisher(config)
    return NullEventPublisher()
