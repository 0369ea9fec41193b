"""Tool calls in the OpenAI chat API (jaxcb/host/tool_calls.py): the request's tools checked, rendered and
parsed back, whole and as streamed deltas, whatever way the answer's text is cut into pieces."""

import dataclasses
import json
import random

import re

import pytest

from jaxcb.host.errors import InvalidRequest
from jaxcb.host import tool_calls, tool_parse

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "now"}}


def _tools(choice="auto"):
    return tool_calls.parse_tools({"tools": [WEATHER, CLOCK], "tool_choice": choice})


def _streamed(tools, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The content and the calls (name, arguments text) a stream of `pieces` gives, deltas merged."""
    stream, content, merged = tool_parse.CallStream(tools), "", {}
    for i, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += c
        for d in deltas:
            call = merged.setdefault(d["index"], {"name": None, "arguments": ""})
            call["name"] = d["function"].get("name") or call["name"]
            call["arguments"] += d["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for c in merged.values()]


def _random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


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
    got_content, got_calls = tool_parse.parse(text, tools)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    rng = random.Random(0)
    for _ in range(30):
        streamed, merged = _streamed(tools, _random_pieces(text, rng))
        assert [(name, json.loads(arguments)) for name, arguments in merged] == calls
        if not calls:
            assert streamed == text
        else:
            assert streamed.strip() == content


def test_a_required_call_has_no_content_beside_it():
    """tool_choice required or a named function: the answer is the grammar's calls; what is between them
    (a newline, or the next call's marker cut off by max_tokens) is not sent as content, whole or streamed."""
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_ca'
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        tools = _tools(choice)
        content, calls = tool_parse.parse(text, tools)
        assert (content, [c["function"]["name"] for c in calls]) == ("", ["get_time"])
        assert _streamed(tools, [text[i:i + 5] for i in range(0, len(text), 5)]) == ("", [("get_time", "{}")])
    assert tool_parse.parse(text, _tools("auto"))[0] == "<tool_ca"  # (in auto mode it may be text)


@pytest.mark.parametrize("text, content, calls", [
    ('Ok.<tool_call>{"name":"get_time","arguments":{}}</tool_call><tool_call>{"name": "get_weather", "arguments": '
     '{"city": "Os', "Ok.", [("get_time", "{}"), ("get_weather", '{"city": "Os')]),
    ('<tool_call>{"name": "get_weather", "argu', "", [("get_weather", "")]),  # named: that call, no arguments yet
    ('<tool_call>{"name": "get_wea', '<tool_call>{"name": "get_wea', []),  # no call named yet
    ('<tool_call>{"name": "get_\\q", "arguments": {}', '<tool_call>{"name": "get_\\q", "arguments": {}', []),
    ('<tool_call>{"name": "unknown", "arguments": {"a', '<tool_call>{"name": "unknown", "arguments": {"a', []),
])
def test_a_call_cut_off_by_max_tokens_is_the_same_whole_and_streamed(text, content, calls):
    """An answer that ends inside a call block (max_tokens): once the block has named one of the tools it
    is that call with the arguments written so far (none yet once the name is whole), whole and streamed
    alike (the stream once sent the call's deltas and then its block again as text); before that, or for
    an unknown name (or no JSON string), it is text."""
    tools = _tools("auto")
    got_content, got_calls = tool_parse.parse(text, tools)
    assert (got_content, [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls]) == (content, calls)
    for step in (1, 3, 7, len(text)):
        streamed, merged = _streamed(tools, [text[i:i + step] for i in range(0, len(text), step)])
        assert (streamed.strip(), merged) == (content, calls), step


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
    # a parallel call's results: one user turn, in order (as Qwen's template writes them); a template that makes turns
    # alternate (Gemma 3's) refused two user turns in a row
    parallel = tool_calls.render_messages([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{c}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{c}"}}'}}
            for c in ("Oslo", "Rome")]},
        {"role": "tool", "tool_call_id": "call_Oslo", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_Rome", "content": "sun"},
        {"role": "user", "content": "thanks"}], tools)
    assert [m["role"] for m in parallel] == ["system", "user", "assistant", "user", "user"]
    assert parallel[3]["content"] == "<tool_response>rain</tool_response>\n<tool_response>sun</tool_response>"
    assert tool_calls.constraint(tools).kind == "grammar"
    assert tool_calls.constraint(_tools("auto")) is None
    none = _tools("none")
    assert tool_calls.render_messages([{"role": "user", "content": "x"}], none) == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("body, message", [
    ({"tools": [], "tool_choice": "required"}, "tool_choice: needs tools"),
    ({"tools": {"f": 1}}, "tools: must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name: 'get_weather' is given twice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice: 'sometimes' is not one of"),
    ({"tool_choice": "required"}, "tool_choice: needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters: must be an object schema"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls: must be true or false"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": [1]}}}]},
     "tools[0].function.parameters.properties: must be an object of schemas"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": [["a"]]}}}]},
     "tools[0].function.parameters.required: must be a list of names"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}", "description": "w " * 40_000}} for i in range(20)]},
     f"tools: more than {tool_calls.MAX_TOOLS_CHARS} characters of descriptions and parameters in all .past it at "
     "tools[13].; the limit"),
])
def test_bad_tools_are_refused_by_name(body, message):
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        tool_calls.parse_tools(body)


@pytest.mark.parametrize("parameters, message", [
    ({"type": "object", "properties": {"a": {"type": "strin"}}},
     "tools[1].function.parameters: not a JSON schema that can be enforced (Invalid type: strin)"),
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


# ---- a chat template's own tool format (jaxcb.host.tool_calls.choose_format) ----
# Templates written for these tests, in the two styles models are trained on: one that lists the tools
# and writes calls as <tool_call> blocks (Hermes, Qwen), one that asks for a {"name", "parameters"}
# object (Llama 3.1-3.3).
BLOCK_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\nCall one as "
    "<tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
    "{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>{% else %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
OBJECT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ 'ipython' if m.role == 'tool' else m.role }}\n"
    "{% if tools and loop.last %}Answer with {\"name\": function name, \"parameters\": its arguments} to call "
    "one of {{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}.\n{% endif %}"
    "{% if m.tool_calls %}{\"name\": \"{{ m.tool_calls[0].function.name }}\", \"parameters\": "
    "{{ m.tool_calls[0].function.arguments | tojson }}}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LIST_TEMPLATE = (
    "{% for m in messages %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}"
    "{% for c in m.tool_calls %}{% if c.id | length != 9 %}{{ raise_exception('ids of 9') }}{% endif %}"
    "{% endfor %}</s>{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.tool_call_id }}: {{ m.content }}[/TOOL_RESULTS]"
    "{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}")
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
XML_TEMPLATE = (  # Qwen3-Coder's way: a call's arguments as <parameter=...> elements (a string as it is)
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n<function>\n<name>{{ t.function.name }}</name>"
    "</function>{% endfor %}\n</tools>\nCall as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls %}\n<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments | items %}<parameter={{ k }}>\n"
    "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}\n</parameter>\n"
    "{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GLM_TEMPLATE = (  # GLM-4.5's kind: the name, then a key and a value element per argument
    "{% if tools %}<|system|>Call functions as <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>"
    "{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for c in m.tool_calls or [] %}\n<tool_call>"
    "{{ c.function.name }}\n{% for k, v in c.function.arguments | items %}<arg_key>{{ k }}</arg_key>\n<arg_value>"
    "{{ v | tojson if v is not string else v }}</arg_value>\n{% endfor %}</tool_call>{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
DS_TEMPLATE = (  # DeepSeek-V3.1's kind: name-first calls between <｜tool▁sep｜>-marked markers
    "{% for m in messages %}{{ m.content }}{% if m.tool_calls %}<｜tool▁calls▁begin｜>{% for c in m.tool_calls %}"
    "<｜tool▁call▁begin｜>{{ c.function.name }}<｜tool▁sep｜>{{ c.function.arguments | tojson }}<｜tool▁call▁end｜>"
    "{% endfor %}<｜tool▁calls▁end｜>{% endif %}{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}")
DS_R1_TEMPLATE = DS_TEMPLATE.replace(  # DeepSeek-V3-0324's and R1's: the type first, the arguments in a fence
    "<｜tool▁call▁begin｜>{{ c.function.name }}<｜tool▁sep｜>{{ c.function.arguments | tojson }}",
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c.function.name }}\n```json\n{{ c.function.arguments | tojson }}\n```")
MINIMAX_TEMPLATE = (  # MiniMax-M2's kind: <invoke> elements in a <minimax:tool_call> block
    "{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}<minimax:tool_call>\n<invoke name=\""
    "{{ c.function.name }}\">\n{% for k, v in c.function.arguments | items %}<parameter name=\"{{ k }}\">{{ v }}"
    "</parameter>\n{% endfor %}</invoke>\n</minimax:tool_call>{% endfor %}{% endfor %}{{ tools | tojson }}")
