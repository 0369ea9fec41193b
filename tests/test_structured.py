"""Structured output (jaxcb.host.structured): constraints enforced inside the step, on the tiny model
(random weights: whatever it would say, the mask decides what it may say) and on the embedded models'
tokenizers (byte-level BPE and SentencePiece with byte fallback)."""

import json
import re

import jsonschema
import pytest

from jaxcb.host.errors import InvalidRequest
from jaxcb.host.request import SamplingParams
from jaxcb.host.structured import Constraint, from_guided, from_response_format, from_structured_outputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bc", "d"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
    },
    "required": ["name", "age", "tags", "code"],
    "additionalProperties": False,
}
REGEX = r"\d{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue", "café", "日本"]  # multi-byte characters too
GRAMMAR = 'start: "x=" NUM (", " NUM)*\nNUM: /[1-9][0-9]?/'


def _check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"x=[1-9][0-9]?(, [1-9][0-9]?)*", text), text


# JSON compact here: the tests' random-weight models, sampling, pick whitespace among the tokens a gap allows
# more often than not (real models write JSON as they learnt it: JSON_WHITESPACE lets them)
CONSTRAINTS = {"json": Constraint.json_schema({**SCHEMA, "x-guidance": {"whitespace_flexible": False}}),
               "regex": Constraint("regex", REGEX),
               "choice": Constraint.choice(CHOICES), "grammar": Constraint("grammar", GRAMMAR)}


def test_every_kind_holds_at_temperature_one_with_n_samples_beside_free_rows(make_llm):
    llm = make_llm()
    prompts, params = [], []
    for seed in range(3):
        for kind, c in CONSTRAINTS.items():
            prompts.append([5 + seed, 6, 7, 8])
            params.append(SamplingParams(max_tokens=120, temperature=1.0, seed=seed, n=2, structured=c))
    free = [[9, 10, 11], [12, 13]]
    alone = llm.generate(free, SamplingParams(max_tokens=20, ignore_eos=True))
    outs = llm.generate(prompts + free, params + [SamplingParams(max_tokens=20, ignore_eos=True)] * 2)
    kinds = [k for _ in range(3) for k in CONSTRAINTS]
    constrained = outs[:-2]
    assert len(constrained) == 2 * len(kinds)
    for i, kind in enumerate(kinds):
        for o in (constrained[2 * i], constrained[2 * i + 1]):
            assert o.finish_reason == "stop", (kind, o.text, o.finish_reason)
            _check(kind, o.text)
    # Rows without a constraint in the same batches: the tokens they get alone.
    assert [o.token_ids for o in outs[-2:]] == [o.token_ids for o in alone]


def test_constrained_output_is_the_same_under_preemption_and_without_async(make_llm):
    kinds = ("json", "regex", "grammar") * 2
    # Free requests that fill the pool first, then the constrained ones (the latest: preempted first).
    prompts = [[3 + i] + list(range(6, 36)) for i in range(4)] + [[5 + i] + list(range(6, 40)) for i in range(6)]
    params = ([SamplingParams(max_tokens=40, ignore_eos=True)] * 4
              + [SamplingParams(max_tokens=120, temperature=1.0 if i % 2 else 0.0, seed=i, structured=CONSTRAINTS[k])
                 for i, k in enumerate(kinds)])
    reference = [o.text for o in make_llm(num_pages=256).generate(prompts, params)]
    for o, k in zip(reference[4:], kinds):
        _check(k, o)
    tight = make_llm(num_pages=14, async_scheduling=False)
    preempted = []
    preempt = tight.engine.scheduler.preempt
    tight.engine.scheduler.preempt = lambda r, *a, **kw: (preempted.append(r.matcher is not None), preempt(r, *a, **kw))[1]
    assert [o.text for o in tight.generate(prompts, params)] == reference
    assert any(preempted), "no constrained request was preempted"


