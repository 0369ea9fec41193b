"""OpenAI's Responses API, kept: responses stored for `previous_response_id` and the retrieval routes
(GET /v1/responses/{id}, DELETE, GET .../input_items, POST .../cancel), `background` responses, which
run on while the client polls, and conversations (the Conversations API).

A response is kept where the call asks (`store`: true unless false, as OpenAI has it) and the server keeps
any (--responses-store-mb; 0: none). Kept are its response object, this call's input items, and the
conversation through its answer as chat messages: the inputs and answers of the previous_response_id chain,
then its own (not `instructions`: a call gives its own, and a previous response's are not carried over, as
OpenAI has it; not the thinking: chat templates drop an earlier turn's, as for reasoning items given back).
A call naming a previous response reads that conversation, its own input after it.

Memory is bounded: each response is charged the bytes of everything it keeps as Python objects (its
conversation whole, though it shares the earlier responses' messages), and the least recently used are dropped
first to stay within the limit (a background response still running never); one that alone is over the limit is
not kept (its `store` false). A server with bearer tokens keeps each token's responses apart (another's id is
not found), each token within an even share of the limit (its own least recently used make room, never another
token's); one without keeps one store for every client. A client runs at most MAX_BACKGROUND background
responses at once (a 429 past them).

OpenAI's Conversations API is kept here too (the same limit, the same owners): a conversation holds items
(input items as a Responses call takes them: messages, function calls and their outputs, reasoning); a
Responses call naming it (`conversation`, not with previous_response_id) reads its items before its own input,
and its input and output items go on it once it is answered (a conversation that would outgrow the limit
stays as it was).

A background response is the one call that outlives its client: it runs until it ends, is cancelled
(POST .../cancel, or DELETE), or the server stops. Its fields are checked, and it is admitted and queued,
before the call answers; a refusal is the call's error, as for any other. A streamed one (`stream` too) keeps
its events as they are made: the call, and any GET .../{id}?stream=true&starting_after=N later, reads them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import dataclasses
import json
import re
import sys
import time
import uuid

from fastapi.responses import Response, StreamingResponse

from jaxcb.host.errors import JaxcbError, shown
from serve import openai_responses
from serve.frontend import MAX_TEXT_CHARS
from serve.openai_fields import (HTTPError, bad_request, bool_field, check_fields, check_metadata, http_error,
                                 list_page, list_query)

FINISHED = ("completed", "incomplete")
CONVERSATION_ITEMS = 20  # the most items a call adds to a conversation at once (OpenAI's)
PAGE_LIMIT = 100  # input_items' most per page
MAX_BACKGROUND = 32  # background responses running at once, per owner (every client's, on a server without tokens)


@dataclasses.dataclass
class Kept:
    owner: str  # "token<i>" with bearer tokens, else ""
    response: dict  # the response object as GET gives it
    items: list  # this call's input items, with their ids
    conversation: tuple = ()  # chat messages through its answer (module docstring)
    size: int = 0
    detached: _Detached | None = None  # a background response's stand-in for the client (a streamed one's events)


@dataclasses.dataclass
class Call:
    """What the store makes of a POST /v1/responses body."""
    owner: str
    keep: bool  # to be kept
    background: bool
    history: tuple  # the chat messages before this call's input: a previous response's or a conversation's
    history_field: str = "previous_response_id"  # the field `history` came from (errors in it name this)
    conversation: str | None = None  # the conversation the call's input and answer go on (Conversations API)


class _Detached:
    """What a background response's work is given in place of the client's request: until_gone's receive(),
    which says the request has been accepted (queued) and ends, as a hang-up would, when it is cancelled. A
    streamed one keeps its events (server-sent, sequence_number i the i-th) for every reader, then and later."""

    def __init__(self):
        self.started, self.cancelled = asyncio.Event(), asyncio.Event()
        self.task: asyncio.Task | None = None
        self.events: list[str] | None = None  # a streamed one's, so far
        self.ended = False  # no more events
        self._grew = asyncio.Event()  # set (and replaced) at each event and at the end

    async def receive(self):
        self.started.set()
        await self.cancelled.wait()
        return {"type": "http.disconnect"}

    def cancel(self) -> None:
        self.cancelled.set()
        if self.events is not None and self.task is not None:  # (a stream's work reads no receive(): stopped)
            self.task.cancel()

    def add(self, text: str | None) -> None:
        """One more event (None: the last has been)."""
        if text is None:
            self.ended = True
        else:
            self.events.append(text)
        grew, self._grew = self._grew, asyncio.Event()
        grew.set()

    async def follow(self, after: int = -1):
        """The events after sequence number `after`, those still to come as they come, to the end. A reader that
        goes away leaves the work running."""
        at = after + 1
        while True:
            grew = self._grew
            new = self.events[at:]
            for text in new:
                yield text
            at += len(new)
            if self.ended and at >= len(self.events):
                return
            if not new:
                await grew.wait()


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


def _not_found(field: str, rid, kind: str = "response", code: str | None = None, status: int = 404) -> HTTPError:
    made = "never made with store, " if kind == "response" else ""
    return HTTPError(status, f"{field}: no {kind} {shown(rid)} is stored here ({made}deleted, or dropped for room: "
                             "--responses-store-mb)", param=field, code=code)


def input_items(body: dict, field: str = "input") -> list[dict]:
    """This call's input (checked by chat_body) as input items, each with an id: a string is one user message."""
    given = body.get(field)
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


