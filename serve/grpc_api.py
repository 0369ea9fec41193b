"""The gRPC API: jaxcb.v1.Jaxcb, JetStream's Orchestrator, grpc.health.v1 and reflection, the token
interceptor, and `make_grpc_server` that puts them on one server (serve.server starts and stops it).

Admission, tenancy, the limits, submission and abort are the front end's (serve.frontend), shared with
the HTTP API; this module maps jaxcb's error kinds (jaxcb.host.errors) to gRPC status codes (GRPC_CODE). Each
streaming call is an asyncio task that submits its request with a callback that hops events onto the
event loop, and yields them as they come. A call that ends early (cancelled, disconnected, past its
deadline) aborts its request in the `finally` of its handler, so its pages are freed at the engine's
next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxcb.device import cpu_dots
from jaxcb.host import classifier
from jaxcb.host.errors import (InvalidRequest, JaxcbError, NotFound, Overloaded, PermissionDenied, StepFailed,
                               Unauthenticated, Unavailable)
from jaxcb.host.request import (MAX_SAMPLES, FinishReason, SamplingParams, TokenEvent, check_allowed_count, check_bad_words, check_logit_bias_count, read_json,
                                check_stop_counts)
from jaxcb.host.structured import MAX_CHOICES, Constraint
from jaxcb.host.chat_template import check_template_kwargs
from serve.frontend import (FAIRNESS_HEADER, MAX_REQUEST_BYTES, ServerOptions, State, check_ids, check_messages,
                            check_request_template, check_settings, check_text, check_text_fits, check_token_count,
                            input_ids, owner, prompt_keep, read_fairness, scores as frontend_scores, tenant, token_index, truncated)
from serve.proto import jaxcb_pb2, jaxcb_pb2_grpc, jetstream_pb2, jetstream_pb2_grpc

log = logging.getLogger("jaxcb.serve")

SERVICE_NAME = "jaxcb.v1.Jaxcb"


GRPC_CODE = {InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT, NotFound: grpc.StatusCode.NOT_FOUND, Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
             Unavailable: grpc.StatusCode.UNAVAILABLE, Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
             StepFailed: grpc.StatusCode.INTERNAL, PermissionDenied: grpc.StatusCode.PERMISSION_DENIED}


def grpc_code(e: JaxcbError) -> grpc.StatusCode:
    """The status for one of jaxcb's errors (its nearest kind in GRPC_CODE; INTERNAL if none)."""
    return next((GRPC_CODE[kind] for kind in type(e).__mro__ if kind in GRPC_CODE), grpc.StatusCode.INTERNAL)


MAX_DETAILS = 2000  # characters of an error's details: they travel in trailers, which clients cap (16 KiB)
# The field a shared check names (the HTTP API's) -> GenerateRequest's; "prompt" by the request's input.
_GRPC_FIELDS = {"prompt_token_ids": "tokens.token_ids", "messages": "chat.messages",
                "chat_template_kwargs": "chat.template_kwargs"}
_PROMPT_OF = {"text": "text", "chat": "chat.messages", "tokens": "tokens.token_ids",
              "text_content": "text_content.text", "token_content": "token_content.token_ids"}  # (and JetStream's)


def details(e: JaxcbError, request=None) -> str:
    """An error's message as a gRPC call's details: the field named as the request's message names it
    (for a GenerateRequest `request`, or JetStream's DecodeRequest), cut to MAX_DETAILS characters."""
    message, field = str(e), e.field
    if request is not None and field:
        root = re.match(r"[A-Za-z_]+", field).group(0)
        oneofs = request.DESCRIPTOR.oneofs_by_name  # (the prompt's: GenerateRequest's input, DecodeRequest's content)
        given = next((request.WhichOneof(name) for name in ("input", "content") if name in oneofs), None)
        decode = given in ("text_content", "token_content")
        named = (_PROMPT_OF.get(given) if root == "prompt" or (decode and root == "prompt_token_ids")
                 else None if decode else _GRPC_FIELDS.get(root))
        if named:
            message = named + message[len(root):]
    return message if len(message) <= MAX_DETAILS else message[:MAX_DETAILS] + f"... ({len(message)} characters)"


