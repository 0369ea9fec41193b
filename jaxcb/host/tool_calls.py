"""Tool calling (the OpenAI chat and Responses APIs, LLM.chat), the request's side: `tools` and
`tool_choice` checked, the tools and the conversation's calls rendered into the prompt, and a grammar
when a call is required. The model's calls are parsed back by jaxcb.host.tool_parse. Plain Python, no JAX.

A model writes its calls in the format it was trained on (a `Format`; vLLM's --tool-call-parser names):

    hermes       <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
                 one block per call (Hermes, Qwen 2.5 and 3, SmolLM3)
    llama3_json  {"name": "get_weather", "parameters": {"city": "Paris"}}
                 the whole answer, one call (Llama 3.1-3.3)
    mistral      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]
                 the whole answer, a list of calls (Mistral 7B v0.3, Mistral Nemo; [TOOL_CALLS] is a
                 control token, not in the answer's text; call ids of 9 letters and digits)
    granite      <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]
                 the same after its own marker (Granite 3)
    mistral_v11  [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...
                 each call its marker, name, [ARGS] and arguments (the tokenizers of Mistral Small 3.1-3.2,
                 Magistral, Devstral: mistral-common's v11 and later; vLLM's "mistral" parser reads both)
    qwen3_coder  <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>
                 one block per call, each argument an element whose text is its value: a string as it is,
                 another type as JSON, read by the function's schema (Qwen3-Coder)
    deepseek_v31 <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
                 name-first blocks inside the calls' markers (DeepSeek-V3.1)
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
                 the same with the type first and the arguments in a code fence (DeepSeek-V3-0324, R1)
    minimax_m2   <minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>
                 a block of <invoke> elements, each a call, its arguments elements read as qwen3_coder's (MiniMax-M2)
    glm45        <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>
                 one block per call: the name, then each argument's key and value elements, the value read
                 as qwen3_coder's are (GLM-4.5, 4.6; 4.7's, without the newlines, reads the same)
    pythonic     [get_weather(city="Paris"), get_time()]
                 the answer a Python list of calls with keyword arguments (Llama 3.2's and Llama 4's templates
                 ask for it; vLLM's pythonic and llama4_pythonic), read by jaxcb.host.pythonic
    harmony      <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
                 a message to the function (gpt-oss; vLLM's parser "openai"), among the answer's reasoning
                 and final messages: read by jaxcb.host.harmony, the answer's reasoning and content with them

A chat template that reads `tools` renders the tools, the earlier calls (`tool_calls`, arguments as
objects) and the `tool` results itself, as the model was trained on them; its format is recognised from
what it writes (`choose_format`), or named by the server (--tool-call-parser). A template without tools
(neither embedded model's has them) gets jaxcb's rendering: a system message lists the functions as JSON
schemas between <tools> and </tools> and asks for calls in the format; earlier calls are written in the
format in the assistant's content, a result as <tool_response>...</tool_response> in a user turn.

With tool_choice "required" or a named function the output is constrained by a grammar
(jaxcb.host.structured) to calls in the format with arguments valid against the function's `parameters`,
so they always parse and validate; with "auto" the model may answer in text or call, and what it wrote
is parsed; with "none" the tools are not shown.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import keyword
import json
import re
import secrets
import string
import uuid

from jaxcb.host.chat_template import ROLE_AS, TextParts, template_reads
from jaxcb.host.errors import InvalidRequest
from jaxcb.host import harmony, pythonic, raw_strings
from jaxcb.host.structured import Constraint, embedded, followed, lark_schema, marker, rebased, special

MAX_TOOLS = 128
MAX_TOOLS_CHARS = 1 << 20  # the tools' descriptions and parameters together, as the chat's messages
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True)
class Format:
    """How a model writes its tool calls, each a JSON object {"name": ..., keys[0]: {arguments}}: in
    blocks, `open` call `close`, anywhere in the answer ("blocks"); or as the answer itself when it begins
    with one ("object": one call) or with a list of them ("list"), after `open` if that is in the text
    (what follows is text). A call read back may name its arguments by any of `keys`. With `args` a
    call is no object but its name, `args` and the arguments object (a block without `close`: it ends
    with the arguments). With `xml` "qwen3_coder" a call is `<function=name>` and an element `<parameter=key>`
    per argument, then `</function>`; with "glm45" the name, then `<arg_key>key</arg_key>` and
    `<arg_value>value</arg_value>` per argument (tool_parse reads each value by the function's schema)."""
    name: str
    shape: str  # "blocks" | "object" | "list"
    open: str
    close: str
    keys: tuple[str, ...]
    id_length: int = 0  # call ids the model's template takes: this many letters and digits (0: any id)
    args: str = ""  # between a call's name and its arguments, where calls are written name-first, no object
    lead: str = ""  # (name-first) before the name in each block (DeepSeek-V3's type: "function<｜tool▁sep｜>")
    tail: str = ""  # (name-first) after the arguments, before `close` (DeepSeek-V3's closing code fence)
    drop: tuple[str, ...] = ()  # (opening, closing) markers around a run of blocks: not the answer's text (DeepSeek's)
    xml: str = ""  # calls as elements, not JSON: "qwen3_coder" (Qwen3-Coder's), "glm45" (GLM-4.5's), "minimax_m2"
    harmony: bool = False  # calls as messages of OpenAI's harmony format (jaxcb.host.harmony)
    pythonic: bool = False  # the answer a Python list of calls (jaxcb.host.pythonic)

    def write(self, name: str, arguments) -> str:
        if self.xml:  # (as the model's template writes them: a string as it is, anything else as JSON)
            style = ELEMENTS[self.xml]
            params = "".join(style.argument.format(k) + (v if isinstance(v, str) else json.dumps(v)) + style.value_end
                             + "\n" for k, v in arguments.items())
            framing = "\n" if style.framed else ""
            return (self.open + framing + style.call.format(name) + params + style.call_end + framing
                    + self.close)
        if self.harmony:
            return f"{self.open}commentary to=functions.{name} <|constrain|>json<|message|>{json.dumps(arguments)}{self.close}"
        if self.pythonic:
            return pythonic.write(name, arguments)
        if self.args:
            call = self.open + self.lead + name + self.args + json.dumps(arguments) + self.tail + self.close
            return self.drop[0] + call + self.drop[1] if self.drop else call
        call = json.dumps({"name": name, self.keys[0]: arguments})
        return self.open + (f"[{call}]" if self.shape == "list" else call) + self.close

    def new_call_id(self) -> str:
        if self.id_length:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(self.id_length))
        return new_call_id()


