"""Server start to SERVING, cold (empty compile cache) and again on the same cache.

    .venv/bin/python -m bench.startup [--config C] [--model M] [--runs 2]

Starts `jaxcb serve` as a user would, with a fresh compile-cache directory, and measures the seconds
from spawning the process until gRPC health says SERVING (model load + warm-up of every bucket);
then stops it and starts it again on the same cache, `--runs` times in all.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

from bench.common import machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_serving(args, cache_dir: str) -> float:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = free_port()
    cmd = [os.path.join(os.path.dirname(sys.executable), "jaxcb"), "serve", "--port", str(port),
           "--compile-cache", cache_dir]
    cmd += ["--config", args.config] if args.config else []
    cmd += ["--model", args.model] if args.model else []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"jaxcb serve exited with {proc.returncode}")
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return time.perf_counter() - t0
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="jaxcb-xla-") as cache_dir:
        times = [time_to_serving(args, cache_dir) for _ in range(args.runs)]
    print(f"machine: {machine()}; config {args.config or 'configs/default.toml'}")
    print(f"cold start to SERVING: {times[0]:.1f} s")
    for i, t in enumerate(times[1:], start=2):
        print(f"start {i} (same compile cache): {t:.1f} s = {times[0] / t:.1f}x faster")


if __name__ == "__main__":
    main()
