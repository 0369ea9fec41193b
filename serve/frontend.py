"""The server's front end, shared by both APIs (gRPC in serve.grpc_api, the OpenAI HTTP API in
serve.openai_api): admission, tenancy, the request limits, submission to the engine and abort. Nothing
here knows a transport: a refusal is one of jaxcb's error kinds (jaxcb.host.errors), which each API maps
to its own status (gRPC codes in serve.grpc_api.GRPC_CODE, HTTP statuses in serve.openai_fields.HTTP_STATUS).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import hmac
import time
import uuid
from collections.abc import Callable

import numpy as np

from jaxcb.host.embedding import Pooling, cosines
from jaxcb.host.errors import (ContextTooLong, InvalidConfig, InvalidRequest, NotFound, Overloaded, PermissionDenied,
                               StepFailed, Unavailable, shown)
from jaxcb.host.replicas import Replicas
from jaxcb.host.request import (FinishReason, SamplingParams, TokenEvent, check_param_ids, check_prompt_length,
                                outside_vocabulary, resolve_bad_words)
from serve import reasoning
from serve.metrics import Metrics, RequestTimer

MAX_STREAM_INTERVAL = 1 << 16  # tokens a streamed chunk holds (--stream-interval, and a request's stream_interval)
MAX_TEXT_CHARS = 1 << 20  # prompt text, and all of a chat's messages together
MAX_MESSAGES = 256
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 256
MAX_REQUEST_BYTES = 16 << 20  # one request's message (gRPC) or body (HTTP): room for MAX_TEXT_CHARS escaped
MAX_PROMPTS = 64  # prompts in one completions request (gRPC takes one)
MAX_EMBED_INPUTS = 2048  # inputs in one embeddings request (OpenAI's limit; and the server's --max-waiting)
MAX_TEMPLATE_CHARS = 65536  # a request's own chat template
MAX_COMPILE_S = 10.0  # compiling one structured-output constraint (llguidance's own limits bound it too)
# The fair policy's flows on a server without tokens: the fairness id the Gateway API Inference Extension's
# gateway sets (x-gateway-inference-fairness-id; gRPC metadata of that name too), read into FAIRNESS for the
# call being served (each API sets it as it reads the caller: openai_api's authorize, grpc_api's tenant_of).
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
MAX_FAIRNESS_CHARS = 256
FAIRNESS: contextvars.ContextVar[str] = contextvars.ContextVar("fairness", default="")


def read_fairness(value: str | None) -> None:
    """This call's fairness id (FAIRNESS), from its header or metadata (cut to MAX_FAIRNESS_CHARS)."""
    FAIRNESS.set((value or "")[:MAX_FAIRNESS_CHARS])