HERMES = Format("hermes", "blocks", "<tool_call>", "</tool_call>", ("arguments",))
LLAMA3_JSON = Format("llama3_json", "object", "", "", ("parameters", "arguments"))
MISTRAL = Format("mistral", "list", "[TOOL_CALLS]", "", ("arguments",), id_length=9)
GRANITE = Format("granite", "list", "<|tool_call|>", "", ("arguments",))
MISTRAL_V11 = Format("mistral_v11", "blocks", "[TOOL_CALLS]", "", ("arguments",), id_length=9, args="[ARGS]")
QWEN3_CODER = Format("qwen3_coder", "blocks", "<tool_call>", "</tool_call>", ("arguments",), xml="qwen3_coder")
GLM45 = Format("glm45", "blocks", "<tool_call>", "</tool_call>", ("arguments",), xml="glm45")
MINIMAX_M2 = Format("minimax_m2", "blocks", "<minimax:tool_call>", "</minimax:tool_call>", ("arguments",),
                    xml="minimax_m2")
_DEEPSEEK = dict(args="<｜tool▁sep｜>", drop=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"))
DEEPSEEK_V31 = Format("deepseek_v31", "blocks", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", ("arguments",), **_DEEPSEEK)
DEEPSEEK_V3 = Format("deepseek_v3", "blocks", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", ("arguments",),
                     **{**_DEEPSEEK, "lead": "function<｜tool▁sep｜>", "args": "\n```json\n", "tail": "\n```"})
HARMONY = Format("harmony", "blocks", "<|channel|>", "<|call|>", ("arguments",), harmony=True)
PYTHONIC = Format("pythonic", "list", "", "", ("arguments",), pythonic=True)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, GRANITE, MISTRAL_V11, QWEN3_CODER, GLM45, MINIMAX_M2,
                                DEEPSEEK_V31, DEEPSEEK_V3, HARMONY, PYTHONIC)}
ALIASES = {"openai": "harmony", "llama4_pythonic": "pythonic", "glm47": "glm45"}  # vLLM's names for these formats
# --tool-call-parser ("mistral": mistral_v11 where the template writes [ARGS])
PARSERS = ("auto", *FORMATS, *ALIASES)


def marked_by_special_tokens(fmt: Format, tokenizer) -> bool:
    """Whether the format's markers are special tokens of `tokenizer` (a <tool_call> some vocabularies mark
    special, Mistral's [TOOL_CALLS]): an answer's calls are then read from its text with special tokens kept
    (SamplingParams.skip_special_tokens False), as vLLM's parsers ask."""
    return any(special(m, tokenizer) is not None for m in (fmt.open, fmt.close, fmt.args, *fmt.drop))


