"""The whole engine step (its forward pass and its sampler) lowers for GPU and TPU without a device
(jaxcb.device.export).

Every warm-up shape of the default configuration (the token buckets of configs/default.toml, the
default SmolLM2 model's shapes), single device and tensor-parallel over an abstract mesh, exported with
jax.export for `cuda` and `tpu`: each forward pass must hold the platform's Pallas kernel and nothing but
it and the partitioner's markers as custom calls (no host callback, no CPU kernel); each sampler (one
per row count) none but the partitioner's.
"""

import pytest

from jaxcb.host.engine_config import load_config
from jaxcb.llm import read_model_config


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_every_warmup_shape_of_the_step_exports_for_gpu_and_tpu(platform):
    import jax.numpy as jnp

    from jaxcb.device.export import KERNEL_CALLS, custom_calls, export_sampler, export_step, unexpected_calls

    model = read_model_config(None)
    config = load_config()
    shapes = config.buckets.shapes(config.page_size, min(config.scheduler.max_context, model.max_context))
    assert len(shapes) == len(config.buckets.tokens) > 10
    exported, samplers = 0, {}
    # Single device over every shape; tensor-parallel over 3 devices (SmolLM2's 3 KV heads) on the
    # smallest (decode only), a middle and the largest shape (the same program at other sizes), with int8
    # KV pages on the mesh to cover the kernels' int8 path.
    on_mesh = [shapes[0], shapes[len(shapes) // 2], shapes[-1]]
    for tensor, kv_dtype, chosen in [(1, None, shapes), (3, jnp.int8, on_mesh)]:
        for shape in chosen:
            e = export_step(model, shape, platform, page_size=config.page_size, tensor=tensor, kv_dtype=kv_dtype)
            calls = custom_calls(e)
            assert KERNEL_CALLS[platform] <= calls, (shape, tensor, calls)
            assert not unexpected_calls(e, platform), (shape, tensor, calls)
            assert "jaxcb_ragged_attention" not in e.mlir_module()
            assert e.nr_devices == tensor and e.platforms == (platform,)
            exported += 1
            key = (tensor, shape.seqs, shape.extra_rows, shape.history)
            if key not in samplers:  # the sampler: one program per row count, as the runner compiles it
                s = samplers[key] = export_sampler(e, model, shape)
                assert not unexpected_calls(s, platform) and not KERNEL_CALLS[platform] & custom_calls(s), (key, s)
                assert s.nr_devices == tensor and s.platforms == (platform,)
            # (How the two programs hand over logits, newest and last tokens on a mesh is XLA's choice at
            # compile time, unrecorded here: the runner checks it as it compiles, tests/tp_check.py's meshes.)
    assert exported == len(shapes) + len(on_mesh) and len(samplers) >= 2


KINDS = {"mixtral": {},
         "gpt-oss": dict(attention_bias=True, out_bias=True, attn_sinks=True, expert_bias=True, activation="swiglu_oai",
                         sliding_window=8, sliding_layers=(True, False), rope_scaled_sliding=True),
         "llama4": dict(moe_input_scale=True, shared_expert_size=32, shared_expert_gated=False, nope_layers=(False, True),
                        qk_rms_rope=True, nope_temperature=8192),
         "glm4moe": dict(moe_layers=(False, True), dense_size=48, router_sigmoid=True, router_choice_bias=True,
                         expert_groups=2, expert_groups_used=1, routed_scale=2.5, shared_expert_size=32,
                         shared_expert_gated=False, attention_bias=True, qk_norm=True, rotary_dim=8),
         "deepseek-v3": dict(moe_layers=(False, True), dense_size=48, router_sigmoid=True, router_choice_bias=True,
                             expert_groups=2, expert_groups_used=1, routed_scale=2.5, shared_expert_size=32,
                             shared_expert_gated=False, kv_lora_rank=512, q_lora_rank=16, qk_nope_dim=8, v_head_dim=8,
                             rotary_dim=64, head_dim=576, num_kv_heads=1)}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_mixture_of_experts_step_exports_with_its_experts_grouped(platform, kind):
    """A Mixtral-shaped step (tiny) lowers for GPU and TPU, single device and tensor-parallel: its experts
    through jax.lax.ragged_dot (the token-expert pairs grouped by expert, which those compilers lower as a
    grouped matmul; XLA:CPU would run every expert over every row), beside the Pallas attention. And a
    gpt-oss-shaped one: its experts' biases, attention sinks (from the kernel's log-sum-exp) and sliding layers; a
    Llama 4-shaped one: experts scaled at their inputs beside an ungated shared expert, NoPE layers' temperature; a
    GLM-4.5-shaped one: a dense layer before the experts' (each kind's weights stacked over its own layers, the
    layer's kind a branch), DeepSeek-V3's grouped sigmoid router; a DeepSeek-V3-shaped one: latent attention (one
    KV head of the rotated part and the latent, replicated over the devices; 64 + 512 wide as DeepSeek-V3's, padded
    to the kernels' 1,024)."""
    from jaxcb.device.export import KERNEL_CALLS, custom_calls, export_step, unexpected_calls
    from jaxcb.host.batch import StepShape
    from jaxcb.model.config import tiny_config

    model = tiny_config(num_experts=8, experts_per_token=2, intermediate_size=32, **KINDS[kind])
    for tensor, shape in ((1, StepShape(8, 8, 4, 8)), (1, StepShape(64, 1, 4, 64)), (2, StepShape(64, 2, 4, 64))):
        e = export_step(model, shape, platform, tensor=tensor)
        assert KERNEL_CALLS[platform] <= custom_calls(e) and not unexpected_calls(e, platform), (shape, tensor)
        assert "ragged_dot" in e.mlir_module() and e.nr_devices == tensor
