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

from jaxcb.host.structured import ASCII_CLASSES, Constraint, lark_schema, marker, special

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|endoftext|>")  # a body's ends (the last three: the answer's)
HEADERS = ("<|start|>", "<|channel|>")  # what a message's header begins with (a body the model left open ends there)
MARKERS = (*HEADERS, "<|constrain|>", MESSAGE, *ENDS)
_BODY_END = re.compile("|".join(re.escape(m) for m in (*ENDS, *HEADERS)))
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_SPACE = re.compile(r"\s*")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
# The first header may open without <|start|> and a channel (the template wrote `<|start|>assistant`): with the
# recipient (`to=functions.x<|channel|>...`, as gpt-oss's own template writes past calls) or the role.
_FIRST = (*HEADERS, "to=", "assistant")
MAX_HEADER_CHARS = 512  # a header longer than this without <|message|> is no header: the answer is plain text


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes the harmony format (gpt-oss's): its channels and message markers."""
    return bool(template) and "<|channel|>" in template and MESSAGE in template


def _opens(head: str, openings) -> bool:
    """Whether `head` begins with one of `openings`, or may yet (it is the start of one)."""
    return any(head.startswith(m) or m.startswith(head) for m in openings)


class HarmonyStream:
    """feed(text delta, final) -> (reasoning, content, tool-call deltas): the deltas OpenAI's chat API
    streams, tool calls as tool_parse.CallStream gives them ({index, id, type, function: {name, arguments:
    ""}} first, then {index, function: {arguments}} pieces). `tools` (jaxcb.host.tool_calls.Tools): the
    request's (None: no tools, so no message is a call); a call to a function it does not list is left out,
    as is every call after the first when parallel_tool_calls is false; under tool_choice required or a
    named function the content is the calls' only. An answer that does not open with a header is plain
    text; text between messages is content. Text that may be the start of a marker is held back until it
    is known. Linear in the text however it is cut."""

    def __init__(self, tools=None):
        self.tools = tools
        self.buffer = ""
        self.in_header = True  # reading a header (else a body)
        self.route = "content"  # where the current body goes: "reasoning", "content", "call" or "drop"
        self.plain = False  # no harmony header at all: every word is content
        self.opened = False  # some message's header has been read
        self.calls = 0
        self.started = False  # the current call's arguments have begun (their leading spaces dropped)

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        buf = self.buffer + text
        at = 0  # what of buf has been read
        reasoning, content, deltas = [], [], []
        while at < len(buf):
            if self.plain:
                content.append(buf[at:])
                at = len(buf)
            elif self.in_header:
                first = _SPACE.match(buf, at).end()  # (a header's leading whitespace)
                head = buf[first:first + MAX_HEADER_CHARS + len(MESSAGE)]
                if not head:
                    if final:
                        at = len(buf)
                    break
                if not _opens(head, HEADERS if self.opened else _FIRST):
                    if not self.opened:  # the answer is no harmony: plain text from here on
                        self.plain = True
                        continue
                    # text between messages: content, up to the next marker
                    m = _BODY_END.search(buf, at)
                    stop = len(buf) if m is None else m.start()
                    if m is None and not final:
                        stop -= _partial_marker(buf[at:])
                    self.route = "content"
                    self._body(buf[at:stop], reasoning, content, deltas)
                    at = stop
                    if m is not None and m.group() in ENDS:
                        at += len(m.group())
                    if m is None:
                        break
                    continue
                end = buf.find(MESSAGE, first, first + len(head))
                if end < 0:
                    if len(head) > MAX_HEADER_CHARS:  # no header after all: plain text, or stray text shown
                        self.plain = not self.opened
                        if self.opened:
                            self.route = "content"
                            self._body(buf[at:first + MAX_HEADER_CHARS], reasoning, content, deltas)
                            at = first + MAX_HEADER_CHARS
                        continue
                    if final:  # an unfinished header at the end: nothing of it is shown, unless it is none
                        self.plain = not self.opened and not any(m in head for m in (*HEADERS, "to="))
                        if self.plain:
                            continue
                        at = len(buf)
                    break
                self._open(buf[first:end], deltas)
                at, self.in_header, self.opened = end + len(MESSAGE), False, True
            else:
                m = _BODY_END.search(buf, at)
                if m is None:
                    keep = 0 if final else _partial_marker(buf[max(at, len(buf) - 16):])
                    self._body(buf[at:len(buf) - keep], reasoning, content, deltas)
                    at = len(buf) - keep
                    break
                self._body(buf[at:m.start()], reasoning, content, deltas)
                at, self.in_header = (m.end() if m.group() in ENDS else m.start()), True
        self.buffer = buf[at:]
        if self.tools is not None and self.tools.choice in ("required", "function"):
            content = []  # (the grammar's calls only)
        return "".join(reasoning), "".join(content), deltas

    def _open(self, header: str, deltas: list[dict]) -> None:
        """A message's header read: route its body, and a call's head delta. The channel is the header's last
        (gpt-oss may write a stray `<|channel|>commentary to=assistant` first); a recipient of `assistant` is
        none."""
        recipient = next((r for r in _RECIPIENT.findall(header) if r != "assistant"), None)
        channels = _CHANNEL.findall(header)
        self.started = False
        if recipient is None:
            self.route = "reasoning" if channels and channels[-1] == "analysis" else "content"
            return
        name = recipient[len("functions."):] if recipient.startswith("functions.") else None
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


def _partial_marker(text: str) -> int:
    """The length of the longest end of `text` that begins one of the markers."""
    for n in range(min(len(text), max(len(m) for m in MARKERS) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
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
        if not isinstance(schema, (dict, bool)) or schema is False:
            return c  # (refused by its own check, naming its field)
        body = f"%json {json.dumps(lark_schema(schema))}"
    elif c.kind == "regex":
        body = f"/{llguidance.regex_to_lark(c.spec, ASCII_CLASSES)}/"
    elif c.kind == "choice":
        body = "(" + " | ".join(json.dumps(x) for x in json.loads(c.spec)) + ")"
    else:
        return c
    answer = f"{m('<|channel|>')} \"final\" {m('<|message|>')} reply {m('<|return|>')}"
    return Constraint("grammar", grammar(answer, [f"reply: {body}"], tokenizer), c.field,
                      ((c.field, c.spec),) if c.kind == "json" else ())
