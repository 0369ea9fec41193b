"""Bucket boundaries chosen from recorded traffic: fewest padded tokens for a number of buckets.

Plain numpy, no JAX. Every step is padded up to the smallest bucket that holds it, so a set of
boundaries b_1 < ... < b_k costs sum over observed lengths l of (bucket(l) - l) padded tokens. An
optimal set only ever places boundaries at observed lengths (moving one down to the largest length it
covers never adds padding), except the largest, which must be the configured maximum. Dynamic
programming over the sorted distinct lengths finds the optimum for at most `max_buckets` buckets:

    best[k][j] = min over i < j of best[k-1][i] + cost(lengths in (v_i, v_j] padded to v_j)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def padded_tokens(lengths: Sequence[int], buckets: Sequence[int]) -> int:
    """Padding of `lengths` under sorted `buckets` (every length must fit the largest)."""
    lengths = np.asarray(lengths)
    b = np.asarray(sorted(buckets))
    assert lengths.max() <= b[-1], f"a length of {lengths.max()} does not fit the largest bucket {b[-1]}"
    return int((b[np.searchsorted(b, lengths)] - lengths).sum())


def padding_fraction(lengths: Sequence[int], buckets: Sequence[int]) -> float:
    """Padded tokens over all token slots the buckets hold."""
    pad = padded_tokens(lengths, buckets)
    return pad / (pad + int(np.sum(lengths)))


def plan(lengths: Sequence[int], max_buckets: int, top: int | None = None) -> list[int]:
    """At most max_buckets boundaries, the largest = top (default: the longest length), minimising
    padded_tokens. Lengths above top are an error (they could never run)."""
    if max_buckets < 1:
        raise ValueError(f"max_buckets: must be >= 1, got {max_buckets}")
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    if values.size == 0:
        raise ValueError("lengths: none recorded")
    if values[0] < 1:
        raise ValueError(f"lengths: must be >= 1, got {values[0]}")
    top = int(values[-1]) if top is None else int(top)
    if values[-1] > top:
        raise ValueError(f"lengths: {values[-1]} is longer than the largest bucket {top}")
    if values[-1] < top:  # the forced largest bucket, holding no length of its own
        values, counts = np.append(values, top), np.append(counts, 0)
    n = values.size
    max_buckets = min(max_buckets, n)  # (more buckets than distinct lengths pad nothing less: 1e12 ran out of memory)
    count = np.concatenate([[0], np.cumsum(counts)])  # count[j + 1] = lengths <= values[j]
    total = np.concatenate([[0], np.cumsum(counts * values)])

    def cost(i: np.ndarray, j: int) -> np.ndarray:
        """Padding of lengths in (values[i], values[j]] up to values[j]; i = -1 means from the start."""
        return values[j] * (count[j + 1] - count[i + 1]) - (total[j + 1] - total[i + 1])

    inf = np.iinfo(np.int64).max // 4
    best = np.full((max_buckets + 1, n), inf, dtype=np.int64)
    back = np.full((max_buckets + 1, n), -1, dtype=np.int64)
    best[1] = cost(np.full(n, -1), np.arange(n)) if n else best[1]
    for k in range(2, max_buckets + 1):
        for j in range(k - 1, n):
            i = np.arange(k - 2, j)
            c = best[k - 1, i] + cost(i, j)
            m = int(np.argmin(c))
            best[k, j], back[k, j] = c[m], i[m]
    k = int(np.argmin(best[1:, n - 1])) + 1  # fewest buckets among the cheapest
    chosen, j = [], n - 1
    while j >= 0 and k >= 1:
        chosen.append(int(values[j]))
        j, k = int(back[k, j]), k - 1
    return sorted(chosen)


def powers_of_two(top: int, smallest: int = 16) -> list[int]:
    """The usual default: powers of two from `smallest` up to `top`, and `top` itself."""
    out, b = [], smallest
    while b < top:
        out.append(b)
        b *= 2
    return out + [top]


def prefill_chunks(prompt_lengths: Sequence[int], max_chunk: int) -> list[int]:
    """The chunk sizes the engine runs for these prompts: whole chunks of max_chunk, then the rest."""
    chunks = []
    for n in prompt_lengths:
        full, rest = divmod(int(n), max_chunk)
        chunks += [max_chunk] * full + ([rest] if rest else [])
    return chunks
