"""Llama and its named variations in JAX over the paged KV cache: one pure step function over a
packed batch of tokens.

The variations (jaxcb.model.config.ModelConfig, each a flag): Qwen3's per-head q/k norms; Gemma's
(1 + w) norms, four norms per layer, GeGLU, scaled embeddings and attention scale; Gemma 2's score
and logit soft-capping; Gemma 2/3's sliding-window layers, whose KV pages are a group of their own
(`kv_pages` is then a pair (full layers' pages, sliding layers' pages), see _attend); mixtures of experts
(experts()), with dense layers among the experts' ones (each kind stacked over its own layers, a layer's kind a
branch of the scan: _layer's `mlps`); DeepSeek's multi-head latent attention, served absorbed (_latent_qkv).

    kv_pages, logits = forward(params, kv_pages, batch, config)

`batch` (jaxcb.host.batch.StepInput) packs decode tokens and prefill chunks of many sequences on one token
axis; every matmul runs once over all of them, attention reads each sequence's own pages.

The per-layer weights are stacked on a leading axis and the layers run under `jax.lax.scan`, so
compile time does not grow with depth. The KV pages travel through the scan as part of the carry
and each layer scatters its new K/V into them; with the pages donated to the jitted caller the
cache is updated in place, never copied.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcb.host.batch import StepInput, WindowPages
from jaxcb.model.config import DENSE_MLP, EXPERT_PARTS, ModelConfig
from jaxcb.model.mesh_axes import AXIS, KV_SPEC
from jaxcb.model.paged_attention import ragged_attention, write_kv
from jaxcb.model.quant import (EXPERTS, MATRICES, QuantRows, QuantWeight, StackedMatrix, dense, dequantize, embed_rows,
                               head_logits,
                               native_stack, quantize_weight)
from kernels_pallas import engine_ragged_attention


@dataclasses.dataclass(frozen=True)
class Attention:
    """Which attention the step runs (a static argument: each choice is its own program)."""

    kernel: str = "xla"  # "xla": plain JAX; "cpu": the native CPU attention (kernels_cpu);
    #                      "gpu" | "tpu": the Pallas kernels; "none": skipped (profiling only)
    interpret: bool = False  # run the Pallas kernel in interpret mode (the CPU)
    mesh: object = None  # a jax.sharding.Mesh with a "model" axis: attention runs per device (jaxcb.device.parallel)
    # The layers' matrices (float32, int8, int4) through the native CPU matmul, read in place from their
    # stacks (kernels_cpu.layer_matmul), and a tied head (kernels_cpu.rows_matmul: int8, or float32 up to
    # jaxcb.model.quant.NATIVE_F32_HEAD_ROWS rows); single device only (XLA cannot partition the custom calls).
    native_matmul: bool = False
    # A mixture of experts' pairs grouped by expert through jax.lax.ragged_dot (GPU and TPU, which lower it as a
    # grouped matmul, whatever the attention); else the CPU's ways (experts()).
    grouped_experts: bool = False


@flax.struct.dataclass
class LayerParams:
    """Stacked over layers: every array has a leading L axis (None: a part the model does not have)."""

    attn_norm: jax.Array | None = None  # [L, E] before attention (None: OLMo 2's layers norm only after)
    wq: jax.Array = None  # [L, E, H*D]
    wk: jax.Array = None  # [L, E, K*D]
    wv: jax.Array = None  # [L, E, K*D]
    wo: jax.Array = None  # [L, H*D, E]
    mlp_norm: jax.Array | None = None  # [L, E] before the MLP
    w_gate: jax.Array | None = None  # [L, E, F] the dense MLP (None in a mixture of experts)
    w_up: jax.Array | None = None  # [L, E, F]
    w_down: jax.Array | None = None  # [L, F, E]
    bq: jax.Array | None = None  # [L, H*D] attention biases (Qwen2); None in Llama
    bk: jax.Array | None = None  # [L, K*D]
    bv: jax.Array | None = None  # [L, K*D]
    q_norm: jax.Array | None = None  # [L, D] per-head norms of q and k (Qwen3, Gemma 3); [L, H*D] whole (OLMo 2)
    k_norm: jax.Array | None = None  # [L, D]; [L, K*D]
    post_attn_norm: jax.Array | None = None  # [L, E] on the attention's output (Gemma 2/3)
    post_mlp_norm: jax.Array | None = None  # [L, E] on the MLP's output (Gemma 2/3)
    router: jax.Array | None = None  # [L, E, X] X experts in place of the MLP (Mixtral, Qwen3-MoE, Granite MoE)
    experts_gate: jax.Array | None = None  # [L, X, E, F]
    experts_up: jax.Array | None = None  # [L, X, E, F]
    experts_down: jax.Array | None = None  # [L, X, F, E]
    shared_gate: jax.Array | None = None  # [L, E, 1] beside the experts, the shared expert's (w_gate, w_up, w_down) gate
    bo: jax.Array | None = None  # [L, E] the attention output's bias (Llama's attention_bias, gpt-oss)
    sinks: jax.Array | None = None  # [L, H] each query head's sink logit (gpt-oss)
    router_bias: jax.Array | None = None  # [L, X] the experts' biases (gpt-oss): the router's logits',
    experts_gate_bias: jax.Array | None = None  # [L, X, F]
    experts_up_bias: jax.Array | None = None  # [L, X, F]
    experts_down_bias: jax.Array | None = None  # [L, X, E]
    router_choice_bias: jax.Array | None = None  # [L, X] added to the sigmoid scores to choose experts (GLM-4.5)
    # A mixture of experts with dense layers among its experts' ones (ModelConfig.moe_layers): the dense layers'
    # MLP, stacked over those layers only, as the experts' parts (and a shared expert) are over theirs.
    dense_gate: jax.Array | None = None  # [Ld, E, Fd]
    dense_up: jax.Array | None = None  # [Ld, E, Fd]
    dense_down: jax.Array | None = None  # [Ld, Fd, E]
    # Multi-head latent attention (ModelConfig.kv_lora_rank: DeepSeek): in place of wk, wv (and wq with a q_lora_rank)
    wq_a: jax.Array | None = None  # [L, E, Q] the queries' first matrix, then q_a_norm, then wq_b
    q_a_norm: jax.Array | None = None  # [L, Q]
    wq_b: jax.Array | None = None  # [L, Q, H*(N+R)] each head's unrotated (N) then rotated (R) part
    wkv_a: jax.Array | None = None  # [L, E, C+R] the latent (C), then the keys' rotated part
    kv_a_norm: jax.Array | None = None  # [L, C]
    w_uk: jax.Array | None = None  # [L, H, N, C] each head's key up-projection, read transposed (absorbed)
    w_uv: jax.Array | None = None  # [L, H, C, V] each head's value up-projection


@flax.struct.dataclass
class Params:
    embed: jax.Array  # [V, E]
    final_norm: jax.Array  # [E]
    lm_head: jax.Array | None  # [E, V], None when tied to the embedding
    layers: LayerParams

    @property
    def compute_dtype(self):
        """The dtype the weights were made to compute in: their norms' (the matrices and the embedding may
        be stored narrower: quantized, or bfloat16 under float32 on the CPU)."""
        return self.final_norm.dtype


def register_pytree(cls):
    """Make a host-side batch type (a plain dataclass, no JAX) a pytree of arrays; once per type."""
    jax.tree_util.register_dataclass(cls, data_fields=[f.name for f in dataclasses.fields(cls)], meta_fields=[])
    return cls


register_pytree(StepInput)
register_pytree(WindowPages)


# A stacked weight larger than this in float32 is built on its devices a layer at a time (_by_layer): the host
# then holds one layer of it, not the stack (a 70B model's MLP stacks are 75 GB each in float32). Smaller ones are
# built whole: a layer at a time compiles a program per weight (SmolLM2's load took 0.5-1 s longer that way;
# bench/load_memory.py), and a 1B model's 0.9 GB stacks loaded 1.5-2.2x faster a layer at a time, in less memory.
LAYERWISE_BYTES = 256 << 20


def by_layer(shape: tuple[int, ...]) -> bool:
    """Whether params_from_numpy builds a stacked weight of `shape` a layer at a time (LAYERWISE_BYTES)."""
    return 4 * math.prod(shape) > LAYERWISE_BYTES


def largest_host_piece(config: ModelConfig) -> tuple[str, int, bool]:
    """(weight, bytes, a layer of it): the largest array params_from_numpy builds on the host at once for `config`, in
    float32 (a layer of a stack built a layer at a time, else a whole weight): about what loading needs beside the
    file's pages (quantizing it takes a few times one layer more)."""
    layered = set(LayerParams.__dataclass_fields__)
    pieces = {name: (4 * math.prod(shape[1:] if name in layered and by_layer(shape) else shape),
                     name in layered and by_layer(shape)) for name, shape in config.weight_shapes().items()}
    name = max(pieces, key=lambda n: pieces[n][0])
    return name, *pieces[name]


