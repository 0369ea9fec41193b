"""OpenAI's harmony format (gpt-oss), read back (jaxcb.host.harmony): each answer's reasoning, content and tool
calls, whole and streamed alike however the text is cut; the format recognised from the chat template; the
grammar of tool_choice required and named calls. (Served end to end: tests/test_openai_api.py.)"""

import dataclasses
import json

import pytest

from jaxcb.host import harmony, tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"

ANSWERS = [  # text, reasoning, content, calls [(name, arguments)]
    ("<|channel|>analysis<|message|>Weather asked.<|end|>" + CALL.format("get_weather", '{"city":"Paris"}'),
     "Weather asked.", None, [("get_weather", '{"city":"Paris"}')]),
    ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
     "Easy.", "It is 4.", []),
    # a preamble (commentary with no recipient) is content; the recipient may come before the channel, and
    # "json" without <|constrain|>; the arguments' leading spaces are not theirs
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary "
     "json<|message|> {}<|call|>", None, "Checking.", [("get_time", "{}")]),
    ("<|channel|>final<|message|>cut off by max_tok", None, "cut off by max_tok", []),
    ("an answer with no header: < and <| are text", None, "an answer with no header: < and <| are text", []),
    ("<|x|> not harmony", None, "<|x|> not harmony", []),
    ("<|channel|>analysis<|message|>thinking until the en", "thinking until the en", None, []),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant", "a", None, []),  # an unfinished header: nothing
    # calls the request did not offer: a built-in tool's, an unknown function's (left out)
    ("<|channel|>analysis<|message|>x<|end|>" + CALL.format("nope", "{}").replace("functions.nope", "browser.search"),
     "x", None, []),
    (CALL.format("nope", "{}")[len("<|start|>assistant"):], None, None, []),
    # the first message's header without <|start|>: the recipient before the channel (as gpt-oss's own template
    # writes past calls), or the role; a stray `<|channel|>commentary to=assistant` first (gpt-oss-20b's): the
    # header's last channel, and `assistant` no recipient; text between messages is content
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}<|call|>', None, None,
     [("get_weather", '{"city":"Paris"}')]),
    ("assistant<|channel|>final<|message|>Hi<|return|>", None, "Hi", []),
    ("<|channel|>commentary to=assistant<|channel|>final<|message|>The answer.<|return|>", None, "The answer.", []),
    ("<|channel|>analysis<|message|>x<|end|>\nHello<|start|>assistant<|channel|>final<|message|>y<|return|>", "x",
     "\nHelloy", []),
    # a body the model did not close before its next header; a call cut off by max_tokens
    ("<|channel|>analysis<|message|>a<|channel|>final<|message|>b<|return|>", "a", "b", []),
    (CALL.format("get_weather", '{"city": "Os')[len("<|start|>assistant"):-len("<|call|>")], None, None,
     [("get_weather", '{"city": "Os')]),
]


@pytest.mark.parametrize("text, reasoning, content, calls", ANSWERS)
def test_answers_read_whole_and_streamed_in_any_pieces(text, reasoning, content, calls):
    tools = tool_calls.parse_tools({"tools": [WEATHER, CLOCK]})
    got = harmony.parse(text, tools)
    assert got[:2] == (reasoning, content)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got[2]] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got[2])
    for size in (1, 2, 3, 5, 11, len(text)):
        stream = harmony.HarmonyStream(tools)
        parts = [text[i:i + size] for i in range(0, len(text), size)]
        pieces = [stream.feed(p, final=i == len(parts) - 1) for i, p in enumerate(parts)]
        assert ("".join(p[0] for p in pieces) or None, "".join(p[1] for p in pieces) or None) == (reasoning, content)
        deltas = [d for p in pieces for d in p[2]]
        assert [(d["function"]["name"], "".join(e["function"]["arguments"] for e in deltas if e["index"] == d["index"]))
                for d in deltas if "id" in d] == calls, size
        assert stream.calls == len(calls)


