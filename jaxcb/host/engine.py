"""The engine loop: requests in, token events out, one packed jitted step at a time.

    step():  schedule N+1 -> pack -> dispatch N+1 (one call) -> fetch N (one copy) -> postprocess N

`schedule` (host) picks decode rows and prefill chunks under the page pool; they are packed into one
token batch (jaxcb.host.batch) of a precompiled bucket and dispatched as one call. With async scheduling
(the default) the scheduler runs one step ahead of the device: a request that is decoding is
scheduled again before its newest token has come back, the step reads that token from the previous
step's output on the device, and a request whose token turns out to stop it wastes one row. Then the
previous step's tokens come back in one copy; each request gets its tokens, its stop checks and its
text delta, and finished requests leave the batch (their pages freed). Speculative decoding
(jaxcb.host.speculative) trades that overlap for several tokens a step: a step with proposals is
scheduled only once every token of its requests is known, and completed before the next is scheduled.
Requests and aborts from other threads go through an inbox that the loop drains at the start of every
step, so only the engine thread touches the scheduler and the pool.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from typing import Callable

import numpy as np

from jaxcb.host.batch import ban_row, force_row, narrow_row, pack_chunks
from jaxcb.host.buckets import LengthLog
from jaxcb.host.draft import describe_speculation, proposer_for
from jaxcb.host.engine_config import EngineConfig
from jaxcb.host.embedding import take_pooled
from jaxcb.host.engine_stats import Counters, EngineStats, StepRecord
from jaxcb.host.inbox import (PAUSE_MODES, WAKE_PARTS, Add, ForgetCache, Inbox, Pause, ReleaseKV, Resume, Swap,
                              WakeUp)
from jaxcb.host.lora import Adapters
from jaxcb.host.errors import InvalidRequest, NotFound, StepFailed, shown
from jaxcb.host.output import EventCallback, Outputs, take_prompt_logprobs, token_logprobs
from jaxcb.host.kv_events import KVEvents
from jaxcb.host.page_pool import PagePool
from jaxcb.host.runner_protocol import Runner
from jaxcb.host.request import (FinishReason, Request, SamplingParams, Status, TokenEvent, banned_tokens,
                                check_param_ids, check_priority, check_tokens, resolve_bad_words)
from jaxcb.host.scheduler import Scheduler
from jaxcb.host.step_plan import Chunk, live_chunks
from jaxcb.host.structured import grammars_for, structured_failure
from jaxcb.host.window import WindowGroup

__all__ = ["Engine", "EventCallback", "Runner"]
log = logging.getLogger("jaxcb.host.engine")


def _pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise InvalidRequest(f"mode: {shown(mode)} is not a pause mode ({', '.join(PAUSE_MODES)})")
    return mode


@dataclasses.dataclass
class _InFlight:
    """A launched step: its chunks (row i = chunk i), each request's preemption count at launch (a
    request preempted since then ignores the step's results), and the device's result."""

    chunks: list[Chunk]
    epochs: list[int]
    result: object
    padded_tokens: int = 0  # the step's token bucket
    started: float | None = None  # when the device could start it: its dispatch when nothing ran before it


class Engine:
    MAX_FAILED_STEPS_IN_A_ROW = 8  # then the engine counts as broken (the server exits non-zero)

    def __init__(self, runner: Runner, tokenizer, config: EngineConfig, eos_ids: tuple[int, ...] = (),
                 load_seconds: float = 0.0, clock: Callable[[], float] = time.monotonic, draft_runner: Runner | None = None,
                 classifier=None):
        self.runner = runner
        # The head classification requests' pooled states go through (jaxcb.host.classifier); None = none
        self.classifier = classifier
        self.draft_runner = draft_runner  # speculative.method "draft": the draft model's (jaxcb.host.draft)
        # Every time the loop reads (arrivals, queueing, step times, first tokens): the wall clock, or the
        # simulator's (jaxcb.sim.simulate: a runner that models the step's time on a virtual clock).
        self._clock = clock
        self.tokenizer = tokenizer
        self.eos_ids = tuple(eos_ids)
        self.config = config
        self.model_config = runner.model_config
        self.pool = PagePool(config.num_pages, config.page_size)
        # Sliding-window layers (Gemma): their pages are a group of their own (jaxcb.host.window).
        self.window_group = None
        if runner.step_config.windowed:
            self.window_group = WindowGroup(runner.num_window_pages, config.page_size,
                                            runner.step_config.sliding_window)
        self.max_context = config.max_context_for(self.model_config)
        self._extra_rows = config.scheduler.speculative.extra_rows  # sample rows for proposals, per step
        self._shapes = config.buckets.shapes(config.page_size, self.max_context, self._extra_rows,
                                             config.scheduler.speculative.verify_tokens)
        # LoRA adapters (jaxcb.host.lora): the registry, its slots filled by the runner
        self.adapters = None
        if config.lora.enabled:
            self.adapters = Adapters(config.lora, fill=runner.fill_lora_slot)
        self.scheduler = Scheduler(dataclasses.replace(config.scheduler, max_context=self.max_context), self.pool,
                                   eos_ids, window=self.window_group, proposer=proposer_for(
                                       config, runner, draft_runner, self.max_context),
                                   adapters=self.adapters)
        self.outputs = Outputs(tokenizer, clock)
        self.inbox = Inbox(config.seed)  # requests and aborts from other threads (jaxcb.host.inbox)
        self._requests: dict[str, list[Request]] = {}  # request id -> its live samples
        self._counters = Counters()
        self._last_fetch_end: float | None = None
        self._in_flight: collections.deque[_InFlight] = collections.deque()  # launched, not yet fetched
        self._step_id = 0  # steps launched
        self.num_failed_steps = 0
        self.last_step_idle = False
        self.failed_in_a_row = 0
        self.load_seconds = load_seconds  # time spent loading the weights (build_engines)
        # Test seam: called with each SchedulerOutput before dispatch; raising simulates a failed step.
        self.fault_injector: Callable | None = None
        self._length_log = None  # record_lengths(): one JSON line per finished request
        self.step_log: list[StepRecord] | None = None  # set to a list to record every step
        # Paused (vLLM's RL routes, jaxcb.host.inbox.Pause): the mode, None while generating; the pauses not yet
        # told they hold; the version the newest weights came with (swap_weights).
        self.paused: str | None = None
        self._pauses: list[Pause] = []
        self.weight_version: str | None = None
        # How the weights were made (jaxcb.weight_update.Origin, set by jaxcb.llm.build_engines): new ones are made so.
        self.origin = None

    def describe_speculation(self) -> str:
        """Speculative decoding as configured ("" off): the start banner and GetServerInfo."""
        return describe_speculation(self.config.scheduler.speculative, self.draft_runner)

    def record_lengths(self, path: str) -> None:
        """Append {"prompt": tokens, "context": tokens} for every request that finishes, for
        `jaxcb buckets` to choose buckets from real traffic."""
        self._length_log = LengthLog(path)

    # ---- the API (thread-safe) ----
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest naming the field and the limit; touches no engine state."""
        if self.model_config.headless and params.pooling is None:
            raise InvalidRequest(f"model: {self.model_config.name} has no language-model head (a base model's or a "
                                 "classifier's checkpoint): it serves embeddings and classification only")
        check_tokens(prompt_ids, params, self.max_context, self.model_config.vocab_size)
        if params.bad_words:
            check_param_ids(resolve_bad_words(params, self.tokenizer), self.model_config.vocab_size)
        if params.structured is not None:
            self.grammars.compile(params.structured)  # cached after the first: check it off the event loop
        if params.lora:  # a reference of no samples: raises, naming the loaded adapters, unless it is loaded
            self._adapters_for(params.lora).ref(params.lora, 0)
        self.scheduler.check_fits(Request(list(prompt_ids), params))

    def _adapters_for(self, name: str) -> Adapters:
        if self.adapters is None:
            raise NotFound(f"lora: no LoRA adapter named {shown(name)}: this server serves none (lora.max_loras = 0)")
        return self.adapters

    # ---- LoRA adapters (any thread) ----
    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Register the PEFT adapter at `path` as `name` (read and checked here, put in a device slot
        when a request for it runs); `replace`: in place of the one of that name (jaxcb.host.lora.Adapters.add)."""
        if self.adapters is None:
            raise InvalidRequest("lora_name: this server has no LoRA slots (start it with --max-loras S)")
        self.adapters.load(name, path, replace)

    def unload_lora(self, name: str) -> bool:
        """Unregister `name`: at once if no request uses it (True), else when the last one ends."""
        if self.adapters is None:
            raise InvalidRequest(f"lora_name: no adapter named {shown(name)} is loaded (this server has no LoRA slots)")
        return self.adapters.remove(name)

    @property
    def grammars(self):
        """The tokenizer's structured-output machinery (jaxcb.host.structured), built on first use."""
        if self.tokenizer is None:
            raise InvalidRequest("structured_outputs: this model has no tokenizer to match a grammar with")
        return grammars_for(self.tokenizer, self.model_config.vocab_size, self.eos_ids, self.config.json_whitespace)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                    priority: int = 0, callback: EventCallback | None = None,
                    arrival_time: float | None = None, validated: bool = False, cache_salt: str = "",
                    client: str = "") -> str:
        """Queue a request; with params.n > 1, n samples that share the prompt's pages (events carry
        the same request id and the sample's `index`). Returns the request id. `validated`: the caller
        already ran validate() on exactly these arguments. `client`: whose request it is (the fair policy's
        flows, jaxcb.host.policies)."""
        check_priority(int(priority) if isinstance(priority, np.integer) else priority)
        if not validated:
            self.validate(prompt_ids, params)
        params = resolve_bad_words(params, self.tokenizer)  # (its token sequences, made once for its samples)
        prompt_ids = [int(t) for t in prompt_ids]
        samples = [Request(prompt_ids, params, request_id=request_id or "", priority=int(priority),
                           cache_salt=cache_salt, client=client)]
        for i in range(1, params.n):
            samples.append(Request(prompt_ids, params, request_id=samples[0].request_id, priority=int(priority),
                                   arrival_time=samples[0].arrival_time, sample_index=i, cache_salt=cache_salt,
                                   client=client))
        if params.lora:  # each sample holds the adapter until it ends
            entry = self._adapters_for(params.lora).ref(params.lora, params.n)
            for r in samples:
                r.lora = entry
        if params.structured is not None:
            for r in samples:  # each sample its own grammar state
                r.matcher = self.grammars.matcher(params.structured)
                r.grammar_after = params.structured_after
        rid = samples[0].request_id
        arrival = self._clock() if arrival_time is None else arrival_time
        for r in samples:
            r.arrival_time = arrival
        seeds = self.inbox.reserve(rid, params.seed, params.n)
        streams = [self.outputs.new_stream(seed, callback, params.skip_special_tokens) for seed in seeds]
        self.inbox.add(samples, streams)
        return rid

    def abort(self, request_id: str) -> None:
        """The request ends with finish reason `abort` and its pages are freed at the next step."""
        self.inbox.abort(request_id)

    def is_live(self, request_id: str) -> bool:
        return self.inbox.is_live(request_id)

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        """Forget every cached prefix (vLLM's reset_prefix_cache; the KV-cache events say AllBlocksCleared), at
        the engine thread's next step and only if no request runs or waits then: the future tells whether it
        did (False: try again when idle)."""
        return self.inbox.put(ForgetCache(concurrent.futures.Future()))

    # ---- pausing, and new weights (any thread; vLLM's RL routes) ----
    def pause(self, mode: str = "abort", clear_cache: bool = True) -> concurrent.futures.Future:
        """Pause generation at the next step (jaxcb.host.inbox.Pause: "abort", "wait" or "keep"): the future is
        told True once the engine is still, False if resumed before."""
        return self.inbox.put(Pause(_pause_mode(mode), bool(clear_cache), concurrent.futures.Future()))

    def resume(self) -> concurrent.futures.Future:
        """Generation goes on at the next step, requests that arrived meanwhile admitted; the future is told whether
        the engine had been paused."""
        return self.inbox.put(Resume(concurrent.futures.Future()))

    def sleep(self, level: int = 1, mode: str = "abort") -> concurrent.futures.Future:
        """vLLM's sleep mode: pause (`mode`), and once still free the devices' memory: level 1 the KV pages, the
        weights copied to the host first; level 2 both dropped (new weights are to come: swap_weights); level 0
        pause only. Running requests are computed again after wake_up. The future is told True once asleep."""
        if level not in (0, 1, 2):
            raise InvalidRequest(f"level: {shown(level)} is not a sleep level (0, 1 or 2)")
        if level and not hasattr(self.runner, "release"):
            raise InvalidRequest("level: this engine cannot free its devices' memory (a multi-host cluster's)")
        return self.inbox.put(Pause(_pause_mode(mode), level > 0, concurrent.futures.Future(), level))

    def wake_up(self, parts=None) -> concurrent.futures.Future:
        """Put back what sleep freed (`parts`: "weights", "kv_cache"; default both; vLLM's "scheduling" alone: the
        pause of a level-0 sleep): the future is told whether the engine is whole again, and then generation
        resumes."""
        parts = frozenset(WAKE_PARTS if parts is None else parts)
        unknown = sorted(parts - set(WAKE_PARTS) - {"scheduling"})
        if unknown:
            raise InvalidRequest(f"tags: {shown(unknown[0])} is not one of {', '.join(WAKE_PARTS)}, scheduling")
        return self.inbox.put(WakeUp(parts - {"scheduling"}, concurrent.futures.Future()))

    def release_kv_cache(self) -> concurrent.futures.Future:
        """vLLM's release_kv_cache_memory: the KV pages off the devices, the weights kept, once paused with no request
        left (the future's InvalidRequest says when not); wake_up(["kv_cache"]) brings them back."""
        if not hasattr(self.runner, "release"):
            raise InvalidRequest("this engine cannot free its devices' memory (a multi-host cluster's)")
        return self.inbox.put(ReleaseKV(concurrent.futures.Future()))

    @property
    def asleep(self) -> set[str]:
        """What sleep took off the devices ("weights", "kv_cache"); empty when awake."""
        return getattr(self.runner, "asleep", set())

    def swap_weights(self, params, version: str | None = None, draft_params=None) -> concurrent.futures.Future:
        """New weights between two steps: `params` made for this engine's runner (jaxcb.device.factory.
        prepare_weights: the same arrays' shapes, dtypes and placements, so nothing compiles again). The step in
        flight finishes on the old ones; then every running request is computed again from its tokens on the new
        ones (none keeps K/V the old weights made) and the prefix cache forgets every page. `draft_params`: the
        draft model's, where it is cut from the target's weights. `params` may be a function of nothing giving
        (params, draft_params), called at the swap on the engine thread (a multi-host cluster reads them there, every
        process in step). The future is told the version."""
        return self.inbox.put(Swap(params, version, concurrent.futures.Future(), draft_params))

    def has_work(self) -> bool:
        if self.paused in ("abort", "keep") or self.asleep:  # nothing is scheduled: what is in flight comes back
            return not self.inbox.empty() or bool(self._in_flight) or bool(self._pauses)
        return self.scheduler.has_work or not self.inbox.empty() or bool(self._in_flight) or bool(self._pauses)

    def stats(self) -> EngineStats:
        return EngineStats.of(self._counters, self.scheduler, self.pool, self.window_group,
                              compilations=self.runner.compilations(), failed_steps=self.num_failed_steps)

    def reset_counters(self) -> None:
        self._counters = Counters()
        self._last_fetch_end = None
        if self.scheduler.cache is not None:
            self.scheduler.cache.num_queried_tokens = self.scheduler.cache.num_hit_tokens = 0
        if self.scheduler.proposer is not None:
            self.scheduler.proposer.reset_counters()

    # ---- the loop ----
    def _drain_inbox(self, events: list[TokenEvent]) -> None:
        for item in self.inbox.drain():
            if isinstance(item, Add):
                for r, st in zip(item.samples, item.streams):
                    self._requests.setdefault(r.request_id, []).append(r)
                    self.outputs.open(r, st)
                    self.scheduler.add(r)
            elif isinstance(item, ForgetCache):  # (only while nothing runs: a running request holds its pages' hashes)
                idle = not self.scheduler.running and not self.scheduler.waiting and not self._in_flight
                if idle:
                    self._forget_cached()
                item.done.set_result(idle)
            elif isinstance(item, Pause):
                if item.mode == "abort":  # every request there is ends (those that arrive later wait)
                    for samples in list(self._requests.values()):
                        for r in list(samples):
                            self._finish(r, FinishReason.ABORT, events)
                # (paused already: the stricter mode holds; "keep"'s frozen requests do not start running again)
                self.paused = max(self.paused or item.mode, item.mode, key=PAUSE_MODES.index)
                self.scheduler.holding = True
                self._pauses.append(item)
            elif isinstance(item, Resume):
                was = self.paused is not None
                self._resume()
                item.done.set_result(was)  # (told after: the caller reads the engine resumed)
            elif isinstance(item, Swap):
                self._swap(item, events)
            elif isinstance(item, ReleaseKV):
                if self.paused is None or self._pauses or self._in_flight or self.scheduler.running:
                    item.done.set_exception(InvalidRequest("pause first, with no request running (mode abort or wait): "
                                                           "the KV pages are released from a still engine"))
                else:
                    self._forget_cached()
                    self.runner.release(None)
                    if self.draft_runner is not None:
                        self.draft_runner.release(None)
                    item.done.set_result(True)
            elif isinstance(item, WakeUp):
                self._settle_pauses_as(False)  # (a sleep not yet settled does not: woken before it slept)
                for runner, parts in ((self.runner, item.parts), (self.draft_runner, item.parts & {"kv_cache"})):
                    if runner is not None and hasattr(runner, "restore"):  # (a multi-host leader's never sleeps)
                        runner.restore(parts)
                if not self.asleep:  # whole again: generation goes on (vLLM's wake_up resumes)
                    self._resume()
                item.done.set_result(not self.asleep)
            elif item.request_id in self._requests:  # an Abort
                for r in list(self._requests[item.request_id]):
                    self._finish(r, FinishReason.ABORT, events)

    def _recompute_running(self, counted: bool = True) -> int:
        """Every running request back to the queue, to be computed again from its tokens (its K/V no longer holds:
        lost, made by old weights, or freed), and the prefix cache forgotten after (the preempted requests'
        registered pages were kept as cache). `counted`: as preemptions (a failure's) or not. Returns how many."""
        running = list(self.scheduler.running)
        for r in running:
            self.scheduler.preempt(r, counted=counted)
        self._forget_cached()
        return len(running)

    def _forget_cached(self) -> None:
        self.pool.forget_cached()
        if self.window_group is not None:
            self.window_group.pool.forget_cached()

    def _swap(self, swap: Swap, events: list[TokenEvent]) -> None:
        """New weights (swap_weights): after the steps in flight, before the next; no request keeps the old K/V."""
        while self._in_flight:
            self._complete(self._in_flight.popleft(), events)
        try:
            params, draft_params = swap.params() if callable(swap.params) else (swap.params, swap.draft_params)
            self.runner.use_params(params)
            if draft_params is not None:
                self.draft_runner.use_params(draft_params)
        except Exception as e:  # noqa: BLE001 - the caller is told; the engine goes on with the weights it had
            swap.done.set_exception(e)
            return
        recomputed = self._recompute_running(counted=False)
        self.weight_version = swap.version
        log.info("new weights%s: %d running requests recomputed on them", f" ({swap.version})" if swap.version else "",
                 recomputed)
        swap.done.set_result(swap.version)

    def _resume(self) -> None:
        """Generation goes on; pauses not yet settled are told they did not hold."""
        self.paused = None
        self.scheduler.holding = False
        self._settle_pauses_as(False)

    def _settle_pauses_as(self, held: bool) -> None:
        """Tell every pause not yet settled whether it held."""
        for p in self._pauses:
            p.done.set_result(held)
        self._pauses.clear()

    def _settle_pauses(self) -> None:
        """Tell the pauses they hold once the engine is still: nothing in flight and, paused with "wait", nothing
        running (asleep, nothing can run) (the prefix cache forgotten first where one asked and none keeps
        requests)."""
        if not self._pauses or self._in_flight or (self.paused == "wait" and self.scheduler.has_work
                                                   and not self.asleep):
            return
        if self.paused != "keep" and any(p.clear_cache for p in self._pauses):
            self._forget_cached()
        level = max(p.level for p in self._pauses)
        if level:  # a sleep: the devices' memory freed; the requests it kept are computed again after wake_up
            self._recompute_running(counted=False)
            self.runner.release("offload" if level == 1 else "discard")
            if self.draft_runner is not None:  # (its KV pages; a draft model's weights stay)
                self.draft_runner.release(None)
            log.info("asleep (level %d): %s off the devices", level, ", ".join(sorted(self.asleep)))
        self._settle_pauses_as(True)

    def publish_kv_events(self, sink, rank: int | None = None) -> KVEvents:
        """From now on, every page registered in or evicted from the prefix cache goes to `sink` as
        vLLM-shaped event batches, one per step (jaxcb.host.kv_events; e.g. a ZmqPublisher's publish)."""
        self.pool.events = KVEvents(self.config.page_size, sink, rank)
        return self.pool.events

    def step(self) -> list[TokenEvent]:
        """Run one engine step; returns the events it produced (also sent to callbacks).

        With async scheduling the step launched here is still running when this returns: its tokens
        are fetched by the next call, after the step after it has been scheduled, packed and
        dispatched behind it. So the host's work (inbox, schedule, pack, output processing) overlaps
        the device's, and the device always has the next step queued while the host waits for one.
        """
        try:
            return self._step()
        finally:
            self.outputs.deliver()  # after the step's retirements: a final event means the pages are back
            if self.pool.events is not None:
                self.pool.events.flush()  # the step's prefix-cache changes, one batch (jaxcb.host.kv_events)

    def _step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        self._drain_inbox(events)
        if self.paused in ("abort", "keep") or self.asleep:  # nothing is scheduled: the steps in flight come back
            while self._in_flight:
                self._complete(self._in_flight.popleft(), events)
            self._settle_pauses()
            self.last_step_idle = True
            return events
        # Speculation needs every token of a proposing request known: the step in flight finishes first
        # (the host's work no longer overlaps the device's for this step), and the speculating step's
        # own tokens are taken before the next is scheduled (how many it accepts decides where that
        # one starts).
        speculate = self.scheduler.wants_speculation()
        while speculate and self._in_flight:
            self._complete(self._in_flight.popleft(), events)
        out = self.scheduler.schedule(now=self._clock(), speculate=speculate)
        launched = False
        if not out.empty:
            try:
                if self.fault_injector is not None:
                    self.fault_injector(out)
                self._in_flight.append(self._launch(out.chunks, out.num_static_rows, events))
                launched = True
            except Exception as e:  # noqa: BLE001 - a failed step fails its own requests; the engine goes on
                self._fail_step(out.chunks, e, events)
        # Nothing ran and nothing came back: requests wait behind a closed batching window (the caller
        # sleeps until it opens). A step that came back may have made room: the caller steps again at once.
        self.last_step_idle = not launched and not self._in_flight
        keep = 1 if launched and self.scheduler.config.async_scheduling and not out.speculative else 0
        while len(self._in_flight) > keep:
            self._complete(self._in_flight.popleft(), events)
        self._settle_pauses()
        return events

    def _launch(self, chunks: list[Chunk], num_static_rows: int, events: list[TokenEvent]) -> _InFlight:
        """Pack the step into one batch of its token bucket and dispatch it (one jitted call, not
        waited for). A decode token whose id is still on the device (sampled by the step in flight)
        is read there by the step itself.

        Structured output: a constrained row's mask needs its input token. When that token is the step
        in flight's, this step is scheduled and packed while that one runs, then that one's tokens are
        taken (the matchers advance) and the masks computed, and only then is this one dispatched: the
        device waits for the masks alone, and rows without a constraint lose only that."""
        packing = self._clock()
        # Each request's preemption count now: a request that the step completed below preempts
        # ignores this step's results.
        epochs = [c.request.num_preemptions for c in chunks]
        pipelined = bool(self._in_flight)
        s = self.config.page_size
        live = sum(c.num_tokens for c in chunks)
        # Static batching pays for the batch's finished rows too: they stay padded in.
        # A step with proposals takes the bucket's verifying program (jaxcb.host.buckets)
        extra_rows = self._extra_rows if any(c.draft for c in chunks) else 0
        shape = self.config.buckets.step_shape(max(live, num_static_rows), s, self.max_context, extra_rows)
        batch, sampling, rows = pack_chunks(chunks, shape, s, self.window_group.window if self.window_group else 0,
                                            self.model_config.vocab_size, self.outputs.seed, self._step_id,
                                            self.scheduler.eos_ids)
        # Rows with a grammar; one that waits for the end of a reasoning part (structured_after) is free
        # until its input token is known to be that end.
        grammar = [i for i, c in enumerate(chunks) if c.samples and c.request.matcher is not None]
        # Rows with bad words; those with a word of several tokens need their newest token to know what it bans.
        banning = [i for i, c in enumerate(chunks) if c.samples and c.request.params.bad_word_ids]
        newest = grammar + [i for i in banning if max(map(len, chunks[i].request.params.bad_word_ids)) > 1]
        # Rows with a thinking budget; near its end they need their newest token to know whether it forces one.
        budgeted = [i for i, c in enumerate(chunks) if c.samples and c.request.params.thinking_token_budget is not None]
        newest += [i for i in budgeted if chunks[i].request.thinking_due()]
        refs = self.pool.ref_counts
        for c in chunks:
            r = c.request
            first, last = c.start // s, (c.start + c.num_tokens - 1) // s
            assert refs[r.page_ids[first]] == 1 and (first == last or all(
                refs[p] == 1 for p in r.page_ids[first + 1:last + 1])), (
                f"{r.key} would write into a page another request holds")
        cnt = self._counters
        cnt.add_step(chunks, shape.tokens, live, s)
        if extra_rows:
            cnt.speculative_steps += 1
        waited = not pipelined
        early = False
        if newest and self._in_flight and any(rows[i].pending for i in newest):
            self._complete(self._in_flight.popleft(), events)  # their input tokens, to the matchers
            waited = early = True
        constrained = [i for i in grammar if chunks[i].request.grammar_after is None]
        if constrained:
            t0 = time.perf_counter()
            n = self.grammars.fill_rows([chunks[i].request for i in constrained], constrained, sampling.allowed)
            for i in constrained:  # a grammar's mask replaced the row's: the request's own narrowing again
                narrow_row(sampling.allowed, i, rows[i], self.scheduler.eos_ids)
            cnt.add_masks(n, time.perf_counter() - t0)
        for i in banning:  # (after any grammar's mask: the ban narrows it)
            ban_row(sampling.allowed, i, banned_tokens(chunks[i].request.params.bad_word_ids,
                                                      chunks[i].request.output_ids))
        for i in budgeted:  # the budget spent: the end tag, whatever else would be allowed
            forced = chunks[i].request.thinking_end()
            if forced is not None:
                force_row(sampling.allowed, i, forced)
        started = self._clock() if early else None  # queued behind nothing: it starts at its dispatch
        result = self.runner.run(batch, sampling, shape)
        dispatch_end = self._clock()
        if early and self._last_fetch_end is not None:
            cnt.mask_waits += 1
            cnt.mask_wait_s += dispatch_end - self._last_fetch_end
        if waited and self._last_fetch_end is not None:  # the device idled since the last fetch
            cnt.host_s += dispatch_end - self._last_fetch_end
            if extra_rows:
                self.scheduler.proposer.observe_sync(dispatch_end - self._last_fetch_end)
        self._step_id += 1
        self.scheduler.on_launched(chunks, self._step_id)
        return _InFlight(chunks, epochs, result, shape.tokens, started if pipelined else packing)

    def _complete(self, step: _InFlight, events: list[TokenEvent]) -> None:
        """Wait for a launched step's tokens (the one device-to-host copy) and process them."""
        try:
            result = self.runner.fetch(step.result)
        except Exception as e:  # noqa: BLE001 - the step failed on the device: its requests fail
            self._fail_step(step.chunks, e, events, step.epochs)
            return
        self.failed_in_a_row = 0
        fetch_end = self._clock()
        if self._last_fetch_end is not None:
            self._counters.step_s += fetch_end - self._last_fetch_end
        # The step's own time: from the previous step's tokens when it was queued behind that step,
        # else from its packing (not from an idle spell before it).
        start = step.started if step.started is not None else self._last_fetch_end
        if self.step_log is not None:
            self.step_log.append(StepRecord.of(step.chunks, step.padded_tokens,
                                               None if start is None else fetch_end - start))
        self._last_fetch_end = fetch_end
        if start is not None and self.scheduler.proposer is not None:
            self.scheduler.proposer.observe_step(step.padded_tokens, fetch_end - start)
        if any(c.request.params.pooling is not None for c in step.chunks):  # embeddings: their hidden states too
            self._take_pooled(step, *self.runner.fetch_pooled(step.result))
        self._postprocess(step, result, events, None if start is None else fetch_end - start)
        self._counters.steps += 1

    @staticmethod
    def _take_pooled(step: _InFlight, last, sums) -> None:
        for i, c in live_chunks(step.chunks, step.epochs):  # sequence i of the step: chunk i
            if c.request.params.pooling is not None:
                take_pooled(c.request, c.start, c.num_tokens, last[i], sums[i])

    def _fail_step(self, chunks: list[Chunk], error: Exception, events: list[TokenEvent],
                   epochs: list[int] | None = None) -> None:
        """Finish this step's requests with an error. If the KV pages' state is unknown (consumed by
        the failed call, or left in an error state), allocate fresh ones and send every other running
        request back to be recomputed; a step already in flight behind this one then ran on the lost
        pages: its requests were sent back too, and its own failure is not theirs (`epochs`: the
        requests' preemption counts at launch). After MAX_FAILED_STEPS_IN_A_ROW failures in a row the
        engine is broken: raise, so the engine thread dies and the server exits non-zero."""
        message = f"{type(error).__name__}: {error}"
        self.num_failed_steps += 1
        self.failed_in_a_row += 1
        for _, chunk in live_chunks(chunks, epochs):
            r = chunk.request
            if r in self.outputs:
                self._finish(r, FinishReason.ERROR, events, error=message)
            else:  # nobody listens for it (a broken invariant): take it out rather than fail every step
                log.error("request %s has no stream; removing it", r.key)
                self.scheduler.finish(r, FinishReason.ERROR)
        if self.runner.reset_kv_if_lost():
            log.warning("a failed step left the KV pages in an unknown state: fresh pages, %d running requests "
                        "recomputed", len(self.scheduler.running))
            self._recompute_running()  # (and the cached pages' contents went with the old KV array)
        self._last_fetch_end = None
        if self.failed_in_a_row >= self.MAX_FAILED_STEPS_IN_A_ROW:
            raise StepFailed(f"{self.failed_in_a_row} steps in a row failed (last: {message}); the engine is broken")

    def _postprocess(self, step: _InFlight, result, events: list[TokenEvent], seconds: float | None) -> None:
        for _, c in live_chunks(step.chunks, step.epochs):  # prompt logprobs, before the tokens that carry them
            if c.score_rows:
                take_prompt_logprobs(c, result)
        sampled = self.scheduler.on_step_done(step.chunks, step.epochs, result.token_ids)
        self._counters.output_tokens += len(sampled)
        # A speculating request's tokens of this step are all in its output already: each is taken back and
        # appended again as its turn comes, so that the output is what has been processed (min_tokens against
        # a stop string, the counts its events report); one that ends at an earlier token drops the rest.
        later = collections.Counter(id(s.request) for s in sampled)
        for s in sampled:
            n = later[id(s.request)]
            if n > 1:
                del s.request.output_ids[len(s.request.output_ids) - n + 1:]
                later[id(s.request)] = 1
        first = set()
        observed = []
        for row, r, token, reason in sampled:  # Sampled
            if id(r) in first:  # a speculating request's later token
                if r.status is Status.FINISHED:  # it ended at an earlier token of this step: this is no output
                    self._counters.output_tokens -= 1
                    continue
                r.output_ids.append(token)
            first.add(id(r))
            if token < 0:  # max_tokens 0: the prompt scored, nothing generated
                self._counters.output_tokens -= 1
                self._finish(r, reason, events)
                observed.append((r, True))
                continue
            logprobs = token_logprobs(result, row, r.params.logprobs) if r.params.logprobs else None
            stop_token = None
            if r.matcher is not None and r.grammar_after is not None:  # still before the grammar's start
                if token == r.grammar_after:
                    r.grammar_after = None  # from the next token on, the grammar holds
            elif r.matcher is not None:  # the grammar takes the token; a finished grammar ends the request
                if r.matcher.is_error() or not r.matcher.consume_token(token):  # (an error: at its mask)
                    if r.matcher.is_error():  # (a limit met: not shared on with later requests)
                        self.grammars.forget(r.params.structured)
                    self._finish(r, FinishReason.ERROR, events, request_error=True,
                                 error=structured_failure(r.params.structured, r.matcher, len(r.output_ids) - 1))
                    observed.append((r, True))
                    continue
                if reason is None and r.matcher.is_stopped():  # its last token is text, not a stop token
                    reason, stop_token = FinishReason.STOP, False
            reason = self.outputs.on_token(r, token, logprobs, reason, events, stop_token)  # sets r.first_token_time
            observed.append((r, reason is not None))
            if reason is not None:
                self._retire(r, reason)
        if self.scheduler.controller is not None:  # the latency target's controller (jaxcb.host.latency)
            self.scheduler.controller.observe_step_done(step.chunks, seconds, observed, self._clock())

    def _finish(self, r: Request, reason: FinishReason, events: list[TokenEvent], error: str | None = None,
                request_error: bool = False) -> None:
        """End a request from outside its tokens (abort, error: the request's own where `request_error`):
        its final event, then retire it."""
        self.outputs.close(r, reason, events, error=error, request_error=request_error)
        self._retire(r, reason)

    def _retire(self, r: Request, reason: FinishReason) -> None:
        self.scheduler.finish(r, reason)
        samples = self._requests.get(r.request_id, [])
        if r in samples:
            samples.remove(r)
        if not samples:  # the last sample of the request: its id is free again
            self._requests.pop(r.request_id, None)
            self.inbox.release(r.request_id)
        if self._length_log is not None:
            self._length_log.record(len(r.prompt_ids), r.num_known)

    # ---- warm-up ----
    def warmup(self, progress: Callable[[int, int, object], None] | None = None) -> int:
        """Compile every step shape ahead of time (nothing is run): the forward pass of each token bucket
        (with speculative decoding also a verifying one per bucket a step with proposals may take) and the
        sampler of each row count (jaxcb.device.runner). Returns the number of step shapes."""
        shapes = self._shapes
        if self.adapters is not None:
            self.runner.warmup_lora()  # the slot filler's program
        programs = [(self.runner, shape) for shape in shapes]
        if self.draft_runner is not None:  # the draft model's steps: the same buckets, one sample per row
            programs += [(self.draft_runner, shape) for shape in self.scheduler.proposer.shapes()]
        for i, (runner, shape) in enumerate(programs):
            runner.compile(shape)
            if progress is not None:
                progress(i + 1, len(programs), shape)
        for runner in (self.runner, self.draft_runner):  # background work may start now (the runners' own)
            if runner is not None:
                runner.warmed_up()
        return len(programs)

    def run_until_done(self, max_steps: int | None = None) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        steps = 0
        while self.has_work():
            events.extend(self.step())
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
        return events
