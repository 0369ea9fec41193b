"""OpenAI's Responses API, kept: responses stored for `previous_response_id` and the retrieval routes
(GET /v1/responses/{id}, DELETE, GET .../input_items, POST .../cancel), and `background` responses, which
run on while the client polls.

A response is kept where the call asks (`store`: true unless false, as OpenAI has it) and the server keeps
any (--responses-store-mb; 0: none). Kept are its response object, this call's input items, and the
conversation through its answer as chat messages: the inputs and answers of the previous_response_id chain,
then its own (not `instructions`: a call gives its own, and a previous response's are not carried over, as
OpenAI has it; not the thinking: chat templates drop an earlier turn's, as for reasoning items given back).
A call naming a previous response reads that conversation, its own input after it.

Memory is bounded: each response is charged the bytes of everything it keeps as Python objects (its
conversation whole, though it shares the earlier responses' messages), and the least recently used are dropped first to stay
within the limit (a background response still running is not dropped); one that alone is over the limit is
not kept (its `store` false). A server with bearer tokens keeps each token's responses apart (another's id is
not found); one without keeps one store for every client.

A background response is the one call that outlives its client: it runs until it ends, is cancelled
(POST .../cancel, or DELETE), or the server stops. Its fields are checked, and it is admitted and queued,
before the call answers; a refusal is the call's error, as for any other.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import sys
import uuid

from fastapi.responses import Response

from jaxcb.host.errors import JaxcbError, shown
from serve import openai_responses
from serve.openai_fields import HTTPError, bad_request, bool_field, check_fields, http_error

FINISHED = ("completed", "incomplete")
PAGE_LIMIT = 100  # input_items' most per page


@dataclasses.dataclass
class Kept:
    owner: str  # "token<i>" with bearer tokens, else ""
    response: dict  # the response object as GET gives it
    items: list  # this call's input items, with their ids
    conversation: tuple = ()  # chat messages through its answer (module docstring)
    size: int = 0
    detached: _Detached | None = None  # a background response's stand-in for the client


@dataclasses.dataclass
class Call:
    """What the store makes of a POST /v1/responses body."""
    owner: str
    keep: bool  # to be kept
    background: bool
    history: tuple  # the previous response's conversation (empty without previous_response_id)


class _Detached:
    """What a background response's work is given in place of the client's request: until_gone's receive(),
    which says the request has been accepted (queued) and ends, as a hang-up would, when it is cancelled."""

    def __init__(self):
        self.started, self.cancelled = asyncio.Event(), asyncio.Event()
        self.task: asyncio.Task | None = None

    async def receive(self):
        self.started.set()
        await self.cancelled.wait()
        return {"type": "http.disconnect"}


def _size(value) -> int:
    """The bytes a kept value holds in this process (sys.getsizeof, over its containers; a message shared with
    an earlier response's conversation counted again: a bound, not a measure): about six times its JSON for
    a short response."""
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        return size + sum(_size(k) + _size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return size + sum(_size(v) for v in value)
    return size


def _not_found(field: str, rid, code: str | None = None, status: int = 404) -> HTTPError:
    return HTTPError(status, f"{field}: no response {shown(rid)} is stored here (never made with store, deleted, "
                             "or dropped for room: --responses-store-mb)", param=field, code=code)


def input_items(body: dict) -> list[dict]:
    """This call's input (checked by chat_body) as input items, each with an id: a string is one user message."""
    given = body.get("input")
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    items = []
    for item in given:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_",
                               "reasoning": "rs_"}.get(kind, "item_") + uuid.uuid4().hex)
        item.setdefault("status", "completed")
        items.append(item)
    return items


def answer_messages(response: dict) -> list[dict]:
    """A finished response's output as the chat's assistant message: its text and its function calls."""
    text, calls = "", []
    for item in response["output"]:
        if item["type"] == "message":
            text += "".join(p.get("text", "") for p in item["content"])
        elif item["type"] == "function_call":
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
    message = {"role": "assistant", "content": text or (None if calls else "")}
    return [dict(message, tool_calls=calls) if calls else message]