def tenant_of(state: State, context) -> str:
    """Who is calling over gRPC: see tenant() (and its fairness id: frontend.read_fairness)."""
    metadata = dict(context.invocation_metadata() or ())
    read_fairness(metadata.get(FAIRNESS_HEADER))
    return tenant(state, metadata.get("authorization", ""), context.peer())


# SamplingParameters' own defaults for a field a request leaves unset, where the server has no model's value
GRPC_SAMPLING = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


def _sampling(req, defaults: dict | None = None, thinking_tags: tuple[int, int] | None = None) -> SamplingParams:
    """The request's SamplingParams; `defaults` (State.sampling_defaults: the model's generation_config.json) for
    the sampling fields it leaves unset, else GRPC_SAMPLING."""
    s = req.sampling
    given = {k: getattr(s, k) if s.HasField(k) else (defaults or {}).get(k, v) for k, v in GRPC_SAMPLING.items()}
    check_stop_counts(len(req.stop), len(req.stop_token_ids))  # before the lists are copied
    check_allowed_count(len(req.allowed_token_ids))
    check_bad_words(req.bad_words)  # (its count before the list is copied)
    check_logit_bias_count(len(s.logit_bias))
    return SamplingParams(
        max_tokens=req.max_tokens, **given, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        seed=s.seed if s.HasField("seed") else None, stop=tuple(req.stop),
        stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, allowed_token_ids=tuple(req.allowed_token_ids),
        bad_words=tuple(req.bad_words),
        repetition_detection=(req.repetition_detection.max_pattern_size, req.repetition_detection.min_pattern_size,
                              req.repetition_detection.min_count) if req.HasField("repetition_detection") else None,
        thinking_token_budget=req.thinking_token_budget if req.HasField("thinking_token_budget") else None,
        thinking_tags=thinking_tags,
        logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
        n=req.n or 1, structured=_structured(req),
        speculative=req.speculative if req.HasField("speculative") else True, lora=req.lora,
        skip_special_tokens=req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
        logit_bias=dict(s.logit_bias),
    )


def _keep(state: State, req) -> int | None:
    """A request's truncate_prompt_tokens and truncation_side, as frontend.prompt_keep reads them."""
    return prompt_keep(state, req.truncate_prompt_tokens if req.HasField("truncate_prompt_tokens") else None,
                       req.truncation_side if req.HasField("truncation_side") else None)


def _template_kwargs(text: str, field: str = "chat.template_kwargs") -> dict:
    """ChatInput.template_kwargs (ScoreRequest.chat_template_kwargs: `field`): a JSON object of chat template
    variables ("" none), read as the HTTP API reads a body (no NaN or Infinity, nesting within Python's recursion
    limit)."""
    if not text:
        return {}
    check_text(field, text)
    kwargs = read_json(text, field, field)
    if not isinstance(kwargs, dict):
        raise InvalidRequest(f"{field}: must be a JSON object")
    return check_template_kwargs(kwargs, field)


def _structured(req) -> Constraint | None:
    if not req.HasField("structured"):
        return None
    s = req.structured
    kind = s.WhichOneof("constraint")
    field = f"structured.{kind}"
    if kind is None:
        raise InvalidRequest("structured: set one of json_schema, json_object, regex, choice, grammar")
    if kind == "json_schema":
        return Constraint.json_schema(s.json_schema, field)
    if kind == "json_object":
        if not s.json_object:
            raise InvalidRequest(f"{field}: must be true")
        return Constraint.json_object(field)
    if kind == "choice":
        if len(s.choice.values) > MAX_CHOICES:  # before the list is copied
            raise InvalidRequest(f"{field}: {len(s.choice.values)} choices; the limit is {MAX_CHOICES}")
        return Constraint.choice(list(s.choice.values), field)
    if kind == "structural_tag":
        return Constraint.structural_tag(s.structural_tag, field)
    return Constraint(kind, getattr(s, kind), field)


