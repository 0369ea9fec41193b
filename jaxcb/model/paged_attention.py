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


def write_kv(kv_layer: jax.Array, k: jax.Array, v: jax.Array, slot_ids: jax.Array) -> jax.Array:
    """Scatter new keys and values into one layer's pages.

    kv_layer [2, K, P, S, D]; k, v [N, K, D] for N tokens; slot_ids [N] flat slot indices
    (padding tokens point into the null page). Returns the updated layer; under jit with the pages
    donated, XLA does this in place.
    """
    two, nk, p, s, d = kv_layer.shape
    flat = kv_layer.reshape(two, nk, p * s, d)
    kv = jnp.stack([k, v]).astype(kv_layer.dtype).transpose(0, 2, 1, 3)  # [2, K, N, D]
    flat = flat.at[:, :, slot_ids].set(kv, mode="promise_in_bounds", unique_indices=False)
    return flat.reshape(kv_layer.shape)


def paged_attention_reference(q, k_pages, v_pages, page_table, kv_lens, q_positions, scale=None):
    """Causal attention of new queries over the paged keys and values of their sequences.

    q [B, T, H, D] queries (T new tokens per sequence, right-padded);
    k_pages, v_pages [K, P, S, D]; page_table int32 [B, N]; kv_lens int32 [B] (tokens of context,
    the new ones included); q_positions int32 [B, T] (each query's position in its sequence).
    A query at position t sees keys 0..t that are below kv_len. Returns [B, T, H, D].
    """
    b, t, h, d = q.shape
    nk, _, s, _ = k_pages.shape
    g = h // nk
    n = page_table.shape[1]
    scale = (1.0 / d**0.5) if scale is None else scale
    k = k_pages[:, page_table].reshape(nk, b, n * s, d)  # [K, B, N*S, D]
    v = v_pages[:, page_table].reshape(nk, b, n * s, d)
    key_pos = jnp.arange(n * s, dtype=jnp.int32)
    valid_key = key_pos[None, :] < kv_lens[:, None]  # [B, N*S]
    # Unwritten or foreign page contents (even NaN) must not leak through a zero softmax weight.
    v = jnp.where(valid_key[None, :, :, None], v, jnp.zeros((), v.dtype))
    qg = q.reshape(b, t, nk, g, d)
    scores = jnp.einsum("btkgd,kbsd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = valid_key[:, None, :] & (key_pos[None, None, :] <= q_positions[:, :, None])  # [B, T, N*S]
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask[:, None, None], probs, 0.0)
    out = jnp.einsum("bkgts,kbsd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)
