"""Per-step cost of the multi-host leader broadcast (jaxcb.device.multihost), two local processes.

    .venv/bin/python -m bench.broadcast [--running 32 256] [--steps 200] [--devices-per-process 2]

Starts two processes of `--devices-per-process` forced host devices joined by jax.distributed
(gloo). For a decode step of each running count (SmolLM2's default context, 2048 tokens, so 128
pages per sequence in the page table), the leader sends what it sends every step (the header, then
the padded step input as one byte buffer) and the follower receives it; prints bytes and
milliseconds per step as the leader sees them (the follower waits in the same collectives).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def worker(args) -> None:
    from jaxcb.device import multihost
    from jaxcb.host.engine_config import make_config

    multihost.initialize(args.coordinator, 2, args.process_id)
    config = make_config(decode_batch=tuple(args.running), max_context=2048, prefill_tokens=(512,))
    shapes = [config.buckets.step_shape(n, config.page_size, 2048) for n in args.running]
    channel = multihost.Channel(shapes, config.page_size, 49152)  # SmolLM2's vocabulary
    results = {}
    for shape in shapes:
        for phase in ("warm", "timed"):
            steps = 10 if phase == "warm" else args.steps
            t0 = time.perf_counter()
            for _ in range(steps):
                if multihost.is_leader():
                    channel.send(multihost.OP_RUN, shape)
                else:
                    channel.receive()
            per_step = (time.perf_counter() - t0) / steps
        results[shape.seqs] = {"bytes_per_step": channel.payload_bytes(shape) + 4 * multihost.HEADER_WORDS,
                               "ms_per_step": round(per_step * 1e3, 3)}
    if multihost.is_leader():
        from common import machine

        print(json.dumps({"machine": machine(), "processes": 2, "devices_per_process": args.devices_per_process,
                          "steps": args.steps, "by_running": results}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--running", type=int, nargs="+", default=[32, 256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--devices-per-process", type=int, default=2)
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.process_id is not None:
        return worker(args)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices_per_process}"}
    common = [sys.executable, __file__, "--coordinator", f"127.0.0.1:{port}", "--steps", str(args.steps),
              "--devices-per-process", str(args.devices_per_process), "--running", *map(str, args.running)]
    follower = subprocess.Popen(common + ["--process-id", "1"], env=env, stderr=subprocess.DEVNULL)
    leader = subprocess.run(common + ["--process-id", "0"], env=env, stderr=subprocess.DEVNULL)
    follower.wait()
    sys.exit(leader.returncode or follower.returncode)


if __name__ == "__main__":
    main()