def _checked_items(body: dict, field: str, limit: int) -> list[dict]:
    """`body[field]`: a list of input items (as a Responses call's input takes them), at most `limit`, with ids."""
    given = body.get(field)
    if not isinstance(given, list) or not given or len(given) > limit:
        raise bad_request(f"{field}: must be a list of 1 to {limit} items")
    try:
        openai_responses.chat_messages(given)  # checked as a call's input is
    except HTTPError as e:
        raise HTTPError(e.status, field + e.message[len("input"):] if e.message.startswith("input") else e.message,
                        param=field + (e.param or "input")[len("input"):], code=e.code) from None
    return input_items(body, field)


def _check_text(items: list, field: str) -> None:
    """A conversation's text within what a call's input may hold (MAX_TEXT_CHARS): one past it could never be
    used (a 400 naming `field`)."""
    chars = sum(len(m["content"]) if isinstance(m.get("content"), str) else len(json.dumps(m.get("content")))
                for m in conversation_messages(items))
    if chars > MAX_TEXT_CHARS:
        raise bad_request(f"{field}: the conversation would hold {chars} characters of text; the limit is "
                          f"{MAX_TEXT_CHARS} (what a call's input may hold)")


def conversation_messages(items: list) -> tuple:
    """A conversation's items as chat messages (as a Responses call's input items become them)."""
    return tuple(openai_responses.chat_messages(items)) if items else ()


def _page(items: list, query, rid: str) -> dict:
    """OpenAI's list of items: `limit` (1-100, 20), `order` (desc, asc), `after`, `before` (an item's id),
    `include` (nothing more to include: taken)."""
    limit, order = list_query(query, {"before", "include", "include[]"}, PAGE_LIMIT, 20)
    items = items[::-1] if order == "desc" else list(items)
    ids = [item["id"] for item in items]
    for name in ("after", "before"):
        if name in query and query[name] not in ids:
            raise bad_request(f"{name}: {shown(query[name])} is not an item of {shown(rid)}")
    start = ids.index(query["after"]) + 1 if "after" in query else 0
    end = ids.index(query["before"]) if "before" in query else len(items)
    page = items[start:end][:limit]
    return list_page(page, start + len(page) < end)


