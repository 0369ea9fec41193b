"""OpenAI's harmony format (gpt-oss), read back from an answer's text: the answer is a run of messages, each a
header and a body,

    <|channel|>analysis<|message|>The user asks for the weather: call get_weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>

(the chat template wrote the first header's `<|start|>assistant`). A message's channel and recipient say what
it is: `analysis` is the model's reasoning; `final`, and `commentary` with no recipient (a preamble before
calls), is the answer's content; a message to `functions.NAME` is a call of the tool NAME, its body the
arguments (JSON). A message to another recipient (a built-in tool jaxcb does not run) is left out. Bodies
end at `<|end|>`, `<|call|>` or `<|return|>` (the last two end the generation); text with no harmony header
at all is content. The markers are special tokens: the answer is decoded with them kept
(SamplingParams.skip_special_tokens False).

`HarmonyStream` gives OpenAI's streamed deltas (reasoning, content, tool-call pieces) from text deltas
however the text is cut; `parse` the same of a whole answer. Plain Python, no JAX.
"""

from __future__ import annotations

import functools
import json
import re

from jaxcb.host.structured import ASCII_CLASSES, Constraint, marker, special

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
HEADERS = ("<|start|>", "<|channel|>")  # what a message's header begins with
MARKERS = ("<|start|>", "<|channel|>", "<|constrain|>", MESSAGE, *ENDS, "<|endoftext|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
MAX_HEADER_CHARS = 512  # a header longer than this without <|message|> is no header: the answer is plain text


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes the harmony format (gpt-oss's): its channels and message markers."""
    return bool(template) and "<|channel|>" in template and MESSAGE in template


class HarmonyStream:
    """feed(text delta, final) -> (reasoning, content, tool-call deltas): the deltas OpenAI's chat API
    streams, tool calls as tool_parse.CallStream gives them ({index, id, type, function: {name, arguments:
    ""}} first, then {index, function: {arguments}} pieces). `tools`: the request's (None: no tools, so
    no message is a call); a call to a function it does not list is left out, as is every call after
    the first when parallel_tool_calls is false; under tool_choice required or a named function the
    content is the calls' only. Text that may be the start of a marker is held back until it is known."""

    def __init__(self, tools=None):  # (jaxcb.host.tool_calls.Tools)
        self.tools = tools
        self.buffer = ""
        self.header: str | None = ""  # the header being read; None inside a body
        self.route = "content"  # where the current body goes: "reasoning", "content", "call" or "drop"
        self.plain = False  # no harmony header at all: every word is content
        self.calls = 0
        self.started = False  # the current call's arguments have begun (their leading spaces dropped)

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        self.buffer += text
        reasoning, content, deltas = [], [], []
        while self.buffer:
            if self.plain:
                content.append(self.buffer)
                self.buffer = ""
            elif self.header is not None:
                at = self.buffer.find(MESSAGE)
                head = self.buffer.lstrip()
                opening = any(head.startswith(m) or m.startswith(head) for m in HEADERS)
                if not opening or (at < 0 and len(self.buffer) > MAX_HEADER_CHARS):
                    self.plain = True  # no header: plain text from here on
                    continue
                if at < 0:
                    if final:  # an unfinished header at the end: nothing of it is shown
                        self.buffer = ""
                    break
                self._open(self.buffer[:at], deltas)
                self.buffer, self.header = self.buffer[at + len(MESSAGE):], None
            else:
                end, closing = _first_end(self.buffer)
                if end < 0:
                    keep = 0 if final else _partial_marker(self.buffer)
                    body, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    self._body(body, reasoning, content, deltas)
                    break
                self._body(self.buffer[:end], reasoning, content, deltas)
                self.buffer, self.header = self.buffer[end + len(closing):], ""
        if self.tools is not None and self.tools.choice in ("required", "function"):
            content = []  # (the grammar's calls only)
        return "".join(reasoning), "".join(content), deltas

    def _open(self, header: str, deltas: list[dict]) -> None:
        """A message's header read: route its body, and a call's head delta."""
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        self.started = False
        if recipient is None:
            self.route = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"
            return
        name = recipient.group(1)
        name = name[len("functions."):] if name.startswith("functions.") else None
        tools = self.tools
        if (name is None or tools is None or not tools.active or name not in tools.functions
                or (not tools.parallel and self.calls)):
            self.route = "drop"
            return
        self.route = "call"
        self.calls += 1
        deltas.append({"index": self.calls - 1, "id": tools.fmt.new_call_id(), "type": "function",
                       "function": {"name": name, "arguments": ""}})

    def _body(self, text: str, reasoning: list, content: list, deltas: list[dict]) -> None:
        if not text:
            return
        if self.route == "reasoning":
            reasoning.append(text)
        elif self.route == "content":
            content.append(text)
        elif self.route == "call":
            if not self.started:
                text = text.lstrip()
                if not text:
                    return
                self.started = True
            deltas.append({"index": self.calls - 1, "function": {"arguments": text}})


def _first_end(text: str) -> tuple[int, str]:
    """Where the first marker that ends a body is in `text`, and which (-1, "" for none). A header's
    opening (<|start|>, <|channel|>) ends a body the model did not close, too."""
    best, which = -1, ""
    for m in (*ENDS, "<|start|>", "<|channel|>", "<|endoftext|>"):
        at = text.find(m)
        if at >= 0 and (best < 0 or at < best):
            best, which = at, m
    if which in ("<|start|>", "<|channel|>"):
        return best, ""  # (the header begins there: not consumed)
    return best, which


def _partial_marker(text: str) -> int:
    """The length of the longest end of `text` that begins one of the markers."""
    at = text.rfind("<", max(0, len(text) - max(len(m) for m in MARKERS)))
    while at >= 0:
        tail = text[at:]
        if any(m.startswith(tail) for m in MARKERS):
            return len(tail)
        at = text.rfind("<", max(0, len(text) - max(len(m) for m in MARKERS)), at)
    return 0


def parse(text: str, tools=None) -> tuple[str | None, str | None, list[dict]]:
    """(reasoning, content, calls) of a whole answer: what a stream of it gives, the call deltas merged into
    OpenAI's tool calls; None for a part it does not have."""
    reasoning, content, deltas = HarmonyStream(tools).feed(text, final=True)
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": d.get("id"), "type": "function",
                                             "function": {"name": d["function"].get("name"), "arguments": ""}})
        call["function"]["arguments"] += d["function"]["arguments"]
    return reasoning or None, content or None, list(calls.values())


