"""A request's own chat template rendered in a process of its own: bounded in time, memory and output.

jinja2's sandbox keeps a template from reaching Python's internals, but not from looping for ever, building a
string of gigabytes or recursing: a template is a program, and one a client sends (vLLM's `chat_template`
field, served with --trust-request-chat-template; LLM.chat's `chat_template`) runs here, in one of at most
WORKERS child processes (python -m jaxcb.host.template_process, plain Python and jinja2: no JAX), each under an
address-space limit of MEMORY_BYTES. A render answers within RENDER_S or its worker is killed (a new one
starts for the next); its output stops at MAX_CHARS; one that finds every worker busy for SLOT_WAIT_S is
refused as overloaded (a 429), so slow templates hold at most WORKERS of the server's threads. Each breach is an InvalidRequest naming the
chat template and the limit, as a template's own errors are; the server's threads never run the template, so
nothing it does can hold them, the event loop or shutdown. The model's template, and the server's
--chat-template, are the operator's: they render in process (jaxcb.host.chat_template).

The protocol is one JSON line each way: {template, variables, max_chars} -> {text} | {invalid} | {error}.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time

from jaxcb.host.errors import InvalidRequest, Overloaded

WORKERS = 2
RENDER_S = 5.0
MEMORY_BYTES = 1 << 30
MAX_CHARS = 4 << 20  # a rendering's characters (the prompt it writes must then fit the context)
SLOT_WAIT_S = 0.5  # how long a render waits for a free worker before it is refused as overloaded


class _Worker:
    def __init__(self):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxcb.host.template_process"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self.buffer = b""

    def ask(self, line: bytes, seconds: float) -> dict | None:
        """The worker's answer to `line`, or None if none came whole within `seconds` (or it died)."""
        deadline = time.monotonic() + seconds
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        out = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out], [], [], left)[0]:
                return None
            chunk = os.read(out, 1 << 20)
            if not chunk:  # (it died: out of memory, or killed)
                return None
            self.buffer += chunk
        reply, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(reply)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


_idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
_slots = threading.BoundedSemaphore(WORKERS)


def render(template: str, variables: dict, field: str = "chat_template") -> str:
    """`template` rendered with `variables` (JSON values) in a worker process; InvalidRequest naming `field`
    for whatever the template does wrong, and for a render past RENDER_S, MEMORY_BYTES or MAX_CHARS."""
    line = (json.dumps({"template": template, "variables": variables, "max_chars": MAX_CHARS}) + "\n").encode()
    if not _slots.acquire(timeout=SLOT_WAIT_S):  # (callers' threads are not held waiting: others need them)
        raise Overloaded(f"{field}: every template worker is busy ({WORKERS} renders at once); retry")
    try:
        try:
            worker = _idle.get_nowait()
        except queue.Empty:
            worker = _Worker()
        reply = worker.ask(line, RENDER_S)
        if reply is None:
            dead = worker.proc.poll() is not None
            worker.kill()
            if dead:
                raise InvalidRequest(f"{field}: the template used more than {MEMORY_BYTES >> 20} MiB while rendering; "
                                     "the limit")
            raise InvalidRequest(f"{field}: the template took more than {RENDER_S:g} s to render; the limit")
        _idle.put(worker)
    finally:
        _slots.release()
    if "text" in reply:
        return reply["text"]
    if "invalid" in reply:
        raise InvalidRequest(reply["invalid"])
    raise InvalidRequest(f"{field}: could not render the request ({reply['error']}: {reply['message']})")


def main() -> None:
    """The worker: renders each request line until stdin closes."""
    import resource

    from jaxcb.host.chat_template import compile_template

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    for line in sys.stdin.buffer:
        try:
            ask = json.loads(line)
            chunks, size = [], 0
            for chunk in compile_template(ask["template"]).generate(**ask["variables"]):
                size += len(chunk)
                if size > ask["max_chars"]:
                    raise InvalidRequest(f"chat_template: the rendering is longer than {ask['max_chars']} characters; "
                                         "the limit")
                chunks.append(chunk)
            reply = {"text": "".join(chunks)}
        except InvalidRequest as e:
            reply = {"invalid": str(e)}
        except MemoryError:
            reply = {"invalid": f"chat_template: the template used more than {MEMORY_BYTES >> 20} MiB while rendering; "
                                "the limit"}
        except Exception as e:  # noqa: BLE001 - the template's fault: the request's error (RecursionError too)
            reply = {"error": type(e).__name__, "message": str(e)[:200]}
        chunks = None
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
