"""Anthropic's Messages API (serve.anthropic_messages) through Anthropic's own SDK: the chat's answers
over the same conversation, streamed as its events, tools as tool_use / tool_result blocks, its error
shape naming the call's fields, x-api-key as the bearer token."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.server_util import http_server, wait_pool_whole
from serve.client import Client

KEY = "k3y"
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tiny model with a 2,048-token context (room for the tools' system text), behind a token."""
    from tests.tiny_gguf import tiny_model_config, write_tiny_gguf

    path = tmp_path_factory.mktemp("anthropic") / "long.toml"
    model = str(path.parent / "tiny-long.gguf")
    write_tiny_gguf(model, tiny_model_config(max_context=2048))
    path.write_text("[model]\ncompile = \"fast\"\njson_whitespace = \"compact\"\n[cache]\npage_size = 16\nnum_pages = 256\n[scheduler]\n"
                    "max_context = 2048\nmax_prefill_tokens = 256\n[buckets]\ndecode_batch = [1, 4]\n"
                    "prefill_tokens = [256]\n")
    yield from http_server(model, str(path), "--auth-token", KEY)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.http, api_key=KEY, max_retries=0)  # (x-api-key)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0)


def _pool_whole(server):
    with Client(server.target, token=KEY) as c:
        return wait_pool_whole(c, 10.0)


def test_messages_answer_as_the_chat_does_whole_and_streamed(server, claude, oai):
    extra = {"ignore_eos": True, "temperature": 0}  # (temperature: older clients' field; the SDK no longer has it)
    chat = oai.chat.completions.create(model="tiny-long", max_tokens=7, temperature=0, extra_body=extra, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello\nthere"}, {"role": "user", "content": "and?"}])
    conversation = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
                    {"role": "user", "content": [{"type": "text", "text": "and?", "cache_control": {"type": "ephemeral"}}]}]
    m = claude.messages.create(model="tiny-long", system=[{"type": "text", "text": "be brief"}], messages=conversation,
                               max_tokens=7, extra_body=extra)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny-long" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert (m.usage.input_tokens + m.usage.cache_read_input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, 7)
    counted = claude.messages.count_tokens(model="tiny-long", system="be brief", messages=conversation)
    assert counted.input_tokens == chat.usage.prompt_tokens
    same = claude.messages.count_tokens(model="tiny-long", system="be brief", messages=conversation,  # (a create's
                                        extra_body={"max_tokens": 7, "temperature": 0.5})  # fields: taken, no count)
    assert same.input_tokens == counted.input_tokens
    with claude.messages.stream(model="tiny-long", system="be brief", messages=conversation, max_tokens=7,
                                extra_body=extra) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 7 and final.usage.input_tokens == m.usage.input_tokens
    raw = [e.type for e in claude.messages.create(model="tiny-long", system="be brief", messages=conversation,
                                                    max_tokens=7, extra_body=extra, stream=True)]
    assert raw[:2] == ["message_start", "content_block_start"] and raw[-3:] == ["content_block_stop", "message_delta",
                                                                                 "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"} and "message_stop" in kinds
    # a stop sequence met: stop_reason stop_sequence, naming it; the text before it
    text = m.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if stop.strip():
        cut = claude.messages.create(model="tiny-long", system="be brief", messages=conversation, max_tokens=7,
                                     stop_sequences=[stop], extra_body=extra)
        assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
        assert cut.content[0].text == text[:text.index(stop)]


def test_a_max_tokens_past_the_context_is_cut_to_the_room_and_a_prompt_past_it_is_too_long(server, claude, oai):
    """max_tokens is required here, and clients set it for far larger contexts (LangChain's ChatAnthropic 4,096,
    LiteLLM 128,000): cut to the room the prompt leaves (as vLLM cuts it), the answer ends with max_tokens. A
    prompt past the context is refused in words Anthropic's clients look for ("prompt is too long"); the OpenAI
    API's in OpenAI's ("This model's maximum context length is")."""
    words = 400
    for _ in range(3):  # (a prompt that leaves a few dozen tokens of the 2,048)
        content = "word " * words
        n = claude.messages.count_tokens(model="tiny-long", messages=[{"role": "user", "content": content}]).input_tokens
        words = max(1, int(words * 2000 / n))
    assert 1900 < n < 2040
    m = claude.messages.create(model="tiny-long", messages=[{"role": "user", "content": content}], max_tokens=4096,
                               extra_body={"ignore_eos": True, "temperature": 0})
    assert m.stop_reason == "max_tokens" and m.usage.input_tokens + m.usage.cache_read_input_tokens == n
    assert m.usage.output_tokens == 2048 - n
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny-long", messages=[{"role": "user", "content": content * 2}], max_tokens=8)
    assert "prompt is too long" in e.value.message and "messages" in e.value.message, e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny-long", messages=[{"role": "user", "content": content * 2}], max_tokens=8)
    assert e.value.code == "context_length_exceeded" and "This model's maximum context length is 2048 tokens" in \
        e.value.message, e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # (the OpenAI API's max_tokens is its own: refused, as OpenAI's)
        oai.chat.completions.create(model="tiny-long", messages=[{"role": "user", "content": "hi"}], max_tokens=4096)
    assert e.value.code == "context_length_exceeded"


