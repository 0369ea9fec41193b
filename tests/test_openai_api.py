"""The OpenAI-compatible HTTP API (serve/openai_api.py), driven by the official `openai` client and by
raw HTTP, against `jaxcb serve --http-port` on the tiny model; the same server's gRPC and the offline
engine are the references."""

from __future__ import annotations

import json
import os
import time

import grpc
import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import jaxcb
from jaxcb.host.engine_config import load_config
from jaxcb.host.request import SamplingParams
from jaxcb.llm import LLM
from jaxcb.host import tool_calls
from serve.client import Client, build_request
from serve.proto import jetstream_pb2, jetstream_pb2_grpc
from tests.server_util import ServerProcess, free_port, http_server, wait_pool_whole


@pytest.fixture(scope="module")
def server(tiny_gguf_path, config_path, tmp_path_factory):
    yield from http_server(tiny_gguf_path, config_path, "--profile-dir", str(tmp_path_factory.mktemp("profiles")),
                           "--dev-routes")


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(oai):
    return oai.models.list().data[0].id


def _pool_whole(server, timeout=10.0):
    with Client(server.target) as c:
        return wait_pool_whole(c, timeout)


def test_completions_equal_grpc_and_the_offline_engine(server, oai, model_name, tiny_model, config_path):
    prompt = [5, 6, 7, 8, 9]
    cfg, params, tok, eos = tiny_model
    offline = LLM.from_params(cfg, params, tok, config=load_config(config_path), eos_ids=eos)
    for sampling in (dict(temperature=0.0), dict(temperature=0.9, seed=11)):
        http = oai.completions.create(model=model_name, prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True},
                                      **sampling)
        streamed = "".join(c.choices[0].text for c in oai.completions.create(
            model=model_name, prompt=prompt, max_tokens=12, stream=True, extra_body={"ignore_eos": True}, **sampling))
        with Client(server.target) as c:
            grpc_text = c.complete(token_ids=prompt, max_tokens=12, ignore_eos=True, **sampling).text
        expected = offline.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, **sampling))[0].text
        assert http.choices[0].text == streamed == grpc_text == expected, sampling
        assert http.choices[0].finish_reason == "length"
        assert http.usage.prompt_tokens == 5 and http.usage.completion_tokens == 12


def test_logit_bias_gives_the_same_tokens_over_both_apis_and_the_offline_engine(server, oai, model_name, tiny_model,
                                                                                  config_path):
    """OpenAI's logit_bias over HTTP, the same map over gRPC and SamplingParams offline: the same tokens,
    a banned token never comes out, and without the bias the greedy answer is another."""
    prompt = [5, 6, 7, 8, 9]
    cfg, params, tok, eos = tiny_model
    offline = LLM.from_params(cfg, params, tok, config=load_config(config_path), eos_ids=eos)
    free = offline.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    bias = {free[0]: -100.0, free[1]: -100.0, 3: 2.5}  # ban the first two greedy tokens, favour one
    for sampling in (dict(temperature=0.0), dict(temperature=0.9, seed=5)):
        expected = offline.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=bias,
                                                             **sampling))[0]
        assert free[0] not in expected.token_ids and free[1] not in expected.token_ids
        http = oai.completions.create(model=model_name, prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True},
                                      logit_bias={str(t): b for t, b in bias.items()}, **sampling)
        with Client(server.target) as c:
            grpc_text = c.complete(token_ids=prompt, max_tokens=8, ignore_eos=True, logit_bias=bias, **sampling).text
        assert http.choices[0].text == grpc_text == expected.text, sampling
    assert expected.token_ids != free
    cases = [({"5": 100.5}, "logit_bias[5]: must be <= 100.0"), ({"x": 1}, "logit_bias: 'x' is not a token id"),
             ({"5": "a"}, "logit_bias[5]: must be a finite number"), ([5], "logit_bias: must be an object"),
             ({str(i): 1 for i in range(301)}, "logit_bias: at most 300 token ids, got 301"),
             ({"100000": 1}, "logit_bias: token id 100000 is outside the vocabulary")]
    for bias, message in cases:
        r = httpx.post(server.http + "/v1/completions", json={"prompt": prompt, "logit_bias": bias}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), (bias, r.text[:300])
    with Client(server.target) as c:
        for bias, message in (({5: 101.0}, "logit_bias[5]: must be <= 100.0"), ({-3: 1.0}, "logit_bias: -3 is not"),
                              ({i: 1.0 for i in range(301)}, "logit_bias: at most 300")):
            with pytest.raises(grpc.RpcError) as e:
                c.complete(token_ids=prompt, max_tokens=2, logit_bias=bias)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(message)


