"""The jitted sampler on hand-made logits."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.device.sampling import sample
from jaxcb.host.batch import SamplingRow, StepShape, pack_sampling
from jaxcb.host.request import SamplingParams

sample_jit = jax.jit(sample)


def inputs(params_list, seeds=None, prompts=None, outputs=None, window=16, vocab=1024):
    rows = [SamplingRow(p, (seeds or [0] * len(params_list))[i], (prompts or [[]] * len(params_list))[i],
                        (outputs or [[]] * len(params_list))[i]) for i, p in enumerate(params_list)]
    return pack_sampling(rows, StepShape(tokens=len(rows), seqs=len(rows), pages_per_seq=1, history=window), vocab)


def test_greedy_and_logprobs():
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0]])
    out = sample_jit(logits, inputs([SamplingParams(logprobs=4)]))
    assert int(out.token_ids[0]) == 1
    lp = np.asarray(jax.nn.log_softmax(logits[0]))
    np.testing.assert_allclose(float(out.logprobs[0]), lp[1], rtol=1e-6)
    assert list(np.asarray(out.top_ids[0, :4])) == [1, 3, 2, 0]


def draw(logits_row, params, n=4000):
    logits = jnp.tile(jnp.asarray(logits_row, jnp.float32)[None], (n, 1))
    out = sample_jit(logits, inputs([params] * n, seeds=list(range(n))))
    return np.bincount(np.asarray(out.token_ids), minlength=len(logits_row)) / n


def test_temperature_sampling_follows_the_distribution():
    logits = np.log(np.asarray([0.1, 0.2, 0.3, 0.4]))
    freq = draw(logits, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(freq, [0.1, 0.2, 0.3, 0.4], atol=0.03)


def test_top_k_top_p_min_p_filters():
    logits = np.log(np.asarray([0.05, 0.15, 0.3, 0.5]))
    assert draw(logits, SamplingParams(temperature=1.0, top_k=2))[:2].sum() == 0
    freq = draw(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(freq[2:], [0.375, 0.625], atol=0.03)
    # top_p 0.7: 0.5 alone is below 0.7, with 0.3 the mass reaches 0.8: keep {0.5, 0.3}
    freq = draw(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert freq[:2].sum() == 0 and freq[2] > 0.3
    # min_p 0.5: keep tokens with p >= 0.25
    freq = draw(logits, SamplingParams(temperature=1.0, min_p=0.5))
    assert freq[:2].sum() == 0
    # top_k = 1 is greedy whatever the temperature
    assert draw(logits, SamplingParams(temperature=5.0, top_k=1))[3] == 1.0


def test_same_seed_same_token_whatever_the_neighbours():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 50)).astype(np.float32)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(6)]
    full = np.asarray(sample_jit(jnp.asarray(logits), inputs(params, seeds=list(range(6)))).token_ids)
    for i in range(6):
        alone = sample_jit(jnp.asarray(logits[i:i + 1]), inputs([params[i]], seeds=[i])).token_ids
        assert int(alone[0]) == full[i]


def test_penalties():
    logits = jnp.asarray([[2.0, 1.9, -1.0, 0.0]])
    # token 0 seen in the prompt: repetition penalty 2 halves its logit -> token 1 wins
    out = sample_jit(logits, inputs([SamplingParams(repetition_penalty=2.0)], prompts=[[0]]))
    assert int(out.token_ids[0]) == 1
    # presence/frequency penalties only count output tokens
    out = sample_jit(logits, inputs([SamplingParams(presence_penalty=0.5)], prompts=[[0]]))
    assert int(out.token_ids[0]) == 0
    out = sample_jit(logits, inputs([SamplingParams(presence_penalty=0.5)], outputs=[[0]]))
    assert int(out.token_ids[0]) == 1
    out = sample_jit(logits, inputs([SamplingParams(frequency_penalty=0.06)], outputs=[[0, 0]]))
    assert int(out.token_ids[0]) == 1  # 2.0 - 2 * 0.06 = 1.88 < 1.9


def test_logit_bias_moves_the_logits_it_names_in_its_own_row_only():
    """OpenAI's logit_bias: each bias is added to its token's logit before anything else (greedy and
    random rows alike, neighbours untouched), -100 bans a token, +100 all but forces it, and the
    logprobs stay the model's own."""
    logits = jnp.asarray([[2.0, 1.9, -1.0, 0.0]] * 4)
    params = [SamplingParams(logit_bias={0: -0.2}, logprobs=2),  # 2.0 - 0.2 = 1.8 < 1.9: token 1
              SamplingParams(logit_bias={0: -0.05}),  # 1.95 > 1.9: still token 0
              SamplingParams(),  # a neighbour without a bias
              SamplingParams(logit_bias=((2, 100.0), (0, -100.0)))]
    out = sample_jit(logits, inputs(params))
    assert list(np.asarray(out.token_ids)) == [1, 0, 0, 2]
    np.testing.assert_allclose(float(out.logprobs[0]), np.asarray(jax.nn.log_softmax(logits[0]))[1], rtol=1e-6)
    # Random rows: the distribution is that of the biased logits (here ln 3 on token 0 of uniform ones).
    freq = draw(np.zeros(4), SamplingParams(temperature=1.0, logit_bias={0: float(np.log(3.0))}))
    np.testing.assert_allclose(freq, [0.5, 1 / 6, 1 / 6, 1 / 6], atol=0.03)
    assert draw(np.zeros(4), SamplingParams(temperature=1.0, logit_bias={1: -100, 3: -100}))[[1, 3]].sum() == 0
    # A structured row's mask still holds: a bias cannot bring back a token its grammar forbids.
    biased = inputs([SamplingParams(logit_bias={1: 100})], vocab=4)
    biased.allowed[0, 0] = 0b1101  # token 1 not allowed
    assert int(sample_jit(logits[:1], biased).token_ids[0]) == 0


