"""Static-shape buckets, and the one place where a step is padded into them.

XLA compiles one program per input shape, so every step is padded to a shape from a small fixed set:
decode steps to (batch, pages per sequence), prefill chunks to (tokens, pages per sequence). Buckets
are sorted tuples looked up with bisect; the largest is the configured maximum and nothing is ever
padded past it. Padded tokens write into the null page and padded page-table entries point at it.

Plain numpy, no JAX: the runner turns a `PaddedBatch` into device arrays.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from jaxcb.page_pool import NULL_PAGE


@dataclasses.dataclass(frozen=True)
class Buckets:
    decode_batch: tuple[int, ...]  # B for decode steps; last = max running requests
    pages_per_seq: tuple[int, ...]  # N; last = max pages one sequence can hold
    prefill_tokens: tuple[int, ...]  # T for a prefill chunk; last = largest chunk

    def __post_init__(self):
        for name in ("decode_batch", "pages_per_seq", "prefill_tokens"):
            values = tuple(int(v) for v in getattr(self, name))
            object.__setattr__(self, name, values)
            if not values:
                raise ValueError(f"buckets.{name}: must not be empty")
            if any(v < 1 for v in values):
                raise ValueError(f"buckets.{name}: every bucket must be >= 1, got {list(values)}")
            if list(values) != sorted(set(values)):
                raise ValueError(f"buckets.{name}: must be strictly increasing, got {list(values)}")

    @property
    def max_batch(self) -> int:
        return self.decode_batch[-1]

    @property
    def max_pages_per_seq(self) -> int:
        return self.pages_per_seq[-1]

    @property
    def max_prefill_tokens(self) -> int:
        return self.prefill_tokens[-1]

    def validate(self, *, max_batch: int, max_pages_per_seq: int, max_prefill_tokens: int) -> None:
        """The largest bucket of each list must be exactly the configured maximum."""
        for name, largest, want in (
            ("decode_batch", self.max_batch, max_batch),
            ("pages_per_seq", self.max_pages_per_seq, max_pages_per_seq),
            ("prefill_tokens", self.max_prefill_tokens, max_prefill_tokens),
        ):
            if largest != want:
                raise ValueError(f"buckets.{name}: the largest bucket is {largest}, but the configured maximum is {want}")

    def shapes(self):
        """Every (kind, rows, tokens, pages) shape a step can take: what warm-up compiles."""
        for b in self.decode_batch:
            for n in self.pages_per_seq:
                yield ("decode", b, 1, n)
        for t in self.prefill_tokens:
            for n in self.pages_per_seq:
                yield ("prefill", 1, t, n)


def bucket_for(buckets: tuple[int, ...], value: int, field: str) -> int:
    i = bisect.bisect_left(buckets, value)
    if i == len(buckets):
        raise ValueError(f"{field}: {value} is above the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclasses.dataclass
class PaddedBatch:
    """numpy arrays of one step, already padded to a bucket shape (see model.llama.StepInput)."""

    token_ids: np.ndarray  # int32 [B, T]
    positions: np.ndarray  # int32 [B, T]
    slot_ids: np.ndarray  # int32 [B, T]
    page_table: np.ndarray  # int32 [B, N]
    kv_lens: np.ndarray  # int32 [B]
    logits_index: np.ndarray  # int32 [B]
    num_rows: int  # live rows; the rest are padding
    num_tokens: int  # live token slots (for the padding fraction)

    @property
    def shape(self) -> tuple[int, int, int]:
        b, t = self.token_ids.shape
        return b, t, self.page_table.shape[1]


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """One sequence's part of a step: `token_ids` start at position `start` of the sequence."""

    token_ids: list[int]
    start: int
    page_ids: list[int]


