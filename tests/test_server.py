"""The gRPC server over a real loopback port, started as a separate process the way a user starts it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import signal
import time
import urllib.request

import grpc
import numpy as np
import prometheus_client
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from jaxcb.host.engine_config import load_config
from jaxcb.host.request import FinishReason, SamplingParams
from jaxcb.llm import LLM
from serve.client import AsyncClient, Client, build_request
from serve.proto import jaxcb_pb2, jaxcb_pb2_grpc, jetstream_pb2, jetstream_pb2_grpc
from tests.server_util import ServerProcess, free_port, wait_pool_whole


@pytest.fixture(scope="module")
def server(tiny_gguf_path, config_path):
    s = ServerProcess(tiny_gguf_path, config_path, "--grace-period", "20")
    try:
        s.wait_serving()
        yield s
    finally:
        code = s.stop()
        assert code == 0, s.output()


@pytest.fixture(scope="module")
def offline(tiny_model, config_path):
    cfg, params, tok, eos = tiny_model
    return LLM.from_params(cfg, params, tok, config=load_config(config_path), eos_ids=eos)


@pytest.fixture
def client(server):
    with Client(server.target) as c:
        yield c


def test_streamed_tokens_equal_the_offline_engine(client, offline):
    prompts = [[5, 6, 7], list(range(10, 60)), [100] * 20]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = offline.generate(prompts, params)
    for prompt, w in zip(prompts, want):
        chunks = list(client.generate(token_ids=prompt, max_tokens=12, ignore_eos=True))
        result = chunks[-1]
        assert len(chunks) > 2, "tokens should stream as separate messages"
        assert result.token_ids == w.token_ids and result.finish_reason == "length"
        assert result.prompt_tokens == len(prompt) and result.completion_tokens == 12
    # Text and chat inputs go through the server's tokenizer and template like the offline path.
    text = client.complete("the weather", max_tokens=6, ignore_eos=True)
    assert text.token_ids == offline.generate(["the weather"], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    chat = client.complete("hi", chat=True, max_tokens=6, ignore_eos=True)
    assert chat.token_ids == offline.generate(["hi"], SamplingParams(max_tokens=6, ignore_eos=True), chat=True)[0].token_ids
    # Seeded sampling through the server equals the offline engine too.
    seeded = client.complete(token_ids=[9, 8, 7], max_tokens=10, ignore_eos=True, temperature=0.8, top_k=50, seed=42)
    assert seeded.token_ids == offline.generate(
        [[9, 8, 7]], SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_k=50, seed=42))[0].token_ids
    wait_pool_whole(client)


def test_jetstream_decode_returns_the_same_tokens(server, client):
    want = client.complete(token_ids=[11, 12, 13, 14], max_tokens=8).token_ids
    with grpc.insecure_channel(server.target) as ch:
        stub = jetstream_pb2_grpc.OrchestratorStub(ch)
        req = jetstream_pb2.DecodeRequest(max_tokens=8, token_content=jetstream_pb2.DecodeRequest.TokenContent(
            token_ids=[11, 12, 13, 14]))
        got = []
        for resp in stub.Decode(req, timeout=60):
            for sample in resp.stream_content.samples:
                got.extend(sample.token_ids)
        assert got == want
        text = "".join(s.text for r in stub.Decode(jetstream_pb2.DecodeRequest(
            max_tokens=5, text_content=jetstream_pb2.DecodeRequest.TextContent(text="is it")), timeout=60)
            for s in r.stream_content.samples)
        assert isinstance(text, str)
        assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=5).is_live
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Decode(jetstream_pb2.DecodeRequest(max_tokens=0, token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[5])), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # As JetStream's own server: a max_tokens past the context ends the answer there, a prompt past it keeps its
        # last tokens (its clients send a request that failed again, forever); ids outside the vocabulary name the field
        long = [5 + i % 50 for i in range(300)]  # (the test server's context: 256)
        for ids, max_tokens in (([11, 12, 13, 14], 1000), (long, 4)):
            got = [t for r in stub.Decode(jetstream_pb2.DecodeRequest(max_tokens=max_tokens, token_content=
                   jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids)), timeout=60) for t in r.stream_content.samples[0].token_ids]
            kept = ids[-255:]
            assert got == client.complete(token_ids=kept, max_tokens=min(max_tokens, 256 - len(kept))).token_ids
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Decode(jetstream_pb2.DecodeRequest(max_tokens=2, token_content=jetstream_pb2.DecodeRequest.TokenContent(
                token_ids=[5, 10**6])), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("token_content.token_ids: "), e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # (an adapter not loaded: named)
            list(stub.Decode(jetstream_pb2.DecodeRequest(max_tokens=2, lora_adapter_id="nope", token_content=
                                                         jetstream_pb2.DecodeRequest.TokenContent(token_ids=[5])), timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and e.value.details().startswith("lora_adapter_id: 'nope'")
        for samples in (-1, 17, 2**31 - 1):  # (0: one sample; -1 generated one once; past 16 was "n" or a full queue)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Decode(jetstream_pb2.DecodeRequest(max_tokens=2, num_samples=samples, text_content=
                                                             jetstream_pb2.DecodeRequest.TextContent(text="hi")), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("num_samples:")
        # num_samples: each message holds every sample (JetStream's requester reads them by position), greedy here
        three = [[], [], []]
        for r in stub.Decode(jetstream_pb2.DecodeRequest(max_tokens=8, num_samples=3, token_content=
                             jetstream_pb2.DecodeRequest.TokenContent(token_ids=[11, 12, 13, 14])), timeout=60):
            assert len(r.stream_content.samples) == 3
            for k, sample in enumerate(r.stream_content.samples):
                three[k] += sample.token_ids
        assert three == [want] * 3


def test_health_and_reflection(server):
    with grpc.insecure_channel(server.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "jaxcb.v1.Jaxcb"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in resp.list_services_response.service}
        assert {"jaxcb.v1.Jaxcb", "jetstream_proto.Orchestrator", "grpc.health.v1.Health"} <= names


def test_model_and_server_info(client, server):
    m = client.model_info()
    assert m.vocab_size == 284 and m.context_length == 256 and m.dtype == "float32"
    s = client.server_info()
    assert list(s.decode_batch_buckets) == [1, 2, 4, 8] and s.page_size == 16 and s.pages_total == 95
    assert s.policy == "fcfs" and s.compilations > 0
    # How the step computes, and XLA:CPU's dot library (the tests run every process with the default).
    assert (s.platform, s.compute_dtype, s.weights, s.kv_dtype) == ("cpu", "float32", "float32", "float32")
    assert s.attention in ("native", "xla") and (s.cpu_dots, s.cpu_max_isa, s.cpu_dots_reason) == (
        "default", "", "asked for")
    assert f"attention {s.attention}; XLA:CPU dots: default, isa all, compute float32 (asked for)" in server.output()
    # the small config compiles fast (a tiny model): the banner says so, as its steps are slower
    assert "; compile fast (XLA's backend optimisations off: slower steps)" in server.output()


BAD = [
    (dict(prompt=""), "text: the prompt must not be empty"),
    (dict(token_ids=[5] * 300), "tokens.token_ids: 300 tokens; the limit is 255"),
    (dict(token_ids=[5], max_tokens=0), "max_tokens: must be >= 1, got 0"),
    (dict(token_ids=[5] * 10, max_tokens=250), "max_tokens: prompt (10) + max_tokens (250) exceeds the context limit of 256"),
    (dict(token_ids=[5], temperature=-0.5), "temperature: must be >= 0"),
    (dict(token_ids=[5], temperature=math.nan), "temperature: must be a finite number"),
    (dict(token_ids=[5], temperature=math.inf), "temperature: must be a finite number"),
    (dict(token_ids=[5], top_p=0.0), "top_p: must be in (0, 1]"),
    (dict(token_ids=[5], top_p=1.5), "top_p: must be in (0, 1]"),
    (dict(token_ids=[5], top_k=-2), "top_k: must be >= -1"),
    (dict(token_ids=[5, 284]), "tokens.token_ids: token id 284 is outside the vocabulary [0, 284)"),
    (dict(token_ids=[-1]), "token id -1 is outside the vocabulary"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "chat.messages[0].role: 'wizard' is not one of"),
    (dict(messages=[{"role": "w" * 500_000, "content": "x"}]), "chat.messages[0].role: 'wwww"),  # (cut: below)
    (dict(prompt="word " * 300), "text: 901 tokens; the limit is 255"),  # (the tiny vocabulary: 3 a word)
    # more characters than 255 tokens of at most 13 (the tiny vocabulary's longest) hold: refused untokenized
    (dict(prompt="x" * 1_000_000), "text: 1000000 characters are more than 255 tokens (the context of 256"),
    (dict(token_ids=[5], lora="nope"), "lora: no LoRA adapter named 'nope'"),
    (dict(token_ids=[5], stop=[f"s{i}" for i in range(17)]), "stop: at most 16 stop strings, got 17"),
    (dict(prompt="x" * ((1 << 20) + 1)), "text: 1048577 characters; the limit is 1048576"),
    (dict(token_ids=[5], logprobs=21), "logprobs: must be <= 20"),
    (dict(token_ids=[5], request_id="r" * 129), "request_id: 129 characters; the limit is 128"),
    (dict(token_ids=[5], cache_salt="s" * 257), "cache_salt: 257 characters; the limit is 256"),
    (dict(messages=[{"role": "user", "content": "x" * (1 << 19)}] * 3),
     "chat.messages: 1572876 characters in all; the limit is 1048576"),
    (dict(token_ids=[5] * 5_000_000), "tokens.token_ids: 5000000 tokens; the limit is 255"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_input_is_invalid_argument(client, kwargs, message):
    kwargs.setdefault("max_tokens", 4)
    with pytest.raises(grpc.RpcError) as e:
        client.complete(timeout=30, **kwargs)
    code = grpc.StatusCode.NOT_FOUND if "lora" in kwargs else grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.code() == code, e.value.details()
    assert message in e.value.details() and len(e.value.details()) < 2100  # (a value echoed back is cut)


@pytest.mark.parametrize("kwargs, message", [
    ("null", "chat.template_kwargs: must be a JSON object"),
    ('{"a": NaN}', "chat.template_kwargs: not valid JSON (NaN is not a JSON number)"),
    ('{"a": ' + "[" * 5000 + "]" * 5000 + "}", "chat.template_kwargs: JSON nested too deeply"),
    ('{"k' + "x" * 100_000 + '\\ud800": 1}', "chat.template_kwargs.kxxx"),
])
def test_template_kwargs_are_read_as_an_http_body_is(client, kwargs, message):
    """ChatInput.template_kwargs: a JSON object (no NaN, nesting within the limit, text only), refused by
    the field otherwise with INVALID_ARGUMENT (a deep one was UNKNOWN and a traceback), details cut short."""
    from serve.client import build_request

    request = build_request(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    request.chat.template_kwargs = kwargs
    with pytest.raises(grpc.RpcError) as e:
        list(client.stub.Generate(request, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(message), e.value.details()
    assert len(e.value.details()) < 2100


def test_bad_input_leaves_the_server_serving(client):
    with pytest.raises(grpc.RpcError):
        client.complete(token_ids=[5, 99999], max_tokens=3)
    assert client.complete(token_ids=[5, 6], max_tokens=3, ignore_eos=True).completion_tokens == 3
    wait_pool_whole(client)


def test_fifty_concurrent_streams_some_cancelled(server):
    async def main():
        async with AsyncClient(server.target) as c:
            async def one(i):
                call = c.stream(build_request(token_ids=[3 + i % 50, 7, 9], max_tokens=40, ignore_eos=True))
                got = []
                async for resp in call:
                    if resp.HasField("chunk"):
                        got.extend(resp.chunk.token_ids)
                        if i % 3 == 0 and len(got) >= 3:
                            call.cancel()
                            return ("cancelled", got)
                    else:
                        return (resp.final.finish_reason, got)
                return ("cancelled", got)

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(50))), 600)

    results = asyncio.run(main())
    for i, (reason, got) in enumerate(results):
        if i % 3 == 0:
            assert reason == "cancelled" and len(got) >= 3
        else:
            assert reason == "length" and len(got) == 40
    with Client(server.target) as c:
        wait_pool_whole(c)


def test_deadline_and_abort_free_pages(server, client):
    with pytest.raises(grpc.RpcError) as e:
        for _ in client.generate(token_ids=[5, 6], max_tokens=250, ignore_eos=True, timeout=0.1):
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_pool_whole(client)
    stream = client.stream(build_request(token_ids=[5, 6], max_tokens=200, ignore_eos=True, request_id="mine"))
    first = next(stream)
    assert first.request_id == "mine"
    assert client.abort("mine") is True
    rest = list(stream)
    assert rest[-1].final.finish_reason == "abort"
    assert client.abort("mine") is False
    wait_pool_whole(client)


def test_request_ids_are_unguessable_and_each_client_aborts_only_its_own(server, client):
    r = client.complete(token_ids=[5, 6], max_tokens=2, ignore_eos=True)
    assert len(r.request_id) == 32 and int(r.request_id, 16) >= 0  # a uuid4, not req-N
    mine = client.stream(build_request(token_ids=[5, 6], max_tokens=200, ignore_eos=True, request_id="job-1"))
    assert next(mine).request_id == "job-1"
    # Another connection is another tenant (a channel of its own: in one process gRPC shares connections).
    with grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        other = jaxcb_pb2_grpc.JaxcbStub(ch)
        assert other.Abort(jaxcb_pb2.AbortRequest(request_id="job-1"), timeout=10).found is False
        # The same client id is free in the other's namespace, and its stream is its own.
        theirs = list(other.Generate(build_request(token_ids=[7, 8], max_tokens=3, ignore_eos=True,
                                                   request_id="job-1"), timeout=60))
        assert theirs[-1].request_id == "job-1" and theirs[-1].final.finish_reason == "length"
    assert client.abort("job-1") is True
    assert list(mine)[-1].final.finish_reason == "abort"
    # A retry with the same id right after a cancelled stream is not killed by the old one's clean-up.
    first = client.stream(build_request(token_ids=[5, 6], max_tokens=200, ignore_eos=True, request_id="job-2"))
    next(first)
    first.cancel()
    deadline = time.monotonic() + 30
    while True:  # until the server has seen the cancel, the id is still in use: then the retry goes in
        try:
            retry = client.complete(token_ids=[5, 6], max_tokens=5, ignore_eos=True, request_id="job-2", timeout=60)
            break
        except grpc.RpcError as e:
            assert "already in use" in e.details() and time.monotonic() < deadline, e.details()
            time.sleep(0.01)
    assert retry.finish_reason == "length" and retry.completion_tokens == 5  # not aborted by the old clean-up
    wait_pool_whole(client)


def test_metrics_endpoint(server, client):
    client.complete(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    for name in ("jaxcb:time_to_first_token_seconds_bucket", "jaxcb:inter_token_latency_seconds_bucket",
                 "jaxcb:e2e_request_latency_seconds_count", "jaxcb:request_queue_time_seconds_count",
                 "jaxcb:num_requests_running", "jaxcb:num_requests_waiting", "jaxcb:kv_cache_usage_perc",
                 "jaxcb:num_preemptions", "jaxcb:compilations", "jaxcb:prompt_tokens_total",
                 "jaxcb:generation_tokens_total", 'jaxcb:request_success_total{finished_reason="length"}'):
        assert name in body, name


def test_parallel_samples_and_cached_prefix_over_grpc(server, client):
    prompt = [int(t) for t in np.random.default_rng(1234).integers(3, 100, size=40)]  # two full pages
    first = client.complete(token_ids=prompt, max_tokens=3, ignore_eos=True)
    again = client.complete(token_ids=prompt + [7], max_tokens=3, ignore_eos=True)
    assert first.cached_prompt_tokens == 0 and again.cached_prompt_tokens == 32
    samples = client.complete_samples(token_ids=prompt, n=3, max_tokens=5, ignore_eos=True, temperature=1.0, seed=3)
    assert [r.index for r in samples] == [0, 1, 2]
    assert all(len(r.token_ids) == 5 and r.finish_reason == "length" for r in samples)
    assert all(r.cached_prompt_tokens == 32 for r in samples)  # all three found the prompt's pages
    assert len({tuple(r.token_ids) for r in samples}) > 1
    with pytest.raises(grpc.RpcError) as e:
        client.complete(token_ids=prompt, n=17, max_tokens=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n: must be <= 16" in e.value.details()
    wait_pool_whole(client)
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    hits = next(float(line.split()[-1]) for line in body.splitlines()
                if line.startswith("jaxcb:prefix_cache_hits_total"))
    assert hits >= 32 + 3 * 32


def test_auth_token_and_queue_limit(tiny_gguf_path, config_path):
    s = ServerProcess(tiny_gguf_path, config_path, "--auth-token", "s3cret", "--max-waiting", "0")
    try:
        s.wait_serving(metadata=(("authorization", "Bearer s3cret"),))
        for token in (None, "wrong"):
            with Client(s.target, token=token) as c:
                with pytest.raises(grpc.RpcError) as e:
                    c.complete(token_ids=[5], max_tokens=2, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as e:
                    c.server_info()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(s.target) as ch:  # health needs no token (it reveals nothing else)
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        with Client(s.target, token="s3cret") as c:
            assert c.server_info().pages_total == 95
            with pytest.raises(grpc.RpcError) as e:
                c.complete(token_ids=[5], max_tokens=2, timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue full" in e.value.details()
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("grace,expect", [("30", "length"), ("0", "abort")])
def test_sigterm_drains_then_exits_zero(tiny_gguf_path, config_path, grace, expect):
    """A stream in flight at SIGTERM runs to its end within the grace period, else is aborted: jaxcb's API says
    so in its final message; JetStream's, which has no finish reason, ends the call UNAVAILABLE rather than OK."""
    s = ServerProcess(tiny_gguf_path, config_path, "--grace-period", grace)
    try:
        s.wait_serving()
        with Client(s.target) as c, grpc.insecure_channel(s.target) as ch:
            assert c.complete(token_ids=[7, 8], max_tokens=250).finish_reason == "length"  # (no end token before)
            stream = c.stream(build_request(token_ids=[5, 6], max_tokens=250, ignore_eos=True))
            decode = jetstream_pb2_grpc.OrchestratorStub(ch).Decode(jetstream_pb2.DecodeRequest(
                max_tokens=250, token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[7, 8])), timeout=60)
            next(stream), next(decode)
            s.proc.send_signal(signal.SIGTERM)
            rest = list(stream)
            assert rest[-1].final.finish_reason == expect
            if expect == "abort":
                with pytest.raises(grpc.RpcError) as e:
                    list(decode)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "aborted after" in e.value.details()
            else:
                assert 1 + sum(len(r.stream_content.samples[0].token_ids) for r in decode) == 250
        assert s.proc.wait(60) == 0, s.output()
    finally:
        s.stop()