V11_TEMPLATE = LIST_TEMPLATE.replace(  # Mistral's tokenizers from v11: each call its marker, name, [ARGS], arguments
    "[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}",
    "{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}")


def test_the_format_is_the_templates_own_where_it_renders_tools():
    assert tool_calls.choose_format(BLOCK_TEMPLATE) == (tool_calls.HERMES, True)
    assert tool_calls.choose_format(OBJECT_TEMPLATE) == (tool_calls.LLAMA3_JSON, True)
    assert tool_calls.choose_format(LIST_TEMPLATE) == (tool_calls.MISTRAL, True)
    assert tool_calls.choose_format(V11_TEMPLATE) == (tool_calls.MISTRAL_V11, True)
    assert tool_calls.choose_format(XML_TEMPLATE) == (tool_calls.QWEN3_CODER, True)  # (its <tool_call>: not hermes)
    assert tool_calls.choose_format(GLM_TEMPLATE) == (tool_calls.GLM45, True)
    assert tool_calls.choose_format(MINIMAX_TEMPLATE) == (tool_calls.MINIMAX_M2, True)
    assert tool_calls.choose_format(DS_TEMPLATE) == (tool_calls.DEEPSEEK_V31, True)
    assert tool_calls.choose_format(DS_R1_TEMPLATE) == (tool_calls.DEEPSEEK_V3, True)
    assert tool_calls.choose_format(PLAIN_TEMPLATE, "glm47") == (tool_calls.GLM45, False)  # (vLLM's name for 4.7's)
    # vLLM's "mistral" parser reads either: the one the template writes
    assert tool_calls.choose_format(V11_TEMPLATE, "mistral") == (tool_calls.MISTRAL_V11, True)
    assert tool_calls.choose_format(LIST_TEMPLATE, "mistral") == (tool_calls.MISTRAL, True)
    granite = LIST_TEMPLATE.replace("[TOOL_CALLS]", "<|tool_call|>")
    assert tool_calls.choose_format(granite) == (tool_calls.GRANITE, True)
    assert tool_calls.choose_format(PLAIN_TEMPLATE) == (tool_calls.HERMES, False)  # jaxcb renders them
    assert tool_calls.choose_format(None) == (tool_calls.HERMES, False)
    # a template that reads tools in a format not recognised: jaxcb's rendering, not the template's
    odd = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert tool_calls.choose_format(odd) == (tool_calls.HERMES, False)
    # the server's --tool-call-parser names the format; the template renders the tools if it reads them
    assert tool_calls.choose_format(odd, "llama3_json") == (tool_calls.LLAMA3_JSON, True)
    assert tool_calls.choose_format(PLAIN_TEMPLATE, "llama3_json") == (tool_calls.LLAMA3_JSON, False)


def _object_tools(choice="auto", fmt=tool_calls.LLAMA3_JSON):
    return dataclasses.replace(_tools(choice), fmt=fmt, native=True)


OBJECT_ANSWERS = [
    ('{"name": "get_weather", "parameters": {"city": "Paris \\"}{"}}', "", [("get_weather", {"city": "Paris \"}{"})]),
    ('\n {"name":"get_time","arguments":{}} Done.', "Done.", [("get_time", {})]),  # "arguments" is read too
    ('{"parameters": {"city": "Rome"}, "name": "get_weather"}', "", [("get_weather", {"city": "Rome"})]),
    ('It is {"name": "get_time", "parameters": {}}', 'It is {"name": "get_time", "parameters": {}}', []),
    ('{"answer": [1, {"b": "}"}]} and more', '{"answer": [1, {"b": "}"}]} and more', []),  # JSON, no call
    ('{"name": "unknown", "parameters": {}}', '{"name": "unknown", "parameters": {}}', []),
]


LIST_ANSWERS = [  # mistral: [TOOL_CALLS] is a control token, so the answer's text begins with the list
    (' [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name":"get_time","arguments":{}}]',
     "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {}}] ok', "ok", [("get_time", {})]),  # the token as text
    ("[link](x) is text", "[link](x) is text", []),
    ("[]", "[]", []),
    ('[{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}, 7] and',
     "7] and", [("get_time", {})]),  # the first object a call: a later one that is none is left out, and
    # what is no object ends the calls
    ('[{"name": "nope", "arguments": {}}, {"name": "get_time", "arguments": {}}]',
     '[{"name": "nope", "arguments": {}}, {"name": "get_time", "arguments": {}}]', []),  # the first none: text
    ("[TOOL_CALLS] plain", "[TOOL_CALLS] plain", []),
]


def test_a_list_of_calls_streams_each_call_as_it_is_written():
    """mistral and granite: each call of the list is sent as soon as its name is written and its arguments
    as they come, not when the list ends (the list shape was held back whole until then)."""
    tools = _object_tools(fmt=tool_calls.MISTRAL)
    stream = tool_parse.CallStream(tools)
    sent = [stream.feed(piece)[1] for piece in ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa',
                                                'ris"}}, {"name": "get_time", ', '"arguments": {')]
    assert [[(d["index"], d["function"]) for d in deltas] for deltas in sent] == [
        [(0, {"name": "get_weather", "arguments": ""}), (0, {"arguments": '{"city": "Pa'})],
        [(0, {"arguments": 'ris"}'})],
        [(1, {"name": "get_time", "arguments": ""}), (1, {"arguments": "{"})]]
    assert stream.feed("}]")[1] == [{"index": 1, "function": {"arguments": "}"}}]


