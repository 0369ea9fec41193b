"""The whole engine step exported for GPU and TPU on a machine that has neither.

    forward = export_step(model_config, shape, "cuda", tensor=2)
    sampler = export_sampler(forward, model_config, shape)

`jax.export` traces and lowers the step's two programs as the runner compiles them (`jaxcb.device.runner`:
the forward pass with the platform's Pallas kernels in place of the CPU attention, and the sampler) for
a platform without its device, so a program that would not lower
there (a CPU-only custom call, a host callback, a kernel that Triton or Mosaic refuses) is found on the
CPU. Weights and pages are abstract (jax.ShapeDtypeStruct); tensor parallelism shards them over an
abstract mesh of `tensor` devices in jaxcb.device.parallel's layout.

`custom_calls(exported)` lists the custom-call targets of the exported module: the engine step must
hold only the kernels' and the SPMD partitioner's, never a host callback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcb.device import parallel
from jaxcb.host.batch import StepShape, pack, pack_sampling
from jaxcb.model.config import ModelConfig
from jaxcb.model.llama import Attention, abstract_params
from jaxcb.model.paged_attention import kv_slot_width

KERNEL_CALLS = {"cuda": {"__gpu$xla.gpu.triton"}, "tpu": {"tpu_custom_call"}}  # the Pallas kernels
PARTITIONER_CALLS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}  # around shard_map
HOST_CALLBACK = re.compile(r"callback|py_func", re.IGNORECASE)


def export_step(config: ModelConfig, shape: StepShape, platform: str, *, page_size: int = 16,
                num_pages: int = 1024, dtype=jnp.bfloat16, kv_dtype=None, max_seqs: int = 256,
                tensor: int = 1) -> export.Exported:
    """The forward pass of the engine step of `shape` (`config`'s model, float weights in `dtype`, pages
    in `kv_dtype`) exported for `platform` ("cuda" or "tpu") with its Pallas kernels, on `tensor` devices:
    what the runner compiles for each step shape (its sampler: `export_sampler`)."""
    from jaxcb.device.runner import PALLAS_KERNEL, _forward

    kv_dtype = jnp.dtype(kv_dtype or dtype)
    config = config.for_kernels()  # (latent attention's width as the kernels take it)
    mesh = AbstractMesh((tensor,), (parallel.AXIS,)) if tensor > 1 else None
    if mesh is not None:  # KV heads replicated up to the devices, as the runner does
        r = parallel.kv_replication(config, tensor)
        config = dataclasses.replace(config, num_kv_heads=config.num_kv_heads * r)

    def sharded(spec):
        return NamedSharding(mesh, spec) if mesh is not None else None

    params = abstract_params(config, dtype, lambda name: sharded(parallel.param_spec(name)))
    groups = [(config.num_full_layers, num_pages)] + ([(config.num_sliding_layers, num_pages)] if config.windowed else [])
    kv = [jax.ShapeDtypeStruct((layers, 2, config.num_kv_heads, pages, page_size,
                                kv_slot_width(config.head_dim, kv_dtype)), kv_dtype, sharding=sharded(parallel.KV_SPEC))
          for layers, pages in groups]
    window = config.sliding_window if config.windowed else 0
    last_tokens = jax.ShapeDtypeStruct((max_seqs,), jnp.int32, sharding=sharded(P()))
    batch = _host_arrays(pack([], shape, page_size, window), sharded(P()))
    args = (params, tuple(kv) if config.windowed else kv[0], last_tokens, batch)
    attention = Attention(PALLAS_KERNEL[platform], mesh=mesh, grouped_experts=True)
    forward_fn = jax.jit(_forward, static_argnames=("config", "attention"), donate_argnums=(1,))
    checks = [export.DisabledSafetyCheck.custom_call(name) for name in KERNEL_CALLS[platform]]
    with jax.sharding.use_abstract_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return export.export(forward_fn, platforms=[platform], disabled_checks=checks)(
            *args, config=config, attention=attention)


def export_sampler(forward: export.Exported, config: ModelConfig, shape: StepShape) -> export.Exported:
    """The sampler of `shape`'s rows (the runner compiles one per row count), exported for the platform
    and devices of `forward` (export_step's), on abstract arguments of `forward`'s logits, newest tokens
    and last_tokens (their shardings as far as the export records them: on an abstract mesh XLA picks
    the forward pass's output shardings only when it compiles, where the runner checks the hand-over)."""
    from jaxcb.device.runner import _sample

    mesh = AbstractMesh((forward.nr_devices,), (parallel.AXIS,)) if forward.nr_devices > 1 else None

    def abstract(tree, avals, shardings):  # shardings: a function of the mesh
        placed = shardings(mesh) if mesh else [None] * len(avals)
        return jax.tree.unflatten(tree, [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                                         for a, s in zip(avals, placed)])

    _, logits, newest, _ = abstract(forward.out_tree, forward.out_avals, forward.out_shardings_jax)
    (_, _, last_tokens, _), _ = abstract(forward.in_tree, forward.in_avals, forward.in_shardings_jax)
    sampling = _host_arrays(pack_sampling([], shape, config.vocab_size), NamedSharding(mesh, P()) if mesh else None)
    with jax.sharding.use_abstract_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return export.export(jax.jit(_sample, static_argnames=("seqs",)), platforms=list(forward.platforms))(
            logits, newest, last_tokens, sampling, seqs=shape.seqs)


def _host_arrays(tree, sharding):
    """The host's numpy batch as abstract arrays, replicated (`sharding`) on a mesh."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding), tree)


def custom_calls(exported: export.Exported) -> set[str]:
    """The custom-call targets named in the exported module."""
    text = exported.mlir_module()
    return set(re.findall(r"stablehlo\.custom_call @([\w$.\-]+)", text)) | set(
        re.findall(r'call_target_name = "([^"]+)"', text))


def unexpected_calls(exported: export.Exported, platform: str) -> set[str]:
    """Custom calls other than the platform's kernels and the partitioner's markers (host callbacks,
    the CPU kernel, anything else): what a step's program exported for `platform` must not hold."""
    calls = custom_calls(exported)
    return {c for c in calls if c not in KERNEL_CALLS[platform] | PARTITIONER_CALLS or HOST_CALLBACK.search(c)}