async def _prompt_ids(state: State, req) -> list[int]:
    """The request's prompt as token ids, cut to its last truncate_prompt_tokens if set. Sizes are checked
    first (nothing is copied, scanned or tokenized past a limit), and tokenization runs off the event loop."""
    keep = _keep(state, req)
    return truncated(await _whole_prompt_ids(state, req, keep is None), keep)


async def _whole_prompt_ids(state: State, req, check_length: bool) -> list[int]:
    kind = req.WhichOneof("input")
    if kind == "text":
        check_text("text", req.text)
        check_text_fits(state, "text", len(req.text), None if check_length else 0)
        return await asyncio.to_thread(state.tokenizer.encode, req.text)
    if kind == "chat":
        check_messages("chat.messages", [(m.role, m.content) for m in req.chat.messages])
        check_text_fits(state, "chat.messages", sum(len(m.content) for m in req.chat.messages), None if check_length else 0)
        messages = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        generation = req.chat.add_generation_prompt if req.chat.HasField("add_generation_prompt") else True
        template = check_request_template("chat.chat_template", req.chat.chat_template or None,
                                          state.options.trust_request_chat_template)
        return await asyncio.to_thread(state.tokenizer.encode_chat, messages, generation,
                                       _template_kwargs(req.chat.template_kwargs), req.chat.continue_final_message,
                                       template)
    if kind == "tokens":
        if check_length:
            check_token_count(state, "tokens.token_ids", len(req.tokens.token_ids))
        return list(req.tokens.token_ids)
    raise InvalidRequest("input: one of text, chat or tokens is required")


def _logprobs_pb(ev: TokenEvent):
    out = []
    if ev.logprobs:
        for token, (lp, top) in zip(ev.token_ids, ev.logprobs):
            out.append(jaxcb_pb2.TokenLogprobs(token_id=token, logprob=lp,
                                               top=[jaxcb_pb2.TopLogprob(token_id=t, logprob=l) for t, l in top]))
    return out


def _prompt_logprobs_pb(prompt: list[int], ev: TokenEvent):
    """The prompt's logprobs (a sample's first event), one per prompt token after the first."""
    return [jaxcb_pb2.TokenLogprobs(token_id=token, logprob=lp, rank=rank,
                                    top=[jaxcb_pb2.TopLogprob(token_id=t, logprob=l) for t, l in top])
            for token, (lp, rank, top) in zip(prompt[1:], ev.prompt_logprobs or ())]


