"""LoRA adapters, the host side: which adapters an engine serves, and which of them sit in the device slots.

An adapter is registered by name (at start with `--lora NAME=PATH`, or while serving) and kept in
host memory; the device holds `max_loras` slots (jaxcb.device.lora). A request names its adapter
(SamplingParams.lora); it holds a reference from the moment it is queued until it ends, and a slot
while it runs. Admission (jaxcb.host.scheduler) asks for a slot: the adapter's own if it is resident,
else a free slot or the least recently used one that no running request holds, filled from host
memory (a swap); when every slot is held by running requests the request waits, and is admitted
once one frees. Unloading an adapter that requests still reference takes effect when the last ends;
new requests for it are refused at once. The prefix cache keys pages by the adapter's load (the same
prompt under two adapters, or under two loads of one name, never shares pages).

Plain Python, no JAX: filling a slot is the runner's (a callback), reading a PEFT directory the model
side's (jaxcb.model.lora).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Callable

from jaxcb.host.errors import InvalidConfig, InvalidRequest, NotFound, shown

# The projections an adapter may adapt, by this project's matrix names (jaxcb.model.lora maps PEFT's).
TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def check_targets(targets, shapes: dict) -> None:
    """The adapters' targets are matrices of the model whose weight shapes are `shapes`
    (ModelConfig.weight_shapes): a mixture of experts has no dense MLP to adapt."""
    missing = [t for t in targets if t not in shapes]
    if missing:
        raise InvalidConfig(f"lora.targets: {missing} are not matrices of this model (a mixture of experts has no "
                            f"dense MLP; its matrices: {[t for t in TARGETS if t in shapes]})")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """`[lora]` in the engine config (flags --lora, --max-loras, --max-lora-rank, --max-cpu-loras)."""

    max_loras: int = 0  # device slots: adapters resident at once (0 = no adapters)
    max_rank: int = 16  # the largest rank an adapter may have (slots are padded to it)
    max_cpu_loras: int = 64  # adapters registered at once (host memory); 0 = no limit
    targets: tuple[str, ...] = TARGETS  # the projections the slots cover
    adapters: tuple[str, ...] = ()  # "NAME=PATH" registered at start

    def __post_init__(self):
        for name, low in (("max_loras", 0), ("max_rank", 1), ("max_cpu_loras", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InvalidConfig(f"lora.{name}: must be an integer >= {low}, got {v!r}")
        object.__setattr__(self, "targets", tuple(self.targets))
        object.__setattr__(self, "adapters", tuple(self.adapters))
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise InvalidConfig(f"lora.targets: {bad or '[]'} not among {list(TARGETS)}")
        if self.adapters and not self.max_loras:
            raise InvalidConfig("lora.adapters: adapters given but lora.max_loras is 0 (no device slots)")

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0


@dataclasses.dataclass(eq=False)
class Entry:
    """A registered adapter: its weights (host), its load's id, who uses it, where it sits."""

    name: str
    adapter: object  # jaxcb.model.lora.Adapter
    load_id: int
    refs: int = 0  # live requests (waiting or running) that use it
    running: int = 0  # ... of those, running: they hold its slot
    slot: int = -1  # its device slot, -1 not resident
    last_used: float = 0.0
    unloading: bool = False  # unloaded (or replaced) while referenced: goes when the last request ends

    @property
    def key(self) -> str:
        """What the prefix cache keys its pages by."""
        return f"\x00lora\x00{self.name}\x00{self.load_id}"


