"""The plain-JAX paged attention against dense causal attention computed directly in numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.model.paged_attention import paged_attention_reference, write_kv


def dense_attention(q, k, v, q_positions, kv_len):
    """q [T, H, D]; k, v [kv_len, K, D] -> [T, H, D], causal by position."""
    t, h, d = q.shape
    g = h // k.shape[1]
    out = np.zeros_like(q)
    for i in range(t):
        n = min(q_positions[i] + 1, kv_len)
        if n <= 0:
            continue
        for head in range(h):
            kh = k[:n, head // g]
            s = kh @ q[i, head] / np.sqrt(d)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, head] = p @ v[:n, head // g]
    return out


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_matches_dense_on_awkward_lengths(page_size, heads, kv_heads):
    rng = np.random.default_rng(page_size * 10 + heads)
    d, pages_per_seq = 8, 6
    max_len = pages_per_seq * page_size
    lengths = [0, 1, page_size - 1, page_size, page_size + 1, max_len]
    b, num_pages = len(lengths), 1 + len(lengths) * pages_per_seq + 3
    # Pages scattered over the pool in random order; unreferenced pages hold NaN.
    perm = rng.permutation(np.arange(1, num_pages))[: b * pages_per_seq].reshape(b, pages_per_seq)
    k_pages = np.full((kv_heads, num_pages, page_size, d), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    t = 3  # up to 3 new queries per sequence, at its last positions
    q = rng.standard_normal((b, t, heads, d)).astype(np.float32)
    q_pos = np.zeros((b, t), np.int32)
    ks, vs = [], []
    for i, n in enumerate(lengths):
        k = rng.standard_normal((max_len, kv_heads, d)).astype(np.float32)
        v = rng.standard_normal((max_len, kv_heads, d)).astype(np.float32)
        for pos in range(n):  # only the first n tokens are written
            page, slot = perm[i, pos // page_size], pos % page_size
            k_pages[:, page, slot] = k[pos]
            v_pages[:, page, slot] = v[pos]
        ks.append(k)
        vs.append(v)
        q_pos[i] = np.maximum(np.arange(n - t, n), 0)
    got = np.asarray(paged_attention_reference(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages),
                                               jnp.asarray(perm, jnp.int32), jnp.asarray(lengths, jnp.int32),
                                               jnp.asarray(q_pos)))
    assert np.isfinite(got).all(), "NaN from unwritten pages reached the output"
    for i, n in enumerate(lengths):
        want = dense_attention(q[i], ks[i], vs[i], q_pos[i], n)
        if n == 0:
            np.testing.assert_array_equal(got[i], 0)
        else:
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)


def test_write_kv_scatters_into_pages_and_padding_into_the_null_page():
    kv_pages = jnp.zeros((3, 2, 2, 5, 4, 3), jnp.float32)  # [L, 2, K, P, S, D]
    k = jnp.arange(3 * 2 * 3, dtype=jnp.float32).reshape(3, 2, 3) + 1
    v = -k
    slots = jnp.asarray([2 * 4 + 1, 3 * 4 + 0, 0], jnp.int32)  # page 2 slot 1, page 3 slot 0, null page
    out = np.asarray(write_kv(kv_pages, jnp.int32(1), k, v, slots))
    np.testing.assert_array_equal(out[1, 0, :, 2, 1], np.asarray(k[0]))
    np.testing.assert_array_equal(out[1, 1, :, 3, 0], np.asarray(v[1]))
    touched = np.zeros(out.shape[3:5], bool)
    touched[2, 1] = touched[3, 0] = touched[0, 0] = True
    assert not np.any(out[1][:, :, ~touched])
    assert not np.any(out[0]) and not np.any(out[2])  # other layers untouched


@pytest.mark.parametrize("tokens", [1, 8])
def test_donated_kv_write_updates_the_pool_in_place(tokens):
    """The KV write is a scatter into the donated pool: XLA aliases the output onto the input and
    needs no temporary anywhere near the pool's size (a copy would need all of it)."""
    import jax

    pool = jax.ShapeDtypeStruct((2, 2, 2, 512, 16, 64), jnp.float32)  # 16 MiB
    k = jax.ShapeDtypeStruct((tokens, 2, 64), jnp.float32)
    slots = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    donated = jax.jit(write_kv, donate_argnums=0).lower(pool, jnp.int32(1), k, k, slots).compile()
    memory = donated.memory_analysis()
    pool_bytes = 2 * 2 * 2 * 512 * 16 * 64 * 4
    assert memory.alias_size_in_bytes == pool_bytes
    assert memory.temp_size_in_bytes < pool_bytes // 100
