"""The serving benchmark (`jaxcb bench serve`): Poisson arrivals against any running server, over the
OpenAI API (`/v1/completions`, streaming), jaxcb's gRPC API or JetStream's.

    jaxcb bench serve --url http://127.0.0.1:8000 --rates 1,2,inf --requests 64
    jaxcb bench serve --url 127.0.0.1:50051 --api grpc --max-concurrency 8
    jaxcb bench serve --url http://127.0.0.1:8000 --also vllm=http://127.0.0.1:8001  # two servers, interleaved

For each rate (requests/s; inf = all at once) it sends the same workload, with an optional cap on
requests in flight, and reports request and output-token throughput, TTFT, TPOT (excluding the first
token), inter-token latency and end-to-end latency (mean, p50, p90, p99) and goodput (requests/s that met
both SLOs), as a table and a JSON line (and a file with --json). The workload is random token ids with
log-normal prompt and output lengths around --input-len and --output-len (EOS ignored, greedy), or a jaxcb
JSONL of requests (--dataset: `prompt_token_ids` or `prompt`, and `max_tokens` per line), or ShareGPT's JSON
(sampled as `vllm bench serve --dataset-name sharegpt` samples it); or a trace (--trace:
jaxcb's, Mooncake's, Azure's or BurstGPT's, as `jaxcb simulate` reads them), replayed at its own arrival times
(--time-scale stretches them) instead of --rates, so a real server's figures stand beside the simulator's. With --also the
other endpoints (OpenAI-compatible) run rate by rate with the main one, so a noisy machine treats them
alike. Nothing here needs JAX: it measures a server from the outside.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import time

import numpy as np

APIS = ("openai", "grpc", "jetstream")


def workload(n: int, seed: int, vocab: int, input_len: float = 75, output_len: float = 45,
             max_input: int = 384, max_output: int = 192):
    """n random prompts (token ids in [100, vocab - 100)) and output lengths, log-normal (sigma 0.8)
    around the given medians, clipped to [8, max_input] and [4, max_output]."""
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(np.round(np.exp(rng.normal(np.log(input_len), 0.8, n))), 8, max_input).astype(int)
    output_lens = np.clip(np.round(np.exp(rng.normal(np.log(output_len), 0.8, n))), 4, max_output).astype(int)
    prompts = [rng.integers(100, vocab - 100, size=p).tolist() for p in prompt_lens]
    return prompts, output_lens.tolist()


def read_dataset(path: str, n: int | None = None):
    """A jaxcb JSONL of requests: each line's `prompt_token_ids` (or `prompt` text) and `max_tokens`."""
    from jaxcb.host.request import jsonl_lines

    prompts, outputs = [], []
    for lineno, obj in jsonl_lines(path):
        prompt = obj.get("prompt_token_ids", obj.get("prompt")) if isinstance(obj, dict) else None
        tokens = obj.get("max_tokens") if isinstance(obj, dict) else None
        if (not isinstance(prompt, (str, list)) or isinstance(tokens, bool) or not isinstance(tokens, int)
                or tokens < 0):
            raise ValueError(f"{path}:{lineno}: needs prompt_token_ids (or prompt text) and max_tokens, an "
                             "integer >= 0")
        prompts.append(prompt)
        outputs.append(tokens)
        if n is not None and len(prompts) == n:
            break
    if not prompts:
        raise ValueError(f"{path}: no requests")
    return prompts, outputs