def choose_format(template: str | None, parser: str = "auto") -> tuple[Format, bool]:
    """(the format calls are written and read in, whether the chat template `template` renders the tools
    and calls itself: it reads `tools`). "auto": the template's own format where it is recognised from what
    the template writes (<|tool_call|>: granite; <function=...> and <parameter=...> elements: qwen3_coder;
    <arg_key> and <arg_value> elements: glm45; <invoke name=...> elements in a <minimax:tool_call>: minimax_m2; <｜tool▁sep｜> between a call's name and its arguments:
    deepseek_v31, before the name with its arguments in a ```json fence: deepseek_v3;
    a <tool_call> block: hermes; [TOOL_CALLS] with [ARGS]:
    mistral_v11, without: mistral; a "parameters" object: llama3_json), else hermes in jaxcb's rendering; a
    parser named by the server: its format (mistral's by what the template writes, as vLLM's parser reads
    either by the tokenizer's version), rendered by the template if it reads `tools` (the server says it is
    the template's), else by jaxcb. A harmony template (gpt-oss's: channels and message markers) is harmony's,
    whatever the parser: its answers are read as harmony's messages (jaxcb.host.harmony)."""
    parser = ALIASES.get(parser, parser)
    reads = bool(template) and template_reads(template, "tools")
    v11 = bool(template) and MISTRAL_V11.args in template
    if harmony.is_harmony(template):  # (whatever the parser: the model answers in harmony's messages)
        return HARMONY, reads
    if parser == "mistral" and v11:
        return MISTRAL_V11, reads
    if parser != "auto":
        return FORMATS[parser], reads
    if reads and GRANITE.open in template:
        return GRANITE, True
    if reads and "func_name1(" in template:  # (its instructions' example; Llama 4's own template asks for JSON)
        return PYTHONIC, True
    if reads and "<function=" in template and "<parameter=" in template:
        return QWEN3_CODER, True
    if reads and "<arg_key>" in template and "<arg_value>" in template:
        return GLM45, True
    if reads and MINIMAX_M2.open in template and "<invoke name=" in template:
        return MINIMAX_M2, True
    if reads and DEEPSEEK_V31.open in template and "<｜tool▁sep｜>" in template:
        return (DEEPSEEK_V3 if "```json" in template else DEEPSEEK_V31), True
    if reads and HERMES.open in template:
        return HERMES, True
    if reads and MISTRAL.open in template:
        return (MISTRAL_V11 if v11 else MISTRAL), True
    if reads and '"parameters"' in template:
        return LLAMA3_JSON, True
    return HERMES, False


@dataclasses.dataclass(frozen=True)
class Tools:
    functions: dict  # name -> its parameters schema (an object schema)
    descriptions: dict  # name -> description
    choice: str  # "none" | "auto" | "required" | "function" (one named function)
    named: str | None = None
    parallel: bool = True
    fmt: Format = HERMES  # how calls are written (choose_format)
    native: bool = False  # the chat template renders the tools (template_tools)

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def listed(self) -> list[dict]:
        """The tools as OpenAI's function tools, each {type: function, function: {name, description, parameters}}."""
        return [{"type": "function", "function": {"name": n, "description": self.descriptions[n], "parameters": p}}
                for n, p in self.functions.items()]

    def template_tools(self) -> list[dict] | None:
        """The template's `tools` where it renders them (with tool_choice none too: the model sees them, as
        OpenAI's and vLLM's do, and its answer is read as text); None when jaxcb renders them (jaxcb's text
        asks for calls: not written for none)."""
        return self.listed() if self.native else None


