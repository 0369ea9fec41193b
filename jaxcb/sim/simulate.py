"""The engine on a simulated clock: `jaxcb simulate --trace FILE --policy P [--step-model FILE | --device NAME]`.

Plain Python, no JAX. The real engine loop (jaxcb.host.engine.Engine: scheduler, page pool, prefix cache,
buckets, packing, async pipelining, output processing) runs a trace (jaxcb.sim.trace), with a runner
that computes nothing (SimRunner): each step takes the time a step-time model gives for its packed
batch on a virtual clock, and every sampled token is a placeholder (requests run to their trace's
output length). A change to the loop is a change to the simulator: there is no second copy of it. The
report is the same table the real runs print (jaxcb.sim.trace.summarize).

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
import types

import numpy as np

from jaxcb.host.engine import Engine
from jaxcb.host.request import SamplingParams, check_prompt_length
from jaxcb.host.runner_protocol import Runner
from jaxcb.sim.trace import RequestRecord, TraceRequest, iter_prompt_ids, summarize

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
        """A model written by to_json: every time a finite number, the intercepts positive (a step takes time)."""
        intercepts = {int(k): float(v) for k, v in d["intercepts_s"].items()}
        slopes = (float(d["per_context_token_s"]), float(d.get("per_extra_pair_s", 0.0)))
        if not intercepts or not all(0 < v < math.inf for v in intercepts.values()):
            raise ValueError("intercepts_s: must give each token bucket a positive, finite time")
        if not all(0 <= v < math.inf for v in slopes):
            raise ValueError("per_context_token_s and per_extra_pair_s: must be finite and >= 0")
        return cls(intercepts, slopes[0], d.get("info"), slopes[1])

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


class SimClock:
    """The simulator's time: it moves only when a step ends or the loop waits for an arrival."""

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)


