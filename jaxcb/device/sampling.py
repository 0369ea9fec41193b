"""Per-request sampling inside the jitted step.

Every setting is a per-row array, so no value ever triggers a compile. The order is vLLM's: penalties
on the raw logits, then temperature, then min-p (against the best token's probability) and top-k, then
top-p over the distribution of what those two kept (renormalised), then
a draw from the filtered distribution at one uniform number whose key derives from the request's seed
and its output position alone (so a seeded request gives the same tokens whatever else shares its
batch). Rows with temperature 0 take the argmax of the penalised logits. Logprobs are those of the
model's own distribution.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxcb.host.batch import SamplingInput
from jaxcb.model.llama import register_pytree

NUM_TOP_LOGPROBS = 20  # returned for every row; the host keeps each request's top-n
register_pytree(SamplingInput)


@flax.struct.dataclass
class SampleOutput:
    token_ids: jax.Array  # i32 [B]
    logprobs: jax.Array  # f32 [B], logprob of the chosen token
    top_ids: jax.Array  # i32 [B, NUM_TOP_LOGPROBS]
    top_logprobs: jax.Array  # f32 [B, NUM_TOP_LOGPROBS]
    ranks: jax.Array  # i32 [B], the chosen token's rank in the model's distribution (1: the most likely)
    # The forward pass's pooled hidden states (embeddings, jaxcb.host.embedding), f32 ([M, E] each sequence's
    # last row, [M, E] the sum over its rows); attached by the runner, fetched only when a step pools
    pooled: tuple | None = None


def _apply_penalties(logits, s: SamplingInput):
    b, v = logits.shape
    valid = s.history_ids >= 0
    ids = jnp.where(valid, s.history_ids, 0)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    seen = jnp.zeros((b, v), jnp.bool_).at[rows, ids].max(valid)
    out_counts = jnp.zeros((b, v), jnp.float32).at[rows, ids].add((valid & s.history_is_output).astype(jnp.float32))
    rp = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - s.frequency_penalty[:, None] * out_counts
    return logits - s.presence_penalty[:, None] * (out_counts > 0)


# XLA:CPU sorts through a comparator call per comparison: a float sort of 32 x 49,152 logits took 260 ms on
# the 2-core Xeon, longer than the whole step it samples for, while its top-k of a few hundred takes 5 ms.
# The filters cut within the best FILTER_CANDIDATES tokens of each row wherever that gives the cut of the
# whole vocabulary, and only a row whose cut lies further down searches for it over the whole vocabulary
# (bisection over the floats' order-preserving int32 keys: 40 ms where sorting those keys took 80); the draw
# takes one uniform number a row, not one a token.
FILTER_CANDIDATES = 256


def _sortable(x):
    """float32 -> int32 with the same order (-0.0 just below +0.0); its own inverse back to the bits."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def _logit(key):
    """The float32 logit of an order-preserving key (`_sortable` back)."""
    return jax.lax.bitcast_convert_type(_sortable(key), jnp.float32)


