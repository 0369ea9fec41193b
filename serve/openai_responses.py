"""OpenAI's Responses API (`POST /v1/responses`) over the chat completions machinery: a call's
`instructions` and `input` become chat messages, `text.format` the response_format, `max_output_tokens`
the token limit; the chat answer (one JSON body, or its server-sent chunks) is reshaped into a response
object and the Responses stream's events (response.created ... response.output_text.delta ...
response.completed). Text and function tools: the output is the message's text and the calls it makes
(function_call items, whole or as argument deltas); earlier calls and their outputs come back as
function_call and function_call_output input items. On a server with a reasoning parser the thinking is
a reasoning item before them (its text a reasoning_text part, streamed as response.reasoning_text.delta
events); a reasoning item given back in the input is taken and left out of the prompt (the chat
templates of thinking models drop earlier thinking too), and the `reasoning` field (effort, summary) is
checked, its effort handed to the chat template as the chat's reasoning_effort. Responses are kept for
`previous_response_id`, the retrieval routes and `background` by serve.openai_responses_store; built-in
tools, images and stored prompts are refused by name, as every unknown field is.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import time
import uuid

from fastapi.responses import Response, StreamingResponse

from jaxcb.host.errors import InvalidRequest, shown
from serve.openai_fields import (REASONING_EFFORTS, SERVICE_FIELDS, VERBOSITIES, HTTPError, bad_request, bool_field, check_fields,
                                 check_metadata, http_error, int_field, unknown_field)
from jaxcb.host.tool_calls import content_text

RESPONSES_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
                    "text", "user", "store", "metadata", "seed", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "ignore_eos", "priority", "cache_salt", "request_id",
                    "tools", "tool_choice", "parallel_tool_calls", "reasoning", "include", "top_logprobs",
                    "truncation", "stream_options", "background", "max_tool_calls", "previous_response_id",
                    "conversation", "prompt", "context_management", "background_options", *SERVICE_FIELDS}
# POST /v1/responses/input_tokens: the fields of a call that decide its input (and a hint)
INPUT_TOKENS_FIELDS = {"model", "input", "instructions", "conversation", "previous_response_id", "parallel_tool_calls",
                       "reasoning", "text", "tool_choice", "tools", "truncation", "personality"}
PASSED_ON = {"model", "temperature", "top_p", "stream", "user", "seed", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "ignore_eos", "priority", "cache_salt", "request_id",
             *SERVICE_FIELDS}
# `include`'s values: the output text's logprobs are given; the others are parts of items this server never
# makes (built-in tools' results, images, encrypted reasoning for stateless turns), so they add nothing.
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs")
# Fields for what is not kept or not served here, each refused by name (absent or null they are not given).
NOT_SERVED = {"prompt": "stored prompt templates are not served"}
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"input_text": "text", "output_text": "text"}  # a message item's part type -> the key of its text


def _content(where: str, content, key: str = ".content") -> str:
    """A message item's content (or another of its fields: `key`) as text: a string, or its text parts joined as
    chat joins its own."""
    if content is None:
        raise bad_request(f"{where}{key}: must be a string or a list of content parts")
    try:
        return content_text(content, f"{where}{key}", TEXT_PARTS)
    except InvalidRequest as e:
        raise http_error(e) from None


def chat_messages(items: list) -> list[dict]:
    """Input items (a conversation's: serve.openai_responses_store) as the chat's messages, checked as a call's
    input is."""
    return _messages({"input": items}, [])


def _messages(body: dict, origins: list, history: tuple = (), history_field: str = "previous_response_id") -> list[dict]:
    """The chat's messages: the instructions, a previous response's conversation (`history`, copied), this
    call's input; `origins` gets, per message, (the field it came from, the fields of its tool calls,
    whether the message's own fields are the item's: own_field)."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions: must be a string")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    origins += [("instructions", [], False)] if instructions else []
    messages += copy.deepcopy(list(history))
    origins += [(history_field, [], False) for _ in history]
    given = body.get("input")
    if isinstance(given, str):
        origins.append(("input", [], False))
        return messages + [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad_request("input: must be a string or a non-empty list of message items")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: must be an input item object")
        item = {k: v for k, v in item.items() if v is not None}  # (a field that is null is not given, as at the top)
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise bad_request(f"{where}.type: must be a string")
        if kind == "reasoning":  # earlier thinking: checked, not part of the prompt
            unknown = sorted(set(item) - ITEM_FIELDS["reasoning"])
            if unknown:
                raise unknown_field(where, unknown[0], "of a reasoning item")
            continue
        if kind in ITEM_FIELDS and kind != "message":
            _tool_item(where, kind, item, messages, origins)
            continue
        if kind != "message":
            raise bad_request(f"{where}.type: {kind!r} is not supported; message, function_call, "
                              "function_call_output and reasoning items only")
        unknown = sorted(set(item) - ITEM_FIELDS["message"])
        if unknown:
            raise unknown_field(where, unknown[0], "of a message item")
        if item.get("role") not in ROLES:
            raise bad_request(f"{where}.role: must be one of {', '.join(ROLES)}, got {shown(item.get('role'))}")
        messages.append({"role": item["role"], "content": _content(where, item.get("content"))})
        origins.append((where, [], True))
    return messages


ITEM_FIELDS = {"message": {"type", "role", "content", "id", "status", "phase"},  # (phase: an output message's)
               "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
               "function_call_output": {"type", "call_id", "output", "id", "status"},
               "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"}}