def read_sharegpt(path: str, n: int, seed: int, count_tokens=None, output_len: int | None = None):
    """ShareGPT's JSON (a list of {"conversations": [{"from", "value"}, ...]}), sampled as vLLM's benchmark
    samples it: conversations of two turns or more, shuffled by `seed`, the first turn the prompt (text), the
    second's token count the output length (or `output_len`); pairs with a prompt or output under 4 tokens, a
    prompt over 1,024 or both over 2,048 skipped, until `n`. `count_tokens(text)`: a server's token count (its
    /tokenize); None (with `output_len`): prompts are not measured or skipped."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable ShareGPT JSON file ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: ShareGPT's file is a JSON list of conversations")
    pairs = [(c["conversations"][0].get("value"), c["conversations"][1].get("value")) for c in data
             if isinstance(c, dict) and isinstance(c.get("conversations"), list) and len(c["conversations"]) >= 2
             and all(isinstance(t, dict) for t in c["conversations"][:2])]
    pairs = [(a, b) for a, b in pairs if isinstance(a, str) and isinstance(b, str) and a]
    np.random.default_rng(seed).shuffle(pairs)
    prompts, outputs = [], []
    for prompt, answer in pairs:
        if len(prompts) == n:
            break
        if count_tokens is None:
            prompts.append(prompt)
            outputs.append(output_len)
            continue
        size, out = count_tokens(prompt), output_len or count_tokens(answer)
        if size < 4 or (output_len is None and out < 4) or size > 1024 or size + out > 2048:
            continue
        prompts.append(prompt)
        outputs.append(out)
    if not prompts:
        raise ValueError(f"{path}: no conversation of ShareGPT's form fits (4..1,024 prompt tokens, 2,048 in all)")
    return prompts, outputs


def tokenize_counter(base: str, model: str | None, auth_token=None):
    """A text's token count by an OpenAI-style server's POST /tokenize (jaxcb's and vLLM's)."""
    import httpx

    root = base[:-len("/v1")] if base.endswith("/v1") else base
    headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
    client = httpx.Client(timeout=60.0, headers=headers)

    def count(text: str) -> int:
        r = client.post(root + "/tokenize", json={"prompt": text, **({"model": model} if model else {})})
        if r.status_code >= 400:
            raise ValueError(f"{root}/tokenize: HTTP {r.status_code}: {r.text[:200]}")
        return int(r.json()["count"])
    return count


def dataset_kind(args) -> str:
    """--dataset's kind: --dataset-name's, else ShareGPT for a JSON file that opens with a list, else jsonl."""
    if args.dataset_name == "random":
        raise ValueError("--dataset-name random takes no --dataset")
    if args.dataset_name:
        return args.dataset_name
    try:
        with open(args.dataset, encoding="utf-8-sig") as f:
            head = f.read(4096).lstrip()
    except OSError as e:
        raise ValueError(f"{args.dataset}: {e.strerror or e}") from None
    return "sharegpt" if head.startswith("[") else "jsonl"


def read_trace_workload(path: str, n: int | None, vocab: int, seed: int, time_scale: float = 1.0,
                        context: int | None = None):
    """A trace's first `n` requests (all: None; jaxcb.sim.trace.load_trace) as prompts of token ids
    (jaxcb.sim.trace.iter_prompt_ids), output lengths and send times in seconds from the first (its arrivals times
    `time_scale`). `context`: the server's, where it says it; a longer prompt is made that long only (the server
    refuses it all the same, and a public trace's 100k-token prompts would take gigabytes here)."""
    from jaxcb.sim.trace import iter_prompt_ids, load_trace

    trace = load_trace(path, n, time_scale)
    prompts = list(iter_prompt_ids(trace, vocab - 100, seed, limit=context))  # (ids in [100, vocab - 100))
    return prompts, [r.output_tokens for r in trace], [r.arrival_s for r in trace]


def openai_base(url: str) -> str:
    """An OpenAI API's base URL: `http://host:port` or `.../v1` -> `.../v1`."""
    url = url.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url if url.endswith("/v1") else url + "/v1"


