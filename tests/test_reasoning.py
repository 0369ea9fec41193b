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
    for parser, want in (("deepseek_r1", r1), ("deepseek_v3", r1), ("qwen3", qwen3), ("glm45", qwen3)):
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


@pytest.mark.parametrize("text, r1, qwen3", CASES)
def test_an_answer_to_a_prompt_that_closed_its_thinking_is_all_content(text, r1, qwen3):
    """A chat template that switches thinking off closes it in the prompt (`<think></think>`: Qwen3's, GLM-4.5's;
    `</think>`: DeepSeek-V3.1's): whatever the parser, the answer is all content, whole and streamed; the
    prompt's </think> among its last 8 tokens, after its last <think>, says so (an earlier turn's kept thinking,
    further back, does not)."""
    from serve.reasoning import prompt_closed

    class Tok:
        def token_id(self, text):
            return {"<think>": 7, "</think>": 8}.get(text)

    assert prompt_closed(Tok(), [1, 7, 8, 3]) and prompt_closed(Tok(), [1, 8])
    assert not prompt_closed(Tok(), [1, 2]) and not prompt_closed(Tok(), [8, 1, 7]) and not prompt_closed(Tok(), [1, 7])
    assert not prompt_closed(Tok(), [1, 7, 2, 8] + [3] * 8)  # (an earlier turn's: answered, then another turn)
    for parser in ("deepseek_r1", "deepseek_v3", "qwen3", "glm45"):
        assert split(text, parser, closed=True) == (None, text or None)
        stream = ReasoningStream(parser, closed=True)
        parts = [text[i:i + 2] for i in range(0, len(text), 2)]
        got = [stream.feed(p, final=i == len(parts) - 1) for i, p in enumerate(parts)]
        assert "".join(r for r, _ in got) == "" and "".join(c for _, c in got) == text, parser


def test_the_responses_api_gives_the_thinking_as_a_reasoning_item_whole_and_streamed():
    """/v1/responses over a chat answer with reasoning_content: a reasoning item (its text a reasoning_text
    part) before the message, whole; streamed, its item opens first and its text comes as
    response.reasoning_text.delta events, the same text as the whole answer's."""
    import asyncio
    import json

    from serve import openai_responses

    body = {"model": "m", "input": "hi"}
    answer = {"model": "m", "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
              "choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": "yes",
                                                                "reasoning_content": "plan a"}}]}
    whole = openai_responses.reshape(answer, body)
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "plan a"}]
    assert whole["output"][1]["content"][0]["text"] == "yes"

    deltas = [{"reasoning_content": "plan"}, {"reasoning_content": " a"}, {"content": "ye"}, {"content": "s"}]
    chunks = [f"data: {json.dumps({'model': 'm', 'choices': [{'index': 0, 'delta': d, 'finish_reason': None}]})}\n\n"
              for d in deltas]
    chunks.append(f"data: {json.dumps({'model': 'm', 'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n")

    async def events():
        async def source():
            for c in chunks:
                yield c
        out = []
        async for text in openai_responses._events(source(), body):
            out.append(json.loads(text.split("data: ", 1)[1]))
        return out

    got = asyncio.run(events())
    kinds = [e["type"] for e in got]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert "".join(e["delta"] for e in got if e["type"] == "response.reasoning_text.delta") == "plan a"
    done = got[-1]["response"]
    assert done["status"] == "completed" and [i["type"] for i in done["output"]] == ["reasoning", "message"]
    assert done["output"] == [{**item, "id": d["id"]} for item, d in zip(whole["output"], done["output"])]
    added = [e["item"]["type"] for e in got if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    # a reasoning item given back in the input is taken (not part of the prompt); the reasoning field checked
    chat = openai_responses.chat_body({"model": "m", "reasoning": {"effort": "low"}, "input": [
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
        {"role": "user", "content": "hi"}]})
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