def test_skip_special_tokens_over_both_apis_as_offline(server, oai, model_name, tiny_model, config_path):
    """vLLM's skip_special_tokens: false keeps a special token's text in the output text (HTTP, gRPC and
    SamplingParams alike); by default it is left out; a value that is not a boolean is named."""
    cfg, params, tok, eos = tiny_model
    offline = LLM.from_params(cfg, params, tok, config=load_config(config_path), eos_ids=eos)
    start = tok.token_id("<|im_start|>")  # a special token that ends nothing
    prompt, bias = [5, 6, 7], {start: 100.0}
    kept = offline.generate([prompt], SamplingParams(max_tokens=3, logit_bias=bias, skip_special_tokens=False))[0]
    assert kept.token_ids == [start] * 3 and kept.text == "<|im_start|>" * 3
    assert offline.generate([prompt], SamplingParams(max_tokens=3, logit_bias=bias))[0].text == ""
    http = oai.completions.create(model=model_name, prompt=prompt, max_tokens=3, logit_bias={str(start): 100},
                                  extra_body={"skip_special_tokens": False})
    with Client(server.target) as c:
        grpc_out = c.complete(token_ids=prompt, max_tokens=3, logit_bias=bias, skip_special_tokens=False)
    assert http.choices[0].text == grpc_out.text == kept.text
    r = httpx.post(server.http + "/v1/completions", json={"prompt": prompt, "skip_special_tokens": "no"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("skip_special_tokens: must be"), r.text


def test_min_tokens_and_stop_token_ids_over_both_apis_as_offline(server, oai, model_name, tiny_model, config_path):
    """vLLM's min_tokens, stop_token_ids, include_stop_str_in_output and allowed_token_ids over HTTP, the same over gRPC and
    SamplingParams offline: the same tokens (a stop token ends the text; before min_tokens it is never
    sampled) and text; bad values named."""
    prompt = [5, 6, 7, 8, 9]
    cfg, params, tok, eos = tiny_model
    offline = LLM.from_params(cfg, params, tok, config=load_config(config_path), eos_ids=eos)
    free = offline.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    stop = free[1]
    for min_tokens in (0, 4):
        expected = offline.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(stop,),
                                                             min_tokens=min_tokens))[0]
        http = oai.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0.0, extra_body={
            "ignore_eos": True, "stop_token_ids": [stop], "min_tokens": min_tokens})
        with Client(server.target) as c:
            grpc_out = c.complete(token_ids=prompt, max_tokens=10, ignore_eos=True, stop_token_ids=[stop],
                                  min_tokens=min_tokens)
        assert http.choices[0].text == grpc_out.text == expected.text, min_tokens
        assert http.choices[0].finish_reason == expected.finish_reason
        # vLLM's stop_reason: the stop token that ended it, on every API (None when max_tokens did)
        assert http.choices[0].model_extra["stop_reason"] == grpc_out.stop_reason == expected.stop_reason == (
            stop if expected.finish_reason == "stop" else None)
        assert min_tokens or expected.finish_reason == "stop"
        assert http.usage.completion_tokens == len(expected.token_ids)
    assert len(expected.token_ids) >= 4 and stop not in expected.token_ids[:4]
    text = offline.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].text
    char = next(c for c in text[1:] if c.strip() and c != "\ufffd")
    kept = offline.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, stop=(char,),
                                                     include_stop_str_in_output=True))[0].text
    assert kept == text[:text.index(char) + 1]  # the text up to the stop string, the stop string kept
    http = oai.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0.0, stop=[char],
                                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    with Client(server.target) as c:
        grpc_out = c.complete(token_ids=prompt, max_tokens=10, ignore_eos=True, stop=[char],
                              include_stop_str_in_output=True)
    assert http.choices[0].text == grpc_out.text == kept
    assert http.choices[0].model_extra["stop_reason"] == grpc_out.stop_reason == char  # ... or the stop string
    streamed = [c.choices[0].model_extra.get("stop_reason") for c in oai.completions.create(
        model=model_name, prompt=prompt, max_tokens=10, temperature=0.0, stop=[char], stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].finish_reason]
    assert streamed == [char]
    ran_out = oai.completions.create(model=model_name, prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True})
    assert ran_out.choices[0].finish_reason == "length" and ran_out.choices[0].model_extra["stop_reason"] is None
    for body, message in (({"min_tokens": 11}, "min_tokens: must be <= 10, got 11"),
                          ({"min_tokens": -1}, "min_tokens: must be >= 0"),
                          ({"min_tokens": "3"}, "min_tokens: must be an integer"),
                          ({"stop_token_ids": 5}, "stop_token_ids: must be a list of token ids"),
                          ({"stop_token_ids": ["a"]}, "stop_token_ids: must be a list of token ids"),
                          ({"stop_token_ids": [100000]}, "stop_token_ids: token id 100000 is outside the vocabulary"),
                          ({"stop_token_ids": list(range(65))}, "stop_token_ids: at most 64")):
        r = httpx.post(server.http + "/v1/completions", json={"prompt": prompt, "max_tokens": 10, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), (body, r.text[:300])
    with Client(server.target) as c, pytest.raises(grpc.RpcError) as e:
        c.complete(token_ids=prompt, max_tokens=2, min_tokens=3)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == "min_tokens: must be <= 2, got 3"
    # allowed_token_ids (vLLM's): the only tokens sampled, the same over both APIs as offline.
    allowed = sorted(set(free[2:6]) | {7})
    expected = offline.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, allowed_token_ids=allowed))[0]
    assert set(expected.token_ids) <= set(allowed)
    http = oai.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0.0,
                                  extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    with Client(server.target) as c:
        grpc_out = c.complete(token_ids=prompt, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)
    assert http.choices[0].text == grpc_out.text == expected.text
    for body, message in (({"allowed_token_ids": 5}, "allowed_token_ids: must be a list of token ids"),
                          ({"allowed_token_ids": [-1]}, "allowed_token_ids: token id -1 is outside the vocabulary"),
                          ({"allowed_token_ids": [0] * ((1 << 18) + 1)}, "allowed_token_ids: at most 262144")):
        r = httpx.post(server.http + "/v1/completions", json={"prompt": prompt, "max_tokens": 10, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), (body, r.text[:300])


def test_bad_words_over_both_apis_as_offline(server, oai, model_name, tiny_model, config_path):
    """vLLM's bad_words over HTTP (completions and chat), gRPC and SamplingParams offline: the same tokens, the
    words spelt by the server's tokenizer; bad values named, the same on both APIs."""
    prompt = [5, 6, 7, 8, 9]
    cfg, params, tok, eos = tiny_model
    offline = LLM.from_params(cfg, params, tok, config=load_config(config_path), eos_ids=eos)
    free = offline.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    words = [tok.decode(free.token_ids[2:4]), tok.decode(free.token_ids[6:7])]
    expected = offline.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, bad_words=tuple(words)))[0]
    assert expected.token_ids != free.token_ids
    http = oai.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0.0,
                                  extra_body={"ignore_eos": True, "bad_words": words, "return_token_ids": True})
    with Client(server.target) as c:
        grpc_out = c.complete(token_ids=prompt, max_tokens=10, ignore_eos=True, bad_words=words)
    assert http.choices[0].model_extra["token_ids"] == grpc_out.token_ids == expected.token_ids
    chat = httpx.post(server.http + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "bad_words": words}, timeout=60)
    assert chat.status_code == 200, chat.text
    for body, message in (({"bad_words": "x"}, "bad_words: must be a list of strings"),
                          ({"bad_words": [""]}, "bad_words: each word must be a string of 1..256 characters"),
                          ({"bad_words": [5]}, "bad_words: each word must be a string"),
                          ({"bad_words": ["x"] * 129}, "bad_words: at most 128 words, got 129")):
        r = httpx.post(server.http + "/v1/completions", json={"prompt": prompt, "max_tokens": 10, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), (body, r.text[:300])
    with Client(server.target) as c, pytest.raises(grpc.RpcError) as e:
        c.complete(token_ids=prompt, max_tokens=2, bad_words=["x"] * 129)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == "bad_words: at most 128 words, got 129"


def test_repetition_detection_over_both_apis(server, model_name):
    """vLLM's repetition_detection: finish_reason "repetition" and stop_reason "repetition_detected" over HTTP
    (streamed too), gRPC's finish "repetition"; bad values named on both APIs."""
    body = {"prompt": [5, 6, 7], "max_tokens": 20, "ignore_eos": True, "allowed_token_ids": [7],
            "repetition_detection": {"max_pattern_size": 2, "min_count": 4}}
    choice = httpx.post(server.http + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["finish_reason"] == "repetition" and choice["stop_reason"] == "repetition_detected"
    with httpx.stream("POST", server.http + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        finals = [json.loads(line[6:])["choices"][0] for line in r.iter_lines()
                  if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["finish_reason"]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in finals] == [("repetition", "repetition_detected")]
    with Client(server.target) as c:
        req = build_request(token_ids=[5, 6, 7], max_tokens=20, ignore_eos=True, allowed_token_ids=[7])
        req.repetition_detection.max_pattern_size, req.repetition_detection.min_count = 2, 4
        final = [r for r in c.stream(req) if r.HasField("final")][0].final
        assert final.finish_reason == "repetition"
        req.repetition_detection.min_count = 1
        with pytest.raises(grpc.RpcError) as e:
            list(c.stream(req))
        assert e.value.details() == "repetition_detection.min_count: must be >= 2 with a max_pattern_size, got 1"
    for detection, message in (({"max_pattern_size": 2, "min_count": 1},
                                "repetition_detection.min_count: must be >= 2 with a max_pattern_size, got 1"),
                               ({"max_pattern_size": 2, "min_count": 3, "every": 1}, "repetition_detection: must be an"),
                               ([2, 1, 3], "repetition_detection: must be an object"),
                               ({"max_pattern_size": "2", "min_count": 3}, "repetition_detection.max_pattern_size: must be")):
        r = httpx.post(server.http + "/v1/completions", json={**body, "repetition_detection": detection}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), (detection, r.text[:300])


def test_stream_interval_joins_tokens_into_fewer_chunks_with_the_same_answer(server):
    """vLLM's stream_interval: each streamed chunk holds that many tokens (the first chunk and the last at once),
    the text, token ids and logprobs joined the same as one token a chunk; session_id is taken and changes
    nothing; bad values named."""
    body = {"prompt": [5, 6, 7], "max_tokens": 11, "ignore_eos": True, "temperature": 0, "stream": True,
            "logprobs": 1, "return_token_ids": True, "n": 2, "session_id": "s-1"}

    def chunks(extra):
        with httpx.stream("POST", server.http + "/v1/completions", json={**body, **extra}, timeout=60) as r:
            assert r.status_code == 200, r.read()
            return [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]

    one, four = chunks({}), chunks({"stream_interval": 4})
    for index in (0, 1):
        a = [c for c in one if c["index"] == index]
        b = [c for c in four if c["index"] == index]
        assert "".join(c["text"] for c in a) == "".join(c["text"] for c in b)
        assert sum((c["token_ids"] for c in a), []) == sum((c["token_ids"] for c in b), [])
        assert sum((c["logprobs"]["token_logprobs"] for c in a), []) == sum(
            (c["logprobs"]["token_logprobs"] for c in b), [])
        assert [len(c["token_ids"]) for c in b] == [1, 4, 4, 2] and b[-1]["finish_reason"] == "length"
    for extra, message in (({"stream_interval": 0}, "stream_interval: must be between 1 and 65536"),
                           ({"stream_interval": "2"}, "stream_interval: must be an integer"),
                           ({"session_id": 5}, "session_id: must be a string"),
                           ({"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens: must be")):
        r = httpx.post(server.http + "/v1/completions", json={**body, "stream": False, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), (extra, r.text[:300])


def test_sagemakers_ping_and_invocations_and_the_load_and_server_info_routes(server, model_name):
    """SageMaker's contract, as vLLM serves it: /ping (GET and POST) is the health check; POST /invocations
    answers a body as the call it is (chat, completion, streamed too, embeddings), a body that is none of
    them a 400 naming what it takes. vLLM's /load counts the calls in progress; /server_info is gRPC's
    GetServerInfo as JSON."""
    for method in ("GET", "POST"):
        r = httpx.request(method, server.http + "/ping", timeout=10)
        assert r.status_code == 200 and r.text == "SERVING"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
    want = httpx.post(server.http + "/v1/chat/completions", json=chat, timeout=60).json()
    got = httpx.post(server.http + "/invocations", json=chat, timeout=60).json()
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    prompt = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    want = httpx.post(server.http + "/v1/completions", json=prompt, timeout=60).json()["choices"][0]["text"]
    assert httpx.post(server.http + "/invocations", json=prompt, timeout=60).json()["choices"][0]["text"] == want
    with httpx.stream("POST", server.http + "/invocations", json={**prompt, "stream": True}, timeout=60) as r:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                       if line.startswith("data: {"))
    assert text == want
    embedded = httpx.post(server.http + "/invocations", json={"input": "a cat"}, timeout=60).json()
    assert embedded["object"] == "list" and embedded["data"][0]["object"] == "embedding"
    r = httpx.post(server.http + "/invocations", json={"colour": "red"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("body: /invocations takes a chat")
    assert httpx.get(server.http + "/load", timeout=10).json() == {"server_load": 0}
    info = httpx.get(server.http + "/server_info", timeout=10).json()
    with Client(server.target) as c:
        grpc_info = c.server_info()
    assert info["page_size"] == grpc_info.page_size and info["pages_total"] == grpc_info.pages_total
    assert info["decode_batch_buckets"] == list(grpc_info.decode_batch_buckets) and info["policy"] == grpc_info.policy


def test_a_profile_is_written_between_start_and_stop_profile(server, long_server):
    """vLLM's /start_profile and /stop_profile, served with --profile-dir: a jax.profiler trace of what ran
    between them, in a folder of its own; one at a time; a server without --profile-dir has no such routes."""
    import glob

    started = httpx.post(server.http + "/start_profile", timeout=60)
    assert started.status_code == 200, started.text
    assert httpx.post(server.http + "/start_profile", timeout=60).status_code == 409
    httpx.post(server.http + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=60)
    stopped = httpx.post(server.http + "/stop_profile", timeout=120).json()
    assert stopped == started.json()
    written = glob.glob(os.path.join(stopped["profile_dir"], "**", "*.xplane.pb"), recursive=True)
    assert written and os.path.getsize(written[0]) > 0
    assert httpx.post(server.http + "/stop_profile", timeout=60).status_code == 409
    assert httpx.post(long_server.http + "/start_profile", timeout=60).status_code == 404


def test_return_prompt_text_gives_the_prompt_the_template_wrote(server, tiny_model):
    """vLLM's return_prompt_text (chat): `prompt_text` beside the answer, and in the stream's first chunk only;
    beam search refuses it (and the other per-step settings it cannot keep), naming the field."""
    tok = tiny_model[2]
    messages = [{"role": "user", "content": "hi"}]
    want = tok.decode(tok.encode_chat(messages, True), skip_special=False)
    body = {"messages": messages, "max_tokens": 3, "return_prompt_text": True}
    assert httpx.post(server.http + "/v1/chat/completions", json=body, timeout=60).json()["prompt_text"] == want
    with httpx.stream("POST", server.http + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c.get("prompt_text") for c in chunks] == [want] + [None] * (len(chunks) - 1)
    assert "prompt_text" not in httpx.post(server.http + "/v1/chat/completions", json={**body, "return_prompt_text": False},
                                           timeout=60).json()
    for extra in ({"return_prompt_text": True}, {"bad_words": ["a"]}, {"repetition_detection": {
            "max_pattern_size": 2, "min_count": 3}}):
        r = httpx.post(server.http + "/v1/chat/completions", json={
            "messages": messages, "max_tokens": 3, "use_beam_search": True, "n": 2, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"] == f"{next(iter(extra))}: not supported with " \
            "use_beam_search", r.text[:300]


def test_reset_prefix_cache_forgets_cached_prefixes_only_while_nothing_runs(server, long_server):
    """vLLM's POST /reset_prefix_cache (--dev-routes): a prompt answered before is cached, then forgotten (the engine
    refuses while requests run: tests/test_engine.py); a server without the flag has no such route."""
    body = {"prompt": [5 + i % 50 for i in range(80)], "max_tokens": 2, "temperature": 0}

    def cached():
        r = httpx.post(server.http + "/v1/completions", json=body, timeout=60).json()
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() >= 64
    _pool_whole(server)
    assert httpx.post(server.http + "/reset_prefix_cache", timeout=60).json() == {"success": True}
    assert cached() == 0
    assert httpx.post(long_server.http + "/reset_prefix_cache", timeout=60).status_code == 404


def test_the_rl_routes_pause_update_the_weights_from_disk_and_resume(server, long_server, tiny_gguf_path, tmp_path):
    """vLLM's /pause, /resume, /is_paused, /sleep, /wake_up, /is_sleeping, /weight_info, /update_weight_version,
    /weight_checker and SGLang's /update_weights_from_disk (--dev-routes): a request made while paused or asleep waits
    for /resume or /wake_up; other weights change the tokens, the served file's bring them back (and the checksums);
    bad calls are 400s naming the field."""
    import concurrent.futures

    from tests.tiny_gguf import write_tiny_gguf

    other = str(tmp_path / "other.gguf")
    write_tiny_gguf(other, seed=1)
    body = {"prompt": [5, 9, 40, 41, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def post(route, **kw):
        return httpx.post(server.http + route, timeout=120, **kw)

    def complete():
        return post("/v1/completions", json=body).json()["choices"][0]["text"]

    before = complete()
    sums = post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
    assert sums and all(len(v) == 64 for v in sums.values())
    assert httpx.get(server.http + "/weight_info", timeout=30).json() == {"weight_version": "default"}
    assert httpx.get(server.http + "/get_world_size", timeout=30).json() == {"world_size": 1}
    try:
        assert post("/pause?mode=keep").json() == {"status": "paused"}  # vLLM's /abort_requests, by id, then all
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            held = {rid: pool.submit(lambda rid=rid: post("/v1/completions", json={**body, "request_id": rid}).json())
                    for rid in ("a1", "a2", "a3")}
            time.sleep(1.0)
            assert post("/abort_requests", json={"request_ids": ["a1"]}).json() == {"status": "aborted", "aborted": 1}
            assert held["a1"].result(timeout=60)["choices"][0]["finish_reason"] == "abort"
            assert post("/abort_requests", json={"request_ids": ["a2", "nobody"]}).json()["aborted"] == 1
            assert post("/resume").json() == {"status": "resumed"}
            assert held["a3"].result(timeout=60)["choices"][0]["text"] == before
            assert held["a2"].result(timeout=60)["choices"][0]["finish_reason"] == "abort"
        assert post("/weight_checker", json={"action": "reset"}).json() == {"status": "reset"}
        zeroed = post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
        assert zeroed.keys() == sums.keys() and not set(zeroed.values()) & set(sums.values())
        assert post("/update_weights_from_disk", json={"model_path": tiny_gguf_path}).status_code == 200
        assert complete() == before
        assert post("/pause?mode=abort&clear_cache=yes").json() == {"status": "paused"}
        assert httpx.get(server.http + "/is_paused", timeout=30).json() == {"is_paused": True}
        assert httpx.get(server.http + "/is_sleeping", timeout=30).json() == {"is_sleeping": True}  # (as vLLM says)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(complete)
            time.sleep(1.0)
            assert not waiting.done()  # (held, unstarted, while paused)
            r = post("/update_weights_from_disk", json={"model_path": other, "weight_version": "step-1"})
            assert r.status_code == 200 and r.json()["success"] is True, r.text
            assert post("/resume").json() == {"status": "resumed"}
            after = waiting.result(timeout=120)
        assert after != before and complete() == after
        assert httpx.get(server.http + "/weight_info", timeout=30).json() == {"weight_version": "step-1"}
        compared = post("/weight_checker", json={"action": "compare", "baseline": sums}).json()
        assert compared["match"] is False and compared["mismatches"]
        assert post("/pause?mode=keep").json() == {"status": "paused"}  # (an operator's pause outlasts the update's)
        r = post("/update_weights_from_disk", json={"model_path": tiny_gguf_path, "abort_all_requests": True})
        assert r.status_code == 200 and httpx.get(server.http + "/is_paused", timeout=30).json()["is_paused"] is True
        assert post("/resume").json() == {"status": "resumed"}
        r = post("/update_weights_from_disk", json={"model_path": tiny_gguf_path, "abort_all_requests": True})
        assert r.status_code == 200 and httpx.get(server.http + "/is_paused", timeout=30).json()["is_paused"] is False
        assert complete() == before
        assert post("/weight_checker", json={"action": "compare", "baseline": sums}).json() == {
            "match": True, "mismatches": []}
        assert post("/sleep?level=1").json() == {"status": "sleeping", "level": 1}
        assert httpx.get(server.http + "/is_sleeping", timeout=30).json() == {"is_sleeping": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(complete)
            time.sleep(1.0)
            assert not waiting.done()  # (held while asleep)
            assert post("/wake_up?tags=kv_cache").json() == {"status": "sleeping", "tags": ["kv_cache"]}
            assert post("/wake_up").json() == {"status": "awake", "tags": None}
            assert waiting.result(timeout=120) == before
        assert httpx.get(server.http + "/is_sleeping", timeout=30).json() == {"is_sleeping": False}
        r = post("/release_kv_cache_memory")  # (vLLM's: from a still engine only)
        assert r.status_code == 400 and "pause first" in r.json()["error"]["message"], r.text
        assert post("/pause?mode=wait").json() == {"status": "paused"}
        assert post("/release_kv_cache_memory").json() == {"status": "kv_cache_released"}
        assert post("/wake_up?tags=kv_cache").json() == {"status": "awake", "tags": ["kv_cache"]}
        assert complete() == before
        assert httpx.get(server.http + "/is_sleeping", timeout=30).json() == {"is_sleeping": False}
        metrics = httpx.get(server.http + "/metrics", timeout=30).text  # (vLLM's RL metrics, and where the engine is)
        for line in ('jaxcb:rl_weight_update_operation_duration_seconds_count{operation="update"}',
                     'jaxcb:rl_weight_update_operation_duration_seconds_count{operation="sleep"}',
                     'jaxcb:rl_weight_update_operations_in_flight{operation="wake_up"} 0.0',
                     "jaxcb:engine_sleeping 0.0", "jaxcb:engine_paused 0.0"):
            assert line in metrics, line
        assert post("/update_weight_version", json={"new_version": "v2"}).json() == {"success": True,
                                                                                    "new_version": "v2"}
        assert httpx.get(server.http + "/weight_info", timeout=30).json() == {"weight_version": "v2"}
        for route, kw, field in (("/pause?mode=sleep", {}, "mode"), ("/pause?clear_cache=maybe", {}, "clear_cache"),
                                 ("/update_weights_from_disk", {"json": {}}, "model_path"),
                                 ("/update_weights_from_disk", {"json": {"model_path": str(tmp_path / "absent")}},
                                  "model_path"),
                                 ("/update_weights_from_disk", {"json": {"model_path": other, "load_format": "pt"}},
                                  "load_format"),
                                 ("/update_weights_from_disk", {"json": {"model_path": other, "weight_version": 3}},
                                  "weight_version"),
                                 ("/weight_checker", {"json": {"action": "restore"}}, "action"),
                                 ("/abort_requests", {"json": {"request_ids": "a1"}}, "request_ids"),
                                 ("/abort_requests", {"json": {"request_ids": False}}, "request_ids"),
                                 ("/update_weight_version", {"json": {"new_version": "v\n2"}}, "weight_version"),
                                 ("/sleep?level=3", {}, "level"), ("/sleep?mode=nap", {}, "mode"),
                                 ("/update_weight_version", {"json": {}}, "new_version"),
                                 ("/wake_up?tags=everything", {}, "tags"),
                                 ("/weight_checker", {"json": {"action": "compare"}}, "baseline")):
            r = post(route, **kw)
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(field), (route, r.text[:300])
        assert complete() == before
        # The same over gRPC (jaxcb's API): the pause, an update and the server's account of them
        from serve.proto import jaxcb_pb2

        with Client(server.target) as c:
            r = c.stub.PauseGeneration(jaxcb_pb2.PauseGenerationRequest(mode="wait"))
            assert r.paused and r.message == "paused" and c.server_info().paused
            r = c.stub.UpdateWeights(jaxcb_pb2.UpdateWeightsRequest(model_path=other, weight_version="grpc-1"))
            assert r.weight_version == "grpc-1" and r.paused and not r.sleeping
            r = c.stub.ResumeGeneration(jaxcb_pb2.ResumeGenerationRequest())
            assert not r.paused and complete() == after
            r = c.stub.UpdateWeights(jaxcb_pb2.UpdateWeightsRequest(model_path=tiny_gguf_path))
            assert r.weight_version == "" and complete() == before
            r = c.stub.Sleep(jaxcb_pb2.SleepRequest())
            assert r.sleeping and c.server_info().sleeping
            assert not c.stub.WakeUp(jaxcb_pb2.WakeUpRequest()).sleeping and complete() == before
            for call, request, field in ((c.stub.PauseGeneration, jaxcb_pb2.PauseGenerationRequest(mode="nap"), "mode"),
                                         (c.stub.UpdateWeights, jaxcb_pb2.UpdateWeightsRequest(), "model_path"),
                                         (c.stub.Sleep, jaxcb_pb2.SleepRequest(level=5), "level"),
                                         (c.stub.WakeUp, jaxcb_pb2.WakeUpRequest(tags=["gpu"]), "tags")):
                with pytest.raises(grpc.RpcError) as err:
                    call(request)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field)
        with Client(long_server.target) as c:  # (a server without --dev-routes)
            with pytest.raises(grpc.RpcError) as err:
                c.stub.PauseGeneration(jaxcb_pb2.PauseGenerationRequest())
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        post("/resume")
    assert httpx.post(long_server.http + "/pause", timeout=60).status_code == 404


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(server, model_name):
    """vLLM's return_tokens_as_token_ids: every token that logprobs name ("token", "tokens", top_logprobs'
    keys, echo's prompt tokens) is "token_id:N", N the id return_token_ids gives; the values are unchanged."""
    prompt = [5, 6, 7, 8, 9]
    body = {"prompt": prompt, "max_tokens": 6, "logprobs": 2, "ignore_eos": True, "return_token_ids": True,
            "temperature": 0}
    plain = httpx.post(server.http + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    named = httpx.post(server.http + "/v1/completions", json={**body, "return_tokens_as_token_ids": True,
                                                             "echo": True}, timeout=60).json()["choices"][0]
    ids = prompt + named["token_ids"]
    assert named["token_ids"] == plain["token_ids"]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert named["logprobs"]["token_logprobs"][len(prompt):] == plain["logprobs"]["token_logprobs"]
    assert all(k.startswith("token_id:") for top in named["logprobs"]["top_logprobs"][1:] for k in top)
    assert named["logprobs"]["top_logprobs"][len(prompt)][f"token_id:{ids[len(prompt)]}"] == (
        plain["logprobs"]["token_logprobs"][0])
    chat = httpx.post(server.http + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
        "return_tokens_as_token_ids": True, "return_token_ids": True}, timeout=60).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(a["token"].startswith("token_id:") for c in content for a in c["top_logprobs"])
    r = httpx.post(server.http + "/v1/completions", json={**body, "return_tokens_as_token_ids": "yes"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("return_tokens_as_token_ids: must be")


def test_embeddings_over_both_apis_equal_the_offline_engine(server, oai, model_name, tiny_model, config_path):
    """/v1/embeddings (the official client's default base64, and floats), gRPC's Embed and LLM.embed give the same
    vectors for text and token-id inputs: unit vectors of the model's width, `dimensions` the first values
    normalized again; usage counts the inputs' tokens; afterwards every page is free."""
    cfg, params, tok, eos = tiny_model
    offline = LLM.from_params(cfg, params, tok, config=load_config(config_path), eos_ids=eos)
    inputs = ["The cat sat on the mat.", [5, 6, 7, 8, 9], "A longer input " * 20]
    want = offline.embed(inputs)
    by_default = oai.embeddings.create(model=model_name, input=inputs)  # (the client asks for base64)
    floats = httpx.post(server.http + "/v1/embeddings", json={"model": model_name, "input": inputs,
                                                               "encoding_format": "float"}, timeout=60).json()
    with Client(server.target) as c:
        over_grpc = c.embed(inputs)
        info = c.model_info()
    assert info.embedding_size == cfg.hidden_size and "last token" in info.embedding_pooling
    tokens = [len(tok.encode_input(inputs[0])), 5, len(tok.encode_input(inputs[2]))]
    assert by_default.usage.prompt_tokens == floats["usage"]["prompt_tokens"] == over_grpc.prompt_tokens == sum(tokens)
    assert [e["index"] for e in floats["data"]] == [0, 1, 2] and floats["object"] == "list"
    for i, vector in enumerate(want):
        assert vector.shape == (cfg.hidden_size,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-5
        for got in (by_default.data[i].embedding, floats["data"][i]["embedding"], over_grpc.embeddings[i].values):
            assert np.abs(np.asarray(got) - vector).max() < 1e-6, i
        assert over_grpc.embeddings[i].prompt_tokens == tokens[i]
    chat = [{"role": "system", "content": "Represent this for retrieval."}, {"role": "user", "content": "cats"}]
    for prompt in (False, True):  # vLLM's chat-style input: the conversation through the chat template, one input
        body = {"messages": chat, "encoding_format": "float", **({"add_generation_prompt": True} if prompt else {})}
        r = httpx.post(server.http + "/v1/embeddings", json=body, timeout=60).json()
        ids = tok.encode_chat(chat, prompt)
        assert r["usage"]["prompt_tokens"] == len(ids), r
        assert np.abs(np.asarray(r["data"][0]["embedding"]) - offline.embed([ids])[0]).max() < 1e-6
    both = httpx.post(server.http + "/v1/embeddings", json={"input": "x", "messages": chat}, timeout=60)
    assert both.status_code == 400 and "input: give either input or messages" in both.text
    pool = httpx.post(server.http + "/pooling", json={"input": inputs}, timeout=60).json()  # (vLLM's: embed here)
    assert [d["index"] for d in pool["data"]] == [0, 1, 2] and pool["usage"]["prompt_tokens"] == sum(tokens)
    for i, vector in enumerate(want):
        assert np.abs(np.asarray(pool["data"][i]["data"]) - vector).max() < 1e-6, i
    r = httpx.post(server.http + "/pooling", json={"input": "x", "task": "classify"}, timeout=60)
    assert r.status_code == 400 and "has no classifier head" in r.text, r.text
    short = oai.embeddings.create(model=model_name, input=inputs[0], dimensions=8, encoding_format="float")
    cut = want[0][:8] / np.linalg.norm(want[0][:8])
    assert np.abs(np.asarray(short.data[0].embedding) - cut).max() < 1e-6
    _pool_whole(server)


def test_score_and_rerank_are_the_cosines_of_the_embeddings(server, model_name, tiny_model, config_path):
    """vLLM's /score (one text against many, and pair by pair) and the rerank API (/rerank, /v1/rerank, /v2/rerank;
    documents as strings or Jina's {text} objects): each score the cosine of the offline engine's embeddings, rerank's
    results best first, cut to top_n; refusals name the field."""
    cfg, params, tok, eos = tiny_model
    offline = LLM.from_params(cfg, params, tok, config=load_config(config_path), eos_ids=eos)
    query, docs = "where do cats sleep", ["Cats sleep on mats.", "Stock prices fell.", "A dog sleeps outside.", "zz"]
    vectors = offline.embed([query, *docs])
    unit = [v / np.linalg.norm(v) for v in vectors]
    want = [float(unit[0] @ u) for u in unit[1:]]
    one = httpx.post(server.http + "/score", json={"model": model_name, "text_1": query, "text_2": docs}, timeout=60)
    assert np.allclose([d["score"] for d in one.json()["data"]], want, atol=1e-5), one.text
    with Client(server.target) as c:
        over_grpc = c.score(query, docs)
        assert np.allclose(over_grpc.scores, want, atol=1e-5) and over_grpc.prompt_tokens == one.json()["usage"][
            "prompt_tokens"]
        for text_1, text_2, message in [(["a", "b"], ["c", "d", "e"], "text_1: 2 texts against text_2's 3"),
                                        ([], ["c"], "text_1: at least one text is required"),
                                        ("a", [""], "text_2: the prompt must not be empty")]:
            with pytest.raises(grpc.RpcError) as e:
                c.score(text_1, text_2)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details(), e.value.details()
    pairwise = httpx.post(server.http + "/v1/score", json={"text_1": docs[:2], "text_2": docs[2:]}, timeout=60).json()
    assert np.allclose([d["score"] for d in pairwise["data"]], [float(unit[1] @ unit[3]), float(unit[2] @ unit[4])],
                       atol=1e-5)
    order = sorted(range(4), key=lambda k: -want[k])
    for path, documents in (("/rerank", docs), ("/v1/rerank", [{"text": d} for d in docs]), ("/v2/rerank", docs)):
        r = httpx.post(server.http + path, json={"model": model_name, "query": query, "documents": documents,
                                                  "top_n": 3}, timeout=60).json()
        assert [x["index"] for x in r["results"]] == order[:3], (path, r)
        assert [x["document"]["text"] for x in r["results"]] == [docs[k] for k in order[:3]]
        assert np.allclose([x["relevance_score"] for x in r["results"]], [want[k] for k in order[:3]], atol=1e-5)
    for path, body, message in [
            ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1: 2 texts against text_2's 3"),
            ("/score", {"text_1": "a", "text_2": []}, "text_2: must be a string or a non-empty list of strings"),
            ("/rerank", {"query": "a", "documents": []}, "documents: must be a non-empty list"),
            ("/rerank", {"query": "a", "documents": ["b", 3]}, "documents[1]: must be a string"),
            ("/rerank", {"query": "", "documents": ["b"]}, "query: the prompt must not be empty"),
            ("/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, "top_n: must be >= 1"),
            ("/rerank", {"query": "a", "documents": ["b"], "stream": True}, "stream: not a field"),
            ("/classify", {"input": "a"}, "model: has no classifier head")]:
        r = httpx.post(server.http + path, json=body, timeout=60)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (path, r.text)
    _pool_whole(server)


@pytest.mark.parametrize("body, message", [
    ({"input": []}, "input: must be a string"),
    ({"input": ""}, "input: the prompt must not be empty"),
    ({"input": [[1, 2], 3]}, "input: must be a string"),
    ({"input": [[5, 6, 1 << 30]]}, "input: token id 1073741824 is outside the vocabulary"),
    ({"input": "x", "dimensions": 0}, "dimensions: must be an integer between 1 and"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format: must be one of float, base64"),
    ({"input": "x", "temperature": 0.5}, "temperature: not a field this endpoint takes"),
    ({"input": ["x"] * 2049}, "input: 2049 inputs; the limit is 2048"),
    ({"input": "x", "model": "other"}, "model: 'other' is not served here")])
def test_embeddings_refusals_name_the_field(server, model_name, body, message):
    r = httpx.post(server.http + "/v1/embeddings", json={"model": model_name, **body}, timeout=60)
    assert r.status_code in (400, 404) and message in r.json()["error"]["message"], r.text


def test_grpc_embed_refusals_name_the_field(server):
    from serve.proto import jaxcb_pb2

    with Client(server.target) as c:
        for inputs, fields, message in [([], {}, "inputs: must not be empty"),
                                        (["x"], {"dimensions": 100000}, "dimensions: must be an integer between"),
                                        ([[5, 1 << 30]], {}, "inputs: token id 1073741824 is outside the vocabulary"),
                                        (["x"], {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens: must be")]:
            with pytest.raises(grpc.RpcError) as e:
                c.embed(inputs, **fields)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details(), e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.stub.Embed(jaxcb_pb2.EmbedRequest(inputs=[jaxcb_pb2.EmbedInput()]))
        assert "inputs[0]: one of text or tokens is required" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.classify(["x"])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model: has no classifier head" in e.value.details()
        assert not c.model_info().classifier_labels
    _pool_whole(server)


def test_chat_streaming_with_usage(oai, model_name):
    messages = [{"role": "user", "content": "Hello there"}]
    full = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    chunks = list(oai.chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True,
                                                                           "include_obfuscation": False},
                                              extra_body={"ignore_eos": True}))  # (OpenAI's hint: taken)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and full.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # vLLM's continuous_usage_stats: every chunk's usage, the tokens so far
    counted = list(oai.chat.completions.create(
        model=model_name, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    assert all(c.usage is not None and c.usage.prompt_tokens == full.usage.prompt_tokens for c in counted)
    so_far = [c.usage.completion_tokens for c in counted if c.choices]
    assert so_far[0] == 0 and so_far == sorted(so_far) and so_far[-1] == counted[-1].usage.completion_tokens == 10
    assert "".join(c.choices[0].delta.content or "" for c in counted if c.choices) == text


def test_chat_template_kwargs_over_both_apis(server, oai, model_name):
    """chat_template_kwargs (vLLM's; gRPC's ChatInput.template_kwargs as JSON): the tiny model's template
    uses none, so the tokens are those without; bad ones are refused naming the field, on both APIs and
    on /tokenize."""
    messages = [{"role": "user", "content": "Hello there"}]
    args = dict(model=model_name, messages=messages, max_tokens=6, temperature=0)
    plain = oai.chat.completions.create(**args, extra_body={"ignore_eos": True})
    given = oai.chat.completions.create(**args, extra_body={"ignore_eos": True,
                                                             "chat_template_kwargs": {"enable_thinking": False}})
    assert given.choices[0].message.content == plain.choices[0].message.content
    assert given.usage.prompt_tokens == plain.usage.prompt_tokens
    with Client(server.target) as c:
        got = c.complete(messages=messages, max_tokens=6, ignore_eos=True, chat_template_kwargs={"enable_thinking": False})
        assert got.text == plain.choices[0].message.content
        for text, message in (("{", "chat.template_kwargs: not valid JSON"),
                              ('{"eos_token": "x"}', "chat.template_kwargs.eos_token: set by jaxcb")):
            req = build_request(messages=messages, max_tokens=2)
            req.chat.template_kwargs = text
            with pytest.raises(grpc.RpcError) as e:
                list(c.stream(req))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(message)
    for path, body in (("/v1/chat/completions", {"messages": messages, "chat_template_kwargs": "yes"}),
                       ("/tokenize", {"messages": messages, "chat_template_kwargs": {"bos_token": 1}})):
        r = httpx.post(server.http + path, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("chat_template_kwargs"), r.text[:300]


def test_continue_final_message_over_both_apis_as_offline(server, oai, model_name, tiny_model, config_path):
    """continue_final_message with add_generation_prompt false (vLLM's; gRPC's ChatInput fields): the
    prompt ends inside the assistant's message (/tokenize gives the same ids) and the model goes on
    writing it, the tokens the offline engine gives on those ids; bad combinations named."""
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "The answer is"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(server.http + "/tokenize", json={"messages": messages, **flags}, timeout=10).json()["tokens"]
    cfg, params, tok, eos = tiny_model
    assert ids == tok.encode_chat(messages, False, None, True) != tok.encode_chat(messages, False)
    offline = LLM.from_params(cfg, params, tok, config=load_config(config_path), eos_ids=eos)
    expected = offline.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True))[0].text
    http = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True, **flags})
    assert http.choices[0].message.content == expected and http.usage.prompt_tokens == len(ids)
    with Client(server.target) as c:
        assert c.complete(messages=messages, max_tokens=6, ignore_eos=True, continue_final_message=True).text == expected
    for body, message in (({"continue_final_message": True}, "continue_final_message: not with add_generation_prompt"),
                          ({**flags, "messages": messages[:1]}, "continue_final_message: the last message must be")):
        r = httpx.post(server.http + "/v1/chat/completions", json={"messages": messages, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text[:300]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_over_both_apis(server, oai, model_name, tiny_model,
                                                                             config_path):
    """vLLM's truncate_prompt_tokens: a prompt longer than the context is cut from the left to its last N
    tokens (-1: as many as fit with one to generate) and answered as those tokens are offline; a token
    prompt that long is refused without it; bad values named."""
    cfg, params, tok, eos = tiny_model
    offline = LLM.from_params(cfg, params, tok, config=load_config(config_path), eos_ids=eos)
    prompt = [5 + i % 200 for i in range(300)]  # past the context of 256
    expected = offline.generate([prompt[-8:]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    http = oai.completions.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True, "truncate_prompt_tokens": 8})
    assert http.choices[0].text == expected.text and http.usage.prompt_tokens == 8
    with Client(server.target) as c:
        assert c.complete(token_ids=prompt, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=8).text == expected.text
        whole = c.complete(token_ids=prompt, max_tokens=1, ignore_eos=True, truncate_prompt_tokens=-1)
        assert whole.prompt_tokens == 255
    most = oai.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"ignore_eos": True, "truncate_prompt_tokens": -1})
    assert most.usage.prompt_tokens == 255
    chat = oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=2, temperature=0, extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    # truncation_side "right" (vLLM's): the first N tokens kept instead; "left" is the default's
    first = offline.generate([prompt[:8]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    for side, want in (("right", first), ("left", expected)):
        http = oai.completions.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0, extra_body={
            "ignore_eos": True, "truncate_prompt_tokens": 8, "truncation_side": side, "echo": True})
        assert http.choices[0].text == tok.decode(prompt[:8] if side == "right" else prompt[-8:],
                                                  skip_special=False) + want.text, side
        with Client(server.target) as c:
            assert c.complete(token_ids=prompt, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=8,
                              truncation_side=side).text == want.text
    embedded = httpx.post(server.http + "/v1/embeddings", json={"input": [prompt[:20]], "truncate_prompt_tokens": 5,
                                                               "truncation_side": "right"}, timeout=60).json()
    assert embedded["usage"]["prompt_tokens"] == 5
    assert embedded["data"][0]["embedding"] == httpx.post(server.http + "/v1/embeddings", json={
        "input": [prompt[:5]]}, timeout=60).json()["data"][0]["embedding"]
    for body, message in (({}, "prompt: 300 tokens; the limit is 255"),
                          ({"truncate_prompt_tokens": 8, "truncation_side": "middle"},
                           'truncation_side: must be "left" or "right"'),
                          ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens: must be -1 or between 1 and 255"),
                          ({"truncate_prompt_tokens": 256}, "truncate_prompt_tokens: must be -1 or between 1 and 255"),
                          ({"truncate_prompt_tokens": "8"}, "truncate_prompt_tokens: must be -1 or between 1")):
        r = httpx.post(server.http + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), (body, r.text[:300])


def test_openai_service_fields_are_taken_and_change_nothing(server, oai, model_name):
    """store, metadata, service_tier, prompt_cache_key, safety_identifier (OpenAI's, about its own service):
    the answer is the one without them; a wrong type is named; other unknown fields stay refused."""
    args = dict(model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0)
    plain = oai.chat.completions.create(**args)
    given = oai.chat.completions.create(**args, store=False, metadata={"team": "a"}, service_tier="auto",
                                        extra_body={"prompt_cache_key": "k", "safety_identifier": "u1"})
    assert given.choices[0].message.content == plain.choices[0].message.content
    for body, message in (({"store": "no"}, "store: must be true or false"),
                          ({"metadata": [1]}, "metadata: must be an object"),
                          ({"metadata": {"a": 1}}, "metadata: 'a': keys of at most 64 characters, string values"),
                          ({"colour": {}}, "colour: not a field this endpoint takes")):
        r = httpx.post(server.http + "/v1/chat/completions", json={"messages": args["messages"], **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text[:300]


def test_echo_starts_each_choice_with_its_prompt(server, oai, model_name, tiny_model):
    """`echo: true` (completions): each choice's text is its prompt's (token ids decoded, a special token's text
    too, as the echoed logprobs' tokens and vLLM show it) and then the completion, whole and streamed (the prompt
    leading each choice's first chunk), the same completion as without echo."""
    _, _, tok, _ = tiny_model
    prompts = ["Hello there", [tok.bos_id, 5, 6, 7]]
    args = dict(model=model_name, prompt=prompts, max_tokens=5, n=2, temperature=0, extra_body={"ignore_eos": True})
    plain = oai.completions.create(**args)
    echoed = oai.completions.create(echo=True, **args)
    heads = ["Hello there", tok.decode([tok.bos_id, 5, 6, 7], skip_special=False)]
    assert heads[1].startswith(tok.id_to_token(tok.bos_id))
    assert [c.text for c in echoed.choices] == [heads[k // 2] + plain.choices[k].text for k in range(4)]
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 20
    texts = [""] * 4
    for chunk in oai.completions.create(echo=True, stream=True, **args):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in echoed.choices]


def test_echo_with_logprobs_scores_the_prompt_as_the_offline_engine(server, oai, model_name, tiny_model, config_path):
    """lm-eval's loglikelihood call (token ids, echo, logprobs 1, max_tokens 1) and OpenAI's legacy
    scoring call (max_tokens 0): each prompt token's logprob given the tokens before it (the first None),
    then the completion's, as the offline engine's prompt_logprobs; vLLM's prompt_logprobs field over
    completions and chat, with each token's rank; the streamed logprobs are the whole answer's."""
    cfg, params, tok, eos = tiny_model
    offline = LLM.from_params(cfg, params, tok, config=load_config(config_path), eos_ids=eos)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    want = offline.generate([prompt], SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=2))[0]
    r = oai.completions.create(model=model_name, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:-1] == pytest.approx([e[0] for e in want.prompt_logprobs[1:]], abs=1e-5)
    assert lp.token_logprobs[-1] == pytest.approx(want.logprobs[0][0], abs=1e-5)
    assert lp.tokens == [tok.decode([t], skip_special=False) for t in prompt + want.token_ids]
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    for top, entry, token in zip(lp.top_logprobs[1:-1], want.prompt_logprobs[1:], lp.tokens[1:-1]):
        best, value = entry[2][0]  # the best alternative, and always the token itself (OpenAI's up to N + 1)
        assert top == {tok.decode([best], skip_special=False): pytest.approx(value, abs=1e-5),
                       token: pytest.approx(entry[0], abs=1e-5)}
    # logprobs 0: each token's own logprob and no alternative; unset: none
    zero = oai.completions.create(model=model_name, prompt=prompt, max_tokens=3, logprobs=0, echo=True,
                                  temperature=0, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert zero.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:-1] + zero.token_logprobs[-3:], abs=1e-5)
    assert all(top == {t: v} for top, t, v in zip(zero.top_logprobs[1:], zero.tokens[1:], zero.token_logprobs[1:]))
    assert oai.completions.create(model=model_name, prompt=prompt, max_tokens=2).choices[0].logprobs is None
    assert r.choices[0].text == tok.decode(prompt) + want.text
    # lm-eval's is_greedy: a continuation the model decodes greedily has each logprob equal to the best
    # of its top_logprobs, exactly (and a forced other token's is lower)
    cont = offline.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    batch = oai.completions.create(model=model_name, prompt=[prompt + cont, prompt + cont[::-1]], max_tokens=1,
                                   logprobs=1, echo=True, temperature=0)
    greedy, other = (sorted(batch.choices, key=lambda c: c.index)[k].logprobs for k in (0, 1))
    n = len(prompt)
    assert all(lp == max(top.values()) for lp, top in zip(greedy.token_logprobs[n:-1], greedy.top_logprobs[n:-1]))
    assert any(lp < max(top.values()) for lp, top in zip(other.token_logprobs[n:-1], other.top_logprobs[n:-1]))
    streamed = []
    for chunk in oai.completions.create(model=model_name, prompt=prompt, max_tokens=1, logprobs=1, echo=True,
                                        temperature=0, stream=True):
        for c in chunk.choices:
            streamed += (c.logprobs.token_logprobs if c.logprobs else [])
    assert streamed == lp.token_logprobs
    only = oai.completions.create(model=model_name, prompt=prompt, max_tokens=0, logprobs=0, echo=True,
                                  extra_body={"prompt_logprobs": 2})
    assert only.choices[0].text == tok.decode(prompt) and only.usage.completion_tokens == 0
    assert only.choices[0].finish_reason == "length"
    plp = only.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    for token, got, (value, rank, top) in zip(prompt[1:], plp[1:], want.prompt_logprobs[1:]):
        assert got[str(token)]["logprob"] == pytest.approx(value, abs=1e-5) and got[str(token)]["rank"] == rank
        assert {int(k) for k in got} == {token} | {t for t, _ in top}
        assert got[str(top[0][0])]["rank"] == 1
    chat = httpx.post(server.http + "/v1/chat/completions", timeout=30, json={
        "model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0})
    chat_lp = chat.json()["prompt_logprobs"]  # vLLM's place: beside the choices
    assert chat.status_code == 200 and chat_lp[0] is None and all(len(d) == 1 for d in chat_lp[1:])
    with Client(server.target) as c:  # gRPC: GenerateRequest.prompt_logprobs, in the first chunk
        scored = c.complete(token_ids=prompt, max_tokens=0, prompt_logprobs=2)
        assert scored.token_ids == [] and scored.finish_reason == "length"
        assert [(t, rank, [i for i, _ in top]) for t, _, rank, top in scored.prompt_logprobs] == [
            (t, rank, [i for i, _ in top]) for t, (_, rank, top) in zip(prompt[1:], want.prompt_logprobs[1:])]
        assert [lp for _, lp, _, _ in scored.prompt_logprobs] == pytest.approx(
            [e[0] for e in want.prompt_logprobs[1:]], abs=1e-5)
        with pytest.raises(grpc.RpcError) as e:
            c.complete(token_ids=prompt, max_tokens=0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens: must be >= 1" in e.value.details()
    r = httpx.post(server.http + "/v1/completions", json={"prompt": "hi", "max_tokens": 0}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens: must be >= 1")
    r = httpx.post(server.http + "/v1/completions", json={"prompt": "hi", "prompt_logprobs": 21}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt_logprobs: must be <= 20")


def test_logprobs_bytes_are_each_tokens_own(oai, model_name):
    """logprobs' `bytes`: a token that is a piece of a multi-byte character carries that piece (it carried
    U+FFFD's three bytes), so that a client joining the bytes gets the text: chosen tokens and alternatives."""
    lead = 3 + 0xF0  # the tiny vocabulary's token of the byte 0xF0 (tests/tiny_gguf.py: 3 specials, then bytes)
    chat = oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=5, logit_bias={str(lead): 100},
                                       extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert [t.bytes for t in content] == [[0xF0]] * 3
    for t in content:
        assert len(t.top_logprobs) == 5
        for alt in t.top_logprobs:
            assert bytes(alt.bytes).decode("utf-8", "replace") == alt.token
    for seed in range(3):  # free runs: the joined bytes are the text
        out = oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                          temperature=1.5, seed=seed, logprobs=True, extra_body={"ignore_eos": True})
        joined = b"".join(bytes(t.bytes) for t in out.choices[0].logprobs.content)
        assert joined.decode("utf-8", "replace") == out.choices[0].message.content


def test_n_logprobs_and_stop(oai, model_name):
    out = oai.completions.create(model=model_name, prompt=[[5, 6], [7, 8, 9]], max_tokens=6, n=2, temperature=1.0,
                                 seed=3, logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        # top_logprobs is keyed by token text (as OpenAI has it): byte tokens that decode alike share a key;
        # the 2 best and the sampled token itself (sampled at temperature 1, maybe not among them)
        assert len(c.logprobs.tokens) == 6 and all(1 <= len(t) <= 3 for t in c.logprobs.top_logprobs)
        assert all(t in top for t, top in zip(c.logprobs.tokens, c.logprobs.top_logprobs))
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    chat = oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert len(chat.choices[0].logprobs.content) == 4 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
    free = oai.completions.create(model=model_name, prompt=[5, 6, 7], max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = free[3:5]
    cut = oai.completions.create(model=model_name, prompt=[5, 6, 7], max_tokens=20, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free[:free.index(stop)]


def test_errors_have_the_openai_shape(server, oai, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model_name, prompt=[5], max_tokens=4, temperature=-1)
    assert e.value.body["param"] == "temperature" and "temperature: must be >= 0" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model_name, prompt=[5] * 300, max_tokens=4)
    assert "prompt: 300 tokens; the limit is 255" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    r = httpx.post(server.http + "/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("body: not valid JSON")


def test_sse_framing_disconnect_health_and_metrics(server):
    with httpx.stream("POST", server.http + "/v1/completions", timeout=60,
                      json={"prompt": [5, 6], "max_tokens": 5, "stream": True, "ignore_eos": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert all(json.loads(line[6:])["object"] == "text_completion" for line in lines[:-1])
    # A client that hangs up mid-stream: its request is aborted and its pages freed.
    with httpx.stream("POST", server.http + "/v1/completions", timeout=60,
                      json={"prompt": [5, 6], "max_tokens": 240, "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    info = _pool_whole(server)
    assert info.pages_free == info.pages_total and info.running == 0
    assert httpx.get(server.http + "/health", timeout=10).status_code == 200
    assert "jaxcb:generation_tokens_total" in httpx.get(server.http + "/metrics", timeout=10).text


def test_http_auth_and_a_full_queue(tiny_gguf_path, config_path):
    """Also: the names of --served-model-name, and the auth of every API path but /health and /version."""
    http = free_port()
    s = ServerProcess(tiny_gguf_path, config_path, "--http-port", str(http), "--auth-token", "s3cret",
                      "--max-waiting", "0", "--served-model-name", "acme/tiny", "tiny-alias")
    try:
        s.wait_serving(metadata=(("authorization", "Bearer s3cret"),))
        base = f"http://127.0.0.1:{http}"
        assert httpx.get(base + "/health", timeout=10).status_code == 200  # no token needed
        assert httpx.get(base + "/version", timeout=10).json() == {"version": jaxcb.__version__}
        for path, body in (("/v1/completions", {"prompt": [5], "max_tokens": 2}), ("/tokenize", {"prompt": "hi"}),
                           ("/detokenize", {"tokens": [5]}), ("/invocations", {"prompt": [5], "model": "x"}),
                           ("/invocations", {"colour": "red"})):
            r = httpx.post(base + path, json=body, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        for path in ("/v1/models", "/load", "/server_info"):
            assert httpx.get(base + path, timeout=10).status_code == 401, path
        assert httpx.get(base + "/ping", timeout=10).status_code == 200
        client = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["acme/tiny", "tiny-alias"]  # the token lets it in
        r = httpx.post(base + "/tokenize", json={"prompt": "hi", "model": "tiny-alias"}, timeout=10,
                       headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0
        with pytest.raises(openai.NotFoundError) as e:  # the GGUF's own name is not one it is served as
            client.completions.create(model="tiny-random", prompt=[5], max_tokens=2)
        assert "'acme/tiny', 'tiny-alias'" in e.value.body["message"] and e.value.body["param"] == "model"
        with pytest.raises(openai.RateLimitError) as e:  # --max-waiting 0: the queue is always full
            client.completions.create(model="tiny-alias", prompt=[5], max_tokens=2)
        assert e.value.status_code == 429 and "queue full" in e.value.body["message"]
        with Client(s.target, token="s3cret") as c:
            info = c.model_info()
            assert info.name == "acme/tiny" and list(info.served_model_names) == ["acme/tiny", "tiny-alias"]
    finally:
        assert s.stop() == 0, s.output()


def test_served_name_model_list_and_unknown_models(server, oai, model_name, tiny_gguf_path):
    """The default served name is the checkpoint's file name; /v1/models carries what vLLM's clients
    read; an unknown name is a 404 naming the names served, on both APIs."""
    assert model_name == os.path.basename(tiny_gguf_path)[:-len(".gguf")] == "tiny"
    entry = httpx.get(server.http + "/v1/models", timeout=10).json()["data"][0]
    assert entry["id"] == entry["root"] == "tiny" and entry["parent"] is None and entry["owned_by"] == "jaxcb"
    assert entry["object"] == "model" and entry["max_model_len"] == 256 and entry["created"] > 0
    answer = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.model == "tiny"
    assert oai.models.retrieve("tiny").model_dump(exclude_unset=True) == entry  # OpenAI's retrieve-model call
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("org/other-model")
    assert e.value.body["code"] == "model_not_found" and "served as 'tiny'" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "served as 'tiny'" in e.value.body["message"]
    r = httpx.post(server.http + "/tokenize", json={"model": "nope", "prompt": "x"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with Client(server.target) as c:
        named = c.complete(token_ids=[5, 6], max_tokens=3, ignore_eos=True, temperature=0, model="tiny")
        assert named.token_ids == c.complete(token_ids=[5, 6], max_tokens=3, ignore_eos=True, temperature=0).token_ids
        with pytest.raises(grpc.RpcError) as e:
            c.complete(token_ids=[5, 6], max_tokens=3, model="gpt-4")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "served as 'tiny'" in e.value.details()


def test_tokenize_and_detokenize_take_vllms_shapes(server, tiny_model):
    _, _, tok, _ = tiny_model
    text = "Hello there, world"
    r = httpx.post(server.http + "/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=10).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert r["token_strs"] == [tok.id_to_token(t) for t in r["tokens"]]
    plain = httpx.post(server.http + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=10).json()
    assert plain["tokens"] == tok.encode(text, add_bos=False) and plain["token_strs"] is None
    messages = [{"role": "user", "content": "Hi <|im_start|>system"}]
    chat = httpx.post(server.http + "/tokenize", json={"messages": messages}, timeout=10).json()
    assert chat["tokens"] == tok.encode_chat(messages)  # the template, and no forged special token
    bare = httpx.post(server.http + "/tokenize", json={"messages": messages, "add_generation_prompt": False},
                      timeout=10).json()
    assert bare["tokens"] == tok.encode_chat(messages, add_generation_prompt=False) != chat["tokens"]
    back = httpx.post(server.http + "/detokenize", json={"tokens": r["tokens"]}, timeout=10).json()
    assert back == {"prompt": tok.decode(r["tokens"], skip_special=False)}
    assert text in back["prompt"]
    cases = [("/tokenize", {"prompt": "x", "messages": messages}, "prompt: give either prompt or messages"),
             ("/tokenize", {}, "prompt: give either"),
             ("/tokenize", {"prompt": 5}, "prompt: must be a string"),
             ("/tokenize", {"prompt": "x" * ((1 << 20) + 1)}, "prompt: 1048577 characters; the limit is 1048576"),
             ("/tokenize", {"messages": "hi"}, "messages: must be a list"),
             ("/tokenize", {"prompt": "x", "spice": 1}, "spice"),
             ("/detokenize", {"tokens": [1, "a"]}, "tokens: must be a list of token ids"),
             ("/detokenize", {"tokens": [10 ** 9]}, "tokens: 1000000000 is not a token id"),
             ("/detokenize", {"tokens": [-1]}, "tokens: -1 is not a token id"),
             ("/detokenize", {"tokens": [5] * 300}, "tokens: 300 tokens; the limit is 256")]
    for path, body, message in cases:
        r = httpx.post(server.http + path, json=body, timeout=30)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (path, body, r.text[:300])
    r = httpx.post(server.http + "/tokenize", content=b"x" * (17 << 20), timeout=30)
    assert r.status_code == 413


def test_content_parts_are_their_text_joined_and_other_parts_are_refused(server, oai, model_name):
    """OpenAI's list of content parts (what newer clients send even for plain text): the text parts
    joined by newlines, as vLLM does, on /tokenize and in a chat; an image part or a malformed one is a
    400 naming the part."""
    joined = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    tokens = [httpx.post(server.http + "/tokenize", json={"messages": m}, timeout=10).json()["tokens"]
              for m in (joined, parts)]
    assert tokens[0] == tokens[1]
    answers = [oai.chat.completions.create(model=model_name, messages=m, max_tokens=6, temperature=0)
               for m in (joined, parts)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens == len(tokens[0])
    cases = [([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
              "messages[0].content[0].type: 'image_url' is not supported"),
             ([{"type": "text", "text": 5}], "messages[0].content[0].text: must be a string"),
             (["hi"], "messages[0].content[0]: must be a content part"),
             ({"type": "text", "text": "hi"}, "messages[0].content: must be a string or a list of content parts")]
    for content, message in cases:
        for path in ("/tokenize", "/v1/chat/completions"):
            r = httpx.post(server.http + path, json={"messages": [{"role": "user", "content": content}]}, timeout=10)
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), (path, r.text[:300])


def test_a_developer_message_is_a_system_message(server, oai, model_name, tiny_model):
    """OpenAI's "developer" role (its newer name for the application's instructions) renders as the
    system message chat templates know, alone and with tools (whose text joins it); gRPC's chat and the
    Python tokenizer read it the same way; a role no API knows is a 400 naming the roles."""
    _, _, tok, _ = tiny_model
    chat = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    tokens = [httpx.post(server.http + "/tokenize", json={"messages": m}, timeout=10).json()["tokens"]
              for m in (chat, system)]
    assert tokens[0] == tokens[1] == tok.encode_chat(chat) == tok.encode_chat(system)
    answers = [oai.chat.completions.create(model=model_name, messages=m, max_tokens=4, temperature=0)
               for m in (chat, system)]
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens == len(tokens[0])
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    tools = tool_calls.parse_tools({"tools": [{"type": "function", "function": {"name": "f"}}]})
    rendered = [tool_calls.render_messages(m, tools) for m in (chat, system)]
    assert rendered[0] == rendered[1] and [m["role"] for m in rendered[0]] == ["system", "user"]
    assert rendered[0][0]["content"].startswith("Be brief.\n\n")  # the tools' text joins it
    r = httpx.post(server.http + "/v1/chat/completions",
                   json={"messages": [{"role": "robot", "content": "hi"}], "max_tokens": 2}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("messages[0].role: 'robot' is not one of system, developer, user, "
                                            "assistant, tool")


def test_malformed_bodies_are_400_naming_the_problem(server):
    """Every malformed body is a 400 (never a 500), and a field out of range is refused before a
    streaming 200 begins."""
    url = server.http + "/v1/completions"
    cases = [
        (b"[" * 100000 + b"]" * 100000, "body: JSON nested too deeply"),
        (b'{"prompt": [5], "max_tokens": ' + b"9" * 5000 + b"}", "body: not valid JSON"),
        (b'{"prompt": [5], "temperature": 1' + b"0" * 400 + b"}", "temperature: must be a finite number"),
        (b'{"prompt": [5], "logit_bias": {"5": 1' + b"0" * 400 + b"}}", "logit_bias[5]: must be a finite number"),
        (b"\xff\xfe garbage", "body: not valid JSON"),
        (json.dumps({"prompt": [5], "best_of": "x"}).encode(), "best_of: must be an integer"),
        (json.dumps({"prompt": [5], "stream": True, "priority": 2**40}).encode(), "priority: must be an integer"),
        (json.dumps({"prompt": [5], "stream": True, "stream_options": "x"}).encode(), "stream_options: must be an object"),
        (json.dumps({"prompt": [5], "stream": "yes"}).encode(), "stream: must be true or false"),
        (json.dumps({"prompt": [5], "echo": "x"}).encode(), "echo: must be true or false"),
        (json.dumps({"prompt": ["a" * 600000, "b" * 600000]}).encode(), "prompt: 1200000 characters in all"),
    ]
    for raw, message in cases:
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (message, r.status_code, r.text[:200])
        assert r.json()["error"]["message"].startswith(message), (message, r.json())
    chat = server.http + "/v1/chat/completions"
    r = httpx.post(chat, json={"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                               "top_logprobs": -1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("top_logprobs: must be between 0 and 20")
    big = b'{"prompt": "' + b"a" * (16 << 20) + b'"}'
    r = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "the limit is 16777216" in r.json()["error"]["message"]
    info = _pool_whole(server)
    assert info.running == 0 and info.pages_free == info.pages_total


def test_a_request_lives_as_long_as_its_client(server):
    """A stream refused after its fields are read starts nothing; a client that hangs up before the
    first byte of its stream, or while waiting for a whole answer, has its request aborted: the
    running count returns to zero and the pool is whole."""
    import socket

    def generated():
        text = httpx.get(server.http + "/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("jaxcb:generation_tokens_total"))

    _pool_whole(server)
    before = generated()
    host, port = server.http.removeprefix("http://").split(":")
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True, "stream": True, "n": 4}).encode()
    for _ in range(3):  # hang up right after sending: before the response's first byte
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    with pytest.raises(httpx.ReadTimeout):  # a whole answer the client stops waiting for
        httpx.post(server.http + "/v1/completions", timeout=httpx.Timeout(10.0, read=0.1),
                   json={"prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True, "n": 16})
    info = _pool_whole(server, timeout=20)
    assert info.running == 0 and info.waiting == 0 and info.pages_free == info.pages_total
    # Aborted, not run to the end: far fewer tokens than the 3 x 4 + 16 samples of 240 asked for.
    assert generated() - before < 0.25 * (3 * 4 + 16) * 240


def test_token_ids_outside_the_vocabulary_are_refused_before_echo_decodes_them(server):
    for prompt, field in (([-5], "prompt"), ([4294967296], "prompt"), ([[5], [7, 10**6]], "prompt[1]")):
        for echo in (True, False):
            r = httpx.post(server.http + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "echo": echo})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{field}: token id"), r.text


def test_counts_past_their_limits_name_their_own_field(server):
    r = httpx.post(server.http + "/v1/completions", json={"prompt": [5], "max_tokens": 2, "best_of": 100})
    assert r.status_code == 400 and r.json()["error"]["message"] == "best_of: must be <= 16, got 100"
    for limit in ("9" * 5000, "\u00b2", "0", "101"):  # (5,000 digits: past Python's int() limit; a superscript digit)
        r = httpx.get(server.http + "/v1/responses/resp_x/input_items", params={"limit": limit})
        assert r.status_code in (400, 404) and r.status_code != 500, r.text
        r = httpx.get(server.http + "/v1/batches", params={"limit": limit})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("limit: must be an integer"), r.text


def test_an_answer_of_too_many_logprobs_is_refused_before_any_work(server):
    """prompt_logprobs (or echo with logprobs) and logprobs over n samples of many long prompts would make a body of
    gigabytes: past MAX_ANSWER_LOGPROBS entries it is a 400 naming the field, at once, and nothing runs."""
    from serve.openai_answer import MAX_ANSWER_LOGPROBS

    prompts = [[5 + i % 50] * 200 for i in range(64)]
    cases = (({"prompt": prompts, "n": 16, "max_tokens": 1, "prompt_logprobs": 20}, "prompt_logprobs"),
             ({"prompt": prompts, "n": 16, "max_tokens": 1, "echo": True, "logprobs": 20}, "prompt_logprobs"),
             ({"prompt": [[5, 6]] * 64, "n": 16, "max_tokens": 50, "logprobs": 20}, "logprobs"))
    for body, field in cases:
        t0 = time.monotonic()
        r = httpx.post(server.http + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert f"the limit is {MAX_ANSWER_LOGPROBS:,}" in r.json()["error"]["message"] and time.monotonic() - t0 < 5
    r = httpx.post(server.http + "/v1/completions", json={"prompt": prompts[:2], "n": 2, "max_tokens": 1,
                                                           "prompt_logprobs": 5}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    _pool_whole(server)


def test_http_limits_count_samples(tiny_gguf_path, config_path):
    """--max-waiting counts samples (n), on gRPC and HTTP alike."""
    http = free_port()
    s = ServerProcess(tiny_gguf_path, config_path, "--http-port", str(http), "--max-waiting", "3",
                      "--grace-period", "0")
    try:
        s.wait_serving()
        base = f"http://127.0.0.1:{http}"
        # (more samples than the queue ever holds: a request that never fits, a 400, not a 429 clients send again)
        r = httpx.post(base + "/v1/completions", json={"prompt": [5], "max_tokens": 2, "n": 4}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "n: 4 samples (prompts x n) are more than the server ever queues; the limit is 3 (--max-waiting)")
        with Client(s.target) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.complete(token_ids=[5], max_tokens=2, n=4, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert len(c.complete_samples(token_ids=[5], max_tokens=2, n=3, timeout=30)) == 3
        r = httpx.post(base + "/v1/completions", json={"prompt": [5], "max_tokens": 2, "n": 3}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
    finally:
        assert s.stop() == 0, s.output()


def test_concurrent_api_calls_past_the_limit_are_429_until_one_ends():
    """The HTTP side of --max-concurrent-streams (serve.openai_api._ConcurrencyLimit), with calls that
    end only when the test lets them: two in progress fill a limit of 2, the third is a 429 before its
    body is read, /health is not counted, and once one ends the next is let in."""
    import asyncio

    from serve.openai_api import _ConcurrencyLimit

    async def scenario():
        release = asyncio.Event()

        async def app(scope, receive, send):
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        limited = _ConcurrencyLimit(app, limit=2)

        async def call(path):
            sent = []

            async def send(message):
                sent.append(message)

            async def receive():
                return {"type": "http.request", "body": b"{}", "more_body": False}

            await limited({"type": "http", "path": path, "method": "POST", "headers": []}, receive, send)
            return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

        first = [asyncio.ensure_future(call("/v1/completions")) for _ in range(2)]
        await asyncio.sleep(0.05)
        status, body = await call("/v1/completions")
        assert status == 429 and b"--max-concurrent-streams" in body
        health = asyncio.ensure_future(call("/health"))  # not an API call: not counted, not refused
        await asyncio.sleep(0.05)
        assert not health.done()
        release.set()
        assert [await f for f in first] == [(200, b"ok")] * 2 and (await health)[0] == 200
        assert limited.in_flight == 0
        assert (await call("/v1/completions"))[0] == 200

    asyncio.run(scenario())


def test_sigterm_ends_the_server_with_a_reader_that_stopped_reading(tiny_gguf_path, config_path):
    """A client opens a large stream and stops reading (a tiny receive buffer, never read): SIGTERM
    still ends the process, exit 0, within the grace period plus a few seconds."""
    import signal
    import socket

    http = free_port()
    s = ServerProcess(tiny_gguf_path, config_path, "--http-port", str(http), "--grace-period", "1")
    try:
        s.wait_serving()
        body = json.dumps({"prompt": [5, 6], "max_tokens": 240, "ignore_eos": True, "stream": True, "n": 16,
                           "logprobs": 5}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", http))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        sock.recv(64)  # the stream has begun; nothing more is read
        time.sleep(1.0)
        t = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        code = s.proc.wait(timeout=30)
        took = time.monotonic() - t
        sock.close()
        assert code == 0, s.output()
        assert took < 1 + 10, took
    finally:
        s.stop()


# ---- structured output and tool calls (jaxcb.host.structured, jaxcb/host/tool_calls.py) ----

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 10},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"], "additionalProperties": False}}}


def test_response_format_and_structured_outputs_hold_on_both_endpoints(server, oai, model_name):
    import re

    import jsonschema

    for seed in range(3):
        r = oai.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "a person"}], max_tokens=100, temperature=1.0,
            seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "json"}], max_tokens=100,
                                    response_format={"type": "json_object"})
    text = r.choices[0].message.content  # any object: random weights may write one key until the limit
    assert text.startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    r = oai.completions.create(model=model_name, prompt="date:", max_tokens=40, temperature=1.0, n=2,
                               extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}"}})
    assert all(re.fullmatch(r"[0-9]{4}-[0-9]{2}", c.text) for c in r.choices), r.choices
    stream = oai.completions.create(model=model_name, prompt="pick:", max_tokens=40, stream=True,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no", "später"]}})
    assert "".join(c.choices[0].text for c in stream) in ("yes", "no", "später")
    r = oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "sum"}], max_tokens=60,
                                    extra_body={"structured_outputs": {"grammar": 'start: NUM "+" NUM\nNUM: /[0-9]{1,3}/'}})
    assert re.fullmatch(r"[0-9]{1,3}\+[0-9]{1,3}", r.choices[0].message.content)
    # vLLM's older guided_* fields: the same constraints, the same tokens as structured_outputs
    for guided, current in (({"guided_regex": r"\d{4}-\d{2}"}, {"regex": r"\d{4}-\d{2}"}),
                            ({"guided_choice": ["yes", "no"], "guided_decoding_backend": "xgrammar"},
                             {"choice": ["yes", "no"]}),
                            ({"guided_json": json.dumps(PERSON)}, {"json": PERSON})):
        old, new = (oai.completions.create(model=model_name, prompt="x:", max_tokens=60, temperature=1.0, seed=3,
                                           extra_body=body).choices[0].text
                    for body in (guided, {"structured_outputs": current}))
        assert old == new, guided


@pytest.mark.parametrize("body, param, message", [
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "not a valid regex"),
    ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs.grammar", "not a valid grammar"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "is not one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format.json_schema.schema", "not a JSON schema that can be enforced"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "give exactly one of"),
    ({"guided_regex": "[a-"}, "guided_regex", "not a valid regex"),
    # a schema no output matches, refused before it runs (also one that fails only a few tokens in: a required
    # property that must hold itself, nothing can follow {"x":); one too large to enforce
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format.json_schema.schema", "no output matches it"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"x": {"$ref": "#/properties/x"}}, "required": ["x"]}}}, "max_tokens": 64},
     "response_format.json_schema.schema", "no output matches it"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}}}},
     "response_format.json_schema.schema", "too large to enforce while generating"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer"}}}]},
     "tools[0].function.parameters", "must be an object schema"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "give one of guided_json"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs", "not both structured_outputs"),
    ({"guided_choice": "yes"}, "guided_choice", "must be a non-empty list"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "only with guided_json"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "(a"}, "guided_whitespace_pattern",
     "not a valid regex"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "must be 1-64"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "is not one of the tools"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be a string"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
])
def test_a_bad_constraint_or_tool_is_a_400_naming_the_field(server, model_name, body, param, message):
    r = httpx.post(server.http + "/v1/chat/completions", timeout=30, json={
        "model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """A server with room for the tools' system text (the tiny model's tokenizer spends about a token a
    byte): the tiny model with a 2,048-token context."""
    from tests.tiny_gguf import tiny_model_config, write_tiny_gguf

    path = tmp_path_factory.mktemp("long") / "long.toml"
    model = str(path.parent / "tiny-long.gguf")
    write_tiny_gguf(model, tiny_model_config(max_context=2048))
    path.write_text("[cache]\npage_size = 16\nnum_pages = 256\n[scheduler]\nmax_context = 2048\n"
                    "max_prefill_tokens = 256\n[buckets]\ndecode_batch = [1, 4]\nprefill_tokens = [256]\n")
    yield from http_server(model, str(path), "--trust-request-chat-template", "--reasoning-parser", "qwen3")


def test_a_requests_chat_template_only_where_the_server_trusts_it(server, long_server, model_name):
    """vLLM's `chat_template` request field (gRPC's ChatInput.chat_template): refused naming the field by a
    server not started with --trust-request-chat-template; taken by one that is (chat, /tokenize and gRPC
    write the same ids), a template that does not compile refused naming it."""
    messages = [{"role": "user", "content": "Hello there"}]
    mine = "{% for m in messages %}## {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}>>{% endif %}"
    r = httpx.post(server.http + "/v1/chat/completions", timeout=30, json={
        "model": model_name, "messages": messages, "max_tokens": 2, "chat_template": mine})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text[:300]
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    own = httpx.post(long_server.http + "/tokenize", json={"messages": messages, "chat_template": mine}, timeout=30).json()
    model = httpx.post(long_server.http + "/tokenize", json={"messages": messages}, timeout=30).json()
    assert own["tokens"] != model["tokens"]
    name = httpx.get(long_server.http + "/v1/models", timeout=30).json()["data"][0]["id"]
    chat = httpx.post(long_server.http + "/v1/chat/completions", timeout=60, json={
        "model": name, "messages": messages, "max_tokens": 2, "chat_template": mine}).json()
    assert chat["usage"]["prompt_tokens"] == own["count"], chat
    r = httpx.post(long_server.http + "/v1/chat/completions", timeout=30, json={
        "model": name, "messages": messages, "max_tokens": 2, "chat_template": "{% for m in messages %}"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("chat_template: not a valid Jinja"), r.text
    r = httpx.post(long_server.http + "/tokenize", timeout=30, json={"messages": messages, "chat_template": "x" * 65537})
    assert r.status_code == 400 and "the limit is 65536" in r.json()["error"]["message"], r.text[:300]
    # gRPC's ChatInput.chat_template, the same way
    for target, trusted in ((server.target, False), (long_server.target, True)):
        with Client(target) as c:
            req = build_request(messages=messages, max_tokens=2, chat_template=mine)
            if trusted:
                assert c.complete(messages=messages, max_tokens=2, chat_template=mine).prompt_tokens == own["count"]
            else:
                with pytest.raises(grpc.RpcError) as e:
                    list(c.stream(req))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details().startswith("chat.chat_template: this server does not take")


def test_documents_reach_the_chat_template_as_vllm_passes_them(long_server):
    """vLLM's chat `documents` (retrieval-augmented templates, Command R's and Granite's): the template's
    `documents` variable, written where it puts them (chat and /tokenize alike); a document holding a special
    token's text is refused, as tools are; bad shapes named."""
    messages = [{"role": "user", "content": "Where?"}]
    mine = ("{% for d in documents or [] %}[{{ d['title'] }}: {{ d['text'] }}]{% endfor %}"
            "{% for m in messages %}## {{ m['content'] }}\n{% endfor %}>>")
    documents = [{"title": "Paris", "text": "The capital of France."}, {"title": "Lyon", "text": "A city."}]
    body = {"messages": messages, "chat_template": mine}
    plain = httpx.post(long_server.http + "/tokenize", json={**body, "return_token_strs": True}, timeout=30).json()
    given = httpx.post(long_server.http + "/tokenize", json={**body, "documents": documents, "return_token_strs": True},
                       timeout=30).json()
    text = "".join(given["token_strs"])
    assert "[Paris: The capital of France.][Lyon: A city.]## Where?" in text.replace("\u0120", " ")
    assert given["count"] > plain["count"]
    name = httpx.get(long_server.http + "/v1/models", timeout=30).json()["data"][0]["id"]
    chat = httpx.post(long_server.http + "/v1/chat/completions", timeout=60, json={
        "model": name, **body, "documents": documents, "max_tokens": 2}).json()
    assert chat["usage"]["prompt_tokens"] == given["count"], chat
    for documents, message in (("x", "documents: must be a list of objects of strings"),
                               ([{"title": 5}], "documents: must be a list of objects of strings"),
                               ([{"text": "a"}] * 1025, "documents: at most 1024, got 1025"),
                               ([{"text": "<|im_start|>system"}], "documents: holds the text of the special token")):
        r = httpx.post(long_server.http + "/v1/chat/completions", timeout=30, json={
            "model": name, **body, "documents": documents, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text[:300]


def test_required_tool_calls_parse_and_validate_streamed_and_not(long_server):
    import jsonschema

    oai = openai.OpenAI(base_url=long_server.http + "/v1", api_key="unused", max_retries=0)
    model_name = oai.models.list().data[0].id

    messages = [{"role": "user", "content": "weather in Paris and the time?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for seed in range(3):
        r = oai.chat.completions.create(model=model_name, messages=messages, tools=[WEATHER, CLOCK],
                                        tool_choice="required", max_tokens=200, temperature=1.0, seed=seed,
                                        parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        # The same request streamed: the deltas add up to calls that validate.
        stream = oai.chat.completions.create(model=model_name, messages=messages, tools=[WEATHER, CLOCK],
                                             tool_choice="required", max_tokens=200, temperature=1.0, seed=seed,
                                             parallel_tool_calls=False, stream=True)
        calls, finish = {}, None
        for chunk in stream:
            for delta in chunk.choices[0].delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
                if delta.function.name:
                    call["name"] = delta.function.name
                call["arguments"] += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and calls
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    # Parallel calls (the default): every block the answer holds is a valid call (random weights may go
    # on calling until max_tokens; a model that is done may end after any whole call).
    r = oai.chat.completions.create(model=model_name, messages=messages, tools=[WEATHER, CLOCK],
                                    tool_choice="required", max_tokens=120, temperature=1.0, seed=7)
    calls = r.choices[0].message.tool_calls
    assert calls and "<tool_call>" not in (r.choices[0].message.content or "")
    if r.choices[0].finish_reason == "length":  # the last call cut off by max_tokens: its arguments so far
        assert not calls[-1].function.arguments or calls[-1].function.arguments.startswith("{")
        calls = calls[:-1]
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # A named function: exactly that one.
    r = oai.chat.completions.create(model=model_name, messages=messages, tools=[WEATHER, CLOCK], max_tokens=200,
                                    tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
    # A conversation that carries the call and its result is accepted back.
    call = r.choices[0].message.tool_calls[0]
    follow = oai.chat.completions.create(model=model_name, max_tokens=5, tools=[WEATHER, CLOCK], messages=messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_calls_in_the_chat_templates_own_format(long_server):
    """A chat template that renders tools (here the request's own, on a server that trusts them): the
    prompt is the template's rendering of the tools (/tokenize counts the chat's prompt), tool_choice
    required holds the answer to the template's format, and the calls come back the same whole and
    streamed; an earlier call and its result are given back to the template as objects."""
    import jsonschema

    from tests.test_tool_calls import BLOCK_TEMPLATE, LIST_TEMPLATE, OBJECT_TEMPLATE, XML_TEMPLATE

    oai = openai.OpenAI(base_url=long_server.http + "/v1", api_key="unused", max_retries=0)
    model_name = oai.models.list().data[0].id
    messages = [{"role": "user", "content": "weather in Paris?"}]
    schema = WEATHER["function"]["parameters"]
    for template in (BLOCK_TEMPLATE, OBJECT_TEMPLATE, LIST_TEMPLATE, XML_TEMPLATE):
        extra = {"chat_template": template}
        tokenized = httpx.post(long_server.http + "/tokenize", timeout=30, json={
            "messages": messages, "tools": [WEATHER, CLOCK], "chat_template": template}).json()
        plain = httpx.post(long_server.http + "/tokenize", timeout=30, json={
            "messages": messages, "chat_template": template}).json()
        assert tokenized["count"] > plain["count"]  # the template wrote the tools
        tools = [WEATHER, CLOCK]  # (the city's maxLength ends a string element of the random model's too)
        r = oai.chat.completions.create(model=model_name, messages=messages, tools=tools, max_tokens=120,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        temperature=1.0, seed=3, extra_body=extra)
        assert r.usage.prompt_tokens == tokenized["count"]
        choice = r.choices[0]
        # (a named function's call ends as "stop", as OpenAI's and vLLM's do; required and auto: "tool_calls")
        assert choice.finish_reason == "stop" and not choice.message.content, choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schema)
        stream = oai.chat.completions.create(model=model_name, messages=messages, tools=tools,
                                             max_tokens=120, temperature=1.0, seed=3, extra_body=extra, stream=True,
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
        name, arguments, finish = None, "", None
        for chunk in stream:
            for delta in chunk.choices[0].delta.tool_calls or ():
                name = delta.function.name or name
                arguments += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert (name, json.loads(arguments)) == ("get_weather", json.loads(call.function.arguments))
        assert finish == "stop"
        # tool_choice none: the template still writes the tools (the model sees them: OpenAI's, vLLM's)
        none = httpx.post(long_server.http + "/tokenize", timeout=30, json={
            "messages": messages, "tools": tools, "tool_choice": "none", "chat_template": template}).json()
        assert none["count"] == tokenized["count"]
        follow = httpx.post(long_server.http + "/tokenize", timeout=30, json={
            "chat_template": template, "tools": [WEATHER, CLOCK], "messages": messages + [
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]}).json()
        text = httpx.post(long_server.http + "/detokenize", timeout=30, json={"tokens": follow["tokens"]}).json()
        written = json.loads(call.function.arguments)
        if template == XML_TEMPLATE:  # (the template writes each argument as an element)
            assert f"<parameter=city>\n{written['city']}\n</parameter>" in text["prompt"]
        else:
            assert json.dumps(written, ensure_ascii=False) in text["prompt"]
        assert "sunny" in text["prompt"]


def test_responses_api_function_calls_as_the_chat_api_makes_them(long_server):
    """Function tools on /v1/responses: the chat's calls as function_call output items (whole, and
    streamed as output_item / function_call_arguments events), and a conversation that carries a call and
    its output back as input items answered as the chat answers the same messages."""
    oai = openai.OpenAI(base_url=long_server.http + "/v1", api_key="unused", max_retries=0)
    model_name = oai.models.list().data[0].id
    tools = [{"type": "function", **WEATHER["function"]}, {"type": "function", **CLOCK["function"]}]
    messages = [{"role": "user", "content": "weather in Paris and the time?"}]
    chat = oai.chat.completions.create(model=model_name, messages=messages, tools=[WEATHER, CLOCK],
                                       tool_choice="required", max_tokens=200, temperature=1.0, seed=1,
                                       parallel_tool_calls=False)
    want = [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls]
    r = oai.responses.create(model=model_name, input="weather in Paris and the time?", tools=tools,
                             tool_choice="required", max_output_tokens=200, temperature=1.0, extra_body={"seed": 1},
                             parallel_tool_calls=False)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"] * len(want)
    assert [(o.name, o.arguments) for o in r.output] == want and all(o.call_id.startswith("call_") for o in r.output)
    events = list(oai.responses.create(model=model_name, input="weather in Paris and the time?", tools=tools,
                                       tool_choice="required", max_output_tokens=200, temperature=1.0, extra_body={"seed": 1},
                                       parallel_tool_calls=False, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(a.type, a.name) for a in added] == [("function_call", name) for name, _ in want]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(arguments for _, arguments in want)
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [a for _, a in want]
    assert events[-1].type == "response.completed" and [(o.name, o.arguments) for o in events[-1].response.output] == want
    # The call and its output back: the same answer as the chat's over the same conversation.
    call = r.output[0]
    follow_chat = oai.chat.completions.create(model=model_name, max_tokens=6, temperature=0, tools=[WEATHER, CLOCK],
                                              messages=messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}])
    follow = oai.responses.create(model=model_name, max_output_tokens=6, temperature=0, tools=tools, input=[
        {"role": "user", "content": "weather in Paris and the time?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    assert follow.usage.input_tokens == follow_chat.usage.prompt_tokens
    assert follow.output_text == (follow_chat.choices[0].message.content or "")
    # The same from the kept response: only the call's output is given
    assert len(r.output) == 1
    kept = oai.responses.create(model=model_name, max_output_tokens=6, temperature=0, tools=tools, previous_response_id=r.id,
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    assert (kept.output_text, kept.usage.input_tokens) == (follow.output_text, follow.usage.input_tokens)


def test_grpc_takes_the_same_constraints(server):
    import re

    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f"]}
    with Client(server.target) as c:  # vLLM's structural tags over each API, a bad one named by its field
        assert c.complete("say:", max_tokens=5, structured={"structural_tag": tag}).finish_reason in ("stop", "length")
        with pytest.raises(grpc.RpcError) as e:
            c.complete("x", max_tokens=4, structured={"structural_tag": {**tag, "triggers": ["<g"]}})
        assert "structured.structural_tag.structures[0].begin: '<f>' starts with none of the triggers" in e.value.details()
    for body in ({"response_format": {"type": "structural_tag", **tag}}, {"structured_outputs": {"structural_tag": tag}}):
        r = httpx.post(server.http + "/v1/completions", json={"prompt": "say:", "max_tokens": 5, **body}, timeout=60)
        assert r.status_code == 200, r.text
    r = httpx.post(server.http + "/v1/completions", timeout=60, json={"prompt": "x", "max_tokens": 4, "response_format": {
        "type": "structural_tag", **tag, "structures": [{**tag["structures"][0], "schema": {"type": "objec"}}]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.structures[0].schema", r.text
    with Client(server.target) as c:
        out = c.complete("date:", max_tokens=30, structured={"regex": r"\d{2}/\d{2}"})
        assert re.fullmatch(r"[0-9]{2}/[0-9]{2}", out.text), out.text
        out = c.complete("pick:", max_tokens=30, structured={"choice": ["alpha", "beta"]})
        assert out.text in ("alpha", "beta")
        with pytest.raises(grpc.RpcError) as e:
            c.complete("x", max_tokens=4, structured={"regex": "(a"})
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured.regex: not a valid regex" in e.value.details()


def test_bench_serve_measures_a_running_server_over_each_api(server, tmp_path, tiny_model):
    """`jaxcb bench serve` from the installed package: the random workload over the OpenAI API (the
    model name found in /v1/models), a JSONL dataset over gRPC; every requested token arrives."""
    import subprocess
    import sys

    vocab = tiny_model[0].vocab_size
    out = tmp_path / "openai.json"
    cmd = [sys.executable, "-m", "jaxcb", "bench", "serve", "--url", server.http, "--num-prompts", "5",
           "--request-rate", "inf", "--random-input-len", "8", "--random-output-len", "4", "--vocab-size", str(vocab),
           "--max-concurrency", "3", "--result-filename", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert "TTFT p50" in done.stdout and run["model"] == "tiny" and run["requests"] == 5
    from serve.benchmark import workload

    assert run["output_tokens"] == sum(workload(5, 0, vocab, 8, 4)[1])  # EOS ignored: every token came
    assert run["ttft_ms"]["p50"] > 0 and run["e2e_ms"]["p99"] >= run["ttft_ms"]["p99"]
    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ({"prompt_token_ids": [5, 6, 7], "max_tokens": 3},
                                                       {"prompt": "hello", "max_tokens": 5})))
    done = subprocess.run([sys.executable, "-m", "jaxcb", "bench", "serve", "--url", server.target, "--api", "grpc",
                           "--dataset", str(data), "--rates", "2,inf"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["rate"], r["requests"], r["output_tokens"]) for r in result["runs"]] == [(2.0, 2, 8), ("inf", 2, 8)]
    # a trace replayed at its own arrival times (stretched by --time-scale): blocks of one hash, the same tokens
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": 0.4 * i, "prompt_tokens": 6, "output_tokens": 2 + i,
                                         "hash_ids": [1, 10 + i], "block_tokens": 4}) + "\n" for i in range(3)))
    done = subprocess.run([sys.executable, "-m", "jaxcb", "bench", "serve", "--url", server.http, "--trace", str(trace),
                           "--time-scale", "2", "--vocab-size", str(vocab)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (run,) = json.loads(done.stdout.strip().splitlines()[-1])["runs"]
    assert (run["rate"], run["requests"], run["output_tokens"]) == ("trace", 3, 9) and run["wall_s"] >= 1.6
    # a public trace's 100k-token prompt is made only as long as the server's context (which refuses it anyway)
    from serve.benchmark import read_trace_workload, served_context

    trace.write_text(json.dumps({"arrival_s": 0, "prompt_tokens": 100_000, "output_tokens": 2}) + "\n")
    assert served_context("openai", server.http + "/v1") == served_context("grpc", server.target) == 256
    prompts, _, _ = read_trace_workload(str(trace), None, vocab, 0, 1.0, served_context("grpc", server.target))
    assert len(prompts[0]) == 256
    # ShareGPT's JSON as vLLM's benchmark samples it: first turn the prompt, the second's token count the output
    share = tmp_path / "sharegpt.json"
    words = "the cat sat on a mat and then it went home to sleep for a long while".split()
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": " ".join(words[:4 + i])},
                                              {"from": "gpt", "value": " ".join(words[i:i + 5])}]} for i in range(4)]
    convs += [{"id": "one turn", "conversations": [{"from": "human", "value": "alone in here"}]},
              {"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}]
    share.write_text(json.dumps(convs))
    done = subprocess.run([sys.executable, "-m", "jaxcb", "bench", "serve", "--url", server.http, "--dataset-name",
                           "sharegpt", "--dataset-path", str(share), "--num-prompts", "3", "--rates", "inf"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (run,) = json.loads(done.stdout.strip().splitlines()[-1])["runs"]
    from serve.benchmark import read_sharegpt, tokenize_counter

    count = tokenize_counter(server.http + "/v1", "tiny")
    prompts, outputs = read_sharegpt(str(share), 3, 0, count)
    assert run["requests"] == 3 and run["output_tokens"] == sum(outputs) and "hi" not in prompts
    assert all(count(p) >= 4 for p in prompts) and len(set(prompts)) == 3
    # a request the server refuses is counted apart with its reason, over each API; the others' figures stand
    data.write_text("\n".join(json.dumps(r) for r in ({"prompt_token_ids": [5, 6, 7], "max_tokens": 3},
                                                       {"prompt_token_ids": [5, 10**6], "max_tokens": 3})))
    for url, api in ((server.http, "openai"), (server.target, "grpc")):
        done = subprocess.run([sys.executable, "-m", "jaxcb", "bench", "serve", "--url", url, "--api", api,
                               "--dataset", str(data), "--rates", "inf"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        (run,) = json.loads(done.stdout.strip().splitlines()[-1])["runs"]
        assert (run["requests"], run["failed"], run["output_tokens"]) == (1, 1, 3), run
        assert "outside the vocabulary" in run["first_error"]
    for bad, message in ((["--rates", "0"], "--rates: '0' is not a rate"), (["--rates", "nan"], "is not a rate"),
                         (["--num-prompts", "0"], "--requests: must be at least 1"),
                         (["--max-concurrency", "-1"], "--concurrency: must be 0"),
                         (["--trace", str(trace), "--time-scale", "0"], "--time-scale: must be a number above 0"),
                         (["--trace", str(trace), "--dataset", str(data)], "--trace and --dataset: give one")):
        done = subprocess.run([sys.executable, "-m", "jaxcb", "bench", "serve", "--url", server.http, *bad],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and message in done.stderr, done.stderr


def test_responses_truncation_auto_drops_the_oldest_items_until_the_input_fits(server):
    """truncation "auto": a conversation past the context loses its oldest items (the instructions kept, a call's
    output with its call), as few as fit; "disabled" refuses it. Output items given back carry null fields and an
    output message's phase, a call's output may be input_text parts."""
    url = server.http + "/v1/responses"
    words = " ".join(f"w{i}" for i in range(30))
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {words}"} for i in range(12)]
    body = {"instructions": "Be brief.", "input": turns, "max_output_tokens": 8, "temperature": 0}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = httpx.post(url, json={**body, "truncation": "auto"}, timeout=60)
    assert r.status_code == 200, r.text
    used = r.json()["usage"]["input_tokens"]
    assert used + 8 <= 256 and r.json()["truncation"] == "auto"  # (the test server's context: 256)
    tokenize = server.http + "/tokenize"

    def count(items):
        return httpx.post(tokenize, json={"messages": [{"role": "system", "content": "Be brief."}, *items]},
                          timeout=60).json()["count"]
    fewest = next(k for k in range(1, 12) if count(turns[k:]) + 8 <= 256)
    assert used == count(turns[fewest:])  # as few dropped as fit
    huge = {**body, "truncation": "auto", "input": [{"role": "user", "content": "w " * 500_000}, *turns]}
    r = httpx.post(url, json=huge, timeout=60)  # (a megabyte dropped by its length, never encoded)
    assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == used, r.text
    counted = httpx.post(url + "/input_tokens", json={k: v for k, v in huge.items() if k in ("instructions", "input",
                         "truncation")}, timeout=60)  # (counted as the call is cut, room left for one token)
    assert counted.status_code == 200 and counted.json()["input_tokens"] == count(
        turns[next(k for k in range(1, 12) if count(turns[k:]) + 1 <= 256):]), counted.text
    items = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok",
              "annotations": [], "logprobs": None}], "phase": None, "status": "completed", "id": None},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "21C"}]}]
    r = httpx.post(url, json={"input": [{"role": "user", "content": "hi"}, *items], "max_output_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_responses_allowed_tools_restrict_the_call_to_those_listed(long_server):
    """tool_choice allowed_tools: only the tools it lists, as its mode says; one it lists that is not a tool: 400."""
    url = long_server.http + "/v1/responses"
    tools = [{"type": "function", **WEATHER["function"]}, {"type": "function", **CLOCK["function"]}]
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    for seed in range(3):
        r = httpx.post(url, timeout=60, json={"input": "weather?", "tools": tools, "tool_choice": allowed,
                                              "parallel_tool_calls": False, "max_output_tokens": 60, "seed": seed,
                                              "temperature": 1.0})
        assert r.status_code == 200, r.text
        assert [(o["type"], o["name"]) for o in r.json()["output"]] == [("function_call", "get_time")], r.text
    r = httpx.post(url, timeout=60, json={"input": "x", "tools": tools, "tool_choice": {
        **allowed, "tools": [{"type": "function", "name": "nope"}]}})
    assert r.status_code == 400 and "tool_choice.tools: 'nope' is not one of the tools" in r.text, r.text


def test_responses_api_answers_as_the_chat_api_does(oai, model_name):
    """POST /v1/responses (OpenAI's newer API) through the openai client: instructions and input items as
    chat messages, max_output_tokens as the limit, text.format as response_format; whole and streamed,
    each the chat answer's text and usage."""
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    chat = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True})
    r = oai.responses.create(model=model_name, instructions="be brief",
                             input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                                                 {"type": "input_text", "text": "there"}]}],
                             max_output_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model_name
    assert r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # cut at the limit
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 7)
    events = list(oai.responses.create(model=model_name, instructions="be brief", input="hi\nthere", max_output_tokens=7,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True}))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == r.output_text
    assert events[-1].response.usage.output_tokens == 7
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
    want = oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "x"}], max_tokens=12,
                                       temperature=0, response_format={"type": "json_schema",
                                                                       "json_schema": {"name": "s", "schema": schema}})
    got = oai.responses.create(model=model_name, input="x", max_output_tokens=12, temperature=0,
                               text={"format": {"type": "json_schema", "name": "s", "schema": schema}})
    assert got.output_text == want.choices[0].message.content


def test_responses_api_takes_what_sdks_send_and_gives_logprobs(oai, model_name):
    """The fields OpenAI's Agents SDK and others send (include, truncation, service fields, stream_options,
    nulls for what is unset) are taken; include message.output_text.logprobs with top_logprobs gives the
    output text's logprobs as the chat gives them, whole and streamed alike."""
    messages = [{"role": "user", "content": "hi"}]
    chat = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    extra = {"ignore_eos": True, "previous_response_id": None, "conversation": None, "prompt": None, "background": False,
             "service_tier": "auto", "safety_identifier": "u1", "prompt_cache_key": "k", "max_tool_calls": 3,
             "prompt_cache_options": {"mode": "implicit"}, "background_options": {},
             "context_management": [{"type": "compaction", "compact_threshold": 100000}]}
    r = oai.responses.create(model=model_name, input="hi", max_output_tokens=6, temperature=0, include=[
        "message.output_text.logprobs", "reasoning.encrypted_content"], top_logprobs=2, truncation="disabled",
        text={"verbosity": "low"}, extra_body=extra, tools=[])  # (an empty tools list: no tools, as the SDK sends it)
    [part] = r.output[0].content
    want = [(c.token, c.logprob, [t.token for t in c.top_logprobs]) for c in chat.choices[0].logprobs.content]
    assert r.output_text == chat.choices[0].message.content and len(want) == 6
    assert [(c.token, c.logprob, [t.token for t in c.top_logprobs]) for c in part.logprobs] == want
    events = list(oai.responses.create(model=model_name, input="hi", max_output_tokens=6, temperature=0, stream=True,
                                       include=["message.output_text.logprobs"], top_logprobs=2, extra_body=extra,
                                       stream_options={"include_obfuscation": False}))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    for got in (streamed, done.logprobs):
        assert [(c.token, c.logprob) for c in got] == [w[:2] for w in want]
    plain = oai.responses.create(model=model_name, input="hi", max_output_tokens=6, temperature=0, include=[],
                                 extra_body={"ignore_eos": True}, reasoning={"effort": "xhigh"})
    assert plain.output_text == r.output_text and not plain.output[0].content[0].logprobs
    added = next(e for e in events if e.type == "response.content_part.added")
    assert added.part.text == "" and not added.part.logprobs  # (the part as it begins)


def test_null_fields_are_not_given_and_openais_other_chat_fields(server):
    """A top-level null is a field not given (serializers send null for what is unset): the same answer as
    without it. OpenAI's chat fields beyond jaxcb's: hints checked and changing nothing, reasoning_effort
    handed to the chat template, what is not served (audio, web search, the deprecated functions) refused by
    name."""
    from serve.openai_fields import template_fields

    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    want = httpx.post(server.http + "/v1/chat/completions", json=base, timeout=30).json()["choices"][0]["message"]
    nulls = {k: None for k in ("parallel_tool_calls", "functions", "function_call", "audio", "tool_choice", "tools",
                               "response_format", "stop", "seed", "n", "logit_bias", "web_search_options", "user",
                               "metadata", "stream_options", "reasoning_effort", "prediction", "modalities")}
    hints = {"modalities": ["text"], "prediction": {"type": "content", "content": "hello"}, "verbosity": "low",
             "reasoning_effort": "low", "prompt_cache_retention": "24h"}
    for extra in (nulls, hints):
        r = httpx.post(server.http + "/v1/chat/completions", json={**base, **extra}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"] == want, r.text
    for extra, message in (({"functions": [{"name": "f"}]}, "functions: OpenAI's deprecated form of tools"),
                           ({"function_call": "auto"}, "function_call: OpenAI's deprecated form of tool_choice"),
                           ({"audio": {"voice": "x"}}, "audio: audio output is not served"),
                           ({"web_search_options": {}}, "web_search_options: built-in web search is not served"),
                           ({"modalities": ["text", "audio"]}, "modalities: only [\"text\"] is served"),
                           ({"verbosity": "loud"}, "verbosity: must be one of"),
                           ({"reasoning_effort": "max"}, "reasoning_effort: must be one of")):
        r = httpx.post(server.http + "/v1/chat/completions", json={**base, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text
    assert template_fields({"reasoning_effort": "high"}, False)[1] == {"reasoning_effort": "high"}
    assert template_fields({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}},
                           False)[1] == {"reasoning_effort": "low"}  # (the template's own kwargs win)


def test_whole_number_floats_are_integers(server):
    """An integer field written as a whole float (2.0: what Python clients send where they computed it) is that
    integer; a fraction is refused naming the field."""
    base = {"prompt": [5, 6], "temperature": 1.0, "ignore_eos": True}
    want = httpx.post(server.http + "/v1/completions", json={**base, "max_tokens": 3, "n": 2, "seed": 7, "logprobs": 1},
                      timeout=30).json()
    got = httpx.post(server.http + "/v1/completions", json={**base, "max_tokens": 3.0, "n": 2.0, "seed": 7.0,
                                                            "logprobs": 1.0}, timeout=30).json()
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]] and len(want["choices"]) == 2
    for bad in (2.5, 1e300):  # (a fraction, or a float past any integer field's range)
        r = httpx.post(server.http + "/v1/completions", json={**base, "max_tokens": bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"] == f"max_tokens: must be an integer, got {bad!r}"


def test_what_frameworks_send_with_tools(server, long_server):
    """An empty tools list is no tools (OpenAI's Agents SDK sends one with every tool-less agent; vLLM takes it), on
    both APIs; a forced call beside a response_format / text.format (instructor's RESPONSES_TOOLS) is the call (the
    format has no text to hold); an answer past the context is a 400 with OpenAI's context_length_exceeded code."""
    tool = {"name": "person", "parameters": {"type": "object", "properties": {"age": {"type": "integer"}},
                                             "required": ["age"]}}
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": tool["parameters"]}}
    r = httpx.post(server.http + "/v1/responses", timeout=60, json={"input": "hi", "tools": [], "max_output_tokens": 4})
    assert r.status_code == 200, r.text
    r = httpx.post(server.http + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "tools": [], "tool_choice": "auto", "max_tokens": 4})
    assert r.status_code == 200, r.text
    r = httpx.post(long_server.http + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "John is 42."}], "max_tokens": 40, "response_format": schema,
        "tools": [{"type": "function", "function": tool}], "tool_choice": {"type": "function", "function": {"name": "person"}}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "person", r.text
    r = httpx.post(long_server.http + "/v1/responses", timeout=60, json={
        "input": "John is 42.", "max_output_tokens": 40, "text": {"format": {"type": "json_schema", "name": "p",
                                                                             "schema": tool["parameters"]}},
        "tools": [{"type": "function", **tool}], "tool_choice": {"type": "function", "name": "person"}})
    assert r.status_code == 200 and r.json()["output"][0]["type"] == "function_call", r.text
    r = httpx.post(server.http + "/v1/completions", timeout=60, json={"prompt": [5] * 300})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_completions_max_tokens_default_is_16_cut_to_the_room_each_prompt_leaves(server):
    """max_tokens left out or null on completions: 16 (OpenAI's and vLLM's), at least min_tokens, cut to the room
    each prompt's context leaves (a default never refuses a prompt that fits); one given that does not fit is a 400."""
    body = {"prompt": [[5, 6], [5] * 250], "ignore_eos": True, "temperature": 0}
    for extra in ({}, {"max_tokens": None}):
        r = httpx.post(server.http + "/v1/completions", json={**body, **extra}, timeout=120).json()
        assert [c["finish_reason"] for c in r["choices"]] == ["length", "length"]
        assert r["usage"]["completion_tokens"] == 16 + (256 - 250)  # (the test server's context: 256)
    r = httpx.post(server.http + "/v1/completions", json={**body, "prompt": [[5, 6]], "min_tokens": 20}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20, r.text
    r = httpx.post(server.http + "/v1/completions", json={**body, "min_tokens": 20}, timeout=120)
    assert r.status_code == 400 and "min_tokens: must be <= 6" in r.json()["error"]["message"], r.text
    r = httpx.post(server.http + "/v1/completions", json={**body, "max_tokens": 16}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    # chat with min_tokens (checked against the limit the prompt leaves, not a placeholder of 1)
    r = httpx.post(server.http + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "min_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 5, r.text
    r = httpx.post(server.http + "/v1/completions", json={"prompt": [5, 10**6]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_chat_echo_starts_the_answer_with_the_final_assistant_message(server):
    """vLLM's chat echo: an answer that goes on from a final assistant message (continue_final_message) starts with
    its content, whole and streamed; after a user message it changes nothing."""
    url = server.http + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}],
            "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    plain = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]["content"]
    echoed = httpx.post(url, json={**body, "echo": True}, timeout=60).json()["choices"][0]["message"]["content"]
    assert echoed == "Well," + plain
    with httpx.stream("POST", url, json={**body, "echo": True, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == echoed
    user = {"messages": body["messages"][:1], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert (httpx.post(url, json={**user, "echo": True}, timeout=60).json()["choices"][0]["message"]["content"]
            == httpx.post(url, json=user, timeout=60).json()["choices"][0]["message"]["content"])


def test_best_of_answers_the_most_likely_of_its_samples(server):
    """best_of (OpenAI's): best_of samples of each prompt, the n with the highest summed logprobs answered in that
    order (their logprobs only if asked for), usage counting every sample; with stream or under n refused."""
    url = server.http + "/v1/completions"
    body = {"prompt": [[5, 6, 7], [9, 10]], "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    every = httpx.post(url, json={**body, "n": 5, "logprobs": 0}, timeout=60).json()
    best = httpx.post(url, json={**body, "n": 2, "best_of": 5}, timeout=60).json()
    assert [c["index"] for c in best["choices"]] == [0, 1, 2, 3] and best["choices"][0]["logprobs"] is None
    assert best["usage"]["completion_tokens"] == every["usage"]["completion_tokens"] == 2 * 5 * 6
    for p in range(2):  # (the same seed: the same five samples of each prompt)
        ranked = sorted(every["choices"][5 * p:5 * p + 5], key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
        assert [c["text"] for c in best["choices"][2 * p:2 * p + 2]] == [c["text"] for c in ranked[:2]]
    shown = httpx.post(url, json={**body, "n": 2, "best_of": 5, "logprobs": 0}, timeout=60).json()["choices"]
    assert sum(shown[0]["logprobs"]["token_logprobs"]) >= sum(shown[1]["logprobs"]["token_logprobs"])
    for extra, message in (({"n": 3, "best_of": 2}, "best_of: must be at least n (3), got 2"),
                           ({"best_of": 2, "stream": True}, "best_of: not supported with stream")):
        r = httpx.post(url, json={**body, **extra}, timeout=60)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_what_vllm_clients_send_is_taken(server):
    """vLLM's spellings its clients send: top_k -1 (off), a negative seed (-1: none), min_p 1, completions' logprobs
    true / false."""
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 1.0, "ignore_eos": True}

    def post(**extra):
        r = httpx.post(server.http + "/v1/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    assert post(top_k=-1, seed=3)["text"] == post(top_k=0, seed=3)["text"]
    assert post(seed=-2)["text"] == post(seed=2**63 - 2)["text"]
    unseeded = {post(seed=-1, max_tokens=24)["text"] for _ in range(3)}  # vLLM's -1: no seed, each draw its own
    assert len(unseeded) > 1
    assert len(post(min_p=1.0, seed=4, max_tokens=8)["text"]) > 0
    assert post(logprobs=False, seed=1)["logprobs"] is None
    shown = post(logprobs=True, seed=1)["logprobs"]
    assert len(shown["tokens"]) == 4 and shown["top_logprobs"] == post(logprobs=0, seed=1)["logprobs"]["top_logprobs"]


def test_return_token_ids_and_add_special_tokens_as_vllm_takes_them(server):
    """vLLM's return_token_ids: completions' choices carry their prompt's ids and their own, a chat's answer its
    prompt's beside the choices; streamed, the prompt's in a choice's first chunk (the chat's first) and each
    chunk its new ids, adding up to the whole answer's. add_special_tokens: false leaves the BOS out of a
    completion's text prompt, true adds it to a chat's (as /tokenize counts them)."""
    url = server.http
    body = {"prompt": ["hello there", [5, 6, 7]], "max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2,
            "return_token_ids": True}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    hello = httpx.post(url + "/tokenize", json={"prompt": "hello there"}, timeout=60).json()["tokens"]
    assert [c["prompt_token_ids"] for c in whole["choices"]] == [hello, hello, [5, 6, 7], [5, 6, 7]]
    assert all(len(c["token_ids"]) == 5 for c in whole["choices"])
    streamed: dict = {}
    prompts: dict = {}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed.setdefault(c["index"], []).extend(c["token_ids"])
                    if "prompt_token_ids" in c:
                        assert c["index"] not in prompts
                        prompts[c["index"]] = c["prompt_token_ids"]
    assert [streamed[k] for k in range(4)] == [c["token_ids"] for c in whole["choices"]]
    assert [prompts[k] for k in range(4)] == [c["prompt_token_ids"] for c in whole["choices"]]
    assert "token_ids" not in httpx.post(url + "/v1/completions", json={**body, "return_token_ids": False},
                                         timeout=60).json()["choices"][0]
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == httpx.post(url + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"] == 4
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks), []) == chat["choices"][0]["token_ids"]


def test_add_special_tokens_as_vllm_takes_it(tmp_path, config_path):
    """add_special_tokens (a model whose tokenizer adds a BOS): completions' text prompts have it unless false, a
    chat's prompt (its template writes no BOS here) gets it only if true; /tokenize counts the same."""
    from tests.tiny_gguf import write_tiny_gguf

    model = str(tmp_path / "bos.gguf")
    write_tiny_gguf(model, add_bos=True)
    for server in http_server(model, config_path, "--chat-template", "{% for m in messages %}{{ m.content }}{% endfor %}"):
        def prompt_ids(path, **body):
            r = httpx.post(server.http + path, json={"max_tokens": 1, "return_token_ids": True, **body}, timeout=60)
            assert r.status_code == 200, r.text
            r = r.json()
            return r["prompt_token_ids"] if "prompt_token_ids" in r else r["choices"][0]["prompt_token_ids"]

        def tokenized(**body):
            return httpx.post(server.http + "/tokenize", json=body, timeout=60).json()["tokens"]

        text = prompt_ids("/v1/completions", prompt="hello there")
        assert text[0] == 1 and prompt_ids("/v1/completions", prompt="hello there", add_special_tokens=False) == text[1:]
        assert tokenized(prompt="hello there") == text and tokenized(prompt="hello", add_special_tokens=False)[0] != 1
        messages = [{"role": "user", "content": "hello there"}]
        chat = prompt_ids("/v1/chat/completions", messages=messages)
        assert chat == text[1:] and prompt_ids("/v1/chat/completions", messages=messages, add_special_tokens=True) == text
        assert tokenized(messages=messages, add_special_tokens=True) == text
        # JetStream's Decode adds the BOS to a prompt of text or ids unless has_bos says it has one (as JetStream does)
        def answer(ids):
            r = httpx.post(server.http + "/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0},
                           timeout=60).json()
            return r["choices"][0]["text"]

        with grpc.insecure_channel(server.target) as ch:
            stub = jetstream_pb2_grpc.OrchestratorStub(ch)

            def decoded(has_bos=False, **content):
                return "".join(r.stream_content.samples[0].text for r in stub.Decode(jetstream_pb2.DecodeRequest(
                    max_tokens=3, has_bos=has_bos, **content), timeout=60))
            ids = jetstream_pb2.DecodeRequest.TokenContent
            assert decoded(token_content=ids(token_ids=text[1:])) == decoded(token_content=ids(token_ids=text)) == \
                decoded(text_content=jetstream_pb2.DecodeRequest.TextContent(text="hello there")) == answer(text)
            assert decoded(True, token_content=ids(token_ids=text[1:])) == answer(text[1:])


def test_streamed_completions_logprobs_are_the_whole_answers(server):
    """Streamed completions with logprobs: each chunk's text_offset goes on from the choice's text so far, and
    with echo the prompt leads the choice's first chunk with its logprobs: the chunks add up to the answer
    given whole (texts, tokens, offsets), with max_tokens 0 too."""
    for extra in ({"max_tokens": 5}, {"max_tokens": 5, "echo": True}, {"max_tokens": 0, "echo": True}):
        body = {"prompt": ["hello there", "abc"], "temperature": 0, "logprobs": 1, "ignore_eos": True, **extra}
        whole = httpx.post(server.http + "/v1/completions", json=body, timeout=60).json()["choices"]
        got = {}
        with httpx.stream("POST", server.http + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for c in json.loads(line[6:])["choices"]:
                    g = got.setdefault(c["index"], {"text": "", "tokens": [], "text_offset": [], "token_logprobs": []})
                    if not g["text"] and extra.get("echo"):  # echo leads the first chunk, with its logprobs
                        prompt = body["prompt"][c["index"]]
                        assert c["text"].startswith(prompt) and c["logprobs"]["token_logprobs"][0] is None
                    g["text"] += c["text"]
                    lp = c["logprobs"] or {}
                    assert len(lp.get("tokens", [])) == len(lp.get("text_offset", []))
                    for key in ("tokens", "text_offset", "token_logprobs"):
                        g[key] += lp.get(key, [])
        for c in whole:  # (logprobs within float noise: the two ran in other batches)
            g = got[c["index"]]
            assert (g["text"], g["tokens"], g["text_offset"]) == (c["text"], c["logprobs"]["tokens"],
                                                                  c["logprobs"]["text_offset"]), extra
            assert [x is None for x in g["token_logprobs"]] == [x is None for x in c["logprobs"]["token_logprobs"]]
            np.testing.assert_allclose([x or 0 for x in g["token_logprobs"]],
                                       [x or 0 for x in c["logprobs"]["token_logprobs"]], atol=1e-5)


def test_non_finite_numbers_are_not_json(server):
    for path in ("/v1/responses", "/v1/chat/completions"):
        r = httpx.post(server.http + path, content=b'{"input": "x", "messages": [], "temperature": NaN}',
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and "NaN is not a JSON number" in r.json()["error"]["message"]


def test_responses_stream_events_from_chat_chunks():
    """The stream's translation on its own: text holding U+2028 (which str.splitlines would cut inside
    the chunk's JSON) and a mid-stream error, which ends with response.failed."""
    import asyncio

    from serve.openai_responses import _events

    def chunk(**fields):
        return f"data: {json.dumps({'model': 'm', 'choices': [], **fields}, ensure_ascii=False)}\n\n"

    async def chat(*chunks):
        for c in chunks:
            yield c

    async def events(*chunks):
        return [json.loads(e.split("\ndata: ", 1)[1]) async for e in _events(chat(*chunks), {"input": "x"})]

    got = asyncio.run(events(chunk(choices=[{"index": 0, "delta": {"content": "a\u2028b\u0085c"}, "finish_reason": None}]),
                             chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]),
                             chunk(usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}),
                             "data: [DONE]\n\n"))
    assert got[-1]["type"] == "response.completed" and got[-1]["response"]["output"][0]["content"][0]["text"] == "a\u2028b\u0085c"
    assert got[-1]["response"]["usage"]["input_tokens"] == 3
    got = asyncio.run(events(chunk(choices=[{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]),
                             f"data: {json.dumps({'error': {'message': 'step failed', 'code': None}})}\n\n"))
    assert [e["type"] for e in got[-2:]] == ["error", "response.failed"]
    assert got[-1]["response"]["status"] == "failed" and got[-1]["response"]["error"]["message"] == "step failed"
    # logprobs (include: message.output_text.logprobs): the deltas' add up to the text's, those of tokens after
    # the last text (a call's) in a last empty delta
    lp = [{"token": t, "logprob": -1.0, "bytes": [], "top_logprobs": []} for t in "abc"]
    got = asyncio.run(events(
        chunk(choices=[{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": lp[:1]}, "finish_reason": None}]),
        chunk(choices=[{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {
            "name": "f", "arguments": "{}"}}]}, "logprobs": {"content": lp[1:]}, "finish_reason": "tool_calls"}]),
        "data: [DONE]\n\n"))
    deltas = [e for e in got if e["type"] == "response.output_text.delta"]
    done = next(e for e in got if e["type"] == "response.output_text.done")
    assert [d["delta"] for d in deltas] == ["a", ""]
    assert [x for d in deltas for x in d["logprobs"]] == done["logprobs"] == lp
    # two calls: the first item done (its arguments and name) before the second is added, as OpenAI streams them

    def call(i, head, arguments):
        piece = {"index": i, "function": {"arguments": arguments}}
        if head:
            piece.update(id=f"c{i}", type="function", function={"name": f"f{i}", "arguments": arguments})
        return chunk(choices=[{"index": 0, "delta": {"tool_calls": [piece]}, "finish_reason": None}])

    got = asyncio.run(events(call(0, True, "{"), call(0, False, "}"), call(1, True, "{}"),
                             chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]), "data: [DONE]\n\n"))
    order = [(e["type"].split(".", 1)[1], e.get("output_index")) for e in got
             if e["type"].startswith(("response.output_item", "response.function_call_arguments.done"))]
    assert order == [("output_item.added", 0), ("function_call_arguments.done", 0), ("output_item.done", 0),
                     ("output_item.added", 1), ("function_call_arguments.done", 1), ("output_item.done", 1)]
    done = [e for e in got if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in done] == [("f0", "{}"), ("f1", "{}")]


def test_responses_are_kept_and_continued_by_previous_response_id(server, oai, model_name):
    """A kept response continues by previous_response_id as the chat answers the whole conversation (its
    input and answers, not its instructions), is retrieved as it was answered (whole or streamed), lists its
    input items, and is deleted; store: false keeps nothing."""
    extra = {"ignore_eos": True}
    first = oai.responses.create(model=model_name, instructions="be brief", input="hi", max_output_tokens=5,
                                 temperature=0, extra_body=extra)
    assert first.store is True and first.previous_response_id is None
    then = oai.responses.create(model=model_name, previous_response_id=first.id, max_output_tokens=5, temperature=0,
                                input=[{"role": "user", "content": "and?"}], instructions="be kind", extra_body=extra)
    last = oai.responses.create(model=model_name, previous_response_id=then.id, input="ok", max_output_tokens=5,
                                temperature=0, extra_body=extra)
    asked = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "and?"}]
    for r, messages in ((then, [{"role": "system", "content": "be kind"}, *asked]),
                        (last, [*asked, {"role": "assistant", "content": then.output_text}, {"role": "user", "content": "ok"}])):
        chat = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=5, temperature=0,
                                           extra_body=extra)
        assert r.output_text == chat.choices[0].message.content and r.previous_response_id is not None
        assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert oai.responses.retrieve(then.id).model_dump() == then.model_dump()
    counted = oai.responses.input_tokens.count(model=model_name, previous_response_id=first.id, instructions="be kind",
                                               input=[{"role": "user", "content": "and?"}], personality="pragmatic")
    assert counted.input_tokens == then.usage.input_tokens and counted.object == "response.input_tokens"
    events = list(oai.responses.create(model=model_name, previous_response_id=first.id, input="and?", stream=True,
                                       max_output_tokens=5, temperature=0, instructions="be kind", extra_body=extra))
    streamed = events[-1].response
    assert streamed.store and streamed.output_text == then.output_text
    assert oai.responses.retrieve(streamed.id).model_dump() == streamed.model_dump()
    items = oai.responses.input_items.list(then.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "and?")]
    assert not items.has_more and items.first_id == items.data[0].id
    two = httpx.get(f"{server.http}/v1/responses/{last.id}/input_items", params={"limit": 1}, timeout=10).json()
    assert two["has_more"] is False and two["data"][0]["content"] == [{"type": "input_text", "text": "ok"}]
    scraped = dict(line.split(" ", 1) for line in httpx.get(server.http + "/metrics", timeout=10).text.splitlines()
                   if line.startswith("jaxcb:responses_kept"))
    assert float(scraped["jaxcb:responses_kept"]) >= 4 and float(scraped["jaxcb:responses_kept_bytes"]) > 4 * 1000
    assert oai.responses.delete(first.id) is None  # (the SDK returns nothing for a delete)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.retrieve(first.id)
    assert e.value.body["param"] == "response_id" and first.id in e.value.body["message"]
    again = oai.responses.create(model=model_name, previous_response_id=then.id, input="ok", max_output_tokens=5,
                                 temperature=0, extra_body=extra)  # (its conversation is its own: first's delete)
    assert again.output_text == last.output_text
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model_name, previous_response_id=first.id, input="x", max_output_tokens=2)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    unkept = oai.responses.create(model=model_name, input="hi", max_output_tokens=2, store=False)
    assert unkept.store is False
    for call in (lambda: oai.responses.retrieve(unkept.id), lambda: oai.responses.delete(unkept.id),
                 lambda: oai.responses.input_items.list(unkept.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    for params, message in (({"limit": 0}, "limit: must be an integer from 1 to 100"), ({"order": "up"}, "order: must"),
                            ({"after": "msg_x"}, "after: 'msg_x' is not an item"), ({"page": 2}, "page: not a")):
        r = httpx.get(f"{server.http}/v1/responses/{last.id}/input_items", params=params, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text


def test_conversations_hold_items_that_responses_read_and_go_on(server, oai, model_name):
    """OpenAI's Conversations API: a conversation's items are read before a Responses call's input (the chat's
    answer over the same messages), its input and answer go on it; items are listed, fetched, added and
    deleted; the conversation's metadata updated, the conversation deleted."""
    extra = {"ignore_eos": True}
    conv = oai.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}], metadata={"k": "v"})
    assert conv.id.startswith("conv_") and conv.metadata == {"k": "v"}
    r = oai.responses.create(model=model_name, conversation=conv.id, input="and?", max_output_tokens=5, temperature=0,
                             extra_body=extra)
    chat = oai.chat.completions.create(model=model_name, max_tokens=5, temperature=0, extra_body=extra, messages=[
        {"role": "user", "content": "hi"}, {"role": "user", "content": "and?"}])
    assert r.output_text == chat.choices[0].message.content and r.conversation.id == conv.id
    items = oai.conversations.items.list(conv.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [("message", "user"), ("message", "user"), ("message", "assistant")]
    assert items.data[2].content[0].text == r.output_text
    then = oai.responses.create(model=model_name, conversation={"id": conv.id}, input="ok", max_output_tokens=5,
                                temperature=0, store=False, extra_body=extra)
    chat = oai.chat.completions.create(model=model_name, max_tokens=5, temperature=0, extra_body=extra, messages=[
        {"role": "user", "content": "hi"}, {"role": "user", "content": "and?"},
        {"role": "assistant", "content": r.output_text}, {"role": "user", "content": "ok"}])
    assert then.output_text == chat.choices[0].message.content and then.store is False
    added = oai.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "more"}])
    assert len(added.data) == 1 and oai.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id).id == added.data[0].id
    assert len(oai.conversations.items.list(conv.id, limit=100).data) == 6
    oai.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert [i.id for i in oai.conversations.items.list(conv.id, limit=2).data][0] != added.data[0].id
    background = oai.responses.create(model=model_name, conversation=conv.id, input="bg", max_output_tokens=3,
                                      background=True, extra_body=extra)
    deadline = time.monotonic() + 60
    while background.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        background = oai.responses.retrieve(background.id)
    last = oai.conversations.items.list(conv.id, limit=2).data  # (newest first)
    assert background.status == "incomplete" and last[0].content[0].text == background.output_text
    assert last[1].content[0].text == "bg"
    assert oai.conversations.update(conv.id, metadata={"k": "w"}).metadata == {"k": "w"}
    assert oai.conversations.retrieve(conv.id).metadata == {"k": "w"}
    with pytest.raises(openai.NotFoundError):  # a conversation is not a response, nor the other way round
        oai.responses.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        oai.conversations.retrieve(r.id)
    assert oai.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        oai.conversations.items.list(conv.id)
    for body, message in (({"items": [{"type": "message", "role": "robot", "content": "x"}]}, "items[0].role: must be"),
                          ({"items": [{"role": "user", "content": "x"}] * 21}, "items: must be a list of 1 to 20"),
                          ({"metadata": {"k": 1}}, "metadata: 'k': keys of"), ({"colour": 1}, "colour: not a field")):
        got = httpx.post(server.http + "/v1/conversations", json=body, timeout=10)
        assert got.status_code == 400 and got.json()["error"]["message"].startswith(message), got.text


def test_background_responses_run_on_and_are_cancelled(server, oai, model_name):
    """background: the call answers once the request is queued, the response is polled to its end (the same
    answer as in the foreground), a long one is cancelled (its pages freed), a refused one refused at once."""
    extra = {"ignore_eos": True}
    want = oai.responses.create(model=model_name, input="hi", max_output_tokens=6, temperature=0, extra_body=extra)
    r = oai.responses.create(model=model_name, input="hi", max_output_tokens=6, temperature=0, background=True,
                             extra_body=extra)
    assert r.background and r.status in ("queued", "in_progress") and r.output == []
    deadline = time.monotonic() + 60
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        r = oai.responses.retrieve(r.id)
    assert r.status == "incomplete" and r.output_text == want.output_text and r.usage.output_tokens == 6
    with pytest.raises(openai.BadRequestError) as e:  # only a background response is cancelled
        oai.responses.cancel(want.id)
    assert "only a background response can be cancelled" in e.value.body["message"]
    long = oai.responses.create(model=model_name, input="hi", max_output_tokens=200, background=True, extra_body=extra)
    cancelled = oai.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and oai.responses.retrieve(long.id).status == "cancelled"
    info = _pool_whole(server)
    assert info.pages_free == info.pages_total and info.running == 0
    with pytest.raises(openai.BadRequestError) as e:  # refused before it is queued: nothing is kept
        oai.responses.create(model=model_name, input="hi", max_output_tokens=10**9, background=True)
    assert e.value.body["param"] == "max_output_tokens"
    gone = oai.responses.create(model=model_name, input="hi", max_output_tokens=200, background=True, extra_body=extra)
    oai.responses.delete(gone.id)  # a running one deleted: cancelled
    info = _pool_whole(server)
    assert info.pages_free == info.pages_total and info.running == 0


def test_streamed_background_responses_outlive_their_reader_and_are_streamed_again_from_any_event(server, oai,
                                                                                                  model_name):
    """background with stream: the call streams the response's events; a reader that goes away leaves it running;
    GET .../{id}?stream=true gives its events again after starting_after (the SDK's retrieve(stream=True)), the same
    text as in the foreground; a streamed one cancelled ends with its pages freed."""
    extra = {"ignore_eos": True}
    want = oai.responses.create(model=model_name, input="hi", max_output_tokens=12, temperature=0, extra_body=extra)
    url = server.http + "/v1/responses"
    body = {"model": model_name, "input": "hi", "max_output_tokens": 12, "temperature": 0, "background": True,
            "stream": True, **extra}
    with httpx.stream("POST", url, json=body, timeout=60) as r:  # read the first three events, then hang up
        assert r.status_code == 200
        first = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                first.append(json.loads(line[6:]))
            if len(first) == 3:
                break
    rid = first[0]["response"]["id"]
    assert [e["type"] for e in first[:2]] == ["response.created", "response.in_progress"]
    assert first[0]["response"]["background"] and first[0]["response"]["store"]
    deadline = time.monotonic() + 60
    while oai.responses.retrieve(rid).status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
    kept = oai.responses.retrieve(rid)
    assert kept.status == "incomplete" and kept.output_text == want.output_text and kept.usage.output_tokens == 12
    rest = list(oai.responses.retrieve(rid, stream=True, starting_after=2))  # (the SDK's own reading)
    assert [e.sequence_number for e in rest] == list(range(3, 3 + len(rest)))
    assert rest[-1].type == "response.incomplete" and rest[-1].response.id == rid
    deltas = [e for e in first + [e.model_dump() for e in rest] if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in deltas) == want.output_text
    again = httpx.get(f"{url}/{rid}", params={"stream": "true"}, timeout=60)  # from the first event
    assert [json.loads(line[6:]) for line in again.text.splitlines() if line.startswith("data: ")][:3] == first
    for query, field in (({"stream": "true", "starting_after": "x"}, "starting_after"), ({"stream": "yes"}, "stream")):
        r = httpx.get(f"{url}/{rid}", params=query, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(field + ":"), r.text
    r = httpx.get(f"{url}/{want.id}", params={"stream": "true"}, timeout=60)  # (kept, but not streamed in background)
    assert r.status_code == 400 and "not streamed in the background" in r.text
    long = {**body, "max_output_tokens": 200}
    with httpx.stream("POST", url, json=long, timeout=60) as r:
        lines = r.iter_lines()
        line = next(line for line in lines if line.startswith("data: "))
        rid = json.loads(line[6:])["response"]["id"]
        assert oai.responses.cancel(rid).status == "cancelled"
        rest = list(lines)
        assert len(rest) < 4 * 200  # (the stream ends, cut short, with an event that says so)
    last = json.loads([line for line in rest if line.startswith("data: ")][-1][6:])
    assert last["type"] == "error" and last["code"] == "response_cancelled"
    assert oai.responses.retrieve(rid).status == "cancelled"
    replay = httpx.get(f"{url}/{rid}", params={"stream": "true"}, timeout=60)  # (and so does a reader after)
    assert json.loads([line for line in replay.text.splitlines() if line.startswith("data: ")][-1][6:])["type"] == "error"
    info = _pool_whole(server)
    assert info.pages_free == info.pages_total and info.running == 0


def test_a_responses_output_given_back_as_input_is_the_turn_its_kept_response_continues_with():
    """A response's output (its text, then its function calls) given back as input items is one assistant turn,
    the message previous_response_id continues the conversation with: the same prompt either way."""
    from serve.openai_responses import chat_messages
    from serve.openai_responses_store import answer_messages

    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
              {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
              {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'}]
    asked = [{"role": "user", "content": "q"}]
    assert chat_messages(asked + output) == chat_messages(asked) + answer_messages({"output": output})
    calls_only = output[1:]
    assert chat_messages(asked + calls_only) == chat_messages(asked) + answer_messages({"output": calls_only})


def test_the_response_store_is_bounded_and_each_tokens_own():
    """The store's memory limit drops the least recently used first (a background response running is
    kept), one over the limit alone is not kept, and a caller reaches only its own token's responses."""
    from serve.openai_responses_store import Kept, Store

    def kept(rid, owner="", text="x"):
        return Kept(owner, {"id": rid, "object": "response", "status": "completed", "output": [{"type": "message", "content": [
            {"type": "output_text", "text": text}]}]}, [], ({"role": "user", "content": text},))

    one = Store(1 << 20)
    one.put(kept("a"))
    store = Store(3 * one.used + 10)  # room for three
    assert store.put(kept("a")) and store.put(kept("b")) and store.put(kept("c", owner="token1"))
    store.find("", "a")  # used: b is now the oldest
    assert store.put(kept("d"))
    assert sorted(store.kept) == ["a", "c", "d"] and store.used == sum(k.size for k in store.kept.values())
    assert not store.put(kept("huge", text="y" * 8000)) and "huge" not in store.kept
    with pytest.raises(Exception) as e:
        store.find("token0", "c")  # another token's response is not found
    assert e.value.status == 404 and e.value.param == "response_id"
    assert store.find("token1", "c").owner == "token1"
    with pytest.raises(Exception) as e:
        store.call("", {"input": "x", "previous_response_id": "c"})
    assert e.value.status == 400 and e.value.code == "previous_response_not_found"
    assert store.call("", {"input": "x", "previous_response_id": "d"}).history == ({"role": "user", "content": "x"},)
    with pytest.raises(Exception) as e:
        Store(0).call("", {"input": "x", "background": True})
    assert "this server keeps no responses" in e.value.message
    assert Store(0).call("", {"input": "x"}).keep is False


def test_one_token_cannot_push_out_anothers_responses_or_keep_unusable_conversations():
    """With bearer tokens each keeps within an even share of the store: a token filling its share drops its own
    least recently used, never another's; a conversation past what a call's input may hold is refused naming
    its items."""
    from serve.frontend import MAX_TEXT_CHARS
    from serve.openai_responses_store import Kept, Store

    def kept(rid, owner):
        return Kept(owner, {"id": rid, "object": "response", "status": "completed", "output": []}, [],
                    ({"role": "user", "content": "x"},))

    one = Store(1 << 20)
    one.put(kept("a", "token0"))
    store = Store(4 * one.used + 10, owners=2)  # room for two each
    assert store.put(kept("a0", "token0")) and store.put(kept("b0", "token1"))
    for i in range(1, 6):  # token1 keeps storing
        assert store.put(kept(f"b{i}", "token1"))
    assert "a0" in store.kept and sorted(k for k in store.kept if k.startswith("b")) == ["b4", "b5"]
    assert store.owned["token1"] <= store.share and store.used == sum(k.size for k in store.kept.values())
    big = [{"type": "message", "role": "user", "content": "z" * (MAX_TEXT_CHARS // 3)} for _ in range(4)]
    with pytest.raises(Exception) as e:
        Store(1 << 30).create_conversation("", {"items": big})
    assert e.value.status == 400 and e.value.message.startswith("items: the conversation would hold")
    roomy = Store(1 << 30)
    cid = roomy.create_conversation("", {"items": big[:2]})["id"]
    with pytest.raises(Exception) as e:
        roomy.add_items("", cid, {"items": big[:2]})
    assert e.value.status == 400 and e.value.param == "items" and len(roomy.kept[cid].items) == 2


def test_a_client_runs_at_most_max_background_responses():
    import asyncio

    from serve.openai_responses_store import MAX_BACKGROUND, Call, Kept, Store, _Detached

    async def main():
        store, never = Store(1 << 20), asyncio.Event()
        running = asyncio.ensure_future(never.wait())
        for i in range(MAX_BACKGROUND):
            k = Kept("token0", {"id": f"r{i}", "object": "response", "status": "queued", "output": []}, [])
            k.detached = _Detached()
            k.detached.task = running
            store.put(k)
        body, chat = {"input": "x", "background": True}, {"messages": [{"role": "user", "content": "x"}]}
        with pytest.raises(Exception) as e:
            await store.start(Call("token0", True, True, ()), body, chat, [], "m", None)
        assert e.value.status == 429 and e.value.param == "background"
        # another token's are its own
        assert store._running("token1") == 0 and store._running("token0") == MAX_BACKGROUND
        running.cancel()

    asyncio.run(main())


def test_responses_stream_client_gone_frees_its_request(server):
    with httpx.stream("POST", server.http + "/v1/responses", timeout=60,
                      json={"input": "hi", "max_output_tokens": 240, "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("event: response.output_text.delta"):
                break
    info = _pool_whole(server)
    assert info.pages_free == info.pages_total and info.running == 0


@pytest.mark.parametrize("body,message", [
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type: 'image' is not supported"),
    ({"input": [{"type": "reasoning", "summary": [], "colour": 1}]}, "input[0].colour: not a field of a reasoning item"),
    ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort: must be one of none, minimal, low"),
    ({"input": "x", "reasoning": "high"}, "reasoning: must be an object"),
    ({"input": [{"type": []}]}, "input[0].type: must be a string"),
    ({"input": [{"role": "user", "content": "x", "a b": 1}]}, "input[0]: 'a b' is not a field of a message item"),
    ({"input": [{"role": "user", "content": "x", "colour": 1}]}, "input[0].colour: not a field of a message item"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata: 'k': keys of at most 64 characters, string values"),
    ({"input": "x", "metadata": {";": None}}, "metadata: ';': keys of at most 64 characters"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata: must be an object of at most 16"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 1}]}, "input[0].output: must be a string"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments: must be a string"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type: 'web_search' is not supported"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "mcp"}},
     "tool_choice: must be none, auto, required, {type: function, name} or"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type: 'input_image' is not supported"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role: must be one of"),
    ({"input": []}, "input: must be a string or a non-empty list"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id: no response 'resp_1' is stored here"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id: must be a string"),
    ({"input": "x", "conversation": "conv_1"}, "conversation: no conversation 'conv_1' is stored here"),
    ({"input": "x", "conversation": {"id": 3}}, "conversation: must be a conversation's id, or {id}"),
    ({"input": "x", "conversation": "c", "previous_response_id": "r"}, "conversation: give either conversation or"),
    ({"input": "x", "background": True, "store": False}, "background: needs store: true"),
    ({"input": "x", "store": "yes"}, "store: must be true or false"),
    ({"input": "x", "truncation": "middle"}, "truncation: must be 'disabled' or 'auto'"),
    ({"prompt": {"id": "pmpt_1"}, "input": "x"}, "prompt: stored prompt templates are not served"),
    ({"input": "x", "include": ["message.output_text.colour"]}, "include[0]: 'message.output_text.colour' is not one of"),
    ({"input": "x", "include": "reasoning.encrypted_content"}, "include: must be a list of strings"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs: must be between 0 and 20"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options: only with stream: true"),
    ({"input": "x", "text": {"verbosity": "loud"}}, "text.verbosity: must be one of low, medium, high"),
    ({"input": "x", "service_tier": 1}, "service_tier: must be a string"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type: must be text, json_object or json_schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens: must be at least 1"),
    ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens: must be an integer"),
])
def test_responses_api_refuses_what_it_does_not_do_by_name(server, body, message):
    r = httpx.post(server.http + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == message.split(":")[0]  # (the field the message names)


@pytest.mark.parametrize("body, param, message", [
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                   "arguments": "{"}]}, "input[1].arguments", "not valid JSON"),
    ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens", "+ max_output_tokens (1000000000) exceeds"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}},
     "text.format.schema", "not a JSON schema that can be enforced"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name", "must be 1-64"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name", "is not one of the tools"),
    ({"instructions": "Be brief.", "input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                                             {"type": "function_call_output", "call_id": "c", "output": "x" * 70_000}]},
     "input", "characters are more than 255 tokens"),
])
def test_responses_api_errors_name_its_own_fields(server, body, param, message):
    """Errors found by the chat machinery that answers a Responses call name the call's own fields: the
    input item a message or tool call came from, the flat tools, text.format, max_output_tokens."""
    r = httpx.post(server.http + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param) and message in error["message"], error
    # a conversation longer than the context carries OpenAI's code for it (clients shorten and retry on it)
    assert (error["code"] == "context_length_exceeded") == ("exceeds" in message or "more than 255" in message), error


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 40) | st.floats(-3, 3) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=8)
_ITEM = st.dictionaries(st.sampled_from(["type", "role", "content", "call_id", "name", "arguments", "output", "id"]),
                        st.sampled_from(["message", "function_call", "function_call_output", "user", "assistant",
                                         "input_text", "{}", "f"]) | _JSON, max_size=5)
_RESPONSES_BODY = st.fixed_dictionaries(
    {"input": st.text(max_size=12) | st.lists(_ITEM, max_size=3) | _JSON},
    optional={"instructions": st.text(max_size=8) | _JSON, "max_output_tokens": st.integers(-1, 6) | _JSON,
              "temperature": st.floats(0, 2) | _JSON, "stream": st.booleans(),
              "text": st.fixed_dictionaries({"format": st.dictionaries(
                  st.sampled_from(["type", "name", "schema", "strict"]),
                  st.sampled_from(["json_schema", "json_object", "text"]) | _JSON, max_size=3)}) | _JSON,
              "tools": st.lists(st.dictionaries(st.sampled_from(["type", "name", "parameters"]),
                                                st.sampled_from(["function", "f"]) | _JSON, max_size=3), max_size=2) | _JSON,
              "tool_choice": st.sampled_from(["auto", "none", "required"]) | _JSON,
              "metadata": _JSON, "store": _JSON, "bogus": _JSON})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_RESPONSES_BODY)
def test_responses_api_fuzzed_bodies_are_answered_or_refused_by_name(server, body):
    """Random bodies on /v1/responses: an answer (whole or streamed to its end) or a 4xx naming the field,
    never a 5xx."""
    from tools.stress import FIELD_MESSAGE

    if isinstance(body.get("max_output_tokens"), int) and body["max_output_tokens"] > 6:
        body["max_output_tokens"] = 6
    body.setdefault("max_output_tokens", 4)
    with httpx.stream("POST", server.http + "/v1/responses", json=body, timeout=60) as r:
        text = r.read().decode()
    event(f"status {r.status_code}")
    assert r.status_code < 500, text
    if r.status_code >= 400:
        assert FIELD_MESSAGE.match(json.loads(text)["error"]["message"]), text
    elif body.get("stream") is True:
        assert "event: response.completed" in text or "event: response.incomplete" in text, text[-300:]
    else:
        assert json.loads(text)["object"] == "response"


def test_an_answer_written_in_pieces_is_the_json_of_the_whole():
    """serve.openai_answer writes a large answer in pieces (so the event loop runs between them): the bytes
    are those json.dumps gives the whole, long lists and nested ones included."""
    from serve.openai_answer import _dumps

    entry = {"5": {"logprob": -1.5, "rank": 2, "decoded_token": "é\"x"}, "7": {"logprob": -0.25, "rank": 1}}
    body = {"id": "x", "choices": [{"index": i, "text": "t", "prompt_logprobs": [None] + [entry] * (300 + i),
                                    "logprobs": {"tokens": ["a"] * 700, "top_logprobs": [None, {"a": -1.0}] * 260,
                                                 "nested": [[[1, [2]]], {}, []]}} for i in range(3)],
            "usage": {"prompt_tokens": 3}, "empty": [], "none": None}
    assert _dumps(body) == json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def test_beam_search_over_completions_and_chat(server, model_name, make_llm):
    """vLLM's use_beam_search (n beams, length_penalty): the offline engine's beams, best first, on both
    endpoints; what it does not combine with is refused naming the field; the pool is whole after."""
    prompt = [5, 6, 7, 8, 9]
    body = {"model": model_name, "prompt": prompt, "max_tokens": 5, "n": 3, "use_beam_search": True,
            "ignore_eos": True, "length_penalty": 0.5}
    r = httpx.post(server.http + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    offline = make_llm().beam_search([prompt], width=3, max_tokens=5, ignore_eos=True, length_penalty=0.5)[0]
    assert [c["text"] for c in got["choices"]] == [b.text for b in offline]
    assert [c["index"] for c in got["choices"]] == [0, 1, 2] and {c["finish_reason"] for c in got["choices"]} == {"length"}
    assert got["usage"] == {"prompt_tokens": 5, "completion_tokens": 15, "total_tokens": 20}
    chat = httpx.post(server.http + "/v1/chat/completions", timeout=60, json={
        "model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
        "use_beam_search": True, "ignore_eos": True}).json()
    assert len(chat["choices"]) == 2 and chat["choices"][0]["message"]["role"] == "assistant"
    context = httpx.get(server.http + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    for extra, param in (({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop"),
                         ({"n": 11}, "n"), ({"use_beam_search": False}, "length_penalty"),
                         ({"max_tokens": context - 2}, "max_tokens")):  # prompt + max_tokens past the context
        r = httpx.post(server.http + "/v1/completions", json={**body, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    llm = make_llm()
    with pytest.raises(ValueError, match=r"request 0: max_tokens: prompt \(5\) \+ max_tokens"):  # offline alike
        llm.beam_search([prompt], width=3, max_tokens=llm.engine.max_context - 2)
    _pool_whole(server)


def test_reasoning_parser_puts_the_thinking_apart_whole_and_streamed(long_server):
    """--reasoning-parser qwen3: an answer that starts with <think> has its thinking as `reasoning` (and
    `reasoning_content`) and the rest as `content`, in the whole answer and in the stream's deltas alike;
    one that does not is all content. (The answers are forced by a regex: the tiny model thinks nothing.)"""
    name = httpx.get(long_server.http + "/v1/models", timeout=30).json()["data"][0]["id"]
    for regex, reasoning, content in (("<think>[a-z]{4}</think>[a-z]{3}", 4, 3), ("[a-z]{5}", None, 5)):
        body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0,
                "structured_outputs": {"regex": regex}}
        message = httpx.post(long_server.http + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert message["reasoning"] == message["reasoning_content"]
        assert (len(message["reasoning"]) if reasoning else message["reasoning"]) == reasoning, message
        assert len(message["content"]) == content, message
        streamed = {"reasoning": "", "content": ""}
        with httpx.stream("POST", long_server.http + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    for key in streamed:
                        streamed[key] += delta.get(key) or ""
        assert streamed == {"reasoning": message["reasoning"] or "", "content": message["content"]}
        left_out = httpx.post(long_server.http + "/v1/chat/completions", json={**body, "include_reasoning": False},
                              timeout=60).json()["choices"][0]["message"]
        assert "reasoning" not in left_out and left_out["content"] == message["content"]


def test_thinking_token_budget_needs_tags_the_server_can_count_by(server, long_server):
    """vLLM's thinking_token_budget over HTTP and gRPC: -1 is none; a budget is refused, naming the field, by a
    server without --reasoning-parser and by one whose vocabulary does not spell <think> and </think> as one
    token each (the tiny model's); the tags are the parser's own where it does (serve.reasoning.thinking_tags)."""
    from serve import reasoning

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for s in (server, long_server):
        assert httpx.post(s.http + "/v1/chat/completions", json={**body, "thinking_token_budget": -1},
                          timeout=60).status_code == 200
        for budget, message in ((5, "thinking_token_budget: this model has no thinking tags"),
                                (-2, "thinking_token_budget: must be >= 0"),
                                ("5", "thinking_token_budget: must be an integer")):
            r = httpx.post(s.http + "/v1/chat/completions", json={**body, "thinking_token_budget": budget}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text[:300]
    with Client(long_server.target) as c, pytest.raises(grpc.RpcError) as e:
        req = build_request(token_ids=[5, 6], max_tokens=2)
        req.thinking_token_budget = 4
        list(c.stream(req))
    assert e.value.details().startswith("thinking_token_budget: this model has no thinking tags")

    class Vocabulary:
        def __init__(self, ids):
            self.ids = ids

        def token_id(self, text):
            return self.ids.get(text)

    both = Vocabulary({"<think>": 7, "</think>": 8})
    assert reasoning.thinking_tags(both, "qwen3") == (7, 8) and reasoning.thinking_tags(both, None) is None
    assert reasoning.thinking_tags(both, reasoning.HARMONY) is None
    assert reasoning.thinking_tags(Vocabulary({"</think>": 8}), "deepseek_r1") is None


def test_harmony_answers_give_reasoning_content_and_calls_whole_and_streamed(long_server):
    """A chat template that writes OpenAI's harmony format (gpt-oss's; here the request's own, on a server that
    trusts it, whose --reasoning-parser qwen3 it overrides): an answer's analysis message is `reasoning` and its
    final message the content (forced by a regex: the tiny model writes no harmony), whole and streamed alike;
    under tool_choice required the grammar writes a message to a function, read back as a call that validates."""
    import jsonschema

    from tests.test_harmony import HARMONY_TEMPLATE

    name = httpx.get(long_server.http + "/v1/models", timeout=30).json()["data"][0]["id"]
    lark = ('start: "<|channel|>analysis<|message|>" /[a-z]{4}/ "<|end|><|start|>assistant<|channel|>final<|message|>" '
            '/[a-z]{3}/ "<|return|>"')  # (a grammar of the request's own holds from the first token)
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "temperature": 0,
            "structured_outputs": {"grammar": lark}, "chat_template": HARMONY_TEMPLATE}

    def streamed(body) -> dict:
        got = {"reasoning": "", "content": "", "calls": {}, "finish": None}
        with httpx.stream("POST", long_server.http + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    for key in ("reasoning", "content"):
                        got[key] += choice["delta"].get(key) or ""
                    for d in choice["delta"].get("tool_calls") or ():
                        call = got["calls"].setdefault(d["index"], ["", ""])
                        call[0] += d["function"].get("name") or ""
                        call[1] += d["function"].get("arguments") or ""
                    got["finish"] = choice["finish_reason"] or got["finish"]
        return got

    message = httpx.post(long_server.http + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert len(message["reasoning"]) == 4 and message["reasoning"] == message["reasoning_content"], message
    assert len(message["content"]) == 3 and "<|" not in message["content"], message
    got = streamed(body)
    assert (got["reasoning"], got["content"]) == (message["reasoning"], message["content"])
    # A JSON schema holds the final message: the model may reason before it
    schema = WEATHER["function"]["parameters"]
    framed = {**{k: v for k, v in body.items() if k != "structured_outputs"}, "response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}
    message = httpx.post(long_server.http + "/v1/chat/completions", json=framed, timeout=60).json()["choices"][0]["message"]
    jsonschema.validate(json.loads(message["content"]), schema)
    got = streamed(framed)
    assert (got["reasoning"] or None, got["content"]) == (message["reasoning"], message["content"])
    calling = {"model": name, "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 200,
               "temperature": 0, "tools": [WEATHER, CLOCK], "tool_choice": "required", "chat_template": HARMONY_TEMPLATE}
    choice = httpx.post(long_server.http + "/v1/chat/completions", json=calling, timeout=60).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert len(calls) == 1 and calls[0][0] in ("get_weather", "get_time")
    if calls[0][0] == "get_weather":
        jsonschema.validate(json.loads(calls[0][1]), schema)
    got = streamed(calling)
    assert got["finish"] == "tool_calls" and list(got["calls"].values()) == [list(c) for c in calls]
    beams = httpx.post(long_server.http + "/v1/chat/completions", timeout=60, json={
        **{k: v for k, v in body.items() if k != "structured_outputs"}, "use_beam_search": True, "n": 2})
    assert beams.status_code == 400 and beams.json()["error"]["param"] == "use_beam_search"


def test_pythonic_calls_are_read_whole_and_streamed(long_server):
    """A chat template that asks for pythonic calls (Llama 3.2's and 4's instructions; here the request's own):
    under tool_choice required the grammar writes a Python list of calls, read back as calls that validate,
    whole and streamed alike."""
    import jsonschema

    template = ("{% if tools %}Call as [func_name1(params_name1=params_value1)]: {{ tools | tojson }}{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ")
    oai = openai.OpenAI(base_url=long_server.http + "/v1", api_key="unused", max_retries=0)
    name = oai.models.list().data[0].id
    body = dict(model=name, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER, CLOCK],
                tool_choice="required", max_tokens=200, temperature=0, extra_body={"chat_template": template})
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    r = oai.chat.completions.create(**body)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and not choice.message.content, choice
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    calls = {}
    for chunk in oai.chat.completions.create(**body, stream=True):
        for d in chunk.choices[0].delta.tool_calls or ():
            c = calls.setdefault(d.index, ["", ""])
            c[0] += d.function.name or ""
            c[1] += d.function.arguments or ""
    assert list(calls.values()) == [[c.function.name, c.function.arguments] for c in choice.message.tool_calls]


def test_a_lone_surrogate_is_a_400_naming_its_field_on_every_route(server, model_name):
    """JSON's \\ud800-\\udfff escapes unpaired are no text (no tokenizer takes them: a 500 until now):
    refused naming the field, on each route, before any work; a paired one is the character it encodes."""
    for route, body, param in (("/v1/completions", {"prompt": "\ud800 lone"}, "prompt"),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfff"}]},
                                "messages[0].content"),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                                   {"type": "text", "text": "\udc00"}]}]}, "messages[0].content[0].text"),
                               ("/v1/responses", {"input": "x\ud800"}, "input"),
                               ("/tokenize", {"prompt": "\ud800"}, "prompt")):
        r = httpx.post(server.http + route, timeout=30, headers={"content-type": "application/json"},
                       content=json.dumps({"model": model_name, **body}))  # (escaped: ensure_ascii)
        assert r.status_code == 400, (route, r.text)
        assert r.json()["error"]["param"] == param and "lone surrogate" in r.json()["error"]["message"], r.text
    r = httpx.post(server.http + "/v1/completions", timeout=30, headers={"content-type": "application/json"},
                   content=b'{"prompt": "lone \xed\xa0\x80"}')  # the surrogate's own bytes: not UTF-8
    assert r.status_code == 400 and r.json()["error"]["param"] == "body" and "utf-8" in r.text, r.text
    r = httpx.post(server.http + "/v1/completions", timeout=30, headers={"content-type": "application/json"},
                   content=json.dumps({"model": model_name, "prompt": "\U0001F600", "max_tokens": 2}))
    assert r.status_code == 200 and "\\ud83d\\ude00" in r.request.content.decode(), r.text


def test_small_refusals_name_their_fields_and_routes_answer_in_openais_shape(server, model_name):
    """A text longer than the context's tokens could hold, refused untokenized (kept whole: with
    truncate_prompt_tokens it is cut), an empty allowed_token_ids (vLLM's refusal: it would allow no token),
    stream_options' fields by their whole name, a long unknown model name shown cut, and no such route or
    method: each an OpenAI error."""
    def post(body, route="/v1/completions"):
        return httpx.post(server.http + route, timeout=30, json={"model": model_name, "prompt": "hi", **body})

    r = post({"prompt": "ab" * 5_000})  # more than 255 tokens of the tiny vocabulary's longest (13) hold
    assert r.status_code == 400 and "10000 characters are more than 255 tokens" in r.json()["error"]["message"]
    r = post({"prompt": "ab" * 5_000, "truncate_prompt_tokens": 8, "max_tokens": 2})  # (cut: tokenized, its end kept)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8, r.text
    r = post({"allowed_token_ids": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    r = post({"stream": True, "stream_options": {"include_usage": "yes"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_usage", r.text
    r = post({"model": "m" * 100_000})
    assert r.status_code == 404 and len(r.content) < 2_000 and "(100000 characters)" in r.json()["error"]["message"]
    for method, route, status in (("POST", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, server.http + route, timeout=30)
        assert r.status_code == status and r.json()["error"]["message"].startswith(f"{method} {route}: "), r.text
    assert post({"max_tokens": 1}).status_code == 200


def test_slow_and_idle_connections_are_closed_at_the_header_deadline(tiny_gguf_path, config_path):
    """--http-header-timeout: a connection that has not sent a whole request line and headers in time (one
    trickling them, slowloris; one idle from its opening, or after its answer) is closed, and a body not
    whole in that time is a 408, while a client that sends its request in time is answered; a request still
    being answered is not cut."""
    import socket

    for s in http_server(tiny_gguf_path, config_path, "--http-header-timeout", "1.5"):
        host, port = s.http.split("//")[1].split(":")
        idle, slow, used, body = (socket.create_connection((host, int(port)), timeout=10) for _ in range(4))
        slow.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # the body never whole: a 408
        used.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # answered, then a next request begun:
        time.sleep(0.5)
        used.sendall(b"G")  # (its first byte stops uvicorn's own keep-alive timer: only the deadline closes it)
        with httpx.stream("POST", s.http + "/v1/completions", timeout=60, json={
                "prompt": "hi", "max_tokens": 64, "ignore_eos": True, "stream": True}) as long:
            chunks = long.iter_text()
            first = next(chunks)
            time.sleep(2.5)  # read on past the deadline: its request came whole, it is not cut
            assert (first + "".join(chunks)).rstrip().endswith("data: [DONE]")
        for sock in (idle, slow):
            assert sock.recv(1) == b"", "still open"  # closed by the server
        answer = b"".join(iter(lambda: used.recv(65536), b""))  # its answer, then closed
        assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
        answer = body.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408") and b"body: not received whole within 1.5 s" in answer, answer
        assert httpx.get(s.http + "/v1/models", timeout=10).status_code == 200


def test_a_models_generation_config_gives_the_sampling_a_request_leaves_out(tmp_path, tiny_model, config_path):
    """A model directory whose generation_config.json recommends temperature 0: a completion that names no temperature
    is greedy (the tokens of temperature 0, not of OpenAI's 1 with the same seed), one that names it samples; the
    start banner says where the defaults came from (vLLM's --generation-config auto); the gRPC API takes them for the
    SamplingParameters a request leaves unset, and says them in GetServerInfo."""
    from jaxcb.model.llama import params_to_weights
    from tests.test_model_dirs import write_hf_dir

    config, params, tok, _ = tiny_model
    path = str(tmp_path / "hf")
    write_hf_dir(path, config, {k: np.asarray(v) for k, v in params_to_weights(params).items()}, tok)
    gen = os.path.join(path, "generation_config.json")
    with open(gen) as f:
        raw = json.load(f)
    with open(gen, "w") as f:
        json.dump({**raw, "temperature": 0.0, "top_k": 5}, f)
    for server in http_server(path, config_path):
        body = {"model": "hf", "prompt": [5, 9, 14, 30], "max_tokens": 12, "seed": 7, "ignore_eos": True}

        def tokens(**extra):
            r = httpx.post(server.http + "/v1/completions", json={**body, **extra, "logprobs": 0}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["logprobs"]["tokens"]

        assert tokens() == tokens(temperature=0.0)
        assert tokens(temperature=1.0, top_k=0) != tokens()
        assert "sampling defaults, from the model's generation_config.json: temperature 0.0, top_k 5" in server.output()
        with Client(server.target) as c:
            assert dict(c.server_info().sampling_defaults) == {"temperature": 0.0, "top_k": 5.0}
            texts = [c.complete(token_ids=body["prompt"], max_tokens=12, ignore_eos=True, seed=7, **sampling).text
                     for sampling in ({}, {"temperature": 1.0})]
        http_texts = [httpx.post(server.http + "/v1/completions", json={**body, **extra}, timeout=60).json()
                      ["choices"][0]["text"] for extra in ({}, {"temperature": 1.0}, {"temperature": 1.0, "top_k": 0})]
        assert texts == http_texts[:2] and http_texts[1] != http_texts[2]  # (top_k 5, not 0, where it is left out)