def grpc_target(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


async def one_request(stub, api, prompt, max_tokens, start_at, t0, sem, model=None, metadata=()):
    import grpc

    from serve.proto import jaxcb_pb2, jetstream_pb2

    await asyncio.sleep(max(0.0, start_at - (time.perf_counter() - t0)))
    async with sem:
        sent = time.perf_counter()
        arrivals = []
        if api == "openai":  # stub: (httpx.AsyncClient, base URL)
            client, base = stub
            body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                    "temperature": 0.0, "stream_options": {"include_usage": True}}
            if model:
                body["model"] = model
            tokens = None
            async with client.stream("POST", base + "/completions", json=body) as r:
                if r.status_code >= 400:  # (the request's failure, counted: the others' figures stand)
                    text = (await r.aread()).decode(errors="replace")
                    return _failed(sent - t0, f"HTTP {r.status_code}: {text[:300]}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        arrivals.append(time.perf_counter())
            if tokens and arrivals and tokens != len(arrivals):  # chunks held several tokens (or none: special ones)
                first, last = arrivals[0], arrivals[-1]
                arrivals = [first] + list(np.linspace(first, last, tokens)[1:])
        elif api == "grpc":
            req = jaxcb_pb2.GenerateRequest(max_tokens=max_tokens, ignore_eos=True, model=model or "")
            if isinstance(prompt, str):
                req.text = prompt
            else:
                req.tokens.token_ids.extend(prompt)
            try:
                async for resp in stub.Generate(req, metadata=metadata):
                    if resp.HasField("chunk") and resp.chunk.token_ids:
                        arrivals.extend([time.perf_counter()] * len(resp.chunk.token_ids))
            except grpc.aio.AioRpcError as e:
                return _failed(sent - t0, f"{e.code().name}: {e.details()}")
        else:
            req = jetstream_pb2.DecodeRequest(max_tokens=max_tokens)
            if isinstance(prompt, str):
                req.text_content.text = prompt
            else:
                req.token_content.token_ids.extend(prompt)
            try:
                async for resp in stub.Decode(req, metadata=metadata):
                    n = sum(len(s.token_ids) for s in resp.stream_content.samples)
                    arrivals.extend([time.perf_counter()] * n)
            except grpc.aio.AioRpcError as e:
                return _failed(sent - t0, f"{e.code().name}: {e.details()}")
        end = time.perf_counter()
    return {"sent": sent - t0, "ttft": arrivals[0] - sent if arrivals else math.nan, "e2e": end - sent,
            "n": len(arrivals), "itl": list(np.diff(arrivals)) if len(arrivals) > 1 else [],
            "tpot": (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else math.nan}


def _failed(sent: float, error: str) -> dict:
    """A request the server refused or failed: counted apart, none of its times in the figures."""
    return {"sent": sent, "ttft": math.nan, "e2e": math.nan, "n": 0, "itl": [], "tpot": math.nan, "error": error}


def summarize(values):
    v = np.asarray([x for x in values if not math.isnan(x)], float) * 1000
    if v.size == 0:
        return {}
    return {"mean": round(float(v.mean()), 1), "p50": round(float(np.percentile(v, 50)), 1),
            "p90": round(float(np.percentile(v, 90)), 1), "p99": round(float(np.percentile(v, 99)), 1)}


async def run_rate(target, api, prompts, outputs, rate, concurrency, seed, slo_ttft, slo_tpot, model=None,
                   auth_token=None, starts=None):
    """One rate against one endpoint: the figures of the whole workload. `starts`: each request's own send time
    (seconds from the first; a trace's arrivals) instead of the rate's Poisson arrivals."""
    import grpc

    from serve.proto import jaxcb_pb2_grpc, jetstream_pb2_grpc

    if starts is None:
        rng = np.random.default_rng(seed)
        gaps = rng.exponential(1.0 / rate, len(prompts)) if math.isfinite(rate) else np.zeros(len(prompts))
        starts = np.cumsum(gaps) - gaps[0]
    sem = asyncio.Semaphore(concurrency or len(prompts))
    if api == "openai":
        import httpx

        limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
        headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, headers=headers) as client:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one_request((client, target), api, p, int(n), s, t0, sem, model)
                                             for p, n, s in zip(prompts, outputs, starts)))
            wall = time.perf_counter() - t0
    else:
        metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        async with grpc.aio.insecure_channel(target) as ch:
            stub = jaxcb_pb2_grpc.JaxcbStub(ch) if api == "grpc" else jetstream_pb2_grpc.OrchestratorStub(ch)
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one_request(stub, api, p, int(n), s, t0, sem, model, metadata)
                                             for p, n, s in zip(prompts, outputs, starts)))
            wall = time.perf_counter() - t0
    good = sum(1 for r in results if r["ttft"] * 1000 <= slo_ttft and (math.isnan(r["tpot"]) or r["tpot"] * 1000 <= slo_tpot))
    out_tokens = sum(r["n"] for r in results)
    failed = [r["error"] for r in results if "error" in r]
    return {
        "rate": rate if isinstance(rate, str) or math.isfinite(rate) else "inf",
        "requests": len(results) - len(failed), "wall_s": round(wall, 2),
        **({"failed": len(failed), "first_error": failed[0]} if failed else {}),
        "request_throughput": round((len(results) - len(failed)) / wall, 3),
        "output_tokens_per_s": round(out_tokens / wall, 1),
        "output_tokens": out_tokens,
        "ttft_ms": summarize(r["ttft"] for r in results), "tpot_ms": summarize(r["tpot"] for r in results),
        "itl_ms": summarize(x for r in results for x in r["itl"]), "e2e_ms": summarize(r["e2e"] for r in results),
        "goodput_rps": round(good / wall, 3), "slo": {"ttft_ms": slo_ttft, "tpot_ms": slo_tpot},
    }