def test_what_the_request_allows_decides_which_messages_are_calls():
    """Without tools no message is a call; with parallel_tool_calls false only the first; under tool_choice
    required there is no content beside the calls (the grammar's only)."""
    text = ("<|channel|>commentary<|message|>Two calls.<|end|>" + CALL.format("get_time", "{}")
            + CALL.format("get_weather", '{"city":"x"}'))
    assert harmony.parse(text) == (None, "Two calls.", [])
    one = tool_calls.parse_tools({"tools": [WEATHER, CLOCK], "parallel_tool_calls": False})
    assert [c["function"]["name"] for c in harmony.parse(text, one)[2]] == ["get_time"]
    required = tool_calls.parse_tools({"tools": [WEATHER, CLOCK], "tool_choice": "required"})
    assert harmony.parse(text, required)[1] is None and len(harmony.parse(text, required)[2]) == 2
    none = tool_calls.parse_tools({"tools": [WEATHER, CLOCK], "tool_choice": "none"})
    assert harmony.parse(text, none) == (None, "Two calls.", [])


HARMONY_TEMPLATE = (  # (a harmony template's shape: gpt-oss's own renders tools as TypeScript)
    "{%- if tools %}<|start|>developer<|message|># Tools\n{{ tools | tojson }}<|end|>{% endif %}"
    "{%- for m in messages %}{% if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}"
    "<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")


def test_the_format_is_recognised_from_the_template_or_named():
    assert harmony.is_harmony(HARMONY_TEMPLATE) and not harmony.is_harmony("{{ messages }}")
    assert tool_calls.choose_format(HARMONY_TEMPLATE) == (tool_calls.HARMONY, True)
    assert tool_calls.choose_format(HARMONY_TEMPLATE.replace("tools", "x")) == (tool_calls.HARMONY, False)
    assert tool_calls.choose_format(None, "openai") == (tool_calls.HARMONY, False)  # (vLLM's name for it)
    assert tool_calls.HARMONY.write("get_time", {}) == CALL.format("get_time", "{}")[len("<|start|>assistant"):]


MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


def _vocabulary(special: bool):
    """(tokenizer, its grammars, ids(text)): byte tokens, and harmony's markers as special tokens if `special`;
    ids() gives each marker its token where it is one, other text character by character."""
    from tokenizers.pre_tokenizers import ByteLevel

    from jaxcb.host.structured import Grammars
    from jaxcb.host.tokenizer import Tokenizer, TokenizerSpec

    specials = ("</s>",) + (MARKERS if special else ())
    tokens = tuple(sorted(ByteLevel.alphabet())) + specials
    tok = Tokenizer(TokenizerSpec(model="gpt2", pre="default", tokens=tokens, merges=(), bos_id=None, eos_id=256,
                                  token_types=(1,) * 256 + (3,) * len(specials), add_bos=False, chat_template=None))

    def ids(text: str) -> list[int]:
        out, rest = [], text
        while rest:
            marker = next((m for m in MARKERS if special and rest.startswith(m)), None)
            out += [tok.token_id(marker)] if marker else tok.encode(rest[0], add_bos=False)
            rest = rest[len(marker) if marker else 1:]
        return out

    return tok, Grammars(tok, len(tokens)), ids


