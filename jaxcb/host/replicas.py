"""Data parallelism: M engine replicas on disjoint devices behind one router.

Each replica is a whole engine (its own scheduler, page pool, prefix cache and runner on its own
devices, `tensor_parallel` of them) stepping on its own thread (EngineThread); nothing is shared
between replicas but the host process. The router sends each request to one replica:

1. the replica whose prefix cache holds the longest run of the request's leading pages, if any holds
   a page of it and its pending tokens are within `balance_tokens` of the least loaded replica;
2. otherwise the replica with the fewest pending tokens.

Pending tokens are the router's own account: a request adds its prompt tokens plus max_tokens per
sample when it is routed; its prompt leaves the account at its first event, each generated token as
it streams, and what a finished sample did not use when it finishes. The prefix lookup reads the
replica's page pool without changing it (one dict lookup per page), so it needs no lock.

`Replicas` offers what the server needs of one engine and its thread (validate, stats, is_live,
warmup; submit, abort, start, stop, alive), so one replica and many are served the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Callable

from jaxcb.host.engine import Engine
from jaxcb.host.engine_stats import EngineStats
from jaxcb.host.engine_thread import EngineThread
from jaxcb.host.errors import InvalidConfig, InvalidRequest
from jaxcb.host.prefix_cache import chain_hash, salt_root
from jaxcb.host.request import SamplingParams, TokenEvent


@dataclasses.dataclass
class _Routed:
    replica: int
    pending: int  # tokens still counted against the replica
    prompt_left: int  # prompt tokens not yet discounted (at the first event)
    samples_left: int
    max_tokens: int
    produced: dict = dataclasses.field(default_factory=dict)  # sample index -> tokens so far


class Replicas:
    def __init__(self, engines: list[Engine], on_death: Callable[[BaseException], None] | None = None,
                 on_step: Callable[[int, Engine, list], None] | None = None, balance_tokens: int | None = None):
        if not engines:
            raise InvalidConfig("parallel.data: at least one replica is needed")
        self.engines = engines
        # on_step(replica index, engine, events) on each replica's thread after each of its steps
        self.threads = [EngineThread(e, on_death=on_death,
                                     on_step=None if on_step is None else functools.partial(on_step, i))
                        for i, e in enumerate(engines)]
        first = engines[0]
        self.model_config, self.tokenizer, self.config = first.model_config, first.tokenizer, first.config
        self.classifier = first.classifier
        self.max_context = first.max_context
        # Prefer a prefix hit unless that replica is this far behind the least loaded: by default one
        # full batch of maximum-context requests' worth of decoding.
        self.balance_tokens = balance_tokens if balance_tokens is not None else first.max_context * 4
        self._lock = threading.Lock()
        self._routes: dict[str, _Routed] = {}
        self.load = [0] * len(engines)  # pending tokens per replica
        self.routed = [0] * len(engines)  # requests sent to each replica
        self.prefix_routed = 0  # requests sent by their cached prefix rather than by load
        self.started = False

    def __len__(self) -> int:
        return len(self.engines)

    # ---- what the server reads ----
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engines[0].validate(prompt_ids, params)  # replicas share the model and the config

    def check_constraint(self, constraint) -> None:
        """Compile a structured-output constraint (cached; InvalidRequest if it is not valid). Slow the
        first time for a large grammar: the server calls it off the event loop."""
        self.engines[0].grammars.compile(constraint)  # one Grammars per tokenizer, shared by the replicas

    def stats(self) -> EngineStats:
        """The replicas' stats summed (compilations are counted per process: the same in every one)."""
        per = [e.stats() for e in self.engines]
        if len(per) == 1:
            return per[0]
        total = {}
        for f in dataclasses.fields(EngineStats):
            values = [getattr(s, f.name) for s in per]
            total[f.name] = (max(values) if f.name == "compilations" else values[0] if isinstance(values[0], str)
                             else sum(values) / len(values) if isinstance(values[0], float) else sum(values))
        return EngineStats(**total)

    # ---- LoRA adapters: registered with every replica (jaxcb.host.lora) ----
    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        first = self.engines[0]
        first.load_lora(name, path, replace)  # read and checked once
        adapter = first.adapters.entries[name].adapter
        for e in self.engines[1:]:
            e.adapters.add(name, adapter, replace)

    def unload_lora(self, name: str) -> bool:
        return all([e.unload_lora(name) for e in self.engines])

    def lora_info(self) -> dict | None:
        """The adapters (jaxcb.host.lora.Adapters.info) summed over the replicas; None without slots."""
        infos = [e.adapters.info() for e in self.engines if e.adapters is not None]
        if not infos:
            return None
        per = {}
        for info in infos:
            for name, (run, wait) in info["per_adapter"].items():
                r, w = per.get(name, (0, 0))
                per[name] = (r + run, w + wait)
        return {"max_lora": infos[0]["max_lora"], "running": sorted(n for n, (r, _) in per.items() if r),
                "waiting": sorted(n for n, (_, w) in per.items() if w), "loaded": infos[0]["loaded"],
                "swaps": sum(i["swaps"] for i in infos), "per_adapter": per}

    def lora_names(self) -> list[str]:
        return self.engines[0].adapters.names() if self.engines[0].adapters is not None else []

    def reset_counters(self) -> None:
        for e in self.engines:
            e.reset_counters()

    def replica_stats(self) -> list[EngineStats]:
        return [e.stats() for e in self.engines]

    def is_live(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._routes

    def warmup(self, progress=None) -> int:
        shapes = 0
        for e in self.engines:
            shapes = e.warmup(progress)
        return shapes

    # ---- the threads ----
    def start(self) -> "Replicas":
        self.started = True
        for t in self.threads:
            t.start()
        return self

    @property
    def alive(self) -> bool:
        return all(t.alive for t in self.threads)

    @property
    def error(self) -> BaseException | None:
        return next((t.error for t in self.threads if t.error is not None), None)

    def stop(self, timeout: float = 10.0) -> None:
        for t in self.threads:
            t.stop(timeout)

    # ---- routing ----
    def choose(self, prompt_ids: list[int], cache_salt: str = "") -> tuple[int, int]:
        """(replica, cached prefix pages there) for a prompt; see the module docstring."""
        least = min(range(len(self.engines)), key=lambda i: (self.load[i], self.routed[i]))
        if len(self.engines) == 1:
            return 0, 0
        s = self.config.page_size
        hashes, h = [], salt_root(cache_salt)
        for k in range((len(prompt_ids) - 1) // s):  # the pages a request can take from the cache
            h = chain_hash(h, prompt_ids[k * s:(k + 1) * s])
            hashes.append(h)
        if not hashes or not self.config.scheduler.prefix_caching:
            return least, 0
        cached = [len(e.pool.lookup(hashes)) for e in self.engines]
        best = max(range(len(self.engines)), key=lambda i: (cached[i], -self.load[i]))
        if cached[best] and self.load[best] - self.load[least] <= self.balance_tokens:
            return best, cached[best]
        return least, 0

    def submit(self, prompt_ids: list[int], params: SamplingParams, callback: Callable[[TokenEvent], None],
               request_id: str | None = None, **kw) -> str:
        prompt_ids = [int(t) for t in prompt_ids]
        cost = len(prompt_ids) + params.n * params.max_tokens

        def on_event(ev: TokenEvent) -> None:  # the replica's engine thread
            self._account(ev)
            callback(ev)

        # Under the lock until the route is recorded: the replica's first event waits for it.
        with self._lock:
            if request_id and request_id in self._routes:
                raise InvalidRequest(f"request_id: {request_id!r} is already in use by a running request")
            i, cached = self.choose(prompt_ids, kw.get("cache_salt", ""))
            rid = self.threads[i].submit(prompt_ids, params, on_event, request_id=request_id, **kw)
            self._routes[rid] = _Routed(i, cost, len(prompt_ids), params.n, params.max_tokens)
            self.load[i] += cost
            self.routed[i] += 1
            self.prefix_routed += cached > 0
        return rid

    def _account(self, ev: TokenEvent) -> None:
        with self._lock:
            route = self._routes.get(ev.request_id)
            if route is None:
                return
            used = route.prompt_left + len(ev.token_ids)
            route.prompt_left = 0
            route.produced[ev.index] = route.produced.get(ev.index, 0) + len(ev.token_ids)
            if ev.finished:
                used += route.max_tokens - route.produced[ev.index]
                route.samples_left -= 1
            used = min(used, route.pending)
            route.pending -= used
            self.load[route.replica] -= used
            if route.samples_left == 0:
                self.load[route.replica] -= route.pending  # 0 unless the accounting drifted
                del self._routes[ev.request_id]

    def reset_prefix_cache(self) -> list:
        """Every replica's prefix cache forgets what it holds where nothing runs (Engine.reset_prefix_cache):
        one future each, telling whether it did."""
        return self.woken([e.reset_prefix_cache() for e in self.engines])

    # ---- pausing, and new weights: every replica (vLLM's RL routes; jaxcb.weight_update) ----
    def pause(self, mode: str = "abort", clear_cache: bool = True) -> list:
        """Every replica pauses (Engine.pause; a mode it does not know is refused by the first, before any pauses):
        one future each, told True once that one is still."""
        return self.woken([e.pause(mode, clear_cache) for e in self.engines])

    def resume(self) -> list:
        return self.woken([e.resume() for e in self.engines])

    @property
    def paused(self) -> bool:
        return any(e.paused is not None for e in self.engines)

    def sleep(self, level: int = 1, mode: str = "abort") -> list:
        """Every replica sleeps (Engine.sleep): one future each, told True once that one is asleep."""
        return self.woken([e.sleep(level, mode) for e in self.engines])

    def wake_up(self, parts=None) -> list:
        """One future each, told whether that replica is whole again (Engine.wake_up)."""
        return self.woken([e.wake_up(parts) for e in self.engines])

    def release_kv_cache(self) -> list:
        return self.woken([e.release_kv_cache() for e in self.engines])

    @property
    def asleep(self) -> bool:
        return any(e.asleep for e in self.engines)

    def woken(self, futures: list) -> list:
        """The engines' inboxes hold something now (their futures): their threads take it at once."""
        for t in self.threads:
            t.wake()
        return futures

    def abort(self, request_id: str) -> None:
        with self._lock:
            route = self._routes.get(request_id)
        if route is not None:
            self.threads[route.replica].abort(request_id)


def split_devices(devices: list, tensor: int, data: int) -> list[list]:
    """Disjoint device groups, one per replica, `tensor` devices each (in jax.devices() order)."""
    need = tensor * data
    if need > len(devices):
        raise InvalidConfig(f"parallel: {data} replicas x {tensor} devices = {need} devices asked for, "
                         f"{len(devices)} present")
    return [devices[i * tensor:(i + 1) * tensor] for i in range(data)]
