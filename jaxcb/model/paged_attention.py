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

from kernels_pallas.flash import first_seen  # (the mask's one definition, the kernels' too)

NULL_PAGE = 0
_MASKED = -1e30  # finite, so an all-masked padding row gives zeros instead of NaN


SCALE_BYTES = 4  # an int8 page's slot: D int8 values, then its float32 scale as 4 bytes


def kv_slot_width(head_dim: int, dtype) -> int:
    """The last axis of a page array: D, or D + SCALE_BYTES for int8 KV (each token-head's values and
    its scale side by side, so the int8 cache is still one array that splits, donates and pages like
    the float one)."""
    return head_dim + SCALE_BYTES if jnp.dtype(dtype) == jnp.int8 else head_dim


def allocate_kv_pages(num_layers, num_kv_heads, num_pages, page_size, head_dim, dtype) -> jax.Array:
    """kv_pages [L, 2, K, P, S, D] (int8: D + 4, see kv_slot_width), zero-filled; page 0 is the null page."""
    return jnp.zeros((num_layers, 2, num_kv_heads, num_pages, page_size, kv_slot_width(head_dim, dtype)), dtype)


def quantize_kv(x: jax.Array) -> jax.Array:
    """[..., D] float -> [..., D + 4] int8: symmetric, one scale per token and head (max / 127), the
    scale's float32 bytes after the values."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8)
    return jnp.concatenate([q, jax.lax.bitcast_convert_type(scale, jnp.int8).reshape(*x.shape[:-1], SCALE_BYTES)],
                           axis=-1)


def dequantize_kv(slots: jax.Array) -> jax.Array:
    """[..., D + 4] int8 -> [..., D] float32 (float pages: just the cast)."""
    if slots.dtype != jnp.int8:
        return slots.astype(jnp.float32)
    d = slots.shape[-1] - SCALE_BYTES
    scale = jax.lax.bitcast_convert_type(slots[..., d:], jnp.float32)  # [..., 4] int8 -> [...] float32
    return slots[..., :d].astype(jnp.float32) * scale[..., None]


def write_kv(kv_pages: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array, slot_ids: jax.Array) -> jax.Array:
    """Scatter new keys and values of one layer into the pool, in place when the pool is donated.

    kv_pages [L, 2, K, P, S, D]; layer a scalar; k, v [N, K, D] for N tokens; slot_ids [N] flat slot
    indices (padding tokens point into the null page). One scatter on the whole pool: slicing the layer
    out first would copy that layer's pages every step.
    """
    l, two, nk, p, s, d = kv_pages.shape
    flat = kv_pages.reshape(l, two, nk, p * s, d)
    kv = jnp.stack([k, v], axis=1)  # [N, 2, K, D], the indexed layout
    kv = quantize_kv(kv) if kv_pages.dtype == jnp.int8 else kv.astype(kv_pages.dtype)
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
    if kv.dtype == jnp.int8:  # int8 pages: values and their scales, dequantized (dequantize_kv)
        kv = dequantize_kv(kv)
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


def _blocks_for(num_seqs: int) -> int:
    """Pages per loop iteration of the decode attention: larger blocks amortise the loop (measured on
    the CPU: 256 pages a block ran 2x faster than 16 at 32 rows x 512 tokens); at most one partial
    block per layer is wasted, so small steps take small blocks."""
    return int(min(256, max(16, 8 * num_seqs)))


PREFILL_BLOCK_PAGES = 16  # pages (keys) per loop iteration of the prefill attention: a 256-key GEMM


def _denominator(mx, den, sinks, nk, g):
    """The online softmax's denominator [..., K, G] from its running max and sum, with each head's sink
    (sinks [H], or None) as one more term; 1 where no key was seen and there is no sink (the sums are 0).
    A row with no key and a sink: exp(sink - MASKED) is inf and its zero sums stay zero."""
    if sinks is None:
        return jnp.where(den > 0, den, 1.0)
    return den + jnp.exp(sinks.astype(jnp.float32).reshape(nk, g) - mx)


def ragged_attention(q, kv_pages, layer, batch, scale=None, window=0, softcap=0.0, native=False, sinks=None):
    """Causal attention of a packed step over the paged cache, in plain JAX (the CPU path).

    q [T, H, D]; kv_pages [L, 2, K, P, S, D]; layer a scalar; batch a jaxcb.host.batch.StepInput. Returns
    [T, H, D] (padding tokens: zeros). `scale`: of the scores (default 1/sqrt(D)); `window` (may be
    traced; 0 = none): a query at position t sees only keys after t - window, or with window < 0 only
    those of its own chunk of -window keys (Llama 4's chunked attention: from t - t % -window); `softcap` (static; 0 =
    off): scores become softcap * tanh(scores / softcap); `sinks` [H] (None: none): each head's sink logit,
    in the scaled scores' units, joins the softmax's denominator (gpt-oss; no value of its own).

    The cost follows what the context holds, not rows x the longest row. Attention loops over the
    step's page items (one per live page of every sequence) in blocks, with a trip count read from
    the batch, so padding costs nothing; each block gathers its pages straight from the pool, so no
    [rows, context] copy of the cache is ever made (that copy, written and read back, was what made the
    padded formulation slow on the CPU). Two sub-computations:
      - decode tokens (one per sequence): per block, each page's scores against its own sequence's
        query, combined per sequence with an online softmax (segment max / sum over the owners);
      - prefill tokens: every token of the step against blocks of the prefill sequences' pages, as
        two GEMMs per block, masked to the token's own sequence and causally, online softmax.
    `native`: the whole step goes to the native CPU kernel instead (kernels_cpu.ragged_attention: each
    sequence's queries over its own pages only, one pass over each page per block of queries); this
    function stays its oracle.
    """
    t, h, d = q.shape
    nl, two, nk, p, s, width = kv_pages.shape  # width: D, or D + 4 for int8 pages (dequantized as gathered)
    g = h // nk
    m = batch.kv_lens.shape[0]
    qg = (q.astype(jnp.float32) * (1.0 / d**0.5 if scale is None else scale)).reshape(t, nk, g, d)
    if native:
        import kernels_cpu

        return kernels_cpu.ragged_attention(qg.reshape(t, h, d), kv_pages, layer, batch.kv_lens, batch.page_table,
                                            batch.cu_q_lens, batch.num_seqs, window, softcap, sinks).astype(q.dtype)
    cap = (lambda x: softcap * jnp.tanh(x / softcap)) if softcap else (lambda x: x)  # noqa: E731
    window = jnp.asarray(window, jnp.int32)
    pool = kv_pages.reshape(nl * two * nk * p, s, width)
    heads = jnp.arange(nk, dtype=jnp.int32)[:, None] * p
    k_base, v_base = (2 * layer) * nk * p, (2 * layer + 1) * nk * p
    n_decode, n_items = batch.item_bounds[0], batch.item_bounds[1]

    def gather(base, ids):  # [K, B, S, D] straight from the pool (prefill: K-major for its GEMMs)
        return dequantize_kv(pool[base + heads + ids[None, :]])

    def gather_pages(base, ids):  # [B, K, S, D]: decode's per-page dots batch over (page, head) with no transpose
        return dequantize_kv(pool[base + heads.T + ids[:, None]])

    # ---- decode: one query per sequence (its last token), page by page ----
    wb, pb = _blocks_for(m), PREFILL_BLOCK_PAGES
    # Room past the last item for either loop's last block (dynamic_slice would shift a block that overhangs).
    pad = lambda x, v: jnp.concatenate([x, jnp.full((max(wb, pb),), v, x.dtype)])  # noqa: E731
    pages, owner, first = pad(batch.item_pages, NULL_PAGE), pad(batch.item_owner, m), pad(batch.item_start, 0)
    q_last = jnp.concatenate([qg[batch.last_token], jnp.zeros((1, nk, g, d), jnp.float32)])  # [M+1, K, G, D]
    kv_lens = jnp.concatenate([batch.kv_lens, jnp.zeros((1,), batch.kv_lens.dtype)])

    def decode_block(i, carry):
        mx, den, acc = carry  # [M+1, K, G], [M+1, K, G], [M+1, K, G, D]
        off = i * wb
        ids = jax.lax.dynamic_slice(pages, (off,), (wb,))
        own = jax.lax.dynamic_slice(owner, (off,), (wb,))
        own = jnp.where(off + jnp.arange(wb) < n_decode, own, m)  # prefill items and padding: dropped
        pos = jax.lax.dynamic_slice(first, (off,), (wb,))[:, None] + jnp.arange(s)[None, :]  # [B, S]
        kv_len = kv_lens[own][:, None]
        valid = ((pos < kv_len) & (pos >= first_seen(kv_len - 1, window)))[:, None, None, :]  # [B, 1, 1, S]
        scores = cap(jnp.einsum("bksd,bkgd->bkgs", gather_pages(k_base, ids), q_last[own]))
        scores = jnp.where(valid, scores, _MASKED)
        new_mx = jnp.maximum(mx, jax.ops.segment_max(scores.max(-1), own, num_segments=m + 1))
        e = jnp.where(valid, jnp.exp(scores - new_mx[own][..., None]), 0.0)
        keep = jnp.exp(mx - new_mx)
        den = den * keep + jax.ops.segment_sum(e.sum(-1), own, num_segments=m + 1)
        values = jnp.where(valid[:, 0, 0][:, None, :, None], gather_pages(v_base, ids), 0.0)  # unwritten slots: 0
        part = jnp.einsum("bkgs,bksd->bkgd", e, values)
        acc = acc * keep[..., None] + jax.ops.segment_sum(part, own, num_segments=m + 1)
        return new_mx, den, acc

    init = (jnp.full((m + 1, nk, g), _MASKED, jnp.float32), jnp.zeros((m + 1, nk, g), jnp.float32),
            jnp.zeros((m + 1, nk, g, d), jnp.float32))
    mx, den, acc = jax.lax.fori_loop(0, (n_decode + wb - 1) // wb, decode_block, init)
    decoded = acc / _denominator(mx, den, sinks, nk, g)[..., None]  # [M+1, K, G, D]

    # ---- prefill: all tokens against blocks of the prefill sequences' pages ----

    def prefill_block(i, carry):
        mx, den, acc = carry  # [T, K, G], [T, K, G], [T, K, G, D]
        off = n_decode + i * pb
        ids = jax.lax.dynamic_slice(pages, (off,), (pb,))
        own = jnp.where(off + jnp.arange(pb) < n_items, jax.lax.dynamic_slice(owner, (off,), (pb,)), -1)
        pos = jax.lax.dynamic_slice(first, (off,), (pb,))[:, None] + jnp.arange(s)[None, :]  # [B, S]
        own_c, pos_c = jnp.repeat(own, s), pos.reshape(-1)  # [C]
        valid = (own_c[None, :] == batch.seq_ids[:, None]) & (pos_c[None, :] <= batch.positions[:, None])
        valid &= pos_c[None, :] >= first_seen(batch.positions, window)[:, None]
        valid = valid[:, None, None, :]  # [T, 1, 1, C]
        keys = gather(k_base, ids).reshape(nk, pb * s, d)
        scores = jnp.where(valid, cap(jnp.einsum("tkgd,kcd->tkgc", qg, keys)), _MASKED)
        new_mx = jnp.maximum(mx, scores.max(-1))
        e = jnp.where(valid, jnp.exp(scores - new_mx[..., None]), 0.0)
        keep = jnp.exp(mx - new_mx)
        written = (pos < kv_lens[jnp.where(own >= 0, own, m)][:, None]).reshape(-1)  # [C]
        values = jnp.where(written[None, :, None], gather(v_base, ids).reshape(nk, pb * s, d), 0.0)
        acc = acc * keep[..., None] + jnp.einsum("tkgc,kcd->tkgd", e, values)
        return new_mx, den * keep + e.sum(-1), acc

    init = (jnp.full((t, nk, g), _MASKED, jnp.float32), jnp.zeros((t, nk, g), jnp.float32),
            jnp.zeros((t, nk, g, d), jnp.float32))
    pmx, pden, pacc = jax.lax.fori_loop(0, (n_items - n_decode + pb - 1) // pb, prefill_block, init)
    prefilled = pacc / _denominator(pmx, pden, sinks, nk, g)[..., None]  # [T, K, G, D]

    out = jnp.where(batch.dense[:, None, None, None], prefilled, decoded[jnp.minimum(batch.seq_ids, m)])
    return out.reshape(t, h, d).astype(q.dtype)
