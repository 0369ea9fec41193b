"""What other threads hand the engine thread: new requests (all samples of one together, with their output
streams) and aborts, which the loop drains at the start of every step, so that only the engine thread
touches the scheduler and the pool; and the request ids in use, with the seeds of the samples.

Plain Python, no JAX.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import random
import secrets
import threading
from typing import Iterator

from jaxcb.host.errors import InvalidRequest
from jaxcb.host.request import Request


@dataclasses.dataclass(frozen=True)
class Add:
    """A request's samples and their output streams (Engine.add_request), which join the scheduler
    together at the next step."""

    samples: list[Request]
    streams: list


@dataclasses.dataclass(frozen=True)
class Abort:
    """Every sample of the request ends at the next step (Engine.abort)."""

    request_id: str


@dataclasses.dataclass(frozen=True)
class ForgetCache:
    """The prefix cache forgets every page it holds, if no request runs or waits (Engine.reset_prefix_cache):
    `done` is told whether it did."""

    done: concurrent.futures.Future


PAUSE_MODES = ("wait", "abort", "keep")  # (from the least strict: a later pause keeps the stricter)
WAKE_PARTS = ("weights", "kv_cache")  # what a sleep frees (Engine.wake_up's tags)


@dataclasses.dataclass(frozen=True)
class Pause:
    """Generation pauses (Engine.pause, vLLM's modes): "abort" ends every request there is, "wait" lets the
    running ones finish, "keep" freezes them where they are; requests that arrive meanwhile wait, unadmitted,
    for Resume. `done` is told True once the engine is still (nothing in flight, nothing running but what
    "keep" froze), its prefix cache forgotten if `clear_cache` (not with "keep"). A sleep (Engine.sleep) is a pause
    of `level` 1 or 2 that, once still, frees the devices' memory."""

    mode: str
    clear_cache: bool
    done: concurrent.futures.Future
    level: int = 0


@dataclasses.dataclass(frozen=True)
class Resume:
    """Generation goes on (Engine.resume); `done` is told whether the engine had been paused."""

    done: concurrent.futures.Future


@dataclasses.dataclass(frozen=True)
class ReleaseKV:
    """The KV pages off the devices, the weights kept (vLLM's release_kv_cache_memory): only once a pause has
    settled and no request is left (`done` is told True; else an InvalidRequest saying so)."""

    done: concurrent.futures.Future


@dataclasses.dataclass(frozen=True)
class WakeUp:
    """What sleep freed back on the devices (Engine.wake_up; `parts` of WAKE_PARTS): `done` is told whether the
    engine is whole again (then it resumes)."""

    parts: frozenset
    done: concurrent.futures.Future


@dataclasses.dataclass(frozen=True)
class Swap:
    """New weights, made for the runner already (Engine.swap_weights; a draft model cut from them, `draft_params`),
    taken between two steps: `done` is told the version once every step after it runs on them."""

    params: object
    version: str | None
    done: concurrent.futures.Future
    draft_params: object = None


class Inbox:
    """Thread-safe: any thread puts, the engine thread drains."""

    def __init__(self, seed: int | None = None):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        # Seeds for requests that bring none: OS entropy (unpredictable, also across restarts), unless
        # the config fixes a seed for reproducible runs.
        self.rng = secrets.SystemRandom() if seed is None else random.Random(seed)
        self._lock = threading.Lock()  # guards the generator and the live ids
        self._live_ids: set[str] = set()

    def reserve(self, request_id: str, seed: int | None, n: int) -> list[int]:
        """Take a request id (a live request's is refused) and draw its n samples' seeds: sample 0 keeps
        the given seed, the others draw theirs from it (not seed + i, which would repeat another request's
        sample 0 that asked for seed + 1); a request without one gets fresh ones."""
        with self._lock:
            if request_id in self._live_ids:
                raise InvalidRequest(f"request_id: {request_id!r} is already in use by a running request")
            self._live_ids.add(request_id)
            return [self.rng.getrandbits(63) if seed is None
                    else seed if i == 0 else random.Random(f"{seed}/{i}").getrandbits(63) for i in range(n)]

    def release(self, request_id: str) -> None:
        """The request's last sample ended: its id is free again."""
        with self._lock:
            self._live_ids.discard(request_id)

    def is_live(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._live_ids

    def add(self, samples: list[Request], streams: list) -> None:
        self._items.put(Add(samples, streams))  # all samples in one item: they arrive together

    def abort(self, request_id: str) -> None:
        self._items.put(Abort(request_id))

    def put(self, item: ForgetCache | Pause | Resume | Swap | WakeUp | ReleaseKV) -> concurrent.futures.Future:
        self._items.put(item)
        return item.done

    def empty(self) -> bool:
        return self._items.empty()

    def drain(self) -> Iterator[Add | Abort | ForgetCache | Pause | Resume | Swap | WakeUp | ReleaseKV]:
        """The items put so far, in order (the engine thread, at the start of a step)."""
        while True:
            try:
                yield self._items.get_nowait()
            except queue.Empty:
                return