def grammar(answer: str, rules: list[str], tokenizer=None) -> str:
    """A Lark grammar of a harmony answer: reasoning messages first if the model writes any (free text up to
    <|end|>), then `answer` (a rule's body, `rules` its rules). The markers are the special tokens of
    `tokenizer` where they are (no text is ever one: free text ends at the token), else their text (a lazy
    lexeme up to the first <|end|>)."""
    m = functools.partial(marker, tokenizer=tokenizer)
    if special("<|end|>", tokenizer) is not None:
        body, thought = f"thought {m('<|end|>')}", "thought: /(?s:.*)/"
    else:
        body, thought = "thought", "thought[lazy]: /(?s:.*)<\\|end\\|>/"
    return "\n".join([f"start: analysis* ({answer})",
                      f"analysis: {m('<|channel|>')} \"analysis\" {m('<|message|>')} {body} {m('<|start|>')} \"assistant\"",
                      thought, *rules])


def framed(c: Constraint, tokenizer=None) -> Constraint:
    """A structured output (a JSON schema, a regex, a choice) as the final message of a harmony answer, the
    model's reasoning free before it (vLLM's reasoning parsers hold it after the thinking likewise); a Lark
    grammar of the request's own is left as it is (it holds from the first token)."""
    import llguidance

    m = functools.partial(marker, tokenizer=tokenizer)
    if c.kind == "json":
        schema = json.loads(c.spec)
        schema = {} if schema is True else schema
        if not isinstance(schema, dict):
            return c  # (refused by its own check, naming its field)
        body = f"%json {json.dumps({'x-guidance': {'whitespace_flexible': False, 'coerce_one_of': True}, **schema})}"
    elif c.kind == "regex":
        body = f"/{llguidance.regex_to_lark(c.spec, ASCII_CLASSES)}/"
    elif c.kind == "choice":
        body = "(" + " | ".join(json.dumps(x) for x in json.loads(c.spec)) + ")"
    else:
        return c
    answer = f"{m('<|channel|>')} \"final\" {m('<|message|>')} reply {m('<|return|>')}"
    return Constraint("grammar", grammar(answer, [f"reply: {body}"], tokenizer), c.field,
                      ((c.field, c.spec),) if c.kind == "json" else ())