class JaxcbService(jaxcb_pb2_grpc.JaxcbServicer):
    def __init__(self, state: State):
        self.state = state

    async def Generate(self, request, context):
        try:
            check_ids(request.request_id, request.cache_salt)
            params = _sampling(request, self.state.sampling_defaults, self.state.thinking_tags)
            if request.model:  # a served name (the base model) or an adapter's, as the HTTP API's `model`
                adapter = self.state.adapter_for(request.model)
                if request.lora and request.lora != adapter:
                    raise InvalidRequest(f"lora: {request.lora!r} differs from the adapter the model field names "
                                         f"({request.model!r})")
                params = dataclasses.replace(params, lora=adapter)
            self.state.admit(params.n)  # before any tokenizing
            params = await check_settings(self.state, params)
            ids = await _prompt_ids(self.state, request)
            tenant = tenant_of(self.state, context)
            # aclosing: a call that ends inside the loop (an error, a cancel) closes the stream at once,
            # aborting the request's other samples, rather than whenever the generator is collected.
            async with contextlib.aclosing(self.state.stream(ids, params, request.priority, request.request_id,
                                                             tenant, request.cache_salt)) as events:
                async for rid, ev in events:
                    prompt = None
                    if ev.prompt_logprobs:  # a prompt's worth of messages: built off the event loop
                        prompt = await asyncio.to_thread(_prompt_logprobs_pb, ids, ev)
                    if ev.token_ids or ev.text or ev.prompt_logprobs is not None:
                        yield jaxcb_pb2.GenerateResponse(request_id=rid, index=ev.index, chunk=jaxcb_pb2.GenerateChunk(
                            token_ids=list(ev.token_ids), text=ev.text, logprobs=_logprobs_pb(ev),
                            prompt_logprobs=prompt))
                    if ev.finished:
                        usage = jaxcb_pb2.Usage(prompt_tokens=ev.num_prompt_tokens, completion_tokens=ev.num_output_tokens,
                                                cached_prompt_tokens=ev.num_cached_tokens)
                        final = jaxcb_pb2.GenerateFinal(finish_reason=ev.finish_reason.value, usage=usage)
                        if isinstance(ev.stop_reason, str):
                            final.stop_string = ev.stop_reason
                        elif ev.stop_reason is not None:
                            final.stop_token_id = ev.stop_reason
                        yield jaxcb_pb2.GenerateResponse(request_id=rid, index=ev.index, final=final)
        except JaxcbError as e:
            await context.abort(grpc_code(e), details(e, request))

    async def Embed(self, request, context):
        s = self.state
        try:
            dimensions = s.pooling.check(s.engine.model_config.hidden_size,
                                         request.dimensions if request.HasField("dimensions") else None)
            results = await self._pooled(request, context, s.pooling.mode,
                                         lambda v: s.pooling.finish(v, dimensions))
        except JaxcbError as e:
            await context.abort(grpc_code(e), details(e, request))
        return jaxcb_pb2.EmbedResponse(
            embeddings=[jaxcb_pb2.Embedding(values=v.tolist(), prompt_tokens=n) for v, n in results],
            prompt_tokens=sum(n for _, n in results))

    async def Classify(self, request, context):
        s = self.state
        try:
            if s.classifier is None:
                raise classifier.not_served("classify")
            activation = request.use_activation if request.HasField("use_activation") else True
            results = await self._pooled(request, context, "last", lambda v: s.classifier.classify(v, activation))
        except JaxcbError as e:
            await context.abort(grpc_code(e), details(e, request))
        return jaxcb_pb2.ClassifyResponse(
            results=[jaxcb_pb2.Classification(label=c.label, probs=c.probs.tolist(), prompt_tokens=n)
                     for c, n in results],
            prompt_tokens=sum(n for _, n in results))

    async def Score(self, request, context):
        s = self.state
        try:
            check_ids(request.request_id, request.cache_salt)
            first, second = list(request.text_1), list(request.text_2)
            for field, texts in (("text_1", first), ("text_2", second)):
                if not texts:
                    raise InvalidRequest(f"{field}: at least one text is required")
                for t in texts:
                    check_text(field, t)
            pairs = classifier.score_pairs(len(first), len(second))
            kwargs = classifier.score_kwargs(s.classifier, request.instruction if request.HasField("instruction")
                                             else None, _template_kwargs(request.chat_template_kwargs,
                                                                         "chat_template_kwargs") or None)
            keep = _keep(s, request)
            scores, tokens = await frontend_scores(s, "text_2", first + second, pairs, s.adapter_for(request.model),
                                                   request.priority, request.request_id, tenant_of(s, context),
                                                   request.cache_salt, keep, kwargs)
        except JaxcbError as e:  # (named by ScoreRequest's fields, which are the HTTP API's)
            await context.abort(grpc_code(e), details(e))
        return jaxcb_pb2.ScoreResponse(scores=scores, prompt_tokens=tokens)

    async def _pooled(self, request, context, pooling: str, finish) -> list[tuple]:
        """An Embed or Classify request's inputs run as pooling requests (State.pool): (finish(pooled vector),
        prompt tokens) per input."""
        s = self.state
        check_ids(request.request_id, request.cache_salt)
        params = SamplingParams(max_tokens=0, pooling=pooling, lora=s.adapter_for(request.model))
        keep = _keep(s, request)
        inputs = []
        for i, item in enumerate(request.inputs):
            kind = item.WhichOneof("input")
            if kind is None:
                raise InvalidRequest(f"inputs[{i}]: one of text or tokens is required")
            inputs.append(item.text if kind == "text" else list(item.tokens.token_ids))
        prompts = await input_ids(s, "inputs", inputs, keep)
        return await s.pool("inputs", prompts, params, request.priority, request.request_id, tenant_of(s, context),
                            request.cache_salt, finish)

    async def Abort(self, request, context):
        """Only the caller's own requests (same token, or same connection without auth) are found."""
        return jaxcb_pb2.AbortResponse(found=self.state.abort(tenant_of(self.state, context), request.request_id))

    async def GetModelInfo(self, request, context):
        s = self.state
        c = s.engine.model_config
        return jaxcb_pb2.ModelInfo(name=s.model_name, served_model_names=s.served_names, vocab_size=c.vocab_size, context_length=s.engine.max_context,
                                   dtype=s.dtype, num_layers=c.num_layers, num_params=c.num_params,
                                   family=c.family, sliding_window=c.sliding_window if c.windowed else 0,
                                   num_sliding_layers=c.num_sliding_layers, lora_adapters=s.engine.lora_names(),
                                   embedding_size=c.hidden_size, embedding_pooling=s.pooling.describe(),
                                   classifier_labels=s.classifier.labels if s.classifier is not None else (),
                                   classifier=s.classifier.describe() if s.classifier is not None else "")

    async def LoadLoraAdapter(self, request, context):
        try:
            if not request.lora_name or not request.lora_path:
                raise InvalidRequest("lora_name: required" if not request.lora_name else "lora_path: required")
            await self.state.load_lora(owner(tenant_of(self.state, context)), request.lora_name, request.lora_path,
                                       request.load_inplace)
        except JaxcbError as e:
            await context.abort(grpc_code(e), details(e))
        return jaxcb_pb2.LoraAdapterResponse(message=f"LoRA adapter {request.lora_name!r} loaded", done=True)

    async def UnloadLoraAdapter(self, request, context):
        try:
            done = self.state.unload_lora(owner(tenant_of(self.state, context)), request.lora_name)
        except JaxcbError as e:
            await context.abort(grpc_code(e), details(e))
        return jaxcb_pb2.LoraAdapterResponse(
            message=f"LoRA adapter {request.lora_name!r} " + ("unloaded" if done else "unloads when its requests end"),
            done=done)

    async def GetServerInfo(self, request, context):
        return server_info(self.state)

    # ---- new weights while serving (--dev-routes, the operator's; serve.frontend.State.update_weights) ----
    async def _weights(self, context, call) -> jaxcb_pb2.WeightsResponse:
        if not self.state.options.dev_routes:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the RL calls are served with --dev-routes only")
        try:
            self.state.check_operator(tenant_of(self.state, context))
            message = await call()
        except JaxcbError as e:
            await context.abort(grpc_code(e), details(e))
        e = self.state.engine
        return jaxcb_pb2.WeightsResponse(message=message, paused=e.paused, sleeping=e.asleep,
                                         weight_version=e.engines[0].weight_version or "")

    async def PauseGeneration(self, request, context):
        async def pause():
            await self.state.pause(request.mode or "abort", not request.keep_cache)
            return "paused"
        return await self._weights(context, pause)

    async def ResumeGeneration(self, request, context):
        async def resume():
            await self.state.resume()
            return "resumed"
        return await self._weights(context, resume)

    async def UpdateWeights(self, request, context):
        async def update():
            if not request.model_path:
                raise InvalidRequest("model_path: required")
            await self.state.update_weights(request.model_path, request.weight_version or None,
                                            request.abort_all_requests)
            return "weights updated"
        return await self._weights(context, update)

    async def Sleep(self, request, context):
        async def sleep():
            level = request.level if request.HasField("level") else 1
            await self.state.sleep(level, request.mode or "abort")
            return f"sleeping (level {level})"
        return await self._weights(context, sleep)

    async def WakeUp(self, request, context):
        async def wake_up():
            return "awake" if await self.state.wake_up(list(request.tags) or None) else "sleeping"
        return await self._weights(context, wake_up)