def test_tools_as_tool_use_and_tool_result_blocks(server, claude, oai):
    """tool_choice any: the chat's required call as a tool_use block (whole and streamed as input_json
    deltas); the call and a tool_result back answer as the chat answers the same messages."""
    tool = {"type": "function", "function": {k if k != "input_schema" else "parameters": v for k, v in WEATHER.items()}}
    question = [{"role": "user", "content": "weather in Paris?"}]
    chat = oai.chat.completions.create(model="tiny-long", messages=question, tools=[tool], tool_choice="required",
                                       max_tokens=200, temperature=1.0, seed=1, parallel_tool_calls=False)
    [want] = chat.choices[0].message.tool_calls
    m = claude.messages.create(model="tiny-long", messages=question, tools=[WEATHER], max_tokens=200,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               extra_body={"seed": 1, "temperature": 1.0})
    [use] = m.content
    assert use.type == "tool_use" and use.name == want.function.name and use.input == json.loads(want.function.arguments)
    assert m.stop_reason == "tool_use"
    with claude.messages.stream(model="tiny-long", messages=question, tools=[WEATHER], max_tokens=200,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body={"seed": 1, "temperature": 1.0}) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", use.name, use.input)]
    assert final.stop_reason == "tool_use"  # (a named tool's call too: the chat's finish is "stop" there)
    named = claude.messages.create(model="tiny-long", messages=question, tools=[WEATHER], max_tokens=200,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   extra_body={"seed": 1, "temperature": 1.0})
    assert named.stop_reason == "tool_use" and [b.type for b in named.content] == ["tool_use"]
    follow_chat = oai.chat.completions.create(model="tiny-long", max_tokens=6, temperature=0, tools=[tool], messages=[
        *question, {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny"}], extra_body={"ignore_eos": True})
    follow = claude.messages.create(model="tiny-long", max_tokens=6, tools=[WEATHER], messages=[
        *question, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "sunny"}]}]}],
                                    extra_body={"ignore_eos": True, "temperature": 0})
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens == follow_chat.usage.prompt_tokens
    assert "".join(b.text for b in follow.content if b.type == "text") == (follow_chat.choices[0].message.content or "")


def test_prefill_output_format_and_hints(server, claude, oai):
    """A last assistant message is continued (the chat's continue_final_message); output_config.format is the
    chat's response_format (the same JSON); what newer SDKs send as hints (cache_control, speed, metadata) is
    taken."""
    extra = {"ignore_eos": True, "temperature": 0}
    prefilled = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    chat = oai.chat.completions.create(model="tiny-long", messages=prefilled, max_tokens=5, extra_body={
        **extra, "continue_final_message": True, "add_generation_prompt": False})
    m = claude.messages.create(model="tiny-long", messages=prefilled, max_tokens=5, extra_body={
                                   **extra, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
                               cache_control={"type": "ephemeral"}, speed="standard", metadata={"user_id": "u1"},
                               extra_headers={"anthropic-beta": "context-management-2025-06-27"},
                               thinking={"type": "adaptive", "display": "summarized"})
    assert m.content[0].text == chat.choices[0].message.content
    assert claude.messages.count_tokens(model="tiny-long", messages=prefilled).input_tokens == chat.usage.prompt_tokens
    thought = [prefilled[0], {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""}]}]
    fresh = claude.messages.create(model="tiny-long", messages=prefilled[:1], max_tokens=5, extra_body=extra)
    assert claude.messages.create(model="tiny-long", messages=thought, max_tokens=5,  # (thinking alone: no prefill)
                                  extra_body=extra).content[0].text == fresh.content[0].text
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
    want = oai.chat.completions.create(model="tiny-long", messages=[{"role": "user", "content": "x"}], max_tokens=12,
                                       temperature=0, response_format={"type": "json_schema",
                                                                       "json_schema": {"name": "s", "schema": schema}})
    got = claude.messages.create(model="tiny-long", messages=[{"role": "user", "content": "x"}], max_tokens=12,
                                 output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
                                 extra_body={"temperature": 0})
    assert got.content[0].text == want.choices[0].message.content and isinstance(json.loads(got.content[0].text)["a"], bool)


