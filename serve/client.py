"""Python clients for jaxcb's gRPC API: `Client` (blocking) and `AsyncClient` (asyncio).

    from serve.client import Client
    with Client("127.0.0.1:50051") as c:
        for chunk in c.generate("Why is the sky blue?", max_tokens=64, chat=True):
            print(chunk.text, end="", flush=True)
        result = c.complete("Hello", max_tokens=16)      # the whole completion at once
"""

from __future__ import annotations

import dataclasses
import json

import grpc

from serve.proto import jaxcb_pb2, jaxcb_pb2_grpc


@dataclasses.dataclass
class Chunk:
    token_ids: list[int]
    text: str
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # (token_id, logprob, rank, [(id, logprob), ...]) per prompt token after the first


@dataclasses.dataclass
class Result:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    index: int = 0  # which sample (GenerateRequest.n)
    prompt_logprobs: list | None = None  # prompt_logprobs: as Chunk's
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "logit_bias")


def build_request(prompt=None, *, messages=None, token_ids=None, chat: bool = False, max_tokens: int = 64,
                  stop=(), stop_token_ids=(), ignore_eos=False, min_tokens=0, priority=0, request_id="", logprobs=0,
                  n=1, cache_salt="", structured: dict | None = None, lora: str = "", model: str = "",
                  speculative: bool | None = None, chat_template_kwargs: dict | None = None,
                  include_stop_str_in_output: bool = False, continue_final_message: bool = False, allowed_token_ids=(),
                  chat_template: str = "", bad_words=(),
                  truncate_prompt_tokens: int | None = None, truncation_side: str | None = None,
                  prompt_logprobs: int | None = None,
                  skip_special_tokens: bool | None = None, **sampling) -> jaxcb_pb2.GenerateRequest:
    """prompt: text (with chat=True it becomes one user message); or messages; or token_ids.
    structured: one constraint on the output, as {"json_schema": "<schema JSON>"}, {"json_object": True},
    {"regex": "..."}, {"choice": ["a", "b"]} or {"grammar": "..."}. lora: a loaded LoRA adapter's name;
    model: a name the model is served as, or an adapter's ("": the base model). speculative: False opts
    the request out of the server's speculative decoding (None: as the server does). chat_template_kwargs:
    more variables for the chat template of a chat prompt, e.g. {"enable_thinking": False};
    continue_final_message: the model goes on writing the final (assistant) message. chat_template: the
    request's own Jinja template (a server started with --trust-request-chat-template takes it)."""
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling settings: {', '.join(sorted(unknown))}")
    req = jaxcb_pb2.GenerateRequest(max_tokens=max_tokens, stop=list(stop), stop_token_ids=list(stop_token_ids),
                                    ignore_eos=ignore_eos, min_tokens=min_tokens, priority=priority,
                                    request_id=request_id, logprobs=logprobs, n=n, cache_salt=cache_salt, lora=lora,
                                    model=model, include_stop_str_in_output=include_stop_str_in_output,
                                    allowed_token_ids=list(allowed_token_ids), bad_words=list(bad_words))
    if speculative is not None:
        req.speculative = speculative
    if truncate_prompt_tokens is not None:
        req.truncate_prompt_tokens = truncate_prompt_tokens
    if truncation_side is not None:
        req.truncation_side = truncation_side
    if prompt_logprobs is not None:
        req.prompt_logprobs = prompt_logprobs
    if skip_special_tokens is not None:
        req.skip_special_tokens = skip_special_tokens
    for kind, value in (structured or {}).items():
        if kind == "choice":
            req.structured.choice.values.extend(value)
        else:
            setattr(req.structured, kind, json.dumps(value) if kind == "structural_tag" and not isinstance(value, str)
                    else value)
    for k, v in sampling.items():
        if k == "logit_bias":  # {token id: bias}
            req.sampling.logit_bias.update({int(t): float(b) for t, b in (v or {}).items()})
        elif v is not None:
            setattr(req.sampling, k, v)
    if token_ids is not None:
        req.tokens.token_ids.extend(token_ids)
    elif messages is not None or chat:
        msgs = messages if messages is not None else [{"role": "user", "content": prompt}]
        req.chat.messages.extend(jaxcb_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in msgs)
        if chat_template_kwargs:
            req.chat.template_kwargs = json.dumps(chat_template_kwargs)
        if continue_final_message:  # the final message goes on: no new assistant turn
            req.chat.continue_final_message = True
            req.chat.add_generation_prompt = False
        if chat_template:
            req.chat.chat_template = chat_template
    else:
        req.text = prompt
    return req


