"""Quantized weights: int8 per output channel (or in groups) and int4 in groups, dequantized inside
the step. (bfloat16 weights on the CPU, under float32 compute: jaxcb.model.llama.params_from_numpy stores
the matrices and the embedding so, blocked_layers lays the matrices out for the native matmul, dense and
head_logits read them.)

    [model] weights = "float32" | "bfloat16" | "int8" | "int4"      (--weights)
    [model] weight_group = 0                                         (input rows per scale; 0 = the default)

A matrix `[..., in, out]` (q/k/v/o, gate/up/down, an untied output head) becomes a QuantWeight:
  int8  q int8 [..., in, out], symmetric (max/127), one scale per output column [..., 1, out] by
        default: x @ w = (x @ q) * scale, the scale applied after the dot. With weight_group = g, one
        scale per g consecutive input rows of each column [..., in/g, out]: closer to the float
        weights (a GGUF's Q8_0/Q4_1 blocks are 32 rows), dequantized right before the dot.
  int4  q uint8 [..., in/2, out], two values a byte (rows 2i and 2i+1 in the low and high nibble, so
        a split of the rows over devices keeps whole bytes), one scale and one offset per group of g
        (default 32) input rows of each column, in float16 [..., in/g, out]: value = nibble x scale +
        offset (asymmetric, as llama.cpp's Q4_1; a GGUF's Q4_1 blocks come back exactly). The step
        runs x @ w as x[:, 0::2] @ low + x[:, 1::2] @ high, each half dequantized right before its dot.
Every dequantization runs inside the layer scan on one layer's matrix: the step reads the quantized
bytes and never holds a float copy of the model's weights (tests/test_quant.py checks the compiled
program). The embedding (and a tied output head, the same array) is int8 in both modes, a scale per 32
values of each vocabulary row (a GGUF's Q8_0 embedding comes back exactly): a row is what a token looks
up and one output column of the head, and the head stays at 8 bits as llama.cpp keeps it. Norms and biases stay in the compute dtype.

Quantization happens once, on the host in numpy, from the float weights the loaders give (at load,
or by `jaxcb convert --weights`). The activations, the KV cache and the logits keep the compute dtype,
unless `[model] activations = "int8"` (--activations int8, with int8 weights per column or int4 weights):
then each row of x entering a layer matrix (and the output head, where it is int8 per column or the int8
embedding: with_int8_activations) is rounded to int8 per 32 consecutive values (scale max |x| /
127, half to even) and the dot sums integer products (VNNI's vpdpbusd in the native CPU kernel; plain JAX
computes the same values in floats), scaled by the row's block scale and the column's scale ("w8a8"), or,
for int4, by the group's scale with the group's offset times the block's sum ("w4a8", as llama.cpp's
Q4_1 x Q8_1 dot).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.host.engine_config import ACTIVATION_BLOCK
from jaxcb.host.engine_config import WEIGHT_CHOICES as WEIGHT_MODES  # the one list of model.weights
from jaxcb.host.errors import InvalidConfig
from jaxcb.host.memory_plan import INT4_GROUP as GROUP  # int4's default input rows per scale
from jaxcb.host.memory_plan import ROW_GROUP  # the int8 embedding's values per scale: a GGUF's Q8_0 blocks

MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "dense_gate", "dense_up", "dense_down", "wq_a", "wq_b",
            "wkv_a")
# A mixture of experts' matrices [L, X, in, out] (jaxcb.model.llama.experts): stored as the layers' matrices
# are (int8, int4, bfloat16), read through XLA (neither the native matmul nor int8 activations take them).
EXPERTS = ("experts_gate", "experts_up", "experts_down")


@flax.struct.dataclass
class QuantWeight:
    """A quantized matrix [..., in, out]: see the module's docstring."""

    q: jax.Array
    scale: jax.Array  # [..., in/g, out] (int8 per column: g = in)
    offset: jax.Array | None = None  # int4: [..., in/g, out]
    bits: int = flax.struct.field(pytree_node=False, default=8)
    # int8 per column or int4 in groups of a multiple of ACT_BLOCK: 0 = float activations; ACT_BLOCK =
    # each row of x quantized to int8 per ACT_BLOCK input values before the dot (model.activations =
    # "int8", quantize_activations).
    act_block: int = flax.struct.field(pytree_node=False, default=0)
    # "quads": q in the native w8a8 / w4a8 matmul's quad blocks, int8 [..., out / B, in / 4, 4 B], int4
    # [..., out / B, in / 8, 4 B] (kernels_cpu.quad_block; blocked_layers), read by XLA through
    # quad_unblock; "": [..., in, out] (int4: [..., in / 2, out])
    layout: str = flax.struct.field(pytree_node=False, default="")

    @property
    def shape(self) -> tuple[int, ...]:
        if self.layout == "quads":
            *lead, blocks, groups, b4 = self.q.shape
            return (*lead, (4 if self.bits == 8 else 8) * groups, blocks * b4 // 4)
        rows = self.q.shape[-2] * (2 if self.bits == 4 else 1)
        return (*self.q.shape[:-2], rows, self.q.shape[-1])

    @property
    def nbytes(self) -> int:
        return int(sum(a.size * a.dtype.itemsize for a in (self.q, self.scale, self.offset) if a is not None))


@flax.struct.dataclass
class QuantRows:
    """An int8 embedding [V, E] with a scale per 32 values of each row [V, E/32]: rows looked up by
    token, and (tied) the output head's columns."""

    q: jax.Array
    scale: jax.Array
    # The tied head's input rows rounded to int8 per group of the scales (= E / G) before its dot (w8a8,
    # w4a8: with_int8_activations); 0 = float. The rows looked up by token are as they are either way.
    act_block: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def dtype(self):
        return self.scale.dtype

    @property
    def nbytes(self) -> int:
        return int(self.q.size + self.scale.size * self.scale.dtype.itemsize)


def _safe(scale: np.ndarray) -> np.ndarray:
    return np.where(scale == 0, np.float32(1), scale).astype(np.float32)


def _groups(w: np.ndarray, group: int, name: str, what: str) -> np.ndarray:
    rows, cols = w.shape[-2], w.shape[-1]
    if group < 1 or rows % group:
        raise InvalidConfig(f"model.weight_group: {what} groups of {group} do not divide the {rows} input rows of {name}")
    return w.reshape(*w.shape[:-2], rows // group, group, cols)


def quantize_int8(w: np.ndarray, group: int = 0, name: str = "weight") -> QuantWeight:
    """Symmetric, one scale per output column (the last axis) over all input rows (`group` 0), or over
    each `group` consecutive input rows."""
    w = np.asarray(w, np.float32)
    g = _groups(w, group or w.shape[-2], name, "int8")
    scale = _safe(np.abs(g).max(axis=-2, keepdims=True) / 127.0)
    q = np.clip(np.rint(g / scale), -127, 127).astype(np.int8).reshape(w.shape)
    return QuantWeight(q, scale.reshape(*w.shape[:-2], g.shape[-3], w.shape[-1]), None, 8)


def quantize_int4(w: np.ndarray, group: int = GROUP, name: str = "weight") -> QuantWeight:
    """Asymmetric in groups of `group` input rows per output column; two values a byte along the input
    axis. The group's minimum is the offset and (max - min) / 15 the scale, both float16."""
    w = np.asarray(w, np.float32)
    if group % 2:
        raise InvalidConfig(f"model.weight_group: int4 needs an even group, got {group}")
    g = _groups(w, group, name, "int4")
    lo, hi = g.min(axis=-2, keepdims=True), g.max(axis=-2, keepdims=True)
    scale = np.float16((hi - lo) / 15.0).astype(np.float32)
    offset = np.float16(lo).astype(np.float32)  # what the step will use, rounded as it is stored
    q = np.clip(np.rint((g - offset) / _safe(scale)), 0, 15).astype(np.uint8).reshape(w.shape)
    packed = q[..., 0::2, :] | (q[..., 1::2, :] << 4)
    lead, cols = w.shape[:-2], w.shape[-1]
    return QuantWeight(packed, scale.reshape(*lead, g.shape[-3], cols).astype(np.float16),
                       offset.reshape(*lead, g.shape[-3], cols).astype(np.float16), 4)




def quantize_rows(w: np.ndarray, group: int = ROW_GROUP) -> QuantRows:
    """int8 of [V, E], symmetric, a scale per `group` values of each row ([V, E/group]; one per row when
    E is not a multiple of `group`). A GGUF's Q8_0 embedding (blocks of 32 along the row) comes back
    exactly."""
    w = np.asarray(w, np.float32)
    v, e = w.shape
    group = group if e % group == 0 else e
    g = w.reshape(v, e // group, group)
    scale = _safe(np.abs(g).max(axis=-1, keepdims=True) / 127.0)
    q = np.clip(np.rint(g / scale), -127, 127).astype(np.int8).reshape(v, e)
    return QuantRows(q, scale[..., 0])


def _rows(embed: QuantRows, q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """Rows [N, E] of int8 values with their [N, E/group] scales, in `dtype`."""
    n, e = q.shape
    groups = scale.shape[-1]
    return (q.reshape(n, groups, e // groups).astype(dtype) * scale.astype(dtype)[..., None]).reshape(n, e)


def _int4_half(w: QuantWeight, nibbles: jax.Array, dtype) -> jax.Array:
    """One half (the even or the odd input rows) of an int4 matrix, dequantized: [..., in/2, out]."""
    *lead, half, cols = nibbles.shape
    groups = w.scale.shape[-2]
    vals = nibbles.astype(dtype).reshape(*lead, groups, half // groups, cols)
    out = vals * w.scale.astype(dtype)[..., :, None, :] + w.offset.astype(dtype)[..., :, None, :]
    return out.reshape(*lead, half, cols)


def dequantize(w: QuantWeight, dtype=jnp.float32) -> jax.Array:
    """The float matrix [..., in, out] (traced inside the step: one layer's matrix at a time)."""
    if w.bits == 4:
        even, odd = _int4_half(w, w.q & 15, dtype), _int4_half(w, w.q >> 4, dtype)
        *lead, half, cols = even.shape
        return jnp.stack([even, odd], axis=-2).reshape(*lead, 2 * half, cols)
    *lead, rows, cols = w.q.shape
    groups = w.scale.shape[-2]
    vals = w.q.reshape(*lead, groups, rows // groups, cols).astype(dtype)
    return (vals * w.scale.astype(dtype)[..., :, None, :]).reshape(*lead, rows, cols)


# Input values per activation scale (32: perplexity +0.8% over int8 weights alone on the held-out excerpt,
# 128: +2.1%, at about the same speed; a divisor of the kernel's 128-row slabs and of int4's groups).
ACT_BLOCK = ACTIVATION_BLOCK


def quantize_activations(x: jax.Array, block: int = ACT_BLOCK) -> jax.Array:
    """x [..., K] with each row's values rounded to int8 levels per `block` consecutive values (scale
    max |x| / 127, half to even) and given back as floats in x's dtype: the values the native w8a8
    kernel multiplies as integers."""
    k = x.shape[-1]
    pad = -k % block
    xf = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    xf = xf.reshape(*x.shape[:-1], (k + pad) // block, block)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    out = jnp.round(xf * inv) * (amax / 127.0)
    return out.reshape(*x.shape[:-1], k + pad)[..., :k].astype(x.dtype)


def with_int8_activations(params, block: int = ACT_BLOCK):
    """The params with every layer matrix set to quantize its input rows (model.activations = "int8"), and
    the output head too where it is int8 per column (untied) or the int8 embedding with a scale per `block`
    values (tied: a GGUF's Q8_0 table, or ours), as llama.cpp multiplies its Q8_0 output by Q8 activations;
    refuses layer weights that are neither int8 with one scale per column nor int4 in groups of a multiple of
    `block`, naming the matrix."""
    layers = params.layers
    changes = {}
    for name in MATRICES:
        w = getattr(layers, name, None)
        if w is None:
            continue
        if not (isinstance(w, QuantWeight) and (w.scale.shape[-2] == 1 if w.bits == 8
                                                 else w.shape[-2] // w.scale.shape[-2] % block == 0)):
            raise InvalidConfig(f"model.activations: int8 activations need int8 weights with one scale per column "
                             f"(--weights int8, weight_group 0) or int4 weights in groups of a multiple of {block} "
                             f"(--weights int4); {name} is "
                             f"{'int%d in groups' % w.bits if isinstance(w, QuantWeight) else jnp.dtype(w.dtype).name}")
        changes[name] = w.replace(act_block=block)
    params = params.replace(layers=layers.replace(**changes))
    embed, lm_head = params.embed, params.lm_head
    if (lm_head is None and isinstance(embed, QuantRows) and embed.scale.dtype == jnp.float32
            and embed.q.shape[-1] == block * embed.scale.shape[-1]):
        params = params.replace(embed=embed.replace(act_block=block))
    if isinstance(lm_head, QuantWeight) and lm_head.bits == 8 and lm_head.scale.shape[-2] == 1:
        params = params.replace(lm_head=lm_head.replace(act_block=block))
    return params


@dataclasses.dataclass(frozen=True)
class StackedMatrix:
    """A layer matrix left in its [L, K, N] stack (float32, or a QuantWeight stack), with the (traced)
    layer to read: the native CPU matmul reads it in place (kernels_cpu.layer_matmul), where slicing it
    out of the stack inside the layer scan makes XLA copy it (and dequantize it) every step."""

    stack: "jax.Array | QuantWeight"  # [L, K, N]
    layer: jax.Array  # [] int32


def native_stack(w) -> bool:
    """Whether the native CPU matmul reads this layer stack in place: float32 matrices, bfloat16 in pair
    blocks (blocked_layers), int8 with float32 scales, int4 with float16 scales and offsets (the formats
    this module writes)."""
    if isinstance(w, QuantWeight):
        if w.bits == 8:
            return w.q.dtype == jnp.int8 and w.scale.dtype == jnp.float32
        return w.q.dtype == jnp.uint8 and w.scale.dtype == jnp.float16 and w.offset.dtype == jnp.float16
    if isinstance(w, jax.Array) and w.dtype == jnp.bfloat16:
        return w.ndim == 4
    return isinstance(w, jax.Array) and w.dtype == jnp.float32


def blocked_layers(params, release: bool = False):
    """params with each float32 layer stack [L, K, N] blocked for the native matmul ([L, N / B, K, B],
    kernels_cpu.block_stack) where B divides N, each bfloat16 one in pair blocks ([L, N / B, K / 2, 2 B],
    kernels_cpu.pair_block) where also K is even, each w8a8 one (int8 per column, int8 activations) in quad
    blocks ([L, N / B, K / 4, 4 B], kernels_cpu.quad_block) where also 4 divides K and the kernels have VNNI,
    each w4a8 one so ([L, N / B, K / 8, 4 B]) where 8 divides K and the activations' block (the others stay
    as they are), one stack at a time. A step reads a blocked matrix natively or through
    XLA (dense). `release`: each stack's buffer is freed once it is blocked (nobody else reads these
    params: the model is held once, not twice)."""
    import kernels_cpu

    b = kernels_cpu.block_columns()
    block, pairs, quads = jax.jit(kernels_cpu.block_stack), jax.jit(kernels_cpu.pair_block), jax.jit(kernels_cpu.quad_block)
    layers = params.layers
    for name in MATRICES:
        w = getattr(layers, name)
        if (isinstance(w, QuantWeight) and w.act_block and not w.layout and w.q.ndim == 3 and w.q.shape[2] % b == 0
                and (w.scale.shape[-2] == 1 and w.shape[1] % 4 == 0 if w.bits == 8 else w.shape[1] % 8 == 0
                     and w.act_block % 8 == 0) and kernels_cpu.vnni()):
            layers = dataclasses.replace(layers, **{name: w.replace(q=quads(w.q), layout="quads")})
            if release:
                jax.block_until_ready(getattr(layers, name).q)
                w.q.delete()
            continue
        if not (isinstance(w, jax.Array) and w.ndim == 3 and w.shape[2] % b == 0):
            continue
        if w.dtype == jnp.float32:
            layers = dataclasses.replace(layers, **{name: block(w)})
        elif w.dtype == jnp.bfloat16 and w.shape[1] % 2 == 0:
            layers = dataclasses.replace(layers, **{name: pairs(w)})
        else:
            continue
        if release:
            jax.block_until_ready(getattr(layers, name))
            w.delete()
    return dataclasses.replace(params, layers=layers)


def dense(x: jax.Array, w) -> jax.Array:
    """x @ w for a float matrix, a QuantWeight or a StackedMatrix, in x's dtype."""
    if isinstance(w, StackedMatrix):
        import kernels_cpu

        if isinstance(w.stack, QuantWeight):
            q = w.stack
            return kernels_cpu.layer_matmul(x, q.q, w.layer, q.scale, q.offset, act_block=q.act_block).astype(x.dtype)
        return kernels_cpu.layer_matmul(x, w.stack, w.layer).astype(x.dtype)
    if not isinstance(w, QuantWeight):
        if w.dtype == jnp.bfloat16 and x.dtype != jnp.bfloat16:  # as the native kernel: x rounded, float sums
            import kernels_cpu

            w = kernels_cpu.pair_unblock(w) if w.ndim == 3 else w
            return x.astype(jnp.bfloat16).astype(x.dtype) @ w.astype(x.dtype)
        if w.ndim == 3:  # a blocked float32 matrix [N / B, K, B] (kernels_cpu.block_stack), read by XLA
            return jnp.einsum("...k,nkb->...nb", x, w).reshape(*x.shape[:-1], w.shape[0] * w.shape[2])
        return x @ w
    if w.act_block:
        x = quantize_activations(x, w.act_block)
    if w.layout == "quads":  # one layer's quad blocks (blocked_layers)
        import kernels_cpu

        w = w.replace(q=kernels_cpu.quad_unblock(w.q), layout="")
    if w.bits == 4:  # the even and the odd input rows: each half dequantized beside its own dot
        return (jnp.dot(x[..., 0::2], _int4_half(w, w.q & 15, x.dtype))
                + jnp.dot(x[..., 1::2], _int4_half(w, w.q >> 4, x.dtype)))
    if w.scale.shape[-2] == 1:  # per column: the scale applies after the dot
        return jnp.dot(x, w.q.astype(x.dtype)) * w.scale.astype(x.dtype)
    return jnp.dot(x, dequantize(w, x.dtype))


def embed_rows(embed, ids: jax.Array, dtype) -> jax.Array:
    """The embedding rows of `ids` [T] -> [T, E] in `dtype`."""
    if isinstance(embed, QuantRows):
        return _rows(embed, embed.q[ids], embed.scale[ids], dtype)
    return embed[ids].astype(dtype)


# A float32 tied head goes through the native kernel up to this many rows (XLA's dot against the
# embedding's transpose beyond): SmolLM2's head alone, 2-core Zen 4, kernels_cpu.rows_matmul against XLA's
# dot at 1 / 2 / 8 / 16 / 32 / 64 / 128 / 256 rows: 2.77 / 2.81 / 5.09 / 8.20 / 12.89 / 21.55 / 38.47 / 93.91 ms
# against 2.73 / 5.93 / 7.82 / 10.30 / 15.10 / 22.80 / 39.87 / 89.79 (since then the kernel's 16 / 32 / 64 /
# 128 rows: 6.05 / 9.98 / 18.31 / 34.79 ms, head.cc). On the 2-core Xeon the decode step
# took 29.9 -> 27.1 ms at 1 row, 33.7 -> 31.4 at 4, 42.4 -> 38.9 at 8 with it, the same at 12 and 1% more at
# 16 and 32 (when this limit was 8).
NATIVE_F32_HEAD_ROWS = 128


def head_logits(last: jax.Array, embed, lm_head, native: bool = False) -> jax.Array:
    """Logits [M, V] in float32 from the final hidden states: the untied head, else the embedding's
    transpose. `native`: an int8 head through the native CPU kernels, which widen each value as they
    read it (kernels_cpu.rows_matmul for the tied embedding, layer_matmul for an untied head as a
    one-layer stack) where XLA dequantizes the whole table first; a bfloat16 tied embedding (x rounded to
    bfloat16 on every path, XLA's too, as the layers' bfloat16 matmuls round theirs; the rows read as
    they are), and a float32 one for up to NATIVE_F32_HEAD_ROWS rows, read in place of XLA's dot against
    its transpose. An int8 head with act_block (w8a8, w4a8) multiplies `last` rounded to int8 per block
    (the kernels sum the integers)."""
    if native and lm_head is None and isinstance(embed, QuantRows) and embed.scale.dtype == jnp.float32:
        import kernels_cpu

        return kernels_cpu.rows_matmul(last, embed.q, embed.scale, act_block=embed.act_block)
    if (native and lm_head is None and not isinstance(embed, QuantRows)
            and (embed.dtype == jnp.bfloat16 or embed.dtype == jnp.float32 and last.shape[0] <= NATIVE_F32_HEAD_ROWS)):
        import kernels_cpu

        return kernels_cpu.rows_matmul(last, embed)
    if native and isinstance(lm_head, QuantWeight) and native_stack(lm_head):
        import kernels_cpu

        one = jax.tree.map(lambda a: a[None], lm_head)
        return kernels_cpu.layer_matmul(last, one.q, 0, one.scale, one.offset, act_block=lm_head.act_block)
    head = lm_head if lm_head is not None else embed
    if getattr(head, "act_block", 0):
        last = quantize_activations(last, head.act_block)
    if lm_head is not None:
        if isinstance(lm_head, QuantWeight):
            return (jnp.dot(last, lm_head.q.astype(last.dtype), preferred_element_type=jnp.float32)
                    * lm_head.scale.astype(jnp.float32))
        return jnp.dot(last, lm_head, preferred_element_type=jnp.float32)
    if isinstance(embed, QuantRows):  # the tied head: the embedding dequantized beside the dot
        if embed.scale.shape[-1] == 1:
            return (jnp.dot(last, embed.q.T.astype(last.dtype), preferred_element_type=jnp.float32)
                    * embed.scale[:, 0].astype(jnp.float32))
        return jnp.dot(last, _rows(embed, embed.q, embed.scale, last.dtype).T, preferred_element_type=jnp.float32)
    if embed.dtype == jnp.bfloat16 and last.dtype != jnp.bfloat16:  # as the native kernel: x rounded, float sums
        last = last.astype(jnp.bfloat16).astype(last.dtype)
    return jnp.dot(last, embed.T, preferred_element_type=jnp.float32)


def check_mode(mode: str) -> str:
    if mode not in WEIGHT_MODES:
        raise InvalidConfig(f"model.weights: {mode!r} is not one of {WEIGHT_MODES}")
    return mode


def quantize_weights(weights: dict[str, np.ndarray], mode: str, group: int = 0) -> dict:
    """The loader's float weights with the matrices, the embedding and an untied head quantized for
    `mode` ("int8" | "int4"; `group` input rows per scale, 0 = the mode's default); other modes return
    them unchanged. Already quantized entries (a converted checkpoint) stay as they are."""
    if check_mode(mode) not in ("int8", "int4"):
        return weights
    return {name: quantize_weight(name, w, mode, group) for name, w in weights.items()}


def quantize_weight(name: str, w, mode: str, group: int = 0):
    """Weight `name` of the loader's layout as quantize_weights stores it in `mode`; a stack of layers quantized a
    layer at a time (the float temporaries of one layer, not of the stack)."""
    if check_mode(mode) not in ("int8", "int4") or is_quantized(w):
        return w
    if name == "embed":
        return quantize_rows(w)
    if name == "lm_head":
        return quantize_int8(w, 0, "lm_head")
    if name not in MATRICES + EXPERTS:
        return w

    def one(m):
        return quantize_int8(m, group, name) if mode == "int8" else quantize_int4(m, group or GROUP, name)

    if w.ndim < 3:
        return one(w)
    layers = [one(w[i]) for i in range(w.shape[0])]
    return jax.tree.map(lambda *parts: np.stack(parts), *layers)


def is_quantized(x) -> bool:
    return isinstance(x, (QuantWeight, QuantRows))
