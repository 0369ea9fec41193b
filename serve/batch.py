"""Batch lines: a file of OpenAI Batch API requests answered by the HTTP API's own handlers in this process
(`jaxcb run-batch`, serve.server.run_batch; a server's Batch API, serve.openai_batches): the file `vllm
run-batch` reads and OpenAI's Batch API takes, each line

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

and one output line per input line, in input order, in OpenAI's batch output shape:

    {"id": "batch_req_...", "custom_id": "r1", "response": {"status_code": 200, "request_id": "...",
     "body": {...}}, "error": null}

A request the API refuses keeps its status and error body under `response`, and its error object under
`error` too (vLLM's readers test `error`, OpenAI's read the body); a line that is no request (not JSON, a
field missing, a URL not served) has `response` null and `error` {code, message, line}. Each body goes
through the app (serve.openai_api.make_app) over an in-process ASGI transport (run_lines), so a batch
line is checked, run and answered exactly as the same body over HTTP. Lines run concurrently (at most
`max_in_flight` at once; the engine batches them), read as they are needed, so a file of any length takes
bounded memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from jaxcb.host.errors import InvalidRequest
from jaxcb.host.request import read_json
from serve import frontend

# The calls a line may make: those that answer a body (streams, background runs and calls that change the
# server's state, such as loading adapters, are not batch work).
URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages",
        "/v1/messages/count_tokens", "/v1/responses/input_tokens", "/score", "/v1/score", "/rerank", "/v1/rerank",
        "/v2/rerank", "/classify", "/v1/classify", "/pooling", "/tokenize", "/detokenize")
LINE_FIELDS = ("custom_id", "method", "url", "body")
MAX_CUSTOM_ID_CHARS = 512
MAX_LINE_BYTES = frontend.MAX_REQUEST_BYTES + (1 << 16)  # a body at the HTTP limit and the line around it
logging.getLogger("httpx").setLevel(logging.WARNING)  # (its INFO line per request: one per batch line)


class LineError(Exception):
    """A line that is no request: its output line has this error and no response."""

    def __init__(self, code: str, message: str, custom_id=None):
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, custom_id


def read_request(raw: bytes | None, seen: set[str]) -> tuple[str, str, dict]:
    """A line's (custom_id, url, body), every field checked (`raw` None: a line past MAX_LINE_BYTES, `lines`);
    `seen` holds the custom_ids before it (each must be unique, as OpenAI's Batch API requires). Raises LineError."""
    if raw is None:
        raise LineError("line_too_long", f"line: longer than {MAX_LINE_BYTES} bytes")
    try:
        line = read_json(raw, "line")
    except InvalidRequest as e:
        raise LineError("invalid_json", str(e)) from None
    if not isinstance(line, dict):
        raise LineError("invalid_request", "line: must be a JSON object with custom_id, method, url and body")
    custom_id = line.get("custom_id")
    custom = custom_id if isinstance(custom_id, str) else None
    extra = [k for k in line if k not in LINE_FIELDS]
    if extra:
        raise LineError("invalid_request", f"{extra[0][:100]}: not a field of a batch line (it has "
                                           f"{', '.join(LINE_FIELDS)})", custom)
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("invalid_request", "custom_id: must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise LineError("invalid_request", f"custom_id: {len(custom_id)} characters; the limit is "
                                           f"{MAX_CUSTOM_ID_CHARS}")
    if custom_id in seen:
        raise LineError("duplicate_custom_id", f"custom_id: {custom_id!r} is on an earlier line; each must be "
                                               "unique", custom)
    seen.add(custom_id)
    if line.get("method") != "POST":
        raise LineError("invalid_request", f"method: must be \"POST\", got {json.dumps(line.get('method'))[:100]}",
                        custom)
    url = line.get("url")
    if url not in URLS:
        raise LineError("invalid_url", f"url: {json.dumps(url)[:200]} is not a batch call; one of {', '.join(URLS)}",
                        custom)
    body = line.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "body: must be a JSON object", custom)
    for flag in ("stream", "background"):
        if body.get(flag):
            raise LineError("invalid_request", f"body.{flag}: a batch line is answered by one body; {flag} must "
                                               "be false or left out", custom)
    return custom_id, url, body


