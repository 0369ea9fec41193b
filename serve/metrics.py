"""Prometheus metrics with the names operators know from vLLM, under the `jaxcb:` prefix.

Per-request timings are observed on the engine thread as events arrive (`RequestTimer`); gauges
are refreshed from `Engine.stats()` after every step. With data-parallel replicas each replica's
step refreshes its own `jaxcb:replica_*{replica="i"}` gauges, and the unlabelled gauges hold the sums.
"""

from __future__ import annotations

import contextlib
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, replicas: int = 1):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("jaxcb:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jaxcb:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxcb:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("jaxcb:request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("jaxcb:num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("jaxcb:num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge("jaxcb:kv_cache_usage_perc", "Fraction of KV pages in use (0-1).", registry=r)
        self.preemptions = Gauge("jaxcb:num_preemptions", "Preemptions since start (cumulative).", registry=r)
        self.switches = Gauge("jaxcb:num_round_robin_switches", "Round-robin yields since start (cumulative).",
                              registry=r)
        self.recomputed = Gauge("jaxcb:recomputed_tokens", "Tokens computed again after preemptions and "
                                "round-robin switches (cumulative).", registry=r)
        self.running_limit = Gauge("jaxcb:running_limit", "Batch slots now (the latency controller moves it).",
                                   registry=r)
        self.prefill_budget = Gauge("jaxcb:prefill_budget_tokens", "Prompt tokens per step now (the latency "
                                    "controller moves it).", registry=r)
        self.measured_tpot = Gauge("jaxcb:measured_p99_tpot_seconds", "With a latency target: the p99 time per "
                                   "output token of recently finished requests, as the controller measures it.",
                                   registry=r)
        self.measured_ttft = Gauge("jaxcb:measured_p99_ttft_seconds", "With a latency target: the p99 time to "
                                   "first token of recent requests, as the controller measures it.", registry=r)
        self.compilations = Gauge("jaxcb:compilations", "XLA compilations since start (cumulative).", registry=r)
        self.kept = Gauge("jaxcb:responses_kept", "Responses and conversations the Responses API keeps.", registry=r)
        self.kept_bytes = Gauge("jaxcb:responses_kept_bytes", "Bytes they are charged (--responses-store-mb bounds "
                                "it).", registry=r)
        self.prompt_tokens = Counter("jaxcb:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("jaxcb:generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter("jaxcb:request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)

        self.prefix_queries = Counter("jaxcb:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter("jaxcb:prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r)
        self.failed_steps = Counter("jaxcb:failed_steps", "Engine steps that failed (their requests got an error).",
                                    registry=r)
        # Speculative decoding (vLLM's spec_decode_* counters): acceptance rate = accepted / draft tokens,
        # mean accepted length = 1 + accepted / drafts.
        self.spec_drafts = Counter("jaxcb:spec_decode_num_drafts", "Speculating rows: a request's proposals "
                                   "scored in one step.", registry=r)
        self.spec_draft_tokens = Counter("jaxcb:spec_decode_num_draft_tokens", "Proposed tokens.", registry=r)
        self.spec_accepted_tokens = Counter("jaxcb:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                                            registry=r)
        self.replica_running = Gauge("jaxcb:replica_num_requests_running", "Requests running, per replica.",
                                     ["replica"], registry=r)
        self.replica_waiting = Gauge("jaxcb:replica_num_requests_waiting", "Requests waiting, per replica.",
                                     ["replica"], registry=r)
        self.replica_kv_usage = Gauge("jaxcb:replica_kv_cache_usage_perc", "KV pages in use (0-1), per replica.",
                                      ["replica"], registry=r)
        # LoRA adapters (jaxcb.host.lora), as vLLM reports them and the Gateway API Inference Extension's
        # endpoint picker reads them: one sample of lora_requests_info whose labels list the adapters with
        # running and with waiting requests (its value: when it was set); counts per adapter besides.
        self.lora_info = Gauge("jaxcb:lora_requests_info", "LoRA adapters: max_lora slots, the adapters with "
                               "running and with waiting requests (comma-separated); the value is the time it "
                               "was set.", ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self.lora_running = Gauge("jaxcb:lora_num_requests_running", "Requests running, per LoRA adapter.",
                                  ["lora_name"], registry=r)
        self.lora_waiting = Gauge("jaxcb:lora_num_requests_waiting", "Requests waiting, per LoRA adapter.",
                                  ["lora_name"], registry=r)
        self.lora_swaps = Gauge("jaxcb:lora_slot_loads", "Adapters put into a device slot since start (cumulative).",
                                registry=r)
        # The KV cache's layout, as vLLM's cache_config_info (the endpoint picker's --cache-info-metric reads
        # block_size and num_gpu_blocks: its prefix scorer hashes prompts in blocks of that size).
        self.cache_info = Gauge("jaxcb:cache_config_info", "The KV cache: tokens per page (block_size), pages "
                                "(num_gpu_blocks, every replica's), their dtype and whether prefixes are cached; "
                                "the value is 1.", ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"],
                                registry=r)
        # New weights while serving (serve.frontend.State.update_weights and the pause and sleep calls): vLLM's RL
        # metrics, and where the engine stands.
        self.weight_operation_s = Histogram("jaxcb:rl_weight_update_operation_duration_seconds", "Duration of one "
                                            "weight operation (pause, resume, update, sleep, wake_up, reset).",
                                            ["operation"], buckets=(0.01, 0.1, 1, 10, 30, 60, 120, 300, 600),
                                            registry=r)
        self.weight_operations = Gauge("jaxcb:rl_weight_update_operations_in_flight", "Weight operations being "
                                       "awaited.", ["operation"], registry=r)
        self.paused = Gauge("jaxcb:engine_paused", "1 while generation is paused (requests wait).", registry=r)
        self.sleeping = Gauge("jaxcb:engine_sleeping", "1 while the KV pages or the weights are off the devices.",
                              registry=r)
        self._lora_key = None
        self._lock = threading.Lock()  # replicas refresh from their own threads
        self._latest = [None] * replicas  # each replica's last stats (the counters grow from them)

    def refresh(self, stats, replica: int = 0) -> None:
        with self._lock:
            prev = self._latest[replica]
            for counter, field in ((self.prefix_queries, "prefix_cache_queries"),
                                   (self.prefix_hits, "prefix_cache_hits"), (self.failed_steps, "failed_steps"),
                                   (self.spec_drafts, "speculative_rows"),
                                   (self.spec_draft_tokens, "speculative_proposed"),
                                   (self.spec_accepted_tokens, "speculative_accepted")):
                counter.inc(max(0, getattr(stats, field) - (getattr(prev, field) if prev is not None else 0)))
            self._latest[replica] = stats
            latest = [s for s in self._latest if s is not None]
            if len(self._latest) > 1:
                label = str(replica)
                self.replica_running.labels(replica=label).set(stats.running)
                self.replica_waiting.labels(replica=label).set(stats.waiting)
                self.replica_kv_usage.labels(replica=label).set(
                    stats.pages_in_use / stats.pages_total if stats.pages_total else 0.0)
            total = sum(s.pages_total for s in latest)
            self.running.set(sum(s.running for s in latest))
            self.waiting.set(sum(s.waiting for s in latest))
            self.kv_usage.set(sum(s.pages_in_use for s in latest) / total if total else 0.0)
            self.preemptions.set(sum(s.preemptions for s in latest))
            self.compilations.set(max(s.compilations for s in latest))
            self.switches.set(sum(s.switches for s in latest))
            self.recomputed.set(sum(s.recomputed_tokens for s in latest))
            self.running_limit.set(sum(s.running_limit for s in latest))
            self.prefill_budget.set(sum(s.prefill_budget for s in latest))
            self.measured_tpot.set(max(s.measured_p99_tpot_ms for s in latest) / 1000)
            self.measured_ttft.set(max(s.measured_p99_ttft_ms for s in latest) / 1000)


    @contextlib.contextmanager
    def weight_operation(self, operation: str, engine):
        """Time one weight operation; after it, whether `engine` (the replicas) is paused or asleep."""
        in_flight = self.weight_operations.labels(operation)
        in_flight.inc()
        started = time.perf_counter()
        try:
            yield
        finally:
            in_flight.dec()
            self.weight_operation_s.labels(operation).observe(time.perf_counter() - started)
            self.paused.set(int(bool(engine.paused)))
            self.sleeping.set(int(bool(engine.asleep)))

    def set_cache_info(self, page_size: int, num_pages: int, kv_dtype: str, prefix_caching: bool) -> None:
        self.cache_info.clear()
        self.cache_info.labels(str(page_size), str(num_pages), kv_dtype, str(prefix_caching).lower()).set(1)

    def refresh_lora(self, info: dict | None) -> None:
        """The adapters' gauges from jaxcb.host.replicas.Replicas.lora_info()."""
        if info is None:
            return
        with self._lock:
            key = (str(info["max_lora"]), ",".join(info["running"]), ",".join(info["waiting"]))
            if key != self._lora_key:  # one sample: the current sets of adapters
                self.lora_info.clear()
                self._lora_key = key
            self.lora_info.labels(*key).set(time.time())
            self.lora_running.clear()
            self.lora_waiting.clear()
            for name, (running, waiting) in info["per_adapter"].items():
                self.lora_running.labels(lora_name=name).set(running)
                self.lora_waiting.labels(lora_name=name).set(waiting)
            self.lora_swaps.set(info["swaps"])


class RequestTimer:
    """Follows one request's events and records its latencies."""

    def __init__(self, metrics: Metrics, arrival: float | None = None):
        self.m = metrics
        self.arrival = time.monotonic() if arrival is None else arrival
        self.last: float | None = None

    def on_event(self, event) -> None:
        now = time.monotonic()
        if event.queue_s is not None:
            self.m.queue_time.observe(event.queue_s)
        if event.token_ids:
            if self.last is None:
                self.m.ttft.observe(now - self.arrival)
            else:
                self.m.itl.observe(now - self.last)
            self.last = now
            self.m.generation_tokens.inc(len(event.token_ids))
        if event.finished:
            self.m.e2e.observe(now - self.arrival)
            if event.index == 0:  # the prompt once, however many samples
                self.m.prompt_tokens.inc(event.num_prompt_tokens)
            reason = event.finish_reason.value if event.finish_reason is not None else "unknown"
            self.m.finished.labels(finished_reason=reason).inc()