def _blocks(x, block: int, fill):
    """[B, V] -> [B, ceil(V / block), block], the tail filled with `fill`."""
    b, v = x.shape
    n = -(-v // block)
    return jnp.pad(x, ((0, 0), (0, n * block - v)), constant_values=fill).reshape(b, n, block)


def argmax(x):
    """jnp.argmax over the last axis of [B, V] (the first of equal maxima, NaN the largest), as the maxima
    of blocks of 1,024, then the first block holding the row's maximum, then inside that block: XLA:CPU's
    argmax is one scalar pass (2.4 ms for 32 x 49,152 logits on the 2-core Xeon, against 0.5 ms)."""
    b, v = x.shape
    block = 1024
    if v <= 2 * block:
        return jnp.argmax(x, axis=-1)
    xb = _blocks(x, block, -jnp.inf)  # the tail after every real value, so never first among equals
    at = jnp.argmax(jnp.max(xb, axis=-1), axis=-1)
    return at * block + jnp.argmax(jnp.take_along_axis(xb, at[:, None, None], axis=1)[:, 0], axis=-1)


def inverse_cdf_draw(u, logits):
    """One token a row from softmax(logits) (-inf: never), by inverting the row's cumulative distribution
    at its uniform number u [B] in [0, 1): the block whose running sum first passes u, then the token
    inside that block. Never a token of probability zero, whatever the rounding."""
    b, v = logits.shape
    block = max(8, int(v ** 0.5))
    p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    pb = _blocks(p, block, 0.0)  # [B, N, block]
    sums = jnp.sum(pb, axis=-1)
    ends = jnp.cumsum(sums, axis=-1)
    target = u * ends[:, -1]

    def first_past(running, weights, limit):
        """The first position whose running sum passes `limit` and whose weight is not zero; else the
        last position of non-zero weight (the limit rounded onto the total); position 0 in a row with
        no weight at all (all -inf or NaN logits: token 0, as a categorical draw gave)."""
        n = running.shape[-1]
        pos = jnp.arange(n, dtype=jnp.int32)[None, :]
        past = jnp.min(jnp.where((running > limit[:, None]) & (weights > 0), pos, n), axis=-1)
        last = jnp.max(jnp.where(weights > 0, pos, 0), axis=-1)
        return jnp.where(past < n, past, last)

    at = first_past(ends, sums, target)
    inside = jnp.take_along_axis(pb, at[:, None, None], axis=1)[:, 0]  # [B, block]
    before = jnp.take_along_axis(ends, at[:, None], axis=1)[:, 0] - jnp.take_along_axis(sums, at[:, None], axis=1)[:, 0]
    return at * block + first_past(before[:, None] + jnp.cumsum(inside, axis=-1), inside, target)


def _cut(ranked, log_total, floor_total, s: SamplingInput, v: int):
    """The logit threshold of min-p, top-k and top-p from a row's best logits `ranked` [B, n] (descending;
    n <= v), the log of its softmax denominator over the whole vocabulary and the mass min-p keeps of it
    (`floor_total` [B]); and whether the cut is that of the whole vocabulary (it is when the token after the
    n-th is excluded whatever it is)."""
    n = ranked.shape[-1]
    probs = jnp.exp(ranked - log_total)
    rank = jnp.arange(n)[None, :]
    k = jnp.where(s.top_k > 0, s.top_k, v)
    floor = s.min_p * probs[:, 0]
    keep = (rank < k[:, None]) & (probs >= floor[:, None])
    # top-p over what min-p and top-k kept: keep a token while the mass before it is below p. What they
    # kept lies within the n where top-k stops within them or min-p's floor is passed within them; else
    # top-k keeps past the n, and its mass is min-p's (exact where top-k keeps everything).
    inside = (k <= n) | (probs[:, -1] < floor)
    kept_probs = jnp.where(keep, probs, 0.0)
    kept_total = jnp.where(inside, jnp.sum(kept_probs, axis=-1), floor_total)
    kept_probs = kept_probs / kept_total[:, None]
    mass_before = jnp.cumsum(kept_probs, axis=-1) - kept_probs
    keep &= mass_before < s.top_p[:, None]
    keep = keep.at[:, 0].set(True)
    threshold = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
    # Whole-vocabulary cut: what min-p and top-k keep lies within the n, or top-k keeps everything and
    # top-p's mass is passed within them.
    passed = jnp.sum(kept_probs, axis=-1) >= s.top_p
    return threshold, (n == v) | inside | ((k >= v) & passed)


def _search(pred, lo, hi):
    """The smallest int32 y in [lo, hi] (per row) with pred(y), for pred false below some value and true
    from it on, true at hi: 32 halvings cover any int32 range."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without int32 overflow
        ok = pred(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)
    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def _cut_by_search(logits, log_total, floor_total, s: SamplingInput, v: int):
    """`_cut`'s threshold over the whole vocabulary, without sorting it: each bound by bisection over the
    logits' order-preserving int32 keys (exact: every bound found is one of the row's own logits).
    top-k's bound is the k-th largest logit (the smallest y with fewer than k logits above it); min-p's
    the smallest logit whose probability is at least min_p of the best one's; top-p's the smallest logit
    with less than top_p of the mass those two kept above it. Both keep a top segment of the row, so what
    both keep is the smaller one, of the smaller mass."""
    keys = _sortable(logits)
    probs = jnp.exp(logits - log_total)
    lo, hi = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, v), v)
    above = lambda y: keys > y[:, None]  # noqa: E731
    # (without a top-k in any row, the k-th largest is the smallest: no search)
    k_key = jax.lax.cond(jnp.any(k < v), lambda: _search(lambda y: jnp.sum(above(y), axis=-1) < k, lo, hi),
                         lambda: lo)
    k_logit = _logit(k_key)
    at_k = k - jnp.sum(above(k_key), axis=-1)  # ties at the k-th logit that top-k keeps
    kept_total = jnp.sum(jnp.where(above(k_key), probs, 0.0), axis=-1) + at_k * jnp.exp(k_logit - log_total[:, 0])
    kept_total = jnp.minimum(kept_total, floor_total)
    # (top_p 1 keeps every token top-k kept: no search, and none of its rounding)
    nucleus = s.top_p < 1.0
    p_key = jax.lax.cond(jnp.any(nucleus), lambda: _search(
        lambda y: jnp.sum(jnp.where(above(y), probs, 0.0), axis=-1) < s.top_p * kept_total, lo, hi), lambda: lo)
    p_key = jnp.where(nucleus, p_key, lo)
    floor = s.min_p[:, None] * jnp.exp(jnp.max(logits, axis=-1, keepdims=True) - log_total)
    m_key = jnp.min(jnp.where(probs >= floor, keys, hi[:, None]), axis=-1)
    key = jnp.minimum(jnp.maximum(jnp.maximum(k_key, p_key), m_key), hi)  # the best token always stays
    return _logit(key)[:, None]


def _floor_total(logits, log_total, best, min_p):
    """The mass of a row's tokens whose probability is at least min_p of the best one's (what min-p keeps;
    1 where min_p is 0)."""
    probs = jnp.exp(logits - log_total)
    kept = jnp.sum(jnp.where(probs >= min_p[:, None] * jnp.exp(best - log_total), probs, 0.0), axis=-1)
    return jnp.where(min_p > 0, kept, 1.0)


def _filter(logits, s: SamplingInput, needs_filter):
    """Mask (to -inf) what top-k, top-p and min-p exclude. logits are temperature-scaled. A row whose cut
    its best tokens cannot give takes the searched one (each row its own way, whatever its neighbours)."""
    v = logits.shape[-1]
    log_total = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    best, _ = jax.lax.top_k(logits, min(v, FILTER_CANDIDATES))
    floor_total = jax.lax.cond(jnp.any(s.min_p > 0), _floor_total, lambda *_: jnp.ones_like(s.min_p),
                               logits, log_total, best[:, :1], s.min_p)
    threshold, exact = _cut(best, log_total, floor_total, s, v)
    exact |= ~needs_filter
    threshold = jax.lax.cond(jnp.all(exact), lambda: threshold, lambda: jnp.where(
        exact[:, None], threshold, _cut_by_search(logits, log_total, floor_total, s, v)))
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _biased(logits, s: SamplingInput):
    """Each row's logit_bias added to its tokens' logits (unused slots, id -1, are dropped)."""
    b, v = logits.shape
    ids = jnp.where(s.bias_ids >= 0, s.bias_ids, v)
    return logits.at[jnp.arange(b)[:, None], ids].add(s.bias, mode="drop")


def _allowed_only(logits, allowed):
    """-inf for every token a row's mask (bit t of word t // 32) does not allow."""
    b, v = logits.shape
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, words, 32]
    return jnp.where(bits.reshape(b, -1)[:, :v] != 0, logits, -jnp.inf)