@dataclasses.dataclass
class _SimOutput:
    """What the engine reads of a step's result (jaxcb.device.sampling.SampleOutput's fields)."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    ranks: np.ndarray
    ready_at: float  # when the simulated device finishes the step


class SimRunner(Runner):
    """The engine's runner on a simulated device: a step computes nothing and takes
    the time `step_model` gives for its packed batch; one step runs at a time, so a step dispatched
    while another runs starts when that one ends; fetching a step's result moves `clock` to its end (a
    SimClock jumps; bench/host.py's wall clock sleeps). Every sampled token is a placeholder, 0 or, with
    `rng`, a random id away from the vocabulary's ends (text for the detokenizer); requests run to their
    max_tokens."""

    def __init__(self, step_model, clock, vocab: int, rng: np.random.Generator | None = None):
        self.step_model, self.clock, self.rng = step_model, clock, rng
        self.model_config = self.step_config = types.SimpleNamespace(
            vocab_size=vocab, max_context=2**31 - 1, windowed=False, sliding_window=0, headless=False)
        self.num_window_pages = 0
        self.device_ids = [0]
        self.busy_until = 0.0

    def run(self, batch, sampling, shape) -> _SimOutput:
        m = int(batch.num_seqs[0])
        q = np.diff(batch.cu_q_lens[: m + 1]).astype(np.int64)
        kv = batch.kv_lens[:m].astype(np.int64)
        start = kv - q
        stats = StepStats(padded_tokens=shape.tokens, tokens=int(q.sum()), context=int(kv.sum()),
                          attention_pairs=int((q * start + q * (q + 1) // 2).sum()), rows=m, sampled_rows=m)
        begin = max(self.clock.now(), self.busy_until)
        self.busy_until = begin + self.step_model.seconds(stats)
        n = shape.rows
        tokens = (np.zeros(n, np.int32) if self.rng is None
                  else self.rng.integers(100, self.model_config.vocab_size - 100, n).astype(np.int32))
        return _SimOutput(tokens, np.zeros(n, np.float32), np.zeros((n, 1), np.int32),
                          np.zeros((n, 1), np.float32), np.ones(n, np.int32), self.busy_until)

    def fetch(self, out: _SimOutput) -> _SimOutput:
        self.clock.advance_to(out.ready_at)
        return out

    def fetch_pooled(self, out: _SimOutput):  # nothing computed: an embedding of one zero per row
        zeros = np.zeros((len(out.token_ids), 1), np.float32)
        return zeros, zeros

    def compile(self, shape) -> None:
        pass

    def idle(self) -> None:
        pass

    def warmed_up(self) -> None:
        pass

    def reset_kv_if_lost(self) -> bool:
        return False

    def describe(self) -> dict[str, str]:
        return {"platform": "simulated", "compute_dtype": "-", "weights": "-", "kv_dtype": "-",
                "attention": getattr(self.step_model, "kind", "-")}

    def compilations(self) -> int:
        return 0


def simulate(trace: list[TraceRequest], config, step_model, *, vocab: int = 32000, seed: int = 0,
             max_running: int | None = None, progress=None) -> dict:
    """Run `trace` through the real engine loop (jaxcb.host.engine.Engine: the same scheduling,
    packing, async pipelining and output processing as a served run) with `config` (an EngineConfig),
    on a simulated clock and device (SimRunner); returns the table's figures (jaxcb.sim.trace.summarize)
    plus the run's counters. `max_running`: a fixed running limit below the config's (as the
    benchmark's fixed-limit runs set it)."""
    clock = SimClock()
    engine = Engine(SimRunner(step_model, clock, vocab), None, dataclasses.replace(config, seed=seed),
                    clock=clock.now)
    sched = engine.scheduler
    if max_running is not None:
        sched.running_limit = max_running
    ids = iter_prompt_ids(trace, vocab, seed, limit=sched.config.max_context)  # (made as each arrives)
    records: list[RequestRecord] = []
    rejected, reasons = 0, []  # (the first few refusals' reasons, in the result)
    i, n, steps = 0, len(trace), 0
    wall0 = time.perf_counter()

    def on_event(rec: RequestRecord):
        def record(ev) -> None:
            if ev.queue_s is not None and rec.scheduled is None:
                rec.scheduled = rec.arrival + ev.queue_s
            if rec.first_token is None and ev.token_ids:
                rec.first_token = clock.now()
            rec.output_tokens = ev.num_output_tokens
            if ev.finished:
                rec.finished = clock.now()
        return record

    while i < n or engine.has_work():
        while i < n and trace[i].arrival_s <= clock.now():
            t = trace[i]
            rec = RequestRecord(t.arrival_s, client=t.client)
            i += 1
            prompt = next(ids)  # (cut to the context: one longer is refused by its own length)
            try:  # (as the engine takes it served: one that does not fit the context is refused, not cut)
                if t.prompt_tokens > len(prompt):
                    check_prompt_length("prompt", t.prompt_tokens, sched.config.max_context)
                engine.add_request(prompt, SamplingParams(max_tokens=t.output_tokens, ignore_eos=True),
                                   request_id=str(i - 1), priority=t.priority, arrival_time=t.arrival_s,
                                   callback=on_event(rec), client=t.client)
            except ValueError as e:
                rejected += 1
                if len(reasons) < 5:
                    reasons.append(f"request {i - 1} (arrival {t.arrival_s:g} s): {e}")
                continue
            records.append(rec)
        if not engine.has_work():
            if i >= n:  # (the last requests were refused)
                break
            clock.advance_to(trace[i].arrival_s)
            continue
        engine.step()
        steps += 1
        if engine.last_step_idle:  # a batching window is closed: wait for it or for the next arrival
            next_arrival = trace[i].arrival_s if i < n else math.inf
            wait = sched.admission_wait_s(clock.now())
            if wait <= 0 and next_arrival == math.inf:
                raise RuntimeError("simulation stalled: requests wait but nothing can be scheduled")
            clock.advance_to(min(next_arrival, clock.now() + wait) if wait > 0 else next_arrival)
        if progress is not None and steps % 10000 == 0:
            progress(clock.now(), i, n)
    engine.pool.check_all_free()
    st = engine.stats()
    return summarize(records, preemptions=sched.num_preemptions, switches=sched.num_switches,
                     recomputed_tokens=sched.num_recomputed_tokens,
                     padding_fraction=round(st.padding_fraction, 4), steps=st.steps, rejected=rejected,
                     prompt_tokens_computed=st.prompt_tokens_computed, prefix_cache_hit_tokens=st.prefix_cache_hits,
                     **({"rejected_first": reasons} if reasons else {}),
                     simulated_s=round(clock.now(), 3),
                     **({"final_running_limit": sched.running_limit,
                         "final_prefill_budget": sched.controller.prefill_budget} if sched.controller else {}),
                     wall_s=round(time.perf_counter() - wall0, 2))