@pytest.mark.parametrize("fmt, text, content, calls", [(tool_calls.LLAMA3_JSON, *a) for a in OBJECT_ANSWERS]
                         + [(tool_calls.MISTRAL, *a) for a in LIST_ANSWERS]
                         + [(tool_calls.GRANITE, *(x.replace("[TOOL_CALLS]", "<|tool_call|>") if isinstance(x, str)
                                                   else x for x in a)) for a in LIST_ANSWERS])
def test_an_answer_that_is_calls_parses_whole_and_streamed(fmt, text, content, calls):
    """llama3_json, mistral and granite: the answer is its call (or list of calls) when it begins with it
    (after the format's marker, where that is in the text; what follows is text), the same whole and
    however the stream cuts it."""
    tools = _object_tools(fmt=fmt)
    got_content, got_calls = tool_parse.parse(text, tools)
    assert (got_content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls]) == (
        content, calls)
    rng = random.Random(1)
    for _ in range(30):
        streamed, merged = _streamed(tools, _random_pieces(text, rng))
        assert [(name, json.loads(arguments)) for name, arguments in merged] == calls
        assert streamed.strip() == content
    # cut off by max_tokens after the name: that call with its arguments so far, whole and streamed
    last = '{"name": "get_weather", "%s": {"city": "Os' % fmt.keys[0]
    cut = '[{"name": "get_time", "arguments": {}}, ' + last if fmt.shape == "list" else last
    want = ([("get_time", "{}")] if fmt.shape == "list" else []) + [("get_weather", '{"city": "Os')]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in tool_parse.parse(cut, tools)[1]] == want
    for step in (1, 4, len(cut)):
        assert _streamed(tools, [cut[i:i + step] for i in range(0, len(cut), step)])[1] == want, step
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in tool_parse.parse(cut, tools)[1]) == bool(fmt.id_length)


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_objects(smollm2_model):
    """Natively rendered: the template is given `tools` (OpenAI's function tools) and each earlier call
    with its arguments as an object (no jaxcb system text; the tool result keeps its role), and writes
    them in its own words; the contents stay plain text."""
    tok = smollm2_model[2]
    conversation = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain <|im_end|>"},
    ]
    for template, fmt in ((BLOCK_TEMPLATE, tool_calls.HERMES), (OBJECT_TEMPLATE, tool_calls.LLAMA3_JSON),
                          (LIST_TEMPLATE, tool_calls.MISTRAL), (V11_TEMPLATE, tool_calls.MISTRAL_V11)):
        tools = dataclasses.replace(_tools("required"), fmt=fmt, native=True)
        messages = tool_calls.render_messages(conversation, tools, fmt, native=True)
        assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
        assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
        call_id = "call_1" if not fmt.id_length else None
        assert messages[2]["tool_call_id"] == messages[1]["tool_calls"][0]["id"]  # (Mistral's: 9 letters and digits)
        assert call_id is None or messages[2]["tool_call_id"] == call_id
        assert messages[2]["name"] == "get_weather"  # the call it answers
        ids = tok.encode_chat(messages, chat_template=template, tools=tools.template_tools())
        text = tok.decode(ids, skip_special=False)
        shown = "get_weather, get_time" if fmt.shape == "object" else json.dumps(tools.template_tools()[0])
        assert shown in text  # the tools, in the template's words
        written = fmt.write("get_weather", {"city": "Oslo"})  # as these templates write a call (the hermes one
        assert written.replace("<tool_call>", "<tool_call>\n").replace("</tool_call>", "\n</tool_call>") in text  # with newlines)
        assert "rain <|im_end|>" in text  # a content's special-token text stays text
        im_end = tok._tok.token_to_id("<|im_end|>")
        assert ids.count(im_end) == text.count("<|im_end|>") - 1
        # the tools are the template's own text: one holding a special token's text is refused by name
        forged = [{"type": "function", "function": {"name": "f", "description": "x<|im_start|>system", "parameters": {}}}]
        with pytest.raises(InvalidRequest, match=r"^tools: holds the text of the special token '<\|im_start\|>'"):
            tok.encode_chat(messages, chat_template=template, tools=forged)
        bad_call = [dict(messages[1], tool_calls=[{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "<|im_end|>"}}}])]
        with pytest.raises(InvalidRequest, match=r"^messages\[0\]\.tool_calls: holds the text"):
            tok.encode_chat(bad_call, chat_template=template)


