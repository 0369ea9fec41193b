"""Tool calls read back from the model's answer (the answer's side of serve.tool_calls): whole (`parse`),
or as OpenAI's streamed deltas (`CallStream`), in the request's format (`Tools.fmt`), the same calls
either way however the answer's text is cut into pieces."""

from __future__ import annotations

import functools
import json
import re

from serve.tool_calls import Format, Tools, new_call_id


@functools.lru_cache(maxsize=None)
def _head(fmt: Format) -> re.Pattern:
    """A call's object up to its arguments: {"name": "...", "<key>": (the name first, the grammar's order)."""
    keys = "|".join(map(re.escape, fmt.keys))
    return re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:' + keys + r')"\s*:\s*')


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _name(quoted: str) -> str | None:
    """A name as the model wrote it between quotes, unescaped (None if it is no JSON string)."""
    try:
        return json.loads(f'"{quoted}"')
    except ValueError:
        return None


def _cut_call(body: str, tools: Tools) -> tuple[str, str] | None:
    """A call cut off at the end of the answer (max_tokens): (its name, its arguments written so far)
    once its name is written whole and is one of the tools' (the grammar's order: the name first)."""
    named = _NAME.match(body)
    if named is None or _name(named.group(1)) not in tools.functions:
        return None
    head = _head(tools.fmt).match(body)
    return _name(named.group(1)), (_json_prefix(body[head.end():]) or "") if head else ""


def _made(name: str, arguments: str) -> dict:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse(text: str, tools: Tools) -> tuple[str, list[dict]]:
    """(the text outside the calls, the calls) from a whole answer; a block (or object) that does not
    parse as a call of one of the tools stays in the text. A call cut off at the end of the answer
    (max_tokens) that has named one of the tools is that call with the arguments written so far
    (`_cut_call`), as a stream of the same answer gives it (its finish_reason says "length")."""
    fmt = tools.fmt
    if not fmt.open:
        return _parse_object_answer(text, tools)
    calls, content, pos = [], [], 0
    for match in re.finditer(re.escape(fmt.open) + r"(.*?)" + re.escape(fmt.close), text, re.S):
        call = _call(match.group(1), tools)
        if call is None:
            continue
        content.append(text[pos:match.start()])
        pos = match.end()
        calls.append(_made(call[0], _arguments_text(match.group(1), call[1], fmt)))
    rest = text[pos:]
    at = rest.rfind(fmt.open)
    cut = _cut_call(rest[at + len(fmt.open):], tools) if at >= 0 and fmt.close not in rest[at:] else None
    if cut is not None:
        calls.append(_made(*cut))
        rest = rest[:at]
    content.append(rest)
    return "".join(content).strip(), calls


def _parse_object_answer(text: str, tools: Tools) -> tuple[str, list[dict]]:
    """An answer that is a call when it begins with one (llama3_json): the call, then the text after it."""
    body = text.lstrip()
    if not body.startswith("{"):
        return text.strip(), []
    end = _object_end(body)
    if end is not None:
        call = _call(body[:end], tools)
        if call is None:
            return text.strip(), []
        return body[end:].strip(), [_made(call[0], _arguments_text(body[:end], call[1], tools.fmt))]
    cut = _cut_call(body, tools)
    return ("", [_made(*cut)]) if cut is not None else (text.strip(), [])


def _call(body: str, tools: Tools):
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


def _arguments_text(body: str, arguments: dict, fmt: Format) -> str:
    """The arguments as the model wrote them (when they come after the name), else re-serialized."""
    head = _head(fmt).match(body)
    raw = _json_prefix(body[head.end():]) if head else None
    try:
        if raw is not None and json.loads(raw) == arguments:
            return raw
    except ValueError:
        pass
    return json.dumps(arguments)


