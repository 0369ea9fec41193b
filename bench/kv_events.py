"""KV-cache events under the engine benchmark's workload: how many, what publishing costs, and whether a
subscriber's rebuilt cache equals the engine's.

    .venv/bin/python -m bench.kv_events [--requests 32] [--trials 2] [--num-pages 512] [--json out.json]

SmolLM2, the engine benchmark's 32 requests (bench/engine.py: prompts median 75 tokens, outputs median 45,
EOS ignored, all at once), on one engine, alternately without events and with a ZmqPublisher on
loopback and a subscriber that rebuilds the cache from the events (msgpack only). A pool of --num-pages
pages makes the cache evict as it goes. Prints events and batches per second, the engine thread's time
in the event hooks per step, the publisher thread's encode-and-send time per batch, throughput with
events over without (interleaved trials), and the rebuilt cache against the engine's (pages compared).
"""

from __future__ import annotations

import argparse
import threading
import time

import msgpack
import zmq

from bench.common import machine, write_result
from bench.engine import run, workload


class Subscriber(threading.Thread):
    """Rebuilds the cache from the events: hash -> parent."""

    def __init__(self, endpoint: str):
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.blocks: dict[int, int | None] = {}
        self.batches = self.events = 0
        self.stop = False

    def run(self):
        while not self.stop:
            if not self.sub.poll(50):
                continue
            _, _, payload = self.sub.recv_multipart()
            self.batches += 1
            for e in msgpack.unpackb(payload)[1]:
                self.events += 1
                if e[0] == "BlockStored":
                    self.blocks[e[1][0]] = e[2]
                elif e[0] == "BlockRemoved":
                    for h in e[1]:
                        self.blocks.pop(h)
                else:
                    self.blocks.clear()
        self.sub.close(0)
        self.ctx.term()


def timed_hooks(events) -> list[float]:
    """Wrap the engine-side hooks (stored, removed, flush) to add their time to the returned cell."""
    spent = [0.0]
    for name in ("stored", "removed", "flush"):
        original = getattr(events, name)

        def wrapper(*a, _f=original, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t

        setattr(events, name, wrapper)
    return spent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--num-pages", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from jaxcb.host.engine import Engine
    from jaxcb.host.kv_events import ZmqPublisher, block_hash
    from jaxcb.llm import build_engine

    first = build_engine(None, None)
    config = first.config.replace(num_pages=args.num_pages)

    def engine():
        return Engine(first.runner, first.tokenizer, config, eos_ids=first.scheduler.eos_ids)

    engine().warmup()
    prompts, lens = workload(args.requests, 0, first.model_config.vocab_size)
    off, on, checks = [], [], []
    for _ in range(args.trials):
        off.append(run(engine(), prompts, lens))
        e = engine()
        publisher = ZmqPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv@bench@smollm2-135m")
        sub = Subscriber(publisher.endpoint)
        sub.start()
        time.sleep(0.3)
        events = e.publish_kv_events(publisher.publish)
        spent = timed_hooks(events)
        r = run(e, prompts, lens)
        deadline = time.monotonic() + 30
        while (publisher.pending or sub.batches < publisher.seq) and time.monotonic() < deadline:
            time.sleep(0.05)
        truth = {block_hash(h) for h in e.pool._hash_of.values()}
        r.update(events=events.num_events, batches=publisher.seq, evictions=e.pool.num_evictions,
                 events_per_s=round(events.num_events / r["wall_s"], 1),
                 hook_ms_per_step=round(1000 * spent[0] / r["steps"], 3),
                 publish_ms_per_batch=round(1000 * publisher.encode_s / max(1, publisher.seq), 3),
                 cached_pages=len(truth), rebuilt_pages=len(sub.blocks), rebuilt_equal=set(sub.blocks) == truth)
        on.append(r)
        sub.stop = True
        sub.join()
        publisher.close()
        checks.append(r["rebuilt_equal"])
    median = lambda runs: sorted(runs, key=lambda x: x["wall_s"])[len(runs) // 2]  # noqa: E731
    a, b = median(off), median(on)
    result = {"machine": machine(), "requests": args.requests, "num_pages": args.num_pages, "trials": args.trials,
              "without": a, "with": b, "ratio": round(b["output_tokens_per_s"] / a["output_tokens_per_s"], 3),
              "rebuilt_equal_every_trial": all(checks)}
    print(f"machine: {result['machine']}")
    print(f"without events: {a['output_tokens_per_s']} tok/s; with: {b['output_tokens_per_s']} tok/s "
          f"({result['ratio']:.3f}x; medians of {args.trials} interleaved)")
    print(f"events: {b['events']} in {b['batches']} batches ({b['events_per_s']}/s), {b['evictions']} evictions; "
          f"engine hooks {b['hook_ms_per_step']} ms/step over {b['steps']} steps; publisher "
          f"{b['publish_ms_per_batch']} ms/batch (its own thread)")
    print(f"rebuilt cache: {b['rebuilt_pages']} pages vs the engine's {b['cached_pages']}: "
          f"{'equal' if result['rebuilt_equal_every_trial'] else 'DIFFERENT'} in every trial")
    write_result(result, args.json)


if __name__ == "__main__":
    main()