def server_info(state: State) -> jaxcb_pb2.ServerInfo:
    """The server as GetServerInfo (and HTTP's /server_info) tells it."""
    e = state.engine
    st = e.stats()
    b = e.config.buckets
    replicas = [jaxcb_pb2.ReplicaInfo(
        replica=i, device_ids=eng.runner.device_ids, pages_total=r.pages_total,
        pages_free=r.pages_free, running=r.running, waiting=r.waiting, preemptions=r.preemptions,
        pending_tokens=e.load[i], requests_routed=e.routed[i])
        for i, (eng, r) in enumerate(zip(e.engines, e.replica_stats()))]
    return jaxcb_pb2.ServerInfo(
        decode_batch_buckets=b.decode_batch, pages_per_seq_buckets=b.pages_per_seq,
        prefill_token_buckets=b.prefill_tokens, page_size=e.config.page_size, pages_total=st.pages_total,
        pages_free=st.pages_free, policy=e.config.scheduler.policy, compilations=st.compilations,
        running=st.running, waiting=st.waiting, preemptions=st.preemptions,
        tensor_parallel=e.config.tensor_parallel, data_parallel=len(e), replicas=replicas,
        speculative_method=st.speculative_method,
        num_speculative_tokens=e.config.scheduler.speculative.num_tokens if st.speculative_method else 0,
        speculative_acceptance_rate=st.acceptance_rate,
        speculative_mean_accepted_length=st.mean_accepted_length,
        speculative=e.engines[0].describe_speculation(), sampling_defaults=state.sampling_defaults,
        weight_version=e.engines[0].weight_version or "", paused=e.paused, sleeping=e.asleep,
        **_step_fields(e.engines[0].runner))


