"""Failures inside the engine, with the server run in this process (so a fault can be injected)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxcb.device.runner import ModelRunner
from jaxcb.host.engine import Engine
from jaxcb.host.engine_config import make_config
from serve.client import Client
from serve.server import ServerOptions, run_server
from tests.server_util import free_port


class InProcessServer:
    def __init__(self, tiny_model, http_port: int | None = None, warmup_gate: threading.Event | None = None):
        cfg, params, tok, eos = tiny_model
        config = make_config(num_pages=64, max_context=128, decode_batch=(1, 4), pages_per_seq=(8,),
                             prefill_tokens=(32,))
        self.engine = Engine(ModelRunner(cfg, params, config.num_pages, config.page_size), tok, config, eos_ids=eos)
        self.announced: list[str] = []
        if warmup_gate is not None:  # warm-up waits until the test opens the gate
            warmup = self.engine.warmup
            self.engine.warmup = lambda progress=None: warmup(progress) if warmup_gate.wait(120) else 0
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.code = None
        self.http_port = http_port
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        def announce(msg):
            self.announced.append(msg)
            if "SERVING" in msg:
                self.ready.set()

        opts = ServerOptions(port=self.port, grace_s=0, http_port=self.http_port)
        self.code = asyncio.run(run_server(self.engine, self.engine.tokenizer, "tiny", "float32", opts, announce))
        self.ready.set()


def health(target):
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_failed_step_fails_its_requests_with_internal_and_serving_goes_on(tiny_model):
    s = InProcessServer(tiny_model)
    assert s.ready.wait(120)
    poison = 77

    def inject(out):
        if any(poison in c.request.prompt_ids for c in out.decode + out.prefill):
            raise RuntimeError("injected device failure")

    s.engine.fault_injector = inject
    with Client(s.target) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.complete(token_ids=[5, poison, 6], max_tokens=5, timeout=30)
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert "injected device failure" in e.value.details()
        ok = c.complete(token_ids=[5, 6, 7], max_tokens=5, ignore_eos=True, timeout=30)
        assert ok.completion_tokens == 5
        # The final message can reach the client a moment before the engine thread has put the
        # request's pages back (it emits, then retires): wait for that, briefly.
        deadline = time.monotonic() + 10
        while (info := c.server_info()).pages_free != info.pages_total and time.monotonic() < deadline:
            time.sleep(0.02)
        assert info.pages_free == info.pages_total and info.running == 0
    assert health(s.target) == health_pb2.HealthCheckResponse.SERVING
    s.engine.fault_injector = None
    s.engine.step = _raise  # now the loop itself breaks: the engine thread dies
    with Client(s.target) as c:
        with pytest.raises(grpc.RpcError):
            c.complete(token_ids=[5, 6], max_tokens=3, timeout=30)
    s.thread.join(60)
    assert s.code == 1  # the server exits non-zero instead of accepting calls it would never answer


def _raise():
    raise MemoryError("engine broken beyond one step")


def test_a_request_during_warm_up_is_told_to_retry_on_both_apis(tiny_model):
    """Until warm-up is done (the engine thread starts after it), gRPC answers UNAVAILABLE and HTTP 503,
    both saying the server is warming up (not that the engine is not running); then both serve."""
    import httpx

    gate = threading.Event()
    s = InProcessServer(tiny_model, http_port=free_port(), warmup_gate=gate)
    deadline = time.monotonic() + 60
    while not any("warming up" in m for m in s.announced) or not any("HTTP" in m for m in s.announced):
        assert time.monotonic() < deadline, s.announced
        time.sleep(0.02)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3}
    with Client(s.target) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.complete(token_ids=[5, 6, 7], max_tokens=3, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in e.value.details()
        r = httpx.post(f"http://127.0.0.1:{s.http_port}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "warming up" in r.json()["error"]["message"], r.text
        gate.set()
        assert s.ready.wait(120)
        assert c.complete(token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True, timeout=30).completion_tokens == 3
        r = httpx.post(f"http://127.0.0.1:{s.http_port}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    s.engine.step = _raise  # the server's way out (run_server stops on SIGTERM, main thread only): a
    with Client(s.target) as c:  # request meets the broken engine, whose death ends the server
        with pytest.raises(grpc.RpcError):
            c.complete(token_ids=[5, 6], max_tokens=3, timeout=30)
    s.thread.join(60)
    assert s.code == 1


def test_a_failed_warm_up_ends_the_server_with_its_error(tiny_model):
    """Warm-up runs on a thread of its own; its failure must reach run_server, not hang it."""
    cfg, params, tok, eos = tiny_model
    config = make_config(num_pages=64, max_context=128, decode_batch=(1, 4), pages_per_seq=(8,),
                         prefill_tokens=(32,))
    engine = Engine(ModelRunner(cfg, params, config.num_pages, config.page_size), tok, config, eos_ids=eos)

    def broken(progress=None):
        raise RuntimeError("the compiler ran out of memory")

    engine.warmup = broken
    opts = ServerOptions(port=free_port(), grace_s=0)
    with pytest.raises(RuntimeError, match="the compiler ran out of memory"):
        asyncio.run(asyncio.wait_for(run_server(engine, tok, "tiny", "float32", opts, lambda m: None), 60))
    # The gRPC server was stopped on the way out (an unstopped one keeps the process from exiting):
    # its port can be bound again.
    with socket.socket() as s:
        s.bind(("127.0.0.1", opts.port))


def test_an_engine_death_ends_every_open_stream_with_an_error_and_the_server_exits_non_zero(tiny_model):
    """A gRPC stream and an HTTP stream are open when the engine thread dies: both end at once with an
    error (nothing more will come from a dead engine), and run_server returns 1."""
    import json

    import httpx

    s = InProcessServer(tiny_model, http_port=free_port())
    assert s.ready.wait(120)
    body = {"prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True, "stream": True}
    ends = {}

    def http_stream(started):
        lines = []
        with httpx.stream("POST", f"http://127.0.0.1:{s.http_port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                started.set()
        ends["http"] = lines

    def grpc_stream(started):
        with Client(s.target) as c:
            try:
                for _ in c.generate(token_ids=[5, 6, 7], max_tokens=120, ignore_eos=True, timeout=60):
                    started.set()
                ends["grpc"] = "finished"
            except grpc.RpcError as e:
                ends["grpc"] = e.code()

    # Slow steps, so that both streams are surely open when the engine dies.
    s.engine.fault_injector = lambda out: time.sleep(0.05)
    events = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=http_stream, args=(events[0],)),
               threading.Thread(target=grpc_stream, args=(events[1],))]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in events)
    s.engine.step = _raise
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    errors = [json.loads(line[6:]) for line in ends["http"] if line.startswith("data: {") and '"error"' in line]
    assert errors and "engine stopped" in errors[-1]["error"]["message"], ends["http"][-3:]
    assert ends["grpc"] == grpc.StatusCode.UNAVAILABLE
    s.thread.join(60)
    assert s.code == 1
