"""Tool calls read back from the model's answer (the answer's side of jaxcb.host.tool_calls): as OpenAI's
streamed deltas (`CallStream`), or whole (`parse`: the stream of the whole answer, so the same calls
either way however the answer's text is cut into pieces), in the request's format (`Tools.fmt`).

Formats of the "blocks" shape (hermes; qwen3_coder and glm45, whose arguments are elements; mistral_v11, whose
blocks end with their arguments) hold calls
anywhere in the answer; those of the "object" and "list" shapes (llama3_json; mistral, granite) are calls
when the answer begins with them (a list: its first object), and what follows is text. A call cut off at
the end of the answer (max_tokens) that has named one of the tools is that call with the arguments
written so far (its finish_reason says "length")."""

from __future__ import annotations

import functools
import json
import math
import re

from jaxcb.host import pythonic
from jaxcb.host.request import not_a_number
from jaxcb.host.structured import followed
from jaxcb.host.tool_calls import ELEMENTS, NAME, Format, Tools, xml_type


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')  # a call's object up to its name
_CALL_ID = "[CALL_ID]"  # (name-first calls: between a name and its arguments' marker, with an id, in some templates)


@functools.lru_cache(maxsize=None)
def _head(fmt: Format) -> re.Pattern:
    """A call's object up to its arguments: {"name": "...", "<key>": (the name first, the grammar's order);
    or, where calls are name-first (fmt.args), the name and the marker (with a [CALL_ID] and id between,
    as some of Mistral's templates write); or (qwen3_coder) the <function=name> element's opening; or (glm45) the
    name, ended by its line's end or the first argument's element."""
    if fmt.xml == "glm45":
        return re.compile(rf"\s*({NAME.pattern})(?:[ \t]*\n|(?=\s*<arg_key>))")
    if fmt.xml == "minimax_m2":
        return re.compile(rf'\s*<invoke name="({NAME.pattern})">\n?')
    if fmt.xml:
        return re.compile(rf"\s*<function=({NAME.pattern})>\n?")
    if fmt.args:
        return re.compile(rf"\s*{re.escape(fmt.lead)}\s*({NAME.pattern})(?:{re.escape(_CALL_ID)}[A-Za-z0-9]{{1,64}})?"
                          rf"{re.escape(fmt.args)}\s*")
    keys = "|".join(map(re.escape, fmt.keys))
    return re.compile(_NAME.pattern + r'\s*,\s*"(?:' + keys + r')"\s*:\s*')


def _name(quoted: str) -> str | None:
    """A name as the model wrote it between quotes, unescaped (None if it is no JSON string)."""
    try:
        return json.loads(f'"{quoted}"')
    except ValueError:
        return None


def parse(text: str, tools: Tools) -> tuple[str, list[dict]]:
    """(the text outside the calls, the calls) from a whole answer: what a stream of it gives (CallStream),
    its deltas merged. A block (or answer) that does not parse as calls of the tools stays text. With
    parallel_tool_calls false, the first call only (OpenAI's: at most one; the others' text is not shown
    either)."""
    content, deltas = CallStream(tools).feed(text, final=True)
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": d.get("id"), "type": "function",
                                             "function": {"name": d["function"].get("name"), "arguments": ""}})
        call["function"]["arguments"] += d["function"]["arguments"]
    return content.strip(), list(calls.values())


def _answer_body(text: str, fmt: Format) -> str | None:
    """(object and list shapes) The answer from its first object or list on (after `open`, where that is
    in the text), or None when it does not begin with one."""
    if fmt.open and text.startswith(fmt.open):
        text = text[len(fmt.open):].lstrip()
    return text if text.startswith("[" if fmt.shape == "list" else "{") else None