def test_async_scheduling_gives_the_synchronous_tokens_with_constraints_in_the_batch(make_llm):
    """With async scheduling a constrained row's step is packed while the step before it runs; its
    mask waits only for that step's tokens. The tokens are those of the synchronous engine."""
    prompts = [[5 + i] + list(range(6, 6 + 3 * i)) for i in range(8)]
    kinds = list(CONSTRAINTS) * 2
    params = [SamplingParams(max_tokens=150, temperature=0.8 * (i % 2), seed=i,
                             structured=CONSTRAINTS[k] if i % 3 else None, ignore_eos=not i % 3)
              for i, k in enumerate(kinds)]
    sync = make_llm(async_scheduling=False).generate(prompts, params)
    llm = make_llm(async_scheduling=True)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in sync]
    st = llm.engine.stats()
    assert st.structured_steps > 0 and st.structured_rows_per_step >= 1
    for i, (o, k) in enumerate(zip(got, kinds)):
        if i % 3:
            assert o.finish_reason == "stop", (k, o.text)
            _check(k, o.text)


@pytest.mark.parametrize("constraint, message", [
    (lambda: Constraint("regex", "[a-"), "structured_outputs: not a valid regex"),
    (lambda: Constraint("grammar", "start: foo\nfoo: 'a' bar"), "structured_outputs: not a valid grammar"),
    (lambda: Constraint.json_schema('{"type": "objec"}'), "structured_outputs.json: not a JSON schema that can be"),
    (lambda: Constraint.json_schema("[1, 2"), "structured_outputs.json: not a valid json"),
    (lambda: Constraint.choice([]), "structured_outputs.choice: must be a non-empty list"),
    (lambda: Constraint.json_schema(False), "structured_outputs.json: the schema false admits no value"),
    (lambda: from_structured_outputs({"json": False}), "structured_outputs.json: the schema false admits no value"),
    (lambda: Constraint("grammar", "start: a", "tools", (("tools[1].function.parameters", "x" * 70_000),)),
     "tools[1].function.parameters: the schema has 70000 characters; the limit is 65536"),
    (lambda: Constraint.json_schema({"type": "array", "uniqueItems": True, "items": {"not": {"type": "null"}}}),
     "structured_outputs.json: the schema uses keywords that cannot be enforced while generating: "),
    (lambda: Constraint("regex", "a" * 70_000), "the regex has 70000 characters; the limit is 65536"),
    (lambda: Constraint("sql", "x"), "the kind 'sql' is not one of"),
    (lambda: Constraint.json_schema({"$ref": "#"}), "structured_outputs.json: no output matches it"),
    # failing a few tokens in (Grammars._probe): a required property that holds itself, past its forced {"x":;
    # too many optional properties, once an object begins; arrays that must hold arrays without end
    (lambda: Constraint.json_schema({"type": "object", "properties": {"x": {"$ref": "#/properties/x"}},
                                     "required": ["x"]}), "structured_outputs.json: no output matches it"),
    (lambda: Constraint.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}),
     "structured_outputs.json: too large to enforce while generating (Parser Error: Current row has"),
    (lambda: Constraint.json_schema({"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
     "structured_outputs.json: too large to enforce while generating"),
    (lambda: Constraint("regex", "(" * 2000 + "a" + ")" * 2000), "structured_outputs: not a valid regex"),
])
def test_a_bad_constraint_is_refused_by_name_before_it_runs(make_llm, constraint, message):
    llm = make_llm()
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        llm.generate([[5, 6]], SamplingParams(max_tokens=4, structured=constraint()))
    assert not llm.engine.has_work()


def test_schema_true_is_any_json_and_lenient_schemas_generate_without_the_keywords_they_cannot_enforce(make_llm):
    """`true` admits any JSON value (as {} does); a schema with keywords llguidance cannot enforce
    (uniqueItems) is refused naming them, and generates under the rest when it asks for lenient mode."""
    llm = make_llm()
    unique = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4, "uniqueItems": True}
    with pytest.raises(InvalidRequest, match=re.escape('keywords that cannot be enforced while generating: ["uniqueItems"]')):
        llm.generate([[5, 6]], SamplingParams(max_tokens=4, structured=Constraint.json_schema(unique)))
    lenient = dict(unique, **{"x-guidance": {"lenient": True}})
    outs = llm.generate([[5, 6, 7], [8, 9]], [
        SamplingParams(max_tokens=60, temperature=1.0, seed=1, structured=Constraint.json_schema(lenient)),
        SamplingParams(max_tokens=60, temperature=1.0, seed=2, structured=Constraint.json_schema(True))])
    assert outs[0].finish_reason == "stop", outs[0].text
    value = json.loads(outs[0].text)  # the rest of the schema holds
    assert isinstance(value, list) and 2 <= len(value) <= 4 and all(isinstance(v, int) for v in value), value
    if outs[1].finish_reason == "stop":
        json.loads(outs[1].text)  # any JSON value
    assert not llm.engine.has_work()


