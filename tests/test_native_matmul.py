"""The native CPU matmul over stacked layer weights (kernels_cpu.layer_matmul) against numpy, and the
step that uses it against the one that does not."""

import numpy as np
import pytest


@pytest.mark.parametrize("m,k,n", [(1, 5, 31), (1, 300, 1000), (1, 64, 48), (7, 130, 32), (9, 576, 70), (33, 257, 192),
                                   (544, 64, 96), (5, 64, 1000)])
def test_layer_matmul_matches_numpy_on_awkward_shapes(m, k, n):
    """Rows below and above the micro-kernel's 8, reductions across the 128-row slabs, column counts
    below, at and past the 32-column blocks (the tail loop), 31 whole blocks in work items of 5 and 6, each
    layer of the stack read in place; one row (its own path: items of up to 16 vectors, a short last
    item, the columns past the last vector)."""
    import jax
    import jax.numpy as jnp

    import kernels_cpu

    assert kernels_cpu.available(), kernels_cpu.unavailable_reason()
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((3, k, n)).astype(np.float32)
    f = jax.jit(kernels_cpu.layer_matmul)
    for layer in range(3):
        got = np.asarray(f(jnp.asarray(x), jnp.asarray(w), jnp.int32(layer)))
        np.testing.assert_allclose(got, x @ w[layer], rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("m,k,n", [(1, 130, 64), (2, 5, 32), (8, 576, 192), (9, 257, 96), (33, 300, 64),
                                   (544, 64, 96)])
def test_blocked_float32_stacks_give_the_matrix_product(m, k, n):
    """A float32 stack blocked for the kernel (kernels_cpu.block_stack: [L, N / B, K, B]) gives x @ w on
    every layer: one row (the tile, not the in-place one-row path), rows around the micro-kernel's 8,
    reductions across slabs; and XLA's product on a blocked matrix (jaxcb.model.quant.dense, what a
    non-native step reads) is the same."""
    import jax
    import jax.numpy as jnp

    import kernels_cpu
    from jaxcb.model.quant import dense

    b = kernels_cpu.block_columns()
    assert b in (16, 32)  # two vectors of float32 lanes (AVX2 / AVX-512)
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((3, k, n)).astype(np.float32)
    blocked = jax.jit(kernels_cpu.block_stack)(jnp.asarray(w))
    assert blocked.shape == (3, n // b, k, b)
    f = jax.jit(kernels_cpu.layer_matmul)
    for layer in range(3):
        want = x @ w[layer]
        got = np.asarray(f(jnp.asarray(x), blocked, jnp.int32(layer)))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
        np.testing.assert_allclose(np.asarray(dense(jnp.asarray(x), blocked[layer])), want, rtol=1e-4,
                                   atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("m,k,n", [(1, 130, 64), (3, 6, 32), (4, 576, 192), (5, 258, 96), (8, 576, 64),
                                   (33, 300, 96), (544, 64, 96)])
def test_bfloat16_pair_blocks_give_the_product_of_the_rounded_rows(m, k, n):
    """bfloat16 layer matrices in pair blocks (kernels_cpu.pair_block) on every layer: x rounded to
    bfloat16 times the weights, summed in float32. Up to 4 rows the pair lanes are widened in registers,
    from 5 rows (where the CPU has AVX512_BF16) vdpbf16ps sums them; rows around the micro-kernel's 8,
    reductions across the 128-row slabs, a last slab of a few pairs; and XLA's reading of one layer's
    pair blocks (jaxcb.model.quant.dense, pair_unblock) gives the same."""
    import jax
    import jax.numpy as jnp

    import kernels_cpu
    from jaxcb.model.quant import dense

    assert kernels_cpu.available(), kernels_cpu.unavailable_reason()
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((3, k, n)).astype(np.float32)).astype(jnp.bfloat16)
    blocks = jax.jit(kernels_cpu.pair_block)(w)
    b = kernels_cpu.block_columns()
    assert blocks.shape == (3, n // b, k // 2, 2 * b) and blocks.dtype == jnp.bfloat16
    rounded = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    assert not np.array_equal(rounded, x)  # (the rounding is what the reference below takes)
    f = jax.jit(kernels_cpu.layer_matmul)
    for layer in range(3):
        want = rounded @ np.asarray(w[layer].astype(jnp.float32))
        got = np.asarray(f(jnp.asarray(x), blocks, jnp.int32(layer)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
        np.testing.assert_allclose(np.asarray(dense(jnp.asarray(x), blocks[layer])), want, rtol=1e-5,
                                   atol=1e-5 * np.sqrt(k))
        np.testing.assert_allclose(np.asarray(dense(jnp.asarray(x), w[layer])), want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("bits,group", [(8, 0), (8, 32), (8, 96), (8, 192), (4, 32), (4, 64), (4, 96), (4, 384)])
@pytest.mark.parametrize("m,n", [(1, 31), (4, 40), (9, 70), (33, 192)])
def test_quantized_layer_matmul_matches_the_dequantized_matrix(bits, group, m, n):
    """int8 (per column, and groups that divide or straddle the 128-row slabs) and int4 (groups of 32
    to more than a slab) stacks read in place: x @ dequantize(w)[layer] within float rounding, for rows
    below and past the micro-kernel's 8 and columns below, at and past the 32-column blocks."""
    import jax
    import jax.numpy as jnp

    import kernels_cpu
    from jaxcb.model.quant import dequantize, quantize_int4, quantize_int8

    k = 384
    rng = np.random.default_rng(bits + group + m + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((3, k, n)).astype(np.float32) + 0.3  # an offset: int4's zero point matters
    quant = quantize_int8(w, group) if bits == 8 else quantize_int4(w, group)
    quant = jax.tree.map(jnp.asarray, quant)
    dense = np.asarray(dequantize(quant))
    f = jax.jit(kernels_cpu.layer_matmul)
    for layer in range(3):
        got = np.asarray(f(jnp.asarray(x), quant.q, jnp.int32(layer), quant.scale, quant.offset))
        np.testing.assert_allclose(got, x @ dense[layer], rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("m,v,e,group", [(1, 37, 576, 32), (5, 64, 40, 40), (33, 9, 96, 32), (4, 130, 24, 8),
                                         (9, 70, 48, 16), (16, 300, 576, 32), (40, 19, 40, 40), (20, 23, 45, 45)])
def test_rows_matmul_matches_numpy(m, v, e, group):
    """The tied head over an int8 embedding (a scale per group of each row, groups that are whole
    vectors, a whole row, or smaller than a vector), a float32 one and a bfloat16 one: x @ rows.T, with rows past the
    4-row blocks and rows of x past the 4-row blocks (a float32 table one row at a time up to 6 rows of
    x); from 16 rows of x the tiled path (rows of x padded to whole vectors, vocabulary rows past the 8-row
    tiles and past a 256-row work item; bfloat16 rows in pairs by vdpbf16ps where the CPU has it, an odd
    E the widening way). A bfloat16 table multiplies x rounded to bfloat16 on every path."""
    import jax
    import jax.numpy as jnp

    import kernels_cpu
    from jaxcb.model.quant import _rows, quantize_rows

    rng = np.random.default_rng(m + v + e)
    x = rng.standard_normal((m, e)).astype(np.float32)
    w = rng.standard_normal((v, e)).astype(np.float32)
    quant = jax.tree.map(jnp.asarray, quantize_rows(w, group))
    dense = np.asarray(_rows(quant, quant.q, quant.scale, jnp.float32))
    got = np.asarray(jax.jit(kernels_cpu.rows_matmul)(jnp.asarray(x), quant.q, quant.scale))
    np.testing.assert_allclose(got, x @ dense.T, rtol=1e-4, atol=1e-4 * np.sqrt(e))
    got = np.asarray(jax.jit(kernels_cpu.rows_matmul)(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_allclose(got, x @ w.T, rtol=1e-4, atol=1e-4 * np.sqrt(e))
    narrow = jnp.asarray(w).astype(jnp.bfloat16)  # the products of its values and x's rounded: exact
    got = np.asarray(jax.jit(kernels_cpu.rows_matmul)(jnp.asarray(x), narrow))
    rounded = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(got, rounded @ np.asarray(narrow.astype(jnp.float32)).T, rtol=1e-5,
                               atol=1e-5 * np.sqrt(e))


@pytest.mark.parametrize("m,v,e,group", [(1, 37, 576, 32), (7, 1027, 576, 32), (8, 300, 64, 32), (33, 523, 96, 32),
                                         (17, 9, 40, 40), (3, 20, 12, 4), (12, 260, 48, 16)])
def test_int8_head_with_int8_activations_sums_integers(m, v, e, group):
    """w8a8's tied head (QuantRows.act_block): x's rows rounded to int8 per group of the table's scales,
    each group's integer sums scaled by both scales. The kernel (VNNI's tiles from 8 rows of x, padded to
    16 lanes, the vocabulary's rows past the 4-row tiles and 256-row items the integer way one at a time;
    fewer rows, and builds without VNNI, the float path over the rounded values) and the plain-JAX head
    (head_logits: quantize_activations, then the dequantized table) against the reference in float64: an
    outlier channel, a zero row; a block that is not the table's group refused."""
    import jax
    import jax.numpy as jnp

    import kernels_cpu
    from jaxcb.model.quant import _rows, head_logits, quantize_activations, quantize_rows

    rng = np.random.default_rng(m * 7 + v + e)
    x = rng.standard_normal((m, e)).astype(np.float32)
    x[:, 1] *= 25
    if m > 2:
        x[2] = 0.0
    quant = jax.tree.map(jnp.asarray, quantize_rows(rng.standard_normal((v, e)).astype(np.float32), group))
    dense = np.asarray(_rows(quant, quant.q, quant.scale, jnp.float32), np.float64)
    rounded = np.asarray(quantize_activations(jnp.asarray(x), group), np.float64)
    want = rounded @ dense.T
    tol = dict(rtol=1e-5, atol=1e-5 * np.abs(want).max())
    got = np.asarray(jax.jit(kernels_cpu.rows_matmul, static_argnames="act_block")(
        jnp.asarray(x), quant.q, quant.scale, act_block=group))
    np.testing.assert_allclose(got, want, **tol)
    assert np.abs(got - np.asarray(x, np.float64) @ dense.T).max() > 1e-4 * np.abs(want).max()  # x was rounded
    if m > 2:
        assert not got[2].any()
    head = quant.replace(act_block=group)
    np.testing.assert_allclose(np.asarray(head_logits(jnp.asarray(x), head, None)), want, **tol)
    np.testing.assert_allclose(np.asarray(head_logits(jnp.asarray(x), head, None, native=True)), got, rtol=0, atol=0)
    if e // group > 1:
        with pytest.raises(Exception, match="per group of the rows' scales"):
            np.asarray(kernels_cpu.rows_matmul(jnp.asarray(x), quant.q, quant.scale, act_block=2 * group))


@pytest.mark.parametrize("weights,tied", [("int8", True), ("int8", False), ("int4", True), ("w8a8", True),
                                          ("w8a8", False), ("w4a8", True), ("bfloat16", True)])
def test_the_native_step_with_quantized_weights_gives_the_plain_step_logits(weights, tied):
    """A step of a tiny random model with int8 / int4 layer matrices and an int8 head (the tied
    embedding, or an untied matrix): the native kernels (reading the quantized arrays in place) against
    the plain step that dequantizes them. w8a8 / w4a8: int8 / int4 weights with int8 activations, integer
    sums in the kernel against the plain step's quantize_activations. bfloat16: the layer matrices stored
    so under float32 activations (the CPU's bfloat16 mode), widened by the kernel and by XLA."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxcb.host.batch import SeqSpec, StepShape, pack
    from jaxcb.model.config import tiny_config
    from jaxcb.model.llama import Attention, forward, params_from_numpy, random_weights
    from jaxcb.model.paged_attention import allocate_kv_pages
    import kernels_cpu
    from jaxcb.model.quant import blocked_layers, quantize_weights, with_int8_activations

    config = dataclasses.replace(tiny_config(), tie_embeddings=tied)
    stored = {"w8a8": "int8", "w4a8": "int4"}.get(weights, weights)
    params = params_from_numpy(quantize_weights(random_weights(config, seed=2), stored), mode=stored)
    if stored != weights:
        params = with_int8_activations(params)
    # As the runner holds them where the native matmul reads them: bfloat16 in pair blocks, w8a8 and w4a8 in
    # quad blocks (where the kernels have VNNI); both steps read these.
    params = blocked_layers(params)
    if weights in ("w8a8", "w4a8") and kernels_cpu.vnni():
        assert params.layers.w_up.layout == "quads" and params.layers.w_up.q.ndim == 4
        assert params.layers.w_up.shape == (config.num_layers, config.hidden_size, config.intermediate_size)
    s = 8
    kv = allocate_kv_pages(config.num_layers, config.num_kv_heads, 40, s, config.head_dim, jnp.float32)
    specs = [SeqSpec([5], 12, list(range(4, 6))), SeqSpec(list(range(3, 3 + 19)), 0, list(range(1, 4)))]
    batch = jax.tree.map(jnp.asarray, pack(specs, StepShape(tokens=32, seqs=4, pages_per_seq=4, history=32), s))
    step = jax.jit(forward, static_argnames=("config", "attention"))
    _, logits_plain = step(params, kv, batch, config=config, attention=Attention("xla"))
    native = Attention("xla", native_matmul=True)
    _, logits_native = step(params, kv, batch, config=config, attention=native)
    got, want = np.asarray(logits_native), np.asarray(logits_plain)
    if stored == weights:
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    else:
        # Activations rounded to int8 levels: where the two summation orders (equal to the last bits: the
        # kernel tests below) leave an activation on either side of a rounding boundary, its sequence's
        # logits move by a level (w4a8 here: one row by 0.029); the other rows agree as closely as above.
        # A step that left the activations unrounded on one side would move every row (by 0.07).
        close = np.all(np.abs(got - want) <= 2e-4 + 2e-4 * np.abs(want), axis=-1)
        assert close.sum() >= len(close) - 1 and np.abs(got - want).max() < 0.05, np.abs(got - want).max(-1)
    text = step.lower(params, kv, batch, config=config, attention=native).as_text()
    if weights == "bfloat16":
        assert params.layers.w_up.dtype == jnp.bfloat16 and params.layers.w_up.ndim == 4
        assert params.embed.dtype == jnp.bfloat16 and params.compute_dtype == jnp.float32
        assert "@jaxcb_layer_matmul_bf16(" in text and "@jaxcb_layer_matmul(" not in text
        assert "@jaxcb_rows_matmul_bf16(" in text
    else:
        assert "jaxcb_layer_matmul_int" in text and (not tied or "jaxcb_rows_matmul_int8" in text)


@pytest.mark.parametrize("tied", [True, False])
def test_the_native_step_gives_the_plain_step_logits(tied):
    """A whole step of a tiny random model (prefill chunks and decode rows) through the native matmul
    and attention, against the plain-JAX step: the same KV pages written and the same logits."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxcb.device.runner import resolve_attention
    from jaxcb.host.batch import SeqSpec, StepShape, pack
    from jaxcb.model.config import tiny_config
    from jaxcb.model.llama import Attention, forward, params_from_numpy, random_weights
    from jaxcb.model.paged_attention import allocate_kv_pages
    from jaxcb.model.quant import NATIVE_F32_HEAD_ROWS, blocked_layers

    import kernels_cpu

    config = dataclasses.replace(tiny_config(), tie_embeddings=tied)  # tied as SmolLM2's and Gemma 3's
    params = params_from_numpy(random_weights(config, seed=1))
    native = resolve_attention("native")
    assert native.native_matmul and native.kernel == "cpu"
    s = 8
    kv = allocate_kv_pages(config.num_layers, config.num_kv_heads, 40, s, config.head_dim, jnp.float32)
    specs = [SeqSpec([5], 12, list(range(4, 6))), SeqSpec(list(range(3, 3 + 19)), 0, list(range(1, 4))),
             SeqSpec(list(range(7, 12)), 8, list(range(6, 8)))]
    batch = jax.tree.map(jnp.asarray, pack(specs, StepShape(tokens=32, seqs=4, pages_per_seq=4, history=32), s))
    step = jax.jit(forward, static_argnames=("config", "attention"))
    kv_plain, logits_plain = step(params, kv, batch, config=config, attention=Attention("xla"))
    kv_native, logits_native = step(params, kv, batch, config=config, attention=native)
    np.testing.assert_allclose(np.asarray(logits_native), np.asarray(logits_plain), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(kv_native), np.asarray(kv_plain), rtol=2e-4, atol=2e-4)
    # As a native runner holds them: the float32 stacks blocked (quant.blocked_layers), both steps alike.
    blocked = blocked_layers(params)
    assert blocked.layers.w_up.ndim == 4 and blocked.layers.w_up.shape[-1] == kernels_cpu.block_columns()
    for attention in (native, Attention("xla")):
        kv_b, logits_b = step(blocked, kv, batch, config=config, attention=attention)
        np.testing.assert_allclose(np.asarray(logits_b), np.asarray(logits_plain), rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(np.asarray(kv_b), np.asarray(kv_plain), rtol=2e-4, atol=2e-4)
    # The native step really calls the kernels; the plain one calls neither.
    text = step.lower(params, kv, batch, config=config, attention=native).as_text()
    assert "jaxcb_layer_matmul" in text and "jaxcb_ragged_attention" in text
    # The tied float32 head of up to quant.NATIVE_F32_HEAD_ROWS sampled rows is read in place; more rows,
    # or an untied head, take XLA's dot.
    assert ("jaxcb_rows_matmul" in text) == tied
    many = NATIVE_F32_HEAD_ROWS + 1
    wide = jax.tree.map(jnp.asarray, pack(specs, StepShape(tokens=many, seqs=many, pages_per_seq=4, history=32), s))
    assert "jaxcb_rows_matmul" not in step.lower(params, kv, wide, config=config, attention=native).as_text()
    plain = step.lower(params, kv, batch, config=config, attention=dataclasses.replace(native, kernel="xla",
                                                                                      native_matmul=False)).as_text()
    assert "jaxcb_" not in plain


def _a8_reference(x, w, block):
    """x @ w (w the dequantized weights) with x's rows rounded to int8 per `block` values (scale max|x| /
    127, half to even): each block's sums in float64, scaled by the row's block scale."""
    y = np.zeros((x.shape[0], w.shape[1]), np.float64)
    for b0 in range(0, x.shape[1], block):
        xs = x[:, b0:b0 + block]
        amax = np.abs(xs).max(1).astype(np.float32)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        qx = np.rint(xs * inv[:, None]).astype(np.float64)
        y += (amax / np.float32(127)).astype(np.float64)[:, None] * (qx @ w[b0:b0 + block].astype(np.float64))
    return y


@pytest.mark.parametrize("m,k,n,block", [(1, 576, 1536, 32), (4, 64, 33, 32), (9, 576, 40, 64), (33, 200, 96, 32),
                                         (32, 1536, 64, 128), (5, 100, 32, 32)])
def test_int8_activations_sum_integers_as_the_reference_does(m, k, n, block):
    """w8a8: the native kernel (VNNI's integer sums where the build has them) and the plain-JAX
    quantize_activations both give the reference's values: rows of x quantized per 32, 64 or 128 inputs
    (K not a multiple of the block or of 128 too), an outlier input channel, a zero row, columns past the
    last 32-block."""
    import jax.numpy as jnp

    import kernels_cpu
    from jaxcb.model.quant import dense, quantize_activations, quantize_int8

    rng = np.random.default_rng(m * 1000 + k + n)
    w = rng.standard_normal((2, k, n)).astype(np.float32)
    qw = quantize_int8(w, 0)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 5] *= 30  # an outlier channel: only its own block loses resolution
    if m > 2:
        x[1] = 0.0
    want = _a8_reference(x, np.asarray(qw.q[1], np.float64) * np.asarray(qw.scale[1], np.float64), block)
    tol = dict(rtol=1e-5, atol=1e-5 * np.abs(want).max())
    got = kernels_cpu.layer_matmul(jnp.asarray(x), jnp.asarray(qw.q), 1, jnp.asarray(qw.scale), act_block=block)
    np.testing.assert_allclose(np.asarray(got), want, **tol)
    one = qw.replace(q=jnp.asarray(qw.q[1]), scale=jnp.asarray(qw.scale[1]), act_block=block)
    np.testing.assert_allclose(np.asarray(dense(jnp.asarray(x), one)), want, **tol)
    if n % kernels_cpu.block_columns() == 0 and k % 4 == 0:  # in quad blocks, as blocked_layers lays w8a8 out
        import jax

        quads = jax.jit(kernels_cpu.quad_block)(jnp.asarray(qw.q))
        assert quads.shape == (2, n // kernels_cpu.block_columns(), k // 4, 4 * kernels_cpu.block_columns())
        layer = one.replace(q=quads[1], layout="quads")
        assert layer.shape == (k, n)
        np.testing.assert_array_equal(np.asarray(kernels_cpu.quad_unblock(quads[1])), qw.q[1])
        np.testing.assert_allclose(np.asarray(dense(jnp.asarray(x), layer)), want, **tol)  # XLA's reading
        if kernels_cpu.vnni():  # the same integer sums in the same order: the same bits
            got_quads = kernels_cpu.layer_matmul(jnp.asarray(x), quads, 1, jnp.asarray(qw.scale), act_block=block)
            np.testing.assert_array_equal(np.asarray(got_quads), np.asarray(got))
        with pytest.raises(Exception, match="quad blocks are read only by VNNI"):  # float activations: refused
            np.asarray(kernels_cpu.layer_matmul(jnp.asarray(x), quads, 1, jnp.asarray(qw.scale)))
    deq = np.asarray(quantize_activations(jnp.asarray(x), block))
    levels = deq[0, :block] / (np.abs(x[0, :block]).max() / 127)
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-3)  # whole int8 levels of the block's scale
    if m > 2:
        assert not deq[1].any()


@pytest.mark.parametrize("m,k,n,group,block", [(1, 576, 1536, 32, 32), (4, 64, 33, 64, 32), (9, 576, 40, 64, 64),
                                               (33, 256, 96, 128, 32), (32, 1536, 64, 128, 128), (5, 96, 32, 32, 32)])
def test_int4_weights_with_int8_activations_sum_as_the_reference_does(m, k, n, group, block):
    """w4a8: the native kernel (VNNI's integer sums of x's int8 levels and the unsigned nibbles, each
    block's sum scaled by its group's scale plus the block's sum of levels times the group's offset) and
    the plain-JAX path both give x's quantized rows times the dequantized int4 weights: groups of 32-128
    with blocks of x of 32-128 inside them, K not a multiple of 128, an outlier input channel, a zero
    row, columns past the last 32-block."""
    import jax.numpy as jnp

    import kernels_cpu
    from jaxcb.model.quant import dense, dequantize, quantize_int4

    rng = np.random.default_rng(m * 1000 + k + n + group)
    w = rng.standard_normal((2, k, n)).astype(np.float32)
    qw = quantize_int4(w, group)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 5] *= 30
    if m > 2:
        x[1] = 0.0
    one = qw.replace(q=jnp.asarray(qw.q[1]), scale=jnp.asarray(qw.scale[1]), offset=jnp.asarray(qw.offset[1]))
    want = _a8_reference(x, np.asarray(dequantize(one)), block)
    tol = dict(rtol=1e-5, atol=1e-5 * np.abs(want).max())
    got = kernels_cpu.layer_matmul(jnp.asarray(x), jnp.asarray(qw.q), 1, jnp.asarray(qw.scale), jnp.asarray(qw.offset),
                                   act_block=block)
    np.testing.assert_allclose(np.asarray(got), want, **tol)
    np.testing.assert_allclose(np.asarray(dense(jnp.asarray(x), one.replace(act_block=block))), want, **tol)
    if m > 2:
        assert not np.asarray(got)[1].any()
    if n % kernels_cpu.block_columns() == 0 and k % 8 == 0 and block % 8 == 0:  # quad blocks (blocked_layers)
        import jax

        quads = jax.jit(kernels_cpu.quad_block)(jnp.asarray(qw.q))
        assert quads.shape == (2, n // kernels_cpu.block_columns(), k // 8, 4 * kernels_cpu.block_columns())
        layer = one.replace(q=quads[1], layout="quads", act_block=block)
        assert layer.shape == (k, n)
        np.testing.assert_array_equal(np.asarray(kernels_cpu.quad_unblock(quads[1])), qw.q[1])
        np.testing.assert_allclose(np.asarray(dense(jnp.asarray(x), layer)), want, **tol)  # XLA's reading
        if kernels_cpu.vnni():  # the same integer sums in the same order: the same bits
            got_quads = kernels_cpu.layer_matmul(jnp.asarray(x), quads, 1, jnp.asarray(qw.scale),
                                                 jnp.asarray(qw.offset), act_block=block)
            np.testing.assert_array_equal(np.asarray(got_quads), np.asarray(got))
        with pytest.raises(Exception, match="quad blocks are read only by VNNI"):  # float activations: refused
            np.asarray(kernels_cpu.layer_matmul(jnp.asarray(x), quads, 1, jnp.asarray(qw.scale), jnp.asarray(qw.offset)))


def test_an_engine_read_from_a_file_holds_its_blocked_weights_once(tmp_path, monkeypatch):
    """Built from a model file for one runner, the native matmul's blocked stacks replace the stacks read: those are
    freed as each is blocked, not held beside the blocked ones while the engine is built (the model once in memory,
    not twice); weights the caller passes in (LLM.from_params) stay the caller's, readable."""
    import jax
    import jax.numpy as jnp

    from jaxcb.model import quant

    from jaxcb.host.engine_config import make_config
    from jaxcb.host.request import SamplingParams
    from jaxcb.llm import LLM, load_model
    from tests.tiny_gguf import tiny_model_config, write_tiny_gguf

    config = tiny_model_config(num_layers=3, intermediate_size=96)  # (stacks of a shape no other test makes)
    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(path, config)
    engine_config = make_config(num_pages=16, max_context=128, decode_batch=(1,), prefill_tokens=(32,),
                                attention="native", compile="fast")

    def unblocked():
        return [a for a in jax.live_arrays() if a.shape == (3, 64, 96) and a.dtype == jnp.float32]

    seen = []  # the unblocked stacks alive as each runner's blocking ends, inside the engine's build
    blocked_layers = quant.blocked_layers
    monkeypatch.setattr(quant, "blocked_layers", lambda *a, **k: (blocked_layers(*a, **k), seen.append(len(unblocked())))[0])
    llm = LLM(path, config=engine_config)
    assert llm.engine.runner.params.layers.w_up.ndim == 4  # (blocked)
    assert seen == [0]
    want = llm.generate([[5, 9, 14]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    llm.close()
    cfg, params, tok, eos = load_model(path)
    llm = LLM.from_params(cfg, params, tok, config=engine_config, eos_ids=eos)
    assert seen[1:] == [2] and np.isfinite(np.asarray(params.layers.w_up)).all()  # (w_gate's, w_up's: kept)
    assert llm.generate([[5, 9, 14]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids == want
    llm.close()