@pytest.mark.parametrize("special", [True, False], ids=["special-tokens", "spelt-out"])
def test_required_calls_grammar(special):
    """tool_choice required: reasoning messages if the model writes them (any text up to <|end|>, which may
    hold a '<'), then a message to one of the functions with arguments valid against its parameters, ended by
    <|call|>; the markers the vocabulary's special tokens where they are (then their text spelt out is no
    marker), else their text. What the grammar allows reads back as those calls."""
    tok, grammars, ids = _vocabulary(special)

    def accepts(tools, text: str) -> bool:
        m = grammars.matcher(tool_calls.constraint(tools, tok))
        x = ids(text)
        return m.try_consume_tokens(x) == len(x) and m.is_accepting()

    required = dataclasses.replace(tool_calls.parse_tools({"tools": [WEATHER, CLOCK], "tool_choice": "required"}),
                                   fmt=tool_calls.HARMONY)
    named = dataclasses.replace(required, choice="function", named="get_time")
    thought = "<|channel|>analysis<|message|>a < b, so<|end|>"
    weather = CALL.format("get_weather", '{"city":"x"}')[len("<|start|>assistant"):]
    for text in (weather, thought + "<|start|>assistant" + weather):
        assert accepts(required, text)
        assert [c["function"]["name"] for c in harmony.parse(text, required)[2]] == ["get_weather"]
    assert not accepts(required, weather.replace('{"city":"x"}', "{}"))  # city is required
    assert not accepts(required, "<|channel|>final<|message|>hi<|return|>")  # no answer but a call
    assert not accepts(named, weather) and accepts(named, CALL.format("get_time", "{}")[len("<|start|>assistant"):])
    spec = tool_calls.constraint(required, tok).spec
    assert ("<[" in spec) == special and ('"<|call|>"' in spec) != special
    if special:  # the markers spelt out in text are not the model's markers
        m = grammars.matcher(tool_calls.constraint(required, tok))
        assert m.try_consume_tokens(tok.encode("<|channel|>", add_bos=False)) < len("<|channel|>")


@pytest.mark.parametrize("special", [True, False], ids=["special-tokens", "spelt-out"])
def test_a_structured_output_holds_the_final_message(special):
    """A JSON schema, a regex or a choice holds a harmony answer's final message, the reasoning before it free
    (as vLLM holds a structured output after the thinking); the reply reads back as the content. A Lark
    grammar of the request's own holds from the first token, as it is."""
    from jaxcb.host.structured import Constraint

    tok, grammars, ids = _vocabulary(special)
    thought = "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant"
    for c, good, bad in ((Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                  "required": ["a"]}), '{"a":1}', '{"a":"x"}'),
                         (Constraint("regex", r"\d{3}"), "123", "12a"), (Constraint("choice", '["yes", "no"]'), "no", "n"),
                         # as a json_schema holds it anywhere: objects closed, formats it does not know dropped
                         (Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
                          '{"a":1}', '{"a":1,"b":2}'),
                         (Constraint.json_schema({"type": "object", "properties": {"p": {
                             "type": "string", "format": "password"}}, "required": ["p"]}), '{"p":"x"}', '{}')):
        framed = harmony.framed(c, tok)
        assert framed.field == c.field
        for text, ok in ((good, True), (bad, False)):
            for before in ("", thought):
                answer = before + f"<|channel|>final<|message|>{text}<|return|>"
                m = grammars.matcher(framed)
                x = ids(answer)
                assert (m.try_consume_tokens(x) == len(x) and m.is_accepting()) == ok, (c.kind, answer)
                assert harmony.parse(answer)[1] == text
    lark = Constraint("grammar", 'start: "x"')
    assert harmony.framed(lark, tok) is lark


def test_served_requests_keep_the_markers_and_take_the_vllm_names():
    """The server's names for the format (vLLM's): --reasoning-parser openai_gptoss, --tool-call-parser openai."""
    from jaxcb.cli.commands import build_parser
    from serve import reasoning

    args = build_parser().parse_args(["serve", "--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai"])
    assert args.reasoning_parser == reasoning.HARMONY and tool_calls.choose_format(None, args.tool_call_parser)[0].harmony
    assert json.dumps(tool_calls.HARMONY.name) == '"harmony"'


def test_llm_chat_keeps_the_markers_of_a_harmony_template(make_llm):
    """LLM.chat with a harmony template: the answers keep its markers (skip_special_tokens false), so that
    harmony.parse reads them; other templates as the caller's params say."""
    from jaxcb.host.request import SamplingParams

    llm = make_llm()
    seen = []
    llm._run = lambda ids, params, _: seen.extend(params)  # the params the requests would run with
    params = SamplingParams(max_tokens=4)
    llm.chat([[{"role": "user", "content": "hi"}]], params, chat_template=HARMONY_TEMPLATE)
    llm.chat([[{"role": "user", "content": "hi"}]], params)
    assert [p.skip_special_tokens for p in seen] == [False, True]
