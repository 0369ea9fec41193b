"""Native CPU kernels, called from the jitted step through XLA's FFI (the CPU backend only).

`ragged_attention(...)` is `jaxcb.model.paged_attention.ragged_attention` (its oracle) for a packed step:
every sequence's new tokens (decode rows and prefill chunks) over its own paged keys and values, causal,
in one pass over each page per block of queries (paged_attention.cc).
`layer_matmul(x, w, layer, scale, offset)` is x @ w[layer] for weights stacked over layers (float32,
bfloat16 in pair blocks, or int8 / int4 with their scales as jaxcb.model.quant stores them), read in place inside the layer scan
(matmul.cc), where XLA would copy (and dequantize) the layer's matrix out of the stack first.
`rows_matmul(x, rows, scale)` is x @ rows.T for the tied output head (the embedding table, float32,
bfloat16 or int8 with a scale per group of each row), without the dequantized copy of the table XLA makes (head.cc).
`available()` builds the library on first use (kernels_cpu.build) and registers it with XLA; where it
cannot be built it is False and the engine keeps the plain-JAX attention, which is also the oracle.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger("jaxcb.kernels_cpu")

TARGET = "jaxcb_ragged_attention"
MATMUL_TARGETS = {"float32": ("jaxcb_layer_matmul", "JaxcbLayerMatmul"),
                  "bfloat16": ("jaxcb_layer_matmul_bf16", "JaxcbLayerMatmulBF16"),
                  "int8": ("jaxcb_layer_matmul_int8", "JaxcbLayerMatmulInt8"),
                  "uint8": ("jaxcb_layer_matmul_int4", "JaxcbLayerMatmulInt4")}  # by the stack's dtype
ROWS_TARGETS = {"float32": ("jaxcb_rows_matmul", "JaxcbRowsMatmul"),
                "bfloat16": ("jaxcb_rows_matmul_bf16", "JaxcbRowsMatmulBF16"),
                "int8": ("jaxcb_rows_matmul_int8", "JaxcbRowsMatmulInt8")}  # by the rows' dtype


@functools.cache
def _load() -> str | None:
    """Builds and registers the library; returns None on success, else why it is not available."""
    import jax

    from kernels_cpu import build

    try:
        path = build.build()
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxcbRaggedAttention), platform="cpu")
        for target, symbol in (*MATMUL_TARGETS.values(), *ROWS_TARGETS.values()):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as e:  # no compiler, a failed build: the plain-JAX path stays
        log.warning("native CPU kernels unavailable (%s); using the plain-JAX step", e)
        return str(e)
    return None


def available() -> bool:
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


def matmul_pays() -> bool:
    """Whether the layer matmul kernel beats XLA's dot on this CPU. Its register tile (8 rows x 32
    columns of float32 accumulators) fits AVX-512's 32 vector registers; AVX2 has 16, and the tile
    spills: measured on a 2-core Zen 1 EPYC (AVX2, no AVX-512), SmolLM2's step took 114 ms at 1 row and
    402 ms at 4 rows with it, 75 and 129 ms with XLA's dot (the native attention kernel in both)."""
    from kernels_cpu import build

    return "avx512f" in build.cpu_flags()


@functools.cache
def block_columns() -> int:
    """The float32 layer matmul's column block: the width of a blocked matrix's blocks (block_stack)."""
    from kernels_cpu import build

    assert available(), unavailable_reason()
    fn = ctypes.cdll.LoadLibrary(str(build.build())).JaxcbMatmulBlockColumns
    fn.restype = ctypes.c_int64
    return int(fn())


@functools.cache
def vnni() -> bool:
    """Whether the library sums int8 products with AVX-512 VNNI (w8a8's integer sums; quad_block's
    layout is read only there)."""
    from kernels_cpu import build

    assert available(), unavailable_reason()
    fn = ctypes.cdll.LoadLibrary(str(build.build())).JaxcbMatmulVnni
    fn.restype = ctypes.c_int64
    return bool(fn())


