"""Reasoning content (vLLM's --reasoning-parser): a model that thinks before it answers (DeepSeek-R1 and its
distills, QwQ, Qwen3) writes `<think>...</think>` and then its answer. With a parser, a chat answer carries
the thinking as `reasoning` (and `reasoning_content`, its older name) and the rest as `content`, whole
or streamed; tool calls are read from the content only. A structured output (a JSON schema, a regex,
...) holds from the end of the thinking on: the model thinks freely, then answers under the grammar.

- `deepseek_r1`: the text is thinking up to `</think>` (a leading `<think>` dropped: the chat template may
  have written it); no `</think>` by the end (cut off) is thinking only.
- `qwen3`: the same when the text starts with `<think>` (as Qwen3 writes it when thinking); otherwise
  (thinking switched off, `enable_thinking: false`) it is all answer. `glm45` (GLM-4.5's, vLLM's name) reads so.
- `deepseek_v3` (vLLM's name for DeepSeek-V3.1's): as `deepseek_r1`.
- `openai_gptoss`: OpenAI's harmony format (gpt-oss), its `analysis` messages the reasoning
  (jaxcb.host.harmony; taken without the flag too where the chat template writes harmony).

Whatever the parser, an answer to a prompt that already closed its thinking (`prompt_closed`: a template that
switches thinking off writes `<think></think>` or `</think>` itself, as Qwen3's, GLM-4.5's and DeepSeek-V3.1's do)
is all answer: a model switched off thinks nothing.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
HARMONY = "openai_gptoss"  # (vLLM's name)
PARSERS = ("deepseek_r1", "deepseek_v3", "qwen3", "glm45", HARMONY)
OPENED_ONLY = ("qwen3", "glm45")  # thinking only where the answer opens it with <think>


def split(text: str, parser: str, closed: bool = False) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; None for a part it does not have. `closed`: the prompt closed the
    thinking (prompt_closed): all answer."""
    if closed:
        return None, text or None
    body = text.lstrip()
    opened = body.startswith(START)
    if parser in OPENED_ONLY and not opened:
        return None, text
    if opened:
        text = body[len(START):]
    reasoning, ended, content = text.partition(END)
    if not ended:
        return reasoning or None, None
    return reasoning, content or None


class ReasoningStream:
    """The same split of a streamed answer: feed() takes each text delta and returns (reasoning, content)
    deltas. Text that may be the start of a tag is held back until it is known."""

    def __init__(self, parser: str, closed: bool = False):
        self.parser = parser
        self.buffer = ""
        self.state = "answer" if closed else "start"  # "start": before the first non-space text; "thinking"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        if self.state == "start":
            body = self.buffer.lstrip()
            if not final and (not body or START.startswith(body)):
                return "", ""  # only whitespace, or a prefix of <think>, so far
            if body.startswith(START):
                self.buffer, self.state = body[len(START):], "thinking"
            elif self.parser in OPENED_ONLY:
                self.state = "answer"
            else:
                self.state = "thinking"
        if self.state == "thinking":
            at = self.buffer.find(END)
            if at < 0:
                keep = 0 if final else _partial_suffix(self.buffer, END)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer, self.state = self.buffer[:at], self.buffer[at + len(END):], "answer"
        content, self.buffer = self.buffer, ""
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# How near its end a prompt closes the thinking for that to be the answer's (the generation prompt's own
# `<think></think>` or `</think>`; an earlier turn's kept thinking ends before that turn's answer and what follows)
CLOSED_WITHIN = 8


def prompt_closed(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether a chat prompt already closed its thinking: a `</think>` (where the vocabulary spells it as one token)
    among its last CLOSED_WITHIN tokens, after its last `<think>` (a template that switches thinking off writes
    `<think></think>`, or `</think>`, at the end of the generation prompt)."""
    end, start = tokenizer.token_id(END), tokenizer.token_id(START)
    if end is None:
        return False
    last_end = max((i for i, t in enumerate(prompt_ids) if t == end), default=-1)
    last_start = max((i for i, t in enumerate(prompt_ids) if t == start), default=-1) if start is not None else -1
    return last_end > last_start and last_end >= len(prompt_ids) - CLOSED_WITHIN


def thinking_tags(tokenizer, parser: str | None) -> tuple[int, int] | None:
    """The (<think>, </think>) token ids a thinking_token_budget counts by under `parser` (None: no parser, the
    harmony format's, or a vocabulary that does not spell both as one token)."""
    if parser is None or parser == HARMONY or tokenizer is None:
        return None
    start, end = tokenizer.token_id(START), tokenizer.token_id(END)
    return None if start is None or end is None else (start, end)


def grammar_start(tokenizer, prompt_ids: list[int]) -> int | None:
    """The token a chat answer's grammar waits for under a reasoning parser (structured outputs hold after
    the thinking, as vLLM's do): `</think>` when the model spells it as one token and the prompt has not
    already closed its thinking (prompt_closed); None: the grammar holds from the first token."""
    end = tokenizer.token_id(END)
    return None if end is None or prompt_closed(tokenizer, prompt_ids) else end
