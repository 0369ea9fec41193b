"""KV-cache events (jaxcb.host.kv_events, `jaxcb serve --kv-events`): a subscriber that knows only the
wire format (vLLM's: ZMQ frames topic / 8-byte sequence / msgpack batch of tagged arrays), decoding with
msgpack alone, rebuilds the prefix cache's exact contents from the events, under load with evictions;
a late subscriber gets the same from the replay socket. (tests/test_routing.py: servers publish the
hashes another engine gives the same prefix, and routing by them.)"""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import zmq

from jaxcb.host.kv_events import ZmqPublisher
from jaxcb.host.request import SamplingParams

PAGE = 16


def _u64(page_hash: bytes) -> int:  # the wire's hash of a page: its first 8 bytes, big-endian
    return int.from_bytes(page_hash[:8], "big")


class Rebuilt:
    """The cache as the events describe it: hash -> (parent, token ids), and the batches seen."""

    def __init__(self):
        self.blocks: dict[int, tuple[int | None, tuple]] = {}
        self.seqs: list[int] = []
        self.kinds: dict[str, int] = {}

    def apply(self, seq: bytes, payload: bytes) -> None:
        self.seqs.append(int.from_bytes(seq, "big"))
        ts, events, *rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and not rank
        for event in events:
            kind = event[0]
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            if kind == "BlockStored":
                (h,), parent, tokens, block_size, lora_id, medium = event[1:7]
                assert block_size == PAGE and len(tokens) == PAGE and medium == "GPU" and lora_id is None
                assert h not in self.blocks, "stored twice without a removal"
                assert parent is None or parent in self.blocks, "a block whose parent is not cached"
                self.blocks[h] = (parent, tuple(tokens))
            elif kind == "BlockRemoved":
                for h in event[1]:
                    del self.blocks[h]
            else:
                assert kind == "AllBlocksCleared"
                self.blocks.clear()


def _receive(sub, rebuilt: Rebuilt, until, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@test@tiny"
            rebuilt.apply(seq, payload)


def test_a_subscriber_rebuilds_the_prefix_cache_from_the_events_alone(make_llm):
    # A pool of 40 pages under 24 requests of 40-90 tokens, half of them sharing 2-page prefixes:
    # registered pages are evicted all along.
    llm = make_llm(num_pages=40, decode_batch=(1, 2, 4), prefill_tokens=(16, 32))
    engine = llm.engine
    publisher = ZmqPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv@test@tiny", buffer=100_000)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(publisher.endpoint)
    try:
        time.sleep(0.3)  # PUB/SUB: the subscription reaches the publisher before the first batch
        events = engine.publish_kv_events(publisher.publish)
        rng = np.random.default_rng(3)
        shared = [rng.integers(3, 200, 2 * PAGE).tolist() for _ in range(3)]
        prompts = [(shared[i % 3] if i % 2 else []) + rng.integers(3, 200, int(rng.integers(24, 60))).tolist()
                   for i in range(24)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
        sequences = [p + o.token_ids for p, o in zip(prompts, outs)]
        engine.pool.check_all_free()
        assert engine.pool.num_evictions > 0
        rebuilt = Rebuilt()
        _receive(sub, rebuilt, lambda: not publisher.pending and len(rebuilt.seqs) == publisher.seq)
        truth = {_u64(h) for h in engine.pool._hash_of.values()}
        print(f"\n{events.num_events} events in {publisher.seq} batches ({rebuilt.kinds}); "
              f"{len(truth)} pages cached, {engine.pool.num_evictions} evicted")
        assert rebuilt.seqs == list(range(publisher.seq))  # every batch, in order
        assert set(rebuilt.blocks) == truth  # exactly the cache's contents
        assert rebuilt.kinds["BlockRemoved"] == engine.pool.num_evictions
        # Each block's tokens are a page of a real sequence: its chain back to a first page spells a
        # prefix of some request's prompt and output.
        for h in rebuilt.blocks:
            tokens, at = [], h
            while at is not None:
                parent, page = rebuilt.blocks[at]
                tokens[:0] = page
                at = parent
            assert any(seq[:len(tokens)] == tokens for seq in sequences), tokens

        # A late subscriber: the replay socket gives every batch from sequence 0, then the end marker.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = Rebuilt()
        while True:
            assert dealer.poll(10_000), "no replay"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.apply(seq, payload)
        assert replayed.blocks == rebuilt.blocks and replayed.seqs == rebuilt.seqs
        dealer.close(0)
        # Losing the device's pages clears the cache: one AllBlocksCleared.
        engine.pool.forget_cached()
        engine.pool.events.flush()
        _receive(sub, rebuilt, lambda: not publisher.pending and len(rebuilt.seqs) == publisher.seq)
        assert rebuilt.blocks == {} and rebuilt.kinds["AllBlocksCleared"] == 1
    finally:
        publisher.close()
        sub.close(0)
        ctx.term()


def test_a_malformed_endpoint_is_refused_before_loading(tiny_gguf_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "jaxcb", "serve", "--model", tiny_gguf_path, "--kv-events", "5557"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "kv_events: '5557' is not tcp://HOST:PORT" in done.stderr


@pytest.mark.parametrize("spec, replica, expected", [
    ("tcp://*:5557", 0, ("tcp://*:5557", "tcp://*:5558")),
    ("tcp://0.0.0.0:5557", 1, ("tcp://0.0.0.0:5559", "tcp://0.0.0.0:5560")),
])
def test_each_replica_publishes_on_ports_of_its_own(spec, replica, expected):
    from jaxcb.host.kv_events import endpoints

    assert endpoints(spec, replica) == expected
