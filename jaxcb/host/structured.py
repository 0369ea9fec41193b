"""Structured output: a constraint that a request's output must match (a JSON schema, any JSON object,
a regex, one of several strings, or a Lark / GBNF grammar), enforced token by token.

The grammar work is llguidance's (the library vLLM and sglang-jax use; Rust, no torch): it compiles a
constraint against the model's tokenizer and, for a request's tokens so far, gives the set of tokens
that may come next as a bitmask of ceil(V/32) int32 words. Here:

- `Constraint` is what a request carries (SamplingParams.structured): kind and text, checked for size.
- `Grammars` is one tokenizer's machinery: the llguidance tokenizer (built once, ~1 s), a cache of
  compiled constraints (LRU; a constraint compiles once, off the engine thread, when its first request
  is checked; every request then gets a cheap copy of the compiled matcher), and the pool of threads
  that computes a step's masks in parallel.

The engine (jaxcb.host.engine) gives each constrained sample a matcher, writes the matchers' masks into
the step's `allowed` input (all ones for free rows) and advances each matcher with the token the step
sampled; the step itself (jaxcb.device.sampling) sets the disallowed logits to -inf before sampling.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import weakref

import numpy as np

from jaxcb.host.errors import InvalidRequest

KINDS = ("json", "regex", "choice", "grammar", "structural_tag")
MAX_STRUCTURES = 128  # a structural tag's structures
MAX_SPEC_CHARS = 1 << 16  # a schema, regex or grammar's text
MAX_CHOICES = 256
ASCII_CLASSES = "dw"  # in a regex constraint, \d is [0-9] and \w is [0-9a-zA-Z_], not any Unicode digit or letter
CACHE_SIZE = 256  # compiled constraints kept per tokenizer
# A compiled constraint is tried on its first PROBE_DEPTH tokens along every way of going on while there are at
# most PROBE_WAYS (Grammars._probe): one that fails there is refused before the request runs.
PROBE_DEPTH, PROBE_WAYS = 8, 4
# llguidance's resource limits (its LLParserLimits): they bound the work of compiling a constraint and
# of each step's mask, so a hostile grammar is refused with the limit it hit instead of stalling.
LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
              step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000,
              verbose_errors=False)


@dataclasses.dataclass(frozen=True)
class Constraint:
    """kind: "json" (spec: a JSON schema's text; '{"type": "object"}' for any object), "regex" (spec:
    the pattern; the whole output must match), "choice" (spec: a JSON list of strings), "grammar"
    (spec: a Lark grammar, or GBNF as llama.cpp writes it), "structural_tag" (spec: {"structures": [{begin,
    schema, end}], "triggers": [...]} as JSON: free text, in which each structure's begin, once one of the triggers
    starts it, is followed by JSON its schema admits and its end: vLLM's structural tags, llguidance's lazy
    grammars, as tool calls inside text are written). `field` names the request field the
    constraint came from, for errors. `parts`: the JSON schemas a grammar embeds, each with its own
    request field ((field, schema text), ...: a tool's parameters), so that a schema llguidance refuses
    is named by its field, not as the grammar."""

    kind: str
    spec: str
    field: str = "structured_outputs"
    parts: tuple[tuple[str, str], ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequest(f"{self.field}: the kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str) or not self.spec:
            raise InvalidRequest(f"{self.field}: the {self.kind} must be a non-empty string")
        for field, text in self.parts:  # (a tool's parameters past the limit: named by their own field)
            if len(text) > MAX_SPEC_CHARS:
                raise InvalidRequest(f"{field}: the schema has {len(text)} characters; the limit is {MAX_SPEC_CHARS}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequest(f"{self.field}: the {self.kind} has {len(self.spec)} characters; "
                                 f"the limit is {MAX_SPEC_CHARS}")

    @classmethod
    def json_schema(cls, schema, field: str = "structured_outputs.json") -> "Constraint":
        """A schema given as a dict (or a bool) or as JSON text."""
        if isinstance(schema, str):
            text = schema
        elif isinstance(schema, (dict, bool)):
            text = json.dumps(schema)
        else:
            raise InvalidRequest(f"{field}: must be a JSON schema (an object), got {type(schema).__name__}")
        return cls("json", text, field)

    @classmethod
    def json_object(cls, field: str = "response_format") -> "Constraint":
        return cls("json", '{"type": "object"}', field)

    @classmethod
    def structural_tag(cls, obj, field: str = "structured_outputs.structural_tag") -> "Constraint":
        """vLLM's structural tag {"structures": [{"begin", "schema", "end"}], "triggers": [...]} (a dict, or JSON
        text), each structure's begin starting with one of the triggers."""
        if isinstance(obj, str):
            try:
                obj = json.loads(obj)
            except ValueError as e:
                raise InvalidRequest(f"{field}: not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise InvalidRequest(f"{field}: must be an object {{structures, triggers}}")
        unknown = sorted(set(obj) - {"type", "structures", "triggers"})
        if unknown:
            raise InvalidRequest(f"{field}.{unknown[0]}: not a field of a structural tag (structures, triggers)")
        triggers, structures = obj.get("triggers"), obj.get("structures")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise InvalidRequest(f"{field}.triggers: must be a non-empty list of non-empty strings")
        if not isinstance(structures, list) or not 0 < len(structures) <= MAX_STRUCTURES:
            raise InvalidRequest(f"{field}.structures: must be a list of 1 to {MAX_STRUCTURES} structures")
        parts = []
        for i, s in enumerate(structures):
            where = f"{field}.structures[{i}]"
            if not isinstance(s, dict) or set(s) - {"begin", "schema", "end"}:
                raise InvalidRequest(f"{where}: must be an object {{begin, schema, end}}")
            if not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
                raise InvalidRequest(f"{where}: begin and end must be strings")
            if not any(s["begin"].startswith(t) for t in triggers):
                raise InvalidRequest(f"{where}.begin: {s['begin'][:64]!r} starts with none of the triggers")
            schema = s.get("schema", {})
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest(f"{where}.schema: must be a JSON schema (an object)")
            parts.append((f"{where}.schema", json.dumps(schema)))
        spec = json.dumps({"structures": [{"begin": s["begin"], "schema": s.get("schema", {}), "end": s["end"]}
                                          for s in structures], "triggers": triggers})
        return cls("structural_tag", spec, field, tuple(parts))

    @classmethod
    def choice(cls, choices, field: str = "structured_outputs.choice") -> "Constraint":
        if (not isinstance(choices, (list, tuple)) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise InvalidRequest(f"{field}: must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise InvalidRequest(f"{field}: {len(choices)} choices; the limit is {MAX_CHOICES}")
        return cls("choice", json.dumps(list(choices)), field)

    def grammar(self) -> str:
        """llguidance's grammar for this constraint (not yet checked: Grammars.compile does that)."""
        import llguidance

        try:
            if self.kind == "json":
                schema = json.loads(self.spec)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema is an object")
                if schema is False:
                    raise Unheld("the schema false admits no value")
                if schema is True:  # any JSON value, as JSON Schema reads it (and {} says)
                    schema = {}
                # oneOf as anyOf where llguidance cannot prove the branches disjoint (as xgrammar reads
                # it): a typical tagged union's branches cannot both match, and it is refused otherwise.
                return llguidance.LLMatcher.grammar_from_json_schema(grammar_schema(schema),
                                                                     defaults=json_defaults(schema))
            if self.kind == "regex":  # \d, \w as ASCII classes (as JSON schema patterns read them)
                return llguidance.LLMatcher.grammar_from_lark(
                    f"start: /{llguidance.regex_to_lark(self.spec, ASCII_CLASSES)}/")
            if self.kind == "choice":
                return llguidance.grammar_from("choice", self.spec)
            if self.kind == "structural_tag":  # (each schema as a tool's arguments are held: lark_schema)
                tag = json.loads(self.spec)
                return llguidance.StructTag.to_grammar([llguidance.StructTag(
                    trigger=next(t for t in tag["triggers"] if s["begin"].startswith(t)), begin=s["begin"],
                    grammar=lark_schema(s["schema"]), end=s["end"]) for s in tag["structures"]])
            return llguidance.grammar_from("grammar", self.spec)
        except Unheld as e:
            raise InvalidRequest(f"{self.field}: {e}") from None
        except (ValueError, TypeError, RecursionError) as e:
            raise InvalidRequest(f"{self.field}: not a valid {self.kind} ({_first_line(e)})") from None


# Keywords whose values are schemas (one, a map of them, a list of them), as grammar_schema walks them.
_ONE_SCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
# Keywords that say nothing about an instance: a schema with only these beside a combinator is the combinator.
_ANNOTATIONS = {"title", "description", "$comment", "$schema", "$id", "$anchor", "examples", "default",
                "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "x-guidance"}


# The string formats llguidance enforces; others are dropped (JSON Schema reads an unknown format as an
# annotation, and pydantic and OpenAPI write some, e.g. "password", "binary", "uri-reference").
FORMATS = {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}


# The whitespace JSON output may have between two of its tokens: what pretty-printed JSON writes (a newline and an
# indent, a space after a colon or comma), one line's worth, so that a model cannot loop on whitespace until its
# tokens run out. Models trained on pretty-printed JSON lose their way when made to write it compact.
JSON_WHITESPACE = r"(\r?\n)?[ \t]{0,40}"
# How a JSON schema is held (a schema's own x-guidance over these): JSON_WHITESPACE between tokens (none before
# the value or after it); oneOf as anyOf where llguidance cannot prove the branches disjoint (as xgrammar reads
# it: a tagged union's cannot both match)
JSON_DEFAULTS = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE, "coerce_one_of": True}
COMPACT = {"whitespace_flexible": False, "whitespace_pattern": None}  # vLLM's disable_any_whitespace
# JSON inside a grammar (a tool call's arguments, written on the call's line as chat templates render them): compact
LARK_JSON = {**COMPACT, "coerce_one_of": True}


def with_whitespace(c: "Constraint | None", options: dict) -> "Constraint | None":
    """A json constraint whose schema takes `options` (x-guidance's whitespace keys: COMPACT, or a
    whitespace_pattern) where the schema says nothing of them itself; other constraints as they are."""
    if c is None or c.kind != "json":
        return c
    try:
        schema = json.loads(c.spec)
    except ValueError:  # (refused by its grammar(), naming it)
        return c
    if schema is True:  # (any JSON value, as {} says)
        schema = {}
    if not isinstance(schema, dict):
        return c
    own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    return dataclasses.replace(c, spec=json.dumps({**schema, "x-guidance": {**options, **own}}))


def lark_schema(schema):
    """`schema` as a Lark grammar's `%json` holds it (grammar_schema, and LARK_JSON under the schema's own
    x-guidance): a tool's arguments, a harmony answer's reply."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        return schema
    own = schema.get("x-guidance")
    schema = {**schema, "x-guidance": {**LARK_JSON, **(own if isinstance(own, dict) else {})}}
    try:
        return grammar_schema(schema)
    except Unheld:  # (refused by its own field: Grammars.compile probes each embedded schema before the grammar)
        return schema


def json_defaults(schema) -> dict:
    """JSON_DEFAULTS for `schema`: without the whitespace pattern where its own x-guidance turns flexible
    whitespace off and gives none (a pattern would turn it back on)."""
    own = schema.get("x-guidance") if isinstance(schema, dict) else None
    if isinstance(own, dict) and own.get("whitespace_flexible") is False and not own.get("whitespace_pattern"):
        return {**JSON_DEFAULTS, "whitespace_pattern": None}
    return JSON_DEFAULTS


def grammar_schema(schema):
    """`schema` as jaxcb hands it to llguidance: string formats it does not know dropped (FORMATS), and
    every object that lists its properties and says nothing of others closed to them
    (additionalProperties: false), as vLLM's and SGLang's default grammar backend (xgrammar's strict
    mode) and OpenAI's strict schemas read them: a small model asked for {name, age} otherwise goes on
    with keys of its own until its tokens run out. An object stays as JSON Schema reads it where closing
    it could refuse what the schema allows: it says additionalProperties, patternProperties or
    unevaluatedProperties itself, requires or counts keys beyond its properties, or is intersected with
    another schema (allOf's members, a $ref or a combinator with sibling keywords, if/then/else,
    dependentSchemas), as is a $defs entry that some $ref intersects, or gives its values (const, enum); where
    a reference that is intersected is not a JSON pointer (an $anchor, an $id), nothing is closed. Returns a
    new schema."""
    if not isinstance(schema, dict):
        return schema
    intersected: set[str] = set()  # the $ref targets that are intersected somewhere

    def find(node, inside: bool) -> None:
        if isinstance(node, list):
            for x in node:
                find(x, inside)
            return
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str) and (inside or set(node) - _ANNOTATIONS - {"$ref", "type"}):
            intersected.add(ref)
        for key, value in node.items():
            if key in ("allOf", "if", "then", "else"):
                find(value, True)
            elif key in ("anyOf", "oneOf"):
                find(value, bool(set(node) - _ANNOTATIONS - {key, "type"}))
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                find(list(value.values()), key == "dependentSchemas")
            elif key in _ONE_SCHEMA or key in _SCHEMA_LISTS:
                find(value, False)

    def close(node, pointer: str, inside: bool):
        if isinstance(node, list):
            return [close(x, f"{pointer}/{i}", inside) for i, x in enumerate(node)]
        if not isinstance(node, dict):
            return node
        out = {}
        combined = set(node) - _ANNOTATIONS
        for key, value in node.items():
            if key in ("allOf", "if", "then", "else"):
                out[key] = close(value, f"{pointer}/{key}", True)
            elif key in ("anyOf", "oneOf"):
                out[key] = close(value, f"{pointer}/{key}", bool(combined - {key, "type"}))
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {k: close(v, f"{pointer}/{key}/{_escape(k)}", key == "dependentSchemas")
                            for k, v in value.items()}
            elif key in _ONE_SCHEMA or key in _SCHEMA_LISTS:
                out[key] = close(value, f"{pointer}/{key}", False)
            elif key == "format" and isinstance(value, str) and value not in FORMATS:
                continue
            elif key in _BOUNDS and isinstance(value, int) and not isinstance(value, bool) and not (
                    -2**63 <= value < 2**63):
                out[key] = float(value)  # (llguidance reads 64-bit integers; a float bound loses nothing here)
            else:
                out[key] = value
        _check_integer_bounds(node, pointer)
        props = node.get("properties")
        required = node.get("required", [])
        if (isinstance(props, dict) and not inside and pointer not in intersected and not foreign
                and not combined & {"additionalProperties", "patternProperties", "unevaluatedProperties",
                                    "allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "not",
                                    "dependentSchemas", "dependentRequired", "propertyNames", "const", "enum"}
                and isinstance(required, list) and all(name in props for name in required)
                and not (isinstance(node.get("minProperties"), int) and node["minProperties"] > len(props))):
            out["additionalProperties"] = False
        return out

    find(schema, False)
    # (an intersected reference by $anchor, $id or URI: its target is not known here, so nothing is closed)
    foreign = any(not _local(ref) for ref in intersected)
    return close(schema, "#", False)


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


class Unheld(ValueError):
    """A schema that is valid but admits nothing llguidance can write (named by Constraint.grammar as it is)."""


def _check_integer_bounds(node: dict, pointer: str) -> None:
    """An integer schema whose bounds leave it no 64-bit integer is refused: llguidance holds integers from -2^63
    to 2^63-1, and would clamp the bound and write values the schema does not admit."""
    kind = node.get("type")
    if not (kind == "integer" or (isinstance(kind, list) and "integer" in kind)):
        return
    for key, value in ((k, node.get(k)) for k in _BOUNDS):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            continue
        lower, exclusive = key in ("minimum", "exclusiveMinimum"), key.startswith("exclusive")
        limit = 2**63 - 1 if lower else -2**63
        if (value > limit if lower else value < limit) or (exclusive and value == limit):
            raise Unheld(f"{pointer}/{key}: {value} leaves the integer no value llguidance can write (it holds "
                         "integers from -2^63 to 2^63-1)")


def _escape(key: str) -> str:
    """A key as a JSON pointer spells it."""
    return key.replace("~", "~0").replace("/", "~1")


def _local(ref) -> bool:
    """A reference within its own document ("#" or a JSON pointer "#/...")."""
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def rebased(schema, at: str):
    """`schema` to be placed at JSON pointer `at` ("#/...") of a larger one: each of its local references made
    to point where it pointed within it (a tool's parameters inside the call's schema). A part with its own
    $id is left as it is: its references resolve against it. Returns a new schema."""
    def walk(node):
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict) or "$id" in node:
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and _local(value):
                out[key] = at + value[1:]
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {k: walk(v) for k, v in value.items()}
            elif key in _ONE_SCHEMA or key in _SCHEMA_LISTS:
                out[key] = walk(value)
            else:  # (values, not schemas: const, enum, default, ...)
                out[key] = value
        return out

    return walk(schema)


def embedded(root, pointer: str):
    """The part of schema `root` at JSON pointer `pointer` ("#/properties/x") as a schema of its own: the part
    itself where `root` has no references, else a reference to it beside `root`, which they resolve in."""
    part = followed(root, {"$ref": pointer})
    if '"$ref"' not in json.dumps(root):
        return part
    return {"$ref": "#/$defs/jaxcb_root" + pointer[1:], "$defs": {"jaxcb_root": rebased(root, "#/$defs/jaxcb_root")}}


def followed(root, node, hops: int = 16):
    """`node` (a part of schema `root`), or where its local reference leads in `root` if it is only a reference
    (beside annotations); `node` itself where that cannot be followed."""
    while hops and isinstance(node, dict) and _local(node.get("$ref")) and not set(node) - _ANNOTATIONS - {"$ref"}:
        target = root
        for key in node["$ref"][2:].split("/") if node["$ref"] != "#" else ():
            key = key.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and key in target:
                target = target[key]
            elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
                target = target[int(key)]
            else:
                return node
        node, hops = target, hops - 1
    return node


# The JSON shapes clients send (the OpenAI HTTP API, `jaxcb generate --input` lines): vLLM's
# structured_outputs object and OpenAI's response_format.
STRUCTURED_OUTPUTS_KEYS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# vLLM's options beside the constraint: disable_any_whitespace makes JSON output compact (else it may have
# JSON_WHITESPACE between tokens); the others jaxcb's grammars hold whatever they say: objects closed unless
# the schema opens them (grammar_schema), and no other backend to fall back to.
STRUCTURED_OUTPUTS_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")


def from_structured_outputs(obj, field: str = "structured_outputs") -> Constraint | None:
    """vLLM's `structured_outputs`: an object with one of json (a schema), json_object (true), regex,
    choice (a list of strings) or grammar."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{field}: must be an object with one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}")
    for option in STRUCTURED_OUTPUTS_OPTIONS:
        if not isinstance(obj.get(option, False), bool):
            raise InvalidRequest(f"{field}.{option}: must be true or false, got {obj[option]!r}")
    compact = obj.get("disable_any_whitespace", False)
    obj = {k: v for k, v in obj.items() if k not in STRUCTURED_OUTPUTS_OPTIONS}
    return with_whitespace(_structured_outputs(obj, field), COMPACT) if compact else _structured_outputs(obj, field)


def _structured_outputs(obj: dict, field: str) -> Constraint:
    unknown = sorted(k for k in obj if k not in STRUCTURED_OUTPUTS_KEYS)
    if unknown:
        raise InvalidRequest(f"{field}.{unknown[0]}: not supported; give one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}")
    given = [k for k in STRUCTURED_OUTPUTS_KEYS  # (json false: the schema false; json_object false: none)
             if obj.get(k) is not None and (k == "json" or obj[k] is not False)]
    if len(given) != 1:
        raise InvalidRequest(f"{field}: give exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}, got "
                             f"{', '.join(given) or 'none'}")
    kind, value = given[0], obj[given[0]]
    where = f"{field}.{kind}"
    if kind == "json":
        return Constraint.json_schema(value, where)
    if kind == "json_object":
        if value is not True:
            raise InvalidRequest(f"{where}: must be true")
        return Constraint.json_object(where)
    if kind == "choice":
        return Constraint.choice(value, where)
    if kind == "structural_tag":
        return Constraint.structural_tag(value, where)
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}: must be a string")
    return Constraint(kind, value, where)


# vLLM's older top-level fields for the same constraints (removed in vLLM 0.12 for structured_outputs; many
# clients still send them). guided_decoding_backend names a grammar engine: jaxcb's is llguidance whatever it
# says (the output matches the constraint either way).
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
GUIDED_EXTRAS = ("guided_decoding_backend", "guided_whitespace_pattern")


def from_guided(body: dict) -> Constraint | None:
    """vLLM's guided_json / guided_regex / guided_choice / guided_grammar (at most one)."""
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise InvalidRequest(f"guided_decoding_backend: must be a string, got {backend!r}")
    pattern = body.get("guided_whitespace_pattern")
    if pattern is not None and (not isinstance(pattern, str) or len(pattern) > 256):
        raise InvalidRequest("guided_whitespace_pattern: must be a regex of at most 256 characters")
    c = _guided(body)
    if pattern is not None and (c is None or c.kind != "json"):
        raise InvalidRequest("guided_whitespace_pattern: only with guided_json")
    if pattern is not None:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(Constraint("regex", pattern, "guided_whitespace_pattern").grammar(),
                                                      None)
        if error:
            raise InvalidRequest(f"guided_whitespace_pattern: not a valid regex ({_first_line(error)})")
    return with_whitespace(c, {"whitespace_flexible": True, "whitespace_pattern": pattern}) if pattern else c


def _guided(body: dict) -> Constraint | None:
    given = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(f"{given[1]}: give one of {', '.join(GUIDED_FIELDS)}, not both {given[0]} and {given[1]}")
    name = given[0]
    kind, value = GUIDED_FIELDS[name], body[name]
    if kind == "json":
        return Constraint.json_schema(value, name)
    if kind == "choice":
        return Constraint.choice(value, name)
    if not isinstance(value, str):
        raise InvalidRequest(f"{name}: must be a string")
    return Constraint(kind, value, name)


def from_response_format(obj, field: str = "response_format") -> Constraint | None:
    """OpenAI's `response_format`: {"type": "text"} (none), {"type": "json_object"} or {"type":
    "json_schema", "json_schema": {"name", "schema", "strict", "description"}}; or vLLM's {"type":
    "structural_tag", "structures", "triggers"}."""
    if obj is None:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise InvalidRequest(f"{field}: must be an object with a type (text, json_object or json_schema)")
    kind = obj["type"]
    if kind == "structural_tag":
        return Constraint.structural_tag(obj, field)
    extra = sorted(set(obj) - {"type", "json_schema"})
    if extra:
        raise InvalidRequest(f"{field}.{extra[0]}: not a field of response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object(field)
    if kind != "json_schema":
        raise InvalidRequest(f"{field}.type: {kind!r} is not one of text, json_object, json_schema, structural_tag")
    spec = obj.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{field}.json_schema: must be an object with the schema")
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise InvalidRequest(f"{field}.json_schema.{extra[0]}: not a field of json_schema")
    if "name" in spec and not isinstance(spec["name"], str):
        raise InvalidRequest(f"{field}.json_schema.name: must be a string")
    if "schema" not in spec:  # OpenAI's default when no schema is given: any object
        return Constraint.json_object(f"{field}.json_schema")
    return Constraint.json_schema(spec["schema"], f"{field}.json_schema.schema")


def structured_failure(c: Constraint, matcher, produced: int) -> str:
    """Why a constrained sample ended in error after `produced` tokens (llguidance's matcher failed): a
    constraint that allows no further token where its output is not complete (a schema no finite JSON
    satisfies: a property that must hold itself), or one of llguidance's limits met while generating."""
    error = _first_line(matcher.get_error() or "the token was not allowed")
    if error == NO_CONTINUATION:  # (as _explain says it before any output)
        return (f"{c.field}: nothing can follow the output's first {produced} tokens, which do not complete it: "
                f"no finite output matches (e.g. a schema whose $ref requires itself)")
    if _limit_met(error):
        return f"{c.field}: too large to enforce while generating (after {produced} output tokens: {error})"
    return f"{c.field}: the constraint failed after {produced} output tokens: {error}"


NO_CONTINUATION = "NoExtensionBias"  # llguidance's error where nothing may follow what is written


def _first_line(e) -> str:
    text = (str(e).strip() or type(e).__name__).replace("<non-verbose/>", "")  # (llguidance's marker, no detail)
    return " ".join(text.split())[:300]


def _limit_met(line: str) -> bool:
    """Whether llguidance's error is one of its limits (LIMITS) met: too large to enforce."""
    return "max is" in line or "(limit " in line


def _explain(kind: str, error) -> str:
    """What a grammar llguidance refused is said to be. A schema that uses keywords it cannot enforce
    while generating (uniqueItems, not, if/then/else, ...) is valid JSON Schema: say which, and how to
    generate without them (llguidance's lenient mode, asked for in the schema itself)."""
    line = _first_line(error)
    if kind == "json" and "Unimplemented keys" in line:
        keys = line.split("Unimplemented keys:", 1)[1].strip()
        return (f"the schema uses keywords that cannot be enforced while generating: {keys}; add "
                '"x-guidance": {"lenient": true} to the schema to generate without them')
    if line == NO_CONTINUATION:
        return "no output matches it (e.g. a schema whose $ref requires itself)"
    if _limit_met(line):
        return f"too large to enforce while generating ({line})"
    return f"not a JSON schema that can be enforced ({line})" if kind == "json" else f"not a valid {kind} ({line})"


class Grammars:
    """One tokenizer's grammar machinery (see the module's docstring). Thread-safe: the server checks
    constraints on worker threads while the engine thread makes matchers and masks."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids=(), cache_size: int = CACHE_SIZE,
                 json_whitespace: str = "flexible"):
        import llguidance

        self.compact = json_whitespace == "compact"  # every json constraint COMPACT (EngineConfig.json_whitespace)
        self._llg = llguidance
        eos = list(eos_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
        # The tokenizer's own definition (Hugging Face tokenizers), the model's vocabulary width: the
        # mask covers every logit, and ids past the tokenizer's vocabulary are never allowed.
        # llguidance's vocabulary covers the tokenizer's too (a model may have fewer logits than the
        # tokenizer has tokens): its masks are that wide, the step's `allowed` the model's width.
        n_vocab = max(vocab_size, getattr(tokenizer, "vocab_size", 0) or 0)
        self.tokenizer = tokenizer.llguidance(n_vocab, eos)  # (built once per tokenizer, shared)
        self._eos = np.asarray(eos, np.int64)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._llg_words = (n_vocab + 31) // 32
        self.limits = llguidance.LLParserLimits(**LIMITS)
        self._executor = llguidance.LLExecutor(num_threads=2)
        self._cache: collections.OrderedDict[Constraint, object] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, c: Constraint):
        """The compiled matcher of `c` (cached): raises InvalidRequest naming the problem. Slow for a
        large grammar the first time: call it off the event loop."""
        with self._lock:
            m = self._cache.get(c)
            if m is not None:
                self._cache.move_to_end(c)
                return m
        source = with_whitespace(c, COMPACT) if self.compact else c  # (EngineConfig.json_whitespace compact)
        # JSON probed compact (_probe follows only a few ways: whitespace between tokens would be too many),
        # the whole constraint's and each embedded schema's (a tool's parameters), naming its own field
        for twin in ([with_whitespace(source, COMPACT)] if source.kind == "json" else []) + [
                with_whitespace(Constraint("json", schema, field), COMPACT) for field, schema in c.parts]:
            if twin != source:
                self.compile(twin)
        m = self._llg.LLMatcher(self.tokenizer, source.grammar(), limits=self.limits, log_level=0)
        if not m.is_error():  # its first few masks, on copies: a failure there is refused here, not mid-output
            m = self._probe(m)
        if m.is_error():
            for field, schema in c.parts:  # the embedded schema that fails, by its own field
                part = Constraint("json", schema, field)
                error = self._llg.LLMatcher.validate_grammar(part.grammar(), None)
                if error:
                    raise InvalidRequest(f"{field}: {_explain('json', error)}")
            raise InvalidRequest(f"{c.field}: {_explain(c.kind, m.get_error())}")
        with self._lock:
            self._cache[c] = m
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return m

    def forget(self, c: Constraint) -> None:
        """Drop `c`'s compiled matcher: one of its copies met a limit of llguidance's lexer, whose regex
        derivatives every copy shares (each would fail from its first mask on); the next request compiles it
        afresh."""
        with self._lock:
            self._cache.pop(c, None)

    def _probe(self, m):
        """`m`, or a copy of it that failed within the first PROBE_DEPTH tokens of some output: each mask is
        computed from the start along every way of going on while there are at most PROBE_WAYS (a schema
        whose required property holds itself fails after its forced {"x":, a large object's limit past
        its first {"). Checked on copies; the cost is a few masks, once per compiled constraint."""
        scratch = np.empty(self._llg_words, np.int32)
        level = [m.deep_copy()]
        for _ in range(PROBE_DEPTH):
            following = []
            for probe in level:
                probe.unsafe_compute_mask_ptr(scratch.ctypes.data, self._llg_words * 4)
                if probe.is_error():
                    return probe
                allowed = np.flatnonzero(np.unpackbits(scratch.view(np.uint8), bitorder="little"))
                allowed = allowed[~np.isin(allowed, self._eos)]  # (an end token ends the output: nothing follows)
                if len(allowed) > PROBE_WAYS:
                    continue
                for token in allowed:
                    step = probe.deep_copy()
                    if step.consume_token(int(token)):
                        following.append(step)
                    elif step.is_error():  # (a limit can be met taking a token, not only making a mask)
                        return step
            level = following[:PROBE_WAYS]
            if not level:
                break
        return m

    def matcher(self, c: Constraint):
        """A fresh matcher for one sample of a request (a copy of the compiled one)."""
        return self.compile(c).deep_copy()

    def fill_rows(self, requests: list, rows: list[int], allowed: np.ndarray) -> int:
        """Row rows[i] of `allowed` gets requests[i]'s next-token mask; a request that ended since it
        was scheduled (its row's result will be ignored) keeps an all-ones row. Returns the masks made."""
        live = [(r.matcher, i) for r, i in zip(requests, rows)
                if r.finish_reason is None and not r.matcher.is_stopped() and not r.matcher.is_error()]
        if live:
            self.fill_masks([m for m, _ in live], [i for _, i in live], allowed)
        return len(live)

    def fill_masks(self, matchers: list, rows: list[int], allowed: np.ndarray) -> None:
        """Write each matcher's next-token mask into row rows[i] of `allowed` (int32 [M, words]), in
        parallel."""
        assert allowed.dtype == np.int32 and allowed.flags["C_CONTIGUOUS"] and allowed.shape[1] == self.words
        target = allowed
        if self._llg_words != self.words:  # wider masks: computed aside, cut to the model's width
            target = np.empty((allowed.shape[0], self._llg_words), np.int32)
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(target[rows[0]].ctypes.data, self._llg_words * 4)
        else:
            self._executor.unsafe_compute_mask_ptr(list(zip(matchers, rows)), target.ctypes.data, self._llg_words * 4,
                                                   target.shape[0])
        if target is not allowed:
            allowed[rows] = target[rows, :self.words]


_SHARED: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def grammars_for(tokenizer, vocab_size: int, eos_ids=(), json_whitespace: str = "flexible") -> Grammars:
    """The one Grammars of a tokenizer (and vocabulary width, and JSON whitespace), shared by every engine that uses
    it (replicas, the LLM API) and built on first use."""
    key = (vocab_size, tuple(eos_ids), json_whitespace)
    with _SHARED_LOCK:
        per = _SHARED.setdefault(tokenizer, {})
        g = per.get(key)
        if g is None:
            g = per[key] = Grammars(tokenizer, vocab_size, eos_ids, json_whitespace=json_whitespace)
        return g


def special(text: str, tokenizer) -> int | None:
    """The id of `text` where it is one special token of `tokenizer`'s vocabulary."""
    i = tokenizer.token_id(text) if tokenizer is not None and text else None
    return i if i is not None and i in tokenizer.special_ids else None


def marker(text: str, tokenizer) -> str:
    """A marker in a Lark grammar: the special token (llguidance's <[id]>) where it is one, else its text."""
    i = special(text, tokenizer)
    return json.dumps(text) if i is None else f"<[{i}]>"