class DefaultDevice:
    """Where params_from_numpy puts the weights by default: the default device (jaxcb.device.parallel.Placement:
    a mesh)."""

    layerwise = True  # (_by_layer may build stacks in place here)

    def __call__(self, name: str, value):
        return jax.device_put(value)

    def shardings(self, name: str, value):
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: device, value)

    def put(self, value, shardings):
        """A host value (a pytree) onto its shardings."""
        return jax.device_put(value, shardings)


def params_from_numpy(weights: dict[str, np.ndarray], dtype=jnp.float32, mode: str = "auto", group: int = 0,
                      place=None) -> Params:
    """Params from the loader's weights: float arrays in `dtype` (the compute dtype), the matrices quantized first
    when `mode` is "int8" or "int4" (jaxcb.model.quant, `group` input rows per scale; int8 scales in `dtype`, int4's
    float16), or, with the embedding, stored in bfloat16 when `mode` is "bfloat16" (under a float32 compute dtype:
    the CPU's, jaxcb.device.factory.compute_dtype). Weights that are already quantized (a converted checkpoint)
    stay as they are. One weight at a time is read (a loader's are built as they are read,
    jaxcb.model.lazy_weights), converted on the host and put on its devices by `place` (default: DefaultDevice;
    jaxcb.device.parallel.Placement: its slices of a mesh) before the next is read; a stack over
    LAYERWISE_BYTES a layer at a time (_by_layer)."""
    place = place or DefaultDevice()

    def cast(a, to):  # (a converted checkpoint's arrays are on a device already: cast there)
        return jnp.asarray(a, dtype=to) if isinstance(a, jax.Array) else np.asarray(a, dtype=to)

    def converted(name, w):
        w = quantize_weight(name, w, mode, group)
        if isinstance(w, QuantRows) or (isinstance(w, QuantWeight) and w.bits == 8):
            return w.replace(scale=cast(w.scale, dtype))
        if isinstance(w, QuantWeight):
            return w
        return cast(w, jnp.bfloat16 if mode == "bfloat16" and (name in MATRICES + EXPERTS or name == "embed") else dtype)

    def as_array(name):
        layers = weights.layers(name) if hasattr(weights, "layers") else None
        shape = weights.shape(name) if layers is not None else None
        if layers and shape and by_layer(shape) and getattr(place, "layerwise", False):
            return _by_layer(name, layers, lambda w: converted(name, w), place)
        return place(name, converted(name, weights[name]))

    layers = LayerParams(**{name: as_array(name) for name in LayerParams.__dataclass_fields__ if name in weights})
    lm_head = as_array("lm_head") if "lm_head" in weights else None
    return Params(embed=as_array("embed"), final_norm=as_array("final_norm"), lm_head=lm_head, layers=layers)


