"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the chat completions
machinery, as vLLM and llama.cpp's server serve it, so that clients written for it (Anthropic's SDKs, coding
agents) reach the model served here.

A call's `system` and `messages` become the chat's messages: text blocks joined by newlines (as chat content
parts are), an assistant's `tool_use` blocks its tool calls (the input as the arguments' JSON), a user's
`tool_result` blocks tool messages before the text that follows them, earlier `thinking` blocks left out
(the chat templates of thinking models drop earlier thinking too); `tools` ({name, description, input_schema})
become function tools, `tool_choice` ({type: auto, any, tool, none}, disable_parallel_tool_use) the chat's;
`max_tokens` (required), `stop_sequences`, temperature, top_p, top_k (older clients' fields) and the server's
extras (seed, min_p, ignore_eos, ...) pass on; `thinking` sets the chat template's enable_thinking (false where
disabled; its budget is not enforced), `output_config` its effort as the chat's reasoning_effort and its format
(a JSON schema) as response_format, enforced; a last assistant message is a prefill, continued. Hints (cache_control:
the prefix cache keeps what it can anyway; speed, inference_geo, context_management: no context edits are made,
a conversation past the context is refused as any other) are checked and change nothing. The answer: `text`, `tool_use` and, on a server with a reasoning
parser, `thinking` content blocks, `stop_reason` end_turn / max_tokens / stop_sequence (with the sequence) /
tool_use, and usage (input_tokens beside cache_read_input_tokens, the prompt's tokens served from the prefix
cache, as Anthropic counts them); streamed as its events (message_start, content_block_start / _delta / _stop,
message_delta, message_stop; an error event mid-stream). Errors are Anthropic's shape ({type: error, error:
{type, message}}), the message naming the call's own field; `x-api-key` is taken for the bearer token.
Images, documents, server tools, MCP servers and containers are refused by name.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid

from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxcb.host.errors import shown
from serve.openai_fields import HTTPError, bad_request, check_fields, int_field, unknown_field
from serve.openai_responses import own, renamed

EXTRAS = {"min_p", "repetition_penalty", "seed", "ignore_eos", "priority", "cache_salt", "request_id",
          "presence_penalty", "frequency_penalty", "min_tokens"}  # the chat's, passed on as vLLM's extras are
PASSED_ON = {"model", "stream", "temperature", "top_p", "top_k", *EXTRAS}
# hints taken and changing nothing here (the prefix cache keeps what it can without cache_control)
# and context_management: its edits clear old tool results when a context grows past a threshold; none are made
# here (a conversation that outgrows the context is refused with the context's limit, as any other)
HINTS = {"cache_control", "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id", "service_tier",
         "context_management"}
OBJECT_HINTS = ("cache_control", "diagnostics", "context_management")
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "mcp_servers",
                "container", *HINTS}
MESSAGES_FIELDS = {*COUNT_FIELDS, *PASSED_ON, "max_tokens", "stop_sequences", "metadata"}
NOT_SERVED = {"mcp_servers": "MCP servers are not served", "container": "code execution containers are not served"}
BLOCK_FIELDS = {"text": {"type", "text", "cache_control", "citations"},
                "tool_use": {"type", "id", "name", "input", "cache_control", "caller", "toolset_name"},
                "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"},
                "thinking": {"type", "thinking", "signature"}, "redacted_thinking": {"type", "data"}}
# A chat field an error names -> this API's (the longest first).
RENAMES = (("response_format.json_schema.schema", "output_config.format.schema"),
           ("response_format.json_schema", "output_config.format"), ("response_format", "output_config.format"),
           ("reasoning_effort", "output_config.effort"), ("max_completion_tokens", "max_tokens"),
           ("stop", "stop_sequences"), ("tool_choice.function", "tool_choice"), ("prompt", "messages"))
EFFORTS = ("low", "medium", "high", "xhigh", "max")
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
              503: "overloaded_error"}


def error_response(e: HTTPError) -> JSONResponse:
    """An error as Anthropic's API gives it."""
    return JSONResponse(status_code=e.status, content={"type": "error", "error": {
        "type": ERROR_TYPE.get(e.status, "api_error"), "message": e.message}})


