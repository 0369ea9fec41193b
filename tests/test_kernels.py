"""Pallas kernels (GPU and TPU variants, interpret mode on the CPU) against the plain-JAX reference.

Every case draws fresh random inputs: a shared pool whose pages are handed out in random order,
page-table entries past each sequence's end pointing at pages nobody owns, and every page that no
sequence owns filled with NaN, which must not reach any output.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxcb.device.runner import COMPILER_OPTIONS
from jaxcb.model.paged_attention import paged_attention_reference
from kernels_pallas import (PAGE_SIZES, engine_attention, engine_ragged_attention, paged_attention,
                            ragged_paged_attention)

# (page size S, head dim D, query heads per kv head, dtype): each S and each D with two ratios, each
# ratio with two S and both D, and each S, D and ratio in both dtypes: 8 cases rather than the full
# product (interpret mode is slow; the dtype changes the kernels' casts, not their indexing).
CASES = [pytest.param(*shape, dtype, id=f"{'-'.join(map(str, shape))}-{name}")
         for shape, dtype, name in [((16, 64, 1), jnp.float32, "f32"), ((16, 128, 3), jnp.bfloat16, "bf16"),
                                    ((32, 64, 8), jnp.float32, "f32"), ((32, 64, 8), jnp.bfloat16, "bf16"),
                                    ((32, 128, 1), jnp.bfloat16, "bf16"), ((32, 128, 1), jnp.float32, "f32"),
                                    ((64, 64, 3), jnp.float32, "f32"), ((64, 128, 8), jnp.bfloat16, "bf16")]]
BACKENDS = ["gpu", "tpu"]
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
NUM_KV_HEADS = 2
FAST_COMPILE = COMPILER_OPTIONS["fast"]


def interpreted(kernel, *arrays, **options):
    """The kernel in interpret mode, compiled as one program with the engine's "fast" compile options:
    interpreting a kernel makes a large XLA program of small shapes, most of whose cost is compiling it.
    On a machine whose JAX runs on an NVIDIA GPU the GPU variant runs compiled (Triton), for real."""
    if options.get("backend") == "gpu" and jax.default_backend() == "gpu":
        return jax.jit(functools.partial(kernel, interpret=False, **options))(*arrays)
    return jax.jit(functools.partial(kernel, interpret=True, **options), compiler_options=FAST_COMPILE)(*arrays)
PAGES_PER_SEQ = 5


def make_pool(rng, kv_lens, page_size, head_dim, dtype, extra_pages=7):
    """Pools [K, P, S, D] and page tables [B, N]; pages beyond each sequence's length are NaN."""
    b = len(kv_lens)
    num_pages = b * PAGES_PER_SEQ + extra_pages
    order = rng.permutation(num_pages)
    table = order[: b * PAGES_PER_SEQ].reshape(b, PAGES_PER_SEQ).astype(np.int32)
    owned = {int(table[i, j]) for i, n in enumerate(kv_lens) for j in range(-(-n // page_size))}
    unowned = np.array(sorted(set(range(num_pages)) - owned))
    for i, n in enumerate(kv_lens):  # table entries past the end name pages no one owns
        used = -(-n // page_size)
        table[i, used:] = rng.choice(unowned, PAGES_PER_SEQ - used)
    shape = (NUM_KV_HEADS, num_pages, page_size, head_dim)
    k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    k[:, unowned] = np.nan
    v[:, unowned] = np.nan
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table)


_reference = jax.jit(paged_attention_reference)


def reference(q, k, v, table, kv_lens, q_lens):
    """Per sequence: q [n, H, D] at the last n positions. Computed in float32, all sequences in one
    jitted call (queries right-padded, padding rows repeating the last position and dropped)."""
    b, m = len(q_lens), max(q_lens)
    heads, dim = q[0].shape[-2:]
    qs = np.zeros((b, m, heads, dim), np.float32)
    pos = np.zeros((b, m), np.int32)
    for i, (n, q_i) in enumerate(zip(q_lens, q)):
        qs[i, :n] = np.asarray(q_i).astype(np.float32)
        pos[i] = np.arange(kv_lens[i] - n, kv_lens[i] - n + m).clip(max=kv_lens[i] - 1)
    out = np.asarray(_reference(jnp.asarray(qs), k.astype(jnp.float32), v.astype(jnp.float32), table[:b],
                                jnp.asarray(kv_lens[:b], jnp.int32), jnp.asarray(pos)))
    return [out[i, :n] for i, n in enumerate(q_lens)]


def decode_reference(q, k, v, table, lengths):
    """reference() for one query per sequence: q [B, H, D] -> [B, H, D]."""
    return np.stack([r[0] for r in reference(np.asarray(q)[:, None], k, v, table, lengths, [1] * len(lengths))])


def assert_close(out, ref, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    assert np.isfinite(out).all(), "NaN/inf reached the output"
    scale = max(np.abs(ref).max(), 1e-6)
    err = np.abs(out - ref).max() / scale
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} >= {TOLERANCE[dtype]}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size,head_dim,group,dtype", CASES)
def test_decode_kernel_matches_reference(backend, page_size, head_dim, group, dtype):
    rng = np.random.default_rng()
    s, max_len = page_size, page_size * PAGES_PER_SEQ
    lengths = [0, 1, s - 1, s, s + 1, max_len, int(rng.integers(1, max_len))]
    k, v, table = make_pool(rng, lengths, s, head_dim, dtype)
    q = jnp.asarray(rng.standard_normal((len(lengths), NUM_KV_HEADS * group, head_dim)), dtype)
    out = interpreted(paged_attention, q, k, v, jnp.array(lengths, jnp.int32), table, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = decode_reference(q, k, v, table, lengths)
    ref[0] = 0  # a sequence of length 0 returns zeros
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_kernel_splits_and_tiles(backend):
    """Long sequences cut into several splits and tiles give the same result as one of each."""
    rng = np.random.default_rng()
    lengths = [80, 33, 1, 0]
    k, v, table = make_pool(rng, lengths, 16, 64, jnp.float32)
    q = jnp.asarray(rng.standard_normal((4, 4, 64)), jnp.float32)
    ref = decode_reference(q, k, v, table, lengths)
    for tiles, splits in [(1, 1), (1, 5), (2, 2), (4, 1), (8, 3)]:
        out = interpreted(paged_attention, q, k, v, jnp.array(lengths, jnp.int32), table, backend=backend,
                              pages_per_tile=tiles, num_splits=splits)
        assert_close(out, ref, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size,head_dim,group,dtype", CASES)
def test_ragged_kernel_matches_reference(backend, page_size, head_dim, group, dtype):
    rng = np.random.default_rng()
    s, max_len = page_size, page_size * PAGES_PER_SEQ
    # (kv_len, q_len): decode rows, a whole prompt, a chunk starting mid-page, a chunk starting on a
    # page boundary, decode at the maximum length.
    seqs = [(s + 1, 1), (2 * s + 3, 2 * s + 3), (3 * s - 2, 2 * s - 2 - s // 2), (2 * s, s), (1, 1),
            (max_len, 1), (int(rng.integers(2, max_len)), 1)]
    rng.shuffle(seqs)
    kv_lens = [n for n, _ in seqs] + [0, 0]  # two padding slots after num_seqs
    q_lens = [n for _, n in seqs]
    k, v, table = make_pool(rng, kv_lens, s, head_dim, dtype)
    live_tokens = sum(q_lens)
    t = live_tokens + 5  # padding rows after the live ones
    cu = np.concatenate([[0], np.cumsum(q_lens), rng.integers(0, t, 2)]).astype(np.int32)  # junk past num_seqs
    q = jnp.asarray(rng.standard_normal((t, NUM_KV_HEADS * group, head_dim)), dtype)
    out = interpreted(ragged_paged_attention, q, k, v, jnp.array(kv_lens, jnp.int32), table, jnp.asarray(cu),
                                 jnp.array([len(seqs)], jnp.int32), backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    qn = np.asarray(q)
    ref = reference([qn[cu[i] : cu[i + 1]] for i in range(len(seqs))], k, v, table, kv_lens, q_lens)
    assert_close(out[:live_tokens], np.concatenate(ref), dtype)
    assert np.isfinite(np.asarray(out[live_tokens:], np.float32)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_layout_reads_only_its_layer(backend):
    """engine_attention over the whole cache [L, 2, K, P, S, D] equals the reference on one layer."""
    rng = np.random.default_rng()
    lengths = [20, 3, 0]
    k, v, table = make_pool(rng, lengths, 16, 64, jnp.float32)
    other = jnp.full_like(k, jnp.nan)
    cache = jnp.stack([jnp.stack([other, other]), jnp.stack([k, v]), jnp.stack([other, other])])
    q_lens = np.array([4, 3, 1])
    q = jnp.asarray(rng.standard_normal((3, 6, 4, 64)), jnp.float32)  # T = 6, right-padded
    out = interpreted(engine_attention, q, cache, jnp.int32(1), jnp.array(lengths, jnp.int32), jnp.asarray(q_lens),
                           table, backend=backend, tokens_per_block=4)
    qn = np.asarray(q)
    ref = reference([qn[i, :n] for i, n in enumerate(q_lens)], k, v, table, lengths, q_lens)
    for i, n in enumerate(q_lens[:2]):
        assert_close(out[i, :n], ref[i], jnp.float32)
    assert np.isfinite(np.asarray(out)).all()
    decode = interpreted(engine_attention, q[:, :1], cache, jnp.int32(1), jnp.array(lengths, jnp.int32),
                              jnp.ones(3, jnp.int32), table, backend=backend)
    ref = reference([qn[i, :1] for i in range(3)], k, v, table, lengths, [1, 1, 1])
    assert_close(decode[:2, 0], np.stack([r[0] for r in ref[:2]]), jnp.float32)


@pytest.mark.parametrize("chunked", [False, True], ids=["sliding", "chunked"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_ragged_kernel_with_a_sliding_window_and_softcap(backend, chunked):
    """The engine's packed step of a sliding layer (Gemma): keys before each query's window masked,
    soft-capped scores, a custom scale; its pages before the window are the null page, filled with NaN
    here, which must never be read. Chunked: the layer attends within chunks of the window's length instead
    (Llama 4; its pages kept as the window's). Against the plain-JAX path the CPU runs."""
    from jaxcb.host.batch import SeqSpec, StepShape, pack
    from jaxcb.model.paged_attention import ragged_attention
    from kernels_pallas import engine_ragged_attention

    rng = np.random.default_rng()
    s, d, nk, h, window = 16, 64, 2, 4, 40
    num_pages = 24
    cache = rng.standard_normal((1, 2, nk, num_pages, s, d)).astype(np.float32)
    cache[:, :, :, 0] = np.nan  # the null page
    # (tokens this step, start): decode past the window, a prefill chunk past it, a short prefill, decode.
    seqs = [(1, 100), (20, 70), (9, 0), (1, 30)]
    pages = iter(rng.permutation(np.arange(1, num_pages)).tolist())
    specs = []
    for n, start in seqs:
        total = -(-(start + n) // s)
        first = max(0, start - window + 1) // s
        ids = [0] * first + [next(pages) for _ in range(total - first)]
        tokens = rng.integers(0, 100, n).tolist()
        specs.append(SeqSpec(tokens, start, ids, window_page_ids=ids))
    specs.sort(key=lambda sp: len(sp.token_ids) > 1)  # decode first
    step = pack(specs, StepShape(64, 8, 8, 256), s, window)
    batch = step.window.apply(step)
    window = -window if chunked else window  # (the kernels' window: < 0 for chunks)
    q = jnp.asarray(rng.standard_normal((64, h, d)), jnp.float32)
    kv = jnp.asarray(cache)
    ref = ragged_attention(q, kv, jnp.int32(0), jax.tree.map(jnp.asarray, batch), scale=0.2, window=window,
                           softcap=3.0)
    out = interpreted(engine_ragged_attention, q, kv, jnp.int32(0), jnp.asarray(batch.kv_lens),
                      jnp.asarray(batch.page_table),
                                  jnp.asarray(batch.cu_q_lens), jnp.asarray(batch.num_seqs), backend=backend,
                                  scale=0.2, window=window, softcap=3.0)
    live = int(batch.cu_q_lens[len(seqs)])
    assert_close(out[:live], np.asarray(ref[:live]), jnp.float32)
    plain = ragged_attention(q, kv.at[:, :, :, 0].set(0.0), jnp.int32(0), jax.tree.map(jnp.asarray, batch),
                             scale=0.2, softcap=3.0)  # no window (null pages as zeros): a different answer
    assert np.abs(np.asarray(plain[:live]) - np.asarray(ref[:live])).max() > 1e-3
    # gpt-oss's sinks: each head's logit in its softmax's denominator, applied from the kernel's log-sum-exp
    sinks = jnp.asarray(rng.standard_normal(h) * 2, jnp.float32)
    ref = ragged_attention(q, kv, jnp.int32(0), jax.tree.map(jnp.asarray, batch), scale=0.2, window=window,
                           softcap=3.0, sinks=sinks)
    out = interpreted(engine_ragged_attention, q, kv, jnp.int32(0), jnp.asarray(batch.kv_lens),
                      jnp.asarray(batch.page_table), jnp.asarray(batch.cu_q_lens), jnp.asarray(batch.num_seqs),
                      backend=backend, scale=0.2, window=window, softcap=3.0, sinks=sinks)
    assert_close(out[:live], np.asarray(ref[:live]), jnp.float32)
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_ragged_kernel_reads_int8_pages(backend):
    """int8 KV pages (cache.kv_dtype): each slot's D int8 values and its float32 scale's 4 bytes; the
    kernels dequantize what they load. Against the plain-JAX path on the same int8 pages, decode rows
    and prefill chunks, with the null page's bytes all 0xFF (a NaN scale) that must never be read."""
    from jaxcb.host.batch import SeqSpec, StepShape, pack
    from jaxcb.model.paged_attention import quantize_kv, ragged_attention
    from kernels_pallas import engine_ragged_attention

    rng = np.random.default_rng()
    s, d, nk, h, num_pages = 16, 64, 2, 4, 24
    values = jnp.asarray(rng.standard_normal((1, 2, nk, num_pages, s, d)) * 2, jnp.float32)
    kv = quantize_kv(values).at[:, :, :, 0].set(-1)
    assert kv.dtype == jnp.int8 and kv.shape[-1] == d + 4
    seqs = [(1, 40), (1, 0), (20, 13), (9, 0)]  # (tokens this step, start)
    pages = iter(rng.permutation(np.arange(1, num_pages)).tolist())
    specs = [SeqSpec(rng.integers(0, 100, n).tolist(), start, [next(pages) for _ in range(-(-(start + n) // s))])
             for n, start in seqs]
    batch = pack(specs, StepShape(48, 8, 6, 128), s)
    q = jnp.asarray(rng.standard_normal((48, h, d)), jnp.float32)
    ref = ragged_attention(q, kv, jnp.int32(0), jax.tree.map(jnp.asarray, batch))
    out = interpreted(engine_ragged_attention, q, kv, jnp.int32(0), jnp.asarray(batch.kv_lens),
                      jnp.asarray(batch.page_table),
                                  jnp.asarray(batch.cu_q_lens), jnp.asarray(batch.num_seqs), backend=backend)
    live = int(batch.cu_q_lens[len(seqs)])
    assert_close(out[:live], np.asarray(ref[:live]), jnp.float32)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernels_lower_for_gpu_and_tpu(platform):
    """Triton and Mosaic lowering of both kernels, on this CPU machine (no device needed to lower)."""
    backend = {"cuda": "gpu", "tpu": "tpu"}[platform]
    sd = jax.ShapeDtypeStruct
    k, h, d, s, p, n, b, t = 8, 32, 128, 16, 512, 32, 8, 64
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for dtype in [jnp.bfloat16, jnp.float32]:
        pool, lens, table = sd((k, p, s, d), dtype), sd((b,), jnp.int32), sd((b, n), jnp.int32)
        decode = jax.jit(lambda *a: paged_attention(*a, backend=backend))
        lowered = export.export(decode, platforms=[platform], disabled_checks=checks)(
            sd((b, h, d), dtype), pool, pool, lens, table)
        assert "jaxcb_paged_attention" in lowered.mlir_module()
        ragged = jax.jit(lambda *a: ragged_paged_attention(*a, backend=backend))
        export.export(ragged, platforms=[platform], disabled_checks=checks)(
            sd((t, h, d), dtype), pool, pool, lens, table, sd((b + 1,), jnp.int32), sd((1,), jnp.int32))
    # The engine's entry over int8 pages (D values + 4 scale bytes a slot), bfloat16 queries.
    engine = jax.jit(lambda q, kv, *a: engine_ragged_attention(q, kv, jnp.int32(0), *a, backend=backend))
    lowered = export.export(engine, platforms=[platform], disabled_checks=checks)(
        sd((t, h, d), jnp.bfloat16), sd((2, 2, k, p, s, d + 4), jnp.int8), lens, table, sd((b + 1,), jnp.int32),
        sd((1,), jnp.int32))
    assert "jaxcb_paged_attention" in lowered.mlir_module()


def test_kernels_reject_unsupported_shapes():
    q = jnp.zeros((1, 4, 64))
    pool = jnp.zeros((2, 4, 16, 64))
    lens, table = jnp.ones(1, jnp.int32), jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="page size 12"):
        paged_attention(q, jnp.zeros((2, 4, 12, 64)), jnp.zeros((2, 4, 12, 64)), lens, table, interpret=True)
    with pytest.raises(ValueError, match=r"query heads \(3\)"):
        paged_attention(jnp.zeros((1, 3, 64)), pool, pool, lens, table, interpret=True)
    with pytest.raises(ValueError, match="head dim 48"):
        paged_attention(jnp.zeros((1, 4, 48)), jnp.zeros((2, 4, 16, 48)), jnp.zeros((2, 4, 16, 48)),
                        lens, table, interpret=True)
    assert 16 in PAGE_SIZES
    from jaxcb.host.engine_config import KERNEL_PAGE_SIZES

    assert KERNEL_PAGE_SIZES == PAGE_SIZES  # the engine's copy (its module imports no JAX) agrees
