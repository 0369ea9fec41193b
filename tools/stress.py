"""The stress suite: a server under cancels, fuzzing, slow and giant clients, faults, SIGTERM and a
long run; prints one table of figures (and JSON with --json).

    .venv/bin/python -m tools.stress [--scale small|full] [--model M] [--json]

`make stress` runs the full scale (500 streams, 10,000 fuzzed requests, RSS after 1,000 vs 10,000
requests); tests/test_stress.py runs the small one and asserts its targets. The model defaults to a
tiny random-weight one (tests/tiny_gguf.py): the suite is about the server, not the model.

Scenarios (streams, fuzz, slow and memory in turn against one `jaxcb serve` process, which must exit 0
after them; sigterm and http each against a fresh one; faults in-process):
  streams   N concurrent streams of mixed lengths, half cancelled at random moments (before the first
            token, mid-prefill, mid-decode): every stream ends with one final message or a status, the
            pool is whole afterwards, nothing compiles.
  fuzz      hypothesis-generated GenerateRequests over every field, JetStream Decode requests, and raw
            random bytes on the wire, while healthy streams run: answers are OK or INVALID_ARGUMENT /
            RESOURCE_EXHAUSTED naming a field; the healthy streams get exactly their tokens alone.
  slow      a client that never reads its stream and the largest request the limits allow, beside a
            healthy stream: its p99 inter-token latency against its own baseline.
  faults    in-process server, 1% of steps raise and some leave the KV pages in an error state: the
            affected requests get INTERNAL, the others their tokens alone, the pool is whole.
  sigterm   SIGTERM under load: every stream finishes or ends with `abort` within the grace period, exit 0.
  memory    server RSS after the first K requests and after 10K.
  http      the same over the OpenAI HTTP API, on one server: SSE streams with random hang-ups (before
            the first byte too), fuzzed bodies (typed fields, raw bytes, deep JSON, huge integers) while
            healthy requests run, a slow reader and a 17 MiB body beside a healthy stream, a flood past
            --max-concurrent-streams, RSS over many requests, SIGTERM with a reader that stopped reading.
  weights   new weights while serving (--dev-routes, over gRPC): clients stream all along while another
            alternates two checkpoints, pauses in every mode, sleeps and wakes: every stream ends with one final
            message, one that ran on one version of the weights has that checkpoint's tokens alone, the pool is
            whole, nothing compiles, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import grpc
import numpy as np

from serve.client import Client, build_request
from serve.proto import jaxcb_pb2, jaxcb_pb2_grpc, jetstream_pb2, jetstream_pb2_grpc
from tests.faults import ErrorBuffer
from tests.server_util import SMALL_CONFIG, ServerProcess

SCALES = {
    "small": dict(streams=60, fuzz=300, raw=50, rss_first=100, rss_total=500, sigterm_streams=12, weight_rounds=16),
    "full": dict(streams=500, fuzz=10_000, raw=1_000, rss_first=1_000, rss_total=10_000, sigterm_streams=64,
                 weight_rounds=200),
}
FIELD_MESSAGE = re.compile(r"^[a-z_][\w.\[\]]*:")  # "max_tokens: must be >= 1", "messages[0].role: ..."
GRACE_S = 0.5  # short enough that long streams are cut (abort), not all finished


def _prompt(rng, n):
    return rng.integers(3, 128, n).tolist()


def _pool_whole(client, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        info = client.server_info()
        if (info.pages_free == info.pages_total and not info.running and not info.waiting) or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


# ---- streams with cancels ----
async def _streams(target, n, seed):
    rng = random.Random(seed)
    results = {"final": 0, "cancelled": 0, "error": 0, "lost": 0, "two_finals": 0}

    async def one(i, stub):
        req = build_request(token_ids=[rng.randrange(3, 128) for _ in range(rng.randrange(1, 200))],
                            max_tokens=rng.randrange(1, 40), ignore_eos=True)
        cancel_after = None
        if i % 2:  # half are cancelled: before the first token (-1), or after k tokens
            cancel_after = rng.choice([-1, 0, 1, 3, 10, 25])
        call = stub.Generate(req, timeout=300)
        finals, tokens = 0, 0
        try:
            if cancel_after == -1:
                await asyncio.sleep(rng.random() * 0.02)
                call.cancel()
            async for resp in call:
                if resp.HasField("final"):
                    finals += 1
                else:
                    tokens += len(resp.chunk.token_ids)
                if cancel_after is not None and tokens >= cancel_after > -1:
                    call.cancel()
                    break
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:
                results["cancelled"] += 1
            else:
                results["error"] += 1
            return
        except asyncio.CancelledError:
            results["cancelled"] += 1
            return
        if finals > 1:
            results["two_finals"] += 1
        if finals == 1:
            results["final"] += 1
        elif cancel_after is not None:
            results["cancelled"] += 1
        else:
            results["lost"] += 1

    async with grpc.aio.insecure_channel(target) as ch:
        stub = jaxcb_pb2_grpc.JaxcbStub(ch)
        await asyncio.gather(*(one(i, stub) for i in range(n)))
    return results


def scenario_streams(s, n):
    with Client(s.target) as c:
        before = c.server_info().compilations
        t0 = time.perf_counter()
        r = asyncio.run(_streams(s.target, n, seed=1))
        r["seconds"] = round(time.perf_counter() - t0, 1)
        info = _pool_whole(c)
        r["pages_leaked"] = info.pages_total - info.pages_free
        r["compilations_after_warmup"] = info.compilations - before
    return r


# ---- fuzzing ----
def _strategies():
    from hypothesis import strategies as st

    i32 = st.integers(-2**31, 2**31 - 1)
    small_or_any = st.one_of(st.integers(1, 8), st.integers(-3, 12), i32)  # mostly valid, some not
    floats = st.one_of(st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True, width=32))
    text = st.text(max_size=120)
    roles = st.one_of(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=12))
    sampling = st.fixed_dictionaries({}, optional={
        "temperature": floats, "top_k": i32, "top_p": floats, "min_p": floats, "repetition_penalty": floats,
        "presence_penalty": floats, "frequency_penalty": floats, "seed": st.integers(0, 2**64 - 1),
        "logit_bias": st.one_of(st.dictionaries(st.integers(0, 100), st.floats(-5, 5), max_size=5),  # mostly valid
                                st.dictionaries(i32, floats, max_size=3))})
    request = st.fixed_dictionaries({
        "input": st.one_of(
            st.tuples(st.just("text"), text),
            st.tuples(st.just("messages"), st.lists(st.fixed_dictionaries({"role": roles, "content": text}), max_size=4)),
            st.tuples(st.just("token_ids"), st.lists(st.one_of(st.integers(-5, 300), i32), max_size=300))),
        "max_tokens": small_or_any, "stop": st.lists(st.text(max_size=300), max_size=20),
        "stop_token_ids": st.lists(i32, max_size=70), "ignore_eos": st.booleans(), "priority": i32,
        "request_id": st.text(max_size=140), "logprobs": small_or_any, "n": st.one_of(st.integers(-1, 3), i32),
        "cache_salt": st.text(max_size=300), "sampling": sampling})
    jetstream = st.fixed_dictionaries({
        "text": st.one_of(st.none(), text), "tokens": st.lists(st.one_of(st.integers(-5, 300), i32), max_size=300),
        "max_tokens": small_or_any, "num_samples": st.integers(-1, 3), "priority": i32})
    return request, jetstream


def _to_proto(d):
    kind, value = d["input"]
    req = jaxcb_pb2.GenerateRequest(max_tokens=d["max_tokens"], stop=d["stop"], stop_token_ids=d["stop_token_ids"],
                                    ignore_eos=d["ignore_eos"], priority=d["priority"], request_id=d["request_id"],
                                    logprobs=d["logprobs"], n=d["n"], cache_salt=d["cache_salt"])
    for k, v in d["sampling"].items():
        if k == "logit_bias":
            req.sampling.logit_bias.update(v)
        else:
            setattr(req.sampling, k, v)
    if kind == "text":
        req.text = value
    elif kind == "messages":
        req.chat.messages.extend(jaxcb_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in value)
    else:
        req.tokens.token_ids.extend(value)
    return req


def _healthy_loop(target, stop, expected, out):
    """Greedy streams over and over while the attack runs: each must give its tokens alone."""
    with Client(target) as c:
        while not stop.is_set():
            for prompt, tokens in expected:
                r = c.complete(token_ids=prompt, max_tokens=len(tokens), ignore_eos=True, timeout=120)
                out["healthy_runs"] += 1
                out["healthy_mismatches"] += r.token_ids != tokens


def scenario_fuzz(s, n, raw):
    from hypothesis import HealthCheck, given, settings

    out = {"fuzzed": 0, "ok": 0, "invalid": 0, "exhausted": 0, "unnamed_errors": 0, "other_status": 0, "raw": 0,
           "raw_statuses": {}, "healthy_runs": 0, "healthy_mismatches": 0}
    rng = np.random.default_rng(3)
    with Client(s.target) as c:
        expected = [(p, c.complete(token_ids=p, max_tokens=12, ignore_eos=True).token_ids)
                    for p in (_prompt(rng, 7), _prompt(rng, 40))]
    stop = threading.Event()
    healthy = threading.Thread(target=_healthy_loop, args=(s.target, stop, expected, out), daemon=True)
    healthy.start()
    request_st, jetstream_st = _strategies()
    with grpc.insecure_channel(s.target) as ch:
        stub, js = jaxcb_pb2_grpc.JaxcbStub(ch), jetstream_pb2_grpc.OrchestratorStub(ch)

        def judge(call):
            try:
                for _ in call:
                    pass
                out["ok"] += 1
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    out["invalid"] += 1
                elif e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    out["exhausted"] += 1
                else:
                    out["other_status"] += 1
                    out.setdefault("other_examples", []).append(f"{e.code().name}: {e.details()[:120]}")
                    return
                if not FIELD_MESSAGE.match(e.details() or ""):
                    out["unnamed_errors"] += 1
                    out.setdefault("unnamed_examples", []).append(e.details()[:120])
            out["fuzzed"] += 1

        @settings(max_examples=n * 9 // 10, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(request_st)
        def fuzz_generate(d):
            judge(stub.Generate(_to_proto(d), timeout=60))

        @settings(max_examples=max(1, n // 10), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(jetstream_st)
        def fuzz_decode(d):
            req = jetstream_pb2.DecodeRequest(max_tokens=d["max_tokens"], num_samples=d["num_samples"],
                                              priority=d["priority"])
            if d["text"] is not None:
                req.text_content.text = d["text"]
            else:
                req.token_content.token_ids.extend(d["tokens"])
            judge(js.Decode(req, timeout=60))

        fuzz_generate()
        fuzz_decode()
        raw_call = ch.unary_stream("/jaxcb.v1.Jaxcb/Generate")  # bytes as they are, no protobuf
        byte_rng = random.Random(5)
        for _ in range(raw):
            data = bytes(byte_rng.randrange(256) for _ in range(byte_rng.randrange(0, 200)))
            try:
                for _ in raw_call(data, timeout=30):
                    pass
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            out["raw_statuses"][code] = out["raw_statuses"].get(code, 0) + 1
            out["raw"] += 1
            out["raw_other"] = out.get("raw_other", 0) + (code not in ("OK", "INVALID_ARGUMENT",
                                                                         "RESOURCE_EXHAUSTED"))
    stop.set()
    healthy.join(120)
    with Client(s.target) as c:
        info = _pool_whole(c)
        out["pages_leaked"] = info.pages_total - info.pages_free
    out["crashed"] = s.proc.poll() is not None
    return out


# ---- slow client and giant request ----
def _itl_p99(target, prompt, n):
    with Client(target) as c:
        times = []
        for _ in c.generate(token_ids=prompt, max_tokens=n, ignore_eos=True, timeout=300):
            times.append(time.perf_counter())
    gaps = np.diff(times[:-1])  # chunks only (the last item is the final)
    return float(np.percentile(gaps, 99)) if len(gaps) else 0.0


def scenario_slow(s, max_context):
    rng = np.random.default_rng(4)
    healthy = _prompt(rng, 10)
    _itl_p99(s.target, healthy, 20)  # warm the path
    baseline = float(np.median([_itl_p99(s.target, healthy, 80) for _ in range(3)]))
    ch = grpc.insecure_channel(s.target)
    stub = jaxcb_pb2_grpc.JaxcbStub(ch)
    slow = stub.Generate(build_request(token_ids=_prompt(rng, 30), max_tokens=max_context // 2,
                                       ignore_eos=True))  # never read
    giant_tokens = 16
    giant_call = stub.Generate(build_request(token_ids=_prompt(rng, max_context - giant_tokens),
                                             max_tokens=giant_tokens, ignore_eos=True))
    drain = threading.Thread(target=lambda: list(giant_call), daemon=True)
    drain.start()
    attacked = float(np.median([_itl_p99(s.target, healthy, 80) for _ in range(3)]))
    slow.cancel()
    drain.join(120)
    ch.close()
    with Client(s.target) as c:
        info = _pool_whole(c)
    out = {"itl_p99_baseline_ms": round(baseline * 1e3, 2), "itl_p99_attacked_ms": round(attacked * 1e3, 2),
           "itl_ratio": round(attacked / baseline, 2) if baseline else None,
           "pages_leaked": info.pages_total - info.pages_free}
    return out


# ---- injected faults (in-process) ----
def scenario_faults(model, n_requests, seed=6):
    import jaxcb.device.runner  # noqa: F401
    from jaxcb.host.engine_config import load_config
    from jaxcb.llm import build_engine
    from serve.server import ServerOptions, run_server
    from tests.server_util import free_port

    cfg_path = os.path.join(tempfile.mkdtemp(), "small.toml")
    with open(cfg_path, "w") as f:
        f.write(SMALL_CONFIG)
    engine = build_engine(model, load_config(cfg_path))
    rng = np.random.default_rng(seed)
    prompts = [_prompt(rng, int(k)) for k in rng.integers(3, 60, n_requests)]
    alone = {}
    for i, p in enumerate(prompts):  # reference: each alone, greedy, before any fault
        rid = engine.add_request(p, _sp(10))
        alone[i] = [t for e in engine.run_until_done() if e.request_id == rid for t in e.token_ids]
    faults = {"raised": 0, "error_state": 0}
    fault_rng = random.Random(seed)

    def inject(out):
        x = fault_rng.random()
        if x < 0.01:
            faults["raised"] += 1
            raise RuntimeError("injected step failure")
        if x < 0.015:
            faults["error_state"] += 1
            engine.runner.kv_pages = ErrorBuffer(engine.runner.kv_pages)
            raise RuntimeError("injected failure leaving the KV pages in an error state")

    engine.fault_injector = inject
    port = free_port()
    ready, result = threading.Event(), {}

    def serve():
        result["code"] = asyncio.run(run_server(engine, engine.tokenizer, "tiny", "float32",
                                                ServerOptions(port=port, grace_s=0),
                                                lambda m: "SERVING" in m and ready.set()))

    threading.Thread(target=serve, daemon=True).start()
    assert ready.wait(300)
    out = {"requests": n_requests, "internal": 0, "identical": 0, "different": 0, "other": 0}
    lock = threading.Lock()

    def one(i):
        with Client(f"127.0.0.1:{port}") as c:
            try:
                r = c.complete(token_ids=prompts[i], max_tokens=10, ignore_eos=True, timeout=120)
                key = "identical" if r.token_ids == alone[i] else "different"
            except grpc.RpcError as e:
                key = "internal" if e.code() == grpc.StatusCode.INTERNAL else "other"
        with lock:
            out[key] += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    engine.fault_injector = None
    with Client(f"127.0.0.1:{port}") as c:
        info = _pool_whole(c)
    out.update(faults, pages_leaked=info.pages_total - info.pages_free, failed_steps=engine.stats().failed_steps)
    return out


def _sp(n):
    from jaxcb.host.request import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True)


# ---- SIGTERM under load ----
def scenario_sigterm(model, config, n):
    s = ServerProcess(model, config, "--grace-period", str(GRACE_S))
    try:
        s.wait_serving()
        rng = np.random.default_rng(8)
        ends, lock = [], threading.Lock()

        def one(i):
            with Client(s.target) as c:
                try:
                    r = c.complete(token_ids=_prompt(rng, 5 + i % 10), max_tokens=240, ignore_eos=True, timeout=120)
                    end = r.finish_reason
                except (grpc.RpcError, RuntimeError) as e:
                    end = f"status {e.code() if isinstance(e, grpc.RpcError) else e}"
            with lock:
                ends.append(end)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # streams admitted and decoding, far from their 240 tokens
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        code = s.proc.wait(60)
        took = time.monotonic() - t0
        for t in threads:
            t.join(30)
        return {"streams": n, "finished_length": ends.count("length"), "finished_abort": ends.count("abort"),
                "other_ends": len(ends) - ends.count("length") - ends.count("abort"), "lost": n - len(ends),
                "exit_code": code, "shutdown_s": round(took, 1), "grace_s": GRACE_S}
    finally:
        s.stop()


# ---- memory ----
def _rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def scenario_memory(s, first, total):
    rng = random.Random(9)

    async def batch(count):
        async with grpc.aio.insecure_channel(s.target) as ch:
            stub = jaxcb_pb2_grpc.JaxcbStub(ch)
            sem = asyncio.Semaphore(32)

            async def one():
                async with sem:
                    req = build_request(token_ids=[rng.randrange(3, 128) for _ in range(rng.randrange(1, 60))],
                                        max_tokens=rng.randrange(1, 6), ignore_eos=True,
                                        request_id=f"m{rng.random()}", cache_salt=str(rng.randrange(4)))
                    async for _ in stub.Generate(req, timeout=120):
                        pass

            await asyncio.gather(*(one() for _ in range(count)))

    asyncio.run(batch(first))
    rss_first = _rss_bytes(s.proc.pid)
    asyncio.run(batch(total - first))
    rss_total = _rss_bytes(s.proc.pid)
    return {"requests_first": first, "rss_first_mib": round(rss_first / 2**20, 1), "requests_total": total,
            "rss_total_mib": round(rss_total / 2**20, 1), "rss_growth": round(rss_total / rss_first - 1, 4)}


# ---- the same attacks over the OpenAI HTTP API ----
def _sse_request(body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)


async def _http_streams(base, n, seed):
    """n concurrent SSE streams; half hang up at random moments (before the first byte, after k
    events). Each completed stream must end with finish reasons for its samples and [DONE]."""
    import httpx

    rng = random.Random(seed)
    host, port = base.removeprefix("http://").split(":")
    results = {"final": 0, "cancelled": 0, "error": 0, "lost": 0}

    async def one(i, client):
        body = {"prompt": [rng.randrange(3, 128) for _ in range(rng.randrange(1, 200))],
                "max_tokens": rng.randrange(1, 40), "ignore_eos": True, "stream": True, "n": rng.choice([1, 1, 2])}
        hang_up = rng.choice([-1, 0, 1, 3, 10]) if i % 2 else None
        if hang_up == -1:  # the request sent, the connection closed before any byte comes back
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(_sse_request(body))
            await writer.drain()
            writer.close()
            results["cancelled"] += 1
            return
        events, done, finishes = 0, False, 0
        try:
            async with client.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
                if r.status_code != 200:
                    results["error"] += 1
                    return
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        events += 1
                        finishes += sum(c.get("finish_reason") is not None for c in json.loads(line[6:])["choices"])
                    if hang_up is not None and events >= hang_up:
                        results["cancelled"] += 1
                        return
        except Exception:  # noqa: BLE001 - a broken stream is an error, counted
            results["error"] += 1
            return
        results["final" if done and finishes == body["n"] else "lost"] += 1

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n)) as client:
        await asyncio.gather(*(one(i, client) for i in range(n)))
    return results


def _http_bodies(n, seed):
    """Fuzzed bodies: hypothesis-drawn fields of every type around the real ones, raw bytes, JSON
    nested too deeply, integers of thousands of digits."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
                              lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4), max_leaves=12)
    # Each field mostly plausible (so that many bodies are served), one time in five anything at all.
    plausible = {
        "prompt": st.one_of(st.text(min_size=1, max_size=60), st.lists(st.integers(3, 120), min_size=1, max_size=80),
                            st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3)),
        "max_tokens": st.integers(-1, 30), "n": st.integers(0, 3), "stream": st.booleans(),
        "temperature": st.floats(-0.5, 2.5), "top_p": st.floats(0, 1.2), "top_k": st.integers(-2, 50),
        "min_p": st.floats(-0.1, 1.0), "presence_penalty": st.floats(-3, 3), "seed": st.integers(-5, 2**64),
        "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=5)),
        "logprobs": st.integers(-1, 25), "priority": st.integers(-2**32, 2**32), "ignore_eos": st.booleans(),
        "request_id": st.text(max_size=20), "cache_salt": st.text(max_size=10), "user": st.text(max_size=10),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        "best_of": st.integers(0, 2), "echo": st.booleans(),
        "logit_bias": st.dictionaries(st.one_of(st.integers(0, 130).map(str), st.text(max_size=6)),
                                      st.one_of(st.floats(-150, 150), st.integers(-101, 101)), max_size=4)}

    def field(value):
        return st.integers(0, 4).flatmap(lambda k: json_value if k == 0 else value)

    body = st.fixed_dictionaries({"prompt": field(plausible["prompt"])},
                                 optional={f: field(v) for f, v in plausible.items() if f != "prompt"})
    bodies = []

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(body)
    def draw(d):
        bodies.append(json.dumps(d).encode())

    draw()
    rng = random.Random(seed)
    for i in range(max(1, n // 10)):
        bodies.append(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200))))
        bodies.append(b"[" * 50000 + b"]" * 50000 if i % 2 else b'{"max_tokens": ' + b"7" * 6000 + b"}")
    return bodies