def _text(where: str, content, kinds=("text",)) -> str:
    """A string, or a list of text blocks joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of content blocks")
    texts = []
    for j, block in enumerate(content):
        kind = _kind(f"{where}[{j}]", block)
        if kind not in kinds:
            raise bad_request(f"{where}[{j}].type: {shown(kind)} is not supported here; text blocks only")
        texts.append(_block_text(f"{where}[{j}]", block))
    return "\n".join(texts)


def _kind(where: str, block) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise bad_request(f"{where}: must be a content block, an object with a type")
    if kind not in BLOCK_FIELDS:
        raise bad_request(f"{where}.type: {shown(kind)} is not supported; the model takes text, tool_use, tool_result "
                          "and thinking blocks")
    unknown = sorted(set(block) - BLOCK_FIELDS[kind])
    if unknown:
        raise unknown_field(where, unknown[0], f"of a {kind} block")
    return kind


def _block_text(where: str, block: dict) -> str:
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{where}.text: must be a string")
    return block["text"]


def _messages(body: dict, origins: list) -> list[dict]:
    """The chat's messages; `origins` gets, per message, (the field it came from, its tool calls' fields,
    whether the chat message's own fields are the block's: openai_responses.own_field)."""
    out = []
    system = body.get("system")
    if system is not None:
        text = _text("system", system)
        if text:
            out.append({"role": "system", "content": text})
            origins.append(("system", [], False))
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise bad_request("messages: must be a non-empty list of {role, content} objects")
    for i, message in enumerate(given):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where}: must be a {{role, content}} object")
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise unknown_field(where, unknown[0], "of a message")
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role: must be user or assistant, got {shown(role)}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            origins.append((where, [], True))
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content: must be a string or a list of content blocks")
        texts, calls, call_fields = [], [], []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = _kind(at, block)
            if kind == "text":
                texts.append(_block_text(at, block))
            elif kind in ("thinking", "redacted_thinking"):
                if role != "assistant":
                    raise bad_request(f"{at}.type: {kind} blocks are an assistant's")
            elif kind == "tool_use":
                if role != "assistant":
                    raise bad_request(f"{at}.type: tool_use blocks are an assistant's")
                for field in ("id", "name"):
                    if not isinstance(block.get(field), str):
                        raise bad_request(f"{at}.{field}: must be a string")
                if not isinstance(block.get("input"), dict):
                    raise bad_request(f"{at}.input: must be an object")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"],
                                           "arguments": json.dumps(block["input"], ensure_ascii=False)}})
                call_fields.append(at)
            else:  # tool_result: a tool message, before the user's text
                if role != "user":
                    raise bad_request(f"{at}.type: tool_result blocks are a user's")
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad_request(f"{at}.tool_use_id: must be a string")
                result = _text(f"{at}.content", block.get("content", ""))
                if block.get("is_error") not in (None, True, False):
                    raise bad_request(f"{at}.is_error: must be true or false")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
                origins.append((at, [], False))
        if role == "assistant" and (texts or calls):
            out.append({"role": "assistant", "content": "\n".join(texts) or None, **({"tool_calls": calls} if calls else {})})
            origins.append((where, call_fields, False))
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            origins.append((where, [], False))
    return out


def _tools(body: dict, chat: dict) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools: must be a list of tools")
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict):
                raise bad_request(f"tools[{i}]: must be a tool object")
            if t.get("type", "custom") != "custom":
                raise bad_request(f"tools[{i}].type: {shown(t.get('type'))} is not supported; client tools (custom) only")
            unknown = sorted(set(t) - {"type", "name", "description", "input_schema", "cache_control", "strict",
                                       "allowed_callers", "defer_loading", "eager_input_streaming", "input_examples"})
            if unknown:
                raise unknown_field(f"tools[{i}]", unknown[0], "of a tool")
            if not isinstance(t.get("input_schema"), dict):
                raise bad_request(f"tools[{i}].input_schema: must be a JSON schema object")
            function = {"name": t.get("name"), "parameters": t["input_schema"]}
            if "description" in t:
                function["description"] = t["description"]
            out.append({"type": "function", "function": function})
        chat["tools"] = out
    choice = body.get("tool_choice")
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request("tool_choice: must be {type: auto | any | tool | none}")
    unknown = sorted(set(choice) - {"type", "name", "disable_parallel_tool_use"})
    if unknown:
        raise unknown_field("tool_choice", unknown[0], "of tool_choice")
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name: must be a string (a tool's name)")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise bad_request("tool_choice.disable_parallel_tool_use: must be true or false")
        chat["parallel_tool_calls"] = not parallel


def _thinking(body: dict, chat: dict) -> None:
    """`thinking` as the chat template's enable_thinking (its budget and display checked, not enforced);
    `output_config`'s effort as the chat's reasoning_effort, its format (a JSON schema) as response_format."""
    thinking = body.get("thinking")
    if thinking is not None:
        kinds = ("enabled", "disabled", "adaptive", "between_tools")
        if not isinstance(thinking, dict) or thinking.get("type") not in kinds:
            raise bad_request(f"thinking: must be {{type: {' | '.join(kinds)}}}")
        unknown = sorted(set(thinking) - {"type", "budget_tokens", "display"})
        if unknown:
            raise unknown_field("thinking", unknown[0], "of thinking")
        if thinking["type"] == "enabled":
            budget = int_field({"thinking.budget_tokens": thinking.get("budget_tokens")}, "thinking.budget_tokens")
            if budget is None or budget < 1:
                raise bad_request(f"thinking.budget_tokens: must be an integer of at least 1, got {shown(budget)}")
        if thinking.get("display") not in (None, "summarized", "omitted"):
            raise bad_request(f"thinking.display: must be summarized or omitted, got {shown(thinking['display'])}")
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
    config = body.get("output_config")
    if config is None:
        return
    if not isinstance(config, dict):
        raise bad_request("output_config: must be an object {effort, format}")
    unknown = sorted(set(config) - {"effort", "format"})
    if unknown:
        raise unknown_field("output_config", unknown[0], "of output_config")
    if config.get("effort") is not None:
        if config["effort"] not in EFFORTS:
            raise bad_request(f"output_config.effort: must be one of {', '.join(EFFORTS)}, got {shown(config['effort'])}")
        chat["reasoning_effort"] = "xhigh" if config["effort"] == "max" else config["effort"]  # (the chat's top)
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or set(fmt) - {"type", "schema"}:
            raise bad_request("output_config.format: must be {type: json_schema, schema}")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


def chat_body(body: dict, origins: list, counting: bool = False) -> dict:
    """The chat completions body that answers this Messages call (every field checked by name first);
    `counting`: count_tokens' body (its sampling fields, as a client that counts the body it will send sends them,
    taken and left: they change no count)."""
    check_fields(body, MESSAGES_FIELDS)
    for name, why in NOT_SERVED.items():
        if name in body:
            raise bad_request(f"{name}: {why}")
    chat = {k: body[k] for k in PASSED_ON if k in body}
    for name in HINTS:  # (checked as what they are, then left)
        if name in body and not isinstance(body[name], dict if name in OBJECT_HINTS else str):
            raise bad_request(f"{name}: must be {'an object' if name in OBJECT_HINTS else 'a string'}")
    if not counting:
        if "max_tokens" not in body:
            raise bad_request("max_tokens: required")
        limit = int_field(body, "max_tokens")
        if limit < 1:
            raise bad_request(f"max_tokens: must be at least 1, got {limit}")
        chat["max_tokens"], chat["max_tokens_to_room"] = limit, True  # (cut to the room the prompt leaves: run_chat)
        stops = body.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise bad_request("stop_sequences: must be a list of strings")
            chat["stop"] = stops
        metadata = body.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or set(metadata) - {"user_id"}
                                     or not isinstance(metadata.get("user_id", ""), (str, type(None)))):
            raise bad_request("metadata: must be an object with at most user_id, a string")
    chat["messages"] = _messages(body, origins)
    if not chat["messages"]:
        raise bad_request("messages: every message is empty; at least one must have content")
    last = chat["messages"][-1]
    if body["messages"][-1].get("role") == "assistant" and last["role"] == "assistant" and last.get("content") \
            and not last.get("tool_calls"):  # a prefilled answer (text): continued, not answered anew
        chat.update(add_generation_prompt=False, continue_final_message=True)
    _tools(body, chat)
    _thinking(body, chat)
    if body.get("stream"):  # (the prompt's tokens in the first chunk, for message_start)
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


def error(e: HTTPError, origins: list) -> HTTPError:
    """A chat error naming this call's own fields; one of a prompt past the context says so in Anthropic's words
    too ("prompt is too long", which client libraries look for)."""
    e = renamed(e, origins, RENAMES)
    if e.code == "context_length_exceeded":
        e = HTTPError(e.status, e.message.replace(" (This model's maximum context length",
                                                  " (prompt is too long: this model's context length"),
                      param=e.param, code=e.code)
    m = re.match(r"tools\[\d+\]\.parameters", e.param or "")
    if m:  # (a tool's schema is its input_schema here)
        field = m.group(0).replace(".parameters", ".input_schema") + e.param[m.end():]
        return HTTPError(e.status, field + e.message[len(e.param):] if e.message.startswith(e.param) else e.message,
                         param=field, code=e.code)
    return e


def _usage(u: dict | None, output: bool = True) -> dict:
    u = u or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    usage = {"input_tokens": u.get("prompt_tokens", 0) - cached, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": cached}
    return {**usage, "output_tokens": u.get("completion_tokens", 0) if output else 0}


def _stop(finish: str | None, reason, stops, called: bool = False) -> tuple[str, str | None]:
    """The stop_reason (and stop_sequence) of an answer that ended so; `called`: it made tool calls (a named
    tool's call ends with the chat's "stop", as OpenAI's does, where Anthropic's says tool_use)."""
    if finish == "length":
        return "max_tokens", None
    if isinstance(reason, str) and reason in (stops or ()):
        return "stop_sequence", reason
    if finish == "tool_calls" or (called and finish == "stop"):
        return "tool_use", None
    return "end_turn", None


def _input(arguments: str) -> dict:
    """A call's arguments as tool_use's input (an object; arguments cut off by max_tokens: empty)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _message(model: str, content: list, stop=(None, None), usage=None) -> dict:
    return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def reshape(answer, body: dict, origins: list):
    """The chat answer (a JSON body, a stream of chunks, or another response such as a 499) as this API's."""
    if isinstance(answer, StreamingResponse):
        return StreamingResponse(_events(answer.body_iterator, body, origins), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    if isinstance(answer, Response):
        return answer
    choice = answer["choices"][0]
    message = choice["message"]
    content = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _input(call["function"]["arguments"])})
    stop = _stop(choice["finish_reason"], choice.get("stop_reason"), body.get("stop_sequences"),
                 bool(message.get("tool_calls")))
    return _message(answer["model"], content, stop, _usage(answer["usage"]))


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