def test_the_request_shapes_of_both_apis():
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}).spec == '{"type": "object"}'
    c = from_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}})
    assert c.kind == "json" and json.loads(c.spec) == SCHEMA and c.field == "response_format.json_schema.schema"
    assert from_structured_outputs({"regex": "a+"}) == Constraint("regex", "a+", "structured_outputs.regex")
    assert from_structured_outputs({"choice": ["x", "y"]}).kind == "choice"
    assert from_structured_outputs({"json": SCHEMA}).kind == "json"
    assert from_structured_outputs({"grammar": GRAMMAR}).kind == "grammar"
    assert from_structured_outputs({"json": SCHEMA, "disable_fallback": False, "disable_additional_properties": True}) == (
        from_structured_outputs({"json": SCHEMA}))  # vLLM's options: what jaxcb's grammars do anyway
    compact = from_structured_outputs({"json": SCHEMA, "disable_any_whitespace": True})  # ... but this one
    assert json.loads(compact.spec) == {**SCHEMA, "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}}
    assert from_guided({"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}) == Constraint(
        "regex", "a+", "guided_regex")
    assert from_guided({"max_tokens": 3}) is None
    for bad, message in [
        ({"type": "xml"}, "response_format.type: 'xml' is not one of"),
        ({"type": "json_schema"}, "response_format.json_schema: must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "nme": "x"}}, "response_format.json_schema.nme"),
    ]:
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            from_response_format(bad)
    for bad, message in [
        ({"regex": "a", "choice": ["b"]}, "give exactly one of"),
        ({}, "give exactly one of"),
        ({"structural_tag": "x"}, "structured_outputs.structural_tag: not valid JSON"),
        ({"structural_tag": {"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<g"]}},
         "structured_outputs.structural_tag.structures[0].begin: '<f>' starts with none of the triggers"),
        ({"structural_tag": {"structures": [], "triggers": ["<f"]}},
         "structured_outputs.structural_tag.structures: must be a list of 1 to 128"),
        ({"json_object": False}, "give exactly one of"),
        ({"regex": 5}, "structured_outputs.regex: must be a string"),
        ({"regex": "a", "disable_fallback": "yes"}, "structured_outputs.disable_fallback: must be true or false"),
        ({"regex": "a", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern: not supported"),
    ]:
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            from_structured_outputs(bad)


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_the_embedded_models_tokenizers_spell_multibyte_choices_exactly(model):
    """Byte-level BPE (SmolLM2) and SentencePiece with byte fallback (Gemma 3): a choice of words with
    multi-byte characters comes out exactly, whichever tokens spell it."""
    from jaxcb.host.structured import Grammars
    from jaxcb.host.tokenizer import Tokenizer
    from jaxcb.model import gguf_loader
    from jaxcb.model.embedded import resolve_model

    reader = gguf_loader.open_reader(resolve_model(model))  # the tokenizer alone, no weights
    cfg, tok = gguf_loader.read_config(reader), Tokenizer(gguf_loader.read_tokenizer(reader))
    g = Grammars(tok, cfg.vocab_size, [tok.eos_id])
    words = ["café", "naïve", "日本語", "Ünïcödé ✓"]
    for word in words:
        m = g.matcher(Constraint.choice(words))
        ids = tok.encode(word)
        if ids and ids[0] == tok.bos_id:
            ids = ids[1:]
        assert m.consume_tokens(ids), (word, m.get_error())
        assert m.is_accepting() and tok.decode(ids) == word


def test_constraints_hold_with_round_robin_stop_strings_logprobs_and_abort(make_llm):
    """Round-robin yielding (a request gives its slot away and comes back: its matcher keeps its state),
    stop strings (the text ends before the stop, the tokens stay grammar-valid), logprobs (of the
    model's own distribution), and an abort mid-generation (its pages come back: the fixture checks)."""
    prompts = [[5 + i, 6, 7] for i in range(6)]
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured=CONSTRAINTS["json"]) for i in range(6)]
    ample = make_llm().generate(prompts, params)
    rr = make_llm(policy="round-robin", quantum_tokens=4, decode_batch=(1, 2))
    got = rr.generate(prompts, params)
    assert rr.engine.stats().switches > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ample]
    for o in got:
        _check("json", o.text)
    llm = make_llm()
    (stopped,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=120, stop=('"age"',), logprobs=2,
                                                          structured=CONSTRAINTS["json"]))
    assert stopped.text.startswith('{"') and '"age"' not in stopped.text
    assert len(stopped.logprobs) == len(stopped.token_ids)
    engine = llm.engine
    rid = engine.add_request([8, 9], SamplingParams(max_tokens=100, structured=CONSTRAINTS["grammar"]))
    for _ in range(3):
        engine.step()
    engine.abort(rid)
    engine.run_until_done()


