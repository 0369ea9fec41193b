"""The OpenAI-compatible HTTP API, beside gRPC: same process, same engine, same admission and limits.

    GET  /v1/models              the model under each name it is served as (--served-model-name) and its LoRA
                                 adapters; a request's `model` selects one (answers carry the first name)
    GET  /v1/models/{name}       one of them (OpenAI's retrieve-model call); 404 for another name
    POST /v1/load_lora_adapter   {"lora_name", "lora_path"}: register a PEFT adapter while serving (vLLM's)
    POST /v1/unload_lora_adapter {"lora_name"}: unregister it (when its requests have ended)
    POST /v1/completions         prompt: text, list of texts, token ids or lists of them
    POST /v1/chat/completions    messages through the model's chat template
    POST /v1/responses           OpenAI's Responses API (text and function tools), over the chat machinery;
                                 previous_response_id and background (serve.openai_responses_store)
    GET  /v1/responses/{id}      a kept response; DELETE it; GET .../input_items its input; POST .../cancel
                                 a background one; POST /v1/responses/input_tokens: a call's input tokens
    POST /v1/conversations       OpenAI's Conversations API (GET, POST, DELETE /v1/conversations/{id}, its
                                 /items, /items/{item_id}): items a Responses call's `conversation` goes on
    POST /v1/messages            Anthropic's Messages API (text, tools, thinking), over the chat machinery
    POST /v1/messages/count_tokens  its input tokens
    POST /v1/embeddings          input: text, list of texts, token ids or lists of them -> their embeddings,
                                 pooled as the model says (jaxcb.host.embedding); float or base64, `dimensions`
    POST /score, /v1/score       vLLM's: text_1 against text_2, by the model's cross-encoder (a one-label
                                 classifier head), else the cosine of their embeddings
    POST /rerank, /v1/rerank, /v2/rerank   Jina's, Cohere's and vLLM's: documents against a query, best first
    POST /classify, /v1/classify vLLM's: each input's labels' probabilities (jaxcb.host.classifier)
    POST /pooling                vLLM's generic pooling: task embed (the embeddings' vector) or classify (probabilities)
    POST /tokenize               vLLM's: {prompt} or {messages} -> {count, max_model_len, tokens, token_strs}
    POST /detokenize             vLLM's: {tokens} -> {prompt}
    POST /v1/files, /v1/batches  OpenAI's Files and Batch APIs (GET, DELETE /v1/files/{id}, its /content; GET
                                 /v1/batches/{id}, POST .../cancel): batches of requests run in the background
                                 through this app (serve.openai_batches)
    POST /pause, /resume, /sleep, /wake_up, /update_weights_from_disk, /update_weight_version, /weight_checker,
         /abort_requests, /release_kv_cache_memory; GET /is_paused, /is_sleeping, /weight_info, /get_world_size: vLLM's and SGLang's RL
                                 routes, new weights while serving
                                 (--dev-routes, the operator's; jaxcb.weight_update)
    GET  /version                {version}: jaxcb's (no auth)
    GET  /health                 200 once warm (no auth), else 503
    GET  /metrics                the server's Prometheus registry

`stream: true` sends server-sent events ending in `data: [DONE]` (with `stream_options.include_usage`
a last chunk carries the usage). jaxcb's extras ride in the body as vLLM's do: top_k, min_p,
repetition_penalty, ignore_eos, priority, cache_salt, request_id. Bad input is 400 in OpenAI's error
shape naming the field (the fields' checks are serve.openai_fields; the limits and admission are the
front end's, serve.frontend, shared with gRPC), a missing token 401, an unknown model 404, a body over
the limit 413, a full queue or too many calls in progress 429, a draining or warming server 503. A
client that disconnects has its request aborted (its pages are freed at the next step), streaming or
not. This module parses and checks each call; serve.openai_answer runs its requests and shapes the answer.

The app runs under uvicorn on the gRPC server's event loop (serve.server.run_server starts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as RouteError

import jaxcb
from jaxcb.host import classifier, embedding, harmony, tool_calls
from jaxcb.host.embedding import check_encoding_format
from jaxcb.host.tokenizer import trim_heap
from jaxcb.host.errors import InvalidRequest, JaxcbError, NotFound, Unauthenticated, shown
from jaxcb.host.request import MAX_SAMPLES, SamplingParams
from serve import anthropic_messages, frontend, openai_batches, openai_responses, openai_scores, reasoning
from serve.openai_responses_store import Store
from serve.openai_answer import answer, best_choices, embeddings_body, json_response, until_gone
from serve.openai_beam import beam_answer, check_beam_request
from serve.openai_fields import (CHAT_FIELDS, COMPLETION_FIELDS, DETOKENIZE_FIELDS, EMBEDDING_FIELDS, TOKENIZE_FIELDS,
                                 MAX_TOP_LOGPROBS,
                                 ERROR_TYPE, HTTPError, bad_request, bool_field, check_chat_spec_fields, check_fields,
                                 common_fields, http_error, int_field, parse_json, placeholder_max_tokens, prompt_list,
                                 sampling_params, str_field, template_fields, beam_fields)


log = logging.getLogger("jaxcb.serve.openai_api")
MAX_PROFILE_S = 30  # a /start_profile trace ends after this long (a trace buffers all the process runs, ~20 MB/s)
KEPT_PROFILES = 8  # the traces --profile-dir keeps (the oldest this server wrote removed first)
LIMITED = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/score", "/rerank", "/pooling", "/classify",
           "/invocations")  # the paths of API calls (what the concurrency limit counts)


class _ConcurrencyLimit:
    """At most `limit` API calls (/v1/..., /tokenize, /detokenize) in progress at once, the number gRPC's maximum_concurrent_rpcs
    has (--max-concurrent-streams): the next is a 429 before its body is read. A call counts until the
    app has sent its last byte or the client has gone (pure ASGI: nothing here can outlive the call)."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.in_flight = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(LIMITED):
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

    def bearer(request: Request) -> str:
        """The Authorization header, or Anthropic's x-api-key as a bearer token."""
        given = request.headers.get("authorization", "")
        return given or (f"Bearer {request.headers['x-api-key']}" if "x-api-key" in request.headers else "")

    def authorize(request: Request) -> str:
        """The caller's tenant (raises 401 when the server has tokens and this is none of them)."""
        given = bearer(request)
        if state.options.tokens and frontend.token_index(state.options.tokens, given) is None:
            raise Unauthenticated("missing or wrong bearer token in the Authorization header (or x-api-key)")
        client = request.client
        frontend.read_fairness(request.headers.get(frontend.FAIRNESS_HEADER))
        return frontend.tenant(state, given, f"http:{client.host}:{client.port}" if client else "http")

    async def body_of(request: Request) -> dict:
        """The JSON object of the body: at most MAX_REQUEST_BYTES (checked from Content-Length before
        reading, and while reading), whole within --http-header-timeout (a 408: a client that declares a
        body and trickles it, or never sends it, does not hold its call), parsed off the event loop when
        large; anything that is not a JSON object (bad bytes, nesting too deep, an integer of thousands of
        digits) is a 400. A top-level field that is null is not given (OpenAI's optional fields are
        nullable, and SDKs and serializers send null for what is unset)."""
        kept = getattr(request.state, "body", None)
        if kept is not None:  # (read already: /invocations chose the call by it)
            return kept
        limit, seconds = frontend.MAX_REQUEST_BYTES, state.options.http_header_timeout_s
        declared = request.headers.get("content-length")
        if declared is not None and (not (declared.isascii() and declared.isdigit()) or len(declared) > 15
                                     or int(declared) > limit):
            raise HTTPError(413, f"body: {declared} bytes; the limit is {limit}", param="body")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(seconds):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise HTTPError(413, f"body: more than {limit} bytes; the limit is {limit}", param="body")
                    chunks.append(chunk)
        except TimeoutError:
            raise HTTPError(408, f"body: not received whole within {seconds:g} s ({size} bytes came)",
                            param="body") from None
        raw = b"".join(chunks)
        body = await asyncio.to_thread(parse_json, raw) if size > 1 << 16 else parse_json(raw)
        body = {k: v for k, v in body.items() if v is not None}
        adapter_of(body)  # the model it names is served (404 before any other work)
        return body

    def adapter_of(body: dict) -> str:
        """The LoRA adapter the body's `model` names ("" = the base model, by any of its served names)."""
        model = str_field(body, "model", "")
        try:
            return state.adapter_for(model)
        except NotFound as e:
            raise HTTPError(404, str(e), param="model", code="model_not_found") from None

    def logged(request, exc: HTTPError):
        if exc.status >= 500:  # the server's fault: in its log too
            log.error("%s %s: %d %s", request.method, request.url.path[:200], exc.status, exc.message)
        return exc.response()

    @app.exception_handler(HTTPError)
    async def _http_error(request, exc: HTTPError):
        return logged(request, exc)

    @app.exception_handler(JaxcbError)  # a refusal from the front end or the engine, before any answer
    async def _jaxcb_error(request, exc: JaxcbError):
        return logged(request, http_error(exc))

    @app.exception_handler(RouteError)  # no such route, or not with this method: OpenAI's error shape too
    async def _route_error(request, exc: RouteError):
        message = f"{request.method} {request.url.path[:200]}: {exc.detail}"
        return JSONResponse({"error": {"message": message, "type": ERROR_TYPE.get(exc.status_code, "invalid_request_error"),
                                       "param": None, "code": None}}, status_code=exc.status_code, headers=exc.headers)

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

    def model_entries() -> list[dict]:
        """/v1/models' entries: each served name, then each loaded LoRA adapter."""
        entry = {"object": "model", "created": state.started, "owned_by": "jaxcb", "parent": None,
                 "max_model_len": state.engine.max_context, "permission": []}
        served = [dict(entry, id=name, root=name) for name in state.served_names]
        adapters = [dict(entry, id=name, root=name, parent=state.model_name) for name in state.engine.lora_names()]
        return [*served, *adapters]

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": model_entries()}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        """OpenAI's retrieve-model call (`client.models.retrieve(name)`): the entry /v1/models lists."""
        authorize(request)
        found = next((e for e in model_entries() if e["id"] == model), None)
        if found is None:
            adapter_of({"model": model})  # the same 404 as a request naming it
        return found

    @app.get("/version")
    async def version():
        return {"version": jaxcb.__version__}

    # SageMaker's hosting contract, as vLLM serves it: /ping is the health check, POST /invocations the call its
    # body is (a chat's messages, a completion's prompt, an embedding's or a classifier's input, a score's text_1
    # and text_2, a rerank's query and documents), answered as that call answers, streamed where it streams.
    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.post("/invocations")
    async def invocations(request: Request):
        authorize(request)  # (before the body is read: the call it routes to checks again)
        body = await body_of(request)
        pooled = state.engine.model_config.headless
        if "messages" in body:
            path = "/v1/embeddings" if pooled else "/v1/chat/completions"
        elif "prompt" in body:
            path = "/v1/completions"
        elif "input" in body:
            path = "/classify" if state.classifier is not None else "/v1/embeddings"
        elif "text_1" in body or "text_2" in body:
            path = "/score"
        elif "query" in body or "documents" in body:
            path = "/rerank"
        else:
            raise bad_request("body: /invocations takes a chat (messages), a completion (prompt), embeddings or "
                              "a classification (input), a score (text_1, text_2) or a rerank (query, documents)")
        request.state.body = body
        endpoint = next(r.endpoint for r in app.router.routes
                        if getattr(r, "path", None) == path and "POST" in getattr(r, "methods", ()))
        return await endpoint(request)

    def operator(request: Request) -> None:
        """The operator's routes (profiles, the prefix cache's reset, the RL routes): State.check_operator."""
        state.check_operator(authorize(request))

    if state.options.profile_dir is not None:
        profiling = asyncio.Lock()
        written: list[str] = []  # the traces this server wrote, oldest first (at most KEPT_PROFILES kept)
        tracing: list[str] = []  # the trace being written (at most one)
        timers: set[asyncio.Task] = set()

        async def stop_tracing(folder: str) -> None:
            """The trace ends (whatever stop_trace says: the routes never stay stuck on a trace that failed)."""
            import jax

            try:
                await asyncio.to_thread(jax.profiler.stop_trace)
            finally:
                tracing.clear()
                await asyncio.to_thread(trim_heap)  # (the trace's buffers, freed, given back to the system)
            log.info("profile written to %s", folder)

        async def time_out(folder: str) -> None:
            """A trace ends after MAX_PROFILE_S if nobody stops it sooner (it buffers everything the process runs)."""
            await asyncio.sleep(MAX_PROFILE_S)
            async with profiling:
                if tracing == [folder]:
                    log.warning("profile %s stopped after %d s (nobody called /stop_profile)", folder, MAX_PROFILE_S)
                    await stop_tracing(folder)

        @app.post("/start_profile")
        async def start_profile(request: Request):
            """vLLM's: a jax.profiler trace of everything the process runs (the engine's steps on every device)
            from now until /stop_profile (at most MAX_PROFILE_S), under --profile-dir: TensorBoard's .xplane.pb."""
            operator(request)
            async with profiling:
                if tracing:
                    raise HTTPError(409, f"a profile is being written already (to {tracing[0]}): /stop_profile first")
                import jax

                while len(written) >= KEPT_PROFILES:
                    await asyncio.to_thread(shutil.rmtree, written.pop(0), True)
                folder = os.path.join(state.options.profile_dir,
                                      f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}")
                await asyncio.to_thread(jax.profiler.start_trace, folder)
                tracing.append(folder)
                written.append(folder)
                timers.add(task := asyncio.ensure_future(time_out(folder)))
                task.add_done_callback(timers.discard)
            log.info("profiling into %s (for at most %d s)", folder, MAX_PROFILE_S)
            return {"profile_dir": folder}

        @app.post("/stop_profile")
        async def stop_profile(request: Request):
            operator(request)
            async with profiling:
                if not tracing:
                    raise HTTPError(409, "no profile is being written: /start_profile first")
                folder = tracing[0]
                await stop_tracing(folder)
            return {"profile_dir": folder}

    if state.options.dev_routes:
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(request: Request):
            """vLLM's (a development route, --dev-routes): every cached prefix forgotten, the KV-cache events'
            AllBlocksCleared published; {"success": false} while requests run or wait (try again when idle)."""
            operator(request)
            return {"success": all(await state.settled(state.engine.reset_prefix_cache(), 30.0))}

        # vLLM's RL routes and SGLang's weight update (development routes, the operator's): a trainer pauses the
        # rollouts, gives new weights, resumes (jaxcb.weight_update).
        TRUE, FALSE = ("true", "1", "yes", "y", "on", "t"), ("false", "0", "no", "n", "off", "f")

        def query_flag(request: Request, name: str, default: bool) -> bool:
            value = request.query_params.get(name)
            if value is None:
                return default
            if value.lower() not in TRUE + FALSE:  # (what vLLM's pydantic reads as a boolean)
                raise bad_request(f"{name}: true or false, not {shown(value)}")
            return value.lower() in TRUE

        @app.post("/pause")
        async def pause(request: Request):
            """vLLM's: ?mode=abort (every request ends), wait (the running ones finish) or keep (they freeze);
            requests that arrive meanwhile wait for /resume. Answered once every replica is still."""
            operator(request)
            await state.pause(request.query_params.get("mode", "abort"), query_flag(request, "clear_cache", True))
            return {"status": "paused"}

        @app.post("/resume")
        async def resume(request: Request):
            operator(request)
            await state.resume()
            return {"status": "resumed"}

        @app.get("/is_paused")
        async def is_paused(request: Request):
            operator(request)
            return {"is_paused": state.engine.paused}

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request):
            """SGLang's: {"model_path": a checkpoint on this machine of the served model's architecture (GGUF, a
            converted one, a Hugging Face directory), "weight_version"?, "abort_all_requests"?: pause with "abort"
            first and resume after}. Running requests are computed again on the new weights; nothing compiles."""
            operator(request)
            body = await body_of(request)
            check_fields(body, {"model_path", "weight_version", "load_format", "abort_all_requests", "flush_cache"})
            path = str_field(body, "model_path", "")
            if not path:
                raise bad_request("model_path: required")
            if body.get("load_format", "auto") != "auto":
                raise bad_request(f"load_format: {shown(body['load_format'])}; jaxcb reads a checkpoint as it finds "
                                  "it (auto)")
            bool_field(body, "flush_cache", True)  # (the prefix cache is always forgotten: it holds the old K/V)
            version = body.get("weight_version")
            await state.update_weights(path, version, bool_field(body, "abort_all_requests", False))
            return {"success": True, "message": "Succeeded to update model weights.", "weight_version": version}

        @app.post("/sleep")
        async def sleep(request: Request):
            """vLLM's sleep mode: ?level=1 (the KV pages freed, the weights kept on the host), 2 (both freed: new
            weights to come), 0 (a pause only); ?mode as /pause's. Answered once every replica is asleep."""
            operator(request)
            level = request.query_params.get("level", "1")
            if level not in ("0", "1", "2", "0.0", "1.0", "2.0"):
                raise bad_request(f"level: {shown(level)} is not a sleep level (0, 1 or 2)")
            await state.sleep(int(float(level)), request.query_params.get("mode", "abort"))
            return {"status": "sleeping", "level": int(float(level))}

        @app.post("/release_kv_cache_memory")
        async def release_kv_cache_memory(request: Request):
            """vLLM's: the KV pages off the devices (the weights stay), once paused with no request left; /wake_up
            brings them back."""
            operator(request)
            await state.release_kv_cache()
            return {"status": "kv_cache_released"}

        @app.post("/wake_up")
        async def wake_up(request: Request):
            """vLLM's: ?tags=weights&tags=kv_cache (default both) back on the devices; generation resumes once the
            engine is whole ("awake")."""
            operator(request)
            tags = request.query_params.getlist("tags") or None
            awake = await state.wake_up(tags)
            return {"status": "awake" if awake else "sleeping", "tags": tags}

        @app.get("/is_sleeping")
        async def is_sleeping(request: Request):
            """vLLM's: paused (a level-0 sleep is a pause) or with memory off the devices."""
            operator(request)
            return {"is_sleeping": state.engine.asleep or state.engine.paused}

        @app.post("/abort_requests")
        async def abort_requests(request: Request):
            """vLLM's: {"request_ids": [...]} (the ids clients gave their requests) end at the next step; none or
            an empty list: every request."""
            operator(request)
            body = await body_of(request)
            check_fields(body, {"request_ids"})
            ids = body.get("request_ids", [])  # (absent, null or []: every request)
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise bad_request("request_ids: a list of request ids")
            return {"status": "aborted", "aborted": state.abort_requests(ids or None)}

        @app.get("/get_world_size")
        async def get_world_size(request: Request):
            """vLLM's: the devices one replica spans (tensor parallel), times the replicas with include_dp."""
            operator(request)
            tensor = state.engine.config.tensor_parallel
            return {"world_size": tensor * len(state.engine) if query_flag(request, "include_dp", True) else tensor}

        @app.get("/weight_info")
        async def weight_info(request: Request):
            """vLLM's: the version the newest weights came with, "default" for those the server started with."""
            operator(request)
            return {"weight_version": state.engine.engines[0].weight_version or "default"}

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request):
            operator(request)
            body = await body_of(request)
            check_fields(body, {"new_version", "abort_all_requests"})
            from jaxcb.weight_update import check_version

            version = check_version(str_field(body, "new_version", ""))
            if not version:
                raise bad_request("new_version: required")
            async with state.aborting_all(bool_field(body, "abort_all_requests", False)):
                for engine in state.engine.engines:
                    engine.weight_version = version
            return {"success": True, "new_version": version}

        @app.post("/weight_checker")
        async def weight_checker(request: Request):
            """vLLM's: {"action": "checksum"} the served arrays' SHA-256 by name; "compare" them with "baseline"."""
            operator(request)
            body = await body_of(request)
            check_fields(body, {"action", "baseline"})
            action = str_field(body, "action", "")
            if action not in ("checksum", "compare", "reset"):
                raise bad_request(f"action: {shown(action)} is not checksum, compare or reset")
            if action == "reset":  # every weight zeroed (a weight-sync test's start: reset, send, compare)
                await state.reset_weights()
                return {"status": "reset"}
            baseline = body.get("baseline")
            if action == "compare" and not (isinstance(baseline, dict)
                                            and all(isinstance(v, str) for v in baseline.values())):
                raise bad_request("baseline: compare needs the checksums to compare with, {name: sha256}")
            from jaxcb.weight_update import checksums

            sums = await asyncio.to_thread(checksums, state.engine.engines[0])
            if action == "checksum":
                return {"checksums": sums}
            return {"match": sums == baseline, "mismatches": sorted(k for k in sums.keys() | baseline.keys()
                                                                    if sums.get(k) != baseline.get(k))}

    @app.get("/kv_event_sources")
    async def kv_event_sources(request: Request):
        """vLLM's: each data-parallel rank's KV-cache event publisher (--kv-events), {} without them."""
        authorize(request)
        return state.kv_event_sources

    @app.get("/load")
    async def load(request: Request):
        """vLLM's server load: the calls in progress (streams and answers being made)."""
        authorize(request)
        return {"server_load": len(state.active)}

    @app.get("/server_info")
    async def server_info(request: Request):
        """What gRPC's GetServerInfo tells (buckets, pages, policy, parallelism, speculation, the step), as JSON."""
        authorize(request)
        from google.protobuf.json_format import MessageToDict

        from serve.grpc_api import server_info as info_of
        return MessageToDict(info_of(state), preserving_proto_field_name=True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: {prompt} or {messages} (through the chat template) -> {count, max_model_len, tokens,
        token_strs}."""
        authorize(request)
        body = await body_of(request)
        check_fields(body, TOKENIZE_FIELDS)
        tokenizer = _tokenizer()
        special = bool_field(body, "add_special_tokens", None)
        strs = bool_field(body, "return_token_strs", False)
        if ("prompt" in body) == ("messages" in body):
            raise bad_request("prompt: give either prompt or messages")
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise bad_request(f"prompt: must be a string, got {type(prompt).__name__}")
            frontend.check_text("prompt", prompt)
            # add_special_tokens (default true): what the tokenizer adds to a text (its BOS, if the model has one)
            ids = await asyncio.to_thread(tokenizer.encode, prompt, None if special is not False else False)
        else:
            ids = await chat_ids(body, True, special)
        # (a megabyte's ids and their strings: made and written off the event loop)
        shown = await asyncio.to_thread(lambda: [tokenizer.id_to_token(t) for t in ids]) if strs else None
        return await json_response({"count": len(ids), "max_model_len": state.engine.max_context, "tokens": ids,
                                    "token_strs": shown})

    async def chat_ids(body: dict, generation_prompt: bool, special: bool | None, fits: bool = False,
                       keep: int | None = None) -> list[int]:
        """The body's `messages` through the chat template (/tokenize's, and the pooling APIs' chat-style input, as
        vLLM's), with its template fields (add_generation_prompt defaulting to `generation_prompt`) and tools;
        `fits`: contents too long for the context (kept whole: `keep` None) refused before tokenizing."""
        tokenizer = _tokenizer()
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise bad_request("messages: must be a list of {role, content} objects")
        template = template_fields(body, state.options.trust_request_chat_template, generation_prompt)
        _, messages, shown = chat_tools(body, messages, template[3])
        frontend.check_messages("messages", [(m["role"], m["content"]) for m in messages])
        dropping = body.get("truncation") == "auto"  # (a Responses call's: counted as run_chat would cut it)
        if dropping:
            messages = dropped_to_fit(messages)
        elif fits:
            frontend.check_text_fits(state, "messages", sum(len(m["content"]) for m in messages), keep)

        async def encoded(msgs):
            try:
                ids = await asyncio.to_thread(functools.partial(tokenizer.encode_chat, msgs, *template, tools=shown))
            except InvalidRequest:  # named already (no chat template, a template that refused them, ...)
                raise
            except ValueError as e:
                raise bad_request(f"messages: {e}") from None
            return with_special(ids, special)

        return await (fitted(messages, encoded, 1) if dropping else encoded(messages))

    def with_special(ids: list[int], special: bool | None) -> list[int]:
        """A chat's ids: the template writes its own special tokens; add_special_tokens (default false) adds the
        tokenizer's BOS where the model's tokenizer adds one and the template did not."""
        tokenizer = _tokenizer()
        if special and tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
            return [tokenizer.bos_id, *ids]
        return ids

    async def pooling_inputs(body: dict) -> list[list[int]]:
        """An embeddings or classify body's inputs as token ids, cut to truncate_prompt_tokens: `input` (texts or
        token ids), or vLLM's chat-style `messages` (one input, through the chat template)."""
        keep = frontend.prompt_keep(state, body.get("truncate_prompt_tokens"), body.get("truncation_side"))
        if "messages" not in body:
            given = prompt_list(body.get("input"), "input", frontend.MAX_EMBED_INPUTS)
            return await frontend.input_ids(state, "input", given, keep)
        if "input" in body:
            raise bad_request("input: give either input or messages")
        ids = await chat_ids(body, False, bool_field(body, "add_special_tokens", False), fits=True, keep=keep)
        return [frontend.truncated(ids, keep)]

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: {tokens} -> {prompt}, the text they decode to."""
        authorize(request)
        body = await body_of(request)
        check_fields(body, DETOKENIZE_FIELDS)
        tokenizer = _tokenizer()
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad_request("tokens: must be a list of token ids")
        if len(ids) > state.engine.max_context:
            raise bad_request(f"tokens: {len(ids)} tokens; the limit is {state.engine.max_context} (the context)")
        vocab = state.engine.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens: {bad} is not a token id (0 <= id < {vocab})")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, ids, False)}

    def _tokenizer():
        if state.tokenizer is None:
            raise bad_request("model: the model has no tokenizer")
        return state.tokenizer

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        owner = frontend.owner(authorize(request))
        body = await body_of(request)
        check_fields(body, {"lora_name", "lora_path", "model", "load_inplace"})
        name, path = str_field(body, "lora_name", ""), str_field(body, "lora_path", "")
        if not name or not path:
            raise bad_request("lora_name: required" if not name else "lora_path: required")
        await state.load_lora(owner, name, path, bool_field(body, "load_inplace", False))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        owner = frontend.owner(authorize(request))
        body = await body_of(request)
        check_fields(body, {"lora_name", "lora_int_id", "model"})
        name = str_field(body, "lora_name", "")
        if not name:
            raise bad_request("lora_name: required")
        now = state.unload_lora(owner, name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully."
                                 + ("" if now else " (its running requests finish first)"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        tenant = authorize(request)
        body = await body_of(request)
        check_fields(body, COMPLETION_FIELDS)
        echo = bool_field(body, "echo", False)
        if str_field(body, "suffix", ""):
            raise bad_request("suffix: not supported")
        best_of = int_field(body, "best_of")
        options = common_fields(body)
        # OpenAI's logprobs N: each token's own logprob and its N most likely alternatives (0: none of
        # them); unset: no logprobs; true / false (as chat takes it, and vLLM here): 0 / none
        if isinstance(body.get("logprobs"), bool):
            body = {**body, "logprobs": 0} if body["logprobs"] else {k: v for k, v in body.items() if k != "logprobs"}
        shown = int_field(body, "logprobs")
        if shown is not None and shown < 0:
            raise bad_request(f"logprobs: must be >= 0, got {shown}")
        # max_tokens: 16 unless given (null too: OpenAI's and vLLM's), at least min_tokens, and cut to the room each
        # prompt's context leaves: a default never refuses a prompt that fits
        room_capped = body.get("max_tokens") is None
        max_tokens = max(16, placeholder_max_tokens(body)) if room_capped else int_field(body, "max_tokens")
        # echo with logprobs: the prompt's tokens' logprobs lead the choice's (lm-eval's loglikelihood);
        # echo with max_tokens 0: the prompt alone, scored (OpenAI's legacy scoring call)
        scored = (shown or 0) if echo and (shown is not None or max_tokens == 0) else None
        params = sampling_params(body, max_tokens=max_tokens, logprobs=0 if shown is None else max(shown, 1),
                                 prompt_logprobs=scored, defaults=state.sampling_defaults,
                                 thinking_tags=state.thinking_tags)
        params = dataclasses.replace(params, lora=adapter_of(body))
        given = prompt_list(body.get("prompt"))
        keep = frontend.prompt_keep(state, body.get("truncate_prompt_tokens"), body.get("truncation_side"))
        penalty = beam_fields(body)
        # best_of (OpenAI's): so many samples of each prompt, the n of them most likely (their tokens' summed
        # logprobs) answered; all are counted in usage
        if best_of is not None and best_of < params.n:
            raise bad_request(f"best_of: must be at least n ({params.n}), got {best_of}")
        if best_of is not None and best_of > MAX_SAMPLES:
            raise bad_request(f"best_of: must be <= {MAX_SAMPLES}, got {best_of}")
        ranked = best_of is not None and best_of > params.n
        if ranked:
            for field, given_too in (("stream", options.stream), ("use_beam_search", penalty is not None)):
                if given_too:
                    raise bad_request(f"best_of: not supported with {field} (the best are known only at the end)")
            params = dataclasses.replace(params, n=best_of, logprobs=max(params.logprobs, 1))
        if penalty is not None:
            check_beam_request(params, options, logprobs=shown is not None, echo=echo)
        state.admit(len(given) * params.n)
        params = await frontend.check_settings(state, params)
        # add_special_tokens (vLLM's; default true): what the tokenizer adds to a text (its BOS, if the model has one)
        encode = state.tokenizer.encode if bool_field(body, "add_special_tokens", True) else functools.partial(
            state.tokenizer.encode, add_bos=False)
        prompts = await frontend.prompt_ids(state, "prompt", given, keep, encode)
        if penalty is not None:
            if room_capped:  # (beams share one limit: the longest prompt's room)
                room = max(1, state.engine.max_context - max(map(len, prompts)))
                params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
            return await json_response(await beam_answer(state, request, options, tenant, prompts, params, penalty,
                                                         chat=False))
        echoed = None
        if echo:  # each choice's text starts with its prompt's (token ids decoded; what is kept of it, if cut)
            # (token ids as the text of each, special tokens too: as the echoed logprobs' tokens, and vLLM's echo)
            echoed = [p if isinstance(p, str) and keep is None else await asyncio.to_thread(
                _tokenizer().decode, ids, not isinstance(p, list)) for p, ids in zip(given, prompts)]
        try:
            answered = await answer(state, request, options, tenant, prompts, params, chat=False, echo=echoed,
                                    top_logprobs=shown or 0, prompt_field="prompt_logprobs" in body,
                                    room_capped=room_capped)
            if ranked and isinstance(answered, dict):
                answered = best_choices(answered, best_of, int_field(body, "n", 1), shown is not None)
            return await json_response(answered)
        except InvalidRequest as e:  # (the engine names a prompt's ids by its own field)
            if e.field == "prompt_token_ids":
                raise bad_request("prompt" + str(e)[len("prompt_token_ids"):]) from None
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant = authorize(request)
        body = await body_of(request)
        check_fields(body, CHAT_FIELDS)
        return await json_response(await run_chat(request, tenant, body))

    store = Store(int(state.options.responses_store_mb * (1 << 20)), len(state.options.tokens))  # (background ones end with the server's
    # requests: shutdown's grace, then its aborts)
    state.metrics.kept.set_function(lambda: len(store.kept))  # (read at each scrape)
    state.metrics.kept_bytes.set_function(lambda: store.used)

    @app.post("/v1/responses")
    async def responses(request: Request):
        """OpenAI's Responses API, answered by the chat machinery (serve.openai_responses), kept by the store."""
        tenant = authorize(request)
        owner = frontend.owner(tenant)
        body = await body_of(request)
        origins = []
        try:
            call = store.call(owner, body)
            chat = openai_responses.chat_body(body, origins, call.history, call.history_field)
            if call.background:
                return await store.start(call, body, chat, origins, answered_as(body),
                                         lambda stand_in: run_chat(stand_in, tenant, chat))
            keep = store.keeper(call, body, chat)
            answer = await run_chat(request, tenant, chat)
        except (HTTPError, JaxcbError) as e:  # named by this API's fields, not the chat's
            raise openai_responses.renamed(e if isinstance(e, HTTPError) else http_error(e), origins) from None
        return await json_response(openai_responses.reshape(answer, body, origins, keep))

    def anthropic_error(request: Request, e: HTTPError | JaxcbError, origins: list | None) -> JSONResponse:
        """An error in Anthropic's shape; one of the chat machinery's (`origins` given) naming the call's field."""
        e = e if isinstance(e, HTTPError) else http_error(e)
        e = anthropic_messages.error(e, origins) if origins is not None else e
        if e.status >= 500:
            log.error("%s %s: %d %s", request.method, request.url.path[:200], e.status, e.message)
        return anthropic_messages.error_response(e)

    @app.post("/v1/messages")
    async def messages(request: Request):
        """Anthropic's Messages API, answered by the chat machinery (serve.anthropic_messages), its errors in
        that API's shape."""
        origins, chat = [], None
        try:
            tenant = authorize(request)
            body = await body_of(request)
            chat = anthropic_messages.chat_body(body, origins)
            answer = await run_chat(request, tenant, chat)
            return await json_response(anthropic_messages.reshape(answer, body, origins))
        except (HTTPError, JaxcbError) as e:  # (the call's own checks name its fields already)
            return anthropic_error(request, e, origins if chat is not None else None)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """Anthropic's: the input tokens a Messages call would take ({input_tokens})."""
        origins, chat = [], None
        try:
            authorize(request)
            body = await body_of(request)
            chat = anthropic_messages.chat_body(body, origins, counting=True)
            return {"input_tokens": len(await chat_ids(chat, True, None))}
        except (HTTPError, JaxcbError) as e:
            return anthropic_error(request, e, origins if chat is not None else None)

    @app.post("/v1/responses/input_tokens")
    async def response_input_tokens(request: Request):
        """OpenAI's count of a Responses call's input tokens (the chat template's rendering of its conversation,
        tools included): {object: response.input_tokens, input_tokens}."""
        owner = frontend.owner(authorize(request))
        body = await body_of(request)
        check_fields(body, openai_responses.INPUT_TOKENS_FIELDS)
        str_field(body, "personality", "")  # (a hint: checked)
        body.pop("personality", None)
        origins = []
        try:
            call = store.call(owner, body)
            chat = openai_responses.chat_body(body, origins, call.history, call.history_field)
            ids = await chat_ids(chat, True, None)
        except (HTTPError, JaxcbError) as e:
            raise openai_responses.renamed(e if isinstance(e, HTTPError) else http_error(e), origins) from None
        return {"object": "response.input_tokens", "input_tokens": len(ids)}

    def kept_route(call, takes: str):
        """A route the store answers: call(owner, its path's ids in order, then the body or the query: `takes`)."""
        async def route(request: Request):
            owner = frontend.owner(authorize(request))
            extra = (await body_of(request),) if takes == "body" else (request.query_params,) if takes == "query" else ()
            # (a kept response with its logprobs is megabytes: written off the event loop, as answers are)
            return await json_response(call(owner, *request.path_params.values(), *extra))

        return route

    # OpenAI's Files and Batch APIs (serve.openai_batches): a batch's lines run through this app.
    batches = openai_batches.Batches(int(state.options.batch_files_mb * (1 << 20)), state.options.http_header_timeout_s,
                                     state.options.tokens, state.options.batch_dir)
    batches.app, state.batches = app, batches

    @app.post("/v1/files")
    async def upload_file(request: Request):
        return await batches.upload(frontend.owner(authorize(request)), request)

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        return batches.create(frontend.owner(authorize(request)), await body_of(request))

    # Kept responses, and OpenAI's Conversations API in the same store: a conversation's items, which a Responses
    # call naming it (`conversation`) reads before its input and goes on with its input and answer; the batches'
    # files and batches.
    for method, path, call, takes in (
            ("GET", "/v1/responses/{response_id}", store.get, "query"),
            ("DELETE", "/v1/responses/{response_id}", store.delete, ""),
            ("GET", "/v1/responses/{response_id}/input_items", store.input_items, "query"),
            ("POST", "/v1/responses/{response_id}/cancel", store.cancel, ""),
            ("POST", "/v1/conversations", store.create_conversation, "body"),
            ("GET", "/v1/conversations/{conversation_id}", store.conversation, ""),
            ("POST", "/v1/conversations/{conversation_id}", store.update_conversation, "body"),
            ("DELETE", "/v1/conversations/{conversation_id}", store.delete_conversation, ""),
            ("GET", "/v1/conversations/{conversation_id}/items", store.conversation_items, "query"),
            ("POST", "/v1/conversations/{conversation_id}/items", store.add_items, "body"),
            ("GET", "/v1/conversations/{conversation_id}/items/{item_id}", store.item, ""),
            ("DELETE", "/v1/conversations/{conversation_id}/items/{item_id}", store.delete_item, ""),
            ("GET", "/v1/files", batches.list_files, "query"),
            ("GET", "/v1/files/{file_id}", batches.get_file, ""),
            ("DELETE", "/v1/files/{file_id}", batches.delete_file, ""),
            ("GET", "/v1/files/{file_id}/content", batches.content, ""),
            ("GET", "/v1/batches", batches.list, "query"),
            ("GET", "/v1/batches/{batch_id}", batches.get, ""),
            ("POST", "/v1/batches/{batch_id}/cancel", batches.cancel, "")):
        app.add_api_route(path, kept_route(call, takes), methods=[method])

    async def pooled(request: Request, tenant: str, body: dict, field: str, prompts: list[list[int]], pooling: str,
                     finish):
        """State.pool's (finish(pooled vector), prompt tokens) per prompt, or a 499 if the client hung up."""
        options = common_fields(body)
        params = SamplingParams(max_tokens=0, pooling=pooling, lora=adapter_of(body))
        return await until_gone(request, state.pool(field, prompts, params, options.priority, options.request_id,
                                                    tenant, options.cache_salt, finish))

    async def scored(request: Request, tenant: str, body: dict, field: str, texts: list[str],
                     pairs: list[tuple[int, int]]):
        """frontend.scores' (each pair's score, prompt tokens), or a 499 if the client hung up."""
        options = common_fields(body)
        kwargs = classifier.score_kwargs(state.classifier, body.get("instruction"), body.get("chat_template_kwargs"))
        keep = frontend.prompt_keep(state, body.get("truncate_prompt_tokens"), body.get("truncation_side"))
        return await until_gone(request, frontend.scores(state, field, texts, pairs, adapter_of(body), options.priority,
                                                         options.request_id, tenant, options.cache_salt, keep, kwargs))

    def answered_as(body: dict) -> str:
        return adapter_of(body) or state.model_name  # an adapter's answers carry its name

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        tenant = authorize(request)
        body = await body_of(request)
        check_fields(body, EMBEDDING_FIELDS)
        fmt = check_encoding_format(body.get("encoding_format"))
        results = await embedded(request, tenant, body)
        if isinstance(results, Response):
            return results
        return await json_response(await asyncio.to_thread(embeddings_body, results, fmt, answered_as(body)))

    async def embedded(request: Request, tenant: str, body: dict):
        """The body's inputs' embeddings (the embeddings API's and /pooling's: pooled as the model says, cut to
        `dimensions`), each with its prompt tokens, or the 499 of a client gone."""
        dimensions = state.pooling.check(state.engine.model_config.hidden_size, body.get("dimensions"))
        prompts = await pooling_inputs(body)
        return await pooled(request, tenant, body, "input", prompts, state.pooling.mode,
                            lambda v: state.pooling.finish(v, dimensions))

    async def classified(request: Request, tenant: str, body: dict):
        """The body's inputs through the classifier head (the classify API's and /pooling's; vLLM's use_activation:
        false gives the raw logits), each with its prompt tokens, or the 499 of a client gone."""
        if state.classifier is None:
            raise classifier.not_served("classify")
        activation = bool_field(body, "use_activation", True)
        prompts = await pooling_inputs(body)
        return await pooled(request, tenant, body, "input", prompts, "last",
                            lambda v: state.classifier.classify(v, activation))

    @app.post("/pooling")
    async def pooling(request: Request):
        """vLLM's generic pooling API: `task` embed (the embeddings API's vector) or classify (the classify API's
        probabilities); by default the model's own (classify for a classifier, else embed)."""
        tenant = authorize(request)
        body = await body_of(request)
        check_fields(body, openai_scores.POOLING_FIELDS)
        task = body.get("task", "classify" if state.classifier is not None else "embed")
        if task not in openai_scores.POOLING_TASKS:
            raise bad_request(f"task: {str(task)[:64]!r} is not one of {', '.join(openai_scores.POOLING_TASKS)} (vLLM's "
                              "per-token tasks are not served)")
        if task == "classify":
            results = await classified(request, tenant, body)
            data = lambda c: [float(p) for p in c.probs]
        else:
            fmt = check_encoding_format(body.get("encoding_format"))
            results = await embedded(request, tenant, body)
            data = lambda v: embedding.encoded(v, fmt)
        if isinstance(results, Response):
            return results
        return await json_response(openai_scores.pooling_body([(data(r), n) for r, n in results], answered_as(body)))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: Request):
        """vLLM's score API: a cross-encoder's, or over embeddings (serve.openai_scores)."""
        tenant = authorize(request)
        body = await body_of(request)
        check_fields(body, openai_scores.SCORE_FIELDS)
        texts, pairs = openai_scores.score_pairs(body)
        results = await scored(request, tenant, body, "text_2", texts, pairs)
        if isinstance(results, Response):
            return results
        return await json_response(openai_scores.score_body(*results, answered_as(body)))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: Request):
        """The rerank API (Jina's, Cohere's, vLLM's): a cross-encoder's, or over embeddings (serve.openai_scores)."""
        tenant = authorize(request)
        body = await body_of(request)
        check_fields(body, openai_scores.RERANK_FIELDS)
        texts, top_n, documents = openai_scores.rerank_request(body)
        results = await scored(request, tenant, body, "documents", texts, [(0, k) for k in range(1, len(texts))])
        if isinstance(results, Response):
            return results
        scores, tokens = results
        return await json_response(openai_scores.rerank_body(texts, scores, top_n, documents, tokens,
                                                             answered_as(body)))

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(request: Request):
        """vLLM's classify API: each input's labels through the model's classifier head (serve.openai_scores)."""
        tenant = authorize(request)
        body = await body_of(request)
        check_fields(body, openai_scores.CLASSIFY_FIELDS)
        results = await classified(request, tenant, body)
        if isinstance(results, Response):
            return results
        return await json_response(openai_scores.classify_body(results, answered_as(body)))

    def chat_tools(body: dict, messages: list, template: str | None):
        """The request's tools and messages for the chat template that writes the chat: the request's own,
        else the model's (jaxcb.host.tool_calls.prepare)."""
        return tool_calls.prepare(body, messages, template or state.tokenizer.chat_template,
                                  state.options.tool_call_parser)

    def first_turn(messages: list[dict]) -> int:
        """The index of the first message after the leading system ones (what truncation may drop from)."""
        return next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))

    def without_oldest(messages: list[dict], drop: int) -> list[dict]:
        """`messages` without the `drop` oldest after the leading system ones (and tool results whose call went
        with them); the last one always kept."""
        head = first_turn(messages)
        start = min(head + drop, len(messages) - 1)
        while start < len(messages) - 1 and messages[start]["role"] == "tool":
            start += 1
        return messages[:head] + messages[start:]

    def dropped_to_fit(messages: list[dict]) -> list[dict]:
        """`messages` without as few of the oldest as leave no more characters of content than the context's
        prompt tokens could hold (or one message): no encoding is then longer than the context could be."""
        chars = (state.engine.max_context - 1) * state.tokenizer.max_token_chars
        head = first_turn(messages)
        total, drop = sum(len(m["content"]) for m in messages), 0
        while total > chars and head + drop < len(messages) - 1:
            total -= len(messages[head + drop]["content"])
            drop += 1
        return without_oldest(messages, drop)

    async def fitted(messages: list[dict], encoded, room: int) -> list[int]:
        """The prompt of `messages` with the fewest of its oldest messages dropped (without_oldest) that leaves
        `room` tokens in the context: the whole, if it does, else found by bisection, each try one encoding. Still
        too long with one message left: that prompt."""
        ids = await encoded(messages)
        if len(ids) + room <= state.engine.max_context:
            return ids
        lo, hi = 1, max(1, len(messages) - first_turn(messages) - 1)  # (the fewest dropped that might fit, the most)
        best = await encoded(without_oldest(messages, hi))
        while lo < hi:
            mid = (lo + hi) // 2
            ids = await encoded(without_oldest(messages, mid))
            if len(ids) + room <= state.engine.max_context:
                hi, best = mid, ids
            else:
                lo = mid + 1
        return best

    async def run_chat(request: Request, tenant: str, body: dict):
        check_chat_spec_fields(body)
        options = common_fields(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise bad_request("messages: must be a list of {role, content} objects")
        template = template_fields(body, state.options.trust_request_chat_template)
        tools, messages, shown = chat_tools(body, messages, template[3])
        keep = frontend.prompt_keep(state, body.get("truncate_prompt_tokens"), body.get("truncation_side"))
        top = int_field(body, "top_logprobs", 0) or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs: must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
        want = bool_field(body, "logprobs", False)
        include_reasoning = bool_field(body, "include_reasoning", True)
        if top and not want:
            raise bad_request("top_logprobs: needs logprobs: true")
        limit = int_field(body, "max_completion_tokens", int_field(body, "max_tokens"))
        frontend.check_messages("messages", [(m["role"], m["content"]) for m in messages])  # the rendered chat
        # The Responses API's truncation "auto" (its chat body's own key): the conversation's oldest messages
        # dropped until it fits; kept whole, a conversation the context cannot hold is refused before tokenizing
        dropping = body.get("truncation") == "auto"
        if dropping:  # (first those whose text alone could not fit)
            messages = dropped_to_fit(messages)
        else:
            frontend.check_text_fits(state, "messages", sum(len(m["content"]) for m in messages), keep)
        # Validated with a placeholder length first (every field before any tokenizing); the real
        # default max_tokens needs the prompt's length.
        params = sampling_params(body, max_tokens=placeholder_max_tokens(body) if limit is None else limit,
                                 logprobs=max(top, 1) if want else 0, defaults=state.sampling_defaults,
                                 thinking_tags=state.thinking_tags)
        params = dataclasses.replace(params, lora=adapter_of(body))
        forced = tool_calls.constraint(tools, state.tokenizer) if tools is not None else None
        if forced is not None:  # "required" or a named function: the output is tool-call blocks (in place of a
            params = dataclasses.replace(params, structured=forced)  # response_format: the answer is no text)
        # gpt-oss's harmony answers: their messages' markers in the text (its reasoning, content and calls)
        harmonic = (harmony.is_harmony(template[3] or state.tokenizer.chat_template)
                    or state.options.reasoning_parser == reasoning.HARMONY or (tools is not None and tools.fmt.harmony))
        if harmonic or (tools is not None and tools.active
                        and tool_calls.marked_by_special_tokens(tools.fmt, state.tokenizer)):
            params = dataclasses.replace(params, skip_special_tokens=False)  # the calls' markers in the text
        if harmonic and forced is None and params.structured is not None:  # the answer's final message holds it
            params = dataclasses.replace(params, structured=harmony.framed(params.structured, state.tokenizer))
        penalty = beam_fields(body)
        if penalty is not None:
            check_beam_request(params, options, logprobs=want, echo=bool_field(body, "echo", False))
            if tools is not None and tools.active:
                raise bad_request("tools: not supported with use_beam_search")
            if harmonic:
                raise bad_request("use_beam_search: not supported where answers are in the harmony format (gpt-oss)")
        state.admit(params.n)
        params = await frontend.check_settings(state, params)
        special = bool_field(body, "add_special_tokens", False)

        async def encoded(msgs):
            ids = await asyncio.to_thread(functools.partial(state.tokenizer.encode_chat, msgs, *template, tools=shown))
            return with_special(ids, special)

        ids = frontend.truncated(await (fitted(messages, encoded, limit or 1) if dropping else encoded(messages)), keep)
        if limit is None:  # the default needs the prompt's length (validated again by replace)
            params = dataclasses.replace(params, max_tokens=max(1, state.engine.max_context - len(ids)))
        elif body.get("max_tokens_to_room"):  # (Anthropic's: a required max_tokens that clients set for far larger
            # contexts, 4,096 or 128,000, cut to the room the prompt leaves, as vLLM cuts it)
            params = dataclasses.replace(params, max_tokens=max(1, min(limit, state.engine.max_context - len(ids))))
        if penalty is not None:
            return await beam_answer(state, request, options, tenant, [ids], params, penalty, chat=True)
        if state.options.reasoning_parser and not harmonic and params.structured is not None:  # after the thinking
            params = dataclasses.replace(params, structured_after=reasoning.grammar_start(state.tokenizer, ids))
        closed = bool(state.options.reasoning_parser) and not harmonic and reasoning.prompt_closed(state.tokenizer, ids)
        if want:  # the tokens' bytes are read by a tokenizer built on first use: not on the event loop
            await asyncio.to_thread(state.tokenizer.token_bytes, 0)
        # vLLM's echo: an answer that goes on from a final assistant message starts with that message's content
        last = body["messages"][-1] if body["messages"] else None
        echoed = ([tool_calls.content_text(last.get("content"), "messages[-1].content") or ""]
                  if bool_field(body, "echo", False) and isinstance(last, dict) and last.get("role") == "assistant"
                  else None)
        return await answer(state, request, options, tenant, [ids], params, chat=True, top_logprobs=top, echo=echoed,
                            tools=tools if tools is not None and tools.active else None,
                            prompt_field="prompt_logprobs" in body,
                            include_reasoning=include_reasoning, harmony=harmonic, thinking_closed=closed)

    return app


def _header_deadline(seconds: float):
    """uvicorn's h11 protocol with a deadline on each request's line and headers: a connection that has not
    sent them whole `seconds` after it opened, or after its last answer, is closed. A client trickling a
    request's first bytes (slowloris) or holding idle sockets cannot keep them (uvicorn's own keep-alive
    timer stops at the first byte, and does not run before a first request)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc):
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self):
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _expire(self):
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # (no whole request yet)
                self.transport.close()

    return Protocol


async def serve_http(app: FastAPI, host: str, port: int, tls_cert: str | None = None, tls_key: str | None = None,
                     close_s: float = 2.0, header_timeout_s: float = 30.0):
    """A uvicorn server for `app` on the running loop (HTTPS with `tls_cert`/`tls_key`, the gRPC
    server's certificate), leaving signals to the gRPC server. Returns (task, stop): await stop() to
    end it; connections still open `close_s` seconds after stop() (a client that stopped reading) are
    cut; one that has not sent a request's line and headers within `header_timeout_s` is closed."""
    import uvicorn

    class _Server(uvicorn.Server):
        def install_signal_handlers(self):  # older uvicorn
            pass

        @contextlib.contextmanager
        def capture_signals(self):  # newer uvicorn
            yield

    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                    access_log=False, ssl_certfile=tls_cert, ssl_keyfile=tls_key,
                                    timeout_graceful_shutdown=close_s, http=_header_deadline(header_timeout_s)))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():
            task.result()  # the port could not be bound: raise why
        await asyncio.sleep(0.02)

    async def stop():
        server.should_exit = True
        await task

    return task, stop
