"""Per-request sampling inside the jitted step.

Every setting is a per-row array, so no value ever triggers a compile. The order follows common
engines: penalties on the raw logits, then temperature, then the top-k / top-p / min-p filters, then
a categorical draw from a key derived from the request's seed and its output position alone (so a
seeded request gives the same tokens whatever else shares its batch). Rows with temperature 0 take
the argmax of the penalised logits. Logprobs are those of the model's own distribution.
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


def _filter(logits, s: SamplingInput):
    """Mask (to -inf) what top-k, top-p and min-p exclude. logits are temperature-scaled."""
    v = logits.shape[-1]
    sorted_logits = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)  # descending
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(v)[None, :]
    k = jnp.where(s.top_k > 0, s.top_k, v)[:, None]
    keep = rank < k
    # top-p over what top-k kept: keep a token while the mass before it is below p.
    kept_probs = jnp.where(keep, probs, 0.0)
    kept_probs = kept_probs / jnp.sum(kept_probs, axis=-1, keepdims=True)
    mass_before = jnp.cumsum(kept_probs, axis=-1) - kept_probs
    keep &= mass_before < s.top_p[:, None]
    keep &= kept_probs >= s.min_p[:, None] * kept_probs[:, :1]
    keep = keep.at[:, 0].set(True)
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _allowed_only(logits, allowed):
    """-inf for every token a row's mask (bit t of word t // 32) does not allow."""
    b, v = logits.shape
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, words, 32]
    return jnp.where(bits.reshape(b, -1)[:, :v] != 0, logits, -jnp.inf)


def _row_key(seed, counter):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), seed[0]), seed[1])
    return jax.random.fold_in(key, counter)


def sample(logits: jax.Array, s: SamplingInput) -> SampleOutput:
    """logits f32 [B, V] -> one token per row.

    Each costly part (penalties, the vocabulary sort of the filters, the random draw, the logprobs'
    top-k) sits behind a `lax.cond` on whether any row needs it, so an all-greedy batch pays only for
    an argmax. Both branches are compiled once; which one runs is data, not shape.
    """
    b, v = logits.shape
    raw = logits = logits.astype(jnp.float32)
    uses_penalty = (s.repetition_penalty != 1.0) | (s.presence_penalty != 0.0) | (s.frequency_penalty != 0.0)
    logits = jax.lax.cond(jnp.any(uses_penalty), _apply_penalties, lambda x, _: x, logits, s)
    # Structured output: only what the row's grammar allows, greedy and random alike.
    logits = jax.lax.cond(jnp.any(s.allowed != -1), _allowed_only, lambda x, _: x, logits, s.allowed)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    sampling = s.temperature > 0
    needs_filter = sampling & ((s.top_k > 0) | (s.top_p < 1.0) | (s.min_p > 0.0))

    def draw(x):
        scaled = x / jnp.maximum(s.temperature, 1e-6)[:, None]
        scaled = jax.lax.cond(jnp.any(needs_filter),
                              lambda y: jnp.where(needs_filter[:, None], _filter(y, s), y),
                              lambda y: y, scaled)
        keys = jax.vmap(_row_key)(s.seed, s.counter)
        drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, scaled).astype(jnp.int32)
        return jnp.where(sampling, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(sampling), draw, lambda x: greedy, logits)

    n = min(NUM_TOP_LOGPROBS, v)

    def logprobs(raw):
        lp = jax.nn.log_softmax(raw, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, n)
        return jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def no_logprobs(raw):
        return jnp.zeros((b,), jnp.float32), jnp.zeros((b, n), jnp.int32), jnp.zeros((b, n), jnp.float32)

    # Logprobs describe the model's own distribution, before penalties and filters.
    chosen, top_ids, top_lp = jax.lax.cond(jnp.any(s.logprobs > 0), logprobs, no_logprobs, raw)
    return SampleOutput(tokens, chosen, top_ids, top_lp)