@dataclasses.dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    http_port: int | None = None  # the OpenAI-compatible HTTP API (serve.openai_api), same engine
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | tuple[str, ...] | None = None  # one or several bearer tokens; each is a tenant
    grace_s: float = 10.0
    max_waiting: int = 1024  # requests accepted and not yet running, before RESOURCE_EXHAUSTED
    max_concurrent_streams: int = 4096  # calls in progress at once (gRPC's maximum_concurrent_rpcs)
    metrics_host: str = "127.0.0.1"  # the metrics port is unauthenticated: loopback unless asked
    kv_events: str | None = None  # publish KV-cache events (jaxcb.host.kv_events) on this ZMQ endpoint
    kv_events_topic: str | None = None  # their topic; None: kv@HOSTNAME@MODEL, as the llm-d indexer reads it
    # A request may bring its own chat template (vLLM's `chat_template`): rendered in the sandbox, but a
    # template is a program a client runs on the server, so only where the operator trusts the clients.
    trust_request_chat_template: bool = False
    reasoning_parser: str | None = None  # chat answers' <think> part as `reasoning` (serve.reasoning.PARSERS)
    tool_call_parser: str = "auto"  # the format of tool calls (jaxcb.host.tool_calls.choose_format)
    http_header_timeout_s: float = 30.0  # an HTTP request's line and headers must come within this, then its body
    # The HTTP API's sampling defaults: "auto", the model's generation_config.json where it has one (vLLM's
    # --generation-config auto); "none" (or vLLM's "vllm"), OpenAI's
    generation_config: str = "auto"
    # The Responses API's kept responses (serve.openai_responses_store): at most this many MiB; 0 keeps none
    responses_store_mb: float = 64.0
    # The Files and Batch APIs' files on disk (serve.openai_batches): at most this many MiB; 0 keeps none
    batch_files_mb: float = 1024.0
    batch_dir: str | None = None  # where they are kept, to outlive the server (None: a folder removed at stop)
    stream_interval: int = 1  # tokens a streamed HTTP chunk holds at least (vLLM's --stream-interval)
    profile_dir: str | None = None  # where POST /start_profile writes jax.profiler traces (None: no such routes)
    dev_routes: bool = False  # vLLM's development routes (/reset_prefix_cache, the RL routes): off unless asked for

    def __post_init__(self):
        if self.generation_config not in ("auto", "none", "vllm"):
            raise InvalidConfig(f"--generation-config: {self.generation_config!r} is not auto, none or vllm")
        if not self.responses_store_mb >= 0:
            raise InvalidConfig(f"--responses-store-mb: must be a number of MiB >= 0, got {self.responses_store_mb}")
        if not 0 <= self.batch_files_mb < 1 << 40:
            raise InvalidConfig(f"--batch-files-mb: must be a number of MiB >= 0, got {self.batch_files_mb}")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise InvalidConfig(f"--stream-interval: must be between 1 and {MAX_STREAM_INTERVAL}, got "
                                f"{self.stream_interval}")
        if not self.http_header_timeout_s > 0:
            raise InvalidConfig(f"--http-header-timeout: must be a positive number of seconds, got "
                                f"{self.http_header_timeout_s}")

    @property
    def tokens(self) -> tuple[str, ...]:
        if not self.auth_token:
            return ()
        return (self.auth_token,) if isinstance(self.auth_token, str) else tuple(self.auth_token)


