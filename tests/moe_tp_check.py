"""Run by test_parallel.py in a subprocess (forced host devices must be set before JAX starts): a mixture of
experts' layer with its experts split by columns over 2 devices, run both ways (the pairs grouped by expert
through jax.lax.ragged_dot, the GPU's and TPU's way; the CPU's loop), as JSON: each way's largest difference
from the single-device output, and the collectives XLA's SPMD partitioner put in its compiled program."""

import json
import os
import re

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcb.device.parallel import make_mesh, param_spec
    from jaxcb.model.config import tiny_config
    from jaxcb.model.llama import experts, params_from_numpy, random_weights

    mesh = make_mesh(2)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32))
    out = {}
    # Mixtral's experts, and gpt-oss's (biases on the router and each expert's three projections, clamped SwiGLU)
    for kind, extra in (("", {}), ("gpt-oss-", {"expert_bias": True, "activation": "swiglu_oai"}),
                        ("llama4-", {"moe_input_scale": True})):
        config = tiny_config(hidden_size=256, intermediate_size=512, num_layers=1, num_heads=8, num_kv_heads=8,
                             head_dim=32, num_experts=8, experts_per_token=2, **extra)
        layer = jax.tree.map(lambda a: a[0], params_from_numpy(random_weights(config)).layers)
        split = layer.replace(**{name: jax.device_put(getattr(layer, name), NamedSharding(mesh, P(*param_spec(name)[1:])))
                                 for name in ("router", "experts_gate", "experts_up", "experts_down", "router_bias",
                                              "experts_gate_bias", "experts_up_bias", "experts_down_bias")
                                 if getattr(layer, name) is not None})
        reference = np.asarray(experts(config, x, layer, grouped=False))
        for way, grouped in (("grouped", True), ("loop", False)):
            f = jax.jit(lambda x, w, g=grouped, c=config: experts(c, x, w, grouped=g))
            hlo = f.lower(x, split).compile().as_text()
            out[kind + way] = {"max_diff": float(np.abs(np.asarray(f(x, split)) - reference).max()),
                               "scale": float(np.abs(reference).max()),
                               "collectives": re.findall(r"= \S+ (all-gather|all-reduce|reduce-scatter|all-to-all)\(", hlo)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
