"""KV-cache events: what enters and leaves the prefix cache, published for routers that route by prefix
(the llm-d KV-cache indexer behind the Gateway API Inference Extension's precise prefix scorer).

The wire format is vLLM's (vllm.distributed.kv_events), so consumers written for vLLM read jaxcb's:
a ZMQ PUB socket sends three frames per batch, the topic, an 8-byte big-endian sequence number and a
msgpack payload `[ts, [event, ...]]` (`[ts, [...], rank]` for a data-parallel replica), each event an
array that starts with its kind:

    ["BlockStored", [hash], parent_hash | None, token_ids, block_size, lora_id | None, medium(, lora_name)]
    ["BlockRemoved", [hash], medium]
    ["AllBlocksCleared"]

A block is one page of the prefix cache: registered (stored) once it is full and computed, removed when
the pool evicts it for new pages, all cleared when the device's pages were lost. Its hash is the
cache's own chained hash (jaxcb.host.prefix_cache.chain_hash: the page's tokens and everything before
them, from the cache salt and LoRA adapter's root) as an unsigned 64-bit integer, so the same prefix has
the same hash on every replica and every server. The parent of a sequence's first page is None.

A ROUTER socket beside the publisher answers late subscribers: sent a starting sequence number (8 bytes),
it replays the batches it still holds from there (the last `buffer` batches), then an end marker
(sequence -1, empty payload). Plain Python on the host side: the engine collects a step's events in
`KVEvents` (no I/O), and `ZmqPublisher` encodes and sends them on a thread of its own.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import zlib

MEDIUM = "GPU"  # vLLM's name for the engine's own KV pages (device memory; host memory on the CPU backend)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def block_hash(page_hash: bytes) -> int:
    """A page's hash as the events carry it: its first 8 bytes, an unsigned 64-bit integer."""
    return int.from_bytes(page_hash[:8], "big")


class KVEvents:
    """The prefix cache's changes during one engine step (the page pool and prefix cache call in),
    handed to `sink` as one batch per step by `flush`."""

    def __init__(self, page_size: int, sink, rank: int | None = None):
        self.page_size = page_size
        self.sink = sink  # called with each batch (a list, msgpack-ready); e.g. ZmqPublisher.publish
        self.rank = rank
        self._events: list[list] = []
        self.num_events = 0

    def stored(self, page_hash: bytes, parent: bytes | None, token_ids, lora_name: str | None = None) -> None:
        event = ["BlockStored", [block_hash(page_hash)], None if parent is None else block_hash(parent),
                 [int(t) for t in token_ids], self.page_size, _lora_id(lora_name), MEDIUM]
        if lora_name:
            event.append(lora_name)
        self._events.append(event)

    def removed(self, page_hash: bytes) -> None:
        self._events.append(["BlockRemoved", [block_hash(page_hash)], MEDIUM])

    def cleared(self) -> None:
        self._events.append(["AllBlocksCleared"])

    def flush(self) -> None:
        if not self._events:
            return
        events, self._events = self._events, []
        self.num_events += len(events)
        batch = [time.time(), events]
        if self.rank is not None:
            batch.append(self.rank)
        self.sink(batch)


def _lora_id(name: str | None) -> int | None:
    """A LoRA adapter's id in the events: a stable 31-bit number from its name (None: the base model)."""
    if not name:
        return None
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


class ZmqPublisher:
    """Publishes batches on `endpoint` (ZMQ PUB, e.g. "tcp://*:5557") from a thread of its own, each with
    `topic` and the next sequence number, and answers replay requests on `replay_endpoint` from the last
    `buffer` batches."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", buffer: int = 10_000):
        import zmq

        self._zmq = zmq
        self.topic = topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            self._pub.bind(endpoint)
            if self._replay is not None:
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._ctx.term()
            from jaxcb.host.errors import InvalidConfig

            raise InvalidConfig(f"kv_events: cannot bind {endpoint} / {replay_endpoint}: {e}") from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer)
        self._queue: queue.Queue = queue.Queue()
        self.seq = 0  # the next batch's
        self.published = 0
        self.pending = 0  # batches queued and not yet sent
        self.encode_s = 0.0  # time spent encoding and sending (the publisher's thread, not the engine's)
        self._thread = threading.Thread(target=self._run, name="jaxcb-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: list) -> None:
        """Queue one batch (called by the engine's thread: no encoding or I/O here)."""
        self.pending += 1
        self._queue.put(batch)

    def _run(self) -> None:
        import msgpack

        zmq = self._zmq
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                batch = None
            if batch is _STOP:
                break
            if batch is not None:
                t = time.perf_counter()
                payload = msgpack.packb(batch, use_bin_type=True)
                seq = self.seq.to_bytes(8, "big")
                self._pub.send_multipart((self.topic, seq, payload))
                self._buffer.append((self.seq, payload))
                self.seq += 1
                self.published += 1
                self.pending -= 1
                self.encode_s += time.perf_counter() - t
            if self._replay is not None and dict(poller.poll(0)).get(self._replay):
                self._answer_replay()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        client, start = frames[0], frames[-1]
        start = int.from_bytes(start, "big", signed=True) if len(start) == 8 else 0
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop."""
        self._queue.put(_STOP)
        self._thread.join(timeout)


_STOP = object()


def endpoints(spec: str, replica: int) -> tuple[str, str]:
    """`--kv-events tcp://HOST:PORT` -> replica `replica`'s publisher and replay endpoints: PORT + 2i and
    PORT + 2i + 1 (each data-parallel replica publishes its own cache); port 0 takes free ports."""
    if spec.startswith(("ipc://", "inproc://")):
        return f"{spec}-{replica}", f"{spec}-{replica}-replay"
    head, sep, port = spec.rpartition(":")
    if not spec.startswith("tcp://") or not sep or not port.isdigit():
        from jaxcb.host.errors import InvalidConfig

        raise InvalidConfig(f"kv_events: {spec!r} is not tcp://HOST:PORT (or ipc://PATH)")
    if int(port) == 0:
        return spec, spec
    base = int(port) + 2 * replica
    return f"{head}:{base}", f"{head}:{base + 1}"