class State:
    """What the handlers share: the engine replicas (one or more, on their threads, behind the
    router), the tokenizer, metrics, and the server's phase. `engine` and `thread` are both the
    Replicas: the first for what one reads of an engine, the second for submit/abort/alive."""

    def __init__(self, engine: Replicas, tokenizer, served_names: str | tuple[str, ...], dtype: str,
                 options: ServerOptions, metrics: Metrics):
        self.engine = engine
        self.tokenizer = tokenizer
        # The names requests may give the model (--served-model-name); answers carry the first.
        self.served_names = (served_names,) if isinstance(served_names, str) else tuple(served_names)
        self.model_name = self.served_names[0]
        self.dtype = dtype
        self.options = options
        # how the model's embeddings pool (jaxcb.host.embedding): its sentence-transformers configuration or GGUF's
        self.pooling = getattr(tokenizer, "pooling", None) or Pooling()
        # the model's classifier head (jaxcb.host.classifier), None if it has none: /classify, and the score and
        # rerank APIs' cross-encoder
        self.classifier = getattr(engine, "classifier", None)
        # what an HTTP request leaves out of its sampling (ServerOptions.generation_config)
        self.sampling_defaults = dict(getattr(tokenizer, "sampling_defaults", {}) or {}) \
            if options.generation_config == "auto" else {}
        # the reasoning parser's <think> and </think> as token ids, what a thinking_token_budget counts by (None:
        # no parser, or tags that are not one token each)
        self.thinking_tags = reasoning.thinking_tags(tokenizer, options.reasoning_parser)
        self.metrics = metrics
        self.started = int(time.time())  # what /v1/models gives as the model's `created`
        self.ready = False
        self.kv_event_sources: dict = {}  # each replica's KV-cache event publisher (serve.server; none: {})
        self.draining = False
        # Engine keys of accepted, unfinished requests -> their samples (n): admission counts samples,
        # as the engine runs each of them as a sequence of its own.
        self.active: dict[str, int] = {}
        self.active_samples = 0  # sum(active.values()), kept as they change: admission is O(1)
        self.queues: dict[str, asyncio.Queue] = {}  # engine key -> its stream's event queue
        # (tenant, the client's request id) -> engine key. Engine keys are uuid4s, never reused: an
        # Abort reaches only its own tenant's requests, and a stream's clean-up only its own request.
        self.ids: dict[tuple[str, str], str] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: Replicas | None = None
        self.died = asyncio.Event()
        self.batches = None  # the Files and Batch APIs' store (serve.openai_batches), where the HTTP API is served
        self.lora_owners: dict[str, str] = {}  # the LoRA adapters loaded while serving -> their loader (owner)
        self.updating = asyncio.Lock()  # new weights being read (update_weights): one update at a time
        self.pauses = 0  # pauses asked for (an update's own pause resumes only if no other came after it)
        self.loading_lora = asyncio.Lock()  # one adapter load at a time: a token's share is counted, then taken

    def check_open(self) -> None:
        if self.draining:
            raise Unavailable("the server is shutting down")
        if not self.ready:  # (the engine thread starts once warm-up is done)
            raise Unavailable("the server is warming up; retry when health is SERVING")
        if self.thread is None or not self.thread.alive:
            raise Unavailable("the engine is not running")

    def adapter_for(self, model: str | None) -> str:
        """The LoRA adapter a request's `model` names: "" for the base model (any of its served names,
        or none given), else a loaded adapter's name; NotFound naming what is served otherwise."""
        if not model or model in self.served_names:
            return ""
        adapters = self.engine.lora_names()
        if model in adapters:
            return model
        names = ", ".join(repr(n) for n in self.served_names)
        raise NotFound(f"model: {shown(model)} is not served here; the model is served as {names}"
                       + (f", the LoRA adapters as {adapters}" if adapters else ""))

    def client(self, tenant_: str) -> str:
        """Whose request it is, for the fair policy (jaxcb.host.policies): with bearer tokens its token (what it
        says of itself changes nothing); without, the fairness id a gateway in front gives it (FAIRNESS_HEADER,
        the Gateway API Inference Extension's; this call's, by FAIRNESS), else everyone's one flow."""
        return tenant_ if self.options.tokens else FAIRNESS.get()

    def check_adapter_name(self, name: str) -> None:
        """A LoRA adapter's name must not be one the base model is served as."""
        if name in self.served_names:
            raise InvalidRequest(f"lora_name: {name!r} is a name the base model is served as")

    async def load_lora(self, owner_: str, name: str, path: str, replace: bool = False) -> None:
        """Load a PEFT adapter while serving (both APIs), as `owner_`'s (frontend.owner): with bearer tokens, a
        token loads at most its even share of lora.max_cpu_loras, and only it unloads what it loaded. `replace`
        (vLLM's load_inplace): in place of the adapter of that name (with bearer tokens, its loader's alone)."""
        self.check_adapter_name(name)
        async with self.loading_lora:  # (the share counted and taken in one go: loads side by side could pass it)
            await self._load_lora(owner_, name, path, replace)

    async def _load_lora(self, owner_: str, name: str, path: str, replace: bool) -> None:
        cap, tokens = self.engine.config.lora.max_cpu_loras, len(self.options.tokens)
        mine = sum(o == owner_ for o in self.lora_owners.values())
        replacing = replace and name in self.engine.lora_names()
        if replacing and self.options.tokens and self.lora_owners.get(name) != owner_:
            who = "the server's command line" if name not in self.lora_owners else "another token"
            raise PermissionDenied(f"lora_name: the adapter {shown(name)} was loaded by {who}; only its loader "
                                   "replaces it")
        if tokens > 1 and cap and mine >= max(1, cap // tokens) and not replacing:
            raise InvalidRequest(f"lora_name: this caller has {mine} adapters loaded, its share of lora.max_cpu_loras "
                                 f"({cap} among {tokens} tokens); unload one first")
        try:
            await asyncio.to_thread(self.engine.load_lora, name, path, replace)
        except InvalidConfig as e:  # what the adapter directory holds: the client's to fix
            raise InvalidRequest(f"lora_path: {e}") from None
        self.lora_owners[name] = owner_

    def unload_lora(self, owner_: str, name: str) -> bool:
        """Unload an adapter (at once, or when its running requests end: False). With bearer tokens, only the
        token that loaded it may; one of the command line's, none (PermissionDenied)."""
        if self.options.tokens and name in self.engine.lora_names() and self.lora_owners.get(name) != owner_:
            who = "the server's command line" if name not in self.lora_owners else "another token"
            raise PermissionDenied(f"lora_name: the adapter {shown(name)} was loaded by {who}; only its loader "
                                   "unloads it")
        done = self.engine.unload_lora(name)
        self.lora_owners.pop(name, None)
        return done

    def check_operator(self, tenant_: str) -> None:
        """The operator's calls (profiles, the prefix cache's reset, the RL routes): with bearer tokens, the first
        --auth-token's only (any other is refused: one tenant must not slow every other); without tokens, anyone's."""
        if self.options.tokens and tenant_ != "token0":
            raise PermissionDenied("this call is the operator's: the server's first --auth-token makes it")

    # ---- new weights while serving (vLLM's and SGLang's RL routes: the operator's, with --dev-routes) ----
    async def pause(self, mode: str, clear_cache: bool) -> None:
        """Every replica pauses (Engine.pause), returning once each is still."""
        self.pauses += 1
        with self.metrics.weight_operation("pause", self.engine):
            await self.settled(self.engine.pause(mode, clear_cache))

    async def resume(self) -> None:
        with self.metrics.weight_operation("resume", self.engine):
            await self.settled(self.engine.resume())

    async def sleep(self, level: int, mode: str) -> None:
        """Every replica sleeps (Engine.sleep), returning once each is asleep."""
        with self.metrics.weight_operation("sleep", self.engine):
            await self.settled(self.engine.sleep(level, mode))

    async def release_kv_cache(self) -> None:
        """Every replica's KV pages off the devices (Engine.release_kv_cache)."""
        with self.metrics.weight_operation("release_kv_cache", self.engine):
            await self.settled(self.engine.release_kv_cache())

    async def wake_up(self, parts) -> bool:
        """Whether every replica is whole again (Engine.wake_up)."""
        with self.metrics.weight_operation("wake_up", self.engine):
            return all(await self.settled(self.engine.wake_up(parts)))

    async def update_weights(self, path: str, version: str | None, abort: bool = False) -> None:
        """New weights from a checkpoint on this machine (jaxcb.weight_update), read off the event loop while the
        engines go on, taken between two steps: returns once every replica steps on them. One at a time. `abort`:
        every request ends first (a pause with "abort", resumed after unless the engines were paused before)."""
        from jaxcb import weight_update

        weight_update.check_version(version)
        weight_update.checked_path(path)  # (before any request is aborted)
        if self.updating.locked():
            raise Overloaded("model_path: new weights are being read already; try again when that update is done")
        async with self.updating:
            async with self.aborting_all(abort):
                with self.metrics.weight_operation("update", self.engine):
                    futures = await asyncio.to_thread(weight_update.update, self.engine.engines, path, version)
                    await self.settled(self.engine.woken(futures))

    @contextlib.asynccontextmanager
    async def aborting_all(self, abort: bool):
        """With `abort`, every request ends before the block (SGLang's abort_all_requests: a pause with "abort") and
        generation resumes after it, unless the engines were paused before."""
        resume = abort and not self.engine.paused
        if abort:
            await self.pause("abort", True)
        ours = self.pauses
        try:
            yield
        finally:
            if resume and self.pauses == ours:  # (an operator's pause since then stands)
                await self.resume()

    async def reset_weights(self) -> None:
        """Every weight zeroed (vLLM's weight checker's reset), taken as an update is."""
        if not all(hasattr(e.runner, "zeroed_params") for e in self.engine.engines):
            raise InvalidRequest("action: reset zeroes one process's weights; a multi-host cluster's are not")
        async with self.updating:
            with self.metrics.weight_operation("reset", self.engine):
                zeros = await asyncio.to_thread(lambda: [e.runner.zeroed_params() for e in self.engine.engines])
                await self.settled(self.engine.woken([e.swap_weights(z, e.weight_version)
                                                       for e, z in zip(self.engine.engines, zeros)]))

    def abort_requests(self, request_ids: list[str] | None) -> int:
        """vLLM's /abort_requests: the requests of these client ids (any tenant's; an HTTP call's prompts, id/0, id/1,
        ..., by its id too), or every request (None); how many were asked to end."""
        wanted = set(request_ids or ())
        keys = ({key for (_, rid), key in self.ids.items() if rid in wanted or rid.rpartition("/")[0] in wanted}
                if request_ids is not None else set(self.active))
        for key in keys:
            self.thread.abort(key)
        return len(keys)

    @staticmethod
    async def settled(futures: list, timeout_s: float = 600.0) -> list:
        """The engines' answers to what was put in their inboxes (Replicas' futures), awaited."""
        return await asyncio.wait_for(asyncio.gather(*map(asyncio.wrap_future, futures)), timeout_s)

    def admit(self, samples: int = 1) -> None:
        """Admission counts every sample of every request accepted and not finished (inbox included)
        and not yet running: `samples` more are refused if they would take that past max_waiting (a 429: later
        they may fit), and a request of more samples than max_waiting itself is refused as one that never fits (a 400:
        clients and SDKs send a 429 again)."""
        self.check_open()
        if samples > self.options.max_waiting > 0:
            raise InvalidRequest(f"n: {samples} samples (prompts x n) are more than the server ever queues; the limit "
                                 f"is {self.options.max_waiting} (--max-waiting)")
        waiting = max(0, self.active_samples - self.engine.stats().running)
        if waiting + samples > self.options.max_waiting:
            raise Overloaded(
                f"queue full: {waiting} samples already waiting and {samples} more asked for; the limit is "
                f"{self.options.max_waiting} (--max-waiting)")

    def engine_died(self) -> None:
        """Ends every open stream with an error: nothing will come from a dead engine."""
        for queue in self.queues.values():
            queue.put_nowait(_DIED)

    async def stream(self, prompt_ids: list[int], params: SamplingParams, priority: int, request_id: str,
                     tenant: str = "", cache_salt: str = ""):
        """Submit one request; yield (public id, TokenEvent) as they arrive; abort it if the call ends early."""
        self.admit(params.n)
        public = request_id or uuid.uuid4().hex
        key = uuid.uuid4().hex  # the engine's id for this request: unguessable, never reused
        if (tenant, public) in self.ids:
            raise InvalidRequest(f"request_id: {public!r} is already in use by a running request")
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        timers = [RequestTimer(self.metrics) for _ in range(params.n)]  # one per sample

        def on_event(ev: TokenEvent) -> None:  # engine thread
            timers[ev.index].on_event(ev)
            loop.call_soon_threadsafe(queue.put_nowait, ev)

        # With auth, each token's requests share cached prefixes only among themselves.
        salt = f"{tenant}\0{cache_salt}" if self.options.tokens else cache_salt
        self.thread.submit(prompt_ids, params, on_event, request_id=key, priority=priority, cache_salt=salt,
                           client=self.client(tenant))
        self.active[key] = params.n
        self.active_samples += params.n
        self.queues[key] = queue
        self.ids[tenant, public] = key
        finished = False
        samples_left = params.n
        try:
            while True:
                ev = await queue.get()
                if ev is _DIED:
                    raise Unavailable("the engine stopped; the request was not finished")
                if ev.finish_reason is FinishReason.ERROR and ev.request_error:  # (its constraint failed)
                    raise InvalidRequest(ev.error)
                if ev.finish_reason is FinishReason.ERROR:
                    raise StepFailed(f"the step running this request failed: {ev.error}")
                samples_left -= ev.finished
                finished = samples_left == 0
                yield public, ev
                if finished:
                    return
        finally:
            self.active_samples -= self.active.pop(key, 0)
            self.queues.pop(key, None)
            if self.ids.get((tenant, public)) == key:
                del self.ids[tenant, public]
            if not finished:
                self.thread.abort(key)

    async def pool(self, field: str, prompts: list[list[int]], params: SamplingParams, priority: int,
                   request_id: str, tenant: str, cache_salt: str, finish: Callable[[np.ndarray], object]) -> list[tuple]:
        """Run each prompt as a pooling request (SamplingParams.pooling; all checked before any is submitted, a
        prompt's ids named by the API's `field`; they run beside every other request): (`finish` of its pooled
        vector: an embedding as the model's pooling finishes it, a classifier's answer; its prompt tokens). One
        failing, or the call cancelled, aborts the rest."""
        for p in prompts:
            try:
                self.engine.validate(p, params)
            except InvalidRequest as e:  # (the engine names a prompt's ids by its own field)
                if e.field not in ("prompt", "prompt_token_ids"):
                    raise
                raise type(e)(field + str(e)[len(e.field):]) from None
        self.admit(len(prompts))

        async def one(i: int, ids: list[int]) -> TokenEvent:
            async with contextlib.aclosing(self.stream(ids, params, priority, f"{request_id}/{i}" if request_id else "",
                                                       tenant, cache_salt)) as events:
                async for _, ev in events:
                    if ev.finished:
                        return ev
            raise StepFailed("the request ended without its embedding")

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(i, ids)) for i, ids in enumerate(prompts)]
        except ExceptionGroup as e:  # the first failure, as a single request's would be
            raise e.exceptions[0] from None
        finals = [t.result() for t in tasks]
        return [(finish(ev.embedding), ev.num_prompt_tokens) for ev in finals]

    def abort(self, tenant: str, request_id: str) -> bool:
        key = self.ids.get((tenant, request_id))
        if key is None:
            return False
        self.thread.abort(key)
        return True