def _by_layer(name: str, makes: list, convert, place):
    """Weight `name` stacked over layers, built on its devices a layer at a time: the stack allocated there in its
    final sharding (place.shardings), each layer (makes[n]()) converted on the host, put on the devices in the stack's
    split less its layer axis, and written into the stack in place (donated): the host holds one layer, the
    devices the stack and one layer."""
    first = convert(makes[0]())
    stacked = jax.tree.map(lambda a: jax.ShapeDtypeStruct((len(makes), *a.shape), a.dtype), first)
    whole = place.shardings(name, stacked)
    per_layer = jax.tree.map(lambda s: NamedSharding(s.mesh, P(*s.spec[1:])) if isinstance(s, NamedSharding) else s,
                             whole)
    stack = jax.tree.map(lambda a, s: jnp.zeros(a.shape, a.dtype, device=s), stacked, whole)
    write = jax.jit(lambda into, layer, n: jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, n, 0),
                                                       into, layer), donate_argnums=0, out_shardings=whole)
    for n, make in enumerate(makes):
        stack = write(stack, place.put(first if n == 0 else convert(make()), per_layer), n)
        first = None
    return stack


def params_to_weights(params: Params) -> dict[str, jax.Array]:
    """The inverse of params_from_numpy: a flat dict in the loader layout (absent parts left out)."""
    weights = {"embed": params.embed, "final_norm": params.final_norm}
    if params.lm_head is not None:
        weights["lm_head"] = params.lm_head
    for name in LayerParams.__dataclass_fields__:
        if getattr(params.layers, name) is not None:
            weights[name] = getattr(params.layers, name)
    return weights


def abstract_params(config: ModelConfig, dtype=jnp.float32, sharding=lambda name: None) -> Params:
    """Params of jax.ShapeDtypeStruct leaves (float weights in `dtype`): for lowering and exporting a
    step without weights. `sharding(name)` gives each weight's sharding (None: unspecified)."""
    sds = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding(name))
           for name, shape in config.weight_shapes().items()}
    layers = LayerParams(**{name: sds.get(name) for name in LayerParams.__dataclass_fields__})
    return Params(embed=sds["embed"], final_norm=sds["final_norm"], lm_head=sds.get("lm_head"), layers=layers)


def random_weights(config: ModelConfig, seed: int = 0, scale: float = 0.08) -> dict[str, np.ndarray]:
    """Random weights in the loader's layout, for tests."""
    rng = np.random.default_rng(seed)
    shapes = config.weight_shapes()
    norms = [k for k in shapes if k.endswith("_norm")]
    w = {}
    for k, s in shapes.items():  # drawn in weight_shapes' order
        if k in norms:
            w[k] = (1.0 + 0.1 * rng.standard_normal(s)).astype(np.float32)
        elif k in ("bq", "bk", "bv", "bo", "sinks") or k.endswith("_bias"):
            w[k] = (rng.standard_normal(s) * 0.5).astype(np.float32)
        elif k == "lm_head":  # logits with a spread of a few units: sampling varies, greedy has clear winners
            w[k] = (rng.standard_normal(s) * 2.5 / np.sqrt(s[0])).astype(np.float32)
        else:
            w[k] = (rng.standard_normal(s) * scale).astype(np.float32)
    w["embed"] *= 4  # embeddings of a useful size next to the layers' outputs
    if config.norm_plus_one:  # the same effective scales, stored as (w - 1)
        for k in norms:
            w[k] -= 1.0
    return w


