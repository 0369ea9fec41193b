"""The scheduler on a simulated clock: `jaxcb simulate --trace FILE --policy P [--step-model FILE | --device NAME]`.

Plain Python, no JAX. The real Scheduler, PagePool, PrefixCache and Buckets run a trace (jaxcb.sim.trace)
exactly as the engine would, but nothing is computed: each step takes the time a step-time model
gives for its shape, and every sampled token is a placeholder (requests run to their trace's
output length). The report is the same table the real runs print (jaxcb.sim.trace.summarize).

Step-time models:
  fitted    step_time = intercept[token bucket] + per_context_token x context + per_extra_pair x
            (prefill attention pairs beyond one per context token), least squares over the steps a
            real run recorded (Engine.step_log, written by bench/policies.py). A bucket
            the run never used is interpolated between its neighbours. The built-in one is SmolLM2
            on the 2-core CPU this project is developed on (jaxcb/sim/step_models/).
  roofline  a named accelerator (peak FLOP/s, memory bandwidth and memory, `DEVICES`) and a model
            shape (`MODELS`): a step takes max(FLOPs / achievable FLOP/s, bytes / achievable
            bandwidth) + a fixed overhead, where the bytes are the weights once and the KV each row
            reads, and the FLOPs are 2 x params x padded tokens plus attention. The efficiencies and
            overhead are assumptions, stated in `RooflineStepModel` and printed with the report.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import time

from jaxcb.host.page_pool import PagePool
from jaxcb.host.request import Request, SamplingParams
from jaxcb.host.scheduler import Scheduler
from jaxcb.sim.trace import RequestRecord, TraceRequest, prompt_ids, summarize

BUILTIN_STEP_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_models",
                                  "smollm2-135m-cpu.json")


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What a step-time model sees of a step."""

    padded_tokens: int  # the token bucket the step is padded to
    tokens: int  # live tokens
    context: int  # tokens of KV its rows attend over (sum over rows of start + tokens)
    attention_pairs: int  # (query, key) pairs its attention computes
    rows: int  # sequences (decode rows and prefill chunks)
    sampled_rows: int  # rows that sample a token (run the vocabulary head)


