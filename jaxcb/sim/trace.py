"""Request traces and the figures every scheduling run reports, real or simulated.

Plain Python and numpy, no JAX. A trace is JSONL, one request a line:
  {"arrival_s": 0.42, "prompt_tokens": 300, "output_tokens": 64, "priority": 0, "prefix_id": 3, "prefix_tokens": 128}
(`prompt_token_ids` may replace `prompt_tokens`; requests with the same `prefix_id` share their first
`prefix_tokens` tokens; or `hash_ids`, the prompt's blocks of `block_tokens` tokens (512 unless given) named by
hash: requests whose first blocks have the same hashes share those blocks' tokens, however many). `bench/policies.py`
writes its traces in this form, replays them on the real engine, and `jaxcb simulate` replays them on the host-side
scheduler with a step-time model; both reduce their per-request records to the same table with `summarize`.

read_trace also takes the public traces as published: Mooncake's JSONL (`timestamp` in ms, `input_length`,
`output_length`, `hash_ids` of 512-token blocks), Azure's LLM inference traces (CSV: `TIMESTAMP`, `ContextTokens`,
`GeneratedTokens`) and BurstGPT (CSV: `Timestamp` in s, `Request tokens`, `Response tokens`); their arrivals count
from the first request's, and their rows with no output (failed requests) are left out and counted.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import random
import re

import numpy as np

from jaxcb.host.latency import quantile

BLOCK_TOKENS = 512  # a hash id's tokens where a trace line does not say (Mooncake's blocks)


@dataclasses.dataclass
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    priority: int = 0
    prefix_id: int | None = None
    prefix_tokens: int = 0
    prompt_token_ids: list[int] | None = None
    hash_ids: tuple[int, ...] | None = None  # the prompt's blocks of block_tokens tokens, by hash (Mooncake's)
    block_tokens: int = BLOCK_TOKENS
    client: str = ""  # whose request (the fair policy's flows; per-client figures in simulate's report)

    def to_json(self) -> str:
        d = {"arrival_s": round(self.arrival_s, 6), "prompt_tokens": self.prompt_tokens,
             "output_tokens": self.output_tokens}
        if self.priority:
            d["priority"] = self.priority
        if self.prefix_id is not None:
            d["prefix_id"], d["prefix_tokens"] = self.prefix_id, self.prefix_tokens
        if self.prompt_token_ids is not None:
            d["prompt_token_ids"] = self.prompt_token_ids
        if self.hash_ids is not None:
            d["hash_ids"], d["block_tokens"] = list(self.hash_ids), self.block_tokens
        if self.client:
            d["client"] = self.client
        return json.dumps(d)


TRACE_FIELDS = {"arrival_s", "prompt_tokens", "prompt_token_ids", "output_tokens", "priority", "prefix_id",
                "prefix_tokens", "hash_ids", "block_tokens", "client"}
MAX_TRACE_TOKENS = 1 << 24  # a request's prompt or output tokens, at most (a trace's ids are made in memory)
# The public traces' own fields (read_trace): Mooncake's JSONL; Azure's and BurstGPT's CSV columns
MOONCAKE_FIELDS = {"timestamp", "input_length", "output_length", "hash_ids"}
CSV_COLUMNS = {"azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
               "burstgpt": ("Timestamp", "Request tokens", "Response tokens")}


def _integer(d: dict, key: str, low: int, default=None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_TRACE_TOKENS:
        raise ValueError(f"{key}: must be an integer from {low} to {MAX_TRACE_TOKENS}, got {json.dumps(v)[:40]}")
    return v


def read_trace(path: str, notes: list | None = None) -> list[TraceRequest]:
    """A trace file, sorted by arrival: jaxcb's JSONL or a public trace's (the module's doc; a .csv file is
    Azure's or BurstGPT's, told by its header). JSONL is UTF-8 (a byte-order mark allowed; lines end at newlines
    only). A bad line is an error naming the line and the field: every field known, each of its type (no float
    where an integer is meant), times finite. `notes` gets what was left out of a public trace, in words."""
    if path.lower().endswith(".csv"):
        out, skipped = _read_csv(path)
    else:
        out, skipped = _read_jsonl(path)
    if skipped and notes is not None:
        notes.append(f"{path}: {skipped} requests with no prompt or no output tokens (failed requests) left out")
    if out and min(r.arrival_s for r in out) > 0 and skipped is not None:  # (a public trace's clock: from its first)
        first = min(r.arrival_s for r in out)
        for r in out:
            r.arrival_s -= first
    out.sort(key=lambda r: r.arrival_s)
    return out


def load_trace(path: str, requests: int | None = None, time_scale: float = 1.0) -> list[TraceRequest]:
    """A trace as a run takes it (`jaxcb simulate --trace`, `jaxcb bench serve --trace`): read_trace's requests, the
    first `requests` of them, their arrival times multiplied by `time_scale`; what a public trace left out is said
    on stderr; a trace of no request is an error."""
    import sys

    if not 0 < time_scale < math.inf:
        raise ValueError(f"--time-scale: must be a number above 0, got {time_scale}")
    notes = []
    trace = read_trace(path, notes)[:requests]
    for note in notes:
        print(note, file=sys.stderr)
    if not trace:
        raise ValueError(f"--trace: {path} holds no requests")
    for r in trace:
        r.arrival_s *= time_scale
        if not math.isfinite(r.arrival_s):
            raise ValueError(f"--time-scale: {time_scale} puts arrivals past what a number of seconds can hold")
    return trace


def _read_jsonl(path: str) -> tuple[list[TraceRequest], int | None]:
    """jaxcb's lines (skipped: None) or Mooncake's (told by the first line; the count of those without output)."""
    from jaxcb.host.request import jsonl_lines

    out, mooncake, skipped = [], None, 0
    for n, d in jsonl_lines(path):
        try:
            if not isinstance(d, dict):
                raise ValueError("must be a JSON object")
            if mooncake is None:
                mooncake = "arrival_s" not in d and "timestamp" in d
            if mooncake:
                r = _mooncake(d)
                skipped += r is None
            else:
                r = _jaxcb_line(d)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        if r is not None:
            out.append(r)
    return out, skipped if mooncake else None


def _known(d: dict, fields: set, what: str) -> None:
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ValueError(f"{unknown[0]}: not a field of {what} ({', '.join(sorted(fields))})")


def _time(d: dict, key: str, unit: str) -> float:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{key}: must be a finite number of {unit} >= 0, got {json.dumps(value)[:40]}")
    return float(value)


def _jaxcb_line(d: dict) -> TraceRequest:
    _known(d, TRACE_FIELDS, "a trace line")
    arrival = _time(d, "arrival_s", "seconds")
    ids = d.get("prompt_token_ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) > MAX_TRACE_TOKENS or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        raise ValueError("prompt_token_ids: must be a list of token ids")
    prefix_id = d.get("prefix_id")
    if prefix_id is not None and (isinstance(prefix_id, bool) or not isinstance(prefix_id, (int, str))):
        raise ValueError(f"prefix_id: must be an integer or a string, got {json.dumps(prefix_id)[:40]}")
    r = TraceRequest(arrival, len(ids) if ids is not None else _integer(d, "prompt_tokens", 1),
                     _integer(d, "output_tokens", 1), _priority(d), prefix_id,
                     _integer(d, "prefix_tokens", 0, 0), ids)
    if not r.prompt_tokens:
        raise ValueError("prompt_token_ids: must not be empty")
    client = d.get("client", "")
    if not isinstance(client, str) or len(client) > 256:
        raise ValueError(f"client: must be a string of at most 256 characters, got {json.dumps(client)[:40]}")
    r.client = client
    if "hash_ids" in d:
        if ids is not None or prefix_id is not None:
            raise ValueError("hash_ids: give hash_ids, prompt_token_ids or prefix_id, one of them")
        r.block_tokens = _integer(d, "block_tokens", 1, BLOCK_TOKENS)
        r.hash_ids = _hash_ids(d["hash_ids"], r.prompt_tokens, r.block_tokens, "prompt_tokens")
    elif "block_tokens" in d:
        raise ValueError("block_tokens: only with hash_ids")
    return r


def _hash_ids(given, tokens: int, block: int, length_field: str) -> tuple[int, ...]:
    """A prompt's block hashes: integers, enough blocks of `block` tokens for its `tokens` and no more."""
    if not isinstance(given, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in given):
        raise ValueError("hash_ids: must be a list of integers")
    if len(given) != -(-tokens // block):
        raise ValueError(f"hash_ids: {len(given)} blocks of {block} tokens for {length_field} {tokens} (must be "
                         f"{-(-tokens // block)})")
    return tuple(given)


def _mooncake(d: dict) -> TraceRequest | None:
    """A Mooncake trace line (timestamp in ms, input_length, output_length, hash_ids of 512-token blocks);
    None for one without output."""
    _known(d, MOONCAKE_FIELDS, "a Mooncake trace line")
    when = _time(d, "timestamp", "milliseconds")
    if d.get("output_length") == 0:
        return None
    tokens = _integer(d, "input_length", 1)
    return TraceRequest(when / 1000.0, tokens, _integer(d, "output_length", 1),
                        hash_ids=_hash_ids(d.get("hash_ids"), tokens, BLOCK_TOKENS, "input_length"))


def _read_csv(path: str) -> tuple[list[TraceRequest], int]:
    """Azure's or BurstGPT's CSV (told by the header); a bad row is an error naming the line and the column."""
    try:
        f = open(path, newline="", encoding="utf-8-sig")
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    out, skipped = [], 0
    with f:
        rows = csv.reader(f)
        try:
            header = [h.strip() for h in next(rows, [])]
            kind = next((k for k, cols in CSV_COLUMNS.items() if set(cols) <= set(header)), None)
            if kind is None:
                raise ValueError(f"{path}:1: a trace's CSV header names " + " or ".join(
                    ", ".join(cols) for cols in CSV_COLUMNS.values()) + f"; this one: {', '.join(header)[:200]}")
            at = [header.index(c) for c in CSV_COLUMNS[kind]]
            for row in rows:
                if not any(cell.strip() for cell in row):
                    continue
                where = f"{path}:{rows.line_num}"
                if len(row) != len(header):
                    raise ValueError(f"{where}: {len(row)} columns, the header has {len(header)}")
                when, prompt, output = (row[i].strip() for i in at)
                names = CSV_COLUMNS[kind]
                arrival = _csv_time(when, kind, f"{where}: {names[0]}")
                prompt, output = _csv_count(prompt, f"{where}: {names[1]}"), _csv_count(output, f"{where}: {names[2]}")
                if not prompt or not output:
                    skipped += 1
                    continue
                out.append(TraceRequest(arrival, prompt, output))
        except csv.Error as e:
            raise ValueError(f"{path}:{rows.line_num}: {e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: {e}") from None
    return out, skipped


_DATE_TIME = re.compile(r"(?P<head>\d{4}-\d\d-\d\d[T ]\d\d:\d\d(?::\d\d)?)(?:\.(?P<frac>\d+))?(?P<zone>Z|[+-]\d\d:?\d\d)?")


def _csv_time(text: str, kind: str, where: str) -> float:
    """Seconds: BurstGPT's Timestamp is a number of seconds; Azure's a date and time (its fractions of a second
    may have 7 digits, more than Python reads: cut to 6)."""
    try:
        if kind == "burstgpt":
            value = float(text)
        else:  # (a time without an offset is UTC; fractions of any length, cut or filled to 6 digits)
            m = _DATE_TIME.fullmatch(text)
            if m is None:
                raise ValueError(text)
            stamp = datetime.datetime.fromisoformat(m["head"] + (f".{m['frac'][:6]:0<6}" if m["frac"] else "")
                                                    + (m["zone"] or "").replace("Z", "+00:00"))
            value = (stamp if stamp.tzinfo else stamp.replace(tzinfo=datetime.timezone.utc)).timestamp()
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise ValueError(f"{where}: {text[:40]!r} is not a " + ("number of seconds >= 0" if kind == "burstgpt" else
                                                                "date and time (2023-11-16 18:15:46.680)"))
    return value


def _csv_count(text: str, where: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_TRACE_TOKENS:  # (not ² nor full-width digits)
        raise ValueError(f"{where}: must be an integer from 0 to {MAX_TRACE_TOKENS}, got {text[:40]!r}")
    return int(text)


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
    """Token ids for every request (iter_prompt_ids, in a list)."""
    return list(iter_prompt_ids(trace, vocab, seed, low, limit))


def iter_prompt_ids(trace: list[TraceRequest], vocab: int, seed: int = 0, low: int = 100, limit: int | None = None):
    """Token ids for each request in turn: its own, or random ones (the same for the same seed) whose first
    `prefix_tokens` are shared with every request of the same `prefix_id`, or those of its `hash_ids`' blocks
    (each hash's tokens the same wherever it is). `limit`: no more than this many made for a request (one that
    long is refused by an engine of that context anyway)."""
    rng = random.Random(seed)
    prefixes: dict[int, list[int]] = {}
    for r in trace:
        size = r.prompt_tokens if limit is None else min(r.prompt_tokens, limit)
        if r.prompt_token_ids is not None:
            yield list(r.prompt_token_ids)
            continue
        if r.hash_ids is not None:
            blocks = [np.random.default_rng([seed, h % (1 << 64)]).integers(low, vocab, r.block_tokens)
                      for h in r.hash_ids[:-(-size // r.block_tokens)]]
            yield np.concatenate(blocks)[:size].tolist()
            continue
        shared = []
        if r.prefix_id is not None and r.prefix_tokens:
            p = prefixes.setdefault(r.prefix_id, [])
            while len(p) < r.prefix_tokens:
                p.append(rng.randrange(low, vocab))
            shared = p[:min(r.prefix_tokens, r.prompt_tokens)]
        yield shared[:size] + [rng.randrange(low, vocab) for _ in range(size - len(shared[:size]))]


@dataclasses.dataclass
class RequestRecord:
    """One request's timeline, in seconds from the run's start."""

    arrival: float
    scheduled: float | None = None  # first given a batch slot
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    client: str = ""

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)


def _client_figures(done: list[RequestRecord]) -> dict:
    span = max(r.finished for r in done) - min(r.arrival for r in done)
    ttft = [r.ttft for r in done]
    return {"requests": len(done), "ttft_p50_s": round(quantile(ttft, 0.5), 4),
            "ttft_p99_s": round(quantile(ttft, 0.99), 4),
            "output_tokens_per_s": round(sum(r.output_tokens for r in done) / span, 2) if span > 0 else 0.0}


def summarize(records: list[RequestRecord], **extra) -> dict:
    """The table's figures: throughput over the run (first arrival to last finish), TTFT, TPOT (per
    request: (finish - first token) / (outputs - 1)), end-to-end latency and the longest wait for a
    first slot (starvation); with clients (a trace's `client`), each client's requests, TTFT p50 / p99 and
    output tokens/s as `clients`. `extra` (preemptions, recomputed tokens, padding...) is passed through."""
    done = [r for r in records if r.finished is not None]
    if not done:
        return {"requests": 0, **extra}
    clients = sorted({r.client for r in done})
    if clients != [""]:
        extra = {**extra, "clients": {c: _client_figures([r for r in done if r.client == c]) for c in clients}}
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