def parse_tools(body: dict) -> Tools | None:
    """The request's tools, tool_choice and parallel_tool_calls, checked; None without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequest(f"parallel_tool_calls: must be true or false, got {parallel!r}")
    if tools is None or tools == []:  # (an empty list is no tools: OpenAI's Agents SDK sends one; vLLM takes it)
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice: needs tools")
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools: must be a list of {type: function, function: {...}}")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools: {len(tools)} tools; the limit is {MAX_TOOLS}")
    functions, descriptions, size = {}, {}, 0
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise InvalidRequest(f"{where}: must be {{type: function, function: {{name, parameters}}}}")
        f = t["function"]
        unknown = sorted(set(f) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise InvalidRequest(f"{where}.function.{unknown[0]}: not a field of a function")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidRequest(f"{where}.function.name: must be 1-64 letters, digits, _ or -, got {name!r}")
        if name in functions:
            raise InvalidRequest(f"{where}.function.name: {name!r} is given twice")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":  # (the arguments: an object)
            raise InvalidRequest(f"{where}.function.parameters: must be an object schema (a JSON schema of "
                                 f"type object), got {json.dumps(params)[:80]}")
        if not isinstance(params.get("properties", {}), dict):
            raise InvalidRequest(f"{where}.function.parameters.properties: must be an object of schemas")
        required = params.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise InvalidRequest(f"{where}.function.parameters.required: must be a list of names")
        description = f.get("description", "")
        if not isinstance(description, str):
            raise InvalidRequest(f"{where}.function.description: must be a string")
        functions[name], descriptions[name] = params, description
        size += len(description) + len(json.dumps(params))
        if size > MAX_TOOLS_CHARS:  # (what a rendering of them would add to the prompt)
            raise InvalidRequest(f"tools: more than {MAX_TOOLS_CHARS} characters of descriptions and parameters in all "
                                 f"(past it at tools[{i}]); the limit is {MAX_TOOLS_CHARS}")
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        f = choice.get("function")
        if choice.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise InvalidRequest("tool_choice: must be none, auto, required or {type: function, function: {name}}")
        if f["name"] not in functions:
            raise InvalidRequest(f"tool_choice.function.name: {f['name']!r} is not one of the tools")
        choice, named = "function", f["name"]
    elif choice not in CHOICES:
        raise InvalidRequest(f"tool_choice: {choice!r} is not one of none, auto, required or a named function")
    return Tools(functions, descriptions, choice, named, parallel)


def system_text(tools: Tools) -> str:
    """jaxcb's rendering of the tools, for a chat template that does not render them: a system message."""
    lines = [json.dumps(t) for t in tools.listed()]
    fmt = tools.fmt
    call = '{"name": <function name>, "%s": <arguments as a JSON object>}' % fmt.keys[0]
    if fmt.args:
        call = f"{fmt.lead}<function name>{fmt.args}<arguments as a JSON object>{fmt.tail}"
    if fmt.xml:
        style = ELEMENTS[fmt.xml]
        framing = "\n" if style.framed else ""
        call = (framing + style.call.format("<function name>") + style.argument.format("<argument name>")
                + "<its value: a string as it is, anything else as JSON>" + style.value_end
                + "\n(an element per argument)" + style.call_end + framing)
    if fmt.pythonic:
        call = "<function name>(<argument name>=<its value as a Python literal>, ...)"
    how = {"blocks": f"{fmt.open}{call}{fmt.close} (one block per call)", "object": f"{call} (one call)",
           "list": f"[{call}, ...] (a list of calls)"}[fmt.shape]
    return ("You may call functions to help with the user's request. The functions, as JSON schemas:\n<tools>\n"
            + "\n".join(lines) + "\n</tools>\nTo call a function, answer with " + how + " and nothing else.")


CHAT_PARTS = {"text": "text", "refusal": "refusal"}  # a chat content part's type -> the key of its text


