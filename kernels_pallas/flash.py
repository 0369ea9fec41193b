"""The online-softmax update that both backends' kernels run on each tile of keys.

Each query row keeps a running maximum m, a running sum l and an unnormalised output acc, all in
float32, so a sequence is attended one tile at a time without ever holding all its scores.
m and l are kept as [R, 1] columns: TPU vector layouts want 2-D values, and the GPU is indifferent.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

MASKED = -1e30  # finite: a row that sees no key keeps m = MASKED and l = 0 instead of NaN


def cdiv(a, b):
    """Ceiling division of non-negative ints with lax.div: jnp's // adds a sign fix-up that Mosaic
    cannot lower without a TPU attached (so kernels could not be lowered for TPU on a CPU machine)."""
    return lax.div(a + b - 1, b)


def page_range(pos, rows, kv_len, split, page_size, pages_per_split, pages_per_tile, window=0):
    """What one program reads: (key_end, first_page, end_page, num_tiles).

    The block's queries see keys below key_end (its last query's position + 1, at most kv_len; 0 for
    a padding block); its split covers table entries [first_page, end_page), walked in num_tiles tiles.
    With a sliding `window` (> 0) or chunks (< 0), pages wholly before the first key the block's first query
    sees (first_seen) are skipped: never read (a sliding layer's table holds the null page there).
    """
    key_end = jnp.where(rows > 0, jnp.minimum(kv_len, pos + rows), 0)
    split_start = split * pages_per_split
    seen_from = lax.div(first_seen(pos, window), page_size)
    first_page = jnp.maximum(split_start, seen_from)
    end_page = jnp.minimum(split_start + pages_per_split, cdiv(key_end, page_size))
    num_tiles = cdiv(jnp.maximum(end_page - first_page, 0), pages_per_tile)
    return key_end, first_page, end_page, num_tiles


def first_seen(pos, window):
    """The first key a query at `pos` sees: after pos - window with a sliding window (window > 0), the first of
    its chunk with chunks of -window keys (window < 0: Llama 4's chunked attention), else 0. Never decreases
    with pos (a block's first query sees from the earliest)."""
    chunk = jnp.maximum(-window, 1)
    return jnp.where(window > 0, jnp.maximum(pos - window + 1, 0),
                     jnp.where(window < 0, pos - lax.rem(jnp.maximum(pos, 0), chunk), 0))


def init(rows: int, head_dim: int):
    return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows, 1), MASKED, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))


def tile_update(carry, q, k, v, first_key, row_pos, key_end, scale, window=0, softcap=0.0):
    """One tile: q [R, D]; k, v [BK, D] for keys at first_key...; row_pos int32 [R, 1]; key_end scalar.

    A key is seen by a row when its position is at most the row's and below key_end (and, with a
    sliding `window` > 0 or chunks, window < 0, from first_seen of the row on). `softcap` (static, 0 = off): scores become
    softcap * tanh(scores / softcap). Keys at or past
    key_end may be pages the sequence never wrote (zeros, or NaN in uninitialised memory): their
    scores are replaced, not multiplied by zero, and their values are zeroed before the product.
    """
    acc, m, l = carry
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale  # [R, BK]
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    bk = k.shape[0]
    key_pos = first_key + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    seen = (key_pos < key_end) & (key_pos <= row_pos)  # [R, BK]
    seen &= key_pos >= first_seen(row_pos, window)
    s = jnp.where(seen, s, MASKED)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(seen, jnp.exp(s - m_new), 0.0)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    key_ok = first_key + lax.broadcasted_iota(jnp.int32, (bk, 1), 0) < key_end  # [BK, 1]
    v = jnp.where(key_ok, v, jnp.zeros((), v.dtype))
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    return acc * alpha + pv, m_new, l


def scales_from_bytes(b0, b1, b2, b3):
    """float32 scales from their four little-endian bytes (int8 arrays of one shape): an int8 page's
    slot holds D values then its scale's bytes (jaxcb.model.paged_attention.quantize_kv)."""
    word = ((b0.astype(jnp.int32) & 255) | ((b1.astype(jnp.int32) & 255) << 8)
            | ((b2.astype(jnp.int32) & 255) << 16) | (b3.astype(jnp.int32) << 24))
    return lax.bitcast_convert_type(word, jnp.float32)


def finish(carry):
    """(output [R, D], log-sum-exp [R, 1]); a row that saw no key gives zeros and lse = MASKED."""
    acc, m, l = carry
    seen_any = l > 0
    out = acc / jnp.where(seen_any, l, 1.0)
    lse = jnp.where(seen_any, m + jnp.log(jnp.where(seen_any, l, 1.0)), MASKED)
    return out, lse