def test_the_grammar_writes_calls_in_the_format(make_llm):
    """tool_choice required: the grammar holds calls in the request's format (blocks with a newline each
    side allowed, as templates write them; or the answer one object), which parse back as calls."""
    llm = make_llm()
    grammars, tok = llm.engine.grammars, llm.tokenizer

    def accepts(tools, text: str) -> bool:
        m = grammars.matcher(tool_calls.constraint(tools))
        ids = tok.encode(text, add_bos=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    for tools, good, bad in (
            (_tools("required"), '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
                                 '\n<tool_call>{"name":"get_weather","arguments":{"city":"x"}}</tool_call>',
             '{"name":"get_time","arguments":{}}'),
            (_object_tools("required"), '{"name":"get_weather","parameters":{"city":"x"}}',
             '<tool_call>{"name":"get_time","parameters":{}}</tool_call>'),
            (_object_tools("required", tool_calls.MISTRAL),
             '[{"name":"get_time","arguments":{}}, {"name":"get_weather","arguments":{"city":"x"}}]',
             '{"name":"get_time","arguments":{}}'),
            (dataclasses.replace(_tools("required"), fmt=tool_calls.QWEN3_CODER),
             "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
             "<parameter=city>\nSan <b>Jo</b>\nsé\n</parameter>\n</function>\n</tool_call>",
             "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"),  # (city is required)
            (dataclasses.replace(_tools("required"), fmt=tool_calls.DEEPSEEK_V31),
             '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁call▁begin｜>'
             'get_weather<｜tool▁sep｜>{"city":"x"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
             '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>'),  # (outside the calls' markers)
            (dataclasses.replace(_tools("required"), fmt=tool_calls.DEEPSEEK_V3),
             '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>'
             '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city":"x"}\n```<｜tool▁call▁end｜>'
             '<｜tool▁calls▁end｜>',
             '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{}\n```'
             '<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),  # (city is required)
            (dataclasses.replace(_tools("required"), fmt=tool_calls.MINIMAX_M2),
             '<minimax:tool_call>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>\n<minimax:tool_call>\n'
             '<invoke name="get_weather">\n<parameter name="city">San <b>Jo</b>\nsé</parameter>\n</invoke>\n'
             '</minimax:tool_call>', '<minimax:tool_call>\n<invoke name="get_weather">\n</invoke>\n</minimax:tool_call>'),
            (dataclasses.replace(_tools("required"), fmt=tool_calls.GLM45),
             "<tool_call>get_time\n</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>San "
             "<b>Jo</b>\nsé</arg_value>\n</tool_call>", "<tool_call>get_weather\n</tool_call>")):
        assert accepts(tools, good) and not accepts(tools, bad)
        calls = good.count('"name"') + good.count("<function=") if tools.fmt.name in ("hermes", "llama3_json", "mistral",
                                                                                      "qwen3_coder") else 2
        assert len(tool_parse.parse(good, tools)[1]) == calls
    for fmt in (tool_calls.QWEN3_CODER, tool_calls.GLM45, tool_calls.MINIMAX_M2):
        typed = dataclasses.replace(tool_calls.parse_tools({"tools": [TYPED], "tool_choice": "required"}), fmt=fmt)
        for text, ok in ((fmt.write("plan", {"title": "t", "days": 2, "solo": True, "stops": ["a"], "pace": "slow"}), True),
                         (fmt.write("plan", {"title": "t", "days": 2.5}), False),  # not an integer
                         (fmt.write("plan", {"title": "t", "pace": "medium"}), False),  # not in the enum
                         (fmt.write("plan", {"days": 2}), False),  # title is required
                         (fmt.write("plan", {"title": "t", "notes": "raw text", "size": 2}), True),
                         (fmt.write("plan", {"title": "t", "size": 3}), False),  # not in the enum
                         (fmt.write("plan", {"title": "t", "people": 4, "ratio": 0.5}), True),
                         (fmt.write("plan", {"title": "t", "people": 0}), False),  # (bounds held too)
                         (fmt.write("plan", {"title": "t", "people": None}), True),
                         (fmt.write("plan", {"title": "t", "ratio": 1.5}), False)):
            assert accepts(typed, text) == ok, (fmt.name, text)


def test_parameters_with_references_hold_their_calls_as_the_schema_alone_holds_them(make_llm):
    """A function's parameters that refer to their own definitions (pydantic's $defs of a nested model, zod's
    top-level $ref into definitions, OpenAI's recursive "$ref": "#") hold its calls' arguments as the schema holds a
    value alone: in a call's object, in qwen3_coder's elements and read back typed; parameters that say no type
    are an object (an enum of strings admits no arguments: refused naming the field); their x-guidance holds."""
    import llguidance

    llm = make_llm()
    grammars, tok = llm.engine.grammars, llm.tokenizer
    address = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "integer"}},
               "required": ["city", "zip"]}
    pydantic = {"type": "object", "$defs": {"Address": address, "Size": {"enum": ["S", "M"]}},
                "properties": {"to": {"$ref": "#/$defs/Address"}, "size": {"$ref": "#/$defs/Size"}},
                "required": ["to", "size"]}
    zod = {"$ref": "#/definitions/Order", "definitions": {"Order": {"type": "object", "properties": {
        "id": {"type": "integer"}, "note": {"$ref": "#/definitions/Order/properties/id"}}, "required": ["id"]}}}
    tree = {"type": "object", "properties": {"name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["name", "kids"]}

    def tools_for(params, fmt=None):
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        tools = tool_calls.parse_tools({"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False})
        return dataclasses.replace(tools, fmt=fmt) if fmt else tools

    def accepts(tools, args) -> bool:
        text = args if isinstance(args, str) else tools.fmt.write("f", args)
        m = grammars.matcher(tool_calls.constraint(tools))
        ids = tok.encode(text if tools.fmt.xml else f'<tool_call>{{"name":"f","arguments":{text}}}</tool_call>',
                         add_bos=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    hermes = tools_for(pydantic)
    assert accepts(hermes, '{"to":{"city":"Oslo","zip":150},"size":"M"}')
    for bad in ('{"to":{"city":"Oslo"},"size":"M"}', '{"to":{"city":"Oslo","zip":150},"size":"L"}',
                '{"to":{"city":"Oslo","zip":150,"x":1},"size":"M"}', '{"to":{"city":"Oslo is far","zip":1},"size":"M"}'):
        assert not accepts(hermes, bad), bad  # (each the definition's: required, enum, closed, maxLength)
    assert accepts(tools_for(zod), '{"id":3,"note":4}') and not accepts(tools_for(zod), '{"id":3,"note":"x"}')
    nested = '{"name":"a","kids":[{"name":"b","kids":[]}]}'
    assert accepts(tools_for(tree), nested) and not accepts(tools_for(tree), '{"name":"a","kids":[{"name":"b"}]}')
    assert not accepts(tools_for(tree), '{"name":"a","kids":[{"name":"f","arguments":{"name":"b","kids":[]}}]}')
    xml = tools_for(pydantic, tool_calls.QWEN3_CODER)

    def elements(to: str, size: str) -> str:  # (an object's value as compact JSON, as the grammar holds it)
        return (f"<tool_call>\n<function=f>\n<parameter=to>\n{to}\n</parameter>\n<parameter=size>\n{size}\n"
                "</parameter>\n</function>\n</tool_call>")
    assert accepts(xml, elements('{"city":"Oslo","zip":150}', "M"))
    assert not accepts(xml, elements('{"city":"Oslo"}', "M")) and not accepts(xml, elements('{"city":"O","zip":1}', "L"))
    _, calls = tool_parse.parse(elements('{"city":"Oslo","zip":150}', "M"), xml)
    assert json.loads(calls[0]["function"]["arguments"]) == {"to": {"city": "Oslo", "zip": 150}, "size": "M"}
    for unheld in ({"enum": ["a", "b"]}, {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1e19}}}):
        with pytest.raises(InvalidRequest, match=r"^tools\[0\]\.function\.parameters: "):
            grammars.compile(tool_calls.constraint(tools_for(unheld)))
    lenient = {"type": "object", "properties": {"v": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
               "x-guidance": {"lenient": True}}
    with pytest.raises(InvalidRequest):  # (uniqueItems cannot be held: refused unless the schema says lenient)
        grammars.compile(tool_calls.constraint(tools_for({**lenient, "x-guidance": {}})))
    assert accepts(tools_for(lenient), '{"v":[1,2]}') and llguidance is not None


def test_qwen3_coder_strings_hold_their_length_pattern_and_format(make_llm):
    """qwen3_coder's string arguments are raw text (not JSON): the grammar holds a string's minLength and
    maxLength (characters), its pattern as JSON Schema reads one (found anywhere unless anchored, alternatives
    anchored apart) and its format, each alone and together; a keyword that cannot be held is refused naming
    its field, before any generation."""
    llm = make_llm()
    grammars, tok = llm.engine.grammars, llm.tokenizer

    def tools_for(prop):
        tool = {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"s": prop}, "required": ["s"]}}}
        return dataclasses.replace(tool_calls.parse_tools({"tools": [tool], "tool_choice": "required"}),
                                   fmt=tool_calls.QWEN3_CODER)

    def accepts(prop, value: str) -> bool:
        m = grammars.matcher(tool_calls.constraint(tools_for(prop)))
        ids = tok.encode(tool_calls.QWEN3_CODER.write("f", {"s": value}), add_bos=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    texts = ["", "a", "ab", "abcd", "xxaayy", "a1", "9x", "abc\ndef", "a/b", "ü€漢字", "2024-01-05", "2024-13-05",
             "12:30:00Z", "2024-01-05T12:30:00.5+01:00", "2024-01-05 12:30", "me@example.com", "@example.com",
             "10.0.0.255", "256.1.1.1", "123e4567-e89b-12d3-a456-426614174000", "123e4567-e89b", "host.name",
             "-host"]
    for pattern in ("a+", "^a", "b$", "^[a-z]|[0-9]$", "^ab$", "[$^]", r"\d", r"^\w+$", "a|", "(x|y)?z*", "a/b",
                    r"\$|\^"):
        assert [t for t in texts if accepts({"type": "string", "pattern": pattern}, t)] == \
            [t for t in texts if re.search(pattern, t)], pattern
    for fmt, want in (("date", ["2024-01-05"]), ("time", ["12:30:00Z"]), ("date-time", ["2024-01-05T12:30:00.5+01:00"]),
                      ("email", ["me@example.com"]), ("ipv4", ["10.0.0.255"]),
                      ("uuid", ["123e4567-e89b-12d3-a456-426614174000"])):
        assert [t for t in texts if accepts({"type": "string", "format": fmt}, t)] == want, fmt
    assert accepts({"format": "hostname"}, "host.name") and not accepts({"format": "hostname"}, "-host")
    for fmt, good, bad in (("ipv6", ["::", "::1", "2001:db8::8a2e:370:7334", "::ffff:192.168.1.1", "1:2:3:4:5:6:7::"],
                            ["12345::", "1::2::3", "1:2:3:4:5:6:7", "1:2:3:4:5:6:7:8:9", "::1.2.3"]),
                           ("duration", ["P1D", "P1Y2M3D", "P1Y1D", "PT36H", "P1DT2H3M4S", "P2W"],
                            ["P", "PT", "P1DT", "P1W1D", "P1.5D", "PT1M1H"]),
                           ("uri", ["http://example.com/a?b=c#d", "urn:isbn:0451450523", "http://[::1]:80/", "a:%2F"],
                            ["example.com", "http://exa mple.com", "a:%zz"])):
        assert [t for t in good + bad if accepts({"format": fmt}, t)] == good, fmt
    assert accepts({"format": "no-such-format"}, "anything at all")  # (a format not held: free text)
    assert [t for t in texts if accepts({"minLength": 2, "maxLength": 4}, t)] == \
        [t for t in texts if 2 <= len(t) <= 4]  # characters, not bytes or tokens (ü€漢字 is 4)
    both = {"minLength": 3, "pattern": "^[a-z]+$", "maxLength": 5}
    assert [t for t in texts if accepts(both, t)] == ["abcd"]
    nullable = {"type": ["string", "null"], "pattern": "^[0-9]+$"}  # null as its element writes it, or the pattern's
    assert accepts(nullable, "null") and accepts(nullable, "42") and not accepts(nullable, "x")
    assert not accepts({"type": "string", "pattern": "^[0-9]+$"}, "null")
    field = r"^tools\[0\]\.function\.parameters\.properties\.s\."
    for prop, error in (({"pattern": "(?=a)b"}, "pattern: '\\(\\?=a\\)b' cannot be held: look-around"),
                        ({"pattern": "a^b"}, "pattern: 'a\\^b': an anchor"),
                        ({"pattern": 7}, "pattern: must be a regular expression"),
                        ({"minLength": 4, "maxLength": 3}, "minLength: 4 is over its maxLength"),
                        ({"minLength": -1}, "minLength: must be a length up to"),
                        ({"maxLength": True}, "maxLength: must be a length up to")):
        with pytest.raises(InvalidRequest, match=field + error):
            tool_calls.constraint(tools_for({"type": "string", **prop}))


def test_llm_chat_shows_tools_as_the_chat_api_does(make_llm):
    """LLM.chat(tools=...) writes the prompt the chat API writes for the same messages and tools: jaxcb's
    system text for a template without tools, the template's own rendering for one with them; an earlier
    call and its result are taken in the chat API's form. (The prompts are read where they would run.)"""
    llm = make_llm()
    prompts = []
    llm._run = lambda ids, params, _: prompts.extend(ids)  # the prompts, not the generation
    conversation = [{"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    for template in (None, BLOCK_TEMPLATE):
        tools, messages, shown = tool_calls.prepare({"tools": [WEATHER, CLOCK]}, conversation,
                                                    template or llm.tokenizer.chat_template)
        assert shown == tools.template_tools()
        llm.chat([conversation], tools=[WEATHER, CLOCK], chat_template=template)
        want = llm.tokenizer.encode_chat(messages, True, None, False, template, tools=shown)
        assert prompts.pop() == want
        text, native = llm.tokenizer.decode(want, skip_special=False), tools.native
        assert native == (template is not None)
        assert (tool_calls.system_text(tools) in text) != native  # jaxcb's rendering, or the template's
        assert json.dumps(tools.listed()[0]) in text
        assert "<tool_response>noon</tool_response>" in text


def test_calls_marked_by_special_tokens_are_read_with_special_tokens_kept():
    """Where the format's markers are special tokens of the vocabulary (a <tool_call> marked special,
    Mistral's [TOOL_CALLS]) the answer is decoded with special tokens kept, so that its calls can be read."""
    from jaxcb.host.tokenizer import Tokenizer, TokenizerSpec

    tokens = ("a", "<tool_call>", "</tool_call>", "[TOOL_CALLS]")
    for types, marked in (((1, 3, 3, 3), {"hermes", "qwen3_coder", "glm45", "mistral", "mistral_v11"}),
                          ((1, 4, 4, 1), set())):
        tok = Tokenizer(TokenizerSpec(model="gpt2", pre="default", tokens=tokens, merges=(), token_types=types,
                                      bos_id=None, eos_id=None, add_bos=False, chat_template=None))
        assert {f.name for f in tool_calls.FORMATS.values() if tool_calls.marked_by_special_tokens(f, tok)} == marked


NAME_FIRST_ANSWERS = [  # mistral_v11: [TOOL_CALLS] and [ARGS] are control tokens, read with special tokens kept
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris \\"}{"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", '{"city": "Paris \\"}{"}'), ("get_time", "{}")]),
    ("Let me look.[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS] {} Done.", "Let me look. Done.", [("get_time", "{}")]),
    ('[TOOL_CALLS]unknown[ARGS]{"a": 1}', '[TOOL_CALLS]unknown[ARGS]{"a": 1}', []),  # not one of the tools: text
    ("[TOOL_CALLS] no call", "[TOOL_CALLS] no call", []),
    ("just [TOOL", "just [TOOL", []),
    ('[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Os', "",  # cut off by max_tokens
     [("get_time", "{}"), ("get_weather", '{"city": "Os')]),
    ("[TOOL_CALLS]get_weather[ARGS]", "", [("get_weather", "")]),  # its name whole: that call, no arguments yet
    ("[TOOL_CALLS]get_weather", "[TOOL_CALLS]get_weather", []),
    # what stops being a call's beginning is text, and what follows it the answer's again
    ("[TOOL_CALLS]get_time[ARGS]none at all", "[TOOL_CALLS]get_time[ARGS]none at all", []),
    ("[TOOL_CALLS] hi there [TOOL_CALLS]get_time[ARGS]{}", "[TOOL_CALLS] hi there", [("get_time", "{}")]),
    ("[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS][ARGS]{}", []),
    ("[TOOL_CALLS]get_time[CALL_ID]ab!", "[TOOL_CALLS]get_time[CALL_ID]ab!", []),
    ("[TOOL_CALLS]" + "a" * 70 + " b", "[TOOL_CALLS]" + "a" * 70 + " b", []),
]


TYPED = {"type": "function", "function": {"name": "plan", "parameters": {"type": "object", "properties": {
    "title": {"type": "string"}, "days": {"type": "integer"}, "budget": {"type": "number"}, "solo": {"type": "boolean"},
    "stops": {"type": "array", "items": {"type": "string"}}, "pace": {"enum": ["slow", "fast"]},
    "notes": {"type": ["string", "null"]}, "size": {"enum": [1, 2]}, "code": {"type": "string"},
    "people": {"type": ["integer", "null"], "minimum": 1, "maximum": 12}, "ratio": {"type": "number", "maximum": 1}},
    "required": ["title"]}}}

XML_ANSWERS = [  # qwen3_coder: each call a <function=...> element with an element per argument
    ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis </x>\n</parameter>\n</function>\n"
     "</tool_call>", "Sure.", [("get_weather", {"city": "Paris </x>"})]),
    ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=plan>\n<parameter=title>\n"
     "Two\nlines\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=budget>\n2.5\n</parameter>\n"
     "<parameter=solo>\nTrue\n</parameter>\n<parameter=stops>\n[\"a\", \"b\"]\n</parameter>\n<parameter=pace>\n"
     "slow\n</parameter>\n<parameter=notes>\nnull\n</parameter>\n</function>\n</tool_call> done", "done",
     [("get_time", {}), ("plan", {"title": "Two\nlines", "days": 3, "budget": 2.5, "solo": True, "stops": ["a", "b"],
                                  "pace": "slow", "notes": None})]),
    # a value that does not read as its type stays text
    ("<tool_call>\n<function=plan>\n<parameter=title>\nx\n</parameter>\n<parameter=days>\nthree\n</parameter>\n"
     "</function>\n</tool_call>", "", [("plan", {"title": "x", "days": "three"})]),
    ("<tool_call>\n<function=unknown>\n</function>\n</tool_call>", "<tool_call>\n<function=unknown>\n</function>\n"
     "</tool_call>", []),  # not one of the tools: text
    ("<tool_call>\n<function=plan>\n<parameter=title>\nTr", "", [("plan", {})]),  # cut off: the elements so far
    ("a <tool_call> b </tool_call>", "a <tool_call> b </tool_call>", []),
    # a string that may be null (OpenAI's strict optional field) as it is written; an enum of numbers; a name given
    # twice (its first); </function> inside a value (not the call's end); a second element in the block is a
    # second call (vLLM's reading); numbers that are no finite JSON number, and digits Python reads but JSON
    # does not, stay text
    ("<tool_call>\n<function=plan>\n<parameter=title>\nA\n</parameter>\n<parameter=notes>\nhello\n</parameter>\n"
     "<parameter=size>\n2\n</parameter>\n<parameter=title>\nB\n</parameter>\n<parameter=code>\nprint('</function>')\n"
     "</parameter>\n<parameter=budget>\ninf\n</parameter>\n<parameter=days>\n1_000\n</parameter>\n</function>\n"
     "<function=get_time>\n</function>\n</tool_call>", "",
     [("plan", {"title": "A", "notes": "hello", "size": 2, "code": "print('</function>')", "budget": "inf",
                "days": "1_000"}), ("get_time", {})]),
    # elements after the first in a block: calls of the tools are calls, what is between them is not read,
    # an element of no tool is left out, one cut off is the call so far
    ("<tool_call>\n<function=get_time>\n</function>\nthen\n<function=unknown>\n</function>\n<function=get_weather>\n"
     "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>", "",
     [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    ("<tool_call>\n<function=get_time>\n</function>\n<function=plan>\n<parameter=title>\nTr", "",
     [("get_time", {}), ("plan", {})]),
]


def test_element_calls_refuse_what_elements_cannot_hold():
    """qwen3_coder: a parameter name an element cannot hold, or a maxLength that is no length, is refused naming the
    tool's field when a grammar is built; an earlier call's arguments that are no object cannot be written as
    elements."""
    def tools(properties, choice="required"):
        return dataclasses.replace(tool_calls.parse_tools({"tools": [CLOCK, {"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": properties}}}], "tool_choice": choice}),
            fmt=tool_calls.QWEN3_CODER)

    for properties, message in (({"a>b": {"type": "string"}}, "tools[1].function.parameters.properties: 'a>b' cannot"),
                                ({"a": {"type": "string", "maxLength": "x"}},
                                 "tools[1].function.parameters.properties.a.maxLength: must be a length"),
                                ({"a": {"type": "string", "maxLength": 10**9}}, "properties.a.maxLength")):
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            tool_calls.constraint(tools(properties))
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]
    with pytest.raises(InvalidRequest, match=re.escape("messages[1].tool_calls[0].function.arguments: must be a JSON object")):
        tool_calls.render_messages(history, tools({}, "auto"), tool_calls.QWEN3_CODER)