class Store:
    """Kept responses by id, least recently used first (module docstring)."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.kept: collections.OrderedDict[str, Kept] = collections.OrderedDict()
        self.used = 0

    def call(self, owner: str, body: dict) -> Call:
        """The store's fields of a call (store, background, previous_response_id), checked."""
        check_fields(body, openai_responses.RESPONSES_FIELDS)  # (unknown fields first, as chat_body names them)
        keep, background = bool_field(body, "store", True), bool_field(body, "background", False)
        if background and not keep:
            raise bad_request("background: needs store: true (a background response is polled from the store)")
        if background and body.get("stream"):
            raise bad_request("background: not served with stream: true; poll GET /v1/responses/{id}")
        history = ()
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise bad_request("previous_response_id: must be a string")
            kept = self.find(owner, previous, "previous_response_id")
            status = kept.response["status"]
            if status not in FINISHED:
                raise bad_request(f"previous_response_id: response {shown(previous)} is {status}; only a completed "
                                  "or incomplete response can be continued")
            history = kept.conversation
        if (background or previous is not None) and not self.limit:
            field = "background" if background else "previous_response_id"
            raise bad_request(f"{field}: this server keeps no responses (--responses-store-mb 0)")
        return Call(owner, keep and self.limit > 0, background, history)

    def find(self, owner: str, rid: str, field: str = "response_id") -> Kept:
        kept = self.kept.get(rid)
        if kept is None or kept.owner != owner:
            if field == "previous_response_id":  # (OpenAI's: the call's field is wrong, a 400)
                raise _not_found(field, rid, "previous_response_not_found", 400)
            raise _not_found(field, rid)
        self.kept.move_to_end(rid)
        return kept

    def put(self, kept: Kept) -> bool:
        """Keep (or keep again, grown) a response; False if it alone is over the limit (not kept)."""
        rid = kept.response["id"]
        size = _size([kept.response, kept.items, kept.conversation])
        old = self.kept.pop(rid, None)
        self.used -= old.size if old is not None else 0
        if size > self.limit:
            return False
        kept.size, self.used = size, self.used + size
        self.kept[rid] = kept
        for other in list(self.kept):  # the least recently used first; never a background response running
            if self.used <= self.limit:
                break
            k = self.kept[other]
            if other != rid and (k.detached is None or k.detached.task is None or k.detached.task.done()):
                self.used -= self.kept.pop(other).size
        return True

    def delete(self, owner: str, rid: str) -> dict:
        kept = self.find(owner, rid)
        if kept.detached is not None:
            kept.detached.cancelled.set()
        self.used -= self.kept.pop(rid).size
        return {"id": rid, "object": "response", "deleted": True}

    def cancel(self, owner: str, rid: str) -> dict:
        kept = self.find(owner, rid)
        if kept.detached is None:
            raise bad_request(f"response_id: {shown(rid)} was not made in the background; only a background "
                              "response can be cancelled")
        kept.detached.cancelled.set()
        if kept.response["status"] in ("queued", "in_progress"):
            kept.response = dict(kept.response, status="cancelled")
        return kept.response

    def input_items(self, owner: str, rid: str, query) -> dict:
        """OpenAI's list of a response's input items: `limit` (1-100, 20), `order` (desc, asc), `after`,
        `before` (an item's id), `include` (nothing more to include: taken)."""
        items = self.find(owner, rid).items
        unknown = sorted(set(query) - {"limit", "order", "after", "before", "include", "include[]"})
        if unknown:
            raise bad_request(f"{unknown[0][:64]}: not a parameter of input_items")
        limit = query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= PAGE_LIMIT:
            raise bad_request(f"limit: must be an integer from 1 to {PAGE_LIMIT}, got {shown(limit)}")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"order: must be asc or desc, got {shown(order)}")
        items = items[::-1] if order == "desc" else list(items)
        ids = [item["id"] for item in items]
        for name in ("after", "before"):
            if name in query and query[name] not in ids:
                raise bad_request(f"{name}: {shown(query[name])} is not an input item of {shown(rid)}")
        start = ids.index(query["after"]) + 1 if "after" in query else 0
        end = ids.index(query["before"]) if "before" in query else len(items)
        page = items[start:end][:int(limit)]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end}

    def keeper(self, call: Call, body: dict, chat: dict):
        """The function reshape calls with the finished response object: keeps it (True), if the call asks."""
        if not call.keep:
            return None
        items, conversation = input_items(body), self._conversation(body, chat)
        return lambda response: self.put(Kept(call.owner, response, items, conversation(response)))

    @staticmethod
    def _conversation(body: dict, chat: dict):
        """The function of a finished response that gives the conversation through it (no instructions)."""
        asked = copy.deepcopy(chat["messages"][1:] if body.get("instructions") else chat["messages"])
        return lambda response: (*asked, *answer_messages(response)) if response["status"] in FINISHED else ()

    async def start(self, call: Call, body: dict, chat: dict, origins: list, model: str, run) -> dict:
        """A background response: `run(stand_in)` answers it (the chat machinery, given the stand-in for the
        client's request); the call answers once it is queued (or refused: raised), the work runs on, and its
        response is kept as it goes (queued, in_progress, then completed, incomplete, failed or cancelled)."""
        detached = _Detached()
        conversation = self._conversation(body, chat)
        response = openai_responses.Shape(body, model, stored=True).response("queued")
        kept = Kept(call.owner, response, input_items(body), detached=detached)

        async def work():
            try:
                answer = await run(detached)
            except (HTTPError, JaxcbError) as e:
                if not detached.started.is_set():  # refused before it was queued: the call's own error
                    raise
                e = e if isinstance(e, HTTPError) else http_error(e)
                return self._failed(kept, openai_responses.renamed(e, origins).message, e.code or "server_error")
            except Exception:  # the server's fault, kept as the response's error
                if not detached.started.is_set():
                    raise
                return self._failed(kept, "the server failed while answering", "server_error")
            if isinstance(answer, Response):  # cancelled (the stand-in hung up)
                kept.response = dict(kept.response, status="cancelled")
                return None
            done = openai_responses.reshape(answer, body, origins, rid=response["id"], stored=True)
            done["created_at"] = response["created_at"]
            if kept.response["status"] != "cancelled":  # (a cancel that came as it finished stays)
                kept.response, kept.conversation = done, conversation(done)
                if response["id"] in self.kept:  # (not deleted meanwhile)
                    self.put(kept)  # charged again, grown
            return None

        detached.task = asyncio.ensure_future(work())
        self.put(kept)
        started = asyncio.ensure_future(detached.started.wait())
        try:
            await asyncio.wait([detached.task, started], return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if detached.task.done() and not detached.started.is_set():
            self.kept.pop(response["id"], None)  # refused: nothing was kept
            self.used -= kept.size
            detached.task.result()  # raises the refusal
        if kept.response["status"] == "queued":
            kept.response = dict(kept.response, status="in_progress")
        return copy.deepcopy(kept.response)

    def _failed(self, kept: Kept, message: str, code: str) -> None:
        kept.response = dict(kept.response, status="failed", error={"code": code, "message": message})
