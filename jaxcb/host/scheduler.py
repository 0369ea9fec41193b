"""The scheduler: each step, which requests run and how many of their tokens.

Plain Python, no JAX. Every step, running requests come first, best first by the policy: each gets
one token if it is decoding, or a chunk of its prompt (chunked prefill, under a per-step budget of
prefill tokens) if it is still prefilling. Each first takes the pages its tokens need; when the pool
cannot supply them, the worst running request by the policy is preempted (its pages freed, its
progress dropped, requeued to be recomputed later) until they fit. Then, if nothing was preempted,
waiting requests are admitted in policy order while a batch slot, budget and pages remain.

With prefix caching (jaxcb.host.prefix_cache), a request being admitted first takes the cached pages of
its longest cached prefix and is scheduled from there. With `prefix_aware`, waiting requests whose
prefix is cached go first, except that a request waiting longer than `prefix_max_wait_ms` goes
before both (so preferring cached prefixes cannot starve anyone). A request whose next page is being
computed right now by a running request's prefill waits for it instead of computing it a second time:
that is how the samples of an n > 1 request, or a burst of requests with one system prompt, prefill
their shared pages once.

A request with a single pending token is a decode row; the engine batches those in one step and runs
each multi-token chunk as a prefill. Policies (jaxcb.host.policies) only decide order; the mechanism is
the same for all. Round-robin adds one thing to it: while requests wait for a slot, a running request
that has generated `quantum_tokens` since it was (re)admitted yields its slot to the longest-waiting
one. Its full pages stay registered in the prefix cache (free but cached), so on its return it
recomputes only what was evicted meanwhile and its partial last page.

A latency target (`target_p99_tpot_ms`, optionally `target_p99_ttft_ms`) hands the running limit and
the prefill budget to a controller (jaxcb.host.latency) fed with measured step times and first-token
times; with it, admission also keeps a page of headroom per running request, so growth does not
preempt.
"""

from __future__ import annotations

import collections
import logging
import time

from jaxcb.host.allotment import Allotment
from jaxcb.host.latency import LatencyController
from jaxcb.host.page_pool import PagePool
from jaxcb.host.policies import SchedulerConfig, admission_order, order_key
from jaxcb.host.prefix_cache import PrefixCache
from jaxcb.host.request import FinishReason, Request, Status, repeats
from jaxcb.host.speculative import Proposer
from jaxcb.host.step_plan import Chunk, Sampled, SchedulerOutput, live_chunks


log = logging.getLogger("jaxcb.host.scheduler")