def _block_end(body: str, fmt: Format) -> int | None:
    """Where a block's body ends (its `close`), None while unfinished; where a block has no `close` (name-first
    calls), just past its arguments object, or where it stops being a call's beginning (a block of text:
    what follows is the answer's again)."""
    if fmt.close:
        end = body.find(fmt.close)
        return None if end < 0 else end
    head = _head(fmt).match(body)  # (up to the arguments' first character)
    if head is None:
        return _not_a_head(body, fmt)
    rest = body[head.end():]
    if rest and not rest.startswith("{"):
        return head.end()  # no arguments object
    end = _scan(rest) if rest else None
    return None if end is None else head.end() + end


_NAME_CHARS = re.compile(r"\s*[A-Za-z0-9_-]*")  # (a name's characters: tool_calls.NAME's, of any number)


def _not_a_head(body: str, fmt: Format) -> int | None:
    """(name-first calls) Where `body` stops being a call's beginning, a name (1 to 64 characters) then
    `fmt.args` (a [CALL_ID] and id between allowed); None while it may still be one."""
    lead = len(body) - len(body.lstrip())
    at = _NAME_CHARS.match(body).end()
    if at - lead > 64:
        return lead + 64
    rest = body[at:]
    if rest and at == lead:  # no name
        return at
    if rest.startswith(_CALL_ID):
        at += len(_CALL_ID) + re.match(r"[A-Za-z0-9]*", rest[len(_CALL_ID):]).end()
        return None if fmt.args.startswith(body[at:]) else at
    return None if any(marker.startswith(rest) for marker in (fmt.args, _CALL_ID)) else at