@pytest.mark.parametrize("body, status, message", [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens: required"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens: must be at least 1"),
    ({"max_tokens": "many", "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens: must be"),
    ({"max_tokens": 4, "messages": []}, 400, "messages: must be a non-empty list"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400, "messages[0].role: must be user or"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "messages[0].content[0].type: 'image' is not supported"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "colour": 1}]}]}, 400,
     "messages[0].content[0].colour: not a field of a text block"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                                  "input": {}}]}]}, 400,
     "messages[0].content[0].type: tool_use blocks are an assistant's"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "x"}, 400,
     "stop_sequences: must be a list of strings"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305",
                                                                                 "name": "w"}]}, 400,
     "tools[0].type: 'web_search_20250305' is not supported"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "tool_choice.name"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [
        dict(WEATHER, input_schema={"type": "objec"})]}, 400, "tools[0].input_schema"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}}, 400,
     "thinking.budget_tokens: must be an integer"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "objec"}}}}, 400,
     "output_config.format.schema"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "huge"}}, 400,
     "output_config.effort: must be one of"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "speed": 3}, 400, "speed: must be a string"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "context_management": []}, 400,
     "context_management: must be an object"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "mcp_servers": []}, 400,
     "mcp_servers: MCP servers are not served"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "colour": 1}, 400, "colour: not a field"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": []}]}, 400, "messages: every message is empty"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm",
                                                                       "signature": ""}]}]}, 400,
     "messages: every message is empty"),
    ({"model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, 404,
     "model: 'claude-x' is not served here"),
])
def test_refusals_in_anthropics_shape_naming_the_field(server, body, status, message):
    r = httpx.post(server.http + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == status, r.text
    got = r.json()
    assert got["type"] == "error" and got["error"]["message"].startswith(message), got
    assert got["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]


def test_the_key_is_needed_and_a_gone_client_frees_its_request(server, claude):
    r = httpx.post(server.http + "/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
                   headers={"x-api-key": "wrong"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.http, api_key="wrong", max_retries=0).messages.count_tokens(
            model="tiny-long", messages=[{"role": "user", "content": "x"}])
    with httpx.stream("POST", server.http + "/v1/messages", headers={"x-api-key": KEY}, timeout=60, json={
            "max_tokens": 1000, "stream": True, "ignore_eos": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                break
    info = _pool_whole(server)
    assert info.pages_free == info.pages_total and info.running == 0


def test_the_stream_translation_of_thinking_calls_and_errors():
    """The translation on its own: thinking (a server with a reasoning parser), text, a call's argument
    deltas, each its own block in order; a stop sequence; a mid-stream error as an error event."""
    from serve.anthropic_messages import _events, reshape

    def chunk(**fields):
        return f"data: {json.dumps({'model': 'm', 'choices': [], **fields}, ensure_ascii=False)}\n\n"

    def choice(finish=None, **delta):
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "stop_reason": "END" if finish else None}]}

    async def chat(*chunks):
        for c in chunks:
            yield c

    async def events(body, *chunks):
        return [json.loads(e.split("\ndata: ", 1)[1]) async for e in _events(chat(*chunks), body, [])]

    usage = {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}
    opening = chunk(usage={"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9},  # (the chat's first
                    **choice(role="assistant", content=""))  # chunk, before the engine's usage: no message yet)
    got = asyncio.run(events({"stop_sequences": ["END"]}, opening, chunk(usage=usage, **choice(reasoning_content="hm")),
                             chunk(**choice(content="a\u2028b")),
                             chunk(**choice(tool_calls=[{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{\"x\""}}])),
                             chunk(**choice(tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}])),
                             chunk(**choice(finish="stop")), chunk(usage=dict(usage, completion_tokens=5)), "data: [DONE]\n\n"))
    assert got[0]["type"] == "message_start" and got[0]["message"]["usage"]["input_tokens"] == 5
    assert got[0]["message"]["usage"]["cache_read_input_tokens"] == 4
    starts = [e["content_block"]["type"] for e in got if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = [(e["index"], e["delta"]) for e in got if e["type"] == "content_block_delta"]
    assert deltas == [(0, {"type": "thinking_delta", "thinking": "hm"}), (1, {"type": "text_delta", "text": "a\u2028b"}),
                      (2, {"type": "input_json_delta", "partial_json": "{\"x\""}),
                      (2, {"type": "input_json_delta", "partial_json": ": 1}"})]
    assert [e["index"] for e in got if e["type"] == "content_block_stop"] == [0, 1, 2]
    assert got[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert got[-2]["usage"]["output_tokens"] == 5 and got[-1]["type"] == "message_stop"
    got = asyncio.run(events({}, chunk(**choice(content="a")),
                             f"data: {json.dumps({'error': {'message': 'step failed', 'type': 'internal_server_error'}})}\n\n"))
    assert got[-1] == {"type": "error", "error": {"type": "api_error", "message": "step failed"}}
    whole = reshape({"model": "m", "usage": usage, "choices": [{"finish_reason": "tool_calls", "message": {
        "content": None, "reasoning_content": "hm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}}]}, {}, [])
    assert [b["type"] for b in whole["content"]] == ["thinking", "tool_use"] and whole["stop_reason"] == "tool_use"
    assert whole["content"][1]["input"] == {"x": 1}


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 40) | st.floats(-3, 3) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=8)
_BLOCK = st.dictionaries(st.sampled_from(["type", "text", "id", "name", "input", "tool_use_id", "content", "is_error"]),
                         st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "x", "f"]) | _JSON,
                         max_size=5)
_ROLE = st.sampled_from(["user", "assistant"])
_MESSAGE = st.fixed_dictionaries({"role": st.one_of(_ROLE, _ROLE, _ROLE, _JSON)},  # (mostly well formed: some are answered)
                                 optional={"content": st.one_of(st.text(max_size=8), st.text(max_size=8),
                                                                st.lists(_BLOCK, max_size=3), _JSON)})
_BODY = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(_MESSAGE, min_size=1, max_size=3), st.lists(_MESSAGE, min_size=1, max_size=3), _JSON)},
    optional={"max_tokens": st.integers(-1, 6) | _JSON, "system": st.text(max_size=8) | _JSON, "stream": st.booleans(),
              "stop_sequences": st.lists(st.text(max_size=3), max_size=2) | _JSON,
              "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "a b"]) | _JSON},
                                                      optional={"input_schema": _JSON, "type": _JSON}), max_size=2) | _JSON,
              "tool_choice": _JSON | st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])}),
              "thinking": _JSON, "output_config": _JSON, "metadata": _JSON, "temperature": st.floats(0, 2) | _JSON,
              "bogus": _JSON})