def test_logit_bias_is_checked():
    import pytest

    from jaxcb.host.errors import InvalidRequest
    from jaxcb.host.request import check_tokens

    assert SamplingParams(logit_bias={9: 1, 3: -2.5}).logit_bias == ((3, -2.5), (9, 1.0))
    for bias, message in (({5: 100.5}, "logit_bias[5]: must be <= 100.0"), ({5: float("nan")}, "logit_bias[5]: must be a finite"),
                          ({-1: 1}, "logit_bias: -1 is not a token id"), ({"5": 1}, "logit_bias: '5' is not a token id"),
                          ({i: 1 for i in range(301)}, "logit_bias: at most 300 token ids, got 301"),
                          ([(5, 1), (5, 2)], "logit_bias: token id 5 is given twice"), (5, "logit_bias: must map")):
        with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("(", r"\(")):
            SamplingParams(logit_bias=bias)
    with pytest.raises(InvalidRequest, match=r"logit_bias: token id 50 is outside the vocabulary \[0, 50\)"):
        check_tokens([1, 2], SamplingParams(logit_bias={50: 1}), 64, 50)


def test_the_allowed_mask_limits_greedy_and_random_rows_and_leaves_free_rows_alone():
    rng = np.random.default_rng(1)
    v = 70  # not a multiple of 32: the last word is partly past the vocabulary
    logits = jnp.asarray(rng.standard_normal((3, v)).astype(np.float32))
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams()]
    s = inputs(params, vocab=v)
    assert s.allowed.shape == (3, 3) and (s.allowed == -1).all()
    allowed_ids = [[5, 40, 69], [1, 2, 66]]
    for row, ids in enumerate(allowed_ids):
        s.allowed[row] = 0
        for t in ids:
            s.allowed[row, t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-2**31)
    raw = np.asarray(logits)
    for seed in range(20):
        s.seed[1, 1] = seed
        out = np.asarray(sample_jit(logits, s).token_ids)
        assert out[0] == max(allowed_ids[0], key=lambda t: raw[0, t])  # greedy: the best allowed token
        assert out[1] in allowed_ids[1]
        assert out[2] == raw[2].argmax()  # a free row in the same batch: untouched


