"""Serving benchmark: Poisson arrivals against a running jaxcb server, over the jaxcb or JetStream API.

    .venv/bin/python bench/serving.py --spawn --rates 0.5,1,2,inf --requests 32 --json out.json --plot lat.png
    .venv/bin/python bench/serving.py --target 127.0.0.1:50051 --rates inf --api jetstream

--spawn starts `jaxcb serve` (the embedded model, configs/default.toml unless --config) and waits for
SERVING. For each rate (requests/s; inf = all at once) it sends the same workload (prompt and output
lengths log-normal as in bench/engine.py, EOS ignored) with an optional concurrency cap, and reports
request and output-token throughput, TTFT, TPOT (excluding the first token), inter-token latency and
end-to-end latency (mean, p50, p90, p99), and goodput: requests/s that met both SLOs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from common import machine  # noqa: E402
from engine import workload  # noqa: E402


async def one_request(stub, api, prompt, max_tokens, start_at, t0, sem):
    from serve.proto import jaxcb_pb2, jetstream_pb2

    await asyncio.sleep(max(0.0, start_at - (time.perf_counter() - t0)))
    async with sem:
        sent = time.perf_counter()
        arrivals = []
        if api == "jaxcb":
            req = jaxcb_pb2.GenerateRequest(max_tokens=max_tokens, ignore_eos=True, tokens=jaxcb_pb2.TokenInput(token_ids=prompt))
            async for resp in stub.Generate(req):
                if resp.HasField("chunk") and resp.chunk.token_ids:
                    arrivals.extend([time.perf_counter()] * len(resp.chunk.token_ids))
        else:
            req = jetstream_pb2.DecodeRequest(max_tokens=max_tokens, token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=prompt))
            async for resp in stub.Decode(req):
                n = sum(len(s.token_ids) for s in resp.stream_content.samples)
                arrivals.extend([time.perf_counter()] * n)
        end = time.perf_counter()
    return {"sent": sent - t0, "ttft": arrivals[0] - sent if arrivals else math.nan, "e2e": end - sent,
            "n": len(arrivals), "itl": list(np.diff(arrivals)) if len(arrivals) > 1 else [],
            "tpot": (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else math.nan}


def summarize(values):
    v = np.asarray([x for x in values if not math.isnan(x)], float) * 1000
    if v.size == 0:
        return {}
    return {"mean": round(float(v.mean()), 1), "p50": round(float(np.percentile(v, 50)), 1),
            "p90": round(float(np.percentile(v, 90)), 1), "p99": round(float(np.percentile(v, 99)), 1)}


async def run_rate(target, api, prompts, outputs, rate, concurrency, seed, slo_ttft, slo_tpot):
    import grpc

    from serve.proto import jaxcb_pb2_grpc, jetstream_pb2_grpc

    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(prompts)) if math.isfinite(rate) else np.zeros(len(prompts))
    starts = np.cumsum(gaps) - gaps[0]
    async with grpc.aio.insecure_channel(target) as ch:
        stub = jaxcb_pb2_grpc.JaxcbStub(ch) if api == "jaxcb" else jetstream_pb2_grpc.OrchestratorStub(ch)
        sem = asyncio.Semaphore(concurrency or len(prompts))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(stub, api, p, int(n), s, t0, sem)
                                         for p, n, s in zip(prompts, outputs, starts)))
        wall = time.perf_counter() - t0
    good = sum(1 for r in results if r["ttft"] * 1000 <= slo_ttft and (math.isnan(r["tpot"]) or r["tpot"] * 1000 <= slo_tpot))
    out_tokens = sum(r["n"] for r in results)
    return {
        "rate": rate if math.isfinite(rate) else "inf", "requests": len(results), "wall_s": round(wall, 2),
        "request_throughput": round(len(results) / wall, 3), "output_tokens_per_s": round(out_tokens / wall, 1),
        "ttft_ms": summarize(r["ttft"] for r in results), "tpot_ms": summarize(r["tpot"] for r in results),
        "itl_ms": summarize(x for r in results for x in r["itl"]), "e2e_ms": summarize(r["e2e"] for r in results),
        "goodput_rps": round(good / wall, 3), "slo": {"ttft_ms": slo_ttft, "tpot_ms": slo_tpot},
    }


def spawn(args):
    from server_util import free_port  # tests/server_util.py

    port = free_port()
    cmd = [sys.executable, "-m", "jaxcb", "serve", "--port", str(port)]
    if args.config:
        cmd += ["--config", args.config]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print("  server:", line.rstrip(), file=sys.stderr)
        if "SERVING" in line:
            return proc, f"127.0.0.1:{port}"
    raise RuntimeError("the server exited before SERVING")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--spawn", action="store_true", help="start a server for the run")
    ap.add_argument("--model", default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--api", choices=("jaxcb", "jetstream"), default="jaxcb")
    ap.add_argument("--rates", default="1,2,4,inf")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=0, help="cap on requests in flight (0 = none)")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()

    proc = None
    if args.spawn:
        proc, args.target = spawn(args)
    try:
        vocab = 49152
        prompts, outputs = workload(args.requests, args.seed, vocab)
        runs = []
        for rate in [float(r) for r in args.rates.split(",")]:
            r = asyncio.run(run_rate(args.target, args.api, prompts, outputs, rate, args.concurrency, args.seed,
                                     args.slo_ttft_ms, args.slo_tpot_ms))
            runs.append(r)
            print(f"rate {r['rate']:>5} req/s: {r['request_throughput']:.2f} req/s, {r['output_tokens_per_s']:.1f} tok/s; "
                  f"TTFT p50 {r['ttft_ms']['p50']:.0f} p99 {r['ttft_ms']['p99']:.0f} ms; "
                  f"TPOT p50 {r['tpot_ms']['p50']:.0f} p99 {r['tpot_ms']['p99']:.0f} ms; "
                  f"ITL p50 {r['itl_ms']['p50']:.0f} ms; E2E p50 {r['e2e_ms']['p50']:.0f} ms; "
                  f"goodput {r['goodput_rps']:.2f} req/s", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    result = {"machine": machine(), "api": args.api, "requests": args.requests, "runs": runs}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["output_tokens_per_s"] for r in runs]
        for key, label in (("ttft_ms", "TTFT p50"), ("tpot_ms", "TPOT p50"), ("e2e_ms", "E2E p50")):
            ax.plot(xs, [r[key]["p50"] for r in runs], "o-", label=label)
        for x, r in zip(xs, runs):
            ax.annotate(f"{r['rate']}/s", (x, r["e2e_ms"]["p50"]), fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"jaxcb serving, {args.api} API\n{result['machine']}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print("wrote", args.plot)


if __name__ == "__main__":
    main()