def test_sigterm_during_warm_up_exits_at_once(tiny_gguf_path, config_path):
    s = ServerProcess(tiny_gguf_path, config_path)
    try:
        deadline = time.monotonic() + 120
        while "warming up" not in s.output():
            assert time.monotonic() < deadline and s.proc.poll() is None, s.output()
            time.sleep(0.1)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(15) == 0, s.output()
        assert "stopped during warm-up" in s.output()
    finally:
        s.stop()


def test_tls(tiny_gguf_path, config_path, tmp_path):
    import shutil
    import subprocess

    openssl = shutil.which("openssl")
    assert openssl, "the openssl command is needed to make a test certificate"
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    http = free_port()
    s = ServerProcess(tiny_gguf_path, config_path, "--tls-cert", str(cert), "--tls-key", str(key),
                      "--http-port", str(http), "--auth-token", "s3cret")
    try:
        deadline = time.monotonic() + 240
        while True:  # health over TLS
            try:
                with Client(s.target, tls_root_cert=str(cert), token="s3cret") as c:
                    r = c.complete(token_ids=[5, 6], max_tokens=3, ignore_eos=True, timeout=10)
                    assert r.completion_tokens == 3
                    break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, s.output()
                time.sleep(0.3)
        with Client(s.target) as plain:  # a plaintext client cannot talk to it
            with pytest.raises(grpc.RpcError):
                plain.complete(token_ids=[5], max_tokens=2, timeout=5)
        # The HTTP API takes the same tokens, so it serves HTTPS with the same certificate; cleartext fails.
        import ssl

        import httpx

        r = httpx.post(f"https://127.0.0.1:{http}/v1/completions", timeout=30,
                       verify=ssl.create_default_context(cafile=str(cert)),
                       headers={"authorization": "Bearer s3cret"}, json={"prompt": [5, 6], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"http://127.0.0.1:{http}/v1/completions", timeout=10,
                       headers={"authorization": "Bearer s3cret"}, json={"prompt": [5, 6], "max_tokens": 3})
        assert "https://127.0.0.1" in s.output()
    finally:
        assert s.stop() == 0


def test_data_parallel_server_routes_over_two_replicas_with_the_single_engine_tokens(tiny_gguf_path, config_path,
                                                                                   offline):
    """`jaxcb serve --data-parallel 2` on two forced host devices: GetServerInfo and the metrics show
    each replica; concurrent requests spread over both and get the one-engine tokens; pools whole."""
    s = ServerProcess(tiny_gguf_path, config_path, "--data-parallel", "2",
                      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    try:
        s.wait_serving()
        rng = np.random.default_rng(7)
        prompts = [rng.integers(3, 128, int(n)).tolist() for n in rng.integers(2, 60, 8)]
        with Client(s.target) as c:
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda p: c.complete(token_ids=p, max_tokens=12, ignore_eos=True, timeout=120),
                                        prompts))
            info = wait_pool_whole(c)
        expected = offline.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        assert [r.token_ids for r in results] == [o.token_ids for o in expected]
        assert info.data_parallel == 2 and info.tensor_parallel == 1
        assert [list(r.device_ids) for r in info.replicas] == [[0], [1]]
        assert all(r.requests_routed > 0 for r in info.replicas) and sum(r.requests_routed for r in info.replicas) == 8
        assert all(r.pending_tokens == 0 and r.pages_free == r.pages_total for r in info.replicas)
        assert info.pages_total == sum(r.pages_total for r in info.replicas)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=10).read().decode()
        assert 'jaxcb:replica_kv_cache_usage_perc{replica="1"}' in metrics
    finally:
        assert s.stop() == 0, s.output()


