"""The OpenAI-compatible HTTP API, beside gRPC: same process, same engine, same admission and limits.

    GET  /v1/models              the one model served
    POST /v1/completions         prompt: text, list of texts, token ids or lists of them
    POST /v1/chat/completions    messages through the model's chat template
    GET  /health                 200 once warm (no auth), else 503
    GET  /metrics                the server's Prometheus registry

`stream: true` sends server-sent events ending in `data: [DONE]` (with `stream_options.include_usage`
a last chunk carries the usage). jaxcb's extras ride in the body as vLLM's do: top_k, min_p,
repetition_penalty, ignore_eos, priority, cache_salt, request_id. Bad input is 400 in OpenAI's error
shape naming the field (the validation is the gRPC one: SamplingParams, the engine's limits and the
server's size checks), a missing token 401, an unknown model 404, a full queue 429, a draining or
warming server 503. A client that disconnects has its request aborted (its pages are freed at the
next step), streaming or not.

The app runs under uvicorn on the gRPC server's event loop (serve.server.run_server starts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from jaxcb.request import FinishReason, SamplingParams
from serve import frontend

_STATUS = {"invalid": 400, "exhausted": 429, "unavailable": 503, "unauthenticated": 401, "internal": 500}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
         429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}
_EXTRAS = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "priority", "cache_salt", "request_id"}
_COMMON = {"model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "presence_penalty",
           "frequency_penalty", "seed", "stop", "user", "logit_bias"}
_COMPLETION_FIELDS = _COMMON | _EXTRAS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
_CHAT_FIELDS = _COMMON | _EXTRAS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                                    "response_format", "tools", "tool_choice", "parallel_tool_calls"}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": _TYPE.get(self.status, "error"), "param": self.param,
            "code": self.code}})


def _bad(message: str) -> HTTPError:
    """A ValueError's message ("field: what is wrong") as a 400 naming that field."""
    field = message.split(":", 1)[0] if ":" in message else None
    return HTTPError(400, message, param=field if field and " " not in field else None)


def _from_rejected(e: frontend.Rejected) -> HTTPError:
    return HTTPError(_STATUS.get(e.kind, 500), e.message)


def _int(body: dict, name: str, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"{name}: must be an integer, got {v!r}")
    return v


def _number(body: dict, name: str, default):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(f"{name}: must be a number, got {v!r}")
    return float(v)


def _sampling(body: dict, *, max_tokens: int, logprobs: int) -> SamplingParams:
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise _bad("stop: must be a string or a list of strings")
    if isinstance(stop, list) and len(stop) > frontend.MAX_STOP_STRINGS:
        raise _bad(f"stop: at most {frontend.MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if isinstance(stop, list) and not all(isinstance(x, str) for x in stop):
        raise _bad("stop: must be a string or a list of strings")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad(f"ignore_eos: must be true or false, got {ignore_eos!r}")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
            top_k=_int(body, "top_k", 0), min_p=_number(body, "min_p", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0), seed=_int(body, "seed"),
            stop=stop or (), ignore_eos=ignore_eos, logprobs=logprobs, n=_int(body, "n", 1))
    except ValueError as e:
        raise _bad(str(e)) from None


MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


def _parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, an integer past Python's digit limit
        raise HTTPError(400, f"body: not valid JSON ({e})", param="body") from None
    except RecursionError:
        raise HTTPError(400, "body: JSON nested too deeply", param="body") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "body: must be a JSON object", param="body")
    return body


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"{name}: must be true or false, got {v!r}")
    return v