class Store:
    """Kept responses by id, least recently used first (module docstring)."""

    def __init__(self, limit_bytes: int, owners: int = 1):
        self.limit = limit_bytes
        # Each owner's part of the limit (the server's bearer tokens share it evenly): one token's responses
        # and conversations never push out another's.
        self.share = limit_bytes // max(1, owners)
        self.kept: collections.OrderedDict[str, Kept] = collections.OrderedDict()
        self.used = 0
        self.owned: collections.Counter[str] = collections.Counter()  # owner -> bytes of what it keeps

    def _drop(self, rid: str) -> None:
        kept = self.kept.pop(rid, None)
        if kept is not None:
            self.used -= kept.size
            self.owned[kept.owner] -= kept.size

    def _running(self, owner: str) -> int:
        """The owner's background responses still running."""
        return sum(k.owner == owner and k.detached is not None and k.detached.task is not None
                   and not k.detached.task.done() for k in self.kept.values())

    def call(self, owner: str, body: dict) -> Call:
        """The store's fields of a call (store, background, previous_response_id), checked."""
        check_fields(body, openai_responses.RESPONSES_FIELDS)  # (unknown fields first, as chat_body names them)
        keep, background = bool_field(body, "store", True), bool_field(body, "background", False)
        if background and not keep:
            raise bad_request("background: needs store: true (a background response is polled from the store)")
        history = ()
        previous = body.get("previous_response_id")
        if previous is not None and body.get("conversation") is not None:
            raise bad_request("conversation: give either conversation or previous_response_id, not both")
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
        call = Call(owner, keep and self.limit > 0, background, history)
        given = body.get("conversation")
        if given is not None:
            cid = given.get("id") if isinstance(given, dict) and set(given) == {"id"} else given
            if not isinstance(cid, str):
                raise bad_request("conversation: must be a conversation's id, or {id}")
            kept = self.find(owner, cid, "conversation", "conversation")
            call.history, call.history_field, call.conversation = conversation_messages(kept.items), "conversation", cid
        return call

    def find(self, owner: str, rid: str, field: str = "response_id", kind: str = "response") -> Kept:
        """A kept response (or conversation: `kind`) of this owner's, now the most recently used."""
        kept = self.kept.get(rid)
        if kept is None or kept.owner != owner or kept.response["object"] != kind:
            if field in ("previous_response_id", "conversation"):  # (OpenAI's: the call's field is wrong, a 400)
                raise _not_found(field, rid, kind, "previous_response_not_found" if kind == "response" else None, 400)
            raise _not_found(field, rid, kind)
        self.kept.move_to_end(rid)
        return kept

    def put(self, kept: Kept) -> bool:
        """Keep (or keep again, grown) a response; False if it alone is over its owner's part of the limit (not
        kept). The owner's least recently used go first to make room, never another owner's."""
        rid = kept.response["id"]
        size = _size([kept.response, kept.items, kept.conversation, kept.detached and kept.detached.events])
        if size > self.share:  # (one kept before stays as it was)
            return False
        self._drop(rid)
        kept.size, self.used = size, self.used + size
        self.owned[kept.owner] += size
        self.kept[rid] = kept
        for other in list(self.kept):  # the least recently used first; never a background response running
            over = self.owned[kept.owner] > self.share
            if not over and self.used <= self.limit:  # (the whole limit too: owners beyond the tokens' count)
                break
            k = self.kept[other]
            if other != rid and (k.owner == kept.owner or not over) and (
                    k.detached is None or k.detached.task is None or k.detached.task.done()):
                self._drop(other)
        return True

    def get(self, owner: str, rid: str, query) -> dict:
        """A kept response as it is now (a background one: queued, in_progress, then finished)."""
        unknown = sorted(set(query) - {"include", "include[]", "stream", "starting_after", "include_obfuscation"})
        if unknown:
            raise bad_request(f"{unknown[0][:64]}: not a parameter of this call")
        kept = self.find(owner, rid)
        if query.get("stream", "false") == "false":
            return kept.response
        if query.get("stream") != "true":
            raise bad_request(f"stream: must be true or false, got {shown(query['stream'])}")
        if kept.detached is None or kept.detached.events is None:
            raise bad_request(f"stream: response {shown(rid)} was not streamed in the background; only such a "
                              "response's events are kept (stream false gives it whole)")
        after = query.get("starting_after", "-1")
        if not re.fullmatch(r"-1|[0-9]{1,12}", after):
            raise bad_request(f"starting_after: must be an event's sequence_number (an integer >= -1), got {shown(after)}")
        return openai_responses.event_stream(kept.detached.follow(int(after)))

    def delete(self, owner: str, rid: str) -> dict:
        kept = self.find(owner, rid)
        if kept.detached is not None:
            kept.detached.cancel()
        self._drop(rid)
        return {"id": rid, "object": "response", "deleted": True}

    def cancel(self, owner: str, rid: str) -> dict:
        kept = self.find(owner, rid)
        if kept.detached is None:
            raise bad_request(f"response_id: {shown(rid)} was not made in the background; only a background "
                              "response can be cancelled")
        kept.detached.cancel()
        if kept.response["status"] in ("queued", "in_progress"):
            kept.response = dict(kept.response, status="cancelled")
        return kept.response

    def input_items(self, owner: str, rid: str, query) -> dict:
        """OpenAI's list of a response's input items."""
        return _page(self.find(owner, rid).items, query, rid)

    # The Conversations API: a conversation is kept as a response is (the same limit, the same owners), its
    # items in `items`, its object (id, created_at, metadata) in `response`.
    def create_conversation(self, owner: str, body: dict) -> dict:
        check_fields(body, {"items", "metadata"})
        check_metadata(body.get("metadata"))
        items = _checked_items(body, "items", CONVERSATION_ITEMS) if body.get("items") is not None else []
        _check_text(items, "items")
        kept = Kept(owner, {"id": "conv_" + uuid.uuid4().hex, "object": "conversation", "created_at": int(time.time()),
                            "metadata": body.get("metadata") or {}}, items)
        if not self.limit:
            raise bad_request("conversation: this server keeps no conversations (--responses-store-mb 0)")
        if not self.put(kept):
            raise bad_request("items: more than the server keeps (--responses-store-mb)")
        return kept.response

    def conversation(self, owner: str, cid: str) -> dict:
        return self.find(owner, cid, "conversation_id", "conversation").response

    def update_conversation(self, owner: str, cid: str, body: dict) -> dict:
        kept = self.find(owner, cid, "conversation_id", "conversation")
        check_fields(body, {"metadata"})
        check_metadata(body.get("metadata"))
        kept.response = dict(kept.response, metadata=body.get("metadata") or {})
        self.put(kept)
        return kept.response

    def delete_conversation(self, owner: str, cid: str) -> dict:
        self.find(owner, cid, "conversation_id", "conversation")
        self._drop(cid)
        return {"id": cid, "object": "conversation.deleted", "deleted": True}

    def conversation_items(self, owner: str, cid: str, query) -> dict:
        return _page(self.find(owner, cid, "conversation_id", "conversation").items, query, cid)

    def add_items(self, owner: str, cid: str, body: dict) -> dict:
        kept = self.find(owner, cid, "conversation_id", "conversation")
        check_fields(body, {"items"})
        added = _checked_items(body, "items", CONVERSATION_ITEMS)
        self._grow(kept, added)
        return {"object": "list", "data": added, "first_id": added[0]["id"], "last_id": added[-1]["id"],
                "has_more": False}

    def item(self, owner: str, cid: str, item_id: str) -> dict:
        for item in self.find(owner, cid, "conversation_id", "conversation").items:
            if item["id"] == item_id:
                return item
        raise HTTPError(404, f"item_id: no item {shown(item_id)} in conversation {shown(cid)}", param="item_id")

    def delete_item(self, owner: str, cid: str, item_id: str) -> dict:
        kept = self.find(owner, cid, "conversation_id", "conversation")
        self.item(owner, cid, item_id)
        kept.items = [item for item in kept.items if item["id"] != item_id]
        self.put(kept)
        return kept.response

    def _grow(self, kept: Kept, items: list, field: str = "items") -> None:
        """Items added to a conversation (kept again, charged for them); one that would be over the limit alone
        is left as it was (a 400 naming `field`)."""
        before = kept.items
        _check_text([*before, *items], field)
        kept.items = [*before, *items]
        if not self.put(kept):
            kept.items = before
            self.put(kept)
            raise bad_request(f"{field}: the conversation would be more than the server keeps (--responses-store-mb)")

    def _continue(self, call: Call, items: list, response: dict) -> None:
        """A finished response's input and output items go on the conversation it names (if still kept; one that
        would outgrow the limit is left as it was)."""
        kept = self.kept.get(call.conversation) if call.conversation else None
        if kept is None or kept.owner != call.owner or kept.response["object"] != "conversation":
            return
        if response["status"] in FINISHED:
            with contextlib.suppress(HTTPError):
                self._grow(kept, copy.deepcopy([*items, *response["output"]]))

    def keeper(self, call: Call, body: dict, chat: dict):
        """The function reshape calls with the finished response object: keeps it (True) if the call asks, and
        puts its input and output on the conversation it names."""
        if not call.keep and call.conversation is None:
            return None
        items, conversation = input_items(body), self._conversation(body, chat)

        def keep(response: dict) -> bool:
            self._continue(call, items, response)
            return call.keep and self.put(Kept(call.owner, response, items, conversation(response)))

        return keep

    @staticmethod
    def _conversation(body: dict, chat: dict):
        """The function of a finished response that gives the conversation through it (no instructions)."""
        asked = copy.deepcopy(chat["messages"][1:] if body.get("instructions") else chat["messages"])
        return lambda response: (*asked, *answer_messages(response)) if response["status"] in FINISHED else ()

    async def start(self, call: Call, body: dict, chat: dict, origins: list, model: str, run):
        """A background response: `run(stand_in)` answers it (the chat machinery, given the stand-in for the
        client's request); the call answers once it is queued (or refused: raised), the work runs on, and its
        response is kept as it goes (queued, in_progress, then completed, incomplete, failed or cancelled). A
        streamed one (`stream`) answers with its events, and keeps them for GET .../{id}?stream=true."""
        if self._running(call.owner) >= MAX_BACKGROUND:
            raise HTTPError(429, f"background: this client has {MAX_BACKGROUND} background responses running, the "
                                 "limit; wait for one to end, or cancel one", param="background")
        detached = _Detached()
        if body.get("stream"):
            detached.events = []
        conversation = self._conversation(body, chat)
        response = openai_responses.Shape(body, model, stored=True).response("queued")
        kept = Kept(call.owner, response, input_items(body), detached=detached)

        def finished(done: dict) -> bool:
            """The finished response object kept (unless cancelled meanwhile, or deleted)."""
            if kept.response["status"] != "cancelled":  # (a cancel that came as it finished stays)
                kept.response, kept.conversation = done, conversation(done)
                self._continue(call, kept.items, done)
                if response["id"] in self.kept and not self.put(kept):  # charged again, grown (not deleted meanwhile)
                    self._drop(response["id"])  # (alone over the limit: not kept)
            return True

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
            if isinstance(answer, StreamingResponse):  # admitted: its requests start as its events are read
                detached.started.set()
                return await self._pump(kept, openai_responses.reshape(
                    answer, body, origins, finished, response["id"], True, response["created_at"]).body_iterator)
            if isinstance(answer, Response):  # cancelled (the stand-in hung up)
                kept.response = dict(kept.response, status="cancelled")
                return None
            done = openai_responses.reshape(answer, body, origins, rid=response["id"], stored=True)
            done["created_at"] = response["created_at"]
            finished(done)
            return None

        detached.task = asyncio.ensure_future(work())
        self.put(kept)
        started = asyncio.ensure_future(detached.started.wait())
        try:
            await asyncio.wait([detached.task, started], return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if detached.task.done() and not detached.started.is_set():
            self._drop(response["id"])  # refused: nothing was kept
            detached.task.result()  # raises the refusal
        if kept.response["status"] == "queued":
            kept.response = dict(kept.response, status="in_progress")
        if detached.events is not None:
            return openai_responses.event_stream(detached.follow())
        return copy.deepcopy(kept.response)

    async def _pump(self, kept: Kept, events) -> None:
        """A streamed background response's events read to their end (the response kept as it finishes), each
        kept for its readers; a cancel closes them (the requests aborted)."""
        detached = kept.detached
        try:
            async with contextlib.aclosing(events):
                async for text in events:
                    detached.add(text)
                    if text.startswith("event: response.failed\n"):  # (failed mid-stream: the event's response)
                        kept.response = json.loads(text.split("\ndata: ", 1)[1])["response"]
        except asyncio.CancelledError:  # (cancelled: the response says so; the task ends here)
            pass
        finally:
            # Cut short: its readers' streams end with an event that says so (an error event, cancelled or deleted;
            # response.failed), never as if it had finished.
            seq, last = len(detached.events), None
            if kept.response["status"] in ("queued", "in_progress", "cancelled") and detached.cancelled.is_set():
                kept.response = dict(kept.response, status="cancelled")
                last = openai_responses.sse_event("error", seq, code="response_cancelled", param=None,
                              message="the response was cancelled (or deleted) before it finished")
            elif kept.response["status"] in ("queued", "in_progress"):  # (ended with no response: the server's fault)
                self._failed(kept, "the server failed while answering", "server_error")
                last = openai_responses.sse_event("response.failed", seq, response=kept.response)
            if last is not None:
                detached.add(last)
            detached.add(None)
            if kept.response["id"] in self.kept:
                self.put(kept)  # (charged for its events)

    def _failed(self, kept: Kept, message: str, code: str) -> None:
        kept.response = dict(kept.response, status="failed", error={"code": code, "message": message})
