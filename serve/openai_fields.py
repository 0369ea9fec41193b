"""The OpenAI HTTP API's request fields: the error shape, each field's type and range, the options both
endpoints share, the prompt shapes and the JSON body itself. Every check here runs before a request
starts (serve.openai_api), and a refusal names the field ("field: what is wrong"): an HTTPError, or
one of jaxcb's error kinds that the app's handler answers with http_error()."""

from __future__ import annotations

import dataclasses
import re

from fastapi.responses import JSONResponse

from jaxcb.host.errors import (ContextTooLong, InvalidRequest, JaxcbError, NotFound, Overloaded, PermissionDenied,
                               StepFailed, Unauthenticated, Unavailable, shown)
from jaxcb.host.request import (SamplingParams, check_allowed_count, check_bad_words, check_priority, check_stop_counts,
                                logit_bias_from_json, read_json)
from jaxcb.host.structured import (GUIDED_EXTRAS, GUIDED_FIELDS, Constraint, from_guided, from_response_format,
                                   from_structured_outputs)
from jaxcb.host.chat_template import check_template_kwargs
from serve import frontend

HTTP_STATUS = {InvalidRequest: 400, NotFound: 404, Overloaded: 429, Unavailable: 503, Unauthenticated: 401, StepFailed: 500,
               PermissionDenied: 403}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
              408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
              503: "service_unavailable"}
EXTRAS = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
          "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids", "truncate_prompt_tokens", "truncation_side",
          "priority", "cache_salt", "request_id", "prompt_logprobs", *GUIDED_FIELDS, *GUIDED_EXTRAS,
          "structured_outputs", "speculative", "use_beam_search", "length_penalty", "return_token_ids", "bad_words",
          "return_tokens_as_token_ids", "repetition_detection", "stream_interval", "thinking_token_budget",
          "spaces_between_special_tokens"}
# OpenAI's fields about its own service that say nothing about the output (storing completions, billing
# tier, cache routing, abuse tracking): SDKs and frameworks send them, a self-hosted server has nothing to
# do with them. Their types are checked; anything else unknown is a 400 naming it.
SERVICE_FIELDS = {"store": bool, "metadata": dict, "service_tier": str, "prompt_cache_key": str, "safety_identifier": str,
                  "prompt_cache_retention": str, "prompt_cache_options": dict,  # (the prefix cache keeps what it can)
                  "session_id": str}  # (vLLM's: a conversation's requests; the prefix cache finds them anyway)
# OpenAI's chat fields for what this server has not (audio out, built-in web search, the functions that tools
# replaced) are refused by name; hints that leave the output as it is (a predicted output, verbosity) are
# checked and change nothing; reasoning_effort goes to the chat template (reasoning models' templates read it).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
VERBOSITIES = ("low", "medium", "high")
CHAT_SPEC_FIELDS = {"reasoning_effort", "functions", "function_call", "modalities", "audio", "prediction", "verbosity",
                    "web_search_options"}
COMMON_FIELDS = {"model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "presence_penalty",
           "frequency_penalty", "seed", "stop", "user", "logit_bias", *SERVICE_FIELDS}
COMPLETION_FIELDS = COMMON_FIELDS | EXTRAS | {"prompt", "logprobs", "echo", "suffix", "best_of", "response_format",
                                              "add_special_tokens"}
CHAT_FIELDS = COMMON_FIELDS | EXTRAS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                                    "response_format", "tools", "tool_choice", "parallel_tool_calls",
                                    "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                                    "chat_template", "include_reasoning", "add_special_tokens", "echo", "documents",
                                    "return_prompt_text",
                                    *CHAT_SPEC_FIELDS}
TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "continue_final_message",
                   "documents",
                   "return_token_strs", "chat_template_kwargs", "chat_template", "tools", "tool_choice",
                   "parallel_tool_calls", "reasoning_effort"}