def token_index(tokens: tuple[str, ...], authorization: str) -> int | None:
    """Which of the server's tokens an `authorization` header carries (None: none). Every token is
    compared, in constant time, whatever matches."""
    given, found = authorization.encode(), None
    for i, token in enumerate(tokens):
        if hmac.compare_digest(given, f"Bearer {token}".encode()) and found is None:
            found = i
    return found


def tenant(state: State, authorization: str, peer: str) -> str:
    """Who is calling: the bearer token's index when the server has tokens (each token is a tenant),
    else the connection."""
    i = token_index(state.options.tokens, authorization)
    return f"peer:{peer}" if i is None else f"token{i}"


def owner(tenant_: str) -> str:
    """Whose kept state (the Responses API's responses and conversations) a tenant reaches: its token's where the
    server has tokens, each its own; else everyone's ("": a connection is no owner)."""
    return tenant_ if tenant_.startswith("token") else ""


_DIED = object()  # put on every open stream's queue when the engine dies


async def check_settings(state: State, params: SamplingParams) -> SamplingParams:
    """A request's settings against the model, before it is tokenized or queued: the token ids they name
    (stop_token_ids, logit_bias) against the vocabulary, then its structured-output constraint compiled and its
    bad_words spelt (both off the event loop); the params to run it with (bad_word_ids filled in)."""
    check_param_ids(params, state.engine.model_config.vocab_size)
    await check_constraint(state, params.structured)
    if params.bad_words:
        params = await asyncio.to_thread(resolve_bad_words, params, state.tokenizer)
        check_param_ids(params, state.engine.model_config.vocab_size)
    return params