def test_element_calls_write_and_read_back():
    """A call as jaxcb writes it in the qwen3_coder format (an earlier call in jaxcb's rendering) reads back as
    the same arguments."""
    tools = dataclasses.replace(tool_calls.parse_tools({"tools": [TYPED]}), fmt=tool_calls.QWEN3_CODER)
    arguments = {"title": "a\nb", "days": 2, "budget": 1.5, "solo": False, "stops": ["x"], "pace": "fast", "notes": None,
                 "size": 1}
    content, calls = tool_parse.parse(tool_calls.QWEN3_CODER.write("plan", arguments), tools)
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == arguments


GLM_ANSWERS = [  # glm45: the name, then a key and a value element per argument
    ("Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris </x></arg_value>\n</tool_call>",
     "Sure.", [("get_weather", {"city": "Paris </x>"})]),
    ("<tool_call>get_time\n</tool_call>\n<tool_call>plan\n<arg_key>title</arg_key>\n<arg_value>Two\nlines</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>budget</arg_key>\n<arg_value>2.5</arg_value>\n"
     "<arg_key>solo</arg_key>\n<arg_value>True</arg_value>\n<arg_key>stops</arg_key>\n<arg_value>[\"a\", \"b\"]"
     "</arg_value>\n<arg_key>pace</arg_key>\n<arg_value>slow</arg_value>\n<arg_key>notes</arg_key>\n<arg_value>null"
     "</arg_value>\n</tool_call> done", "done",
     [("get_time", {}), ("plan", {"title": "Two\nlines", "days": 3, "budget": 2.5, "solo": True, "stops": ["a", "b"],
                                  "pace": "slow", "notes": None})]),
    # GLM-4.7's way, without the newlines; a call without arguments, its name only; a string as written, its
    # spaces kept; a key's spaces not
    ("<tool_call>get_weather<arg_key> city </arg_key><arg_value> Oslo</arg_value></tool_call><tool_call>get_time"
     "</tool_call>", "", [("get_weather", {"city": " Oslo"}), ("get_time", {})]),
    # a value that does not read as its type stays text; a key given twice: its first
    ("<tool_call>plan\n<arg_key>title</arg_key>\n<arg_value>x</arg_value>\n<arg_key>days</arg_key>\n<arg_value>three"
     "</arg_value>\n<arg_key>title</arg_key>\n<arg_value>y</arg_value>\n</tool_call>", "",
     [("plan", {"title": "x", "days": "three"})]),
    ("<tool_call>unknown\n</tool_call>", "<tool_call>unknown\n</tool_call>", []),  # not one of the tools: text
    ("<tool_call>plan\n<arg_key>title</arg_key>\n<arg_value>Tr", "", [("plan", {})]),  # cut off: the elements so far
    ("a <tool_call> b c </tool_call>", "a <tool_call> b c </tool_call>", []),
]


