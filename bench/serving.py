"""Serving benchmark: Poisson arrivals against a running server, over the jaxcb, JetStream or OpenAI API.

    .venv/bin/python -m bench.serving --spawn --rates 0.5,1,2,inf --requests 32 --json out.json --plot lat.png
    .venv/bin/python -m bench.serving --target 127.0.0.1:50051 --rates inf --api jetstream
    .venv/bin/python -m bench.serving --spawn --api openai --also llama.cpp=http://127.0.0.1:8081/v1
    .venv/bin/python -m bench.serving --api openai --openai http://127.0.0.1:8000/v1   # any OpenAI server

With `--api openai` the requests go to `/v1/completions` (token-id prompts, `stream: true`,
`ignore_eos`, usage in the last chunk), so the same client and trace measure any OpenAI-compatible
server; `--also NAME=URL` (repeatable) runs more such endpoints in the same run, interleaved rate by
rate with the main target (the machines are noisy), and prints one table.

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
import subprocess
import sys
import time

import numpy as np

from bench.common import machine, write_result
from bench.engine import workload


async def one_request(stub, api, prompt, max_tokens, start_at, t0, sem):
    from serve.proto import jaxcb_pb2, jetstream_pb2

    await asyncio.sleep(max(0.0, start_at - (time.perf_counter() - t0)))
    async with sem:
        sent = time.perf_counter()
        arrivals = []
        if api == "openai":  # stub: (httpx.AsyncClient, base URL)
            client, base = stub
            body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                    "temperature": 0.0, "stream_options": {"include_usage": True}}
            tokens = None
            async with client.stream("POST", base + "/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        arrivals.append(time.perf_counter())
            if tokens and len(arrivals) > 1 and tokens != len(arrivals):  # chunks held several tokens
                first, last = arrivals[0], arrivals[-1]
                arrivals = [first] + list(np.linspace(first, last, tokens)[1:])
        elif api == "jaxcb":
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
    sem = asyncio.Semaphore(concurrency or len(prompts))
    if api == "openai":
        import httpx

        limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one_request((client, target.rstrip("/")), api, p, int(n), s, t0, sem)
                                             for p, n, s in zip(prompts, outputs, starts)))
            wall = time.perf_counter() - t0
    else:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = jaxcb_pb2_grpc.JaxcbStub(ch) if api == "jaxcb" else jetstream_pb2_grpc.OrchestratorStub(ch)
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


def table(runs, slo_ttft, slo_tpot) -> str:
    head = (f"{'server':<12}{'rate':>6}{'req/s':>8}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
            f"{'TPOT p99':>10}{'ITL p50':>9}{'E2E p50':>9}{'goodput':>9}")
    lines = [f"SLO: TTFT <= {slo_ttft:.0f} ms and TPOT <= {slo_tpot:.0f} ms (goodput: requests/s meeting both)", head]
    for r in runs:
        lines.append(f"{r.get('name', ''):<12}{str(r['rate']):>6}{r['request_throughput']:>8.2f}"
                     f"{r['output_tokens_per_s']:>8.1f}{r['ttft_ms'].get('p50', math.nan):>10.0f}"
                     f"{r['ttft_ms'].get('p99', math.nan):>10.0f}{r['tpot_ms'].get('p50', math.nan):>10.0f}"
                     f"{r['tpot_ms'].get('p99', math.nan):>10.0f}{r['itl_ms'].get('p50', math.nan):>9.0f}"
                     f"{r['e2e_ms'].get('p50', math.nan):>9.0f}{r['goodput_rps']:>9.2f}")
    return "\n".join(lines)


def spawn(args):
    from tests.server_util import free_port  # tests/server_util.py

    port, http = free_port(), free_port()
    cmd = [sys.executable, "-m", "jaxcb", "serve", "--port", str(port), "--http-port", str(http)]
    if args.config:
        cmd += ["--config", args.config]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print("  server:", line.rstrip(), file=sys.stderr)
        if "SERVING" in line:
            return proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{http}/v1"
    raise RuntimeError("the server exited before SERVING")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--spawn", action="store_true", help="start a server for the run")
    ap.add_argument("--model", default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--api", choices=("jaxcb", "jetstream", "openai"), default="jaxcb")
    ap.add_argument("--openai", default=None, metavar="URL", help="base URL of an OpenAI-compatible API "
                    "(with --api openai; default: the spawned server's)")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=URL",
                    help="another OpenAI-compatible endpoint run in the same run, interleaved rate by rate "
                         "(URL 'spawned': the spawned server's own HTTP API, to compare it with its gRPC)")
    ap.add_argument("--name", default="jaxcb", help="the main target's name in the table")
    ap.add_argument("--rates", default="1,2,4,inf")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=0, help="cap on requests in flight (0 = none)")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
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

    proc, spawned_http = None, None
    if args.spawn:
        proc, args.target, spawned_http = spawn(args)
        args.openai = args.openai or spawned_http
    if args.api == "openai":
        args.target = args.openai or "http://127.0.0.1:8000/v1"
    also = [a.split("=", 1) for a in args.also]  # URL "spawned": the spawned server's HTTP API
    targets = [(args.name, args.api, args.target)] + [(n, "openai", spawned_http if u == "spawned" else u)
                                                      for n, u in also]
    try:
        vocab = 49152
        prompts, outputs = workload(args.requests, args.seed, vocab)
        runs = []
        for rate in [float(r) for r in args.rates.split(",")]:
            for name, api, target in targets:  # interleaved: every endpoint at this rate, then the next
                r = asyncio.run(run_rate(target, api, prompts, outputs, rate, args.concurrency, args.seed,
                                         args.slo_ttft_ms, args.slo_tpot_ms))
                r["name"], r["api"] = name, api
                runs.append(r)
                print(f"{name:>10} ({api}) rate {r['rate']:>5} req/s: {r['request_throughput']:.2f} req/s, "
                      f"{r['output_tokens_per_s']:.1f} tok/s; "
                      f"TTFT p50 {r['ttft_ms']['p50']:.0f} p99 {r['ttft_ms']['p99']:.0f} ms; "
                      f"TPOT p50 {r['tpot_ms']['p50']:.0f} p99 {r['tpot_ms']['p99']:.0f} ms; "
                      f"ITL p50 {r['itl_ms']['p50']:.0f} ms; E2E p50 {r['e2e_ms']['p50']:.0f} ms; "
                      f"goodput {r['goodput_rps']:.2f} req/s", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    result = {"machine": machine(), "api": args.api, "requests": args.requests, "runs": runs}
    print(table(runs, args.slo_ttft_ms, args.slo_tpot_ms))
    write_result(result, args.json)
    if args.plot:
        plot(result, args.plot)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r.get("name", "jaxcb") for r in runs):
        mine = [r for r in runs if r.get("name", "jaxcb") == name]
        xs = [r["output_tokens_per_s"] for r in mine]
        for key, label, style in (("ttft_ms", "TTFT p50", "o-"), ("tpot_ms", "TPOT p50", "s--")):
            ax.plot(xs, [r[key].get("p50", math.nan) for r in mine], style, label=f"{name} {label}")
        for x, r in zip(xs, mine):
            ax.annotate(f"{r['rate']}/s", (x, r["ttft_ms"].get("p50", math.nan)), fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("latency (ms)")
    names = ", ".join(dict.fromkeys(r.get("name", "jaxcb") for r in runs))
    ax.set_title(f"serving: {names}\n{result['machine']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
