"""Request traces and the figures every scheduling run reports, real or simulated.

Plain Python, no JAX. A trace is JSONL, one request a line:
  {"arrival_s": 0.42, "prompt_tokens": 300, "output_tokens": 64, "priority": 0, "prefix_id": 3, "prefix_tokens": 128}
(`prompt_token_ids` may replace `prompt_tokens`; requests with the same `prefix_id` share their first
`prefix_tokens` tokens). `bench/policies.py` writes its traces in this form, replays them on the real
engine, and `jaxcb simulate` replays them on the host-side scheduler with a step-time model; both
reduce their per-request records to the same table with `summarize`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

from jaxcb.host.latency import quantile


@dataclasses.dataclass
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    priority: int = 0
    prefix_id: int | None = None
    prefix_tokens: int = 0
    prompt_token_ids: list[int] | None = None

    def to_json(self) -> str:
        d = {"arrival_s": round(self.arrival_s, 6), "prompt_tokens": self.prompt_tokens,
             "output_tokens": self.output_tokens}
        if self.priority:
            d["priority"] = self.priority
        if self.prefix_id is not None:
            d["prefix_id"], d["prefix_tokens"] = self.prefix_id, self.prefix_tokens
        if self.prompt_token_ids is not None:
            d["prompt_token_ids"] = self.prompt_token_ids
        return json.dumps(d)


TRACE_FIELDS = {"arrival_s", "prompt_tokens", "prompt_token_ids", "output_tokens", "priority", "prefix_id",
                "prefix_tokens"}
MAX_TRACE_TOKENS = 1 << 24  # a request's prompt or output tokens, at most (a trace's ids are made in memory)


def _integer(d: dict, key: str, low: int, default=None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_TRACE_TOKENS:
        raise ValueError(f"{key}: must be an integer from {low} to {MAX_TRACE_TOKENS}, got {json.dumps(v)[:40]}")
    return v


def read_trace(path: str) -> list[TraceRequest]:
    """A trace file (UTF-8, a byte-order mark allowed; lines end at newlines only), sorted by arrival; a bad
    line is an error naming the line and the field: every field known, each of its type (no float where an
    integer is meant), times finite."""
    from jaxcb.host.request import jsonl_lines

    out = []
    for n, d in jsonl_lines(path):
        try:
            if not isinstance(d, dict):
                raise ValueError("must be a JSON object")
            unknown = sorted(set(d) - TRACE_FIELDS)
            if unknown:
                raise ValueError(f"{unknown[0]}: not a field of a trace line ({', '.join(sorted(TRACE_FIELDS))})")
            arrival = d.get("arrival_s")
            if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not 0 <= arrival < math.inf:
                raise ValueError(f"arrival_s: must be a finite number of seconds >= 0, got {json.dumps(arrival)}")
            ids = d.get("prompt_token_ids")
            if ids is not None and (not isinstance(ids, list) or len(ids) > MAX_TRACE_TOKENS or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
                raise ValueError("prompt_token_ids: must be a list of token ids")
            prefix_id = d.get("prefix_id")
            if prefix_id is not None and (isinstance(prefix_id, bool) or not isinstance(prefix_id, (int, str))):
                raise ValueError(f"prefix_id: must be an integer or a string, got {json.dumps(prefix_id)[:40]}")
            r = TraceRequest(float(arrival), len(ids) if ids is not None else _integer(d, "prompt_tokens", 1),
                             _integer(d, "output_tokens", 1), _priority(d), prefix_id,
                             _integer(d, "prefix_tokens", 0, 0), ids)
            if not r.prompt_tokens:
                raise ValueError("prompt_token_ids: must not be empty")
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        out.append(r)
    out.sort(key=lambda r: r.arrival_s)
    return out


def _priority(d: dict) -> int:
    v = d.get("priority", 0)
    if isinstance(v, bool) or not isinstance(v, int) or abs(v) > 1 << 31:
        raise ValueError(f"priority: must be an integer, got {json.dumps(v)[:40]}")
    return v


def write_trace(path: str, requests: list[TraceRequest]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(r.to_json() + "\n")


def prompt_ids(trace: list[TraceRequest], vocab: int, seed: int = 0, low: int = 100,
               limit: int | None = None) -> list[list[int]]:
    """Token ids for every request: its own, or random ones (the same for the same seed) whose first
    `prefix_tokens` are shared with every request of the same `prefix_id`. `limit`: no more than this many
    made for a request (one that long is refused by an engine of that context anyway)."""
    rng = random.Random(seed)
    prefixes: dict[int, list[int]] = {}
    out = []
    for r in trace:
        if r.prompt_token_ids is not None:
            out.append(list(r.prompt_token_ids))
            continue
        shared = []
        if r.prefix_id is not None and r.prefix_tokens:
            p = prefixes.setdefault(r.prefix_id, [])
            while len(p) < r.prefix_tokens:
                p.append(rng.randrange(low, vocab))
            shared = p[:min(r.prefix_tokens, r.prompt_tokens)]
        size = r.prompt_tokens if limit is None else min(r.prompt_tokens, limit)
        out.append(shared[:size] + [rng.randrange(low, vocab) for _ in range(size - len(shared[:size]))])
    return out


@dataclasses.dataclass
class RequestRecord:
    """One request's timeline, in seconds from the run's start."""

    arrival: float
    scheduled: float | None = None  # first given a batch slot
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)


def summarize(records: list[RequestRecord], **extra) -> dict:
    """The table's figures: throughput over the run (first arrival to last finish), TTFT, TPOT (per
    request: (finish - first token) / (outputs - 1)), end-to-end latency and the longest wait for a
    first slot (starvation). `extra` (preemptions, recomputed tokens, padding...) is passed through."""
    done = [r for r in records if r.finished is not None]
    if not done:
        return {"requests": 0, **extra}
    span = max(r.finished for r in done) - min(r.arrival for r in records)
    tokens = sum(r.output_tokens for r in done)
    ttft = [r.ttft for r in done]
    tpot = [t for t in (r.tpot for r in done) if t is not None]
    e2e = [r.finished - r.arrival for r in done]
    waits = [(r.scheduled if r.scheduled is not None else r.first_token) - r.arrival for r in done]
    return {
        "requests": len(done), "output_tokens": tokens, "span_s": round(span, 3),
        "output_tokens_per_s": round(tokens / span, 2) if span > 0 else 0.0,
        "requests_per_s": round(len(done) / span, 4) if span > 0 else 0.0,
        "ttft_p50_s": round(quantile(ttft, 0.5), 4), "ttft_p99_s": round(quantile(ttft, 0.99), 4),
        "tpot_p50_s": round(quantile(tpot, 0.5), 5), "tpot_p99_s": round(quantile(tpot, 0.99), 5),
        "e2e_p50_s": round(quantile(e2e, 0.5), 4), "e2e_p99_s": round(quantile(e2e, 0.99), 4), "max_wait_s": round(max(waits), 4),
        **extra,
    }
