"""OpenAI's Responses API (`POST /v1/responses`) over the chat completions machinery: a call's
`instructions` and `input` become chat messages, `text.format` the response_format, `max_output_tokens`
the token limit; the chat answer (one JSON body, or its server-sent chunks) is reshaped into a response
object and the Responses stream's events (response.created ... response.output_text.delta ...
response.completed). Text in, text out: one output message a call. Not kept: `store` is accepted but no
response is stored, so `previous_response_id` and the retrieval routes are not served; tools, images
and reasoning items are refused by name, as every unknown field is.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid

from fastapi.responses import Response, StreamingResponse

from serve.openai_fields import bad_request, check_fields, int_field

RESPONSES_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
                    "text", "user", "store", "metadata", "seed", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "ignore_eos", "priority", "cache_salt", "request_id"}
PASSED_ON = {"model", "temperature", "top_p", "stream", "user", "seed", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "ignore_eos", "priority", "cache_salt", "request_id"}
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")


def _content(where: str, content):
    """A message item's content: a string, or its text parts as chat's content parts (which the chat
    path joins as it joins its own)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad_request(f"{where}.content[{j}].type: {kind!r} is not supported; the model takes "
                              f"{' and '.join(TEXT_PARTS)} parts only")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}].text: must be a string")
        texts.append({"type": "text", "text": part["text"]})
    return texts


def _messages(body: dict) -> list[dict]:
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions: must be a string")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    given = body.get("input")
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad_request("input: must be a string or a non-empty list of message items")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: must be a message item object")
        kind = item.get("type", "message")
        if kind != "message":
            raise bad_request(f"{where}.type: {kind!r} is not supported; message items only")
        unknown = sorted(set(item) - {"type", "role", "content", "id", "status"})
        if unknown:
            raise bad_request(f"{where}.{unknown[0]}: not a field of a message item")
        if item.get("role") not in ROLES:
            raise bad_request(f"{where}.role: must be one of {', '.join(ROLES)}, got {item.get('role')!r}")
        messages.append({"role": item["role"], "content": _content(where, item.get("content"))})
    return messages


def _response_format(body: dict):
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format"}:
        raise bad_request("text: must be an object with at most `format`")
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
            raise bad_request(f"text.format.{unknown[0]}: not a field of a json_schema format")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise bad_request(f"text.format.type: must be text, json_object or json_schema, got {kind!r}")


def chat_body(body: dict) -> dict:
    """The chat completions body that answers this Responses call (every field checked by name first)."""
    check_fields(body, RESPONSES_FIELDS)
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad_request("store: must be a boolean")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("metadata: must be an object")
    chat = {k: body[k] for k in PASSED_ON if k in body}
    chat["messages"] = _messages(body)
    limit = int_field(body, "max_output_tokens")
    if limit is not None:
        if limit < 1:
            raise bad_request(f"max_output_tokens: must be at least 1, got {limit}")
        chat["max_completion_tokens"] = limit
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


class _Shape:
    """One response object as it grows: its text, finish and usage."""

    def __init__(self, body: dict, model: str):
        self.id, self.message_id = "resp_" + uuid.uuid4().hex, "msg_" + uuid.uuid4().hex
        self.created, self.body, self.model = int(time.time()), body, model
        self.text, self.finish, self.usage = "", None, None

    def usage_json(self):
        u = self.usage or {}
        return {"input_tokens": u.get("prompt_tokens", 0), "output_tokens": u.get("completion_tokens", 0),
                "total_tokens": u.get("total_tokens", 0),
                "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
                "output_tokens_details": {"reasoning_tokens": 0}}

    def part(self):
        return {"type": "output_text", "text": self.text, "annotations": []}

    def item(self, status: str):
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [self.part()] if status != "in_progress" else []}

    def response(self, status: str | None = None):
        status = status or ("incomplete" if self.finish == "length" else "completed")
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "model": self.model, "output": [] if status == "in_progress" else [self.item(status)],
                "parallel_tool_calls": False, "temperature": b.get("temperature"), "top_p": b.get("top_p"),
                "tool_choice": "auto", "tools": [], "text": b.get("text") or {"format": {"type": "text"}},
                "store": False, "metadata": b.get("metadata") or {},
                "usage": self.usage_json() if status != "in_progress" else None}


def reshape(answer, body: dict):
    """The chat answer (a JSON body, a stream of chunks, or another response such as a 499) as the
    Responses API gives it."""
    if isinstance(answer, StreamingResponse):
        return StreamingResponse(_events(answer.body_iterator, body), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    if isinstance(answer, Response):
        return answer
    shape = _Shape(body, answer["model"])
    choice = answer["choices"][0]
    shape.text, shape.finish, shape.usage = choice["message"]["content"] or "", choice["finish_reason"], answer["usage"]
    return shape.response()


async def _events(chunks, body: dict):
    """Chat completion chunks in, the Responses stream's events out."""
    seq = 0

    def event(kind: str, **fields):
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields}, ensure_ascii=False)}\n\n"

    where = {"output_index": 0, "content_index": 0}
    # A client gone: both generators close at once, the chat stream's requests aborted.
    async with contextlib.aclosing(chunks), contextlib.aclosing(_translate(chunks, body, event, where)) as events:
        async for text in events:
            yield text


async def _translate(chunks, body: dict, event, where):
    shape = None
    async for raw in chunks:
        for line in (raw.decode() if isinstance(raw, bytes) else raw).splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # mid-stream: the error event ends it
                e = chunk["error"]
                yield event("error", code=e.get("code"), message=e.get("message"), param=e.get("param"))
                return
            if shape is None:
                shape = _Shape(body, chunk["model"])
                yield event("response.created", response=shape.response("in_progress"))
                yield event("response.in_progress", response=shape.response("in_progress"))
                yield event("response.output_item.added", output_index=0, item=shape.item("in_progress"))
                yield event("response.content_part.added", item_id=shape.message_id, **where, part=shape.part())
            if chunk.get("usage"):
                shape.usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    shape.text += delta
                    yield event("response.output_text.delta", item_id=shape.message_id, **where, delta=delta,
                                logprobs=[])
                if choice.get("finish_reason"):
                    shape.finish = choice["finish_reason"]
    if shape is None:
        return
    status = "incomplete" if shape.finish == "length" else "completed"
    yield event("response.output_text.done", item_id=shape.message_id, **where, text=shape.text, logprobs=[])
    yield event("response.content_part.done", item_id=shape.message_id, **where, part=shape.part())
    yield event("response.output_item.done", output_index=0, item=shape.item(status))
    yield event(f"response.{status}", response=shape.response(status))