def test_the_inverse_cdf_draw_gives_each_token_its_share_and_never_an_impossible_one():
    """N evenly spaced uniform numbers must land on each token about N x its probability times (within
    one either side: each token owns an interval of the cumulative distribution); the ends of [0, 1)
    give the first and the last possible token, never one masked to -inf."""
    from jaxcb.device.sampling import inverse_cdf_draw

    rng = np.random.default_rng(3)
    v, n = 3001, 20_000
    logits = rng.standard_normal(v).astype(np.float32) * 2
    logits[rng.random(v) < 0.3] = -np.inf
    logits[:5] = logits[-7:] = -np.inf  # impossible tokens at both ends of the vocabulary
    u = (np.arange(n, dtype=np.float64) + 0.5) / n
    drawn = np.asarray(jax.jit(inverse_cdf_draw)(jnp.asarray(u, jnp.float32),
                                                jnp.asarray(np.tile(logits, (n, 1)))))
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    counts = np.bincount(drawn, minlength=v)
    assert counts[~np.isfinite(logits)].sum() == 0
    assert np.abs(counts - n * p).max() <= 1.5
    possible = np.flatnonzero(np.isfinite(logits))
    # u = 1 stands for a product u x total that rounded up onto the total: still the last possible token.
    ends = np.asarray(inverse_cdf_draw(jnp.asarray([0.0, np.nextafter(np.float32(1), np.float32(0)), 1.0], jnp.float32),
                                       jnp.asarray(np.tile(logits, (3, 1)))))
    assert list(ends) == [possible[0], possible[-1], possible[-1]]
    one = np.full((1, v), -np.inf, np.float32)
    one[0, 1234] = 0.0
    assert int(inverse_cdf_draw(jnp.asarray([0.999], jnp.float32), jnp.asarray(one))[0]) == 1234
    nothing = np.stack([np.full(v, -np.inf, np.float32), np.full(v, np.nan, np.float32)])  # no possible token
    assert list(np.asarray(inverse_cdf_draw(jnp.asarray([0.5, 0.5], jnp.float32), jnp.asarray(nothing)))) == [0, 0]


def test_logprobs_and_filters_on_a_real_sized_vocabulary():
    """The sampler's own top-k and sort on a vocabulary of SmolLM2's size: the top logprobs are those of
    a full sort, and top-k = 1 at any temperature is the greedy token."""
    rng = np.random.default_rng(4)
    v = 49_152
    logits = jnp.asarray(rng.standard_normal((3, v)).astype(np.float32) * 3)
    out = sample_jit(logits, inputs([SamplingParams(logprobs=20), SamplingParams(temperature=2.0, top_k=1, seed=1),
                                     SamplingParams(temperature=1.0, top_p=0.5, seed=2)], vocab=v))
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    order = np.argsort(-lp[0], kind="stable")[:20]
    np.testing.assert_array_equal(np.asarray(out.top_ids[0]), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs[0]), lp[0, order], rtol=1e-6)
    assert int(out.token_ids[1]) == int(np.argmax(lp[1]))
    # top_p 0.5: the drawn token lies in the smallest set of best tokens holding half the mass
    probs = np.exp(lp[2].astype(np.float64))
    ranked = np.argsort(-probs)
    nucleus = ranked[:np.searchsorted(np.cumsum(probs[ranked]), 0.5) + 1]
    assert int(out.token_ids[2]) in set(nucleus.tolist())


def _filter_reference(row, top_k, top_p, min_p):
    """vLLM's order on one row in numpy float64: min-p (against the best token's probability) and top-k,
    then top-p over what those kept, renormalised: the kept tokens."""
    order = np.argsort(-row, kind="stable")
    p = np.exp(row[order] - row.max())
    p /= p.sum()
    keep = (np.arange(len(row)) < (top_k or len(row))) & (p >= min_p * p[0])
    kept = np.where(keep, p, 0) / p[keep].sum()
    keep &= np.cumsum(kept) - kept < top_p
    keep[0] = True
    return set(np.flatnonzero(row >= row[order][keep].min()).tolist())


def test_the_filters_cut_within_the_best_tokens_or_over_the_whole_vocabulary_alike():
    """Rows whose cut lies among their best FILTER_CANDIDATES tokens (peaked) and rows whose cut lies
    further down (flat, or a top-k past the candidates) keep exactly the tokens of the filters' definition,
    alone or in one batch."""
    from jaxcb.device.sampling import FILTER_CANDIDATES, _filter

    rng = np.random.default_rng(5)
    v = 5000
    peaked = rng.standard_normal(v) * 4
    flat = rng.standard_normal(v) * 0.1
    rows = [(peaked, 0, 0.9, 0.0), (peaked, 40, 1.0, 0.0), (peaked, 0, 1.0, 0.05), (flat, 0, 0.9, 0.0),
            (flat, FILTER_CANDIDATES + 100, 1.0, 0.0), (peaked, 0, 0.99, 0.0), (flat, 0, 1.0, 0.5),
            (flat, FILTER_CANDIDATES + 44, 0.05, 0.0),  # top-p over a top-k past the candidates
            # min-p with top-p: top-p over what min-p kept (vLLM's order), its floor within the candidates or past
            (peaked, 0, 0.5, 0.05), (peaked, 30, 0.8, 0.02), (flat, 0, 0.5, 0.9), (flat, 0, 0.3, 0.05),
            (flat, FILTER_CANDIDATES + 100, 0.6, 0.01), (flat, 100, 0.7, 0.1)]
    for batch in ([r] for r in rows), [rows[:3]], [rows]:
        for group in batch:
            logits = np.stack([r[0] for r in group]).astype(np.float32)
            params = [SamplingParams(temperature=1.0, top_k=k, top_p=p, min_p=m) for _, k, p, m in group]
            s = inputs(params, vocab=v)
            needs = jnp.ones(len(group), bool)
            out = np.asarray(jax.jit(_filter)(jnp.asarray(logits), s, needs))
            for i, (row, k, p, m) in enumerate(group):
                assert set(np.flatnonzero(np.isfinite(out[i])).tolist()) == _filter_reference(
                    row.astype(np.float32).astype(np.float64), k, p, m), (i, k, p, m)