def content_text(content, where: str, parts: dict[str, str] = CHAT_PARTS) -> str | None:
    """A message's content as text: a string as it is, or OpenAI's list of content parts, whose text
    parts (chat's text and an assistant's refusal parts, or the `parts` given: the Responses API's
    input_text and output_text) are joined by newlines, as vLLM joins them (a TextParts: a template that reads
    the parts itself is given them, as vLLM gives them); None (an assistant message
    of tool calls only) stays None. A part of another kind (an image, audio, a file) is refused naming
    it: the models served here read text only."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: must be a string or a list of content parts")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise InvalidRequest(f"{where}[{k}]: must be a content part, an object with a type")
        if kind not in parts:
            raise InvalidRequest(f"{where}[{k}].type: {kind[:40]!r} is not supported; the model takes "
                                 f"{' and '.join(parts)} parts only")
        if not isinstance(part.get(parts[kind]), str):
            raise InvalidRequest(f"{where}[{k}].{parts[kind]}: must be a string")
        texts.append(part[parts[kind]])
    return TextParts(texts)


def prepare(body: dict, messages: list, template: str | None,
            parser: str = "auto") -> tuple[Tools | None, list[dict], list[dict] | None]:
    """A chat's tools (`body`'s tools, tool_choice, parallel_tool_calls; None without tools) in the format
    of the chat template `template` that writes the chat (choose_format), its messages rendered for that
    template (render_messages: each message's fields checked), and the template's `tools`
    (Tools.template_tools; None where jaxcb renders them or there are none)."""
    fmt, native = choose_format(template, parser)
    tools = parse_tools(body)
    if tools is not None:
        tools = dataclasses.replace(tools, fmt=fmt, native=native)
    return tools, render_messages(messages, tools, fmt, native), tools.template_tools() if tools else None


def render_messages(messages: list, tools: Tools | None, fmt: Format = HERMES, native: bool = False) -> list[dict]:
    """The chat's messages as the template takes them ({role, content} with string content). For a template
    that renders tools (`native`): an assistant's `tool_calls` with their arguments as objects, a `tool`
    message's `tool_call_id` and the called function's `name` (given, or that of the call it answers:
    Hermes' template needs it). Else as jaxcb renders them: the tools' system text first
    (merged into the conversation's own system message), assistant tool calls written in `fmt` in its
    content, tool results in user turns (consecutive results, a parallel call's, in one turn, as Qwen's template
    writes them: a template that makes turns alternate refuses two user turns in a row). Checks the tool-related
    fields of each message."""
    out, called = [], {}  # call id -> function name
    after_result = False  # (the last message out is a tool result's user turn)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}]: must be an object with a role")
        role, content = m["role"], content_text(m.get("content"), f"messages[{i}].content")
        content = content or ""
        calls, rendered = m.get("tool_calls"), []
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise InvalidRequest(f"messages[{i}].tool_calls: only an assistant message has a list of tool calls")
            for k, c in enumerate(calls):
                f = c.get("function") if isinstance(c, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
                    raise InvalidRequest(f"messages[{i}].tool_calls[{k}]: must be {{function: {{name, arguments}}}}")
                try:
                    arguments = json.loads(f["arguments"])
                except ValueError:
                    raise InvalidRequest(f"messages[{i}].tool_calls[{k}].function.arguments: not valid JSON") from None
                if native:
                    call_id = _call_id(c.get("id"), fmt)
                    called[call_id] = f["name"]
                    rendered.append({"id": call_id, "type": "function",
                                     "function": {"name": f["name"], "arguments": arguments}})
                else:
                    if fmt.xml and not isinstance(arguments, dict):  # (an element per argument: an object's)
                        raise InvalidRequest(f"messages[{i}].tool_calls[{k}].function.arguments: must be a JSON "
                                             "object")
                    content += fmt.write(f["name"], arguments)
        elif m.get("content") is None:
            raise InvalidRequest(f"messages[{i}].content: must be a string or a list of content parts")
        message = {"role": ROLE_AS.get(role, role), "content": content}  # "developer" is the system's
        if rendered:
            message["tool_calls"] = rendered
        if role == "tool" and native:
            if isinstance(m.get("tool_call_id"), str):
                message["tool_call_id"] = _call_id(m["tool_call_id"], fmt)
            name = m.get("name") if isinstance(m.get("name"), str) else called.get(message.get("tool_call_id"))
            if name is not None:
                message["name"] = name
        elif role == "tool":
            message = {"role": "user", "content": f"<tool_response>{content}</tool_response>"}
            if after_result:
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + message["content"]}
                continue
        after_result = role == "tool" and not native
        out.append(message)
    if tools is not None and tools.active and not native:
        text = system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _call_id(given, fmt: Format) -> str:
    """An earlier call's id as the template takes it: the client's, or where the format has ids of
    `id_length` letters and digits (Mistral's template refuses others) its last so many of them, or for a
    shorter id as many hex digits of its hash (the same for the call and its result); a new one where
    there is none."""
    if not isinstance(given, str):
        return fmt.new_call_id()
    if fmt.id_length:
        kept = "".join(ch for ch in given if ch.isascii() and ch.isalnum())[-fmt.id_length:]
        return kept if len(kept) == fmt.id_length else hashlib.sha256(given.encode()).hexdigest()[:fmt.id_length]
    return given


def constraint(tools: Tools, tokenizer=None) -> Constraint | None:
    """The grammar for "required" or a named function: calls in the format only (blocks, a newline each
    side of the object, between blocks and after the last allowed, as templates write them: a model that
    ends its line may still end its answer there; or the answer one object),
    each with a function's name and arguments valid against its parameters; None when the model may
    answer in text. A marker that is a special token of `tokenizer` is that token in the grammar (the
    model writes it as it was trained to, not spelt out in text)."""
    if tools.choice not in ("required", "function"):
        return None
    names = [tools.named] if tools.choice == "function" else list(tools.functions)
    order = list(tools.functions)  # each schema's own field, for an error (Grammars.compile)
    parts = tuple((f"tools[{order.index(n)}].function.parameters", json.dumps(arguments_schema(tools.functions[n])))
                  for n in names)
    more = tools.parallel and tools.choice == "required"
    if tools.fmt.xml:
        return Constraint("grammar", _xml_grammar(tools, names, more, tokenizer), "tools", parts)
    if tools.fmt.harmony:
        return Constraint("grammar", _harmony_grammar(tools, names, tokenizer), "tools", parts)
    if tools.fmt.pythonic:
        return Constraint("grammar", _pythonic_grammar(tools, names, more), "tools", parts)
    if tools.fmt.args:  # name-first calls: one rule per function, its name then its arguments
        fmt, m = tools.fmt, functools.partial(_markers, tokenizer=tokenizer)
        calls = "\n".join(f"call_{k}: {m(fmt.open)} {m(fmt.lead)} {json.dumps(n)} {m(fmt.args)} "
                          f"%json {json.dumps(lark_schema(arguments_schema(tools.functions[n])))} {m(fmt.tail)} "
                          f"{m(fmt.close)}"
                          for k, n in enumerate(names))
        alternatives = " | ".join(f"call_{k}" for k in range(len(names)))
        run = f"call{'+' if more else ''}"
        start = f"{m(fmt.drop[0])} {run} {m(fmt.drop[1])}" if fmt.drop else run
        return Constraint("grammar", f"start: {start}\ncall: {alternatives}\n{calls}", "tools", parts)
    key = tools.fmt.keys[0]
    # (each function's parameters where the call's schema holds them, their references made to point there; their
    # own x-guidance, e.g. lenient, the call's)
    own = [tools.functions[n].get("x-guidance") for n in names]
    body = json.dumps(lark_schema({"anyOf": [
        {"type": "object", "properties": {"name": {"const": n}, key: rebased(arguments_schema(tools.functions[n]),
                                                                             f"#/anyOf/{i}/properties/{key}")},
         "required": ["name", key], "additionalProperties": False} for i, n in enumerate(names)],
        "x-guidance": {k: v for g in own if isinstance(g, dict) for k, v in g.items()}}))
    if tools.fmt.shape == "object":
        grammar = f"start: %json {body}"
    elif tools.fmt.shape == "list":
        opening = marker(tools.fmt.open, tokenizer) + ' " "? ' if special(tools.fmt.open, tokenizer) else ""
        rest = ' ("," " "? call)*' if more else ""
        grammar = f'start: {opening}"[" call{rest} "]"\ncall: %json {body}'
    else:
        newline = '"\\n"?'
        rest = f" ({newline} call)*" if more else ""
        grammar = (f"start: call{rest} {newline}\ncall: {marker(tools.fmt.open, tokenizer)} "
                   f"{newline} %json {body} {newline} {marker(tools.fmt.close, tokenizer)}")
    return Constraint("grammar", grammar, "tools", parts)


def arguments_schema(params: dict) -> dict:
    """A function's parameters as its calls' arguments are held: an object (a schema that says no type is given
    type object: a schema of values of another kind admits no arguments, and is refused as such)."""
    return params if "type" in params else {**params, "type": "object"}


def _markers(text: str, tokenizer) -> str:
    """Text in a Lark grammar, each special token of `tokenizer` in it that token (structured.marker), the rest text;
    nothing for no text."""
    pieces = [p for p in re.split(r"(<｜[^｜<>]{1,64}｜>)", text) if p]
    return " ".join(marker(p, tokenizer) for p in pieces)


def xml_type(prop) -> tuple[str | None, bool]:
    """(the type an argument's element is read as, whether null is allowed) from its schema, for qwen3_coder's
    grammar and its reading back (tool_parse) alike: the schema's `type`, the one beside "null" in a list
    ("json" where several are: the value as JSON); None where it has none (read as a string)."""
    kind = prop.get("type") if isinstance(prop, dict) else None
    if not isinstance(kind, list):
        return (kind if isinstance(kind, str) else None), kind == "null"
    rest = [k for k in kind if k != "null"]
    return (rest[0] if len(rest) == 1 and isinstance(rest[0], str) else "json" if rest else None), "null" in kind


def _literal_enum(prop) -> list | None:
    """A property's enum where it lists scalars only (a grammar writes each as one of its values), else None."""
    enum = prop.get("enum") if isinstance(prop, dict) else None
    ok = isinstance(enum, list) and enum and all(e is None or isinstance(e, (str, int, float, bool)) for e in enum)
    return enum if ok else None


@dataclasses.dataclass(frozen=True)
class Elements:
    """How a format of element calls (Format.xml) writes one: the call's opening (`call`, by its name) and closing,
    each argument's opening (`argument`, by its key) and its value's closing (then a newline), whether a block
    holds its call between newlines (`framed`); and the keys an element can hold (tool_parse reads these)."""
    call: str
    call_end: str
    argument: str
    value_end: str
    framed: bool
    key: re.Pattern
    key_rule: str  # (the refusal's words for a key it cannot hold)


ELEMENTS = {
    "qwen3_coder": Elements("<function={}>\n", "</function>", "<parameter={}>\n", "\n</parameter>", True,
                            re.compile(r"[^>\n]{1,256}"), "no > or newline"),
    "glm45": Elements("{}\n", "", "<arg_key>{}</arg_key>\n<arg_value>", "</arg_value>", False,
                      re.compile(r"[^<\s](?:[^<\n]{0,254}[^<\s])?"), "no < or newline, none at its ends"),
    "minimax_m2": Elements('<invoke name="{}">\n', "</invoke>", '<parameter name="{}">', "</parameter>", True,
                           re.compile(r'[^"<>\n]{1,256}'), 'no ", <, > or newline'),
}


def _xml_grammar(tools: Tools, names: list[str], more: bool, tokenizer=None) -> str:
    """Element calls (qwen3_coder's, glm45's, minimax_m2's: Elements) as a Lark grammar: per function its name and an
    element per property of its
    parameters, in their order (the required ones always, the others optional; no others); a value by its
    schema (xml_type): an enum one of its values, a string the text up to its closing tag (a lazy lexeme) as
    its minLength, maxLength, pattern and format allow (jaxcb.host.raw_strings), an integer, number or boolean
    as JSON writes it ("null" too where its type allows; within its bounds), anything else JSON valid against
    the schema. A name
    an element cannot hold, or a string keyword that cannot be held, is refused naming the tool's field."""
    rules, calls, order, style = [], [], list(tools.functions), ELEMENTS[tools.fmt.xml]
    end = json.dumps(style.value_end)
    for k, name in enumerate(names):
        schema, where = tools.functions[name], f"tools[{order.index(name)}].function.parameters"
        required = set(schema.get("required") or ())
        params = []
        for j, (key, given) in enumerate((schema.get("properties") or {}).items()):
            if not style.key.fullmatch(key):
                raise InvalidRequest(f"{where}.properties: {key[:64]!r} cannot be an element's name in the "
                                     f"{tools.fmt.name} format (1-256 characters, {style.key_rule})")
            prop = followed(schema, given)  # (a property that only refers to a definition: that definition)
            kind, nullable = xml_type(prop)
            enum = _literal_enum(prop)
            null = ' | "null"' if nullable else ""
            if enum:
                body = ("(" + " | ".join(json.dumps(e if isinstance(e, str) else json.dumps(e)) for e in enum)
                        + f") {end}")
            elif kind in (None, "string"):
                text = raw_strings.lexeme(prop, f"{where}.properties.{key}")
                text = f'({text} | "null")' if nullable else text  # (read back as null: tool_parse)
                rules.append(f"t_{k}_{j}[lazy]: {text} {end}")
                body = f"t_{k}_{j}"
            elif kind in ("integer", "number") and set(prop) & {"minimum", "maximum", "exclusiveMinimum",
                                                                "exclusiveMaximum", "multipleOf"}:
                body = f"%json {json.dumps(lark_schema(prop))} {end}"  # (its bounds held: written as JSON writes it)
            elif kind == "integer":
                body = f'(/-?(0|[1-9][0-9]*)/{null}) {end}'
            elif kind == "number":
                body = f'(/-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/{null}) {end}'
            elif kind == "boolean":
                body = f'("true" | "false"{null}) {end}'
            else:
                whole = embedded(schema, f"#/properties/{key}")  # (with what its references lead to)
                body = f"%json {json.dumps(lark_schema(whole if isinstance(whole, dict) else {}))} {end}"
            rules.append(f"v_{k}_{j}: {body}")
            rules.append(f"p_{k}_{j}: {json.dumps(style.argument.format(key))} v_{k}_{j} \"\\n\"")
            params.append(f"p_{k}_{j}" + ("" if key in required else "?"))
        end_call = f" {json.dumps(style.call_end)}" if style.call_end else ""
        rules.append(f"call_{k}: {json.dumps(style.call.format(name))} {' '.join(params)}{end_call}")
        calls.append(f"call_{k}")
    newline = '"\\n"?'
    rest = f" ({newline} call)*" if more else ""
    inner = f'"\\n" ({" | ".join(calls)}) "\\n"' if style.framed else f'({" | ".join(calls)})'
    return "\n".join([f"start: call{rest} {newline}",
                      f'call: {marker(tools.fmt.open, tokenizer)} {inner} {marker(tools.fmt.close, tokenizer)}', *rules])


def _pythonic_grammar(tools: Tools, names: list[str], more: bool) -> str:
    """Pythonic calls as a Lark grammar: `[name(key=value, ...), ...]`, per function its parameters in their
    order as keyword arguments (the required ones always, the others optional), each value a Python literal by
    its schema: an enum one of its values, a boolean True/False, null None, a string, number or integer (and any
    other schema) as JSON writes it, valid against the schema (jaxcb.host.pythonic reads JSON's true/false/null
    inside lists and dicts too). A name a keyword cannot be is refused naming the tool's field."""
    rules, calls, order = [], [], list(tools.functions)
    for k, name in enumerate(names):
        schema, where = tools.functions[name], f"tools[{order.index(name)}].function.parameters"
        if not _keyword(name):
            raise InvalidRequest(f"tools[{order.index(name)}].function.name: {name!r} cannot be called in the pythonic "
                                 "format (a Python identifier)")
        required = set(schema.get("required") or ())
        props = list((schema.get("properties") or {}).items())
        for j, (key, prop) in enumerate(props):
            if not _keyword(key):
                raise InvalidRequest(f"{where}.properties: {key[:64]!r} cannot be a keyword argument in the "
                                     "pythonic format (a Python identifier)")
            kind, nullable = xml_type(prop)
            enum = _literal_enum(prop)
            if enum:
                value = "(" + " | ".join(json.dumps(pythonic.literal(e)) for e in enum) + ")"
            elif kind == "boolean":
                value = '("True" | "False"' + (' | "None")' if nullable else ")")
            elif kind == "null":
                value = '"None"'
            else:
                body = lark_schema(prop if isinstance(prop, dict) else {})
                if nullable and isinstance(body, dict):  # (None, not JSON's null)
                    body = {**body, "type": [t for t in body["type"] if t != "null"]} if isinstance(body.get("type"), list) else body
                value = f"%json {json.dumps(body)}" + (' | "None"' if nullable else "")
                value = f"({value})"
            rules.append(f"v_{k}_{j}: {value}")
        # the arguments from parameter j on: r_k_j after one was written (a comma first), s_k_j before any
        later_required = [any(p in required for p, _ in props[j + 1:]) for j in range(len(props))]
        for j in range(len(props) - 1, -1, -1):
            key = props[j][0]
            tail_r = f" r_{k}_{j + 1}" if j + 1 < len(props) else ""
            item_r = f'", {key}=" v_{k}_{j}'
            rules.append(f"r_{k}_{j}: {item_r}{tail_r}" if key in required else f"r_{k}_{j}: ({item_r})?{tail_r}")
            first = f'"{key}=" v_{k}_{j}{tail_r}'
            if key in required:
                rules.append(f"s_{k}_{j}: {first}")
            elif later_required[j]:  # (something must still be written)
                rules.append(f"s_{k}_{j}: ({first} | s_{k}_{j + 1})")
            elif j + 1 < len(props):
                rules.append(f"s_{k}_{j}: ({first} | s_{k}_{j + 1})?")
            else:
                rules.append(f"s_{k}_{j}: ({first})?")
        args = f" s_{k}_0" if props else ""
        rules.append(f'call_{k}: "{name}("{args} ")"')
        calls.append(f"call_{k}")
    rest = ' ("," " "? call)*' if more else ""
    return "\n".join([f'start: "[" call{rest} "]"', f"call: {' | '.join(calls)}", *rules])


def _keyword(name: str) -> bool:
    """Whether `name` can be a pythonic call's function or keyword argument: an identifier, no reserved word."""
    return name.isidentifier() and not keyword.iskeyword(name)


def _harmony_grammar(tools: Tools, names: list[str], tokenizer=None) -> str:
    """Harmony's calls as a Lark grammar (jaxcb.host.harmony.grammar: reasoning first if the model writes it):
    a message to one of the functions, its arguments JSON valid against its parameters, ended by <|call|>
    (which ends the generation: one call an answer, as gpt-oss makes them)."""
    m = functools.partial(marker, tokenizer=tokenizer)
    calls = [f"call_{k}: {m('<|channel|>')} \"commentary to=functions.{n} \" {m('<|constrain|>')} \"json\" "
             f"{m('<|message|>')} %json {json.dumps(lark_schema(tools.functions[n]))} {m('<|call|>')}"
             for k, n in enumerate(names)]
    return harmony.grammar(" | ".join(f"call_{k}" for k in range(len(names))), calls, tokenizer)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
