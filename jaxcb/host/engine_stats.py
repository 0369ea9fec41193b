"""What the engine counts: one record per completed step (for fitting the simulator's step-time model),
the running counters, and the snapshot `Engine.stats()` hands to the server's metrics. Plain Python."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class StepRecord:
    """One completed step, as `Engine.step_log` keeps it (its JSON form, `dataclasses.asdict`, is what
    jaxcb.sim.simulate.FittedStepModel.fit reads): its tokens (live and padded), the context its
    attention read, its rows, and the time it took (from the previous step's tokens, or from its own
    packing when nothing ran before it; None when unknown)."""

    tokens: int
    padded_tokens: int
    context: int
    rows: int
    attention_pairs: int
    decode_rows: int
    seconds: float | None

    @classmethod
    def of(cls, chunks, padded_tokens: int, seconds: float | None) -> "StepRecord":
        """The record of a step that ran these scheduler chunks (jaxcb.host.scheduler.Chunk)."""
        return cls(tokens=sum(c.num_tokens for c in chunks), padded_tokens=padded_tokens,
                   context=sum(c.start + c.num_tokens for c in chunks), rows=len(chunks),
                   attention_pairs=sum(c.attention_pairs for c in chunks),
                   decode_rows=sum(1 for c in chunks if c.is_decode), seconds=seconds)


@dataclasses.dataclass(slots=True)
class Counters:
    """The engine's running sums since start or the last `Engine.reset_counters()`."""

    prompt_tokens_computed: int = 0  # prompt (and recomputed) tokens run through the model
    output_tokens: int = 0
    steps: int = 0
    slots: int = 0  # token slots dispatched (the buckets' sizes)
    live: int = 0  # ... of those, holding a real token
    page_slots: int = 0  # token slots of the pages the steps' sequences held
    page_tokens: int = 0  # ... of those, holding a token
    host_s: float = 0.0  # time the device waited for the host with nothing queued
    step_s: float = 0.0  # time from one step's tokens to the next's
    structured_steps: int = 0  # steps with a structured-output row (jaxcb.host.structured)
    structured_rows: int = 0  # ... their constrained rows, summed
    mask_s: float = 0.0  # host time computing those rows' masks
    mask_waits: int = 0  # ... steps whose dispatch waited for the step before (its tokens, then the masks)
    mask_wait_s: float = 0.0  # ... the device's idle time from that step's tokens to this one's dispatch
    speculative_steps: int = 0  # steps with a speculating row (jaxcb.host.speculative)

    def add_step(self, chunks, padded_tokens: int, live: int, page_size: int) -> None:
        """A launched step's slots, its sequences' page use and the prompt tokens it computes."""
        self.slots += padded_tokens
        self.live += live
        for c in chunks:
            r = c.request
            self.page_slots += len(r.page_ids) * page_size
            self.page_tokens += c.start + c.num_tokens
            if not (c.is_decode and c.samples and c.start >= len(r.prompt_ids)):  # all but decode tokens
                self.prompt_tokens_computed += c.num_tokens

    def add_masks(self, rows: int, seconds: float) -> None:
        """A step with structured-output rows: `rows` masks computed in `seconds`."""
        self.structured_steps += 1
        self.structured_rows += rows
        self.mask_s += seconds


