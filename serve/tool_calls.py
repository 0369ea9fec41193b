"""Tool calling for the OpenAI chat API: the request's `tools` and `tool_choice` checked, rendered into
the prompt, enforced with a grammar when a call is required, and the model's calls parsed back (whole,
or as OpenAI's streamed deltas).

Neither embedded model's chat template has a tool format, so jaxcb uses one documented format (the
Hermes / Qwen style that many open models are trained on): a system message lists the functions as JSON
schemas between <tools> and </tools>, and the model calls one by answering

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

one block per call. Earlier calls in the conversation are rendered the same way, and a `tool` message's
result as <tool_response>...</tool_response> in a user turn. With tool_choice "required" or a named
function the output is constrained by a grammar (jaxcb.host.structured) to such blocks with arguments
valid against the function's `parameters`, so they always parse and validate; with "auto" the model
may answer in text or call, and what it wrote is parsed; with "none" the tools are not shown.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from jaxcb.host.errors import InvalidRequest
from jaxcb.host.structured import Constraint, grammar_schema
from jaxcb.host.chat_template import ROLE_AS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True)
class Tools:
    functions: dict  # name -> its parameters schema (an object schema)
    descriptions: dict  # name -> description
    choice: str  # "none" | "auto" | "required" | "function" (one named function)
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.choice != "none"


def parse_tools(body: dict) -> Tools | None:
    """The request's tools, tool_choice and parallel_tool_calls, checked; None without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequest(f"parallel_tool_calls: must be true or false, got {parallel!r}")
    if tools is None:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice: needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest("tools: must be a non-empty list of {type: function, function: {...}}")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools: {len(tools)} tools; the limit is {MAX_TOOLS}")
    functions, descriptions = {}, {}
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
        if not isinstance(params, dict):
            raise InvalidRequest(f"{where}.function.parameters: must be a JSON schema object")
        description = f.get("description", "")
        if not isinstance(description, str):
            raise InvalidRequest(f"{where}.function.description: must be a string")
        functions[name], descriptions[name] = params, description
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
    lines = [json.dumps({"type": "function", "function": {"name": n, "description": tools.descriptions[n],
                                                          "parameters": p}}) for n, p in tools.functions.items()]
    return ("You may call functions to help with the user's request. The functions, as JSON schemas:\n<tools>\n"
            + "\n".join(lines) + "\n</tools>\nTo call a function, answer with " + OPEN
            + '{"name": <function name>, "arguments": <arguments as a JSON object>}' + CLOSE
            + " (one block per call) and nothing else.")


CHAT_PARTS = {"text": "text", "refusal": "refusal"}  # a chat content part's type -> the key of its text


def content_text(content, where: str, parts: dict[str, str] = CHAT_PARTS) -> str | None:
    """A message's content as text: a string as it is, or OpenAI's list of content parts, whose text
    parts (chat's text and an assistant's refusal parts, or the `parts` given: the Responses API's
    input_text and output_text) are joined by newlines, as vLLM joins them; None (an assistant message
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
    return "\n".join(texts)


def render_messages(messages: list, tools: Tools | None) -> list[dict]:
    """The chat's messages as the template takes them ({role, content} with string content): the tools'
    system text first (merged into the conversation's own system message), assistant tool calls and tool
    results in the format above. Checks the tool-related fields of each message."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}]: must be an object with a role")
        role, content = m["role"], content_text(m.get("content"), f"messages[{i}].content")
        content = content or ""
        calls = m.get("tool_calls")
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
                content += OPEN + json.dumps({"name": f["name"], "arguments": arguments}) + CLOSE
        elif m.get("content") is None:
            raise InvalidRequest(f"messages[{i}].content: must be a string or a list of content parts")
        if role == "tool":
            role, content = "user", f"<tool_response>{content}</tool_response>"
        out.append({"role": ROLE_AS.get(role, role), "content": content})  # "developer" is the system's
    if tools is not None and tools.active:
        text = system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def constraint(tools: Tools) -> Constraint | None:
    """The grammar for "required" or a named function: tool-call blocks only, each with a function's
    name and arguments valid against its parameters; None when the model may answer in text."""
    if tools.choice not in ("required", "function"):
        return None
    names = [tools.named] if tools.choice == "function" else list(tools.functions)
    schema = {"x-guidance": {"whitespace_flexible": False},
              "anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": tools.functions[n]},
                         "required": ["name", "arguments"], "additionalProperties": False} for n in names]}
    repeat = "+" if tools.parallel and tools.choice == "required" else ""
    body = json.dumps(grammar_schema(schema))  # the arguments read as a json_schema's schema is
    grammar = f"start: call{repeat}\ncall: {json.dumps(OPEN)} %json {body} {json.dumps(CLOSE)}"
    order = list(tools.functions)  # each schema's own field, for an error (Grammars.compile)
    parts = tuple((f"tools[{order.index(n)}].function.parameters", json.dumps(tools.functions[n])) for n in names)
    return Constraint("grammar", grammar, "tools", parts)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse(text: str, tools: Tools) -> tuple[str, list[dict]]:
    """(the text outside tool-call blocks, the calls) from a whole answer; a block that does not parse
    as a call of one of the tools stays in the text. A block cut off at the end of the answer (max_tokens)
    that has named one of the tools is that call with the arguments written so far, as a stream of the
    same answer gives it (its finish_reason says "length")."""
    calls, content, pos = [], [], 0
    for match in re.finditer(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), text, re.S):
        call = _call(match.group(1), tools)
        if call is None:
            continue
        content.append(text[pos:match.start()])
        pos = match.end()
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": call[0], "arguments": _arguments_text(match.group(1), call[1])}})
    rest = text[pos:]
    cut = rest.rfind(OPEN)
    head = _HEAD.match(rest, cut + len(OPEN)) if cut >= 0 and CLOSE not in rest[cut:] else None
    name = json.loads(f'"{head.group(1)}"') if head is not None else None
    if name in tools.functions:
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": name, "arguments": _json_prefix(rest[head.end():]) or ""}})
        rest = rest[:cut]
    content.append(rest)
    return "".join(content).strip(), calls