def pad_step(rows: list[RowSpec], batch_bucket: int, token_bucket: int, pages_bucket: int,
             page_size: int) -> PaddedBatch:
    """Lay the rows into arrays of shape [batch_bucket, token_bucket] and [batch_bucket, pages_bucket]."""
    assert len(rows) <= batch_bucket, f"{len(rows)} rows do not fit batch bucket {batch_bucket}"
    token_ids = np.zeros((batch_bucket, token_bucket), np.int32)
    positions = np.zeros((batch_bucket, token_bucket), np.int32)
    slot_ids = np.full((batch_bucket, token_bucket), NULL_PAGE * page_size, np.int32)
    page_table = np.full((batch_bucket, pages_bucket), NULL_PAGE, np.int32)
    kv_lens = np.zeros(batch_bucket, np.int32)
    logits_index = np.zeros(batch_bucket, np.int32)
    live_tokens = 0
    for r, row in enumerate(rows):
        n = len(row.token_ids)
        end = row.start + n
        assert 0 < n <= token_bucket, f"row of {n} tokens does not fit token bucket {token_bucket}"
        assert len(row.page_ids) * page_size >= end, "the row's pages do not cover its tokens"
        assert len(row.page_ids) <= pages_bucket, f"{len(row.page_ids)} pages do not fit bucket {pages_bucket}"
        pos = np.arange(row.start, end, dtype=np.int32)
        pages = np.asarray(row.page_ids, np.int32)
        token_ids[r, :n] = row.token_ids
        positions[r, :n] = pos
        slot_ids[r, :n] = pages[pos // page_size] * page_size + pos % page_size
        page_table[r, : len(pages)] = pages
        kv_lens[r] = end
        logits_index[r] = n - 1
        live_tokens += n
    return PaddedBatch(token_ids, positions, slot_ids, page_table, kv_lens, logits_index,
                       num_rows=len(rows), num_tokens=live_tokens)


@dataclasses.dataclass
class PaddedSampling:
    """Per-row sampling settings of one step, padded like its PaddedBatch (see sampling.SamplingInput)."""

    temperature: np.ndarray  # f32 [B]
    top_k: np.ndarray  # i32 [B]
    top_p: np.ndarray  # f32 [B]
    min_p: np.ndarray  # f32 [B]
    repetition_penalty: np.ndarray  # f32 [B]
    presence_penalty: np.ndarray  # f32 [B]
    frequency_penalty: np.ndarray  # f32 [B]
    seed: np.ndarray  # u32 [B, 2]
    counter: np.ndarray  # i32 [B]
    history_ids: np.ndarray  # i32 [B, W]
    history_is_output: np.ndarray  # bool [B, W]
    logprobs: np.ndarray  # i32 [B]


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    params: "object"  # request.SamplingParams
    seed: int  # 64-bit
    prompt_ids: list[int]
    output_ids: list[int]
    samples: bool = True  # False for a prefill chunk that ends before the newest token


def pad_sampling(rows: list[SamplingRow], batch_bucket: int, window: int) -> PaddedSampling:
    """`window` (the step's pages x page size) bounds the sequence length, so the token history that
    the penalties need always fits; it is filled only for rows that use a penalty."""
    b = batch_bucket
    out = PaddedSampling(
        temperature=np.zeros(b, np.float32), top_k=np.zeros(b, np.int32), top_p=np.ones(b, np.float32),
        min_p=np.zeros(b, np.float32), repetition_penalty=np.ones(b, np.float32),
        presence_penalty=np.zeros(b, np.float32), frequency_penalty=np.zeros(b, np.float32),
        seed=np.zeros((b, 2), np.uint32), counter=np.zeros(b, np.int32),
        history_ids=np.full((b, window), -1, np.int32), history_is_output=np.zeros((b, window), bool),
        logprobs=np.zeros(b, np.int32),
    )
    for r, row in enumerate(rows):
        p = row.params
        out.temperature[r] = p.temperature
        out.top_k[r] = p.top_k
        out.top_p[r] = p.top_p
        out.min_p[r] = p.min_p
        out.repetition_penalty[r] = p.repetition_penalty
        out.presence_penalty[r] = p.presence_penalty
        out.frequency_penalty[r] = p.frequency_penalty
        out.seed[r] = (row.seed >> 32) & 0xFFFFFFFF, row.seed & 0xFFFFFFFF
        out.counter[r] = len(row.output_ids)
        out.logprobs[r] = p.logprobs
        if row.samples and (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
            n_prompt, n_out = len(row.prompt_ids), len(row.output_ids)
            assert n_prompt + n_out <= window, "the token history does not fit the step's window"
            out.history_ids[r, :n_prompt] = row.prompt_ids
            out.history_ids[r, n_prompt:n_prompt + n_out] = row.output_ids
            out.history_is_output[r, n_prompt:n_prompt + n_out] = True
    return out


# Relative costs of a decode call, measured on the CPU (SmolLM2, float32): a fixed part per call
# (reading every weight once), a part per padded row (its matmuls), and a part per padded page of
# context per row (gathering and attending over it).
CALL_COST, ROW_COST, PAGE_ROW_COST = 30.0, 2.0, 0.25


def plan_decode_groups(pages_per_row: list[int], buckets: Buckets, max_groups: int = 3) -> list[list[int]]:
    """Split decode rows into up to `max_groups` calls when that costs less than one padded call.

    One call pads every row to the longest row's pages; a batch with a few long sequences among
    many short ones then pays for the long context on every row. Rows sorted by pages, the best
    split points are found by dynamic programming over the cost model above. Returns groups of row
    indices; every group's shape is an existing bucket, so no split ever compiles anything.
    """
    order = sorted(range(len(pages_per_row)), key=lambda i: pages_per_row[i])
    n = len(order)

    def cost(lo: int, hi: int) -> float:  # rows order[lo:hi] in one call
        b = bucket_for(buckets.decode_batch, hi - lo, "batch")
        p = bucket_for(buckets.pages_per_seq, pages_per_row[order[hi - 1]], "pages per sequence")
        return CALL_COST + b * (ROW_COST + PAGE_ROW_COST * p)

    best = {0: (0.0, [])}  # rows taken -> (cost, split points), for the current number of groups
    answer = (cost(0, n), [])
    for _ in range(max_groups - 1):
        nxt = {}
        for taken, (c, cuts) in best.items():
            for end in range(taken + 1, n):
                cand = (c + cost(taken, end), cuts + [end])
                if end not in nxt or cand[0] < nxt[end][0]:
                    nxt[end] = cand
        for taken, (c, cuts) in nxt.items():
            total = c + cost(taken, n)
            if total < answer[0]:
                answer = (total, cuts)
        best = nxt
    bounds = [0, *answer[1], n]
    return [[order[i] for i in range(lo, hi)] for lo, hi in zip(bounds, bounds[1:])]