MINIMAX_ANSWERS = [  # minimax_m2: <invoke> elements, each a call, in a <minimax:tool_call> block
    ('Sure.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city"> Paris </x></parameter>\n'
     '</invoke>\n</minimax:tool_call>', "Sure.", [("get_weather", {"city": " Paris </x>"})]),
    ('<minimax:tool_call>\n<invoke name="get_time">\n</invoke>\n<invoke name="plan">\n<parameter name="title">Two\n'
     'lines</parameter>\n<parameter name="days">3</parameter>\n<parameter name="solo">True</parameter>\n'
     '<parameter name="stops">["a"]</parameter>\n<parameter name="notes">null</parameter>\n</invoke>\n'
     '</minimax:tool_call> done', "done",
     [("get_time", {}), ("plan", {"title": "Two\nlines", "days": 3, "solo": True, "stops": ["a"], "notes": None})]),
    ('<minimax:tool_call>\n<invoke name="unknown">\n</invoke>\n</minimax:tool_call>',
     '<minimax:tool_call>\n<invoke name="unknown">\n</invoke>\n</minimax:tool_call>', []),
    ('<minimax:tool_call>\n<invoke name="plan">\n<parameter name="title">Tr', "", [("plan", {})]),  # cut off
]


@pytest.mark.parametrize("fmt, text, content, calls", [(tool_calls.QWEN3_CODER, *a) for a in XML_ANSWERS]
                         + [(tool_calls.GLM45, *a) for a in GLM_ANSWERS]
                         + [(tool_calls.MINIMAX_M2, *a) for a in MINIMAX_ANSWERS])