def lines(source):
    """(line number, its bytes or None where it is longer than MAX_LINE_BYTES), blank lines left out."""
    number = 0
    while True:
        raw = source.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        number += 1
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # (a UTF-8 byte-order mark: Windows editors write one)
            raw = raw[3:]
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (rest := source.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield number, None
        elif raw.strip():
            yield number, raw


def json_line(out: dict) -> str:
    """An output line as the file holds it: UTF-8, but the line breaks JSON leaves raw in strings escaped
    (U+2028, U+2029, U+0085: httpx's iter_lines and str.splitlines split lines at them)."""
    text = json.dumps(out, ensure_ascii=False)
    for raw, escaped in _BREAKS:
        text = text.replace(raw, escaped)
    return text + "\n"


_BREAKS = (("\u2028", "\\u2028"), ("\u2029", "\\u2029"), ("\x85", "\\u0085"))


def output_line(custom_id, status: int | None = None, body=None, error=None) -> dict:
    response = None if status is None else {"status_code": status, "request_id": f"batch-{uuid.uuid4().hex}",
                                            "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


class Tally:
    """A run's lines so far: answered (status 200), failed (any other answer, or no request), output tokens."""

    def __init__(self):
        self.lines = self.answered = self.failed = self.output_tokens = self.input_tokens = self.cached_tokens = 0
        self.model = None  # the model the first answer names

    def count(self, out: dict) -> None:
        self.lines += 1
        response = out["response"]
        if out["error"] is None and response and response["status_code"] == 200:
            self.answered += 1
            body = response["body"] if isinstance(response["body"], dict) else {}
            self.model = self.model or body.get("model")
            usage = body.get("usage") or {}
            self.output_tokens += _int(usage.get("completion_tokens", usage.get("output_tokens", 0)))
            self.input_tokens += _int(usage.get("prompt_tokens", usage.get("input_tokens", 0)))
            details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
            self.cached_tokens += _int(details.get("cached_tokens", 0))
        else:
            self.failed += 1

    def usage(self) -> dict:
        """OpenAI's Batch usage over the answered lines."""
        return {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + self.output_tokens}


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


BUSY = (429,)  # the answers a line waits out and is sent again for, with retry_busy (the server is full)


async def run_lines(app, source, write, max_in_flight: int, tally: Tally, *, headers: dict | None = None,
                    retry_busy: bool = False, alive=lambda: True, progress=None, answered: set = frozenset()) -> None:
    """Every line of `source` (a binary file) through `app`, each output line given to `write(out)` in
    input order and counted in `tally`. At most `max_in_flight` lines run at once, and at most 8x that many
    answers wait for a slower line before them. `headers` go with every line (a batch's owner's
    authorization). `retry_busy`: a line refused because the server is full (429) is sent again after a
    wait, not failed (a server's batch behind its other clients); else the caller admits max_in_flight lines.
    `alive()` false (the engine died) stops the reading: the lines after are not run (`progress(text)` says
    so, and every 10 s how far the run is). Cancelled, the lines in flight are cancelled (their requests
    aborted). Lines whose custom_id is in `answered` (answered before: a batch that goes on) are not run again
    and give no output line."""
    import httpx

    seen = set()
    slots = asyncio.Semaphore(max_in_flight)
    order: asyncio.Queue = asyncio.Queue(maxsize=8 * max_in_flight)  # the lines' tasks, in input order
    live: set[asyncio.Task] = set()
    headers = {**(headers or {}), "content-type": "application/json"}
    transport = httpx.ASGITransport(app=app, client=("run-batch", 0))

    async def post(client, url: str, body: dict) -> tuple[int, dict]:
        content, wait = json.dumps(body).encode(), 0.25
        while True:
            response = await client.post(url, content=content, headers=headers)
            if not (retry_busy and response.status_code in BUSY):
                break
            await asyncio.sleep(wait)
            wait = min(2 * wait, 5.0)
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, {"error": {"message": response.text[:1000], "type": "error", "param": None,
                                                    "code": None}}

    async def run(client, number: int, raw: bytes | None) -> dict:
        try:
            custom_id, url, body = read_request(raw, seen)
            if custom_id in answered:
                return None
            status, answer = await post(client, url, body)
            error = None
            if status != 200:  # (OpenAI's and Anthropic's error bodies both hold an "error" object)
                error = answer.get("error") if isinstance(answer, dict) else None
                error = error if isinstance(error, dict) else {"message": str(error)}
                error = {"code": error.get("code") or error.get("type") or "error",
                         "message": error.get("message", ""), "line": number}
            return output_line(custom_id, status, answer, error)
        except LineError as e:
            return output_line(e.custom_id, error={"code": e.code, "message": e.message, "line": number})
        finally:
            slots.release()

    async def read(client):
        for number, raw in lines(source):
            await slots.acquire()
            if not alive():
                slots.release()
                if progress:
                    progress(f"the engine stopped; lines from {number} on were not run")
                break
            task = asyncio.ensure_future(run(client, number, raw))
            live.add(task)
            task.add_done_callback(live.discard)
            await order.put(task)
        await order.put(None)

    last = time.monotonic()
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
        reader = asyncio.ensure_future(read(client))
        try:
            while (task := await order.get()) is not None:
                if (out := await task) is None:
                    continue
                write(out)  # (counted once written: a write that fails leaves it uncounted)
                tally.count(out)
                if progress and time.monotonic() - last > 10:
                    last = time.monotonic()
                    progress(f"{tally.lines} lines answered ({tally.failed} failed)")
            await reader
        finally:
            reader.cancel()
            for task in list(live):
                task.cancel()
