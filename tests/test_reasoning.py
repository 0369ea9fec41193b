"""Reasoning content (serve.reasoning, --reasoning-parser): the thinking apart from the answer, whole and
streamed alike."""

import pytest

from serve.reasoning import ReasoningStream, split

CASES = [  # text, deepseek_r1's (reasoning, content), qwen3's
    ("<think>\nplan</think>\n\nanswer", ("\nplan", "\n\nanswer"), ("\nplan", "\n\nanswer")),
    ("  <think>a</think>b", ("a", "b"), ("a", "b")),
    ("plan</think>answer", ("plan", "answer"), (None, "plan</think>answer")),  # the template wrote <think>
    ("<think>cut off", ("cut off", None), ("cut off", None)),
    ("just an answer", ("just an answer", None), (None, "just an answer")),
    ("<think>x</think>", ("x", None), ("x", None)),
    ("<thin", ("<thin", None), (None, "<thin")),
    ("  ", ("  ", None), (None, "  ")),
]


@pytest.mark.parametrize("text, r1, qwen3", CASES)
def test_whole_and_streamed_answers_split_alike(text, r1, qwen3):
    for parser, want in (("deepseek_r1", r1), ("qwen3", qwen3)):
        assert split(text, parser) == want, parser
        for size in (1, 2, 3, 5, len(text)):  # every way of cutting it into deltas
            stream = ReasoningStream(parser)
            parts = [text[i:i + size] for i in range(0, len(text), size)]
            got = [stream.feed(p, final=i == len(parts) - 1) for i, p in enumerate(parts)]
            reasoning, content = "".join(r for r, _ in got), "".join(c for _, c in got)
            assert (reasoning or None, content or None) == (want[0] or None, want[1] or None), (parser, size)


def test_the_grammar_waits_for_the_end_of_the_thinking_unless_the_prompt_closed_it():
    from serve.reasoning import grammar_start

    class Tok:
        ids = {"<think>": 7, "</think>": 8}

        def token_id(self, text):
            return self.ids.get(text)

    tok = Tok()
    assert grammar_start(tok, [1, 2, 3]) == 8  # thinking ahead: the grammar after </think>
    assert grammar_start(tok, [1, 7, 3]) == 8  # the template opened it
    assert grammar_start(tok, [1, 7, 8, 3]) is None  # the template closed it (thinking off): from the start
    assert grammar_start(tok, [8, 1, 7]) == 8  # an earlier turn's closed, this one open
    tok.ids = {}
    assert grammar_start(tok, [1, 2]) is None  # no </think> token: the grammar from the start
