"""Tool calls written as a Python list of calls (vLLM's `pythonic` parser; Llama 3.2's and Llama 4's templates
ask for it, Llama 4 sometimes between <|python_start|> and <|python_end|>):

    [get_weather(city="Paris", unit="c"), get_time()]

An answer that begins with `[` is a list of calls when its first element reads as one: a function of the
request's tools called with keyword arguments whose values are literals (strings, numbers, True/False/None,
lists, dicts; JSON's true/false/null too, as a grammar's JSON values write them; a number that is not finite, a
string with a lone surrogate or an integer JSON cannot write is none). Each call is sent whole as its
parenthesis closes; a later element that is no call of the tools is left out; what follows the list is text;
a first element that is no call makes the whole answer text. Read by walking the text once (strings,
brackets), each element parsed at most once with Python's `ast` (literals only: nothing is evaluated). Plain
Python, no JAX."""

from __future__ import annotations

import ast
import json
import math
import re

START, END = "<|python_start|>", "<|python_end|>"
_HEAD = re.compile(r"\s*([^\W\d]\w*)\(")
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _value(node):
    """A literal's value (ValueError for anything else: names, calls, operators but a sign)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # (surrogate pairs joined, as JSON reads them)
        try:
            return node.value.encode("utf-16", "surrogatepass").decode("utf-16")
        except UnicodeDecodeError:
            raise ValueError("a lone surrogate") from None
    if isinstance(node, ast.Constant) and isinstance(node.value, float) and not math.isfinite(node.value):
        raise ValueError("not a finite number")
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(node.operand, ast.Constant) \
            and isinstance(node.operand.value, (int, float)) and not isinstance(node.operand.value, bool):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(x) for x in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        keys = [_value(k) for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict's keys are strings")
        return dict(zip(keys, (_value(v) for v in node.values)))
    raise ValueError("not a literal")


def read_call(text: str, functions) -> tuple[str, dict] | None:
    """(name, arguments) of one call `name(key=value, ...)` of a function in `functions`, or None. Names as
    written: Python reads identifiers NFKC-normalised (a fullwidth `ｇet_time` is get_time), which would call a
    function, or fill an argument, that the model did not name."""
    try:
        src = text.strip()
        node = ast.parse(src, mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return None
        name = ast.get_source_segment(src, node.func)
        if name not in functions:
            return None
        args = {}
        for k in node.keywords:
            key = ast.get_source_segment(src, k).split("=", 1)[0].strip()
            args.setdefault(key, _value(k.value))  # (a name given twice: its first)
        return name, args
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _step(text: str, i: int, quote: str) -> tuple[int, str, str]:
    """One step of reading Python source at `i`, inside the string `quote` opened ("" none): (where the next
    step starts, the string open after this one, the character read outside any string: "" for a string's)."""
    if quote:
        if text[i] == "\\":  # (an escape: the next character is the string's)
            return i + 2, quote, ""
        return (i + len(quote), "", "") if text.startswith(quote, i) else (i + 1, quote, "")
    if text[i] in "'\"":
        opened = text[i] * 3 if text.startswith(text[i] * 3, i) else text[i]
        return i + len(opened), opened, ""
    return i + 1, "", text[i]


def _argument_ends(text: str, start: int) -> list[int]:
    """Where a call's keyword arguments end in `text` (its commas at the call's own level), from `start`."""
    ends, depth, quote, i = [], 0, "", start
    while i < len(text):
        at = i
        i, quote, c = _step(text, i, quote)
        if c in ("(", "[", "{"):
            depth += 1
        elif c in (")", "]", "}"):
            depth -= 1
        elif c == "," and depth == 0:
            ends.append(at)
    return ends


def literal(value) -> str:
    """`value` (JSON's types) as a Python literal: how a call's argument is written."""
    if value is True or value is False or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)  # (strings double-quoted: Python reads JSON's escapes alike)


def write(name: str, arguments: dict) -> str:
    return f"[{name}({', '.join(f'{k}={literal(v)}' for k, v in arguments.items())})]"