async def check_constraint(state: State, constraint) -> None:
    """Compile a request's structured-output constraint off the event loop (cached by the engine), before
    the request is queued: InvalidRequest naming the problem, or the time limit."""
    if constraint is None:
        return
    try:
        await asyncio.wait_for(asyncio.to_thread(state.engine.check_constraint, constraint), MAX_COMPILE_S)
    except asyncio.TimeoutError:
        raise InvalidRequest(f"{constraint.field}: compiling the {constraint.kind} took longer than the limit of "
                             f"{MAX_COMPILE_S:g} s") from None


def check_text(field: str, text: str) -> None:
    """The size limits of a text prompt, before any work (shared by the gRPC and HTTP front ends)."""
    if not text:
        raise InvalidRequest(f"{field}: the prompt must not be empty")
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidRequest(f"{field}: {len(text)} characters; the limit is {MAX_TEXT_CHARS}")


def check_request_template(field: str, template, trusted: bool) -> str | None:
    """A request's own chat template (HTTP's chat_template, gRPC's ChatInput.chat_template; None for
    none): taken only by a server that trusts its clients' templates (--trust-request-chat-template),
    a non-empty string within MAX_TEMPLATE_CHARS, before any work. Returns it (None for none)."""
    if template is None:
        return None
    if not trusted:
        raise InvalidRequest(f"{field}: this server does not take a request's chat template (start it with "
                             "--trust-request-chat-template)")
    if not isinstance(template, str) or not template:
        raise InvalidRequest(f"{field}: must be a non-empty string (a Jinja chat template)")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise InvalidRequest(f"{field}: the template has {len(template)} characters; the limit is {MAX_TEMPLATE_CHARS}")
    return template


