"""The scheduler: each step, which requests run and how many of their tokens.

Plain Python, no JAX. Every step, running requests come first, best first by the policy: each gets
one token if it is decoding, or a chunk of its prompt (chunked prefill, under a per-step budget of
prefill tokens) if it is still prefilling. Each first takes the pages its tokens need; when the pool
cannot supply them, the worst running request by the policy is preempted (its pages freed, its
progress dropped, requeued to be recomputed later) until they fit. Then, if nothing was preempted,
waiting requests are admitted in policy order while a batch slot, budget and pages remain.

With prefix caching (jaxcb.prefix_cache), a request being admitted first takes the cached pages of
its longest cached prefix and is scheduled from there. With `prefix_aware`, waiting requests whose
prefix is cached go first, except that a request waiting longer than `prefix_max_wait_ms` goes
before both (so preferring cached prefixes cannot starve anyone). A request whose next page is being
computed right now by a running request's prefill waits for it instead of computing it a second time:
that is how the samples of an n > 1 request, or a burst of requests with one system prompt, prefill
their shared pages once.

A request with a single pending token is a decode row; the engine batches those in one step and runs
each multi-token chunk as a prefill. Policies only decide order; the mechanism is the same for all:
  fcfs            arrival order
  sjf             shortest first (prompt length + max_tokens)
  priority        larger priority first; waiting raises it by `aging_per_s` a second, so nothing starves
  length-buckets  prompts grouped by length; a group is admitted together once it fills the free
                  slots or its oldest request has waited max_wait_ms, then the others fill in
  round-robin     queue order; while requests wait for a slot, a running request that has generated
                  `quantum_tokens` since it was (re)admitted yields its slot to the longest-waiting
                  one. Its full pages stay registered in the prefix cache (free but cached), so on its
                  return it recomputes only what was evicted meanwhile and its partial last page.

A latency target (`target_p99_tpot_ms`, optionally `target_p99_ttft_ms`) hands the running limit and
the prefill budget to a controller (`LatencyController`) fed with measured step times and first-token
times; with it, admission also keeps a page of headroom per running request, so growth does not
preempt.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import time
from typing import NamedTuple

from jaxcb.page_pool import PagePool
from jaxcb.prefix_cache import PrefixCache
from jaxcb.request import FinishReason, Request, Status
from jaxcb.trace import quantile

POLICIES = ("fcfs", "sjf", "priority", "length-buckets", "round-robin")


class Sampled(NamedTuple):
    """A token a step sampled for a request (Scheduler.on_step_done): its row in the step's output, the
    request it was appended to, the token, and how the request ends with it (None: it goes on)."""

    row: int
    request: Request
    token: int
    finish: FinishReason | None


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
    quantum_tokens: int = 32  # round-robin: tokens a request generates before it yields to a waiting one
    target_p99_tpot_ms: float | None = None  # latency target: the running limit and prefill budget adapt
    target_p99_ttft_ms: float | None = None  # ... and to this time to first token (the TPOT target wins)
    static: bool = False  # classic static batching: admit a new batch only when the last one is done
    prefix_caching: bool = True  # share computed pages between requests with a common prefix
    prefix_aware: bool = False  # admit requests whose prefix is cached first ...
    prefix_max_wait_ms: float = 500.0  # ... unless another has waited longer than this
    async_scheduling: bool = True  # schedule and pack step N+1 while the device runs step N

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in ("page_size", "max_running", "max_prefill_tokens", "max_chunk", "max_context", "min_batch",
                     "quantum_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_wait_ms < float("inf"):
            raise ValueError(f"max_wait_ms: must be a finite number >= 0, got {self.max_wait_ms}")
        if self.max_priority < 0:
            raise ValueError(f"max_priority: must be >= 0, got {self.max_priority}")
        if self.aging_per_s < 0 or self.sjf_aging_tokens_per_s < 0:
            raise ValueError("aging_per_s, sjf_aging_tokens_per_s: must be >= 0")
        for name in ("target_p99_tpot_ms", "target_p99_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name}: must be a positive number of milliseconds, got {value}")
        if self.prefix_max_wait_ms < 0:
            raise ValueError(f"prefix_max_wait_ms: must be >= 0, got {self.prefix_max_wait_ms}")


class LatencyController:
    """Holds a p99 time-per-output-token target (and optionally a time-to-first-token one) by moving the
    running limit and the per-step prefill budget, from measured step times.

    A request's time per token is the mean of the step times over its life, and what makes a step slow
    is the prompt tokens it carries beside the decode rows. So the prefill budget is set from two
    running estimates, the time of a decode-only step and the time each prompt token adds: the most
    prompt tokens the next step can carry and keep the mean of the last `span` decode steps under
    `high` x target (at least `min_budget`). Prefill is
    then spread over the steps instead of arriving in bursts that a short request cannot average out,
    at the same cost per prompt token. The running limit is the backstop: once `span` steps ran since
    the last change, a mean of the last `span` decode steps above `high` x target shrinks it by target
    / mean (at most halving it, at least by 15%); every `every` steps, when the largest `span`-step mean
    over the last `window` steps is below `high` x target, it grows by one. A TTFT target above its
    measured p90 (first tokens of the last requests) grows the budget while the TPOT target leaves room,
    since queueing is what makes a first token late; the TPOT target wins a conflict.
    """

    high, window, span, every = 0.9, 64, 8, 8
    smoothing = 0.2  # weight of the newest step in the running estimates

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.running_limit = config.max_running
        self.min_budget = min(16, config.max_prefill_tokens)
        self.prefill_budget = config.max_prefill_tokens
        self._steps = collections.deque(maxlen=self.window)
        self._ttft = collections.deque(maxlen=32)
        self._tpot = collections.deque(maxlen=128)  # finished requests' mean time per token (the metric)
        self._since = 0  # steps since the last evaluation of growth
        self._fresh = 0  # steps since the last change of the limit
        self.decode_ms: float | None = None  # a decode-only step, smoothed
        self.prompt_token_ms: float | None = None  # what a prompt token adds to a step, smoothed
        self._extra = 0.0  # TTFT: the share of the room between the budget's step and the target to use
        self.signal_ms = 0.0  # the last signal: the largest mean of `span` consecutive decode steps
        self.num_adjustments = 0

    def observe_step(self, seconds: float, decode_rows: int = 1, prompt_tokens: int = 0) -> None:
        """A completed step took `seconds`: `decode_rows` rows waited for their next token in it beside
        `prompt_tokens` tokens of prefill chunks."""
        ms, a = seconds * 1000, self.smoothing
        if prompt_tokens == 0:
            self.decode_ms = ms if self.decode_ms is None else (1 - a) * self.decode_ms + a * ms
        elif prompt_tokens >= self.min_budget // 2:  # enough tokens to tell their cost from the noise
            base = self.decode_ms if self.decode_ms is not None and decode_rows else 0.0
            per = max(ms - base, 0.0) / prompt_tokens
            self.prompt_token_ms = per if self.prompt_token_ms is None else (1 - a) * self.prompt_token_ms + a * per
        tpot = self.config.target_p99_tpot_ms
        if decode_rows:  # a prefill-only step: no row waited for a token
            self._steps.append(ms)
            self._since += 1
            self._fresh += 1
        if tpot is not None:
            self._budget_for(tpot)
        if not decode_rows:
            return
        k = self.span
        if self._fresh < k:
            return
        steps = list(self._steps)
        recent = sum(steps[-k:]) / k
        if tpot is not None and recent > self.high * tpot:
            self._set_limit(int(self.running_limit * min(0.85, max(0.5, self.high * tpot / recent))))
            return
        if self._since < self.every:
            return
        self._since = 0
        run = worst = sum(steps[:k])
        for i in range(k, len(steps)):
            run += steps[i] - steps[i - k]
            worst = max(worst, run)
        self.signal_ms = worst / k
        ttft, late = self.config.target_p99_ttft_ms, False
        if ttft is not None and len(self._ttft) >= 4:
            late = quantile(list(self._ttft), 0.9) > ttft
        if tpot is None:
            if late:  # only a TTFT target: queueing makes first tokens late; more of everything
                self._set_limit(self.running_limit + 1)
                self.prefill_budget = min(self.config.max_prefill_tokens, int(self.prefill_budget * 1.15) + 1)
            return
        if self.signal_ms < self.high * tpot:
            self._set_limit(self.running_limit + 1)
            if late:
                self._extra = min(1.0, self._extra + 0.25)
        elif not late:
            self._extra = 0.0

    def _budget_for(self, tpot: float) -> None:
        """The most prompt tokens the next step can carry and keep the mean of the last `span` decode
        steps under `high` x target: a big chunk is followed by decode-only steps until the window has
        room again, so prefill is spread over the steps instead of arriving in bursts."""
        if self.prompt_token_ms is None or self.prompt_token_ms <= 0:
            return
        k = self.span
        previous = list(self._steps)[-(k - 1):]
        previous_ms = sum(previous) + (k - 1 - len(previous)) * (self.decode_ms or 0.0)
        room = k * self.high * tpot - previous_ms - (self.decode_ms or 0.0)
        room += self._extra * k * (1 - self.high) * tpot  # a late TTFT may use the margin
        budget = int(room / self.prompt_token_ms + 1e-6)
        self.prefill_budget = min(max(self.min_budget, budget), self.config.max_prefill_tokens)

    def observe_first_token(self, seconds: float) -> None:
        self._ttft.append(seconds * 1000)

    def observe_finished(self, tpot_seconds: float) -> None:
        self._tpot.append(tpot_seconds * 1000)

    @property
    def measured_p99_tpot_ms(self) -> float:
        return quantile(list(self._tpot), 0.99)

    @property
    def measured_p99_ttft_ms(self) -> float:
        return quantile(list(self._ttft), 0.99)

    def _set_limit(self, limit: int) -> None:
        limit = min(max(1, limit), self.config.max_running)
        if limit != self.running_limit:
            self.num_adjustments += 1
            self._fresh = 0  # judge the new setting on its own steps
        self.running_limit = limit


@dataclasses.dataclass(slots=True)
class Chunk:
    """Tokens `request.all_ids[start:start + num_tokens]` run this step."""

    request: Request
    start: int
    num_tokens: int
    samples: bool = dataclasses.field(init=False)  # it reaches the newest token: it yields the next one

    def __post_init__(self):
        # Fixed when scheduled: by the time the step's tokens come back the request may have grown.
        self.samples = self.start + self.num_tokens == self.request.num_tokens

    @property
    def attention_pairs(self) -> int:
        """(query, key) pairs its causal attention computes: each token sees the context before it."""
        return self.num_tokens * self.start + self.num_tokens * (self.num_tokens + 1) // 2


@dataclasses.dataclass
class SchedulerOutput:
    decode: list[Chunk]  # one token each, batched in one decode step
    prefill: list[Chunk]  # more than one token each, one prefill step each
    preempted: list[Request]  # lost their pages this step; back in the waiting queue
    num_static_rows: int = 0  # static mode: rows the batch occupies, finished ones included

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """Owns the request state: which run, their pages, their computed and generated tokens, their end."""

    def __init__(self, config: SchedulerConfig, pool: PagePool, eos_ids: tuple[int, ...] = (), window=None):
        self.config = config
        self.pool = pool
        self.window = window  # jaxcb.window.WindowGroup: the sliding layers' pages (Gemma), else None
        self.eos_ids = frozenset(eos_ids)
        self.cache = PrefixCache(pool, window) if config.prefix_caching else None
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.controller = (LatencyController(config) if config.target_p99_tpot_ms is not None
                           or config.target_p99_ttft_ms is not None else None)
        self._fixed_limit = config.max_running
        self.num_preemptions = 0  # out of pages
        self.num_switches = 0  # round-robin yields
        self.num_recomputed_tokens = 0  # tokens computed again after a preemption or a switch ...
        self.num_switch_recomputed_tokens = 0  # ... of those, after a switch
        self._static_rows = 0  # static mode: size of the current batch, finished members included
        self._static_batch: list[Request] = []

    # ---- queue ----
    def check_fits(self, request: Request) -> None:
        """Reject at once what could never run, instead of queueing it forever: a request whose whole
        context needs more pages than the cache holds. (The context limit is checked with the other
        fields by Engine.validate.)"""
        pages = self.pool.pages_for(request.max_total_tokens)
        if pages > self.pool.num_usable:
            raise ValueError(
                f"max_tokens: prompt + max_tokens needs {pages} KV pages but the cache holds only "
                f"{self.pool.num_usable}"
            )
        if self.window is not None:
            chunk = min(self.config.max_chunk, self.config.max_prefill_tokens, request.max_total_tokens)
            pages = min(self.window.pages_per_chunk(chunk), self.pool.pages_for(request.max_total_tokens))
            if pages > self.window.pool.num_usable:
                raise ValueError(f"max_tokens: the sliding-window layers need {pages} KV pages for this request "
                                 f"but their cache holds only {self.window.pool.num_usable}")

    @property
    def running_limit(self) -> int:
        """Batch slots now: max_running, or the latency controller's current limit."""
        return self.controller.running_limit if self.controller is not None else self._fixed_limit

    @running_limit.setter
    def running_limit(self, value: int) -> None:  # a fixed limit (benchmarks); the controller sets its own
        if self.controller is not None:
            self.controller.running_limit = value
        else:
            self._fixed_limit = value

    def add(self, request: Request) -> None:
        """Queue a validated request (Engine.validate)."""
        request.status = Status.WAITING
        if request.queued_time is None:
            request.queued_time = request.arrival_time
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drop a request (finished or aborted) and return its pages."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.page_ids:
            self.pool.free(request.page_ids)
            request.page_ids = []
        if self.window is not None:
            self.window.release(request)
        request.num_registered = 0

    def finish(self, request: Request, reason: FinishReason) -> None:
        """The request ends (its last token, a stop string, an abort or an error): its pages go back."""
        self.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason

    # ---- a step's life: launched, then its tokens back ----
    def on_launched(self, chunks: list[Chunk], step_id: int) -> None:
        """The step is on the device: its tokens count as computed, and each sampling chunk's next token
        is pending (row `i` of step `step_id`'s output) until the step's tokens come back."""
        for row, c in enumerate(chunks):
            r = c.request
            r.num_computed = c.start + c.num_tokens
            if c.samples:
                r.num_pending += 1
                r.pending_src = (step_id, row)

    def on_step_done(self, chunks: list[Chunk], epochs: list[int], token_ids) -> list[Sampled]:
        """The step's tokens came back (`token_ids[i]` sampled for chunk i). Registers the pages it filled,
        appends each sampled token and returns a Sampled for each, its finish being STOP
        for a stop token or EOS and LENGTH at max_tokens or the context limit; the caller finishes them.
        A chunk whose request ended or was preempted (`epochs`: preemption counts at launch) since the
        launch is void."""
        sampled = []
        eos, max_context = self.eos_ids, self.config.max_context
        for row, (c, epoch) in enumerate(zip(chunks, epochs)):
            r = c.request
            if r.status is not Status.RUNNING or r.num_preemptions != epoch:
                continue
            if self.cache is not None:
                self.cache.register(r, c.start + c.num_tokens)
            if not c.samples:
                continue
            r.num_pending -= 1
            if not r.num_pending:
                r.pending_src = None
            token = int(token_ids[row])
            r.output_ids.append(token)
            p, reason = r.params, None
            if token in p.stop_token_ids or (token in eos and not p.ignore_eos):
                reason = FinishReason.STOP
            elif len(r.output_ids) >= p.max_tokens or r.num_known >= max_context:
                reason = FinishReason.LENGTH
            sampled.append(Sampled(row, r, token, reason))
        return sampled

    def observe_step_done(self, chunks: list[Chunk], seconds: float | None,
                          sampled: list[tuple[Request, bool]], now: float) -> None:
        """Feed the latency controller from a completed step, by the one rule the engine and the
        simulator share: the step's time when it had decode rows (`seconds`: None when it followed an
        idle spell), the wait for each first token, each finished request's mean time per token.
        `sampled`: (request, finished) for each token the step appended, with `first_token_time` set."""
        ctl = self.controller
        if ctl is None:
            return
        if seconds is not None:
            decode = sum(1 for c in chunks if c.num_tokens == 1)  # each waited this long for its token
            ctl.observe_step(seconds, decode, sum(c.num_tokens for c in chunks if c.num_tokens > 1))
        for r, finished in sampled:
            n = len(r.output_ids)
            if n == 1:
                ctl.observe_first_token(r.first_token_time - r.arrival_time)
            if finished and n > 1:
                ctl.observe_finished((now - r.first_token_time) / (n - 1))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- policy ----
    def _key(self, r: Request, now: float):
        p = self.config.policy
        waited = now - r.arrival_time
        if p == "sjf":  # aging: a long request waits at most (its length - a short one's) / rate seconds
            return (r.max_total_tokens - self.config.sjf_aging_tokens_per_s * waited, r.arrival_time, r.seq_no)
        if p == "priority":
            m = self.config.max_priority
            priority = min(max(r.priority, -m), m)  # clamped: no priority outranks aging for long
            return (-(priority + self.config.aging_per_s * waited), r.arrival_time, r.seq_no)
        if p == "round-robin":  # queue order: a request that yielded goes to the back
            return (r.queued_time if r.queued_time is not None else r.arrival_time, r.seq_no)
        return (r.arrival_time, r.seq_no)

    def _length_bucket(self, r: Request) -> int:
        return bisect.bisect_right(self.config.length_bounds, len(r.prompt_ids))

    def _prefix_key(self, r: Request, now: float) -> int:
        if (now - r.arrival_time) * 1000 >= self.config.prefix_max_wait_ms:
            return 0  # waited long enough: first, whatever its prefix
        return 1 if self.cache.cached_pages(r) else 2

    def _admission_order(self, now: float, room: int) -> list[Request]:
        c = self.config
        waiting = sorted(self.waiting, key=lambda r: self._key(r, now))
        if not waiting:
            return []
        if c.prefix_aware and self.cache is not None:
            waiting.sort(key=lambda r: self._prefix_key(r, now))  # stable: policy order within a tier
        oldest_wait_ms = (now - min(r.arrival_time for r in waiting)) * 1000
        window_open = len(waiting) >= c.min_batch or oldest_wait_ms >= c.max_wait_ms or c.max_wait_ms == 0
        if c.policy != "length-buckets":
            return waiting if window_open else []
        groups: dict[int, list[Request]] = collections.defaultdict(list)
        for r in waiting:
            groups[self._length_bucket(r)].append(r)

        def ready(g):
            return len(g) >= room or (now - g[0].arrival_time) * 1000 >= c.max_wait_ms

        ready_groups = [g for g in groups.values() if ready(g)]
        if not ready_groups:
            if self.running:
                return []  # let a group fill up (it becomes ready by max_wait_ms at the latest)
            ready_groups = [max(groups.values(), key=len)]
        first = min(ready_groups, key=lambda g: g[0].arrival_time)
        chosen = set(map(id, first))  # by identity, in one pass: `r not in first` was O(waiting x group)
        return first + [r for r in waiting if id(r) not in chosen]

    # ---- the step ----
    def preempt(self, victim: Request, out: SchedulerOutput | None = None, *, switch: bool = False,
                now: float | None = None) -> None:
        """Free victim's pages and requeue it to be recomputed (listed in `out.preempted` if given). Its
        registered pages stay in the prefix cache while nobody needs their memory, so what it recomputes
        at readmission is only what was evicted meanwhile. `switch`: a round-robin yield (it goes to the
        back of the queue) rather than an out-of-pages preemption."""
        self.running.remove(victim)
        victim.lost_tokens = max(victim.lost_tokens, victim.num_computed)
        victim.lost_by_switch = switch
        self.pool.free(victim.page_ids)
        victim.page_ids = []
        if self.window is not None:
            self.window.release(victim)
        victim.num_computed = victim.num_registered = 0
        victim.num_pending, victim.pending_src = 0, None  # a token in flight is dropped and recomputed
        victim.status = Status.WAITING
        victim.num_preemptions += 1  # the epoch: its chunks in flight are void
        if switch:
            self.num_switches += 1
            victim.queued_time = time.monotonic() if now is None else now
        else:
            self.num_preemptions += 1
        self.waiting.append(victim)
        if out is not None:
            out.preempted.append(victim)

    def _grow(self, r: Request, num_tokens: int) -> bool:
        """Give `r` the pages to hold its first num_tokens tokens; False when the pool is short."""
        need = self.pool.pages_for(num_tokens) - len(r.page_ids)
        pages = []
        if need > 0:
            pages = self.pool.allocate(need)
            if pages is None:
                return False
            r.page_ids.extend(pages)
        if self.window is None or self.window.grow(r, r.num_computed, num_tokens):
            return True
        if pages:  # the sliding layers are short: give back what was just taken, not hold it while waiting
            del r.page_ids[-len(pages):]
            self.pool.free(pages)
        return False

    def _chunk(self, r: Request, budget: int) -> int:
        if r.last_in_flight:
            return 0  # finishes by length once that token arrives
        pending = r.num_tokens - r.num_computed
        if pending == 1:
            return 1
        return min(pending, budget, self.config.max_chunk)

    def admission_wait_s(self, now: float | None = None) -> float:
        """Seconds until a closed batching window (max_wait_ms) opens for the oldest waiting request;
        0 when there is nothing to wait for. The engine thread sleeps this long instead of stepping."""
        if not self.waiting or self.config.max_wait_ms == 0:
            return 0.0
        now = time.monotonic() if now is None else now
        oldest = min(r.arrival_time for r in self.waiting)
        return max(0.0, oldest + self.config.max_wait_ms / 1000 - now)

    def _round_robin_yields(self, now: float) -> None:
        """Round-robin: for each request waiting for a slot, the running request that has used its
        quantum for longest yields its slot (back of the queue, its pages left in the prefix cache)."""
        short = len(self.waiting) - max(0, self.running_limit - len(self.running))
        if short <= 0:
            return
        q = self.config.quantum_tokens
        done = [r for r in self.running
                if len(r.output_ids) + r.num_pending - r.admitted_output >= q and not r.last_in_flight]
        done.sort(key=lambda r: self._key(r, now))
        for r in done[:short]:
            self.preempt(r, switch=True, now=now)

    def _admitted(self, r: Request, now: float) -> None:
        """r got a slot (after attaching its cached prefix): its quantum starts, its recompute is counted."""
        self.waiting.remove(r)
        r.status = Status.RUNNING
        if r.first_scheduled_time is None:
            r.first_scheduled_time = now
        r.admitted_output = len(r.output_ids) + r.num_pending
        if r.lost_tokens:
            lost = max(0, r.lost_tokens - r.num_computed)
            self.num_recomputed_tokens += lost
            if r.lost_by_switch:
                self.num_switch_recomputed_tokens += lost
            r.lost_tokens, r.lost_by_switch = 0, False
        self.running.append(r)

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        now = time.monotonic() if now is None else now
        c = self.config
        out = SchedulerOutput(decode=[], prefill=[], preempted=[])
        budget = self.controller.prefill_budget if self.controller is not None else c.max_prefill_tokens
        scheduled: set[int] = set()
        if c.policy == "round-robin" and self.waiting:
            self._round_robin_yields(now)

        self.running.sort(key=lambda r: self._key(r, now))
        i = 0
        while i < len(self.running):
            r = self.running[i]
            n = self._chunk(r, budget)
            if n == 0:
                i += 1
                continue
            while not self._grow(r, r.num_computed + n):
                victim = next((v for v in reversed(self.running) if id(v) not in scheduled), None)
                self.preempt(victim, out)
                if victim is r:
                    break
            if r.status is Status.WAITING:  # r preempted itself: nothing left to take from
                break
            scheduled.add(id(r))
            self._emit(out, Chunk(r, r.num_computed, n))
            if n > 1 or r.num_tokens - r.num_computed > 1:
                budget -= n
            i += 1

        admit = not out.preempted
        if admit:
            room = self.running_limit - len(self.running)
            order = self._admission_order(now, room)
            if c.static:
                # A batch is chosen whole when the last one is done, then admitted as the prefill budget
                # allows; nothing joins it until every member has finished.
                if not self.running and not any(r.status is Status.WAITING for r in self._static_batch):
                    self._static_batch = order[: self.running_limit]
                    self._static_rows = len(self._static_batch)
                members = {id(r) for r in self._static_batch}
                order = [r for r in order if id(r) in members]
            pending = set()  # pages running prefills are computing now
            if self.cache is not None:
                for r in self.running:
                    pending.update(self.cache.upcoming(r))
            for r in order:
                if room <= 0 or budget <= 0:
                    break
                if self.cache is not None:
                    self.cache.attach(r)
                    if self.cache.next_hash(r) in pending:
                        self.cache.detach(r)  # wait for those pages rather than compute them twice
                        continue
                n = self._chunk(r, budget)
                if (self.controller is not None and self.pool.num_free
                        < self.pool.pages_for(r.num_computed + n) - len(r.page_ids) + len(self.running)):
                    if self.cache is not None:  # keep a page of headroom per running request: growth
                        self.cache.detach(r)    # must not preempt under a latency target
                    break
                if not self._grow(r, r.num_computed + n):
                    if self.cache is not None:
                        self.cache.detach(r)
                    break  # out of pages: wait for running requests to finish
                self._admitted(r, now)
                if self.cache is not None:
                    pending.update(self.cache.upcoming(r))
                self._emit(out, Chunk(r, r.num_computed, n))
                if n > 1 or r.num_tokens - r.num_computed > 1:
                    budget -= n
                room -= 1
        out.num_static_rows = self._static_rows if c.static else 0
        return out

    @staticmethod
    def _emit(out: SchedulerOutput, chunk: Chunk) -> None:
        (out.decode if chunk.num_tokens == 1 else out.prefill).append(chunk)