def _channel(target, tls_root_cert, aio):
    mod = grpc.aio if aio else grpc
    if tls_root_cert is not None:
        with open(tls_root_cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(f.read())
        return mod.secure_channel(target, creds)
    return mod.insecure_channel(target)


def _metadata(token):
    return (("authorization", f"Bearer {token}"),) if token else None


class _Collector:
    """Turns response messages into Chunks, and the final message into the whole Result."""

    def __init__(self):
        self.ids: list[int] = []
        self.text: list[str] = []
        self.prompt_logprobs: list | None = None

    def add(self, resp) -> Chunk | Result:
        if resp.HasField("chunk"):
            lps = [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in resp.chunk.logprobs]
            prompt = [(lp.token_id, lp.logprob, lp.rank, [(t.token_id, t.logprob) for t in lp.top])
                      for lp in resp.chunk.prompt_logprobs]
            chunk = Chunk(list(resp.chunk.token_ids), resp.chunk.text, lps or None, prompt or None)
            if prompt:
                self.prompt_logprobs = prompt
            self.ids.extend(chunk.token_ids)
            self.text.append(chunk.text)
            return chunk
        u, which = resp.final.usage, resp.final.WhichOneof("stop_reason")
        return Result(resp.request_id, self.ids, "".join(self.text), resp.final.finish_reason, u.prompt_tokens,
                      u.completion_tokens, u.cached_prompt_tokens, resp.index, self.prompt_logprobs,
                      getattr(resp.final, which) if which else None)


def _result(responses) -> Result:
    collector = _Collector()
    for resp in responses:
        item = collector.add(resp)
        if isinstance(item, Result):
            return item
    raise RuntimeError("the stream ended without a final message")


class Client:
    def __init__(self, target: str = "127.0.0.1:50051", *, token: str | None = None, tls_root_cert: str | None = None):
        self.channel = _channel(target, tls_root_cert, aio=False)
        self.stub = jaxcb_pb2_grpc.JaxcbStub(self.channel)
        self.metadata = _metadata(token)

    def stream(self, request: jaxcb_pb2.GenerateRequest, timeout: float | None = None):
        """The raw response stream (cancel it with .cancel())."""
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def generate(self, prompt=None, *, timeout=None, **kw):
        """Yield Chunks as they arrive; the last item is the Result."""
        collector = _Collector()
        for resp in self.stream(build_request(prompt, **kw), timeout):
            yield collector.add(resp)

    def complete(self, prompt=None, *, timeout=None, **kw) -> Result:
        return _result(self.stream(build_request(prompt, **kw), timeout))

    def complete_samples(self, prompt=None, *, n: int, timeout=None, **kw) -> list[Result]:
        """n samples of one prompt (they share its prefill), in index order."""
        collectors: dict[int, _Collector] = {}
        results: dict[int, Result] = {}
        for resp in self.stream(build_request(prompt, n=n, **kw), timeout):
            item = collectors.setdefault(resp.index, _Collector()).add(resp)
            if isinstance(item, Result):
                results[resp.index] = item
        if len(results) != n:
            raise RuntimeError(f"the stream ended after {len(results)} of {n} samples")
        return [results[i] for i in range(n)]

    def embed(self, inputs, *, timeout=None, **fields) -> jaxcb_pb2.EmbedResponse:
        """The embeddings of `inputs` (each a string or a list of token ids); `fields`: EmbedRequest's others
        (dimensions, model, priority, request_id, cache_salt, truncate_prompt_tokens)."""
        return self.stub.Embed(jaxcb_pb2.EmbedRequest(inputs=_inputs(inputs), **fields), timeout=timeout,
                               metadata=self.metadata)

    def classify(self, inputs, *, timeout=None, **fields) -> jaxcb_pb2.ClassifyResponse:
        """The labels' probabilities of `inputs` (each a string or a list of token ids) through the model's
        classifier head; `fields`: ClassifyRequest's others (model, priority, request_id, cache_salt,
        truncate_prompt_tokens)."""
        return self.stub.Classify(jaxcb_pb2.ClassifyRequest(inputs=_inputs(inputs), **fields), timeout=timeout,
                                  metadata=self.metadata)

    def score(self, text_1, text_2, *, timeout=None, **fields) -> jaxcb_pb2.ScoreResponse:
        """text_1 (a string, or a list as long as text_2) against each of text_2 (a string or a list), by the model's
        cross-encoder or its embeddings' cosine; `fields`: ScoreRequest's others (model, priority, request_id,
        cache_salt, truncate_prompt_tokens)."""
        listed = lambda t: [t] if isinstance(t, str) else list(t)  # noqa: E731
        return self.stub.Score(jaxcb_pb2.ScoreRequest(text_1=listed(text_1), text_2=listed(text_2), **fields),
                               timeout=timeout, metadata=self.metadata)

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(jaxcb_pb2.AbortRequest(request_id=request_id), metadata=self.metadata).found

    def model_info(self):
        return self.stub.GetModelInfo(jaxcb_pb2.GetModelInfoRequest(), metadata=self.metadata)

    def server_info(self):
        return self.stub.GetServerInfo(jaxcb_pb2.GetServerInfoRequest(), metadata=self.metadata)

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _inputs(inputs) -> list:
    """Embed's and Classify's inputs: strings, or lists of token ids."""
    return [jaxcb_pb2.EmbedInput(text=i) if isinstance(i, str) else
            jaxcb_pb2.EmbedInput(tokens=jaxcb_pb2.TokenInput(token_ids=list(i))) for i in inputs]


class AsyncClient:
    def __init__(self, target: str = "127.0.0.1:50051", *, token: str | None = None, tls_root_cert: str | None = None):
        self.channel = _channel(target, tls_root_cert, aio=True)
        self.stub = jaxcb_pb2_grpc.JaxcbStub(self.channel)
        self.metadata = _metadata(token)

    def stream(self, request: jaxcb_pb2.GenerateRequest, timeout: float | None = None):
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    async def generate(self, prompt=None, *, timeout=None, **kw):
        """Yield Chunks as they arrive; the last item is the Result."""
        collector = _Collector()
        async for resp in self.stream(build_request(prompt, **kw), timeout):
            yield collector.add(resp)

    async def complete(self, prompt=None, *, timeout=None, **kw) -> Result:
        last = None
        async for item in self.generate(prompt, timeout=timeout, **kw):
            last = item
        if not isinstance(last, Result):
            raise RuntimeError("the stream ended without a final message")
        return last

    async def server_info(self):
        return await self.stub.GetServerInfo(jaxcb_pb2.GetServerInfoRequest(), metadata=self.metadata)

    async def close(self):
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