class Scheduler:
    """Owns the request state: which run, their pages, their computed and generated tokens, their end."""

    def __init__(self, config: SchedulerConfig, pool: PagePool, eos_ids: tuple[int, ...] = (), window=None,
                 proposer: Proposer | None = None, adapters=None):
        self.config = config
        self.adapters = adapters  # jaxcb.host.lora.Adapters: LoRA slots, taken at admission; None without
        self.pool = pool
        self.window = window  # jaxcb.host.window.WindowGroup: the sliding layers' pages (Gemma), else None
        self.eos_ids = frozenset(eos_ids)
        self.allot = Allotment(pool, window, adapters)  # pages and adapter slots (jaxcb.host.allotment)
        self.cache = PrefixCache(pool, window) if config.prefix_caching else None
        # speculative decoding: the n-gram proposer, or the one given (a draft model's, jaxcb.host.draft)
        self.proposer = proposer or (Proposer(config.speculative) if config.speculative.enabled else None)
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
        # A paused engine's (jaxcb.host.engine.Engine.pause): requests never admitted wait; the others go on.
        self.holding = False

    # ---- queue ----
    def check_fits(self, request: Request) -> None:
        """Reject at once a request whose whole context could never have its pages (jaxcb.host.allotment);
        the context limit is checked with the other fields by Engine.validate."""
        self.allot.check_fits(request, min(self.config.max_chunk, self.config.max_prefill_tokens))

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
        self.allot.release(request)
        if request.lora is not None:  # it no longer uses its adapter (an unloaded one may go now)
            self.adapters.unref(request.lora)
            request.lora = None

    def finish(self, request: Request, reason: FinishReason) -> None:
        """The request ends (its last token, a stop string, an abort or an error): its pages go back."""
        self.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        if self.proposer is not None and reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.REPETITION):
            self.proposer.observe_finish(request)

    # ---- a step's life: launched, then its tokens back ----
    def on_launched(self, chunks: list[Chunk], step_id: int) -> None:
        """The step is on the device: its tokens count as computed, and each sampling chunk's next token
        is pending (row `i` of step `step_id`'s output) until the step's tokens come back."""
        for row, c in enumerate(chunks):
            r = c.request
            r.num_computed = c.start + c.num_tokens  # with proposals: until the step says how many hold
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
        for row, c in live_chunks(chunks, epochs):
            r = c.request
            if c.draft:
                self._accept(c, row, token_ids, sampled)
                continue
            if self.cache is not None:
                self.cache.register(r, c.start + c.num_tokens)
            if not c.samples:
                continue
            r.num_pending -= 1
            if not r.num_pending:
                r.pending_src = None
            sampled.append(self._append(r, row, int(token_ids[row])))
        return sampled

    def _append(self, r: Request, row: int, token: int) -> Sampled:
        """Append a sampled token to r: its Sampled, with how r ends with it."""
        p, reason = r.params, None
        if p.max_tokens == 0:  # the prompt was only scored (prompt_logprobs): nothing is generated
            return Sampled(row, r, -1, FinishReason.LENGTH)
        r.output_ids.append(token)
        if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
            reason = FinishReason.STOP
        elif len(r.output_ids) >= p.max_tokens or r.num_known >= self.config.max_context:
            reason = FinishReason.LENGTH
        elif (p.repetition_detection is not None and len(r.output_ids) >= p.min_tokens
              and repeats(r.output_ids, p.repetition_detection)):
            reason = FinishReason.REPETITION
        return Sampled(row, r, token, reason)

    def _accept(self, c: Chunk, row: int, token_ids, sampled: list[Sampled]) -> None:
        """A speculating chunk's tokens: the one sampled after its newest token, then while the token
        sampled at a proposal's position equals that proposal, the one sampled after it (each is what
        decoding one token at a time would have sampled). The K/V of rejected proposals is dropped: the
        request's length ends after the accepted ones, and pages past its tokens go back."""
        r, k = c.request, len(c.draft)
        r.num_pending -= 1
        if not r.num_pending:
            r.pending_src = None
        accepted = 0
        for j in range(k + 1):
            out_row = c.extra_row + j if j < k else row
            s = self._append(r, out_row, int(token_ids[out_row]))
            sampled.append(s)
            if j == k or s.token != c.draft[j]:
                break
            accepted += 1  # the proposal held (also when it ends the request)
            if s.finish is not None:
                break
        r.num_computed = c.start + 1 + accepted
        self.proposer.record(r, k, accepted)
        self.allot.trim(r, r.num_tokens)
        if self.cache is not None:
            self.cache.register(r, r.num_computed)

    @property
    def has_work(self) -> bool:
        """Requests it may schedule: holding (a paused engine's), only those it has admitted before."""
        if self.holding:
            return bool(self.running) or any(r.num_preemptions for r in self.waiting)
        return bool(self.waiting or self.running)

    # ---- the step ----
    def preempt(self, victim: Request, out: SchedulerOutput | None = None, *, switch: bool = False,
                now: float | None = None, counted: bool = True) -> None:
        """Free victim's pages and requeue it to be recomputed (listed in `out.preempted` if given). Its
        registered pages stay in the prefix cache while nobody needs their memory, so what it recomputes
        at readmission is only what was evicted meanwhile. `switch`: a round-robin yield (it goes to the
        back of the queue) rather than an out-of-pages preemption; `counted` False: neither (new weights, a
        sleep: jaxcb.host.engine), not counted in num_preemptions."""
        self.running.remove(victim)
        victim.lost_tokens = max(victim.lost_tokens, victim.num_computed)
        victim.lost_by_switch = switch
        self.allot.release(victim)
        victim.num_computed = 0
        victim.num_pending, victim.pending_src = 0, None  # a token in flight is dropped and recomputed
        victim.pooled, victim.pooled_upto = None, 0  # an embedding pools its recomputed positions again
        victim.status = Status.WAITING
        victim.num_preemptions += 1  # the epoch: its chunks in flight are void
        if switch:
            self.num_switches += 1
            victim.queued_time = time.monotonic() if now is None else now
        elif counted:
            self.num_preemptions += 1
        self.waiting.append(victim)
        if out is not None:
            out.preempted.append(victim)

    def _chunk(self, r: Request, budget: int) -> int:
        if r.last_in_flight:
            return 0  # finishes by length once that token arrives
        pending = r.num_tokens - r.num_computed
        if pending == 1:
            return 1
        n = min(pending, budget, self.config.max_chunk)
        if r.scoring:  # its positions take the step's spare rows: about as many as the running requests leave
            free = max(0, len(r.prompt_logprobs) - r.num_computed)  # positions already scored need no row
            n = min(n, free + max(0, self.config.max_running - len(self.running) - 1) + 1)
        return n

    def _fit_scores(self, out: SchedulerOutput) -> None:
        """The prompt positions a step scores besides its chunks' last ones take its spare sequence rows
        (jaxcb.host.batch): max_running less one per chunk. A prompt chunk that would score more is cut
        to what fits (its last position, which has the chunk's own row, always does)."""
        spare = self.config.max_running - len(out.decode) - len(out.speculative) - len(out.prefill)
        for i, c in enumerate(out.prefill):
            r = c.request
            positions = r.positions_to_score(c.start, c.start + c.num_tokens - 1)
            if len(positions) <= spare:
                spare -= len(positions)
                continue
            n = positions.start + spare - c.start + 1
            spare = 0
            self.allot.trim(r, c.start + n)
            out.prefill[i] = Chunk(r, c.start, n)
        if any(c.num_tokens == 1 for c in out.prefill):  # cut to one token: a single token goes first
            out.decode += [c for c in out.prefill if c.num_tokens == 1]
            out.prefill = [c for c in out.prefill if c.num_tokens > 1]

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
        done.sort(key=lambda r: order_key(self.config, r, now))
        for r in done[:short]:
            self.preempt(r, switch=True, now=now)

    def _fair_yields(self, now: float) -> None:
        """Fair: while a client with fewer running than its share of the slots (running_limit over the clients
        running or waiting) waits and no slot is free, the client furthest over its share yields its newest
        request that has used its quantum (back of the queue, its pages left in the prefix cache)."""
        waiting = {r.client for r in self.waiting}
        running = collections.Counter(r.client for r in self.running)
        share = max(1, self.running_limit // len(waiting | set(running)))
        short = sum(running[c] < share for c in waiting) - max(0, self.running_limit - len(self.running))
        q = self.config.quantum_tokens
        for _ in range(max(0, short)):
            heavy = max(running, key=lambda c: running[c], default=None)
            if heavy is None or running[heavy] <= share:
                return
            done = [r for r in self.running if r.client == heavy and not r.last_in_flight
                    and len(r.output_ids) + r.num_pending - r.admitted_output >= q]
            if not done:
                return
            self.preempt(max(done, key=lambda r: (r.arrival_time, r.seq_no)), switch=True, now=now)
            running[heavy] -= 1

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

    def schedule(self, now: float | None = None, speculate: bool = False) -> SchedulerOutput:
        """This step's chunks. `speculate`: decoding requests whose tokens are all known may bring
        proposals (the engine has no step in flight; jaxcb.host.speculative)."""
        now = time.monotonic() if now is None else now
        c = self.config
        out = SchedulerOutput(decode=[], prefill=[], preempted=[])
        budget = self.controller.prefill_budget if self.controller is not None else c.max_prefill_tokens
        scheduled: set[int] = set()
        if c.policy == "round-robin" and self.waiting and not self.holding:
            self._round_robin_yields(now)
        elif c.policy == "fair" and self.waiting and not self.holding:
            self._fair_yields(now)

        self.running.sort(key=lambda r: order_key(self.config, r, now))
        i = 0
        while i < len(self.running):
            r = self.running[i]
            n = self._chunk(r, budget)
            if n == 0:
                i += 1
                continue
            if n == 1 and r.num_tokens - r.num_computed == 1 and self.proposer is not None:  # decoding, not a
                # prompt chunk cut to one token (by the budget, or by the rows a scoring prompt's positions take)
                draft = self._propose(r, budget, speculate)
                if draft:
                    scheduled.add(id(r))
                    self._emit(out, Chunk(r, r.num_computed, 1 + len(draft), tuple(draft)))
                    budget -= len(draft)  # proposals are tokens of the step like a prompt's
                    i += 1
                    continue
            while not self.allot.grow(r, r.num_computed + n):
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
            order = admission_order(self.config, self.waiting, self.running, self.cache, now, room)
            if self.holding:  # (a paused engine's: only requests it had admitted before, preempted since)
                order = [r for r in order if r.num_preemptions]
            if c.static:
                # A batch is chosen whole when the last one is done, then admitted as the prefill budget
                # allows; nothing joins it until every member has finished.
                if not self.running and not any(r.status is Status.WAITING for r in self._static_batch):
                    self._static_batch = order[: self.running_limit]
                    self._static_rows = len(self._static_batch)
                members = {id(r) for r in self._static_batch}
                order = [r for r in order if id(r) in members]
            # Pages running prefills are computing now: hash -> whether one of them keeps its tokens'
            # logprobs (a scoring request's does; only such a page saves a scoring request its work).
            pending: dict[bytes, bool] = {}
            if self.cache is not None:
                for r in self.running:
                    self._computing(r, pending)
            for r in order:
                if room <= 0 or budget <= 0:
                    break
                attached = self.cache is not None
                if attached:
                    self.cache.attach(r)
                    upcoming = self.cache.next_hash(r)
                    if upcoming in pending and (pending[upcoming] or not r.scoring):
                        self.cache.detach(r)  # wait for those pages rather than compute them twice
                        continue
                n = self._chunk(r, budget)
                if (self.controller is not None and self.pool.num_free
                        < self.pool.pages_for(r.num_computed + n) - len(r.page_ids) + len(self.running)):
                    if attached:  # keep a page of headroom per running request: growth
                        self.cache.detach(r)    # must not preempt under a latency target
                    break
                if r.lora is not None and r.lora_slot < 0:
                    r.lora_slot = self.adapters.acquire(r.lora, now)
                    if r.lora_slot < 0:  # every LoRA slot is held by running requests: it waits for one
                        if attached:
                            self.cache.detach(r)
                        continue
                if not self.allot.grow(r, r.num_computed + n):
                    if attached:
                        self.cache.detach(r)
                    self.allot.release_slot(r)
                    break  # out of pages: wait for running requests to finish
                self._admitted(r, now)
                if self.cache is not None:
                    self._computing(r, pending)
                self._emit(out, Chunk(r, r.num_computed, n))
                if n > 1 or r.num_tokens - r.num_computed > 1:
                    budget -= n
                room -= 1
        out.num_static_rows = self._static_rows if c.static else 0
        if any(r.scoring for r in self.running):
            self._fit_scores(out)
        if out.speculative:
            self._keep_proposals(out)
            try:
                self.proposer.fill(out.speculative)  # a draft model runs for the rows that kept proposals
            except Exception:  # noqa: BLE001 - a failed draft step: these rows decode one token instead
                log.exception("speculative decoding: the draft model's step failed; decoding without proposals")
                for c in out.speculative:
                    self.allot.trim(c.request, c.start + 1)
                    out.decode.append(Chunk(c.request, c.start, 1))
                out.speculative = []
        return out

    def _computing(self, r: Request, pending: dict[bytes, bool]) -> None:
        """The pages r is yet to compute, into `pending` (with whether r keeps their tokens' logprobs)."""
        for page_hash in self.cache.upcoming(r):
            pending[page_hash] = pending.get(page_hash, False) or r.scoring

    def _propose(self, r: Request, budget: int, speculate: bool) -> list[int]:
        """Proposals for r's next decode step, its pages already grown to hold them; [] to decode one
        token (not speculating now, nothing to propose, or no pages for them: never preempts)."""
        self.proposer.tick(r)
        if not speculate or r.num_pending or budget <= 0 or not self.proposer.eligible(r):
            return []
        # Room for the proposals and the token after them, within max_tokens and the context limit.
        limit = min(budget, r.params.max_tokens - len(r.output_ids) - 1, self.config.max_context - r.num_known - 1)
        draft = self.proposer.propose(r, limit) if limit > 0 else []
        if draft and not self.allot.grow(r, r.num_computed + 1 + len(draft)):
            return []
        return draft

    def _keep_proposals(self, out: SchedulerOutput) -> None:
        """Drop the proposals' tokens that do not pay in this step (Proposer.keep); their pages go back."""
        chunks = out.chunks
        counts = self.proposer.keep([(c.request, len(c.draft)) for c in out.speculative],
                                    sum(c.num_tokens - len(c.draft) for c in chunks), sum(c.samples for c in chunks))
        kept = []
        for c, n in zip(out.speculative, counts):
            if n < len(c.draft):
                self.allot.trim(c.request, c.start + 1 + n)
                c = Chunk(c.request, c.start, 1 + n, c.draft[:n])
            (kept if n else out.decode).append(c)
        out.speculative = kept

    def wants_speculation(self) -> bool:
        """Whether the next step would speculate if the running requests' tokens were all known: some
        decoding request finds a proposal in the tokens it has, and proposals of that size would pay
        in a step of the running requests' decode rows (Proposer.keep). The engine then lets the step
        in flight finish before scheduling (its host work no longer overlaps the device's)."""
        p = self.proposer
        if p is None or not p.active(len(self.running)):
            return False
        likely = [r for r in self.running if r.num_tokens - r.num_computed == 1 and not r.last_in_flight and p.likely(r)]
        if not likely:
            return False
        n = len(self.running)
        return any(p.keep([(r, p.config.num_tokens) for r in likely], n, n))

    @staticmethod
    def _emit(out: SchedulerOutput, chunk: Chunk) -> None:
        if chunk.draft:
            out.speculative.append(chunk)
        else:
            (out.decode if chunk.num_tokens == 1 else out.prefill).append(chunk)