def check_messages(field: str, messages: list[tuple[str, str]]) -> None:
    """(role, content) pairs of a chat: count and total size, before any work."""
    if not messages:
        raise InvalidRequest(f"{field}: must not be empty")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"{field}: {len(messages)} messages; the limit is {MAX_MESSAGES}")
    total = sum(len(content) + len(role) for role, content in messages)
    if total > MAX_TEXT_CHARS:
        raise InvalidRequest(f"{field}: {total} characters in all; the limit is {MAX_TEXT_CHARS}")


async def prompt_ids(state: State, field: str, prompts: list, keep: int | None, encode) -> list[list[int]]:
    """Prompts (each a string or a list of token ids: a completion's, an embedding's inputs) as token ids, strings
    encoded by `encode` off the event loop, each cut to its last `keep` (truncate_prompt_tokens): every size (total
    characters, each text's, token counts) checked before any is tokenized."""
    total = sum(len(p) for p in prompts if isinstance(p, str))
    if total > MAX_TEXT_CHARS:
        raise InvalidRequest(f"{field}: {total} characters in all; the limit is {MAX_TEXT_CHARS}")
    for p in prompts:
        if isinstance(p, str):
            check_text(field, p)
            check_text_fits(state, field, len(p), keep)
        elif keep is None:
            check_token_count(state, field, len(p))
    vocab = state.engine.model_config.vocab_size
    for i, p in enumerate(prompts):  # (ids are decoded before the engine sees them: echo's text)
        if not isinstance(p, str):
            bad = outside_vocabulary(p, vocab)
            if bad is not None:
                where = f"{field}[{i}]" if len(prompts) > 1 else field
                raise InvalidRequest(f"{where}: token id {bad!r} is outside the vocabulary [0, {vocab})")
    texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
    encoded = await asyncio.to_thread(lambda: [encode(prompts[i]) for i in texts]) if texts else []
    ids = [list(p) for p in prompts]
    for i, e in zip(texts, encoded):
        ids[i] = e
    return [truncated(p, keep) for p in ids]