# An argument's element (its name, its text) as read back, by format, more leniently than tool_calls.ELEMENTS writes
# it (its other markers): qwen3_coder's <parameter=...>, glm45's key and value, minimax_m2's <parameter name="...">
_ELEMENT = {"qwen3_coder": re.compile(r"<parameter=([^>\n]{1,256})>\n?(.*?)\n?</parameter>", re.S),
            "glm45": re.compile(r"<arg_key>\s*([^<]{1,256}?)\s*</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S),
            "minimax_m2": re.compile(r'<parameter name="([^"<>\n]{1,256})">(.*?)</parameter>', re.S)}
_INTEGER = re.compile(r"-?[0-9]+")


def _xml_value(text: str, schema) -> object:
    """An argument's element text as its value, read by its schema (tool_calls.xml_type; vLLM's qwen3_coder
    rules): a string as it is (an untyped or unknown argument too), null for "null" where it may be, an
    enum's value as written, an integer, number or boolean as written (True and False too, as Python writes
    them), anything else as JSON; text that does not read as its type (or as a finite number) stays text."""
    kind, nullable = xml_type(schema)
    word = text.strip()
    if word.lower() == "null" and (nullable or kind not in (None, "string")):
        return None
    enum = schema.get("enum") if isinstance(schema, dict) else None
    for value in enum if isinstance(enum, list) else ():
        if value == text if isinstance(value, str) else json.dumps(value) == word:
            return value
    if kind in (None, "string"):
        return text
    if kind in ("integer", "number") and _INTEGER.fullmatch(word):
        return int(word)
    try:
        if kind == "number":
            value = float(word)
            return value if math.isfinite(value) else text
        if kind == "boolean":
            return {"true": True, "false": False}[word.lower()]
        return json.loads(word, parse_constant=not_a_number)
    except (ValueError, KeyError):
        return text


def _xml_args(text: str, schema: dict, whole: bool, style: str) -> str:
    """The arguments of an element call (`style`: qwen3_coder's or glm45's elements) as the JSON text written so
    far: "{", then each argument's element once its closing tag is written (a name given twice: its first), then
    "}" once the call is closed (qwen3_coder: its </function> outside any element; or `whole`: the block ended),
    so each piece goes on from the last, and a whole call's text is json.dumps of its arguments. Nothing after
    its </function> is read."""
    return _xml_read(text, schema, whole, style)[0]


def _xml_read(text: str, schema: dict, whole: bool, style: str) -> tuple[str, int | None]:
    """(_xml_args's text, where the function's element ends: just past its </function>, None while open or where
    calls have no such element: glm45's)."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    items, seen, at, closed, closed_at = [], set(), 0, whole, None
    # (an argument element's opening as its format writes one; a call that is an element of its own, its closing)
    pattern, function_end, argument = _ELEMENT[style], ELEMENTS[style].call_end, ELEMENTS[style].argument.split("{}")[0]
    while True:
        element = pattern.search(text, at)
        end = text.find(function_end, at) if function_end else -1
        opening = text.find(argument, at)
        if end >= 0 and (element is None or end < element.start()) and not 0 <= opening < end:
            closed, closed_at = True, end + len(function_end)
            break
        if element is None:
            break
        key = element.group(1)
        if key not in seen:
            seen.add(key)
            value = _xml_value(element.group(2), followed(schema, properties.get(key)))  # (a reference: its target)
            items.append(f"{json.dumps(key)}: {json.dumps(value)}")
        at = element.end()
    return "{" + ", ".join(items) + ("}" if closed else ""), closed_at


def _call(body: str, tools: Tools):
    if tools.fmt.xml:  # <function=name> (or glm45's name) and its argument elements (a whole block)
        head = _head(tools.fmt).match(body)
        if head is None and tools.fmt.xml == "glm45":  # (a call without arguments: the block its name only)
            head = re.fullmatch(rf"\s*({NAME.pattern})\s*", body)
        if head is None or head.group(1) not in tools.functions:
            return None
        schema = tools.functions[head.group(1)]
        return head.group(1), json.loads(_xml_args(body[head.end():], schema, True, tools.fmt.xml))
    if tools.fmt.args:  # name-first: the name, then the arguments object (then the format's tail)
        head = _head(tools.fmt).match(body)
        if head is None or head.group(1) not in tools.functions:
            return None
        rest = body[head.end():].rstrip()
        try:
            arguments = json.loads(rest[:len(rest) - len(tools.fmt.tail.strip())] if tools.fmt.tail.strip()
                                   and rest.endswith(tools.fmt.tail.strip()) else rest)
        except ValueError:
            return None
        return (head.group(1), arguments) if isinstance(arguments, dict) else None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tools.functions:
        return None
    arguments = next((obj[k] for k in tools.fmt.keys if k in obj), None)
    if not isinstance(arguments, dict):
        return None
    return obj["name"], arguments


def _cut_call(body: str, tools: Tools) -> tuple[str, str] | None:
    """A call cut off at the end of the answer: (its name, its arguments written so far) once its name is
    written whole and is one of the tools' (the grammar's order: the name first)."""
    head = _head(tools.fmt).match(body)
    named = head if tools.fmt.args or tools.fmt.xml else _NAME.match(body)
    if named is None or _name(named.group(1)) not in tools.functions:
        return None
    name = _name(named.group(1))
    if tools.fmt.xml:  # (its whole parameter elements so far)
        return name, _xml_args(body[head.end():], tools.functions[name], False, tools.fmt.xml)
    return name, (_json_prefix(body[head.end():]) or "") if head else ""


class CallStream:
    """OpenAI's streamed tool calls from an answer's text deltas: feed() returns the content to send and
    the tool-call deltas ({index, id, type, function: {name, arguments}} first, then {index, function:
    {arguments}} pieces). Text that may begin a call is held back until it is known. A call's arguments
    stream as the model writes them when it writes the name first (the grammar's order), else the call
    comes whole when its object ends. An answer that is a list is calls when its first object is one; a
    later object that is no call of the tools is left out."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.fmt = tools.fmt
        self.buffer = ""  # text not yet sent: a possible opening, or the inside of a call
        self.in_block = False
        self.text_only = False  # (object, list) the answer did not begin with calls, or they ended
        self.calls = 0
        self.sent_args = None  # the current call's arguments sent so far (None: its head not yet sent)
        self.block_called = False  # the current block's call has been sent (its head at least)
        self.args_start = 0  # where the current call's arguments begin in its block
        self.function = ""  # the current call's function
        self.element_end = None  # (xml) where the current call's <function> element ends in its block, once closed
        self.head_text = ""  # (object, list) the text before the calls: sent only if they are no calls
        self.at = 0  # (object, list) where the current object begins in the buffer
        self.ids: list[str] = []
        self.pythonic = pythonic.PythonicStream(tools) if self.fmt.pythonic else None  # (a Python list of calls)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        if self.pythonic is not None:  # (its own reader)
            content, deltas = self.pythonic.feed(text, final)
            self.calls = self.pythonic.calls
        else:
            self.buffer += text
            content, deltas = self._feed_blocks(final) if self.fmt.shape == "blocks" else self._feed_answer(final)
        if not self.tools.parallel:  # the first call only, as parse() gives it
            deltas = [d for d in deltas if d["index"] == 0]
        if self.tools.choice in ("required", "function"):  # the grammar's calls only: what is between them (a
            content = ""  # newline, a marker cut off by max_tokens) is no answer
        return content, deltas

    def _feed_blocks(self, final: bool) -> tuple[str, list[dict]]:
        content, deltas = "", []
        open_, close = self.fmt.open, self.fmt.close
        while True:
            if not self.in_block:
                at = self.buffer.find(open_)
                if at < 0:
                    keep = 0 if final else max(_partial_suffix(self.buffer, m) for m in (open_, *self.fmt.drop))
                    content += self._text(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, deltas
                content += self._text(self.buffer[:at])
                self.buffer = self.buffer[at + len(open_):]
                self.in_block, self.sent_args, self.block_called = True, None, False
            end = _block_end(self.buffer, self.fmt)
            body = self.buffer if end is None else self.buffer[:end]
            deltas += self._stream_args(body, whole=end is not None)
            if self.fmt.xml and ELEMENTS[self.fmt.xml].call_end and self._next_element(body):  # (calls as elements)
                continue
            if end is None:
                if final:  # unfinished at the end: a call cut short if it named one, else text
                    cut = None if self.block_called else _cut_call(body, self.tools)
                    if cut is not None:
                        deltas += self._whole(*cut)
                    elif not self.block_called:
                        content += open_ + self.buffer
                    self.buffer = ""
                return content, deltas
            if not self.block_called:  # a whole block that is no call of the tools: it was text
                content += open_ + body + close
            self.buffer = self.buffer[end + len(close):]
            self.in_block = False

    def _text(self, text: str) -> str:
        """Text between blocks as the answer's: without the markers around a run of calls (Format.drop)."""
        for m in self.fmt.drop:
            text = text.replace(m, "")
        return text

    def _next_element(self, body: str) -> bool:
        """(qwen3_coder, minimax_m2) Whether another <function=...> (<invoke ...>) element begins after the current one, closed, in a
        block that holds a call: then the block goes on from it, each element a call of the tools (as vLLM's
        parser reads them); text between elements, and an element of no tool, are not read."""
        if not self.block_called:
            return False
        if self.sent_args is not None:  # a call of the tools: _stream_args found its end
            end = self.element_end
        else:  # an element of no tool: read to its end
            head = _head(self.fmt).match(body)
            done = None if head is None else _xml_read(body[head.end():], {}, False, self.fmt.xml)[1]
            end = None if done is None else head.end() + done
        after = -1 if end is None else body.find(ELEMENTS[self.fmt.xml].call.split("{}")[0], end)
        if after < 0:
            return False
        self.buffer, self.sent_args = self.buffer[after:], None
        return True

    def _feed_answer(self, final: bool) -> tuple[str, list[dict]]:
        content, deltas = "", []
        if not self.in_block and not self.text_only:  # the answer's beginning decides
            stripped = self.buffer.lstrip()
            opening = self.fmt.open and self.fmt.open.startswith(stripped[:len(self.fmt.open)])
            if not final and (not stripped or (opening and len(stripped) <= len(self.fmt.open))):
                return content, deltas  # not known yet
            body = _answer_body(stripped, self.fmt)
            if body is None:
                self.text_only = True
            else:
                self.head_text = self.buffer[:len(self.buffer) - len(body)]  # text if no calls come
                self.buffer, self.in_block = body, True
                self.at = 1 if self.fmt.shape == "list" else 0  # where the next object begins
                self.sent_args, self.block_called = None, False
        if self.text_only:
            content, self.buffer = self.buffer, ""
            return content, deltas
        while True:
            if self.fmt.shape == "list":  # the next object, past commas and spaces; else the list's end
                rest = self.buffer[self.at:]
                self.at += len(rest) - len(rest.lstrip(" \n\t,"))
                if self.at >= len(self.buffer) and not final:
                    return content, deltas
                if self.at >= len(self.buffer) or self.buffer[self.at] != "{":
                    return self._answer_ended(content, deltas, self.at + self.buffer.startswith("]", self.at))
            item = self.buffer[self.at:]
            end = _scan(item)
            deltas += self._stream_args(item if end is None else item[:end], whole=end is not None)
            if end is None:
                if not final:
                    return content, deltas
                cut = None if self.block_called else _cut_call(item, self.tools)
                if cut is not None:  # cut off once it named one of the tools
                    deltas += self._whole(*cut)
                return self._answer_ended(content, deltas, len(self.buffer))
            if self.fmt.shape == "object" or not self.calls:  # one call; or a list whose first object is none
                return self._answer_ended(content, deltas, self.at + end)
            self.at += end  # (a later object of the list that is no call of the tools is left out)
            self.sent_args, self.block_called = None, False

    def _answer_ended(self, content: str, deltas: list[dict], end: int) -> tuple[str, list[dict]]:
        """The answer's calls ended at `end` of the buffer: what follows is text; all of it where no call came."""
        content += (self.head_text + self.buffer) if not self.calls else self.buffer[end:]
        self.buffer, self.in_block, self.text_only = "", False, True
        return content, deltas

    def _stream_args(self, body: str, whole: bool) -> list[dict]:
        out = []
        if self.sent_args is None:
            head = _head(self.fmt).match(body)
            if head is not None and self.fmt.args and not body[head.end():].startswith("{"):
                head = None  # (a name-first call is one once its arguments begin)
            if head is None or _name(head.group(1)) not in self.tools.functions:
                if not whole:
                    return out
                call = _call(body, self.tools)
                if call is None:
                    return out
                return self._whole(call[0], json.dumps(call[1]))
            out.append(self._head(_name(head.group(1))))
            self.sent_args, self.args_start, self.function = "", head.end(), _name(head.group(1))
        if self.fmt.xml:
            rest = body[self.args_start:]
            args, done = _xml_read(rest, self.tools.functions[self.function], whole, self.fmt.xml)
            self.element_end = None if done is None else self.args_start + done
        else:
            args = _json_prefix(body[self.args_start:])
        if whole:  # the arguments as written, unless they are not what the call holds (a key given twice)
            call = _call(body, self.tools)
            if call is not None and args is not None and not json.loads(args) == call[1]:
                args = None if self.sent_args else json.dumps(call[1])
        if args is not None and args.startswith(self.sent_args) and len(args) > len(self.sent_args):
            out.append(self._args(args[len(self.sent_args):]))
            self.sent_args = args
        return out

    def _whole(self, name: str, arguments: str) -> list[dict]:
        return [self._head(name)] + ([self._args(arguments)] if arguments else [])

    def _head(self, name: str) -> dict:
        self.block_called = True
        self.ids.append(self.fmt.new_call_id())
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
    end = _scan(text)
    return text if end is None else text[:end]


def _scan(text: str) -> int | None:
    """Just past the closing bracket of the object or list `text` begins with; None while it is unfinished."""
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
                return i + 1
    return None