def test_a_constraint_that_compiles_too_long_is_refused_with_the_limit(monkeypatch):
    """The server compiles a constraint off the event loop, within MAX_COMPILE_S (llguidance's own fuel
    limits bound the work too): past it the request is refused, naming the limit."""
    import asyncio
    import time
    import types

    from serve import frontend

    monkeypatch.setattr(frontend, "MAX_COMPILE_S", 0.2)
    slow = types.SimpleNamespace(check_constraint=lambda c: time.sleep(1.0))
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"structured_outputs: compiling the regex took longer than the limit of 0.2 s"):
        asyncio.run(frontend.check_constraint(types.SimpleNamespace(engine=slow), Constraint("regex", "a+")))
    assert time.monotonic() - t0 < 5


def test_objects_that_list_their_properties_get_no_others_unless_the_schema_allows_them():
    """A schema's objects are closed to keys they do not list (as vLLM's and SGLang's default backend
    reads them; a small model otherwise adds keys until its tokens run out), except where the schema
    allows others or closing could refuse what it allows (intersections, keys required or counted
    beyond the listed ones). Whatever comes out still validates against the schema as given."""
    from jaxcb.host.structured import Grammars, grammar_schema
    from jaxcb.host.tokenizer import Tokenizer
    from jaxcb.model import gguf_loader
    from jaxcb.model.embedded import resolve_model

    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    schema = {"$defs": {"pt": point, "base": {"properties": {"a": {"type": "integer"}}}},
              "type": "object", "properties": {
                  "p": {"$ref": "#/$defs/pt"},
                  "both": {"allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {"type": "integer"}}}]},
                  "list": {"type": "array", "items": point},
                  "more": {"properties": {"z": {}}, "required": ["y"]},
                  "open": {"properties": {"z": {}}, "additionalProperties": True},
                  "maybe": {"anyOf": [point, {"type": "null"}]}}}
    closed = grammar_schema(schema)
    assert schema["$defs"]["pt"] == point and "additionalProperties" not in point  # the input is not changed
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["pt"]["additionalProperties"] is False  # used by $ref alone: closed
    assert "additionalProperties" not in closed["$defs"]["base"]  # intersected through allOf: open
    assert all("additionalProperties" not in s for s in closed["properties"]["both"]["allOf"])
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["more"]  # requires y, which it does not list
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["maybe"]["anyOf"][0]["additionalProperties"] is False
    assert grammar_schema({"type": "object"}) == {"type": "object"}  # any object stays any object
    assert grammar_schema(True) is True

    reader = gguf_loader.open_reader(resolve_model("smollm2-135m"))  # the tokenizer alone, no weights
    cfg, tok = gguf_loader.read_config(reader), Tokenizer(gguf_loader.read_tokenizer(reader))
    g = Grammars(tok, cfg.vocab_size, [tok.eos_id])

    def accepts(s, text: str) -> bool:
        m = g.matcher(s if isinstance(s, Constraint) else Constraint.json_schema(s))
        ids = tok.encode(text)
        if ids and ids[0] == tok.bos_id:
            ids = ids[1:]
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    assert accepts(schema, '{"p":{"x":1},"both":{"a":1,"b":2,"c":3},"more":{"y":1},"open":{"w":1},"maybe":null}')
    assert not accepts(schema, '{"p":{"x":1},"q":2}')  # a key the top level does not list
    assert not accepts(schema, '{"p":{"x":1,"y":2}}')  # nor its $ref'd object
    assert not accepts(schema, '{"list":[{"x":1,"w":2}]}')
    assert accepts({"type": "object"}, '{"anything":[1]}')
    # oneOf whose branches llguidance cannot prove disjoint: read as anyOf (as xgrammar does), not refused.
    # Formats llguidance does not know are annotations (pydantic's "password"); those it knows hold.
    formats = {"type": "object", "properties": {"p": {"type": "string", "format": "password"},
                                                "d": {"type": "string", "format": "date"}}}
    assert accepts(formats, '{"p":"x","d":"2026-12-05"}') and not accepts(formats, '{"p":"x","d":"soon"}')
    union = {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}
    assert accepts(union, '{"v":1.5}') and not accepts(union, '{"v":"1"}')
    # A tool's parameters, in the tool-call grammar of tool_choice "required", likewise.
    from jaxcb.host import tool_calls

    tools = tool_calls.parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": point}}],
                                    "tool_choice": "required"})
    call = tool_calls.HERMES.open + '{"name":"f","arguments":%s}' + tool_calls.HERMES.close
    assert accepts(tool_calls.constraint(tools), call % '{"x":1}')
    assert not accepts(tool_calls.constraint(tools), call % '{"x":1,"y":2}')
    # Whitespace as pretty-printed JSON writes it, bounded (vLLM's disable_any_whitespace: none); a model that ends
    # its line after its last call may end its answer there
    pretty = '{\n  "p": {\n    "x": 1\n  },\n  "list": [\n    {"x": 2}\n  ]\n}'
    assert accepts(schema, pretty) and accepts(tool_calls.constraint(tools), call % '{"x":1}' + "\n")
    assert not accepts(schema, '{"p": {"x": 1' + " " * 41 + "}}") and accepts(schema, '{"p": {"x": 1' + " " * 40 + "}}")
    assert not accepts(schema, '{"p": {"x": 1\n\n}}') and accepts(schema, '{"p": {"x": 1\r\n\t}}')
    assert not accepts(schema, " " + pretty) and not accepts(schema, pretty + "\n")  # (nothing around the value)
    assert not accepts(from_structured_outputs({"json": schema, "disable_any_whitespace": True}), pretty)
    assert not accepts({**schema, "x-guidance": {"whitespace_flexible": False}}, pretty)
    # vLLM's structural tags: free text, each structure's JSON (as a tool call's) between its begin and its end
    tag = from_response_format({"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=f>", "schema": point, "end": "</function>"}]})
    assert tag.kind == "structural_tag" and tag.parts[0][0] == "response_format.structures[0].schema"
    assert accepts(tag, "no call") and accepts(tag, 'one: <function=f>{"x":1}</function> done')
    assert not accepts(tag, '<function=f>{"x":1,"y":2}</function>') and not accepts(tag, '<function=f>{"x":1}')
    assert not accepts(tag, "<function=g>{}")  # (a trigger begins one of the structures)
    assert not accepts(tool_calls.constraint(tools), call % '{"x":1}' + "\n\n")
    assert not accepts(tool_calls.constraint(tools), call % '{"x": 1}')  # (a call's line: compact JSON, as before)
    # Objects that give their values (const, enum) are left open: closed, values with keys they do not list would be
    # refused; and where a reference that is intersected is an $anchor or an $id, nothing is closed
    valued = {"type": "object", "properties": {"a": {"type": "integer"}}, "const": {"a": 1, "b": 2}}
    assert accepts(valued, '{"a":1,"b":2}') and not accepts(valued, '{"a":1}')
    bounded = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["k"]}
    also = {"properties": {"m": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["m"]}
    for defined, ref in (({**bounded, "$anchor": "base"}, "#base"), ({**bounded, "$id": "item"}, "item"),
                         (bounded, "https://example.com/root#/$defs/x")):
        both = {"$id": "https://example.com/root", "$defs": {"x": defined}, "allOf": [{"$ref": ref}, also]}
        assert accepts(both, '{"k":1,"m":2}') and not accepts(both, '{"k":1}'), ref
    # An integer's bound past 64-bit integers that leaves it no 64-bit value is refused (llguidance would clamp it,
    # and write values the schema does not admit); one that only cuts off values past them is held as a float
    for bound in ({"minimum": 1e19}, {"minimum": 2**64}, {"exclusiveMinimum": 2**63 - 1}, {"maximum": -(2**63) - 1}):
        with pytest.raises(InvalidRequest, match=f"^response_format: #/{next(iter(bound))}: .* leaves the integer no "):
            g.compile(Constraint("json", json.dumps({"type": "integer", **bound}), "response_format"))
    assert accepts({"type": "integer", "minimum": 2**63 - 2, "maximum": 10**30}, str(2**63 - 1))
    compact = Grammars(tok, cfg.vocab_size, [tok.eos_id], json_whitespace="compact")  # (--json-whitespace compact)
    assert not compact.matcher(Constraint.json_schema(schema)).try_consume_tokens(tok.encode(pretty)[1:]) == len(
        tok.encode(pretty)) - 1


def test_a_grammar_after_a_token_leaves_the_text_before_it_free(make_llm):
    """structured_after (a reasoning part's end, as the server sets it under a reasoning parser): the
    tokens up to and including that token are free, the rest hold to the grammar; a request whose token
    never comes is never constrained. (The first token is forced by a logit bias: the tiny model thinks
    nothing.)"""
    llm = make_llm()
    tok = llm.tokenizer
    end, other = tok.encode("#")[-1], tok.encode("%")[-1]
    regex = Constraint("regex", "[a-z]{3}")
    bias = {end: 100.0}
    after, never, plain = llm.generate([[5, 6, 7]] * 3, [
        SamplingParams(max_tokens=12, structured=regex, structured_after=end, logit_bias=bias),
        SamplingParams(max_tokens=12, structured=regex, structured_after=other, logit_bias=bias),
        SamplingParams(max_tokens=12, structured=regex, logit_bias=bias)])
    assert after.token_ids[0] == end and after.finish_reason == "stop"
    assert re.fullmatch(r"[a-z]{3}", tok.decode(after.token_ids[1:])), after.text
    assert never.token_ids == [end] * 12 and never.finish_reason == "length"  # free all along
    assert re.fullmatch(r"[a-z]{3}", plain.text) and end not in plain.token_ids  # the grammar from the start
    assert not llm.engine.has_work()


def test_a_constraint_that_fails_while_generating_ends_its_request_with_an_error_naming_the_field(make_llm):
    """A schema whose required property must hold itself, behind a key of more tokens than the check at
    compile time tries (Grammars._probe): the output begins ({"<key>":) and then nothing can follow. The
    request ends as an error naming its field (it ended as a "stop" with that fragment for its text);
    the request beside it runs on, and every page comes back."""
    from jaxcb.host.structured import PROBE_DEPTH

    llm = make_llm()
    key = "abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz"
    assert len(llm.tokenizer.encode(f'{{"{key}":', add_bos=False)) > PROBE_DEPTH
    looping = Constraint.json_schema({"type": "object", "properties": {key: {"$ref": f"#/properties/{key}"}},
                                      "required": [key]})
    bad, good = llm.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=200, structured=looping),
                                                SamplingParams(max_tokens=8, ignore_eos=True)])
    assert bad.finish_reason == "error", (bad.finish_reason, bad.text)
    assert bad.error.startswith("structured_outputs.json: nothing can follow the output's first "), bad.error
    assert len(good.token_ids) == 8 and good.finish_reason == "length"
    llm.engine.pool.check_all_free()
