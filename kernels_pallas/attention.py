"""Public entry points: decode, ragged and the engine's padded batches, on GPU or TPU kernels.

Each entry point cuts its queries into blocks (kernels_pallas.blocks), runs the backend's kernel over
the page pool and puts the outputs back in the caller's layout. The pool is passed as
[X, K, P, S, D] with the indices of the key and value layers in it, so that the engine can hand the
kernels its whole cache [L, 2, K, P, S, D] (a free reshape) instead of slicing a layer out (a copy).

Page sizes: powers of two from 8 to 256 (GPU tiles are powers of two; TPU copies whole pages).
Head dims: powers of two, at least 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import blocks as qblocks
from kernels_pallas import gpu, tpu

PAGE_SIZES = (8, 16, 32, 64, 128, 256)
_TILE_KEYS = {"gpu": 128, "tpu": 256}  # keys per tile when the caller does not choose
_GPU_PROGRAMS = 512  # decode splits a sequence until about this many programs run


def default_backend(interpret: bool) -> str:
    """'gpu' or 'tpu' for the platform; on the CPU the GPU kernel in interpret mode."""
    platform = jax.default_backend()
    if platform == "tpu":
        return "tpu"
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    if not interpret:
        raise ValueError(f"no Pallas kernel compiles for platform {platform!r}: pass interpret=True "
                         "or use the plain-JAX reference (attention = 'xla')")
    return "gpu"


def _check(num_heads, num_kv_heads, page_size, head_dim):
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page size {page_size} is not supported by the kernels; supported: {PAGE_SIZES}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head dim {head_dim} must be a power of two >= 16 for the kernels")


def _attend(qb: qblocks.QueryBlocks, k_pool, v_pool, kv_index, kv_lens, page_indices, *, scale,
            backend, interpret, pages_per_tile, num_splits, decode, softcap=0.0, with_lse=False):
    """Runs the kernel over query blocks and merges splits: returns [K, NB, R, D] in q's dtype (`with_lse`:
    and each row's log-sum-exp of its scaled scores [K, NB, R, 1], float32; MASKED where it saw no key)."""
    kv_int8 = k_pool.dtype == jnp.int8  # slots of D values and 4 scale bytes (jaxcb.model.paged_attention)
    nk, nb, _, d = qb.q.shape
    page_size = k_pool.shape[3]
    _check(nk * qb.group_pad, nk, page_size, d)
    backend = backend or default_backend(interpret)
    pages_per_seq = page_indices.shape[1]
    if pages_per_tile is None:
        pages_per_tile = max(1, _TILE_KEYS[backend] // page_size)
    pages_per_tile = min(pages_per_tile, qblocks.next_power_of_2(pages_per_seq))
    num_tiles = -(-pages_per_seq // pages_per_tile)
    if num_splits is None:
        num_splits = 1
        if decode and backend == "gpu":
            num_splits = min(qblocks.next_power_of_2(-(-_GPU_PROGRAMS // (nk * nb))), num_tiles)
    # Pad the table so every split holds whole tiles; the padding entries are never read.
    tiles_per_split = -(-num_tiles // num_splits)
    width = tiles_per_split * num_splits * pages_per_tile
    page_indices = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, width - pages_per_seq)))
    kernel = {"gpu": gpu.attend_blocks, "tpu": tpu.attend_blocks}[backend]
    out, lse = kernel(qb.q, qb.seq, qb.pos, qb.rows, kv_lens.astype(jnp.int32), page_indices,
                      kv_index.astype(jnp.int32), k_pool, v_pool, group_pad=qb.group_pad,
                      scale=(1.0 / d**0.5) if scale is None else scale, pages_per_tile=pages_per_tile,
                      num_splits=num_splits, out_dtype=qb.q.dtype if num_splits == 1 else jnp.float32,
                      interpret=interpret, softcap=softcap, kv_int8=kv_int8)
    if num_splits == 1:
        return (out[:, :, 0], lse[:, :, 0]) if with_lse else out[:, :, 0]
    merged = qblocks.combine_splits(out, lse).astype(qb.q.dtype)
    if not with_lse:
        return merged
    top = jnp.max(lse, axis=2)
    return merged, top + jnp.log(jnp.sum(jnp.exp(lse - top[:, :, None]), axis=2))


_STATIC = ("scale", "interpret", "backend", "pages_per_tile", "num_splits")


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_attention(q, k_pages, v_pages, lengths, page_indices, *, scale=None, interpret=False,
                    backend=None, pages_per_tile=None, num_splits=None):
    """Decode attention: one query per sequence, at its last position.

    q [B, H, D]; k_pages, v_pages [K, P, S, D]; lengths int32 [B] (0 allowed: zeros out);
    page_indices int32 [B, N]. Returns [B, H, D], softmax(scale * q k^T) v over the first lengths[b]
    tokens. `backend` 'gpu' | 'tpu' (default: the platform's); `interpret` runs it on the CPU.
    """
    _check(q.shape[1], k_pages.shape[0], k_pages.shape[2], q.shape[2])
    qb = qblocks.decode_blocks(q, lengths, k_pages.shape[0])
    out = _attend(qb, k_pages[None], v_pages[None], jnp.zeros(3, jnp.int32), lengths, page_indices,
                  scale=scale, backend=backend, interpret=interpret, pages_per_tile=pages_per_tile,
                  num_splits=num_splits, decode=True)
    return qblocks.decode_unblock(out, q.shape[1])


@functools.partial(jax.jit, static_argnames=_STATIC + ("tokens_per_block",))
def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, scale=None,
                           interpret=False, backend=None, pages_per_tile=None, num_splits=None,
                           tokens_per_block=16):
    """Attention for a packed mix of prefill chunks and decode tokens.

    q [T, H, D]: sequence i < num_seqs[0] owns rows cu_q_lens[i]:cu_q_lens[i+1] (cu_q_lens int32
    [M+1]); its keys are the first kv_lens[i] tokens of its pages (page_indices [M, N]), its new
    tokens included, and its queries sit at the last positions, causally masked. Rows past the live
    sequences return zeros. Returns [T, H, D].
    """
    _check(q.shape[1], k_pages.shape[0], k_pages.shape[2], q.shape[2])
    qb, where = qblocks.ragged_blocks(q, kv_lens.astype(jnp.int32), cu_q_lens.astype(jnp.int32),
                                      num_seqs.astype(jnp.int32), k_pages.shape[0], tokens_per_block)
    out = _attend(qb, k_pages[None], v_pages[None], jnp.zeros(3, jnp.int32), kv_lens, page_indices,
                  scale=scale, backend=backend, interpret=interpret, pages_per_tile=pages_per_tile,
                  num_splits=num_splits, decode=False)
    return qblocks.ragged_unblock(out, where, q.shape[1], qb.group_pad)


def engine_attention(q, kv_pages, layer, kv_lens, q_lens, page_table, *, backend=None, interpret=False,
                     tokens_per_block=16):
    """The engine's padded step over its whole cache, without slicing a layer out.

    q [B, T, H, D], row b's q_lens[b] new tokens first; kv_pages [L, 2, K, P, S, D]; layer a scalar;
    kv_lens [B] (new tokens included); page_table [B, N]. Returns [B, T, H, D] (padding rows: zeros
    or any finite value, never read).
    """
    b, t, h, d = q.shape
    nl, _, nk, p, s, width = kv_pages.shape  # width: D, or D + 4 for int8 pages
    pool = kv_pages.reshape(nl * 2, nk, p, s, width)
    kv_index = jnp.stack([2 * layer, 2 * layer + 1, 0]).astype(jnp.int32)
    if t == 1:
        qb = qblocks.decode_blocks(q[:, 0], kv_lens, nk)
        out = _attend(qb, pool, pool, kv_index, kv_lens, page_table, scale=None, backend=backend,
                      interpret=interpret, pages_per_tile=None, num_splits=None, decode=True)
        return qblocks.decode_unblock(out, h)[:, None]
    qb = qblocks.padded_blocks(q, kv_lens.astype(jnp.int32), q_lens, nk, tokens_per_block)
    out = _attend(qb, pool, pool, kv_index, kv_lens, page_table, scale=None, backend=backend,
                  interpret=interpret, pages_per_tile=None, num_splits=None, decode=False)
    return qblocks.padded_unblock(out, b, t, h, qb.group_pad)


def engine_ragged_attention(q, kv_pages, layer, kv_lens, page_table, cu_q_lens, num_seqs, *, backend=None,
                            interpret=False, tokens_per_block=16, scale=None, window=0, softcap=0.0, sinks=None):
    """The engine's packed step (jaxcb.host.batch) over its whole cache, without slicing a layer out.

    q [T, H, D], sequence i's tokens at rows cu_q_lens[i]:cu_q_lens[i+1] (cu_q_lens [M+1], num_seqs
    [1]); kv_pages [L, 2, K, P, S, D] (int8 pages: D + 4, values then scale, dequantized as read);
    layer a scalar; kv_lens [M] (new tokens included); page_table [M, N]. `scale` of the scores (default 1/sqrt(D)); `window` (may be traced; 0 = none): a query at
    t sees keys after t - window only, and pages wholly before its block's window are never read;
    `softcap` (static; 0 = off); `sinks` [H] (None: none): each head's sink logit joins its softmax's
    denominator (gpt-oss), applied to the kernel's output from its log-sum-exp: out * sigmoid(lse - sink).
    Returns [T, H, D] (rows past the live sequences: zeros).
    """
    t, h, d = q.shape
    nl, _, nk, p, s, width = kv_pages.shape  # width: D, or D + 4 for int8 pages
    pool = kv_pages.reshape(nl * 2, nk, p, s, width)
    kv_index = jnp.stack([2 * layer, 2 * layer + 1, jnp.asarray(window, jnp.int32)]).astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    qb, where = qblocks.ragged_blocks(q, kv_lens, cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32), nk,
                                      tokens_per_block)
    out = _attend(qb, pool, pool, kv_index, kv_lens, page_table, scale=scale, backend=backend,
                  interpret=interpret, pages_per_tile=None, num_splits=None, decode=False, softcap=softcap,
                  with_lse=sinks is not None)
    if sinks is None:
        return qblocks.ragged_unblock(out, where, h, qb.group_pad)
    out, lse = out
    out, lse = qblocks.ragged_unblock(out, where, h, qb.group_pad), qblocks.ragged_unblock(lse, where, h, qb.group_pad)
    kept = jax.nn.sigmoid(lse - sinks.astype(jnp.float32)[None, :, None])  # [T, H, 1]: 0 where no key was seen
    return (out.astype(jnp.float32) * kept).astype(out.dtype)
