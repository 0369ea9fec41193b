"""The paged attention kernel for NVIDIA GPUs (Pallas lowered through Triton).

Grid (K, NB, splits): one program per kv head, query block and split of the sequence's pages. A
program walks its pages a tile of `pages_per_tile` pages at a time: it loads that many page ids from
the page table, gathers those pages of K and V straight from the pool in HBM (one masked gather
each, so pages past the sequence's end are never read) and runs the online-softmax update. Splitting
a long sequence over several programs keeps the GPU's SMs busy when the batch is small; the splits
are merged outside the kernel from their log-sum-exps.

Tiles must be powers of two (Triton): R = BQ * G_pad >= 16 rows, pages_per_tile * S keys, D.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import flash


def _kernel(seq_ref, pos_ref, rows_ref, kv_lens_ref, pages_ref, kv_index_ref, q_ref, k_ref, v_ref,
            out_ref, lse_ref, *, page_size, pages_per_tile, pages_per_split, group_pad, scale, softcap, kv_int8):
    h, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq, pos = seq_ref[j], pos_ref[j]
    window = kv_index_ref[2]
    key_end, first_page, end_page, num_tiles = flash.page_range(
        pos, rows_ref[j], kv_lens_ref[seq], split, page_size, pages_per_split, pages_per_tile, window)

    q = q_ref[...]
    r, d = q.shape
    row_pos = pos + lax.div(lax.broadcasted_iota(jnp.int32, (r, 1), 0), group_pad)
    k_layer, v_layer = kv_index_ref[0], kv_index_ref[1]
    tile_keys = pages_per_tile * page_size
    slot_iota = lax.broadcasted_iota(jnp.int32, (page_size,), 0)
    dim_iota = lax.broadcasted_iota(jnp.int32, (d,), 0)

    def body(i, carry):
        tile_page = first_page + i * pages_per_tile
        in_use = tile_page + lax.broadcasted_iota(jnp.int32, (pages_per_tile,), 0) < end_page
        ids = plgpu.load(pages_ref.at[seq, pl.ds(tile_page, pages_per_tile)], mask=in_use, other=0)
        # Every index an array, broadcast to the tile [pages, S, D]: one gather, masked by page.
        page_ids, slot, dim = ids[:, None, None], slot_iota[None, :, None], dim_iota[None, None, :]
        mask = jnp.broadcast_to(in_use[:, None, None], (pages_per_tile, page_size, d))
        k = plgpu.load(k_ref.at[k_layer, h, page_ids, slot, dim], mask=mask, other=0)
        v = plgpu.load(v_ref.at[v_layer, h, page_ids, slot, dim], mask=mask, other=0)
        if kv_int8:  # each slot's scale: its 4 bytes after the D values, one masked gather a byte
            slot_mask = jnp.broadcast_to(in_use[:, None], (pages_per_tile, page_size))

            def scales(ref, layer):
                b = [plgpu.load(ref.at[layer, h, ids[:, None], slot_iota[None, :], d + c], mask=slot_mask, other=0)
                     for c in range(4)]
                return flash.scales_from_bytes(*b)[:, :, None].astype(q.dtype)

            k = k.astype(q.dtype) * scales(k_ref, k_layer)
            v = v.astype(q.dtype) * scales(v_ref, v_layer)
        k, v = k.reshape(tile_keys, d), v.reshape(tile_keys, d)
        return flash.tile_update(carry, q, k, v, tile_page * page_size, row_pos, key_end, scale, window, softcap)

    out, lse = flash.finish(lax.fori_loop(0, num_tiles, body, flash.init(r, d)))
    out_ref[...] = out.astype(out_ref.dtype)
    lse_ref[...] = lse


def attend_blocks(q, seq, pos, rows, kv_lens, page_indices, kv_index, k_pool, v_pool, *, group_pad,
                  scale, pages_per_tile, num_splits, out_dtype, interpret, softcap=0.0, kv_int8=False):
    """q [K, NB, R, D]; k_pool, v_pool [X, K, P, S, D] (int8 pools, `kv_int8`: [.., D + 4], each slot's
    values then its float32 scale's bytes); page_indices [M, N'] with N' a multiple of
    num_splits * pages_per_tile; kv_index [3]: (key layer, value layer, sliding window or 0).
    Returns out [K, NB, splits, R, D] (out_dtype), lse [.., R, 1] f32."""
    nk, nb, r, d = q.shape
    page_size = k_pool.shape[3]
    pages_per_split = page_indices.shape[1] // num_splits
    kernel = functools.partial(_kernel, page_size=page_size, pages_per_tile=pages_per_tile,
                               pages_per_split=pages_per_split, group_pad=group_pad, scale=scale,
                               softcap=softcap, kv_int8=kv_int8)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(nk, nb, num_splits),
        in_specs=[whole(seq), whole(pos), whole(rows), whole(kv_lens), whole(page_indices),
                  whole(kv_index), pl.BlockSpec((None, None, r, d), lambda h, j, s: (h, j, 0, 0)),
                  whole(k_pool), whole(v_pool)],
        out_specs=[pl.BlockSpec((None, None, None, r, d), lambda h, j, s: (h, j, s, 0, 0)),
                   pl.BlockSpec((None, None, None, r, 1), lambda h, j, s: (h, j, s, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((nk, nb, num_splits, r, d), out_dtype),
                   jax.ShapeDtypeStruct((nk, nb, num_splits, r, 1), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jaxcb_paged_attention",
    )(seq, pos, rows, kv_lens, page_indices, kv_index, q, k_pool, v_pool)