_GOOD = st.fixed_dictionaries(  # well formed: these are answered
    {"messages": st.lists(st.fixed_dictionaries({"role": _ROLE, "content": st.text(max_size=8) | st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), min_size=1, max_size=2)}),
        min_size=1, max_size=3)},
    optional={"system": st.text(max_size=8), "stream": st.booleans(), "stop_sequences": st.lists(st.text(max_size=3), max_size=2),
              "max_tokens": st.integers(1, 6)})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_GOOD | _BODY)
def test_fuzzed_bodies_are_answered_or_refused_by_name(server, body):
    """Random bodies on /v1/messages: an answer (whole, or streamed to message_stop) or a 4xx in Anthropic's
    shape naming the field, never a 5xx."""
    from tools.stress import FIELD_MESSAGE

    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 6:
        body["max_tokens"] = 6
    body.setdefault("max_tokens", 4)
    with httpx.stream("POST", server.http + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        text = r.read().decode()
    event(f"status {r.status_code}")
    assert r.status_code < 500, text
    if r.status_code >= 400:
        error = json.loads(text)
        assert error["type"] == "error" and FIELD_MESSAGE.match(error["error"]["message"]), text
    elif body.get("stream") is True:
        assert text.rstrip().endswith('"type": "message_stop"}'), text[-300:]
    else:
        assert json.loads(text)["type"] == "message"