async def input_ids(state: State, field: str, inputs: list, keep: int | None) -> list[list[int]]:
    """Inputs to embed as token ids (prompt_ids), strings encoded as embedding models take them
    (Tokenizer.encode_input); at most MAX_EMBED_INPUTS of them, and the server's max_waiting."""
    if not inputs:
        raise InvalidRequest(f"{field}: must not be empty")
    check_input_count(state, field, len(inputs), "inputs")
    return await prompt_ids(state, field, inputs, keep, state.tokenizer.encode_input)


def check_input_count(state: State, field: str, n: int, what: str) -> None:
    """A pooling request's number of inputs (or of pairs to score): at most MAX_EMBED_INPUTS, and the server's
    max_waiting, since each is a request of its own."""
    limit = min(MAX_EMBED_INPUTS, state.options.max_waiting)
    if n > limit:
        raise InvalidRequest(f"{field}: {n} {what}; the limit is {limit}"
                             + (" (--max-waiting)" if limit < MAX_EMBED_INPUTS else ""))


async def scores(state: State, field: str, texts: list[str], pairs: list[tuple[int, int]], lora: str, priority: int,
                 request_id: str, tenant: str, cache_salt: str, keep: int | None,
                 template_kwargs: dict) -> tuple[list[float], int]:
    """The score of each pair (i, j) of `texts` (vLLM's score and rerank APIs, gRPC's Score), and the prompt tokens
    run: with a cross-encoder (a one-label classifier head) each pair is one input (pair_ids; `template_kwargs`:
    the score template's variables, classifier.score_kwargs) scored by the head's probability; otherwise every
    text is embedded once and a pair scores the cosine of its two vectors."""
    head = state.classifier
    if head is not None:
        head.check_scores()
        prompts = await pair_ids(state, field, [(texts[i], texts[j]) for i, j in pairs], keep, template_kwargs)
        params = SamplingParams(max_tokens=0, pooling="last", lora=lora)
        results = await state.pool(field, prompts, params, priority, request_id, tenant, cache_salt,
                                   lambda v: float(head.probs(v)[0]))
        return [s for s, _ in results], sum(n for _, n in results)
    dimensions = state.pooling.check(state.engine.model_config.hidden_size, None)
    prompts = await input_ids(state, field, texts, keep)
    params = SamplingParams(max_tokens=0, pooling=state.pooling.mode, lora=lora)
    results = await state.pool(field, prompts, params, priority, request_id, tenant, cache_salt,
                               lambda v: state.pooling.finish(v, dimensions))
    return cosines([v for v, _ in results], pairs), sum(n for _, n in results)