class PythonicStream:
    """feed(text delta, final) -> (content, tool-call deltas) as tool_parse.CallStream gives them: each call
    whole ({index, id, type, function: {name, arguments}}) once its parenthesis closes."""

    def __init__(self, tools):
        self.tools = tools
        self.buffer = ""
        self.state = "start"  # "start": before the answer's first word; "list": inside the calls; "text"
        self.at = 0  # (list) where scanning goes on in the buffer
        self.depth = 0  # brackets open ([ ( {) in the list, its own included
        self.quote = ""  # the string the scan is inside ("" none; ', ", ''' or \"\"\")
        self.call_start = 0  # where the current element begins in the buffer
        self.done = False  # the current element has been read (at its closing parenthesis): the rest is not
        self.elements = 0  # elements read
        self.calls = 0
        self.head = ""  # the text before the list (<|python_start|>, spaces): shown only if no call comes

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buffer += text
        if self.state == "start":
            stripped = self.buffer.lstrip()
            if not final and (not stripped or (START.startswith(stripped) and stripped != START)):
                return "", []  # not known yet: spaces, or the start of <|python_start|>
            body = stripped[len(START):].lstrip() if stripped.startswith(START) else stripped
            if not final and not body:
                return "", []
            if not body.startswith("["):
                self.state = "text"
            else:
                self.head = self.buffer[:len(self.buffer) - len(body)]
                self.buffer, self.state, self.at, self.depth, self.call_start = body, "list", 1, 1, 1
        if self.state == "after":  # the list's end: <|python_end|> there is no text
            stripped = self.buffer.lstrip()
            if not final and END.startswith(stripped) and stripped != END:
                return "", []
            self.buffer = stripped[len(END):] if stripped.startswith(END) else self.buffer
            self.state = "text"
        if self.state == "text":
            content, self.buffer = self.buffer, ""
            return content, []
        return self._scan(final)

    def _scan(self, final: bool) -> tuple[str, list[dict]]:
        deltas, buf, i = [], self.buffer, self.at
        while i < len(buf):
            if buf[i] in "'\"" and len(buf) - i < 3 and not final:
                break  # a quote: whether it is one of three is not known yet
            i, self.quote, c = _step(buf, i, self.quote)
            if c in ("(", "[", "{"):
                self.depth += 1
            elif c in (")", "]", "}"):
                self.depth -= 1
                if self.depth == 1 and c == ")" and not self.done:  # an element closed: a call, if it reads as one
                    deltas += self._element(buf[self.call_start:i])
                    if self.state == "text":  # (its first element was none: the answer is text)
                        return self._ended(deltas, final)
                elif self.depth == 0:  # the list's end: what follows is text
                    self.at = i
                    return self._ended(deltas, final)
            elif c == "," and self.depth == 1:
                if not self.done:  # an element that never closed a call: no call (the first: no list of calls)
                    self.elements += 1
                    if self.elements == 1 and not self.calls:
                        self.state = "text"
                        return self._ended(deltas, final)
                self.call_start, self.done = i, False
        self.at = i  # (past the end after an escape: the escaped character is skipped as it comes)
        if final:  # cut off inside the list (max_tokens): the calls so far, and one cut short that named a tool
            if not self.done and (not self.calls or self.tools.parallel):  # with the arguments it wrote whole
                deltas += self._cut(buf[self.call_start:])
            return self._ended(deltas, final)
        return "", deltas

    def _cut(self, text: str) -> list[dict]:
        """A call cut off by the end of the answer: the longest prefix ending at one of its keyword arguments'
        ends that reads as a call of the tools ("name()" at least), whole."""
        head = _HEAD.match(text)
        if head is None or head.group(1) not in self.tools.functions:
            return []
        for end in [*_argument_ends(text, head.end())[-1:], head.end()]:  # (its last whole argument, or none)
            deltas = self._element(text[:end].rstrip().rstrip(",") + ")", cut=True)
            if deltas:
                return deltas
        return []

    def _element(self, text: str, cut: bool = False) -> list[dict]:
        """An element read (once): a call of the tools, sent; else left out, and for the first, no calls at all."""
        first, self.done = not self.elements, True
        self.elements += 1
        call = read_call(text, self.tools.functions)
        try:
            arguments = json.dumps(call[1], ensure_ascii=False, allow_nan=False) if call else None
        except (ValueError, TypeError):  # (an integer past what Python writes as text)
            arguments = None
        if arguments is None:
            if first and not cut:
                self.state = "text"
            return []
        if self.calls and not self.tools.parallel:
            return []
        self.calls += 1
        return [{"index": self.calls - 1, "id": self.tools.fmt.new_call_id(), "type": "function",
                 "function": {"name": call[0], "arguments": arguments}}]

    def _ended(self, deltas: list[dict], final: bool) -> tuple[str, list[dict]]:
        """The list ended at self.at (or the answer did, or its first element is no call): the text after it is
        content; with no call at all the whole answer was text."""
        if not self.calls:
            content, self.buffer, self.state = self.head + self.buffer, "", "text"
            return content, deltas
        self.buffer, self.state = self.buffer[self.at:], "after"
        content, _ = self.feed("", final)
        return content, deltas