def _http_healthy_loop(base, stop, expected, out):
    import httpx

    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            for prompt, text in expected:
                r = c.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "ignore_eos": True,
                                                           "temperature": 0})
                out["healthy_runs"] += 1
                out["healthy_mismatches"] += r.status_code != 200 or r.json()["choices"][0]["text"] != text


def _http_itl_p99(base, prompt, n):
    import httpx

    times = []
    with httpx.stream("POST", base + "/v1/completions", timeout=300,
                      json={"prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    gaps = np.diff(times[:-1])
    return float(np.percentile(gaps, 99)) if len(gaps) else 0.0


def scenario_http(model, config, streams, fuzz, rss_total):
    """The stress suite's attacks through the OpenAI HTTP API, on one server: streams with random
    hang-ups, fuzzed bodies while healthy requests run, a slow reader and an oversized body beside a
    healthy stream, a flood past --max-concurrent-streams, RSS over many requests, then SIGTERM with a
    reader that stopped reading."""
    import socket

    import httpx

    from tests.server_util import free_port

    http = free_port()
    limit = streams + 16  # room for the streams scenario; the flood goes past it
    s = ServerProcess(model, config, "--http-port", str(http), "--grace-period", str(GRACE_S),
                      "--max-concurrent-streams", str(limit))
    base = f"http://127.0.0.1:{http}"
    out = {"statuses": {}, "unnamed_errors": 0, "healthy_runs": 0, "healthy_mismatches": 0}
    try:
        s.wait_serving()
        with Client(s.target) as c:
            before = c.server_info().compilations
        t0 = time.perf_counter()
        out["streams"] = asyncio.run(_http_streams(base, streams, seed=11))
        out["streams_s"] = round(time.perf_counter() - t0, 1)
        rng = np.random.default_rng(12)
        prompts = [_prompt(rng, 7), _prompt(rng, 40)]
        expected = [(p, httpx.post(base + "/v1/completions", timeout=120, json={
            "prompt": p, "max_tokens": 12, "ignore_eos": True, "temperature": 0}).json()["choices"][0]["text"])
            for p in prompts]
        stop = threading.Event()
        healthy = threading.Thread(target=_http_healthy_loop, args=(base, stop, expected, out), daemon=True)
        healthy.start()
        with httpx.Client(timeout=60) as c:
            for body in _http_bodies(fuzz, seed=13):
                r = c.post(base + "/v1/completions", content=body, headers={"content-type": "application/json"})
                out["statuses"][str(r.status_code)] = out["statuses"].get(str(r.status_code), 0) + 1
                if 400 <= r.status_code < 500:
                    message = r.json()["error"]["message"]
                    if not FIELD_MESSAGE.match(message):
                        out["unnamed_errors"] += 1
                        out.setdefault("unnamed_examples", []).append(message[:120])
                elif r.status_code == 200 and b'"stream": true' not in body:
                    r.json()  # a whole answer parses
        stop.set()
        healthy.join(120)
        out["fuzzed"] = sum(out["statuses"].values())
        # A slow reader (never reads its large stream) and the largest request beside a healthy stream.
        healthy_prompt = _prompt(rng, 10)
        _http_itl_p99(base, healthy_prompt, 20)
        baseline = float(np.median([_http_itl_p99(base, healthy_prompt, 80) for _ in range(3)]))
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", http))
        slow.sendall(_sse_request({"prompt": _prompt(rng, 30), "max_tokens": 120, "ignore_eos": True, "stream": True,
                                   "n": 4, "logprobs": 5}))
        oversized = httpx.post(base + "/v1/completions", content=b'{"prompt": "' + b"a" * (17 << 20) + b'"}',
                               headers={"content-type": "application/json"}, timeout=120)
        out["oversized_status"] = oversized.status_code
        attacked = float(np.median([_http_itl_p99(base, healthy_prompt, 80) for _ in range(3)]))
        out.update(itl_p99_baseline_ms=round(baseline * 1e3, 2), itl_p99_attacked_ms=round(attacked * 1e3, 2),
                   itl_ratio=round(attacked / baseline, 2) if baseline else None)
        slow.close()

        async def flood(count):  # past --max-concurrent-streams: 200 or 429, nothing else
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=count), timeout=120) as client:
                async def one(i):
                    r = await client.post(base + "/v1/completions", json={"prompt": [3 + i % 100, 5], "max_tokens": 8,
                                                                           "ignore_eos": True})
                    return r.status_code
                return await asyncio.gather(*(one(i) for i in range(count)))

        codes = asyncio.run(flood(limit + 136))
        out["flood"] = {str(k): codes.count(k) for k in sorted(set(codes))}
        out["flood_limit"] = limit
        rss_first = _rss_bytes(s.proc.pid)
        with httpx.Client(timeout=120) as c:
            for i in range(rss_total):
                c.post(base + "/v1/completions", json={"prompt": [3 + i % 100, 7, 9], "max_tokens": 2,
                                                       "cache_salt": str(i % 4), "request_id": f"r{i}"})
        out.update(rss_first_mib=round(rss_first / 2**20, 1), rss_total_mib=round(_rss_bytes(s.proc.pid) / 2**20, 1),
                   rss_requests=rss_total)
        out["rss_growth"] = round(out["rss_total_mib"] / out["rss_first_mib"] - 1, 4)
        with Client(s.target) as c:
            info = _pool_whole(c)
            out["pages_leaked"] = info.pages_total - info.pages_free
            out["compilations_after_warmup"] = info.compilations - before
        out["crashed"] = s.proc.poll() is not None
        # SIGTERM with a reader that has stopped reading a large stream.
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", http))
        stalled.sendall(_sse_request({"prompt": _prompt(rng, 8), "max_tokens": 200, "ignore_eos": True,
                                      "stream": True, "n": 16, "logprobs": 5}))
        stalled.recv(64)
        time.sleep(0.5)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        out["sigterm_exit_code"] = s.proc.wait(60)
        out["sigterm_shutdown_s"] = round(time.monotonic() - t0, 1)
        stalled.close()
        return out
    finally:
        s.stop()