def _step_fields(runner) -> dict:
    """How the step computes; on the CPU, also XLA:CPU's dot settings (jaxcb.device.cpu_dots)."""
    fields = runner.describe()
    if fields["platform"] == "cpu":
        d = cpu_dots.current()
        fields.update(cpu_dots=d.library, cpu_max_isa=d.isa, cpu_dots_reason=d.reason)
    return fields


class OrchestratorService(jetstream_pb2_grpc.OrchestratorServicer):
    """JetStream's API over the same engine: greedy, as JetStream's Decode carries no sampling settings."""

    def __init__(self, state: State):
        self.state = state

    async def Decode(self, request, context):
        """JetStream's Decode, as JetStream's own server answers it: a prompt longer than the context keeps its last
        tokens, and an answer ends at the context whatever max_tokens asks (its clients take an error for a fault
        and send the request again); the prompt gets the model's BOS unless has_bos says it has one. A request cut
        short by the server (its shutdown) or failed ends with an error status, not as a finished answer."""
        s = self.state
        try:
            n = max(request.num_samples, 1)  # (0: one, as JetStream reads it)
            if not 0 <= request.num_samples <= MAX_SAMPLES:
                raise InvalidRequest(f"num_samples: must be from 0 (0: 1) to {MAX_SAMPLES}, got {request.num_samples}")
            if request.max_tokens <= 0:
                raise InvalidRequest(f"max_tokens: must be at least 1, got {request.max_tokens}")
            lora = ""
            if request.lora_adapter_id:
                try:
                    lora = s.adapter_for(request.lora_adapter_id)
                except NotFound as e:
                    raise NotFound("lora_adapter_id" + str(e)[len("model"):]) from None
            kind = request.WhichOneof("content")
            bos = s.tokenizer is not None and s.tokenizer.add_bos and not request.has_bos
            if kind == "text_content":
                if s.tokenizer is None:
                    raise InvalidRequest("text_content: this model has no tokenizer; send token_content")
                check_text("text_content.text", request.text_content.text)
                s.admit(n)  # (before any tokenizing)
                ids = await asyncio.to_thread(s.tokenizer.encode, request.text_content.text, bos)
            elif kind == "token_content":
                ids = list(request.token_content.token_ids)
                if bos and s.tokenizer.bos_id is not None and ids and ids[0] != s.tokenizer.bos_id:
                    ids = [s.tokenizer.bos_id, *ids]
            else:
                raise InvalidRequest("content: text_content or token_content is required")
            if not ids:
                raise InvalidRequest(f"{kind}.{'text' if kind == 'text_content' else 'token_ids'}: must not be empty")
            ids = truncated(ids, s.engine.max_context - 1)
            params = SamplingParams(max_tokens=min(request.max_tokens, s.engine.max_context - len(ids)), n=n, lora=lora)
            async with contextlib.aclosing(s.stream(ids, params, request.priority, "", tenant_of(s, context))) as events:
                async for _, ev in events:
                    if ev.token_ids or ev.text:  # (each message holds every sample, as JetStream's: the others empty)
                        samples = [jetstream_pb2.DecodeResponse.StreamContent.Sample() for _ in range(n)]
                        samples[ev.index].text, samples[ev.index].token_ids[:] = ev.text, list(ev.token_ids)
                        yield jetstream_pb2.DecodeResponse(
                            stream_content=jetstream_pb2.DecodeResponse.StreamContent(samples=samples))
                    if ev.finish_reason is FinishReason.ABORT:
                        raise Unavailable(f"the request was aborted after {ev.num_output_tokens} tokens (the server "
                                          "is shutting down)")
                    if ev.finish_reason is FinishReason.ERROR:
                        raise (InvalidRequest if ev.request_error else StepFailed)(ev.error or "the request failed")
        except JaxcbError as e:
            await context.abort(grpc_code(e), details(e, request))

    async def HealthCheck(self, request, context):
        s = self.state
        return jetstream_pb2.HealthCheckResponse(is_live=bool(s.ready and s.thread and s.thread.alive and not s.draining))