DETOKENIZE_FIELDS = {"model", "tokens"}
# OpenAI's embeddings fields, and vLLM's extras that apply to them
# vLLM's chat-style input to the pooling APIs (embeddings, classify): one conversation through the chat template
CHAT_INPUT_FIELDS = {"messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                     "chat_template", "add_special_tokens"}
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens",
                    "truncation_side", "priority",
                    "request_id", "cache_salt", *SERVICE_FIELDS, *CHAT_INPUT_FIELDS}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": ERROR_TYPE.get(self.status, "error"), "param": self.param,
            "code": self.code}})


def bad_request(message: str) -> HTTPError:
    """A message ("field: what is wrong") as a 400 naming that field."""
    return http_error(InvalidRequest(message))


def http_error(e: JaxcbError) -> HTTPError:
    """One of jaxcb's errors as its HTTP status (its nearest kind in HTTP_STATUS; 500 if none), naming
    the field it names."""
    status = next((HTTP_STATUS[kind] for kind in type(e).__mro__ if kind in HTTP_STATUS), 500)
    message = str(e)
    if isinstance(e, ContextTooLong) and e.context:  # (OpenAI's and vLLM's words, which client libraries look for)
        message += f" (This model's maximum context length is {e.context} tokens.)"
    return HTTPError(status, message, param=e.field if status == 400 else None,
                     code="context_length_exceeded" if isinstance(e, ContextTooLong) else None)


def _typed(body: dict, name: str, default, ok, what: str):
    """body[name] if it passes `ok` (absent or null: `default`), else a 400 naming the field."""
    v = body.get(name)
    if v is None:
        return default
    if not ok(v):
        raise bad_request(f"{name}: must be {what}, got {shown(v)}")
    return v


def int_field(body: dict, name: str, default=None):
    """An integer field; a float that is a whole number is taken as that integer (Python clients write 2.0
    where they computed it; vLLM's pydantic takes it too), a fraction is refused."""
    v = _typed(body, name, default, lambda v: (isinstance(v, int) and not isinstance(v, bool))
               or (isinstance(v, float) and v.is_integer() and abs(v) < 2**63), "an integer")
    return int(v) if isinstance(v, float) else v


def number_field(body: dict, name: str, default):
    v = _typed(body, name, None, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
    if v is None:
        return default
    try:
        return float(v)
    except OverflowError:  # an integer of hundreds of digits
        raise bad_request(f"{name}: must be a finite number, got an integer too large") from None


def bool_field(body: dict, name: str, default: bool) -> bool:
    return _typed(body, name, default, lambda v: isinstance(v, bool), "true or false")


def str_field(body: dict, name: str, default: str) -> str:
    return _typed(body, name, default, lambda v: isinstance(v, str), "a string")


def _ids_field(body: dict, name: str, check_count) -> list[int]:
    """body[name] as a list of token ids (absent or null: none), its length checked before it is read."""
    ids = body.get(name)
    if ids is None:
        return []
    if not isinstance(ids, list):
        raise bad_request(f"{name}: must be a list of token ids")
    check_count(len(ids))
    if not is_token_ids(ids):
        raise bad_request(f"{name}: must be a list of token ids")
    return ids


def template_fields(body: dict, trusted: bool, generation_prompt: bool = True) -> tuple[bool, dict, bool, str | None]:
    """The chat template's fields of a chat or /tokenize body, checked, in Tokenizer.encode_chat's order:
    add_generation_prompt (default `generation_prompt`: false for the pooling APIs' chat input, as vLLM's),
    chat_template_kwargs, continue_final_message, chat_template (the request's own template, vLLM's field: taken
    only from a server that trusts its clients' templates, `trusted`)."""
    template = frontend.check_request_template("chat_template", body.get("chat_template"), trusted)
    kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
    effort = _typed(body, "reasoning_effort", None, lambda v: v in REASONING_EFFORTS, f"one of {REASONING_EFFORTS}")
    if effort is not None and "reasoning_effort" not in kwargs:  # (vLLM's: the template reads it)
        kwargs = {**kwargs, "reasoning_effort": effort}
    documents = check_documents(body.get("documents"))
    if documents is not None:  # (vLLM's: a retrieval template, e.g. Command R's or Granite's, writes them)
        kwargs = {**kwargs, "documents": documents}
    return (bool_field(body, "add_generation_prompt", generation_prompt), kwargs,
            bool_field(body, "continue_final_message", False), template)


MAX_DOCUMENTS = 1024  # a chat's `documents`


def check_documents(documents) -> list[dict] | None:
    """vLLM's chat `documents`: a list of objects of strings (each {"title", "text"}, say), at most MAX_DOCUMENTS,
    MAX_TEXT_CHARS characters in all; None where not given."""
    if documents is None:
        return None
    if not isinstance(documents, list) or not all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents):
        raise bad_request("documents: must be a list of objects of strings (e.g. {\"title\": ..., \"text\": ...})")
    if len(documents) > MAX_DOCUMENTS:
        raise bad_request(f"documents: at most {MAX_DOCUMENTS}, got {len(documents)}")
    chars = sum(len(k) + len(v) for d in documents for k, v in d.items())
    if chars > frontend.MAX_TEXT_CHARS:
        raise bad_request(f"documents: {chars} characters in all; the limit is {frontend.MAX_TEXT_CHARS}")
    return documents