def rms_norm(x, weight, eps, plus_one: bool = False):
    """x RMS-normed over its last axis (in float32), scaled by `weight` (1 + weight with `plus_one`; None:
    no weight, Llama 4's q/k norm)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is None:
        return x32.astype(x.dtype)
    scale = weight.astype(jnp.float32)
    return ((1.0 + scale if plus_one else scale) * x32).astype(x.dtype)


def rope_frequencies(config: ModelConfig, theta, sliding):
    """A layer's RoPE frequencies f32 [R/2] (R: the rotated dimensions, ModelConfig.rope_dim) from its base
    (traced: the layer's kind), divided by the scaling of full-attention layers (ModelConfig.rope_divisors,
    a constant) where it has one."""
    d = config.rope_dim
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    divisors = config.rope_divisors()
    if divisors is not None and config.rope_scaled_sliding:
        inv_freq = inv_freq / jnp.asarray(divisors)
    elif divisors is not None:
        inv_freq = inv_freq / jnp.where(sliding, jnp.float32(1.0), jnp.asarray(divisors))
    return inv_freq


def rotary(x, positions, inv_freq, scale: float = 1.0):
    """Rotate-half rotary embedding of each head's first R = 2 * len(inv_freq) dimensions (the others pass
    as they are). x [..., heads, D]; positions int32 [...]; inv_freq f32 [R/2]; `scale`: cos and sin times
    it (LongRoPE's attention factor)."""
    d = 2 * inv_freq.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., R/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x32 = x.astype(jnp.float32)
    part = x32[..., :d] if d < x.shape[-1] else x32
    half = d // 2
    rotated = jnp.concatenate([-part[..., half:], part[..., :half]], axis=-1)
    out = part * cos + rotated * sin
    if d < x.shape[-1]:
        out = jnp.concatenate([out, x32[..., d:]], axis=-1)
    return out.astype(x.dtype)


def layer_kinds(config: ModelConfig):
    """Per-layer arrays scanned with the weights: (sliding: bool, RoPE base: f32, index of the layer in
    its KV page group: i32, RoPE on: f32 1, or 0 for a layer without RoPE, experts: bool (a mixed_mlp model's
    layers with experts), index of the layer in its MLP's stack: i32)."""
    flags = np.array(config.sliding_layers if config.windowed else [False] * config.num_layers)
    local = config.local_rope_theta or config.rope_theta
    theta = np.where(flags, local, config.rope_theta).astype(np.float32)
    group_index = np.where(flags, np.cumsum(flags) - 1, np.cumsum(~flags) - 1).astype(np.int32)
    rope = 1.0 - np.array(config.nope_layers or [False] * config.num_layers, np.float32)
    moe = np.array(config.moe_layers if config.mixed_mlp else [bool(config.num_experts)] * config.num_layers)
    mlp_index = np.where(moe, np.cumsum(moe) - 1, np.cumsum(~moe) - 1).astype(np.int32)
    return (jnp.asarray(flags), jnp.asarray(theta), jnp.asarray(group_index), jnp.asarray(rope), jnp.asarray(moe),
            jnp.asarray(mlp_index))


def _layer(config: ModelConfig, attention: Attention, batch: StepInput, h, kv_pages, kind, w: LayerParams,
           lora=None, lora_mask=None, mlps=None):
    """One decoder layer. `mlps` (a mixed_mlp model): (the experts' layers' parts, the dense layers' MLP, the
    names of these the native matmul reads in place), each stacked over its own layers, not in `w`: the layer
    runs the one of its kind, at its own index in that stack."""
    t, _ = h.shape
    sliding, theta, group_index, rope, moe, mlp_index = kind
    norm = functools.partial(rms_norm, eps=config.rms_norm_eps, plus_one=config.norm_plus_one)

    def proj(x, name, w=w):
        """x @ the layer's matrix `name` (of `w`), plus each token's own adapter's low-rank update: every slot's
        A at once ([in, S*R], a few columns), the columns of other slots masked to zero, then B."""
        y = dense(x, getattr(w, name))
        if lora is not None and name in lora["a"]:
            y = y + ((x @ lora["a"][name]) * lora_mask) @ lora["b"][name]
        return y

    x = norm(h, w.attn_norm) if w.attn_norm is not None else h
    q, k, v = (_latent_qkv if config.mla else _qkv)(config, x, w, proj, norm)
    inv_freq = rope_frequencies(config, theta, sliding)
    if config.nope_layers:  # a layer without RoPE: every angle 0, its q and k as they are
        inv_freq = inv_freq * rope
    q = rotary(q, batch.positions, inv_freq, config.rope_attention_factor)
    k = rotary(k, batch.positions, inv_freq, config.rope_attention_factor)
    if config.qk_rms_rope:  # (Llama 4) the RoPE layers' q and k RMS-normed per head, without a weight
        on = rope > 0
        q, k = (jnp.where(on, rms_norm(a, None, config.rms_norm_eps), a) for a in (q, k))
    if config.nope_temperature:  # (Llama 4) the NoPE layers' queries scaled by their position
        pos = batch.positions.astype(jnp.float32)
        scale = jnp.log1p(jnp.floor((pos + 1.0) / config.nope_temperature)) * config.nope_temperature_scale + 1.0
        q = jnp.where(rope > 0, q, (q.astype(jnp.float32) * scale[:, None, None]).astype(q.dtype))

    attend = functools.partial(_attend, attention, config)
    if attention.mesh is None:
        attn, kv_pages = attend(q, k, v, kv_pages, sliding, group_index, batch, w.sinks)
    else:  # each device writes and reads the pages of its own KV heads: no communication
        heads = P(None, AXIS, None)
        kv_spec = jax.tree.map(lambda _: KV_SPEC, kv_pages)
        attn, kv_pages = jax.shard_map(
            attend, mesh=attention.mesh,
            in_specs=(heads, heads, heads, kv_spec, P(), P(), P(), None if w.sinks is None else P(AXIS)),
            out_specs=(heads, kv_spec), check_vma=False)(q, k, v, kv_pages, sliding, group_index, batch, w.sinks)
    if config.mla:  # each head's output out of the latent (after the rotated part) by its value up-projection
        latent = attn[..., config.rotary_dim:config.rotary_dim + config.kv_lora_rank]
        attn = jnp.einsum("thc,hcv->thv", latent, w.w_uv.astype(attn.dtype))
    out = proj(attn.reshape(t, -1), "wo")
    if w.bo is not None:
        out = out + w.bo
    if w.post_attn_norm is not None:
        out = norm(out, w.post_attn_norm)
    if config.residual_multiplier != 1.0:
        out = out * jnp.asarray(config.residual_multiplier, out.dtype)
    h = h + out

    x = norm(h, w.mlp_norm) if w.mlp_norm is not None else h
    if mlps is None:
        out = _mlp(config, attention, x, w, proj)
    else:  # the experts, or this layer's dense MLP (as w_gate, w_up, w_down)
        parts, dense_mlp = (_stacked_at(stacks, mlp_index, mlps[2]) for stacks in mlps[:2])
        dense_mlp = dict(zip(("w_gate", "w_up", "w_down"), (dense_mlp[n] for n in DENSE_MLP)))
        no_experts = {n: None for n in EXPERT_PARTS}
        out = jax.lax.cond(moe, lambda x: _mlp(config, attention, x, dataclasses.replace(w, **parts), proj),
                           lambda x: _mlp(config, attention, x, dataclasses.replace(w, **{**no_experts, **dense_mlp}),
                                          proj), x)
    if w.post_mlp_norm is not None:
        out = norm(out, w.post_mlp_norm)
    if config.residual_multiplier != 1.0:
        out = out * jnp.asarray(config.residual_multiplier, out.dtype)
    return h + out, kv_pages


def _qkv(config: ModelConfig, x, w: LayerParams, proj, norm):
    """A layer's q [T, H, D], k and v [T, K, D] from its input x [T, E]: the projections, their biases, the q/k
    norms (per head, or over all heads: OLMo 2)."""
    t, nh, nk, d = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    q, k, v = proj(x, "wq"), proj(x, "wk"), proj(x, "wv")
    if w.bq is not None:
        q, k, v = q + w.bq, k + w.bk, v + w.bv
    if config.qk_norm_whole:  # over all of q's and k's heads at once (OLMo 2)
        q, k = norm(q, w.q_norm), norm(k, w.k_norm)
    q, k, v = q.reshape(t, nh, d), k.reshape(t, nk, d), v.reshape(t, nk, d)
    if w.q_norm is not None and not config.qk_norm_whole:
        q, k = norm(q, w.q_norm), norm(k, w.k_norm)
    return q, k, v


def _latent_qkv(config: ModelConfig, x, w: LayerParams, proj, norm):
    """Multi-head latent attention's q [T, H, R+C] and k = v [T, K, R+C], absorbed (ModelConfig.kv_lora_rank): a
    head's query is its rotated part (R), then its unrotated part carried into the latent by the head's key
    up-projection; the key (and value) of a token is its rotated part, then its normed latent (C), the same for
    every head (K copies: 1, or one per device under tensor parallelism). RoPE then rotates the first R."""
    t, nh, n, r = x.shape[0], config.num_heads, config.qk_nope_dim, config.rotary_dim
    q = proj(norm(proj(x, "wq_a"), w.q_a_norm), "wq_b") if w.wq_a is not None else proj(x, "wq")
    q = q.reshape(t, nh, n + r)
    kv = proj(x, "wkv_a")
    latent, k_rot = norm(kv[:, :config.kv_lora_rank], w.kv_a_norm), kv[:, config.kv_lora_rank:]
    absorbed = jnp.einsum("thn,hnc->thc", q[..., :n], w.w_uk.astype(q.dtype))
    pad = config.head_dim - r - config.kv_lora_rank  # (ModelConfig.for_kernels: zeros to the kernels' width)
    q = jnp.concatenate([q[..., n:], absorbed, jnp.zeros((t, nh, pad), q.dtype)], axis=-1)
    k = jnp.concatenate([k_rot, latent, jnp.zeros((t, pad), kv.dtype)], axis=-1)
    k = jnp.broadcast_to(k[:, None], (t, config.num_kv_heads, config.head_dim))
    return q, k, k


def _mlp(config: ModelConfig, attention: Attention, x, w: LayerParams, proj):
    """The layer's MLP over x [T, E]: its experts (beside a shared expert, the w_* matrices), or its dense MLP."""
    out = experts(config, x, w, grouped=attention.grouped_experts) if w.router is not None else None
    if w.w_gate is not None:  # the dense MLP, or a mixture's shared expert (weighed by its gate)
        mlp = proj(glu(config, proj(x, "w_gate", w), proj(x, "w_up", w)), "w_down", w)
        if w.shared_gate is not None:
            mlp = mlp * jax.nn.sigmoid(jnp.dot(x, w.shared_gate, preferred_element_type=jnp.float32)).astype(x.dtype)
        out = mlp if out is None else out + mlp
    return out


def _stacked_at(stacks: dict, index, native) -> dict:
    """One layer's weights from stacks over some of the layers ({name: stack}): a matrix the native CPU matmul
    reads in place (its name in `native`) stays its stack (StackedMatrix), the rest are sliced at `index`."""
    return {name: StackedMatrix(a, index) if name in native else jax.tree.map(lambda t: t[index], a)
            for name, a in stacks.items()}


def glu(config: ModelConfig, gate, up):
    """The gated MLP's hidden values from its gate and up projections (config.activation)."""
    if config.activation == "silu":
        return jax.nn.silu(gate) * up
    if config.activation == "gelu_tanh":
        return jax.nn.gelu(gate, approximate=True) * up
    limit = jnp.asarray(config.swiglu_limit, gate.dtype)  # "swiglu_oai": gpt-oss's clamped SwiGLU
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(gate * jnp.asarray(config.swiglu_alpha, gate.dtype)) * (up + 1)


def experts(config: ModelConfig, x, w: LayerParams, grouped: bool):
    """A mixture of experts over x [T, E]: each token's router probabilities (softmax, float32), its
    `experts_per_token` most probable experts (their probabilities renormalized over them when
    config.norm_topk), and the sum of those experts' gated MLPs weighted by them, [T, E]. `grouped` (GPU,
    TPU): the token-expert pairs sorted by expert and each expert's rows multiplied at once
    (jax.lax.ragged_dot). Else (XLA:CPU, where ragged_dot is every expert over every row): a loop over the
    experts some token chose, each run over every token weighted by its probability for the token (0 where
    it was not chosen); an expert no token chose is not read (bench.moe, a Mixtral-shaped layer on the
    2-core Zen 4, consecutive runs: one token 2.6-3.9 ms against 17.3 ms when each pair gathered its own
    expert's matrices, and 10-11 ms through ragged_dot; 256 tokens 136-140 ms against ragged_dot's
    267-279 ms). Quantized (and bfloat16) experts are made x's dtype as they are read. With
    config.expert_bias (gpt-oss) the router's logits and each expert's three projections have biases; with
    config.moe_input_scale (Llama 4) each chosen expert's score is the sigmoid of its logit and scales its
    input, the outputs summed. With config.router_sigmoid (DeepSeek-V3, GLM-4.5) each expert's score is the
    sigmoid of its logit, the experts are chosen by score plus w.router_choice_bias among the best groups
    (config.expert_groups_used of expert_groups, a group worth its two best), and weighed by their scores
    (renormalized when config.norm_topk); every router's weights times config.routed_scale."""
    t, k, n = x.shape[0], config.experts_per_token, config.num_experts
    logits = jnp.dot(x, w.router, preferred_element_type=jnp.float32)
    if w.router_bias is not None:
        logits = logits + w.router_bias.astype(jnp.float32)
    if config.moe_input_scale:  # (Llama 4) the chosen ones' sigmoid scores, which scale the experts' inputs
        top, chosen = jax.lax.top_k(logits, k)
        top = jax.nn.sigmoid(top)
    elif config.router_sigmoid:  # (DeepSeek-V3, GLM-4.5) chosen by score + correction bias in the best groups
        scores = jax.nn.sigmoid(logits)
        choice = scores if w.router_choice_bias is None else scores + w.router_choice_bias.astype(jnp.float32)
        if config.expert_groups > 1:
            choice = jnp.where(_in_best_groups(choice, config, worth=2), choice, -jnp.inf)
        chosen = jax.lax.top_k(choice, k)[1]
        top = jnp.take_along_axis(scores, chosen, axis=-1)
        if config.norm_topk:
            top = top / (jnp.sum(top, axis=-1, keepdims=True) + 1e-20)
    else:
        probs = jax.nn.softmax(logits, axis=-1)  # [T, X]
        if config.expert_groups > 1:  # (DeepSeek-V2's group_limited_greedy: the others' probabilities 0)
            probs = jnp.where(_in_best_groups(probs, config, worth=1), probs, 0.0)
        top, chosen = jax.lax.top_k(probs, k)  # [T, k]
        if config.norm_topk:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
    if config.routed_scale != 1.0:
        top = top * config.routed_scale
    top = top.astype(x.dtype)
    scale_in = config.moe_input_scale

    def down_bias(top, chosen):  # the chosen experts' down biases, weighed: once, after the experts' (partial) sums
        if w.experts_down_bias is None:
            return 0.0
        return jnp.einsum("tk,tke->te", top, w.experts_down_bias[chosen].astype(x.dtype))

    def take(stack, index):  # the experts `index` picks from a layer's stack, as x's dtype (dequantized)
        if isinstance(stack, QuantWeight):
            return dequantize(jax.tree.map(lambda a: a[index], stack), x.dtype)
        return stack[index].astype(x.dtype)

    if grouped:
        flat = chosen.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # pairs by expert
        sizes = jnp.bincount(flat, length=n).astype(jnp.int32)
        rows = x[order // k]
        if scale_in:
            rows = rows * top.reshape(-1)[order][:, None]
        gate, up, down = (take(s, slice(None)) for s in (w.experts_gate, w.experts_up, w.experts_down))
        g, u = jax.lax.ragged_dot(rows, gate, sizes), jax.lax.ragged_dot(rows, up, sizes)
        if w.router_bias is not None:  # each pair's own expert's biases
            e = flat[order]
            g, u = g + w.experts_gate_bias[e].astype(x.dtype), u + w.experts_up_bias[e].astype(x.dtype)
        y = jax.lax.ragged_dot(glu(config, g, u), down, sizes)
        out = jnp.zeros((t * k, x.shape[1]), x.dtype).at[order].set(y).reshape(t, k, -1)
        return (out.sum(1) if scale_in else jnp.einsum("tk,tke->te", top, out)) + down_bias(top, chosen)
    weight = jnp.zeros((t, n), x.dtype).at[jnp.arange(t)[:, None], chosen].set(top)  # [T, X]
    used = jnp.zeros((n,), bool).at[chosen.reshape(-1)].set(True)

    def run(e, out):
        if scale_in:  # (its input scaled: 0 for a token that did not choose it, whose output is then 0)
            xe = x * weight[:, e, None]
            return out + glu(config, xe @ take(w.experts_gate, e), xe @ take(w.experts_up, e)) @ take(w.experts_down, e)
        g, u = x @ take(w.experts_gate, e), x @ take(w.experts_up, e)
        if w.router_bias is not None:
            g, u = g + w.experts_gate_bias[e].astype(x.dtype), u + w.experts_up_bias[e].astype(x.dtype)
        return out + weight[:, e, None] * (glu(config, g, u) @ take(w.experts_down, e))

    def one(e, out):  # an expert no token chose is not read
        return jax.lax.cond(used[e], run, lambda e, out: out, e, out)

    return jax.lax.fori_loop(0, n, one, jnp.zeros_like(x)) + down_bias(top, chosen)


def _in_best_groups(scores, config: ModelConfig, worth: int):
    """[T, X] whether each expert is in one of its token's config.expert_groups_used best groups (of
    config.expert_groups equal ones), a group worth the sum of its `worth` best scores (DeepSeek-V3: two; V2: one)."""
    t, n = scores.shape
    groups = scores.reshape(t, config.expert_groups, n // config.expert_groups)
    value = jax.lax.top_k(groups, min(worth, n // config.expert_groups))[0].sum(-1)  # [T, G]
    best = jax.lax.top_k(value, config.expert_groups_used)[1]
    kept = jnp.zeros(value.shape, bool).at[jnp.arange(t)[:, None], best].set(True)
    return jnp.repeat(kept, n // config.expert_groups, axis=1)


def _attend_group(attention: Attention, config: ModelConfig, q, k, v, pages, layer_index, batch: StepInput,
                  window, sinks=None):
    """Write this layer's new K/V into one page group, then attend over it: (attention [T, H, D], pages).
    `sinks` [H] (gpt-oss): each head's sink logit joins its softmax's denominator."""
    # The K/V projections stay their own fusions: XLA:GPU fused a one-row step's (a dot it lowers as a
    # reduction) into the scatter that writes them, which then ran the reduction once per element
    # written: 8.1 of 21.3 ms of an 8B-shaped decode step on an H200 (jax 0.11.2); 23.3 -> 15.6 ms with
    # the barrier. On every platform, so that programs exported for a GPU elsewhere carry it too.
    k, v = jax.lax.optimization_barrier((k, v))
    pages = write_kv(pages, layer_index, k, v, batch.slot_ids)
    if attention.kernel in ("xla", "cpu"):
        attn = ragged_attention(q, pages, layer_index, batch, scale=config.attention_scale, window=window,
                                softcap=config.attn_softcap, native=attention.kernel == "cpu", sinks=sinks)
    elif attention.kernel == "none":  # bench/step.py: the step's cost without attention
        attn = q
    else:  # the ragged Pallas kernel over the whole cache, one call for the step's every sequence
        attn = engine_ragged_attention(q, pages, layer_index, batch.kv_lens, batch.page_table, batch.cu_q_lens,
                                       batch.num_seqs, backend=attention.kernel, interpret=attention.interpret,
                                       scale=config.attention_scale, window=window, softcap=config.attn_softcap,
                                       sinks=sinks)
    return attn, pages


def _attend(attention: Attention, config: ModelConfig, q, k, v, kv_pages, sliding, group_index, batch: StepInput,
            sinks=None):
    """Attention of one layer. A model without sliding layers has one page group (`kv_pages` an array).
    With sliding layers there are two, each with its own page table (batch.window holds the sliding
    group's): the layer writes and reads its own group, and the other group's call has nothing to do
    (its writes go to the null page, its lengths and page items are empty), so no branch is needed and
    both arrays stay in place."""
    if not config.windowed:
        return _attend_group(attention, config, q, k, v, kv_pages, group_index, batch, 0, sinks)
    full, swa = kv_pages
    full_batch, swa_batch = _inactive(batch, ~sliding), _inactive(batch.window.apply(batch), sliding)
    a_full, full = _attend_group(attention, config, q, k, v, full, jnp.where(sliding, 0, group_index), full_batch, 0,
                                 sinks)
    a_swa, swa = _attend_group(attention, config, q, k, v, swa, jnp.where(sliding, group_index, 0), swa_batch,
                               config.attention_window, sinks)
    return a_full + a_swa, (full, swa)


def _inactive(batch: StepInput, active):
    """`batch` when `active`, else the same step with nothing to write or read (traced select)."""
    return dataclasses.replace(
        batch, slot_ids=jnp.where(active, batch.slot_ids, 0), kv_lens=jnp.where(active, batch.kv_lens, 0),
        item_bounds=jnp.where(active, batch.item_bounds, 0))


def _with_head_axis(a):
    """A page array as the layers see it, [L, 2, K, P, S, D]. With one KV head the runner stores it
    without that axis ([L, 2, P, S, D], jaxcb.device.runner): carried through the scan with a size-1 axis, XLA
    on the CPU copied the whole cache every layer (measured: a 0.3 GB cache, 1.3 s a step instead of
    0.1 ms); the reshape inside the loop body is free."""
    return a.reshape(a.shape[:2] + (1,) + a.shape[2:]) if a.ndim == 5 else a


def forward(params: Params, kv_pages, batch: StepInput, config: ModelConfig, attention: Attention = Attention()):
    """One packed step. Returns (kv_pages with this step's K/V written, logits [M, V] in float32 of each
    sequence's last token)."""
    kv_pages, h = forward_hidden(params, kv_pages, batch, config, attention)
    return kv_pages, logits_at(params, h, batch.last_token, config, attention)


def forward_hidden(params: Params, kv_pages, batch: StepInput, config: ModelConfig,
                   attention: Attention = Attention(), lora=None):
    """The layers of one packed step: (kv_pages with its K/V written, the last layer's output [T, E]).
    `lora`: the adapter slots (jaxcb.device.lora: {"a": {target: [L, in, S*R]}, "b": {target: [L, S*R, out]},
    "col_slot": [S*R]}); each token takes its sequence's slot, batch.lora_slots (-1: the base model)."""
    h = embed_rows(params.embed, batch.token_ids, params.final_norm.dtype)  # [T, E]
    lora_mask = None
    if lora is not None:  # [T, S*R]: 1 in the columns of the token's own slot
        lora_mask = (batch.lora_slots[:, None] == lora["col_slot"][None, :]).astype(h.dtype)
    if config.embed_scale:
        h = h * jnp.asarray(config.hidden_size**0.5, h.dtype)
    if config.embed_multiplier != 1.0:
        h = h * jnp.asarray(config.embed_multiplier, h.dtype)

    layers, stacks, mlps = params.layers, {}, None
    if config.mixed_mlp:  # the MLPs' parts stacked over their own layers: out of the scanned xs, indexed per layer
        parts = {name: getattr(layers, name) for name in EXPERT_PARTS + DENSE_MLP if getattr(layers, name) is not None}
        native = {name for name, a in parts.items() if attention.native_matmul and name in MATRICES and native_stack(a)}
        mlps = ({n: a for n, a in parts.items() if n in EXPERT_PARTS}, {n: a for n, a in parts.items() if n in DENSE_MLP},
                frozenset(native))
        layers = dataclasses.replace(layers, **{name: None for name in parts})
    if attention.native_matmul:  # matrices stay out of the scanned xs: the body reads them from the stack
        stacks = {name: getattr(layers, name) for name in MATRICES if native_stack(getattr(layers, name))}
        layers = dataclasses.replace(layers, **{name: None for name in stacks})

    def body(carry, xs):
        h, stored = carry
        kind, index, w, lora_w = xs
        w = dataclasses.replace(w, **{name: StackedMatrix(stack, index) for name, stack in stacks.items()})
        h, kv = _layer(config, attention, batch, h, jax.tree.map(_with_head_axis, stored), kind, w, lora_w, lora_mask,
                       mlps)
        return (h, jax.tree.map(lambda a, like: a.reshape(like.shape), kv, stored)), None

    lora_layers = None if lora is None else {"a": lora["a"], "b": lora["b"]}
    xs = (layer_kinds(config), jnp.arange(config.num_layers, dtype=jnp.int32), layers, lora_layers)
    (h, kv_pages), _ = jax.lax.scan(body, (h, kv_pages), xs)
    return kv_pages, h


def head_rows(params: Params, ids: list[int]) -> np.ndarray:
    """The output head's rows for tokens `ids` [N, E] in float32 (dequantized): token i's logit is the final
    norm's output dotted with row i (before the model's logit scale and softcap), as head_logits computes it.
    Weights split over a mesh give their rows replicated (every process of a multi-host mesh calls this)."""
    def rows(embed, lm_head, ids):
        if lm_head is None:
            return embed_rows(embed, ids, jnp.float32)
        if isinstance(lm_head, QuantWeight):
            lm_head = dequantize(QuantWeight(lm_head.q[..., ids], lm_head.scale[..., ids], None if lm_head.offset is None
                                             else lm_head.offset[..., ids], lm_head.bits, lm_head.act_block), jnp.float32)
            return lm_head.T
        return lm_head[:, ids].astype(jnp.float32).T

    sharding = jax.tree.leaves(params.embed)[0].sharding
    replicated = NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else None
    return np.asarray(jax.jit(rows, out_shardings=replicated)(params.embed, params.lm_head,
                                                              np.asarray(ids, np.int32)))


def logits_at(params: Params, h, rows, config: ModelConfig, attention: Attention = Attention()):
    """float32 logits [R, V] of the token rows `rows` [R] of the last layer's output h [T, E]."""
    last = rms_norm(h[rows], params.final_norm, config.rms_norm_eps, config.norm_plus_one)  # [R, E]
    logits = head_logits(last, params.embed, params.lm_head, native=attention.native_matmul)
    if config.logit_scale != 1.0:
        logits = logits / config.logit_scale
    if config.final_softcap:
        logits = config.final_softcap * jnp.tanh(logits / config.final_softcap)
    return logits