def _uniform(seed, counter):
    """A row's uniform number in [0, 1) from its seed (two words) and output position: one Threefry block
    keyed by the seed over the position (a fold_in), its first word's top 24 bits."""
    bits = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), counter))[0]
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


FILTERED_LOGPROB = -9999.0  # a token the processed distribution excludes (OpenAI's value for one it cannot pick)


def sample(logits: jax.Array, s: SamplingInput, logprobs_mode: str = "raw_logprobs") -> SampleOutput:
    """logits f32 [B, V] -> one token per row.

    Each costly part (penalties, the filters' whole-vocabulary search, the random draw, the logprobs'
    top-k) sits behind a `lax.cond` on whether any row needs it, so an all-greedy batch pays only for
    an argmax. Both branches are compiled once; which one runs is data, not shape. `logprobs_mode`
    (EngineConfig.logprobs_mode): the logprobs of the model's distribution ("raw_logprobs") or of the one each
    token is drawn from ("processed_logprobs": after logit_bias, penalties and the grammar's mask, and for a
    sampled row its temperature and filters; FILTERED_LOGPROB where a token is excluded).
    """
    processed = logprobs_mode == "processed_logprobs"
    b, v = logits.shape
    raw = logits = logits.astype(jnp.float32)
    logits = jax.lax.cond(jnp.any(s.bias_ids >= 0), _biased, lambda x, _: x, logits, s)
    uses_penalty = (s.repetition_penalty != 1.0) | (s.presence_penalty != 0.0) | (s.frequency_penalty != 0.0)
    logits = jax.lax.cond(jnp.any(uses_penalty), _apply_penalties, lambda x, _: x, logits, s)
    # Structured output: only what the row's grammar allows, greedy and random alike.
    logits = jax.lax.cond(jnp.any(s.allowed != -1), _allowed_only, lambda x, _: x, logits, s.allowed)
    greedy = argmax(logits).astype(jnp.int32)

    sampling = s.temperature > 0
    needs_filter = sampling & ((s.top_k > 0) | (s.top_p < 1.0) | (s.min_p > 0.0))

    def draw(x):
        scaled = x / jnp.maximum(s.temperature, 1e-6)[:, None]
        scaled = jax.lax.cond(jnp.any(needs_filter),
                              lambda y: jnp.where(needs_filter[:, None], _filter(y, s, needs_filter), y),
                              lambda y: y, scaled)
        u = jax.vmap(_uniform)(s.seed, s.counter)
        drawn = inverse_cdf_draw(u, scaled).astype(jnp.int32)
        tokens = jnp.where(sampling, drawn, greedy)
        return (tokens, jnp.where(sampling[:, None], scaled, x)) if processed else tokens

    # (processed: with the tokens, what each row's draw saw: its temperature-scaled, filtered logits; a greedy row's
    # processed logits as they are)
    drawn = jax.lax.cond(jnp.any(sampling), draw, lambda x: (greedy, x) if processed else greedy, logits)
    tokens, shaped = drawn if processed else (drawn, raw)

    n = min(NUM_TOP_LOGPROBS, v)

    def logprobs(raw):
        # Each logprob is its logit less the log of the softmax's denominator, and the best logprobs are
        # the best logits': the log-softmax of the whole row is never written out (on the 2-core CPU, 32
        # rows of 49,152 took 6.7 ms that way, 3.5 ms this way).
        log_total = jax.nn.logsumexp(raw, axis=-1, keepdims=True)
        top, top_ids = jax.lax.top_k(raw, n)
        picked = jnp.take_along_axis(raw, tokens[:, None], axis=-1)
        rank = 1 + jnp.sum(raw > picked, axis=-1, dtype=jnp.int32)
        chosen, top = (picked - log_total)[:, 0], top - log_total
        # (what the processed distribution excludes is -inf, and logits a broken model made may be NaN: numbers
        # JSON can write instead)
        chosen, top = (jnp.nan_to_num(x, nan=FILTERED_LOGPROB, neginf=FILTERED_LOGPROB) for x in (chosen, top))
        return chosen, top_ids.astype(jnp.int32), top, rank

    def no_logprobs(raw):
        return (jnp.zeros((b,), jnp.float32), jnp.zeros((b, n), jnp.int32), jnp.zeros((b, n), jnp.float32),
                jnp.zeros((b,), jnp.int32))

    # Logprobs describe the model's own distribution, before logit_bias, penalties and filters (raw), or the
    # one the token was drawn from (processed).
    chosen, top_ids, top_lp, rank = jax.lax.cond(jnp.any(s.logprobs > 0), logprobs, no_logprobs, shaped)
    return SampleOutput(tokens, chosen, top_ids, top_lp, rank)
