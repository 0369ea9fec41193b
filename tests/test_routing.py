"""Prefix-aware routing across jaxcb servers by their KV-cache events and metrics, as the Gateway API
Inference Extension's endpoint picker does with its precise prefix scorer and load scorer. The router
here is a test harness, not a product: two `jaxcb serve --kv-events` on loopback, a router that keeps
each server's cached blocks from its events (keyed by its own hash of the tokens, as llm-d's indexer
keys them, never by jaxcb's) and scrapes its queue, and a workload of requests that share prefixes in
groups. Routed by events, the two servers together hit their prefix caches as often as one server that
sees every request; round-robin hits less (each group's prefix is computed on both)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import httpx
import msgpack
import numpy as np
import zmq
from prometheus_client.parser import text_string_to_metric_families

PAGE = 16


class Index(threading.Thread):
    """One server's cached blocks from its event stream: engine hash -> our key of the whole prefix."""

    def __init__(self, ctx, endpoint: str):
        super().__init__(daemon=True)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(endpoint)
        self.key_of: dict[int, bytes] = {}
        self.stored: list = []  # every BlockStored event, as it came
        self.keys: set[bytes] = set()
        self.batches = 0
        self.stopped = False

    def run(self):
        while not self.stopped:
            if not self.sub.poll(20):
                continue
            _, _, payload = self.sub.recv_multipart()
            self.batches += 1
            for e in msgpack.unpackb(payload)[1]:
                if e[0] == "BlockStored":
                    self.stored.append(e)
                    parent = self.key_of.get(e[2], b"") if e[2] is not None else b""
                    key = prefix_key(parent, e[3])
                    self.key_of[e[1][0]] = key
                    self.keys.add(key)
                elif e[0] == "BlockRemoved":
                    for h in e[1]:
                        self.keys.discard(self.key_of.pop(h, None))
                else:
                    self.key_of.clear()
                    self.keys.clear()
        self.sub.close(0)

    def matched_pages(self, prompt: list[int]) -> int:
        key, n = b"", 0
        for i in range(len(prompt) // PAGE):
            key = prefix_key(key, prompt[i * PAGE:(i + 1) * PAGE])
            if key not in self.keys:
                break
            n += 1
        return n


def prefix_key(parent: bytes, tokens) -> bytes:
    return hashlib.sha256(parent + np.asarray(tokens, np.int64).tobytes()).digest()


def scrape(metrics_port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def workload(seed: int, groups: int = 7, per_group: int = 5):
    """Waves: the first request of every group, then the second of every group, ...; each request is its
    group's 4-page prefix and a suffix of its own. An odd number of groups: round-robin sends each
    group's requests to both servers in turn."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 250, 4 * PAGE).tolist() for _ in range(groups)]
    return [[prefixes[g] + rng.integers(3, 250, int(rng.integers(8, 30))).tolist() for g in range(groups)]
            for _ in range(per_group)]


async def _send(client, http: str, prompt: list[int], outstanding: list[int], i: int):
    try:
        await _post(client, http, prompt)
    finally:
        outstanding[i] -= 1


async def _post(client, http: str, prompt: list[int]):
    r = await client.post(http + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True,
                                                         "temperature": 0}, timeout=120)
    r.raise_for_status()


async def _post_once(http: str, prompt: list[int]):
    async with httpx.AsyncClient() as client:
        await _post(client, http, prompt)


def run_phase(servers, indexes, waves, choose) -> dict:
    """Send the waves (each wave's requests at once), routing each request with choose(n, prompt,
    outstanding): outstanding[i] is how many of the router's requests server i has not answered."""
    before = [scrape(s.metrics_port) for s in servers]
    t0 = time.perf_counter()
    sent, outstanding, routing = [0] * len(servers), [0] * len(servers), [0.0]

    async def go():
        async with httpx.AsyncClient() as client:
            n = 0
            for wave in waves:
                jobs = []
                for prompt in wave:
                    t = time.perf_counter()
                    i = choose(n, prompt, outstanding)
                    routing[0] += time.perf_counter() - t
                    sent[i] += 1
                    outstanding[i] += 1
                    n += 1
                    jobs.append(_send(client, servers[i].http, prompt, outstanding, i))
                await asyncio.gather(*jobs)
                await asyncio.sleep(0.3)  # the wave's events reach the router

    asyncio.run(go())
    wall = time.perf_counter() - t0
    after = [scrape(s.metrics_port) for s in servers]
    delta = lambda name: sum(a.get(name, 0) - b.get(name, 0) for a, b in zip(after, before))  # noqa: E731
    queried, hits = delta("jaxcb:prefix_cache_queries_total"), delta("jaxcb:prefix_cache_hits_total")
    prompts = sum(len(p) for w in waves for p in w)
    # the router's own time (its scrapes) is not the servers': throughput counts the rest
    return {"hit_rate": hits / queried, "prompt_tokens_computed": prompts - hits, "wall_s": wall - routing[0],
            "routing_s": routing[0], "sent": sent, "output_tokens": 8 * sum(len(w) for w in waves)}


def test_routing_by_kv_events_keeps_the_single_server_hit_rate(tiny_gguf_path, config_path, make_llm):
    """Also, on the same servers: the endpoint picker's metric specs (deploy/inferencepool.yaml) name
    metrics they export, /kv_event_sources (vLLM's) names each publisher, and a server's events carry the hashes
    another engine gives the same prompt."""
    from jaxcb.host.request import SamplingParams
    from tests.server_util import ServerProcess, free_port, free_port_pair
    from tests.test_deploy import check_epp_metrics

    servers, ctx = [], zmq.Context()
    try:
        for _ in range(2):
            events, http = free_port_pair(), free_port()
            s = ServerProcess(tiny_gguf_path, config_path, "--http-port", str(http), "--kv-events",
                              f"tcp://127.0.0.1:{events}", "--max-loras", "1")
            s.http, s.events = f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{events}"
            servers.append(s)
        for s in servers:
            s.wait_serving()
        check_epp_metrics(httpx.get(servers[0].http + "/metrics", timeout=10).text)  # idle: before any request
        assert f"KV-cache events of replica 0 on {servers[0].events}" in servers[0].output()
        sources = httpx.get(servers[0].http + "/kv_event_sources", timeout=10).json()  # (vLLM's route)
        host, port = servers[0].events.rsplit(":", 1)
        assert sources == {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": servers[0].events,
                                 "replay_endpoint": f"{host}:{int(port) + 1}", "topic": sources["0"]["topic"]}}
        assert sources["0"]["topic"].startswith("kv@") and sources["0"]["topic"].endswith("@tiny")
        indexes = [Index(ctx, s.events) for s in servers]
        for ix in indexes:
            ix.start()
        time.sleep(0.3)

        scraped = [0.0, []]

        def by_events(n, prompt, outstanding):
            """The precise prefix scorer first (pages of the prompt cached, from the events), then load: the
            server's queue and running batch (its metrics) and what the router has sent it unanswered."""
            matched = [ix.matched_pages(prompt) for ix in indexes]
            if time.monotonic() - scraped[0] > 0.1:  # the picker refreshes metrics on an interval, not per request
                scraped[:] = [time.monotonic(), [scrape(s.metrics_port) for s in servers]]
            load = [m.get("jaxcb:num_requests_waiting", 0) + m.get("jaxcb:num_requests_running", 0) + mine
                    for m, mine in zip(scraped[1], outstanding)]
            return max(range(len(servers)), key=lambda i: (matched[i], -load[i], -i))

        single = run_phase(servers, indexes, workload(1), lambda n, p, o: 0)
        round_robin = run_phase(servers, indexes, workload(2), lambda n, p, o: n % 2)
        routed = run_phase(servers, indexes, workload(3), by_events)
        print(f"\nprefix-cache hit rate: one server {single['hit_rate']:.3f}, round-robin over 2 "
              f"{round_robin['hit_rate']:.3f}, routed by KV events over 2 {routed['hit_rate']:.3f}; prompt tokens "
              f"computed {single['prompt_tokens_computed']:.0f} / {round_robin['prompt_tokens_computed']:.0f} / "
              f"{routed['prompt_tokens_computed']:.0f}; serving wall {single['wall_s']:.1f} / {round_robin['wall_s']:.1f} / "
              f"{routed['wall_s']:.1f} s (the router's scrapes: {routed['routing_s']:.1f} s more); routed requests per "
              f"server {routed['sent']}")
        assert routed["hit_rate"] >= single["hit_rate"] > round_robin["hit_rate"]
        assert routed["prompt_tokens_computed"] < round_robin["prompt_tokens_computed"]
        assert min(routed["sent"]) > 0  # both servers serve: the groups spread by load, then stick by prefix

        # The same prefix, the same hashes: a new prompt's pages on server 0 and on an engine here.
        prompt = list(range(5, 5 + 3 * PAGE + 3))
        before = len(indexes[0].stored)
        asyncio.run(_post_once(servers[0].http, prompt))
        deadline = time.monotonic() + 20
        while len(indexes[0].stored) < before + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        served = indexes[0].stored[before:before + 3]
        mine = []
        llm = make_llm()
        llm.engine.publish_kv_events(lambda batch: mine.extend(e for e in batch[1] if e[0] == "BlockStored"))
        llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
        assert [e[1:4] for e in served] == [e[1:4] for e in mine[:3]]  # hashes, parents, tokens
        assert [e[3] for e in served] == [prompt[i * PAGE:(i + 1) * PAGE] for i in range(3)]
        assert served[0][2] is None and served[1][2] == served[0][1][0]
    finally:
        for s in servers:
            assert s.stop() == 0, s.output()
        for ix in locals().get("indexes", []):
            ix.stopped = True
            ix.join()
        ctx.term()
