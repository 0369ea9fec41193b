"""The scheduling policies: their settings (SchedulerConfig) and the order each puts requests in. The
scheduler (jaxcb.host.scheduler) owns the mechanism (pages, chunks, preemption); this module only says
who goes first. Plain Python, no JAX.

  fcfs            arrival order
  sjf             shortest first (prompt length + max_tokens), aged so that no long request starves
  priority        larger priority first; waiting raises it by `aging_per_s` a second
  length-buckets  prompts grouped by length; a group is admitted together once it fills the free
                  slots or its oldest request has waited max_wait_ms, then the others fill in
  round-robin     queue order; a request that yielded its slot goes to the back
  fair            each client (Request.client: a bearer token, a gateway's fairness id) an even share of
                  the batch slots: the waiting are admitted client by client, fewest running first, and a
                  client over its share yields a slot (after its quantum) to one under it that waits
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq

from jaxcb.host.errors import InvalidConfig
from jaxcb.host.request import Request
from jaxcb.host.speculative import SpeculativeConfig

POLICIES = ("fcfs", "sjf", "priority", "length-buckets", "round-robin", "fair")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16
    max_running: int = 32  # batch slots
    max_prefill_tokens: int = 512  # prompt tokens per step, over all chunks
    max_chunk: int = 512  # tokens of one prefill chunk (the largest prefill bucket)
    max_context: int = 2048  # tokens one sequence may hold (prompt + output)
    policy: str = "fcfs"
    max_wait_ms: float = 0.0  # dynamic-batching window for admitting new prefills
    min_batch: int = 1  # admit new prefills once this many wait (or max_wait_ms passed)
    aging_per_s: float = 1.0  # priority policy: priority gained per second of waiting
    max_priority: int = 100  # priority policy: client priorities are clamped to +-this (bounds any wait)
    sjf_aging_tokens_per_s: float = 100.0  # sjf: a waiting request counts this many tokens shorter a second
    length_bounds: tuple[int, ...] = (64, 256)  # length-buckets policy: short < 64 <= medium < 256 <= long
    quantum_tokens: int = 32  # round-robin, fair: tokens a request generates before it yields to a waiting one
    target_p99_tpot_ms: float | None = None  # latency target: the running limit and prefill budget adapt
    target_p99_ttft_ms: float | None = None  # ... and to this time to first token (the TPOT target wins)
    static: bool = False  # classic static batching: admit a new batch only when the last one is done
    prefix_caching: bool = True  # share computed pages between requests with a common prefix
    prefix_aware: bool = False  # admit requests whose prefix is cached first ...
    prefix_max_wait_ms: float = 500.0  # ... unless another has waited longer than this
    async_scheduling: bool = True  # schedule and pack step N+1 while the device runs step N
    speculative: SpeculativeConfig = SpeculativeConfig()  # speculative decoding (off by default)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise InvalidConfig(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in ("page_size", "max_running", "max_prefill_tokens", "max_chunk", "max_context", "min_batch",
                     "quantum_tokens"):
            if getattr(self, name) < 1:
                raise InvalidConfig(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_wait_ms < float("inf"):
            raise InvalidConfig(f"max_wait_ms: must be a finite number >= 0, got {self.max_wait_ms}")
        if self.max_priority < 0:
            raise InvalidConfig(f"max_priority: must be >= 0, got {self.max_priority}")
        if self.aging_per_s < 0 or self.sjf_aging_tokens_per_s < 0:
            raise InvalidConfig("aging_per_s, sjf_aging_tokens_per_s: must be >= 0")
        for name in ("target_p99_tpot_ms", "target_p99_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise InvalidConfig(f"{name}: must be a positive number of milliseconds, got {value}")
        if self.prefix_max_wait_ms < 0:
            raise InvalidConfig(f"prefix_max_wait_ms: must be >= 0, got {self.prefix_max_wait_ms}")


def order_key(config: SchedulerConfig, r: Request, now: float):
    """A request's place in the policy's order: smaller first."""
    p = config.policy
    waited = now - r.arrival_time
    if p == "sjf":  # aging: a long request waits at most (its length - a short one's) / rate seconds
        return (r.max_total_tokens - config.sjf_aging_tokens_per_s * waited, r.arrival_time, r.seq_no)
    if p == "priority":
        m = config.max_priority
        priority = min(max(r.priority, -m), m)  # clamped: no priority outranks aging for long
        return (-(priority + config.aging_per_s * waited), r.arrival_time, r.seq_no)
    if p == "round-robin":  # queue order: a request that yielded goes to the back
        return (r.queued_time if r.queued_time is not None else r.arrival_time, r.seq_no)
    return (r.arrival_time, r.seq_no)


def _length_bucket(config: SchedulerConfig, r: Request) -> int:
    return bisect.bisect_right(config.length_bounds, len(r.prompt_ids))


def _prefix_key(config: SchedulerConfig, cache, r: Request, now: float) -> int:
    if (now - r.arrival_time) * 1000 >= config.prefix_max_wait_ms:
        return 0  # waited long enough: first, whatever its prefix
    return 1 if cache.cached_pages(r) else 2


def fair_order(waiting: list[Request], running) -> list[Request]:
    """`waiting` (in arrival order) client by client: each next slot to the client with the fewest requests
    running or placed before, its oldest first."""
    counts = collections.Counter(r.client for r in running)
    queues: dict[str, collections.deque] = collections.defaultdict(collections.deque)
    for r in waiting:
        queues[r.client].append(r)
    heap = [(counts[c], q[0].arrival_time, q[0].seq_no, c) for c, q in queues.items()]
    heapq.heapify(heap)
    out = []
    while heap:
        n, _, _, c = heapq.heappop(heap)
        out.append(queues[c].popleft())
        if queues[c]:
            heapq.heappush(heap, (n + 1, queues[c][0].arrival_time, queues[c][0].seq_no, c))
    return out


def admission_order(config: SchedulerConfig, waiting, running, cache, now: float, room: int) -> list[Request]:
    """The waiting requests in the order the policy admits them (empty: admit none this step). `cache`:
    the prefix cache (or None); `room`: free batch slots; `running`: the requests running."""
    c = config
    waiting = sorted(waiting, key=lambda r: order_key(c, r, now))
    if not waiting:
        return []
    if c.policy == "fair":
        waiting = fair_order(waiting, running)
    if c.prefix_aware and cache is not None:
        waiting.sort(key=lambda r: _prefix_key(c, cache, r, now))  # stable: policy order within a tier
    oldest_wait_ms = (now - min(r.arrival_time for r in waiting)) * 1000
    window_open = len(waiting) >= c.min_batch or oldest_wait_ms >= c.max_wait_ms or c.max_wait_ms == 0
    if c.policy != "length-buckets":
        return waiting if window_open else []
    groups: dict[int, list[Request]] = collections.defaultdict(list)
    for r in waiting:
        groups[_length_bucket(c, r)].append(r)

    def ready(g):
        return len(g) >= room or (now - g[0].arrival_time) * 1000 >= c.max_wait_ms

    ready_groups = [g for g in groups.values() if ready(g)]
    if not ready_groups:
        if running:
            return []  # let a group fill up (it becomes ready by max_wait_ms at the latest)
        ready_groups = [max(groups.values(), key=len)]
    first = min(ready_groups, key=lambda g: g[0].arrival_time)
    chosen = set(map(id, first))  # by identity, in one pass: `r not in first` was O(waiting x group)
    return first + [r for r in waiting if id(r) not in chosen]
