"""The paged KV cache on the device, and the plain-JAX paged attention over it.

Layout. All layers share one preallocated array

    kv_pages: [L, 2, K, P, S, D]   (layer, key/value, kv head, page, slot in page, head dim)

so that `kv_pages[l, 0]` is layer l's key pool `[K, P, S, D]`, the layout the Pallas kernels take.
A token at position t of a sequence with page table `pages` lives in page `pages[t // S]`, slot
`t % S`; its flat slot index is `page * S + t % S`.

Page 0 is the null page: it is never handed to a request. Padded tokens write their K/V into it and
padded page-table entries point at it, so padding never touches a real page and the step needs no
branch for it. Whatever page 0 holds is masked out by the lengths.

`paged_attention_reference` is the oracle that the Pallas kernels are tested against, and the
attention used on the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NULL_PAGE = 0
_MASKED = -1e30  # finite, so an all-masked padding row gives zeros instead of NaN


def allocate_kv_pages(num_layers, num_kv_heads, num_pages, page_size, head_dim, dtype) -> jax.Array:
    """kv_pages [L, 2, K, P, S, D], zero-filled; page 0 is the null page."""
    return jnp.zeros((num_layers, 2, num_kv_heads, num_pages, page_size, head_dim), dtype)


def write_kv(kv_pages: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array, slot_ids: jax.Array) -> jax.Array:
    """Scatter new keys and values of one layer into the pool, in place when the pool is donated.

    kv_pages [L, 2, K, P, S, D]; layer a scalar; k, v [N, K, D] for N tokens; slot_ids [N] flat slot
    indices (padding tokens point into the null page). One scatter on the whole pool: slicing the layer
    out first would copy that layer's pages every step.
    """
    l, two, nk, p, s, d = kv_pages.shape
    flat = kv_pages.reshape(l, two, nk, p * s, d)
    kv = jnp.stack([k, v], axis=1).astype(kv_pages.dtype)  # [N, 2, K, D], the indexed layout
    if slot_ids.shape[0] == 1:
        # XLA on the CPU turns a one-index scatter into a dynamic-update-slice that it then performs on
        # a copy of the whole pool (seconds per step for a large pool). A second write, into the null
        # page, keeps it a scatter, which is done in place.
        slot_ids = jnp.concatenate([slot_ids, jnp.zeros((1,), slot_ids.dtype)])
        kv = jnp.concatenate([kv, jnp.zeros_like(kv)])
    flat = flat.at[layer, :, :, slot_ids].set(kv, mode="promise_in_bounds")
    return flat.reshape(kv_pages.shape)


def gather_kv(kv_pages: jax.Array, layer: jax.Array, page_table: jax.Array):
    """Keys and values of each sequence's pages, [B, K, N*S, D] each, in one gather of whole pages.

    The gather indexes (key/value, kv head, page) together so its output already has the [B, K, C, D]
    layout the attention matmuls take, with no transpose of the gathered pages afterwards. Whole pages
    (S*D contiguous values) are copied, never single tokens.
    """
    l, two, nk, p, s, d = kv_pages.shape
    b, n = page_table.shape
    rows = kv_pages.reshape(l, two * nk * p, s * d)
    index = (jnp.arange(two, dtype=page_table.dtype)[:, None, None, None] * (nk * p)
             + jnp.arange(nk, dtype=page_table.dtype)[None, None, :, None] * p
             + page_table[None, :, None, :])  # [2, B, K, N]
    kv = rows[layer][index].reshape(two, b, nk, n * s, d)
    return kv[0], kv[1]


def attend(q, k, v, kv_lens, q_positions, scale=None, mask_values=True):
    """Causal attention over gathered keys and values.

    q [B, T, H, D]; k, v [B, K, C, D] (C = N*S context slots); kv_lens [B]; q_positions [B, T].
    A query at position t sees keys 0..t that are below kv_len. Returns [B, T, H, D].
    `mask_values` zeroes values past kv_len, so that whatever unused slots hold (even NaN) cannot
    leak through a zero softmax weight; the engine's pages only ever hold finite values, so its step
    skips that extra pass.
    """
    b, t, h, d = q.shape
    nk, c = k.shape[1], k.shape[2]
    g = h // nk
    scale = (1.0 / d**0.5) if scale is None else scale
    key_pos = jnp.arange(c, dtype=jnp.int32)
    valid_key = key_pos[None, :] < kv_lens[:, None]  # [B, C]
    if mask_values:
        v = jnp.where(valid_key[:, None, :, None], v, jnp.zeros((), v.dtype))
    qg = q.reshape(b, t, nk, g, d)
    # Scores as [B, K, C, T, G]: with the context dim leading, this is one plain matmul per (b, k)
    # over the gathered keys; measured 10-15% faster in the whole CPU step than [.., T, G, C].
    scores = jnp.einsum("bkcd,btkgd->bkctg", k, qg, preferred_element_type=jnp.float32) * scale
    mask = valid_key[:, :, None] & (key_pos[None, :, None] <= q_positions[:, None, :])  # [B, C, T]
    mask = mask[:, None, :, :, None]
    scores = jnp.where(mask, scores, _MASKED)
    probs = jnp.where(mask, jax.nn.softmax(scores, axis=2), 0.0)
    out = jnp.einsum("bkctg,bkcd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def paged_attention_reference(q, k_pages, v_pages, page_table, kv_lens, q_positions, scale=None):
    """Causal attention of new queries over the paged keys and values of their sequences.

    q [B, T, H, D] queries (T new tokens per sequence, right-padded);
    k_pages, v_pages [K, P, S, D]; page_table int32 [B, N]; kv_lens int32 [B] (tokens of context,
    the new ones included); q_positions int32 [B, T] (each query's position in its sequence).
    Returns [B, T, H, D]; a sequence of length 0 gives zeros.
    """
    pool = jnp.stack([k_pages, v_pages])[None]  # [1, 2, K, P, S, D]
    k, v = gather_kv(pool, jnp.int32(0), page_table)
    return attend(q, k, v, kv_lens, q_positions, scale, mask_values=True)