class CallStream:
    """OpenAI's streamed tool calls from an answer's text deltas: feed() returns the content to send and
    the tool-call deltas ({index, id, type, function: {name, arguments}} first, then {index, function:
    {arguments}} pieces). Text that may begin a call is held back until it is known; a call's arguments
    stream as the model writes them when it writes the name first (the grammar's order), else the call
    comes whole when it ends. In a format without blocks (llama3_json) the answer's first character
    decides: an object may be a call, held back until its head is known, and what follows it is text."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.fmt = tools.fmt
        self.buffer = ""  # text not yet sent: a possible opening, or the inside of a call
        self.in_block = False
        self.text_only = False  # (no blocks) the answer did not begin with an object, or its call ended
        self.calls = 0
        self.sent_args = None  # the current call's arguments sent so far (None: its head not yet sent)
        self.block_called = False  # the current block's call has been sent (its head at least)
        self.args_start = 0  # where the current call's arguments begin in its block
        self.ids: list[str] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buffer += text
        content, deltas = "", []
        open_, close = self.fmt.open, self.fmt.close
        while True:
            if not self.in_block:
                if not open_:
                    if not self.text_only:
                        stripped = self.buffer.lstrip()
                        if not stripped and not final:
                            return content, deltas  # the answer has not begun yet
                        self.text_only = not stripped.startswith("{")
                        if not self.text_only:
                            content += self.buffer[:len(self.buffer) - len(stripped)]
                            self.buffer = stripped
                            self.in_block, self.sent_args, self.block_called = True, None, False
                    if self.text_only:
                        content += self.buffer
                        self.buffer = ""
                        return content, deltas
                else:
                    at = self.buffer.find(open_)
                    if at < 0:
                        keep = 0 if final else _partial_suffix(self.buffer, open_)
                        content += self.buffer[:len(self.buffer) - keep]
                        self.buffer = self.buffer[len(self.buffer) - keep:]
                        return content, deltas
                    content += self.buffer[:at]
                    self.buffer = self.buffer[at + len(open_):]
                    self.in_block, self.sent_args, self.block_called = True, None, False
            if close:
                end = self.buffer.find(close)
                body = self.buffer if end < 0 else self.buffer[:end]
            else:
                end = _object_end(self.buffer)
                end = -1 if end is None else end
                body = self.buffer if end < 0 else self.buffer[:end]
            deltas += self._stream_args(body, whole=end >= 0)
            if end < 0:
                if final:  # unfinished at the end: a call cut short if it named one, else text
                    cut = None if self.block_called else _cut_call(body, self.tools)
                    if cut is not None:
                        deltas.append(self._head(cut[0]))
                        deltas += [self._args(cut[1])] if cut[1] else []
                    elif not self.block_called:
                        content += open_ + self.buffer
                    self.buffer = ""
                return content, deltas
            if not self.block_called:  # a whole block that is no call of the tools: it was text
                content += open_ + body + close
            self.buffer = self.buffer[end + len(close):]
            self.in_block = False
            self.text_only = not open_  # (no blocks) one call an answer: the rest is text

    def _stream_args(self, body: str, whole: bool) -> list[dict]:
        out = []
        if self.sent_args is None:
            head = _head(self.fmt).match(body)
            if head is None or _name(head.group(1)) not in self.tools.functions:
                if not whole:
                    return out
                call = _call(body, self.tools)
                if call is None:
                    return out
                return [self._head(call[0]), self._args(json.dumps(call[1]))]
            out.append(self._head(_name(head.group(1))))
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


def _object_end(text: str) -> int | None:
    """Where the JSON object that `text` begins with (after any space) ends, just past its closing brace;
    None while it is unfinished or when the text does not begin with one."""
    lead = len(text) - len(text.lstrip())
    if not text.startswith("{", lead):
        return None
    end = _scan(text[lead:])
    return None if end is None else lead + end


def _json_prefix(text: str) -> str | None:
    """The arguments object's text written so far (up to its closing brace, once written), or None if
    the text does not start an object."""
    text = text.lstrip()
    if not text.startswith("{"):
        return None
    end = _scan(text)
    return text if end is None else text[:end]


def _scan(text: str) -> int | None:
    """Just past the closing brace of the object `text` begins with; None while it is unfinished."""
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