SUMMARIES = ("auto", "concise", "detailed")


def _check_reasoning(value) -> None:
    """The `reasoning` field ({effort, summary}): checked (its effort goes to the chat template as the chat's
    reasoning_effort: chat_body; a summary is not written)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad_request("reasoning: must be an object {effort, summary}")
    unknown = sorted(set(value) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise unknown_field("reasoning", unknown[0], "of reasoning")
    if value.get("effort") not in (None, *REASONING_EFFORTS):
        raise bad_request(f"reasoning.effort: must be one of {', '.join(REASONING_EFFORTS)}, got "
                          f"{shown(value.get('effort'))}")
    for key in ("summary", "generate_summary"):
        if value.get(key) not in (None, *SUMMARIES):
            raise bad_request(f"reasoning.{key}: must be one of {', '.join(SUMMARIES)}, got {value.get(key)!r}")


def _tool_item(where: str, kind: str, item: dict, messages: list[dict], origins: list) -> None:
    """An earlier function call (joined to the assistant message just before it: its text or the calls before it,
    one turn, as serve.openai_responses_store.answer_messages makes a kept response's) or a call's output (a tool
    message), as the chat's messages have them."""
    unknown = sorted(set(item) - ITEM_FIELDS[kind])
    if unknown:
        raise unknown_field(where, unknown[0], f"of a {kind} item")
    if not isinstance(item.get("call_id"), str):
        raise bad_request(f"{where}.call_id: must be a string")
    if kind == "function_call_output":  # (a string, or a list of input_text parts)
        output = item.get("output")
        output = output if isinstance(output, str) else _content(where, output, ".output")
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        origins.append((where, [], False))
        return
    for field in ("name", "arguments"):
        if not isinstance(item.get(field), str):
            raise bad_request(f"{where}.{field}: must be a string")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        origins[-1][1].append(where)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        origins.append((where, [where], False))


# A chat field an error names -> this API's (the longest first).
_RENAMED = (("response_format.json_schema.schema", "text.format.schema"), ("response_format.json_schema", "text.format"),
            ("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
            ("max_tokens", "max_output_tokens"), ("tool_choice.function", "tool_choice"),
            ("prompt", "input"), ("messages", "input"))  # (the rendered chat's length; the whole conversation)


def own_field(field: str, origins: list, renames: tuple = _RENAMED) -> str:
    """The field of a Responses call (or another API's over the chat: `renames`, a chat field -> its own) that
    a chat field named by an error came from (chat_body's `origins`): a message's (or one of its tool calls')
    input item, instructions, the tools' flat fields, text.format, max_output_tokens; others are the same in
    both."""
    m = re.fullmatch(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?(.*)", field)
    if m and int(m.group(1)) < len(origins):
        where, calls, own = origins[int(m.group(1))]
        if m.group(2) is not None and int(m.group(2)) < len(calls):
            return calls[int(m.group(2))] + m.group(3)
        return where + (m.group(3) if own and m.group(2) is None else "")
    m = re.fullmatch(r"tools\[(\d+)\]\.function(.*)", field)
    if m:
        return f"tools[{m.group(1)}]{m.group(2)}"
    for old, new in renames:
        if field == old or field.startswith((old + ".", old + "[")):
            return new + field[len(old):]
    return field


def own(message: str, param: str | None, origins: list, renames: tuple = _RENAMED) -> tuple[str, str | None]:
    """An error's (message, param) naming this call's own field (the param and the message's lead)."""
    if not param:
        return message, param
    field = own_field(param, origins, renames)
    if param in ("max_tokens", "max_completion_tokens"):  # (the engine's sum names the limit by the chat's name)
        message = message.replace("+ max_tokens (", f"+ {field} (")
    return (field + message[len(param):] if message.startswith(param) else message), field


class OwnFieldError(HTTPError):
    """A 400 that names this API's own field already (a field it refuses itself): renamed() leaves it."""


def renamed(e: HTTPError, origins: list, renames: tuple = _RENAMED) -> HTTPError:
    """A chat answer's 400 naming this call's own field."""
    if e.status != 400 or isinstance(e, OwnFieldError):
        return e
    message, field = own(e.message, e.param, origins, renames)
    return HTTPError(400, message, param=field, code=e.code)


def _tools(body: dict, chat: dict) -> None:
    """Responses' function tools ({type, name, parameters, ...}) and tool_choice as the chat's."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools: must be a list of function tools")
        out = []
        for i, t in enumerate(tools):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise bad_request(f"tools[{i}].type: {kind!r} is not supported; function tools only")
            unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
            if unknown:
                raise unknown_field(f"tools[{i}]", unknown[0], "of a function tool")
            out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
        chat["tools"] = out
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        choice = _allowed_tools(choice, chat)
    elif isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice: must be none, auto, required, {type: function, name} or "
                              "{type: allowed_tools, mode, tools}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    if "parallel_tool_calls" in body:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]


def _allowed_tools(choice: dict, chat: dict) -> str:
    """OpenAI's tool_choice {type: allowed_tools, mode: auto | required, tools: [{type: function, name}]}: the
    call may use only those of the tools (the others left out of the chat's), as `mode` says. Returns the mode."""
    unknown = sorted(set(choice) - {"type", "mode", "tools"})
    if unknown:
        raise unknown_field("tool_choice", unknown[0], "of allowed_tools")
    if choice.get("mode") not in ("auto", "required"):
        raise bad_request(f"tool_choice.mode: must be auto or required, got {shown(choice.get('mode'))}")
    given = choice.get("tools")
    if not isinstance(given, list) or not given:
        raise bad_request("tool_choice.tools: must be a non-empty list of {type: function, name}")
    names = []
    for i, t in enumerate(given):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise bad_request(f"tool_choice.tools[{i}]: must be {{type: function, name}}")
        names.append(t["name"])
    served = {t["function"].get("name") for t in chat.get("tools", [])}
    missing = [n for n in names if n not in served]
    if missing:
        raise bad_request(f"tool_choice.tools: {missing[0]!r} is not one of the tools")
    chat["tools"] = [t for t in chat["tools"] if t["function"].get("name") in names]
    return choice["mode"]


def _response_format(body: dict):
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_request("text: must be an object with at most `format` and `verbosity`")
    if text.get("verbosity") not in (None, *VERBOSITIES):  # (a hint: checked, changes nothing)
        raise bad_request(f"text.verbosity: must be one of {', '.join(VERBOSITIES)}, got {shown(text['verbosity'])}")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        unknown = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
        if unknown:
            raise unknown_field("text.format", unknown[0], "of a json_schema format")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise bad_request(f"text.format.type: must be text, json_object or json_schema, got {kind!r}")


def chat_body(body: dict, origins: list | None = None, history: tuple = (),
              history_field: str = "previous_response_id") -> dict:
    """The chat completions body that answers this Responses call (every field checked by name first),
    after a previous response's conversation (`history`: Store.call); `origins`, where given, gets where
    each of its messages came from (own_field)."""
    origins = [] if origins is None else origins
    check_fields(body, RESPONSES_FIELDS)
    for name, why in NOT_SERVED.items():
        if name in body:
            raise OwnFieldError(400, f"{name}: {why}", param=name)
    _check_reasoning(body.get("reasoning"))
    check_metadata(body.get("metadata"))
    chat = {k: body[k] for k in PASSED_ON if k in body}
    if (body.get("reasoning") or {}).get("effort") is not None:  # (to the chat template, as the chat's own field)
        chat["reasoning_effort"] = body["reasoning"]["effort"]
    include = body.get("include", [])
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise bad_request("include: must be a list of strings")
    for i, value in enumerate(include):
        if value not in INCLUDABLE:
            raise bad_request(f"include[{i}]: {shown(value)} is not one of {', '.join(INCLUDABLE)}")
    top = int_field(body, "top_logprobs", 0)
    if LOGPROBS in include or top:  # (the chat checks top_logprobs' range)
        chat.update(logprobs=True, top_logprobs=top)
    truncation = body.get("truncation", "disabled")
    if truncation not in ("disabled", "auto"):
        raise bad_request(f"truncation: must be 'disabled' or 'auto', got {shown(truncation)}")
    if truncation == "auto":  # (the conversation's oldest items dropped until it fits: run_chat)
        chat["truncation"] = "auto"
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_obfuscation"}:
            raise bad_request("stream_options: must be an object with at most include_obfuscation")
        bool_field({"stream_options.include_obfuscation": options.get("include_obfuscation")},
                   "stream_options.include_obfuscation", False)  # (no padding is sent: nothing to obfuscate)
        if not body.get("stream"):
            raise bad_request("stream_options: only with stream: true")
    # hints: compaction past a threshold (none is made: an input past the context is refused, as any other); the
    # background run's completion window (a background response here runs at once)
    if not isinstance(body.get("context_management", []), list):
        raise bad_request("context_management: must be a list of context management entries")
    if not isinstance(body.get("background_options", {}), dict):
        raise bad_request("background_options: must be an object")
    limit = int_field(body, "max_tool_calls")  # (the built-in tools' limit: none are served)
    if limit is not None and limit < 1:
        raise bad_request(f"max_tool_calls: must be at least 1, got {limit}")
    chat["messages"] = _messages(body, origins, history, history_field)
    limit = int_field(body, "max_output_tokens")
    if limit is not None:
        if limit < 1:
            raise bad_request(f"max_output_tokens: must be at least 1, got {limit}")
        chat["max_completion_tokens"] = limit
    _tools(body, chat)
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


class Shape:
    """One response object as it grows: its output items in order (the thinking, the message's text,
    function calls), finish and usage; `rid` its id (made here if None), `stored` whether it is kept."""

    def __init__(self, body: dict, model: str, rid: str | None = None, stored: bool = False, created: int | None = None):
        self.id, self.message_id = rid or "resp_" + uuid.uuid4().hex, "msg_" + uuid.uuid4().hex
        self.stored = stored
        self.reasoning_id = "rs_" + uuid.uuid4().hex
        self.created, self.body, self.model = created or int(time.time()), body, model
        self.text, self.thought, self.finish, self.usage = "", "", None, None
        self.order: list = []  # "reasoning", "message" and the indexes of self.calls, as they came
        self.calls: list[dict] = []  # {id, call_id, name, arguments}
        # the answer's tokens' logprobs (the chat's entries: token, logprob, bytes, top_logprobs), where asked;
        # the text's part carries those of every token the answer wrote (its calls' and thinking's too)
        self.logprobs: list = []

    def usage_json(self):
        u = self.usage or {}
        return {"input_tokens": u.get("prompt_tokens", 0), "output_tokens": u.get("completion_tokens", 0),
                "total_tokens": u.get("total_tokens", 0),
                # (cache_write_tokens: the prefix cache keeps pages as it computes them, charging no write)
                "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                                         "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}}

    def add_call(self, call_id: str, name: str, arguments: str = "") -> int:
        self.calls.append({"id": "fc_" + uuid.uuid4().hex, "call_id": call_id, "name": name, "arguments": arguments})
        self.order.append(len(self.calls) - 1)
        return len(self.order) - 1

    def part(self, opened: bool = False):
        """The message's text part: as it is now, or (`opened`) as it begins, empty."""
        return {"type": "output_text", "text": "" if opened else self.text, "annotations": [],
                "logprobs": [] if opened else self.logprobs}

    def item(self, which, status: str):
        if which == "reasoning":
            return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": self.thought}] if status != "in_progress" else []}
        if which == "message":
            return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                    "content": [self.part()] if status != "in_progress" else []}
        c = self.calls[which]
        if status == "incomplete" and which != self.order[-1]:  # (only the last item can be the one cut off)
            status = "completed"
        return {"type": "function_call", "id": c["id"], "call_id": c["call_id"], "name": c["name"],
                "arguments": c["arguments"] if status != "in_progress" else "", "status": status}

    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def response(self, status: str | None = None):
        status = status or self.status()
        b = self.body
        order = self.order or ["message"]  # an answer with no text and no call: one empty message
        finished = status in ("completed", "incomplete")  # (queued, in_progress, failed, cancelled: no output yet)
        output = [self.item(w, status) for w in order] if finished else []
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "model": self.model, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "temperature": b.get("temperature"), "top_p": b.get("top_p"),
                "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
                "text": b.get("text") or {"format": {"type": "text"}}, "store": self.stored,
                "previous_response_id": b.get("previous_response_id"), "background": b.get("background", False),
                "conversation": _conversation_ref(b.get("conversation")),
                "metadata": b.get("metadata") or {}, "reasoning": b.get("reasoning") or {"effort": None, "summary": None},
                "truncation": b.get("truncation", "disabled"), "service_tier": b.get("service_tier", "default"),
                "top_logprobs": b.get("top_logprobs", 0), "max_tool_calls": b.get("max_tool_calls"),
                "user": b.get("user"), "usage": self.usage_json() if finished else None}


def _conversation_ref(given):
    """A call's `conversation` (an id, or {id}) as a response gives it: {id}, or None."""
    if given is None:
        return None
    return {"id": given["id"] if isinstance(given, dict) else given}


def reshape(answer, body: dict, origins: list | None = None, keep=None, rid: str | None = None, stored: bool = False,
            created: int | None = None):
    """The chat answer (a JSON body, a stream of chunks, or another response such as a 499) as the
    Responses API gives it (a streamed error naming the call's own fields: chat_body's `origins`); `keep`,
    where given, is called with the finished response object and says whether it was kept (its `store`); `rid` and
    `created`: the response's id and time where it has them already (a background one's)."""
    if isinstance(answer, StreamingResponse):
        return event_stream(_events(answer.body_iterator, body, origins or [], keep, rid, stored, created))
    if isinstance(answer, Response):
        return answer
    shape = Shape(body, answer["model"], rid, stored or keep is not None, created)
    choice = answer["choices"][0]
    message = choice["message"]
    shape.text, shape.finish, shape.usage = message.get("content") or "", choice["finish_reason"], answer["usage"]
    shape.logprobs = (choice.get("logprobs") or {}).get("content") or []
    shape.thought = message.get("reasoning_content") or ""
    if shape.thought:
        shape.order.append("reasoning")
    if shape.text or not message.get("tool_calls"):
        shape.order.append("message")
    for call in message.get("tool_calls") or ():
        shape.add_call(call["id"], call["function"]["name"], call["function"]["arguments"])
    return _kept(shape, keep)


def event_stream(events) -> StreamingResponse:
    """Server-sent events (their text) as the answer."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _kept(shape: Shape, keep) -> dict:
    """The finished response object, kept where asked (its `store` false if it could not be)."""
    response = shape.response()
    if keep is not None:
        shape.stored = response["store"] = keep(copy.deepcopy(response))
    return response


def sse_event(kind: str, seq: int, **fields) -> str:
    """One server-sent event of the Responses stream, its sequence_number `seq`."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields}, ensure_ascii=False)}\n\n"


async def _events(chunks, body: dict, origins: list = (), keep=None, rid: str | None = None, stored: bool = False,
                  created: int | None = None):
    """Chat completion chunks in, the Responses stream's events out (the response's id `rid`, made if None)."""
    seq = 0

    def event(kind: str, **fields):
        nonlocal seq
        seq += 1
        return sse_event(kind, seq - 1, **fields)

    # A client gone: both generators close at once, the chat stream's requests aborted.
    async with contextlib.aclosing(chunks), contextlib.aclosing(_translate(chunks, body, event, origins, keep, rid,
                                                                         stored, created)) as events:
        async for text in events:
            yield text


async def _translate(chunks, body: dict, event, origins, keep, rid, stored, created):
    shape = None
    at: dict[int, int] = {}  # the chat's tool-call index -> its output index
    pending: list = []  # logprobs of tokens not yet in a text delta
    text_at = {"content_index": 0}
    closed: set[int] = set()  # output indexes whose items are done (a call once the next opens, the thinking
    # once the answer begins: one item open at a time, as OpenAI streams them)

    def close_before(kinds) -> list:
        """The done events of the open items of these kinds ("reasoning", "call"), before another opens."""
        out = []
        for index, which in enumerate(shape.order):
            kind = which if isinstance(which, str) else "call"
            if kind in kinds and index not in closed:
                out += list(close(index, which))
        return out

    def close(index: int, which):
        closed.add(index)
        status = shape.status()
        if which == "reasoning":
            yield event("response.reasoning_text.done", item_id=shape.reasoning_id, output_index=index,
                        content_index=0, text=shape.thought)
        elif which == "message":
            where = {"output_index": index, **text_at}
            yield event("response.output_text.done", item_id=shape.message_id, **where, text=shape.text,
                        logprobs=shape.logprobs)
            yield event("response.content_part.done", item_id=shape.message_id, **where, part=shape.part())
        else:
            c = shape.calls[which]
            yield event("response.function_call_arguments.done", item_id=c["id"], output_index=index,
                        name=c["name"], arguments=c["arguments"])
        yield event("response.output_item.done", output_index=index, item=shape.item(which, status))

    async for raw in chunks:
        # (split on newlines only: the chunks' JSON leaves U+2028 and its kind unescaped, which splitlines cuts)
        for line in (raw.decode() if isinstance(raw, bytes) else raw).split("\n"):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # mid-stream: the error event, then the response failed
                e = chunk["error"]
                message, param = own(e.get("message") or "", e.get("param"), list(origins))
                yield event("error", code=e.get("code"), message=message, param=param)
                if shape is not None:
                    failed = shape.response("failed")
                    failed["error"] = {"code": e.get("code") or "server_error", "message": message}
                    yield event("response.failed", response=failed)
                return
            if shape is None:
                shape = Shape(body, chunk["model"], rid, stored or keep is not None, created)
                yield event("response.created", response=shape.response("in_progress"))
                yield event("response.in_progress", response=shape.response("in_progress"))
            if chunk.get("usage"):
                shape.usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta") or {}
                logprobs = (choice.get("logprobs") or {}).get("content") or []
                shape.logprobs += logprobs
                pending += logprobs
                if delta.get("reasoning_content"):
                    if "reasoning" not in shape.order:
                        shape.order.append("reasoning")
                        yield event("response.output_item.added", output_index=len(shape.order) - 1,
                                    item=shape.item("reasoning", "in_progress"))
                    shape.thought += delta["reasoning_content"]
                    yield event("response.reasoning_text.delta", item_id=shape.reasoning_id,
                                output_index=shape.order.index("reasoning"), content_index=0,
                                delta=delta["reasoning_content"])
                if delta.get("content"):
                    if "message" not in shape.order:
                        for text in close_before(("reasoning",)):
                            yield text
                        shape.order.append("message")
                        index = len(shape.order) - 1
                        yield event("response.output_item.added", output_index=index, item=shape.item("message", "in_progress"))
                        yield event("response.content_part.added", item_id=shape.message_id, output_index=index,
                                    **text_at, part=shape.part(opened=True))
                    shape.text += delta["content"]
                    yield event("response.output_text.delta", item_id=shape.message_id,
                                output_index=shape.order.index("message"), **text_at, delta=delta["content"],
                                logprobs=pending)
                    pending = []
                for piece in delta.get("tool_calls") or ():
                    f = piece.get("function") or {}
                    if piece.get("id"):  # a call's head: a new output item
                        for text in close_before(("reasoning", "call")):
                            yield text
                        at[piece["index"]] = shape.add_call(piece["id"], f.get("name", ""))
                        index = at[piece["index"]]
                        yield event("response.output_item.added", output_index=index,
                                    item=shape.item(shape.order[index], "in_progress"))
                    if f.get("arguments") and piece.get("index") in at:
                        index = at[piece["index"]]
                        call = shape.calls[shape.order[index]]
                        call["arguments"] += f["arguments"]
                        yield event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                                    delta=f["arguments"])
                if choice.get("finish_reason"):
                    shape.finish = choice["finish_reason"]
    if shape is None:
        return
    if not [w for w in shape.order if w != "reasoning"]:  # no text and no call: one empty message, opened and closed
        shape.order.append("message")
        index = len(shape.order) - 1
        yield event("response.output_item.added", output_index=index, item=shape.item("message", "in_progress"))
        yield event("response.content_part.added", item_id=shape.message_id, output_index=index, **text_at,
                    part=shape.part(opened=True))
    if pending and "message" in shape.order:  # logprobs of tokens after the last text (calls, thinking): an empty
        yield event("response.output_text.delta", item_id=shape.message_id,  # delta, so the deltas' add up
                    output_index=shape.order.index("message"), **text_at, delta="", logprobs=pending)
    for index, which in enumerate(shape.order):
        for text in close(index, which) if index not in closed else ():
            yield text
    yield event(f"response.{shape.status()}", response=_kept(shape, keep))
