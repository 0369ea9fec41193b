"""An OpenAI answer: the requests of one completions or chat call run on the engine, their events shaped
into OpenAI's JSON (one body, or server-sent chunks ending in `data: [DONE]`), logprobs and tool calls
included. serve.openai_api parses the call and checks it; this module only runs and answers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from jaxcb.host import harmony as harmony_format
from jaxcb.host import tool_parse
from jaxcb.host.embedding import encoded
from jaxcb.host.errors import InvalidRequest, JaxcbError
from jaxcb.host.request import FinishReason, TokenEvent
from serve import reasoning
from serve.openai_fields import ERROR_TYPE, HTTPError, RequestOptions, http_error


# The logprobs one answer may hold (each token's and its alternatives', every sample's; about 60 bytes each as
# JSON): prompt_logprobs or echo with logprobs on n samples of many long prompts would otherwise ask for a body of
# gigabytes, built before the first byte goes out.
MAX_ANSWER_LOGPROBS = 1 << 20


def check_logprob_entries(prompts: list[list[int]], params_of) -> None:
    """Refuses (InvalidRequest naming the field that asks for most of them) an answer that would hold more
    than MAX_ANSWER_LOGPROBS logprobs: each sample's prompt tokens with theirs (prompt_logprobs, or echo with
    logprobs) and its max_tokens with theirs (logprobs)."""
    prompt = output = 0
    for ids in prompts:
        p = params_of(ids)
        if p.prompt_logprobs is not None:
            prompt += p.n * len(ids) * (1 + p.prompt_logprobs)
        if p.logprobs:
            output += p.n * p.max_tokens * (1 + p.logprobs)
    if prompt + output > MAX_ANSWER_LOGPROBS:
        field = "prompt_logprobs" if prompt >= output else "logprobs"
        raise InvalidRequest(f"{field}: the answer would hold {prompt + output:,} logprobs ({prompt:,} for the prompts' "
                             f"tokens, {output:,} for the output's, over {len(prompts)} prompt(s) x n); the limit is "
                             f"{MAX_ANSWER_LOGPROBS:,}: fewer prompts, samples or alternatives")


async def answer(state, request: Request, options: RequestOptions, tenant: str, prompts: list[list[int]], params, *,
                 chat: bool, top_logprobs: int = 0, tools=None, echo: list[str] | None = None,
                 prompt_field: bool = False, include_reasoning: bool = True, room_capped: bool = False,
                 harmony: bool = False, thinking_closed: bool = False):
    """Run the prompts (each params.n samples) and answer as OpenAI does: server-sent chunks with
    `stream`, else one JSON body once all are done; a client that hangs up has its requests aborted.
    `echo`: each prompt's text, which its choices' texts start with (completions'; the chat's: its final assistant
    message's), and in completions with logprobs its tokens' logprobs those of the choice's (the first None). `prompt_field`: vLLM's `prompt_logprobs` list,
    in each completions choice, in a chat answer beside its choices (its one prompt's), as vLLM places it.
    `include_reasoning` (vLLM's; with the server's reasoning parser): false leaves the thinking out.
    `room_capped`: max_tokens (a default the request did not set) is cut, per prompt, to the room its context leaves.
    `harmony` (chat): the answers are in OpenAI's harmony format (gpt-oss): their reasoning, content and tool calls
    read from its messages (jaxcb.host.harmony), whatever the reasoning parser. `thinking_closed` (chat): the prompt
    closed the thinking (serve.reasoning.prompt_closed): the answers are all content."""
    def prompt_text() -> str:
        """vLLM's return_prompt_text (chat): the prompt as the chat template wrote it, its special tokens' text too."""
        return state.tokenizer.decode(prompts[0], skip_special=False)

    def params_of(ids):
        room = max(1, state.engine.max_context - len(ids))
        return dataclasses.replace(params, max_tokens=min(params.max_tokens, room)) if room_capped else params

    for p in prompts:  # every prompt checked before any is submitted
        state.engine.validate(p, params_of(p))
    check_logprob_entries(prompts, params_of)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    reasoning_parser = state.options.reasoning_parser if chat and not harmony else None
    created = int(time.time())
    model_name = params.lora or state.model_name  # an adapter's answers carry its name
    events: asyncio.Queue = asyncio.Queue()
    n = params.n
    request_id = options.request_id

    # A streamed chunk holds this many tokens (vLLM's stream_interval, at least the server's): each sample's
    # events are joined until they do, but its first and its last go at once.
    interval = max(options.stream_interval, state.options.stream_interval) if options.stream else 1

    async def pump(i, ids):
        held: dict[int, TokenEvent] = {}  # per sample, the events joined for its next chunk
        sent: set[int] = set()
        try:
            async with contextlib.aclosing(state.stream(ids, params_of(ids), options.priority,
                                                        f"{request_id}/{i}" if request_id else "", tenant,
                                                        options.cache_salt)) as stream:
                async for _, ev in stream:
                    if interval > 1:
                        if ev.index in held:
                            ev = held.pop(ev.index).then(ev)
                        if ev.index in sent and not ev.finished and len(ev.token_ids) < interval:
                            held[ev.index] = ev
                            continue
                        sent.add(ev.index)
                    await events.put((i, ev))
        except JaxcbError as e:
            await events.put((i, http_error(e)))

    # The requests start only where something is there to stop them: inside the stream's generator
    # (a client gone before the first byte never starts one) or the try below.
    tasks: list[asyncio.Future] = []

    def start():
        tasks.extend(asyncio.ensure_future(pump(i, ids)) for i, ids in enumerate(prompts))

    left = len(prompts) * n
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached": 0}
    sample_usage: dict[int, dict] = {}  # each choice's tokens so far (stream_options.continuous_usage_stats)

    async def shape(i, ev):
        index = i * n + ev.index
        logprobs = _logprobs(state.tokenizer, ev, chat, top_logprobs, options.tokens_as_ids) if ev.logprobs else None
        prompt = None
        if ev.prompt_logprobs is not None:  # a sample's first event: a prompt's worth, shaped off the event loop
            echoed, prompt = await asyncio.to_thread(
                _prompt_parts, state.tokenizer, prompts[i], ev.prompt_logprobs,
                top_logprobs if echo is not None and not chat and params.logprobs > 0 else None,
                params.prompt_logprobs if prompt_field else None, options.tokens_as_ids)
            logprobs = _merge(echoed, logprobs, chat)
        finish = (ev.finish_reason.value if isinstance(ev.finish_reason, FinishReason) else ev.finish_reason)
        sample_usage[index] = {"prompt_tokens": ev.num_prompt_tokens, "completion_tokens": ev.num_output_tokens,
                               "total_tokens": ev.num_prompt_tokens + ev.num_output_tokens,
                               "prompt_tokens_details": {"cached_tokens": ev.num_cached_tokens}}
        if ev.finished:
            usage["completion_tokens"] += ev.num_output_tokens
            if ev.index == 0:
                usage["prompt_tokens"] += ev.num_prompt_tokens
                usage["cached"] += ev.num_cached_tokens
        return index, ev.text, logprobs, finish if ev.finished else None, prompt, ev.stop_reason, list(ev.token_ids)

    def usage_json():
        return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": usage["cached"]}}

    async def next_event():
        i, ev = await events.get()
        if isinstance(ev, HTTPError):
            raise ev
        return i, ev

    if options.stream:
        include_usage = options.include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"

        readers: dict = {}  # per choice, with tools or harmony: its tool_parse.CallStream or harmony.HarmonyStream
        thoughts: dict[int, reasoning.ReasoningStream] = {}  # per choice, with a reasoning parser

        async def sse():
            nonlocal left
            try:
                start()
                def before(k):  # a choice's usage before its first token (continuous_usage_stats)
                    p = len(prompts[k // n])
                    return {"usage": {"prompt_tokens": p, "completion_tokens": 0, "total_tokens": p}
                            } if options.continuous_usage else {}

                if chat:
                    for k in range(len(prompts) * n):
                        yield _sse({"id": rid, "object": obj, "created": created, "model": model_name,
                                    "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}], **before(k),
                                    **({"prompt_token_ids": prompts[k // n]} if options.return_token_ids else {}),
                                    **({"prompt_text": prompt_text()} if options.prompt_text and k == 0 else {})})
                # return_token_ids: each chunk's new token ids (those of events without a chunk of their own held
                # for the next), completions' prompt ids in each choice's first chunk
                pending: dict[int, list[int]] = {}
                unprompted = set(range(len(prompts) * n)) if options.return_token_ids and not chat else set()
                # completions: echo leads each choice's first chunk (with the prompt's logprobs, when asked, as
                # that chunk's first), and each chunk's text_offset goes on from the choice's text so far
                echo_due = set(range(len(prompts) * n)) if echo is not None else set()
                offsets: dict[int, int] = {}
                while left:
                    try:
                        i, ev = await next_event()
                    except HTTPError as e:  # mid-stream: an error event, then the end
                        yield _sse({"error": {"message": e.message, "type": ERROR_TYPE.get(e.status, "error"),
                                              "param": e.param, "code": e.code}})
                        break
                    left -= ev.finished
                    index, text, logprobs, finish, prompt, stop_reason, token_ids = await shape(i, ev)
                    pending.setdefault(index, []).extend(token_ids)
                    if index in echo_due:
                        echo_due.discard(index)
                        text = echo[index // n] + text
                    if logprobs and not chat:
                        logprobs = _with_offsets(logprobs, offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
                    thought = ""
                    if reasoning_parser is not None:  # the thinking first (serve.reasoning), the answer after
                        thinking = thoughts.setdefault(index, reasoning.ReasoningStream(reasoning_parser,
                                                                                         thinking_closed))
                        thought, text = thinking.feed(text, final=bool(finish))
                    delta = {"content": text} if text else {}
                    if harmony or tools is not None:  # text in; content (and harmony's reasoning), call deltas out
                        if index not in readers:
                            readers[index] = harmony_format.HarmonyStream(tools) if harmony else tool_parse.CallStream(tools)
                        reader = readers[index]
                        if harmony:
                            thought, content, pieces = reader.feed(text, final=bool(finish))
                        else:
                            content, pieces = reader.feed(text, final=bool(finish))
                        delta = {"content": content} if content else {}
                        if pieces:
                            delta["tool_calls"] = pieces
                        finish = _call_finish(finish, reader.calls, tools)
                    if thought and include_reasoning:
                        delta.update(reasoning=thought, reasoning_content=thought)
                    if not (delta or finish or logprobs or prompt):
                        continue
                    choice = {"index": index, "logprobs": logprobs, "finish_reason": finish}
                    if finish:
                        choice["stop_reason"] = stop_reason
                    if prompt is not None and not chat:
                        choice["prompt_logprobs"] = prompt
                    choice.update({"delta": delta} if chat else {"text": text})
                    if options.return_token_ids:
                        if index in unprompted:
                            unprompted.discard(index)
                            choice["prompt_token_ids"] = prompts[index // n]
                        choice["token_ids"] = pending.pop(index, [])
                    chunk = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice],
                             **({"prompt_logprobs": prompt} if prompt and chat else {}),
                             **({"usage": sample_usage[index]} if options.continuous_usage else {})}
                    if ev.prompt_logprobs is not None:  # a prompt's worth of logprobs: written off the event loop
                        yield await asyncio.to_thread(_sse, chunk)
                    else:
                        yield _sse(chunk)
                if include_usage and not left:
                    yield _sse({"id": rid, "object": obj, "created": created, "model": model_name,
                                "choices": [], "usage": usage_json()})
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or we are done): what still runs is aborted
                for t in tasks:
                    t.cancel()

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    texts = [echo[k // n] if echo is not None else "" for k in range(len(prompts) * n)]
    logs: list = [None] * len(texts)
    finishes = [None] * len(texts)
    prompt_lists: list = [None] * len(texts)
    stop_reasons: list = [None] * len(texts)
    token_lists: list[list[int]] = [[] for _ in texts]

    async def collect():
        nonlocal left
        while left:
            i, ev = await next_event()
            left -= ev.finished
            index, text, logprobs, finish, prompt, stop_reason, token_ids = await shape(i, ev)
            texts[index] += text
            token_lists[index] += token_ids
            stop_reasons[index] = stop_reason
            if logprobs:
                logs[index] = _merge(logs[index], logprobs, chat)
            if prompt is not None:
                prompt_lists[index] = prompt
            if finish:
                finishes[index] = finish

    try:  # a client that hangs up while we work: abort, the moment the server hears of it
        start()
        gone = await until_gone(request, collect())
        if gone is not None:
            return gone
    finally:
        for t in tasks:
            t.cancel()
    def token_ids(choices: list[dict]) -> dict:
        """return_token_ids: each choice's token ids, and the prompt's (completions': in each choice; the chat's
        one prompt: beside the choices, as vLLM places them)."""
        shown = {"prompt_text": prompt_text()} if options.prompt_text else {}
        if not options.return_token_ids:
            return shown
        for k, choice in enumerate(choices):
            if not chat:
                choice["prompt_token_ids"] = prompts[k // n]
            choice["token_ids"] = token_lists[k]
        return {"prompt_token_ids": prompts[0], **shown} if chat else shown

    if chat and harmony:
        choices = [_harmony_choice(k, texts[k], tools, logs[k], finishes[k], stop_reasons[k], include_reasoning)
                   for k in range(len(texts))]
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage_json(), **token_ids(choices),
                **({"prompt_logprobs": prompt_lists[0]} if prompt_field else {})}
    if chat:
        choices = [{"index": k, "message": {"role": "assistant", "content": texts[k]}, "logprobs": logs[k],
                    "finish_reason": finishes[k], "stop_reason": stop_reasons[k]} for k in range(len(texts))]
        for choice in choices if reasoning_parser is not None else ():  # the thinking apart (serve.reasoning)
            thought, content = reasoning.split(choice["message"]["content"], reasoning_parser, thinking_closed)
            choice["message"]["content"] = content
            if include_reasoning:
                choice["message"].update(reasoning=thought, reasoning_content=thought)
        for choice in choices if tools is not None else ():  # the calls the answers make
            content, calls = tool_parse.parse(choice["message"]["content"] or "", tools)
            if calls:
                choice["message"].update(content=content or None, tool_calls=calls)
                choice["finish_reason"] = _call_finish(choice["finish_reason"], len(calls), tools)
            elif tools.choice in ("required", "function"):  # no call came whole (cut off): no content either,
                choice["message"]["content"] = content or None  # as streamed (tool_parse.CallStream)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage_json(), **token_ids(choices),
                **({"prompt_logprobs": prompt_lists[0]} if prompt_field else {})}
    choices = [{"index": k, "text": texts[k], "logprobs": _with_offsets(logs[k]), "finish_reason": finishes[k],
                "stop_reason": stop_reasons[k]} for k in range(len(texts))]
    token_ids(choices)
    if prompt_field:
        for k, choice in enumerate(choices):
            choice["prompt_logprobs"] = prompt_lists[k]
    return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
            "choices": choices, "usage": usage_json()}


def best_choices(answer: dict, best_of: int, n: int, logprobs: bool) -> dict:
    """A completions answer of `best_of` samples a prompt cut to the `n` most likely of each prompt's (the sums of
    their tokens' logprobs; the prompt's, when echoed, the same for all), in that order, their logprobs kept only
    where the request asked for them; the usage stays all the samples'."""
    choices = []
    for p in range(0, len(answer["choices"]), best_of):
        group = answer["choices"][p:p + best_of]
        group.sort(key=lambda c: -sum(lp for lp in c["logprobs"]["token_logprobs"] if lp is not None))
        for rank, choice in enumerate(group[:n]):
            choices.append({**choice, "index": p // best_of * n + rank, **({} if logprobs else {"logprobs": None})})
    return {**answer, "choices": choices}


async def until_gone(request: Request, work):
    """Await `work` (a coroutine) unless the client hangs up first: then it is cancelled (its requests aborted)
    and the answer is a 499."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":  # the body was read: only this comes
            pass

    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(watch())
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            return Response(status_code=499)
        return task.result()
    finally:
        task.cancel()
        gone.cancel()


def embeddings_body(results: list, encoding_format: str, model_name: str) -> dict:
    """OpenAI's embeddings answer: each input's vector (State.pool's (vector, prompt tokens)) in order."""
    tokens = sum(n for _, n in results)
    return {"id": "embd-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()), "model": model_name,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v, encoding_format)}
                     for i, (v, _) in enumerate(results)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _call_finish(finish, calls: int, tools):
    """A choice's finish_reason once its answer made `calls` calls: "tool_calls" for a stop, but for a named
    function's call (OpenAI's, vLLM's: "stop")."""
    return "tool_calls" if finish == "stop" and calls and tools.choice != "function" else finish


def _harmony_choice(index: int, text: str, tools, logprobs, finish, stop_reason, include_reasoning: bool) -> dict:
    """A whole chat choice from a harmony answer (jaxcb.host.harmony): its reasoning, content and calls."""
    thought, content, calls = harmony_format.parse(text, tools)
    message = {"role": "assistant", "content": content}
    if include_reasoning:
        message.update(reasoning=thought, reasoning_content=thought)
    if calls:
        message["tool_calls"] = calls
        finish = _call_finish(finish, len(calls), tools)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_JSON = dict(ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))  # as Starlette writes it
_SLICE = 256  # list items a piece


def _pieces(obj, depth: int = 0):
    """`obj` as JSON text in pieces (the C encoder holds the GIL for a whole call: 200 ms for 4 x 2,047 x 21
    prompt-logprob entries in one): a long list a slice of items at a time, and the answer's outer levels
    (the choices, their logprobs) item by item; anything else, and anything deeper, in one call."""
    if isinstance(obj, list) and len(obj) > _SLICE:
        yield "["
        for i in range(0, len(obj), _SLICE):
            yield ("," if i else "") + json.dumps(obj[i:i + _SLICE], **_JSON)[1:-1]
        yield "]"
    elif isinstance(obj, list) and depth < 4 and any(isinstance(v, (list, dict)) for v in obj):
        yield "["
        for j, value in enumerate(obj):
            if j:
                yield ","
            yield from _pieces(value, depth + 1)
        yield "]"
    elif isinstance(obj, dict) and depth < 4 and any(isinstance(v, (list, dict)) for v in obj.values()):
        yield "{"
        for j, (key, value) in enumerate(obj.items()):
            yield ("," if j else "") + json.dumps(str(key), **_JSON) + ":"
            yield from _pieces(value, depth + 1)
        yield "}"
    else:
        yield json.dumps(obj, **_JSON)


def _dumps(body) -> bytes:
    """JSON as Starlette's JSONResponse writes it, encoded in pieces (_pieces)."""
    return "".join(_pieces(body)).encode()


async def json_response(answer):
    """An answer's JSON body written off the event loop, in pieces that let the loop run between them (a
    prompt's logprobs for n samples are megabytes: FastAPI's own encoding of 4 x 2,047 x 21 entries held the
    loop for 1.5 s, every other stream with it); a stream or another response as it is."""
    if isinstance(answer, Response):
        return answer
    return Response(await asyncio.to_thread(_dumps, answer), media_type="application/json")


def _token_text(tokenizer, token: int, as_id: bool = False) -> str:
    """A token as logprobs name it: its text, or with vLLM's return_tokens_as_token_ids "token_id:N" (a
    token that is a piece of a character, or not JSON-encodable, is then still told apart)."""
    if as_id:
        return f"token_id:{token}"
    return tokenizer.decode([token], skip_special=False) if tokenizer is not None else str(token)


def _token_bytes(tokenizer, token: int) -> list[int]:
    """The token's own bytes (a piece of a character is its piece, not U+FFFD's three bytes)."""
    return list(tokenizer.token_bytes(token) if tokenizer is not None else str(token).encode())


def _logprobs(tokenizer, ev, chat: bool, top: int, as_ids: bool = False):
    """One event's logprobs in OpenAI's shape: chat `{content: [...]}`, completions the four lists; `as_ids`:
    each token named "token_id:N" (its bytes still its own)."""
    if chat:
        content = []
        for token, (lp, alts) in zip(ev.token_ids, ev.logprobs):
            text = _token_text(tokenizer, token, as_ids)
            content.append({"token": text, "logprob": lp, "bytes": _token_bytes(tokenizer, token),
                            "top_logprobs": [{"token": _token_text(tokenizer, t, as_ids), "logprob": l,
                                              "bytes": _token_bytes(tokenizer, t)}
                                             for t, l in alts[:top]]})
        return {"content": content}
    tokens, token_logprobs, tops = [], [], []
    for token, (lp, alts) in zip(ev.token_ids, ev.logprobs):
        tokens.append(_token_text(tokenizer, token, as_ids))
        token_logprobs.append(lp)
        tops.append(_top(tokens[-1], lp, ((_token_text(tokenizer, t, as_ids), l) for t, l in alts[:top])))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": []}


def _top(token: str, logprob: float, alternatives) -> dict:
    """Completions' top_logprobs of a token: its alternatives and always the token itself (as OpenAI's legacy
    API and vLLM give it: up to N + 1 entries)."""
    top = dict(alternatives)
    top.setdefault(token, logprob)
    return top


def _prompt_parts(tokenizer, prompt: list[int], entries, echo: int | None, n: int | None, as_ids: bool = False):
    """A prompt's logprobs (a sample's first event's `prompt_logprobs`) as the answer shows them: with
    `echo` (not None), completions' four lists with `echo` alternatives a token, the first token without a
    logprob (nothing comes before it; `as_ids`: tokens named "token_id:N"); with `n` (not None), vLLM's
    prompt_logprobs: None for the first token, then {token id: {logprob, rank, decoded_token}} of each token
    and its n best alternatives. Each token's text is decoded once."""
    text = functools.lru_cache(maxsize=None)(lambda t: _token_text(tokenizer, t))
    echoed = None
    if echo is not None:
        named = functools.partial(_token_text, tokenizer, as_id=True) if as_ids else text
        echoed = {"tokens": [named(t) for t in prompt], "token_logprobs": [None] + [lp for lp, _, _ in entries],
                  "top_logprobs": [None] + [_top(named(token), lp, ((named(t), l) for t, l in top[:echo]))
                                            for token, (lp, _, top) in zip(prompt[1:], entries)],
                  "text_offset": []}
    listed = None
    if n is not None:
        listed = [None]
        for token, (lp, rank, top) in zip(prompt[1:], entries):
            d = {str(t): {"logprob": l, "rank": k, "decoded_token": text(t)} for k, (t, l) in enumerate(top[:n], start=1)}
            d[str(token)] = {"logprob": lp, "rank": rank, "decoded_token": text(token)}
            listed.append(d)
    return echoed, listed


def _with_offsets(logprobs, at: int = 0):
    """Completions' logprobs with each token's character offset in the choice's text (the first at `at`)."""
    if logprobs is None:
        return None
    offsets = []
    for token in logprobs["tokens"]:
        offsets.append(at)
        at += len(token)
    return {**logprobs, "text_offset": offsets}


def _merge(old, new, chat: bool):
    if old is None or new is None:
        return new if old is None else old
    if chat:
        return {"content": old["content"] + new["content"]}
    return {k: old[k] + new[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