class FittedStepModel:
    kind = "fitted"

    def __init__(self, intercepts: dict[int, float], per_context_token: float, info: dict | None = None,
                 per_extra_pair: float = 0.0):
        self.buckets = sorted(int(k) for k in intercepts)
        self.intercepts = [float(intercepts[k] if k in intercepts else intercepts[str(k)]) for k in self.buckets]
        self.per_context_token = float(per_context_token)
        self.per_extra_pair = float(per_extra_pair)
        self.info = info or {}

    def intercept(self, padded: int) -> float:
        b, v = self.buckets, self.intercepts
        i = bisect.bisect_left(b, padded)
        if i < len(b) and b[i] == padded:
            return v[i]
        if len(b) == 1:
            return v[0] * padded / b[0]
        lo, hi = (0, 1) if i == 0 else (len(b) - 2, len(b) - 1) if i == len(b) else (i - 1, i)
        slope = (v[hi] - v[lo]) / (b[hi] - b[lo])
        return max(v[lo] + slope * (padded - b[lo]), 1e-6)

    def seconds(self, s: StepStats) -> float:
        return (self.intercept(s.padded_tokens) + self.per_context_token * s.context
                + self.per_extra_pair * _extra_pairs(s.attention_pairs, s.context))

    @staticmethod
    def _stats(r: dict) -> StepStats:
        return StepStats(int(r["padded_tokens"]), r.get("tokens", 0), r["context"],
                         r.get("attention_pairs", r["context"]), r.get("rows", 0), 0)

    @classmethod
    def fit(cls, records: list[dict], info: dict | None = None) -> "FittedStepModel":
        """Least squares over recorded steps ({"padded_tokens", "context", "seconds"}, optionally
        "attention_pairs"): one intercept per token bucket, one slope for the context the rows read, and
        one for the (query, key) pairs of prefill chunks beyond one per context token (a decode row has
        none); a slope that comes out negative is dropped and the rest refitted."""
        import numpy as np

        rows = [r for r in records if r.get("seconds") is not None]
        if not rows:
            raise ValueError("step model: no timed steps to fit")
        buckets = sorted({int(r["padded_tokens"]) for r in rows})
        col = {b: i for i, b in enumerate(buckets)}
        y = np.array([r["seconds"] for r in rows])
        slopes = np.array([[r["context"], _extra_pairs(r.get("attention_pairs", r["context"]), r["context"])]
                           for r in rows], dtype=float)
        onehot = np.zeros((len(rows), len(buckets)))
        for i, r in enumerate(rows):
            onehot[i, col[int(r["padded_tokens"])]] = 1.0
        use = [j for j in range(2) if slopes[:, j].any()]
        while True:
            coef, *_ = np.linalg.lstsq(np.hstack([onehot, slopes[:, use]]), y, rcond=None)
            negative = [j for j, c in zip(use, coef[len(buckets):]) if c < 0]
            if not negative:
                break
            use.remove(negative[0])
        k = dict(zip(use, (float(c) for c in coef[len(buckets):])))
        per_context, per_pair = k.get(0, 0.0), k.get(1, 0.0)
        intercepts = {}
        for b in buckets:  # each intercept: the mean residual of its steps (kept positive)
            ys = [r["seconds"] - per_context * s[0] - per_pair * s[1] for r, s in zip(rows, slopes)
                  if int(r["padded_tokens"]) == b]
            intercepts[b] = max(sum(ys) / len(ys), 1e-6)
        return cls(intercepts, per_context, info, per_pair)

    def error(self, records: list[dict]) -> dict:
        """How well the model predicts recorded steps: mean absolute error over the steps (as a fraction
        of their mean time) and the total time predicted over the total measured."""
        rows = [r for r in records if r.get("seconds") is not None]
        pred = [self.seconds(self._stats(r)) for r in rows]
        real = [r["seconds"] for r in rows]
        mean = sum(real) / len(real)
        return {"steps": len(rows), "mean_abs_error_frac": round(sum(abs(p - q) for p, q in zip(pred, real))
                                                                / len(real) / mean, 4),
                "total_ratio": round(sum(pred) / sum(real), 4)}

    @classmethod
    def from_json(cls, d: dict) -> "FittedStepModel":
        return cls({int(k): v for k, v in d["intercepts_s"].items()}, d["per_context_token_s"], d.get("info"),
                   d.get("per_extra_pair_s", 0.0))

    def to_json(self) -> dict:
        return {"kind": "fitted", "intercepts_s": {str(b): round(v, 7) for b, v in zip(self.buckets, self.intercepts)},
                "per_context_token_s": self.per_context_token, "per_extra_pair_s": self.per_extra_pair,
                **({"info": self.info} if self.info else {})}


def _extra_pairs(attention_pairs: int, context: int) -> int:
    """Attention pairs beyond one per context token: zero for decode rows, ~n^2/2 for a chunk of n."""
    return max(0, attention_pairs - context)


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    flops: float  # peak dense bfloat16 FLOP/s
    bandwidth: float  # memory bytes/s
    memory: float  # bytes


