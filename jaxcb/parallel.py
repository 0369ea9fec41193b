"""Tensor parallelism: one step program over a mesh of devices with a `model` axis.

The layout (as tpu-inference lays out Llama): the q/k/v projections and the MLP's gate/up are split
by output columns (whole heads, whole intermediate columns), the o projection and the MLP's down by
input rows, so each device holds a slice of every layer and XLA adds one all-reduce after each of
those two; the embedding is split by vocabulary rows and an untied output head by vocabulary
columns; norms are replicated. The KV pages `[L, 2, K, P, S, D]` are split on the KV-head axis, so
each device holds every page of its own heads and attention (the KV write and the paged attention
of model.llama) runs per device under `shard_map` with no communication. Everything else is left
to jit's sharding propagation. The host side (scheduler, pool, buckets) never sees the mesh: the
step's inputs are replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcb.model.config import ModelConfig

AXIS = "model"

# Per Params leaf (model.llama): how it is split over the model axis.
_LAYER_SPECS = {
    "attn_norm": P(), "mlp_norm": P(),
    "wq": P(None, None, AXIS), "wk": P(None, None, AXIS), "wv": P(None, None, AXIS),
    "bq": P(None, AXIS), "bk": P(None, AXIS), "bv": P(None, AXIS),
    "wo": P(None, AXIS, None),
    "w_gate": P(None, None, AXIS), "w_up": P(None, None, AXIS), "w_down": P(None, AXIS, None),
}
KV_SPEC = P(None, None, AXIS, None, None, None)  # [L, 2, K, P, S, D] split on K


def check_tensor_parallel(config: ModelConfig, tensor: int) -> None:
    """Raise ValueError naming the numbers when `tensor` devices cannot split this model."""
    if tensor < 1:
        raise ValueError(f"parallel.tensor: must be >= 1, got {tensor}")
    for what, n in (("query heads", config.num_heads), ("KV heads", config.num_kv_heads),
                    ("intermediate columns", config.intermediate_size)):
        if n % tensor:
            raise ValueError(f"parallel.tensor: {tensor} devices do not divide the model's {n} {what}")
    if config.vocab_size % tensor:
        raise ValueError(f"parallel.tensor: {tensor} devices do not divide the vocabulary of {config.vocab_size}")


def make_mesh(tensor: int, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if tensor > len(devices):
        raise ValueError(f"parallel.tensor: {tensor} devices asked for, {len(devices)} present")
    return Mesh(np.array(devices[:tensor]), (AXIS,))


def shard_params(params, mesh: Mesh):
    """Place Params (model.llama) on the mesh in the layout above."""
    from jaxcb.model.llama import LayerParams, Params

    def put(x, spec):
        return None if x is None else jax.device_put(x, NamedSharding(mesh, spec))

    layers = LayerParams(**{name: put(getattr(params.layers, name), spec) for name, spec in _LAYER_SPECS.items()})
    return Params(embed=put(params.embed, P(AXIS, None)), final_norm=put(params.final_norm, P()),
                  lm_head=put(params.lm_head, P(None, AXIS)), layers=layers)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def kv_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_SPEC)