def run(scale: str, model: str | None) -> dict:
    sizes = SCALES[scale]
    workdir = tempfile.mkdtemp(prefix="jaxcb-stress-")
    config = os.path.join(workdir, "small.toml")
    with open(config, "w") as f:
        f.write(SMALL_CONFIG.replace("num_pages = 96", "num_pages = 160"))
    if model is None:
        from tests.tiny_gguf import write_tiny_gguf

        model = os.path.join(workdir, "tiny.gguf")
        write_tiny_gguf(model)
    os.environ.setdefault("JAXCB_COMPILE_CACHE", os.path.join(workdir, "xla"))
    out = {"scale": scale}

    def scenario(name, fn):
        t0 = time.perf_counter()
        out[name] = fn()
        out[name]["scenario_s"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {json.dumps(out[name])}", file=sys.stderr, flush=True)

    # streams, fuzz, slow and memory one after another on one server (each ends with the pool whole,
    # checked before the next starts); it must exit 0 after all four.
    shared = ServerProcess(model, config)
    try:
        shared.wait_serving()
        scenario("streams", lambda: scenario_streams(shared, sizes["streams"]))
        scenario("fuzz", lambda: scenario_fuzz(shared, sizes["fuzz"], sizes["raw"]))
        scenario("slow", lambda: scenario_slow(shared, 256))
        scenario("memory", lambda: scenario_memory(shared, sizes["rss_first"], sizes["rss_total"]))
        code = shared.stop()
    finally:
        shared.stop()
    for name in ("streams", "fuzz", "slow", "memory"):
        out[name]["exit_code"] = code
    scenario("faults", lambda: scenario_faults(model, sizes["streams"]))
    scenario("sigterm", lambda: scenario_sigterm(model, config, sizes["sigterm_streams"]))
    scenario("http", lambda: scenario_http(model, config, sizes["streams"], sizes["fuzz"], sizes["rss_total"] // 2))
    scenario("weights", lambda: scenario_weights(model, config, sizes["weight_rounds"], workdir))
    return out


# ---- new weights while serving ----
def scenario_weights(model, config, rounds, workdir, clients=3, seed=9):
    """Clients stream greedy requests all along (prompts from a fixed set) while the operator, `rounds` times,
    gives the other checkpoint (a fresh version each time), pauses (abort, wait or keep) and resumes, or sleeps
    (level 1 or 2: then the update is what brings the weights back) and wakes. A stream whose weight version was
    the same when it was sent and when it ended must have that checkpoint's tokens (computed here, in-process)."""
    from jaxcb.host.engine_config import load_config
    from jaxcb.host.request import SamplingParams
    from jaxcb.llm import LLM, load_model
    from tests.tiny_gguf import write_tiny_gguf

    other = os.path.join(workdir, "other.gguf")
    write_tiny_gguf(other, seed=1)
    files = (model, other)
    rng = np.random.default_rng(seed)
    prompts = [_prompt(rng, int(n)) for n in rng.integers(2, 60, 8)]
    lengths = [int(n) for n in rng.integers(4, 40, len(prompts))]
    expected = {}
    for f in files:
        cfg, params, tok, eos = load_model(f)
        llm = LLM.from_params(cfg, params, tok, eos_ids=eos, config=load_config(config))
        for i, p in enumerate(prompts):
            expected[f, i] = llm.generate([p], SamplingParams(max_tokens=lengths[i], ignore_eos=True))[0].token_ids
        llm.close()
    s = ServerProcess(model, config, "--dev-routes")
    out = {"streams": 0, "finished": 0, "aborted": 0, "lost": 0, "errors": 0, "checked": 0, "mismatched": 0,
           "updates": 0, "pauses": 0, "sleeps": 0}
    stop = threading.Event()
    lock = threading.Lock()
    served = {"file": model, "version": ""}  # what the operator has set (read under the lock)

    def client(k):
        r = random.Random(seed + k)
        with Client(s.target) as c:
            while not stop.is_set():
                i = r.randrange(len(prompts))
                with lock:
                    before = (served["file"], served["version"])
                try:
                    res = c.complete(token_ids=prompts[i], max_tokens=lengths[i], ignore_eos=True, timeout=300)
                except grpc.RpcError:
                    with lock:
                        out["errors"] += 1
                    continue
                with lock:
                    after = (served["file"], served["version"])
                    out["streams"] += 1
                    if res.finish_reason == "abort":
                        out["aborted"] += 1
                    elif res.finish_reason == "length":
                        out["finished"] += 1
                        if before == after and not before[1].startswith("changing"):
                            out["checked"] += 1
                            out["mismatched"] += list(res.token_ids) != expected[before[0], i]
                    else:
                        out["lost"] += 1

    try:
        s.wait_serving()
        with Client(s.target) as c:
            warm = c.server_info().compilations
            threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
            for t in threads:
                t.start()
            ops = random.Random(seed)
            for n in range(rounds):
                time.sleep(ops.random() * 0.2)
                kind = ops.choice(["update", "pause", "sleep"])
                if kind == "pause":
                    c.stub.PauseGeneration(jaxcb_pb2.PauseGenerationRequest(mode=ops.choice(["abort", "wait", "keep"])))
                    time.sleep(ops.random() * 0.1)
                    c.stub.ResumeGeneration(jaxcb_pb2.ResumeGenerationRequest())
                    out["pauses"] += 1
                    continue
                level = ops.choice([0, 1, 2]) if kind == "sleep" else None
                with lock:  # (a stream sent or ended while the weights change is not checked)
                    served["version"] = f"changing{n}"
                    path = served["file"] if level == 1 else files[(files.index(served["file"]) + 1) % 2]
                if level is not None:
                    c.stub.Sleep(jaxcb_pb2.SleepRequest(level=level, mode=ops.choice(["abort", "keep"])))
                    out["sleeps"] += 1
                if level != 1:  # (a level-1 sleep wakes on the weights it had; level 2 needs new ones)
                    c.stub.UpdateWeights(jaxcb_pb2.UpdateWeightsRequest(model_path=path, weight_version=f"v{n}"))
                    out["updates"] += 1
                if level is not None:
                    c.stub.WakeUp(jaxcb_pb2.WakeUpRequest())
                with lock:
                    served["file"], served["version"] = path, f"v{n}"
            time.sleep(0.5)
            stop.set()
            for t in threads:
                t.join(300)
            info = _pool_whole(c)
            out["pages_leaked"] = info.pages_total - info.pages_free
            out["compilations_after_warmup"] = info.compilations - warm
            out["weight_version"] = info.weight_version
        out["exit_code"] = s.stop()
    finally:
        stop.set()
        s.stop()
    return out


def table(r: dict) -> str:
    return (_grpc_table(r) + "\n\nOpenAI HTTP API\n" + _http_table(r["http"]) + "\n\nNew weights while serving\n"
            + _weights_table(r["weights"]))


def _weights_table(w: dict) -> str:
    return _format_rows([
        ("streams: finished / aborted by a pause / lost / errors", f"{w['finished']} / {w['aborted']} / {w['lost']} / "
         f"{w['errors']}", "lost 0, errors 0"),
        ("operations: updates / pauses / sleeps", f"{w['updates']} / {w['pauses']} / {w['sleeps']}", ""),
        ("streams on one version checked (its tokens not the checkpoint's)", f"{w['checked']} ({w['mismatched']})",
         "0"),
        ("pages leaked / compilations after warm-up / exit", f"{w['pages_leaked']} / "
         f"{w['compilations_after_warmup']} / {w['exit_code']}", "0 / 0 / 0"),
    ])


def _http_table(h: dict) -> str:
    hs = h["streams"]
    statuses = " / ".join(f"{k}: {v}" for k, v in sorted(h["statuses"].items()))
    bad = sum(v for k, v in h["statuses"].items() if k not in ("200", "400", "404", "413", "429"))
    rows = [
        ("streams (hung up)", f"{sum(hs.values())} ({hs['cancelled']})", ""),
        ("streams lost / broken", f"{hs['lost']} / {hs['error']}", "0 / 0"),
        ("fuzzed bodies answered (by status)", f"{h['fuzzed']} ({statuses})", ""),
        ("fuzz answers other than 200/400/404/413/429 / unnamed 4xx", f"{bad} / {h['unnamed_errors']}", "0 / 0"),
        ("healthy requests during fuzz (mismatches)", f"{h['healthy_runs']} ({h['healthy_mismatches']})", "0"),
        ("17 MiB body", str(h["oversized_status"]), "413"),
        (f"flood of {sum(h['flood'].values())} past --max-concurrent-streams {h['flood_limit']}",
         " / ".join(f"{k}: {v}" for k, v in h["flood"].items()), "200 or 429 only"),
        ("pages leaked / crashed", f"{h['pages_leaked']} / {h['crashed']}", "0 / False"),
        ("compilations after warm-up", str(h["compilations_after_warmup"]), "0"),
        ("healthy-stream p99 ITL under slow reader + 17 MiB body", f"{h['itl_ratio']}x ({h['itl_p99_baseline_ms']} -> "
         f"{h['itl_p99_attacked_ms']} ms)", "<= 2x"),
        ("RSS growth", f"{h['rss_growth']:.1%} ({h['rss_first_mib']} -> {h['rss_total_mib']} MiB over "
         f"{h['rss_requests']} requests)", "<= 10%"),
        ("SIGTERM with a stalled reader: exit, time", f"exit {h['sigterm_exit_code']} in {h['sigterm_shutdown_s']} s "
         f"(grace {GRACE_S} s)", "exit 0"),
    ]
    return _format_rows(rows)


def _format_rows(rows) -> str:
    """(figure, value, target) rows as aligned text; a row without a target has none printed."""
    width = max(len(a) for a, _, _ in rows)
    return "\n".join(f"{a:<{width}}  {b:<40}  target {c}" if c else f"{a:<{width}}  {b}" for a, b, c in rows)


def _grpc_table(r: dict) -> str:
    st, fz, sl, fa, sg, mem = (r[k] for k in ("streams", "fuzz", "slow", "faults", "sigterm", "memory"))
    lost = st["lost"] + sg["lost"] + fa["other"] + fz.get("other_status", 0)
    leaked = st["pages_leaked"] + fz["pages_leaked"] + sl["pages_leaked"] + fa["pages_leaked"]
    crashes = int(fz["crashed"]) + sum(x.get("exit_code", 0) not in (0, None) for x in (st, fz, sl, sg, mem))
    rows = [
        ("streams (cancelled)", f"{st['final'] + st['cancelled'] + st['error'] + st['lost']} ({st['cancelled']})", ""),
        ("fuzzed inputs (raw bytes)", f"{fz['fuzzed']} ({fz['raw']})", ""),
        ("raw bytes answered other than OK / INVALID / EXHAUSTED", str(fz.get("raw_other", 0)), "0"),
        ("fuzz answers OK / INVALID / EXHAUSTED / unnamed", f"{fz['ok']} / {fz['invalid']} / {fz['exhausted']} / "
         f"{fz['unnamed_errors']}", "unnamed 0"),
        ("healthy streams during fuzz (mismatches)", f"{fz['healthy_runs']} ({fz['healthy_mismatches']})", "0"),
        ("faults injected (raised + error state)", f"{fa['raised'] + fa['error_state']}", ""),
        ("fault run: INTERNAL / identical / different", f"{fa['internal']} / {fa['identical']} / {fa['different']}",
         "different 0"),
        ("requests lost", str(lost), "0"),
        ("pages leaked", str(leaked), "0"),
        ("crashes (unexpected exit codes)", str(crashes), "0"),
        ("compilations after warm-up (streams)", str(st["compilations_after_warmup"]), "0"),
        ("healthy-stream p99 ITL under slow+giant clients", f"{sl['itl_ratio']}x ({sl['itl_p99_baseline_ms']} -> "
         f"{sl['itl_p99_attacked_ms']} ms)", "<= 2x"),
        ("SIGTERM under load: length / abort / other, exit", f"{sg['finished_length']} / {sg['finished_abort']} / "
         f"{sg['other_ends']}, exit {sg['exit_code']} in {sg['shutdown_s']} s", "exit 0"),
        ("RSS growth", f"{mem['rss_growth']:.1%} ({mem['rss_first_mib']} MiB after {mem['requests_first']} -> "
         f"{mem['rss_total_mib']} MiB after {mem['requests_total']})", "<= 10%"),
    ]
    return _format_rows(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument("--model", default=None, help="GGUF file (default: a tiny random-weight model)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = p.parse_args()
    from bench.common import machine

    r = run(args.scale, args.model)
    print(f"jaxcb stress ({args.scale}) on {machine()}")
    print(table(r))
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