def served_model(base: str, auth_token=None) -> str | None:
    """The first model an OpenAI API lists (what its requests name), or None if it lists none."""
    return _first_model(base, auth_token).get("id")


def _first_model(base: str, auth_token=None) -> dict:
    """The first model an OpenAI API lists ({} if none, or no answer)."""
    import httpx

    headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
    try:
        r = httpx.get(base + "/models", headers=headers, timeout=30.0)
        r.raise_for_status()
        data = r.json().get("data") or []
        return data[0] if data and isinstance(data[0], dict) else {}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return {}


def served_context(api: str, target: str, auth_token=None) -> int | None:
    """The tokens per sequence a server takes, where it says (vLLM's and jaxcb's max_model_len, jaxcb's gRPC
    ModelInfo.context_length); None otherwise."""
    if api == "openai":
        value = _first_model(target, auth_token).get("max_model_len")
        return value if isinstance(value, int) and value > 0 else None
    info = _model_info(target, auth_token)
    return info.context_length if info is not None and info.context_length > 0 else None


def table(runs, slo_ttft, slo_tpot) -> str:
    w = max([12] + [len(str(r.get("name", ""))) + 2 for r in runs])
    head = (f"{'server':<{w}}{'rate':>6}{'req/s':>8}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
            f"{'TPOT p99':>10}{'ITL p50':>9}{'E2E p50':>9}{'goodput':>9}")
    lines = [f"SLO: TTFT <= {slo_ttft:.0f} ms and TPOT <= {slo_tpot:.0f} ms (goodput: requests/s meeting both)", head]
    for r in runs:
        lines.append(f"{r.get('name', ''):<{w}}{str(r['rate']):>6}{r['request_throughput']:>8.2f}"
                     f"{r['output_tokens_per_s']:>8.1f}{r['ttft_ms'].get('p50', math.nan):>10.0f}"
                     f"{r['ttft_ms'].get('p99', math.nan):>10.0f}{r['tpot_ms'].get('p50', math.nan):>10.0f}"
                     f"{r['tpot_ms'].get('p99', math.nan):>10.0f}{r['itl_ms'].get('p50', math.nan):>9.0f}"
                     f"{r['e2e_ms'].get('p50', math.nan):>9.0f}{r['goodput_rps']:>9.2f}")
    return "\n".join(lines)


