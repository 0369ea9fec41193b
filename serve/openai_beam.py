"""vLLM's `use_beam_search` over the OpenAI API: completions and chat answered by beam search
(jaxcb.host.beam_search), `n` beams, best first, with vLLM's `length_penalty`. Each round of the search is
one-token requests for every live beam through the same admission, tenancy and prefix cache as any
request; a client that hangs up has its round aborted. Not streamed (as in vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from fastapi import Request

from jaxcb.host.beam_search import BeamSearch
from jaxcb.host.errors import JaxcbError
from jaxcb.host.request import SamplingParams
from serve.openai_answer import until_gone
from serve.openai_fields import RequestOptions, bad_request, http_error


def check_beam_request(params: SamplingParams, options: RequestOptions, *, logprobs: bool, echo: bool = False) -> None:
    """What beam search does not combine with, refused naming the field (before any work)."""
    for field, given in (("stream", options.stream), ("logprobs", logprobs), ("echo", echo),
                         ("return_token_ids", options.return_token_ids),
                         ("stop", bool(params.stop)), ("min_tokens", params.min_tokens > 0),
                         ("structured_outputs", params.structured is not None),
                         ("prompt_logprobs", params.prompt_logprobs is not None),
                         ("bad_words", bool(params.bad_words)),
                         ("repetition_detection", params.repetition_detection is not None),
                         ("thinking_token_budget", params.thinking_token_budget is not None),
                         ("return_prompt_text", options.prompt_text)):
        if given:
            raise bad_request(f"{field}: not supported with use_beam_search")


async def beam_answer(state, request: Request, options: RequestOptions, tenant: str, prompts: list[list[int]],
                      params: SamplingParams, length_penalty: float, *, chat: bool):
    """The answer to a completions (or chat) call with use_beam_search: for each prompt, params.n choices."""
    engine = state.engine
    eos = engine.engines[0].eos_ids
    searches = [BeamSearch(p, params.n, params.max_tokens, eos, ignore_eos=params.ignore_eos,
                           stop_token_ids=params.stop_token_ids, length_penalty=length_penalty,
                           include_stop=params.include_stop_str_in_output, max_context=engine.max_context)
                for p in prompts]
    step = searches[0].round_params(params.lora)
    for s in searches:  # every prompt checked before anything is submitted
        engine.validate(s.prompt, s.checked_as(params.lora))

    async def score(ids: list[int]) -> list:
        async with contextlib.aclosing(state.stream(ids, step, options.priority, "", tenant, options.cache_salt)) as st:
            async for _, ev in st:
                if ev.finished:
                    return list(ev.logprobs[0][1])
        raise RuntimeError("a beam's request ended without its token")

    async def search():
        while not all(s.done for s in searches):
            live = [s for s in searches if not s.done]
            tops = iter(await asyncio.gather(*(score(p) for s in live for p in s.prompts())))
            for s in live:
                s.advance([next(tops) for _ in s.live])

    try:  # a client that hangs up: the round in flight is aborted
        gone = await until_gone(request, search())
    except JaxcbError as e:
        raise http_error(e) from None
    if gone is not None:
        return gone
    return await asyncio.to_thread(_shape, state, searches, params, chat)


def _shape(state, searches: list[BeamSearch], params: SamplingParams, chat: bool) -> dict:
    choices, completion_tokens, prompt_tokens = [], 0, 0
    for i, s in enumerate(searches):
        prompt_tokens += len(s.prompt)
        for k, beam in enumerate(s.best()):
            text = state.tokenizer.decode(s.shown(beam))
            completion_tokens += len(beam.tokens)
            choice = {"index": i * params.n + k, "logprobs": None, "finish_reason": beam.finish_reason,
                      "stop_reason": beam.stop_token}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            choices.append(choice)
    return {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": params.lora or state.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
