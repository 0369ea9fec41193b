"""Start `jaxcb serve` as a user would, in its own process, and wait for it to report SERVING."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def compile_mode(model_config) -> str:
    """EngineConfig.compile for a test's model: the tiny random models' steps cost nothing to run, so
    they compile "fast" (most of the suite's time is XLA compiling them); the real models keep XLA's
    optimised compile, as served."""
    return "fast" if model_config.hidden_size < 512 else "optimized"


SMALL_CONFIG = (  # for the tiny test models (compile = "fast": compile_mode; compact JSON: random weights pick
    "[model]\ncompile = \"fast\"\njson_whitespace = \"compact\"\n"  # whitespace among the tokens a gap allows)
    "[cache]\npage_size = 16\nnum_pages = 96\n"
    "[scheduler]\nmax_context = 256\nmax_prefill_tokens = 64\n"
    "[buckets]\ndecode_batch = [1, 2, 4, 8]\npages_per_seq = [4, 16]\nprefill_tokens = [32, 64]\n"
)


def wait_pool_whole(client, timeout=10.0):
    """The server's GetServerInfo once nothing runs or waits and every page is free (via a
    serve.client.Client); fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        info = client.server_info()
        if info.pages_free == info.pages_total and info.running == 0 and info.waiting == 0:
            return info
        assert time.monotonic() < deadline, f"pool not whole: {info}"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p such that p and p + 1 are free (`--kv-events` binds both), taken below the kernel's
    ephemeral range, where free_port's next answer (any process's) cannot land on p + 1."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20_000, 32_000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free ports in a row below 32,000")


class ServerProcess:
    def __init__(self, model: str, config: str, *extra: str, env=None, port: int | None = None):
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "jaxcb", "serve", "--model", model, "--config", config,
               "--port", str(self.port), "--metrics-port", str(self.metrics_port), *extra]
        self.log_path = config + f".{self.port}.{self.metrics_port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def wait_serving(self, timeout=240.0, metadata=None):
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, f"server exited early:\n{self.output()}"
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2, metadata=metadata)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise AssertionError(f"server not SERVING after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout=30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def http_server(model: str, config: str, *args: str):
    """A `jaxcb serve` with the HTTP API (its URL as .http), stopped cleanly at the end (a fixture's generator)."""
    http = free_port()
    s = ServerProcess(model, config, "--http-port", str(http), *args)
    s.http = f"http://127.0.0.1:{http}"
    try:
        s.wait_serving()
        yield s
    finally:
        assert s.stop() == 0, s.output()
