"""Tool calls in the OpenAI chat API (serve/tool_calls.py): the request's tools checked, rendered and
parsed back, whole and as streamed deltas, whatever way the answer's text is cut into pieces."""

import json
import random

import re

import pytest

from jaxcb.host.errors import InvalidRequest
from serve import tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "now"}}


def _tools(choice="auto"):
    return tool_calls.parse_tools({"tools": [WEATHER, CLOCK], "tool_choice": choice})


ANSWERS = [
    ("Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris \\\"}{\"}}\n</tool_call>",
     "Sure.", [("get_weather", {"city": "Paris \"}{"})]),
    ('<tool_call>{"name":"get_time","arguments":{}}</tool_call><tool_call>{"name":"get_weather","arguments":'
     '{"city":"Oslo"}}</tool_call>', "", [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>', "",
     [("get_weather", {"city": "Rome"})]),  # arguments first: the call comes whole at the block's end
    ("no call here, just < and <tool", "no call here, just < and <tool", []),
    ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', '<tool_call>{"name": "unknown", '
     '"arguments": {}}</tool_call>', []),  # not one of the tools: it stays text
]


@pytest.mark.parametrize("text, content, calls", ANSWERS)
def test_answers_parse_whole_and_streamed_in_any_pieces(text, content, calls):
    tools = _tools()
    got_content, got_calls = tool_calls.parse(text, tools)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        stream = tool_calls.CallStream(tools)
        streamed, deltas = "", []
        for i, piece in enumerate(pieces):
            c, d = stream.feed(piece, final=i == len(pieces) - 1)
            streamed += c
            deltas += d
        merged = {}
        for d in deltas:
            call = merged.setdefault(d["index"], {"name": None, "arguments": ""})
            call["name"] = d["function"].get("name") or call["name"]
            call["arguments"] += d["function"]["arguments"]
        assert [(c["name"], json.loads(c["arguments"])) for c in merged.values()] == calls
        if not calls:
            assert streamed == text
        else:
            assert streamed.strip() == content


@pytest.mark.parametrize("text, content, calls", [
    ('Ok.<tool_call>{"name":"get_time","arguments":{}}</tool_call><tool_call>{"name": "get_weather", "arguments": '
     '{"city": "Os', "Ok.", [("get_time", "{}"), ("get_weather", '{"city": "Os')]),
    ('<tool_call>{"name": "get_weather", "argu', '<tool_call>{"name": "get_weather", "argu', []),  # no call named yet
    ('<tool_call>{"name": "unknown", "arguments": {"a', '<tool_call>{"name": "unknown", "arguments": {"a', []),
])
def test_a_call_cut_off_by_max_tokens_is_the_same_whole_and_streamed(text, content, calls):
    """An answer that ends inside a call block (max_tokens): once the block has named one of the tools it
    is that call with the arguments written so far, whole and streamed alike (the stream once sent the
    call's deltas and then its block again as text); before that, or for an unknown name, it is text."""
    tools = _tools("required")
    got_content, got_calls = tool_calls.parse(text, tools)
    assert (got_content, [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls]) == (content, calls)
    for step in (1, 3, 7, len(text)):
        stream = tool_calls.CallStream(tools)
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        streamed, merged = "", {}
        for i, piece in enumerate(pieces):
            c, deltas = stream.feed(piece, final=i == len(pieces) - 1)
            streamed += c
            for d in deltas:
                call = merged.setdefault(d["index"], {"name": None, "arguments": ""})
                call["name"] = d["function"].get("name") or call["name"]
                call["arguments"] += d["function"]["arguments"]
        assert (streamed.strip(), [(c["name"], c["arguments"]) for c in merged.values()]) == (content, calls), step


def test_tools_and_messages_render_for_the_chat_template():
    tools = _tools("required")
    messages = tool_calls.render_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ], tools)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert messages[3]["content"] == "<tool_response>rain</tool_response>"
    assert tool_calls.constraint(tools).kind == "grammar"
    assert tool_calls.constraint(_tools("auto")) is None
    none = _tools("none")
    assert tool_calls.render_messages([{"role": "user", "content": "x"}], none) == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("body, message", [
    ({"tools": []}, "tools: must be a non-empty list"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name: 'get_weather' is given twice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice: 'sometimes' is not one of"),
    ({"tool_choice": "required"}, "tool_choice: needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls: must be true or false"),
])
def test_bad_tools_are_refused_by_name(body, message):
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        tool_calls.parse_tools(body)


@pytest.mark.parametrize("parameters, message", [
    ({"type": "objec"}, "tools[1].function.parameters: not a valid json (Invalid type: objec)"),
    ({"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}},
     'tools[1].function.parameters: the schema uses keywords that cannot be enforced while generating: ["uniqueItems"]'),
])
def test_a_tool_schema_that_cannot_constrain_is_refused_naming_the_tool(make_llm, parameters, message):
    """tool_choice required (or a named tool) constrains the answer by the tools' schemas: one that
    llguidance cannot compile is named by its place in `tools`, not as the grammar built from them."""
    grammars = make_llm().engine.grammars
    bad = {"type": "function", "function": {"name": "bad", "parameters": parameters}}
    for choice in ("required", {"type": "function", "function": {"name": "bad"}}):
        tools = tool_calls.parse_tools({"tools": [WEATHER, bad], "tool_choice": choice})
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            grammars.compile(tool_calls.constraint(tools))
    grammars.compile(tool_calls.constraint(tool_calls.parse_tools({"tools": [WEATHER, bad], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})))  # only the named tool's schema is used