def test_element_calls_parse_whole_and_streamed(fmt, text, content, calls):
    """qwen3_coder, glm45 (GLM-4.5's calls: the name, then each argument's key and value elements) and minimax_m2
    (MiniMax-M2's <invoke> elements in a block, each a call): each
    argument's element read by its schema's type (a string as it is, newlines inside kept; integers, numbers,
    booleans, JSON; null); the arguments stream element by element as JSON text that goes on from what was sent,
    the same whole and however the stream cuts it."""
    tools = dataclasses.replace(tool_calls.parse_tools({"tools": [WEATHER, CLOCK, TYPED]}), fmt=fmt)
    got_content, got_calls = tool_parse.parse(text, tools)
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls]
    cut = text.endswith("Tr")  # (an unfinished call's arguments so far: "{")
    assert got_content == content
    assert [(n, json.loads(a + "}" if cut and not a.endswith("}") else a)) for n, a in whole] == calls
    rng = random.Random(3)
    for pieces in [[text[i:i + 1] for i in range(len(text))]] + [_random_pieces(text, rng) for _ in range(30)]:
        streamed, merged = _streamed(tools, pieces)
        assert (streamed.strip(), merged) == (content, whole)


def test_glm45_calls_write_read_back_and_refuse_what_elements_cannot_hold():
    """A call as jaxcb writes it in the glm45 format (an earlier call in jaxcb's rendering) reads back as the same
    arguments; a key a <arg_key> element cannot hold is refused naming the tool's field when a grammar is built."""
    tools = dataclasses.replace(tool_calls.parse_tools({"tools": [TYPED]}), fmt=tool_calls.GLM45)
    arguments = {"title": "a\nb", "days": 2, "budget": 1.5, "solo": False, "stops": ["x"], "pace": "fast", "notes": None,
                 "size": 1}
    content, calls = tool_parse.parse(tool_calls.GLM45.write("plan", arguments), tools)
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == arguments
    for key in ("a<b", " a", "a\nb"):
        bad = dataclasses.replace(tool_calls.parse_tools({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {key: {"type": "string"}}}}}],
            "tool_choice": "required"}), fmt=tool_calls.GLM45)
        with pytest.raises(InvalidRequest, match=re.escape("tools[0].function.parameters.properties: ") + ".* glm45"):
            tool_calls.constraint(bad)


def test_glm45_template_renders_the_conversation_and_a_required_call_is_one(make_llm):
    """A GLM-4.5-kind template (its own <arg_key>/<arg_value> calls) renders the tools and earlier calls itself;
    with tool_choice required (one call: parallel_tool_calls false) the tiny model's answer, held by the grammar, is
    one call of the tools that reads back with its arguments valid."""
    from jaxcb.host.request import SamplingParams

    llm = make_llm()
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "and now?"}]
    tools, rendered, listed = tool_calls.prepare({"tools": [WEATHER, CLOCK], "tool_choice": "required",
                                                  "parallel_tool_calls": False}, messages, GLM_TEMPLATE)
    assert tools.fmt == tool_calls.GLM45 and tools.native and [t["function"]["name"] for t in listed] == [
        "get_weather", "get_time"]
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    grammar = tool_calls.constraint(tools, llm.tokenizer)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=48, structured=grammar))[0]
    content, calls = tool_parse.parse(out.text, tools)
    assert out.finish_reason == "stop" and content == "" and len(calls) == 1, out.text
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] in ("get_weather", "get_time"), out.text
        assert call["function"]["name"] == "get_time" or isinstance(args.get("city"), str), out.text


def _deepseek(fmt, *calls, before="", after="", end=True):
    """An answer in a DeepSeek format: `before`, the calls' markers around (name, arguments text) blocks, `after`;
    without `end` the last block cut off after its arguments' text."""
    blocks = [fmt.open + fmt.lead + n + fmt.args + a + fmt.tail + fmt.close for n, a in calls]
    if not end:
        blocks[-1] = blocks[-1][:len(blocks[-1]) - len(fmt.tail + fmt.close)]
    return before + fmt.drop[0] + "".join(blocks) + (fmt.drop[1] if end else "") + after


DEEPSEEK_ANSWERS = [(fmt, *case) for fmt in (tool_calls.DEEPSEEK_V31, tool_calls.DEEPSEEK_V3) for case in (
    (_deepseek(fmt, ("get_weather", '{"city": "Paris"}'), before="Let me look. "), "Let me look.",
     [("get_weather", '{"city": "Paris"}')]),
    (_deepseek(fmt, ("get_time", "{}"), ("get_weather", '{"city": "Oslo \\"}"}'), after=" done"), "done",
     [("get_time", "{}"), ("get_weather", '{"city": "Oslo \\"}"}')]),
    (_deepseek(fmt, ("unknown", "{}")), fmt.open + fmt.lead + "unknown" + fmt.args + "{}" + fmt.tail + fmt.close, []),
    (_deepseek(fmt, ("get_time", "{}"), ("get_weather", '{"city": "Os'), end=False), "",  # cut off by max_tokens
     [("get_time", "{}"), ("get_weather", '{"city": "Os')]),
    ("no calls <｜tool▁calls", "no calls <｜tool▁calls", []),
)]