class _Malformed:
    """A request body that is not the message it should be (random bytes on the wire)."""

    def __init__(self, name: str, error: Exception):
        self.message = f"request: the body is not a valid {name} ({type(error).__name__})"


def _add_service(server, descriptor, servicer) -> None:
    """Register `servicer` for a service from its descriptor, like the generated add_*_to_server, but a
    body that does not parse is answered INVALID_ARGUMENT (gRPC's own answer is UNKNOWN)."""
    from google.protobuf import message_factory

    handlers = {}
    for method in descriptor.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)

        def parse(data, cls=request_cls):
            try:
                return cls.FromString(data)
            except Exception as e:  # noqa: BLE001 - any parse failure is the client's
                return _Malformed(cls.DESCRIPTOR.full_name, e)

        fn = getattr(servicer, method.name)
        if method.server_streaming:
            async def handler(request, context, fn=fn):
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                async for item in fn(request, context):
                    yield item

            make = grpc.unary_stream_rpc_method_handler
        else:
            async def handler(request, context, fn=fn):
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return await fn(request, context)

            make = grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(handler, request_deserializer=parse,
                                     response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))
    server.add_registered_method_handlers(descriptor.full_name, handlers)


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every call but health checks must carry `authorization: Bearer <token>` with one of the tokens
    (compared in constant time). Health is exempt so that load balancers and Kubernetes' gRPC probes
    can use it: it answers SERVING or NOT_SERVING and reveals nothing else."""

    EXEMPT = ("/grpc.health.v1.Health/",)

    def __init__(self, tokens: tuple[str, ...]):
        self._tokens = tokens

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token in 'authorization'")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token in 'authorization'")
            yield  # pragma: no cover - makes this an async generator

        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(self, continuation, details):
        if details.method.startswith(self.EXEMPT):
            return await continuation(details)
        md = dict(details.invocation_metadata or ())
        if token_index(self._tokens, md.get("authorization", "")) is not None:
            return await continuation(details)
        handler = await continuation(details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


def make_grpc_server(state: State, options: ServerOptions):
    """The gRPC server (not started) with jaxcb.v1, JetStream's Orchestrator, health and reflection, and
    `set_health(status)`, the coroutine that sets every service's health."""
    interceptors = [_AuthInterceptor(options.tokens)] if options.tokens else []
    server = grpc.aio.server(interceptors=interceptors, maximum_concurrent_rpcs=options.max_concurrent_streams, options=[
        ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
    ])
    _add_service(server, jaxcb_pb2.DESCRIPTOR.services_by_name["Jaxcb"], JaxcbService(state))
    _add_service(server, jetstream_pb2.DESCRIPTOR.services_by_name["Orchestrator"], OrchestratorService(state))
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE_NAME, "jetstream_proto.Orchestrator", health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)

    async def set_health(status):
        for name in ("", SERVICE_NAME, "jetstream_proto.Orchestrator"):
            result = health_servicer.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    return server, set_health