def test_admission_counts_requests_not_yet_in_the_scheduler(tiny_gguf_path, config_path):
    """16 long streams at once against 8 batch slots and --max-waiting 2: at most 10 are accepted, even
    though they all arrive before the engine has moved any into its queue."""
    s = ServerProcess(tiny_gguf_path, config_path, "--max-waiting", "2", "--grace-period", "0")
    try:
        s.wait_serving()
        with Client(s.target) as c:
            def one(i):
                try:
                    return c.complete(token_ids=[5 + i, 6], max_tokens=240, ignore_eos=True, timeout=120).finish_reason
                except grpc.RpcError as e:
                    return e.code().name

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                ends = list(pool.map(one, range(16)))
        assert ends.count("RESOURCE_EXHAUSTED") >= 6, ends
        assert ends.count("length") == 16 - ends.count("RESOURCE_EXHAUSTED")
    finally:
        assert s.stop() == 0


def test_metrics_time_each_sample_and_count_failed_steps():
    from jaxcb.host.engine_stats import EngineStats
    from jaxcb.host.request import TokenEvent
    from serve.metrics import Metrics, RequestTimer

    m = Metrics()
    timers = [RequestTimer(m, arrival=0.0) for _ in range(2)]  # n = 2: one timer per sample
    for i, t in enumerate(timers):
        t.on_event(TokenEvent("r", (5,), "a", False, None, None, 7, 1, index=i))
    for i, t in enumerate(timers):
        t.on_event(TokenEvent("r", (6,), "b", True, FinishReason.LENGTH, None, 7, 2, index=i))
    text = prometheus_client.generate_latest(m.registry).decode()
    assert "jaxcb:prompt_tokens_total 7.0" in text  # the prompt once, not once per sample
    assert "jaxcb:inter_token_latency_seconds_count 2.0" in text  # one gap per sample, none across them
    stats = EngineStats(running=0, waiting=0, pages_total=10, pages_free=10, pages_in_use=0, compilations=0,
                        preemptions=0, prompt_tokens_computed=0, output_tokens=0, steps=0, padding_fraction=0.0,
                        page_utilization=0.0, host_wait_fraction=0.0, failed_steps=3)
    m.refresh(stats)
    m.refresh(stats)
    assert "jaxcb:failed_steps_total 3.0" in prometheus_client.generate_latest(m.registry).decode()
