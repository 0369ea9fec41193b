"""Bucket planning from recorded lengths: the dynamic programme against brute force."""

import itertools

import numpy as np
import pytest

from jaxcb.sim.bucket_plan import padded_tokens, padding_fraction, plan, powers_of_two, prefill_chunks


def brute_force(lengths, max_buckets, top):
    candidates = sorted(set(lengths) - {top})
    best = None
    for k in range(0, max_buckets):
        for combo in itertools.combinations(candidates, k):
            cost = padded_tokens(lengths, list(combo) + [top])
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_plan_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, size=int(rng.integers(1, 25))).tolist()
    top = max(lengths) + int(rng.integers(0, 8))
    for max_buckets in (1, 2, 3, 4):
        buckets = plan(lengths, max_buckets, top)
        assert len(buckets) <= max_buckets and buckets[-1] == top and buckets == sorted(set(buckets))
        assert padded_tokens(lengths, buckets) == brute_force(lengths, max_buckets, top)


def test_plan_beats_powers_of_two_on_a_skewed_distribution():
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(np.exp(rng.normal(np.log(75), 0.8, 2000))), 8, 512).astype(int)
    pow2 = powers_of_two(512, smallest=32)
    ours = plan(lengths, len(pow2), 512)
    assert padding_fraction(lengths, ours) < padding_fraction(lengths, pow2)
    assert plan(lengths, 1000, 512)[-1] == 512 and padded_tokens(lengths, plan(lengths, 1000, 512)) == 0


def test_bad_input_and_chunks():
    with pytest.raises(ValueError, match="longer than the largest bucket 10"):
        plan([5, 11], 2, top=10)
    with pytest.raises(ValueError, match="max_buckets"):
        plan([5], 0)
    with pytest.raises(ValueError, match="none recorded"):
        plan([], 2)
    assert prefill_chunks([5, 512, 1100], 512) == [5, 512, 512, 512, 76]
    assert powers_of_two(100, 16) == [16, 32, 64, 100]
    # more buckets than distinct lengths: as many as there are lengths (10**12 asked for a table of that size)
    assert plan([3, 7, 7, 9], 10**12) == [3, 7, 9] == plan([3, 7, 7, 9], 3)