def check_chat_spec_fields(body: dict) -> None:
    """OpenAI's chat fields of CHAT_SPEC_FIELDS but reasoning_effort (template_fields'): refused by name where
    this server has not what they ask for, else checked."""
    for name, why in (("functions", "OpenAI's deprecated form of tools: send tools"),
                      ("function_call", "OpenAI's deprecated form of tool_choice: send tool_choice"),
                      ("audio", "audio output is not served"),
                      ("web_search_options", "built-in web search is not served")):
        if name in body:
            raise bad_request(f"{name}: {why}")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request(f"modalities: only [\"text\"] is served, got {shown(modalities)}")
    _typed(body, "prediction", None, lambda v: isinstance(v, dict), "an object")
    _typed(body, "verbosity", None, lambda v: v in VERBOSITIES, f"one of {VERBOSITIES}")


def placeholder_max_tokens(body: dict) -> int:
    """max_tokens to check the other fields with where the real one needs the prompt's length (a limit up to the
    context): at least min_tokens, which must fit under it."""
    return max(1, int_field(body, "min_tokens", 0) or 0)


def sampling_params(body: dict, *, max_tokens: int, logprobs: int, prompt_logprobs: int | None = None,
                    defaults: dict | None = None, thinking_tags: tuple[int, int] | None = None) -> SamplingParams:
    """The request's SamplingParams. `prompt_logprobs`: at least this many alternatives for each prompt
    token (completions' echo with logprobs), besides what vLLM's prompt_logprobs field asks for. `defaults`: what
    the request leaves out of temperature, top_p, top_k, min_p and repetition_penalty (the model's
    generation_config.json, State.sampling_defaults), else OpenAI's."""
    d = defaults or {}
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise bad_request("stop: must be a string or a list of strings")
    if isinstance(stop, list):
        check_stop_counts(len(stop), 0)
    if isinstance(stop, list) and not all(isinstance(x, str) for x in stop):
        raise bad_request("stop: must be a string or a list of strings")
    stop_token_ids = _ids_field(body, "stop_token_ids", lambda n: check_stop_counts(0, n))
    allowed = _ids_field(body, "allowed_token_ids", check_allowed_count)
    if body.get("allowed_token_ids") == []:  # (vLLM's: an empty list would allow no token)
        raise bad_request("allowed_token_ids: must not be empty (leave it out to allow every token)")
    ignore_eos = bool_field(body, "ignore_eos", False)
    # (vLLM's; its fast tokenizers' decoding, as jaxcb's, puts no space between special tokens either way)
    bool_field(body, "spaces_between_special_tokens", True)
    bad_words = body.get("bad_words") or []
    if not isinstance(bad_words, list):
        raise bad_request("bad_words: must be a list of strings")
    check_bad_words(bad_words)
    repetition = body.get("repetition_detection")
    if repetition is not None:
        if not isinstance(repetition, dict) or set(repetition) - {"max_pattern_size", "min_pattern_size", "min_count"}:
            raise bad_request("repetition_detection: must be an object of max_pattern_size, min_pattern_size and "
                              "min_count")
        repetition = tuple(repetition.get(k, 0) for k in ("max_pattern_size", "min_pattern_size", "min_count"))
    asked = int_field(body, "prompt_logprobs")
    if prompt_logprobs is not None:
        asked = prompt_logprobs if asked is None else max(asked, prompt_logprobs)
    return SamplingParams(prompt_logprobs=asked,
        max_tokens=max_tokens, temperature=number_field(body, "temperature", d.get("temperature", 1.0)),
        top_p=number_field(body, "top_p", d.get("top_p", 1.0)), top_k=int_field(body, "top_k", d.get("top_k", 0)),
        min_p=number_field(body, "min_p", d.get("min_p", 0.0)),
        repetition_penalty=number_field(body, "repetition_penalty", d.get("repetition_penalty", 1.0)),
        presence_penalty=number_field(body, "presence_penalty", 0.0),
        frequency_penalty=number_field(body, "frequency_penalty", 0.0), seed=int_field(body, "seed"),
        stop=stop or (), stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
        include_stop_str_in_output=bool_field(body, "include_stop_str_in_output", False),
        skip_special_tokens=bool_field(body, "skip_special_tokens", True),
        allowed_token_ids=allowed, bad_words=tuple(bad_words), repetition_detection=repetition,
        thinking_token_budget=int_field(body, "thinking_token_budget"), thinking_tags=thinking_tags,
        min_tokens=int_field(body, "min_tokens", 0), logprobs=logprobs, n=int_field(body, "n", 1),
        structured=constraint_of(body), speculative=bool_field(body, "speculative", True),
        logit_bias=logit_bias_from_json(body.get("logit_bias")))