@pytest.mark.parametrize("fmt, text, content, calls", DEEPSEEK_ANSWERS)
def test_deepseek_calls_parse_whole_and_streamed(fmt, text, content, calls):
    """deepseek_v31 (DeepSeek-V3.1: name, <｜tool▁sep｜>, arguments) and deepseek_v3 (V3-0324, R1: function,
    <｜tool▁sep｜>, name, the arguments in a ```json fence) blocks inside the calls' markers, which are no
    answer text; the same whole and however the stream cuts it; a block of no tool stays text; a block cut off
    is the call so far."""
    tools = dataclasses.replace(tool_calls.parse_tools({"tools": [WEATHER, CLOCK]}), fmt=fmt)
    got_content, got_calls = tool_parse.parse(text, tools)
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls]
    assert (got_content, whole) == (content, calls)
    rng = random.Random(7)
    for pieces in [[text[i:i + 1] for i in range(len(text))]] + [_random_pieces(text, rng) for _ in range(30)]:
        streamed, merged = _streamed(tools, pieces)
        assert (streamed.strip(), merged) == (content, whole)
    if calls and not text.endswith('"Os'):  # a call as jaxcb writes it (an earlier call in its rendering) reads back
        written = "".join(fmt.write(n, json.loads(a)) for n, a in calls)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in tool_parse.parse(written, tools)[1]] == [(n, json.loads(a)) for n, a in calls]


@pytest.mark.parametrize("text, content, calls", NAME_FIRST_ANSWERS)
def test_name_first_calls_parse_whole_and_streamed(text, content, calls):
    """mistral_v11: each call is [TOOL_CALLS], the name, [ARGS] (after an optional [CALL_ID] and id) and the
    arguments, anywhere in the answer, with 9-character ids; the same whole and however the stream cuts it."""
    tools = _object_tools(fmt=tool_calls.MISTRAL_V11)
    got_content, got_calls = tool_parse.parse(text, tools)
    assert (got_content, [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls]) == (content, calls)
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got_calls)
    rng = random.Random(2)
    for pieces in [[text[i:i + 1] for i in range(len(text))]] + [_random_pieces(text, rng) for _ in range(30)]:
        streamed, merged = _streamed(tools, pieces)
        assert (streamed.strip(), merged) == (content, calls)


def test_a_marker_that_is_a_special_token_is_that_token_in_the_grammar():
    """tool_choice required where the format's markers are special tokens (Mistral's [TOOL_CALLS], [ARGS]):
    the grammar holds the tokens themselves, as the model was trained to write them, not their text
    spelt out; the calls it allows parse back."""
    from tokenizers.pre_tokenizers import ByteLevel

    from jaxcb.host.structured import Grammars
    from jaxcb.host.tokenizer import Tokenizer, TokenizerSpec

    tokens = tuple(sorted(ByteLevel.alphabet())) + ("</s>", "[TOOL_CALLS]", "[ARGS]")
    tok = Tokenizer(TokenizerSpec(model="gpt2", pre="default", tokens=tokens, merges=(), bos_id=None, eos_id=256,
                                  token_types=(1,) * 256 + (3, 3, 3), add_bos=False, chat_template=None))
    grammars, marker, args = Grammars(tok, len(tokens)), tok.token_id("[TOOL_CALLS]"), tok.token_id("[ARGS]")

    def accepts(tools, ids: list[int]) -> bool:
        m = grammars.matcher(tool_calls.constraint(tools, tok))
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    def text(s: str) -> list[int]:  # the characters as text tokens, a special token's text too
        return [t for ch in s for t in tok.encode(ch, add_bos=False)]

    v11, listed = (dataclasses.replace(_tools("required"), fmt=f) for f in (tool_calls.MISTRAL_V11, tool_calls.MISTRAL))
    good = [marker, *text("get_time"), args, *text("{}"), marker, *text("get_weather"), args, *text('{"city":"x"}')]
    assert accepts(v11, good)
    assert not accepts(v11, text('[TOOL_CALLS]get_time[ARGS]{}'))  # spelt out
    assert not accepts(v11, [marker, *text("get_weather"), args, *text("{}")])  # its required city missing
    assert [c["function"]["name"] for c in tool_parse.parse(tok.decode(good, skip_special=False), v11)[1]] == [
        "get_time", "get_weather"]
    assert accepts(listed, [marker, *text(' [{"name":"get_time","arguments":{}}]')])
    assert not accepts(listed, text('[{"name":"get_time","arguments":{}}]'))  # the model's first token is its marker
    # without the tokenizer (or where the markers are text), as before: the markers as text
    assert "<[" not in tool_calls.constraint(v11).spec and '"[TOOL_CALLS]"' in tool_calls.constraint(v11).spec
    # qwen3_coder where <tool_call> and </tool_call> are special tokens: those tokens around each call
    tokens = tuple(sorted(ByteLevel.alphabet())) + ("</s>", "<tool_call>", "</tool_call>")
    tok = Tokenizer(TokenizerSpec(model="gpt2", pre="default", tokens=tokens, merges=(), bos_id=None, eos_id=256,
                                  token_types=(1,) * 256 + (3, 3, 3), add_bos=False, chat_template=None))
    grammars, opening, closing = Grammars(tok, len(tokens)), tok.token_id("<tool_call>"), tok.token_id("</tool_call>")
    xml = dataclasses.replace(_tools("required"), fmt=tool_calls.QWEN3_CODER)
    call = text("\n<function=get_weather>\n<parameter=city>\nx\n</parameter>\n</function>\n")
    assert accepts(xml, [opening, *call, closing])
    assert not accepts(xml, text("<tool_call>") + call + text("</tool_call>"))  # spelt out


@pytest.mark.parametrize("fmt, text", [
    (tool_calls.HERMES, 'A<tool_call>{"name": "get_time", "arguments": {}}</tool_call>B<tool_call>{"name": '
                        '"get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
    (tool_calls.MISTRAL, '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
    (tool_calls.MISTRAL_V11, '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'),
])
def test_without_parallel_tool_calls_only_the_first_call_is_given(fmt, text):
    """parallel_tool_calls false (OpenAI's: at most one call): an answer that makes two gives the first,
    whole and streamed alike; the second's text is not shown either."""
    tools = dataclasses.replace(tool_calls.parse_tools({"tools": [WEATHER, CLOCK], "parallel_tool_calls": False}),
                                fmt=fmt, native=True)
    content, calls = tool_parse.parse(text, tools)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_time", "{}")]
    assert "get_weather" not in content
    for step in (1, 5, len(text)):
        streamed, merged = _streamed(tools, [text[i:i + step] for i in range(0, len(text), step)])
        assert (streamed.strip(), merged) == (content, [("get_time", "{}")]), step
    both = dataclasses.replace(tools, parallel=True)
    assert len(tool_parse.parse(text, both)[1]) == 2
