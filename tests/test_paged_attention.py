"""The plain-JAX paged attention against dense causal attention computed directly in numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxcb.model.llama  # noqa: F401 - registers the packed step's types (StepInput) as pytrees
from jaxcb.model.paged_attention import paged_attention_reference, write_kv


def dense_attention(q, k, v, q_positions, kv_len, sinks=None, window=0):
    """q [T, H, D]; k, v [kv_len, K, D] -> [T, H, D], causal by position; `sinks` [H]: each head's sink logit
    as one more softmax term (with no value); `window` > 0: a query at t sees the keys from t - window + 1 on,
    < 0: those of its chunk of -window positions (from the last multiple of -window at or before t)."""
    t, h, d = q.shape
    g = h // k.shape[1]
    out = np.zeros_like(q)
    for i in range(t):
        n = min(q_positions[i] + 1, kv_len)
        lo = max(0, q_positions[i] - window + 1) if window > 0 else (q_positions[i] // -window) * -window if window else 0
        if n <= lo:
            continue
        for head in range(h):
            kh = k[lo:n, head // g]
            s = kh @ q[i, head] / np.sqrt(d)
            top = s.max() if sinks is None else max(s.max(), sinks[head])
            p = np.exp(s - top)
            p /= p.sum() + (0.0 if sinks is None else np.exp(sinks[head] - top))
            out[i, head] = p @ v[lo:n, head // g]
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


@pytest.mark.parametrize("native,sinks", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["xla", "native", "xla-sinks", "native-sinks"])
@pytest.mark.parametrize("page_size,heads,kv_heads", [(4, 4, 4), (16, 6, 2), (8, 8, 1)])
def test_ragged_attention_matches_dense_on_a_mixed_step(page_size, heads, kv_heads, native, sinks):
    """The engine's CPU attention over a packed step: decode rows at awkward lengths and prefill chunks
    (a whole prompt, one starting mid-page, one starting on a page boundary), padding tokens, pages in
    random order, NaN in every slot nobody wrote; against dense causal attention. `native`: decode
    rows through the C++ kernel (kernels_cpu), which must build on every CPU machine the tests run on.
    `sinks`: each head's sink logit in its softmax's denominator (gpt-oss). Each with no window, a sliding
    window and chunks (Llama 4), both cutting through pages and the prefill chunks."""
    import functools

    import jax

    from jaxcb.host.batch import SeqSpec, StepShape, pack
    from jaxcb.model.paged_attention import ragged_attention

    rng = np.random.default_rng(page_size + heads)
    d, n_max, layers, layer = 8, 7, 2, 1
    head_sinks = rng.standard_normal(heads).astype(np.float32) * 2 if sinks else None
    s = page_size
    # (context before this step, new tokens): decode rows first, then prefill chunks.
    seqs = [(0, 1), (s - 2, 1), (s - 1, 1), (s, 1), (n_max * s - 1, 1), (0, 2 * s + 3), (s + 3, s), (2 * s, 5)]
    num_pages = 1 + sum(-(-(c + n) // s) for c, n in seqs) + 4
    kv = np.full((layers, 2, kv_heads, num_pages, s, d), np.nan, np.float32)
    perm = iter(rng.permutation(np.arange(1, num_pages)))
    specs, qs, seq_kv = [], [], []
    for ctx, n in seqs:
        total = ctx + n
        pages = [int(next(perm)) for _ in range(-(-total // s))]
        k = rng.standard_normal((total, kv_heads, d)).astype(np.float32)
        v = rng.standard_normal((total, kv_heads, d)).astype(np.float32)
        for pos in range(total):  # the step's own tokens are written before attention runs
            kv[layer, 0, :, pages[pos // s], pos % s] = k[pos]
            kv[layer, 1, :, pages[pos // s], pos % s] = v[pos]
        q = rng.standard_normal((n, heads, d)).astype(np.float32)
        specs.append(SeqSpec([0] * n, ctx, pages))
        qs.append(q)
        seq_kv.append((k, v, np.arange(ctx, total), total))
    live = sum(n for _, n in seqs)
    batch = pack(specs, StepShape(tokens=live + 5, seqs=len(seqs) + 2, pages_per_seq=n_max, history=n_max * s), s)
    q = np.zeros((live + 5, heads, d), np.float32)
    q[:live] = np.concatenate(qs)
    batch = jax.tree_util.tree_map(jnp.asarray, batch)
    if native:
        import kernels_cpu

        assert kernels_cpu.available(), kernels_cpu.unavailable_reason()
    attention = jax.jit(functools.partial(ragged_attention, native=native))
    for window in (0, s + 3, -(s + 1)):
        want = [dense_attention(sq, k, v, positions, total, head_sinks, window)
                for sq, (k, v, positions, total) in zip(qs, seq_kv)]
        got = np.asarray(attention(jnp.asarray(q), jnp.asarray(kv), jnp.int32(layer), batch, window=window,
                                   sinks=None if head_sinks is None else jnp.asarray(head_sinks)))
        assert np.isfinite(got).all(), "NaN from unwritten slots reached the output"
        np.testing.assert_allclose(got[:live], np.concatenate(want), rtol=1e-5, atol=1e-5, err_msg=f"window {window}")
        np.testing.assert_array_equal(got[live:], 0)


@pytest.mark.parametrize("native", [False, True], ids=["xla", "native"])
def test_int8_pages_hold_values_and_scales_and_attention_reads_them(native):
    """int8 KV (cache.kv_dtype): write_kv stores each token-head as int8 values and its float32 scale
    side by side; the CPU attention dequantizes what it gathers. Against dense attention over the
    dequantized keys and values, with every slot nobody wrote holding bytes whose scale is NaN."""
    import functools

    import jax

    from jaxcb.host.batch import SeqSpec, StepShape, pack
    from jaxcb.model.paged_attention import dequantize_kv, quantize_kv, ragged_attention

    rng = np.random.default_rng(7)
    s, heads, kv_heads, d, n_max, layers, layer = 16, 6, 2, 8, 7, 2, 1
    x = rng.standard_normal((5, kv_heads, d)).astype(np.float32) * 3
    x[2, 1] = 0  # an all-zero token-head: scale 1, values 0
    q8 = np.asarray(quantize_kv(jnp.asarray(x)))
    assert q8.dtype == np.int8 and q8.shape == (5, kv_heads, d + 4)
    back = np.asarray(dequantize_kv(jnp.asarray(q8)))
    step = np.abs(x).max(-1, keepdims=True) / 127
    assert (np.abs(back - x) <= step / 2 + 1e-6).all() and (back[2, 1] == 0).all()

    seqs = [(0, 1), (s - 1, 1), (3 * s, 1), (0, 2 * s + 3), (s + 3, s)]
    num_pages = 1 + sum(-(-(c + n) // s) for c, n in seqs) + 4
    kv = jnp.full((layers, 2, kv_heads, num_pages, s, d + 4), -1, jnp.int8)  # scale bytes 0xFFFFFFFF: NaN
    perm = iter(rng.permutation(np.arange(1, num_pages)))
    specs, qs, want = [], [], []
    write = jax.jit(write_kv)  # one program per sequence length, not one per operation
    round_trip = jax.jit(lambda a: dequantize_kv(quantize_kv(a)))
    for ctx, n in seqs:
        total = ctx + n
        pages = [int(next(perm)) for _ in range(-(-total // s))]
        k = rng.standard_normal((total, kv_heads, d)).astype(np.float32)
        v = rng.standard_normal((total, kv_heads, d)).astype(np.float32)
        slots = jnp.asarray([pages[p // s] * s + p % s for p in range(total)], jnp.int32)
        kv = write(kv, jnp.int32(layer), jnp.asarray(k), jnp.asarray(v), slots)
        deq = lambda a: np.asarray(round_trip(jnp.asarray(a)))  # noqa: E731
        q = rng.standard_normal((n, heads, d)).astype(np.float32)
        specs.append(SeqSpec([0] * n, ctx, pages))
        qs.append(q)
        want.append(dense_attention(q, deq(k), deq(v), np.arange(ctx, total), total))
    live = sum(n for _, n in seqs)
    batch = pack(specs, StepShape(tokens=live + 3, seqs=len(seqs) + 1, pages_per_seq=n_max, history=n_max * s), s)
    q = np.zeros((live + 3, heads, d), np.float32)
    q[:live] = np.concatenate(qs)
    batch = jax.tree_util.tree_map(jnp.asarray, batch)
    got = np.asarray(jax.jit(functools.partial(ragged_attention, native=native))(jnp.asarray(q), kv, jnp.int32(layer),
                                                                                 batch))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[:live], np.concatenate(want), rtol=1e-5, atol=1e-5)


def plain_and_native(q, kv, layer, batch, **options):
    """The plain-JAX ragged attention and the native kernel's on the same step, as numpy arrays."""
    import functools

    import jax

    from jaxcb.model.paged_attention import ragged_attention

    def run(native):
        attention = jax.jit(functools.partial(ragged_attention, native=native, **options))
        return np.asarray(attention(q, kv, jnp.int32(layer), batch))

    return run(False), run(True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_native_attention_matches_the_plain_jax_path_with_window_and_softcap(dtype):
    """The native kernel against the plain-JAX loops it replaces, on what the unit tests above do not
    cover: a sliding window (keys before t - window skipped) and chunks (Llama 4's: keys before t's chunk
    skipped) for decode rows and for prefill chunks longer than a query block and crossing the window's
    edge, score soft-capping, a custom score scale,
    bfloat16 and int8 pages, 16 query heads per KV head, page size 256 with lengths 1, 255, 256, 257
    and one near the maximum, and padding rows; and each head's sink logit in its softmax (gpt-oss)."""
    import jax

    import kernels_cpu
    from jaxcb.host.batch import SeqSpec, StepShape, pack

    assert kernels_cpu.available(), kernels_cpu.unavailable_reason()
    rng = np.random.default_rng(3)
    s, heads, kv_heads, d, n_max, layers, layer = 256, 32, 2, 16, 4, 3, 2
    lens = [1, 255, 256, 257, n_max * s - 3, 40]  # decode rows: context lengths
    chunks = [(300, 45), (0, 19)]  # prefill chunks: (start, tokens)
    totals = lens + [a + b for a, b in chunks]
    num_pages = 1 + sum(-(-n // s) for n in totals) + 2
    kv = jnp.asarray(rng.standard_normal((layers, 2, kv_heads, num_pages, s, d)), jnp.float32)
    if dtype == "int8":
        from jaxcb.model.paged_attention import quantize_kv

        kv = quantize_kv(kv)
    else:
        kv = kv.astype(dtype)
    perm = iter(rng.permutation(np.arange(1, num_pages)))
    pages = [[int(next(perm)) for _ in range(-(-n // s))] for n in totals]
    specs = [SeqSpec([0], n - 1, pages[i]) for i, n in enumerate(lens)]
    specs += [SeqSpec([0] * b, a, pages[len(lens) + i]) for i, (a, b) in enumerate(chunks)]
    live = len(lens) + sum(b for _, b in chunks)
    batch = pack(specs, StepShape(tokens=live + 3, seqs=len(specs) + 2, pages_per_seq=n_max, history=n_max * s), s)
    batch = jax.tree_util.tree_map(jnp.asarray, batch)
    q = jnp.asarray(rng.standard_normal((live + 3, heads, d)), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(heads) * 2, jnp.float32)
    for window, softcap, scale, sink in [(0, 0.0, None, None), (300, 0.0, 0.1, None), (37, 5.0, None, None),
                                         (37, 0.0, None, sinks), (0, 0.0, 0.1, sinks), (-300, 0.0, None, None),
                                         (-37, 5.0, 0.1, sinks)]:
        want, got = plain_and_native(q, kv, layer, batch, window=window, softcap=softcap, scale=scale, sinks=sink)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"window {window} softcap {softcap}")
        np.testing.assert_array_equal(got[live:], 0)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_native_attention_splits_few_long_decode_rows_and_merges_them_exactly(dtype):
    """One or two long decode rows read enough K/V for the pool's threads to join, but hold fewer blocks
    (a row per KV head) than threads x items: the kernel splits each along its pages into parts with
    their own softmax state and merges them. Against the plain-JAX path, with a window that leaves the
    first parts without keys, soft-capping, each head's sink logit, and pages in runs and scattered."""
    import jax

    import kernels_cpu
    from jaxcb.host.batch import SeqSpec, StepShape, pack
    from jaxcb.model.paged_attention import quantize_kv

    assert kernels_cpu.available(), kernels_cpu.unavailable_reason()
    rng = np.random.default_rng(5)
    s, heads, kv_heads, d, layers = 16, 9, 3, 64, 2
    for lens in ([2000], [2003, 700]):
        n_max = -(-max(lens) // s)
        num_pages = 1 + sum(-(-n // s) for n in lens) + 5
        kv = jnp.asarray(rng.standard_normal((layers, 2, kv_heads, num_pages, s, d)), jnp.float32)
        kv = quantize_kv(kv) if dtype == "int8" else kv
        ids = np.arange(1, num_pages) if len(lens) == 1 else rng.permutation(np.arange(1, num_pages))
        it = iter(ids.tolist())
        specs = [SeqSpec([0], n - 1, [next(it) for _ in range(-(-n // s))]) for n in lens]
        batch = pack(specs, StepShape(tokens=4, seqs=4, pages_per_seq=n_max, history=n_max * s), s)
        batch = jax.tree_util.tree_map(jnp.asarray, batch)
        q = jnp.asarray(rng.standard_normal((4, heads, d)), jnp.float32)
        sinks = jnp.asarray(rng.standard_normal(heads) * 2, jnp.float32)
        for window, softcap, sink in [(0, 0.0, None), (100, 20.0, None), (100, 0.0, sinks), (-100, 0.0, None)]:
            want, got = plain_and_native(q, kv, 1, batch, window=window, softcap=softcap, sinks=sink)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"lens {lens} window {window}")
            np.testing.assert_array_equal(got[len(lens):], 0)


@pytest.mark.parametrize("page_size,heads,kv_heads,d,dtype", [
    (16, 9, 3, 64, "float32"), (16, 9, 3, 64, "int8"), (32, 32, 2, 128, "bfloat16"), (16, 4, 4, 64, "float32")])
def test_native_prefill_blocks_as_small_matrix_products_match_the_plain_jax_path(page_size, heads, kv_heads, d, dtype):
    """Prefill chunks (blocks of several queries) go through the tiled path when the head dim is a
    multiple of 64 and the page size of 16 (AVX-512): query rows in the lanes, 16 slots at a time. Chunks
    of 2, 3, 8, 19 and 40 tokens (whole and partial blocks, rows not filling a vector), starting on and
    off page boundaries, next to decode rows; with a window cutting through pages, soft-capping, sinks."""
    import jax

    import kernels_cpu
    from jaxcb.host.batch import SeqSpec, StepShape, pack
    from jaxcb.model.paged_attention import quantize_kv

    assert kernels_cpu.available(), kernels_cpu.unavailable_reason()
    rng = np.random.default_rng(11)
    s, layers = page_size, 2
    decodes = [5, 70]
    chunks = [(0, 19), (37, 40), (64, 8), (3, 3), (100, 2)]  # (start, tokens)
    totals = decodes + [a + b for a, b in chunks]
    n_max = max(-(-n // s) for n in totals)
    num_pages = 1 + sum(-(-n // s) for n in totals) + 2
    kv = jnp.asarray(rng.standard_normal((layers, 2, kv_heads, num_pages, s, d)), jnp.float32)
    kv = quantize_kv(kv) if dtype == "int8" else kv.astype(dtype)
    it = iter(rng.permutation(np.arange(1, num_pages)).tolist())
    pages = [[next(it) for _ in range(-(-n // s))] for n in totals]
    specs = [SeqSpec([0], n - 1, pages[i]) for i, n in enumerate(decodes)]
    specs += [SeqSpec([0] * b, a, pages[len(decodes) + i]) for i, (a, b) in enumerate(chunks)]
    live = len(decodes) + sum(b for _, b in chunks)
    batch = pack(specs, StepShape(tokens=live + 5, seqs=len(specs) + 1, pages_per_seq=n_max, history=n_max * s), s)
    batch = jax.tree_util.tree_map(jnp.asarray, batch)
    q = jnp.asarray(rng.standard_normal((live + 5, heads, d)), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(heads) * 2, jnp.float32)
    for window, softcap, sink in [(0, 0.0, None), (37, 0.0, None), (50, 5.0, None), (37, 0.0, sinks), (-37, 0.0, None),
                                  (-50, 5.0, sinks)]:
        want, got = plain_and_native(q, kv, 1, batch, window=window, softcap=softcap, sinks=sink)
        np.testing.assert_allclose(got, want, rtol=3e-5, atol=3e-5, err_msg=f"window {window} softcap {softcap}")
        np.testing.assert_array_equal(got[live:], 0)


def test_the_avx2_build_of_the_native_attention_matches_the_plain_jax_path():
    """Without AVX-512 the kernel takes other code (8 lanes in single AVX2 registers); on a CPU that has
    AVX-512 the tests above never reach it, so here they run again against a build with AVX-512 turned
    off (JAXCB_KERNEL_FLAGS, its own cached library), in a process of their own; with them the bfloat16
    matmul's tests (without AVX512_BF16 every row count widens the pair lanes in registers)."""
    import os
    import subprocess
    import sys

    from kernels_cpu import build

    flags = build.cpu_flags()
    if "avx2" not in flags or "avx512f" not in flags:
        pytest.skip("this CPU's own build is the AVX2 path (or not x86), which the tests above run")
    env = {**os.environ, "JAXCB_KERNEL_FLAGS": f"{os.environ.get('JAXCB_KERNEL_FLAGS', '')} -mno-avx512f".strip()}
    matmul = os.path.join(os.path.dirname(__file__), "test_native_matmul.py")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                          "(native and not avx2 and not matmul) or bfloat16", __file__, matmul], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-2000:]