# Public spec-sheet figures (dense bfloat16, no sparsity).
DEVICES = {
    "h200": Device("NVIDIA H200 (SXM)", 989e12, 4.8e12, 141e9),
    "h100": Device("NVIDIA H100 (SXM)", 989e12, 3.35e12, 80e9),
    "a100": Device("NVIDIA A100 (80 GB)", 312e12, 2.04e12, 80e9),
    "tpu-v5e": Device("TPU v5e (one chip)", 197e12, 819e9, 16e9),
    "tpu-v6e": Device("TPU v6e (one chip)", 918e12, 1640e9, 32e9),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    weight_bytes_per_param: float = 2.0  # bfloat16
    kv_bytes_per_value: float = 2.0

    @property
    def layer_params(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * d * (2 * self.heads + 2 * self.kv_heads) + 3 * h * self.intermediate

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> float:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.kv_bytes_per_value


MODELS = {
    "llama-3-8b": ModelShape("Llama 3 8B", 32, 4096, 32, 8, 128, 14336, 128256),
    "smollm2-135m": ModelShape("SmolLM2 135M", 30, 576, 9, 3, 64, 1536, 49152),
    "qwen3-0.6b": ModelShape("Qwen3 0.6B", 28, 1024, 16, 8, 128, 3072, 151936),
}


class RooflineStepModel:
    kind = "roofline"

    def __init__(self, device: Device, model: ModelShape, flops_efficiency: float = 0.5,
                 bandwidth_efficiency: float = 0.7, overhead_s: float = 0.0005):
        self.device, self.model = device, model
        self.flops_efficiency, self.bandwidth_efficiency, self.overhead_s = (
            flops_efficiency, bandwidth_efficiency, overhead_s)

    def seconds(self, s: StepStats) -> float:
        m = self.model
        flops = (2 * m.layers * m.layer_params * s.padded_tokens + 2 * m.vocab * m.hidden * s.sampled_rows
                 + 4 * m.layers * m.heads * m.head_dim * s.attention_pairs)
        weight_bytes = m.params * m.weight_bytes_per_param
        kv_bytes = m.kv_bytes_per_token * (s.context + s.tokens)  # read every row's context, write the new
        return max(flops / (self.device.flops * self.flops_efficiency),
                   (weight_bytes + kv_bytes) / (self.device.bandwidth * self.bandwidth_efficiency)) + self.overhead_s

    def num_pages(self, page_size: int, memory_fraction: float = 0.9, activation_bytes: float = 2e9) -> int:
        """Pages the device holds beside the weights (and a reserve for activations)."""
        free = self.device.memory * memory_fraction - self.model.params * self.model.weight_bytes_per_param
        return max(2, int((free - activation_bytes) // (self.model.kv_bytes_per_token * page_size)))

    def to_json(self) -> dict:
        return {"kind": "roofline", "device": self.device.name, "model": self.model.name,
                "flops_efficiency": self.flops_efficiency, "bandwidth_efficiency": self.bandwidth_efficiency,
                "overhead_s": self.overhead_s}


def load_step_model(path: str | None = None) -> FittedStepModel:
    path = path or BUILTIN_STEP_MODEL
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return FittedStepModel.from_json(d)
    except FileNotFoundError:
        raise ValueError(f"step model: file not found: {path}") from None
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"step model: {path} is not a fitted step model ({type(e).__name__}: {e})") from None


def simulate(trace: list[TraceRequest], config, step_model, *, vocab: int = 32000, seed: int = 0,
             max_running: int | None = None, progress=None) -> dict:
    """Run `trace` through the host-side scheduler with `config` (an EngineConfig) on a simulated
    clock; returns the table's figures (jaxcb.sim.trace.summarize) plus the run's counters. `max_running`:
    a fixed running limit below the config's (as the benchmark's fixed-limit runs set it)."""
    sc, buckets, page_size = config.scheduler, config.buckets, config.page_size
    pool = PagePool(config.num_pages, page_size)
    sched = Scheduler(sc, pool)
    if max_running is not None:
        sched.running_limit = max_running
    ids = prompt_ids(trace, vocab, seed)
    records: list[RequestRecord] = []
    index: dict[int, int] = {}
    rejected = 0
    clock, i, n, step_id = 0.0, 0, len(trace), 0
    slots = live_total = steps = 0
    # The step on the simulated device: (chunks, epochs at launch, its end time, its duration). With
    # async scheduling (the engine's default) step N+1 is scheduled while step N runs, so it is planned
    # before N's tokens are known: a request whose last token is in flight keeps its slot one more
    # step, and one arriving during step N joins at N+2 — as in Engine.step().
    in_flight: tuple | None = None
    pipelined = sc.async_scheduling
    wall0 = time.perf_counter()

    def complete(step) -> None:
        nonlocal clock
        chunks, epochs, end, dt = step
        clock = max(clock, end)
        observed = []
        for _, r, _, reason in sched.on_step_done(chunks, epochs, [0] * len(chunks)):
            rec = records[index[id(r)]]
            if rec.first_token is None:
                rec.first_token = r.first_token_time = clock
                rec.scheduled = r.first_scheduled_time
            rec.output_tokens = len(r.output_ids)
            observed.append((r, reason is not None))
            if reason is not None:
                sched.finish(r, reason)
                rec.finished = clock
                del index[id(r)]
        sched.observe_step_done(chunks, dt, observed, clock)  # as the engine feeds the latency controller

    while i < n or sched.has_work:
        while i < n and trace[i].arrival_s <= clock:
            t = trace[i]
            prompt = ids[i][: max(1, sc.max_context - 1)]
            r = Request(prompt, SamplingParams(max_tokens=max(1, min(t.output_tokens, sc.max_context - len(prompt))),
                                               ignore_eos=True), request_id=str(i), priority=t.priority)
            r.arrival_time = t.arrival_s
            i += 1
            try:
                sched.check_fits(r)
            except ValueError:
                rejected += 1
                continue
            index[id(r)] = len(records)
            records.append(RequestRecord(t.arrival_s))
            sched.add(r)
        if not sched.has_work:
            clock = trace[i].arrival_s
            continue
        out = sched.schedule(now=clock)
        if out.empty:
            if in_flight is not None:  # nothing new to run: wait for the step on the device
                step, in_flight = in_flight, None
                complete(step)
                continue
            next_arrival = trace[i].arrival_s if i < n else math.inf
            wait = sched.admission_wait_s(clock)
            if wait <= 0 and next_arrival == math.inf:
                raise RuntimeError("simulation stalled: requests wait but nothing can be scheduled")
            clock = min(next_arrival, clock + wait) if wait > 0 else next_arrival
            continue
        chunks = out.decode + out.prefill
        live = sum(c.num_tokens for c in chunks)
        shape = buckets.step_shape(max(live, out.num_static_rows), page_size, sc.max_context)
        stats = StepStats(
            padded_tokens=shape.tokens, tokens=live, context=sum(c.start + c.num_tokens for c in chunks),
            attention_pairs=sum(c.attention_pairs for c in chunks),
            rows=len(chunks), sampled_rows=sum(1 for c in chunks if c.samples))
        slots += shape.tokens
        live_total += live
        epochs = [c.request.num_preemptions for c in chunks]
        step_id += 1
        sched.on_launched(chunks, step_id)
        dt = step_model.seconds(stats)
        start = clock if in_flight is None else max(clock, in_flight[2])  # queued behind the running step
        launched = (chunks, epochs, start + dt, dt)
        steps += 1
        if in_flight is not None:
            complete(in_flight)
        in_flight = launched
        if not pipelined:
            in_flight = None
            complete(launched)
        if progress is not None and steps % 10000 == 0:
            progress(clock, i, n)
    assert in_flight is None
    pool.check_all_free()
    return summarize(records, preemptions=sched.num_preemptions, switches=sched.num_switches,
                     recomputed_tokens=sched.num_recomputed_tokens,
                     padding_fraction=round((slots - live_total) / slots, 4) if slots else 0.0,
                     steps=steps, rejected=rejected, simulated_s=round(clock, 3),
                     **({"final_running_limit": sched.running_limit,
                         "final_prefill_budget": sched.controller.prefill_budget} if sched.controller else {}),
                     wall_s=round(time.perf_counter() - wall0, 2))