def test_the_blocked_argmax_is_jnp_argmax():
    """The greedy token by blocks: the first of equal maxima, NaN above everything, a row of -inf, a
    vocabulary no block size divides."""
    from jaxcb.device.sampling import argmax

    rng = np.random.default_rng(6)
    v = 5003
    x = rng.integers(0, 3, (6, v)).astype(np.float32)  # ties everywhere
    x[1] = rng.standard_normal(v)
    x[2] = -np.inf
    x[3, [17, 4000]] = np.nan
    x[4, -1] = 9.0  # the maximum in the last, partial block
    x[5, [1100, 3000]] = 7.0  # equal maxima in two blocks
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(jnp.asarray(x))), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert list(np.asarray(argmax(jnp.asarray(x)))[2:]) == [0, 17, v - 1, 1100]


def test_processed_logprobs_are_of_the_distribution_each_token_is_drawn_from():
    """logprobs_mode "processed_logprobs" (vLLM's): a sampled row's logprobs are log-softmax of its logits after
    logit_bias, penalties, its temperature and its filters (-9999 where a filter excludes a token); a greedy row's,
    of its biased logits; the tokens are those of the raw mode, whose logprobs are the model's own."""
    import functools

    from jaxcb.device.sampling import FILTERED_LOGPROB

    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((4, 64)).astype(np.float32) * 3)
    params = [SamplingParams(temperature=0.7, top_k=5, logprobs=8), SamplingParams(temperature=1.3, top_p=0.6, logprobs=8),
              SamplingParams(logprobs=8, logit_bias={7: 5.0}), SamplingParams(temperature=1.0, logprobs=8)]
    s = inputs(params, seeds=[1, 2, 3, 4], vocab=64)
    raw = sample_jit(logits, s)
    processed = jax.jit(functools.partial(sample, logprobs_mode="processed_logprobs"))(logits, s)
    assert np.array_equal(np.asarray(raw.token_ids), np.asarray(processed.token_ids))
    x = np.asarray(logits, np.float64)
    np.testing.assert_allclose(np.asarray(raw.logprobs), [jax.nn.log_softmax(x[i])[t] for i, t in
                                                          enumerate(np.asarray(raw.token_ids))], atol=1e-5)
    expected = []
    for i, p in enumerate(params):
        row = x[i].copy()
        if p.logit_bias:
            row[7] += 5.0
        if p.temperature > 0:
            row = row / p.temperature
            order = np.argsort(-row)
            probs = np.exp(row - np.logaddexp.reduce(row))
            keep = order[:p.top_k] if p.top_k else order[:np.searchsorted(np.cumsum(probs[order]), p.top_p) + 1]
            row = np.where(np.isin(np.arange(64), keep), row, -np.inf)
        lp = row - np.logaddexp.reduce(row[np.isfinite(row)])
        expected.append(np.maximum(lp, FILTERED_LOGPROB))
    for i, want in enumerate(expected):
        t = int(processed.token_ids[i])
        assert abs(float(processed.logprobs[i]) - want[t]) < 1e-4, i
        top = np.asarray(processed.top_logprobs[i, :8])
        np.testing.assert_allclose(top, np.sort(want)[::-1][:8], atol=1e-4)
    assert (np.asarray(processed.top_logprobs[0, 5:8]) == FILTERED_LOGPROB).all()  # (top_k 5: the rest excluded)