def constraint_of(body: dict) -> Constraint | None:
    """The request's structured output: OpenAI's response_format, vLLM's structured_outputs or its older
    guided_* fields (one of them)."""
    given = [(name, c) for name, c in (("response_format", from_response_format(body.get("response_format"))),
                                       ("structured_outputs", from_structured_outputs(body.get("structured_outputs"))),
                                       ("guided_*", from_guided(body))) if c is not None]
    if len(given) > 1:
        raise InvalidRequest(f"structured_outputs: give one of response_format, structured_outputs and vLLM's "
                             f"guided_* fields, not both {given[0][0]} and {given[1][0]}")
    return given[0][1] if given else None


MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


def parse_json(raw: bytes) -> dict:
    body = read_json(raw, "body")
    if not isinstance(body, dict):
        raise HTTPError(400, "body: must be a JSON object", param="body")
    return body


@dataclasses.dataclass(frozen=True)
class RequestOptions:
    """The request's fields that are not sampling settings, checked before any work."""

    stream: bool
    include_usage: bool
    priority: int
    cache_salt: str
    request_id: str
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's): usage in every chunk
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:N"
    stream_interval: int = 1  # tokens a streamed chunk holds (vLLM's; the first and the last sent at once)
    prompt_text: bool = False  # vLLM's return_prompt_text (chat): the prompt's text beside the answer


