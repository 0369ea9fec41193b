"""Tensor parallelism: one step program over a mesh of devices with a `model` axis.

The layout (as tpu-inference lays out Llama): the q/k/v projections and the MLP's gate/up are split
by output columns (whole heads, whole intermediate columns), the o projection and the MLP's down by
input rows, so each device holds a slice of every layer and XLA adds one all-reduce after each of
those two; the embedding is split by vocabulary rows and an untied output head by vocabulary
columns; norms are replicated. The KV pages `[L, 2, K, P, S, D]` are split on the KV-head axis, so
each device holds every page of its own heads (when the devices outnumber the KV heads, each KV head
is replicated so that every device holds one copy: `replicate_kv_heads`) and attention (the KV write and the paged attention
of model.llama) runs per device under `shard_map` with no communication. Everything else is left
to jit's sharding propagation. The host side (scheduler, pool, buckets) never sees the mesh: the
step's inputs are replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcb.host.errors import InvalidConfig
from jaxcb.model.config import ModelConfig
from jaxcb.model.mesh_axes import AXIS, KV_SPEC  # noqa: F401 - the shared names, re-exported

# Per Params leaf (model.llama): how it is split over the model axis.
_LAYER_SPECS = {
    "attn_norm": P(), "mlp_norm": P(), "q_norm": P(), "k_norm": P(), "post_attn_norm": P(), "post_mlp_norm": P(),
    "wq": P(None, None, AXIS), "wk": P(None, None, AXIS), "wv": P(None, None, AXIS),
    "bq": P(None, AXIS), "bk": P(None, AXIS), "bv": P(None, AXIS),
    "wo": P(None, AXIS, None),
    "w_gate": P(None, None, AXIS), "w_up": P(None, None, AXIS), "w_down": P(None, AXIS, None),
    # a mixture of experts: the router replicated, each expert split as the dense MLP is (its columns)
    "router": P(), "shared_gate": P(), "experts_gate": P(None, None, None, AXIS), "experts_up": P(None, None, None, AXIS),
    "experts_down": P(None, None, AXIS, None),
    # gpt-oss: the output's bias added after the all-reduce; each query head's sink with its head; the router's
    # bias replicated, the experts' gate and up biases split as their columns, the down's (added whole) replicated
    "bo": P(), "sinks": P(None, AXIS), "router_bias": P(), "experts_gate_bias": P(None, None, AXIS),
    "experts_up_bias": P(None, None, AXIS), "experts_down_bias": P(),
    # the dense layers among a mixture's (split as the dense MLP); DeepSeek-V3's correction biases replicated
    "dense_gate": P(None, None, AXIS), "dense_up": P(None, None, AXIS), "dense_down": P(None, AXIS, None),
    "router_choice_bias": P(),
    # latent attention: the latent and the queries' first matrix replicated (shared by every head), the rest by heads
    "wq_a": P(), "q_a_norm": P(), "wq_b": P(None, None, AXIS), "wkv_a": P(), "kv_a_norm": P(),
    "w_uk": P(None, AXIS, None, None), "w_uv": P(None, AXIS, None, None),
}


def param_spec(name: str) -> P:
    """How the weight `name` (the loader's layout) is split: embedding by vocabulary rows, an untied
    head by vocabulary columns, the final norm replicated, the layers as _LAYER_SPECS."""
    top = {"embed": P(AXIS, None), "lm_head": P(None, AXIS), "final_norm": P()}
    return top[name] if name in top else _LAYER_SPECS[name]


def check_tensor_parallel(config: ModelConfig, tensor: int, weights: str = "auto", group: int = 0) -> None:
    """Raise ValueError naming the numbers when `tensor` devices cannot split this model (stored as
    `weights` with `group` input rows per scale: a group must not straddle two devices)."""
    if tensor < 1:
        raise InvalidConfig(f"parallel.tensor: must be >= 1, got {tensor}")
    for what, n in (("query heads", config.num_heads), ("intermediate columns", config.intermediate_size),
                    ("shared expert's columns", config.shared_expert_size or tensor),
                    ("dense layers' columns", config.dense_size or tensor)):
        if n % tensor:
            raise InvalidConfig(f"parallel.tensor: {tensor} devices do not divide the model's {n} {what}")
    k = config.num_kv_heads
    if (k % tensor) if tensor <= k else (tensor % k):
        raise InvalidConfig(f"parallel.tensor: the model's {k} KV heads can be neither split evenly over {tensor} "
                         f"devices nor replicated evenly onto them")
    if config.vocab_size % tensor:
        raise InvalidConfig(f"parallel.tensor: {tensor} devices do not divide the vocabulary of {config.vocab_size}")
    if weights == "int4" or (weights == "int8" and group):
        from jaxcb.host.memory_plan import INT4_GROUP

        g = group or INT4_GROUP
        for what, rows in (("attention output rows", config.num_heads * config.head_dim),
                           ("MLP down rows", config.intermediate_size), ("dense MLP down rows", config.dense_size)):
            if (rows // g) % tensor:
                raise InvalidConfig(f"parallel.tensor: {weights} weights: the {rows} {what} make {rows // g} groups of {g}, "
                                 f"which {tensor} devices do not divide")


def kv_replication(config: ModelConfig, tensor: int) -> int:
    """Copies of each KV head on the mesh: 1 when the devices split the KV heads, tensor/K when they
    outnumber them (each device then holds one copy of the head its query heads read)."""
    return max(1, tensor // config.num_kv_heads)


def replicate_kv_heads(config: ModelConfig, params, tensor: int):
    """(config, params) with each KV head repeated kv_replication times, so that the KV heads equal the
    devices. Query head h reads KV head h // (H / K); after repeating head k into k*r .. k*r+r-1,
    device d holds query heads d*H/N .. (d+1)*H/N - 1, all of which read original head d // r = copy d.
    """
    r = kv_replication(config, tensor)
    if r == 1:
        return config, params
    import dataclasses

    import jax.numpy as jnp

    k, d = config.num_kv_heads, config.head_dim

    def repeat(x):  # [..., K*D] -> [..., K*r*D], each head's D columns r times in a row
        if x is None:
            return None
        if not hasattr(x, "reshape"):  # a QuantWeight: its values and scales have the columns last
            return jax.tree.map(repeat, x)
        y = jnp.repeat(x.reshape(*x.shape[:-1], k, d), r, axis=-2)
        return y.reshape(*x.shape[:-1], k * r * d)

    layers = dataclasses.replace(params.layers, **{n: repeat(getattr(params.layers, n)) for n in ("wk", "wv", "bk", "bv")})
    return dataclasses.replace(config, num_kv_heads=k * r), dataclasses.replace(params, layers=layers)


def make_mesh(tensor: int, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if tensor > len(devices):
        raise InvalidConfig(f"parallel.tensor: {tensor} devices asked for, {len(devices)} present")
    return Mesh(np.array(devices[:tensor]), (AXIS,))


def weight_shardings(name: str, x, mesh: Mesh):
    """The shardings of weight `name` (an array, or a QuantWeight / QuantRows of them) on the mesh in the layout
    above, as a pytree like `x`."""
    from jaxcb.model.quant import QuantRows, QuantWeight

    spec = param_spec(name)
    if isinstance(x, QuantWeight):  # scales [.., in/g, out] split as the matrix; per column ([.., 1, out]) by columns
        scale_spec = spec if x.scale.shape[-2] > 1 else P(*spec[:-2], None, spec[-1])
        return x.replace(q=NamedSharding(mesh, spec), scale=NamedSharding(mesh, scale_spec),
                         offset=None if x.offset is None else NamedSharding(mesh, scale_spec))
    if isinstance(x, QuantRows):  # [V, E] and its [V, 1] scales, split by vocabulary rows
        return x.replace(q=NamedSharding(mesh, spec), scale=NamedSharding(mesh, spec))
    return NamedSharding(mesh, spec)


def place_weight(name: str, x, mesh: Mesh):
    """Weight `name` (host or device arrays) placed on the mesh in the layout above (a no-op where it is already)."""
    return jax.tree.map(place, x, weight_shardings(name, x, mesh))


class Placement:
    """Where the loader puts each weight of `config` on the mesh as it is read (jaxcb.model.llama.params_from_numpy),
    so that no device ever holds the whole model: the layout above, but the K and V projections whole on every
    device where the KV heads are to be replicated first (replicate_kv_heads, in the runner)."""

    layerwise = True  # (llama._by_layer may build stacks in place here; across processes too: put)

    def __init__(self, mesh: Mesh, config: ModelConfig):
        self.mesh = mesh
        self.copied = kv_replication(config, mesh.devices.size) > 1

    def shardings(self, name: str, x):
        """Weight `name`'s shardings, a pytree like `x` (whose leaves may be jax.ShapeDtypeStruct)."""
        if self.copied and name in ("wk", "wv", "bk", "bv"):
            return jax.tree.map(lambda _: replicated(self.mesh), x)
        return weight_shardings(name, x, self.mesh)

    def __call__(self, name: str, x):
        return self.put(x, self.shardings(name, x))

    def put(self, x, shardings):
        """A host value (a pytree) onto its shardings; across processes each makes its own shards (place)."""
        return jax.tree.map(place, x, shardings)


def shard_params(params, mesh: Mesh):
    """Place Params (model.llama) on the mesh in the layout above."""
    from jaxcb.model.llama import LayerParams, Params

    def put(name, x):
        return None if x is None else place_weight(name, x, mesh)

    layers = LayerParams(**{name: put(name, getattr(params.layers, name)) for name in _LAYER_SPECS})
    return Params(embed=put("embed", params.embed), final_norm=put("final_norm", params.final_norm),
                  lm_head=put("lm_head", params.lm_head), layers=layers)


def place(x, sharding: NamedSharding):
    """device_put onto a sharding; across processes (multi-host), each process makes its own shards
    from its copy of the same host value."""
    if isinstance(x, jax.Array) and x.sharding == sharding:  # (placed as it was read)
        return x
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)  # (a global array: resharded across the processes)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def kv_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_SPEC)