def block_stack(w):
    """A float32 layer stack [L, K, N] blocked for layer_matmul: [L, N / B, K, B] (B = block_columns(),
    dividing N), each block of B columns one contiguous run of its K rows. The kernel's tile reads a
    block down its rows; in place that is B values a row, one row per page of a wide matrix, where the
    hardware prefetchers do not follow; blocked it is one stream (SmolLM2's up projection, 200 layers
    from memory, 2-core Xeon: 1.3-1.5x at 1 to 16 rows, the same at 32)."""
    b = block_columns()
    layers, k, n = w.shape
    return w.reshape(layers, k, n // b, b).transpose(0, 2, 1, 3)


def quad_block(q):
    """A layer stack in quad blocks as the w8a8 / w4a8 matmul reads it (B = block_columns() dividing N),
    each block of B columns one run, read in place where it had to be packed so every step from rows a
    page apart. int8 [L, K, N] (K a multiple of 4) -> [L, N / B, K / 4, 4 B]: a group of 4 bytes per column
    holding input rows 4g .. 4g + 3 side by side (the 32-bit lanes vpdpbusd sums). int4 [L, K / 2, N]
    uint8 (rows 2i, 2i + 1 in byte row i's low and high nibble; K a multiple of 8) -> [L, N / B, K / 8, 4 B]:
    byte i of a column's four holds row 8g + i in its low nibble and 8g + 4 + i in its high one."""
    import jax.numpy as jnp

    b = block_columns()
    if q.dtype == jnp.uint8:
        layers, half, n = q.shape
        rows = jnp.stack([q & 15, q >> 4], axis=2).reshape(layers, half // 4, 2, 4, n // b, b)  # row 8g + 4h + i
        rows = rows.transpose(0, 4, 1, 5, 3, 2)  # [L, N / B, K / 8, B, i, h]
        return (rows[..., 0] | (rows[..., 1] << 4)).reshape(layers, n // b, half // 4, 4 * b)
    layers, k, n = q.shape
    return q.reshape(layers, k // 4, 4, n // b, b).transpose(0, 3, 1, 4, 2).reshape(layers, n // b, k // 4, 4 * b)


def quad_unblock(q):
    """quad_block's inverse on one layer's blocks (XLA's reading of them): int8 [N / B, K / 4, 4 B] ->
    [K, N]; int4 [N / B, K / 8, 4 B] uint8 -> [K / 2, N] in byte rows."""
    import jax.numpy as jnp

    nb, groups, b4 = q.shape
    if q.dtype == jnp.uint8:
        rows = jnp.stack([q & 15, q >> 4], axis=-1).reshape(nb, groups, b4 // 4, 4, 2)  # [N / B, K / 8, B, i, h]
        rows = rows.transpose(1, 4, 3, 0, 2).reshape(4 * groups, 2, nb * b4 // 4)  # byte row 4g + 2h' ...: rows 2i, 2i+1
        return rows[:, 0] | (rows[:, 1] << 4)
    return q.reshape(nb, groups, b4 // 4, 4).transpose(1, 3, 0, 2).reshape(4 * groups, nb * b4 // 4)


def pair_block(w):
    """A bfloat16 layer stack [L, K, N] (K even, B = block_columns() dividing N) as layer_matmul reads it:
    [L, N / B, K / 2, 2 B], each block of B columns one run of pair rows, a pair row holding input rows 2p
    and 2p + 1 of each column side by side (the 32-bit lanes AVX512_BF16's vdpbf16ps multiplies)."""
    b = block_columns()
    layers, k, n = w.shape
    return w.reshape(layers, k // 2, 2, n // b, b).transpose(0, 3, 1, 4, 2).reshape(layers, n // b, k // 2, 2 * b)


def pair_unblock(w):
    """pair_block's inverse on one layer's block [N / B, K / 2, 2 B] -> [K, N] (XLA's reading of it)."""
    nb, pairs, b2 = w.shape
    return w.reshape(nb, pairs, b2 // 2, 2).transpose(1, 3, 0, 2).reshape(2 * pairs, nb * b2 // 2)


def ragged_attention(q, kv_pages, layer, kv_lens, page_table, cu_q_lens, num_seqs, window=0, softcap=0.0,
                     sinks=None, target=TARGET):
    """q [T, H, D] float32, already multiplied by the score scale; kv_pages [L, 2, K, P, S, W] float32,
    bfloat16 or int8 (W = D + 4); layer, window scalars; kv_lens [M]; page_table [M, N]; cu_q_lens
    [M + 1]; num_seqs [1]. Returns [T, H, D] float32: sequence i's tokens cu_q_lens[i]:cu_q_lens[i+1]
    are the last of its kv_lens[i] keys, each attends causally to the keys up to its own position
    (only the last `window` when window > 0; those of its own chunk of -window keys when window < 0, Llama 4's
    chunked attention); padding rows and sequences without keys give zeros.
    `softcap` (static): scores become softcap * tanh(scores / softcap). `sinks` [H] (None: none): each head's
    sink logit, in the scaled scores' units, joins its softmax's denominator (gpt-oss). `target`: another
    build's registered handler (bench.attention_cpu --compare)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    assert available(), unavailable_reason()
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    sinks = jnp.zeros((0,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32)
    return call(q.astype(jnp.float32), kv_pages, i32(layer), i32(kv_lens), i32(page_table), i32(cu_q_lens),
                i32(num_seqs).reshape(1), i32(window), sinks, softcap=np.float32(softcap))


def layer_matmul(x, w, layer, scale=None, offset=None, act_block=0):
    """x [..., K] float32 @ w[layer] -> [..., N] float32 (layer a scalar, may be traced), reading the
    layer's matrix in place. w: float32 [L, K, N] or blocked [L, N / B, K, B] (block_stack); bfloat16 in
    pair-row blocks [L, N / B, K / 2, 2 B] (pair_block: x rounded to bfloat16, float32 sums); int8 [L, K, N] with `scale` float32 [L, G, N] (a
    scale per K/G input rows of each column), or in quad blocks [L, N / B, K / 4, 4 B] (quad_block: w8a8 where
    vnni(); int4 too, [L, N / B, K / 8, 4 B]); or uint8 [L, K/2, N] (int4: input rows 2i and 2i+1 in
    the low and high nibble of byte row i) with `scale` and `offset` float16 [L, G, N]. Quantized w:
    `act_block` > 0 (dividing 128, and int4's group) quantizes each row of x per that many input rows
    first (w8a8, w4a8: jaxcb.model.quant)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    assert available(), unavailable_reason()
    target, _ = MATMUL_TARGETS[jnp.dtype(w.dtype).name]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    operands = {"float32": (w,), "bfloat16": (w,), "int8": (w, scale),
                "uint8": (w, scale, offset)}[jnp.dtype(w.dtype).name]
    n = w.shape[1] * w.shape[3] if w.ndim == 4 else w.shape[2]  # blocked (block_stack, pair_block, quad_block),
    if w.dtype == jnp.bfloat16:                                      # or in place
        n //= 2
    elif w.ndim == 4 and w.dtype in (jnp.int8, jnp.uint8):  # quad blocks
        n //= 4
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))
    attrs = {"act_block": np.int64(act_block)} if jnp.dtype(w.dtype) in (jnp.int8, jnp.uint8) else {}
    return call(x2, *operands, jnp.asarray(layer, jnp.int32), **attrs).reshape(*lead, n)


def rows_matmul(x, rows, scale=None, act_block=0):
    """x [M, E] float32 @ rows [V, E]^T -> [M, V] float32: rows float32, bfloat16 (x rounded to bfloat16,
    the exact products summed in float32), or int8 with `scale` float32 [V, G] (a scale per E/G values of
    each row); int8 rows with `act_block` = E/G (w8a8, w4a8): x's rows rounded to int8 per group first
    (jaxcb.model.quant.quantize_activations) and each group's products summed as integers (VNNI)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    assert available(), unavailable_reason()
    target, _ = ROWS_TARGETS[jnp.dtype(rows.dtype).name]
    operands = (rows,) if scale is None else (rows, scale)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], rows.shape[0]), jnp.float32))
    attrs = {"act_block": np.int64(act_block)} if scale is not None else {}
    return call(x.astype(jnp.float32), *operands, **attrs)