class Adapters:
    """The registry of one engine (see the module docstring). add/remove/ref come from any thread;
    acquire/release run on the engine thread."""

    def __init__(self, config: LoraConfig, reader: Callable[[str, str], object] | None = None,
                 fill: Callable[[int, object], None] | None = None):
        self.config = config
        self.reader = reader  # (name, path) -> Adapter: read and check a PEFT directory
        self.fill = fill  # (slot, Adapter) -> None: the runner fills a device slot
        self.entries: dict[str, Entry] = {}
        self.slots: list[Entry | None] = [None] * config.max_loras
        self.num_swaps = 0  # slot fills
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # ---- registration (any thread) ----
    def load(self, name: str, path: str, replace: bool = False) -> Entry:
        """Read the adapter at `path` and register it as `name` (`replace`: in place of the one of that name)."""
        self._check_name(name)
        if self.reader is None:
            raise InvalidConfig("lora: this engine has no adapter reader")
        with self._lock:
            self._check_free(name, replace)
        adapter = self.reader(name, path)  # outside the lock: reading may take a while
        return self.add(name, adapter, replace)

    def add(self, name: str, adapter, replace: bool = False) -> Entry:
        """Register `adapter` as `name`. `replace` (vLLM's load_inplace): in place of the adapter of that name, if
        any: requests from now on run the new one; those that took the old one (running or waiting) finish on it,
        which goes when the last ends. A new load is a new prefix-cache key: no page of the old is shared."""
        self._check_name(name)
        with self._lock:
            self._check_free(name, replace)
            old = self.entries.get(name)
            entry = Entry(name, adapter, next(self._ids))
            self.entries[name] = entry
            if old is not None:
                old.unloading = True
                if not old.refs:
                    self._drop(old)
            return entry

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name or len(name) > 256:
            raise InvalidRequest(f"lora_name: must be a non-empty string of at most 256 characters, got {shown(name)}")

    def _check_free(self, name: str, replace: bool = False) -> None:
        if not self.config.enabled:
            raise InvalidRequest("lora_name: this server has no LoRA slots (lora.max_loras = 0)")
        if replace and name in self.entries:
            return  # (in place of it: the count stays)
        if name in self.entries and self.entries[name].unloading:
            raise InvalidRequest(f"lora_name: the adapter named {shown(name)} is being unloaded: its running requests "
                                 "finish first; load it again once they have")
        if name in self.entries:
            raise InvalidRequest(f"lora_name: an adapter named {shown(name)} is already loaded")
        limit = self.config.max_cpu_loras
        if limit and len(self.entries) >= limit:
            raise InvalidRequest(f"lora_name: {len(self.entries)} adapters are loaded, the limit lora.max_cpu_loras is "
                                 f"{limit}; unload one first")

    def remove(self, name: str) -> bool:
        """Unload `name`: at once if no request uses it (True), else when the last one ends (False)."""
        with self._lock:
            entry = self.entries.get(name)
            if entry is None or entry.unloading:
                raise InvalidRequest(f"lora_name: no adapter named {shown(name)} is loaded")
            if entry.refs:
                entry.unloading = True
                return False
            self._drop(entry)
            return True

    def _drop(self, entry: Entry) -> None:
        if self.entries.get(entry.name) is entry:  # (one replaced in place is no longer under its name)
            del self.entries[entry.name]
        if entry.slot >= 0:
            self.slots[entry.slot] = None
            entry.slot = -1

    def names(self) -> list[str]:
        with self._lock:
            return [n for n, e in self.entries.items() if not e.unloading]

    def ref(self, name: str, count: int = 1) -> Entry:
        """A new request (`count` samples) uses `name`: its entry, or InvalidRequest naming what is loaded."""
        with self._lock:
            entry = self.entries.get(name)
            if entry is None or entry.unloading:
                loaded = sorted(n for n, e in self.entries.items() if not e.unloading)
                raise NotFound(f"lora: no LoRA adapter named {shown(name)} is loaded (loaded: {loaded or 'none'})")
            entry.refs += count
            return entry

    def unref(self, entry: Entry) -> None:
        """A request that used `entry` ended (its slot already released)."""
        with self._lock:
            entry.refs -= 1
            if not entry.refs and entry.unloading:
                self._drop(entry)

    # ---- slots (the engine thread) ----
    def acquire(self, entry: Entry, now: float | None = None) -> int:
        """A slot holding `entry` for a request about to run: its own, a free one or the least recently
        used one nobody runs on (filled now); -1 when every slot is held."""
        with self._lock:
            if entry.slot < 0:
                free = [i for i, e in enumerate(self.slots) if e is None]
                if free:
                    slot = free[0]
                else:
                    idle = [e for e in self.slots if e is not None and not e.running]
                    if not idle:
                        return -1
                    victim = min(idle, key=lambda e: e.last_used)
                    slot, victim.slot = victim.slot, -1
                self.fill(slot, entry.adapter)
                self.slots[slot] = entry
                entry.slot = slot
                self.num_swaps += 1
            entry.running += 1
            entry.last_used = time.monotonic() if now is None else now
            return entry.slot

    def release(self, entry: Entry, now: float | None = None) -> None:
        """A request running on `entry`'s slot stopped running (finished or preempted)."""
        with self._lock:
            entry.running -= 1
            entry.last_used = time.monotonic() if now is None else now

    def info(self) -> dict:
        """For metrics: the adapters with running and with waiting requests, and the slot count."""
        with self._lock:
            running = sorted(n for n, e in self.entries.items() if e.running)
            waiting = sorted(n for n, e in self.entries.items() if e.refs > e.running)
            return {"max_lora": self.config.max_loras, "running": running, "waiting": waiting,
                    "loaded": sorted(self.entries), "swaps": self.num_swaps,
                    "per_adapter": {n: (e.running, e.refs - e.running) for n, e in self.entries.items()}}
