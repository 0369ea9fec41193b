"""Run by test_multihost.py, once per process (0 and 1, two forced host devices each, joined by jax.distributed:
gloo collectives): the tiny DeepSeek-V3 checkpoint read onto a mesh of all four devices with every stack built a
layer at a time (jaxcb.model.llama._by_layer); each process's shards of each weight against the same weight read
whole on its host, as JSON."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

TINY_HF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "tiny_hf")


def main(coordinator: str, process_id: int) -> None:
    from jaxcb.device import multihost

    multihost.initialize(coordinator, 2, process_id)
    import jax
    import numpy as np

    from jaxcb.device.parallel import make_mesh
    from jaxcb.llm import load_model
    from jaxcb.model import hf_loader, llama
    from jaxcb.model.llama import params_to_weights

    llama.LAYERWISE_BYTES = 0
    built, by_layer = [], llama._by_layer
    llama._by_layer = lambda name, *args: (built.append(name), by_layer(name, *args))[1]
    path = os.path.join(TINY_HF, "deepseek-v3")
    config, params = load_model(path, mesh=make_mesh(jax.device_count()))[:2]
    want = hf_loader.load_weights(path, config)
    weights = params_to_weights(params)
    differ = [name for name, w in weights.items()
              if not all(np.array_equal(np.asarray(s.data), np.asarray(want[name], np.float32)[s.index])
                         for s in w.addressable_shards)]
    print(json.dumps({"process": jax.process_index(), "devices": jax.device_count(), "weights": len(weights),
                      "local_shards": sum(len(w.addressable_shards) for w in weights.values()), "differ": differ,
                      "by_layer": built}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
