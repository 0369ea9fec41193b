"""A runner for an engine config: the compute dtype, the memory plan (before any weight is loaded), and
the runners themselves, the target model's and speculative decoding's draft model's (jaxcb.device.runner).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcb.device.runner import ModelRunner, runs_pallas
from jaxcb.model.config import ModelConfig
from jaxcb.model.llama import Params


def default_dtype():
    """float32 on the CPU, bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def device_memory_bytes() -> int:
    """The accelerator's memory; on the CPU, the host memory available now."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports it
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def compute_dtype(config, dtype=None):
    """The dtype of activations and KV pages: `dtype` (--dtype) if given, else the float mode of
    model.weights, else the backend's default. On the CPU bfloat16 weights compute in float32 (XLA:CPU's
    bfloat16 dots ran 2.7-3.4x slower than float32; the matrices and the embedding stay bfloat16, which
    the native kernels read as they are: half the bytes of float32 to stream, jaxcb.model.llama.params_from_numpy)."""
    if dtype is not None:
        return jnp.dtype(dtype)
    weights = getattr(config, "weights", "auto")
    if weights in ("float32", "bfloat16"):
        return float_weights_dtype(weights)
    return jnp.dtype(default_dtype())


def float_weights_dtype(weights: str):
    """The compute dtype of a float weights mode: its own, but float32 for bfloat16 on the CPU."""
    if weights == "bfloat16" and default_dtype() == jnp.float32:
        return jnp.dtype(jnp.float32)
    return jnp.dtype(weights)


def plan_memory(model_config: ModelConfig, config, dtype=None, budget_bytes: int | None = None, draft=None):
    """The engine config's memory plan for this model in `dtype` on this device (per device of the
    mesh under tensor parallelism), with speculative decoding's draft model (`draft`, a ModelConfig) if
    any. Needs no weights, so it runs before anything is loaded or allocated; raises ValueError with
    the numbers when the configuration cannot fit."""
    from jaxcb.host import memory_plan

    dtype = compute_dtype(config, dtype)
    if config.tensor_parallel > 1:
        from jaxcb.device.parallel import check_tensor_parallel

        check_tensor_parallel(model_config, config.tensor_parallel, config.weights, config.weight_group)
    model_config = served(model_config, config)
    budget = budget_bytes or config.memory_bytes
    if not budget:
        budget = device_memory_bytes()
        if jax.default_backend() == "cpu":  # host devices share the one memory
            budget //= config.tensor_parallel * config.data_parallel
    return memory_plan.plan_for_model(model_config, config, budget_bytes=budget, dtype_bytes=dtype.itemsize, draft=draft)


def served(model_config: ModelConfig, config, target: ModelConfig | None = None) -> ModelConfig:
    """The model as this engine runs it: LongRoPE's factors for the context served (ModelConfig.at_context; a
    draft's by its `target`'s), and where attention runs the Pallas kernels, their head width
    (ModelConfig.for_kernels: latent attention's padded to a power of two)."""
    model_config = model_config.at_context(config.max_context_for(target or model_config))
    if runs_pallas(config.attention):
        model_config = model_config.for_kernels()
    return model_config


def make_runner(model_config: ModelConfig, params: Params, config, dtype=None, plan=None, devices=None,
                release_params: bool = False):
    """(ModelRunner, config with num_pages resolved): the memory plan (`plan`, if already made for
    these weights' dtype), then the KV pages. `devices`: where this runner lives (a data-parallel
    replica's share); default the first `tensor_parallel` devices, or the default device. `release_params`:
    the caller hands the params over (ModelRunner: what it rewrites is freed, not kept twice)."""
    plan = plan or plan_memory(model_config, config, dtype or params.compute_dtype)
    model_config = served(model_config, config)
    if plan.num_pages != config.num_pages:
        config = config.replace(num_pages=plan.num_pages)
    mesh = None
    if config.tensor_parallel > 1 or devices is not None:
        from jaxcb.device import parallel

        parallel.check_tensor_parallel(model_config, config.tensor_parallel, config.weights, config.weight_group)
        mesh = parallel.make_mesh(config.tensor_parallel, devices)
    if config.activations == "int8":
        from jaxcb.model.quant import with_int8_activations

        params = with_int8_activations(params)
    runner = ModelRunner(model_config, params, config.num_pages, config.page_size, dtype, attention=config.attention,
                         max_seqs=config.buckets.max_batch, mesh=mesh, num_window_pages=plan.num_window_pages or None,
                         kv_dtype=None if config.kv_dtype == "auto" else config.kv_dtype, compile=config.compile,
                         lora=(config.lora.targets, config.lora.max_loras, config.lora.max_rank) if config.lora.enabled else None,
                         release_params=release_params, logprobs_mode=config.logprobs_mode)
    return runner, config


def prepare_weights(runner, params: Params, config, release: bool = False, private: bool = False) -> Params:
    """New weights for a running `runner` (jaxcb.weight_update), made as make_runner made its own: int8 activations
    where the config asks for them, then the runner's own layout (ModelRunner.prepare_params)."""
    if config.activations == "int8":
        from jaxcb.model.quant import with_int8_activations

        params = with_int8_activations(params)
    return runner.prepare_params(params, release=release, private=private)


def make_draft_runner(target: "ModelRunner", model_config: ModelConfig, params: Params, config):
    """Speculative decoding's draft model on the target's devices (under tensor parallelism split over
    the target's mesh as the target is: its heads, KV pages and vocabulary), its KV pages laid out as
    the target's (the same page count, size and sliding group: it writes each request's own page ids,
    jaxcb.host.draft)."""
    mesh = target.mesh
    model_config = served(model_config, config, target.model_config)
    if mesh is not None and config.tensor_parallel > 1:
        from jaxcb.device import parallel

        spec = config.scheduler.speculative
        weights = config.weights if spec.draft_weights == "auto" else spec.draft_weights
        parallel.check_tensor_parallel(model_config, config.tensor_parallel, weights,
                                       config.weight_group if spec.draft_weights == "auto" else 0)
    return ModelRunner(model_config, params, target.num_pages, target.page_size, attention=config.attention,
                       max_seqs=config.buckets.max_batch, mesh=mesh, num_window_pages=target.num_window_pages or None,
                       kv_dtype=None if config.kv_dtype == "auto" else config.kv_dtype, compile=config.compile)