def _call(body: str, tools: Tools):
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tools.functions or not isinstance(obj.get("arguments"), dict):
        return None
    return obj["name"], obj["arguments"]


def _arguments_text(body: str, arguments: dict) -> str:
    """The arguments as the model wrote them (when they come after the name), else re-serialized."""
    head = _HEAD.match(body)
    raw = _json_prefix(body[head.end():]) if head else None
    try:
        if raw is not None and json.loads(raw) == arguments:
            return raw
    except ValueError:
        pass
    return json.dumps(arguments)


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class CallStream:
    """OpenAI's streamed tool calls from an answer's text deltas: feed() returns the content to send and
    the tool-call deltas ({index, id, type, function: {name, arguments}} first, then {index, function:
    {arguments}} pieces). Text that may begin a tool-call block is held back until it is known; a call's
    arguments stream as the model writes them when it writes the name first (the grammar's order),
    else the call comes whole when its block ends."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.buffer = ""  # text not yet sent: a possible OPEN, or the inside of a block
        self.in_block = False
        self.calls = 0
        self.sent_args = None  # the current call's arguments sent so far (None: its head not yet sent)
        self.block_called = False  # the current block's call has been sent (its head at least)
        self.args_start = 0  # where the current call's arguments begin in its block
        self.ids: list[str] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if not self.in_block:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, OPEN)
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, deltas
                content += self.buffer[:at]
                self.buffer = self.buffer[at + len(OPEN):]
                self.in_block, self.sent_args, self.block_called = True, None, False
            end = self.buffer.find(CLOSE)
            body = self.buffer if end < 0 else self.buffer[:end]
            deltas += self._stream_args(body, whole=end >= 0)
            if end < 0:
                if final:  # an unfinished block at the end: a call cut short if it named one, else text
                    content += "" if self.block_called else OPEN + self.buffer
                    self.buffer = ""
                return content, deltas
            if not self.block_called:  # a whole block that is no call of the tools: it was text
                content += OPEN + body + CLOSE
            self.buffer = self.buffer[end + len(CLOSE):]
            self.in_block = False

    def _stream_args(self, body: str, whole: bool) -> list[dict]:
        out = []
        if self.sent_args is None:
            head = _HEAD.match(body)
            if head is None or head.group(1) not in self.tools.functions:
                if not whole:
                    return out
                call = _call(body, self.tools)
                if call is None:
                    return out
                return [self._head(call[0]), self._args(json.dumps(call[1]))]
            out.append(self._head(json.loads(f'"{head.group(1)}"')))
            self.sent_args, self.args_start = "", head.end()
        args = _json_prefix(body[self.args_start:])
        if whole:
            call = _call(body, self.tools)
            if call is not None and args is not None and not json.loads(args) == call[1]:
                args = None
        if args is not None and args.startswith(self.sent_args) and len(args) > len(self.sent_args):
            out.append(self._args(args[len(self.sent_args):]))
            self.sent_args = args
        return out

    def _head(self, name: str) -> dict:
        self.block_called = True
        self.ids.append(new_call_id())
        self.calls += 1
        return {"index": self.calls - 1, "id": self.ids[-1], "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _args(self, piece: str) -> dict:
        return {"index": self.calls - 1, "function": {"arguments": piece}}


def _partial_suffix(text: str, token: str) -> int:
    """The length of the longest end of `text` that begins `token`."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def _json_prefix(text: str) -> str | None:
    """The arguments object's text written so far (up to its closing brace, once written), or None if
    the text does not start an object."""
    text = text.lstrip()
    if not text.startswith("{"):
        return None
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return text[:i + 1]
    return text