def cpu_name() -> str:
    """This machine's CPU model (/proc/cpuinfo's model name, else what platform knows)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return cpu


def client_machine() -> str:
    """The machine the benchmark ran from (the client; the server may be elsewhere)."""
    return f"client: {os.cpu_count()} cores, {cpu_name()}"


def add_args(ap: argparse.ArgumentParser, *, url_required: bool = True) -> None:
    """The benchmark's options (vLLM's `bench serve` names are accepted as aliases)."""
    ap.add_argument("--url", "--base-url", required=url_required, default=None,
                    help="the server: an OpenAI API's base URL (http://HOST:PORT[/v1]) or a gRPC HOST:PORT")
    ap.add_argument("--api", choices=APIS, default="openai",
                    help="openai (/v1/completions, streamed), grpc (jaxcb's Generate) or jetstream (Decode)")
    ap.add_argument("--model", default=None,
                    help="the model name requests carry (default: the first /v1/models lists; none over gRPC)")
    ap.add_argument("--name", default=None, help="the main target's name in the table (default: its API)")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=URL",
                    help="another OpenAI-compatible endpoint measured in the same run, interleaved rate by rate")
    ap.add_argument("--rates", "--request-rate", default="1,2,4,inf",
                    help="requests/s, comma-separated (inf: all at once)")
    ap.add_argument("--requests", "--num-prompts", type=int, default=None,
                    help="requests per rate (default: 32, or every line of a JSONL --dataset)")
    ap.add_argument("--concurrency", "--max-concurrency", type=int, default=0,
                    help="cap on requests in flight (0 = none)")
    ap.add_argument("--input-len", "--random-input-len", type=float, default=75,
                    help="median prompt tokens of the random workload (log-normal)")
    ap.add_argument("--output-len", "--random-output-len", type=float, default=45,
                    help="median output tokens of the random workload (log-normal)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="the random prompts' token ids lie in [100, VOCAB - 100) (default: the server's, over "
                         "jaxcb's gRPC; else 32000, in range for most models)")
    ap.add_argument("--dataset", "--dataset-path", default=None, metavar="FILE",
                    help="a jaxcb JSONL of requests (prompt_token_ids or prompt, max_tokens) instead of the random "
                         "workload, or ShareGPT's JSON (sampled as vLLM's benchmark samples it, its lengths counted "
                         "by the server's /tokenize)")
    ap.add_argument("--dataset-name", choices=("random", "sharegpt", "jsonl"), default=None,
                    help="vLLM's name: random (the default without --dataset), sharegpt or jsonl (told from the "
                         "file by default)")
    ap.add_argument("--sharegpt-output-len", type=int, default=None,
                    help="ShareGPT: every output this long, instead of the reference answer's length")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="replay a trace at its arrival times instead of --rates: jaxcb's JSONL, Mooncake's JSONL, "
                         "Azure's or BurstGPT's CSV (as `jaxcb simulate --trace`); prompts of random token ids in "
                         "[100, vocab), blocks of equal hashes (Mooncake's) the same tokens")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="with --trace: arrival times multiplied by this (0.5: the same requests in half the time)")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--auth-token", default=os.environ.get("JAXCB_AUTH_TOKEN"),
                    help="bearer token (default: $JAXCB_AUTH_TOKEN)")
    ap.add_argument("--json", "--result-filename", default=None, metavar="FILE", help="write the result here")
    ap.add_argument("--plot", default=None, metavar="PNG", help="latency against throughput (needs matplotlib)")


def grpc_vocab(target: str, auth_token=None) -> int | None:
    """A jaxcb server's vocabulary size (GetModelInfo), or None."""
    info = _model_info(target, auth_token)
    return info.vocab_size if info is not None else None


def _model_info(target: str, auth_token=None):
    """A jaxcb server's GetModelInfo, or None."""
    import grpc

    from serve.proto import jaxcb_pb2, jaxcb_pb2_grpc

    metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
    try:
        with grpc.insecure_channel(target) as ch:
            return jaxcb_pb2_grpc.JaxcbStub(ch).GetModelInfo(jaxcb_pb2.GetModelInfoRequest(), metadata=metadata,
                                                             timeout=30)
    except grpc.RpcError:
        return None


def rates(text) -> list[float]:
    """--rates: requests/s, each above 0 and finite, or inf (all at once)."""
    out = []
    for part in str(text).split(","):
        try:
            rate = float(part)
        except ValueError:
            rate = math.nan
        if not rate > 0:  # (0, negative, nan)
            raise ValueError(f"--rates: {part.strip()!r} is not a rate: requests/s above 0, or inf")
        out.append(rate)
    return out