def check_metadata(metadata) -> None:
    """OpenAI's `metadata` (chat and Responses alike): at most 16 pairs, keys of at most 64 characters,
    string values of at most 512 (absent or null: none)."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise bad_request("metadata: must be an object of at most 16 pairs")
    for k, v in metadata.items():
        if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise bad_request(f"metadata: {k[:64]!r}: keys of at most 64 characters, string values of at most 512")


def common_fields(body: dict) -> RequestOptions:
    """Checks every field both endpoints share that SamplingParams does not (types and ranges)."""
    stream = bool_field(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request(f"stream_options: must be an object, got {stream_options!r}")
    stream_options = stream_options or {}
    # (include_obfuscation, OpenAI's: random padding against length side channels on its network: none here)
    unknown = sorted(set(stream_options) - {"include_usage", "continuous_usage_stats", "include_obfuscation"})
    if unknown:
        raise unknown_field("stream_options", unknown[0])
    named = {f"stream_options.{k}": v for k, v in stream_options.items()}  # (errors name the whole field)
    bool_field(named, "stream_options.include_obfuscation", False)
    include_usage = bool_field(named, "stream_options.include_usage", False)
    continuous = bool_field(named, "stream_options.continuous_usage_stats", False)
    if stream_options and not stream:
        raise bad_request("stream_options: only with stream: true")
    priority = int_field(body, "priority", 0)
    salt, request_id = str_field(body, "cache_salt", ""), str_field(body, "request_id", "")
    str_field(body, "user", "")
    for name, kind in SERVICE_FIELDS.items():
        _typed(body, name, None, lambda v, kind=kind: isinstance(v, kind),
               {bool: "true or false", dict: "an object", str: "a string"}[kind])
    check_metadata(body.get("metadata"))
    check_priority(priority)
    frontend.check_ids(request_id, salt)
    interval = int_field(body, "stream_interval", 1)
    if not 1 <= interval <= frontend.MAX_STREAM_INTERVAL:
        raise bad_request(f"stream_interval: must be between 1 and {frontend.MAX_STREAM_INTERVAL}, got {interval}")
    return RequestOptions(stream, include_usage, priority, salt, request_id, include_usage and continuous,
                          bool_field(body, "return_token_ids", False),
                          bool_field(body, "return_tokens_as_token_ids", False), interval,
                          bool_field(body, "return_prompt_text", False))


def is_token_ids(p) -> bool:
    return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def prompt_list(prompt, field: str = "prompt", limit: int = frontend.MAX_PROMPTS) -> list:
    """`prompt` (the completions' prompt, the embeddings' input) as a list of prompts (each a string or a list of
    token ids), shapes checked; at most `limit` of them."""
    shapes = f"{field}: must be a string, a list of strings, a list of token ids or a list of lists"
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(shapes)
    if is_token_ids(prompt):
        prompt = [prompt]
    if len(prompt) > limit:
        raise bad_request(f"{field}: {len(prompt)} {'prompts' if field == 'prompt' else 'inputs'}; the limit is {limit}")
    if not all(isinstance(p, str) or is_token_ids(p) for p in prompt):
        raise bad_request(shapes)
    return prompt


def unknown_field(where: str, name: str, of: str = "this endpoint takes") -> HTTPError:
    """An unknown field, named as the field when it is a plain name, else inside `where`'s message
    (`of`: what it is no field of, e.g. "of a message item")."""
    if re.fullmatch(r"[a-z_][a-z0-9_]*", name):
        return bad_request(f"{where + '.' if where != 'body' else ''}{name}: not a field {of}")
    return bad_request(f"{where}: {name[:64]!r} is not a field {of}")


def list_query(query, more: set, most: int, default: int) -> tuple[int, str]:
    """A list call's query (OpenAI's lists): no parameter but `limit` (1 to `most`, `default`), `order` (desc, the
    default, or asc), `after` and the list's own `more`; returns (limit, order)."""
    unknown = sorted(set(query) - {"limit", "order", "after"} - more)
    if unknown:
        raise bad_request(f"{unknown[0][:64]}: not a parameter of this list")
    limit = query.get("limit", str(default))
    if not (limit.isascii() and limit.isdigit() and len(limit) < 7 and 1 <= int(limit) <= most):
        raise bad_request(f"limit: must be an integer from 1 to {most}, got {shown(limit)}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order: must be asc or desc, got {shown(order)}")
    return int(limit), order


def list_page(page: list[dict], has_more: bool) -> dict:
    """OpenAI's list object of one page."""
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": has_more}


def check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise unknown_field("body", unknown[0])


def beam_fields(body: dict) -> float | None:
    """vLLM's use_beam_search and length_penalty: the length penalty when the call asks for beam search,
    else None (a length_penalty without it is refused: it would change nothing)."""
    beam = bool_field(body, "use_beam_search", False)
    if not beam and "length_penalty" in body:
        raise bad_request("length_penalty: only with use_beam_search")
    return number_field(body, "length_penalty", 1.0) if beam else None