@dataclasses.dataclass
class EngineStats:
    running: int
    waiting: int
    pages_total: int
    pages_free: int
    pages_in_use: int
    compilations: int
    preemptions: int
    prompt_tokens_computed: int  # prompt (and recomputed) tokens run through the model
    output_tokens: int
    steps: int
    padding_fraction: float  # padded token slots over computed token slots
    page_utilization: float  # mean fraction of allocated page slots holding tokens
    host_wait_fraction: float  # fraction of step time the device sat waiting for the host (with nothing queued)
    pages_cached: int = 0  # pages registered in the prefix cache (in use or free-but-cached)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, found cached (not computed again)
    failed_steps: int = 0  # steps that raised (their requests ended with an error)
    window_pages_total: int = 0  # the sliding layers' page group (jaxcb.host.window); 0 without one
    window_pages_in_use: int = 0
    switches: int = 0  # round-robin yields
    recomputed_tokens: int = 0  # tokens computed again after preemptions and switches
    switch_recomputed_tokens: int = 0  # ... of those, after switches
    running_limit: int = 0  # batch slots now (the latency controller moves it)
    prefill_budget: int = 0  # prompt tokens per step now (the latency controller moves it)
    measured_p99_tpot_ms: float = 0.0  # with a latency target: p99 time per token of recent requests
    measured_p99_ttft_ms: float = 0.0  # ... and of their first tokens
    structured_steps: int = 0  # steps with structured-output rows (not pipelined: their tokens decide the next mask)
    structured_rows_per_step: float = 0.0  # ... their mean number of constrained rows
    mask_ms_per_step: float = 0.0  # ... the host's mean time computing their masks
    mask_wait_fraction: float = 0.0  # ... the share whose dispatch waited for the step before's tokens
    mask_wait_ms: float = 0.0  # ... the device's mean idle time in such a wait
    speculative_method: str = ""  # speculative decoding ("" off; jaxcb.host.speculative)
    speculative_steps: int = 0  # steps with a speculating row
    speculative_rows: int = 0  # speculating rows (a request's proposals scored in one step)
    speculative_proposed: int = 0  # proposed tokens
    speculative_accepted: int = 0  # ... of those, accepted
    acceptance_rate: float = 0.0  # accepted / proposed
    mean_accepted_length: float = 0.0  # tokens a speculating row emitted, on average (accepted + 1)

    @classmethod
    def of(cls, c: Counters, scheduler, pool, window_group, *, compilations: int, failed_steps: int) -> "EngineStats":
        """An engine's stats from its counters and the state of its scheduler and page pools."""
        cache, ctl = scheduler.cache, scheduler.controller
        return cls(
            running=len(scheduler.running), waiting=len(scheduler.waiting),
            pages_total=pool.num_usable, pages_free=pool.num_free, pages_in_use=pool.num_in_use,
            compilations=compilations, preemptions=scheduler.num_preemptions,
            prompt_tokens_computed=c.prompt_tokens_computed, output_tokens=c.output_tokens, steps=c.steps,
            padding_fraction=(c.slots - c.live) / c.slots if c.slots else 0.0,
            page_utilization=c.page_tokens / c.page_slots if c.page_slots else 0.0,
            host_wait_fraction=c.host_s / c.step_s if c.step_s else 0.0,
            pages_cached=pool.num_cached,
            prefix_cache_queries=cache.num_queried_tokens if cache else 0,
            prefix_cache_hits=cache.num_hit_tokens if cache else 0,
            failed_steps=failed_steps,
            window_pages_total=window_group.pool.num_usable if window_group else 0,
            window_pages_in_use=window_group.pool.num_in_use if window_group else 0,
            switches=scheduler.num_switches, recomputed_tokens=scheduler.num_recomputed_tokens,
            switch_recomputed_tokens=scheduler.num_switch_recomputed_tokens,
            running_limit=scheduler.running_limit,
            prefill_budget=ctl.prefill_budget if ctl else scheduler.config.max_prefill_tokens,
            measured_p99_tpot_ms=ctl.measured_p99_tpot_ms if ctl else 0.0,
            measured_p99_ttft_ms=ctl.measured_p99_ttft_ms if ctl else 0.0,
            structured_steps=c.structured_steps,
            structured_rows_per_step=c.structured_rows / c.structured_steps if c.structured_steps else 0.0,
            mask_ms_per_step=1000 * c.mask_s / c.structured_steps if c.structured_steps else 0.0,
            mask_wait_fraction=c.mask_waits / c.structured_steps if c.structured_steps else 0.0,
            mask_wait_ms=1000 * c.mask_wait_s / c.mask_waits if c.mask_waits else 0.0,
            **_speculation(c, scheduler.proposer),
        )


def _speculation(c: Counters, proposer) -> dict:
    if proposer is None:
        return {}
    rows, proposed, accepted = proposer.num_rows, proposer.num_proposed, proposer.num_accepted
    return dict(speculative_method=proposer.config.method, speculative_steps=c.speculative_steps,
                speculative_rows=rows, speculative_proposed=proposed, speculative_accepted=accepted,
                acceptance_rate=accepted / proposed if proposed else 0.0,
                mean_accepted_length=(accepted + rows) / rows if rows else 0.0)
