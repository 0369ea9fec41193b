"""Query blocks: the one shape in which every batch reaches the kernels.

A kernel program attends one *query block*, for one kv head, over (a split of) one sequence's pages.
A block holds up to BQ consecutive new tokens of one sequence with the G query heads that share the
kv head, flattened to R = BQ * G_pad rows (row = token * G_pad + head; G is padded to a power of two
so every tile is one). Per block, three int32 arrays say what it is:

    seq  [NB]  which sequence: a row of the page table and an entry of kv_lens
    pos  [NB]  position in that sequence of the block's first token
    rows [NB]  tokens in the block; 0 for a padding block, which reads nothing and returns zeros

A decode batch is one block per sequence (BQ = 1); a ragged batch and the engine's padded prefill
batch are cut into blocks of BQ tokens per sequence. The cutting and un-cutting are plain JAX around
the kernel: they move the queries and outputs (small), never the pages (large).

Row r of a block sits at position pos + r // G_pad and may see keys at positions <= its own and
below its sequence's kv_len (causal attention; for decode the only query is the last position).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

MIN_ROWS = 16  # tiles of fewer rows do not map onto the GPU's matrix units


class QueryBlocks(NamedTuple):
    q: jax.Array  # [K, NB, R, D], R = BQ * G_pad
    seq: jax.Array  # int32 [NB]
    pos: jax.Array  # int32 [NB]
    rows: jax.Array  # int32 [NB]
    group_pad: int  # G_pad, query heads per kv head after padding


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _split_heads(q, num_kv_heads, group_pad):
    """[..., H, D] -> [..., K, G_pad, D], padding query heads with zeros."""
    *lead, h, d = q.shape
    g = h // num_kv_heads
    q = q.reshape(*lead, num_kv_heads, g, d)
    if group_pad > g:
        q = jnp.pad(q, [(0, 0)] * (len(lead) + 1) + [(0, group_pad - g), (0, 0)])
    return q


def _join_heads(out, num_heads):
    """[..., K, G_pad, D] -> [..., H, D], dropping the padded heads."""
    *lead, k, _, d = out.shape
    return out[..., : num_heads // k, :].reshape(*lead, num_heads, d)


def decode_blocks(q: jax.Array, lengths: jax.Array, num_kv_heads: int) -> QueryBlocks:
    """q [B, H, D], one query per sequence at its last position; lengths [B]."""
    b, h, d = q.shape
    group_pad = max(MIN_ROWS, next_power_of_2(h // num_kv_heads))
    qb = _split_heads(q, num_kv_heads, group_pad).transpose(1, 0, 2, 3)  # [K, B, G_pad, D]
    lengths = lengths.astype(jnp.int32)
    return QueryBlocks(qb, jnp.arange(b, dtype=jnp.int32), lengths - 1, (lengths > 0).astype(jnp.int32),
                       group_pad)


def decode_unblock(out: jax.Array, num_heads: int) -> jax.Array:
    """[K, B, G_pad, D] -> [B, H, D]."""
    return _join_heads(out.transpose(1, 0, 2, 3), num_heads)


def block_tokens(num_heads: int, num_kv_heads: int, tokens_hint: int) -> tuple[int, int]:
    """(BQ, G_pad) for multi-token blocks: at least MIN_ROWS rows, BQ a power of two."""
    group_pad = next_power_of_2(num_heads // num_kv_heads)
    return max(next_power_of_2(tokens_hint), MIN_ROWS // min(group_pad, MIN_ROWS)), group_pad


def padded_blocks(q, kv_lens, q_lens, num_kv_heads, tokens_per_block) -> QueryBlocks:
    """The engine's padded batch: q [B, T, H, D], sequence b's q_lens[b] new tokens first in its row.

    Row b's tokens end at position kv_lens[b] - 1. Blocks are cut along T, so no gather is needed.
    """
    b, t, h, d = q.shape
    bq, group_pad = block_tokens(h, num_kv_heads, min(tokens_per_block, t))  # no longer than the rows
    per_seq = -(-t // bq)
    q = jnp.pad(q, ((0, 0), (0, per_seq * bq - t), (0, 0), (0, 0)))
    qb = _split_heads(q, num_kv_heads, group_pad)  # [B, T', K, G_pad, D]
    qb = qb.reshape(b, per_seq, bq, num_kv_heads, group_pad, d).transpose(3, 0, 1, 2, 4, 5)
    qb = qb.reshape(num_kv_heads, b * per_seq, bq * group_pad, d)
    seq = jnp.repeat(jnp.arange(b, dtype=jnp.int32), per_seq)
    first = jnp.tile(jnp.arange(per_seq, dtype=jnp.int32) * bq, b)
    q_lens = jnp.where(kv_lens > 0, q_lens, 0).astype(jnp.int32)
    pos = (kv_lens - q_lens).astype(jnp.int32)[seq] + first
    rows = jnp.clip(q_lens[seq] - first, 0, bq)
    return QueryBlocks(qb, seq, pos, rows, group_pad)


def padded_unblock(out: jax.Array, batch: int, tokens: int, num_heads: int, group_pad: int) -> jax.Array:
    """[K, B * T'/BQ, BQ * G_pad, D] -> [B, T, H, D]."""
    k, _, _, d = out.shape
    out = out.reshape(k, batch, -1, group_pad, d).transpose(1, 2, 0, 3, 4)[:, :tokens]
    return _join_heads(out, num_heads)


def ragged_unblock(out: jax.Array, where, num_heads: int, group_pad: int) -> jax.Array:
    """[K, NB, BQ * G_pad, D] -> [T, H, D], with `where` from ragged_blocks."""
    k, nb, r, d = out.shape
    tok_block, tok_offset, tok_live = where
    out = out.reshape(k, nb, r // group_pad, group_pad, d).transpose(1, 2, 0, 3, 4)
    out = _join_heads(out[tok_block, tok_offset], num_heads)  # [T, H, D]
    return jnp.where(tok_live[:, None, None], out, jnp.zeros((), out.dtype))


def ragged_blocks(q, kv_lens, cu_q_lens, num_seqs, num_kv_heads, tokens_per_block):
    """q [T, H, D] packed; sequence i owns rows cu_q_lens[i]:cu_q_lens[i+1] for i < num_seqs[0].

    Returns the blocks and, per token, (block, token-in-block) to gather the outputs back. The number
    of blocks is static: each sequence's last block may be partial, so at most cdiv(T, BQ) + M.
    """
    t, h, d = q.shape
    m = kv_lens.shape[0]
    bq, group_pad = block_tokens(h, num_kv_heads, tokens_per_block)
    live = jnp.arange(m) < num_seqs[0]
    starts = cu_q_lens[:-1].astype(jnp.int32)
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0).astype(jnp.int32)
    per_seq = -(-q_lens // bq)
    block_end = jnp.cumsum(per_seq)
    block_start = block_end - per_seq
    nb = -(-t // bq) + m
    j = jnp.arange(nb, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(block_end, j, side="right"), m - 1).astype(jnp.int32)
    first = (j - block_start[seq]) * bq  # first token of the block within its sequence
    rows = jnp.where(j < block_end[-1], jnp.clip(q_lens[seq] - first, 0, bq), 0)
    pos = kv_lens[seq].astype(jnp.int32) - q_lens[seq] + first
    token = jnp.clip(starts[seq][:, None] + first[:, None] + jnp.arange(bq), 0, t - 1)  # [NB, BQ]
    qb = _split_heads(q[token], num_kv_heads, group_pad)  # [NB, BQ, K, G_pad, D]
    qb = qb.transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, nb, bq * group_pad, d)

    # Where each packed token's output lands; tokens past the live sequences point at nothing useful.
    tok = jnp.arange(t, dtype=jnp.int32)
    ends = jnp.where(live, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    tok_seq = jnp.minimum(jnp.searchsorted(ends, tok, side="right"), m - 1)
    offset = tok - starts[tok_seq]
    tok_block = jnp.clip(block_start[tok_seq] + offset // bq, 0, nb - 1)
    tok_live = tok < jnp.where(num_seqs[0] > 0, cu_q_lens[num_seqs[0]], 0)
    return QueryBlocks(qb, seq, pos, rows, group_pad), (tok_block, offset % bq, tok_live)


def combine_splits(out: jax.Array, lse: jax.Array) -> jax.Array:
    """Merge attention over disjoint key ranges: out [..., splits, R, D], lse [..., splits, R, 1]."""
    w = jnp.exp(lse - jnp.max(lse, axis=-3, keepdims=True))  # a split that saw no key has lse = -1e30
    return jnp.sum(out * w, axis=-3) / jnp.sum(w, axis=-3)
