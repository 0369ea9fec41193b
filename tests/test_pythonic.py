"""Tool calls as a Python list of calls (jaxcb.host.pythonic; vLLM's pythonic and llama4_pythonic): read back
whole and streamed alike however the text is cut, written for earlier turns, recognised from the template, and
the grammar of tool_choice required."""

import dataclasses
import json

import pytest

from jaxcb.host import pythonic, tool_calls, tool_parse

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer"},
    "alerts": {"type": ["boolean", "null"]}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

ANSWERS = [  # text, content, calls [(name, arguments)]
    ('[get_weather(city="Paris (FR)", days=-2), get_time()] Done.', " Done.",
     [("get_weather", {"city": "Paris (FR)", "days": -2}), ("get_time", {})]),
    (" <|python_start|>[get_weather(city='a, b', alerts=None)]<|python_end|>", "",
     [("get_weather", {"city": "a, b", "alerts": None})]),
    ('[get_weather(city="""x ) y""", tags=["a", \'b\'], alerts=True)]', "",
     [("get_weather", {"city": "x ) y", "tags": ["a", "b"], "alerts": True})]),
    ('[get_weather(city="x", tags=[true, null])]', "", [("get_weather", {"city": "x", "tags": [True, None]})]),
    ("no calls [here]", "no calls [here]", []),
    ("[unknown(a=1)] x", "[unknown(a=1)] x", []),  # not one of the tools: text
    ("[get_weather('Paris')]", "[get_weather('Paris')]", []),  # positional: no call
    ('[get_weather(city=__import__("os"))]', '[get_weather(city=__import__("os"))]', []),  # no literal: nothing run
    ('[get_weather(city="x"), other(), get_time()]', "", [("get_weather", {"city": "x"}), ("get_time", {})]),
    ('[get_time(), get_weather(city="Oslo", unit="c', "", [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    # (a helper's review) a call closed but the list not: once; a first element that is no call: text
    ('[get_weather(city="Paris") ', "", [("get_weather", {"city": "Paris"})]),
    ('<|python_start|>[get_weather(city="Paris")<|python_end|>', "", [("get_weather", {"city": "Paris"})]),
    ("[Note, get_time() is handy]", "[Note, get_time() is handy]", []),
    # values JSON cannot carry are no call: infinities, lone surrogates, integers past Python's text; pairs join
    ("[get_weather(city=1e999)]", "[get_weather(city=1e999)]", []),
    ('[get_weather(city="\\ud800")]', '[get_weather(city="\\ud800")]', []),
    ("[get_weather(city=0x" + "f" * 4000 + ")]", "[get_weather(city=0x" + "f" * 4000 + ")]", []),
    ('[get_weather(city="\\ud83d\\ude00")]', "", [("get_weather", {"city": "\U0001F600"})]),
    # names as written, not as Python reads them (NFKC): a fullwidth letter names no tool, and no parameter
    ("[\uff47et_time()]", "[\uff47et_time()]", []),
    ('[get_weather(\uff43ity="x", city="y")]', "", [("get_weather", {"\uff43ity": "x", "city": "y"})]),
]


@pytest.mark.parametrize("text, content, calls", ANSWERS)
def test_answers_read_whole_and_streamed_in_any_pieces(text, content, calls):
    tools = dataclasses.replace(tool_calls.parse_tools({"tools": [WEATHER, CLOCK]}), fmt=tool_calls.PYTHONIC)
    got = tool_parse.parse(text, tools)
    assert (got[0], [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got[1]]) == (
        content.strip(), calls)
    for size in (1, 2, 3, 7, len(text)):
        stream = tool_parse.CallStream(tools)
        parts = [text[i:i + size] for i in range(0, len(text), size)]
        pieces = [stream.feed(p, final=i == len(parts) - 1) for i, p in enumerate(parts)]
        assert "".join(p[0] for p in pieces) == content, size
        assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for p in pieces for d in p[1]] == calls
        assert stream.calls == len(calls)


def test_calls_written_for_earlier_turns_read_back_and_the_template_names_the_format():
    args = {"city": 'Qu"ote', "alerts": False, "tags": ["x"], "nested": {"k": None}}
    text = tool_calls.PYTHONIC.write("get_weather", args)
    assert text == '[get_weather(city="Qu\\"ote", alerts=False, tags=["x"], nested={"k": None})]'
    assert pythonic.read_call(text[1:-1], {"get_weather"}) == ("get_weather", args)
    template = "{% if tools %}[func_name1(params_name1=params_value1)]{{ tools }}{% endif %}{{ messages }}"
    assert tool_calls.choose_format(template) == (tool_calls.PYTHONIC, True)
    assert tool_calls.choose_format(None, "llama4_pythonic")[0] is tool_calls.PYTHONIC
    # Llama 4's own template wraps earlier turns in <|python_start|> but asks for JSON calls: not pythonic
    official = ('{% if tools %}Respond with {"name": function name, "parameters": dictionary of argument name and its '
                "value}}{{ tools }}{% endif %}{% for m in messages %}<|python_start|>{{ m.content }}<|python_end|>{% endfor %}")
    assert tool_calls.choose_format(official) == (tool_calls.LLAMA3_JSON, True)
    # jaxcb's own rendering asks for pythonic calls in their own words
    text = tool_calls.system_text(dataclasses.replace(tool_calls.parse_tools({"tools": [CLOCK]}), fmt=tool_calls.PYTHONIC))
    assert "[<function name>(<argument name>=<its value as a Python literal>, ...), ...]" in text


def test_required_calls_grammar():
    """tool_choice required: a list of calls, each a function's name and its parameters as keyword arguments in
    their order (required ones always, the others optional), values as the schema says in Python's literals;
    what it allows reads back as those calls; names that cannot be Python keywords are refused by field."""
    from tokenizers.pre_tokenizers import ByteLevel

    from jaxcb.host.errors import InvalidRequest
    from jaxcb.host.structured import Grammars
    from jaxcb.host.tokenizer import Tokenizer, TokenizerSpec

    tokens = tuple(sorted(ByteLevel.alphabet())) + ("</s>",)
    tok = Tokenizer(TokenizerSpec(model="gpt2", pre="default", tokens=tokens, merges=(), bos_id=None, eos_id=256,
                                  token_types=(1,) * 256 + (3,), add_bos=False, chat_template=None))
    grammars = Grammars(tok, len(tokens))
    tools = dataclasses.replace(tool_calls.parse_tools({"tools": [WEATHER, CLOCK], "tool_choice": "required"}),
                                fmt=tool_calls.PYTHONIC)

    def accepts(text: str, t=tools) -> bool:
        m = grammars.matcher(tool_calls.constraint(t, tok))
        ids = tok.encode(text, add_bos=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    for good in ('[get_time()]', '[get_weather(city="Oslo")]', '[get_weather(city="a", unit="f", alerts=None), get_time()]',
                 '[get_weather(city="a", days=3, alerts=True, tags=["x","y"])]'):
        assert accepts(good), good
        assert len(tool_parse.parse(good, tools)[1]) == good.count("(")
    for bad in ('[get_weather()]', '[get_weather(unit="c")]', '[get_weather(city="a", unit="k")]',
                '[get_weather(city="a", alerts=true)]', '[get_weather(days=1, city="a")]', "get_time()",
                '[get_weather(city="much too long a name")]'):
        assert not accepts(bad), bad
    one = dataclasses.replace(tools, parallel=False)
    assert accepts("[get_time()]", one) and not accepts("[get_time(), get_time()]", one)
    later = dataclasses.replace(tool_calls.parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["b"]}}}],
        "tool_choice": "required"}), fmt=tool_calls.PYTHONIC)
    assert accepts("[f(b=1)]", later) and accepts("[f(a=1, b=2)]", later) and not accepts("[f()]", later)
    for key in ("not-an-identifier", "from"):  # (a reserved word cannot be a keyword argument either)
        odd = tool_calls.parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {key: {"type": "string"}}}}}], "tool_choice": "required"})
        with pytest.raises(InvalidRequest, match=r"tools\[0\].function.parameters.properties"):
            tool_calls.constraint(dataclasses.replace(odd, fmt=tool_calls.PYTHONIC), tok)