def _str(body: dict, name: str, default: str) -> str:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise _bad(f"{name}: must be a string, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class _Options:
    """The request's fields that are not sampling settings, checked before any work."""

    stream: bool
    include_usage: bool
    priority: int
    cache_salt: str
    request_id: str


def _common(body: dict) -> _Options:
    """Checks every field both endpoints share that SamplingParams does not (types and ranges)."""
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise _bad(f"stream_options: must be an object, got {stream_options!r}")
    stream_options = stream_options or {}
    unknown = sorted(set(stream_options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise _unknown_field("stream_options", unknown[0])
    include_usage = _bool(stream_options, "include_usage", False)
    if stream_options and not stream:
        raise _bad("stream_options: only with stream: true")
    priority = _int(body, "priority", 0)
    salt, request_id = _str(body, "cache_salt", ""), _str(body, "request_id", "")
    _str(body, "user", "")
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise _bad(f"logit_bias: must be an object, got {bias!r}")
    if bias:  # refused rather than ignored: a token the caller banned must not come out
        raise _bad("logit_bias: not supported")
    try:
        frontend.check_priority(priority)
        frontend.check_ids(request_id, salt)
    except ValueError as e:
        raise _bad(str(e)) from None
    return _Options(stream, include_usage, priority, salt, request_id)


def _is_ids(p) -> bool:
    return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def _prompt_list(prompt) -> list:
    """`prompt` as a list of prompts (each a string or a list of token ids), shapes checked."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise _bad("prompt: must be a string, a list of strings, a list of token ids or a list of lists")
    if _is_ids(prompt):
        prompt = [prompt]
    if len(prompt) > frontend.MAX_PROMPTS:
        raise _bad(f"prompt: {len(prompt)} prompts; the limit is {frontend.MAX_PROMPTS}")
    if not all(isinstance(p, str) or _is_ids(p) for p in prompt):
        raise _bad("prompt: must be a string, a list of strings, a list of token ids or a list of lists")
    return prompt


def _prompt_count(prompt) -> int:
    return len(_prompt_list(prompt))


def _unknown_field(where: str, name: str) -> HTTPError:
    """An unknown field, named as the field when it is a plain name, else inside `where`'s message."""
    if re.fullmatch(r"[a-z_][a-z0-9_]*", name):
        return _bad(f"{where + '.' if where != 'body' else ''}{name}: not a field this endpoint takes")
    return _bad(f"{where}: {name[:64]!r} is not a field this endpoint takes")


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _unknown_field("body", unknown[0])


class _ConcurrencyLimit:
    """At most `limit` API calls (/v1/...) in progress at once, the number gRPC's maximum_concurrent_rpcs
    has (--max-concurrent-streams): the next is a 429 before its body is read. A call counts until the
    app has sent its last byte or the client has gone (pure ASGI: nothing here can outlive the call)."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.in_flight = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            response = HTTPError(429, f"too many requests in progress: the limit is {self.limit} "
                                      "(--max-concurrent-streams)").response()
            return await response(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def make_app(state) -> FastAPI:
    app = FastAPI(title="jaxcb", docs_url=None, redoc_url=None, openapi_url=None)

    def authorize(request: Request) -> str:
        """The caller's tenant (raises 401 when the server has tokens and this is none of them)."""
        given = request.headers.get("authorization", "")
        if state.options.tokens and frontend.token_index(state.options.tokens, given) is None:
            raise HTTPError(401, "missing or wrong bearer token in the Authorization header")
        client = request.client
        return frontend.tenant(state, given, f"http:{client.host}:{client.port}" if client else "http")

    async def body_of(request: Request) -> dict:
        """The JSON object of the body: at most MAX_REQUEST_BYTES (checked from Content-Length before
        reading, and while reading), parsed off the event loop when large; anything that is not a
        JSON object (bad bytes, nesting too deep, an integer of thousands of digits) is a 400."""
        limit = frontend.MAX_REQUEST_BYTES
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise HTTPError(413, f"body: {declared} bytes; the limit is {limit}", param="body")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"body: more than {limit} bytes; the limit is {limit}", param="body")
            chunks.append(chunk)
        raw = b"".join(chunks)
        body = await asyncio.to_thread(_parse_json, raw) if size > 1 << 16 else _parse_json(raw)
        model = body.get("model")
        if model is not None and model != state.model_name:
            raise HTTPError(404, f"model: {model!r} is not served here; the model is {state.model_name!r}",
                            param="model", code="model_not_found")
        return body

    @app.exception_handler(HTTPError)
    async def _http_error(request, exc: HTTPError):
        return exc.response()

    app.add_middleware(_ConcurrencyLimit, limit=state.options.max_concurrent_streams)

    @app.get("/health")
    async def health():
        ok = state.ready and state.thread is not None and state.thread.alive and not state.draining
        return PlainTextResponse("SERVING" if ok else "NOT_SERVING", status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        authorize(request)
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "jaxcb", "max_model_len": state.engine.max_context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        tenant = authorize(request)
        body = await body_of(request)
        _check_fields(body, _COMPLETION_FIELDS)
        if _bool(body, "echo", False):
            raise _bad("echo: not supported")
        if _str(body, "suffix", ""):
            raise _bad("suffix: not supported")
        if _int(body, "best_of", 1) != 1:
            raise _bad("best_of: only 1 is supported")
        options = _common(body)
        logprobs = _int(body, "logprobs", 0) or 0
        params = _sampling(body, max_tokens=_int(body, "max_tokens", 16), logprobs=logprobs)
        prompt = body.get("prompt")
        count = _prompt_count(prompt)
        state_check(count * params.n)
        prompts = await _completion_prompts(prompt)
        return await _run(request, options, tenant, prompts, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant = authorize(request)
        body = await body_of(request)
        _check_fields(body, _CHAT_FIELDS)
        for name in ("tools", "response_format"):
            if body.get(name):
                raise _bad(f"{name}: not supported")
        options = _common(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise _bad("messages: must be a list of {role, content} objects with string content")
        top = _int(body, "top_logprobs", 0) or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _bad(f"top_logprobs: must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
        want = _bool(body, "logprobs", False)
        if top and not want:
            raise _bad("top_logprobs: needs logprobs: true")
        limit = _int(body, "max_completion_tokens", _int(body, "max_tokens"))
        try:
            frontend.check_messages("messages", [(m["role"], m["content"]) for m in messages])
        except ValueError as e:
            raise _bad(str(e)) from None
        # Validated with a placeholder length first (every field before any tokenizing); the real
        # default max_tokens needs the prompt's length.
        params = _sampling(body, max_tokens=limit or 1, logprobs=max(top, 1) if want else 0)
        state_check(params.n)
        try:
            ids = await asyncio.to_thread(state.tokenizer.encode_chat,
                                          [{"role": m["role"], "content": m["content"]} for m in messages])
        except ValueError as e:
            raise _bad(str(e)) from None
        max_tokens = limit if limit is not None else max(1, state.engine.max_context - len(ids))
        params = _sampling(body, max_tokens=max_tokens, logprobs=max(top, 1) if want else 0)
        return await _run(request, options, tenant, [ids], params, chat=True, top_logprobs=top)

    def state_check(samples: int):
        try:
            state.admit(samples)
        except frontend.Rejected as e:
            raise _from_rejected(e) from None

    async def _completion_prompts(prompt) -> list[list[int]]:
        """The prompts as token ids; every size (count, total characters, token counts) is checked
        before any is tokenized."""
        prompts = _prompt_list(prompt)
        try:
            total = sum(len(p) for p in prompts if isinstance(p, str))
            if total > frontend.MAX_TEXT_CHARS:
                raise ValueError(f"prompt: {total} characters in all; the limit is {frontend.MAX_TEXT_CHARS}")
            for p in prompts:
                if isinstance(p, str):
                    frontend.check_text("prompt", p)
                else:
                    frontend.check_token_count(state, "prompt", len(p))
            out = []
            for p in prompts:
                out.append(await asyncio.to_thread(state.tokenizer.encode, p) if isinstance(p, str) else list(p))
            return out
        except ValueError as e:
            raise _bad(str(e)) from None

    async def _run(request: Request, options: "_Options", tenant: str, prompts, params, *, chat: bool,
                   top_logprobs=0):
        try:
            for p in prompts:  # every prompt checked before any is submitted
                state.engine.validate(p, params)
        except ValueError as e:
            raise _bad(str(e)) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        events: asyncio.Queue = asyncio.Queue()
        n = params.n
        request_id = options.request_id

        async def pump(i, ids):
            try:
                async with contextlib.aclosing(state.stream(ids, params, options.priority,
                                                            f"{request_id}/{i}" if request_id else "", tenant,
                                                            options.cache_salt)) as stream:
                    async for _, ev in stream:
                        await events.put((i, ev))
            except frontend.Rejected as e:
                await events.put((i, _from_rejected(e)))

        # The requests start only where something is there to stop them: inside the stream's generator
        # (a client gone before the first byte never starts one) or the try below.
        tasks: list[asyncio.Future] = []

        def start():
            tasks.extend(asyncio.ensure_future(pump(i, ids)) for i, ids in enumerate(prompts))

        left = len(prompts) * n
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached": 0}

        def shape(i, ev):
            index = i * n + ev.index
            logprobs = _logprobs(state.tokenizer, ev, chat, top_logprobs) if ev.logprobs else None
            finish = (ev.finish_reason.value if isinstance(ev.finish_reason, FinishReason) else ev.finish_reason)
            if ev.finished:
                usage["completion_tokens"] += ev.num_output_tokens
                if ev.index == 0:
                    usage["prompt_tokens"] += ev.num_prompt_tokens
                    usage["cached"] += ev.num_cached_tokens
            return index, ev.text, logprobs, finish if ev.finished else None

        def usage_json():
            return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                    "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                    "prompt_tokens_details": {"cached_tokens": usage["cached"]}}

        async def next_event():
            i, ev = await events.get()
            if isinstance(ev, HTTPError):
                raise ev
            if ev.finish_reason is FinishReason.ERROR:
                raise HTTPError(500, f"the step running this request failed: {ev.error}")
            return i, ev

        if options.stream:
            include_usage = options.include_usage
            obj = "chat.completion.chunk" if chat else "text_completion"

            async def sse():
                nonlocal left
                try:
                    start()
                    if chat:
                        for k in range(len(prompts) * n):
                            yield _sse({"id": rid, "object": obj, "created": created, "model": state.model_name,
                                        "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]})
                    while left:
                        try:
                            i, ev = await next_event()
                        except HTTPError as e:  # mid-stream: an error event, then the end
                            yield _sse({"error": {"message": e.message, "type": _TYPE.get(e.status, "error"),
                                                  "param": e.param, "code": e.code}})
                            break
                        left -= ev.finished
                        index, text, logprobs, finish = shape(i, ev)
                        if not (text or finish or logprobs):
                            continue
                        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish}
                        choice.update({"delta": {"content": text} if text else {}} if chat else {"text": text})
                        yield _sse({"id": rid, "object": obj, "created": created, "model": state.model_name,
                                    "choices": [choice]})
                    if include_usage and not left:
                        yield _sse({"id": rid, "object": obj, "created": created, "model": state.model_name,
                                    "choices": [], "usage": usage_json()})
                    yield "data: [DONE]\n\n"
                finally:  # the client went away (or we are done): what still runs is aborted
                    for t in tasks:
                        t.cancel()

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        texts = [""] * (len(prompts) * n)
        logs: list = [None] * len(texts)
        finishes = [None] * len(texts)

        async def collect():
            nonlocal left
            while left:
                i, ev = await next_event()
                left -= ev.finished
                index, text, logprobs, finish = shape(i, ev)
                texts[index] += text
                if logprobs:
                    logs[index] = _merge(logs[index], logprobs, chat)
                if finish:
                    finishes[index] = finish

        async def watch():  # a client that hangs up while we work: abort
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        work = gone = None
        try:
            start()
            work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(watch())
            await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                return Response(status_code=499)
            work.result()
        finally:
            for t in (*tasks, work, gone):
                if t is not None:
                    t.cancel()
        if chat:
            choices = [{"index": k, "message": {"role": "assistant", "content": texts[k]}, "logprobs": logs[k],
                        "finish_reason": finishes[k]} for k in range(len(texts))]
            return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                    "choices": choices, "usage": usage_json()}
        choices = [{"index": k, "text": texts[k], "logprobs": logs[k], "finish_reason": finishes[k]}
                   for k in range(len(texts))]
        return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                "choices": choices, "usage": usage_json()}

    return app


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special=False) if tokenizer is not None else str(token)


def _logprobs(tokenizer, ev, chat: bool, top: int):
    """One event's logprobs in OpenAI's shape: chat `{content: [...]}`, completions the four lists."""
    if chat:
        content = []
        for token, (lp, alts) in zip(ev.token_ids, ev.logprobs):
            text = _token_text(tokenizer, token)
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                            "top_logprobs": [{"token": _token_text(tokenizer, t), "logprob": l,
                                              "bytes": list(_token_text(tokenizer, t).encode())}
                                             for t, l in alts[:top]]})
        return {"content": content}
    tokens, token_logprobs, tops = [], [], []
    for token, (lp, alts) in zip(ev.token_ids, ev.logprobs):
        tokens.append(_token_text(tokenizer, token))
        token_logprobs.append(lp)
        tops.append({_token_text(tokenizer, t): l for t, l in alts})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": []}


def _merge(old, new, chat: bool):
    if old is None:
        return new
    if chat:
        return {"content": old["content"] + new["content"]}
    return {k: old[k] + new[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


async def serve_http(app: FastAPI, host: str, port: int, tls_cert: str | None = None, tls_key: str | None = None,
                     close_s: float = 2.0):
    """A uvicorn server for `app` on the running loop (HTTPS with `tls_cert`/`tls_key`, the gRPC
    server's certificate), leaving signals to the gRPC server. Returns (task, stop): await stop() to
    end it; connections still open `close_s` seconds after stop() (a client that stopped reading) are
    cut."""
    import contextlib

    import uvicorn

    class _Server(uvicorn.Server):
        def install_signal_handlers(self):  # older uvicorn
            pass

        @contextlib.contextmanager
        def capture_signals(self):  # newer uvicorn
            yield

    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                    access_log=False, ssl_certfile=tls_cert, ssl_keyfile=tls_key,
                                    timeout_graceful_shutdown=close_s))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():
            task.result()  # the port could not be bound: raise why
        await asyncio.sleep(0.02)

    async def stop():
        server.should_exit = True
        await task

    return task, stop