async def _events(chunks, body: dict, origins: list):
    """Chat completion chunks in, this API's stream events out (a client gone: both closed at once, the
    chat stream's request aborted)."""
    async with contextlib.aclosing(chunks), contextlib.aclosing(_translate(chunks, body, origins)) as events:
        async for text in events:
            yield text


async def _translate(chunks, body: dict, origins: list):
    started, index, open_kind = False, -1, None
    finish, reason, usage, model = None, None, None, ""
    calls: dict[int, int] = {}  # the chat's tool-call index -> its block index

    def close():
        nonlocal open_kind
        if open_kind is not None:
            open_kind = None
            return [_event("content_block_stop", index=index)]
        return []

    def open_block(kind: str, block: dict):
        nonlocal index, open_kind
        out = close()
        index, open_kind = index + 1, kind
        return out + [_event("content_block_start", index=index, content_block=block)]

    async for raw in chunks:
        for line in (raw.decode() if isinstance(raw, bytes) else raw).split("\n"):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # mid-stream: the error event, then the end
                e = chunk["error"]
                message, _ = own(e.get("message") or "", e.get("param"), origins, RENAMES)
                yield _event("error", error={"type": "api_error" if (e.get("type") or "").endswith("server_error")
                                             else "invalid_request_error", "message": message})
                return
            model = chunk.get("model", model)
            if chunk.get("usage"):
                usage = chunk["usage"]
            opening = all(not c.get("finish_reason") and set(c.get("delta") or {}) <= {"role", "content"}
                          and not (c.get("delta") or {}).get("content") for c in chunk.get("choices", ()))
            if not started and not opening:  # (after the chat's opening chunk: the first with the engine's
                started = True               # usage, its cached prompt tokens counted)
                yield _event("message_start", message=_message(model, [], usage=_usage(usage, output=False)))
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    if open_kind != "thinking":
                        for text in open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                            yield text
                    yield _event("content_block_delta", index=index,
                                 delta={"type": "thinking_delta", "thinking": delta["reasoning_content"]})
                if delta.get("content"):
                    if open_kind != "text":
                        for text in open_block("text", {"type": "text", "text": ""}):
                            yield text
                    yield _event("content_block_delta", index=index, delta={"type": "text_delta", "text": delta["content"]})
                for piece in delta.get("tool_calls") or ():
                    f = piece.get("function") or {}
                    if piece.get("id"):  # a call's head: a new block
                        for text in open_block("tool_use", {"type": "tool_use", "id": piece["id"],
                                                            "name": f.get("name", ""), "input": {}}):
                            yield text
                        calls[piece["index"]] = index
                    if f.get("arguments") and calls.get(piece.get("index")) == index:
                        yield _event("content_block_delta", index=index,
                                     delta={"type": "input_json_delta", "partial_json": f["arguments"]})
                if choice.get("finish_reason"):
                    finish, reason = choice["finish_reason"], choice.get("stop_reason")
    if not started:
        return
    for text in close():
        yield text
    stop = _stop(finish, reason, body.get("stop_sequences"), bool(calls))
    yield _event("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]}, usage=_usage(usage))
    yield _event("message_stop")