async def pair_ids(state: State, field: str, pairs: list[tuple[str, str]], keep: int | None,
                   template_kwargs: dict) -> list[list[int]]:
    """Text pairs as the model's cross-encoder takes them (Tokenizer.encode_pair), each cut to its last `keep`
    tokens: the count, the characters and each pair's length checked before any is tokenized (`field`: what the
    errors name)."""
    check_input_count(state, field, len(pairs), "pairs to score")
    total = sum(len(a) + len(b) for a, b in pairs)
    if total > MAX_TEXT_CHARS:
        raise InvalidRequest(f"{field}: {total} characters in all pairs; the limit is {MAX_TEXT_CHARS}")
    for a, b in pairs:
        check_text_fits(state, field, len(a) + len(b), keep)
    head = state.classifier
    encoded = await asyncio.to_thread(lambda: [state.tokenizer.encode_pair(a, b, head.joins_pairs, head.templated,
                                                                           template_kwargs) for a, b in pairs])
    return [truncated(p, keep) for p in encoded]


def check_ids(request_id: str, cache_salt: str) -> None:
    """The lengths of a request's id and cache salt, before any work."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id: {len(request_id)} characters; the limit is {MAX_REQUEST_ID_CHARS}")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"cache_salt: {len(cache_salt)} characters; the limit is {MAX_CACHE_SALT_CHARS}")




def check_token_count(state: State, field: str, n: int) -> None:
    check_prompt_length(field, n, state.engine.max_context)


def check_text_fits(state: State, field: str, chars: int, keep: int | None) -> None:
    """A text prompt (or a chat's contents) of `chars` characters kept whole (`keep` None: no
    truncate_prompt_tokens) that is longer than the context's prompt tokens of the vocabulary's longest token
    could hold is refused without tokenizing it (a megabyte of text costs a second or more of a core)."""
    limit, widest = state.engine.max_context - 1, state.tokenizer.max_token_chars
    if keep is None and chars > limit * widest:
        raise ContextTooLong(f"{field}: {chars} characters are more than {limit} tokens (the context of "
                             f"{state.engine.max_context}, one left to generate) can hold: a token is at most "
                             f"{widest} characters", state.engine.max_context)


def prompt_keep(state: State, value, side=None) -> int | None:
    """truncate_prompt_tokens (vLLM's), checked: how many of a prompt's tokens to keep (-1: as many as the
    context holds with one left to generate), its last ones, or with truncation_side "right" (`side`) its first
    ones (then negative: truncated's sign), or None to keep it whole."""
    if side is not None and side not in ("left", "right"):
        raise InvalidRequest(f"truncation_side: must be \"left\" or \"right\", got {shown(side)}")
    if value is None:
        return None
    limit = state.engine.max_context - 1
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or 1 <= value <= limit):
        raise InvalidRequest(f"truncate_prompt_tokens: must be -1 or between 1 and {limit}, got {value!r}")
    keep = limit if value == -1 else value
    return -keep if side == "right" else keep


def truncated(ids: list[int], keep: int | None) -> list[int]:
    """A prompt's ids cut as prompt_keep says, as vLLM cuts them: to its last `keep` (from the left), or with a
    negative `keep` to its first -keep (from the right)."""
    if keep is None or len(ids) <= abs(keep):
        return ids
    return ids[-keep:] if keep > 0 else ids[:-keep]
