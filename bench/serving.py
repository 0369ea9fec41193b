"""Serving benchmark with a server of its own: `jaxcb bench serve` (serve/benchmark.py) against a
`jaxcb serve` this script starts (--spawn) and stops, with every option of `jaxcb bench serve`.

    .venv/bin/python -m bench.serving --spawn --rates 0.5,1,2,inf --requests 32 --json out.json --plot lat.png
    .venv/bin/python -m bench.serving --spawn --api grpc --rates inf
    .venv/bin/python -m bench.serving --spawn --also llama.cpp=http://127.0.0.1:8081/v1
    .venv/bin/python -m bench.serving --spawn --api grpc --name grpc --also http=spawned  # both APIs, one server
    .venv/bin/python -m bench.serving --from-json out.json --plot lat.png

--spawn starts `jaxcb serve` (the embedded model unless --serve-model, configs/default.toml unless
--config) with both APIs and waits for SERVING; --url defaults to its HTTP API (or its gRPC port with
--api grpc/jetstream), and an --also URL `spawned` is its HTTP API. The machine line is the server's
(this machine, its JAX devices).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench.common import machine
from serve.benchmark import add_args, grpc_vocab, plot, run, table


def spawn(args):
    from tests.server_util import free_port  # tests/server_util.py

    port, http = free_port(), free_port()
    cmd = [sys.executable, "-m", "jaxcb", "serve", "--port", str(port), "--http-port", str(http)]
    if args.config:
        cmd += ["--config", args.config]
    if args.serve_model:
        cmd += ["--model", args.serve_model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print("  server:", line.rstrip(), file=sys.stderr)
        if "SERVING" in line:
            return proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{http}/v1"
    raise RuntimeError("the server exited before SERVING")


def main():
    ap = argparse.ArgumentParser()
    add_args(ap, url_required=False)
    ap.add_argument("--spawn", action="store_true", help="start a server for the run")
    ap.add_argument("--serve-model", default=None, help="the spawned server's --model")
    ap.add_argument("--config", default=None, help="the spawned server's --config")
    ap.add_argument("--from-json", default=None, metavar="FILE",
                    help="print the table (and --plot) of an earlier run's --json instead of running")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        print(table(result["runs"], args.slo_ttft_ms, args.slo_tpot_ms))
        if args.plot:
            plot(result, args.plot)
        return
    proc = None
    try:
        if args.spawn:
            proc, grpc_target, http = spawn(args)
            args.url = args.url or (http if args.api == "openai" else grpc_target)
            args.vocab_size = args.vocab_size or grpc_vocab(grpc_target)  # the spawned model's, for every API
            args.also = [f"{n}={http}" if u == "spawned" else f"{n}={u}" for n, _, u in
                         (a.partition("=") for a in args.also)]
        if not args.url:
            ap.error("--url is required without --spawn")
        run(args, machine=machine() if args.spawn else None)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