def run(args, machine: str | None = None) -> dict:
    """The benchmark of `args` (add_args's): runs every rate against every target, prints a line per run
    and the table; returns the result (also written to args.json)."""
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests: must be at least 1, got {args.requests}")
    if args.concurrency < 0:
        raise ValueError(f"--concurrency: must be 0 (no cap) or more, got {args.concurrency}")
    rates(args.rates)  # (checked before any request)
    if args.trace and args.dataset:
        raise ValueError("--trace and --dataset: give one of them")
    if not 0 < args.time_scale < math.inf:  # (before any request; load_trace checks it as well)
        raise ValueError(f"--time-scale: must be a number above 0, got {args.time_scale}")
    if args.api == "openai":
        target = openai_base(args.url)
        model = args.model or served_model(target, args.auth_token)
    else:
        target, model = grpc_target(args.url), args.model
    vocab = args.vocab_size or (grpc_vocab(target, args.auth_token) if args.api == "grpc" else None) or 32000
    starts = None
    if args.trace:
        prompts, outputs, starts = read_trace_workload(args.trace, args.requests, vocab, args.seed, args.time_scale,
                                                       served_context(args.api, target, args.auth_token))
    elif args.dataset and dataset_kind(args) == "sharegpt":
        if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
            raise ValueError(f"--sharegpt-output-len: must be at least 1, got {args.sharegpt_output_len}")
        if args.api != "openai" and args.sharegpt_output_len is None:
            raise ValueError("ShareGPT over gRPC: give --sharegpt-output-len (the lengths are counted by an OpenAI "
                             "API's /tokenize)")
        counter = tokenize_counter(target, model, args.auth_token) if args.api == "openai" else None
        prompts, outputs = read_sharegpt(args.dataset, args.requests or 32, args.seed, counter,
                                         args.sharegpt_output_len)
    elif args.dataset:
        prompts, outputs = read_dataset(args.dataset, args.requests)
    elif args.dataset_name not in (None, "random"):
        raise ValueError(f"--dataset-name {args.dataset_name}: give its file (--dataset-path)")
    else:
        prompts, outputs = workload(args.requests or 32, args.seed, vocab, args.input_len, args.output_len)
    targets = [(args.name or args.api, args.api, target, model)]
    for spec in args.also:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--also: {spec!r} is not NAME=URL")
        base = openai_base(url)
        targets.append((name, "openai", base, served_model(base, args.auth_token)))
    runs = []
    for rate in rates(args.rates) if starts is None else ["trace"]:
        for name, api, url, name_model in targets:  # interleaved: every endpoint at this rate, then the next
            r = asyncio.run(run_rate(url, api, prompts, outputs, rate, args.concurrency, args.seed,
                                     args.slo_ttft_ms, args.slo_tpot_ms, name_model, args.auth_token, starts))
            r["name"], r["api"], r["url"], r["model"] = name, api, url, name_model
            runs.append(r)
            print(f"{name:>10} ({api}) rate {r['rate']:>5} req/s: {r['request_throughput']:.2f} req/s, "
                  f"{r['output_tokens_per_s']:.1f} tok/s; "
                  f"TTFT p50 {r['ttft_ms'].get('p50', math.nan):.0f} p99 {r['ttft_ms'].get('p99', math.nan):.0f} ms; "
                  f"TPOT p50 {r['tpot_ms'].get('p50', math.nan):.0f} p99 {r['tpot_ms'].get('p99', math.nan):.0f} ms; "
                  f"ITL p50 {r['itl_ms'].get('p50', math.nan):.0f} ms; E2E p50 {r['e2e_ms'].get('p50', math.nan):.0f} ms; "
                  f"goodput {r['goodput_rps']:.2f} req/s"
                  + (f"; {r['failed']} failed, the first: {r['first_error']}" if r.get("failed") else ""), flush=True)
    result = {"machine": machine or client_machine(), "api": args.api, "requests": len(prompts),
              "dataset": (f"trace {args.trace} (time scale {args.time_scale:g})" if args.trace else args.dataset
                          or f"random (input {args.input_len:g}, output {args.output_len:g}, seed {args.seed})"),
              "runs": runs}
    print(table(runs, args.slo_ttft_ms, args.slo_tpot_ms))
    print(json.dumps(result))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return result


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
