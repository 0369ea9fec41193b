"""The paged attention kernel for TPUs (Pallas lowered through Mosaic).

Grid (K, NB, splits), every dimension parallel, so a megacore chip shares the programs between its
two cores. The page table, lengths and block metadata are scalar-prefetched into SMEM; the pools
stay in HBM (memory space ANY) and each program copies its pages into VMEM itself, one DMA per
page into a tile of `pages_per_tile` pages, with two tile buffers: while the kernel computes on one
tile, the DMAs of the next are in flight. Only pages below the sequence's end are ever copied; the
rest of a tile's buffer is masked by position (it may hold anything, NaN included).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import flash


def _kernel(seq_ref, pos_ref, rows_ref, kv_lens_ref, pages_ref, kv_index_ref,  # scalar prefetch
            q_ref, k_hbm, v_hbm, out_ref, lse_ref, k_buf, v_buf, sems,
            *, page_size, pages_per_tile, pages_per_split, pages_per_seq, group_pad, scale, softcap, kv_int8):
    h, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq, pos = seq_ref[j], pos_ref[j]
    window = kv_index_ref[2]
    key_end, first_page, end_page, num_tiles = flash.page_range(
        pos, rows_ref[j], kv_lens_ref[seq], split, page_size, pages_per_split, pages_per_tile, window)
    k_layer, v_layer = kv_index_ref[0], kv_index_ref[1]

    def copies(tile, slot, page_in_tile):
        page = pages_ref[seq * pages_per_seq + first_page + tile * pages_per_tile + page_in_tile]
        dst = pl.ds(page_in_tile * page_size, page_size)
        return (pltpu.make_async_copy(k_hbm.at[k_layer, h, page], k_buf.at[slot, dst], sems.at[0, slot]),
                pltpu.make_async_copy(v_hbm.at[v_layer, h, page], v_buf.at[slot, dst], sems.at[1, slot]))

    def for_each_page(tile, slot, action):
        for p in range(pages_per_tile):
            @pl.when(first_page + tile * pages_per_tile + p < end_page)
            def _():
                for c in copies(tile, slot, p):
                    action(c)

    @pl.when(num_tiles > 0)
    def _():
        for_each_page(0, 0, lambda c: c.start())

    q = q_ref[...]
    r, _ = q.shape
    row_pos = pos + lax.div(lax.broadcasted_iota(jnp.int32, (r, 1), 0), group_pad)

    def body(tile, carry):
        slot = lax.rem(tile, 2)

        @pl.when(tile + 1 < num_tiles)
        def _():
            for_each_page(tile + 1, 1 - slot, lambda c: c.start())

        for_each_page(tile, slot, lambda c: c.wait())
        first_key = (first_page + tile * pages_per_tile) * page_size
        if kv_int8:  # [keys, D + 4]: the values, then each slot's float32 scale as 4 bytes
            d = q.shape[-1]

            def dequantized(buf):
                scale_ = flash.scales_from_bytes(*(buf[slot, :, pl.ds(d + c, 1)] for c in range(4)))
                return buf[slot, :, pl.ds(0, d)].astype(q.dtype) * scale_.astype(q.dtype)

            k, v = dequantized(k_buf), dequantized(v_buf)
        else:
            k, v = k_buf[slot], v_buf[slot]
        return flash.tile_update(carry, q, k, v, first_key, row_pos, key_end, scale, window, softcap)

    out, lse = flash.finish(lax.fori_loop(0, num_tiles, body, flash.init(*q.shape)))
    out_ref[...] = out.astype(out_ref.dtype)
    lse_ref[...] = lse


def attend_blocks(q, seq, pos, rows, kv_lens, page_indices, kv_index, k_pool, v_pool, *, group_pad,
                  scale, pages_per_tile, num_splits, out_dtype, interpret, softcap=0.0, kv_int8=False):
    """Same contract as kernels_pallas.gpu.attend_blocks."""
    nk, nb, r, d = q.shape
    page_size = k_pool.shape[3]
    num_seqs, pages_per_seq = page_indices.shape
    kernel = functools.partial(_kernel, page_size=page_size, pages_per_tile=pages_per_tile,
                               pages_per_split=pages_per_seq // num_splits, pages_per_seq=pages_per_seq,
                               group_pad=group_pad, scale=scale, softcap=softcap, kv_int8=kv_int8)
    tile = (2, pages_per_tile * page_size, k_pool.shape[-1])  # whole slots: int8 ones hold their scale too
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(nk, nb, num_splits),
        in_specs=[pl.BlockSpec((None, None, r, d), lambda h, j, s, *_: (h, j, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((None, None, None, r, d), lambda h, j, s, *_: (h, j, s, 0, 0)),
                   pl.BlockSpec((None, None, None, r, 1), lambda h, j, s, *_: (h, j, s, 0, 0))],
        scratch_shapes=[pltpu.VMEM(tile, k_pool.dtype), pltpu.VMEM(tile, v_pool.dtype),
                        pltpu.SemaphoreType.DMA((2, 2))],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((nk, nb, num_splits, r, d), out_dtype),
                   jax.ShapeDtypeStruct((nk, nb, num_splits, r, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="jaxcb_paged_attention",
    )(seq, pos, rows, kv_lens, page_indices.reshape(-1), kv_index, q, k_pool, v_pool)
